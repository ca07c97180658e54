//! `stoker-lab bench balance`: how even the ranks' work is per step when a global batch is sliced
//! naively vs assigned by token cost, and how much of a batch is padding, plain vs packed
//! (docs/benchmarks.md). Pure arithmetic over a length distribution; no data is read.
//!
//! The distribution: photographs' sizes (long side uniform in 300–1,600 px, common aspect
//! ratios, either orientation: mean ~0.75 MP, like a set of real photographs), through the
//! preset's smart_resize to vision tokens; a mix of samples — 50 % single-image VQA (20–80
//! text tokens), 20 % single-image long answers (80–400), 15 % multi-image (2–4 images,
//! 40–250), 15 % multi-turn chat (3–8 turns of 40–250 tokens, 70 % with one image). Or a
//! real dataset's lengths (`stoker dataset stats --lengths-out`), drawn with replacement.

use rand::{Rng, SeedableRng};
use stoker_balance::{
    balance, loads, max_over_mean, pack_ranks, padding_packed, padding_plain, slice_evenly,
    CostModel,
};
use stoker_config::PresetName;
use stoker_worker::preprocess::preset::Preset;

const WORLD_SIZES: [usize; 3] = [8, 64, 512];
const ASPECTS: [(u32, u32); 5] = [(1, 1), (4, 3), (3, 2), (16, 9), (2, 1)];

#[derive(clap::Args)]
pub struct BalanceArgs {
    /// Samples per rank per step (global batch = world size x this).
    #[arg(long, default_value_t = 16)]
    samples_per_rank: usize,
    /// Steps (fresh global batches) per world size.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Longest packed sequence, in tokens.
    #[arg(long, default_value_t = 16_384)]
    max_tokens: u64,
    /// Cost model: the length at which attention's quadratic work equals the linear work.
    #[arg(long, default_value_t = CostModel::default().attention_tokens)]
    attention_tokens: u64,
    /// Model preset (its smart_resize turns image sizes into vision tokens).
    #[arg(long, value_enum, default_value_t = PresetName::Qwen2Vl)]
    preset: PresetName,
    /// Draw sample lengths from this JSON array of token counts (`stoker dataset stats
    /// --lengths-out`) instead of the built-in mix.
    #[arg(long)]
    lengths: Option<std::path::PathBuf>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// One JSON object per world size instead of the table.
    #[arg(long)]
    json: bool,
}

/// One world size's figures, averaged over the steps.
#[derive(serde::Serialize)]
struct Row {
    world_size: usize,
    samples_per_rank: usize,
    steps: usize,
    /// Heaviest rank's cost / mean rank's cost: contiguous equal slices.
    naive_max_over_mean: f64,
    /// Same, samples assigned by cost (equal sample counts per rank).
    balanced_max_over_mean: f64,
    /// Same, packed sequences assigned by cost (equal sequence counts per rank).
    packed_max_over_mean: f64,
    /// Padding of plain batches (each rank's batch padded to its longest sample).
    padding_plain: f64,
    /// Padding of packed sequences (each padded to the step's longest sequence).
    padding_packed: f64,
    /// Padding of plain batches from length buckets: all steps' samples as one window,
    /// sorted by length and cut into global batches, each sliced over ranks.
    padding_bucketed: f64,
    /// Sequences per rank per step (packed).
    sequences_per_rank: f64,
    /// Simulated synchronous step time (the heaviest rank's cost), naive over balanced.
    step_time_naive_over_balanced: f64,
    /// Same, naive over packed.
    step_time_naive_over_packed: f64,
}

pub fn run(a: BalanceArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.samples_per_rank > 0 && a.steps > 0,
        "--samples-per-rank and --steps must be > 0"
    );
    let preset = Preset::new(a.preset);
    let model = CostModel {
        attention_tokens: a.attention_tokens,
    };
    let measured: Option<Vec<u64>> = match &a.lengths {
        Some(path) => Some(serde_json::from_slice(&std::fs::read(path)?)?),
        None => None,
    };
    anyhow::ensure!(
        measured.as_ref().is_none_or(|v| !v.is_empty()),
        "--lengths holds no lengths"
    );
    let draw = |rng: &mut rand_chacha::ChaCha8Rng| match &measured {
        Some(v) => Ok(v[rng.gen_range(0..v.len())]),
        None => sample_tokens(rng, &preset),
    };
    let rows: Vec<Row> = WORLD_SIZES
        .iter()
        .map(|&w| world(&a, &draw, model, w))
        .collect::<anyhow::Result<_>>()?;
    if a.json {
        for r in &rows {
            println!("{}", serde_json::to_string(r)?);
        }
    } else {
        print_table(&a, &rows);
    }
    Ok(())
}

/// A sample's length in tokens, drawn from the benchmark's distribution.
type Draw<'a> = dyn Fn(&mut rand_chacha::ChaCha8Rng) -> anyhow::Result<u64> + 'a;

fn world(a: &BalanceArgs, draw: &Draw, model: CostModel, w: usize) -> anyhow::Result<Row> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(a.seed ^ (w as u64) << 32);
    let n = w * a.samples_per_rank;
    let mut sums = [0.0f64; 6];
    let (mut naive_steps, mut balanced_steps, mut packed_steps) = (0u64, 0u64, 0u64);
    let mut window = Vec::with_capacity(n * a.steps);
    for _ in 0..a.steps {
        let lengths: Vec<u64> = (0..n)
            .map(|_| draw(&mut rng))
            .collect::<anyhow::Result<_>>()?;
        let lengths: Vec<u64> = lengths.into_iter().map(|l| l.min(a.max_tokens)).collect();
        window.extend_from_slice(&lengths);
        let costs: Vec<u64> = lengths.iter().map(|&l| model.cost(l)).collect();
        let naive = slice_evenly(n, w);
        let balanced = balance(&costs, w, Some(&vec![a.samples_per_rank; w]));
        let packed = pack_ranks(&lengths, &costs, w, a.max_tokens);
        let packed_ranks: Vec<Vec<usize>> = packed.iter().map(|r| r.concat()).collect();
        let heaviest = |groups: &[Vec<usize>]| loads(&costs, groups).into_iter().max().unwrap_or(0);
        naive_steps += heaviest(&naive);
        balanced_steps += heaviest(&balanced);
        packed_steps += heaviest(&packed_ranks);
        sums[0] += max_over_mean(&costs, &naive);
        sums[1] += max_over_mean(&costs, &balanced);
        sums[2] += max_over_mean(&costs, &packed_ranks);
        sums[3] += padding_plain(&lengths, &naive);
        sums[4] += padding_packed(&lengths, &packed.concat());
        sums[5] += packed[0].len() as f64;
    }
    let mean = |i: usize| sums[i] / a.steps as f64;
    window.sort_unstable();
    let padding_bucketed = window
        .chunks(n)
        .map(|batch| padding_plain(batch, &slice_evenly(n, w)))
        .sum::<f64>()
        / a.steps as f64;
    Ok(Row {
        world_size: w,
        samples_per_rank: a.samples_per_rank,
        steps: a.steps,
        naive_max_over_mean: mean(0),
        balanced_max_over_mean: mean(1),
        packed_max_over_mean: mean(2),
        padding_plain: mean(3),
        padding_packed: mean(4),
        padding_bucketed,
        sequences_per_rank: mean(5),
        step_time_naive_over_balanced: naive_steps as f64 / balanced_steps as f64,
        step_time_naive_over_packed: naive_steps as f64 / packed_steps as f64,
    })
}

/// One sample of the mix (module docs): its sequence length in tokens.
fn sample_tokens(rng: &mut impl Rng, preset: &Preset) -> anyhow::Result<u64> {
    let kind = rng.gen_range(0..100);
    let (images, text) = match kind {
        0..50 => (1, rng.gen_range(20..=80)),
        50..70 => (1, rng.gen_range(80..=400)),
        70..85 => (rng.gen_range(2..=4), rng.gen_range(40..=250)),
        _ => {
            let turns = rng.gen_range(3..=8);
            let text = (0..turns).map(|_| rng.gen_range(40..=250)).sum();
            (u32::from(rng.gen_bool(0.7)), text)
        }
    };
    let mut tokens = text;
    for _ in 0..images {
        tokens += image_tokens(rng, preset)?;
    }
    Ok(tokens)
}

/// A photograph's vision tokens: its size through smart_resize, one token per merged patch,
/// plus the vision start/end tokens.
fn image_tokens(rng: &mut impl Rng, preset: &Preset) -> anyhow::Result<u64> {
    let (a, b) = ASPECTS[rng.gen_range(0..ASPECTS.len())];
    let long = rng.gen_range(300..=1600u32);
    let short = (long * b / a).max(1);
    let (h, w) = if rng.gen_bool(0.5) {
        (long, short)
    } else {
        (short, long)
    };
    // The image's tokens plus its vision start and end tokens.
    Ok(preset.image_tokens(preset.resized((h, w))?) as u64 + 2)
}

fn print_table(a: &BalanceArgs, rows: &[Row]) {
    let lengths = a
        .lengths
        .as_ref()
        .map_or("the built-in mix".to_string(), |p| p.display().to_string());
    println!(
        "Rank balance, lengths from {lengths}, {} preset, {} samples per rank, {} steps, packed sequences <= {} tokens, cost = tokens + tokens^2/{}",
        a.preset.as_str(),
        a.samples_per_rank,
        a.steps,
        a.max_tokens,
        a.attention_tokens
    );
    println!(
        "{:>6} {:>14} {:>14} {:>12} {:>14} {:>15} {:>17} {:>9} {:>17} {:>15}",
        "world",
        "naive max/mean",
        "balanced",
        "packed",
        "padding plain",
        "padding packed",
        "padding bucketed",
        "seq/rank",
        "step naive/bal",
        "step naive/pack"
    );
    for r in rows {
        println!(
            "{:>6} {:>14.3} {:>14.3} {:>12.3} {:>13.1}% {:>14.1}% {:>16.1}% {:>9.1} {:>16.2}x {:>14.2}x",
            r.world_size,
            r.naive_max_over_mean,
            r.balanced_max_over_mean,
            r.packed_max_over_mean,
            100.0 * r.padding_plain,
            100.0 * r.padding_packed,
            100.0 * r.padding_bucketed,
            r.sequences_per_rank,
            r.step_time_naive_over_balanced,
            r.step_time_naive_over_packed
        );
    }
}
