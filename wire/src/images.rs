//! What makes a batch's images agree with its tokens: checked by the worker before it sends a
//! batch and by the client before it delivers one, so a model's forward never meets pixels
//! without their placeholder tokens (or tokens without their pixels).

/// How a plan's images turn into tokens: each image of grid (t, h, w) has t·h·w rows of
/// `pixel_values` and t·h·w / merge² placeholder tokens `image_token`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageTokens {
    pub image_token: u32,
    /// The spatial merge size (2 for every Qwen-VL); 0 for a plan without images.
    pub merge_size: u32,
}

impl ImageTokens {
    /// Checks a batch: `input_ids` as little-endian int64 bytes of `rows` rows, the images'
    /// `grid` ((t, h, w) each, in row order), the rows of `pixel_values`, and for a packed
    /// batch the images of each row (`pack_images`). Every row's placeholder tokens must be
    /// the tokens of its own images, taken in order: for a plain batch (a row is one sample)
    /// the images whose tokens add up to the row's count exactly.
    pub fn check(
        &self,
        input_ids: &[u8],
        rows: usize,
        grid: &[i64],
        pixel_rows: u64,
        pack_images: Option<&[i64]>,
    ) -> Result<(), String> {
        if !grid.len().is_multiple_of(3) {
            return Err(format!("image_grid_thw of {} values", grid.len()));
        }
        let mut tokens = Vec::with_capacity(grid.len() / 3);
        let mut pixels = 0u64;
        for (i, thw) in grid.chunks_exact(3).enumerate() {
            let merge = i64::from(self.merge_size);
            let fits = thw.iter().all(|&d| d > 0 && d <= 1 << 20)
                && merge > 0
                && thw[1] % merge == 0
                && thw[2] % merge == 0;
            if !fits {
                return Err(format!(
                    "image {i}: grid {thw:?} is not whole {merge}×{merge} merges"
                ));
            }
            let n = (thw[0] * thw[1] * thw[2]) as u64;
            pixels += n;
            tokens.push(n / (merge * merge) as u64);
        }
        if pixels != pixel_rows {
            return Err(format!(
                "pixel_values has {pixel_rows} rows, the grids {pixels}"
            ));
        }
        let width = input_ids.len().checked_div(rows * 8).unwrap_or_default();
        if width * rows * 8 != input_ids.len() {
            return Err(format!(
                "input_ids of {} bytes in {rows} rows",
                input_ids.len()
            ));
        }
        let token = i64::from(self.image_token).to_le_bytes();
        let mut images = tokens.iter();
        for row in 0..rows {
            let ids = &input_ids[row * width * 8..(row + 1) * width * 8];
            let have = ids.chunks_exact(8).filter(|id| *id == token).count() as u64;
            let want: u64 = match pack_images.map(|p| p.get(row)) {
                Some(Some(&n)) => images.by_ref().take(n.max(0) as usize).sum(),
                Some(None) => return Err(format!("pack_images has no row {row}")),
                None => {
                    let mut sum = 0;
                    while sum < have {
                        let Some(n) = images.next() else { break };
                        sum += n;
                    }
                    sum
                }
            };
            if have != want {
                return Err(format!(
                    "row {row} holds {have} image tokens, its images {want}"
                ));
            }
        }
        match images.len() {
            0 => Ok(()),
            left => Err(format!("{left} images have no tokens in any row")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAD: u32 = 7;
    const LAYOUT: ImageTokens = ImageTokens {
        image_token: PAD,
        merge_size: 2,
    };

    fn ids(rows: &[&[i64]]) -> Vec<u8> {
        rows.iter()
            .flat_map(|r| r.iter().flat_map(|v| v.to_le_bytes()))
            .collect()
    }

    #[test]
    fn tokens_that_match_their_images_pass_and_every_mismatch_is_named() {
        // Row 0: one image of 1×2×4 (2 tokens); row 1: images of 1×2×2 and 1×4×2 (1 + 2).
        let grid = [1, 2, 4, 1, 2, 2, 1, 4, 2];
        let good = ids(&[&[1, 7, 7, 0], &[7, 7, 7, 0]]);
        assert_eq!(LAYOUT.check(&good, 2, &grid, 20, None), Ok(()));
        assert_eq!(LAYOUT.check(&good, 2, &grid, 20, Some(&[1, 2])), Ok(()));
        let err = |ids: &[u8], grid: &[i64], pixels, packs| {
            LAYOUT.check(ids, 2, grid, pixels, packs).unwrap_err()
        };
        // The literal-token case: a row keeps its image's grid but none of its tokens.
        let cut = ids(&[&[1, 2, 3, 0], &[7, 7, 7, 0]]);
        assert!(err(&cut, &grid, 20, None).contains("row 0 holds 0 image tokens, its images 2"));
        assert!(err(&good, &grid, 19, None).contains("pixel_values has 19 rows"));
        assert!(err(&good, &grid[..6], 12, None).contains("row 1 holds 3 image tokens"));
        assert!(err(&good, &[1, 3, 4, 1, 2, 2, 1, 4, 2], 24, None).contains("not whole"));
        assert!(err(&good, &grid, 20, Some(&[2, 1]))
            .contains("row 0 holds 2 image tokens, its images 3"));
        let extra = [1, 2, 4, 1, 2, 2, 1, 4, 2, 1, 2, 2];
        assert!(err(&good, &extra, 24, None).contains("1 images have no tokens"));
    }
}
