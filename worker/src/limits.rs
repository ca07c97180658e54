//! Bounds on the work one sample may cause: images, decoded pixels, decoding work, object and
//! line bytes, turns. Each is part of the plan's identity (workers of one pipeline apply the same limits,
//! so a sample over one is skipped by every worker and batches stay byte-identical), and each
//! is checked before the work it bounds: a line's length from the index before it is read,
//! an object's length before its body is, an image's size from its header before it is
//! decoded.

use crate::dataset::sample::Conversation;
use crate::metrics::SampleErrorKind;
use crate::preprocess::video::VideoBudget;
use crate::preprocess::video_decode::VideoLimits;
use crate::preprocess::vision::{DecodeLimits, ImageError, Spent, MAX_DECODED_BYTES_PER_PIXEL};
use serde::Serialize;
use stoker_config::Preprocessing;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SampleLimits {
    /// Per image, from its header.
    pub decode: DecodeLimits,
    pub images: u32,
    /// Decoded pixels of all the sample's images together.
    pub sample_pixels: u64,
    pub object_bytes: u64,
    /// Bytes of a sample's images and frames together (`crate::byte_budget`).
    pub sample_bytes: u64,
    pub line_bytes: u64,
    pub turns: u32,
    /// Frames a video's stream may hold.
    pub video_frames: u64,
}

impl Default for SampleLimits {
    fn default() -> Self {
        SampleLimits::from_config(&Preprocessing::default())
    }
}

/// A sample over one of the limits: a deterministic data fault, skipped under `on_error: skip`.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum LimitError {
    #[error("line of {len} bytes is over the limit of {max} (max-line-bytes); not read")]
    LineBytes { len: u64, max: u64 },
    #[error("{count} messages are over the limit of {max} (max-turns)")]
    Turns { count: usize, max: u32 },
    #[error("{count} images and videos are over the limit of {max} (max-images-per-sample)")]
    Images { count: usize, max: u32 },
    #[error(
        "image {key} ({w}x{h}) would bring the sample's decoded pixels over the limit of {max} \
         (max-sample-pixels); not decoded"
    )]
    SamplePixels {
        key: String,
        w: u32,
        h: u32,
        max: u64,
    },
}

impl LimitError {
    /// The metric label and skip reason.
    pub fn kind(&self) -> SampleErrorKind {
        match self {
            LimitError::LineBytes { .. } => SampleErrorKind::LineTooLong,
            LimitError::Turns { .. } => SampleErrorKind::TooManyTurns,
            LimitError::Images { .. } => SampleErrorKind::TooManyImages,
            LimitError::SamplePixels { .. } => SampleErrorKind::SampleTooLarge,
        }
    }
}

impl SampleLimits {
    pub fn from_config(c: &Preprocessing) -> Self {
        SampleLimits {
            decode: DecodeLimits::from_config(c),
            images: c.max_images_per_sample,
            sample_pixels: c.max_sample_pixels,
            object_bytes: c.max_object_bytes,
            sample_bytes: c.max_sample_bytes,
            line_bytes: c.max_line_bytes,
            turns: c.max_turns,
            video_frames: c.max_video_frames,
        }
    }

    /// The next video's budget when the sample has `spent` so much: its header's limits
    /// (frames as large as an image may be, at most `video_frames` of them), the pixels its
    /// resized frames may take and the decoding work left.
    pub fn next_video(&self, spent: Spent) -> VideoBudget {
        VideoBudget {
            limits: VideoLimits {
                max_side: self.decode.max_side,
                max_frame_pixels: self.decode.max_pixels,
                max_frames: self.video_frames,
            },
            pixels: self.pixels_left(spent),
            work: self.decode.max_work.saturating_sub(spent.work),
        }
    }

    /// The sample's pixels left when it has `spent` so much.
    pub fn pixels_left(&self, spent: Spent) -> u64 {
        self.sample_pixels.saturating_sub(spent.pixels)
    }

    /// The most bytes one sample may hold while it is prepared (docs/reliability.md, "What a
    /// worker holds"): its line and parsed conversation, its images and frames as read, one
    /// image or clip frame being decoded at the decoder's widest layout, a frame list's frames
    /// decoded together (they count toward `sample_pixels`), its prepared pixels (each image
    /// resized to at most `max_pixels` and doubled in time, a video's within
    /// `sample_pixels`) at `value_bytes` a value, and a clip's read block.
    pub fn peak_sample_bytes(&self, max_pixels: u64, value_bytes: u64) -> u64 {
        let s = self.sample_pixels;
        let images = u64::from(self.images);
        let prepared = (3 * value_bytes)
            .saturating_mul((2 * images).saturating_mul(max_pixels).saturating_add(s));
        [
            2 * self.line_bytes,
            self.sample_bytes,
            MAX_DECODED_BYTES_PER_PIXEL.saturating_mul(self.decode.max_pixels),
            3 * s,
            prepared,
            crate::range_reader::BLOCK_BYTES,
        ]
        .into_iter()
        .fold(0, u64::saturating_add)
    }

    /// Before the line is fetched: its length is in the index.
    pub fn check_line(&self, len: u64) -> Result<(), LimitError> {
        match len > self.line_bytes {
            true => Err(LimitError::LineBytes {
                len,
                max: self.line_bytes,
            }),
            false => Ok(()),
        }
    }

    /// Before any image is fetched.
    pub fn check_conversation(&self, conv: &Conversation) -> Result<(), LimitError> {
        let turns = conv.messages.len();
        if turns > self.turns as usize {
            return Err(LimitError::Turns {
                count: turns,
                max: self.turns,
            });
        }
        let images = conv.media().count();
        if images > self.images as usize {
            return Err(LimitError::Images {
                count: images,
                max: self.images,
            });
        }
        Ok(())
    }

    /// The decode limits of the next image when the sample has `spent` so much: the
    /// per-image limits, tightened to what the sample has left.
    pub fn next_image(&self, spent: Spent) -> DecodeLimits {
        DecodeLimits {
            max_pixels: self.decode.max_pixels.min(self.pixels_left(spent)),
            max_work: self.decode.max_work.saturating_sub(spent.work),
            ..self.decode
        }
    }

    /// An image refused under [`Self::next_image`]'s limits only because of the sample's
    /// budget is the sample's fault, and named so; otherwise the image's own error stands.
    pub fn classify(&self, key: String, err: ImageError) -> Result<ImageError, LimitError> {
        match err {
            ImageError::TooLarge { w, h, .. }
                if w <= self.decode.max_side
                    && h <= self.decode.max_side
                    && w as u64 * h as u64 <= self.decode.max_pixels =>
            {
                Err(LimitError::SamplePixels {
                    key,
                    w,
                    h,
                    max: self.sample_pixels,
                })
            }
            other => Ok(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> SampleLimits {
        SampleLimits {
            decode: DecodeLimits {
                max_side: 1000,
                max_pixels: 500_000,
                max_work: 2_000_000,
            },
            images: 2,
            sample_pixels: 600_000,
            object_bytes: 1 << 20,
            sample_bytes: 1 << 21,
            line_bytes: 100,
            turns: 3,
            video_frames: 1000,
        }
    }

    #[test]
    fn lines_turns_and_images_over_their_limits_are_named() {
        let l = limits();
        assert!(l.check_line(100).is_ok());
        assert_eq!(
            l.check_line(101).unwrap_err().kind().as_str(),
            "line_too_long"
        );
        let conv = |turns: usize, images: usize| {
            let mut line = String::from(r#"{"messages": ["#);
            for t in 0..turns {
                let role = if t % 2 == 0 { "user" } else { "assistant" };
                let parts: Vec<String> = (0..if t == 0 { images } else { 0 })
                    .map(|i| format!(r#"{{"type": "image", "image": "{i}.jpg"}}"#))
                    .chain([r#"{"type": "text", "text": "x"}"#.to_string()])
                    .collect();
                let sep = if t > 0 { "," } else { "" };
                line += &format!(
                    r#"{sep}{{"role": "{role}", "content": [{}]}}"#,
                    parts.join(",")
                );
            }
            Conversation::parse(format!("{line}]}}").as_bytes()).unwrap()
        };
        assert!(l.check_conversation(&conv(3, 2)).is_ok());
        let e = l.check_conversation(&conv(4, 0)).unwrap_err();
        assert_eq!(
            (e.kind().as_str(), e.to_string().contains("4 messages")),
            ("too_many_turns", true)
        );
        let e = l.check_conversation(&conv(2, 3)).unwrap_err();
        assert_eq!(
            (
                e.kind().as_str(),
                e.to_string().contains("3 images and videos")
            ),
            ("too_many_images", true)
        );
    }

    #[test]
    fn the_sample_budget_tightens_the_next_images_limit() {
        let l = limits();
        let spent = |pixels, work| Spent { pixels, work };
        assert_eq!(l.next_image(spent(0, 0)).max_pixels, 500_000);
        assert_eq!(l.next_image(spent(400_000, 0)).max_pixels, 200_000);
        assert_eq!(l.next_image(spent(700_000, 0)).max_pixels, 0);
        assert_eq!(l.next_image(spent(0, 1_500_000)).max_work, 500_000);
        assert_eq!(l.next_video(spent(0, 2_500_000)).work, 0);
        assert_eq!(l.next_video(spent(100_000, 0)).pixels, 500_000);
        let too_large = |w, h| ImageError::TooLarge {
            w,
            h,
            max_side: 1000,
            max_pixels: 200_000,
        };
        // Within the image's own limits: the sample's budget refused it.
        let e = l.classify("b.jpg".into(), too_large(500, 500)).unwrap_err();
        assert_eq!(e.kind().as_str(), "sample_too_large");
        assert!(e.to_string().contains("b.jpg (500x500)"), "{e}");
        // Over the image's own limits: the image's error stands.
        assert!(l.classify("c.jpg".into(), too_large(1001, 10)).is_ok());
        assert!(l.classify("c.jpg".into(), too_large(1000, 1000)).is_ok());
    }
}
