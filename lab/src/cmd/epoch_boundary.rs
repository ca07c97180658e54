//! `stoker-lab bench epoch-boundary`: request latency of the worker's plan step across an epoch
//! boundary, and how late a health probe on the same runtime runs, for three ways of getting
//! an epoch's order: built by the first request on a serving thread (`inline`, what workers
//! did before), built on the blocking pool ahead of the boundary (`ahead`, what
//! `Plan::serve_slice` does for `--order shuffle`), and not built at all (`feistel`).
//! Simulated ranks step through the last tenth of epoch 0 and into epoch 1 in lock step.

use std::sync::Arc;
use std::time::{Duration, Instant};
use stoker_worker::plan::{Plan, SampleOrder, Shaping};

#[derive(clap::Args)]
pub struct EpochBoundaryArgs {
    #[arg(long, default_value_t = 10_000_000)]
    samples: u64,
    #[arg(long, default_value_t = 1024)]
    global_batch_size: u32,
    /// Ranks asking for each global batch.
    #[arg(long, default_value_t = 32)]
    ranks: u32,
    /// The trainer's step time (each rank's pause between requests): the last tenth of an
    /// epoch must last longer than a build for it to finish ahead (977 steps of 5 ms here;
    /// real steps are seconds).
    #[arg(long, default_value_t = 5)]
    step_ms: u64,
    /// Global batches of epoch 1 counted as "at the boundary".
    #[arg(long, default_value_t = 8)]
    boundary_batches: u64,
    /// Plain shuffled order (no length bucketing, which makes a build ~3x longer).
    #[arg(long)]
    no_bucketing: bool,
    /// Serving threads of the runtime (a worker has one per core).
    #[arg(long, default_value_t = 2)]
    threads: usize,
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Inline,
    Ahead,
    Feistel,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Inline => "inline (before)",
            Mode::Ahead => "ahead (shuffle)",
            Mode::Feistel => "feistel",
        }
    }
}

/// Made-up lengths of `n` samples, 200–4,000 tokens, spread by a multiplicative hash: a plan's
/// memory and build time do not depend on the values.
pub(super) fn synthetic_lengths(n: u64) -> Vec<u32> {
    (0..n)
        .map(|i| (200 + (i.wrapping_mul(0x9e37_79b9) % 3800)) as u32)
        .collect()
}

pub fn run(a: EpochBoundaryArgs) -> anyhow::Result<()> {
    let lengths = stoker_worker::dataset::le_u32s::LeU32s::from(synthetic_lengths(a.samples));
    println!(
        "{} samples, global batch {}, {} ranks, step {} ms, {}",
        a.samples,
        a.global_batch_size,
        a.ranks,
        a.step_ms,
        if a.no_bucketing {
            "shuffled"
        } else {
            "bucketed by length"
        }
    );
    println!(
        "{:<16} {:>13} {:>13} {:>15} {:>15} {:>15}",
        "order built", "p50 ms", "p99 ms", "boundary p99", "boundary max", "probe late max"
    );
    for mode in [Mode::Inline, Mode::Ahead, Mode::Feistel] {
        let mut plan = Plan::new(a.samples, a.global_batch_size, 7);
        if mode == Mode::Feistel {
            plan = plan.with_order(SampleOrder::Feistel);
        }
        if !a.no_bucketing {
            let shaping = Shaping {
                bucket_by_length: true,
                ..Shaping::default()
            };
            plan = plan.with_lengths(lengths.clone(), shaping);
        }
        let plan = Arc::new(plan);
        // A warm worker: epoch 0 was built when it started serving.
        plan.prepare(0);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(a.threads)
            .enable_time()
            .build()?;
        let (elsewhere, boundary, late) = runtime.block_on(measure(plan, mode, &a))?;
        runtime.shutdown_background();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "{:<16} {:>13.3} {:>13.3} {:>15.3} {:>15.3} {:>15.1}",
            mode.name(),
            ms(quantile(&elsewhere, 0.5)),
            ms(quantile(&elsewhere, 0.99)),
            ms(quantile(&boundary, 0.99)),
            ms(quantile(&boundary, 1.0)),
            ms(late)
        );
    }
    Ok(())
}

/// Request latencies away from and at the boundary, and the probe's longest delay.
async fn measure(
    plan: Arc<Plan>,
    mode: Mode,
    a: &EpochBoundaryArgs,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>, Duration)> {
    let n = plan.batches_per_epoch();
    let first = n - n.div_ceil(10) - 1;
    let steps: Vec<(u64, u64)> = (first..n)
        .map(|g| (0, g))
        .chain((0..a.boundary_batches * 4).map(|g| (1, g)))
        .collect();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let probe = tokio::spawn({
        let done = done.clone();
        async move {
            let mut late = Duration::ZERO;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let t = Instant::now();
                tokio::time::sleep(Duration::from_millis(10)).await;
                late = late.max(t.elapsed().saturating_sub(Duration::from_millis(10)));
            }
            late
        }
    });
    let mut ranks = Vec::new();
    for rank in 0..a.ranks {
        let (plan, steps) = (plan.clone(), steps.clone());
        let (world, step, at_boundary) = (a.ranks, a.step_ms, a.boundary_batches);
        ranks.push(tokio::spawn(async move {
            let (mut elsewhere, mut boundary) = (Vec::new(), Vec::new());
            for (epoch, g) in steps {
                let t = Instant::now();
                let slice = match mode {
                    Mode::Inline => plan.rank_slice(epoch, g, rank, world),
                    Mode::Ahead | Mode::Feistel => plan.serve_slice(epoch, g, rank, world).await,
                };
                slice.expect("in range");
                let took = t.elapsed();
                if epoch == 1 && g < at_boundary {
                    boundary.push(took);
                } else {
                    elsewhere.push(took);
                }
                tokio::time::sleep(Duration::from_millis(step)).await;
            }
            (elsewhere, boundary)
        }));
    }
    let (mut elsewhere, mut boundary) = (Vec::new(), Vec::new());
    for r in ranks {
        let (e, b) = r.await?;
        elsewhere.extend(e);
        boundary.extend(b);
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    Ok((elsewhere, boundary, probe.await?))
}

fn quantile(v: &[Duration], q: f64) -> Duration {
    let mut v = v.to_vec();
    v.sort_unstable();
    v.get(((v.len() as f64 - 1.0) * q).round() as usize)
        .copied()
        .unwrap_or_default()
}
