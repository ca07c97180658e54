//! Stoker's wire format: length-prefixed frames between a trainer client and a worker.
//!
//! Every frame is a fixed 16-byte header followed by `len` payload bytes:
//!
//! ```text
//! magic "STKR" | version u8 | kind u8 | reserved u16 | len u64      (little endian)
//! ```
//!
//! The payload layout per kind is specified in `docs/protocol.md`. Decoding never trusts a
//! length: every offset is bounds-checked, so a hostile or corrupt frame yields an error, never
//! a panic or an unbounded allocation (`decode_*` are fuzzed, see `fuzz/`).
//!
//! Batches are built so that the client can read the payload once into one buffer and hand
//! out every tensor as a view of it: tensor data starts at a 64-byte aligned offset of the
//! payload and each tensor's offset is 64-byte aligned too.

#![forbid(unsafe_code)]

mod codec;
mod frame;
#[cfg(feature = "tokio")]
pub mod io;
mod media;

pub use codec::{Reader, Writer};
pub use frame::*;
pub use media::{BatchMedia, Ids, MediaGrids, MediaTokens};

/// The names of a batch's tensors (docs/protocol.md), spelled once for workers and clients.
pub mod tensor {
    /// int64 `[B, L]`: token ids, right-padded with the pad token.
    pub const INPUT_IDS: &str = "input_ids";
    /// int64 `[B, L]`: -100 outside assistant turns and on padding.
    pub const LABELS: &str = "labels";
    /// int64 `[B, L]`: 1 on tokens, 0 on padding.
    pub const ATTENTION_MASK: &str = "attention_mask";
    /// `[P, 3·2·p·p]`: every image's patches, in sample order.
    pub const PIXEL_VALUES: &str = "pixel_values";
    /// int64 `[n_images, 3]`: (t, h, w) of each image, in patches.
    pub const IMAGE_GRID_THW: &str = "image_grid_thw";
    /// int64 `[4, B, L]`, packed batches only: rope positions restarting at every sample.
    pub const POSITION_IDS: &str = "position_ids";
    /// int32 `[B, max samples + 1]`, packed batches only: each pack's sample boundaries.
    pub const CU_SEQLENS: &str = "cu_seqlens";
    /// int64 `[B]`, packed batches only: images per pack.
    pub const PACK_IMAGES: &str = "pack_images";
    /// int64 `[B]`, packed batches holding a video: videos per pack.
    pub const PACK_VIDEOS: &str = "pack_videos";
    /// float32 `[3, 256]`, u8 pixels only: the normalization table, per channel and value.
    pub const PIXEL_LUT: &str = "pixel_lut";
    /// `[P, 3·2·p·p]`, batches with a video only: every video's patches, in sample order, in
    /// the dtype of `pixel_values` (u8 normalized on the rank with `pixel_lut_videos`).
    pub const PIXEL_VALUES_VIDEOS: &str = "pixel_values_videos";
    /// int64 `[n_videos, 3]`, with `pixel_values_videos`: (t, h, w) of each video, in patches.
    pub const VIDEO_GRID_THW: &str = "video_grid_thw";
    /// float32 `[3, 256]`, u8 pixels with a video: the video processors' normalization table
    /// (they rescale and normalize in float32 in one step; images in float64 then float32).
    pub const PIXEL_LUT_VIDEOS: &str = "pixel_lut_videos";
    /// float32 `[n_videos]`, Qwen2.5-VL batches with a video: seconds per temporal patch.
    pub const SECOND_PER_GRID_TS: &str = "second_per_grid_ts";
}

/// A metric's label set defined once, for both ends of the wire (worker and client): the
/// enum the code passes around, every value's label, and the list that registration
/// pre-creates at 0 (dashboards and alerts see every series before the first event) and the
/// docs are checked against.
#[macro_export]
macro_rules! label_set {
    ($(#[$doc:meta])* $name:ident { $($variant:ident => $label:literal,)+ }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name { $($variant,)+ }
        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant,)+];
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $label,)+ }
            }
        }
    };
}
