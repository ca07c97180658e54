//! Stoker's data plane: dataset sources and index, the deterministic plan, Qwen-VL
//! preprocessing, and the batch server that streams ready batches to trainer ranks.
//!
//! Public: what the product binary, the lab and the tests drive (the pipeline, the server, the
//! plan, sources, datasets, presets, the per-image chain). The rest is the crate's own.

pub mod dataset {
    pub mod index;
    pub mod le_u32s;
    pub mod lengths;
    pub mod parquet;
    pub mod sample;
    pub mod shard;
}
pub mod preprocess {
    pub(crate) mod image_error;
    pub mod preset;
    pub(crate) mod resample;
    mod sws_chroma;
    pub(crate) mod text;
    pub(crate) mod torch_resize;
    pub mod video;
    pub mod video_decode;
    pub(crate) mod video_error;
    mod video_rgb;
    pub mod vision;
}
pub mod alloc;
pub(crate) mod assemble;
pub mod batch;
pub(crate) mod batch_frame;
pub(crate) mod byte_budget;
pub mod cancel;
pub mod connection;
pub(crate) mod failure;
pub mod handshake;
pub mod identity;
pub mod limits;
pub(crate) mod line_cache;
pub(crate) mod media_check;
pub mod memory;
pub mod metrics;
pub mod open;
pub(crate) mod pack;
pub mod pipeline;
pub mod plan;
pub(crate) mod range_reader;
pub mod server;
pub mod source;
pub(crate) mod stall;
pub mod tokenizer_source;
