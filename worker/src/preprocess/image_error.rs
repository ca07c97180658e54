//! What can go wrong with one image: the decoder's refusals (vision) and the resize's
//! (the preset's smart_resize), one type both import.

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ImageError {
    #[error("unsupported image format")]
    Unsupported,
    #[error("corrupt or truncated image: {0}")]
    Corrupt(String),
    #[error(
        "image {w}x{h} exceeds the decode limits ({max_side} px per side, {max_pixels} pixels)"
    )]
    TooLarge {
        w: u32,
        h: u32,
        max_side: u32,
        max_pixels: u64,
    },
    #[error("image {h}x{w} (HxW) is too thin: aspect ratio above 200")]
    AspectRatio { h: u32, w: u32 },
    #[error("over the image's memory budget: {0}")]
    OverBudget(String),
    #[error("progressive JPEG of more than {max} scans")]
    TooManyScans { max: usize },
    #[error(
        "decoding {w}x{h} pixels in {passes} passes would bring the sample's work over what it \
         has left of its budget, {max} pixel passes (max-sample-work); not decoded"
    )]
    OverWorkBudget {
        w: u32,
        h: u32,
        passes: u64,
        max: u64,
    },
}
