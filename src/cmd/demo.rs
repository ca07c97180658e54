//! `stoker demo`: the whole story on one machine, no cluster and no cloud.
//!
//! A synthetic dataset sits behind an embedded S3-compatible server that behaves like an
//! object store (time to first byte, per-connection bandwidth); `stoker worker` processes
//! serve it; simulated trainer ranks (a fixed compute time per step) pull batches through the
//! real client. The same trainer runs through five stages, each adding one fix of the design
//! (DESIGN.md, "The problem, in numbers"):
//!
//! 1. `serial baseline`: one worker loads one sample at a time, no prefetch, and each batch is
//!    pickled through a coordinator to the rank (as a DataLoader hands batches over);
//! 2. `+ concurrency`: concurrent object-store reads, all samples of a request at once;
//! 3. `+ prefetch`: the client keeps batches requested ahead (adaptive depth);
//! 4. `+ zero-copy hand-over`: the rank takes batches straight from the client's buffers;
//! 5. `+ autoscaled workers`: the autoscaler of the operator (stoker-control) adds worker
//!    processes while the trainers' wait ratio is above target.

use super::local::{cache_root, ensure_dataset, http_get, spawn_worker};
use crate::operator::scrape::rank_counters;
use std::collections::BTreeSet;
use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stoker_client::{Depth, Discovery, Loader, LoaderConfig, WorkerSet};
use stoker_control::autoscale::{Autoscaler, Observation, RankCounters, Rule, Rules, Spec};
use stoker_worker::dataset::synth::{SynthFormat, SynthOptions};
use stoker_worker::embedded_s3::{EmbeddedS3, StoreBehaviour};
use stoker_worker::pipeline::PreprocessArgs;
use stoker_worker::preprocess::preset::PixelDtype;
use stoker_worker::process::LocalWorker;

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
    /// Steps measured per stage (per rank).
    #[arg(long, default_value_t = 12)]
    steps: usize,
    /// Steps per stage before measuring (cold start: connections, first batches).
    #[arg(long, default_value_t = 3)]
    warmup_steps: usize,
    /// CPU threads per worker process (a worker pod's CPU limit).
    #[arg(long, default_value_t = 1)]
    worker_cpus: usize,
    /// Object-store reads in flight per worker (a worker pod's connection pool).
    #[arg(long, default_value_t = 8)]
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
    /// Where the dataset is cached [default: ~/.cache/stoker/demo].
    #[arg(long)]
    cache: Option<std::path::PathBuf>,
    /// Preprocessing (the demo defaults to --max-pixels 200704 and --pixel-dtype bf16, i.e.
    /// up to 256 vision tokens per image, to keep the run short).
    #[command(flatten)]
    pre: PreprocessArgs,
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
    anyhow::ensure!(
        a.target_wait_ratio > 0.0 && a.target_wait_ratio < 1.0,
        "--target-wait-ratio must be in (0, 1)"
    );
    a.pre.max_pixels.get_or_insert(200_704);
    a.pre.pixel_dtype.get_or_insert(PixelDtype::Bf16);
    let root = a.cache.clone().unwrap_or_else(|| cache_root().join("demo"));
    let bucket = format!("demo-{}", a.samples);
    let synth = SynthOptions {
        samples: a.samples,
        format: SynthFormat::Llava,
        samples_per_shard: 100,
        max_side: 1024,
        ..SynthOptions::default()
    };
    let dir = root.join(&bucket);
    tokio::task::spawn_blocking(move || ensure_dataset(&dir, &synth)).await??;
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
            "Trainer: {} ranks x {} samples per step, {} ms compute per step. Object store: {} ms to first byte, {} MB/s per connection. Workers: {} CPU and {} object-store reads each, {} preset, {:?} pixels.",
            a.ranks,
            a.batch_size,
            a.step_ms,
            a.first_byte_latency_ms,
            a.bandwidth_mb_s,
            a.worker_cpus,
            a.worker_fetches,
            a.pre.preset().label(),
            a.pre.preset().pixel_dtype,
        );
    }
    let a = Arc::new(a);
    let total = (STAGES.len() * (a.warmup_steps + a.steps)) as u64;
    let progress = indicatif::ProgressBar::new(total).with_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}")
            .expect("valid template"),
    );
    let mut results = Vec::new();
    for stage in STAGES {
        progress.set_message(stage.name);
        let (a, data, env, pb) = (a.clone(), data.clone(), env.clone(), progress.clone());
        let r =
            tokio::task::spawn_blocking(move || run_stage(&a, stage, &data, &env, &pb)).await??;
        results.push(r);
    }
    progress.finish_and_clear();
    print_results(&a, &results);
    Ok(())
}

/// Flags every worker of the demo gets.
fn worker_args(a: &DemoArgs, serial: bool) -> anyhow::Result<Vec<OsString>> {
    let mut args: Vec<OsString> = vec![
        "--no-auth".into(),
        "--s3-path-style".into(),
        "--global-batch-size".into(),
        (a.ranks * a.batch_size).to_string().into(),
        "--cpu-threads".into(),
        a.worker_cpus.to_string().into(),
    ];
    if !serial {
        args.extend(["--max-fetches".into(), a.worker_fetches.to_string().into()]);
    }
    args.extend(a.pre.to_args()?);
    Ok(args)
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
    data: String,
    args: Vec<OsString>,
    env: Vec<(&'static str, String)>,
    workers: Vec<LocalWorker>,
    set: tokio::sync::watch::Sender<WorkerSet>,
}

impl Pool {
    fn resize(&mut self, n: usize) -> anyhow::Result<()> {
        while self.workers.len() < n {
            self.workers
                .push(spawn_worker(&self.data, &self.args, &self.env)?);
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
) -> anyhow::Result<StageResult> {
    let mut args = worker_args(a, stage.serial_worker)?;
    if stage.serial_worker {
        args.extend(["--max-fetches", "1", "--sample-parallelism", "1"].map(OsString::from));
    }
    let (set_tx, set_rx) = tokio::sync::watch::channel(WorkerSet::new());
    let mut pool = Pool {
        data: data.to_string(),
        args,
        env: env.to_vec(),
        workers: Vec::new(),
        set: set_tx,
    };
    pool.resize(1)?;

    let measuring = Arc::new(AtomicBool::new(!stage.autoscale));
    let done = Arc::new(AtomicU64::new(0));
    let mut ranks = Vec::new();
    let mut metrics_addrs = Vec::new();
    for rank in 0..a.ranks {
        let mut cfg = LoaderConfig::new(Discovery::Watch(set_rx.clone()), rank, a.ranks);
        cfg.depth = stage.depth;
        cfg.metrics_listen = Some("127.0.0.1:0".into());
        cfg.pipeline = "demo".into();
        let loader = Loader::new(cfg)?;
        metrics_addrs.push(loader.metrics_addr().expect("enabled").to_string());
        let (measuring, done, progress) = (measuring.clone(), done.clone(), progress.clone());
        let (step, warmup, steps) = (Duration::from_millis(a.step_ms), a.warmup_steps, a.steps);
        let handover = stage.handover;
        ranks.push(std::thread::spawn(move || {
            let source = BatchSource::new(loader, handover)?;
            let r = train(
                source,
                step,
                warmup,
                steps,
                &measuring,
                &progress,
                rank == 0,
            );
            done.fetch_add(1, Ordering::Release);
            r
        }));
    }

    let mut workers_measured = 1;
    if stage.autoscale {
        workers_measured = autoscale_until_settled(a, &mut pool, &metrics_addrs)?;
        measuring.store(true, Ordering::Release);
        // Keep the autoscaler running while the ranks measure.
        let mut scaler = Autoscaler::default();
        let spec = demo_spec(a);
        let t0 = Instant::now();
        let mut last = scrape(&metrics_addrs);
        while done.load(Ordering::Acquire) < a.ranks as u64 {
            std::thread::sleep(Duration::from_secs_f64(a.autoscale_interval_s));
            let now = scrape(&metrics_addrs);
            let obs = observe(&last, &now, pool.workers.len() as u32);
            last = now;
            let current = pool.workers.len() as u32;
            let d = scaler.evaluate(&spec, t0.elapsed(), current, obs);
            if d.replicas != current {
                pool.resize(d.replicas as usize)?;
            }
            workers_measured = workers_measured.max(pool.workers.len() as u32);
        }
    }
    let mut stats = Vec::new();
    for r in ranks {
        stats.push(r.join().expect("rank thread")?);
    }
    let worst = stats
        .iter()
        .max_by(|x, y| (x.wait_s / x.wall_s).total_cmp(&(y.wait_s / y.wall_s)))
        .copied()
        .unwrap_or_default();
    let samples: u64 = stats.iter().map(|s| s.samples).sum();
    let wall = stats.iter().map(|s| s.wall_s).fold(0.0, f64::max);
    Ok(StageResult {
        stage: stage.name,
        wait_ratio: worst.wait_s / worst.wall_s,
        samples_per_s: samples as f64 / wall,
        data_s_per_batch: worst.wait_s / worst.steps.max(1) as f64,
        workers: workers_measured,
    })
}

/// The demo's autoscaler settings: quick to act (a short demo), same policy as the operator.
fn demo_spec(a: &DemoArgs) -> Spec {
    // A change is measured for three evaluations before the next one.
    let period = Duration::from_secs_f64(a.autoscale_interval_s * 3.0);
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
        .map(|addr| rank_counters(&http_get(addr, "/metrics").ok()?))
        .collect()
}

fn observe(before: &Scrape, after: &Scrape, ready: u32) -> Option<Observation> {
    Observation::between(before, after, ready)
}

/// Runs the autoscaler until the worker count held for 4 evaluations (or the timeout).
fn autoscale_until_settled(
    a: &DemoArgs,
    pool: &mut Pool,
    metrics: &[String],
) -> anyhow::Result<u32> {
    let spec = demo_spec(a);
    let mut scaler = Autoscaler::default();
    let t0 = Instant::now();
    let mut last = scrape(metrics);
    let mut unchanged = 0;
    while unchanged < 4 && t0.elapsed() < Duration::from_secs(a.settle_timeout_s) {
        std::thread::sleep(Duration::from_secs_f64(a.autoscale_interval_s));
        let now = scrape(metrics);
        let obs = observe(&last, &now, pool.workers.len() as u32);
        last = now;
        let current = pool.workers.len() as u32;
        let d = scaler.evaluate(&spec, t0.elapsed(), current, obs);
        if d.replicas != current {
            tracing::info!(
                "autoscaler: {current} -> {} workers: {}",
                d.replicas,
                d.reason
            );
            pool.resize(d.replicas as usize)?;
            unchanged = 0;
        } else {
            unchanged += 1;
        }
    }
    Ok(pool.workers.len() as u32)
}

/// Where a rank gets its batches: straight from its client, or through a coordinator.
enum BatchSource {
    Direct(Box<Loader>),
    /// A coordinator thread owns the client and pickles every batch into a socket.
    Coordinator(UnixStream),
}

impl BatchSource {
    fn new(loader: Loader, handover: Handover) -> anyhow::Result<BatchSource> {
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
    warmup: usize,
    steps: usize,
    measuring: &AtomicBool,
    progress: &indicatif::ProgressBar,
    report: bool,
) -> anyhow::Result<RankStats> {
    let mut stats = RankStats::default();
    let mut warm = 0;
    let mut start = None;
    while stats.steps < steps as u64 {
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
