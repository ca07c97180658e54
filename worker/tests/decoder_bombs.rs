//! Crafted files of every format and chunk kind a decoder allocates for: each is refused by
//! name, or decoded, within a bound on the bytes the decoder holds at once, measured by this
//! test binary's allocator (a decompression bomb shows as a peak, whatever error follows).

mod common;

use common::png_chunk;
use flate2::{write::ZlibEncoder, Compression};
use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;
use stoker_worker::preprocess::vision::{decode, DecodeLimits, ImageError, METADATA_BYTES};

/// The system allocator, counting the bytes live and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Relaxed) + layout.size();
        PEAK.fetch_max(live, Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Relaxed);
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// One measurement at a time: the counters are process-wide.
static MEASURING: Mutex<()> = Mutex::new(());

/// Decodes `bytes` under the default limits; returns the result and the bytes allocated at
/// the peak beyond what was live before.
fn decode_measured(bytes: &[u8]) -> (Result<(usize, usize), ImageError>, usize) {
    let _one = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let before = LIVE.load(Relaxed);
    PEAK.store(before, Relaxed);
    let result = decode(bytes, DecodeLimits::default()).map(|rgb| (rgb.width, rgb.height));
    let peak = PEAK.load(Relaxed) - before;
    eprintln!("decoding {} bytes held {peak} bytes at most", bytes.len());
    (result, peak)
}

const MIB: usize = 1 << 20;

/// What a crafted file may cost: the metadata budget twice (a buffer grown by doubling holds
/// its old half while it moves) and change.
const BOUND: usize = 2 * METADATA_BYTES as usize + 8 * MIB;

fn zlib(data: &[u8]) -> Vec<u8> {
    let mut z = ZlibEncoder::new(Vec::new(), Compression::best());
    z.write_all(data).unwrap();
    z.finish().unwrap()
}

/// `len` zero bytes, zlib-compressed without holding them (~1,000:1).
fn zlib_zeros(len: usize) -> Vec<u8> {
    let mut z = ZlibEncoder::new(Vec::new(), Compression::best());
    let block = vec![0u8; MIB];
    for _ in 0..len / MIB {
        z.write_all(&block).unwrap();
    }
    z.finish().unwrap()
}

/// A 2×2 RGB8 PNG with `extra` chunks between its header and its pixels.
fn png_with(extra: &[(&[u8], Vec<u8>)]) -> Vec<u8> {
    let mut v = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&2u32.to_be_bytes());
    ihdr.extend_from_slice(&2u32.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    png_chunk(&mut v, b"IHDR", &ihdr);
    for (kind, data) in extra {
        png_chunk(&mut v, kind, data);
    }
    // Two rows, filter byte 0, then 2 × 3 bytes.
    png_chunk(
        &mut v,
        b"IDAT",
        &zlib(&[0, 1, 2, 3, 4, 5, 6, 0, 7, 8, 9, 10, 11, 12]),
    );
    png_chunk(&mut v, b"IEND", &[]);
    v
}

fn assert_refused_within_bound(name: &str, bytes: &[u8]) {
    let (result, peak) = decode_measured(bytes);
    assert!(
        matches!(result, Err(ImageError::OverBudget(_))),
        "{name}: {:?}",
        result.map_err(|e| e.to_string())
    );
    assert!(peak < BOUND, "{name}: decoding held {} MiB", peak / MIB);
}

/// The decoder stops inflating the profile at the metadata budget and drops it (profiles are
/// not applied, as Pillow's convert("RGB") does not): the image decodes, the bomb costs 16 MiB.
#[test]
fn a_png_colour_profile_that_inflates_to_256_mib_is_cut_at_the_metadata_budget() {
    let mut iccp = b"bomb\0\0".to_vec();
    iccp.extend(zlib_zeros(256 * MIB));
    assert!(iccp.len() < MIB, "the file is small: {} bytes", iccp.len());
    let (result, peak) = decode_measured(&png_with(&[(b"iCCP", iccp)]));
    assert_eq!(result, Ok((2, 2)));
    assert!(peak < BOUND, "iCCP: decoding held {} MiB", peak / MIB);
}

#[test]
fn png_text_and_exif_chunks_past_the_metadata_budget_are_refused() {
    // Stored text is held as read: 24 chunks of 1 MiB go past the 16 MiB budget.
    let text: Vec<(&[u8], Vec<u8>)> = (0..24)
        .map(|_| {
            let mut t = b"k\0".to_vec();
            t.resize(MIB, b'x');
            (&b"tEXt"[..], t)
        })
        .collect();
    assert_refused_within_bound("tEXt", &png_with(&text));
    // Compressed text is kept compressed (never inflated), so a zTXt bomb costs its size.
    let mut ztxt = b"k\0\0".to_vec();
    ztxt.extend(zlib_zeros(256 * MIB));
    let (result, peak) = decode_measured(&png_with(&[(b"zTXt", ztxt)]));
    assert_eq!(result, Ok((2, 2)));
    assert!(peak < BOUND, "zTXt: decoding held {} MiB", peak / MIB);
    let exif: Vec<(&[u8], Vec<u8>)> = (0..24).map(|_| (&b"eXIf"[..], vec![0; MIB])).collect();
    let (result, peak) = decode_measured(&png_with(&exif));
    assert!(
        matches!(result, Ok(_) | Err(ImageError::OverBudget(_))),
        "eXIf: {result:?}"
    );
    assert!(peak < BOUND, "eXIf: decoding held {} MiB", peak / MIB);
}

#[test]
fn an_ordinary_colour_profile_and_text_still_decode() {
    let mut iccp = b"sRGB\0\0".to_vec();
    iccp.extend(zlib(&[7u8; 3144]));
    let text = b"Comment\0made by a camera".to_vec();
    let (result, _) = decode_measured(&png_with(&[(b"iCCP", iccp), (b"tEXt", text)]));
    assert_eq!(result, Ok((2, 2)));
}

/// An APNG whose second frame claims 16,384 × 16,384 pixels: only the default image is
/// decoded, so the frame costs nothing.
#[test]
fn apng_frames_beyond_the_default_image_are_not_decoded() {
    let mut actl = 2u32.to_be_bytes().to_vec();
    actl.extend(0u32.to_be_bytes());
    let fctl = |seq: u32, w: u32, h: u32| {
        let mut f = seq.to_be_bytes().to_vec();
        for v in [w, h, 0, 0] {
            f.extend(v.to_be_bytes());
        }
        f.extend([0, 1, 0, 1, 0, 0]);
        f
    };
    let mut v = png_with(&[(b"acTL", actl), (b"fcTL", fctl(0, 2, 2))]);
    let iend = v.len() - 12;
    let mut tail = Vec::new();
    png_chunk(&mut tail, b"fcTL", &fctl(1, 16_384, 16_384));
    let mut fdat = 2u32.to_be_bytes().to_vec();
    fdat.extend(zlib_zeros(64 * MIB));
    png_chunk(&mut tail, b"fdAT", &fdat);
    v.splice(iend..iend, tail);
    let (result, peak) = decode_measured(&v);
    assert_eq!(result, Ok((2, 2)));
    assert!(peak < BOUND, "APNG: decoding held {} MiB", peak / MIB);
}

/// A GIF whose logical screen is 1 × 1 but whose frame claims 8,000 × 8,000 pixels: the
/// decoder would allocate the frame (244 MiB) before reading a byte of it.
#[test]
fn a_gif_frame_larger_than_its_screen_is_refused_before_it_is_allocated() {
    let mut v = b"GIF89a".to_vec();
    v.extend(1u16.to_le_bytes());
    v.extend(1u16.to_le_bytes());
    v.extend([0x80, 0, 0]); // a global colour table of 2 entries
    v.extend([0, 0, 0, 255, 255, 255]);
    v.push(0x2c);
    for d in [0u16, 0, 8_000, 8_000] {
        v.extend(d.to_le_bytes());
    }
    v.push(0);
    v.extend([2, 1, 0x2c, 0]); // LZW: clear, end
    v.push(0x3b);
    assert_refused_within_bound("GIF frame", &v);
}

/// Sets a TIFF's first-IFD entry `tag` (SHORT or LONG, little endian) to `value`.
fn patch_tiff_tag(tiff: &mut [u8], tag: u16, value: u32) {
    let ifd = u32::from_le_bytes(tiff[4..8].try_into().unwrap()) as usize;
    let count = u16::from_le_bytes([tiff[ifd], tiff[ifd + 1]]) as usize;
    let entry = (0..count)
        .map(|i| ifd + 2 + 12 * i)
        .find(|&e| u16::from_le_bytes([tiff[e], tiff[e + 1]]) == tag)
        .expect("tag present");
    match u16::from_le_bytes([tiff[entry + 2], tiff[entry + 3]]) {
        3 => tiff[entry + 8..entry + 10].copy_from_slice(&(value as u16).to_le_bytes()),
        4 => tiff[entry + 8..entry + 12].copy_from_slice(&value.to_le_bytes()),
        t => panic!("tag {tag} has type {t}"),
    }
}

fn tiff(img: image::DynamicImage) -> Vec<u8> {
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Tiff).unwrap();
    out.into_inner()
}

/// A float RGBA TIFF of 8,192 × 8,192 pixels (within the pixel limit) decodes to 1 GiB at
/// 16 bytes a pixel: over the image's byte budget, refused from the header. One 2,048 × 2,048
/// decodes.
#[test]
fn a_float_tiff_is_bounded_by_bytes_not_only_pixels() {
    let small = image::DynamicImage::ImageRgba32F(image::ImageBuffer::new(2, 2));
    let mut big = tiff(small.clone());
    patch_tiff_tag(&mut big, 256, 8_192);
    patch_tiff_tag(&mut big, 257, 8_192);
    patch_tiff_tag(&mut big, 278, 8_192);
    assert_refused_within_bound("float TIFF", &big);
    let (result, _) = decode_measured(&tiff(small));
    assert_eq!(result, Ok((2, 2)));
}

/// A TIFF whose strips claim 4 GiB each: read strip by strip within the image's bytes.
#[test]
fn tiff_strips_that_claim_more_than_the_file_are_refused_within_the_bound() {
    let mut v = tiff(image::DynamicImage::ImageRgb8(image::ImageBuffer::new(
        64, 64,
    )));
    patch_tiff_tag(&mut v, 279, u32::MAX);
    let (result, peak) = decode_measured(&v);
    assert!(result.is_err(), "{result:?}");
    assert!(
        peak < BOUND,
        "TIFF strips: decoding held {} MiB",
        peak / MIB
    );
}

fn progressive_jpeg(scans: u8) -> Vec<u8> {
    let px: Vec<u8> = (0..64 * 64 * 3).map(|i| (i * 7 % 251) as u8).collect();
    let mut out = Vec::new();
    let mut enc = jpeg_encoder::Encoder::new(&mut out, 90);
    enc.set_progressive(true);
    enc.set_progressive_scans(scans);
    enc.encode(&px, 64, 64, jpeg_encoder::ColorType::Rgb)
        .unwrap();
    out
}

/// Every scan is a pass over the image: past 100 the file is refused by name, unread.
#[test]
fn a_progressive_jpeg_of_too_many_scans_is_refused_and_an_ordinary_one_decodes() {
    let (result, _) = decode_measured(&progressive_jpeg(4));
    assert_eq!(result, Ok((64, 64)));
    let (result, _) = decode_measured(&progressive_jpeg(64));
    assert_eq!(result, Err(ImageError::TooManyScans { max: 100 }));
}

/// A zero-length APP segment before the first scan (`FF E5 00 00`): libjpeg skips it and
/// decodes every scan, so the count must skip it too — and the decoder's own limit holds
/// whatever the count says.
#[test]
fn a_zero_length_segment_does_not_hide_the_scans() {
    let mut v = progressive_jpeg(64);
    v.splice(2..2, [0xff, 0xe5, 0x00, 0x00]);
    let (result, _) = decode_measured(&v);
    assert_eq!(result, Err(ImageError::TooManyScans { max: 100 }));
    let mut ordinary = progressive_jpeg(4);
    ordinary.splice(2..2, [0xff, 0xe5, 0x00, 0x00]);
    assert_eq!(decode_measured(&ordinary).0, Ok((64, 64)));
}
