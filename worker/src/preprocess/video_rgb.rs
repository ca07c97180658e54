//! Decoded frames → upright packed RGB24, the pixels PyAV's `to_ndarray(format="rgb24")` gives.
//!
//! PyAV converts with the swscale of the FFmpeg it bundles (8.1); the worker links Debian's
//! (5.1). Both take swscale's unscaled YUV → RGB converter for 4:2:0 frames of even height, and
//! the same code for other formats and sizes, so those frames are equal. A 4:2:0 frame of odd
//! height goes through swscale's scaler instead, which interpolates each RGB row's chroma between
//! two chroma rows: 8.1 weighs them as its bilinear filter says, 5.1 rounds the weight to 0 or ½
//! (it averages the two rows wherever the second weighs at least half) — up to 60 levels apart.
//! For those frames the chroma rows are interpolated here, with swscale's own filter and
//! rounding ([`ChromaRows`]), into a 4:2:2 frame that swscale then converts with no vertical
//! interpolation, through the same tables: PyAV's pixels.

use super::video_error::VideoError;
use super::vision::Rgb;
use ffmpeg_next as ff;

fn failed(e: ff::Error) -> VideoError {
    VideoError::Corrupt(format!("converting to RGB: {e}"))
}

/// What a conversion is made for: the format swscale reads, the size, colour matrix and range.
type ScalerKey = (ff::format::Pixel, u32, u32, i32, i32);

/// YUV (or any pixel format) → packed RGB24 at the frame's own size, as PyAV converts: swscale,
/// bilinear, the frame's colour matrix (BT.601 when it names none) and range, full-range output.
#[derive(Default)]
pub(super) struct Converter {
    scaler: Option<(ff::software::scaling::Context, ScalerKey)>,
    rgb: Option<ff::frame::Video>,
    /// The 4:2:2 frame odd-height 4:2:0 frames are made into, and its chroma filter.
    upsampled: Option<(ff::frame::Video, ChromaRows)>,
}

impl Converter {
    pub(super) fn rgb(
        &mut self,
        frame: &ff::frame::Video,
        rotation: u16,
    ) -> Result<Rgb, VideoError> {
        let (w, h) = (frame.width(), frame.height());
        // SAFETY: plain fields of a decoded frame.
        let (space, range) = unsafe {
            let p = frame.as_ptr();
            ((*p).colorspace as i32, (*p).color_range as i32)
        };
        let input = match upsampled_format(frame.format(), h) {
            Some(format) => upsample(&mut self.upsampled, frame, format),
            None => frame,
        };
        let key = (input.format(), w, h, space, range);
        if self.scaler.as_ref().map(|(_, k)| *k) != Some(key) {
            let mut ctx = ff::software::scaling::Context::get(
                input.format(),
                w,
                h,
                ff::format::Pixel::RGB24,
                w,
                h,
                ff::software::scaling::Flags::BILINEAR,
            )
            .map_err(failed)?;
            set_colorspace(&mut ctx, space, range);
            self.scaler = Some((ctx, key));
            self.rgb = Some(ff::frame::Video::new(ff::format::Pixel::RGB24, w, h));
        }
        let (scaler, _) = self.scaler.as_mut().expect("set above");
        let out = self.rgb.as_mut().expect("set with the scaler");
        scaler.run(input, out).map_err(failed)?;
        let (w, h) = (w as usize, h as usize);
        let stride = out.stride(0);
        let plane = out.data(0);
        let mut data = Vec::with_capacity(w * h * 3);
        for y in 0..h {
            data.extend_from_slice(&plane[y * stride..y * stride + w * 3]);
        }
        Ok(rotate(
            Rgb {
                width: w,
                height: h,
                data,
            },
            rotation,
        ))
    }
}

/// `frame` (4:2:0, 8 bits) as the 4:2:2 `format` frame whose chroma rows are the ones swscale
/// 8.1 interpolates for each row, made in `slot` (kept for the clip's next frames).
fn upsample<'a>(
    slot: &'a mut Option<(ff::frame::Video, ChromaRows)>,
    frame: &ff::frame::Video,
    format: ff::format::Pixel,
) -> &'a ff::frame::Video {
    let (w, h) = (frame.width(), frame.height());
    let fits = slot
        .as_ref()
        .is_some_and(|(out, _)| (out.format(), out.width(), out.height()) == (format, w, h));
    if !fits {
        let rows = ChromaRows::new(h.div_ceil(2) as usize, h as usize);
        *slot = Some((ff::frame::Video::new(format, w, h), rows));
    }
    let (out, rows) = slot.as_mut().expect("set above");
    let (w, h) = (w as usize, h as usize);
    let stride = (frame.stride(0), out.stride(0));
    for y in 0..h {
        out.data_mut(0)[y * stride.1..][..w].copy_from_slice(&frame.data(0)[y * stride.0..][..w]);
    }
    let cw = w.div_ceil(2);
    for plane in 1..3 {
        let stride = (frame.stride(plane), out.stride(plane));
        let src = frame.data(plane);
        let dst = out.data_mut(plane);
        for y in 0..h {
            rows.row(
                y,
                |r| &src[r * stride.0..][..cw],
                &mut dst[y * stride.1..][..cw],
            );
        }
    }
    out
}

/// The 4:2:2 format an 8-bit 4:2:0 frame of odd height is converted through, else `None`.
fn upsampled_format(format: ff::format::Pixel, height: u32) -> Option<ff::format::Pixel> {
    use ff::format::Pixel;
    match format {
        _ if height.is_multiple_of(2) => None,
        Pixel::YUV420P => Some(Pixel::YUV422P),
        Pixel::YUVJ420P => Some(Pixel::YUVJ422P),
        _ => None,
    }
}

/// swscale's vertical chroma filter for `src` chroma rows shown on `dst` rows: libswscale's
/// `initFilter` for SWS_BILINEAR with centre siting (a frame naming no chroma location, as
/// PyAV's swscale reads it), its trimming, edge folding and normalisation to weights in 1/4096,
/// then each row rounded as 8.1's RGB output rounds it, `(Σ row·weight + 2048) >> 12`.
struct ChromaRows {
    /// Per output row: its first source row.
    first: Vec<usize>,
    /// Per output row, `taps` weights summing to 4096.
    weights: Vec<i64>,
    taps: usize,
}

impl ChromaRows {
    fn new(src: usize, dst: usize) -> ChromaRows {
        let (src_n, dst_n) = (src as i64, dst as i64);
        let x_inc = ((src_n << 16) + (dst_n >> 1)) / dst_n;
        // The filter's unit: 1 << (54 - log2(src / dst)), and src < dst here.
        let one: i64 = 1 << 54;
        // Bilinear: 2 taps either side of the centre, at most src - 2 (at least 1).
        let taps = (if x_inc <= 1 << 16 {
            3
        } else {
            1 + (2 * src_n + dst_n - 1) / dst_n
        })
        .min(src_n - 2)
        .max(1) as usize;
        // Centre siting of source and destination: 128 / 256 of a row past their left edge.
        let (src_pos, dst_pos) = (128i64, 128i64);
        let mut x = ((dst_pos * x_inc) >> 7) - ((src_pos * 0x10000) >> 7);
        let mut first = vec![0i64; dst];
        let mut filter = vec![0i64; dst * taps];
        for i in 0..dst {
            // C's division: toward zero.
            first[i] = (x - (taps as i64 - 2) * (1 << 16)) / (1 << 17);
            for j in 0..taps {
                let d = (((first[i] + j as i64) * (1 << 17)) - x).abs() << 13;
                filter[i * taps + j] = ((1i64 << 30) - d).max(0) * (one >> 30);
            }
            x += 2 * x_inc;
        }
        // Trim near-zero taps: shift left while the dropped ones stay under the cutoff, then
        // count those on the right.
        let cutoff = 0.002 * one as f64;
        let mut kept = 0;
        for i in (0..dst).rev() {
            let row = &mut filter[i * taps..(i + 1) * taps];
            let mut cut = 0i64;
            for _ in 0..taps {
                cut += row[0].abs();
                if cut as f64 > cutoff || (i < dst - 1 && first[i] >= first[i + 1]) {
                    break;
                }
                row.rotate_left(1);
                row[taps - 1] = 0;
                first[i] += 1;
            }
            let (mut size, mut cut) = (taps, 0i64);
            for j in (1..taps).rev() {
                cut += row[j].abs();
                if cut as f64 > cutoff {
                    break;
                }
                size -= 1;
            }
            kept = kept.max(size);
        }
        // (swscale aligns the size to 2 on x86 and Arm, but not a size of 1: bilinear keeps at
        // most 2 taps, so the alignment never changes a weight.)
        let mut weights = vec![0i64; dst * kept];
        for i in 0..dst {
            let row = &mut weights[i * kept..(i + 1) * kept];
            row.copy_from_slice(&filter[i * taps..i * taps + kept]);
            // Fold taps before the first row and past the last onto the edge rows.
            if first[i] < 0 {
                for j in 1..kept {
                    let left = (j as i64 + first[i]).max(0) as usize;
                    let v = row[j];
                    row[j] = 0;
                    row[left] += v;
                }
                first[i] = 0;
            }
            if first[i] + kept as i64 > src_n {
                let shift = first[i] + (kept as i64 - src_n).min(0);
                let mut acc = 0;
                for j in (0..kept).rev() {
                    if first[i] + j as i64 >= src_n {
                        acc += row[j];
                        row[j] = 0;
                    }
                }
                for j in (0..kept).rev() {
                    row[j] = if (j as i64) < shift {
                        0
                    } else {
                        row[j - shift as usize]
                    };
                }
                first[i] -= shift;
                row[(src_n - 1 - first[i]) as usize] += acc;
            }
            // Normalise to 4096, carrying each tap's rounding error to the next.
            let sum = ((row.iter().sum::<i64>() + 2048) / 4096).max(1);
            let mut error = 0;
            for w in row.iter_mut() {
                let v = *w + error;
                let rounded = if v >= 0 { v + sum / 2 } else { v - sum / 2 } / sum;
                *w = rounded;
                error = v - rounded * sum;
            }
        }
        ChromaRows {
            first: first.into_iter().map(|f| f as usize).collect(),
            weights,
            taps: kept,
        }
    }

    /// Writes output row `y` into `out` from the source rows `row(r)` gives.
    fn row<'a>(&self, y: usize, row: impl Fn(usize) -> &'a [u8], out: &mut [u8]) {
        let weights = &self.weights[y * self.taps..(y + 1) * self.taps];
        let rows: Vec<(&[u8], i64)> = weights
            .iter()
            .enumerate()
            .filter(|(_, w)| **w != 0)
            .map(|(j, w)| (row(self.first[y] + j), *w))
            .collect();
        for (x, o) in out.iter_mut().enumerate() {
            let acc: i64 = rows.iter().map(|(r, w)| i64::from(r[x]) * w).sum();
            *o = ((acc + 2048) >> 12).clamp(0, 255) as u8;
        }
    }
}

/// The colour matrix and input range of a conversion, from the frame's own (as PyAV does).
fn set_colorspace(ctx: &mut ff::software::scaling::Context, space: i32, range: i32) {
    use ff::ffi::*;
    let sws_space = match space {
        x if x == AVColorSpace::AVCOL_SPC_BT709 as i32 => SWS_CS_ITU709,
        x if x == AVColorSpace::AVCOL_SPC_FCC as i32 => SWS_CS_FCC,
        x if x == AVColorSpace::AVCOL_SPC_SMPTE240M as i32 => SWS_CS_SMPTE240M,
        x if x == AVColorSpace::AVCOL_SPC_BT2020_NCL as i32
            || x == AVColorSpace::AVCOL_SPC_BT2020_CL as i32 =>
        {
            SWS_CS_BT2020
        }
        _ => SWS_CS_DEFAULT,
    };
    let full = i32::from(range == AVColorRange::AVCOL_RANGE_JPEG as i32);
    // SAFETY: the context is valid; the coefficient tables are static.
    unsafe {
        let table = sws_getCoefficients(sws_space);
        let dst = sws_getCoefficients(SWS_CS_DEFAULT);
        sws_setColorspaceDetails(ctx.as_mut_ptr(), table, full, dst, 1, 0, 1 << 16, 1 << 16);
    }
}

/// `rgb` turned clockwise by `degrees` (a multiple of 90).
fn rotate(rgb: Rgb, degrees: u16) -> Rgb {
    let (w, h) = (rgb.width, rgb.height);
    let (nw, nh) = match degrees {
        90 | 270 => (h, w),
        180 => (w, h),
        _ => return rgb,
    };
    let mut data = vec![0u8; w * h * 3];
    for y in 0..h {
        for x in 0..w {
            let (nx, ny) = match degrees {
                90 => (h - 1 - y, x),
                180 => (w - 1 - x, h - 1 - y),
                _ => (y, w - 1 - x),
            };
            let (s, d) = ((y * w + x) * 3, (ny * nw + nx) * 3);
            data[d..d + 3].copy_from_slice(&rgb.data[s..s + 3]);
        }
    }
    Rgb {
        width: nw,
        height: nh,
        data,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(src: usize, dst: usize) -> Vec<(usize, Vec<i64>)> {
        let f = ChromaRows::new(src, dst);
        (0..dst)
            .map(|y| (f.first[y], f.weights[y * f.taps..(y + 1) * f.taps].to_vec()))
            .collect()
    }

    #[test]
    fn chroma_rows_are_swscales_bilinear_weights() {
        // 7 rows from 4 (PyAV's weights for a 7-row frame, read back from its pixels).
        let want: Vec<(usize, Vec<i64>)> = vec![
            (0, vec![4096, 0]),
            (0, vec![2633, 1463]),
            (0, vec![293, 3803]),
            (1, vec![2048, 2048]),
            (2, vec![3803, 293]),
            (2, vec![1463, 2633]),
            (2, vec![0, 4096]),
        ];
        assert_eq!(rows(4, 7), want);
        // Every row's weights sum to one and stay within the source rows, whatever the size.
        for dst in (1..200usize).step_by(2) {
            let src = dst.div_ceil(2);
            for (first, w) in rows(src, dst) {
                assert_eq!(w.iter().sum::<i64>(), 4096, "{dst} rows");
                assert!(w
                    .iter()
                    .enumerate()
                    .all(|(j, w)| *w == 0 || first + j < src));
            }
        }
        // One or two chroma rows: swscale's filter is a single tap (src - 2 < 1).
        assert_eq!(rows(1, 1), vec![(0, vec![4096])]);
        assert_eq!(
            rows(2, 3),
            vec![(0, vec![4096]), (1, vec![4096]), (1, vec![4096])]
        );
    }

    #[test]
    fn a_row_is_rounded_as_swscale_rounds_it() {
        let f = ChromaRows::new(4, 7);
        let src = [[10u8, 200], [11, 0], [255, 255], [0, 0]];
        let mut out = [0u8; 2];
        f.row(1, |r| &src[r], &mut out);
        // (10·2633 + 11·1463 + 2048) >> 12, (200·2633 + 2048) >> 12.
        assert_eq!(out, [10, 129]);
    }

    #[test]
    fn rotation_turns_clockwise() {
        // 2x1 image: red then green.
        let rgb = Rgb {
            width: 2,
            height: 1,
            data: vec![255, 0, 0, 0, 255, 0],
        };
        let r = rotate(rgb, 90);
        assert_eq!((r.width, r.height), (1, 2));
        // Clockwise: the left pixel ends up on top.
        assert_eq!(r.data, vec![255, 0, 0, 0, 255, 0]);
        let r = rotate(r, 90);
        assert_eq!((r.width, r.height), (2, 1));
        assert_eq!(r.data, vec![0, 255, 0, 255, 0, 0]);
    }
}
