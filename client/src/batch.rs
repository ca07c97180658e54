//! A batch as the trainer receives it: metadata plus tensors that are views of one buffer.

use crate::buffer::AlignedBuf;
use crate::metrics::RejectReason;
use std::ops::Range;
use std::sync::Arc;
use stoker_wire::{
    tensor, BatchHead, BatchMedia, DType, Ids, MediaGrids, MediaTokens, Skipped, TensorMeta,
};

pub struct Batch {
    pub epoch: u64,
    pub global_batch: u64,
    pub rank: u32,
    pub world_size: u32,
    /// Dataset sample ids, in row order.
    pub sample_ids: Vec<u64>,
    /// Samples the worker could not serve, and why (the batch is short by these).
    pub skipped: Vec<Skipped>,
    pub tensors: Vec<TensorMeta>,
    /// The whole frame payload; every tensor lies inside it at its aligned offset.
    pub payload: Arc<AlignedBuf>,
    /// The worker that served it.
    pub worker: String,
    /// A packed batch's packs in row order; `None` for plain batches (one sample per row).
    pub packs: Option<Vec<Pack>>,
}

/// One pack of a packed batch (workers started with `--pack-max-tokens`): where its samples,
/// tokens and images lie in the batch's tensors, checked when the batch arrived. A varlen
/// forward takes row `row`'s first `tokens` columns of `input_ids` and `labels` (and of
/// `position_ids`, `[4, packs, L]`), `cu_seqlens`, the `image_grid_thw` rows `images` and the
/// `pixel_values` rows `pixel_rows`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pack {
    pub row: usize,
    pub tokens: usize,
    /// Sample boundaries: 0, the end of each sample, the last one `tokens` (the wire row's
    /// padding repeats left out).
    pub cu_seqlens: Vec<i32>,
    /// The longest sample's tokens: a varlen kernel's `max_seqlen`.
    pub max_seqlen: i32,
    /// The pack's entries of [`Batch::sample_ids`].
    pub samples: Range<usize>,
    /// Its rows of `image_grid_thw`.
    pub images: Range<usize>,
    /// Its rows of `pixel_values`.
    pub pixel_rows: Range<usize>,
    /// Its rows of `video_grid_thw` (and `second_per_grid_ts`); empty without videos.
    pub videos: Range<usize>,
    /// Its rows of `pixel_values_videos`.
    pub video_rows: Range<usize>,
}

/// One tensor of a batch: metadata and its bytes, borrowed from the batch payload.
pub struct TensorView<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [u64],
    pub bytes: &'a [u8],
}

impl Batch {
    /// The batch a worker answered, or why its tensors do not fit together (then it is
    /// never delivered): a packed layout that points past its tensors or skips samples, media
    /// that disagree with their pad tokens (`media`: the plan's, from the Welcome).
    pub(crate) fn new(
        head: BatchHead,
        payload: AlignedBuf,
        worker: String,
        media: &MediaTokens,
    ) -> std::result::Result<Self, (RejectReason, String)> {
        let mut batch = Batch {
            epoch: head.request.epoch,
            global_batch: head.request.global_batch,
            rank: head.request.rank,
            world_size: head.request.world_size,
            sample_ids: head.sample_ids,
            skipped: head.skipped,
            tensors: head.tensors,
            payload: Arc::new(payload),
            worker,
            packs: None,
        };
        if batch.tensor(tensor::CU_SEQLENS).is_some() {
            let packs = packs(&batch)
                .map_err(|e| (RejectReason::MalformedLayout, format!("packed layout: {e}")))?;
            batch.packs = Some(packs);
        }
        check_media(&batch, media).map_err(|e| {
            (
                RejectReason::MediaMismatch,
                format!("media and tokens disagree: {e}"),
            )
        })?;
        Ok(batch)
    }

    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .map(|t| self.view(t))
    }

    pub fn views(&self) -> impl Iterator<Item = TensorView<'_>> {
        self.tensors.iter().map(|t| self.view(t))
    }

    fn view<'a>(&'a self, t: &'a TensorMeta) -> TensorView<'a> {
        // The head decoder checked that every tensor lies inside the payload.
        let start = t.offset as usize;
        TensorView {
            name: &t.name,
            dtype: t.dtype,
            shape: &t.shape,
            bytes: &self.payload.as_slice()[start..start + t.nbytes as usize],
        }
    }

    /// Bytes of the frame payload (head and tensors).
    pub fn payload_bytes(&self) -> u64 {
        self.payload.len() as u64
    }
}

/// The tensors that hold media: a batch with any of them has its tokens checked against them.
const MEDIA_TENSORS: [&str; 5] = [
    tensor::PIXEL_VALUES,
    tensor::IMAGE_GRID_THW,
    tensor::PIXEL_VALUES_VIDEOS,
    tensor::VIDEO_GRID_THW,
    tensor::SECOND_PER_GRID_TS,
];

/// `stoker_wire`'s media check on the batch's tensors (the packs, when packed, already
/// checked against them).
fn check_media(batch: &Batch, media: &MediaTokens) -> std::result::Result<(), String> {
    let Some(ids) = batch.tensor(tensor::INPUT_IDS) else {
        return match MEDIA_TENSORS.iter().find(|n| batch.tensor(n).is_some()) {
            Some(name) => Err(format!("{name} without input_ids")),
            None => Ok(()),
        };
    };
    let rows = match (ids.dtype, ids.shape) {
        (DType::I64, &[rows, _]) => rows as usize,
        (dtype, shape) => {
            return Err(format!(
                "input_ids is {} {shape:?}, not [rows, L] int64",
                dtype.name()
            ))
        }
    };
    if batch.packs.is_none() && rows != batch.sample_ids.len() {
        return Err(format!(
            "input_ids has {rows} rows for {} samples",
            batch.sample_ids.len()
        ));
    }
    let grid = |name| match batch.tensor(name) {
        None => Ok(Vec::new()),
        Some(_) => match ints(batch, name, 2)? {
            (v, shape) if shape[1] == 3 => Ok(v),
            (_, shape) => Err(format!("{name} has shape {shape:?}, not [n, 3]")),
        },
    };
    let pixel_rows =
        |name| (batch.tensor(name)).map_or(0, |t| t.shape.first().copied().unwrap_or(0));
    let per_pack = |count: fn(&Pack) -> usize| -> Option<Vec<i64>> {
        (batch.packs.as_ref()).map(|packs| packs.iter().map(|p| count(p) as i64).collect())
    };
    let (image_grid, video_grid) = (grid(tensor::IMAGE_GRID_THW)?, grid(tensor::VIDEO_GRID_THW)?);
    let (images_per_pack, videos_per_pack) =
        (per_pack(|p| p.images.len()), per_pack(|p| p.videos.len()));
    let seconds = match batch.tensor(tensor::SECOND_PER_GRID_TS).map(|t| t.shape) {
        None => None,
        Some(&[n]) => Some(n),
        Some(shape) => return Err(format!("second_per_grid_ts has shape {shape:?}")),
    };
    media.check(&BatchMedia {
        input_ids: Ids::Bytes(ids.bytes),
        rows,
        images: MediaGrids {
            grid: &image_grid,
            pixel_rows: pixel_rows(tensor::PIXEL_VALUES),
            per_row: images_per_pack.as_deref(),
        },
        videos: MediaGrids {
            grid: &video_grid,
            pixel_rows: pixel_rows(tensor::PIXEL_VALUES_VIDEOS),
            per_row: videos_per_pack.as_deref(),
        },
        second_per_grid_ts: seconds,
    })
}

/// A tensor's values as i64, with its shape, if it has `dims` dimensions and an integer dtype.
fn ints(
    batch: &Batch,
    name: &str,
    dims: usize,
) -> std::result::Result<(Vec<i64>, Vec<usize>), String> {
    let t = batch
        .tensor(name)
        .ok_or_else(|| format!("no {name} tensor"))?;
    if t.shape.len() != dims {
        return Err(format!(
            "{name} has shape {:?}, not {dims} dimensions",
            t.shape
        ));
    }
    let values = match t.dtype {
        DType::I32 => t
            .bytes
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as i64)
            .collect(),
        DType::I64 => t
            .bytes
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        other => return Err(format!("{name} is {}, not an integer tensor", other.name())),
    };
    Ok((values, t.shape.iter().map(|&d| d as usize).collect()))
}

/// The packs a packed batch's tensors describe, every range checked against the tensor it
/// points into: a worker of another version (or a hostile one) never makes a trainer index
/// past a tensor, and every sample, image and video belongs to exactly one pack.
fn packs(batch: &Batch) -> std::result::Result<Vec<Pack>, String> {
    let (cu, cu_shape) = ints(batch, tensor::CU_SEQLENS, 2)?;
    let (rows, width) = match batch.tensor(tensor::INPUT_IDS).map(|t| t.shape) {
        Some(&[rows, width]) => (rows as usize, width as usize),
        shape => return Err(format!("input_ids has shape {shape:?}")),
    };
    if cu_shape[0] != rows || cu_shape[1] == 0 {
        return Err(format!(
            "input_ids has {rows} rows, cu_seqlens shape {cu_shape:?}"
        ));
    }
    let positions = batch.tensor(tensor::POSITION_IDS).map(|t| t.shape);
    if positions != Some(&[4, rows as u64, width as u64][..]) {
        return Err(format!(
            "position_ids has shape {positions:?}, not [4, {rows}, {width}]"
        ));
    }
    let images = media_ranges(batch, rows, Media::IMAGES)?;
    let videos = match batch.tensor(tensor::PACK_VIDEOS) {
        Some(_) => media_ranges(batch, rows, Media::VIDEOS)?,
        None => vec![(0..0, 0..0); rows],
    };
    let mut out: Vec<Pack> = Vec::with_capacity(rows);
    for (row, bounds) in cu.chunks_exact(cu_shape[1]).enumerate() {
        let cu_seqlens = sample_bounds(bounds, width).map_err(|e| format!("pack {row}: {e}"))?;
        // Each pack's samples follow the previous pack's.
        let first_sample = out.last().map_or(0, |p| p.samples.end);
        let (images, pixel_rows) = images[row].clone();
        let (videos, video_rows) = videos[row].clone();
        out.push(Pack {
            row,
            tokens: *cu_seqlens.last().unwrap() as usize,
            max_seqlen: cu_seqlens
                .windows(2)
                .map(|w| w[1] - w[0])
                .max()
                .unwrap_or(0),
            samples: first_sample..first_sample + cu_seqlens.len() - 1,
            cu_seqlens,
            images,
            pixel_rows,
            videos,
            video_rows,
        });
    }
    let samples = out.last().map_or(0, |p| p.samples.end);
    if samples != batch.sample_ids.len() {
        return Err(format!(
            "packs hold {samples} samples, the batch {}",
            batch.sample_ids.len()
        ));
    }
    Ok(out)
}

/// One kind of media in a packed batch: its per-pack counts, grids and pixel tensors.
struct Media {
    what: &'static str,
    counts: &'static str,
    grid: &'static str,
    pixels: &'static str,
}

impl Media {
    const IMAGES: Media = Media {
        what: "images",
        counts: tensor::PACK_IMAGES,
        grid: tensor::IMAGE_GRID_THW,
        pixels: tensor::PIXEL_VALUES,
    };
    const VIDEOS: Media = Media {
        what: "videos",
        counts: tensor::PACK_VIDEOS,
        grid: tensor::VIDEO_GRID_THW,
        pixels: tensor::PIXEL_VALUES_VIDEOS,
    };
}

/// Each pack's (grid rows, pixel rows) of one kind of media, packs one after another, all of
/// the batch's media in them.
type MediaRanges = Vec<(Range<usize>, Range<usize>)>;

fn media_ranges(batch: &Batch, rows: usize, m: Media) -> std::result::Result<MediaRanges, String> {
    let (counts, _) = ints(batch, m.counts, 1)?;
    let (grid, _) = ints(batch, m.grid, 2)?;
    if counts.len() != rows {
        return Err(format!(
            "input_ids has {rows} rows, {} {}",
            m.counts,
            counts.len()
        ));
    }
    let first_row = pixel_row_starts(&grid, m.grid)?;
    let mut out: MediaRanges = Vec::with_capacity(rows);
    for (row, &n) in counts.iter().enumerate() {
        let first = out.last().map_or(0, |p| p.0.end);
        let items = usize::try_from(n)
            .ok()
            .and_then(|n| first.checked_add(n))
            .filter(|&end| end < first_row.len())
            .map(|end| first..end)
            .ok_or_else(|| {
                let have = grid.len() / 3;
                format!("pack {row}: {n} {}, past {}'s {have}", m.what, m.grid)
            })?;
        let pixels = first_row[items.start]..first_row[items.end];
        out.push((items, pixels));
    }
    let pixel_rows = batch
        .tensor(m.pixels)
        .map_or(0, |t| t.shape.first().copied().unwrap_or(0) as usize);
    let ends = out.last().map_or((0, 0), |p| (p.0.end, p.1.end));
    let want = (grid.len() / 3, pixel_rows);
    if ends != want {
        return Err(format!(
            "packs hold ({}, {} rows) {ends:?}, the batch {want:?}",
            m.grid, m.pixels
        ));
    }
    Ok(out)
}

/// Each image's (video's) first row of its pixel tensor (t·h·w rows each), and the end.
fn pixel_row_starts(grid: &[i64], name: &str) -> std::result::Result<Vec<usize>, String> {
    let mut starts = vec![0usize];
    for thw in grid.chunks_exact(3) {
        let rows = thw.iter().try_fold(1usize, |n, &d| {
            usize::try_from(d).ok().and_then(|d| n.checked_mul(d))
        });
        let end = rows.and_then(|r| starts.last().unwrap().checked_add(r));
        starts.push(end.ok_or_else(|| format!("{name} holds {thw:?}"))?);
    }
    Ok(starts)
}

/// A pack's sample boundaries without the row's padding: they start at 0, rise with every
/// sample, then repeat the pack's length, which fits the row's `width`.
fn sample_bounds(row: &[i64], width: usize) -> std::result::Result<Vec<i32>, String> {
    let samples = row.windows(2).take_while(|w| w[1] > w[0]).count();
    let (bounds, padding) = row.split_at(samples + 1);
    let tokens = bounds[samples];
    if bounds[0] != 0 || padding.iter().any(|&b| b != tokens) || tokens > width as i64 {
        return Err(format!(
            "cu_seqlens {row:?} do not rise from 0 to at most {width} then repeat"
        ));
    }
    Ok(bounds.iter().map(|&b| b as i32).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use stoker_wire::BatchRequest;

    fn le<T: Copy, const N: usize>(values: &[T], bytes: fn(T) -> [u8; N]) -> Vec<u8> {
        values.iter().flat_map(|&v| bytes(v)).collect()
    }

    /// Image pad 9, video pad 10, merged 1x1 (a pad token per patch).
    const MEDIA: MediaTokens = MediaTokens {
        image_token: 9,
        video_token: 10,
        merge_size: 1,
    };

    /// A batch of two packs over a row width of 6: samples of 3 and 2 tokens with images of
    /// 2 and 1 pixel rows (and pad tokens), then one sample of 4 tokens without images.
    fn tensors() -> Vec<(&'static str, DType, Vec<u64>, Vec<u8>)> {
        vec![
            (
                "input_ids",
                DType::I64,
                vec![2, 6],
                le(&[9i64, 9, 1, 9, 1, 0, 1, 1, 1, 1, 0, 0], i64::to_le_bytes),
            ),
            ("pixel_values", DType::U8, vec![3, 4], vec![0; 12]),
            (
                "image_grid_thw",
                DType::I64,
                vec![2, 3],
                le(&[1i64, 1, 2, 1, 1, 1], i64::to_le_bytes),
            ),
            (
                "cu_seqlens",
                DType::I32,
                vec![2, 3],
                le(&[0i32, 3, 5, 0, 4, 4], i32::to_le_bytes),
            ),
            (
                "pack_images",
                DType::I64,
                vec![2],
                le(&[2i64, 0], i64::to_le_bytes),
            ),
            ("position_ids", DType::I64, vec![4, 2, 6], vec![0; 384]),
        ]
    }

    fn batch(samples: u64, tensors: &[(&str, DType, Vec<u64>, Vec<u8>)]) -> Result<Batch, String> {
        checked(samples, tensors).map_err(|(_, why)| why)
    }

    fn checked(
        samples: u64,
        tensors: &[(&str, DType, Vec<u64>, Vec<u8>)],
    ) -> Result<Batch, (RejectReason, String)> {
        let mut payload = Vec::new();
        let mut metas = Vec::new();
        for (name, dtype, shape, bytes) in tensors {
            payload.resize(payload.len().next_multiple_of(8), 0);
            metas.push(TensorMeta {
                name: name.to_string(),
                dtype: *dtype,
                shape: shape.clone(),
                offset: payload.len() as u64,
                nbytes: bytes.len() as u64,
            });
            payload.extend_from_slice(bytes);
        }
        let mut buf = AlignedBuf::zeroed(payload.len());
        buf.as_mut_slice().copy_from_slice(&payload);
        let head = BatchHead {
            request: BatchRequest {
                request_id: 1,
                plan_id: 1,
                epoch: 0,
                global_batch: 0,
                rank: 0,
                world_size: 1,
            },
            sample_ids: (0..samples).collect(),
            skipped: Vec::new(),
            tensors: metas,
            payload_len: payload.len() as u64,
        };
        Batch::new(head, buf, "w".into(), &MEDIA)
    }

    #[test]
    fn packs_locate_their_samples_tokens_and_images() {
        let packs = batch(3, &tensors()).unwrap().packs.unwrap();
        assert_eq!(
            packs,
            [
                Pack {
                    row: 0,
                    tokens: 5,
                    cu_seqlens: vec![0, 3, 5],
                    max_seqlen: 3,
                    samples: 0..2,
                    images: 0..2,
                    pixel_rows: 0..3,
                    videos: 0..0,
                    video_rows: 0..0,
                },
                Pack {
                    row: 1,
                    tokens: 4,
                    cu_seqlens: vec![0, 4],
                    max_seqlen: 4,
                    samples: 2..3,
                    images: 2..2,
                    pixel_rows: 3..3,
                    videos: 0..0,
                    video_rows: 0..0,
                },
            ]
        );
    }

    #[test]
    fn a_plain_batch_has_no_packs() {
        let plain: Vec<_> = tensors().into_iter().take(3).collect();
        assert_eq!(batch(2, &plain).unwrap().packs, None);
    }

    /// A forged or buggy batch whose media disagree with its pad tokens never reaches the
    /// model: packed or plain, the client names the row and the counts.
    #[test]
    fn media_that_disagree_with_their_pad_tokens_are_refused_by_name() {
        let i64s = |v: &[i64]| le(v, i64::to_le_bytes);
        let refused = |samples, tensors: &[(&str, DType, Vec<u64>, Vec<u8>)]| {
            let (reason, why) = checked(samples, tensors).err().expect("refused");
            assert_eq!(reason, RejectReason::MediaMismatch, "{why}");
            why
        };
        // One pad token more in pack 0.
        let mut one_more = tensors();
        one_more[0].3 = i64s(&[9, 9, 9, 9, 1, 0, 1, 1, 1, 1, 0, 0]);
        assert!(refused(3, &one_more)
            .contains("media and tokens disagree: row 0 holds 4 image pad tokens, its images 3"));
        // A plain batch missing its second grid row (and its pixel row).
        let mut missing = tensors()[..3].to_vec();
        missing[1].2 = vec![2, 4];
        missing[1].3 = vec![0; 8];
        missing[2].2 = vec![1, 3];
        missing[2].3 = i64s(&[1, 1, 2]);
        assert!(refused(2, &missing).contains("row 0 holds 3 image pad tokens, its images 2"));
        // Pixel rows that are not the grids' patches; a grid that is not [n, 3].
        let mut pixels = tensors()[..3].to_vec();
        pixels[1].2 = vec![4, 3];
        assert!(refused(2, &pixels).contains("pixel_values has 4 rows, image_grid_thw 3"));
        let mut flat = tensors()[..3].to_vec();
        flat[2].2 = vec![3, 2];
        assert!(refused(2, &flat).contains("image_grid_thw has shape [3, 2], not [n, 3]"));
        // Media without any input_ids; rows that are not the samples.
        assert!(refused(2, &tensors()[1..3]).contains("pixel_values without input_ids"));
        assert!(refused(3, &tensors()[..3]).contains("input_ids has 2 rows for 3 samples"));
        // A packed layout that does not fit is named as such.
        let mut cut = tensors();
        cut[3].2 = vec![1, 3];
        let (reason, _) = checked(3, &cut).err().unwrap();
        assert_eq!(reason, RejectReason::MalformedLayout);
    }

    #[test]
    fn a_layout_that_does_not_fit_its_tensors_is_refused_with_the_reason() {
        let with = |name: &str, shape: Vec<u64>, bytes: Vec<u8>| {
            let mut t = tensors();
            let at = t.iter().position(|t| t.0 == name).unwrap();
            t[at].2 = shape;
            t[at].3 = bytes;
            t
        };
        let i32s = |v: &[i32]| le(v, i32::to_le_bytes);
        let i64s = |v: &[i64]| le(v, i64::to_le_bytes);
        let mut float_bounds = tensors();
        float_bounds[3].1 = DType::F32;
        let cases = [
            (
                3,
                with("cu_seqlens", vec![2, 3], i32s(&[0, 3, 7, 0, 4, 4])),
                "at most 6",
            ),
            (
                3,
                with("cu_seqlens", vec![2, 3], i32s(&[1, 3, 5, 0, 4, 4])),
                "rise from 0",
            ),
            (
                3,
                with("cu_seqlens", vec![2, 3], i32s(&[0, 0, 5, 0, 4, 4])),
                "then repeat",
            ),
            (
                3,
                with("cu_seqlens", vec![1, 3], i32s(&[0, 3, 5])),
                "cu_seqlens shape",
            ),
            (4, tensors(), "packs hold 3 samples, the batch 4"),
            (
                3,
                with("pack_images", vec![2], i64s(&[2, 1])),
                "past image_grid_thw",
            ),
            (3, with("pack_images", vec![2], i64s(&[-1, 3])), "-1 images"),
            (
                3,
                with("pack_images", vec![2], i64s(&[1, 0])),
                "packs hold (image_grid_thw, pixel_values rows)",
            ),
            (
                3,
                with("image_grid_thw", vec![2, 3], i64s(&[1, 2, 2, 1, -1, 2])),
                "image_grid_thw holds",
            ),
            (3, float_bounds, "not an integer tensor"),
            (
                3,
                with("position_ids", vec![4, 1, 6], vec![0; 192]),
                "position_ids has shape",
            ),
        ];
        for (samples, tensors, want) in cases {
            let why = batch(samples, &tensors).err().expect(want);
            assert!(why.contains(want), "{why:?} should say {want:?}");
        }
    }
}
