//! `stoker dataset synth | index | inspect`.

use clap::Subcommand;
use std::path::PathBuf;
use stoker_config::{Concurrency, OnError, Preprocessing, S3Connection, Sampling, WorkerConfig};
use stoker_testkit::synth::{generate, SynthOptions};
use stoker_worker::dataset::index::{DatasetIndex, Progress, INDEX_KEY};
use stoker_worker::metrics::Metrics;
use stoker_worker::pipeline::{collate, open_pipeline};
use stoker_worker::source::Store;

#[derive(Subcommand)]
pub enum DatasetCommand {
    /// Write a synthetic VLM SFT dataset (JSONL shards + JPEG/PNG images).
    Synth {
        /// Folder to write (created; shards at its root, images under images/).
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        options: SynthOptions,
    },
    /// Build the index (shards, line offsets, counts), validating every line; writes
    /// stoker-index.json at the dataset root. Exits 1 if any line is bad (use --allow-bad).
    Index {
        /// s3://bucket/prefix or a local folder.
        uri: String,
        #[command(flatten)]
        s3: S3Connection,
        /// Do not write the index back to the dataset.
        #[arg(long)]
        dry_run: bool,
        /// Exit 0 even when bad lines were found (they are excluded from the plan).
        #[arg(long)]
        allow_bad: bool,
    },
    /// Show what the model will see for one sample: chat text, tokens, image sizes and grids.
    Inspect {
        uri: String,
        #[arg(long)]
        sample: u64,
        #[command(flatten)]
        s3: S3Connection,
        #[command(flatten)]
        pre: Preprocessing,
        /// Write input_ids, labels, pixel_values and image_grid_thw as safetensors.
        #[arg(long)]
        out: Option<PathBuf>,
    },
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
        DatasetCommand::Synth { out, options: o } => {
            let samples = o.samples;
            let pb = bar("synth");
            pb.set_length(samples as u64);
            tokio::task::spawn_blocking(move || {
                generate(&out, &o, &|| pb.inc(1))?;
                pb.finish();
                anyhow::Ok(())
            })
            .await??;
            println!("wrote {samples} samples");
            Ok(())
        }
        DatasetCommand::Index {
            uri,
            s3,
            dry_run,
            allow_bad,
        } => {
            let store = Store::open(&uri, &s3).await?;
            let pb = bar("index");
            pb.set_style(
                indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes}")
                    .expect("template"),
            );
            let bar = ByteBar(pb);
            let idx = DatasetIndex::build(&store, &bar).await?;
            bar.0.finish_and_clear();
            for b in &idx.bad_lines {
                eprintln!("bad line {b}");
            }
            println!(
                "{} shards, {} samples, {} bad lines, version {:016x}",
                idx.shards.len(),
                idx.num_samples(),
                idx.bad_lines.len(),
                idx.version
            );
            if !dry_run {
                store.put(INDEX_KEY, idx.to_json()).await?;
                println!("wrote {}", store.describe(INDEX_KEY));
            }
            if !idx.bad_lines.is_empty() && !allow_bad {
                anyhow::bail!("{} bad lines (listed above)", idx.bad_lines.len());
            }
            Ok(())
        }
        DatasetCommand::Inspect {
            uri,
            sample,
            s3,
            pre,
            out,
        } => {
            let cfg = WorkerConfig {
                data: uri,
                s3,
                preprocessing: pre,
                sampling: Sampling {
                    global_batch_size: 1,
                    on_error: OnError::Fail,
                    ..Sampling::default()
                },
                concurrency: Concurrency {
                    cpu_threads: Some(1),
                    ..Concurrency::default()
                },
                ..WorkerConfig::default()
            };
            inspect(&cfg, sample, out).await
        }
    }
}

async fn inspect(cfg: &WorkerConfig, sample: u64, out: Option<PathBuf>) -> anyhow::Result<()> {
    let p = open_pipeline(cfg, Metrics::new()).await?;
    let (shard, line) = p.index.locate(sample).ok_or_else(|| {
        anyhow::anyhow!(
            "sample {sample} is beyond the {} samples",
            p.index.num_samples()
        )
    })?;
    println!("sample {sample}: {}:{}", shard.key, line.0);
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
    if let Some(path) = out {
        let batch = collate(vec![s], vec![], p.text.pad_id);
        write_safetensors(&path, &batch, p.pixel_dtype(), p.config.preset.patch_dim())?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// One sample's tensors as safetensors (shapes as transformers returns them).
fn write_safetensors(
    path: &std::path::Path,
    b: &stoker_worker::pipeline::Batch,
    dtype: stoker_wire::DType,
    patch_dim: usize,
) -> anyhow::Result<()> {
    use safetensors::tensor::{Dtype, TensorView};
    use stoker_worker::pipeline::i64_bytes;
    let st = |d: stoker_wire::DType| match d {
        stoker_wire::DType::F32 => Dtype::F32,
        stoker_wire::DType::BF16 => Dtype::BF16,
        stoker_wire::DType::U8 => Dtype::U8,
        _ => Dtype::I64,
    };
    let ids = i64_bytes(&b.input_ids);
    let labels = i64_bytes(&b.labels);
    let grid = i64_bytes(&b.image_grid_thw);
    let pixels: Vec<u8> = b
        .pixel_chunks
        .iter()
        .flat_map(|c| c.as_bytes())
        .copied()
        .collect();
    let l = b.seq_len;
    let tensors = vec![
        ("input_ids", TensorView::new(Dtype::I64, vec![1, l], &ids)?),
        ("labels", TensorView::new(Dtype::I64, vec![1, l], &labels)?),
        (
            "pixel_values",
            TensorView::new(st(dtype), vec![b.pixel_rows, patch_dim], &pixels)?,
        ),
        (
            "image_grid_thw",
            TensorView::new(Dtype::I64, vec![b.image_grid_thw.len() / 3, 3], &grid)?,
        ),
    ];
    safetensors::serialize_to_file(tensors, &None, path)?;
    Ok(())
}
