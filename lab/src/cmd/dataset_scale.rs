//! `stoker-lab bench dataset-scale`: what indexing a large text dataset and starting a worker on
//! it cost — time, peak memory and (behind the embedded S3 server) store requests — for this
//! binary and, side by side, a baseline binary (e.g. the previous release). The dataset is
//! text-only shards whose lines reference a few hundred images, generated once and reused.
//!
//! `--serve` then reads with one rank across two epoch boundaries (resumed a few batches
//! before each end): the worker holds its index, the epochs' orders it caches, and with
//! `--lengths` the samples' lengths (a synthetic `stoker-lengths.bin` for the worker's
//! preprocessing, written without tokenizing 10^7 samples) for `--bucket-by-length`; its
//! peak resident memory (VmHWM) after that is the figure the memory formula of docs/design.md
//! is checked against.
//!
//! `--read` instead has `--ranks` ranks read `--read-batches` global batches each from an
//! epoch's start (a worker that is every rank's home, as each worker is for its ranks at
//! scale) and counts what reading the samples' text cost: store requests per sample beyond
//! the one GET of its image (the S3 server's count) and bytes per sample beyond the image
//! (the worker's read bytes), with `--line-cache-mib` set to what the default cache is to the
//! text at 10^8 samples.

use super::bench::{peak_rss_mib, status_mib};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use stoker_config::WorkerConfig;
use stoker_testkit::embedded_s3::EmbeddedS3;
use stoker_testkit::local_worker::LocalWorker;

#[derive(clap::Args)]
pub struct DatasetScaleArgs {
    /// Samples (JSONL lines) in the dataset.
    #[arg(long, default_value_t = 10_000_000)]
    samples: u64,
    #[arg(long, default_value_t = 100_000)]
    samples_per_shard: u64,
    /// Image objects the lines reference (each line one of them).
    #[arg(long, default_value_t = 300)]
    images: u64,
    /// Another `stoker` binary measured the same way, first (a before/after table).
    #[arg(long)]
    baseline: Option<PathBuf>,
    /// Where the dataset is generated [default: $STOKER_CACHE/bench/text-SAMPLES].
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Measure behind the embedded S3 server only (skip the local folder).
    #[arg(long)]
    s3_only: bool,
    /// Once ready, read across two epoch boundaries and measure the worker's memory.
    #[arg(long)]
    serve: bool,
    /// Give the worker samples' lengths and `--bucket-by-length` (with `--serve`).
    #[arg(long)]
    lengths: bool,
    /// The worker's sample order.
    #[arg(long, value_enum, default_value = "shuffle")]
    order: stoker_config::SampleOrder,
    /// Lines per run with `--order runs`.
    #[arg(long, default_value_t = stoker_config::DEFAULT_RUN_LINES)]
    run_lines: u32,
    /// Once ready, read with several ranks and count the text's requests and bytes.
    #[arg(long, conflicts_with = "serve")]
    read: bool,
    /// With `--read`: ranks reading, global batches each, and the global batch size.
    #[arg(long, default_value_t = 16)]
    ranks: u32,
    #[arg(long, default_value_t = 256)]
    read_batches: u64,
    #[arg(long, default_value_t = 64)]
    global_batch_size: u32,
    /// The worker's line cache [default: the worker's].
    #[arg(long)]
    line_cache_mib: Option<u64>,
    /// Once indexed, re-upload one shard with a line more before the worker starts (put back
    /// after): what a worker does with an index gone stale.
    #[arg(long)]
    stale_shard: bool,
}

/// One binary's figures on one store.
struct Row {
    binary: String,
    store: &'static str,
    index_s: f64,
    index_peak_mib: f64,
    ready_s: f64,
    ready_peak_mib: f64,
    ready_rss_mib: f64,
    /// Store requests from start to ready (S3 only).
    requests: Option<u64>,
    /// With `--serve`: peak and resident MiB after two epoch boundaries.
    served: Option<(f64, f64)>,
    /// With `--read`: what the samples' text cost.
    read: Option<TextCost>,
}

/// Per sample served, beyond its image: store requests, and bytes read with the bytes of its
/// line (for the ratio).
struct TextCost {
    samples: u64,
    requests_per_sample: f64,
    bytes_per_sample: f64,
    line_bytes_per_sample: f64,
    /// The worker's peak resident MiB after the read (its line cache filled as it reads).
    peak_mib: f64,
}

pub async fn run(a: DatasetScaleArgs) -> anyhow::Result<()> {
    let dir = match &a.dir {
        Some(d) => d.clone(),
        None => stoker_config::cache_root().join(format!("bench/text-{}", a.samples)),
    };
    let data = dir.join("bucket/data");
    generate(&data, &a)?;
    let this = super::local::product_binary()?;
    let mut binaries: Vec<(String, PathBuf)> = Vec::new();
    if let Some(b) = &a.baseline {
        binaries.push(("baseline".into(), b.clone()));
    }
    binaries.push(("this".into(), this));
    let s3 = EmbeddedS3::start(&dir, "127.0.0.1:0", Duration::ZERO).await?;
    let mut rows = Vec::new();
    for (name, exe) in &binaries {
        if !a.s3_only {
            let uri = data.display().to_string();
            rows.push(measure(name, exe, "local", &uri, &[], None, &a, &data).await?);
        }
        let s3_uri = "s3://bucket/data";
        rows.push(measure(name, exe, "s3", s3_uri, &s3.env(), Some(&s3), &a, &data).await?);
    }
    println!(
        "\n{} samples in {} shards, {} images",
        a.samples,
        a.samples.div_ceil(a.samples_per_shard),
        a.images
    );
    println!(
        "{:<9} {:<6} {:>9} {:>11} {:>12} {:>9} {:>14} {:>13} {:>9} {:>15} {:>14}",
        "binary",
        "store",
        "index s",
        "lines/s",
        "index MiB",
        "ready s",
        "ready peak MiB",
        "ready RSS MiB",
        "requests",
        "served peak MiB",
        "served RSS MiB"
    );
    for r in &rows {
        let (peak, rss) = r.served.map_or(("-".into(), "-".into()), |(p, r)| {
            (format!("{p:.0}"), format!("{r:.0}"))
        });
        println!(
            "{:<9} {:<6} {:>9.1} {:>11.0} {:>12.0} {:>9.2} {:>14.0} {:>13.0} {:>9} {:>15} {:>14}",
            r.binary,
            r.store,
            r.index_s,
            a.samples as f64 / r.index_s,
            r.index_peak_mib,
            r.ready_s,
            r.ready_peak_mib,
            r.ready_rss_mib,
            r.requests.map_or("-".into(), |n| n.to_string()),
            peak,
            rss
        );
    }
    if a.stale_shard {
        println!("ready: with one of the shards re-uploaded (a line more) after indexing");
    }
    if a.read {
        println!(
            "\nread: {} ranks x {} global batches of {} from an epoch's start, order {}{}, \
             line cache {}",
            a.ranks,
            a.read_batches,
            a.global_batch_size,
            a.order.as_str(),
            match a.order {
                stoker_config::SampleOrder::Runs => format!(" ({} lines)", a.run_lines),
                _ => String::new(),
            },
            a.line_cache_mib
                .map_or("the default".into(), |m| format!("{m} MiB"))
        );
        println!(
            "{:<9} {:<6} {:>9} {:>22} {:>19} {:>16} {:>10}",
            "binary",
            "store",
            "samples",
            "text requests/sample",
            "text bytes/sample",
            "x line bytes",
            "peak MiB"
        );
        for r in &rows {
            if let Some(t) = &r.read {
                println!(
                    "{:<9} {:<6} {:>9} {:>22.4} {:>19.0} {:>16.2} {:>10.0}",
                    r.binary,
                    r.store,
                    t.samples,
                    t.requests_per_sample,
                    t.bytes_per_sample,
                    t.bytes_per_sample / t.line_bytes_per_sample,
                    t.peak_mib
                );
            }
        }
    }
    if a.serve {
        println!(
            "served: one rank from 4 batches before the end of epochs 0 and 1 to 4 batches into \
             the next; order {:?}{}",
            a.order,
            if a.lengths {
                ", --bucket-by-length"
            } else {
                ""
            }
        );
    }
    Ok(())
}

/// Indexes the dataset with `exe`, then starts a worker on it and waits until it is ready
/// (and with `--serve`, reads across two epoch boundaries). `data`: the dataset's folder,
/// which the S3 server serves too.
#[allow(clippy::too_many_arguments)]
async fn measure(
    binary: &str,
    exe: &Path,
    store: &'static str,
    uri: &str,
    env: &[(&'static str, String)],
    s3: Option<&EmbeddedS3>,
    a: &DatasetScaleArgs,
    data: &Path,
) -> anyhow::Result<Row> {
    eprintln!("{binary} on {store}: indexing {uri}");
    let mut index = Command::new(exe);
    index
        .args(["dataset", "index", uri, "--allow-bad"])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(std::process::Stdio::null());
    let (index_s, index_peak_kib) = run_measured(index)?;
    eprintln!("{binary} on {store}: starting a worker");
    let mut config = WorkerConfig {
        data: uri.into(),
        ..WorkerConfig::default()
    };
    config.serving.insecure_plaintext = true;
    config.sampling.order = a.order;
    config.sampling.run_lines = a.run_lines;
    if a.read {
        config.sampling.global_batch_size = a.global_batch_size;
    }
    if let Some(mib) = a.line_cache_mib {
        config.concurrency.line_cache_mib = mib;
    }
    if a.lengths {
        write_synthetic_lengths(data).await?;
        config.sampling.bucket_by_length = true;
    }
    let stale = match a.stale_shard {
        true => Some(StaleShard::make(data)?),
        false => None,
    };
    let before = s3.map(EmbeddedS3::requests_received);
    let t = Instant::now();
    let worker = tokio::task::spawn_blocking({
        let (exe, mut env) = (exe.to_path_buf(), env.to_vec());
        env.push(("STOKER_TOKEN", "bench".into()));
        move || -> anyhow::Result<LocalWorker> {
            let w = LocalWorker::spawn(&exe, &config, &env)?;
            w.wait_ready(Duration::from_secs(3600))?;
            Ok(w)
        }
    })
    .await??;
    let ready_s = t.elapsed().as_secs_f64();
    let requests = s3.zip(before).map(|(s, b)| s.requests_received() - b);
    drop(stale);
    let ready = memory_mib(worker.pid())?;
    let served = match a.serve {
        false => None,
        true => {
            eprintln!("{binary} on {store}: reading across two epoch boundaries");
            let addr = worker.addr.clone();
            tokio::task::spawn_blocking(move || across_epochs(&addr)).await??;
            Some(memory_mib(worker.pid())?)
        }
    };
    let read = match (a.read, s3) {
        (true, Some(s3)) => {
            eprintln!("{binary} on {store}: reading with {} ranks", a.ranks);
            Some(read_text(&worker, s3, a, data).await?)
        }
        _ => None,
    };
    Ok(Row {
        read,
        binary: binary.into(),
        store,
        index_s,
        index_peak_mib: index_peak_kib / 1024.0,
        ready_s,
        ready_peak_mib: ready.0,
        ready_rss_mib: ready.1,
        requests,
        served,
    })
}

/// The first shard, re-uploaded with its first line once more at its end.
struct StaleShard {
    path: PathBuf,
    len: u64,
}

impl StaleShard {
    fn make(data: &Path) -> anyhow::Result<StaleShard> {
        let path = data.join("shard-00000.jsonl");
        let len = std::fs::metadata(&path)?.len();
        let first = std::io::BufRead::lines(std::io::BufReader::new(std::fs::File::open(&path)?))
            .next()
            .ok_or_else(|| anyhow::anyhow!("{} is empty", path.display()))??;
        let mut f = std::fs::OpenOptions::new().append(true).open(&path)?;
        writeln!(f, "{first}")?;
        Ok(StaleShard { path, len })
    }
}

impl Drop for StaleShard {
    /// The shard as it was (the generated dataset is reused), whatever happened.
    fn drop(&mut self) {
        let file = std::fs::OpenOptions::new().write(true).open(&self.path);
        if let Err(e) = file.and_then(|f| f.set_len(self.len)) {
            eprintln!("putting {} back: {e}", self.path.display());
        }
    }
}

/// A process's peak and current resident MiB (VmHWM, VmRSS).
fn memory_mib(pid: u32) -> anyhow::Result<(f64, f64)> {
    Ok((peak_rss_mib(pid)?, status_mib(pid, "VmRSS")?))
}

/// One rank reads the last 4 batches of epochs 0 and 1 and the first 4 of the next: the
/// worker builds (or computes) three epochs' orders, each next one ahead of its boundary.
fn across_epochs(addr: &str) -> anyhow::Result<()> {
    use stoker_client::{Dial, Discovery, Loader, LoaderConfig, LoaderState};
    let mut cfg = LoaderConfig::new(Discovery::parse(addr)?, 0, 1);
    cfg.dial = Some(Dial::InsecurePlaintext);
    cfg.token = "bench".into();
    let mut loader = Loader::new(cfg)?;
    let (plan_id, bpe) = (loader.plan().plan_id, loader.plan().batches_per_epoch);
    for epoch in 0..2 {
        let next_batch = bpe.saturating_sub(4);
        loader.load_state(LoaderState {
            plan_id,
            epoch,
            next_batch,
        })?;
        let mut batches = 0;
        while batches < 8 {
            if loader.next_batch()?.is_some() {
                batches += 1;
            }
        }
    }
    Ok(())
}

/// `--read`: every rank reads `read_batches` global batches from epoch 0's start; what the
/// store served beyond one GET and the bytes of one image per sample the worker served (those
/// the ranks asked ahead included) is the text's cost.
async fn read_text(
    worker: &LocalWorker,
    s3: &EmbeddedS3,
    a: &DatasetScaleArgs,
    data: &Path,
) -> anyhow::Result<TextCost> {
    use stoker_client::{Dial, Discovery, Loader, LoaderConfig};
    use stoker_worker::dataset::index::{DatasetIndex, INDEX_KEY};
    let value = |m: &str, name| stoker_control::exposition::metric_value(m, name).unwrap_or(0.0);
    let read_bytes = |m: &str| value(m, "stoker_worker_object_store_read_bytes_total");
    let served = |m: &str| value(m, "stoker_worker_samples_total");
    let metrics = || stoker_testkit::http::get_ok(&worker.metrics_addr, "/metrics");
    let start = metrics()?;
    let requests = s3.requests_received();
    let ranks: Vec<_> = (0..a.ranks)
        .map(|rank| {
            let (addr, world, batches) = (worker.addr.clone(), a.ranks, a.read_batches);
            std::thread::spawn(move || -> anyhow::Result<()> {
                let mut cfg = LoaderConfig::new(Discovery::parse(&addr)?, rank, world);
                cfg.dial = Some(Dial::InsecurePlaintext);
                cfg.token = "bench".into();
                let mut loader = Loader::new(cfg)?;
                let mut read = 0;
                while read < batches {
                    read += u64::from(loader.next_batch()?.is_some());
                }
                Ok(())
            })
        })
        .collect();
    for r in ranks {
        r.join().map_err(|_| anyhow::anyhow!("a rank panicked"))??;
    }
    // What the ranks had asked ahead is finished or cancelled: the worker's figures, with
    // the samples it served (those read ahead included), are whole.
    let mut end = metrics()?;
    while value(&end, "stoker_worker_requests_in_flight") > 0.0 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        end = metrics()?;
    }
    let requests = s3.requests_received() - requests;
    let bytes = read_bytes(&end) - read_bytes(&start);
    let samples = (served(&end) - served(&start)) as u64;
    let index = DatasetIndex::from_bytes(std::fs::read(data.join(INDEX_KEY))?)?;
    let text: u64 = index.shards.iter().map(|s| s.size).sum();
    let n = samples as f64;
    Ok(TextCost {
        samples,
        requests_per_sample: (requests as f64 - n) / n,
        bytes_per_sample: (bytes - n * TINY_PNG.len() as f64) / n,
        line_bytes_per_sample: text as f64 / index.num_samples() as f64,
        peak_mib: peak_rss_mib(worker.pid())?,
    })
}

/// A `stoker-lengths.bin` for the dataset's index as it is now and the default worker's
/// preprocessing: every sample a made-up length (200–4,000 tokens), as if measured.
async fn write_synthetic_lengths(data: &Path) -> anyhow::Result<()> {
    use stoker_worker::dataset::index::{DatasetIndex, INDEX_KEY};
    use stoker_worker::dataset::lengths::{SampleLengths, LENGTHS_KEY};
    let index = DatasetIndex::from_bytes(std::fs::read(data.join(INDEX_KEY))?)?;
    let config = WorkerConfig {
        data: data.display().to_string(),
        ..WorkerConfig::default()
    };
    let metrics = stoker_worker::metrics::Metrics::new();
    let p = stoker_worker::open::open_pipeline(&config, metrics).await?;
    let lengths = SampleLengths {
        index_version: index.version,
        preprocessing: stoker_worker::identity::preprocessing_id(&p.config, p.text.fingerprint),
        tokens: super::epoch_boundary::synthetic_lengths(index.num_samples()).into(),
    };
    std::fs::write(data.join(LENGTHS_KEY), lengths.to_bytes())?;
    Ok(())
}

/// Runs a command to its end: wall seconds and its peak resident KiB (from `wait4`).
fn run_measured(mut cmd: Command) -> anyhow::Result<(f64, f64)> {
    let t = Instant::now();
    let child = cmd.spawn()?;
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: a plain wait4 on our own child, with valid out-pointers; `child` is not waited
    // on elsewhere (std's Child does not reap on drop).
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    anyhow::ensure!(r == pid, "wait4: {}", std::io::Error::last_os_error());
    anyhow::ensure!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{cmd:?} failed (status {status})"
    );
    Ok((t.elapsed().as_secs_f64(), usage.ru_maxrss as f64))
}

/// Writes the dataset unless it is there: shards of llava-style lines, each referencing one
/// of the images (a tiny PNG each; nothing decodes them here).
fn generate(data: &Path, a: &DatasetScaleArgs) -> anyhow::Result<()> {
    let done = data.join(".complete");
    let want = format!("{} {} {}", a.samples, a.samples_per_shard, a.images);
    if std::fs::read_to_string(&done).ok().as_deref() == Some(want.as_str()) {
        return Ok(());
    }
    if data.exists() {
        std::fs::remove_dir_all(data)?;
    }
    std::fs::create_dir_all(data.join("images"))?;
    eprintln!("generating {} samples in {}", a.samples, data.display());
    for i in 0..a.images {
        std::fs::write(data.join(format!("images/{i:05}.png")), TINY_PNG)?;
    }
    let shards = a.samples.div_ceil(a.samples_per_shard);
    for s in 0..shards {
        let path = data.join(format!("shard-{s:05}.jsonl"));
        let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
        let first = s * a.samples_per_shard;
        for id in first..(first + a.samples_per_shard).min(a.samples) {
            writeln!(
                out,
                r#"{{"id":{id},"image":"images/{:05}.png","conversations":[{{"from":"human","value":"<image>\nWhat is in picture {id}?"}},{{"from":"gpt","value":"A small square, number {id}, on a plain background."}}]}}"#,
                id % a.images
            )?;
        }
        out.flush()?;
    }
    std::fs::write(done, want)?;
    Ok(())
}

/// A 1x1 grey PNG.
const TINY_PNG: &[u8] = &[
    0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x48, 0x44, 0x52,
    0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01, 0x08, 0x00, 0x00, 0x00, 0x00, 0x3a, 0x7e, 0x9b,
    0x55, 0x00, 0x00, 0x00, 0x0a, 0x49, 0x44, 0x41, 0x54, 0x08, 0xd7, 0x63, 0x68, 0x00, 0x00, 0x00,
    0x82, 0x00, 0x81, 0xdd, 0x43, 0x6a, 0xf4, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45, 0x4e, 0x44, 0xae,
    0x42, 0x60, 0x82,
];
