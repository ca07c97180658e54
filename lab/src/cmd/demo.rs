//! `stoker-lab demo`: the whole story on one machine, no cluster and no cloud.
//!
//! A synthetic dataset sits behind an embedded S3-compatible server that behaves like an
//! object store (time to first byte, per-connection bandwidth); `stoker worker` processes
//! serve it; simulated trainer ranks (a fixed compute time per step) pull batches through the
//! real client. The same trainer runs through five stages, each adding one fix of the design
//! (docs/design.md, "The problem, in numbers"):
//!
//! 1. `serial baseline`: one worker loads one sample at a time, no prefetch, and each batch is
//!    pickled through a coordinator to the rank: copied, sent over the coordinator's link (a
//!    head node's network share, shared by every rank) and unpickled;
//! 2. `+ concurrency`: concurrent object-store reads, all samples of a request at once;
//! 3. `+ prefetch`: the client keeps batches requested ahead (adaptive depth);
//! 4. `+ zero-copy hand-over`: the rank takes batches straight from the client's buffers (no
//!    coordinator hop);
//! 5. `+ autoscaled workers`: the autoscaler of the operator (stoker-control) adds worker
//!    processes while the trainers' wait ratio is above target.
//!
//! Each stage removes the bottleneck of the one before, and every bottleneck is a latency or a
//! bandwidth (store, worker connection pool, coordinator link), not this machine's CPU: a
//! worker's images are small and its reads few, so the rows keep their order on a loaded
//! machine too.

use super::local::{demo_preprocessing, ensure_demo_dataset, spawn_worker};
use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stoker_client::{Depth, Dial, Discovery, Loader, LoaderConfig, WorkerSet};
use stoker_config::{cache_root, Concurrency, Preprocessing, Serving, WorkerConfig};
use stoker_control::autoscale::{Autoscaler, Observation, RankCounters, Rule, Rules, Spec};
use stoker_control::exposition::rank_counters;
use stoker_control::metrics::{PipelineGauges, ScalerMetrics};
use stoker_testkit::embedded_s3::{EmbeddedS3, StoreBehaviour};
use stoker_testkit::http;
use stoker_testkit::local_worker::LocalWorker;

#[derive(clap::Args)]
pub struct DemoArgs {
    /// Samples in the synthetic dataset (generated once, cached under --cache).
    #[arg(long, default_value_t = 400)]
    samples: usize,
    /// Object store: time to first byte of every GET, in ms.
    #[arg(long, default_value_t = 20)]
    first_byte_latency_ms: u64,
    /// Object store: bandwidth of one connection, in MB/s.
    #[arg(long, default_value_t = 100.0)]
    bandwidth_mb_s: f64,
    /// Trainer: data-parallel ranks (each one a thread with its own client).
    #[arg(long, default_value_t = 2)]
    ranks: u32,
    /// Trainer: samples per rank per step (global batch = ranks x this).
    #[arg(long, default_value_t = 4)]
    batch_size: u32,
    /// Trainer: compute time of one step, in ms. The default asks for more than one worker
    /// delivers, so that the last stage needs at least two.
    #[arg(long, default_value_t = 60)]
    step_ms: u64,
    /// Copying hand-over: bandwidth of the coordinator's link, in MB/s (all ranks share it).
    #[arg(long, default_value_t = 150.0)]
    coordinator_mb_s: f64,
    /// Steps measured per stage (per rank).
    #[arg(long, default_value_t = 12)]
    steps: usize,
    /// Steps per stage before measuring (cold start: connections, first batches).
    #[arg(long, default_value_t = 3)]
    warmup_steps: usize,
    /// CPU threads per worker process (a worker pod's CPU limit).
    #[arg(long, default_value_t = 1)]
    worker_cpus: usize,
    /// Object-store reads in flight per worker (a worker pod's connection pool): what bounds
    /// one worker here, so that the last stage needs more of them.
    #[arg(long, default_value_t = 3)]
    worker_fetches: usize,
    /// Autoscaler: most workers.
    #[arg(long, default_value_t = 4)]
    max_workers: u32,
    /// Autoscaler: the wait ratio to stay under.
    #[arg(long, default_value_t = 0.05)]
    target_wait_ratio: f64,
    /// Autoscaler: seconds between evaluations.
    #[arg(long, default_value_t = 1.0)]
    autoscale_interval_s: f64,
    /// Autoscaler: longest time to wait for the worker count to settle before measuring.
    #[arg(long, default_value_t = 40)]
    settle_timeout_s: u64,
    /// Print one JSON object per stage instead of the table.
    #[arg(long)]
    json: bool,
    /// Instead of the ablation, run the autoscaled stage for this many seconds (for watching
    /// the dashboards: see --metrics-listen and --prometheus-targets).
    #[arg(long)]
    observe_s: Option<u64>,
    /// Serve the local autoscaler's metrics (the operator's series, namespace "local") here.
    #[arg(long)]
    metrics_listen: Option<String>,
    /// Keep this file listing every /metrics endpoint (autoscaler, workers, trainer ranks) in
    /// Prometheus file_sd format, updated as workers come and go.
    #[arg(long)]
    prometheus_targets: Option<std::path::PathBuf>,
    /// Where the dataset is cached [default: $STOKER_CACHE/demo, the cache defaulting to ~/.cache/stoker].
    #[arg(long)]
    cache: Option<std::path::PathBuf>,
    /// Preprocessing (the demo defaults to --max-pixels 200704 and --pixel-dtype bf16, i.e.
    /// up to 256 vision tokens per image, to keep the run short).
    #[command(flatten)]
    pre: Preprocessing,
}

/// One row of the ablation.
#[derive(Debug, Clone)]
struct StageResult {
    stage: &'static str,
    wait_ratio: f64,
    samples_per_s: f64,
    data_s_per_batch: f64,
    workers: u32,
}

#[derive(Clone, Copy, PartialEq)]
enum Handover {
    /// Pickled through a coordinator thread and a socket, unpickled into fresh arrays.
    Copy,
    /// The rank holds the client's buffer.
    ZeroCopy,
}

/// Long side of the demo's images: small, so that a worker is bound by its reads, not by
/// this machine's CPU.
const DEMO_MAX_SIDE: u32 = 640;

/// The `pipeline` label of every series the demo's processes export.
const PIPELINE: &str = "demo";

#[derive(Clone, Copy)]
struct Stage {
    name: &'static str,
    serial_worker: bool,
    depth: Depth,
    handover: Handover,
    autoscale: bool,
}

const STAGES: [Stage; 5] = [
    Stage {
        name: "serial baseline",
        serial_worker: true,
        depth: Depth::OnDemand,
        handover: Handover::Copy,
        autoscale: false,
    },
    Stage {
        name: "+ concurrency",
        serial_worker: false,
        depth: Depth::OnDemand,
        handover: Handover::Copy,
        autoscale: false,
    },
    Stage {
        name: "+ prefetch",
        serial_worker: false,
        depth: Depth::Auto { max: 16 },
        handover: Handover::Copy,
        autoscale: false,
    },
    Stage {
        name: "+ zero-copy hand-over",
        serial_worker: false,
        depth: Depth::Auto { max: 16 },
        handover: Handover::ZeroCopy,
        autoscale: false,
    },
    Stage {
        name: "+ autoscaled workers",
        serial_worker: false,
        depth: Depth::Auto { max: 16 },
        handover: Handover::ZeroCopy,
        autoscale: true,
    },
];

pub async fn run(mut a: DemoArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.ranks > 0 && a.batch_size > 0,
        "--ranks and --batch-size must be > 0"
    );
    anyhow::ensure!(a.coordinator_mb_s > 0.0, "--coordinator-mb-s must be > 0");
    anyhow::ensure!(
        a.target_wait_ratio > 0.0 && a.target_wait_ratio < 1.0,
        "--target-wait-ratio must be in (0, 1)"
    );
    demo_preprocessing(&mut a.pre);
    let root = a.cache.clone().unwrap_or_else(|| cache_root().join("demo"));
    let (dataset_root, samples) = (root.clone(), a.samples);
    let bucket = tokio::task::spawn_blocking(move || {
        ensure_demo_dataset(&dataset_root, samples, DEMO_MAX_SIDE)
    })
    .await??;
    let store = StoreBehaviour {
        first_byte_latency: Duration::from_millis(a.first_byte_latency_ms),
        bandwidth_bytes_per_s: Some((a.bandwidth_mb_s * 1e6) as u64),
        ..StoreBehaviour::default()
    };
    let s3 = EmbeddedS3::start_with(&root, "127.0.0.1:0", store).await?;
    let env = s3.env();
    let data = format!("s3://{bucket}");
    if !a.json {
        println!(
            "Trainer: {} ranks x {} samples per step, {} ms compute per step. Object store: {} ms to first byte, {} MB/s per connection. Coordinator link (copying hand-over): {} MB/s. Workers: {} CPU and {} object-store reads each, {} preset, {} pixels.",
            a.ranks,
            a.batch_size,
            a.step_ms,
            a.first_byte_latency_ms,
            a.bandwidth_mb_s,
            a.coordinator_mb_s,
            a.worker_cpus,
            a.worker_fetches,
            a.pre.preset.as_str(),
            a.pre.pixel_dtype.expect("set above").as_str(),
        );
    }
    let observer = match &a.metrics_listen {
        Some(addr) => {
            let registry = prometheus::Registry::new();
            let metrics = Arc::new(ScalerMetrics::register(&registry)?);
            let listener = tokio::net::TcpListener::bind(addr).await?;
            let local = listener.local_addr()?.to_string();
            println!("metrics {local}");
            tokio::spawn(serve_scaler_metrics(listener, registry));
            Some((metrics, local))
        }
        None => None,
    };
    let a = Arc::new(a);
    let stages: Vec<Stage> = match a.observe_s {
        Some(_) => vec![STAGES[4]],
        None => STAGES.to_vec(),
    };
    let total = (stages.len() * (a.warmup_steps + a.steps)) as u64;
    let progress = indicatif::ProgressBar::new(total).with_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}")
            .expect("valid template"),
    );
    let mut results = Vec::new();
    for stage in stages {
        progress.set_message(stage.name);
        let (a, data, env, pb) = (a.clone(), data.clone(), env.clone(), progress.clone());
        let obs = observer.clone();
        let r = tokio::task::spawn_blocking(move || {
            run_stage(&a, stage, &data, &env, &pb, obs.as_ref())
        })
        .await??;
        results.push(r);
    }
    progress.finish_and_clear();
    print_results(&a, &results);
    Ok(())
}

/// The configuration of every worker of a stage (the serial baseline reads one object at a
/// time and loads one sample after another).
fn worker_config(a: &DemoArgs, data: &str, serial: bool) -> WorkerConfig {
    let mut c = WorkerConfig {
        data: data.to_string(),
        preprocessing: a.pre.clone(),
        concurrency: Concurrency {
            max_fetches: if serial { 1 } else { a.worker_fetches },
            cpu_threads: Some(a.worker_cpus),
            sample_parallelism: serial.then_some(1),
            ..Concurrency::default()
        },
        serving: Serving {
            no_auth: true,
            insecure_plaintext: true,
            pipeline: PIPELINE.into(),
            ..Serving::default()
        },
        ..WorkerConfig::default()
    };
    c.s3.path_style = true;
    c.sampling.global_batch_size = a.ranks * a.batch_size;
    c
}

fn print_results(a: &DemoArgs, rows: &[StageResult]) {
    if a.json {
        for r in rows {
            println!(
                "{{\"stage\":\"{}\",\"wait_ratio\":{:.4},\"samples_per_s\":{:.2},\"data_s_per_batch\":{:.4},\"workers\":{}}}",
                r.stage, r.wait_ratio, r.samples_per_s, r.data_s_per_batch, r.workers
            );
        }
        return;
    }
    println!();
    println!(
        "{:<24} {:>17} {:>11} {:>10} {:>8}",
        "stage", "data s per batch", "wait ratio", "samples/s", "workers"
    );
    for r in rows {
        println!(
            "{:<24} {:>17.3} {:>11.3} {:>10.1} {:>8}",
            r.stage, r.data_s_per_batch, r.wait_ratio, r.samples_per_s, r.workers
        );
    }
    println!(
        "\nwait ratio = time a rank blocked on data / its wall time (worst rank); data s per batch = that blocked time per step. Target: final wait ratio <= {}.",
        a.target_wait_ratio
    );
}

/// What one rank measured.
#[derive(Debug, Default, Clone, Copy)]
struct RankStats {
    wait_s: f64,
    wall_s: f64,
    samples: u64,
    steps: u64,
}

/// The workers of a stage and the address set the clients discover them by.
struct Pool {
    config: WorkerConfig,
    env: Vec<(&'static str, String)>,
    workers: Vec<LocalWorker>,
    set: tokio::sync::watch::Sender<WorkerSet>,
}

impl Pool {
    fn resize(&mut self, n: usize) -> anyhow::Result<()> {
        while self.workers.len() < n {
            self.workers.push(spawn_worker(&self.config, &self.env)?);
        }
        // Newest first: the client retries whatever the removed worker had in flight.
        self.workers.truncate(n);
        let set: BTreeSet<String> = self.workers.iter().map(|w| w.addr.clone()).collect();
        self.set.send_replace(set);
        Ok(())
    }
}

fn run_stage(
    a: &DemoArgs,
    stage: Stage,
    data: &str,
    env: &[(&'static str, String)],
    progress: &indicatif::ProgressBar,
    observer: Option<&(Arc<ScalerMetrics>, String)>,
) -> anyhow::Result<StageResult> {
    let (set_tx, set_rx) = tokio::sync::watch::channel(WorkerSet::new());
    let mut pool = Pool {
        config: worker_config(a, data, stage.serial_worker),
        env: env.to_vec(),
        workers: Vec::new(),
        set: set_tx,
    };
    pool.resize(1)?;

    let link = Arc::new(Link::new(a.coordinator_mb_s));
    let measuring = Arc::new(AtomicBool::new(!stage.autoscale));
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mut ranks = Vec::new();
    let mut metrics_addrs = Vec::new();
    for rank in 0..a.ranks {
        let mut cfg = LoaderConfig::new(Discovery::Watch(set_rx.clone()), rank, a.ranks);
        cfg.dial = Some(Dial::InsecurePlaintext); // the demo's workers, on loopback
        cfg.depth = stage.depth;
        cfg.metrics_listen = Some("127.0.0.1:0".into());
        cfg.pipeline = PIPELINE.into();
        let loader = Loader::new(cfg)?;
        metrics_addrs.push(loader.metrics_addr().expect("enabled").to_string());
        let (measuring, stop, done) = (measuring.clone(), stop.clone(), done.clone());
        let progress = progress.clone();
        let steps = if a.observe_s.is_some() {
            usize::MAX
        } else {
            a.steps
        };
        let (step, warmup) = (Duration::from_millis(a.step_ms), a.warmup_steps);
        let (handover, link) = (stage.handover, link.clone());
        ranks.push(std::thread::spawn(move || {
            let source = BatchSource::new(loader, handover, link)?;
            let r = train(
                source,
                step,
                (warmup, steps),
                (&measuring, &stop),
                &progress,
                rank == 0,
            );
            done.fetch_add(1, Ordering::Release);
            r
        }));
    }

    let workers_measured = if stage.autoscale {
        let flags = (&*measuring, &*stop, &*done);
        autoscale_while_training(a, &mut pool, &metrics_addrs, observer, flags)?
    } else {
        1
    };
    let mut stats = Vec::new();
    for r in ranks {
        stats.push(r.join().expect("rank thread")?);
    }
    Ok(summarize(stage.name, &stats, workers_measured))
}

/// The stage's row: the worst rank's wait, everyone's throughput.
fn summarize(stage: &'static str, stats: &[RankStats], workers: u32) -> StageResult {
    let worst = stats
        .iter()
        .max_by(|x, y| (x.wait_s / x.wall_s).total_cmp(&(y.wait_s / y.wall_s)))
        .copied()
        .unwrap_or_default();
    let samples: u64 = stats.iter().map(|s| s.samples).sum();
    let wall = stats.iter().map(|s| s.wall_s).fold(0.0, f64::max);
    StageResult {
        stage,
        wait_ratio: worst.wait_s / worst.wall_s,
        samples_per_s: samples as f64 / wall,
        data_s_per_batch: worst.wait_s / worst.steps.max(1) as f64,
        workers,
    }
}

/// Scales the pool with the operator's policy until the count settles, then starts the
/// measurement and keeps scaling until every rank is done (or `--observe-s` ends the run);
/// the most workers used while measuring.
fn autoscale_while_training(
    a: &DemoArgs,
    pool: &mut Pool,
    rank_metrics: &[String],
    observer: Option<&(Arc<ScalerMetrics>, String)>,
    (measuring, stop, done): (&AtomicBool, &AtomicBool, &AtomicU64),
) -> anyhow::Result<u32> {
    let mut scaler = LocalScaler::new(a, rank_metrics, observer);
    scaler.record(pool, None);
    scaler.publish(pool)?;
    if a.observe_s.is_some() {
        // Let scrapers record the starting count, so the first decision shows as a change.
        std::thread::sleep(Duration::from_secs(5));
    }
    // Until the count holds for 4 evaluations (or the timeout), then measure.
    let t0 = Instant::now();
    let mut unchanged = 0;
    while a.observe_s.is_none()
        && unchanged < 4
        && t0.elapsed() < Duration::from_secs(a.settle_timeout_s)
    {
        unchanged = if scaler.step(pool)? { 0 } else { unchanged + 1 };
    }
    measuring.store(true, Ordering::Release);
    let deadline = a.observe_s.map(|s| Instant::now() + Duration::from_secs(s));
    let mut workers_measured = 1;
    while done.load(Ordering::Acquire) < a.ranks as u64 {
        scaler.step(pool)?;
        workers_measured = workers_measured.max(pool.workers.len() as u32);
        if deadline.is_some_and(|d| Instant::now() >= d) {
            stop.store(true, Ordering::Release);
        }
    }
    Ok(workers_measured)
}

/// The demo's autoscaler settings: quick to act (a short demo), same policy as the operator.
fn demo_spec(a: &DemoArgs) -> Spec {
    // A change is measured for five evaluations before the next one (new workers take a
    // second or two to start and to refill the ranks' prefetch).
    let period = Duration::from_secs_f64(a.autoscale_interval_s * 5.0);
    Spec {
        rule: Rule::FeedForward,
        min_replicas: 1,
        max_replicas: a.max_workers,
        target_wait_ratio: a.target_wait_ratio,
        headroom: 0.2,
        scale_up: Rules {
            stabilization: Duration::ZERO,
            max_pods: 2,
            max_percent: 100,
            period,
        },
        scale_down: Rules {
            stabilization: Duration::from_secs(20),
            max_pods: 1,
            max_percent: 10,
            period,
        },
    }
}

/// Each rank's client counters, from its /metrics (`None` where unreadable).
type Scrape = Vec<Option<RankCounters>>;

fn scrape(addrs: &[String]) -> Scrape {
    addrs
        .iter()
        .map(|addr| rank_counters(&http::get_ok(addr, "/metrics").ok()?))
        .collect()
}

fn observe(before: &Scrape, after: &Scrape, ready: u32) -> Option<Observation> {
    Observation::between(before, after, ready)
}

/// /metrics of the local autoscaler: the operator's per-pipeline series.
async fn serve_scaler_metrics(listener: tokio::net::TcpListener, registry: prometheus::Registry) {
    let render = move || {
        let r = registry.clone();
        async move { stoker_control::metrics::render(&r) }
    };
    let app = axum::Router::new().route("/metrics", axum::routing::get(render));
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!("autoscaler metrics endpoint: {e}");
    }
}

/// The local autoscaler: the operator's policy over worker processes, exporting the
/// operator's series and the Prometheus targets of everything running.
struct LocalScaler<'a> {
    a: &'a DemoArgs,
    spec: Spec,
    scaler: Autoscaler,
    t0: Instant,
    ranks: &'a [String],
    last: Scrape,
    observer: Option<&'a (Arc<ScalerMetrics>, String)>,
}

impl<'a> LocalScaler<'a> {
    fn new(
        a: &'a DemoArgs,
        ranks: &'a [String],
        observer: Option<&'a (Arc<ScalerMetrics>, String)>,
    ) -> Self {
        LocalScaler {
            a,
            spec: demo_spec(a),
            scaler: Autoscaler::default(),
            t0: Instant::now(),
            ranks,
            last: scrape(ranks),
            observer,
        }
    }

    /// One evaluation after an interval; true when the worker count changed.
    fn step(&mut self, pool: &mut Pool) -> anyhow::Result<bool> {
        std::thread::sleep(Duration::from_secs_f64(self.a.autoscale_interval_s));
        let now = scrape(self.ranks);
        let current = pool.workers.len() as u32;
        let obs = observe(&self.last, &now, current);
        self.last = now;
        let d = self
            .scaler
            .evaluate(&self.spec, self.t0.elapsed(), current, obs);
        let changed = d.replicas != current;
        if changed {
            tracing::info!(
                "autoscaler: {current} -> {} workers: {}",
                d.replicas,
                d.reason
            );
            pool.resize(d.replicas as usize)?;
            if let Some((m, _)) = self.observer {
                m.count_scale("local", PIPELINE, d.replicas > current);
            }
        }
        self.record(pool, Some(obs.is_some()));
        self.publish(pool)?;
        Ok(changed)
    }

    /// The operator's per-pipeline gauges (the first call records the starting count, so
    /// that the first change shows as one).
    fn record(&self, pool: &Pool, metrics_available: Option<bool>) {
        if let Some((m, _)) = self.observer {
            m.record_pipeline(PipelineGauges {
                namespace: "local",
                pipeline: PIPELINE,
                desired: pool.workers.len() as i32,
                ready: pool.workers.len() as i32,
                max: self.spec.max_replicas as i32,
                target: Some(self.spec.target_wait_ratio),
                metrics_available,
            });
        }
    }

    /// Rewrites the file_sd targets (atomically: Prometheus may read at any time).
    fn publish(&self, pool: &Pool) -> anyhow::Result<()> {
        let Some(path) = &self.a.prometheus_targets else {
            return Ok(());
        };
        let group = |component: &str, targets: Vec<String>| serde_json::json!({"targets": targets, "labels": {"component": component}});
        let mut groups = vec![
            group(
                "worker",
                pool.workers
                    .iter()
                    .map(|w| w.metrics_addr.clone())
                    .collect(),
            ),
            group("trainer", self.ranks.to_vec()),
        ];
        if let Some((_, addr)) = self.observer {
            groups.push(group("autoscaler", vec![addr.clone()]));
        }
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(&groups)?)?;
        std::fs::rename(&tmp, path)?;
        Ok(())
    }
}

/// The coordinator's network link (a head node's share of its NIC): pickled batches cross it
/// one after another, whichever rank they are for.
struct Link {
    bytes_per_s: f64,
    free_at: std::sync::Mutex<Instant>,
}

impl Link {
    fn new(mb_per_s: f64) -> Link {
        Link {
            bytes_per_s: mb_per_s * 1e6,
            free_at: std::sync::Mutex::new(Instant::now()),
        }
    }

    /// Blocks while `bytes` cross the link, after whatever is queued on it before them.
    fn send(&self, bytes: usize) {
        let done = {
            let mut free_at = self.free_at.lock().expect("link lock");
            let start = (*free_at).max(Instant::now());
            *free_at = start + Duration::from_secs_f64(bytes as f64 / self.bytes_per_s);
            *free_at
        };
        std::thread::sleep(done.saturating_duration_since(Instant::now()));
    }
}

/// Where a rank gets its batches: straight from its client, or through a coordinator.
enum BatchSource {
    Direct(Box<Loader>),
    /// A coordinator thread owns the client and pickles every batch into a socket.
    Coordinator(UnixStream),
}

impl BatchSource {
    fn new(loader: Loader, handover: Handover, link: Arc<Link>) -> anyhow::Result<BatchSource> {
        if handover == Handover::ZeroCopy {
            return Ok(BatchSource::Direct(Box::new(loader)));
        }
        let (rank_end, mut coord_end) = UnixStream::pair()?;
        std::thread::spawn(move || {
            let mut loader = loader;
            let mut ask = [0u8; 1];
            // One batch per request from the rank: the coordinator adds no prefetch of its own.
            while coord_end.read_exact(&mut ask).is_ok() {
                let batch = match next_in_any_epoch(&mut loader) {
                    Ok(b) => b,
                    Err(e) => {
                        tracing::error!("coordinator: {e:#}");
                        return;
                    }
                };
                let bytes = pickle(&batch);
                link.send(bytes.len());
                let len = (bytes.len() as u64).to_le_bytes();
                if coord_end.write_all(&len).is_err() || coord_end.write_all(&bytes).is_err() {
                    return; // the rank is done
                }
            }
        });
        Ok(BatchSource::Coordinator(rank_end))
    }

    /// The next batch's sample count (the simulated trainer looks at nothing else).
    fn next(&mut self) -> anyhow::Result<usize> {
        match self {
            BatchSource::Direct(loader) => Ok(next_in_any_epoch(loader)?.sample_ids.len()),
            BatchSource::Coordinator(sock) => {
                sock.write_all(&[1])?;
                let mut len = [0u8; 8];
                sock.read_exact(&mut len)?;
                let mut bytes = vec![0u8; u64::from_le_bytes(len) as usize];
                sock.read_exact(&mut bytes)?;
                Ok(unpickle(&bytes).0)
            }
        }
    }
}

/// The next batch, across epoch ends (the simulated trainer does not count epochs).
fn next_in_any_epoch(loader: &mut Loader) -> anyhow::Result<stoker_client::Batch> {
    loop {
        if let Some(b) = loader.next_batch()? {
            return Ok(b);
        }
    }
}

/// Serializes a batch the way pickling does: a fresh byte string holding a copy of every
/// tensor, prefixed by the sample count.
fn pickle(b: &stoker_client::Batch) -> Vec<u8> {
    let mut out = Vec::with_capacity(b.payload.len() + 64);
    out.extend_from_slice(&(b.sample_ids.len() as u64).to_le_bytes());
    for t in b.views() {
        out.extend_from_slice(&(t.bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(t.bytes);
    }
    out
}

/// Rebuilds fresh arrays from a pickled batch (a second copy, as unpickling does).
fn unpickle(bytes: &[u8]) -> (usize, Vec<Vec<u8>>) {
    let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let samples = word(0) as usize;
    let mut at = 8;
    let mut tensors = Vec::new();
    while at < bytes.len() {
        let n = word(at) as usize;
        tensors.push(bytes[at + 8..at + 8 + n].to_vec());
        at += 8 + n;
    }
    (samples, tensors)
}

/// The simulated trainer of one rank: take a batch (timed: that is the wait), compute for
/// `step`, repeat; warm up, wait for the go, then measure `steps` steps.
fn train(
    mut source: BatchSource,
    step: Duration,
    (warmup, steps): (usize, usize),
    (measuring, stop): (&AtomicBool, &AtomicBool),
    progress: &indicatif::ProgressBar,
    report: bool,
) -> anyhow::Result<RankStats> {
    let mut stats = RankStats::default();
    let mut warm = 0;
    let mut start = None;
    while stats.steps < steps as u64 && !stop.load(Ordering::Acquire) {
        let t = Instant::now();
        let samples = source.next()?;
        let wait = t.elapsed();
        std::thread::sleep(step);
        if start.is_some() {
            stats.wait_s += wait.as_secs_f64();
            stats.samples += samples as u64;
            stats.steps += 1;
        } else {
            warm += 1;
        }
        if start.is_none() && warm >= warmup && measuring.load(Ordering::Acquire) {
            start = Some(Instant::now());
        }
        if report && (warm <= warmup || start.is_some()) {
            progress.inc(1);
        }
    }
    stats.wall_s = start.map_or(0.0, |s| s.elapsed().as_secs_f64());
    Ok(stats)
}
