//! Video containers → upright RGB frames, through FFmpeg's libav* (Debian's libraries, bound
//! by `ffmpeg-next`).
//!
//! A container is read through any `Read + Seek` (a whole object in memory, or ranges of it
//! from the store), its header checked against the limits before a packet is decoded, and only
//! the frames a sampling asks for are converted to RGB: the rest are decoded (inter-coded
//! streams need them as references) and dropped.

use super::video_error::VideoError;
use super::vision::Rgb;
use ffmpeg_next as ff;
use std::io::{Read, Seek};
use std::sync::Once;

/// What a container's header says of its first video stream, before any frame is decoded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VideoHeader {
    /// Coded size of a frame.
    pub width: u32,
    pub height: u32,
    /// Clockwise rotation the display matrix asks for: 0, 90, 180 or 270.
    pub rotation: u16,
    /// Frames in the stream: the container's count, or (when it keeps none, as Matroska and
    /// WebM do) its packets counted without decoding them.
    pub frames: u64,
    /// Average frame rate (PyAV's `average_rate`); `None` when the container gives none.
    pub fps: Option<f64>,
}

impl VideoHeader {
    /// (height, width) of a frame once upright.
    pub fn upright(&self) -> (u32, u32) {
        match self.rotation {
            90 | 270 => (self.width, self.height),
            _ => (self.height, self.width),
        }
    }
}

/// Bounds checked from the header, before decoding: each frame's size, and the frames the
/// decoder must run through (decode time grows with them, whatever is sampled).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct VideoLimits {
    pub max_side: u32,
    pub max_frame_pixels: u64,
    pub max_frames: u64,
}

fn init() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        // Decoder warnings go to our error messages, not the worker's stderr.
        ff::util::log::set_level(ff::util::log::Level::Fatal);
        let _ = ff::init();
    });
}

fn corrupt(what: &str, e: ff::Error) -> VideoError {
    VideoError::Corrupt(format!("{what}: {e}"))
}

/// An opened container and the index of its video stream.
struct Opened {
    input: ff::format::context::Input,
    stream: usize,
}

fn open<R: Read + Seek + Send + 'static>(reader: R) -> Result<Opened, VideoError> {
    init();
    let io = ff::format::context::StreamIo::from_read_seek(reader)
        .map_err(|e| corrupt("opening the container", e))?;
    // FFmpeg says "invalid data" alike for a file no demuxer knows and one cut short before its
    // index: both are the data's fault, named with FFmpeg's words.
    let input = ff::format::input_from_stream(io, None, None)
        .map_err(|e| corrupt("opening the container", e))?;
    let stream = input
        .streams()
        .best(ff::media::Type::Video)
        .ok_or(VideoError::NoVideoStream)?
        .index();
    Ok(Opened { input, stream })
}

/// The header of the container `reader` holds. Reads the container's index; counts packets
/// only when the container keeps no frame count.
pub fn probe<R: Read + Seek + Send + 'static>(
    reader: R,
    limits: VideoLimits,
) -> Result<VideoHeader, VideoError> {
    let mut opened = open(reader)?;
    let header = header_of(&mut opened)?;
    check(&header, limits)?;
    Ok(header)
}

fn header_of(opened: &mut Opened) -> Result<VideoHeader, VideoError> {
    let stream = opened.input.stream(opened.stream).expect("found in open");
    let params = stream.parameters();
    // SAFETY: the parameters live as long as `stream`; width and height are plain fields.
    let (width, height) = unsafe {
        let p = params.as_ptr();
        ((*p).width.max(0) as u32, (*p).height.max(0) as u32)
    };
    if width == 0 || height == 0 {
        return Err(VideoError::Corrupt(
            "the video stream has no frame size".into(),
        ));
    }
    let rate = stream.avg_frame_rate();
    let fps = (rate.numerator() > 0 && rate.denominator() > 0).then(|| f64::from(rate));
    let rotation = rotation_of(&stream);
    let mut frames = stream.frames().max(0) as u64;
    let index = opened.stream;
    if frames == 0 {
        frames = opened
            .input
            .packets()
            .filter(|(s, _)| s.index() == index)
            .count() as u64;
    }
    Ok(VideoHeader {
        width,
        height,
        rotation,
        frames,
        fps,
    })
}

/// The clockwise rotation of a stream's display matrix, to the nearest quarter turn.
fn rotation_of(stream: &ff::format::stream::Stream) -> u16 {
    for side in stream.side_data() {
        if side.kind() != ff::codec::packet::side_data::Type::DisplayMatrix {
            continue;
        }
        let data = side.data();
        if data.len() < 36 {
            continue;
        }
        // SAFETY: a display matrix is nine i32s (checked above); FFmpeg reads it unaligned-safe.
        let degrees = unsafe { ff::ffi::av_display_rotation_get(data.as_ptr() as *const i32) };
        if !degrees.is_finite() {
            return 0;
        }
        // av_display_rotation_get is counter-clockwise.
        let quarter = ((-degrees / 90.0).round() as i64).rem_euclid(4);
        return (quarter * 90) as u16;
    }
    0
}

fn check(h: &VideoHeader, limits: VideoLimits) -> Result<(), VideoError> {
    let pixels = u64::from(h.width) * u64::from(h.height);
    if h.width > limits.max_side || h.height > limits.max_side || pixels > limits.max_frame_pixels {
        return Err(VideoError::FrameTooLarge {
            w: h.width,
            h: h.height,
            max_side: limits.max_side,
            max_pixels: limits.max_frame_pixels,
        });
    }
    if h.frames > limits.max_frames {
        return Err(VideoError::TooManyFrames {
            frames: h.frames,
            max: limits.max_frames,
        });
    }
    if h.frames == 0 {
        return Err(VideoError::Corrupt("the video stream has no frames".into()));
    }
    Ok(())
}

/// Decodes the video stream of the container `reader` holds (whose header [`probe`] gave)
/// and hands `frame(k, rgb)` the upright RGB frame at each of `indices` (frame numbers in
/// presentation order, ascending, repeats allowed), `k` being its place in `indices`.
pub fn decode<R: Read + Seek + Send + 'static>(
    reader: R,
    header: &VideoHeader,
    indices: &[u64],
    mut frame: impl FnMut(usize, Rgb) -> Result<(), VideoError>,
) -> Result<(), VideoError> {
    debug_assert!(indices.windows(2).all(|w| w[0] <= w[1]));
    if indices.is_empty() {
        return Ok(());
    }
    let mut opened = open(reader)?;
    let stream = opened.input.stream(opened.stream).expect("found in open");
    let mut ctx = ff::codec::context::Context::from_parameters(stream.parameters())
        .map_err(|e| corrupt("reading the codec parameters", e))?;
    // One thread per clip: the worker already decodes samples side by side on every core.
    ctx.set_threading(ff::codec::threading::Config {
        kind: ff::codec::threading::Type::None,
        count: 1,
        ..Default::default()
    });
    let mut decoder = ctx.decoder().video().map_err(|e| match e {
        ff::Error::DecoderNotFound => VideoError::Unsupported,
        e => corrupt("opening the decoder", e),
    })?;
    let index = opened.stream;
    let mut converter = Converter::default();
    let mut decoded = ff::frame::Video::empty();
    let (mut next, mut number) = (0usize, 0u64);
    let mut take =
        |decoded: &ff::frame::Video, number: u64, next: &mut usize| -> Result<(), VideoError> {
            while *next < indices.len() && indices[*next] == number {
                let rgb = converter.rgb(decoded, header.rotation)?;
                frame(*next, rgb)?;
                *next += 1;
            }
            Ok(())
        };
    let mut packets = opened.input.packets();
    let mut eof = false;
    while next < indices.len() {
        match decoder.receive_frame(&mut decoded) {
            Ok(()) => {
                if number > header.frames {
                    // More frames than the header said: the header bounded the work.
                    return Err(VideoError::TooManyFrames {
                        frames: number,
                        max: header.frames,
                    });
                }
                take(&decoded, number, &mut next)?;
                number += 1;
                continue;
            }
            Err(ff::Error::Eof) => break,
            Err(ff::Error::Other {
                errno: ff::util::error::EAGAIN,
            }) => {}
            Err(e) => return Err(corrupt(&format!("decoding frame {number}"), e)),
        }
        if eof {
            break;
        }
        match packets.by_ref().find(|(s, _)| s.index() == index) {
            Some((_, packet)) => decoder
                .send_packet(&packet)
                .map_err(|e| corrupt(&format!("decoding frame {number}"), e))?,
            None => {
                eof = true;
                decoder
                    .send_eof()
                    .map_err(|e| corrupt("flushing the decoder", e))?
            }
        }
    }
    if next < indices.len() {
        return Err(VideoError::Corrupt(format!(
            "the stream ended after {number} frames; its header says {} (frame {} was sampled)",
            header.frames, indices[next]
        )));
    }
    Ok(())
}

/// What a conversion is made for: the frames' format, size, colour matrix and range.
type ScalerKey = (ff::format::Pixel, u32, u32, i32, i32);

/// YUV (or any pixel format) → packed RGB24 at the frame's own size, as PyAV's
/// `to_ndarray(format="rgb24")` converts: swscale, bilinear, the frame's colour matrix
/// (BT.601 when it names none) and range, full-range output.
#[derive(Default)]
struct Converter {
    scaler: Option<(ff::software::scaling::Context, ScalerKey)>,
    rgb: Option<ff::frame::Video>,
}

impl Converter {
    fn rgb(&mut self, frame: &ff::frame::Video, rotation: u16) -> Result<Rgb, VideoError> {
        let (w, h) = (frame.width(), frame.height());
        // SAFETY: plain fields of a decoded frame.
        let (space, range) = unsafe {
            let p = frame.as_ptr();
            ((*p).colorspace as i32, (*p).color_range as i32)
        };
        let key = (frame.format(), w, h, space, range);
        if self.scaler.as_ref().map(|(_, k)| *k) != Some(key) {
            let mut ctx = ff::software::scaling::Context::get(
                frame.format(),
                w,
                h,
                ff::format::Pixel::RGB24,
                w,
                h,
                ff::software::scaling::Flags::BILINEAR,
            )
            .map_err(|e| corrupt("converting to RGB", e))?;
            set_colorspace(&mut ctx, space, range);
            self.scaler = Some((ctx, key));
            self.rgb = Some(ff::frame::Video::new(ff::format::Pixel::RGB24, w, h));
        }
        let (scaler, _) = self.scaler.as_mut().expect("set above");
        let out = self.rgb.as_mut().expect("set with the scaler");
        scaler
            .run(frame, out)
            .map_err(|e| corrupt("converting to RGB", e))?;
        let (w, h) = (w as usize, h as usize);
        let stride = out.stride(0);
        let plane = out.data(0);
        let mut data = Vec::with_capacity(w * h * 3);
        for y in 0..h {
            data.extend_from_slice(&plane[y * stride..y * stride + w * 3]);
        }
        Ok(rotate(
            Rgb {
                width: w,
                height: h,
                data,
            },
            rotation,
        ))
    }
}

/// The colour matrix and input range of a conversion, from the frame's own (as PyAV does).
fn set_colorspace(ctx: &mut ff::software::scaling::Context, space: i32, range: i32) {
    use ff::ffi::*;
    let sws_space = match space {
        x if x == AVColorSpace::AVCOL_SPC_BT709 as i32 => SWS_CS_ITU709,
        x if x == AVColorSpace::AVCOL_SPC_FCC as i32 => SWS_CS_FCC,
        x if x == AVColorSpace::AVCOL_SPC_SMPTE240M as i32 => SWS_CS_SMPTE240M,
        x if x == AVColorSpace::AVCOL_SPC_BT2020_NCL as i32
            || x == AVColorSpace::AVCOL_SPC_BT2020_CL as i32 =>
        {
            SWS_CS_BT2020
        }
        _ => SWS_CS_DEFAULT,
    };
    let full = i32::from(range == AVColorRange::AVCOL_RANGE_JPEG as i32);
    // SAFETY: the context is valid; the coefficient tables are static.
    unsafe {
        let table = sws_getCoefficients(sws_space);
        let dst = sws_getCoefficients(SWS_CS_DEFAULT);
        sws_setColorspaceDetails(ctx.as_mut_ptr(), table, full, dst, 1, 0, 1 << 16, 1 << 16);
    }
}

/// `rgb` turned clockwise by `degrees` (a multiple of 90).
fn rotate(rgb: Rgb, degrees: u16) -> Rgb {
    let (w, h) = (rgb.width, rgb.height);
    let (nw, nh) = match degrees {
        90 | 270 => (h, w),
        180 => (w, h),
        _ => return rgb,
    };
    let mut data = vec![0u8; w * h * 3];
    for y in 0..h {
        for x in 0..w {
            let (nx, ny) = match degrees {
                90 => (h - 1 - y, x),
                180 => (w - 1 - x, h - 1 - y),
                _ => (y, w - 1 - x),
            };
            let (s, d) = ((y * w + x) * 3, (ny * nw + nx) * 3);
            data[d..d + 3].copy_from_slice(&rgb.data[s..s + 3]);
        }
    }
    Rgb {
        width: nw,
        height: nh,
        data,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_turns_clockwise() {
        // 2x1 image: red then green.
        let rgb = Rgb {
            width: 2,
            height: 1,
            data: vec![255, 0, 0, 0, 255, 0],
        };
        let r = rotate(rgb, 90);
        assert_eq!((r.width, r.height), (1, 2));
        // Clockwise: the left pixel ends up on top.
        assert_eq!(r.data, vec![255, 0, 0, 0, 255, 0]);
        let r = rotate(r, 90);
        assert_eq!((r.width, r.height), (2, 1));
        assert_eq!(r.data, vec![0, 255, 0, 255, 0, 0]);
    }
}
