//! `stoker-lab bench store`: how long a worker's read of one image takes, through the worker's
//! own store (aws-sdk-s3 with its retries, then the worker's) on the embedded S3 server, at the
//! concurrency a worker reads with; then the same with every n-th request answered 503
//! SlowDown, beside what the simulator's model of those retries predicts from the first
//! distribution. `--write-store-profile` saves the first as the profile `stoker-lab bench
//! scale` draws its reads from.

use super::local::ensure_dataset;
use super::scale::store::{retry_pause, StoreProfile};
use rand::{Rng, SeedableRng};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use stoker_testkit::embedded_s3::{EmbeddedS3, Faults, StoreBehaviour};
use stoker_testkit::synth::{SynthFormat, SynthOptions};
use stoker_worker::source::{ReadCap, Store};

#[derive(clap::Args)]
pub struct StoreArgs {
    /// Samples of the benchmark dataset whose images are read (generated once, cached).
    #[arg(long, default_value_t = 500)]
    samples: usize,
    /// Reads in each run.
    #[arg(long, default_value_t = 4000)]
    reads: usize,
    /// Reads in flight at once: a worker's sample budget (8 per preprocessing thread, at
    /// least 32).
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// The throttled run: every n-th request is answered 503 SlowDown (0: no such run).
    #[arg(long, default_value_t = 4)]
    slow_down_every: u64,
    /// Write the unthrottled reads' times here (JSON): the profile of `bench scale
    /// --store-profile`.
    #[arg(long)]
    write_store_profile: Option<PathBuf>,
    /// Where the dataset is cached [default: $STOKER_CACHE/bench/store-SAMPLES].
    #[arg(long)]
    dir: Option<PathBuf>,
}

pub async fn run(a: StoreArgs) -> anyhow::Result<()> {
    let dir = match &a.dir {
        Some(d) => d.clone(),
        None => stoker_config::cache_root().join(format!("bench/store-{}", a.samples)),
    };
    let data = dir.join("bucket/data");
    let synth = SynthOptions {
        samples: a.samples,
        format: SynthFormat::Llava,
        ..SynthOptions::default()
    };
    ensure_dataset(&data, &synth)?;
    let mut keys: Vec<String> = Vec::new();
    for entry in std::fs::read_dir(data.join("images"))? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        keys.push(format!("images/{name}"));
    }
    keys.sort();
    anyhow::ensure!(!keys.is_empty(), "no images under {}", data.display());

    let plain = reads(&dir, &a, &keys, Faults::default()).await?;
    println!(
        "{} reads of {} images, {} at once, through the worker's store on the embedded S3 server:",
        a.reads,
        keys.len(),
        a.concurrency
    );
    println!(
        "{:>34} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "", "mean ms", "p50", "p90", "p99", "max"
    );
    print_row("unthrottled", &plain);
    if let Some(path) = &a.write_store_profile {
        let profile = StoreProfile {
            what: format!(
                "seconds per image read through the worker's store (aws-sdk-s3) on the embedded \
                 S3 server, {} reads of {} images of the benchmark dataset, {} at once \
                 (`stoker-lab bench store`)",
                a.reads,
                keys.len(),
                a.concurrency
            ),
            // Microseconds are plenty, and keep the embedded profile small.
            per_get_s: plain.iter().map(|t| (t * 1e6).round() / 1e6).collect(),
        };
        std::fs::write(path, serde_json::to_string_pretty(&profile)? + "\n")?;
        println!("store profile written to {}", path.display());
    }
    if a.slow_down_every > 0 {
        let faults = Faults {
            every_nth_slow_down: a.slow_down_every,
            ..Faults::default()
        };
        let throttled = reads(&dir, &a, &keys, faults).await?;
        print_row(
            &format!("1 in {} answered 503, measured", a.slow_down_every),
            &throttled,
        );
        let modelled = model(&plain, 1.0 / a.slow_down_every as f64, a.reads);
        print_row("the same, the simulator's model", &modelled);
    }
    Ok(())
}

/// Reads `a.reads` images, `a.concurrency` at a time, from a fresh server: each read's time.
async fn reads(
    dir: &std::path::Path,
    a: &StoreArgs,
    keys: &[String],
    faults: Faults,
) -> anyhow::Result<Vec<f64>> {
    let behaviour = StoreBehaviour {
        faults,
        ..StoreBehaviour::default()
    };
    let s3 = EmbeddedS3::start_with(dir, "127.0.0.1:0", behaviour).await?;
    let store = Arc::new(Store::open("s3://bucket/data", &s3.s3_options()).await?);
    let cap = ReadCap {
        bytes: 64 << 20,
        name: "the benchmark's 64 MiB cap",
    };
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..a.concurrency.max(1) {
        let (store, next, keys) = (store.clone(), next.clone(), keys.to_vec());
        let total = a.reads;
        tasks.push(tokio::spawn(async move {
            let mut times = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= total {
                    return Ok::<_, anyhow::Error>(times);
                }
                let t = Instant::now();
                store.get_at_most(&keys[i % keys.len()], cap).await?;
                times.push(t.elapsed().as_secs_f64());
            }
        }));
    }
    let mut times = Vec::new();
    for t in tasks {
        times.extend(t.await??);
    }
    Ok(times)
}

/// What the simulator makes of reads whose every attempt is throttled with probability `p`:
/// each attempt's time drawn from `plain`, the worker's pauses between them.
fn model(plain: &[f64], p: f64, n: usize) -> Vec<f64> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    (0..n)
        .map(|_| {
            let mut t = 0.0;
            let mut made = 0;
            loop {
                t += plain[rng.gen_range(0..plain.len())];
                made += 1;
                if rng.gen::<f64>() >= p {
                    return t;
                }
                match retry_pause(made, Duration::from_secs_f64(t), &mut rng) {
                    Some(pause) => t += pause.as_secs_f64(),
                    None => return t,
                }
            }
        })
        .collect()
}

fn print_row(name: &str, times: &[f64]) {
    let mut v = times.to_vec();
    v.sort_by(f64::total_cmp);
    let q = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize] * 1e3;
    let mean = v.iter().sum::<f64>() / v.len().max(1) as f64 * 1e3;
    println!(
        "{name:>34} {mean:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
        q(0.5),
        q(0.9),
        q(0.99),
        q(1.0)
    );
}
