//! Opening what a worker serves: its datasets (each store, index and lengths), combined into
//! one store and index when mixed, the plan over them, and the pipeline.

use crate::dataset::index::DatasetIndex;
use crate::dataset::lengths::SampleLengths;
use crate::identity::preprocessing_id;
use crate::limits::SampleLimits;
use crate::metrics::Metrics;
use crate::pipeline::{Pipeline, PipelineConfig};
use crate::plan::{Plan, Shaping};
use crate::preprocess::preset::Preset;
use crate::source::Store;
use std::sync::Arc;
use stoker_config::WorkerConfig;

/// One dataset of a pipeline: where it is, its weight in a mix, its own store (its index
/// and lengths live at its root) and index.
struct Dataset {
    uri: String,
    weight: u32,
    store: Store,
    index: DatasetIndex,
}

impl Dataset {
    async fn open(uri: &str, weight: u32, cfg: &WorkerConfig) -> anyhow::Result<Dataset> {
        let store = Store::open(uri, &cfg.s3).await?;
        let index = DatasetIndex::load_or_build(&store).await?;
        if let Some(first) = index.bad_lines.first() {
            tracing::warn!(
                "{uri}: {} invalid lines are excluded from the plan (first: {first}); `stoker dataset index` lists them",
                index.bad_line_count,
            );
        }
        anyhow::ensure!(index.num_samples() > 0, "{uri}: no valid samples");
        Ok(Dataset {
            uri: uri.to_string(),
            weight,
            store,
            index,
        })
    }

    /// Its samples' lengths for these preprocessing settings, each fitting a pack if packing.
    async fn lengths(&self, preprocessing: u64, shaping: Shaping) -> anyhow::Result<Vec<u32>> {
        let n = self.index.num_samples();
        let lengths =
            SampleLengths::load(&self.store, self.index.version, preprocessing, n).await?;
        if let Some(max) = shaping.pack_max_tokens {
            lengths
                .check_fit(max)
                .map_err(|e| e.context(self.uri.clone()))?;
        }
        Ok(lengths.tokens)
    }
}

/// The main dataset and those mixed in.
async fn open_datasets(cfg: &WorkerConfig) -> anyhow::Result<Vec<Dataset>> {
    let mut datasets = vec![Dataset::open(&cfg.data, cfg.sampling.data_weight, cfg).await?];
    for m in &cfg.sampling.mix {
        datasets.push(Dataset::open(&m.data, m.weight, cfg).await?);
    }
    Ok(datasets)
}

/// The datasets read through one store with one index: the main dataset's own, or for a mix
/// a store rooted at the datasets' common folder and their indexes concatenated.
async fn combine(
    mut datasets: Vec<Dataset>,
    cfg: &WorkerConfig,
) -> anyhow::Result<(Store, DatasetIndex)> {
    if datasets.len() == 1 {
        let d = datasets.pop().expect("one dataset");
        return Ok((d.store, d.index));
    }
    let uris: Vec<&str> = datasets.iter().map(|d| d.uri.as_str()).collect();
    let (root, folders) = crate::source::common_root(&uris)?;
    let store = Store::open(&root, &cfg.s3).await?;
    let parts = folders.into_iter().zip(datasets).map(|(f, d)| (f, d.index));
    Ok((store, DatasetIndex::concat(parts.collect())))
}

/// Opens the datasets, loads (or builds) their indexes and assembles the pipeline `cfg`
/// describes.
pub async fn open_pipeline(
    cfg: &WorkerConfig,
    metrics: Arc<Metrics>,
) -> anyhow::Result<Arc<Pipeline>> {
    let datasets = open_datasets(cfg).await?;
    let text = crate::tokenizer_source::text_processor(&cfg.preprocessing, &cfg.s3).await?;
    let c = &cfg.concurrency;
    let config = PipelineConfig {
        preset: Preset::from_config(&cfg.preprocessing),
        limits: SampleLimits::from_config(&cfg.preprocessing),
        on_error: cfg.sampling.on_error,
        max_fetches: c.max_fetches,
        cpu_threads: c
            .cpu_threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get())),
        sample_parallelism: c.sample_parallelism.unwrap_or(usize::MAX),
        line_cache_bytes: c.line_cache_mib << 20,
        keep_decoded_frames: false,
    };
    let sizes: Vec<u64> = datasets.iter().map(|d| d.index.num_samples()).collect();
    let mut plan = Plan::new(
        sizes.iter().sum(),
        cfg.sampling.global_batch_size,
        cfg.sampling.seed,
    )
    .with_order(cfg.sampling.order);
    if datasets.len() > 1 {
        let weights: Vec<u32> = datasets.iter().map(|d| d.weight).collect();
        plan = plan.with_mix(&sizes, &weights);
    }
    let shaping = Shaping {
        balance_ranks: cfg.sampling.balance_ranks,
        bucket_by_length: cfg.sampling.bucket_by_length,
        pack_max_tokens: cfg.sampling.pack_max_tokens,
    };
    if shaping != Shaping::default() {
        let id = preprocessing_id(&config, text.fingerprint);
        let mut lengths = Vec::with_capacity(plan.num_samples as usize);
        for d in &datasets {
            lengths.extend(d.lengths(id, shaping).await?);
        }
        plan = plan.with_lengths(lengths, shaping);
    }
    let names = datasets.iter().map(|d| d.uri.clone()).zip(sizes).collect();
    let (store, index) = combine(datasets, cfg).await?;
    let pipeline = Pipeline::new(store, index, plan, text, config, metrics);
    Ok(Arc::new(pipeline.with_dataset_names(names)))
}
