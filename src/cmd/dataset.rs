//! `stoker dataset index | inspect | stats` (synthetic datasets: `stoker-lab synth`).

use clap::Subcommand;
use std::path::PathBuf;
use std::sync::Arc;
use stoker_config::{Concurrency, OnError, Preprocessing, S3Connection, Sampling, WorkerConfig};
use stoker_worker::batch::{collate, i64_bytes, Batch};
use stoker_worker::dataset::index::{DatasetIndex, Progress, Shard, INDEX_KEY};
use stoker_worker::dataset::lengths::{SampleLengths, LENGTHS_KEY};
use stoker_worker::dataset::parquet::ColumnRequest;
use stoker_worker::identity::preprocessing_id;
use stoker_worker::metrics::Metrics;
use stoker_worker::open::open_pipeline;
use stoker_worker::pipeline::{Pipeline, SampleShape};
use stoker_worker::preprocess::vision::PixelBuf;
use stoker_worker::source::{MediaRoot, Store};

/// A dataset and how to reach it.
#[derive(clap::Args)]
pub struct DatasetArgs {
    /// s3://bucket/prefix or a local folder.
    uri: String,
    /// Where the samples' media paths resolve when not beside their shards: s3://bucket/prefix
    /// or a local folder (a path that leaves it is a bad line).
    #[arg(long, value_name = "URI")]
    media_root: Option<String>,
    #[command(flatten)]
    s3: S3Connection,
}

#[derive(Subcommand)]
pub enum DatasetCommand {
    /// Build the index (shards, line offsets, counts), validating every line; writes
    /// stoker-index.bin at the dataset root. Exits 1 if any line is bad (use --allow-bad).
    Index {
        #[command(flatten)]
        data: DatasetArgs,
        /// Do not write the index back to the dataset.
        #[arg(long)]
        dry_run: bool,
        /// The shards' file format, checked: every shard must be of it [default: any of
        /// .jsonl, .json and .parquet].
        #[arg(long, value_enum)]
        format: Option<ShardFormat>,
        /// Parquet shards: which column holds the conversation and which the images
        /// (`messages=conversations,images=images`) [default: the columns named messages or
        /// conversations, and images or image].
        #[arg(long, value_name = "ROLE=COLUMN,...")]
        columns: Option<ColumnRequest>,
        /// Exit 0 even when bad lines were found (they are excluded from the plan).
        #[arg(long)]
        allow_bad: bool,
        /// Also measure every sample's length from its text and image headers (no pixel is
        /// decoded) and store them (stoker-lengths.bin) for workers with `--balance-ranks`,
        /// `--bucket-by-length` or `--pack-max-tokens` and these preprocessing flags.
        #[arg(long, conflicts_with = "dry_run")]
        write_lengths: bool,
        #[command(flatten)]
        pre: Preprocessing,
    },
    /// Show what the model will see for one sample: chat text, tokens, image sizes and grids.
    Inspect {
        #[command(flatten)]
        data: DatasetArgs,
        #[arg(long)]
        sample: u64,
        #[command(flatten)]
        pre: Preprocessing,
        /// Write input_ids, labels, pixel_values and image_grid_thw as safetensors:
        /// pixel_values model-ready (float32, normalized as the processor does; with u8 pixels
        /// by the rank's own lookup), or bfloat16 with `--pixel-dtype bf16`.
        #[arg(long)]
        out: Option<PathBuf>,
        /// With u8 pixels: write the wire's u8 `pixel_values` and its `pixel_lut` table
        /// (`[3, 256]` float32) instead of normalizing them.
        #[arg(long, requires = "out")]
        wire_pixels: bool,
    },
    /// The distribution of sequence lengths (tokens per sample, vision tokens, images): each
    /// sample's text through the real tokenizer and template, its images' sizes from their
    /// headers (EXIF orientation applied) through smart_resize — exactly what the model gets,
    /// without decoding a pixel.
    Stats {
        #[command(flatten)]
        data: DatasetArgs,
        /// Run every sample through the whole pipeline instead (decode, resize, patchify): the
        /// same lengths, slower; samples whose pixels fail to decode count as 0 rather than
        /// at their headers' length.
        #[arg(long)]
        decode: bool,
        /// The first N samples [default: all].
        #[arg(long)]
        samples: Option<u64>,
        /// Write every sample's length (tokens) as a JSON array, for `stoker-lab bench balance
        /// --lengths`.
        #[arg(long)]
        lengths_out: Option<PathBuf>,
        /// Store every sample's length at the dataset root (stoker-lengths.bin), for workers
        /// with `--balance-ranks` and these preprocessing flags.
        #[arg(long, conflicts_with = "samples")]
        write_lengths: bool,
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        pre: Preprocessing,
    },
}

/// A shard file format `stoker dataset index --format` checks.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ShardFormat {
    Jsonl,
    Json,
    Parquet,
}

impl ShardFormat {
    fn holds(self, key: &str) -> bool {
        let ext = match self {
            ShardFormat::Jsonl => ".jsonl",
            ShardFormat::Json => ".json",
            ShardFormat::Parquet => ".parquet",
        };
        key.ends_with(ext)
    }
}

fn bar(msg: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(0);
    pb.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} ({eta})")
            .expect("template")
            .progress_chars("=> "),
    );
    pb.set_message(msg.to_string());
    pb
}

/// Shards listed one by one at most; more are summed up per format.
const SHARDS_LISTED: usize = 20;

/// A shard's format as the index report names it: its samples' text format, in a Parquet
/// file or not (`parquet (typed-parts)`).
fn format_label(s: &Shard) -> String {
    match &s.parquet {
        Some(_) => format!("parquet ({})", s.format_name()),
        None => s.format_name().to_string(),
    }
}

/// Each shard's detected format and counts (`format: llava, 1,204 samples, 2 bad lines`; a
/// Parquet shard's rows, row groups and columns too), or for many shards the same per format.
fn print_formats(shards: &[Shard]) {
    if shards.len() <= SHARDS_LISTED {
        for s in shards {
            let layout = match &s.parquet {
                Some(p) => format!(
                    ", {} rows in {} row groups, columns {}",
                    thousands(p.rows()),
                    thousands(p.row_groups.len() as u64),
                    p.columns
                ),
                None => String::new(),
            };
            println!(
                "{}: format: {}{layout}, {} samples, {} bad {}",
                s.key,
                format_label(s),
                thousands(s.samples().into()),
                thousands(s.bad_lines),
                if s.parquet.is_some() { "rows" } else { "lines" },
            );
        }
        return;
    }
    let mut per_format: Vec<(String, u64, u64, u64)> = Vec::new();
    for s in shards {
        let name = format_label(s);
        let at = match per_format.iter().position(|f| f.0 == name) {
            Some(at) => at,
            None => {
                per_format.push((name, 0, 0, 0));
                per_format.len() - 1
            }
        };
        let f = &mut per_format[at];
        (f.1, f.2, f.3) = (f.1 + 1, f.2 + u64::from(s.samples()), f.3 + s.bad_lines);
    }
    for (name, n, samples, bad) in per_format {
        println!(
            "format: {name}, {} shards, {} samples, {} bad lines",
            thousands(n),
            thousands(samples),
            thousands(bad)
        );
    }
}

/// 1204311 → "1,204,311".
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The index build's progress, as a bar of shard bytes.
struct ByteBar(indicatif::ProgressBar);

impl Progress for ByteBar {
    fn total(&self, bytes: u64) {
        self.0.set_length(bytes);
    }
    fn advance(&self, bytes: u64) {
        self.0.inc(bytes);
    }
}

pub async fn run(cmd: DatasetCommand) -> anyhow::Result<()> {
    match cmd {
        DatasetCommand::Index {
            data,
            dry_run,
            format,
            columns,
            allow_bad,
            write_lengths,
            pre,
        } => {
            let store = Store::open(&data.uri, &data.s3).await?;
            let media_root = match &data.media_root {
                Some(m) => Some(MediaRoot::open(m, &data.s3).await?),
                None => None,
            };
            let pb = bar("index");
            pb.set_style(
                indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes}")
                    .expect("template"),
            );
            let bar = ByteBar(pb);
            let columns = columns.unwrap_or_default();
            let idx = DatasetIndex::build_with_columns(&store, media_root.as_ref(), &columns, &bar)
                .await?;
            bar.0.finish_and_clear();
            if let Some(other) = format.and_then(|f| idx.shards.iter().find(|s| !f.holds(&s.key))) {
                anyhow::bail!(
                    "{} is not a {} shard (--format)",
                    other.key,
                    format.map_or("", |f| match f {
                        ShardFormat::Jsonl => "JSONL",
                        ShardFormat::Json => "JSON array",
                        ShardFormat::Parquet => "Parquet",
                    })
                );
            }
            for b in &idx.bad_lines {
                eprintln!("bad line {b}");
            }
            if idx.bad_line_count > idx.bad_lines.len() as u64 {
                eprintln!(
                    "... and {} more bad lines (the first {} are listed)",
                    idx.bad_line_count - idx.bad_lines.len() as u64,
                    idx.bad_lines.len()
                );
            }
            print_formats(&idx.shards);
            println!(
                "{} shards, {} samples, {} bad lines, version {:016x}, {} bytes in memory",
                idx.shards.len(),
                idx.num_samples(),
                idx.bad_line_count,
                idx.version,
                idx.resident_bytes()
            );
            if !dry_run {
                store.put(INDEX_KEY, idx.to_bytes()).await?;
                println!("wrote {}", store.describe(INDEX_KEY));
            }
            if write_lengths {
                let p = open_pipeline(&one_sample_config(data, pre, None), Metrics::new()).await?;
                store_lengths(&p, &sample_lengths(&p, None, false).await).await?;
            }
            if idx.bad_line_count > 0 && !allow_bad {
                anyhow::bail!("{} bad lines (listed above)", idx.bad_line_count);
            }
            Ok(())
        }
        DatasetCommand::Inspect {
            data,
            sample,
            pre,
            out,
            wire_pixels,
        } => {
            let cfg = one_sample_config(data, pre, Some(1));
            inspect(&cfg, sample, out, wire_pixels).await
        }
        DatasetCommand::Stats {
            data,
            decode,
            samples,
            lengths_out,
            write_lengths,
            json,
            pre,
        } => {
            let cfg = one_sample_config(data, pre, None);
            let p = open_pipeline(&cfg, Metrics::new()).await?;
            let by_id = sample_lengths(&p, samples, decode).await;
            let lengths: Vec<&SampleShape> = by_id.iter().flatten().collect();
            if let Some(path) = lengths_out {
                let tokens: Vec<u64> = lengths.iter().map(|l| l.tokens).collect();
                std::fs::write(&path, serde_json::to_vec(&tokens)?)?;
                eprintln!("wrote {} lengths to {}", tokens.len(), path.display());
            }
            if write_lengths {
                store_lengths(&p, &by_id).await?;
            }
            print_stats(&LengthStats::of(&lengths), json)
        }
    }
}

/// A worker configuration for looking at samples one by one (a failing sample is an error).
fn one_sample_config(
    data: DatasetArgs,
    pre: Preprocessing,
    cpu_threads: Option<usize>,
) -> WorkerConfig {
    WorkerConfig {
        data: data.uri,
        media_root: data.media_root,
        s3: data.s3,
        preprocessing: pre,
        sampling: Sampling {
            global_batch_size: 1,
            on_error: OnError::Fail,
            ..Sampling::default()
        },
        concurrency: Concurrency {
            cpu_threads,
            ..Concurrency::default()
        },
        ..WorkerConfig::default()
    }
}

async fn inspect(
    cfg: &WorkerConfig,
    sample: u64,
    out: Option<PathBuf>,
    wire_pixels: bool,
) -> anyhow::Result<()> {
    let mut p = open_pipeline(cfg, Metrics::new()).await?;
    if out.is_some() {
        // Saved with the tensors: each video's sampled frames as decoded.
        Arc::get_mut(&mut p)
            .expect("a pipeline of its own")
            .config
            .keep_decoded_frames = true;
    }
    let (shard, line) = p.index.locate(sample).ok_or_else(|| {
        anyhow::anyhow!(
            "sample {sample} is beyond the {} samples",
            p.index.num_samples()
        )
    })?;
    println!("sample {sample}: {}:{}", shard.key, line.line);
    let s = p.load_sample(sample).await?;
    println!("--- chat text ---\n{}--- end ---", s.text);
    let trained = s.labels.iter().filter(|&&l| l >= 0).count();
    println!(
        "tokens: {} ({} trained){}",
        s.input_ids.len(),
        trained,
        if s.truncated { ", truncated" } else { "" }
    );
    for (i, img) in s.images.iter().enumerate() {
        println!(
            "image {i}: {}x{} (HxW) -> {}x{}, grid_thw {:?}, {} patches, {} tokens",
            img.original.0,
            img.original.1,
            img.resized.0,
            img.resized.1,
            img.grid_thw,
            img.rows,
            img.rows / (p.config.preset.merge_size * p.config.preset.merge_size) as usize
        );
    }
    for (i, v) in s.videos.iter().enumerate() {
        let m = (p.config.preset.merge_size * p.config.preset.merge_size) as usize;
        println!(
            "video {i}: frames {:?}, grid_thw {:?}, {} patches, {} tokens{}",
            v.indices,
            v.grid_thw,
            v.rows,
            v.rows / m,
            match v.timestamps.is_empty() {
                true => String::new(),
                false => format!(", groups at {:?} s", v.timestamps),
            }
        );
    }
    if let Some(path) = out {
        let frames: Vec<(Vec<u8>, [usize; 4], Vec<u8>)> = (s.videos.iter())
            .filter_map(|v| {
                let d = v.decoded.as_ref()?;
                let shape = [d.len(), d[0].height, d[0].width, 3];
                let bytes = d.iter().flat_map(|f| f.data.iter().copied()).collect();
                Some((
                    bytes,
                    shape,
                    i64_bytes(&v.indices.iter().map(|&i| i as i64).collect::<Vec<_>>()),
                ))
            })
            .collect();
        let batch = collate(vec![s], vec![], p.text.pad_id);
        let pixels = SavedPixels::of(&batch.pixel_chunks, &p, p.pixel_lut(), wire_pixels)?;
        let luts = p.video_pixel_lut();
        let videos = SavedPixels::of(&batch.video_chunks, &p, luts, wire_pixels)?;
        write_safetensors(&path, &batch, &pixels, &videos, &frames)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// The `pixel_values` `inspect` saves: model-ready unless the wire's u8 bytes are asked for.
struct SavedPixels {
    dtype: stoker_wire::DType,
    bytes: Vec<u8>,
    columns: usize,
    /// `pixel_lut`'s bytes, saved beside u8 pixels.
    lut: Option<Vec<u8>>,
}

impl SavedPixels {
    fn of(
        chunks: &[PixelBuf],
        p: &Pipeline,
        lut: Option<&[u8]>,
        wire: bool,
    ) -> anyhow::Result<Self> {
        let bytes: Vec<u8> = chunks.iter().flat_map(|c| c.as_bytes()).copied().collect();
        let columns = p.config.preset.patch_dim();
        let dtype = p.pixel_dtype();
        let Some(lut) = lut.filter(|_| !wire) else {
            let lut = lut.map(<[u8]>::to_vec);
            return Ok(SavedPixels {
                dtype,
                bytes,
                columns,
                lut,
            });
        };
        // What the model sees: the rank's own lookup (stoker_client), as a trainer runs it.
        let table: Vec<f32> = lut
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        let table = stoker_client::PixelLut::new(&table)?;
        let mut values = vec![0f32; bytes.len()];
        let out = stoker_client::PixelOut::F32(&mut values);
        stoker_client::normalize_pixels(&bytes, columns, &table, out, 1)?;
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let dtype = stoker_wire::DType::F32;
        Ok(SavedPixels {
            dtype,
            bytes,
            columns,
            lut: None,
        })
    }
}

/// Each video's sampled frames as decoded (`[n, H, W, 3]` u8) and their frame numbers.
type DecodedFrames = (Vec<u8>, [usize; 4], Vec<u8>);

/// One sample's tensors as safetensors (shapes as transformers returns them), and each
/// video's decoded frames (`video_frames_K`, `video_indices_K`).
fn write_safetensors(
    path: &std::path::Path,
    b: &Batch,
    pixels: &SavedPixels,
    videos: &SavedPixels,
    frames: &[DecodedFrames],
) -> anyhow::Result<()> {
    use safetensors::tensor::{Dtype, TensorView};
    let st = |d: stoker_wire::DType| match d {
        stoker_wire::DType::F32 => Dtype::F32,
        stoker_wire::DType::BF16 => Dtype::BF16,
        stoker_wire::DType::U8 => Dtype::U8,
        _ => Dtype::I64,
    };
    let ids = i64_bytes(&b.input_ids);
    let labels = i64_bytes(&b.labels);
    let grid = i64_bytes(&b.image_grid_thw);
    let l = b.seq_len;
    let pixel_shape = vec![b.pixel_rows, pixels.columns];
    let mut tensors = vec![
        ("input_ids", TensorView::new(Dtype::I64, vec![1, l], &ids)?),
        ("labels", TensorView::new(Dtype::I64, vec![1, l], &labels)?),
        (
            "pixel_values",
            TensorView::new(st(pixels.dtype), pixel_shape, &pixels.bytes)?,
        ),
        (
            "image_grid_thw",
            TensorView::new(Dtype::I64, vec![b.image_grid_thw.len() / 3, 3], &grid)?,
        ),
    ];
    if let Some(lut) = &pixels.lut {
        tensors.push(("pixel_lut", TensorView::new(Dtype::F32, vec![3, 256], lut)?));
    }
    let video_grid = i64_bytes(&b.video_grid_thw);
    let seconds: Vec<u8> = (b.second_per_grid_ts.iter())
        .flat_map(|s| s.to_le_bytes())
        .collect();
    let names: Vec<(String, String)> = (0..frames.len())
        .map(|k| (format!("video_frames_{k}"), format!("video_indices_{k}")))
        .collect();
    let mut owned: Vec<(&str, TensorView)> = Vec::new();
    if !b.video_chunks.is_empty() {
        let shape = vec![b.video_rows, videos.columns];
        owned.push((
            "pixel_values_videos",
            TensorView::new(st(videos.dtype), shape, &videos.bytes)?,
        ));
        let n = b.video_grid_thw.len() / 3;
        owned.push((
            "video_grid_thw",
            TensorView::new(Dtype::I64, vec![n, 3], &video_grid)?,
        ));
        owned.push((
            "second_per_grid_ts",
            TensorView::new(Dtype::F32, vec![n], &seconds)?,
        ));
        if let Some(lut) = &videos.lut {
            owned.push((
                "pixel_lut_videos",
                TensorView::new(Dtype::F32, vec![3, 256], lut)?,
            ));
        }
        for ((bytes, shape, indices), (fname, iname)) in frames.iter().zip(&names) {
            owned.push((fname, TensorView::new(Dtype::U8, shape.to_vec(), bytes)?));
            owned.push((
                iname,
                TensorView::new(Dtype::I64, vec![indices.len() / 8], indices)?,
            ));
        }
    }
    tensors.extend(owned);
    safetensors::serialize_to_file(tensors, &None, path)?;
    Ok(())
}

/// Every (or the first `limit`) sample's length, by sample id, from headers or (`decode`)
/// through the whole pipeline (`None` for a sample that fails, reported by name).
async fn sample_lengths(
    p: &Arc<Pipeline>,
    limit: Option<u64>,
    decode: bool,
) -> Vec<Option<SampleShape>> {
    use futures::StreamExt;
    let n = limit.map_or(p.index.num_samples(), |l| l.min(p.index.num_samples()));
    let preset = &p.config.preset;
    let in_flight = 2 * std::thread::available_parallelism().map_or(1, |n| n.get());
    let pb = bar("stats");
    pb.set_length(n);
    let results: Vec<_> = futures::stream::iter(0..n)
        .map(|id| {
            let p = p.clone();
            async move {
                if !decode {
                    return p.measure_sample(id).await;
                }
                p.load_sample(id).await.map(|s| SampleShape {
                    tokens: s.input_ids.len() as u64,
                    vision_tokens: s
                        .images
                        .iter()
                        .map(|i| preset.image_tokens(i.resized) as u64)
                        .sum(),
                    images: s.images.len(),
                    videos: s.videos.len(),
                })
            }
        })
        .buffered(in_flight)
        .inspect(|_| pb.inc(1))
        .collect()
        .await;
    pb.finish_and_clear();
    results
        .into_iter()
        .map(|r| r.inspect_err(|e| eprintln!("left out: {e}")).ok())
        .collect()
}

/// Stores every sample's length (stoker-lengths.bin) with the index version and
/// preprocessing they hold for.
async fn store_lengths(p: &Pipeline, by_id: &[Option<SampleShape>]) -> anyhow::Result<()> {
    let stored = SampleLengths {
        index_version: p.index.version,
        preprocessing: preprocessing_id(&p.config, p.text.fingerprint),
        // A sample that cannot be loaded costs nothing (workers skip it too).
        tokens: by_id
            .iter()
            .map(|l| l.as_ref().map_or(0, |l| l.tokens as u32))
            .collect::<Vec<u32>>()
            .into(),
    };
    p.store.put(LENGTHS_KEY, stored.to_bytes()).await?;
    eprintln!("wrote {}", p.store.describe(LENGTHS_KEY));
    Ok(())
}

/// The distribution `dataset stats` prints.
#[derive(serde::Serialize)]
struct LengthStats {
    samples: usize,
    mean_tokens: f64,
    /// Tokens per sample at the 10th, 50th, 90th and 99th percentile, and the longest.
    p10: u64,
    p50: u64,
    p90: u64,
    p99: u64,
    max: u64,
    /// Share of all tokens that are vision tokens.
    vision_share: f64,
    /// Samples with 0, 1, 2, 3 and 4 or more images.
    images: [usize; 5],
    /// Samples per length range: `[from, below, count]`, ranges doubling from 256 tokens.
    histogram: Vec<[u64; 3]>,
}

impl LengthStats {
    fn of(lengths: &[&SampleShape]) -> LengthStats {
        let mut tokens: Vec<u64> = lengths.iter().map(|l| l.tokens).collect();
        tokens.sort_unstable();
        let at = |q: f64| {
            let i = ((tokens.len() as f64 - 1.0) * q).round() as usize;
            tokens.get(i).copied().unwrap_or(0)
        };
        let total: u64 = tokens.iter().sum();
        let mut images = [0; 5];
        for l in lengths {
            images[l.images.min(4)] += 1;
        }
        let mut histogram = Vec::new();
        let (mut from, mut below) = (0, 256);
        while from <= at(1.0) && !tokens.is_empty() {
            let count = tokens.iter().filter(|&&t| t >= from && t < below).count() as u64;
            histogram.push([from, below, count]);
            (from, below) = (below, below * 2);
        }
        LengthStats {
            samples: tokens.len(),
            mean_tokens: total as f64 / tokens.len().max(1) as f64,
            p10: at(0.10),
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
            max: at(1.0),
            vision_share: lengths.iter().map(|l| l.vision_tokens).sum::<u64>() as f64
                / total.max(1) as f64,
            images,
            histogram,
        }
    }
}

fn print_stats(s: &LengthStats, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(s)?);
        return Ok(());
    }
    println!(
        "{} samples; tokens per sample: mean {:.0}, p10 {}, p50 {}, p90 {}, p99 {}, max {}; vision tokens {:.0} % of all",
        s.samples, s.mean_tokens, s.p10, s.p50, s.p90, s.p99, s.max, 100.0 * s.vision_share
    );
    println!(
        "images per sample: 0: {}, 1: {}, 2: {}, 3: {}, 4+: {}",
        s.images[0], s.images[1], s.images[2], s.images[3], s.images[4]
    );
    let widest = s.histogram.iter().map(|h| h[2]).max().unwrap_or(1).max(1);
    for [from, below, count] in &s.histogram {
        let bar = "#".repeat((40 * count).div_ceil(widest) as usize);
        println!("{from:>7} - {below:<7} {count:>7}  {bar}");
    }
    Ok(())
}
