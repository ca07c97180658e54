//! Sample id → preprocessed sample → collated batch.
//!
//! Concurrency is matched to the stage: object-store reads are async and bounded by a
//! semaphore (`max_fetches`); decode, resize, patchify and tokenize run on the blocking pool,
//! bounded by a second semaphore sized to the cores. A request's samples are loaded
//! concurrently, so a slow object delays only its own batch, never other requests.

use crate::batch::PreparedSample;
use crate::byte_budget::ByteBudget;
use crate::cancel::Cancel;
use crate::dataset::index::{DatasetIndex, Shard};
use crate::dataset::sample::{Conversation, VideoPart};
use crate::failure::{image_cause, on_blocking_pool, video_cause, Cause};
use crate::limits::SampleLimits;
use crate::line_cache::{merge_spans, LineCache, Span, BLOCK_BYTES};
use crate::media_check::MediaCheck;
use crate::memory::{self, Account, Charge};
use crate::metrics::{GaugeGuard, Metrics, Queue, SampleErrorKind, Stage};
use crate::plan::Plan;
use crate::preprocess::preset::{PixelDtype, Preset};
use crate::preprocess::text::{MediaTokens, TextProcessor};
use crate::preprocess::video;
use crate::preprocess::video_error::VideoError;
use crate::preprocess::vision::{
    self, normalization_table, process_image, read_header, video_normalization_table, DecodeLimits,
    ImageError, ImageHeader, ImageTimings, PixelLut, Spent,
};
use crate::range_reader::{FetchRange, RangeReader};
use crate::source::{FetchError, MediaRoot, ReadCap, Store};
use parquet::arrow::arrow_reader::ArrowReaderMetadata;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use stoker_wire::DType;
use tokio::sync::Semaphore;

pub use crate::failure::SampleFailure;

mod read;

pub use stoker_config::OnError;

/// A clip's failure: the store's when a read failed (transient: asked again, never skipped),
/// else the clip's own.
fn clip_cause(key: &str, err: VideoError, failure: &Mutex<Option<FetchError>>) -> Cause {
    match failure.lock().expect("not poisoned").take() {
        Some(fetch) => Cause::Fetch(fetch),
        None => video_cause(key, err),
    }
}

/// float32s as little-endian bytes (the wire's).
fn le_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
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
    /// An image a Parquet row holds: its name for messages, and its bytes.
    Embedded(String, bytes::Bytes),
    Clip(String, VideoPart),
    Frames(Vec<String>, VideoPart),
}

/// An image's or video's bytes (a clip's are read by ranges as it is decoded).
enum Fetched {
    Image(String, bytes::Bytes),
    Clip(String, u64, VideoPart),
    Frames(Vec<(String, bytes::Bytes)>, VideoPart),
}

/// A medium checked from its header, not yet decoded (a clip is: its tokens need it).
enum Checked {
    Image(String, bytes::Bytes, ImageHeader, DecodeLimits),
    Frames(
        Vec<(String, bytes::Bytes, ImageHeader, DecodeLimits)>,
        VideoPart,
        u64,
    ),
    Clip(video::VideoOut),
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
    /// Shard text kept in memory (the line cache); 0 reads every line on its own, never
    /// merged with its request's neighbours.
    pub line_cache_bytes: u64,
    /// Keep each video's sampled frames as decoded (`dataset inspect` saves them).
    pub keep_decoded_frames: bool,
}

/// The line cache under [`TextReads::Lines`], whatever `--line-cache-mib` says: a request's
/// merged spans and those of a request asked again while they are fresh (a retry, a hedge's
/// twin). A line read for another request comes back only by chance, the cache's share of the
/// text (1.3 % for 256 MiB of 20 GB at 10^8 samples): more cache would only hold memory.
pub const LINES_CACHE_BYTES: u64 = 16 << 20;

/// How a worker reads its samples' text, chosen once from the dataset's text size, the line
/// cache and the plan (docs/design.md, "Reading text").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextReads {
    /// The whole text fits the line cache: 1 MiB blocks, each read once while it stays.
    Blocks,
    /// `--order runs`, unshaped: a run's lines with one read, which the rank's next steps
    /// take from the cache.
    Runs,
    /// Each line by its own range (a request's neighbours merged): the cache holds too
    /// little of the text for a block to be read again before it goes, and holds at most
    /// [`LINES_CACHE_BYTES`].
    Lines,
}

impl TextReads {
    /// What a worker with `cache_bytes` of line cache serving `text_bytes` of text with
    /// `plan` reads.
    pub fn choose(text_bytes: u64, cache_bytes: u64, plan: &Plan) -> TextReads {
        if cache_bytes > 0 && text_bytes <= cache_bytes {
            TextReads::Blocks
        } else if cache_bytes > 0 && plan.run_of(0).is_some() {
            TextReads::Runs
        } else {
            TextReads::Lines
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            TextReads::Blocks => "blocks",
            TextReads::Runs => "runs",
            TextReads::Lines => "lines",
        }
    }
}

pub struct Pipeline {
    pub store: Store,
    /// The stores of the media roots the index's shards name.
    media_roots: Vec<MediaRoot>,
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
    text_reads: TextReads,
    /// Each dataset's name and first sample id (one dataset unless mixed).
    datasets: Vec<(String, u64)>,
    /// Parquet shards' metadata, by key (at most [`read::PARQUET_FILES_CACHED`]).
    parquet_files: Mutex<HashMap<String, ArrowReaderMetadata>>,
}

impl Pipeline {
    /// `media_roots` holds every root the index's shards name (see
    /// [`DatasetIndex::media_roots`]).
    pub fn new(
        store: Store,
        media_roots: Vec<MediaRoot>,
        index: DatasetIndex,
        plan: Plan,
        text: TextProcessor,
        config: PipelineConfig,
        metrics: Arc<Metrics>,
    ) -> Self {
        metrics.dataset_samples.set(index.num_samples() as i64);
        metrics.dataset_bad_lines.set(index.bad_line_count as i64);
        let text_bytes: u64 = index.shards.iter().map(|s| s.size).sum();
        let text_reads = TextReads::choose(text_bytes, config.line_cache_bytes, &plan);
        let cache_bytes = match text_reads {
            TextReads::Lines => config.line_cache_bytes.min(LINES_CACHE_BYTES),
            TextReads::Blocks | TextReads::Runs => config.line_cache_bytes,
        };
        tracing::info!(
            "sample text read by {}: {text_bytes} bytes of text, {cache_bytes} of line cache",
            text_reads.as_str(),
        );
        Pipeline {
            lut: PixelLut::new(&config.preset),
            video_lut: PixelLut::for_videos(&config.preset),
            pixel_lut: (config.preset.pixel_dtype == PixelDtype::U8)
                .then(|| le_bytes(&normalization_table(&config.preset))),
            video_pixel_lut: (config.preset.pixel_dtype == PixelDtype::U8)
                .then(|| le_bytes(&video_normalization_table(&config.preset))),
            fetch_slots: Semaphore::new(config.max_fetches.max(1)),
            cpu_slots: Arc::new(Semaphore::new(config.cpu_threads.max(1))),
            line_cache: LineCache::new(cache_bytes),
            text_reads,
            datasets: vec![(store.describe(""), 0)],
            parquet_files: Mutex::default(),
            store,
            media_roots,
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
    /// The most bytes one sample may hold while it is prepared
    /// ([`SampleLimits::peak_sample_bytes`]).
    pub fn peak_sample_bytes(&self) -> u64 {
        let preset = &self.config.preset;
        let value_bytes = self.pixel_dtype().size() as u64;
        (self.config.limits).peak_sample_bytes(preset.max_pixels, value_bytes)
    }

    /// How this plan's media become tokens: what every batch is checked against, here before
    /// it is sent and by the client (the Welcome carries it).
    pub fn media_tokens(&self) -> stoker_wire::MediaTokens {
        let id = |t: i64| u32::try_from(t).expect("token ids fit in u32");
        stoker_wire::MediaTokens {
            image_token: id(self.text.image_token()),
            video_token: id(self.text.video_token()),
            merge_size: self.config.preset.merge_size,
        }
    }

    pub fn pixel_lut(&self) -> Option<&[u8]> {
        self.pixel_lut.as_deref()
    }

    /// The same for `pixel_values_videos` (`pixel_lut_videos`).
    pub fn video_pixel_lut(&self) -> Option<&[u8]> {
        self.video_pixel_lut.as_deref()
    }

    /// The store holding `key` (a media root's, for a key under it) and the key in it.
    fn store_for<'k>(&self, key: &'k str) -> (&Store, &'k str) {
        self.media_roots
            .iter()
            .find_map(|m| m.split(key))
            .unwrap_or((&self.store, key))
    }

    /// Reads a sample's line (`range`) or a whole image, at most `max_object_bytes` of it;
    /// a whole one is also taken from `sample_bytes` as it arrives.
    async fn fetch(
        &self,
        key: &str,
        range: Option<(u64, u64)>,
        sample_bytes: Option<&ByteBudget>,
    ) -> Result<bytes::Bytes, FetchError> {
        let (store, key) = self.store_for(key);
        let queued = self.metrics.queued(Queue::Fetch);
        let permit = self.fetch_slots.acquire().await.expect("never closed");
        drop(queued);
        let fetching = GaugeGuard::new(&self.metrics.fetches_in_flight);
        let t = Instant::now();
        let r = match range {
            Some((s, l)) => store.get_range(key, s, l).await,
            None => {
                let cap = ReadCap {
                    bytes: self.config.limits.object_bytes,
                    name: "max-object-bytes",
                };
                match sample_bytes {
                    Some(b) => store.get_within(key, cap, b, "max-sample-bytes").await,
                    None => store.get_at_most(key, cap).await,
                }
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

    /// The line cache's capacity and the bytes it holds now.
    pub fn line_cache_bytes(&self) -> (u64, u64) {
        (self.line_cache.capacity(), self.line_cache.held())
    }

    pub fn text_reads(&self) -> TextReads {
        self.text_reads
    }

    /// Loads and preprocesses one sample.
    pub async fn load_sample(
        self: &Arc<Self>,
        sample_id: u64,
    ) -> Result<PreparedSample, SampleFailure> {
        self.load_sample_of_request(sample_id, None).await
    }

    /// [`Pipeline::load_sample`], its line read with `span` (one that holds it, from
    /// [`Pipeline::request_spans`]) unless the cache holds it.
    pub(crate) async fn load_sample_of_request(
        self: &Arc<Self>,
        sample_id: u64,
        span: Option<Span>,
    ) -> Result<PreparedSample, SampleFailure> {
        let (shard, line, location) = self.locate(sample_id)?;
        let span = span.unwrap_or_else(|| self.text_span(sample_id, shard, line, self.text_reads));
        self.prepare(sample_id, shard, line, span)
            .await
            .map_err(|c| self.failure(sample_id, location, c))
    }

    /// The span each of a request's samples reads its line with: its own (by how this worker
    /// reads text) merged with its neighbours' in the request while that reads at most twice
    /// their bytes. `None` for a sample not in the index, and for all without a line cache
    /// (each line read on its own).
    pub(crate) fn request_spans(&self, ids: &[u64]) -> Vec<Option<Span>> {
        if self.line_cache.capacity() == 0 {
            return vec![None; ids.len()];
        }
        let own: Vec<Option<(usize, Span)>> = ids
            .iter()
            .map(|&id| {
                // The index's own lookup: a missing sample is counted once, when it is loaded.
                let (shard, line) = self.index.locate(id)?;
                // A Parquet row's pages go through the cache as arrow-rs asks for them.
                if shard.parquet.is_some() {
                    return None;
                }
                let span = self.text_span(id, shard, (line.offset, line.len), self.text_reads);
                Some((self.index.shard_of(id)?, span))
            })
            .collect();
        let found: Vec<(usize, Span)> = own.iter().flatten().copied().collect();
        let mut merged = merge_spans(&found).into_iter();
        own.iter().map(|o| o.and_then(|_| merged.next())).collect()
    }

    /// The span a sample's line (`(offset, len)` of `shard`) is read with under `reads`: its
    /// 1 MiB block (the line itself if it crosses one), its run's lines in its shard, or the
    /// line.
    fn text_span(&self, sample_id: u64, shard: &Shard, line: (u64, u64), reads: TextReads) -> Span {
        let own = Span {
            start: line.0,
            len: line.1,
        };
        match reads {
            TextReads::Blocks => {
                let start = line.0 / BLOCK_BYTES * BLOCK_BYTES;
                let block = Span {
                    start,
                    len: BLOCK_BYTES.min(shard.size.saturating_sub(start)),
                };
                match line.0 + line.1 <= block.end() {
                    true => block,
                    false => own,
                }
            }
            TextReads::Runs => {
                let ids = self
                    .plan
                    .run_of(sample_id)
                    .zip(self.index.shard_of(sample_id));
                let Some((run, shard)) = ids else {
                    return own;
                };
                let in_shard = self.index.shard_ids(shard);
                let first = self.index.locate(run.start.max(in_shard.start));
                let last = self.index.locate(run.end.min(in_shard.end) - 1);
                match (first, last) {
                    (Some((_, a)), Some((_, b))) => Span {
                        start: a.offset,
                        len: b.offset + b.len - a.offset,
                    },
                    _ => own,
                }
            }
            TextReads::Lines => own,
        }
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
        // Measured in id order (`stoker dataset stats`): blocks, each read once.
        let reads = match self.line_cache.capacity() {
            0 => TextReads::Lines,
            _ => TextReads::Blocks,
        };
        let span = self.text_span(sample_id, shard, line, reads);
        self.measure(shard, line, span)
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

    async fn prepare(
        self: &Arc<Self>,
        sample_id: u64,
        shard: &Shard,
        line: (u64, u64),
        span: Span,
    ) -> Result<PreparedSample, Cause> {
        let (conv, keys) = self.read_sample(shard, line, span).await?;
        let (media, read) = self.fetch_media(keys).await?;
        let account = memory::current();
        let fetched = Charge::on(account.as_ref(), read);

        let queued = self.metrics.queued(Queue::Cpu);
        let permit = self
            .cpu_slots
            .clone()
            .acquire_owned()
            .await
            .expect("never closed");
        drop(queued);
        // Dropped with this future (its request cancelled, late or disconnected), the guard
        // stops the blocking work, which holds the CPU slot, within one image or frame.
        let cancel = Cancel::default();
        let _stop_when_dropped = cancel.on_drop();
        let this = self.clone();
        on_blocking_pool(move || {
            let _permit = permit;
            let prepared = this.preprocess(sample_id, conv, media, &cancel, account.as_ref());
            drop(fetched);
            if prepared.is_err() && cancel.is_set() {
                // Counted here: nobody is left to count the sample's failure.
                let stopped = SampleErrorKind::Cancelled.as_str();
                this.metrics
                    .sample_errors_total
                    .with_label_values(&[stopped])
                    .inc();
            }
            prepared
        })
        .await
    }

    /// The CPU part: every image and video checked from its header (a clip decoded: its
    /// tokens need its container), the text tokenized and truncated, then the images and
    /// frame lists it keeps decoded, resized and patchified. What it decodes and prepares is
    /// charged to `account` (the prepared pixels kept until the batch is sent).
    fn preprocess(
        self: &Arc<Self>,
        sample_id: u64,
        conv: Conversation,
        media: Vec<Fetched>,
        cancel: &Cancel,
        account: Option<&Arc<Account>>,
    ) -> Result<PreparedSample, Cause> {
        let keep = |pixels: &vision::PixelBuf| {
            if let Some(a) = account {
                a.keep(pixels.as_bytes().len() as u64);
            }
        };
        let preset = &self.config.preset;
        let limits = &self.config.limits;
        let mut timings = ImageTimings::default();
        let mut tokens = Vec::with_capacity(media.len());
        let mut checked = Vec::with_capacity(media.len());
        let mut check = MediaCheck::new(preset, limits);
        let keep_frames = self.config.keep_decoded_frames;
        let go_on = || match cancel.is_set() {
            true => Err(Cause::Cancelled),
            false => Ok(()),
        };
        for m in media {
            go_on()?;
            match m {
                Fetched::Image(key, bytes) => {
                    let header = whole_header(&key, &bytes)?;
                    let (decode, t) = check.image(&key, &header)?;
                    tokens.push(t);
                    checked.push(Checked::Image(key, bytes, header, decode));
                }
                Fetched::Clip(key, size, part) => {
                    let t = Instant::now();
                    let budget = check.next_clip();
                    let lut = &self.video_lut;
                    let failure = Arc::default();
                    let open = || self.clip_reader(&key, size, &failure);
                    let out =
                        video::process_clip(open, &part, preset, lut, budget, keep_frames, cancel)
                            .map_err(|e| clip_cause(&key, e, &failure))?;
                    keep(&out.pixels);
                    timings.decode += t.elapsed();
                    check.spend(Spent {
                        pixels: out.rows as u64
                            * u64::from(preset.patch_size.pow(2))
                            * u64::from(preset.temporal_patch_size),
                        work: out.work,
                    });
                    tokens.push(MediaTokens::Video(out.tokens(preset)));
                    checked.push(Checked::Clip(out));
                }
                Fetched::Frames(frames, part) => {
                    let mut size = None;
                    let mut listed = Vec::with_capacity(frames.len());
                    for (key, bytes) in frames {
                        let header = whole_header(&key, &bytes)?;
                        let decode = check.frame(&key, &header, &mut size)?;
                        listed.push((key, bytes, header, decode));
                    }
                    let upright = size.expect("a frame list holds frames");
                    let (t, left) = check.frame_list(&listed[0].0, listed.len(), upright, &part)?;
                    tokens.push(t);
                    checked.push(Checked::Frames(listed, part, left));
                }
            }
        }
        go_on()?;
        let t = Instant::now();
        let tok = self.text.tokenize(&conv, &tokens)?;
        self.metrics.observe_stage(Stage::Tokenize, t.elapsed());
        // What the truncation keeps is decoded; the rest never is.
        let mut images = Vec::with_capacity(tok.kept_images);
        let mut videos = Vec::with_capacity(tok.kept_videos);
        for c in checked {
            match c {
                Checked::Image(key, bytes, header, decode) if images.len() < tok.kept_images => {
                    go_on()?;
                    let decoding = Charge::on(account, decoded_bytes(&header));
                    let out = process_image(&bytes, preset, &self.lut, decode, &mut timings)
                        .map_err(|err| image_cause(limits, &key, err))?;
                    drop(decoding);
                    as_its_header_says(&key, &header, out.original)?;
                    keep(&out.pixels);
                    images.push(out);
                }
                Checked::Frames(listed, part, left) if videos.len() < tok.kept_videos => {
                    let first = listed[0].0.clone();
                    let mut decoded = Vec::with_capacity(listed.len());
                    let mut decoding = Vec::with_capacity(listed.len());
                    for (key, bytes, header, decode) in listed {
                        go_on()?;
                        decoding.push(Charge::on(account, decoded_bytes(&header)));
                        let t = Instant::now();
                        let rgb = vision::decode(&bytes, decode)
                            .map_err(|err| image_cause(limits, &key, err))?;
                        timings.decode += t.elapsed();
                        as_its_header_says(&key, &header, (rgb.height as u32, rgb.width as u32))?;
                        decoded.push(rgb);
                    }
                    let lut = &self.video_lut;
                    let out =
                        video::process_frame_list(decoded, &part, preset, lut, left, keep_frames)
                            .map_err(|e| video_cause(&first, e))?;
                    drop(decoding);
                    keep(&out.pixels);
                    videos.push(out);
                }
                Checked::Clip(out) if videos.len() < tok.kept_videos => videos.push(out),
                Checked::Image(..) | Checked::Frames(..) | Checked::Clip(_) => {}
            }
        }
        if !tokens.is_empty() {
            self.metrics.observe_stage(Stage::Decode, timings.decode);
            self.metrics.observe_stage(Stage::Resize, timings.resize);
        }
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
        span: Span,
    ) -> Result<SampleShape, Cause> {
        let (conv, keys) = self.read_sample(shard, line, span).await?;
        let mut tokens = Vec::with_capacity(keys.len());
        let mut check = MediaCheck::new(&self.config.preset, &self.config.limits);
        for m in keys {
            match m {
                MediaKey::Image(key) => {
                    let header = self.image_header(&key).await?;
                    tokens.push(check.image(&key, &header)?.1);
                }
                MediaKey::Embedded(name, bytes) => {
                    let header = whole_header(&name, &bytes)?;
                    tokens.push(check.image(&name, &header)?.1);
                }
                MediaKey::Clip(key, part) => {
                    // Only what the container's header needs is read (never a frame decoded).
                    let size = self.clip_size(&key).await?;
                    let budget = check.next_clip();
                    let this = self.clone();
                    let (t, cost) = on_blocking_pool(move || {
                        let failure = Arc::default();
                        let reader = this.clip_reader(&key, size, &failure);
                        video::measure_clip(reader, &part, &this.config.preset, budget)
                            .map_err(|e| clip_cause(&key, e, &failure))
                    })
                    .await?;
                    check.spend(cost);
                    tokens.push(MediaTokens::Video(t));
                }
                MediaKey::Frames(keys, part) => {
                    let mut size = None;
                    for key in &keys {
                        let header = self.image_header(key).await?;
                        check.frame(key, &header, &mut size)?;
                    }
                    let upright = size.expect("a frame list holds frames");
                    tokens.push(check.frame_list(&keys[0], keys.len(), upright, &part)?.0);
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

    /// A clip's size, from one HEAD, within `max_object_bytes`.
    async fn clip_size(&self, key: &str) -> Result<u64, FetchError> {
        let (store, key) = self.store_for(key);
        let size = store.head(key).await?.size;
        let max = self.config.limits.object_bytes;
        if size > max {
            let what = store.describe(key);
            return Err(FetchError::TooLarge {
                what,
                len: size,
                max,
                limit: "max-object-bytes",
            });
        }
        Ok(size)
    }

    /// A clip read by ranges through this pipeline's reads, from blocking code (the demuxer's).
    fn clip_reader(
        self: &Arc<Self>,
        key: &str,
        size: u64,
        failure: &Arc<Mutex<Option<FetchError>>>,
    ) -> RangeReader {
        let (this, key) = (self.clone(), key.to_string());
        let runtime = tokio::runtime::Handle::current();
        let fetch: FetchRange = Box::new(move |start, len| {
            runtime.block_on(this.fetch(&key, Some((start, len)), None))
        });
        RangeReader::new(size, fetch, failure.clone())
    }

    /// An image's header: from its first bytes, or the whole object when they do not hold it.
    async fn image_header(&self, key: &str) -> Result<ImageHeader, Cause> {
        let image_error = |err| Cause::Image {
            key: key.to_string(),
            err,
        };
        let prefix = self.fetch(key, Some((0, HEADER_PREFIX)), None).await?;
        let complete = (prefix.len() as u64) < HEADER_PREFIX;
        if let Some(h) = read_header(&prefix, complete).map_err(image_error)? {
            return Ok(h);
        }
        let whole = self.fetch(key, None, None).await?;
        whole_header(key, &whole)
    }
}

/// An image's or frame's header from its whole bytes.
/// An image decoded to 8-bit RGB, as the sample holds it until it is resized.
fn decoded_bytes(header: &ImageHeader) -> u64 {
    u64::from(header.width) * u64::from(header.height) * 3
}

fn whole_header(key: &str, bytes: &[u8]) -> Result<ImageHeader, Cause> {
    let image_error = |err| Cause::Image {
        key: key.to_string(),
        err,
    };
    read_header(bytes, true)
        .map_err(image_error)?
        .ok_or_else(|| image_error(ImageError::Corrupt("no image header".into())))
}

/// A decoded image's (height, width) is the one its header gave, from which its tokens were
/// counted: otherwise the batch would not add up.
fn as_its_header_says(key: &str, header: &ImageHeader, decoded: (u32, u32)) -> Result<(), Cause> {
    match decoded == header.upright() {
        true => Ok(()),
        false => Err(Cause::Image {
            key: key.to_string(),
            err: ImageError::Corrupt(format!(
                "it decodes to {}x{} (HxW), its header says {}x{}",
                decoded.0,
                decoded.1,
                header.upright().0,
                header.upright().1
            )),
        }),
    }
}
