//! Packed batches for varlen attention: a rank's samples laid end to end in rows of at most
//! `--pack-max-tokens`, with what a varlen kernel and Qwen-VL's rope need to keep the samples
//! apart: `cu_seqlens` per row, and position ids that restart at every sample — a text row
//! (0, 1, 2, … per sample: Hugging Face's packed-sequence detection reads it) and the three
//! multimodal rope rows exactly as the model's `get_rope_index` gives them for that sample
//! alone (tests/parity/test_packing.py checks them against it).

use crate::batch::{collate, Batch, Packing, PreparedSample};
use crate::preprocess::text::IGNORE_INDEX;
use stoker_wire::Skipped;

/// How image and video tokens get their rope positions: which token ids they are, how many
/// patches per side merge into one token, and (Qwen2.5-VL) the rope's `tokens_per_second`.
#[derive(Debug, Clone, Copy)]
pub struct RopeLayout {
    pub image_token: i64,
    pub video_token: i64,
    pub merge_size: i64,
    /// Qwen2.5-VL: a video's temporal positions are `t · second_per_grid · tokens_per_second`,
    /// truncated (the model's `get_rope_index`); other presets count groups.
    pub tokens_per_second: Option<i64>,
}

/// One run of vision tokens: its grid, and the step between its temporal positions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VisionRun {
    pub grid: [i64; 3],
    pub second_per_grid: Option<f32>,
}

/// A sample's vision runs in token order: an image's one; a video's one, or (Qwen3-VL, whose
/// prompt dates each temporal group) one per group of `[1, h, w]`.
pub fn vision_runs(sample: &PreparedSample, layout: RopeLayout, dated: bool) -> Vec<VisionRun> {
    let mut images = sample.images.iter();
    let mut videos = sample.videos.iter();
    let mut runs = Vec::new();
    let mut i = 0;
    while i < sample.input_ids.len() {
        let id = sample.input_ids[i];
        let run = if id == layout.image_token {
            let g = images.next().expect("a grid per image run").grid_thw;
            vec![VisionRun {
                grid: g,
                second_per_grid: None,
            }]
        } else if id == layout.video_token {
            let v = videos.next().expect("a grid per video");
            let [t, h, w] = v.grid_thw;
            match dated {
                true => (0..t)
                    .map(|_| VisionRun {
                        grid: [1, h, w],
                        second_per_grid: None,
                    })
                    .collect(),
                false => vec![VisionRun {
                    grid: [t, h, w],
                    second_per_grid: layout.tokens_per_second.map(|_| v.second_per_grid as f32),
                }],
            }
        } else {
            i += 1;
            continue;
        };
        // Skip this media's tokens: its runs and, when dated, the text between them.
        let mut left = run.len();
        for r in &run {
            let n = (r.grid[0] * r.grid[1] * r.grid[2] / (layout.merge_size * layout.merge_size))
                as usize;
            i += n;
            left -= 1;
            if left > 0 {
                while i < sample.input_ids.len() && sample.input_ids[i] != id {
                    i += 1;
                }
            }
        }
        runs.extend(run);
    }
    runs
}

/// Qwen-VL's multimodal rope positions of one sample (the model's `get_rope_index` on it
/// alone): text tokens count up on all three rows; a run of image or video tokens gets
/// (temporal, height, width) grid positions offset by the position before it, and the text
/// after it continues at that offset plus the larger merged side.
pub fn rope_positions(input_ids: &[i64], runs: &[VisionRun], layout: RopeLayout) -> [Vec<i64>; 3] {
    let mut rows: [Vec<i64>; 3] = std::array::from_fn(|_| Vec::with_capacity(input_ids.len()));
    let mut runs = runs.iter();
    let (mut pos, mut i) = (0i64, 0usize);
    while i < input_ids.len() {
        let id = input_ids[i];
        if id != layout.image_token && id != layout.video_token {
            rows.iter_mut().for_each(|r| r.push(pos));
            pos += 1;
            i += 1;
            continue;
        }
        let run = runs.next().expect("a grid per vision run");
        let [t, h, w] = run.grid;
        let (h, w) = (h / layout.merge_size, w / layout.merge_size);
        let tps = layout.tokens_per_second.unwrap_or(1) as f32;
        let t_at = |ti: i64| match run.second_per_grid {
            // float32 as torch computes it, then `.long()`.
            Some(spg) => ((ti as f32 * spg) * tps) as i64,
            None => ti,
        };
        for (ti, hi, wi) in
            (0..t).flat_map(|ti| (0..h).flat_map(move |hi| (0..w).map(move |wi| (ti, hi, wi))))
        {
            rows[0].push(pos + t_at(ti));
            rows[1].push(pos + hi);
            rows[2].push(pos + wi);
        }
        i += (t * h * w) as usize;
        // transformers 5.23: the text after a run starts its merged height or width further
        // on, whatever its temporal extent.
        pos += h.max(w);
    }
    rows
}

/// Collates `samples` (in plan order) into `pack_sizes.len()` rows, `pack_sizes[p]` samples
/// in row `p`. A sample's first label is ignored, so no loss term reaches across from the
/// sample before it.
pub fn collate_packed(
    samples: Vec<PreparedSample>,
    pack_sizes: &[usize],
    skipped: Vec<Skipped>,
    pad_id: i64,
    layout: RopeLayout,
    dated: bool,
) -> Batch {
    let sample_ids: Vec<u64> = samples.iter().map(|s| s.sample_id).collect();
    let max_samples = pack_sizes.iter().copied().max().unwrap_or(0);
    let mut samples = samples.into_iter();
    let mut rows = Vec::with_capacity(pack_sizes.len());
    let mut positions: Vec<[Vec<i64>; 4]> = Vec::with_capacity(pack_sizes.len());
    let mut cu_seqlens = Vec::with_capacity(pack_sizes.len() * (max_samples + 1));
    let mut pack_images = Vec::with_capacity(pack_sizes.len());
    let mut pack_videos = Vec::with_capacity(pack_sizes.len());
    for &n in pack_sizes {
        let mut row = PreparedSample {
            sample_id: 0,
            input_ids: Vec::new(),
            labels: Vec::new(),
            images: Vec::new(),
            videos: Vec::new(),
            text: String::new(),
            truncated: false,
        };
        let mut pos: [Vec<i64>; 4] = Default::default();
        let mut bounds = vec![0i32];
        for mut s in samples.by_ref().take(n) {
            let runs = vision_runs(&s, layout, dated);
            let [t, h, w] = rope_positions(&s.input_ids, &runs, layout);
            pos[0].extend(0..s.input_ids.len() as i64);
            pos[1].extend(t);
            pos[2].extend(h);
            pos[3].extend(w);
            if let Some(first) = s.labels.first_mut() {
                *first = IGNORE_INDEX;
            }
            row.input_ids.append(&mut s.input_ids);
            row.labels.append(&mut s.labels);
            row.images.append(&mut s.images);
            row.videos.append(&mut s.videos);
            bounds.push(row.input_ids.len() as i32);
        }
        let end = *bounds.last().expect("starts with 0");
        bounds.resize(max_samples + 1, end);
        cu_seqlens.extend(bounds);
        pack_images.push(row.images.len() as i64);
        pack_videos.push(row.videos.len() as i64);
        positions.push(pos);
        rows.push(row);
    }
    let mut batch = collate(rows, skipped, pad_id);
    let l = batch.seq_len;
    let mut position_ids = vec![0i64; 4 * pack_sizes.len() * l];
    for (p, pos) in positions.iter().enumerate() {
        for (axis, values) in pos.iter().enumerate() {
            let at = (axis * pack_sizes.len() + p) * l;
            position_ids[at..at + values.len()].copy_from_slice(values);
        }
    }
    batch.sample_ids = sample_ids;
    batch.packing = Some(Packing {
        position_ids,
        cu_seqlens,
        max_samples,
        pack_images,
        pack_videos,
    });
    batch
}

#[cfg(test)]
mod tests {
    use super::*;

    const LAYOUT: RopeLayout = RopeLayout {
        image_token: 9,
        video_token: 8,
        merge_size: 2,
        tokens_per_second: None,
    };

    #[test]
    fn rope_positions_count_text_and_lay_an_image_on_its_grid() {
        // Two text tokens, one image of 1 x 4 x 6 patches (2 x 3 tokens), two text tokens.
        let ids = [1, 2, 9, 9, 9, 9, 9, 9, 3, 4];
        let run = |grid| VisionRun {
            grid,
            second_per_grid: None,
        };
        let [t, h, w] = rope_positions(&ids, &[run([1, 4, 6])], LAYOUT);
        assert_eq!(t, [0, 1, 2, 2, 2, 2, 2, 2, 5, 6]);
        assert_eq!(h, [0, 1, 2, 2, 2, 3, 3, 3, 5, 6]);
        assert_eq!(w, [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]);
        // A video of 2 temporal groups of 2 x 2 tokens (video token 8): t counts groups.
        let ids = [1, 8, 8, 8, 8, 8, 8, 8, 8, 2];
        let [t, h, w] = rope_positions(&ids, &[run([2, 4, 4])], LAYOUT);
        assert_eq!(t, [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]);
        assert_eq!(h, [0, 1, 1, 2, 2, 1, 1, 2, 2, 3]);
        assert_eq!(w, [0, 1, 2, 1, 2, 1, 2, 1, 2, 3]);
        // Qwen2.5-VL: t · second_per_grid · tokens_per_second (2), truncated.
        let scaled = RopeLayout {
            tokens_per_second: Some(2),
            ..LAYOUT
        };
        let r = VisionRun {
            grid: [2, 4, 4],
            second_per_grid: Some(1.75),
        };
        let [t, _, _] = rope_positions(&ids, &[r], scaled);
        // The text after it starts two (the merged side) past the run's start, as 5.23 has it.
        assert_eq!(t, [0, 1, 1, 1, 1, 4, 4, 4, 4, 3]);
    }

    /// Real served samples (1, 2 and 3 images, non-square grids) and transformers' Qwen2-VL
    /// `get_rope_index` on each alone, written by tests/parity/test_packing.py
    /// (`STOKER_WRITE_ROPE_FIXTURE`), which also checks served packs against the model live
    /// where torch is installed.
    #[test]
    fn rope_positions_are_the_models_get_rope_index() {
        #[derive(serde::Deserialize)]
        struct Case {
            sample: u64,
            input_ids: Vec<i64>,
            image_grid_thw: Vec<[i64; 3]>,
            rope: [Vec<i64>; 3],
        }
        let cases: Vec<Case> =
            serde_json::from_str(include_str!("../tests/fixtures/rope_positions.json")).unwrap();
        assert_eq!(cases.len(), 3);
        let layout = RopeLayout {
            image_token: 151_655,
            video_token: 151_656,
            merge_size: 2,
            tokens_per_second: None,
        };
        for c in cases {
            let runs: Vec<VisionRun> = (c.image_grid_thw.iter())
                .map(|&grid| VisionRun {
                    grid,
                    second_per_grid: None,
                })
                .collect();
            let got = rope_positions(&c.input_ids, &runs, layout);
            assert_eq!(got, c.rope, "sample {}", c.sample);
        }
    }

    fn sample(id: u64, ids: Vec<i64>) -> PreparedSample {
        PreparedSample {
            sample_id: id,
            labels: ids.clone(),
            input_ids: ids,
            images: vec![],
            videos: vec![],
            text: String::new(),
            truncated: false,
        }
    }

    #[test]
    fn packs_keep_samples_apart() {
        let samples = vec![
            sample(7, vec![1, 2, 3]),
            sample(8, vec![4, 5]),
            sample(9, vec![6]),
        ];
        let b = collate_packed(samples, &[2, 1, 0], vec![], 0, LAYOUT, false);
        assert_eq!(
            (b.rows, b.seq_len, b.sample_ids.clone()),
            (3, 5, vec![7, 8, 9])
        );
        assert_eq!(b.input_ids, [1, 2, 3, 4, 5, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        // No label crosses a boundary: each sample's first is ignored.
        assert_eq!(b.labels[..5], [-100, 2, 3, -100, 5]);
        assert_eq!(b.attention_mask[..10], [1, 1, 1, 1, 1, 1, 0, 0, 0, 0]);
        let p = b.packing.unwrap();
        assert_eq!(p.cu_seqlens, [0, 3, 5, 0, 1, 1, 0, 0, 0]);
        assert_eq!(p.max_samples, 2);
        assert_eq!(p.pack_images, [0, 0, 0]);
        // Text row, then the rope rows: every sample restarts at 0.
        assert_eq!(p.position_ids[..5], [0, 1, 2, 0, 1]);
        assert_eq!(p.position_ids[15..20], [0, 1, 2, 0, 1]);
        assert_eq!(p.position_ids[20..25], [0, 0, 0, 0, 0]);
    }
}
