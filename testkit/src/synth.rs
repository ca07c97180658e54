//! A realistic synthetic VLM SFT dataset: JSONL shards plus JPEG and PNG images of varied
//! sizes and aspect ratios, some grayscale, some CMYK, some EXIF-rotated; single- and
//! multi-image samples; multi-turn conversations; images linked relative to the JSONL file.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use std::io::Write;
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum SynthFormat {
    /// `{"image": …, "conversations": [{"from": "human", …}]}`
    Llava,
    /// `{"messages": [{"role": "user", "content": [{"type": "image", …}]}]}`
    Messages,
}

#[derive(Debug, Clone)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct SynthOptions {
    /// Samples to write.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = 1000))]
    pub samples: usize,
    #[cfg_attr(feature = "clap", arg(long, value_enum, default_value = "llava"))]
    pub format: SynthFormat,
    #[cfg_attr(feature = "clap", arg(long, default_value_t = 0))]
    pub seed: u64,
    #[cfg_attr(feature = "clap", arg(long, default_value_t = 500))]
    pub samples_per_shard: usize,
    /// Longest image side is drawn from [min-side, max-side] pixels.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = 200))]
    pub min_side: u32,
    #[cfg_attr(feature = "clap", arg(long, default_value_t = 1600))]
    pub max_side: u32,
}

impl Default for SynthOptions {
    /// The command line's defaults (a test checks they agree).
    fn default() -> Self {
        SynthOptions {
            samples: 1000,
            format: SynthFormat::Llava,
            seed: 0,
            samples_per_shard: 500,
            min_side: 200,
            max_side: 1600,
        }
    }
}

const ASPECTS: [(u32, u32); 8] = [
    (1, 1),
    (4, 3),
    (3, 4),
    (16, 9),
    (9, 16),
    (3, 2),
    (2, 1),
    (1, 3),
];
const WORDS: &[&str] = &[
    "the", "a", "chart", "shows", "red", "blue", "boat", "river", "sign", "two", "people", "near",
    "building", "tree", "sky", "table", "with", "on", "left", "right", "of", "small", "large",
    "text", "reads", "value", "increase", "between", "image", "object", "color", "green", "car",
    "street", "window", "dog", "cat", "book", "label", "number", "circle", "square", "above",
];
const QUESTIONS: &[&str] = &[
    "What is shown in this image?",
    "Describe the scene in detail.",
    "How many objects can you count?",
    "What color is the largest shape?",
    "Read the text in the picture.",
    "Compare the two images.",
    "What happens next?",
];

fn sentence(rng: &mut ChaCha8Rng, min: usize, max: usize) -> String {
    let n = rng.gen_range(min..=max);
    let mut s: Vec<&str> = (0..n)
        .map(|_| WORDS[rng.gen_range(0..WORDS.len())])
        .collect();
    let first = s[0].to_string();
    let cap = first[..1].to_uppercase() + &first[1..];
    s[0] = &cap;
    s.join(" ") + "."
}

/// Kinds of image the generator mixes, with what makes each realistic to decode.
#[derive(Debug, Clone, Copy)]
enum ImageKind {
    Jpeg,
    JpegGray,
    JpegCmyk,
    JpegRotated(u16),
    Png,
    PngGray,
}

fn pick_kind(rng: &mut ChaCha8Rng) -> ImageKind {
    match rng.gen_range(0..100) {
        0..=49 => ImageKind::Jpeg,
        50..=61 => ImageKind::JpegGray,
        62..=66 => ImageKind::JpegCmyk,
        67..=76 => ImageKind::JpegRotated([3, 6, 8][rng.gen_range(0..3)]),
        77..=93 => ImageKind::Png,
        _ => ImageKind::PngGray,
    }
}

/// A photo-like RGB picture: smooth gradients, a few shapes, mild noise (so JPEG sizes and
/// decode costs resemble real photos rather than flat fills).
fn paint(rng: &mut ChaCha8Rng, w: u32, h: u32) -> Vec<u8> {
    let base: [f32; 3] = [rng.gen(), rng.gen(), rng.gen()];
    let grad: [f32; 3] = [
        rng.gen_range(-1.0..1.0),
        rng.gen_range(-1.0..1.0),
        rng.gen_range(-1.0..1.0),
    ];
    let shapes: Vec<(f32, f32, f32, [u8; 3])> = (0..rng.gen_range(3..9))
        .map(|_| {
            (
                rng.gen_range(0.0..w as f32),
                rng.gen_range(0.0..h as f32),
                rng.gen_range(0.05..0.3) * w.min(h) as f32,
                [rng.gen(), rng.gen(), rng.gen()],
            )
        })
        .collect();
    let mut noise = rng.gen::<u32>() | 1;
    let (w, h) = (w as usize, h as usize);
    let mut px = vec![0u8; w * h * 3];
    for (y, row) in px.chunks_exact_mut(w * 3).enumerate() {
        let fy = y as f32 / h as f32;
        for (x, p) in row.chunks_exact_mut(3).enumerate() {
            let fx = x as f32 / w as f32;
            for k in 0..3 {
                p[k] = ((base[k] + grad[k] * (fx - fy) * 0.5).clamp(0.0, 1.0) * 255.0) as u8;
            }
        }
        // Shapes as horizontal spans: later shapes cover earlier ones.
        for (cx, cy, r, col) in &shapes {
            let dy = y as f32 - cy;
            if dy.abs() >= *r {
                continue;
            }
            let half = (r * r - dy * dy).sqrt();
            let x0 = (cx - half).max(0.0) as usize;
            let x1 = ((cx + half).max(0.0) as usize).min(w);
            for p in row[x0.min(x1) * 3..x1 * 3].chunks_exact_mut(3) {
                p.copy_from_slice(col);
            }
        }
        for v in row.iter_mut() {
            noise ^= noise << 13;
            noise ^= noise >> 17;
            noise ^= noise << 5;
            *v = (*v as i16 + (noise % 9) as i16 - 4).clamp(0, 255) as u8;
        }
    }
    px
}

/// A minimal EXIF APP1 payload holding only the Orientation tag.
fn exif_orientation(o: u16) -> Vec<u8> {
    let mut v = b"Exif\0\0II*\0".to_vec();
    v.extend_from_slice(&8u32.to_le_bytes()); // IFD0 offset
    v.extend_from_slice(&1u16.to_le_bytes()); // one entry
    v.extend_from_slice(&0x0112u16.to_le_bytes()); // Orientation
    v.extend_from_slice(&3u16.to_le_bytes()); // SHORT
    v.extend_from_slice(&1u32.to_le_bytes()); // count
    v.extend_from_slice(&o.to_le_bytes());
    v.extend_from_slice(&[0, 0]);
    v.extend_from_slice(&0u32.to_le_bytes()); // no next IFD
    v
}

fn to_gray(rgb: &[u8]) -> Vec<u8> {
    rgb.chunks_exact(3)
        .map(|p| ((p[0] as u32 * 299 + p[1] as u32 * 587 + p[2] as u32 * 114) / 1000) as u8)
        .collect()
}

/// Encodes one image; returns (file extension, bytes).
fn encode(
    rng: &mut ChaCha8Rng,
    kind: ImageKind,
    w: u32,
    h: u32,
) -> anyhow::Result<(&'static str, Vec<u8>)> {
    use jpeg_encoder::{ColorType, Encoder};
    let rgb = paint(rng, w, h);
    let quality = rng.gen_range(75..=95);
    let jpeg = |data: &[u8], color: ColorType, exif: Option<Vec<u8>>| -> anyhow::Result<Vec<u8>> {
        let mut out = Vec::new();
        let mut enc = Encoder::new(&mut out, quality);
        if let Some(e) = exif {
            enc.add_app_segment(1, &e)?;
        }
        enc.encode(data, w as u16, h as u16, color)?;
        Ok(out)
    };
    let png = |img: image::DynamicImage| -> anyhow::Result<Vec<u8>> {
        let mut out = std::io::Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageFormat::Png)?;
        Ok(out.into_inner())
    };
    Ok(match kind {
        ImageKind::Jpeg => ("jpg", jpeg(&rgb, ColorType::Rgb, None)?),
        ImageKind::JpegRotated(o) => (
            "jpg",
            jpeg(&rgb, ColorType::Rgb, Some(exif_orientation(o)))?,
        ),
        ImageKind::JpegGray => ("jpg", jpeg(&to_gray(&rgb), ColorType::Luma, None)?),
        ImageKind::JpegCmyk => {
            let cmyk: Vec<u8> = rgb
                .chunks_exact(3)
                .flat_map(|p| {
                    let k = 255 - p[0].max(p[1]).max(p[2]);
                    [255 - p[0] - k, 255 - p[1] - k, 255 - p[2] - k, k]
                })
                .collect();
            ("jpg", jpeg(&cmyk, ColorType::Cmyk, None)?)
        }
        ImageKind::Png => (
            "png",
            png(image::RgbImage::from_raw(w, h, rgb).expect("size").into())?,
        ),
        ImageKind::PngGray => (
            "png",
            png(image::GrayImage::from_raw(w, h, to_gray(&rgb))
                .expect("size")
                .into())?,
        ),
    })
}

fn image_size(rng: &mut ChaCha8Rng, o: &SynthOptions) -> (u32, u32) {
    let (a, b) = ASPECTS[rng.gen_range(0..ASPECTS.len())];
    let long = rng.gen_range(o.min_side..=o.max_side);
    let short = (long * a.min(b) / a.max(b)).max(32);
    if a >= b {
        (long, short)
    } else {
        (short, long)
    }
}

fn sample_json(rng: &mut ChaCha8Rng, format: SynthFormat, images: &[String]) -> serde_json::Value {
    let turns = rng.gen_range(1..=3);
    let mut qa: Vec<(String, String)> = (0..turns)
        .map(|_| {
            let q = QUESTIONS[rng.gen_range(0..QUESTIONS.len())].to_string();
            let a = (0..rng.gen_range(1..=4))
                .map(|_| sentence(rng, 4, 14))
                .collect::<Vec<_>>()
                .join(" ");
            (q, a)
        })
        .collect();
    match format {
        SynthFormat::Llava => {
            let tags = "<image>\n".repeat(images.len());
            qa[0].0 = format!("{tags}{}", qa[0].0);
            let conv: Vec<_> = qa
                .iter()
                .flat_map(|(q, a)| {
                    [
                        json!({"from": "human", "value": q}),
                        json!({"from": "gpt", "value": a}),
                    ]
                })
                .collect();
            let image = if images.len() == 1 {
                json!(images[0])
            } else {
                json!(images)
            };
            json!({"image": image, "conversations": conv})
        }
        SynthFormat::Messages => {
            let mut msgs = Vec::new();
            for (i, (q, a)) in qa.iter().enumerate() {
                let mut content: Vec<serde_json::Value> = Vec::new();
                if i == 0 {
                    content.extend(images.iter().map(|p| json!({"type": "image", "image": p})));
                }
                content.push(json!({"type": "text", "text": q}));
                msgs.push(json!({"role": "user", "content": content}));
                msgs.push(json!({"role": "assistant", "content": a}));
            }
            json!({"messages": msgs})
        }
    }
}

/// Writes one shard (samples `first..end`) and its images.
fn write_shard(
    out: &Path,
    o: &SynthOptions,
    shard: usize,
    first: usize,
    end: usize,
    on_sample: &(dyn Fn() + Sync),
) -> anyhow::Result<()> {
    let mut rng = ChaCha8Rng::seed_from_u64(o.seed ^ (shard as u64).wrapping_mul(0x9e37_79b9));
    let name = format!("shard-{shard:05}.jsonl");
    let mut jsonl = std::io::BufWriter::new(std::fs::File::create(out.join(&name))?);
    for i in first..end {
        let n_images = match rng.gen_range(0..100) {
            0..=74 => 1,
            75..=89 => 2,
            _ => 3,
        };
        let mut paths = Vec::new();
        for k in 0..n_images {
            let kind = pick_kind(&mut rng);
            let (w, h) = image_size(&mut rng, o);
            let (ext, bytes) = encode(&mut rng, kind, w, h)?;
            let rel = format!("images/{i:07}-{k}.{ext}");
            std::fs::write(out.join(&rel), bytes)?;
            paths.push(rel);
        }
        let line = sample_json(&mut rng, o.format, &paths);
        serde_json::to_writer(&mut jsonl, &line)?;
        jsonl.write_all(b"\n")?;
        on_sample();
    }
    jsonl.flush()?;
    Ok(())
}

/// Writes the dataset under `out`, shards in parallel on all cores, calling `on_sample` once
/// per sample written. The output depends only on the options (each shard has its own RNG).
/// A PNG of `side`² pixels of noise: about 3 bytes a pixel, as nothing compresses (an object
/// of a chosen size, for byte budgets).
pub fn noise_png(side: u32, seed: u64) -> Vec<u8> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut rgb = vec![0u8; side as usize * side as usize * 3];
    rng.fill(&mut rgb[..]);
    let img = image::RgbImage::from_raw(side, side, rgb).expect("side² pixels");
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png)
        .expect("a PNG in memory");
    out.into_inner()
}

pub fn generate(out: &Path, o: &SynthOptions, on_sample: &(dyn Fn() + Sync)) -> anyhow::Result<()> {
    anyhow::ensure!(
        o.min_side >= 1 && o.min_side <= o.max_side,
        "images' sides: --min-side {} and --max-side {}: expected 1 <= min <= max",
        o.min_side,
        o.max_side
    );
    std::fs::create_dir_all(out.join("images"))?;
    let per_shard = o.samples_per_shard.max(1);
    let shards = o.samples.div_ceil(per_shard);
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(shards.max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| loop {
                    let s = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if s >= shards {
                        return anyhow::Ok(());
                    }
                    let first = s * per_shard;
                    write_shard(
                        out,
                        o,
                        s,
                        first,
                        (first + per_shard).min(o.samples),
                        on_sample,
                    )?;
                })
            })
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().expect("synth thread panicked"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use stoker_worker::dataset::sample::Conversation;
    use stoker_worker::preprocess::vision::{decode, read_header, DecodeLimits};

    #[test]
    fn generated_samples_parse_and_images_decode_upright() {
        let dir = tempfile::tempdir().unwrap();
        let o = SynthOptions {
            samples: 12,
            samples_per_shard: 5,
            max_side: 400,
            format: SynthFormat::Messages,
            ..SynthOptions::default()
        };
        generate(dir.path(), &o, &|| {}).unwrap();
        let mut lines = 0;
        for s in 0..3 {
            let text =
                std::fs::read_to_string(dir.path().join(format!("shard-{s:05}.jsonl"))).unwrap();
            for l in text.lines() {
                let c = Conversation::parse(l.as_bytes()).unwrap();
                for p in c.image_paths() {
                    decode(
                        &std::fs::read(dir.path().join(p)).unwrap(),
                        DecodeLimits::default(),
                    )
                    .unwrap();
                }
                lines += 1;
            }
        }
        assert_eq!(lines, 12);
    }

    #[test]
    fn sides_that_leave_no_size_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let o = SynthOptions {
            samples: 1,
            max_side: 100,
            ..SynthOptions::default()
        };
        let err = generate(dir.path(), &o, &|| {}).unwrap_err().to_string();
        assert!(
            err.contains("--min-side 200") && err.contains("--max-side 100"),
            "{err}"
        );
    }

    #[test]
    fn defaults_are_the_command_lines() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            o: SynthOptions,
        }
        let parsed = <Cli as clap::Parser>::parse_from(["synth"]).o;
        assert_eq!(
            format!("{parsed:?}"),
            format!("{:?}", SynthOptions::default())
        );
    }

    #[test]
    fn exif_orientation_is_applied_on_decode() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let (_, bytes) = encode(&mut rng, ImageKind::JpegRotated(6), 64, 32).unwrap();
        let rgb = decode(&bytes, DecodeLimits::default()).unwrap();
        assert_eq!((rgb.width, rgb.height), (32, 64));
    }

    #[test]
    fn headers_give_the_decoded_upright_size_from_the_first_bytes() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let kinds = [
            ImageKind::Jpeg,
            ImageKind::JpegGray,
            ImageKind::JpegCmyk,
            ImageKind::Png,
            ImageKind::PngGray,
        ];
        let rotations = (1..=8).map(ImageKind::JpegRotated);
        for kind in kinds.into_iter().chain(rotations) {
            let (_, bytes) = encode(&mut rng, kind, 300, 120).unwrap();
            let rgb = decode(&bytes, DecodeLimits::default()).unwrap();
            let want = Some((rgb.height as u32, rgb.width as u32));
            let whole = read_header(&bytes, true).unwrap().map(|h| h.upright());
            let prefix = read_header(&bytes[..200], false)
                .unwrap()
                .map(|h| h.upright());
            assert_eq!((whole, prefix), (want, want), "{kind:?}");
        }
    }

    #[test]
    fn a_header_past_the_prefix_asks_for_the_whole_file() {
        use jpeg_encoder::{ColorType, Encoder};
        // Two large APP2 segments (an ICC profile, say) before the frame header.
        let mut bytes = Vec::new();
        let mut enc = Encoder::new(&mut bytes, 90);
        enc.add_app_segment(2, &[7; 60_000]).unwrap();
        enc.add_app_segment(2, &[7; 60_000]).unwrap();
        enc.encode(&[128; 3 * 40 * 30], 40, 30, ColorType::Rgb)
            .unwrap();
        assert_eq!(read_header(&bytes[..65_536], false).unwrap(), None);
        let h = read_header(&bytes, true).unwrap().unwrap();
        assert_eq!(h.upright(), (30, 40));
        // A cut file whose header never comes is corrupt, not a hang or a guess.
        assert!(read_header(&bytes[..65_536], true).is_err());
    }
}
