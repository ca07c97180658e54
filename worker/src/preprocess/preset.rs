//! Model-family presets: the constants of the Qwen-VL image processors and chat formats.

use super::image_error::ImageError;
use serde::{Deserialize, Serialize};
pub use stoker_config::{PixelDtype, PresetName};

const CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
// transformers: OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711), written at f32 precision.
const CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_6, 0.275_777_1];

/// Everything that determines the bytes of a preprocessed sample.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Preset {
    pub name: PresetName,
    pub patch_size: u32,
    pub merge_size: u32,
    pub temporal_patch_size: u32,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    pub min_pixels: u64,
    pub max_pixels: u64,
    pub pixel_dtype: PixelDtype,
    /// Longest token sequence per sample; see docs/preprocessing.md for the truncation policy.
    pub max_length: usize,
    pub video: VideoPreset,
}

/// How a model family's video processor samples and sizes a clip (transformers 5.23's
/// `Qwen2VLVideoProcessor` and `Qwen3VLVideoProcessor` defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VideoPreset {
    /// Frames sampled per second of video, unless a sample says otherwise.
    pub fps: f64,
    pub min_frames: u32,
    pub max_frames: u32,
    /// `size.shortest_edge` / `size.longest_edge`: per frame, or for the whole video.
    pub min_pixels: u64,
    pub max_pixels: u64,
    pub sampling: FrameSampling,
    pub budget: PixelBudget,
    /// Qwen2.5-VL's `second_per_grid_ts` goes with the batch.
    pub second_per_grid: bool,
    /// Qwen3-VL's `<t seconds>` before each temporal group.
    pub timestamps: bool,
}

/// Which frames of a clip are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FrameSampling {
    /// Qwen2-VL / Qwen2.5-VL: n floored to the temporal patch, `arange(0, total, total / n).int()`.
    Arange,
    /// Qwen3-VL: `linspace(0, total - 1, n).round()`; a clip without a frame rate counts as 24.
    Linspace,
}

/// What `min_pixels` / `max_pixels` bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PixelBudget {
    /// Each frame on its own (the image `smart_resize`).
    PerFrame,
    /// frames × height × width (Qwen3-VL's video `smart_resize`).
    WholeVideo,
}

impl Preset {
    pub fn new(name: PresetName) -> Self {
        let qwen2 = Preset {
            name,
            patch_size: 14,
            merge_size: 2,
            temporal_patch_size: 2,
            image_mean: CLIP_MEAN,
            image_std: CLIP_STD,
            // What a trainer loading the model's processor gets: the Hub preprocessor configs of
            // Qwen2-VL and Qwen2.5-VL set max_pixels 12,845,056 (transformers' class default,
            // 1,003,520, is not what `AutoProcessor.from_pretrained` gives).
            min_pixels: 56 * 56,
            max_pixels: 12_845_056,
            // u8 on the wire, normalized on the rank (`batch.pixel_values()`, bit-identical):
            // a quarter of float32's bytes for the worker to write and the NIC to carry.
            pixel_dtype: PixelDtype::U8,
            max_length: 8192,
            video: VideoPreset {
                fps: 2.0,
                min_frames: 4,
                max_frames: 768,
                min_pixels: 128 * 28 * 28,
                max_pixels: 768 * 28 * 28,
                sampling: FrameSampling::Arange,
                budget: PixelBudget::PerFrame,
                second_per_grid: name == PresetName::Qwen25Vl,
                timestamps: false,
            },
        };
        match name {
            PresetName::Qwen2Vl | PresetName::Qwen25Vl => qwen2,
            PresetName::Qwen3Vl => Preset {
                patch_size: 16,
                image_mean: [0.5; 3],
                image_std: [0.5; 3],
                min_pixels: 65_536,
                max_pixels: 16_777_216,
                video: VideoPreset {
                    min_pixels: 128 * 32 * 32,
                    max_pixels: 768 * 32 * 32,
                    sampling: FrameSampling::Linspace,
                    budget: PixelBudget::WholeVideo,
                    second_per_grid: false,
                    timestamps: true,
                    ..qwen2.video
                },
                ..qwen2
            },
        }
    }

    pub fn factor(&self) -> u32 {
        self.patch_size * self.merge_size
    }

    /// The size an upright image of this (height, width) is resized to: `smart_resize` with
    /// this preset's factor and pixel bounds.
    pub fn resized(&self, (height, width): (u32, u32)) -> Result<(u32, u32), ImageError> {
        smart_resize(
            height,
            width,
            self.factor(),
            self.min_pixels,
            self.max_pixels,
        )
    }

    /// Tokens of one image of this (smart-resized) height and width: one per merged patch.
    pub fn image_tokens(&self, (height, width): (u32, u32)) -> usize {
        (height / self.factor()) as usize * (width / self.factor()) as usize
    }

    /// Values per row of `pixel_values`: C·T·P·P.
    pub fn patch_dim(&self) -> usize {
        (3 * self.temporal_patch_size * self.patch_size * self.patch_size) as usize
    }

    /// The template's system prompt inserted when a conversation has none.
    pub fn default_system(&self) -> Option<&'static str> {
        match self.name {
            PresetName::Qwen2Vl | PresetName::Qwen25Vl => Some("You are a helpful assistant."),
            PresetName::Qwen3Vl => None,
        }
    }

    pub fn label(&self) -> &'static str {
        self.name.as_str()
    }

    /// The preset a configuration names, with its overrides applied.
    pub fn from_config(c: &stoker_config::Preprocessing) -> Self {
        let mut p = Preset::new(c.preset);
        if let Some(d) = c.pixel_dtype {
            p.pixel_dtype = d;
        }
        if let Some(v) = c.min_pixels {
            p.min_pixels = v;
        }
        if let Some(v) = c.max_pixels {
            p.max_pixels = v;
        }
        if let Some(v) = c.video_min_pixels {
            p.video.min_pixels = v;
        }
        if let Some(v) = c.video_max_pixels {
            p.video.max_pixels = v;
        }
        if let Some(v) = c.max_length {
            p.max_length = v as usize;
        }
        p
    }
}

/// Python's `round` (ties to even) of a non-negative f64.
pub(crate) fn round_half_even(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - 1.0
    } else {
        r
    }
}

/// The Qwen-VL `smart_resize`: dimensions divisible by `factor`, pixel count within
/// [min_pixels, max_pixels], aspect ratio kept. Float operation order follows transformers.
pub fn smart_resize(
    height: u32,
    width: u32,
    factor: u32,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(u32, u32), ImageError> {
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    if h.max(w) / h.min(w) > 200.0 {
        return Err(ImageError::AspectRatio {
            h: height,
            w: width,
        });
    }
    let mut h_bar = round_half_even(h / f) * f;
    let mut w_bar = round_half_even(w / f) * f;
    if h_bar * w_bar > max_pixels as f64 {
        let beta = ((h * w) / max_pixels as f64).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    Ok((h_bar as u32, w_bar as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_matches_reference_fixtures() {
        assert_eq!(
            smart_resize(561, 278, 28, 3136, 1_003_520).unwrap(),
            (560, 280)
        );
        // 640x480 (WxH): qwen2-vl → 476x644, qwen3-vl unchanged.
        assert_eq!(
            smart_resize(480, 640, 28, 3136, 1_003_520).unwrap(),
            (476, 644)
        );
        assert_eq!(
            smart_resize(480, 640, 32, 65_536, 16_777_216).unwrap(),
            (480, 640)
        );
        // Tiny images are scaled up to min_pixels; huge ones down to max_pixels.
        let (h, w) = smart_resize(10, 10, 28, 3136, 1_003_520).unwrap();
        assert!(h as u64 * w as u64 >= 3136 && h % 28 == 0 && w % 28 == 0);
        let (h, w) = smart_resize(4000, 3000, 28, 3136, 1_003_520).unwrap();
        assert!(h as u64 * w as u64 <= 1_003_520);
        assert!(matches!(
            smart_resize(10, 2100, 28, 3136, 1_003_520),
            Err(ImageError::AspectRatio { .. })
        ));
    }

    #[test]
    fn video_bounds_are_the_processors_unless_overridden() {
        let q2 = Preset::new(PresetName::Qwen25Vl);
        assert_eq!(
            (q2.video.min_pixels, q2.video.max_pixels),
            (100_352, 602_112)
        );
        assert!(q2.video.second_per_grid && !q2.video.timestamps);
        let hub = stoker_config::Preprocessing {
            preset: PresetName::Qwen25Vl,
            video_min_pixels: Some(3136),
            video_max_pixels: Some(12_845_056),
            ..Default::default()
        };
        let p = Preset::from_config(&hub);
        assert_eq!((p.video.min_pixels, p.video.max_pixels), (3136, 12_845_056));
        assert_eq!(p.video.budget, PixelBudget::PerFrame);
        let q3 = Preset::new(PresetName::Qwen3Vl);
        assert_eq!(q3.video.budget, PixelBudget::WholeVideo);
        assert_eq!(q3.video.sampling, FrameSampling::Linspace);
    }

    #[test]
    fn python_round_ties_to_even() {
        assert_eq!(round_half_even(2.5), 2.0);
        assert_eq!(round_half_even(3.5), 4.0);
        assert_eq!(round_half_even(2.4), 2.0);
    }
}
