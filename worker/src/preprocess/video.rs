//! A video → `pixel_values_videos` rows, a `(t, h, w)` grid, and what its tokens need (Qwen3-VL's
//! timestamps, Qwen2.5-VL's `second_per_grid_ts`), as transformers 5.23's video processors do:
//! frames sampled from the header's count and rate, padded to the temporal patch by repeating
//! the last, resized with torchvision's uint8 bicubic (not Pillow's), normalized and patchified.

use super::preset::{round_half_even, FrameSampling, PixelBudget, Preset};
use super::torch_resize::FrameResizer;
use super::video_decode::{decode, probe, Skipping, VideoHeader, VideoLimits};
use super::video_error::VideoError;
use super::vision::{patchify_frames, PixelBuf, PixelLut, Rgb, Spent};
use crate::cancel::Cancel;
use crate::dataset::sample::VideoPart;
use std::io::{Read, Seek};

/// Frames of a clip to decode, and the rate that dates them.
#[derive(Debug, Clone, PartialEq)]
pub struct FramePlan {
    /// Frame numbers in the clip, ascending: the frames decoded.
    pub indices: Vec<u64>,
    /// Frames the sampling chose (`VideoMetadata.frames_indices`), counting those past the
    /// clip's end: Qwen2-VL's `arange` sometimes picks frame `total`, which PyAV's reader
    /// cannot give and leaves out, while the processor's sampled rate still counts it.
    pub sampled: u64,
    /// The clip's own rate (`VideoMetadata.fps`), which dates a frame number.
    pub video_fps: f64,
    /// Frames counted by the sampling (the clip's, or its `video_start…video_end` part).
    pub total: u64,
}

impl FramePlan {
    /// Qwen2.5-VL's `second_per_grid_ts`: the temporal patch over the sampled rate
    /// (`VideoMetadata.sampled_fps` = sampled / total × fps).
    pub fn second_per_grid(&self, temporal: u32) -> f64 {
        let sampled_fps = self.sampled as f64 / self.total as f64 * self.video_fps;
        f64::from(temporal) / sampled_fps
    }

    /// Qwen3-VL's time of each temporal group: indices padded with the last, each pair's mean
    /// of `index / fps`.
    pub fn timestamps(&self, temporal: u32) -> Vec<f64> {
        let t = temporal as usize;
        let mut idx: Vec<u64> = self.indices.clone();
        while !idx.len().is_multiple_of(t) {
            idx.push(*idx.last().expect("at least one frame"));
        }
        idx.chunks(t)
            .map(|g| {
                let (a, b) = (
                    g[0] as f64 / self.video_fps,
                    g[t - 1] as f64 / self.video_fps,
                );
                (a + b) / 2.0
            })
            .collect()
    }
}

/// The frames a preset samples from a clip whose header is `header`, `fps` per second
/// (the sample's, else the preset's), within `[start, end]` seconds when given.
pub fn plan_frames(
    preset: &Preset,
    header: &VideoHeader,
    fps: Option<f64>,
    (start, end): (Option<f64>, Option<f64>),
) -> Result<FramePlan, VideoError> {
    let v = &preset.video;
    let fps = fps.unwrap_or(v.fps);
    let video_fps = match (header.fps, v.sampling) {
        (Some(f), _) => f,
        (None, FrameSampling::Linspace) => 24.0,
        (None, FrameSampling::Arange) => {
            return Err(VideoError::Sampling(
                "the container gives no frame rate, which sampling by fps needs".into(),
            ))
        }
    };
    // A part of the clip: the frames whose time lies in [start, end].
    let first = start.map_or(0, |s| (s * video_fps).ceil() as u64);
    let last = end.map_or(header.frames - 1, |e| {
        ((e * video_fps).floor() as u64).min(header.frames - 1)
    });
    if first > last {
        return Err(VideoError::Sampling(format!(
            "video_start..video_end holds no frame of the {} at {video_fps} fps",
            header.frames
        )));
    }
    let total = last - first + 1;
    let local = match v.sampling {
        FrameSampling::Arange => {
            arange_indices(total, video_fps, fps, v, preset.temporal_patch_size)?
        }
        FrameSampling::Linspace => linspace_indices(total, video_fps, fps, v),
    };
    // What transformers' PyAV reader does with an index past the end: nothing (it decodes
    // frames 0.. and keeps those whose number was chosen).
    Ok(FramePlan {
        sampled: local.len() as u64,
        indices: local
            .into_iter()
            .filter(|&i| i < total)
            .map(|i| i + first)
            .collect(),
        video_fps,
        total,
    })
}

/// `Qwen2VLVideoProcessor.sample_frames` with `fps`.
fn arange_indices(
    total: u64,
    video_fps: f64,
    fps: f64,
    v: &super::preset::VideoPreset,
    temporal: u32,
) -> Result<Vec<u64>, VideoError> {
    let t = f64::from(temporal);
    let max_frames = (f64::from(v.max_frames).min(total as f64) / t).floor() * t;
    let n = (total as f64 / video_fps * fps)
        .max(f64::from(v.min_frames))
        .min(max_frames)
        .min(total as f64);
    let n = (n / t).floor() * t;
    if n < 1.0 {
        return Err(VideoError::Sampling(format!(
            "a clip of {total} frames samples no whole temporal patch of {temporal}"
        )));
    }
    // torch.arange(0, total, step) in float32: length ceil(total / step) in f64, each value
    // start + step·i computed in f64 and stored as f32, then `.int()` truncates.
    let step = total as f64 / n;
    let len = (total as f64 / step).ceil() as u64;
    Ok((0..len)
        .map(|i| ((step * i as f64) as f32) as i32 as u64)
        .collect())
}

/// `Qwen3VLVideoProcessor.sample_frames` with `fps`.
fn linspace_indices(
    total: u64,
    video_fps: f64,
    fps: f64,
    v: &super::preset::VideoPreset,
) -> Vec<u64> {
    let n = ((total as f64 / video_fps * fps) as u64)
        .max(u64::from(v.min_frames))
        .min(u64::from(v.max_frames))
        .min(total);
    // np.linspace(0, total - 1, n).round(): i · step, the last exactly total − 1, halves to even.
    let stop = (total - 1) as f64;
    match n {
        1 => vec![0],
        _ => {
            let step = stop / (n - 1) as f64;
            (0..n)
                .map(|i| match i == n - 1 {
                    true => total - 1,
                    false => round_half_even(i as f64 * step) as u64,
                })
                .collect()
        }
    }
}

/// The (height, width) a preset resizes a video's frames of `(height, width)` to, `frames`
/// being sampled.
pub fn resized(
    preset: &Preset,
    frames: usize,
    (height, width): (u32, u32),
) -> Result<(u32, u32), VideoError> {
    let v = &preset.video;
    let f = preset.factor();
    let shape = |e: super::image_error::ImageError| VideoError::Sampling(e.to_string());
    match v.budget {
        PixelBudget::PerFrame => {
            super::preset::smart_resize(height, width, f, v.min_pixels, v.max_pixels).map_err(shape)
        }
        PixelBudget::WholeVideo => {
            video_smart_resize(frames, height, width, preset.temporal_patch_size, f, v)
        }
    }
}

/// Qwen3-VL's video `smart_resize`: frames × height × width within the budget.
fn video_smart_resize(
    frames: usize,
    height: u32,
    width: u32,
    temporal: u32,
    factor: u32,
    v: &super::preset::VideoPreset,
) -> Result<(u32, u32), VideoError> {
    if frames < temporal as usize {
        return Err(VideoError::Sampling(format!(
            "{frames} sampled frames, fewer than the temporal patch of {temporal}"
        )));
    }
    let (mut h, mut w) = (f64::from(height), f64::from(width));
    let f = f64::from(factor);
    if h < f || w < f {
        let scale = (f / h).max(f / w);
        h = (h * scale).trunc();
        w = (w * scale).trunc();
    }
    if h.max(w) / h.min(w) > 200.0 {
        return Err(VideoError::Sampling(format!(
            "frames of {height}x{width} (HxW) are too thin: aspect ratio above 200"
        )));
    }
    let n = frames as f64;
    let mut h_bar = round_half_even(h / f) * f;
    let mut w_bar = round_half_even(w / f) * f;
    let t_bar = round_half_even(n / f64::from(temporal)) * f64::from(temporal);
    let (min, max) = (v.min_pixels as f64, v.max_pixels as f64);
    if t_bar * h_bar * w_bar > max {
        let beta = ((n * h * w) / max).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if t_bar * h_bar * w_bar < min {
        let beta = (min / (n * h * w)).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    Ok((h_bar as u32, w_bar as u32))
}

/// One video's contribution to a batch.
pub struct VideoOut {
    /// `[rows, patch_dim]` of `pixel_values_videos`.
    pub pixels: PixelBuf,
    pub rows: usize,
    pub grid_thw: [i64; 3],
    /// Qwen2.5-VL's `second_per_grid_ts` (presets without it: 0).
    pub second_per_grid: f64,
    /// Qwen3-VL: each temporal group's time in seconds (empty for other presets).
    pub timestamps: Vec<f64>,
    /// The frame numbers sampled (a frame list: 0, 1, …).
    pub indices: Vec<u64>,
    /// The sampled frames as decoded, upright, before the resize (for `dataset inspect`).
    pub decoded: Option<Vec<Rgb>>,
    /// The decoding work charged for a clip, in pixel passes (a frame list's frames are
    /// charged as the images they are).
    pub work: u64,
}

/// Tokens one video takes: per temporal group, `<|video_pad|>` × `per_group` (Qwen3-VL dates
/// each group; other presets run the groups together).
#[derive(Debug, Clone, PartialEq)]
pub struct VideoTokens {
    pub groups: usize,
    pub per_group: usize,
    pub timestamps: Vec<f64>,
}

impl VideoOut {
    pub fn tokens(&self, preset: &Preset) -> VideoTokens {
        video_tokens(preset, self.grid_thw, self.timestamps.clone())
    }
}

pub fn video_tokens(preset: &Preset, grid_thw: [i64; 3], timestamps: Vec<f64>) -> VideoTokens {
    let m = preset.merge_size as usize;
    VideoTokens {
        groups: grid_thw[0] as usize,
        per_group: grid_thw[1] as usize * grid_thw[2] as usize / (m * m),
        timestamps,
    }
}

/// The sampled frames (decoded, upright, all of one size) → the video's tensors. Frames are
/// resized as they come, so a clip never holds its full-size frames at once.
struct FrameCollector<'a> {
    preset: &'a Preset,
    resizer: FrameResizer,
    from: (usize, usize),
    to: (usize, usize),
    frames: Vec<Rgb>,
    keep_decoded: bool,
    decoded: Vec<Rgb>,
}

impl<'a> FrameCollector<'a> {
    /// For `count` frames of `(height, width)` each.
    fn new(
        preset: &'a Preset,
        count: usize,
        (height, width): (u32, u32),
        keep_decoded: bool,
    ) -> Result<Self, VideoError> {
        let (rh, rw) = resized(preset, count, (height, width))?;
        let from = (height as usize, width as usize);
        let to = (rh as usize, rw as usize);
        Ok(FrameCollector {
            preset,
            resizer: FrameResizer::new(from, to),
            from,
            to,
            frames: Vec::with_capacity(count.next_multiple_of(preset.temporal_patch_size as usize)),
            keep_decoded,
            decoded: Vec::new(),
        })
    }

    /// Takes sampled frame `k` (a decode that starts again hands frames from 0 again).
    fn push(&mut self, k: usize, rgb: Rgb) -> Result<(), VideoError> {
        self.frames.truncate(k);
        self.decoded.truncate(k);
        let size = |(h, w): (usize, usize)| (h as u32, w as u32);
        let frame = k.to_string();
        same_size(&frame, size((rgb.height, rgb.width)), size(self.from))?;
        if self.keep_decoded {
            self.decoded.push(Rgb {
                width: rgb.width,
                height: rgb.height,
                data: rgb.data.clone(),
            });
        }
        let data = self.resizer.resize(rgb.data);
        self.frames.push(Rgb {
            width: self.to.1,
            height: self.to.0,
            data,
        });
        Ok(())
    }

    /// Pads to the temporal patch with the last frame and patchifies.
    fn finish(mut self, lut: &PixelLut, plan: &FramePlan) -> VideoOut {
        let t = self.preset.temporal_patch_size as usize;
        while !self.frames.len().is_multiple_of(t) {
            let last = self.frames.last().expect("at least one frame");
            let copy = Rgb {
                width: last.width,
                height: last.height,
                data: last.data.clone(),
            };
            self.frames.push(copy);
        }
        let (pixels, rows, grid_thw) = patchify_frames(&self.frames, self.preset, lut);
        let second_per_grid = match self.preset.video.second_per_grid {
            true => plan.second_per_grid(self.preset.temporal_patch_size),
            false => 0.0,
        };
        VideoOut {
            pixels,
            rows,
            grid_thw,
            second_per_grid,
            timestamps: dates(self.preset, plan),
            indices: plan.indices.clone(),
            decoded: self.keep_decoded.then_some(self.decoded),
            work: 0,
        }
    }
}

/// A video's frames all have the first's (height, width): a frame of another size (a clip's
/// frame `frame`, or a listed image) is refused by name.
pub(crate) fn same_size(frame: &str, got: (u32, u32), first: (u32, u32)) -> Result<(), VideoError> {
    match got == first {
        true => Ok(()),
        false => Err(VideoError::Corrupt(format!(
            "frame {frame} is {}x{}, the first {}x{} (HxW): sizes may not change",
            got.0, got.1, first.0, first.1
        ))),
    }
}

/// What preparing one video may use: the header's limits, the pixels its resized frames may
/// take of what the sample has left, and the decoding work it has left.
#[derive(Debug, Clone, Copy)]
pub struct VideoBudget {
    pub limits: VideoLimits,
    pub pixels: u64,
    pub work: u64,
}

/// Frames of `(height, width)` resized for `count` sampled, within `pixels`.
fn sized(
    preset: &Preset,
    count: usize,
    upright: (u32, u32),
    pixels: u64,
) -> Result<(u32, u32), VideoError> {
    let (h, w) = resized(preset, count, upright)?;
    let kept = count.next_multiple_of(preset.temporal_patch_size as usize);
    if kept as u64 * u64::from(h) * u64::from(w) > pixels {
        return Err(VideoError::SamplePixels {
            frames: kept,
            w,
            h,
            max: pixels,
        });
    }
    Ok((h, w))
}

/// A clip's tensors: header checked, frames sampled, decoded, resized, patchified. `open`
/// gives a reader of the clip from its start (it is read twice: header, then frames).
pub fn process_clip<R: Read + Seek + Send + 'static>(
    mut open: impl FnMut() -> R,
    part: &VideoPart,
    preset: &Preset,
    lut: &PixelLut,
    budget: VideoBudget,
    keep_decoded: bool,
    cancel: &Cancel,
) -> Result<VideoOut, VideoError> {
    let (header, plan, work) = clip_plan(open(), part, preset, budget)?;
    let upright = header.upright();
    sized(preset, plan.indices.len(), upright, budget.pixels)?;
    let mut frames = FrameCollector::new(preset, plan.indices.len(), upright, keep_decoded)?;
    decode(
        open,
        &header,
        &plan.indices,
        Skipping::NonReference,
        cancel,
        |k, rgb| frames.push(k, rgb),
    )?;
    Ok(VideoOut {
        work,
        ..frames.finish(lut, &plan)
    })
}

/// A frame list's tensors: every frame kept, in order, dated at the part's `fps` (2 when
/// absent), as qwen-vl-utils takes a list of frames.
pub fn process_frame_list(
    decoded: Vec<Rgb>,
    part: &VideoPart,
    preset: &Preset,
    lut: &PixelLut,
    pixels: u64,
    keep_decoded: bool,
) -> Result<VideoOut, VideoError> {
    let plan = frame_list_plan(decoded.len(), part);
    let first = &decoded[0];
    let upright = (first.height as u32, first.width as u32);
    sized(preset, decoded.len(), upright, pixels)?;
    let mut frames = FrameCollector::new(preset, decoded.len(), upright, keep_decoded)?;
    for (k, rgb) in decoded.into_iter().enumerate() {
        frames.push(k, rgb)?;
    }
    Ok(frames.finish(lut, &plan))
}

fn frame_list_plan(count: usize, part: &VideoPart) -> FramePlan {
    FramePlan {
        indices: (0..count as u64).collect(),
        sampled: count as u64,
        video_fps: part.fps.unwrap_or(2.0),
        total: count as u64,
    }
}

/// A clip's tokens from its header alone (no frame is decoded), and what it costs.
pub fn measure_clip<R: Read + Seek + Send + 'static>(
    reader: R,
    part: &VideoPart,
    preset: &Preset,
    budget: VideoBudget,
) -> Result<(VideoTokens, Spent), VideoError> {
    let (header, plan, work) = clip_plan(reader, part, preset, budget)?;
    let (tokens, pixels) = measured(preset, &plan, header.upright(), budget.pixels)?;
    Ok((tokens, Spent { pixels, work }))
}

/// A clip's header, checked, the frames the preset samples from it, and the decoding work
/// they cost: every frame up to the last one sampled, at the header's size (the decoder
/// refuses a frame of another size, or past the header's count, and stops at the last
/// sampled), charged before a frame is decoded.
fn clip_plan<R: Read + Seek + Send + 'static>(
    reader: R,
    part: &VideoPart,
    preset: &Preset,
    budget: VideoBudget,
) -> Result<(VideoHeader, FramePlan, u64), VideoError> {
    let header = probe(reader, budget.limits)?;
    let part_range = (part.video_start, part.video_end);
    let plan = plan_frames(preset, &header, part.fps, part_range)?;
    let frames = plan.indices.last().map_or(0, |last| last + 1);
    let work = frames * u64::from(header.width) * u64::from(header.height);
    if work > budget.work {
        return Err(VideoError::OverWorkBudget {
            frames,
            w: header.width,
            h: header.height,
            max: budget.work,
        });
    }
    Ok((header, plan, work))
}

/// A frame list's tokens from its frames' (upright) size.
pub fn measure_frame_list(
    count: usize,
    upright: (u32, u32),
    part: &VideoPart,
    preset: &Preset,
    pixels: u64,
) -> Result<(VideoTokens, u64), VideoError> {
    measured(preset, &frame_list_plan(count, part), upright, pixels)
}

/// The tokens and the resized pixels of a video sampled as `plan` says.
fn measured(
    preset: &Preset,
    plan: &FramePlan,
    upright: (u32, u32),
    pixels: u64,
) -> Result<(VideoTokens, u64), VideoError> {
    let n = plan.indices.len();
    let (h, w) = sized(preset, n, upright, pixels)?;
    let t = preset.temporal_patch_size as usize;
    let p = preset.patch_size;
    let grid = [n.div_ceil(t) as i64, i64::from(h / p), i64::from(w / p)];
    let timestamps = dates(preset, plan);
    let used = (n.next_multiple_of(t) as u64) * u64::from(h) * u64::from(w);
    Ok((video_tokens(preset, grid, timestamps), used))
}

/// Qwen3-VL's group times, or none.
fn dates(preset: &Preset, plan: &FramePlan) -> Vec<f64> {
    match preset.video.timestamps {
        true => plan.timestamps(preset.temporal_patch_size),
        false => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preprocess::preset::PresetName;

    fn header(frames: u64, fps: f64) -> VideoHeader {
        VideoHeader {
            width: 640,
            height: 360,
            rotation: 0,
            frames,
            fps: Some(fps),
        }
    }

    #[test]
    fn qwen2_samples_by_arange_and_qwen3_by_linspace() {
        let q2 = Preset::new(PresetName::Qwen2Vl);
        // 10 s at 30 fps, 2 fps: 20 frames, every 15th.
        let p = plan_frames(&q2, &header(300, 30.0), None, (None, None)).unwrap();
        assert_eq!(p.indices.len(), 20);
        assert_eq!(&p.indices[..3], &[0, 15, 30]);
        assert_eq!(p.second_per_grid(2), 1.0);
        // A short clip takes min_frames, floored to the temporal patch.
        let p = plan_frames(&q2, &header(5, 30.0), None, (None, None)).unwrap();
        assert_eq!(p.indices, vec![0, 1, 2, 3]);
        let q3 = Preset::new(PresetName::Qwen3Vl);
        let p = plan_frames(&q3, &header(37, 29.97), None, (None, None)).unwrap();
        // int(37 / 29.97 * 2) = 2 → min_frames 4: linspace(0, 36, 4) = 0, 12, 24, 36.
        assert_eq!(p.indices, vec![0, 12, 24, 36]);
        let ts = p.timestamps(2);
        assert_eq!(ts.len(), 2);
        assert!((ts[0] - 6.0 / 29.97).abs() < 1e-12);
        // A clip shorter than min_frames keeps every frame.
        let p = plan_frames(&q3, &header(3, 24.0), None, (None, None)).unwrap();
        assert_eq!(p.indices, vec![0, 1, 2]);
    }

    #[test]
    fn a_frame_past_the_end_is_sampled_but_not_decoded() {
        // arange(0, 397, 397 / 30) has 31 values, the last 397: a frame the clip does not
        // have. PyAV's reader leaves it out; the sampled rate counts it.
        for name in [PresetName::Qwen2Vl, PresetName::Qwen25Vl] {
            for (frames, fps, last) in [(397, 25.0, 383), (367, 23.976, 354)] {
                let p = plan_frames(&Preset::new(name), &header(frames, fps), None, (None, None))
                    .unwrap();
                assert_eq!((p.sampled, p.indices.len()), (31, 30), "{frames} at {fps}");
                assert_eq!(*p.indices.last().unwrap(), last);
                assert_eq!(p.second_per_grid(2), 2.0 / (31.0 / frames as f64 * fps));
            }
        }
    }

    #[test]
    fn a_part_of_the_clip_samples_within_it() {
        let q3 = Preset::new(PresetName::Qwen3Vl);
        let p = plan_frames(&q3, &header(300, 30.0), Some(1.0), (Some(2.0), Some(6.0))).unwrap();
        assert_eq!(p.total, 121);
        assert_eq!(*p.indices.first().unwrap(), 60);
        assert_eq!(*p.indices.last().unwrap(), 180);
        assert_eq!(p.indices.len(), 4);
        let e = plan_frames(&q3, &header(30, 30.0), None, (Some(5.0), Some(6.0))).unwrap_err();
        assert!(e.to_string().contains("holds no frame"), "{e}");
    }

    #[test]
    fn qwen3_budgets_the_whole_video() {
        let q3 = Preset::new(PresetName::Qwen3Vl);
        // 4 frames of 360x640 = 921,600 px > 786,432: scaled down together.
        let (h, w) = resized(&q3, 4, (360, 640)).unwrap();
        assert!(4 * h as u64 * w as u64 <= q3.video.max_pixels);
        assert_eq!((h % 32, w % 32), (0, 0));
        let q2 = Preset::new(PresetName::Qwen2Vl);
        // Per frame: 230,400 px lies within [100,352, 602,112]: rounded to 28s only.
        assert_eq!(resized(&q2, 100, (360, 640)).unwrap(), (364, 644));
    }
}
