//! What can go wrong for a trainer, by kind: the Python package raises one exception class per
//! kind (`stoker.PlanMismatch`, `stoker.Unauthorized`, …), so a training script can tell a
//! misconfiguration from a transient outage.

use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The loader was configured wrongly (rank outside the world, a bad worker list).
    #[error("{0}")]
    Config(String),
    /// A worker refused the pipeline token: retrying cannot help.
    #[error("worker {worker} refused the connection: {reason}")]
    Unauthorized { worker: String, reason: String },
    /// The workers serve another plan than the loader needs (another dataset version, seed,
    /// batch size or preprocessing), or a saved state does not fit the plan.
    #[error("{0}")]
    PlanMismatch(String),
    /// No worker could be used for `timeout`; `why` names each worker's problem.
    #[error("no usable worker for {timeout:?}: {why}")]
    NoWorker { timeout: Duration, why: String },
    /// A batch could not be served: every worker would answer the same (a sample that fails
    /// under `on_error: fail`, a bad request), or its attempts ran out.
    #[error("epoch {epoch} batch {batch} (rank {rank}/{world_size}): worker {worker}: {reason}")]
    BatchFailed {
        epoch: u64,
        batch: u64,
        rank: u32,
        world_size: u32,
        worker: String,
        reason: String,
    },
    /// The loader itself failed (its runtime, its metrics endpoint).
    #[error("{0}")]
    Internal(String),
}

impl Error {
    /// A short, stable name of the kind: the `kind` label of the client's error metric and
    /// the Python exception's class.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Config(_) => "config",
            Error::Unauthorized { .. } => "unauthorized",
            Error::PlanMismatch(_) => "plan_mismatch",
            Error::NoWorker { .. } => "no_worker",
            Error::BatchFailed { .. } => "batch_failed",
            Error::Internal(_) => "internal",
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;
