//! `stoker-lab bench …`: benchmarks that print ours-vs-baseline tables (docs/benchmarks.md).
//!
//! Rates are "per core": samples per CPU-second spent by the process (or thread) doing the
//! work, so that runs on a shared, noisy 2-core machine compare like with like.

use super::local::{ensure_dataset, product_binary, spawn_worker};
use super::scale::ServiceProfile;
use clap::Subcommand;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use stoker_client::Dial;
use stoker_config::{cache_root, Preprocessing, Serving, WorkerConfig};
use stoker_testkit::embedded_s3::EmbeddedS3;
use stoker_testkit::http;
use stoker_testkit::local_worker::LocalWorker;
use stoker_testkit::synth::{SynthFormat, SynthOptions};
use stoker_testkit::tls::serve_tls;
use stoker_worker::connection::Connection;
use stoker_worker::dataset::sample::Conversation;
use stoker_worker::preprocess::preset::Preset;
use stoker_worker::preprocess::vision::{process_image, DecodeLimits, ImageTimings, PixelLut};
use stoker_worker::source::resolve_relative;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Full served preprocessing (embedded S3 → worker → TCP) vs transformers in Python, vs
    /// the in-memory decode/resize/patchify ceiling.
    Preprocess(PreprocessBench),
    /// A protocol peer answering every request with one prebuilt batch, for
    /// benches/transport.py (client transport vs plain TCP vs pickling).
    TransportServer(super::transport::TransportServerArgs),
    /// The NIC-bound placement experiment: workers packed vs spread over network-namespace
    /// "nodes" with capped links, and the relay hop (needs root; docs/benchmarks.md).
    Spread(super::spread::SpreadArgs),
    /// Simulated trainer ranks through the real client for a fixed time (used by `spread`).
    Trainer(super::spread::TrainerArgs),
    /// A byte relay in front of workers: the coordinator path (used by `spread`).
    Relay(super::spread::RelayArgs),
    /// The embedded S3 server on its own (used by `spread`).
    S3Server(super::spread::S3ServerArgs),
    /// The autoscaler's rule vs the HPA proportional rule vs one step at a time, on the
    /// simulated plant (stoker-control's sim): convergence, oscillation, worker-hours.
    Autoscale {
        /// Seeds of the plant's noise to run (one row per rule, averaged).
        #[arg(long, default_value_t = 10)]
        seeds: u64,
    },
    /// Token-aware rank balance and packing vs naive slicing and plain batches, on a
    /// realistic length distribution, for world sizes 8, 64 and 512.
    Balance(super::balance::BalanceArgs),
    /// The trainer client's real scheduler at 4,096 ranks × 1,024 workers in virtual time:
    /// bounded links vs the full mesh, fault-free and through a restart, a drain and +25 %.
    Scale(super::scale::ScaleArgs),
    /// A worker's image reads through its store on the embedded S3 server: the latency
    /// distribution `scale` draws its reads from, and the worker's retries under 503s.
    Store(super::store_latency::StoreArgs),
    /// Indexing a large text dataset and starting a worker on it: time, peak memory and
    /// store requests, this binary beside a baseline one.
    DatasetScale(super::dataset_scale::DatasetScaleArgs),
    /// Request latency across an epoch boundary (the plan's order built on the serving
    /// threads, ahead of the boundary off them, or not at all) and the health probes' delay.
    EpochBoundary(super::epoch_boundary::EpochBoundaryArgs),
    /// Crafted images and clips beside normal ones through the worker's decode path: CPU
    /// seconds, peak memory and outcome of each.
    Hostile(super::hostile::HostileArgs),
}

#[derive(clap::Args)]
pub struct PreprocessBench {
    /// Samples in the synthetic dataset (generated once, cached).
    #[arg(long, default_value_t = 2000)]
    samples: usize,
    /// Samples for the Python baselines (they are ~10x slower; their rate is what counts).
    #[arg(long, default_value_t = 300)]
    baseline_samples: usize,
    /// Run only the in-memory ceiling (for profiling the CPU chain).
    #[arg(long)]
    ceiling_only: bool,
    /// Samples for the in-memory ceiling.
    #[arg(long, default_value_t = 500)]
    ceiling_samples: usize,
    /// Write each ceiling sample's time through the CPU chain on one thread to this file
    /// (JSON): the service-time profile `stoker-lab bench scale --service-profile` draws from.
    #[arg(long)]
    write_service_profile: Option<PathBuf>,
    #[arg(long, default_value_t = 32)]
    global_batch_size: u32,
    /// Requests kept in flight by the benchmark's client.
    #[arg(long, default_value_t = 4)]
    depth: usize,
    /// Preprocessing threads of the worker [default: the number of cores].
    #[arg(long)]
    cpu_threads: Option<usize>,
    /// Pin the worker to these CPUs (a `taskset -c` list, e.g. "1") and run the benchmark
    /// itself under `taskset -c 0`: the worker's own per-core rate, away from the embedded
    /// store and the client it shares the machine with otherwise (in a cluster they are
    /// elsewhere). Set --cpu-threads to the number of CPUs given.
    #[arg(long)]
    pin_worker: Option<String>,
    /// Where the dataset is cached [default: $STOKER_CACHE/bench, the cache defaulting to ~/.cache/stoker].
    #[arg(long)]
    cache: Option<PathBuf>,
    /// Serve the batches over TLS (a fresh CA; the worker's certificate for 127.0.0.1), as
    /// in production: the served row's CPU then includes the record layer's.
    #[arg(long)]
    tls: bool,
    /// Python with transformers (as installed by scripts/setup-test-deps.sh).
    #[arg(long)]
    python: Option<PathBuf>,
    /// Clips for the video rows (made with the `ffmpeg` command; 0: no video rows).
    #[arg(long, default_value_t = 24)]
    clips: usize,
    /// Clips for the transformers video processor loop.
    #[arg(long, default_value_t = 8)]
    baseline_clips: usize,
    /// Clips per global batch in the video rows.
    #[arg(long, default_value_t = 4)]
    clip_batch_size: u32,
    #[command(flatten)]
    pre: Preprocessing,
}

pub async fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Preprocess(b) => preprocess(b).await,
        BenchCommand::TransportServer(a) => super::transport::run(a).await,
        BenchCommand::Spread(a) => super::spread::run(a).await,
        BenchCommand::Trainer(a) => {
            tokio::task::spawn_blocking(move || super::spread::trainer(a)).await?
        }
        BenchCommand::Relay(a) => super::spread::relay(a).await,
        BenchCommand::S3Server(a) => super::spread::s3_server(a).await,
        BenchCommand::Autoscale { seeds } => {
            autoscale(seeds);
            Ok(())
        }
        BenchCommand::Balance(a) => super::balance::run(a),
        BenchCommand::Hostile(a) => {
            tokio::task::spawn_blocking(move || super::hostile::run(a)).await?
        }
        BenchCommand::DatasetScale(a) => super::dataset_scale::run(a).await,
        BenchCommand::EpochBoundary(a) => {
            tokio::task::spawn_blocking(move || super::epoch_boundary::run(a)).await?
        }
        BenchCommand::Scale(a) => tokio::task::spawn_blocking(move || super::scale::run(a)).await?,
        BenchCommand::Store(a) => super::store_latency::run(a).await,
    }
}

/// CPU seconds (user + system) a process has used, from /proc.
fn process_cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the parenthesized command name; utime and stime are fields 14 and 15.
    let rest = &stat[stat
        .rfind(')')
        .ok_or_else(|| anyhow::anyhow!("bad /proc stat"))?
        + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>()? + f[12].parse::<f64>()?;
    Ok(ticks / 100.0) // USER_HZ is 100 on Linux
}

/// Peak resident memory of a process, in MiB.
pub(super) fn peak_rss_mib(pid: u32) -> anyhow::Result<f64> {
    status_mib(pid, "VmHWM")
}

/// A memory figure (`VmRSS`, `VmHWM`, ...) of a process's `/proc/PID/status`, in MiB.
pub(super) fn status_mib(pid: u32, field: &str) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .ok_or_else(|| anyhow::anyhow!("no {field}"))?
        .trim()
        .trim_end_matches(" kB")
        .parse()?;
    Ok(kb / 1024.0)
}

pub(super) fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into the pointer we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

struct Row {
    name: &'static str,
    samples: usize,
    wall_s: f64,
    cpu_s: f64,
    note: String,
}

impl Row {
    fn per_core(&self) -> f64 {
        self.samples as f64 / self.cpu_s
    }
}

async fn preprocess(b: PreprocessBench) -> anyhow::Result<()> {
    let root = b
        .cache
        .clone()
        .unwrap_or_else(|| cache_root().join("bench"));
    let bucket = format!("preprocess-{}", b.samples);
    let dir = root.join(&bucket);
    let synth = SynthOptions {
        samples: b.samples,
        format: SynthFormat::Llava,
        ..SynthOptions::default()
    };
    ensure_dataset(&dir, &synth)?;
    let tokenizer = stoker_worker::tokenizer_source::local_path(&b.pre)?;

    let in_memory = ceiling_samples(&b, &dir)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (one_thread, per_sample) = ceiling(&b, &in_memory, 1)?;
    if let Some(path) = &b.write_service_profile {
        let profile = ServiceProfile {
            what: format!(
                "seconds per sample, decode + resize + patchify of its images on one thread, \
                 {} samples of the benchmark dataset (`stoker-lab bench preprocess`)",
                per_sample.len()
            ),
            per_sample_s: per_sample,
        };
        std::fs::write(path, serde_json::to_string_pretty(&profile)? + "\n")?;
        println!("service profile written to {}", path.display());
    }
    let ceilings = [one_thread, ceiling(&b, &in_memory, cores)?.0];
    if b.ceiling_only {
        for c in &ceilings {
            println!(
                "{}: {:.1} samples/s per core; {}",
                c.name,
                c.per_core(),
                c.note
            );
        }
        return Ok(());
    }
    let served = served_pipeline(&b, &root, &bucket, b.global_batch_size).await?;
    let python = python_baselines(&b, &dir, &tokenizer).await;

    let [one_thread, all_cores] = ceilings;
    let mut rows = vec![served.0, one_thread, all_cores];
    let mut missing = Vec::new();
    match python {
        Ok(r) => rows.extend(r),
        Err(e) => missing.push(format!("Python baselines not run: {e}")),
    }
    println!();
    println!(
        "Preprocessing, {} preset, {:?} pixel_values, {cores} cores",
        b.pre.preset.as_str(),
        Preset::from_config(&b.pre).pixel_dtype
    );
    println!(
        "{:<44} {:>8} {:>9} {:>10} {:>12}  note",
        "pipeline", "samples", "wall s", "samples/s", "per core"
    );
    for r in &rows {
        println!(
            "{:<44} {:>8} {:>9.2} {:>10.1} {:>12.1}  {}",
            r.name,
            r.samples,
            r.wall_s,
            r.samples as f64 / r.wall_s,
            r.per_core(),
            r.note
        );
    }
    println!(
        "worker peak RSS at default queue depths: {:.0} MiB",
        served.1
    );
    let ours = rows[0].per_core();
    // The served pipeline runs on every core, so its ceiling is the chain on every core too
    // (same cache and memory-bandwidth contention); the 1-thread row shows the contention.
    println!(
        "served / ceiling on all cores (per core): {:.0} %  (target >= 70 %); vs 1 thread: {:.0} %",
        100.0 * ours / rows[2].per_core(),
        100.0 * ours / rows[1].per_core()
    );
    if let Some(a) = rows.iter().find(|r| r.name.starts_with("(a)")) {
        println!(
            "served / (a) transformers loop (per core): {:.1}x  (target >= 5x)",
            ours / a.per_core()
        );
    }
    for m in missing {
        println!("{m}");
    }
    if b.clips > 0 {
        video_rows(&b, &root).await?;
    }
    Ok(())
}

/// The video rows: the same clips served (embedded S3 → worker → TCP) and through
/// transformers' video processor in a Python loop (benches/video_preprocess.py, which makes
/// the clips), per CPU-second.
async fn video_rows(b: &PreprocessBench, root: &Path) -> anyhow::Result<()> {
    let bucket = format!("video-{}", b.clips);
    let preset = b.pre.preset.as_str();
    let out = python_bench(b, "video_preprocess.py", |c| {
        c.arg("--dir")
            .arg(root.join(&bucket))
            .args(["--clips", &b.clips.to_string()])
            .args(["--baseline-clips", &b.baseline_clips.to_string()])
            .args(["--preset", preset, "--baseline-only"]);
    })
    .await?;
    let v: serde_json::Value = serde_json::from_slice(&out)?;
    let baseline = Row {
        name: "transformers video processor + PyAV, loop",
        samples: v["clips"].as_u64().unwrap_or(0) as usize,
        wall_s: v["wall_s"].as_f64().unwrap_or(f64::NAN),
        cpu_s: v["cpu_s"].as_f64().unwrap_or(f64::NAN),
        note: "1 process; every frame decoded (transformers' PyAV way)".into(),
    };
    let (served, _) = served_pipeline(b, root, &bucket, b.clip_batch_size).await?;
    println!();
    println!(
        "Video preprocessing, {preset} preset, clips of 6-8 s (H.264 640x360@30, H.265 \
         480x270@25, VP9 640x360@24)"
    );
    println!(
        "{:<44} {:>8} {:>9} {:>12}  note",
        "pipeline", "clips", "wall s", "clips/CPU-s"
    );
    for r in [&served, &baseline] {
        println!(
            "{:<44} {:>8} {:>9.2} {:>12.2}  {}",
            r.name,
            r.samples,
            r.wall_s,
            r.per_core(),
            r.note
        );
    }
    println!(
        "served / transformers loop (per CPU-second): {:.1}x",
        served.per_core() / baseline.per_core()
    );
    decode_rows(
        &Preset::from_config(&b.pre),
        &root.join(&bucket).join("clips"),
    )
}

/// Decoding alone, one thread, the same clips twice: H.264's unsampled non-reference frames
/// left out (the worker's way) vs every frame up to the last sampled one decoded.
fn decode_rows(preset: &Preset, clips: &Path) -> anyhow::Result<()> {
    use std::collections::BTreeMap;
    use stoker_worker::cancel::Cancel;
    use stoker_worker::preprocess::video::plan_frames;
    use stoker_worker::preprocess::video_decode::{decode, probe, Skipping, VideoLimits};
    #[derive(Default)]
    struct Totals {
        clips: usize,
        frames: u64,
        sampled: usize,
        decoded: [u64; 2],
        again: usize,
        time: [Duration; 2],
    }
    let unbounded = VideoLimits {
        max_side: u32::MAX,
        max_frame_pixels: u64::MAX,
        max_frames: u64::MAX,
    };
    let mut paths: Vec<PathBuf> = std::fs::read_dir(clips)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    paths.sort();
    let mut by_container = BTreeMap::<String, Totals>::new();
    for path in paths {
        let bytes = std::sync::Arc::<[u8]>::from(std::fs::read(&path)?);
        let open = || std::io::Cursor::new(bytes.clone());
        let header = probe(open(), unbounded)?;
        let plan = plan_frames(preset, &header, None, (None, None))?;
        let kind = path.extension().unwrap_or_default().to_string_lossy();
        let t = by_container.entry(kind.into_owned()).or_default();
        t.clips += 1;
        t.frames += header.frames;
        t.sampled += plan.indices.len();
        for (i, skipping) in [Skipping::NonReference, Skipping::Off]
            .into_iter()
            .enumerate()
        {
            let start = Instant::now();
            let never = Cancel::default();
            let stats = decode(
                open,
                &header,
                &plan.indices,
                skipping,
                &never,
                |_, _| Ok(()),
            )?;
            t.time[i] += start.elapsed();
            t.decoded[i] += stats.decoded;
            t.again += usize::from(stats.decoded_again);
        }
    }
    println!();
    println!(
        "Video decoding alone, 1 thread, same clips: H.264's unsampled non-reference frames \
         left out (first) vs every frame up to the last sampled decoded (second)"
    );
    println!(
        "{:<10} {:>5} {:>8} {:>8} {:>9} {:>9} {:>10} {:>10} {:>8}  note",
        "container",
        "clips",
        "frames",
        "sampled",
        "decoded",
        "decoded",
        "ms/clip",
        "ms/clip",
        "speedup"
    );
    for (kind, t) in &by_container {
        let ms = |d: Duration| 1e3 * d.as_secs_f64() / t.clips as f64;
        println!(
            "{:<10} {:>5} {:>8} {:>8} {:>9} {:>9} {:>10.1} {:>10.1} {:>7.2}x  {} decoded again whole",
            kind,
            t.clips,
            t.frames,
            t.sampled,
            t.decoded[0],
            t.decoded[1],
            ms(t.time[0]),
            ms(t.time[1]),
            t.time[1].as_secs_f64() / t.time[0].as_secs_f64(),
            t.again
        );
    }
    Ok(())
}

/// Runs `benches/<script>` with the benchmark's Python, `args` given; its standard output.
async fn python_bench(
    b: &PreprocessBench,
    script: &str,
    args: impl FnOnce(&mut tokio::process::Command),
) -> anyhow::Result<Vec<u8>> {
    let python = b
        .python
        .clone()
        .unwrap_or_else(|| cache_root().join("venv/bin/python"));
    let mut command = tokio::process::Command::new(&python);
    command.arg(repo().join("benches").join(script));
    args(&mut command);
    let out = command
        .env("STOKER_BIN", product_binary()?)
        .stderr(Stdio::inherit())
        .output()
        .await
        .map_err(|e| anyhow::anyhow!("{}: {e}", python.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "benches/{script} exited with {}",
        out.status
    );
    Ok(out.stdout)
}

/// The repository root, where `benches/` lives (this crate is `lab/` inside it).
fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// Ours: an embedded S3 server in this process, `stoker worker` as a child process, and a
/// client here requesting every batch of an epoch. CPU is the worker process's.
async fn served_pipeline(
    b: &PreprocessBench,
    root: &Path,
    bucket: &str,
    global_batch_size: u32,
) -> anyhow::Result<(Row, f64)> {
    let s3 = EmbeddedS3::start(root, "127.0.0.1:0", Duration::ZERO).await?;
    let mut config = WorkerConfig {
        data: format!("s3://{bucket}"),
        preprocessing: b.pre.clone(),
        serving: Serving {
            no_auth: true,
            insecure_plaintext: true,
            ..Serving::default()
        },
        ..WorkerConfig::default()
    };
    config.s3.path_style = true;
    config.sampling.global_batch_size = global_batch_size;
    config.concurrency.cpu_threads = b.cpu_threads;
    let dial = match b.tls {
        true => Dial::Tls(serve_tls(&root.join("tls"), &["127.0.0.1"], &mut config)?),
        false => Dial::InsecurePlaintext,
    };
    let env = s3.env();
    let pin = b.pin_worker.clone();
    let worker = tokio::task::spawn_blocking(move || match pin {
        Some(cpus) => LocalWorker::spawn_pinned(&cpus, &product_binary()?, &config, &env),
        None => spawn_worker(&config, &env),
    })
    .await??;
    let (addr, metrics_addr, pid) = (
        worker.addr.clone(),
        worker.metrics_addr.clone(),
        worker.pid(),
    );
    let mut conn = Connection::open_with(&dial, &addr, "")
        .await?
        .map_err(|e| anyhow::anyhow!("{}", e.message))?;
    let batches = conn.welcome.batches_per_epoch;
    let (t0, c0) = (Instant::now(), process_cpu_seconds(pid)?);
    let requests0 = s3.requests_received();
    let mut next = 0u64;
    let mut samples = 0usize;
    let mut skipped = 0usize;
    // The benchmark's consumer drops each batch at once: one reused buffer keeps its own CPU
    // (which shares this machine with the worker) small.
    let mut payload = Vec::new();
    for done in 0..batches {
        while next < batches && next < done + b.depth as u64 {
            let req = conn.request(next, 0, next, 0, 1);
            conn.send(&req).await?;
            next += 1;
        }
        match conn.recv_into(&mut payload).await? {
            Ok(head) => {
                samples += head.sample_ids.len();
                skipped += head.skipped.len();
            }
            Err(e) => anyhow::bail!("worker error: {}", e.message),
        }
    }
    let (wall, cpu) = (t0.elapsed().as_secs_f64(), process_cpu_seconds(pid)? - c0);
    let requests = s3.requests_received() - requests0;
    let rss = peak_rss_mib(pid)?;
    let stages = stage_means(&metrics_addr)
        .await
        .unwrap_or_else(|e| format!("stage times unavailable: {e}"));
    drop(worker);
    let row = Row {
        name: "stoker: S3 -> worker -> TCP batches",
        samples,
        wall_s: wall,
        cpu_s: cpu,
        note: format!(
            "{batches} batches of {global_batch_size}, depth {}, {}, {skipped} skipped; \
             {requests} S3 requests ({:.2} per sample); {}worker stage means: {stages}",
            b.depth,
            if b.tls { "TLS" } else { "plaintext" },
            requests as f64 / samples.max(1) as f64,
            match &b.pin_worker {
                Some(cpus) => format!("worker pinned to CPU {cpus}; "),
                None => String::new(),
            }
        ),
    };
    Ok((row, rss))
}

/// Mean time per observation of each stage, from the worker's own histograms (wall time
/// inside the worker, so it shows where a sample's latency goes).
async fn stage_means(metrics_addr: &str) -> anyhow::Result<String> {
    let addr = metrics_addr.to_string();
    let text = tokio::task::spawn_blocking(move || http::get_ok(&addr, "/metrics")).await??;
    // Found by label, whatever else the series carries (the `pipeline` label comes first).
    let value = |suffix: &str, stage: &str| {
        let name = format!("stoker_worker_stage_seconds_{suffix}");
        stoker_control::exposition::metric_value_with(&text, &name, &[("stage", stage)])
    };
    let mut parts = Vec::new();
    for stage in ["fetch", "decode", "resize", "tokenize", "collate", "send"] {
        if let (Some(sum), Some(count)) = (value("sum", stage), value("count", stage)) {
            parts.push(format!("{stage} {:.2} ms", 1e3 * sum / count.max(1.0)));
        }
    }
    Ok(parts.join(", "))
}

/// (c) The ceiling: decode + resize + normalize/patchify of each sample's images from memory,
/// one thread, no IO, no tokenizing, no sending.
/// The images of the first `b.ceiling_samples` samples, read into memory.
fn ceiling_samples(b: &PreprocessBench, dir: &Path) -> anyhow::Result<Vec<Vec<Vec<u8>>>> {
    let mut samples: Vec<Vec<Vec<u8>>> = Vec::new();
    'shards: for shard in std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
        .collect::<std::collections::BTreeSet<_>>()
    {
        let name = shard
            .file_name()
            .expect("file")
            .to_string_lossy()
            .to_string();
        for line in std::fs::read_to_string(&shard)?.lines() {
            let conv = Conversation::parse(line.as_bytes())?;
            let imgs = conv
                .image_paths()
                .map(|p| Ok(std::fs::read(dir.join(resolve_relative(&name, p)?))?))
                .collect::<anyhow::Result<Vec<_>>>()?;
            samples.push(imgs);
            if samples.len() == b.ceiling_samples {
                break 'shards;
            }
        }
    }
    Ok(samples)
}

/// (c) The ceiling: decode + resize + normalize/patchify of each sample's images from memory,
/// no IO, no tokenizing, no sending, on `threads` threads (each taking every n-th sample).
/// CPU is the sum of those threads' CPU time. Also each sample's wall time, in seconds.
fn ceiling(
    b: &PreprocessBench,
    samples: &[Vec<Vec<u8>>],
    threads: usize,
) -> anyhow::Result<(Row, Vec<f64>)> {
    let preset = Preset::from_config(&b.pre);
    let limits = DecodeLimits::from_config(&b.pre);
    let lut = PixelLut::new(&preset);
    let t0 = Instant::now();
    type ThreadResult = anyhow::Result<(f64, ImageTimings, usize, Vec<f64>)>;
    let per_thread: Vec<ThreadResult> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|k| {
                let (preset, lut) = (&preset, &lut);
                scope.spawn(move || {
                    let c0 = thread_cpu_seconds();
                    let mut timings = ImageTimings::default();
                    let mut images = 0;
                    let mut per_sample = Vec::new();
                    for imgs in samples.iter().skip(k).step_by(threads) {
                        let s0 = Instant::now();
                        for bytes in imgs {
                            process_image(bytes, preset, lut, limits, &mut timings)?;
                            images += 1;
                        }
                        per_sample.push(s0.elapsed().as_secs_f64());
                    }
                    Ok((thread_cpu_seconds() - c0, timings, images, per_sample))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("ceiling thread panicked"))
            .collect()
    });
    let wall_s = t0.elapsed().as_secs_f64();
    let (mut cpu_s, mut t, mut images) = (0.0, ImageTimings::default(), 0usize);
    let mut per_sample = Vec::new();
    for r in per_thread {
        let (c, tt, n, s) = r?;
        per_sample.extend(s);
        cpu_s += c;
        t.decode += tt.decode;
        t.resize += tt.resize;
        t.patchify += tt.patchify;
        images += n;
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3 / images as f64;
    let row = Row {
        name: if threads == 1 {
            "(c) ceiling, 1 thread"
        } else {
            "(c) ceiling, all cores"
        },
        samples: samples.len(),
        wall_s,
        cpu_s,
        note: format!(
            "{threads} thread(s); ms/image: decode {:.2}, resize {:.2}, patchify {:.2}",
            ms(t.decode),
            ms(t.resize),
            ms(t.patchify)
        ),
    };
    Ok((row, per_sample))
}

/// (a) and (b): benches/preprocess_baseline.py with the reference Python stack.
async fn python_baselines(
    b: &PreprocessBench,
    dir: &Path,
    tokenizer: &Path,
) -> anyhow::Result<Vec<Row>> {
    let out = python_bench(b, "preprocess_baseline.py", |c| {
        c.arg("--data")
            .arg(dir)
            .args([
                "--samples",
                &b.baseline_samples.to_string(),
                "--batch",
                &b.global_batch_size.to_string(),
            ])
            .arg("--tokenizer")
            .arg(tokenizer)
            .arg("--template")
            .arg(repo().join("worker/templates/qwen2-vl.jinja"));
    })
    .await?;
    let mut rows = Vec::new();
    for line in String::from_utf8_lossy(&out).lines() {
        let v: serde_json::Value = serde_json::from_str(line)?;
        let mode = v["mode"].as_str().unwrap_or("");
        let name = if mode == "loop" {
            "(a) transformers + PIL, Python loop"
        } else {
            "(b) same in torch DataLoader workers"
        };
        if let Some(why) = v["skipped"].as_str() {
            rows.push(Row {
                name,
                samples: 0,
                wall_s: f64::NAN,
                cpu_s: f64::NAN,
                note: format!("not run: {why}"),
            });
            continue;
        }
        rows.push(Row {
            name,
            samples: v["samples"].as_u64().unwrap_or(0) as usize,
            wall_s: v["wall_s"].as_f64().unwrap_or(f64::NAN),
            cpu_s: v["cpu_s"].as_f64().unwrap_or(f64::NAN),
            note: v
                .get("workers")
                .map(|w| format!("{w} workers"))
                .unwrap_or_else(|| "1 process".into()),
        });
    }
    Ok(rows)
}

/// Prints the three scaling rules side by side on the standard simulated scenario.
fn autoscale(seeds: u64) {
    use stoker_control::autoscale::Spec;
    use stoker_control::sim::{rules, run, standard_scenario};
    let sc = standard_scenario(1);
    println!(
        "Simulated plant: {} ranks x {} samples, workers of {}/s +-{:.0} %, {} interval to start, {} s intervals; demand {:.0} -> {:.0} -> {:.0} samples/s; {} seeds",
        sc.plant.ranks,
        sc.plant.samples_per_rank,
        sc.plant.per_worker_per_s,
        100.0 * sc.plant.noise,
        sc.plant.startup_intervals,
        sc.interval.as_secs(),
        sc.plant.demand(),
        (sc.plant.ranks * sc.plant.samples_per_rank) as f64 / sc.changes[0].1,
        (sc.plant.ranks * sc.plant.samples_per_rank) as f64 / sc.changes[1].1,
        seeds
    );
    println!(
        "{:<36} {:>22} {:>13} {:>13} {:>11} {:>10}",
        "rule", "intervals to optimum", "oscillations", "worker-hours", "mean wait", "final/opt"
    );
    for (rule, name) in rules() {
        // The rules compared at the wait target: the other two know no headroom, so ours runs
        // with as little as they have (the default's 40 % sizes for faults, docs/design.md).
        let spec = Spec {
            rule,
            max_replicas: 32,
            headroom: 0.05,
            ..Spec::default()
        };
        let outs: Vec<_> = (1..=seeds)
            .map(|s| run(&standard_scenario(s), &spec))
            .collect();
        let n = outs.len() as f64;
        let conv: Vec<String> = (0..outs[0].phases.len())
            .map(|p| {
                let v: Vec<usize> = outs.iter().filter_map(|o| o.phases[p].0).collect();
                if v.len() < outs.len() {
                    format!("never({})", outs.len() - v.len())
                } else {
                    format!("{:.1}", v.iter().sum::<usize>() as f64 / n)
                }
            })
            .collect();
        let last = outs[0].phases.last().expect("phases");
        println!(
            "{:<36} {:>22} {:>13.1} {:>13.2} {:>11.3} {:>10}",
            name,
            conv.join(" / "),
            outs.iter().map(|o| o.oscillations as f64).sum::<f64>() / n,
            outs.iter().map(|o| o.worker_hours).sum::<f64>() / n,
            outs.iter().map(|o| o.mean_wait).sum::<f64>() / n,
            format!("{}/{}", last.2, last.1),
        );
    }
}
