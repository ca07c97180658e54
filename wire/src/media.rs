//! What makes a batch's media agree with its tokens: checked by the worker before it sends a
//! batch and by the client before it delivers one, so that a model's forward never meets
//! pixels without their placeholder tokens, tokens without their pixels, or grids that point
//! past `pixel_values` (at best an exception deep in the rope index, at worst a silent
//! misalignment of pixels and text).

/// How a plan's media become tokens (the Welcome carries it): an image or video of grid
/// (t, h, w) has t·h·w rows of pixels and t·h·w / merge² placeholder tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediaTokens {
    /// `<|image_pad|>`'s id.
    pub image_token: u32,
    /// `<|video_pad|>`'s id.
    pub video_token: u32,
    /// The spatial merge size (2 for every Qwen-VL).
    pub merge_size: u32,
}

/// A batch's `input_ids`, as the worker holds them or as they arrive.
#[derive(Clone, Copy)]
pub enum Ids<'a> {
    Values(&'a [i64]),
    /// Little-endian int64.
    Bytes(&'a [u8]),
}

impl Ids<'_> {
    fn len(&self) -> usize {
        match self {
            Ids::Values(v) => v.len(),
            Ids::Bytes(b) => b.len() / 8,
        }
    }

    fn whole(&self) -> bool {
        match self {
            Ids::Values(_) => true,
            Ids::Bytes(b) => b.len().is_multiple_of(8),
        }
    }

    /// How many of ids `range` are `token`.
    fn count(&self, range: std::ops::Range<usize>, token: i64) -> u64 {
        match self {
            Ids::Values(v) => v[range].iter().filter(|&&id| id == token).count() as u64,
            Ids::Bytes(b) => {
                let token = token.to_le_bytes();
                (b[range.start * 8..range.end * 8].chunks_exact(8))
                    .filter(|id| *id == token)
                    .count() as u64
            }
        }
    }
}

/// One kind of media in a batch: its grids ((t, h, w) each, in row order), the rows of its
/// pixel tensor, and for a packed batch how many belong to each row.
#[derive(Clone, Copy, Default)]
pub struct MediaGrids<'a> {
    pub grid: &'a [i64],
    pub pixel_rows: u64,
    pub per_row: Option<&'a [i64]>,
}

/// What [`MediaTokens::check`] reads of a batch.
pub struct BatchMedia<'a> {
    /// `[rows, L]`.
    pub input_ids: Ids<'a>,
    pub rows: usize,
    pub images: MediaGrids<'a>,
    pub videos: MediaGrids<'a>,
    /// Entries of `second_per_grid_ts`, when the batch has the tensor.
    pub second_per_grid_ts: Option<u64>,
}

/// A grid dimension past this is no image or clip a processor makes (and keeps the products
/// far from overflowing).
const MAX_GRID_DIM: i64 = 1 << 20;

struct Kind {
    name: &'static str,
    grid: &'static str,
    pixels: &'static str,
    token: i64,
}

impl MediaTokens {
    /// Checks that every row's image and video pad tokens are exactly those of its own
    /// media, taken in order (a packed row: the `per_row` count of them; a plain row, one
    /// sample: those whose tokens add up to the row's count), that pixel rows equal the
    /// grids' patches, and that `second_per_grid_ts` has one entry per video. The error
    /// names the first disagreement.
    pub fn check(&self, b: &BatchMedia) -> Result<(), String> {
        if !b.input_ids.whole() || (b.rows == 0 && b.input_ids.len() > 0) {
            return Err(format!(
                "input_ids of {} ids in {} rows",
                b.input_ids.len(),
                b.rows
            ));
        }
        let width = b.input_ids.len().checked_div(b.rows).unwrap_or(0);
        if width * b.rows != b.input_ids.len() {
            return Err(format!(
                "input_ids of {} ids in {} rows",
                b.input_ids.len(),
                b.rows
            ));
        }
        let kinds = [
            (
                Kind {
                    name: "image",
                    grid: crate::tensor::IMAGE_GRID_THW,
                    pixels: crate::tensor::PIXEL_VALUES,
                    token: self.image_token.into(),
                },
                &b.images,
            ),
            (
                Kind {
                    name: "video",
                    grid: crate::tensor::VIDEO_GRID_THW,
                    pixels: crate::tensor::PIXEL_VALUES_VIDEOS,
                    token: self.video_token.into(),
                },
                &b.videos,
            ),
        ];
        for (kind, media) in kinds {
            self.check_kind(&kind, media, b.input_ids, b.rows, width)?;
        }
        let videos = (b.videos.grid.len() / 3) as u64;
        match b.second_per_grid_ts {
            Some(n) if n != videos => Err(format!(
                "second_per_grid_ts has {n} entries for {videos} videos"
            )),
            _ => Ok(()),
        }
    }

    fn check_kind(
        &self,
        kind: &Kind,
        media: &MediaGrids,
        ids: Ids,
        rows: usize,
        width: usize,
    ) -> Result<(), String> {
        let grid = media.grid;
        if !grid.len().is_multiple_of(3) {
            return Err(format!("{} of {} values", kind.grid, grid.len()));
        }
        let merge = i64::from(self.merge_size);
        let mut tokens = Vec::with_capacity(grid.len() / 3);
        let mut pixels = 0u64;
        for (i, thw) in grid.chunks_exact(3).enumerate() {
            let whole = merge > 0
                && thw.iter().all(|&d| d > 0 && d <= MAX_GRID_DIM)
                && thw[1] % merge == 0
                && thw[2] % merge == 0;
            if !whole {
                return Err(format!(
                    "{} {i}: grid {thw:?} is not whole {merge}x{merge} merges",
                    kind.name
                ));
            }
            let patches = (thw[0] * thw[1] * thw[2]) as u64;
            pixels = pixels.saturating_add(patches);
            tokens.push(patches / (merge * merge) as u64);
        }
        if pixels != media.pixel_rows {
            return Err(format!(
                "{} has {} rows, {} {pixels}",
                kind.pixels, media.pixel_rows, kind.grid
            ));
        }
        if let Some(per_row) = media.per_row {
            if per_row.len() != rows {
                return Err(format!("{} per-row counts for {rows} rows", per_row.len()));
            }
        }
        let mut items = tokens.iter();
        for row in 0..rows {
            let have = ids.count(row * width..(row + 1) * width, kind.token);
            let want: u64 = match media.per_row.map(|p| p[row]) {
                Some(n) => {
                    let n =
                        usize::try_from(n).map_err(|_| format!("row {row}: {n} {}s", kind.name))?;
                    let taken: Vec<u64> = items.by_ref().take(n).copied().collect();
                    if taken.len() < n {
                        return Err(format!(
                            "row {row}: {n} {}s, past {}'s {}",
                            kind.name,
                            kind.grid,
                            tokens.len()
                        ));
                    }
                    taken.iter().fold(0u64, |a, &n| a.saturating_add(n))
                }
                None => {
                    let mut sum = 0;
                    while sum < have {
                        let Some(n) = items.next() else { break };
                        sum = n.saturating_add(sum);
                    }
                    sum
                }
            };
            if have != want {
                return Err(format!(
                    "row {row} holds {have} {} pad tokens, its {}s {want}",
                    kind.name, kind.name
                ));
            }
        }
        match items.len() {
            0 => Ok(()),
            left => Err(format!(
                "{left} {}s of {} have no pad tokens in any row",
                kind.name, kind.grid
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKENS: MediaTokens = MediaTokens {
        image_token: 7,
        video_token: 8,
        merge_size: 2,
    };

    fn check(
        ids: &[i64],
        rows: usize,
        images: MediaGrids,
        videos: MediaGrids,
        seconds: Option<u64>,
    ) -> Result<(), String> {
        let bytes: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
        let by_value = TOKENS.check(&BatchMedia {
            input_ids: Ids::Values(ids),
            rows,
            images,
            videos,
            second_per_grid_ts: seconds,
        });
        let by_bytes = TOKENS.check(&BatchMedia {
            input_ids: Ids::Bytes(&bytes),
            rows,
            images,
            videos,
            second_per_grid_ts: seconds,
        });
        assert_eq!(by_value, by_bytes, "the two forms of input_ids agree");
        by_value
    }

    fn media<'a>(grid: &'a [i64], pixel_rows: u64) -> MediaGrids<'a> {
        MediaGrids {
            grid,
            pixel_rows,
            per_row: None,
        }
    }

    // Row 0: an image of 1x2x4 (2 tokens); row 1: images of 1x2x2 and 1x4x2 (1 + 2) and a
    // video of 2x2x2 (2 tokens).
    const GRID: [i64; 9] = [1, 2, 4, 1, 2, 2, 1, 4, 2];
    const VIDEO: [i64; 3] = [2, 2, 2];
    const IDS: [i64; 12] = [1, 7, 7, 0, 0, 0, 7, 7, 7, 8, 8, 0];

    #[test]
    fn plain_and_packed_rows_whose_tokens_match_their_media_pass() {
        let (images, videos) = (media(&GRID, 20), media(&VIDEO, 8));
        assert_eq!(check(&IDS, 2, images, videos, None), Ok(()));
        assert_eq!(check(&IDS, 2, images, videos, Some(1)), Ok(()));
        let packed = |per_image: &'static [i64], per_video: &'static [i64]| {
            let images = MediaGrids {
                per_row: Some(per_image),
                ..images
            };
            let videos = MediaGrids {
                per_row: Some(per_video),
                ..videos
            };
            check(&IDS, 2, images, videos, None)
        };
        assert_eq!(packed(&[1, 2], &[0, 1]), Ok(()));
        assert!(packed(&[2, 1], &[0, 1])
            .unwrap_err()
            .contains("row 0 holds 2 image pad tokens, its images 3"));
        assert!(packed(&[1, 2], &[1, 0])
            .unwrap_err()
            .contains("row 0 holds 0 video pad tokens, its videos 2"));
        assert!(packed(&[1, 3], &[0, 1])
            .unwrap_err()
            .contains("past image_grid_thw's 3"));
        // Text only: no media, no pad tokens.
        let text = [1, 2, 3, 0];
        assert_eq!(
            check(&text, 2, MediaGrids::default(), MediaGrids::default(), None),
            Ok(())
        );
    }

    #[test]
    fn every_disagreement_is_named() {
        let (images, videos) = (media(&GRID, 20), media(&VIDEO, 8));
        let err = |ids: &[i64], images, videos, seconds| {
            check(ids, 2, images, videos, seconds).unwrap_err()
        };
        // A pad token off by one (a plain row takes images until its count is reached: one
        // more in row 0 takes row 1's first image, and row 1 comes up short).
        let mut one_more = IDS;
        one_more[3] = 7;
        assert!(err(&one_more, images, videos, None)
            .contains("row 1 holds 3 image pad tokens, its images 2"));
        let mut one_less = IDS;
        one_less[2] = 1;
        assert!(err(&one_less, images, videos, None).contains("row 0 holds 1 image pad tokens"));
        // A grid row missing, or one too many.
        assert!(err(&IDS, media(&GRID[..6], 12), videos, None)
            .contains("row 1 holds 3 image pad tokens, its images 1"));
        let extra = [1, 2, 4, 1, 2, 2, 1, 4, 2, 1, 2, 2];
        assert!(err(&IDS, media(&extra, 24), videos, None)
            .contains("1 images of image_grid_thw have no pad tokens"));
        // Pixel rows that are not the grids' patches.
        assert!(err(&IDS, media(&GRID, 19), videos, None)
            .contains("pixel_values has 19 rows, image_grid_thw 20"));
        assert!(err(&IDS, images, media(&VIDEO, 9), None)
            .contains("pixel_values_videos has 9 rows, video_grid_thw 8"));
        // Grids that are not whole merges, or absurd.
        assert!(
            err(&IDS, media(&[1, 3, 4, 1, 2, 2, 1, 4, 2], 24), videos, None)
                .contains("image 0: grid [1, 3, 4] is not whole 2x2 merges")
        );
        assert!(
            err(&IDS, media(&[1, 2, -4, 1, 2, 2, 1, 4, 2], 0), videos, None)
                .contains("is not whole")
        );
        // A video without its tokens; one timestamp entry too many.
        let no_video = [1, 7, 7, 0, 0, 0, 7, 7, 7, 1, 1, 0];
        assert!(err(&no_video, images, videos, None)
            .contains("1 videos of video_grid_thw have no pad tokens"));
        assert!(err(&IDS, images, videos, Some(2))
            .contains("second_per_grid_ts has 2 entries for 1 videos"));
        // Ids that are not rows.
        assert!(check(&IDS[..11], 2, images, videos, None)
            .unwrap_err()
            .contains("input_ids of 11 ids in 2 rows"));
    }
}
