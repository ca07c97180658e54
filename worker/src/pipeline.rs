//! Sample id → preprocessed sample → collated batch.
//!
//! Concurrency is matched to the stage: object-store reads are async and bounded by a
//! semaphore (`max_fetches`); decode, resize, patchify and tokenize run on the blocking pool,
//! bounded by a second semaphore sized to the cores. A request's samples are loaded
//! concurrently, so a slow object delays only its own batch, never other requests.

use crate::batch::{collate, Batch, PreparedSample};
use crate::dataset::index::{DatasetIndex, Shard};
use crate::dataset::lengths::SampleLengths;
use crate::dataset::sample::{Conversation, Media, SampleError, VideoPart, VideoSource};
use crate::limits::{LimitError, SampleLimits};
use crate::line_cache::{LineCache, Lookup};
use crate::metrics::{GaugeGuard, LineCacheResult, Metrics, Queue, SampleErrorKind, Stage};
use crate::pack::{collate_packed, RopeLayout};
use crate::plan::{Plan, RankSlice, Shaping};
use crate::preprocess::preset::{PixelDtype, Preset};
use crate::preprocess::text::{MediaTokens, TextError, TextProcessor};
use crate::preprocess::video::{self, VideoBudget};
use crate::preprocess::video_error::VideoError;
use crate::preprocess::vision::{
    check_limits, decode, normalization_table, process_image, read_header,
    video_normalization_table, ImageError, ImageHeader, ImageTimings, PixelLut,
};
use crate::source::{resolve_relative, FetchError, PathError, Store};
use futures::{FutureExt, StreamExt};
use std::sync::Arc;
use std::time::Instant;
use stoker_config::WorkerConfig;
use stoker_wire::{DType, Skipped};
use tokio::sync::Semaphore;

pub use stoker_config::OnError;

/// Why one sample failed; `kind` is the metric label, the message names the object or line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("sample {sample_id} ({location}): {message}")]
pub struct SampleFailure {
    pub sample_id: u64,
    pub location: String,
    pub kind: &'static str,
    pub message: String,
    /// The store failed, not the data: retrying may succeed, so the sample is never skipped
    /// for it (two workers would serve different bytes for one request).
    pub transient: bool,
}

#[derive(Debug, thiserror::Error)]
enum Cause {
    #[error(transparent)]
    Fetch(#[from] FetchError),
    #[error(transparent)]
    Sample(#[from] SampleError),
    #[error(transparent)]
    Path(#[from] PathError),
    #[error("image {key}: {err}")]
    Image { key: String, err: ImageError },
    #[error("video {key}: {err}")]
    Video { key: String, err: VideoError },
    #[error(transparent)]
    Text(#[from] TextError),
    #[error(transparent)]
    Limit(#[from] LimitError),
    #[error("sample id is not in the index")]
    NoSuchSample,
    #[error("preprocessing panicked: {0}")]
    Panicked(String),
    /// The runtime is going away (the worker stops or is killed) and cancelled the sample's
    /// work: not the data's fault, so never a skip.
    #[error("the worker is shutting down; the sample was not prepared")]
    ShuttingDown,
}

impl Cause {
    fn kind(&self) -> SampleErrorKind {
        use SampleErrorKind as K;
        match self {
            Cause::Fetch(FetchError::NotFound(_)) => K::ObjectMissing,
            Cause::Fetch(FetchError::Io(..)) => K::ObjectStore,
            Cause::Fetch(FetchError::TooLarge { .. }) => K::ObjectTooLarge,
            Cause::Sample(SampleError::NotUtf8(_)) => K::NotUtf8,
            Cause::Sample(SampleError::Json(_)) => K::InvalidJson,
            Cause::Sample(SampleError::Schema(_)) => K::InvalidSample,
            Cause::Path(_) => K::PathRefused,
            Cause::Image { err, .. } => match err {
                ImageError::Unsupported => K::ImageUnsupported,
                ImageError::Corrupt(_) => K::ImageCorrupt,
                ImageError::TooLarge { .. } => K::ImageTooLarge,
                ImageError::AspectRatio { .. } => K::ImageAspectRatio,
                ImageError::OverBudget(_) => K::ImageOverBudget,
                ImageError::TooManyScans { .. } => K::ImageTooManyScans,
            },
            Cause::Video { err, .. } => match err {
                VideoError::Unsupported | VideoError::NoVideoStream => K::VideoUnsupported,
                VideoError::Corrupt(_) => K::VideoCorrupt,
                VideoError::FrameTooLarge { .. } => K::VideoTooLarge,
                VideoError::TooManyFrames { .. } => K::VideoTooLong,
                VideoError::Sampling(_) => K::VideoSampling,
                VideoError::SamplePixels { .. } => K::SampleTooLarge,
            },
            Cause::Text(TextError::TooLong { .. }) => K::TooLong,
            Cause::Text(_) => K::Text,
            Cause::Limit(e) => e.kind(),
            Cause::NoSuchSample => K::NoSuchSample,
            Cause::Panicked(_) => K::Panic,
            Cause::ShuttingDown => K::ShuttingDown,
        }
    }

    /// The store or the worker failed, not the data: another attempt may succeed.
    fn is_transient(&self) -> bool {
        matches!(self, Cause::Fetch(FetchError::Io(..)) | Cause::ShuttingDown)
    }
}

/// float32s as little-endian bytes (the wire's).
fn le_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Runs `work` on the blocking pool. A panic there (a bug, or a decoder's) becomes this
/// sample's failure, named and counted like any other, never a request left unanswered.
async fn on_blocking_pool<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, Cause> + Send + 'static,
) -> Result<T, Cause> {
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|e| Err(blocking_failure(e)))
}

/// Why blocking work did not finish: it panicked, or shutdown cancelled it (a killed
/// worker's last answers once served such samples as skipped).
fn blocking_failure(e: tokio::task::JoinError) -> Cause {
    match e.try_into_panic() {
        Ok(payload) => Cause::Panicked(
            payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-text panic".into()),
        ),
        Err(_) => Cause::ShuttingDown,
    }
}

/// An image's error as a sample failure: the image's own fault, or (refused only because of
/// the sample's pixel budget) the sample's.
fn image_cause(limits: &SampleLimits, key: &str, err: ImageError) -> Cause {
    match limits.classify(key.to_string(), err) {
        Ok(err) => Cause::Image {
            key: key.to_string(),
            err,
        },
        Err(over) => Cause::Limit(over),
    }
}

/// Bytes of an image read first for its header: JPEG's frame header and EXIF, and PNG's
/// header chunks, fit in it in every file we have seen; a file that does not is read whole.
pub const HEADER_PREFIX: u64 = 64 << 10;

/// A sample's length as the model sees it, measured without decoding pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleShape {
    pub tokens: u64,
    pub vision_tokens: u64,
    pub images: usize,
    pub videos: usize,
}

/// Where one image or video of a sample lies in the store.
enum MediaKey {
    Image(String),
    Clip(String, VideoPart),
    Frames(Vec<String>, VideoPart),
}

/// An image's or video's bytes.
enum Fetched {
    Image(String, bytes::Bytes),
    Clip(String, bytes::Bytes, VideoPart),
    Frames(Vec<(String, bytes::Bytes)>, VideoPart),
}

fn video_cause(key: &str, err: VideoError) -> Cause {
    Cause::Video {
        key: key.to_string(),
        err,
    }
}

#[derive(Debug, Clone)]
pub struct PipelineConfig {
    pub preset: Preset,
    pub limits: SampleLimits,
    pub on_error: OnError,
    /// Object-store reads in flight at once, across all requests.
    pub max_fetches: usize,
    /// CPU-bound preprocessing tasks at once; default: the number of cores.
    pub cpu_threads: usize,
    /// Samples of one request loaded at once (1 = one after another, the serial baseline).
    pub sample_parallelism: usize,
    /// Shard text kept in memory (the line cache); 0 reads every line on its own.
    pub line_cache_bytes: u64,
    /// Keep each video's sampled frames as decoded (`dataset inspect` saves them).
    pub keep_decoded_frames: bool,
}

pub struct Pipeline {
    pub store: Store,
    pub index: DatasetIndex,
    pub plan: Arc<Plan>,
    pub text: TextProcessor,
    pub config: PipelineConfig,
    pub metrics: Arc<Metrics>,
    lut: PixelLut,
    video_lut: PixelLut,
    /// With u8 pixels: the normalization table's bytes, sent with every batch.
    pixel_lut: Option<Vec<u8>>,
    /// With u8 pixels: the video processors' table, sent with batches holding a video.
    video_pixel_lut: Option<Vec<u8>>,
    fetch_slots: Semaphore,
    cpu_slots: Arc<Semaphore>,
    line_cache: LineCache,
    /// Each dataset's name and first sample id (one dataset unless mixed).
    datasets: Vec<(String, u64)>,
}

impl Pipeline {
    pub fn new(
        store: Store,
        index: DatasetIndex,
        plan: Plan,
        text: TextProcessor,
        config: PipelineConfig,
        metrics: Arc<Metrics>,
    ) -> Self {
        metrics.dataset_samples.set(index.num_samples() as i64);
        metrics.dataset_bad_lines.set(index.bad_line_count as i64);
        Pipeline {
            lut: PixelLut::new(&config.preset),
            video_lut: PixelLut::for_videos(&config.preset),
            pixel_lut: (config.preset.pixel_dtype == PixelDtype::U8)
                .then(|| le_bytes(&normalization_table(&config.preset))),
            video_pixel_lut: (config.preset.pixel_dtype == PixelDtype::U8)
                .then(|| le_bytes(&video_normalization_table(&config.preset))),
            fetch_slots: Semaphore::new(config.max_fetches.max(1)),
            cpu_slots: Arc::new(Semaphore::new(config.cpu_threads.max(1))),
            line_cache: LineCache::new(config.line_cache_bytes),
            datasets: vec![(store.describe(""), 0)],
            store,
            index,
            plan: Arc::new(plan),
            text,
            config,
            metrics,
        }
    }

    /// Names the datasets (name, sample count), in sample-id order.
    pub fn with_dataset_names(mut self, names: Vec<(String, u64)>) -> Self {
        let mut first = 0;
        self.datasets = names
            .into_iter()
            .map(|(name, n)| {
                first += n;
                (name, first - n)
            })
            .collect();
        self
    }

    /// How many of `ids` each dataset holds, by name (the metrics' `dataset` label);
    /// datasets with none are left out.
    pub fn samples_by_dataset(&self, ids: &[u64]) -> impl Iterator<Item = (&str, u64)> {
        let mut counts = vec![0u64; self.datasets.len()];
        for &id in ids {
            let after = self.datasets.partition_point(|(_, first)| *first <= id);
            counts[after.saturating_sub(1)] += 1;
        }
        self.datasets
            .iter()
            .zip(counts)
            .filter(|(_, n)| *n > 0)
            .map(|((name, _), n)| (name.as_str(), n))
    }

    pub fn pixel_dtype(&self) -> DType {
        match self.config.preset.pixel_dtype {
            PixelDtype::F32 => DType::F32,
            PixelDtype::Bf16 => DType::BF16,
            PixelDtype::U8 => DType::U8,
        }
    }

    /// The `pixel_lut` tensor's bytes (`[3, 256]` float32) when pixels go out as u8: what
    /// the rank needs to normalize them exactly as this worker would have.
    pub fn pixel_lut(&self) -> Option<&[u8]> {
        self.pixel_lut.as_deref()
    }

    /// The same for `pixel_values_videos` (`pixel_lut_videos`).
    pub fn video_pixel_lut(&self) -> Option<&[u8]> {
        self.video_pixel_lut.as_deref()
    }

    /// Reads a sample's line (`range`) or a whole image, at most `max_object_bytes` of it.
    async fn fetch(
        &self,
        key: &str,
        range: Option<(u64, u64)>,
    ) -> Result<bytes::Bytes, FetchError> {
        let queued = self.metrics.queued(Queue::Fetch);
        let permit = self.fetch_slots.acquire().await.expect("never closed");
        drop(queued);
        let fetching = GaugeGuard::new(&self.metrics.fetches_in_flight);
        let t = Instant::now();
        let r = match range {
            Some((s, l)) => self.store.get_range(key, s, l).await,
            None => {
                self.store
                    .get_at_most(key, self.config.limits.object_bytes)
                    .await
            }
        };
        self.metrics.observe_stage(Stage::Fetch, t.elapsed());
        drop(fetching);
        drop(permit);
        if let Ok(b) = &r {
            self.metrics.object_bytes_total.inc_by(b.len() as u64);
        }
        r
    }

    /// Loads and preprocesses one sample.
    pub async fn load_sample(
        self: &Arc<Self>,
        sample_id: u64,
    ) -> Result<PreparedSample, SampleFailure> {
        let (shard, line, location) = self.locate(sample_id)?;
        self.prepare(sample_id, shard, line)
            .await
            .map_err(|c| self.failure(sample_id, location, c))
    }

    /// What loading one sample would give in tokens, from its line and its images' headers
    /// alone: no pixel is decoded, and an image is read whole only when its header (or a
    /// WebP's or TIFF's orientation) lies beyond the first [`HEADER_PREFIX`] bytes. The same
    /// limits and truncation apply as when serving it.
    pub async fn measure_sample(
        self: &Arc<Self>,
        sample_id: u64,
    ) -> Result<SampleShape, SampleFailure> {
        let (shard, line, location) = self.locate(sample_id)?;
        self.measure(shard, line)
            .await
            .map_err(|c| self.failure(sample_id, location, c))
    }

    /// A sample's shard, (offset, length) of its line, and its location for messages.
    fn locate(&self, sample_id: u64) -> Result<(&Shard, (u64, u64), String), SampleFailure> {
        let Some((shard, line)) = self.index.locate(sample_id) else {
            return Err(self.failure(sample_id, "-".into(), Cause::NoSuchSample));
        };
        let location = format!("{}:{}", shard.key, line.line);
        Ok((shard, (line.offset, line.len), location))
    }

    fn failure(&self, sample_id: u64, location: String, cause: Cause) -> SampleFailure {
        let kind = cause.kind().as_str();
        self.metrics
            .sample_errors_total
            .with_label_values(&[kind])
            .inc();
        SampleFailure {
            sample_id,
            location,
            kind,
            message: cause.to_string(),
            transient: cause.is_transient(),
        }
    }

    /// A sample's JSONL line: from the line cache when it lies within one block, else read
    /// on its own.
    async fn read_line(
        self: &Arc<Self>,
        shard: &Shard,
        offset: u64,
        len: u64,
    ) -> Result<bytes::Bytes, FetchError> {
        if !self.line_cache.covers(offset, len) {
            return self.fetch(&shard.key, Some((offset, len))).await;
        }
        let read_block = |start, len| {
            let (this, key) = (self.clone(), shard.key.clone());
            async move { this.fetch(&key, Some((start, len))).await }.boxed()
        };
        let (line, lookup) = self
            .line_cache
            .line(&shard.key, shard.size, (offset, len), read_block)
            .await?;
        self.metrics.line_cache(match lookup {
            Lookup::Hit => LineCacheResult::Hit,
            Lookup::Miss => LineCacheResult::Miss,
        });
        Ok(line)
    }

    /// A sample's conversation and its images' and videos' keys, limits checked.
    async fn read_sample(
        self: &Arc<Self>,
        shard: &Shard,
        (offset, len): (u64, u64),
    ) -> Result<(Conversation, Vec<MediaKey>), Cause> {
        self.config.limits.check_line(len)?;
        let line = self.read_line(shard, offset, len).await?;
        let conv = Conversation::parse(&line)?;
        self.config.limits.check_conversation(&conv)?;
        let key = |p: &str| resolve_relative(&shard.key, p);
        let keys = conv
            .media()
            .map(|m| {
                Ok(match m {
                    Media::Image(p) => MediaKey::Image(key(p)?),
                    Media::Video(v) => match &v.video {
                        VideoSource::Clip(p) => MediaKey::Clip(key(p)?, v.clone()),
                        VideoSource::Frames(ps) => MediaKey::Frames(
                            ps.iter().map(|p| key(p)).collect::<Result<_, _>>()?,
                            v.clone(),
                        ),
                    },
                })
            })
            .collect::<Result<Vec<_>, PathError>>()?;
        Ok((conv, keys))
    }

    /// Every object of a sample's media, read concurrently.
    async fn fetch_media(&self, keys: Vec<MediaKey>) -> Result<Vec<Fetched>, Cause> {
        let whole = |k: String| async move {
            let r = self.fetch(&k, None).await;
            r.map(|b| (k, b))
        };
        let fetches = keys.into_iter().map(|m| async move {
            Ok::<_, FetchError>(match m {
                MediaKey::Image(k) => {
                    let (k, b) = whole(k).await?;
                    Fetched::Image(k, b)
                }
                MediaKey::Clip(k, part) => {
                    let (k, b) = whole(k).await?;
                    Fetched::Clip(k, b, part)
                }
                MediaKey::Frames(ks, part) => {
                    let frames = futures::future::join_all(ks.into_iter().map(whole)).await;
                    Fetched::Frames(frames.into_iter().collect::<Result<_, _>>()?, part)
                }
            })
        });
        let mut out = Vec::new();
        for r in futures::future::join_all(fetches).await {
            out.push(r?);
        }
        Ok(out)
    }

    async fn prepare(
        self: &Arc<Self>,
        sample_id: u64,
        shard: &Shard,
        line: (u64, u64),
    ) -> Result<PreparedSample, Cause> {
        let (conv, keys) = self.read_sample(shard, line).await?;
        let media = self.fetch_media(keys).await?;

        let queued = self.metrics.queued(Queue::Cpu);
        let permit = self
            .cpu_slots
            .clone()
            .acquire_owned()
            .await
            .expect("never closed");
        drop(queued);
        let this = self.clone();
        on_blocking_pool(move || {
            let _permit = permit;
            this.preprocess(sample_id, conv, media)
        })
        .await
    }

    /// The CPU part: decode/resize/patchify every image and video, then tokenize.
    fn preprocess(
        &self,
        sample_id: u64,
        conv: Conversation,
        media: Vec<Fetched>,
    ) -> Result<PreparedSample, Cause> {
        let preset = &self.config.preset;
        let limits = &self.config.limits;
        let mut timings = ImageTimings::default();
        let mut images = Vec::new();
        let mut videos = Vec::new();
        let mut tokens = Vec::with_capacity(media.len());
        let mut decoded_pixels = 0;
        let keep = self.config.keep_decoded_frames;
        for m in media {
            match m {
                Fetched::Image(key, bytes) => {
                    let decode = limits.next_image(decoded_pixels);
                    let out = process_image(&bytes, preset, &self.lut, decode, &mut timings)
                        .map_err(|err| image_cause(limits, &key, err))?;
                    decoded_pixels += out.original.0 as u64 * out.original.1 as u64;
                    tokens.push(MediaTokens::Image(preset.image_tokens(out.resized)));
                    images.push(out);
                }
                Fetched::Clip(key, bytes, part) => {
                    let t = Instant::now();
                    let budget = VideoBudget {
                        limits: limits.video(),
                        pixels: limits.sample_pixels.saturating_sub(decoded_pixels),
                    };
                    let lut = &self.video_lut;
                    let out = video::process_clip(bytes, &part, preset, lut, budget, keep)
                        .map_err(|e| video_cause(&key, e))?;
                    timings.decode += t.elapsed();
                    decoded_pixels += out.rows as u64
                        * u64::from(preset.patch_size.pow(2))
                        * u64::from(preset.temporal_patch_size);
                    tokens.push(MediaTokens::Video(out.tokens(preset)));
                    videos.push(out);
                }
                Fetched::Frames(frames, part) => {
                    let first = frames.first().map(|f| f.0.clone()).unwrap_or_default();
                    let mut decoded = Vec::with_capacity(frames.len());
                    for (key, bytes) in frames {
                        let limit = limits.next_image(decoded_pixels);
                        let rgb =
                            decode(&bytes, limit).map_err(|err| image_cause(limits, &key, err))?;
                        decoded_pixels += (rgb.width * rgb.height) as u64;
                        decoded.push(rgb);
                    }
                    let left = limits.sample_pixels.saturating_sub(decoded_pixels);
                    let out = video::process_frame_list(
                        decoded,
                        &part,
                        preset,
                        &self.video_lut,
                        left,
                        keep,
                    )
                    .map_err(|e| video_cause(&first, e))?;
                    tokens.push(MediaTokens::Video(out.tokens(preset)));
                    videos.push(out);
                }
            }
        }
        if !tokens.is_empty() {
            self.metrics.observe_stage(Stage::Decode, timings.decode);
            self.metrics.observe_stage(Stage::Resize, timings.resize);
        }
        let t = Instant::now();
        let tok = self.text.tokenize(&conv, &tokens)?;
        self.metrics.observe_stage(Stage::Tokenize, t.elapsed());
        images.truncate(tok.kept_images);
        videos.truncate(tok.kept_videos);
        Ok(PreparedSample {
            sample_id,
            input_ids: tok.input_ids,
            labels: tok.labels,
            images,
            videos,
            text: tok.text,
            truncated: tok.truncated,
        })
    }

    async fn measure(
        self: &Arc<Self>,
        shard: &Shard,
        line: (u64, u64),
    ) -> Result<SampleShape, Cause> {
        let (conv, keys) = self.read_sample(shard, line).await?;
        let (preset, limits) = (&self.config.preset, &self.config.limits);
        let mut tokens = Vec::with_capacity(keys.len());
        let mut decoded_pixels = 0;
        for m in keys {
            match m {
                MediaKey::Image(key) => {
                    let header = self.image_header(&key).await?;
                    let refused = |err| image_cause(limits, &key, err);
                    let (w, h) = (header.width, header.height);
                    check_limits(w, h, limits.next_image(decoded_pixels)).map_err(refused)?;
                    decoded_pixels += u64::from(w) * u64::from(h);
                    let resized = preset.resized(header.upright()).map_err(refused)?;
                    tokens.push(MediaTokens::Image(preset.image_tokens(resized)));
                }
                MediaKey::Clip(key, part) => {
                    // The container's index may lie at its end: the whole object is read
                    // (never decoded).
                    let bytes = self.fetch(&key, None).await?;
                    let budget = VideoBudget {
                        limits: limits.video(),
                        pixels: limits.sample_pixels.saturating_sub(decoded_pixels),
                    };
                    let (preset, k) = (preset.clone(), key.clone());
                    let (t, used) = on_blocking_pool(move || {
                        video::measure_clip(bytes, &part, &preset, budget)
                            .map_err(|e| video_cause(&k, e))
                    })
                    .await?;
                    decoded_pixels += used;
                    tokens.push(MediaTokens::Video(t));
                }
                MediaKey::Frames(keys, part) => {
                    let mut size = None;
                    for key in &keys {
                        let header = self.image_header(key).await?;
                        let refused = |err| image_cause(limits, key, err);
                        let (w, h) = (header.width, header.height);
                        check_limits(w, h, limits.next_image(decoded_pixels)).map_err(refused)?;
                        decoded_pixels += u64::from(w) * u64::from(h);
                        let first = *size.get_or_insert(header.upright());
                        if header.upright() != first {
                            let (a, b) = (header.upright(), first);
                            let err = VideoError::Corrupt(format!(
                                "frame {key} is {}x{}, the list's first {}x{} (HxW): sizes may not change",
                                a.0, a.1, b.0, b.1
                            ));
                            return Err(video_cause(key, err));
                        }
                    }
                    let upright = size.expect("a frame list holds frames");
                    let left = limits.sample_pixels.saturating_sub(decoded_pixels);
                    let (t, _) =
                        video::measure_frame_list(keys.len(), upright, &part, preset, left)
                            .map_err(|e| video_cause(&keys[0], e))?;
                    tokens.push(MediaTokens::Video(t));
                }
            }
        }
        let tok = self.text.tokenize(&conv, &tokens)?;
        let kept = tok.kept_images + tok.kept_videos;
        let vision: usize = tokens[..kept]
            .iter()
            .map(|t| match t {
                MediaTokens::Image(n) => *n,
                MediaTokens::Video(v) => v.groups * v.per_group,
            })
            .sum();
        Ok(SampleShape {
            tokens: tok.input_ids.len() as u64,
            vision_tokens: vision as u64,
            images: tok.kept_images,
            videos: tok.kept_videos,
        })
    }

    /// An image's header: from its first bytes, or the whole object when they do not hold it.
    async fn image_header(&self, key: &str) -> Result<ImageHeader, Cause> {
        let image_error = |err| Cause::Image {
            key: key.to_string(),
            err,
        };
        let prefix = self.fetch(key, Some((0, HEADER_PREFIX))).await?;
        let complete = (prefix.len() as u64) < HEADER_PREFIX;
        if let Some(h) = read_header(&prefix, complete).map_err(image_error)? {
            return Ok(h);
        }
        let whole = self.fetch(key, None).await?;
        read_header(&whole, true)
            .map_err(image_error)?
            .ok_or_else(|| image_error(ImageError::Corrupt("no image header".into())))
    }

    /// Loads a rank slice's samples (concurrently, in order) and collates them, packed if the
    /// slice is. Under `OnError::Skip` failed samples are listed in `skipped` (a pack gets
    /// shorter); under `Fail`, and for a transient store failure always, the first failure is
    /// returned.
    pub async fn build_batch(self: &Arc<Self>, slice: &RankSlice) -> Result<Batch, SampleFailure> {
        let ids = &slice.samples;
        let mut pack_sizes = slice.packs.clone();
        // Each sample's pack, so a skipped sample shortens its own.
        let pack_of: Vec<usize> = slice
            .packs
            .iter()
            .flatten()
            .enumerate()
            .flat_map(|(p, &n)| std::iter::repeat_n(p, n))
            .collect();
        let mut pack_of = pack_of.into_iter();
        let results: Vec<Result<PreparedSample, SampleFailure>> =
            futures::stream::iter(ids.iter().copied())
                .map(|id| {
                    let this = self.clone();
                    async move { this.load_sample(id).await }
                })
                .buffered(self.config.sample_parallelism.clamp(1, ids.len().max(1)))
                .collect()
                .await;
        let mut samples = Vec::with_capacity(results.len());
        let mut skipped = Vec::new();
        for r in results {
            let pack = pack_of.next();
            match r {
                Ok(s) => samples.push(s),
                Err(f) if self.config.on_error == OnError::Skip && !f.transient => {
                    if let (Some(sizes), Some(p)) = (&mut pack_sizes, pack) {
                        sizes[p] -= 1;
                    }
                    tracing::warn!("skipping {f}");
                    skipped.push(Skipped {
                        sample_id: f.sample_id,
                        reason: f.to_string(),
                    })
                }
                Err(f) => return Err(f),
            }
        }
        let t = Instant::now();
        let pad = self.text.pad_id;
        let batch = match pack_sizes {
            Some(sizes) => {
                let dated = self.config.preset.video.timestamps;
                collate_packed(samples, &sizes, skipped, pad, self.rope_layout(), dated)
            }
            None => collate(samples, skipped, pad),
        };
        self.metrics.observe_stage(Stage::Collate, t.elapsed());
        Ok(batch)
    }

    fn rope_layout(&self) -> RopeLayout {
        let preset = &self.config.preset;
        RopeLayout {
            image_token: self.text.image_token(),
            video_token: self.text.video_token(),
            merge_size: preset.merge_size.into(),
            // The released Qwen2.5-VL checkpoints' vision_config.tokens_per_second.
            tokens_per_second: preset.video.second_per_grid.then_some(2),
        }
    }
}

/// What fixes a sample's tensors besides its data: preset, limits, tokenizer and template.
pub fn preprocessing_parts(config: &PipelineConfig, text_fingerprint: u64) -> [Vec<u8>; 3] {
    [
        serde_json::to_vec(&config.preset).expect("preset serializes"),
        serde_json::to_vec(&config.limits).expect("limits serialize"),
        text_fingerprint.to_le_bytes().to_vec(),
    ]
}

/// [`preprocessing_parts`] as one number: the lengths `--balance-ranks` reads must have been
/// measured with the same.
pub fn preprocessing_id(config: &PipelineConfig, text_fingerprint: u64) -> u64 {
    let parts = preprocessing_parts(config, text_fingerprint);
    crate::dataset::index::fingerprint(&parts)
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_in_preprocessing_becomes_the_samples_named_failure() {
        let err = on_blocking_pool::<()>(|| panic!("decoder bug in x.jpg"))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), SampleErrorKind::Panic);
        assert_eq!(
            err.to_string(),
            "preprocessing panicked: decoder bug in x.jpg"
        );
        assert_eq!(on_blocking_pool(|| Ok(7)).await.unwrap(), 7);
    }

    /// A killed worker's runtime cancels the blocking work still to start; the sample must
    /// fail as transient (asked again elsewhere), never be skipped as if its data were bad.
    #[tokio::test]
    async fn preprocessing_cancelled_by_shutdown_is_transient_never_a_skip() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let handle = rt.handle().clone();
        rt.shutdown_background();
        let cancelled = handle.spawn_blocking(|| ()).await.unwrap_err();
        assert!(cancelled.is_cancelled());
        let cause = blocking_failure(cancelled);
        assert_eq!(cause.kind(), SampleErrorKind::ShuttingDown);
        assert!(cause.is_transient());
        assert!(!Cause::Panicked("bug".into()).is_transient());
    }
}
