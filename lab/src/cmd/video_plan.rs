//! `stoker-lab video-plan`: the frames a preset samples from clips known by their header alone
//! (frame count and rate), one JSON line in, one out — how tests/parity/test_video_sampling.py
//! sweeps every length against transformers' own sampling without making thousands of clips.

use serde::Deserialize;
use std::io::{BufRead, Write};
use stoker_config::PresetName;
use stoker_worker::preprocess::preset::Preset;
use stoker_worker::preprocess::video::plan_frames;
use stoker_worker::preprocess::video_decode::VideoHeader;

/// One clip: `{"preset": "qwen2-vl", "frames": 397, "video_fps": 25.0}`, with the sample's
/// `fps`, `start` and `end` (seconds) when it gives them.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Clip {
    preset: PresetName,
    frames: u64,
    video_fps: Option<f64>,
    fps: Option<f64>,
    start: Option<f64>,
    end: Option<f64>,
}

/// Reads clips from stdin until it ends; writes `{"indices", "sampled", "second_per_grid",
/// "timestamps"}` per clip (the frames decoded, the count the sampling chose, Qwen2.5-VL's
/// seconds per temporal group, Qwen3-VL's group times), or `{"error"}` when it refuses one.
pub fn run() -> anyhow::Result<()> {
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for line in std::io::stdin().lock().lines() {
        let clip: Clip = serde_json::from_str(&line?)?;
        anyhow::ensure!(
            clip.frames > 0,
            "a clip has at least one frame (its header says so)"
        );
        let preset = Preset::new(clip.preset);
        let header = VideoHeader {
            width: 64,
            height: 64,
            rotation: 0,
            frames: clip.frames,
            fps: clip.video_fps,
        };
        let answer = match plan_frames(&preset, &header, clip.fps, (clip.start, clip.end)) {
            Ok(plan) => serde_json::json!({
                "indices": plan.indices,
                "sampled": plan.sampled,
                "second_per_grid": plan.second_per_grid(preset.temporal_patch_size),
                "timestamps": plan.timestamps(preset.temporal_patch_size),
            }),
            Err(e) => serde_json::json!({ "error": e.to_string() }),
        };
        writeln!(out, "{answer}")?;
    }
    Ok(out.flush()?)
}
