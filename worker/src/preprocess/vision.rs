//! Image bytes → `pixel_values` rows and a `(t, h, w)` grid, as the Qwen-VL processors do.

use super::preset::{PixelDtype, Preset};
use super::resample::resize_rgb8;
use image::{DynamicImage, ImageDecoder, ImageReader, Limits};
use std::io::Cursor;

/// Guards against decompression bombs: checked from the header, before any pixel is decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct DecodeLimits {
    pub max_side: u32,
    pub max_pixels: u64,
    /// Pixel passes decoding may cost (see [`decode_passes`]).
    pub max_work: u64,
}

/// What a sample's media have cost so far: the pixels they decode to, and the decoding work
/// in pixel passes (a pixel decoded once is one).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Spent {
    pub pixels: u64,
    pub work: u64,
}

impl std::ops::AddAssign for Spent {
    fn add_assign(&mut self, other: Spent) {
        self.pixels += other.pixels;
        self.work += other.work;
    }
}

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits::from_config(&stoker_config::Preprocessing::default())
    }
}

impl DecodeLimits {
    pub fn from_config(c: &stoker_config::Preprocessing) -> Self {
        DecodeLimits {
            max_side: c.max_image_side,
            max_pixels: c.max_image_pixels,
            max_work: c.max_sample_work,
        }
    }
}

pub use super::image_error::ImageError;

/// A decoded, upright RGB image.
pub struct Rgb {
    pub width: usize,
    pub height: usize,
    pub data: Vec<u8>,
}

/// What a decoder may allocate besides the pixels: colour profiles, text and EXIF chunks,
/// TIFF tag values, line buffers. Header parsing runs under this alone, so a few-kilobyte
/// profile that inflates to gigabytes is refused before the image's size is even known.
pub const METADATA_BYTES: u64 = 16 << 20;

/// Bytes per pixel of the widest decoded layout an image may have at `max_pixels` (RGBA16): a
/// layout wider than that (float TIFF, 16 bytes per pixel) is refused past `max_pixels / 2`.
pub(crate) const MAX_DECODED_BYTES_PER_PIXEL: u64 = 8;

/// Scans a progressive JPEG may have: encoders write up to ~10; every scan is another pass
/// over the whole image, so a file of thousands of tiny scans costs a decode thread minutes.
pub(crate) const MAX_JPEG_SCANS: usize = 100;

/// Decodes any supported format, applies the EXIF orientation and converts to RGB8.
///
/// JPEG goes through libjpeg-turbo with the settings Pillow uses (accurate integer IDCT, fancy
/// upsampling, Pillow's CMYK → RGB), so our pixels equal the reference processor's; other
/// formats go through the `image` crate. Every allocation is bounded: [`METADATA_BYTES`]
/// while the header is parsed, then the decoded layout's bytes for at most `max_pixels`.
pub fn decode(bytes: &[u8], limits: DecodeLimits) -> Result<Rgb, ImageError> {
    let mut reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| ImageError::Corrupt(e.to_string()))?;
    match reader.format() {
        None => return Err(ImageError::Unsupported),
        Some(image::ImageFormat::Jpeg) => return decode_jpeg(bytes, limits),
        Some(_) => {}
    }
    reader.limits(with_max_alloc(METADATA_BYTES));
    let mut decoder = reader.into_decoder().map_err(classify)?;
    let (w, h) = decoder.dimensions();
    check_limits(w, h, limits)?;
    check_work(w, h, 1, limits)?;
    let need = decoder.total_bytes();
    let max = limits.max_pixels * MAX_DECODED_BYTES_PER_PIXEL;
    if need > max {
        return Err(ImageError::OverBudget(format!(
            "its {w}x{h} pixels decode to {need} bytes, over {max}"
        )));
    }
    decoder
        .set_limits(with_max_alloc(need + METADATA_BYTES))
        .map_err(classify)?;
    let orientation = decoder.orientation().ok();
    let img = DynamicImage::from_decoder(decoder).map_err(classify)?;
    Ok(upright_rgb(img, orientation))
}

fn with_max_alloc(bytes: u64) -> Limits {
    let mut limits = Limits::no_limits();
    limits.max_alloc = Some(bytes);
    limits
}

/// An image's size as its header gives it, and its EXIF orientation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageHeader {
    pub width: u32,
    pub height: u32,
    pub orientation: Option<image::metadata::Orientation>,
    /// [`decode_passes`].
    pub passes: u64,
}

impl ImageHeader {
    /// Its limits checked (see [`check_limits`], [`check_work`]); what decoding it costs.
    pub fn check(&self, limits: DecodeLimits) -> Result<Spent, ImageError> {
        check_limits(self.width, self.height, limits)?;
        check_work(self.width, self.height, self.passes, limits)?;
        Ok(image_cost(self.width, self.height, self.passes))
    }

    /// (height, width) once upright: what `decode` gives, so what smart_resize sees.
    pub fn upright(&self) -> (u32, u32) {
        use image::metadata::Orientation::*;
        match self.orientation {
            Some(Rotate90 | Rotate270 | Rotate90FlipH | Rotate270FlipH) => {
                (self.width, self.height)
            }
            _ => (self.height, self.width),
        }
    }
}

/// Reads an image's header without decoding a pixel. `bytes` may be only the file's first
/// bytes (`complete` false): then `None` means the header runs past them, or the format may
/// keep its orientation past them (only JPEG's and PNG's come before the pixels), and the
/// whole file is needed.
pub fn read_header(bytes: &[u8], complete: bool) -> Result<Option<ImageHeader>, ImageError> {
    let mut reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| ImageError::Corrupt(e.to_string()))?;
    reader.limits(with_max_alloc(METADATA_BYTES));
    use image::ImageFormat::{Bmp, Gif, Jpeg, Png};
    let format = reader.format().ok_or(ImageError::Unsupported)?;
    let header = if format == Jpeg {
        jpeg_frame_size(bytes).map(|(width, height)| ImageHeader {
            width,
            height,
            orientation: jpeg_orientation(bytes),
            passes: decode_passes(bytes),
        })
    } else if complete || matches!(format, Png | Gif | Bmp) {
        match reader.into_decoder() {
            Ok(mut d) => {
                let (width, height) = d.dimensions();
                let orientation = d.orientation().ok();
                Some(ImageHeader {
                    width,
                    height,
                    orientation,
                    passes: 1,
                })
            }
            Err(e) if complete => return Err(classify(e)),
            Err(_) => None,
        }
    } else {
        None
    };
    match header {
        None if complete => Err(ImageError::Corrupt("no image header".into())),
        h => Ok(h),
    }
}

/// A JPEG's start-of-frame segment: its marker (the coding process) and body.
fn jpeg_frame(bytes: &[u8]) -> Option<(u8, &[u8])> {
    let is_frame = |m: u8| (0xc0..=0xcf).contains(&m) && ![0xc4, 0xc8, 0xcc].contains(&m);
    jpeg_segments(bytes).find(|(m, b)| is_frame(*m) && b.len() >= 5)
}

/// A JPEG's (width, height) from its start-of-frame segment.
fn jpeg_frame_size(bytes: &[u8]) -> Option<(u32, u32)> {
    let (_, body) = jpeg_frame(bytes)?;
    let height = u16::from_be_bytes([body[1], body[2]]);
    let width = u16::from_be_bytes([body[3], body[4]]);
    Some((width.into(), height.into()))
}

/// How many times decoding goes over an image's pixels: a progressive JPEG once per scan, up
/// to [`MAX_JPEG_SCANS`] (the decoder's own limit, charged whole: libjpeg-turbo reports no
/// progress), as is a JPEG whose frame header the segment walk does not find; any other
/// image once (a sequential JPEG's scans each carry other components).
pub fn decode_passes(bytes: &[u8]) -> u64 {
    if !bytes.starts_with(&[0xff, 0xd8]) {
        return 1;
    }
    match jpeg_frame(bytes).map(|(marker, _)| marker) {
        Some(0xc2 | 0xc6 | 0xca | 0xce) | None => MAX_JPEG_SCANS as u64,
        Some(_) => 1,
    }
}

/// What decoding an image of `w`×`h` in `passes` passes costs.
pub fn image_cost(w: u32, h: u32, passes: u64) -> Spent {
    let pixels = u64::from(w) * u64::from(h);
    Spent {
        pixels,
        work: pixels * passes,
    }
}

/// An image of `w`×`h` decoded in `passes` passes, within `limits.max_work`.
pub(crate) fn check_work(
    w: u32,
    h: u32,
    passes: u64,
    limits: DecodeLimits,
) -> Result<(), ImageError> {
    if image_cost(w, h, passes).work > limits.max_work {
        return Err(ImageError::OverWorkBudget {
            w,
            h,
            passes,
            max: limits.max_work,
        });
    }
    Ok(())
}

pub(crate) fn check_limits(w: u32, h: u32, limits: DecodeLimits) -> Result<(), ImageError> {
    if w > limits.max_side || h > limits.max_side || w as u64 * h as u64 > limits.max_pixels {
        return Err(ImageError::TooLarge {
            w,
            h,
            max_side: limits.max_side,
            max_pixels: limits.max_pixels,
        });
    }
    Ok(())
}

fn upright_rgb(mut img: DynamicImage, orientation: Option<image::metadata::Orientation>) -> Rgb {
    if let Some(o) = orientation {
        img.apply_orientation(o);
    }
    let (width, height) = (img.width() as usize, img.height() as usize);
    // The common 8-bit layouts are converted directly (as Pillow's convert("RGB") does: gray
    // replicated, alpha dropped); `to_rgb8` goes through a generic colour-space path that costs
    // more than decoding.
    let data = match img {
        DynamicImage::ImageRgb8(i) => i.into_raw(),
        DynamicImage::ImageLuma8(i) => i.as_raw().iter().flat_map(|&v| [v, v, v]).collect(),
        DynamicImage::ImageLumaA8(i) => i
            .as_raw()
            .chunks_exact(2)
            .flat_map(|p| [p[0], p[0], p[0]])
            .collect(),
        DynamicImage::ImageRgba8(i) => i
            .as_raw()
            .chunks_exact(4)
            .flat_map(|p| [p[0], p[1], p[2]])
            .collect(),
        other => other.to_rgb8().into_raw(),
    };
    Rgb {
        width,
        height,
        data,
    }
}

thread_local! {
    static TURBO: std::cell::RefCell<Option<turbojpeg::Decompressor>> = const { std::cell::RefCell::new(None) };
}

fn decode_jpeg(bytes: &[u8], limits: DecodeLimits) -> Result<Rgb, ImageError> {
    if !jpeg_has_end(bytes) {
        // libjpeg would fill the missing rows with gray; Pillow refuses such files.
        return Err(ImageError::Corrupt(
            "truncated JPEG: no end-of-image marker".into(),
        ));
    }
    // Counted before anything is allocated; the decoder enforces the same limit itself, so a
    // file this walk miscounts is still refused after at most MAX_JPEG_SCANS passes.
    if jpeg_scans(bytes) > MAX_JPEG_SCANS {
        return Err(ImageError::TooManyScans {
            max: MAX_JPEG_SCANS,
        });
    }
    let (w, h, data) = decompress_jpeg(bytes, limits)?;
    let img = image::RgbImage::from_raw(w, h, data).expect("sized above");
    Ok(upright_rgb(img.into(), jpeg_orientation(bytes)))
}

/// libjpeg-turbo's decode as Pillow configures it, under its own scan limit: RGB8 (CMYK
/// converted as Pillow does), before the EXIF orientation.
fn decompress_jpeg(bytes: &[u8], limits: DecodeLimits) -> Result<(u32, u32, Vec<u8>), ImageError> {
    use turbojpeg::{Colorspace, Image, PixelFormat};
    let corrupt = |e: turbojpeg::Error| match e {
        turbojpeg::Error::TurboJpegError(m) if m.contains("scans") => ImageError::TooManyScans {
            max: MAX_JPEG_SCANS,
        },
        e => ImageError::Corrupt(e.to_string()),
    };
    TURBO.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            let mut d = turbojpeg::Decompressor::new().map_err(corrupt)?;
            d.set_scan_limit(MAX_JPEG_SCANS as u32).map_err(corrupt)?;
            *slot = Some(d);
        }
        let d = slot.as_mut().expect("initialized above");
        let header = d.read_header(bytes).map_err(corrupt)?;
        let (w, h) = (header.width, header.height);
        check_limits(w as u32, h as u32, limits)?;
        check_work(w as u32, h as u32, decode_passes(bytes), limits)?;
        let cmyk = matches!(header.colorspace, Colorspace::CMYK | Colorspace::YCCK);
        let format = if cmyk {
            PixelFormat::CMYK
        } else {
            PixelFormat::RGB
        };
        let mut pixels = vec![0u8; w * h * format.size()];
        let out = Image {
            pixels: pixels.as_mut_slice(),
            width: w,
            pitch: w * format.size(),
            height: h,
            format,
        };
        d.decompress(bytes, out).map_err(corrupt)?;
        if cmyk {
            pixels = cmyk_to_rgb(&pixels, has_adobe_marker(bytes));
        }
        Ok((w as u32, h as u32, pixels))
    })
}

/// Pillow's CMYK → RGB (`Convert.c: cmyk2rgb`); Adobe-marked files store inverted CMYK
/// (Pillow's "CMYK;I" raw mode).
fn cmyk_to_rgb(cmyk: &[u8], inverted: bool) -> Vec<u8> {
    let muldiv255 = |a: i32, b: i32| {
        let t = a * b + 128;
        ((t >> 8) + t) >> 8
    };
    let mut out = Vec::with_capacity(cmyk.len() / 4 * 3);
    for px in cmyk.chunks_exact(4) {
        let v = |i: usize| {
            if inverted {
                255 - px[i] as i32
            } else {
                px[i] as i32
            }
        };
        let nk = 255 - v(3);
        for c in 0..3 {
            out.push((nk - muldiv255(v(c), nk)).clamp(0, 255) as u8);
        }
    }
    out
}

/// Whether the JPEG has an Adobe APP14 segment before its image data.
fn has_adobe_marker(bytes: &[u8]) -> bool {
    jpeg_segments(bytes).any(|(marker, body)| marker == 0xee && body.starts_with(b"Adobe"))
}

/// The EXIF orientation of a JPEG, read from its APP1 segment.
fn jpeg_orientation(bytes: &[u8]) -> Option<image::metadata::Orientation> {
    let (_, body) = jpeg_segments(bytes).find(|(m, b)| *m == 0xe1 && b.starts_with(b"Exif\0\0"))?;
    image::metadata::Orientation::from_exif_chunk(&body[6..])
}

/// (marker, body) of each JPEG header segment up to the start of scan.
fn jpeg_segments(bytes: &[u8]) -> impl Iterator<Item = (u8, &[u8])> {
    let mut pos = 2; // after SOI
    std::iter::from_fn(move || {
        if bytes.get(pos) != Some(&0xff) {
            return None;
        }
        let marker = *bytes.get(pos + 1)?;
        if marker == 0xda || marker == 0xd9 {
            return None;
        }
        let len = u16::from_be_bytes([*bytes.get(pos + 2)?, *bytes.get(pos + 3)?]) as usize;
        let body = bytes.get(pos + 4..pos + 2 + len)?;
        pos += 2 + len;
        Some((marker, body))
    })
}

/// The scans of a JPEG, counted up to one past [`MAX_JPEG_SCANS`] in one pass over its
/// markers: segments are skipped by their length, and entropy-coded data up to the next
/// marker (inside it 0xFF is followed by a stuffed 0x00 or a restart marker).
fn jpeg_scans(bytes: &[u8]) -> usize {
    let (mut pos, mut scans) = (2, 0);
    while scans <= MAX_JPEG_SCANS && bytes.get(pos) == Some(&0xff) {
        let Some(&marker) = bytes.get(pos + 1) else {
            break;
        };
        match marker {
            0xff => pos += 1,
            0xd9 => break,
            0x01 | 0xd0..=0xd7 => pos += 2,
            _ => {
                let Some(len) = bytes.get(pos + 2..pos + 4) else {
                    break;
                };
                // A length below 2 (the length field's own bytes) is skipped as libjpeg skips
                // it: past the field, nothing more.
                pos += 2 + (u16::from_be_bytes([len[0], len[1]]) as usize).max(2);
                if marker == 0xda {
                    scans += 1;
                    pos = next_marker(bytes, pos);
                }
            }
        }
    }
    scans
}

/// The position of the first marker at or after `pos` in entropy-coded data.
fn next_marker(bytes: &[u8], mut pos: usize) -> usize {
    while let Some(off) = bytes
        .get(pos..)
        .and_then(|rest| rest.iter().position(|&b| b == 0xff))
    {
        pos += off;
        match bytes.get(pos + 1) {
            Some(0x00 | 0xd0..=0xd7) => pos += 2,
            _ => return pos,
        }
    }
    bytes.len()
}

/// Whether a JPEG's end-of-image marker (FF D9) is present near its end (some writers append
/// a few bytes after it).
fn jpeg_has_end(bytes: &[u8]) -> bool {
    let tail = &bytes[bytes.len().saturating_sub(1024)..];
    tail.windows(2).any(|w| w == [0xff, 0xd9])
}

fn classify(e: image::ImageError) -> ImageError {
    match e {
        image::ImageError::Unsupported(_) => ImageError::Unsupported,
        // The header's own data (a profile, text, tag values) past METADATA_BYTES, or a
        // decoder's buffer past the bytes set for the pixels.
        image::ImageError::Limits(e) => {
            ImageError::OverBudget(format!("{e} (metadata may use {METADATA_BYTES} bytes)"))
        }
        other => ImageError::Corrupt(other.to_string()),
    }
}

/// `pixel_values` rows of one image, in the preset's dtype.
pub enum PixelBuf {
    F32(Vec<f32>),
    /// bfloat16 bit patterns.
    Bf16(Vec<u16>),
    U8(Vec<u8>),
}

#[cfg(target_endian = "big")]
compile_error!("the wire format is little endian; PixelBuf::as_bytes assumes a little-endian host");

impl PixelBuf {
    /// The values as little-endian bytes, without copying.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            PixelBuf::F32(v) => bytemuck::cast_slice(v),
            PixelBuf::Bf16(v) => bytemuck::cast_slice(v),
            PixelBuf::U8(v) => v,
        }
    }
}

/// One image's contribution to a batch.
pub struct ImageOut {
    /// `[rows, patch_dim]`.
    pub pixels: PixelBuf,
    pub rows: usize,
    pub grid_thw: [i64; 3],
    /// Size after smart_resize (height, width).
    pub resized: (u32, u32),
    /// Size of the decoded, upright image (height, width).
    pub original: (u32, u32),
}

/// Per-channel lookup from an 8-bit value to its output value: the normalization is a pure
/// function of (channel, value), so computing it once per value is both exact and fast.
pub enum PixelLut {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
    U8,
}

impl PixelLut {
    pub fn new(preset: &Preset) -> Self {
        Self::of(preset, normalization_table(preset))
    }

    /// The lookup for videos (the video processors normalize their own way).
    pub fn for_videos(preset: &Preset) -> Self {
        Self::of(preset, video_normalization_table(preset))
    }

    fn of(preset: &Preset, table: Vec<f32>) -> Self {
        match preset.pixel_dtype {
            PixelDtype::F32 => PixelLut::F32(table),
            PixelDtype::Bf16 => PixelLut::Bf16(
                table
                    .into_iter()
                    .map(|n| half::bf16::from_f32(n).to_bits())
                    .collect(),
            ),
            PixelDtype::U8 => PixelLut::U8,
        }
    }
}

/// The normalization as a table: `table[c * 256 + v]` is channel c's float32 value for the
/// 8-bit value v, with transformers' arithmetic (float64 v × 1/255 → float32, then
/// (x − mean) / std in float32). A worker applies it (f32 or bf16 on the wire) or, with u8
/// pixels, sends it along (`pixel_lut`) for the rank to apply: a lookup in the same table is
/// bit-identical wherever it runs.
pub(crate) fn normalization_table(preset: &Preset) -> Vec<f32> {
    (0..3)
        .flat_map(|c| {
            (0..=255u8).map(move |v| {
                let x = (v as f64 * (1.0 / 255.0)) as f32;
                (x - preset.image_mean[c]) / preset.image_std[c]
            })
        })
        .collect()
}

/// The video processors' normalization as a table, `[3, 256]` like [`normalization_table`]:
/// transformers' torchvision backend fuses rescale into normalize, all in float32 —
/// `(x − mean·255) / (std·255)` with `mean·255` and `std·255` float32 products — which
/// differs from the image path's float64 rescale in the last bit of most values.
pub(crate) fn video_normalization_table(preset: &Preset) -> Vec<f32> {
    // 1 / rescale_factor, as torch casts the scalar: 255 in float32.
    let scale = (1.0f64 / (1.0f64 / 255.0)) as f32;
    (0..3)
        .flat_map(|c| {
            let (mean, std) = (preset.image_mean[c] * scale, preset.image_std[c] * scale);
            (0..=255u8).map(move |v| (f32::from(v) - mean) / std)
        })
        .collect()
}

/// Normalizes and patchifies a resized RGB image into `pixel_values` rows.
///
/// Row order is (h-block, w-block, merge-row, merge-col) and within a row (c, t, py, px), the
/// transformers layout; the temporal frames are copies of the one image.
pub(crate) fn patchify(rgb: &Rgb, preset: &Preset, lut: &PixelLut) -> (PixelBuf, usize, [i64; 3]) {
    patchify_frames(std::slice::from_ref(rgb), preset, lut)
}

/// Normalizes and patchifies frames of one size: one image (its temporal frames copies of
/// it), or a video's frames, a multiple of the temporal patch size (`pixel_values_videos`,
/// rows ordered by temporal group first).
pub(crate) fn patchify_frames(
    frames: &[Rgb],
    preset: &Preset,
    lut: &PixelLut,
) -> (PixelBuf, usize, [i64; 3]) {
    let p = preset.patch_size as usize;
    let t = preset.temporal_patch_size as usize;
    assert!(
        frames.len() == 1 || frames.len().is_multiple_of(t),
        "one image, or whole temporal groups"
    );
    let gt = frames.len().div_ceil(t);
    let (gh, gw) = (frames[0].height / p, frames[0].width / p);
    let pixels = match lut {
        PixelLut::F32(tab) => PixelBuf::F32(patchify_with(frames, preset, |c, src, out| {
            lookup(tab, c, src, out)
        })),
        PixelLut::Bf16(tab) => PixelBuf::Bf16(patchify_with(frames, preset, |c, src, out| {
            lookup(tab, c, src, out)
        })),
        // Not normalized: the bytes themselves, no table (a third faster than an identity one).
        PixelLut::U8 => PixelBuf::U8(patchify_with(frames, preset, |_, src, out| {
            out.extend((0..src.len().div_ceil(3)).map(|i| src[i * 3]))
        })),
    };
    (pixels, gt * gh * gw, [gt as i64, gh as i64, gw as i64])
}

/// One patch row of channel `c` through its row of a `[3, 256]` table; `src` holds the row's
/// pixels at every third byte (RGB interleaved).
#[inline(always)]
fn lookup<T: Copy>(table: &[T], c: usize, src: &[u8], out: &mut Vec<T>) {
    let lut: &[T; 256] = table[c * 256..(c + 1) * 256]
        .try_into()
        .expect("3 x 256 entries");
    // A Range map is TrustedLen: extend writes without per-item checks.
    out.extend((0..src.len().div_ceil(3)).map(|i| lut[src[i * 3] as usize]));
}

/// The patchify loop for one output type; `emit(c, src, out)` appends channel `c`'s values
/// of one patch row (`src`: the row's bytes, that channel's at every third).
fn patchify_with<T: Copy>(
    frames: &[Rgb],
    preset: &Preset,
    emit: impl Fn(usize, &[u8], &mut Vec<T>),
) -> Vec<T> {
    // The model families' patch sizes as constants, so the per-row loop unrolls.
    match preset.patch_size {
        14 => patchify_inline(frames, preset, emit, 14),
        16 => patchify_inline(frames, preset, emit, 16),
        p => patchify_inline(frames, preset, emit, p as usize),
    }
}

#[inline(always)]
fn patchify_inline<T: Copy>(
    frames: &[Rgb],
    preset: &Preset,
    emit: impl Fn(usize, &[u8], &mut Vec<T>),
    p: usize,
) -> Vec<T> {
    let m = preset.merge_size as usize;
    let t = preset.temporal_patch_size as usize;
    let (width, height) = (frames[0].width, frames[0].height);
    let (gh, gw) = (height / p, width / p);
    let row_len = 3 * t * p * p;
    let frame = p * p;
    // One image: its later temporal frames copy the first.
    let image = frames.len() == 1;
    // Written once, front to back (no zero-fill).
    let mut out = Vec::with_capacity(frames.len().div_ceil(t) * gh * gw * row_len);
    for group in frames.chunks(t) {
        for bh in 0..gh / m {
            for bw in 0..gw / m {
                for mh in 0..m {
                    for mw in 0..m {
                        let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                        for c in 0..3 {
                            let first = out.len();
                            let sources = if image { &group[..1] } else { group };
                            for rgb in sources {
                                for py in 0..p {
                                    let start = ((y0 + py) * width + x0) * 3 + c;
                                    emit(c, &rgb.data[start..start + 3 * (p - 1) + 1], &mut out);
                                }
                            }
                            if image {
                                for _ in 1..t {
                                    out.extend_from_within(first..first + frame);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// Stage timings of one image, for the worker's histograms.
#[derive(Default, Debug, Clone, Copy)]
pub struct ImageTimings {
    pub decode: std::time::Duration,
    pub resize: std::time::Duration,
    pub patchify: std::time::Duration,
}

/// The whole per-image chain: decode → smart_resize → bicubic → normalize/patchify.
pub fn process_image(
    bytes: &[u8],
    preset: &Preset,
    lut: &PixelLut,
    limits: DecodeLimits,
    timings: &mut ImageTimings,
) -> Result<ImageOut, ImageError> {
    let t0 = std::time::Instant::now();
    let rgb = decode(bytes, limits)?;
    let t1 = std::time::Instant::now();
    let (h, w) = preset.resized((rgb.height as u32, rgb.width as u32))?;
    let original = (rgb.height as u32, rgb.width as u32);
    let resized = Rgb {
        data: if (h as usize, w as usize) == (rgb.height, rgb.width) {
            rgb.data
        } else {
            resize_rgb8(&rgb.data, rgb.width, rgb.height, w as usize, h as usize)
        },
        width: w as usize,
        height: h as usize,
    };
    let t2 = std::time::Instant::now();
    let (pixels, rows, grid_thw) = patchify(&resized, preset, lut);
    let t3 = std::time::Instant::now();
    timings.decode += t1 - t0;
    timings.resize += t2 - t1;
    timings.patchify += t3 - t2;
    Ok(ImageOut {
        pixels,
        rows,
        grid_thw,
        resized: (h, w),
        original,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preprocess::preset::PresetName;

    /// The decoder stops at the limit by itself: the marker walk is only an early refusal.
    #[test]
    fn the_decoder_holds_the_scan_limit_without_the_count() {
        let mut jpeg = Vec::new();
        let mut enc = jpeg_encoder::Encoder::new(&mut jpeg, 90);
        enc.set_progressive(true);
        enc.set_progressive_scans(33); // the most whose bands of coefficients are all valid
        enc.encode(&[128; 32 * 32 * 3], 32, 32, jpeg_encoder::ColorType::Rgb)
            .unwrap();
        // Its last scan again and again (libjpeg only warns of a repeated band).
        let eoi = jpeg.len() - 2;
        let last = (0..eoi)
            .rev()
            .find(|&i| jpeg[i..i + 2] == [0xff, 0xda])
            .unwrap();
        let scan = jpeg[last..eoi].to_vec();
        while jpeg_scans(&jpeg) <= MAX_JPEG_SCANS {
            jpeg.splice(eoi..eoi, scan.iter().copied());
        }
        assert_eq!(
            decompress_jpeg(&jpeg, DecodeLimits::default()).unwrap_err(),
            ImageError::TooManyScans {
                max: MAX_JPEG_SCANS
            }
        );
    }

    #[test]
    fn patchify_shapes_match_the_reference_example() {
        let mut preset = Preset::new(PresetName::Qwen2Vl);
        assert_eq!(
            preset.pixel_dtype,
            PixelDtype::U8,
            "u8 on the wire by default"
        );
        preset.pixel_dtype = PixelDtype::F32;
        let lut = PixelLut::new(&preset);
        let rgb = Rgb {
            width: 644,
            height: 476,
            data: vec![128; 644 * 476 * 3],
        };
        let (pixels, rows, grid) = patchify(&rgb, &preset, &lut);
        assert_eq!(grid, [1, 34, 46]);
        assert_eq!(rows, 1564);
        assert_eq!(pixels.as_bytes().len(), 1564 * 1176 * 4);
        // qwen3-vl: 640x480 (WxH) keeps its size: grid [1, 30, 40], [1200, 1536].
        let mut preset = Preset::new(PresetName::Qwen3Vl);
        preset.pixel_dtype = PixelDtype::F32;
        let rgb = Rgb {
            width: 640,
            height: 480,
            data: vec![255; 640 * 480 * 3],
        };
        let (pixels, rows, grid) = patchify(&rgb, &preset, &PixelLut::new(&preset));
        assert_eq!((rows, grid), (1200, [1, 30, 40]));
        let PixelBuf::F32(v) = pixels else {
            panic!("f32 asked for")
        };
        assert_eq!(v.len(), 1200 * 1536);
        assert!(v.iter().all(|&x| x == 1.0), "(1 - 0.5) / 0.5");
    }

    #[test]
    fn patchify_places_pixels_in_transformers_order() {
        let mut preset = Preset::new(PresetName::Qwen2Vl);
        preset.pixel_dtype = PixelDtype::U8;
        preset.patch_size = 2;
        let lut = PixelLut::new(&preset);
        // 4x8 image (h x w): gh=2, gw=4; pixel value encodes (y, x, c).
        let (w, h) = (8, 4);
        let data: Vec<u8> = (0..h * w * 3)
            .map(|i| {
                let (y, x, c) = (i / 3 / w, i / 3 % w, i % 3);
                (y * 40 + x * 4 + c) as u8
            })
            .collect();
        let rgb = Rgb {
            width: w,
            height: h,
            data,
        };
        let (pixels, rows, _) = patchify(&rgb, &preset, &lut);
        let out = pixels.as_bytes();
        assert_eq!(rows, 8);
        let row_len = 3 * 2 * 2 * 2;
        // Row 1 is merge-col 1 of the first 2x2 block: patch (py=0, px=1) → x0 = 2.
        let r1 = &out[row_len..2 * row_len];
        assert_eq!(r1[0], 2 * 4); // c=0, t=0, py=0, px=0 → pixel (0, 2)
        assert_eq!(r1[4], 2 * 4); // t=1 repeats the frame
        assert_eq!(r1[8], 2 * 4 + 1); // c=1
                                      // Row 2 is merge-row 1: patch (py=1, px=0) → y0 = 2.
        assert_eq!(out[2 * row_len], 2 * 40);
        // Row 4 is the second 2x2 block along w: x0 = 4.
        assert_eq!(out[4 * row_len], 4 * 4);
    }

    /// Every value of every dtype where the transformers layout puts it, by the formula
    /// (row = (h-block, w-block, merge-row, merge-col); within it (c, t, py, px)).
    #[test]
    fn patchify_matches_the_layout_formula_for_every_dtype() {
        let (w, h) = (28 * 3, 28 * 2);
        let data: Vec<u8> = (0..w * h * 3).map(|i| (i * 7919 % 251) as u8).collect();
        let rgb = Rgb {
            width: w,
            height: h,
            data,
        };
        for dtype in [PixelDtype::U8, PixelDtype::F32, PixelDtype::Bf16] {
            let mut preset = Preset::new(PresetName::Qwen2Vl);
            preset.pixel_dtype = dtype;
            let lut = PixelLut::new(&preset);
            let (pixels, rows, _) = patchify(&rgb, &preset, &lut);
            let (p, m, t) = (14, 2, 2);
            let row_len = 3 * t * p * p;
            let bytes = pixels.as_bytes();
            let width = bytes.len() / (rows * row_len);
            let (gw, mut checked) = (w / p, 0);
            for r in 0..rows {
                let (block, within) = (r / (m * m), r % (m * m));
                let (bh, bw) = (block / (gw / m), block % (gw / m));
                let y0 = (bh * m + within / m) * p;
                let x0 = (bw * m + within % m) * p;
                for k in 0..row_len {
                    let (c, rest) = (k / (t * p * p), k % (p * p));
                    let v = rgb.data[((y0 + rest / p) * w + x0 + rest % p) * 3 + c] as usize;
                    let want: Vec<u8> = match &lut {
                        PixelLut::U8 => vec![v as u8],
                        PixelLut::F32(tab) => tab[c * 256 + v].to_le_bytes().to_vec(),
                        PixelLut::Bf16(tab) => tab[c * 256 + v].to_le_bytes().to_vec(),
                    };
                    let at = (r * row_len + k) * width;
                    assert_eq!(
                        &bytes[at..at + width],
                        &want[..],
                        "{dtype:?} row {r} value {k}"
                    );
                    checked += 1;
                }
            }
            assert_eq!(checked, 6 * 4 * row_len);
        }
    }
}
