//! What a loader is asked to do: the workers, this rank, depth, hedging, timeouts, resume
//! state and the topology policy. Its own module so the scheduler and the loader both import
//! it and neither imports the other.

use crate::discovery::Discovery;
use crate::policy::{Depth, HedgePolicy};
use std::time::Duration;
use stoker_tls::{ClientTls, Dial};

/// The CA bundle (PEM) a loader trusts when it is given no other way to dial.
pub const CA_ENV: &str = "STOKER_TLS_CA";

pub struct LoaderConfig {
    pub workers: Discovery,
    /// How workers are dialled; `None`: TLS trusting the CA bundle at `$STOKER_TLS_CA` (an
    /// error when unset: plaintext is only ever asked for by name).
    pub dial: Option<Dial>,
    /// The pipeline token (the operator's Secret); empty for workers run with --no-auth.
    pub token: String,
    pub rank: u32,
    pub world_size: u32,
    pub depth: Depth,
    /// `None` disables hedging.
    pub hedge: Option<HedgePolicy>,
    /// Failed answers per batch before the trainer gets an error (lost connections are
    /// always retried while any worker is left).
    pub max_attempts: u32,
    /// With no usable worker for this long, construction (or the next batch) fails with
    /// the reason per worker.
    pub no_worker_timeout: Duration,
    /// A request unanswered for this long counts as a failed attempt and is asked again,
    /// elsewhere first (a stalled worker never holds a batch forever; hedging covers only
    /// the head of the line, once).
    pub request_timeout: Duration,
    /// Serve Prometheus /metrics on this address (e.g. "0.0.0.0:9400").
    pub metrics_listen: Option<String>,
    /// Value of the `pipeline` label on every series.
    pub pipeline: String,
    /// Start here instead of epoch 0, batch 0.
    pub state: Option<LoaderState>,
    /// How requests spread over the workers (docs/design.md, "Topology").
    pub policy: Policy,
    /// Workers this rank may be linked to at once; 0: what the workers suggest
    /// (`--links-per-rank`), else 8, never more than fits the workers' connection slots.
    pub links_per_rank: usize,
    /// Prefetched batches are also capped by their bytes (the rank's host memory).
    pub max_prefetch_bytes: u64,
}

impl LoaderConfig {
    pub fn new(workers: Discovery, rank: u32, world_size: u32) -> Self {
        LoaderConfig {
            workers,
            dial: None,
            token: String::new(),
            rank,
            world_size,
            depth: Depth::Auto { max: 16 },
            hedge: Some(HedgePolicy::default()),
            max_attempts: 5,
            no_worker_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(120),
            metrics_listen: None,
            pipeline: "default".into(),
            state: None,
            policy: Policy::Subset,
            links_per_rank: 0,
            max_prefetch_bytes: 4 << 30,
        }
    }
}

impl LoaderConfig {
    /// `dial`, else TLS trusting `$STOKER_TLS_CA`. Workers found through `dns:NAME:PORT` are
    /// dialled by address and must prove NAME, unless a server name was given.
    pub(crate) fn resolve_dial(&self) -> crate::Result<Dial> {
        let config = |e: stoker_tls::TlsError| crate::Error::Config(e.to_string());
        let dial = match &self.dial {
            Some(dial) => dial.clone(),
            None => match ca_from_env()? {
                Some(tls) => Dial::Tls(tls),
                None => {
                    return Err(crate::Error::Config(format!(
                        "no CA bundle to check the workers' certificates with: set {CA_ENV} (or \
                     the loader's tls_ca) to the pipeline's CA, or dial workers run with \
                     --insecure-plaintext in plaintext (insecure_plaintext)"
                    )))
                }
            },
        };
        Ok(match (dial, &self.workers) {
            (Dial::Tls(tls), Discovery::Dns { name, .. }) if !tls.has_server_name() => {
                let host = name.rsplit_once(':').map_or(name.as_str(), |(h, _)| h);
                Dial::Tls(tls.with_server_name(host).map_err(config)?)
            }
            (dial, _) => dial,
        })
    }
}

/// TLS trusting the CA bundle at `$STOKER_TLS_CA`, when it is set.
pub fn ca_from_env() -> crate::Result<Option<ClientTls>> {
    std::env::var_os(CA_ENV)
        .map(|path| {
            ClientTls::from_ca_file(&path)
                .map_err(|e| crate::Error::Config(format!("{CA_ENV}: {e}")))
        })
        .transpose()
}

/// Where a loader is in the plan: enough to resume exactly, on any world size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoaderState {
    pub plan_id: u64,
    pub epoch: u64,
    /// The next global batch this loader will hand out.
    pub next_batch: u64,
}

/// How a rank spreads its requests over the workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// A bounded set of links per rank (homes from a balanced assignment, spares on demand),
    /// neutral estimates with a slow start for new links, depth that grows once the step time
    /// is known, budgeted hedges, cancelled losers.
    #[default]
    Subset,
    /// The rules before bounded subsets, kept as the baseline `stoker-lab bench scale` measures
    /// against: every rank links to every worker, a link without a latency costs 0 (ties to
    /// the lowest link id), depth jumps to its cap once a latency is seen, hedges are
    /// unbudgeted and losers run on.
    FullMesh,
}
