//! Stoker's data plane: dataset sources and index, the deterministic plan, Qwen-VL
//! preprocessing, and the batch server that streams ready batches to trainer ranks.

pub mod dataset {
    pub mod index;
    pub mod lengths;
    pub mod sample;
}
pub mod preprocess {
    pub mod image_error;
    pub mod preset;
    pub mod resample;
    pub mod text;
    pub mod vision;
}
pub mod alloc;
pub mod batch;
pub mod connection;
pub mod limits;
pub mod line_cache;
pub mod metrics;
pub mod pack;
pub mod pipeline;
pub mod plan;
pub mod server;
pub mod source;
pub mod tokenizer_source;
