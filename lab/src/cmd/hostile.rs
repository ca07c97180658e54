//! `stoker-lab bench hostile`: what each crafted image or clip of docs/reliability.md costs
//! the worker's own decode path, beside a normal photo and clip, the largest image the limits
//! decode and the costliest legitimate sample they serve (ten minutes of 1080p at 60 fps
//! sampled at 0.5 fps: every frame decoded to the last sampled one, 36,000 frames): CPU
//! seconds on one thread, peak resident memory and the outcome.
//!
//! Inputs are made once under `$STOKER_CACHE/bench/hostile` (the clips with Debian's ffmpeg,
//! as the test clips are); every case runs in this process, one after another, each with the
//! peak resident memory reset before it (`/proc/self/clear_refs`).

use super::bench::{peak_rss_mib, status_mib, thread_cpu_seconds};
use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::process::Command;
use stoker_config::{cache_root, Preprocessing};
use stoker_worker::cancel::Cancel;
use stoker_worker::dataset::sample::{VideoPart, VideoSource};
use stoker_worker::limits::SampleLimits;
use stoker_worker::preprocess::preset::Preset;
use stoker_worker::preprocess::video::process_clip;
use stoker_worker::preprocess::vision::{process_image, ImageTimings, PixelLut, Spent};

#[derive(clap::Args)]
pub struct HostileArgs {
    /// Runs of each case (one of a case that takes over 10 CPU seconds); the median CPU time
    /// is shown.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Where the inputs are cached [default: $STOKER_CACHE/bench/hostile].
    #[arg(long)]
    dir: Option<PathBuf>,
}

enum Medium {
    Image(Vec<u8>),
    /// A clip and the frames per second its sample asks for (the preset's when `None`).
    Clip(Vec<u8>, Option<f64>),
}

struct Case {
    name: &'static str,
    crafted: bool,
    medium: Medium,
}

/// The legitimate sample the crafted ones are held against: the most decoding the default
/// limits serve from a real clip (at the preset's 2 fps its 768 sampled frames, the preset's
/// cap, are over --max-sample-pixels; at 0.5 fps its 300 are not, and every frame up to the
/// last is decoded: 74.6 G of the 137.4 G pixel passes of --max-sample-work).
const REFERENCE: &str = "clip, 10 minutes of 1920x1080 H.264 at 60 fps, sampled at 0.5 fps";

/// CPU seconds past which a case runs once.
const LONG_S: f64 = 10.0;

/// The largest image the default limits decode (64 Mi pixels), as a progressive JPEG.
const LARGEST: u16 = 8192;

pub fn run(a: HostileArgs) -> anyhow::Result<()> {
    let dir = a.dir.unwrap_or_else(|| cache_root().join("bench/hostile"));
    std::fs::create_dir_all(&dir)?;
    let cases = cases(&dir)?;
    let pre = Preprocessing::default();
    let (preset, limits) = (Preset::from_config(&pre), SampleLimits::from_config(&pre));
    let (lut, video_lut) = (PixelLut::new(&preset), PixelLut::for_videos(&preset));
    println!("| input | outcome | CPU s | peak RSS MiB | CPU vs the 10-minute clip |");
    println!("|---|---|---|---|---|");
    let (mut reference, mut costliest) = (None, (0.0, ""));
    for case in &cases {
        let (mut cpu, mut peak, mut outcome) = (Vec::new(), 0f64, String::new());
        for _ in 0..a.runs.max(1) {
            std::fs::write("/proc/self/clear_refs", "5")?; // resets VmHWM to the current RSS
            let rss = status_mib(std::process::id(), "VmRSS")?;
            let c0 = thread_cpu_seconds();
            outcome = match &case.medium {
                Medium::Image(bytes) => {
                    let limits = limits.next_image(Spent::default());
                    let mut t = ImageTimings::default();
                    match process_image(bytes, &preset, &lut, limits, &mut t) {
                        Ok(out) => format!(
                            "served, {}x{} → grid {:?}",
                            out.original.1, out.original.0, out.grid_thw
                        ),
                        Err(e) => format!("refused: {e}"),
                    }
                }
                Medium::Clip(bytes, fps) => {
                    let part = VideoPart {
                        video: VideoSource::Clip(case.name.into()),
                        fps: *fps,
                        video_start: None,
                        video_end: None,
                    };
                    let open = || Cursor::new(bytes.clone());
                    let budget = limits.next_video(Spent::default());
                    let never = Cancel::default();
                    match process_clip(open, &part, &preset, &video_lut, budget, false, &never) {
                        Ok(out) => format!(
                            "served, {} frames → grid {:?}",
                            out.indices.len(),
                            out.grid_thw
                        ),
                        Err(e) => format!("refused: {e}"),
                    }
                }
            };
            cpu.push(thread_cpu_seconds() - c0);
            peak = peak.max(peak_rss_mib(std::process::id())? - rss);
            if cpu[0] > LONG_S {
                break; // once is enough to tell
            }
        }
        cpu.sort_by(f64::total_cmp);
        let median = cpu[cpu.len() / 2];
        if case.name == REFERENCE {
            reference = Some(median);
        }
        if case.crafted && median > costliest.0 {
            costliest = (median, case.name);
        }
        let ratio = match (case.crafted, reference) {
            (true, Some(r)) => format!("{:.2}x", median / r),
            _ => "".into(),
        };
        println!(
            "| {}{} | {} | {median:.3} | {peak:.0} | {ratio} |",
            if case.crafted { "crafted: " } else { "" },
            case.name,
            outcome.replace('|', "/"),
        );
    }
    if let Some(r) = reference {
        println!(
            "\nthe costliest crafted input: {:.3} CPU s, {:.2}x the 10-minute clip (goal <= 2x): {}",
            costliest.0,
            costliest.0 / r,
            costliest.1
        );
    }
    Ok(())
}

/// The inputs, made once.
fn cases(dir: &Path) -> anyhow::Result<Vec<Case>> {
    let cached = |name: &str, make: &dyn Fn(&Path) -> anyhow::Result<()>| {
        let path = dir.join(name);
        if !path.exists() {
            eprintln!("making {}", path.display());
            let tmp = dir.join(format!("{name}.tmp"));
            make(&tmp)?;
            std::fs::rename(&tmp, &path)?;
        }
        std::fs::read(&path).map_err(anyhow::Error::from)
    };
    let jpeg_to = |w: u16, h: u16, progressive: bool| {
        move |p: &Path| -> anyhow::Result<()> { Ok(std::fs::write(p, jpeg(w, h, progressive)?)?) }
    };
    // Encoded with libx264 from one of FFmpeg's test sources.
    let encoded = |source: &'static str| {
        move |p: &Path| {
            let encode = "-c:v libx264 -preset ultrafast -pix_fmt yuv420p";
            ffmpeg(&format!("-f lavfi -i {source} {encode}"), p)
        }
    };
    // Another clip's stream `times` + 1 times over, copied (not encoded again).
    let looped = |clip: &'static str, times: u32| {
        let clip = dir.join(clip);
        move |p: &Path| {
            let input = format!("-stream_loop {times} -i {} -c copy", clip.display());
            ffmpeg(&input, p)
        }
    };
    cached(
        "still-4096.mp4",
        &encoded("color=c=gray:s=4096x4096:r=30:d=10"),
    )?;
    cached(
        "1080p60-10s.mp4",
        &encoded("testsrc2=s=1920x1080:r=60:d=10"),
    )?;
    let image = |name, crafted, file, make: &dyn Fn(&Path) -> anyhow::Result<()>| {
        anyhow::Ok(Case {
            name,
            crafted,
            medium: Medium::Image(cached(file, make)?),
        })
    };
    let clip = |name, crafted, (file, fps), make: &dyn Fn(&Path) -> anyhow::Result<()>| {
        anyhow::Ok(Case {
            name,
            crafted,
            medium: Medium::Clip(cached(file, make)?, fps),
        })
    };
    let (side, jpeg_largest) = (LARGEST, || jpeg(LARGEST, LARGEST, true));
    Ok(vec![
        image(
            "photo, 4032x3024 JPEG",
            false,
            "photo.jpg",
            &jpeg_to(4032, 3024, false),
        )?,
        image(
            "largest image, 8192x8192 progressive JPEG",
            false,
            "largest.jpg",
            &jpeg_to(side, side, true),
        )?,
        image(
            "8192x8192 progressive JPEG of 100 scans, the most the scan limit lets through",
            true,
            "scans-100.jpg",
            &|p| Ok(std::fs::write(p, many_scans(&jpeg_largest()?, 100, false))?),
        )?,
        image(
            "8192x8192 progressive JPEG of 5,000 scans behind a zero-length segment",
            true,
            "scans-5000.jpg",
            &|p| Ok(std::fs::write(p, many_scans(&jpeg_largest()?, 5000, true))?),
        )?,
        clip(
            "clip, 10 s of 1280x720 H.264 at 30 fps",
            false,
            ("720p30-10s.mp4", None),
            &encoded("testsrc2=s=1280x720:r=30:d=10"),
        )?,
        clip(
            "clip, 10 minutes of 1920x1080 H.264 at 60 fps, at the preset's 2 fps",
            false,
            ("1080p60-10min.mp4", None),
            &looped("1080p60-10s.mp4", 59),
        )?,
        clip(
            REFERENCE,
            false,
            ("1080p60-10min.mp4", Some(0.5)),
            &looped("1080p60-10s.mp4", 59),
        )?,
        clip(
            "4096x4096 GIF of 1,800 one-pixel frames, as a video",
            true,
            ("frames.gif", None),
            &|p| Ok(std::fs::write(p, gif(4096, 1800))?),
        )?,
        clip(
            "8,400 still frames of 4096x4096 H.264 (2.8 MB)",
            true,
            ("still-4096-long.mp4", None),
            &looped("still-4096.mp4", 27),
        )?,
        clip(
            "8,100 still frames of 4096x4096 H.264 sampled at 0.1 fps: every frame decoded, just under the work budget",
            true,
            ("still-4096-8100.mp4", Some(0.1)),
            &looped("still-4096.mp4", 26),
        )?,
    ])
}

/// Runs `ffmpeg` with `args` (split at spaces) writing MP4 to `out`.
fn ffmpeg(args: &str, out: &Path) -> anyhow::Result<()> {
    let run = Command::new("ffmpeg")
        .args(["-hide_banner", "-loglevel", "error", "-y"])
        .args(args.split(' '))
        .args(["-f", "mp4"])
        .arg(out)
        .output()?;
    anyhow::ensure!(
        run.status.success(),
        "ffmpeg {args}: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    Ok(())
}

fn jpeg(w: u16, h: u16, progressive: bool) -> anyhow::Result<Vec<u8>> {
    // A smooth picture with some texture, as photos are.
    let px: Vec<u8> = (0..h as usize)
        .flat_map(|y| {
            (0..w as usize)
                .flat_map(move |x| [(x / 16) as u8, (y / 16) as u8, ((x * y) % 251) as u8])
        })
        .collect();
    let mut out = Vec::new();
    let mut enc = jpeg_encoder::Encoder::new(&mut out, 90);
    enc.set_progressive(progressive);
    enc.encode(&px, w, h, jpeg_encoder::ColorType::Rgb)?;
    Ok(out)
}

/// `jpeg` with its last scan repeated until it has `scans` (libjpeg decodes each, warning
/// only of a repeated band) and, with `hide`, a zero-length APP5 segment before its first
/// scan, which a marker walk that stops there would not count past.
fn many_scans(jpeg: &[u8], scans: usize, hide: bool) -> Vec<u8> {
    let eoi = jpeg.len() - 2;
    let starts: Vec<usize> = (2..eoi)
        .filter(|&i| jpeg[i..i + 2] == [0xff, 0xda])
        .collect();
    let (first, last) = (starts[0], starts[starts.len() - 1]);
    let mut out = jpeg[..first].to_vec();
    if hide {
        out.extend_from_slice(&[0xff, 0xe5, 0x00, 0x00]);
    }
    out.extend_from_slice(&jpeg[first..eoi]);
    for _ in starts.len()..scans {
        out.extend_from_slice(&jpeg[last..eoi]);
    }
    out.extend_from_slice(&[0xff, 0xd9]);
    out
}

/// A GIF of a `side`² screen and `frames` frames of one pixel each.
fn gif(side: u16, frames: usize) -> Vec<u8> {
    let mut out = b"GIF89a".to_vec();
    out.extend_from_slice(&side.to_le_bytes());
    out.extend_from_slice(&side.to_le_bytes());
    out.extend_from_slice(&[0x80, 0, 0, 0, 0, 0, 255, 255, 255]); // two global colours
    for k in 0..frames {
        out.extend_from_slice(&[0x21, 0xf9, 4, 0, 1, 0, 0, 0]); // 1/100 s each
        out.push(0x2c);
        let at = (k as u16) % side;
        out.extend_from_slice(&at.to_le_bytes());
        out.extend_from_slice(&at.to_le_bytes());
        out.extend_from_slice(&[1, 0, 1, 0, 0]); // 1x1, no local colours
        out.extend_from_slice(&[2, 2, 0x44, 0x01, 0]); // LZW: clear, pixel 0, end
    }
    out.push(0x3b);
    out
}
