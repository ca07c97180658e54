//! Opening what a worker serves: its datasets (each store, index and lengths), combined into
//! one store and index when mixed, the plan over them, and the pipeline.

use crate::dataset::index::DatasetIndex;
use crate::dataset::le_u32s::LeU32s;
use crate::dataset::lengths::SampleLengths;
use crate::identity::preprocessing_id;
use crate::limits::SampleLimits;
use crate::metrics::Metrics;
use crate::pipeline::{Pipeline, PipelineConfig};
use crate::plan::{Plan, Shaping};
use crate::preprocess::preset::Preset;
use crate::source::{MediaRoot, Store};
use prometheus::IntCounterVec;
use std::sync::Arc;
use stoker_config::{SampleOrder, WorkerConfig};

/// One dataset of a pipeline: where it is, its weight in a mix, its own store (its index
/// and lengths live at its root), its media root if its media lie apart, and its index.
struct Dataset {
    uri: String,
    weight: u32,
    store: Store,
    media_root: Option<MediaRoot>,
    index: DatasetIndex,
}

impl Dataset {
    async fn open(
        uri: &str,
        media_root: Option<&str>,
        weight: u32,
        cfg: &WorkerConfig,
        requests: &IntCounterVec,
    ) -> anyhow::Result<Dataset> {
        let store = Store::open(uri, &cfg.s3).await?.counted(requests);
        let media_root = match media_root {
            Some(m) => Some(MediaRoot::open(m, &cfg.s3).await?.counted(requests)),
            None => None,
        };
        let max_objects = cfg.concurrency.self_index_max_objects;
        let index = DatasetIndex::load_or_build(&store, media_root.as_ref(), max_objects).await?;
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
            media_root,
            index,
        })
    }

    /// Its samples' lengths for these preprocessing settings, each fitting a pack if packing.
    async fn lengths(&self, preprocessing: u64, shaping: Shaping) -> anyhow::Result<LeU32s> {
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

/// The main dataset and those mixed in, their store requests counted in `requests`.
async fn open_datasets(
    cfg: &WorkerConfig,
    requests: &IntCounterVec,
) -> anyhow::Result<Vec<Dataset>> {
    let main = Dataset::open(
        &cfg.data,
        cfg.media_root.as_deref(),
        cfg.sampling.data_weight,
        cfg,
        requests,
    );
    let mut datasets = vec![main.await?];
    for m in &cfg.sampling.mix {
        let media_root = m.media_root.as_deref();
        datasets.push(Dataset::open(&m.data, media_root, m.weight, cfg, requests).await?);
    }
    Ok(datasets)
}

/// The datasets read through one store with one index: the main dataset's own, or for a mix
/// a store rooted at the datasets' common folder and their indexes concatenated; and the
/// media roots their shards name.
async fn combine(
    mut datasets: Vec<Dataset>,
    cfg: &WorkerConfig,
    requests: &IntCounterVec,
) -> anyhow::Result<(Store, Vec<MediaRoot>, DatasetIndex)> {
    let mut media_roots: Vec<MediaRoot> = Vec::new();
    for m in datasets.iter().filter_map(|d| d.media_root.clone()) {
        if media_roots.iter().all(|r| r.uri != m.uri) {
            media_roots.push(m);
        }
    }
    if datasets.len() == 1 {
        let d = datasets.pop().expect("one dataset");
        return Ok((d.store, media_roots, d.index));
    }
    let uris: Vec<&str> = datasets.iter().map(|d| d.uri.as_str()).collect();
    let (root, folders) = crate::source::common_root(&uris)?;
    let store = Store::open(&root, &cfg.s3).await?.counted(requests);
    let parts = folders.into_iter().zip(datasets).map(|(f, d)| (f, d.index));
    Ok((store, media_roots, DatasetIndex::concat(parts.collect())))
}

/// From this many samples the `shuffle` order's arrays (4 bytes a sample, two around an
/// epoch boundary) are worth a warning: 67 MB each here, 400 MB at 10^8 (docs/design.md, "What a worker
/// holds").
const LARGE_SHUFFLE: u64 = 1 << 24;

/// Opens the datasets, loads (or builds) their indexes and assembles the pipeline `cfg`
/// describes.
pub async fn open_pipeline(
    cfg: &WorkerConfig,
    metrics: Arc<Metrics>,
) -> anyhow::Result<Arc<Pipeline>> {
    let datasets = open_datasets(cfg, &metrics.store_requests).await?;
    let text = crate::tokenizer_source::text_processor(&cfg.preprocessing, &cfg.s3).await?;
    let c = &cfg.concurrency;
    let cpu_threads = c
        .cpu_threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
    // A request's samples are prepared side by side, never more than the worker prepares at
    // once (its memory bound counts on it).
    let inflight = cfg.serving.inflight_samples(cpu_threads);
    let config = PipelineConfig {
        preset: Preset::from_config(&cfg.preprocessing),
        limits: SampleLimits::from_config(&cfg.preprocessing),
        on_error: cfg.sampling.on_error,
        max_fetches: c.max_fetches,
        cpu_threads,
        sample_parallelism: c.sample_parallelism.unwrap_or(usize::MAX).min(inflight),
        line_cache_bytes: c.line_cache_mib << 20,
        keep_decoded_frames: false,
    };
    let sizes: Vec<u64> = datasets.iter().map(|d| d.index.num_samples()).collect();
    let mut plan = Plan::new(
        sizes.iter().sum(),
        cfg.sampling.global_batch_size,
        cfg.sampling.seed,
    )
    .with_order(cfg.sampling.order)
    .with_run_lines(cfg.sampling.run_lines);
    let n = plan.num_samples;
    if cfg.sampling.order == SampleOrder::Shuffle && n >= LARGE_SHUFFLE {
        tracing::warn!(
            "--order shuffle holds each epoch's order, 4 bytes a sample: {} MB for {n} samples, \
             twice that around an epoch boundary; --order feistel holds none \
             (another plan: a resume state of one is refused by the other)",
            4 * n / 1_000_000
        );
    }
    if datasets.len() > 1 {
        anyhow::ensure!(
            cfg.sampling.order != SampleOrder::Runs,
            "--order runs takes one dataset: with --mix, use --order feistel (or shuffle)"
        );
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
        let mut lengths = Vec::with_capacity(datasets.len());
        for d in &datasets {
            lengths.push(d.lengths(id, shaping).await?);
        }
        plan = plan.with_lengths(LeU32s::concat(lengths), shaping);
    }
    let names = datasets.iter().map(|d| d.uri.clone()).zip(sizes).collect();
    let (store, media_roots, index) = combine(datasets, cfg, &metrics.store_requests).await?;
    let pipeline = Pipeline::new(store, media_roots, index, plan, text, config, metrics);
    Ok(Arc::new(pipeline.with_dataset_names(names)))
}
