//! Video containers → upright RGB frames, through FFmpeg's libav* (Debian's libraries, bound
//! by `ffmpeg-next`).
//!
//! A container is read through any `Read + Seek` (a whole object in memory, or ranges of it
//! from the store), its header checked against the limits before a packet is decoded, and only
//! the frames a sampling asks for are converted to RGB. Of the rest, those no other frame
//! refers to are not decoded at all (H.264); the others are decoded as references and dropped.

use super::video_error::VideoError;
use super::video_rgb::Converter;
use super::vision::Rgb;
use crate::cancel::Cancel;
use ffmpeg_next as ff;
use std::collections::{BTreeSet, HashMap, VecDeque};
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

/// An opened container and the index of its video stream.
struct Opened {
    input: ff::format::context::Input,
    stream: usize,
}

/// The demuxers clips are read with (FFmpeg's names): MP4/MOV, Matroska/WebM and AVI, the
/// containers datasets hold. FFmpeg refuses any other (GIF, image sequences, raw streams: each
/// more code reading untrusted bytes, some far costlier per byte) as soon as it has probed the
/// format, before reading the stream.
const CONTAINERS: &str = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi";

fn open<R: Read + Seek + Send + 'static>(reader: R) -> Result<Opened, VideoError> {
    init();
    let io = ff::format::context::StreamIo::from_read_seek(reader)
        .map_err(|e| VideoError::corrupt("opening the container", e))?;
    let mut options = ff::Dictionary::new();
    options.set("format_whitelist", CONTAINERS);
    // FFmpeg says "invalid data" alike for a file no demuxer knows and one cut short before its
    // index: both are the data's fault, named with FFmpeg's words. A format off the list is
    // its EINVAL.
    let input = ff::format::input_from_stream(io, None, Some(options)).map_err(|e| match e {
        ff::Error::Other { errno } if errno == ff::util::error::EINVAL => {
            VideoError::UnsupportedContainer
        }
        e => VideoError::corrupt("opening the container", e),
    })?;
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

/// Whether the decoder may leave out frames that are neither sampled nor referenced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skipping {
    /// H.264's non-reference frames (`nal_ref_idc` 0: no other frame is predicted from them)
    /// that no index asks for are not decoded. Other codecs decode every frame: HEVC's
    /// "non-reference" marks are per temporal sub-layer, and a higher one may refer to them.
    NonReference,
    /// Every frame up to the last sampled is decoded.
    Off,
}

/// What one decode did, for tests and benchmarks.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DecodeStats {
    /// Packets sent to the decoder.
    pub sent: u64,
    /// Frames it decoded and put out (those it left out never come out).
    pub decoded: u64,
    /// The stream's timestamps did not let frames be known before decoding, so it was decoded
    /// again with nothing skipped.
    pub decoded_again: bool,
}

/// Decodes the video stream of the container `open()` reads (whose header [`probe`] gave)
/// and hands `frame(k, rgb)` the upright RGB frame at each of `indices` (frame numbers in
/// presentation order, ascending, repeats allowed), `k` being its place in `indices`.
///
/// Frame numbers are those of a decoder that outputs every frame (PyAV's): the n-th frame
/// out. When `skipping` lets frames be left out, a frame's number comes from its timestamp
/// instead, ranked among the stream's; where the timestamps cannot say it before decoding
/// (missing, repeated, decode order going back, a frame the rank did not foresee), the clip is
/// opened again and decoded whole, and `frame` is called again from `k = 0`.
///
/// Before each packet is decoded `cancel` is read: once it is set, decoding stops with
/// [`VideoError::Cancelled`].
pub fn decode<R: Read + Seek + Send + 'static>(
    mut open: impl FnMut() -> R,
    header: &VideoHeader,
    indices: &[u64],
    skipping: Skipping,
    cancel: &Cancel,
    mut frame: impl FnMut(usize, Rgb) -> Result<(), VideoError>,
) -> Result<DecodeStats, VideoError> {
    debug_assert!(indices.windows(2).all(|w| w[0] <= w[1]));
    if indices.is_empty() {
        return Ok(DecodeStats::default());
    }
    if skipping == Skipping::NonReference {
        match run(open(), header, indices, true, cancel, &mut frame) {
            // Any failure with frames left out is retried with none: the whole decode's own
            // answer (a frame, or the error that names what is wrong) is the one that counts.
            Ok(stats) => return Ok(stats),
            Err(e @ VideoError::Cancelled { .. }) => return Err(e),
            Err(_) => {
                let stats = run(open(), header, indices, false, cancel, &mut frame)?;
                return Ok(DecodeStats {
                    decoded_again: true,
                    ..stats
                });
            }
        }
    }
    run(open(), header, indices, false, cancel, &mut frame)
}

/// One pass over the stream; `skip` asks to leave non-reference frames out where the codec
/// allows it.
fn run<R: Read + Seek + Send + 'static>(
    reader: R,
    header: &VideoHeader,
    indices: &[u64],
    skip: bool,
    cancel: &Cancel,
    frame: &mut impl FnMut(usize, Rgb) -> Result<(), VideoError>,
) -> Result<DecodeStats, VideoError> {
    let mut opened = open(reader)?;
    let stream = opened.input.stream(opened.stream).expect("found in open");
    let mut ctx = ff::codec::context::Context::from_parameters(stream.parameters())
        .map_err(|e| VideoError::corrupt("reading the codec parameters", e))?;
    // One thread per clip: the worker already decodes samples side by side on every core
    // (and a skip decision must reach the decoder with its packet).
    ctx.set_threading(ff::codec::threading::Config {
        kind: ff::codec::threading::Type::None,
        count: 1,
        ..Default::default()
    });
    // The decoder refuses a frame larger than the header's (with room for coded sizes rounded
    // up to whole macroblocks) before allocating it; one of another size is refused before
    // conversion (`Output::take`).
    let coded = |side: u32| i64::from(side.next_multiple_of(64));
    // SAFETY: a plain field of a codec context not yet opened.
    unsafe { (*ctx.as_mut_ptr()).max_pixels = coded(header.width) * coded(header.height) };
    let mut decoder = ctx.decoder().video().map_err(|e| match e {
        ff::Error::DecoderNotFound => VideoError::Unsupported,
        e => VideoError::corrupt("opening the decoder", e),
    })?;
    let skip = skip && decoder.id() == ff::codec::Id::H264;
    let mut out = Output {
        header,
        indices,
        next: 0,
        number: 0,
        converter: Converter::default(),
        decoded: ff::frame::Video::empty(),
        order: skip.then(Order::default),
        last_rank: None,
        cancel,
        frame,
    };
    let mut stats = DecodeStats::default();
    let index = opened.stream;
    // Packets waiting for their frame number (known once decode order has passed their time).
    let mut waiting: VecDeque<(ff::Packet, Option<i64>)> = VecDeque::new();
    let mut skipping_now = false;
    let mut packets = opened.input.packets();
    while out.next < indices.len() {
        let packet = packets.by_ref().find(|(s, _)| s.index() == index);
        let Some(order) = out.order.as_mut() else {
            match packet {
                Some((_, packet)) => {
                    stats.sent += 1;
                    out.send(&mut decoder, &packet)?;
                    continue;
                }
                None => {
                    out.finish(&mut decoder)?;
                    break;
                }
            }
        };
        match packet {
            Some((_, packet)) => {
                // The demuxer's own discards (before an edit list's start) are decoded as
                // references and never output: they take no number.
                let pts = match discarded(&packet) {
                    true => None,
                    false => {
                        order.add(packet.pts(), packet.dts())?;
                        packet.pts()
                    }
                };
                waiting.push_back((packet, pts));
                if waiting.len() > MAX_REORDER {
                    return Err(unforeseen("frames reordered further than any codec"));
                }
            }
            None => order.finish(),
        }
        let ended = order.ended;
        while let Some(&(_, pts)) = waiting.front() {
            let rank = match pts {
                Some(pts) => match out.order.as_ref().and_then(|o| o.rank(pts)) {
                    Some(rank) => Some(rank),
                    None => break,
                },
                None => None,
            };
            let (packet, _) = waiting.pop_front().expect("looked at above");
            let leave_out = rank.is_some_and(|r| indices.binary_search(&r).is_err());
            if leave_out != skipping_now {
                decoder.skip_frame(match leave_out {
                    true => ff::Discard::NonReference,
                    false => ff::Discard::Default,
                });
                skipping_now = leave_out;
            }
            stats.sent += 1;
            out.send(&mut decoder, &packet)?;
            if out.next == indices.len() {
                break;
            }
        }
        if ended {
            out.finish(&mut decoder)?;
            break;
        }
    }
    if out.next < indices.len() {
        return Err(VideoError::Corrupt(format!(
            "the stream ended after {} frames; its header says {} (frame {} was sampled)",
            out.number, header.frames, indices[out.next]
        )));
    }
    Ok(DecodeStats {
        decoded: out.number,
        ..stats
    })
}

/// Packets a decoder may hold back for reordering, and more: H.264 reorders at most 16.
const MAX_REORDER: usize = 64;

/// Frames left out need numbers from timestamps; this stream's do not give them.
fn unforeseen(why: &str) -> VideoError {
    VideoError::Corrupt(format!("{why}: frames cannot be numbered before decoding"))
}

fn discarded(packet: &ff::Packet) -> bool {
    use ff::packet::Ref;
    // SAFETY: a plain field of a packet the demuxer filled.
    unsafe { (*packet.as_ptr()).flags & ff::ffi::AV_PKT_FLAG_DISCARD != 0 }
}

/// Presentation numbers of a stream's frames from their timestamps, as packets arrive in
/// decode order. Every later packet's pts is at least its dts, which is at least the last dts
/// seen: a pts below that has all the frames before it in view, and its number is final.
#[derive(Default)]
struct Order {
    /// Timestamps seen and not yet numbered.
    pending: BTreeSet<i64>,
    /// Numbered and not yet output.
    numbered: HashMap<i64, u64>,
    count: u64,
    last_dts: Option<i64>,
    ended: bool,
}

impl Order {
    fn add(&mut self, pts: Option<i64>, dts: Option<i64>) -> Result<(), VideoError> {
        let Some(pts) = pts else {
            return Err(unforeseen("a packet without a presentation time"));
        };
        // Frames before the last decode time are numbered: a frame shown before it now
        // would have been ranked too late.
        if self.last_dts.is_some_and(|last| pts < last) {
            return Err(unforeseen("a frame shown before frames already numbered"));
        }
        if dts.is_some_and(|dts| pts < dts || self.last_dts.is_some_and(|last| dts < last)) {
            return Err(unforeseen("decode timestamps out of order"));
        }
        if self.numbered.contains_key(&pts) || !self.pending.insert(pts) {
            return Err(unforeseen("two frames at one time"));
        }
        // No decode time (Matroska's first packets of a reordered stream, where FFmpeg cannot
        // derive one yet): nothing more is known, nothing is numbered.
        let Some(dts) = dts else { return Ok(()) };
        self.last_dts = Some(dts);
        while let Some(first) = self.pending.first().copied().filter(|&p| p < dts) {
            self.number(first);
        }
        Ok(())
    }

    /// The stream ended: every timestamp seen is numbered.
    fn finish(&mut self) {
        while let Some(first) = self.pending.first().copied() {
            self.number(first);
        }
        self.ended = true;
    }

    fn number(&mut self, pts: i64) {
        self.pending.remove(&pts);
        self.numbered.insert(pts, self.count);
        self.count += 1;
    }

    fn rank(&self, pts: i64) -> Option<u64> {
        self.numbered.get(&pts).copied()
    }
}

/// The decoder's side of a pass: frames out, numbered (counted, or by timestamp when frames
/// are left out), and the sampled ones handed on.
struct Output<'a, F> {
    header: &'a VideoHeader,
    indices: &'a [u64],
    /// The next place in `indices` to hand on.
    next: usize,
    /// Frames out so far.
    number: u64,
    converter: Converter,
    decoded: ff::frame::Video,
    order: Option<Order>,
    last_rank: Option<u64>,
    cancel: &'a Cancel,
    frame: &'a mut F,
}

impl<F: FnMut(usize, Rgb) -> Result<(), VideoError>> Output<'_, F> {
    fn send(
        &mut self,
        decoder: &mut ff::decoder::Video,
        packet: &ff::Packet,
    ) -> Result<(), VideoError> {
        if self.cancel.is_set() {
            return Err(VideoError::Cancelled {
                frames: self.number,
            });
        }
        decoder
            .send_packet(packet)
            .map_err(|e| VideoError::corrupt(&format!("decoding frame {}", self.number), e))?;
        self.receive(decoder)
    }

    fn finish(&mut self, decoder: &mut ff::decoder::Video) -> Result<(), VideoError> {
        decoder
            .send_eof()
            .map_err(|e| VideoError::corrupt("flushing the decoder", e))?;
        self.receive(decoder)
    }

    /// Takes every frame the decoder has ready.
    fn receive(&mut self, decoder: &mut ff::decoder::Video) -> Result<(), VideoError> {
        while self.next < self.indices.len() {
            match decoder.receive_frame(&mut self.decoded) {
                Ok(()) => self.take()?,
                Err(ff::Error::Eof)
                | Err(ff::Error::Other {
                    errno: ff::util::error::EAGAIN,
                }) => break,
                Err(e) => {
                    return Err(VideoError::corrupt(
                        &format!("decoding frame {}", self.number),
                        e,
                    ))
                }
            }
        }
        Ok(())
    }

    fn take(&mut self) -> Result<(), VideoError> {
        if self.number > self.header.frames {
            // More frames than the header said: the header bounded the work.
            return Err(VideoError::TooManyFrames {
                frames: self.number,
                max: self.header.frames,
            });
        }
        let size = (self.decoded.width(), self.decoded.height());
        if size != (self.header.width, self.header.height) {
            return Err(VideoError::Corrupt(format!(
                "frame {} is {}x{}, the stream's header says {}x{}: a clip changing frame size \
                 is not read",
                self.number, size.0, size.1, self.header.width, self.header.height
            )));
        }
        let number = match &mut self.order {
            None => self.number,
            Some(order) => {
                let rank = self
                    .decoded
                    .pts()
                    .and_then(|pts| order.numbered.remove(&pts))
                    .ok_or_else(|| unforeseen("a frame out at a time no packet had"))?;
                if self.last_rank.is_some_and(|last| rank <= last) || self.indices[self.next] < rank
                {
                    return Err(unforeseen("frames out of order or missing"));
                }
                self.last_rank = Some(rank);
                rank
            }
        };
        self.number += 1;
        while self.next < self.indices.len() && self.indices[self.next] == number {
            let rgb = self.converter.rgb(&self.decoded, self.header.rotation)?;
            (self.frame)(self.next, rgb)?;
            self.next += 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    const CLIP: &[u8] = include_bytes!("../../tests/fixtures/clip.mp4");
    /// The same stream remuxed (`ffmpeg -c copy`): Matroska gives its first packets no dts.
    const CLIP_MKV: &[u8] = include_bytes!("../../tests/fixtures/clip.mkv");
    /// Again, in AVI (LLaMA-Factory's own video demo is an H.264 `.avi`).
    const CLIP_AVI: &[u8] = include_bytes!("../../tests/fixtures/clip.avi");
    /// H.264 at 64x48 for 5 frames, then 96x72 (two raw streams joined, `-c copy` to Matroska).
    const SIZE_CHANGE: &[u8] = include_bytes!("../../tests/fixtures/size_change.mkv");

    const LIMITS: VideoLimits = VideoLimits {
        max_side: 4096,
        max_frame_pixels: 1 << 24,
        max_frames: 1000,
    };

    #[test]
    fn decoding_stops_within_one_frame_of_the_cancel() {
        let header = probe(Cursor::new(CLIP.to_vec()), LIMITS).unwrap();
        let open = || Cursor::new(CLIP.to_vec());
        let cancel = Cancel::default();
        let mut guard = Some(cancel.on_drop());
        let mut taken = Vec::new();
        let err = decode(
            open,
            &header,
            &[0, 1, 29],
            Skipping::NonReference,
            &cancel,
            |k, _| {
                taken.push(k);
                guard.take(); // the waiting side goes away once the first frame is out
                Ok(())
            },
        )
        .unwrap_err();
        let VideoError::Cancelled { frames } = err else {
            panic!("{err:?}")
        };
        // Frames the decoder already held come out with the first; no packet is decoded
        // after the flag, so the sampled frame 29 is never reached.
        assert!(
            taken.len() < 3 && (1..29).contains(&frames),
            "{taken:?} {frames}"
        );
    }

    #[test]
    fn avi_is_read_as_mp4_is_and_other_containers_are_refused_unread() {
        let frames = [0, 14, 29];
        let (mp4, _) = decode_of(CLIP, &frames, Skipping::Off);
        let (avi, _) = decode_of(CLIP_AVI, &frames, Skipping::Off);
        assert!(mp4.iter().zip(&avi).all(|(a, b)| a.data == b.data));
        let mut gif = Vec::new();
        {
            let mut enc = image::codecs::gif::GifEncoder::new(&mut gif);
            for i in 0..3u8 {
                let img = image::RgbaImage::from_pixel(16, 16, image::Rgba([i * 80, 0, 0, 255]));
                enc.encode_frame(image::Frame::new(img)).unwrap();
            }
        }
        let got = probe(Cursor::new(gif), LIMITS);
        assert_eq!(got.unwrap_err(), VideoError::UnsupportedContainer);
    }

    #[test]
    fn a_frame_of_another_size_than_the_header_is_refused_before_conversion() {
        let header = probe(Cursor::new(SIZE_CHANGE.to_vec()), LIMITS).unwrap();
        let open = || Cursor::new(SIZE_CHANGE.to_vec());
        let mut converted = 0;
        let err = decode(
            open,
            &header,
            &[0, 9],
            Skipping::Off,
            &Cancel::default(),
            |_, _| {
                converted += 1;
                Ok(())
            },
        )
        .unwrap_err();
        assert!(
            matches!(&err, VideoError::Corrupt(m) if m.contains("the stream's header says")),
            "{err}"
        );
        assert_eq!(converted, 0, "no frame of another size is converted");
    }

    fn decode_of(clip: &[u8], indices: &[u64], skipping: Skipping) -> (Vec<Rgb>, DecodeStats) {
        let header = probe(Cursor::new(clip.to_vec()), LIMITS).unwrap();
        let mut got = Vec::new();
        let open = || Cursor::new(clip.to_vec());
        let stats = decode(
            open,
            &header,
            indices,
            skipping,
            &Cancel::default(),
            |k, rgb| {
                got.truncate(k);
                got.push(rgb);
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(got.len(), indices.len());
        (got, stats)
    }

    #[test]
    fn left_out_frames_change_no_sampled_frame() {
        // The fixture: H.264, 30 frames, mostly non-reference B-frames between I and P.
        let cases = [vec![0, 5, 10, 15, 20, 25, 29], vec![3, 3, 17], vec![29]];
        for (clip, indices) in [CLIP, CLIP_MKV]
            .into_iter()
            .flat_map(|c| cases.iter().map(move |i| (c, i)))
        {
            let (all, whole) = decode_of(clip, indices, Skipping::Off);
            let (some, skipped) = decode_of(clip, indices, Skipping::NonReference);
            let up_to_last = indices.last().unwrap() + 1;
            assert_eq!(whole.decoded, up_to_last, "{indices:?}: {whole:?}");
            assert!(
                skipped.decoded < up_to_last,
                "{indices:?}: nothing left out ({skipped:?})"
            );
            assert!(!skipped.decoded_again, "{indices:?}");
            for (k, (a, b)) in all.iter().zip(&some).enumerate() {
                assert_eq!(a.data, b.data, "{indices:?}: frame {} differs", indices[k]);
            }
        }
    }

    #[test]
    fn frames_are_numbered_when_decode_order_has_passed_them() {
        let mut order = Order::default();
        // I0 P3 B1 B2 in decode order, dts trailing by two frames.
        order.add(Some(0), Some(-2)).unwrap();
        order.add(Some(3), Some(-1)).unwrap();
        assert_eq!(
            order.rank(0),
            None,
            "a later packet may still come before it"
        );
        order.add(Some(1), Some(0)).unwrap();
        assert_eq!(order.rank(0), None);
        order.add(Some(2), Some(1)).unwrap();
        assert_eq!(
            (order.rank(0), order.rank(1), order.rank(2)),
            (Some(0), None, None)
        );
        order.add(Some(6), Some(3)).unwrap();
        assert_eq!(
            (order.rank(1), order.rank(2), order.rank(3)),
            (Some(1), Some(2), None)
        );
        order.finish();
        assert_eq!((order.rank(3), order.rank(6)), (Some(3), Some(4)));
    }

    #[test]
    fn timestamps_that_cannot_number_frames_are_refused() {
        let mut order = Order::default();
        assert!(order.add(None, Some(0)).is_err());
        order.add(Some(5), Some(1)).unwrap();
        assert!(
            order.add(Some(7), Some(0)).is_err(),
            "decode order went back"
        );
        assert!(
            order.add(Some(5), Some(2)).is_err(),
            "two frames at one time"
        );
        assert!(order.add(Some(1), Some(2)).is_err(), "pts before dts");
        assert!(
            order.add(Some(0), None).is_err(),
            "shown before numbered frames"
        );
    }

    #[test]
    fn packets_without_decode_time_wait_for_one() {
        // Matroska's reordered H.264: the first two packets have no dts.
        let mut order = Order::default();
        order.add(Some(0), None).unwrap();
        order.add(Some(3), None).unwrap();
        assert_eq!(order.rank(0), None);
        order.add(Some(1), Some(0)).unwrap();
        order.add(Some(2), Some(1)).unwrap();
        assert_eq!((order.rank(0), order.rank(1)), (Some(0), None));
        order.add(Some(6), Some(3)).unwrap();
        assert_eq!(
            (order.rank(1), order.rank(2), order.rank(3)),
            (Some(1), Some(2), None)
        );
    }
}
