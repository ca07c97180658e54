//! Stoker's trainer client: keeps batches prefetched from many workers, hands them over as
//! views of the buffers the socket filled, and measures how long the trainer waits.
//!
//! ```no_run
//! use stoker_client::{Loader, LoaderConfig, Discovery};
//! let mut loader = Loader::new(LoaderConfig::new(Discovery::parse("127.0.0.1:7700")?, 0, 1))?;
//! while let Some(batch) = loader.next_batch()? {
//!     let ids = batch.tensor("input_ids").unwrap();
//!     // ... train on it ...
//! }
//! let state = loader.state(); // resume exactly from here with Loader::load_state
//! # Ok::<(), stoker_client::Error>(())
//! ```
//!
//! [`Loader::next_batch`] is blocking (a trainer loop is synchronous); the network side runs
//! on the loader's own small tokio runtime.

#![forbid(unsafe_code)]

mod batch;
mod buffer;
mod config;
mod discovery;
mod driver;
mod error;
mod link;
mod metrics;
mod normalize;
pub mod policy;
pub mod scheduler;
pub mod topology;

pub use batch::{Batch, Pack, TensorView};
pub use buffer::{AlignedBuf, BufferPool};
pub use config::{ca_from_env, LoaderConfig, LoaderState, Policy, CA_ENV};
pub use discovery::{Discovery, WorkerSet};
pub use error::{Error, Result};
pub use link::CONNECT_TIMEOUT;
pub use metrics::ClientMetrics;
pub use normalize::{normalize_pixels, NormalizeError, PixelLut, PixelOut};
pub use policy::{Depth, HedgePolicy};
pub use scheduler::PlanIdentity;
pub use stoker_tls::{ClientTls, Dial, TlsError};

use scheduler::{Control, Delivery, Shared};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Accumulated blocked vs. stepping time, for the wait ratio.
#[derive(Debug, Clone, Copy, Default)]
pub struct WaitStats {
    pub wait_s: f64,
    pub step_s: f64,
    pub batches: u64,
    pub samples: u64,
}

impl WaitStats {
    /// Blocked time over wall time (0 when nothing was measured).
    pub fn wait_ratio(&self) -> f64 {
        let total = self.wait_s + self.step_s;
        if total > 0.0 {
            self.wait_s / total
        } else {
            0.0
        }
    }
}

pub struct Loader {
    runtime: tokio::runtime::Runtime,
    shared: Arc<Shared>,
    deliveries: tokio::sync::mpsc::Receiver<Delivery>,
    control: tokio::sync::mpsc::Sender<Control>,
    identity: PlanIdentity,
    metrics: Arc<ClientMetrics>,
    metrics_addr: Option<std::net::SocketAddr>,
    rank: u32,
    world_size: u32,
    /// The next position (epoch × batches per epoch + batch) to hand out.
    position: u64,
    generation: u64,
    /// The last batch of an epoch was handed out; the next call ends the epoch.
    epoch_end_pending: bool,
    last_return: Option<Instant>,
    stats: WaitStats,
    recent: std::collections::VecDeque<(Instant, f64, f64)>,
}

/// The window of `stoker_trainer_wait_ratio`.
const RECENT_WINDOW: Duration = Duration::from_secs(30);

impl Loader {
    /// Connects to the workers and learns their plan; fails with the reason per worker if
    /// none serves (wrong token, unreachable, another plan than `cfg.state`'s).
    pub fn new(cfg: LoaderConfig) -> Result<Loader> {
        if cfg.world_size == 0 || cfg.rank >= cfg.world_size {
            return Err(Error::Config(format!(
                "rank {} is not in a world of size {}",
                cfg.rank, cfg.world_size
            )));
        }
        let dial = cfg.resolve_dial()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("stoker-client")
            .enable_all()
            .build()
            .map_err(|e| Error::Internal(format!("starting the loader's runtime: {e}")))?;
        let metrics = ClientMetrics::new(&cfg.pipeline, cfg.rank);
        let metrics_addr = match &cfg.metrics_listen {
            Some(addr) => {
                let metrics_error = |e| Error::Config(format!("metrics endpoint on {addr}: {e}"));
                let listener = runtime
                    .block_on(tokio::net::TcpListener::bind(addr))
                    .map_err(metrics_error)?;
                let local = listener.local_addr().map_err(metrics_error)?;
                runtime.spawn(metrics::serve(listener, metrics.clone()));
                Some(local)
            }
            None => None,
        };
        let shared = Shared::new();
        let (no_worker_timeout, rank, world_size, state) =
            (cfg.no_worker_timeout, cfg.rank, cfg.world_size, cfg.state);
        let handles = {
            let _guard = runtime.enter();
            let workers = cfg.workers.start();
            driver::spawn(cfg, dial, workers, shared.clone(), metrics.clone())
        };
        let identity = runtime
            .block_on(async {
                tokio::time::timeout(no_worker_timeout + Duration::from_secs(1), handles.identity)
                    .await
            })
            .map_err(|_| Error::NoWorker {
                timeout: no_worker_timeout,
                why: "no worker answered".into(),
            })?
            .map_err(|_| Error::Internal("the loader's scheduler stopped".into()))??;
        let mut loader = Loader {
            runtime,
            shared,
            deliveries: handles.deliveries,
            control: handles.control,
            identity,
            metrics,
            metrics_addr,
            rank,
            world_size,
            position: 0,
            generation: 0,
            epoch_end_pending: false,
            last_return: None,
            stats: WaitStats::default(),
            recent: Default::default(),
        };
        if let Some(s) = state {
            // The scheduler already starts there; this validates and sets our side.
            loader.position = loader.check_state(&s)?;
            loader
                .shared
                .consumed
                .store(loader.position, Ordering::Release);
        }
        Ok(loader)
    }

    /// The plan the workers serve.
    pub fn plan(&self) -> &PlanIdentity {
        &self.identity
    }

    pub fn rank(&self) -> (u32, u32) {
        (self.rank, self.world_size)
    }

    /// The next batch in plan order, blocking until it is here; `Ok(None)` once at the end
    /// of each epoch (the call after that starts the next epoch).
    pub fn next_batch(&mut self) -> Result<Option<Batch>> {
        let entered = Instant::now();
        if let Some(prev) = self.last_return {
            let step = entered.duration_since(prev);
            self.stats.step_s += step.as_secs_f64();
            self.metrics.step_seconds.inc_by(step.as_secs_f64());
        }
        if self.epoch_end_pending {
            self.epoch_end_pending = false;
            self.last_return = Some(Instant::now());
            return Ok(None);
        }
        let batch = loop {
            self.shared.asking.store(true, Ordering::Release);
            self.shared.wake.notify_one();
            let d = self.deliveries.blocking_recv();
            self.shared.asking.store(false, Ordering::Release);
            let d = d.ok_or_else(|| Error::Internal("the loader's scheduler stopped".into()))?;
            if d.generation != self.generation {
                continue; // from before a load_state
            }
            match d.result {
                Ok(b) => break b,
                Err(e) => {
                    self.record_wait(entered, 0);
                    return Err(e);
                }
            }
        };
        self.position += 1;
        let interval = self.last_return.map(|prev| prev.elapsed());
        self.shared.took(self.position, interval);
        if self
            .position
            .is_multiple_of(self.identity.batches_per_epoch)
        {
            self.epoch_end_pending = true;
        }
        self.record_wait(entered, batch.sample_ids.len() as u64);
        Ok(Some(batch))
    }

    fn record_wait(&mut self, entered: Instant, samples: u64) {
        let now = Instant::now();
        let wait = now.duration_since(entered).as_secs_f64();
        let step = self
            .last_return
            .map_or(0.0, |p| entered.duration_since(p).as_secs_f64());
        self.last_return = Some(now);
        self.stats.wait_s += wait;
        if samples > 0 {
            self.stats.batches += 1;
            self.stats.samples += samples;
            self.metrics.batches.inc();
            self.metrics.samples.inc_by(samples);
        }
        self.metrics.wait_seconds.inc_by(wait);
        self.metrics.next_wait.observe(wait);
        self.recent.push_back((now, wait, step));
        while self
            .recent
            .front()
            .is_some_and(|(t, _, _)| now.duration_since(*t) > RECENT_WINDOW)
        {
            self.recent.pop_front();
        }
        let (w, s) = self
            .recent
            .iter()
            .fold((0.0, 0.0), |(w, s), (_, a, b)| (w + a, s + b));
        if w + s > 0.0 {
            self.metrics.wait_ratio.set(w / (w + s));
        }
    }

    /// Where the loader is: after `load_state` of this, a loader hands out exactly the
    /// batches this one would have handed out next.
    pub fn state(&self) -> LoaderState {
        let bpe = self.identity.batches_per_epoch;
        LoaderState {
            plan_id: self.identity.plan_id,
            epoch: self.position / bpe,
            next_batch: self.position % bpe,
        }
    }

    /// Continues from `state` (of this or any other world size: positions are global).
    pub fn load_state(&mut self, state: LoaderState) -> Result<()> {
        self.position = self.check_state(&state)?;
        self.generation += 1;
        self.epoch_end_pending = false;
        self.shared.consumed.store(self.position, Ordering::Release);
        self.control
            .blocking_send(Control::Seek {
                position: self.position,
                generation: self.generation,
            })
            .map_err(|_| Error::Internal("the loader's scheduler stopped".into()))
    }

    /// The global position `state` names, if it is one of this plan's.
    fn check_state(&self, state: &LoaderState) -> Result<u64> {
        if state.plan_id != self.identity.plan_id {
            return Err(Error::PlanMismatch(format!(
                "the state is for plan {:016x}, the workers serve plan {:016x} ({}): same dataset, seed, batch size and preprocessing are needed to resume",
                state.plan_id, self.identity.plan_id, self.identity.description
            )));
        }
        let bpe = self.identity.batches_per_epoch;
        if state.next_batch >= bpe {
            return Err(Error::PlanMismatch(format!(
                "the state names batch {} but an epoch has {bpe}",
                state.next_batch
            )));
        }
        self.identity
            .position(state.epoch, state.next_batch)
            .ok_or_else(|| {
                Error::PlanMismatch(format!(
                    "the state names epoch {} of {bpe} batches: past the last position a loader counts",
                    state.epoch
                ))
            })
    }

    pub fn stats(&self) -> WaitStats {
        self.stats
    }

    pub fn metrics(&self) -> &ClientMetrics {
        &self.metrics
    }

    /// Where /metrics is served, when enabled.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.metrics_addr
    }

    /// The loader's runtime, for callers that feed it (e.g. a pushed worker list).
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        self.runtime.handle()
    }
}
