//! The worker's configuration, defined once.
//!
//! Three things must agree on every worker setting: the `DataPipeline` CRD's schema (derived
//! from these types with schemars), the `stoker worker` command line (derived with clap, behind
//! the `clap` feature so the data-plane library and the operator carry no CLI code), and the
//! arguments the operator writes into the worker Deployment ([`WorkerConfig::to_args`], the one
//! place a flag is spelled). Tests parse `to_args()` back with clap and compare.
//!
//! Defaults live here too, as constants both serde and clap read.

#![forbid(unsafe_code)]

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub const DEFAULT_MAX_IMAGE_SIDE: u32 = 16_384;
pub const DEFAULT_MAX_IMAGE_PIXELS: u64 = 64 << 20;
pub const DEFAULT_MAX_IMAGES_PER_SAMPLE: u32 = 64;
pub const DEFAULT_MAX_SAMPLE_PIXELS: u64 = 256 << 20;
pub const DEFAULT_MAX_OBJECT_BYTES: u64 = 64 << 20;
/// 256 MiB: 64 photos of 4 MB, or a frame list of 768 frames (its most) of 300 KB.
pub const DEFAULT_MAX_SAMPLE_BYTES: u64 = 256 << 20;
pub const DEFAULT_MAX_LINE_BYTES: u64 = 4 << 20;
pub const DEFAULT_MAX_TURNS: u32 = 512;
pub const DEFAULT_MAX_VIDEO_FRAMES: u64 = 36_000;
/// 128 Gi pixel passes: a 10-minute 1080p clip at 60 fps decoded whole (75 G), a 4K photo
/// (8 M) of 100 progressive scans (0.8 G), with room for the sample's other media.
pub const DEFAULT_MAX_SAMPLE_WORK: u64 = 128 << 30;
pub const DEFAULT_S3_READ_TIMEOUT_S: u64 = 20;
pub const DEFAULT_GLOBAL_BATCH_SIZE: u32 = 32;
pub const DEFAULT_MAX_FETCHES: usize = 64;
pub const DEFAULT_LINE_CACHE_MIB: u64 = 256;
pub const DEFAULT_MAX_INFLIGHT_PER_CONN: u32 = 8;
pub const DEFAULT_MAX_CONNECTIONS: u32 = 1024;
pub const DEFAULT_LINKS_PER_RANK: u32 = 0;
pub const DEFAULT_IDLE_TIMEOUT_S: u64 = 600;
/// Bytes of samples being prepared and batches waiting to be sent, per worker.
pub const DEFAULT_MAX_WORKER_BYTES: u64 = 2 << 30;
/// How long a peer may take no bytes while an answer waits.
pub const DEFAULT_SEND_TIMEOUT_S: u64 = 60;
/// Bounds of the serving limits (the CRD schema, the worker's flags and the operator's check).
pub const MAX_INFLIGHT_PER_CONN_LIMIT: u32 = 1024;
pub const MAX_CONNECTIONS_LIMIT: u32 = 65_536;
pub const LINKS_PER_RANK_LIMIT: u32 = 1024;
pub const DEFAULT_DRAIN_TIMEOUT_S: u64 = 30;

/// The local cache the scripts fill and the binaries and tests read: `$STOKER_CACHE`, else
/// `~/.cache/stoker` (scripts/lib.sh spells the same rule), so an empty `STOKER_CACHE` is a
/// fresh machine for the scripts and the binaries alike.
pub fn cache_root() -> std::path::PathBuf {
    match std::env::var_os("STOKER_CACHE") {
        Some(dir) if !dir.is_empty() => dir.into(),
        _ => std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| ".".into()))
            .join(".cache/stoker"),
    }
}

/// Model family: patch size, normalization, resize bounds and chat format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum PresetName {
    #[default]
    #[serde(rename = "qwen2-vl")]
    #[cfg_attr(feature = "clap", value(name = "qwen2-vl"))]
    Qwen2Vl,
    #[serde(rename = "qwen2.5-vl")]
    #[cfg_attr(feature = "clap", value(name = "qwen2.5-vl"))]
    Qwen25Vl,
    #[serde(rename = "qwen3-vl")]
    #[cfg_attr(feature = "clap", value(name = "qwen3-vl"))]
    Qwen3Vl,
}

impl PresetName {
    /// The name as users write it (`--preset`, `spec.preprocessing.preset`).
    pub fn as_str(self) -> &'static str {
        match self {
            PresetName::Qwen2Vl => "qwen2-vl",
            PresetName::Qwen25Vl => "qwen2.5-vl",
            PresetName::Qwen3Vl => "qwen3-vl",
        }
    }
}

/// `pixel_values` on the wire. u8 (the default): resized, patchified 8-bit pixels plus the
/// normalization table, normalized on the rank by the client (bit-identical to the
/// processor's float32) — a quarter of f32's bytes for the worker to write, the NIC to carry
/// and the rank to receive. f32 / bf16: normalized on the worker, 4 / 2 bytes per value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum PixelDtype {
    /// Normalized float32, what transformers returns.
    F32,
    /// Normalized bfloat16: half the bytes.
    Bf16,
    /// Raw resized pixels; normalization is left to the GPU: a quarter of the bytes.
    U8,
}

impl PixelDtype {
    pub fn as_str(self) -> &'static str {
        match self {
            PixelDtype::F32 => "f32",
            PixelDtype::Bf16 => "bf16",
            PixelDtype::U8 => "u8",
        }
    }
}

/// How an epoch's sample order is drawn (either is a pure function of seed and epoch).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum SampleOrder {
    /// A Fisher–Yates shuffle of the whole epoch, held in memory (4 bytes per sample) and
    /// built once per epoch, ahead of the boundary and off the serving threads. The order of
    /// earlier releases: stored resume states keep their plan.
    #[default]
    Shuffle,
    /// A keyed Feistel permutation: each position's sample is computed on its own, so there
    /// is no array to hold and nothing to build at an epoch boundary (for 10^7 samples and
    /// more). Another plan than `shuffle`, with its own plan id.
    Feistel,
    /// Runs of neighbouring lines (`--run-lines` each) in a keyed order, one run per slot
    /// of a global batch for as many steps as a run has lines: every global batch draws
    /// from as many runs as it has samples, and a rank's slots keep their runs, so its
    /// worker reads each run's text once (one ranged GET for many samples). Holds nothing
    /// (the runs' order is a Feistel permutation). For datasets whose text is much larger
    /// than the workers' line cache (10^8 samples); another plan, with its own plan id.
    Runs,
}

impl SampleOrder {
    fn is_shuffle(&self) -> bool {
        *self == SampleOrder::Shuffle
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SampleOrder::Shuffle => "shuffle",
            SampleOrder::Feistel => "feistel",
            SampleOrder::Runs => "runs",
        }
    }
}

/// What to do with a sample that cannot be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum OnError {
    /// Serve the batch without it, naming it in the batch's `skipped` list (and a metric).
    #[default]
    Skip,
    /// Fail the whole request with an error naming the sample.
    Fail,
}

impl OnError {
    pub fn as_str(self) -> &'static str {
        match self {
            OnError::Skip => "skip",
            OnError::Fail => "fail",
        }
    }
}

/// Connection settings for an S3-compatible store; credentials come from the standard chain
/// (environment, profile, web identity, instance metadata).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
#[serde(rename_all = "camelCase")]
pub struct S3Connection {
    /// Endpoint of an S3-compatible store (MinIO, Ceph, R2, an embedded server); absent: AWS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "clap", arg(long = "s3-endpoint", env = "AWS_ENDPOINT_URL"))]
    pub endpoint: Option<String>,
    /// Region; absent: from the environment, else us-east-1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "clap", arg(long = "s3-region", env = "AWS_REGION"))]
    pub region: Option<String>,
    /// Path-style addressing (http://host/bucket/key), needed by most non-AWS stores.
    #[serde(default)]
    #[cfg_attr(feature = "clap", arg(long = "s3-path-style"))]
    pub path_style: bool,
    /// A response that does not start, or a body that delivers no byte, for this long is a
    /// transient failure (retried; never a skip): a stalled store never holds a request.
    #[serde(default = "default_s3_read_timeout_s")]
    #[schemars(range(min = 1))]
    #[cfg_attr(
        feature = "clap",
        arg(long = "s3-read-timeout-s", default_value_t = DEFAULT_S3_READ_TIMEOUT_S)
    )]
    pub read_timeout_s: u64,
    /// Static (access key, secret key), for in-process use only; never in a spec or a flag.
    #[serde(skip)]
    #[schemars(skip)]
    #[cfg_attr(feature = "clap", arg(skip))]
    pub static_credentials: Option<(String, String)>,
}

impl Default for S3Connection {
    fn default() -> Self {
        S3Connection {
            endpoint: None,
            region: None,
            path_style: false,
            read_timeout_s: DEFAULT_S3_READ_TIMEOUT_S,
            static_credentials: None,
        }
    }
}

fn default_s3_read_timeout_s() -> u64 {
    DEFAULT_S3_READ_TIMEOUT_S
}

/// How samples are preprocessed: the model family's processor, with overrides. Together with
/// the tokenizer it fixes the bytes of every sample.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "!has(self.minPixels) || !has(self.maxPixels) || self.minPixels <= self.maxPixels",
    "message": "preprocessing.minPixels must not exceed maxPixels"
}]))]
pub struct Preprocessing {
    /// Model family: sets patch size, normalization, resize bounds and chat format.
    #[serde(default)]
    #[cfg_attr(feature = "clap", arg(long, value_enum, default_value = "qwen2-vl"))]
    pub preset: PresetName,
    /// Lower bound on resized pixels per image; absent: the preset's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    #[cfg_attr(feature = "clap", arg(long))]
    pub min_pixels: Option<u64>,
    /// Upper bound on resized pixels per image; absent: the preset's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    #[cfg_attr(feature = "clap", arg(long))]
    pub max_pixels: Option<u64>,
    /// Lower bound on a video's resized pixels (per frame for qwen2-vl and qwen2.5-vl, for
    /// the whole video for qwen3-vl: the video processor's `size.shortest_edge`); absent: the
    /// preset's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    #[cfg_attr(feature = "clap", arg(long))]
    pub video_min_pixels: Option<u64>,
    /// Upper bound on a video's resized pixels (`size.longest_edge`, per frame or whole video
    /// as above); absent: the preset's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    #[cfg_attr(feature = "clap", arg(long))]
    pub video_max_pixels: Option<u64>,
    /// pixel_values dtype on the wire; absent: u8, normalized on the rank (the client's
    /// `pixel_values()`, bit-identical to the processor's float32) with 4x fewer bytes than
    /// f32 to write, send and receive; f32 or bf16 normalize on the worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "clap", arg(long, value_enum))]
    pub pixel_dtype: Option<PixelDtype>,
    /// Longest token sequence per sample (docs/preprocessing.md describes truncation);
    /// absent: the preset's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 16))]
    #[cfg_attr(feature = "clap", arg(long))]
    pub max_length: Option<u32>,
    /// The model's tokenizer.json, or a folder holding it: s3://bucket/path/tokenizer.json
    /// (fetched by each worker at start with the source's S3 settings, checked and cached), or
    /// a local path (in a container: the image or a mounted volume). Absent: $STOKER_TOKENIZER,
    /// else qwen-tokenizer in the cache ($STOKER_CACHE, default ~/.cache/stoker) as
    /// scripts/setup-tokenizer.sh installs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "clap", arg(long))]
    pub tokenizer: Option<String>,
    /// Chat template override: a .jinja file, chat_template.json or tokenizer_config.json
    /// (a local path). Absent: the preset's own template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "clap", arg(long))]
    pub template: Option<String>,
    /// Largest image side accepted for decoding (decompression-bomb guard).
    #[serde(default = "default_max_image_side")]
    #[schemars(range(min = 1))]
    #[cfg_attr(feature = "clap", arg(long, default_value_t = DEFAULT_MAX_IMAGE_SIDE))]
    pub max_image_side: u32,
    /// Largest decoded image, in pixels (decompression-bomb guard).
    #[serde(default = "default_max_image_pixels")]
    #[schemars(range(min = 1))]
    #[cfg_attr(feature = "clap", arg(long, default_value_t = DEFAULT_MAX_IMAGE_PIXELS))]
    pub max_image_pixels: u64,
    /// Most images one sample may hold; a sample with more is skipped, named
    /// (`too_many_images`).
    #[serde(default = "default_max_images_per_sample")]
    #[schemars(range(min = 1))]
    #[cfg_attr(feature = "clap", arg(long, default_value_t = DEFAULT_MAX_IMAGES_PER_SAMPLE))]
    pub max_images_per_sample: u32,
    /// Most decoded pixels of one sample's images together; checked from each image's header
    /// before it is decoded (`sample_too_large`).
    #[serde(default = "default_max_sample_pixels")]
    #[schemars(range(min = 1))]
    #[cfg_attr(feature = "clap", arg(long, default_value_t = DEFAULT_MAX_SAMPLE_PIXELS))]
    pub max_sample_pixels: u64,
    /// Largest object (image) read, in bytes; a bigger one is refused from its length, its
    /// body is never read into memory (`object_too_large`).
    #[serde(default = "default_max_object_bytes")]
    #[schemars(range(min = 1))]
    #[cfg_attr(feature = "clap", arg(long, default_value_t = DEFAULT_MAX_OBJECT_BYTES))]
    pub max_object_bytes: u64,
    /// Most bytes of one sample's images and frame lists' frames together, each object
    /// counted once however often the sample names it; counted as the bytes arrive, so a
    /// read stops at the budget (`sample_over_byte_budget`). Clips are read by ranges, a
    /// block at a time, and are not counted.
    #[serde(default = "default_max_sample_bytes")]
    #[schemars(range(min = 1))]
    #[cfg_attr(feature = "clap", arg(long, default_value_t = DEFAULT_MAX_SAMPLE_BYTES))]
    pub max_sample_bytes: u64,
    /// Longest JSONL line (one sample's text), in bytes; a longer one is skipped from the
    /// index's length without being read (`line_too_long`).
    #[serde(default = "default_max_line_bytes")]
    #[schemars(range(min = 1))]
    #[cfg_attr(feature = "clap", arg(long, default_value_t = DEFAULT_MAX_LINE_BYTES))]
    pub max_line_bytes: u64,
    /// Most messages (turns) one conversation may hold (`too_many_turns`).
    #[serde(default = "default_max_turns")]
    #[schemars(range(min = 1))]
    #[cfg_attr(feature = "clap", arg(long, default_value_t = DEFAULT_MAX_TURNS))]
    pub max_turns: u32,
    /// Most frames a video's stream may hold (20 minutes at 30 fps): decoding runs through
    /// every frame up to the last one sampled, so this bounds a clip's work; checked from the
    /// container's header before decoding (`video_too_long`).
    #[serde(default = "default_max_video_frames")]
    #[schemars(range(min = 1))]
    #[cfg_attr(feature = "clap", arg(long, default_value_t = DEFAULT_MAX_VIDEO_FRAMES))]
    pub max_video_frames: u64,
    /// Most decoding work one sample may cost, in pixel passes: an image's pixels times its
    /// scans (a progressive JPEG decodes the image once per scan), a clip's frame pixels times
    /// the frames decoded (every frame up to the last one sampled). Charged from each
    /// medium's header before it is decoded, so every worker skips the same samples
    /// (`sample_over_work_budget`).
    #[serde(default = "default_max_sample_work")]
    #[schemars(range(min = 1))]
    #[cfg_attr(feature = "clap", arg(long, default_value_t = DEFAULT_MAX_SAMPLE_WORK))]
    pub max_sample_work: u64,
}

fn default_max_video_frames() -> u64 {
    DEFAULT_MAX_VIDEO_FRAMES
}

fn default_max_sample_work() -> u64 {
    DEFAULT_MAX_SAMPLE_WORK
}

fn default_max_image_side() -> u32 {
    DEFAULT_MAX_IMAGE_SIDE
}

fn default_max_image_pixels() -> u64 {
    DEFAULT_MAX_IMAGE_PIXELS
}

fn default_max_images_per_sample() -> u32 {
    DEFAULT_MAX_IMAGES_PER_SAMPLE
}

fn default_max_sample_pixels() -> u64 {
    DEFAULT_MAX_SAMPLE_PIXELS
}

fn default_max_object_bytes() -> u64 {
    DEFAULT_MAX_OBJECT_BYTES
}

fn default_max_sample_bytes() -> u64 {
    DEFAULT_MAX_SAMPLE_BYTES
}

fn default_max_line_bytes() -> u64 {
    DEFAULT_MAX_LINE_BYTES
}

fn default_max_turns() -> u32 {
    DEFAULT_MAX_TURNS
}

impl Default for Preprocessing {
    fn default() -> Self {
        Preprocessing {
            preset: PresetName::default(),
            min_pixels: None,
            max_pixels: None,
            video_min_pixels: None,
            video_max_pixels: None,
            pixel_dtype: None,
            max_length: None,
            tokenizer: None,
            template: None,
            max_image_side: DEFAULT_MAX_IMAGE_SIDE,
            max_image_pixels: DEFAULT_MAX_IMAGE_PIXELS,
            max_images_per_sample: DEFAULT_MAX_IMAGES_PER_SAMPLE,
            max_sample_pixels: DEFAULT_MAX_SAMPLE_PIXELS,
            max_object_bytes: DEFAULT_MAX_OBJECT_BYTES,
            max_sample_bytes: DEFAULT_MAX_SAMPLE_BYTES,
            max_line_bytes: DEFAULT_MAX_LINE_BYTES,
            max_turns: DEFAULT_MAX_TURNS,
            max_video_frames: DEFAULT_MAX_VIDEO_FRAMES,
            max_sample_work: DEFAULT_MAX_SAMPLE_WORK,
        }
    }
}

/// The deterministic sample order and what happens to a sample that cannot be served.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
#[serde(rename_all = "camelCase")]
pub struct Sampling {
    /// Seed of the sample order (with the epoch, it fixes every batch).
    #[serde(default)]
    #[cfg_attr(feature = "clap", arg(long, default_value_t = 0))]
    pub seed: u64,
    /// Samples per global batch, all ranks together.
    #[schemars(range(min = 1))]
    #[cfg_attr(feature = "clap", arg(long, default_value_t = DEFAULT_GLOBAL_BATCH_SIZE))]
    pub global_batch_size: u32,
    /// A sample that cannot be served: skip it (named in the batch and counted) or fail the
    /// request.
    #[serde(default)]
    #[cfg_attr(feature = "clap", arg(long, value_enum, default_value = "skip"))]
    pub on_error: OnError,
    /// How each epoch's order is drawn: `shuffle` (in memory, 4 bytes per sample, built once
    /// per epoch), `feistel` (computed per position: no memory, no build at an epoch
    /// boundary; for 10^7 samples and more) or `runs` (runs of `runLines` neighbouring lines,
    /// each read with one request: for text much larger than the line cache, 10^8 samples).
    #[serde(default, skip_serializing_if = "SampleOrder::is_shuffle")]
    #[cfg_attr(feature = "clap", arg(long, value_enum, default_value = "shuffle"))]
    pub order: SampleOrder,
    /// With order `runs`: lines per run. A rank's slot takes a run's lines on as many
    /// consecutive steps (in a shuffled order within the run), and its worker reads them with
    /// one request: 1/runLines text requests per sample.
    #[serde(
        default = "default_run_lines",
        skip_serializing_if = "is_default_run_lines"
    )]
    #[schemars(range(min = 1, max = 4096))]
    #[cfg_attr(feature = "clap", arg(long, default_value_t = DEFAULT_RUN_LINES, value_parser = clap::value_parser!(u32).range(1..=4096)))]
    pub run_lines: u32,
    /// Assign each global batch's samples to ranks by token cost (longest first, to the
    /// lightest rank; equal sample counts), so no rank waits on a heavier slice. The global
    /// batches themselves do not change, so resume at another world size still holds. Needs
    /// the dataset's lengths for these preprocessing settings (`stoker dataset stats DATA
    /// --write-lengths`, stoker-lengths.bin at the dataset root).
    #[serde(default)]
    #[cfg_attr(feature = "clap", arg(long))]
    pub balance_ranks: bool,
    /// Make each global batch's samples similar in length: windows of 32 global batches of the
    /// shuffled order are sorted by length, cut into batches, and those shuffled (less padding
    /// for trainers that cannot take packed input; the order is still a function of seed and
    /// epoch). Needs the dataset's lengths, as `balanceRanks` does.
    #[serde(default)]
    #[cfg_attr(feature = "clap", arg(long))]
    pub bucket_by_length: bool,
    /// Pack each rank's samples into sequences of at most this many tokens, for varlen
    /// attention: a rank's batch is its packs (every rank gets the same number per global
    /// batch, balanced by token cost), each row with `cu_seqlens` and position ids that
    /// restart at every sample (Qwen-VL's rope rows as the model computes them for that
    /// sample alone). Must be at least the longest sample's length. Needs the dataset's
    /// lengths, as `balanceRanks` does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    #[cfg_attr(feature = "clap", arg(long))]
    pub pack_max_tokens: Option<u32>,
    /// More datasets mixed into the plan with the main one (`--mix s3://bucket/vqa=1`, once
    /// per dataset, `--mix s3://bucket/vqa=1,media-root=s3://images/coco` for one whose media
    /// lie apart; all in the main dataset's bucket, or all local folders). An epoch draws
    /// as many samples as all the datasets hold, each dataset's share by weight, shuffled
    /// together by (seed, epoch); a dataset drawn more often than it has samples starts its
    /// own next epoch (a new shuffle), one drawn less often continues where it stopped.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[cfg_attr(feature = "clap", arg(long, value_name = "DATA=WEIGHT"))]
    pub mix: Vec<MixSource>,
    /// The main dataset's weight when others are mixed in.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    #[schemars(range(min = 1))]
    #[cfg_attr(feature = "clap", arg(long, default_value_t = 1))]
    pub data_weight: u32,
}

/// Lines per run of the `runs` order: text requests per sample 1/32 (≤ 0.05 with a few
/// positions answered elsewhere), and a rank's slot sees 32 neighbouring lines in 32 steps.
pub const DEFAULT_RUN_LINES: u32 = 32;

fn default_run_lines() -> u32 {
    DEFAULT_RUN_LINES
}

fn is_default_run_lines(n: &u32) -> bool {
    *n == DEFAULT_RUN_LINES
}

fn one() -> u32 {
    1
}

fn is_one(v: &u32) -> bool {
    *v == 1
}

/// A dataset mixed into the plan, and its weight (relative to the others').
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MixSource {
    /// s3://bucket/prefix in the main dataset's bucket (read with its connection), or a local
    /// folder; in a DataPipeline whose source is a volume, a folder inside the volume.
    pub data: String,
    /// Its share of each epoch's draws, relative to the other datasets' weights.
    #[schemars(range(min = 1))]
    pub weight: u32,
    /// Where its samples' media paths resolve, when not beside its shards (as the main
    /// dataset's media root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_root: Option<String>,
}

/// What follows a mixed dataset's weight when it has a media root.
const MIX_MEDIA_ROOT: &str = ",media-root=";

impl std::str::FromStr for MixSource {
    type Err = String;
    /// `DATA=WEIGHT` or `DATA=WEIGHT,media-root=URI`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (s, media_root) = match s.split_once(MIX_MEDIA_ROOT) {
            Some((_, "")) => return Err(format!("{s:?}: media-root= names no folder")),
            Some((s, root)) => (s, Some(root.to_string())),
            None => (s, None),
        };
        let (data, weight) = s
            .rsplit_once('=')
            .ok_or_else(|| format!("{s:?}: expected DATA=WEIGHT, e.g. s3://bucket/vqa=1"))?;
        let weight = weight
            .parse()
            .ok()
            .filter(|&w| w > 0)
            .ok_or_else(|| format!("{s:?}: the weight must be a whole number above 0"))?;
        Ok(MixSource {
            data: data.to_string(),
            weight,
            media_root,
        })
    }
}

impl std::fmt::Display for MixSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.data, self.weight)?;
        match &self.media_root {
            Some(root) => write!(f, "{MIX_MEDIA_ROOT}{root}"),
            None => Ok(()),
        }
    }
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            seed: 0,
            global_batch_size: DEFAULT_GLOBAL_BATCH_SIZE,
            on_error: OnError::Skip,
            order: SampleOrder::Shuffle,
            run_lines: DEFAULT_RUN_LINES,
            balance_ranks: false,
            bucket_by_length: false,
            pack_max_tokens: None,
            mix: Vec::new(),
            data_weight: 1,
        }
    }
}

/// How hard one worker works: concurrency limits (none changes a batch's bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct Concurrency {
    /// Object-store reads in flight at once.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = DEFAULT_MAX_FETCHES))]
    pub max_fetches: usize,
    /// Preprocessing threads [default: the number of cores].
    #[cfg_attr(feature = "clap", arg(long))]
    pub cpu_threads: Option<usize>,
    /// Samples of one request loaded at once [default: all of them]; 1 loads them one after
    /// another (the demo's serial baseline).
    #[cfg_attr(feature = "clap", arg(long))]
    pub sample_parallelism: Option<usize>,
    /// Shard text kept in memory, in MiB: while the dataset's text fits, lines are read in
    /// 1 MiB blocks, once (a sample costs one GET per image, none for its line); past it, a
    /// run's lines at once under `--order runs`, else each line by its range. 0 reads each
    /// line on its own.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = DEFAULT_LINE_CACHE_MIB))]
    pub line_cache_mib: u64,
    /// The most objects (shards and images) of a dataset, or of its media root, a worker
    /// lists and indexes itself when `stoker-index.bin` is missing; past it the worker stays
    /// unready, naming `stoker dataset index`, until the index is written.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = DEFAULT_SELF_INDEX_MAX_OBJECTS))]
    pub self_index_max_objects: u64,
}

/// A dataset a worker indexes itself: 100 listing pages at most, its shards read once per
/// worker start (the demo's and the tests' datasets, far below).
pub const DEFAULT_SELF_INDEX_MAX_OBJECTS: u64 = 100_000;

impl Default for Concurrency {
    fn default() -> Self {
        Concurrency {
            max_fetches: DEFAULT_MAX_FETCHES,
            cpu_threads: None,
            sample_parallelism: None,
            line_cache_mib: DEFAULT_LINE_CACHE_MIB,
            self_index_max_objects: DEFAULT_SELF_INDEX_MAX_OBJECTS,
        }
    }
}

/// How much one worker takes from its clients: connections, requests in flight per
/// connection, idle connections, and the hint each trainer rank gets on how many workers to
/// use. `spec.serving` of a DataPipeline.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
#[serde(rename_all = "camelCase")]
pub struct ServingLimits {
    /// Batch requests prepared at once per connection (more wait, read ahead, for a slot).
    #[serde(default = "default_max_inflight_per_conn")]
    #[schemars(range(min = 1, max = MAX_INFLIGHT_PER_CONN_LIMIT))]
    #[cfg_attr(
        feature = "clap",
        arg(
            long,
            default_value_t = DEFAULT_MAX_INFLIGHT_PER_CONN,
            value_parser = clap::value_parser!(u32).range(1..=MAX_INFLIGHT_PER_CONN_LIMIT as i64)
        )
    )]
    pub max_inflight_per_conn: u32,
    /// Connections open at once (authenticated or not); one more is refused with an Error
    /// frame (Unavailable) naming the limit. A trainer rank holds one per worker it uses;
    /// clients are told the limit in the Welcome.
    #[serde(default = "default_max_connections")]
    #[schemars(range(min = 1, max = MAX_CONNECTIONS_LIMIT))]
    #[cfg_attr(
        feature = "clap",
        arg(
            long,
            default_value_t = DEFAULT_MAX_CONNECTIONS,
            value_parser = clap::value_parser!(u32).range(1..=MAX_CONNECTIONS_LIMIT as i64)
        )
    )]
    pub max_connections: u32,
    /// The most workers each trainer rank should connect to, told to clients in the Welcome
    /// (0: the client decides).
    #[serde(default)]
    #[schemars(range(max = LINKS_PER_RANK_LIMIT))]
    #[cfg_attr(
        feature = "clap",
        arg(
            long,
            default_value_t = DEFAULT_LINKS_PER_RANK,
            value_parser = clap::value_parser!(u32).range(0..=LINKS_PER_RANK_LIMIT as i64)
        )
    )]
    pub links_per_rank: u32,
    /// A connection with no request in flight that completes no frame for this many seconds
    /// is closed (an idle or drip-feeding peer must not hold a connection slot forever).
    #[serde(default = "default_idle_timeout_s")]
    #[schemars(range(min = 1))]
    #[cfg_attr(
        feature = "clap",
        arg(
            long,
            default_value_t = DEFAULT_IDLE_TIMEOUT_S,
            value_parser = clap::value_parser!(u64).range(1..)
        )
    )]
    pub idle_timeout_s: u64,
    /// Bytes of samples being prepared and batches waiting to be sent, across connections
    /// (fetched objects, decoded images, prepared pixels): a request starts only while the
    /// worker holds less, and its connection less than its share (this over the connections
    /// open plus one), so a rank that stops reading fills only its own share.
    #[serde(default = "default_max_worker_bytes")]
    #[schemars(range(min = 1))]
    #[cfg_attr(
        feature = "clap",
        arg(
            long,
            default_value_t = DEFAULT_MAX_WORKER_BYTES,
            value_parser = clap::value_parser!(u64).range(1..)
        )
    )]
    pub max_worker_bytes: u64,
    /// A connection whose peer takes no bytes for this many seconds while an answer waits is
    /// closed and its answers dropped: a rank that stops reading gives back what it holds.
    #[serde(default = "default_send_timeout_s")]
    #[schemars(range(min = 1))]
    #[cfg_attr(
        feature = "clap",
        arg(
            long,
            default_value_t = DEFAULT_SEND_TIMEOUT_S,
            value_parser = clap::value_parser!(u64).range(1..)
        )
    )]
    pub send_timeout_s: u64,
}

fn default_max_worker_bytes() -> u64 {
    DEFAULT_MAX_WORKER_BYTES
}

fn default_send_timeout_s() -> u64 {
    DEFAULT_SEND_TIMEOUT_S
}

fn default_max_inflight_per_conn() -> u32 {
    DEFAULT_MAX_INFLIGHT_PER_CONN
}

fn default_max_connections() -> u32 {
    DEFAULT_MAX_CONNECTIONS
}

fn default_idle_timeout_s() -> u64 {
    DEFAULT_IDLE_TIMEOUT_S
}

impl Default for ServingLimits {
    fn default() -> Self {
        ServingLimits {
            max_inflight_per_conn: DEFAULT_MAX_INFLIGHT_PER_CONN,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            links_per_rank: DEFAULT_LINKS_PER_RANK,
            idle_timeout_s: DEFAULT_IDLE_TIMEOUT_S,
            max_worker_bytes: DEFAULT_MAX_WORKER_BYTES,
            send_timeout_s: DEFAULT_SEND_TIMEOUT_S,
        }
    }
}

impl ServingLimits {
    /// Every value outside its bounds, each named as `spec.serving` spells it. The schema and
    /// the flags hold the same bounds; this names them for a spec that reached the operator
    /// without that schema, which the worker would otherwise refuse at start.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut check = |field: &str, value: u64, min: u64, max: Option<u64>| match max {
            Some(max) if !(min..=max).contains(&value) => {
                out.push(format!("serving.{field} {value} is outside {min}..={max}"))
            }
            None if value < min => out.push(format!("serving.{field} {value} is below {min}")),
            _ => {}
        };
        let limit = |l: u32| Some(u64::from(l));
        check(
            "maxInflightPerConn",
            self.max_inflight_per_conn.into(),
            1,
            limit(MAX_INFLIGHT_PER_CONN_LIMIT),
        );
        check(
            "maxConnections",
            self.max_connections.into(),
            1,
            limit(MAX_CONNECTIONS_LIMIT),
        );
        check(
            "linksPerRank",
            self.links_per_rank.into(),
            0,
            limit(LINKS_PER_RANK_LIMIT),
        );
        check("idleTimeoutS", self.idle_timeout_s, 1, None);
        check("maxWorkerBytes", self.max_worker_bytes, 1, None);
        check("sendTimeoutS", self.send_timeout_s, 1, None);
        out
    }
}

/// Where and how the worker serves: ports, authentication, limits, draining.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct Serving {
    /// Address for batch requests.
    #[cfg_attr(feature = "clap", arg(long, default_value = "0.0.0.0:7700"))]
    pub listen: String,
    /// Address for /metrics, /healthz and /readyz.
    #[cfg_attr(feature = "clap", arg(long, default_value = "0.0.0.0:9090"))]
    pub metrics_listen: String,
    /// File holding the pipeline token clients must present [default: $STOKER_TOKEN].
    #[cfg_attr(feature = "clap", arg(long, conflicts_with = "no_auth"))]
    pub token_file: Option<String>,
    /// Run without a token (only on a trusted, local network).
    #[cfg_attr(feature = "clap", arg(long))]
    pub no_auth: bool,
    /// The worker's TLS certificate chain (PEM), for the names ranks dial [default:
    /// $STOKER_TLS_CERT].
    #[cfg_attr(
        feature = "clap",
        arg(long, env = "STOKER_TLS_CERT", requires = "tls_key")
    )]
    pub tls_cert: Option<String>,
    /// The private key of --tls-cert (PEM) [default: $STOKER_TLS_KEY].
    #[cfg_attr(
        feature = "clap",
        arg(long, env = "STOKER_TLS_KEY", requires = "tls_cert")
    )]
    pub tls_key: Option<String>,
    /// Serve without TLS, whatever certificate is configured: the token travels in the clear
    /// and nothing proves to a rank that it talks to this worker (only on a trusted, local
    /// network; docs/security.md).
    #[cfg_attr(feature = "clap", arg(long))]
    pub insecure_plaintext: bool,
    #[cfg_attr(feature = "clap", command(flatten))]
    pub limits: ServingLimits,
    /// Samples being prepared at once, across connections: with --max-worker-bytes, the
    /// bound on the worker's memory [default: 8 per preprocessing thread, at least 32; a
    /// value given is taken as it is].
    #[cfg_attr(feature = "clap", arg(long))]
    pub max_inflight_samples: Option<usize>,
    /// The pipeline this worker belongs to (the `pipeline` label of its metrics).
    #[cfg_attr(
        feature = "clap",
        arg(long, env = "STOKER_PIPELINE", default_value = "default")
    )]
    pub pipeline: String,
    /// On SIGTERM, how long to wait for in-flight requests.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = DEFAULT_DRAIN_TIMEOUT_S))]
    pub drain_timeout_s: u64,
}

impl Default for Serving {
    fn default() -> Self {
        Serving {
            listen: "0.0.0.0:7700".into(),
            metrics_listen: "0.0.0.0:9090".into(),
            token_file: None,
            no_auth: false,
            tls_cert: None,
            tls_key: None,
            insecure_plaintext: false,
            limits: ServingLimits::default(),
            max_inflight_samples: None,
            pipeline: "default".into(),
            drain_timeout_s: DEFAULT_DRAIN_TIMEOUT_S,
        }
    }
}

/// Everything `stoker worker` is told: the dataset, how to reach it, how to preprocess and
/// order it, how hard to work and where to serve.
#[derive(Debug, Clone, Default, PartialEq)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct WorkerConfig {
    /// The dataset: s3://bucket/prefix or a local folder.
    #[cfg_attr(feature = "clap", arg(long))]
    pub data: String,
    /// Where the samples' media paths resolve when not beside their shards: s3://bucket/prefix
    /// (any bucket the S3 connection reaches) or a local folder. A path that leaves it is
    /// refused.
    #[cfg_attr(feature = "clap", arg(long, value_name = "URI"))]
    pub media_root: Option<String>,
    #[cfg_attr(feature = "clap", command(flatten))]
    pub s3: S3Connection,
    #[cfg_attr(feature = "clap", command(flatten))]
    pub preprocessing: Preprocessing,
    #[cfg_attr(feature = "clap", command(flatten))]
    pub sampling: Sampling,
    #[cfg_attr(feature = "clap", command(flatten))]
    pub concurrency: Concurrency,
    #[cfg_attr(feature = "clap", command(flatten))]
    pub serving: Serving,
}

/// Accumulates `--flag value` pairs; the only code that spells a worker flag.
#[derive(Default)]
struct Args(Vec<String>);

impl Args {
    fn value(&mut self, flag: &str, value: impl ToString) {
        self.0.push(format!("--{flag}"));
        self.0.push(value.to_string());
    }
    fn optional(&mut self, flag: &str, value: Option<impl ToString>) {
        if let Some(v) = value {
            self.value(flag, v);
        }
    }
    fn switch(&mut self, flag: &str, on: bool) {
        if on {
            self.0.push(format!("--{flag}"));
        }
    }
}

impl S3Connection {
    fn write_args(&self, a: &mut Args) {
        a.optional("s3-endpoint", self.endpoint.as_ref());
        a.optional("s3-region", self.region.as_ref());
        a.switch("s3-path-style", self.path_style);
        a.value("s3-read-timeout-s", self.read_timeout_s);
    }
}

impl Preprocessing {
    /// These settings as `stoker worker` flags (for a child worker the demo or a benchmark
    /// starts).
    pub fn to_args(&self) -> Vec<String> {
        let mut a = Args::default();
        self.write_args(&mut a);
        a.0
    }

    fn write_args(&self, a: &mut Args) {
        a.value("preset", self.preset.as_str());
        a.optional("min-pixels", self.min_pixels);
        a.optional("max-pixels", self.max_pixels);
        a.optional("video-min-pixels", self.video_min_pixels);
        a.optional("video-max-pixels", self.video_max_pixels);
        a.optional("pixel-dtype", self.pixel_dtype.map(PixelDtype::as_str));
        a.optional("max-length", self.max_length);
        a.optional("tokenizer", self.tokenizer.as_ref());
        a.optional("template", self.template.as_ref());
        a.value("max-image-side", self.max_image_side);
        a.value("max-image-pixels", self.max_image_pixels);
        a.value("max-images-per-sample", self.max_images_per_sample);
        a.value("max-sample-pixels", self.max_sample_pixels);
        a.value("max-object-bytes", self.max_object_bytes);
        a.value("max-sample-bytes", self.max_sample_bytes);
        a.value("max-line-bytes", self.max_line_bytes);
        a.value("max-turns", self.max_turns);
        a.value("max-video-frames", self.max_video_frames);
        a.value("max-sample-work", self.max_sample_work);
    }
}

impl Sampling {
    fn write_args(&self, a: &mut Args) {
        a.value("seed", self.seed);
        a.value("global-batch-size", self.global_batch_size);
        a.value("on-error", self.on_error.as_str());
        if !self.order.is_shuffle() {
            a.value("order", self.order.as_str());
        }
        if self.run_lines != DEFAULT_RUN_LINES {
            a.value("run-lines", self.run_lines);
        }
        a.switch("balance-ranks", self.balance_ranks);
        a.switch("bucket-by-length", self.bucket_by_length);
        a.optional("pack-max-tokens", self.pack_max_tokens);
        for m in &self.mix {
            a.value("mix", m);
        }
        if self.data_weight != 1 {
            a.value("data-weight", self.data_weight);
        }
    }
}

impl Concurrency {
    fn write_args(&self, a: &mut Args) {
        a.value("max-fetches", self.max_fetches);
        a.optional("cpu-threads", self.cpu_threads);
        a.optional("sample-parallelism", self.sample_parallelism);
        a.value("line-cache-mib", self.line_cache_mib);
        if self.self_index_max_objects != DEFAULT_SELF_INDEX_MAX_OBJECTS {
            a.value("self-index-max-objects", self.self_index_max_objects);
        }
    }
}

impl ServingLimits {
    fn write_args(&self, a: &mut Args) {
        a.value("max-inflight-per-conn", self.max_inflight_per_conn);
        a.value("max-connections", self.max_connections);
        a.value("links-per-rank", self.links_per_rank);
        a.value("idle-timeout-s", self.idle_timeout_s);
        a.value("max-worker-bytes", self.max_worker_bytes);
        a.value("send-timeout-s", self.send_timeout_s);
    }
}

impl Serving {
    /// Samples prepared at once on `cpu_threads` preprocessing threads: the flag's value as
    /// given, else 8 a thread and at least 32.
    pub fn inflight_samples(&self, cpu_threads: usize) -> usize {
        (self.max_inflight_samples)
            .unwrap_or((8 * cpu_threads).max(32))
            .max(1)
    }

    fn write_args(&self, a: &mut Args) {
        a.value("listen", &self.listen);
        a.value("metrics-listen", &self.metrics_listen);
        a.optional("token-file", self.token_file.as_ref());
        a.switch("no-auth", self.no_auth);
        a.optional("tls-cert", self.tls_cert.as_ref());
        a.optional("tls-key", self.tls_key.as_ref());
        a.switch("insecure-plaintext", self.insecure_plaintext);
        self.limits.write_args(a);
        a.optional("max-inflight-samples", self.max_inflight_samples);
        a.value("pipeline", &self.pipeline);
        a.value("drain-timeout-s", self.drain_timeout_s);
    }
}

impl WorkerConfig {
    /// The `stoker worker` arguments (after the subcommand) that reproduce this configuration.
    pub fn to_args(&self) -> Vec<String> {
        let mut a = Args::default();
        a.value("data", &self.data);
        a.optional("media-root", self.media_root.as_ref());
        self.s3.write_args(&mut a);
        self.preprocessing.write_args(&mut a);
        self.sampling.write_args(&mut a);
        self.concurrency.write_args(&mut a);
        self.serving.write_args(&mut a);
        a.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        worker: WorkerConfig,
    }

    fn parse(args: &[String]) -> WorkerConfig {
        let argv = std::iter::once("stoker-worker".to_string()).chain(args.iter().cloned());
        Cli::try_parse_from(argv).expect("to_args() parses").worker
    }

    /// Every field away from its default, so a flag `to_args` forgot comes back different.
    fn everything_set() -> WorkerConfig {
        WorkerConfig {
            data: "s3://datasets/llava".into(),
            media_root: Some("s3://images/coco".into()),
            s3: S3Connection {
                endpoint: Some("http://minio:9000".into()),
                region: Some("eu-west-1".into()),
                path_style: true,
                read_timeout_s: 3,
                static_credentials: None,
            },
            preprocessing: Preprocessing {
                preset: PresetName::Qwen3Vl,
                min_pixels: Some(1024),
                max_pixels: Some(1 << 20),
                video_min_pixels: Some(3136),
                video_max_pixels: Some(1 << 22),
                pixel_dtype: Some(PixelDtype::Bf16),
                max_length: Some(4096),
                tokenizer: Some("s3://models/qwen/tokenizer.json".into()),
                template: Some("/etc/stoker/chat.jinja".into()),
                max_image_side: 8000,
                max_image_pixels: 1 << 24,
                max_images_per_sample: 4,
                max_sample_pixels: 1 << 26,
                max_object_bytes: 1 << 22,
                max_sample_bytes: 1 << 26,
                max_line_bytes: 1 << 16,
                max_turns: 12,
                max_video_frames: 900,
                max_sample_work: 1 << 33,
            },
            sampling: Sampling {
                seed: 42,
                global_batch_size: 256,
                on_error: OnError::Fail,
                order: SampleOrder::Feistel,
                run_lines: 16,
                balance_ranks: true,
                bucket_by_length: true,
                pack_max_tokens: Some(8192),
                mix: vec![
                    "s3://b/vqa=2,media-root=s3://images/vqa".parse().unwrap(),
                    "/data/chat=1".parse().unwrap(),
                ],
                data_weight: 3,
            },
            concurrency: Concurrency {
                max_fetches: 16,
                cpu_threads: Some(3),
                sample_parallelism: Some(1),
                line_cache_mib: 17,
                self_index_max_objects: 5,
            },
            serving: Serving {
                listen: "127.0.0.1:1".into(),
                metrics_listen: "127.0.0.1:2".into(),
                token_file: Some("/var/run/stoker/token".into()),
                no_auth: false,
                tls_cert: Some("/var/run/stoker/tls/tls.crt".into()),
                tls_key: Some("/var/run/stoker/tls/tls.key".into()),
                insecure_plaintext: false,
                limits: ServingLimits {
                    max_inflight_per_conn: 3,
                    max_connections: 5,
                    links_per_rank: 2,
                    idle_timeout_s: 9,
                    max_worker_bytes: 11,
                    send_timeout_s: 13,
                },
                max_inflight_samples: Some(99),
                pipeline: "llava".into(),
                drain_timeout_s: 7,
            },
        }
    }

    #[test]
    fn a_mixed_dataset_may_name_its_media_root() {
        let m: MixSource = "s3://b/vqa=2,media-root=s3://img/a=b".parse().unwrap();
        assert_eq!(
            (m.data.as_str(), m.weight, m.media_root.as_deref()),
            ("s3://b/vqa", 2, Some("s3://img/a=b"))
        );
        assert_eq!(m.to_string(), "s3://b/vqa=2,media-root=s3://img/a=b");
        let e = "s3://b/vqa=2,media-root=".parse::<MixSource>().unwrap_err();
        assert!(e.contains("names no folder"), "{e}");
    }

    #[test]
    fn to_args_parses_back_to_the_same_configuration() {
        let c = everything_set();
        assert_eq!(parse(&c.to_args()), c);
        let plain = WorkerConfig {
            serving: Serving {
                token_file: None,
                no_auth: true,
                tls_cert: None,
                tls_key: None,
                insecure_plaintext: true,
                ..c.serving.clone()
            },
            ..c
        };
        assert_eq!(parse(&plain.to_args()), plain);
    }

    #[test]
    fn the_cli_defaults_are_the_types_defaults() {
        // Serde, clap and Default read the same constants; a drift shows here.
        let parsed = parse(&["--data".into(), String::new()]);
        assert_eq!(parsed.preprocessing, Preprocessing::default());
        assert_eq!(parsed.sampling, Sampling::default());
        assert_eq!(parsed.concurrency, Concurrency::default());
        assert_eq!(parsed.serving, Serving::default());
        // (The endpoint and region may come from the environment.)
        assert_eq!(
            parsed.s3.read_timeout_s,
            S3Connection::default().read_timeout_s
        );
        let from_spec: Preprocessing = serde_json::from_str("{}").unwrap();
        assert_eq!(from_spec, Preprocessing::default());
    }

    #[test]
    fn the_schema_names_the_fields_as_the_spec_spells_them() {
        let schema = serde_json::to_value(schemars::schema_for!(Preprocessing)).unwrap();
        let props = schema["properties"].as_object().unwrap();
        for f in [
            "preset",
            "minPixels",
            "maxPixels",
            "pixelDtype",
            "maxLength",
            "tokenizer",
        ] {
            assert!(props.contains_key(f), "{f} missing from {props:?}");
        }
        let rule = &schema["x-kubernetes-validations"][0]["rule"];
        assert!(rule
            .as_str()
            .unwrap()
            .contains("minPixels <= self.maxPixels"));
        let preset = serde_json::to_value(schemars::schema_for!(PresetName)).unwrap();
        assert_eq!(
            preset["enum"],
            serde_json::json!(["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
        );
    }

    #[test]
    fn serving_limits_are_bounded_alike_in_the_schema_the_flags_and_the_check() {
        let from_spec: ServingLimits = serde_json::from_str("{}").unwrap();
        assert_eq!(from_spec, ServingLimits::default());
        let schema = serde_json::to_value(schemars::schema_for!(ServingLimits)).unwrap();
        let props = &schema["properties"];
        // (schemars writes the bounds as JSON numbers with a fraction: 1.0)
        let bounds = |f: &str| (props[f]["minimum"].as_f64(), props[f]["maximum"].as_f64());
        assert_eq!(bounds("maxConnections"), (Some(1.0), Some(65_536.0)));
        assert_eq!(bounds("linksPerRank"), (Some(0.0), Some(1024.0)));
        assert_eq!(bounds("maxInflightPerConn"), (Some(1.0), Some(1024.0)));
        assert_eq!(bounds("idleTimeoutS"), (Some(1.0), None));
        assert_eq!(bounds("maxWorkerBytes"), (Some(1.0), None));
        assert_eq!(bounds("sendTimeoutS"), (Some(1.0), None));

        let flag = |args: &[&str]| {
            let argv = ["stoker-worker", "--data", "x"].iter().chain(args);
            Cli::try_parse_from(argv).map(|c| c.worker.serving.limits)
        };
        let ok = flag(&["--max-connections", "65536", "--links-per-rank", "1024"]).unwrap();
        assert_eq!((ok.max_connections, ok.links_per_rank), (65_536, 1024));
        for bad in [
            ["--max-connections", "0"],
            ["--max-connections", "65537"],
            ["--links-per-rank", "1025"],
            ["--max-inflight-per-conn", "0"],
            ["--idle-timeout-s", "0"],
            ["--max-worker-bytes", "0"],
            ["--send-timeout-s", "0"],
        ] {
            let e = flag(&bad)
                .err()
                .unwrap_or_else(|| panic!("{bad:?} accepted"));
            assert!(e.to_string().contains(bad[0]), "{e}");
        }

        assert!(ServingLimits::default().problems().is_empty());
        let wrong = ServingLimits {
            max_inflight_per_conn: 0,
            max_connections: 70_000,
            links_per_rank: 2000,
            idle_timeout_s: 0,
            max_worker_bytes: 0,
            send_timeout_s: 0,
        };
        assert_eq!(
            wrong.problems(),
            [
                "serving.maxInflightPerConn 0 is outside 1..=1024",
                "serving.maxConnections 70000 is outside 1..=65536",
                "serving.linksPerRank 2000 is outside 0..=1024",
                "serving.idleTimeoutS 0 is below 1",
                "serving.maxWorkerBytes 0 is below 1",
                "serving.sendTimeoutS 0 is below 1",
            ]
        );
    }
}
