//! A rank slice's tensors: the prepared samples going in, the collated batch coming out
//! (plain, or with a packed layout's extra tensors), and the unpacked collate. The pipeline
//! fills it, packing rearranges it, the server writes it: all three import it from here.

use crate::preprocess::text::IGNORE_INDEX;
use crate::preprocess::video::VideoOut;
use crate::preprocess::vision::{ImageOut, PixelBuf};
use stoker_wire::{BatchMedia, Ids, MediaGrids, Skipped};

/// A preprocessed sample, ready to collate.
pub struct PreparedSample {
    pub sample_id: u64,
    pub input_ids: Vec<i64>,
    pub labels: Vec<i64>,
    pub images: Vec<ImageOut>,
    pub videos: Vec<VideoOut>,
    /// The rendered chat text, for `dataset inspect`.
    pub text: String,
    pub truncated: bool,
}

/// Collated tensors of one rank slice.
pub struct Batch {
    pub sample_ids: Vec<u64>,
    pub skipped: Vec<Skipped>,
    /// Rows of the token tensors: one per sample, or per pack when packed.
    pub rows: usize,
    /// `[rows, L]` each, right-padded to the longest row.
    pub input_ids: Vec<i64>,
    pub labels: Vec<i64>,
    pub attention_mask: Vec<i64>,
    pub seq_len: usize,
    /// One chunk per image, in sample then image order: concatenated they are `pixel_values`.
    pub pixel_chunks: Vec<PixelBuf>,
    pub pixel_rows: usize,
    pub image_grid_thw: Vec<i64>,
    /// The same for videos: `pixel_values_videos`' chunks and rows, `video_grid_thw`, and
    /// (Qwen2.5-VL) `second_per_grid_ts`; empty when the batch holds no video.
    pub video_chunks: Vec<PixelBuf>,
    pub video_rows: usize,
    pub video_grid_thw: Vec<i64>,
    pub second_per_grid_ts: Vec<f32>,
    pub packing: Option<Packing>,
}

impl Batch {
    /// What the media check reads, as the batch goes on the wire (video tensors only with a
    /// video, `second_per_grid_ts` only with a non-zero entry).
    pub fn media(&self) -> BatchMedia<'_> {
        let packing = self.packing.as_ref();
        let with_videos = !self.video_chunks.is_empty();
        BatchMedia {
            input_ids: Ids::Values(&self.input_ids),
            rows: self.rows,
            images: MediaGrids {
                grid: &self.image_grid_thw,
                pixel_rows: self.pixel_rows as u64,
                per_row: packing.map(|p| p.pack_images.as_slice()),
            },
            videos: match with_videos {
                true => MediaGrids {
                    grid: &self.video_grid_thw,
                    pixel_rows: self.video_rows as u64,
                    per_row: packing.map(|p| p.pack_videos.as_slice()),
                },
                false => MediaGrids::default(),
            },
            second_per_grid_ts: (with_videos && self.second_per_grid_ts.iter().any(|&s| s > 0.0))
                .then_some(self.second_per_grid_ts.len() as u64),
        }
    }

    /// Bytes of its tensors on the wire (a frame adds the head and alignment padding).
    pub fn tensor_bytes(&self) -> u64 {
        let i64s = self.input_ids.len()
            + self.labels.len()
            + self.attention_mask.len()
            + self.image_grid_thw.len()
            + self.video_grid_thw.len();
        let pixels: usize = (self.pixel_chunks.iter().chain(&self.video_chunks))
            .map(|c| c.as_bytes().len())
            .sum();
        let packing = self.packing.as_ref().map_or(0, Packing::tensor_bytes);
        (i64s * 8 + pixels + self.second_per_grid_ts.len() * 4) as u64 + packing
    }
}

/// A packed batch's extra tensors (the token tensors are `[rows, seq_len]` as unpacked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packing {
    /// `[4, rows, seq_len]`: the text positions, then rope's temporal, height and width rows;
    /// each sample starts at 0; 0 past a row's end.
    pub position_ids: Vec<i64>,
    /// `[rows, max_samples + 1]` int32: each row's sample boundaries (0, end of the first,
    /// …), its length repeated past its last sample (empty sequences to a varlen kernel).
    pub cu_seqlens: Vec<i32>,
    pub max_samples: usize,
    /// `[rows]`: each row's images (their `pixel_values` rows follow each other in order).
    pub pack_images: Vec<i64>,
    /// `[rows]`: each row's videos, likewise.
    pub pack_videos: Vec<i64>,
}

impl Packing {
    pub fn tensor_bytes(&self) -> u64 {
        let counts = self.pack_images.len() + self.pack_videos.len();
        (self.position_ids.len() * 8 + self.cu_seqlens.len() * 4 + counts * 8) as u64
    }
}

/// Converts i64s to little-endian bytes (the wire is little endian).
pub fn i64_bytes(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Pads token sequences to the longest and lines the images up.
pub fn collate(samples: Vec<PreparedSample>, skipped: Vec<Skipped>, pad_id: i64) -> Batch {
    let seq_len = samples.iter().map(|s| s.input_ids.len()).max().unwrap_or(0);
    let b = samples.len();
    let mut input_ids = vec![pad_id; b * seq_len];
    let mut labels = vec![IGNORE_INDEX; b * seq_len];
    let mut attention_mask = vec![0i64; b * seq_len];
    let mut pixel_chunks = Vec::new();
    let mut pixel_rows = 0;
    let mut image_grid_thw = Vec::new();
    let (mut video_chunks, mut video_rows) = (Vec::new(), 0);
    let (mut video_grid_thw, mut second_per_grid_ts) = (Vec::new(), Vec::new());
    let mut sample_ids = Vec::with_capacity(b);
    for (i, s) in samples.into_iter().enumerate() {
        let n = s.input_ids.len();
        let row = i * seq_len;
        input_ids[row..row + n].copy_from_slice(&s.input_ids);
        labels[row..row + n].copy_from_slice(&s.labels);
        attention_mask[row..row + n].fill(1);
        for img in s.images {
            pixel_rows += img.rows;
            image_grid_thw.extend_from_slice(&img.grid_thw);
            pixel_chunks.push(img.pixels);
        }
        for v in s.videos {
            video_rows += v.rows;
            video_grid_thw.extend_from_slice(&v.grid_thw);
            second_per_grid_ts.push(v.second_per_grid as f32);
            video_chunks.push(v.pixels);
        }
        sample_ids.push(s.sample_id);
    }
    Batch {
        sample_ids,
        skipped,
        rows: b,
        input_ids,
        labels,
        attention_mask,
        seq_len,
        pixel_chunks,
        pixel_rows,
        image_grid_thw,
        video_chunks,
        video_rows,
        video_grid_thw,
        second_per_grid_ts,
        packing: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stoker_wire::MediaTokens;

    const TOKENS: MediaTokens = MediaTokens {
        image_token: 7,
        video_token: 8,
        merge_size: 2,
    };

    /// One row of ids, an image of grid 1x2x4 (8 patches, 2 tokens), a video of 2x2x2 (8
    /// patches, 2 tokens) with its seconds.
    fn batch(ids: Vec<i64>) -> Batch {
        Batch {
            sample_ids: vec![0],
            skipped: Vec::new(),
            rows: 1,
            seq_len: ids.len(),
            labels: vec![IGNORE_INDEX; ids.len()],
            attention_mask: vec![1; ids.len()],
            input_ids: ids,
            pixel_chunks: Vec::new(),
            pixel_rows: 8,
            image_grid_thw: vec![1, 2, 4],
            video_chunks: vec![PixelBuf::U8(vec![0; 8 * 12])],
            video_rows: 8,
            video_grid_thw: vec![2, 2, 2],
            second_per_grid_ts: vec![1.0],
            packing: None,
        }
    }

    #[test]
    fn the_media_checked_are_the_media_sent() {
        assert_eq!(TOKENS.check(&batch(vec![7, 7, 8, 8, 1]).media()), Ok(()));
        let why = TOKENS
            .check(&batch(vec![7, 1, 8, 8, 1]).media())
            .unwrap_err();
        assert!(
            why.contains("row 0 holds 1 image pad tokens, its images 2"),
            "{why}"
        );
        let why = TOKENS
            .check(&batch(vec![7, 7, 8, 1, 1]).media())
            .unwrap_err();
        assert!(
            why.contains("row 0 holds 1 video pad tokens, its videos 2"),
            "{why}"
        );
        // Seconds go on the wire only when one is non-zero, and are checked only then.
        let mut no_seconds = batch(vec![7, 7, 8, 8, 1]);
        no_seconds.second_per_grid_ts = vec![0.0, 0.0];
        assert_eq!(no_seconds.media().second_per_grid_ts, None);
        let mut two_seconds = batch(vec![7, 7, 8, 8, 1]);
        two_seconds.second_per_grid_ts = vec![1.0, 1.0];
        let why = TOKENS.check(&two_seconds.media()).unwrap_err();
        assert!(
            why.contains("second_per_grid_ts has 2 entries for 1 videos"),
            "{why}"
        );
    }
}
