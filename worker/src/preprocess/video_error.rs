//! Why a video could not become frames: each variant is one metric label (see
//! `SampleErrorKind`), and its message names what was wrong.

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum VideoError {
    #[error("a codec this worker does not decode")]
    Unsupported,
    #[error("the container holds no video stream")]
    NoVideoStream,
    #[error("not a container clips are read from (MP4/MOV, Matroska/WebM, AVI)")]
    UnsupportedContainer,
    #[error("corrupt video: {0}")]
    Corrupt(String),
    #[error(
        "frames of {w}x{h} are over the limit (max side {max_side}, max {max_pixels} pixels); not decoded"
    )]
    FrameTooLarge {
        w: u32,
        h: u32,
        max_side: u32,
        max_pixels: u64,
    },
    #[error("{frames} frames are over the limit of {max} (max-video-frames); not decoded")]
    TooManyFrames { frames: u64, max: u64 },
    #[error("{0}")]
    Sampling(String),
    #[error(
        "its {frames} sampled frames of {w}x{h} would bring the sample's pixels over the limit of \
         {max} (max-sample-pixels); not decoded"
    )]
    SamplePixels {
        frames: usize,
        w: u32,
        h: u32,
        max: u64,
    },
    #[error(
        "decoding its first {frames} frames of {w}x{h} (up to the last sampled) would bring the \
         sample's work over what it has left of its budget, {max} pixel passes \
         (max-sample-work); not decoded"
    )]
    OverWorkBudget {
        frames: u64,
        w: u32,
        h: u32,
        max: u64,
    },
    /// Nobody waits for the sample any more (see `crate::cancel`).
    #[error("stopped after {frames} frames: its request went away")]
    Cancelled { frames: u64 },
}

impl VideoError {
    /// A clip FFmpeg failed on while `what` (decoding, converting…), with FFmpeg's reason.
    pub(crate) fn corrupt(what: &str, e: impl std::fmt::Display) -> Self {
        VideoError::Corrupt(format!("{what}: {e}"))
    }
}
