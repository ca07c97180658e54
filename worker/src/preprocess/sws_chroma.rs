//! The chroma swscale 8.1 (PyAV's FFmpeg) gives each RGB pixel on its scaler path, made here so
//! that Debian's swscale (5.1) can turn it into PyAV's pixels.
//!
//! swscale converts YUV → RGB by one of two paths. Its unscaled converter (8-bit 4:2:0 and 4:2:2
//! of even height) is the same in both FFmpegs. Its scaler (an odd height, more than 8 bits)
//! filters each chroma row horizontally to the chroma samples the RGB output reads (identity for
//! centre siting; a quarter-sample shift for MPEG-2's left siting, which H.264 and HEVC frames
//! name, and which 5.1 ignores), then interpolates between chroma rows; 8.1 weighs the two rows
//! as its bilinear filter says, 5.1 rounds the weight to 0 or ½ (it averages them wherever the
//! second weighs at least half) — up to 60 levels apart at 8 bits, 155 at 12. Here both steps
//! run as 8.1 runs them (its `initFilter`, `hScale` and RGB output arithmetic), giving per RGB
//! row the 8-bit chroma 8.1 looks its tables up with; written into a 4:2:2 frame of the
//! source's depth, which 5.1 converts with neither filter, through the same tables.

use ffmpeg_next as ff;

/// How swscale reads a format on its scaler path, for the formats handled here.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Source {
    /// The 4:2:2 format the resampled frame is written in (the source's depth and range).
    resampled: ff::format::Pixel,
    bits: u32,
    /// Chroma rows are half the frame's (4:2:0).
    half_rows: bool,
}

/// The format to convert `format` through, where 8.1 takes its scaler for a frame `height`
/// rows high and 5.1 would give other pixels; `None` where both give the same.
fn source(format: ff::format::Pixel, height: u32) -> Option<Source> {
    use ff::format::Pixel;
    let odd = !height.is_multiple_of(2);
    let (resampled, bits, half_rows) = match format {
        Pixel::YUV420P if odd => (Pixel::YUV422P, 8, true),
        Pixel::YUVJ420P if odd => (Pixel::YUVJ422P, 8, true),
        Pixel::YUV422P if odd => (Pixel::YUV422P, 8, false),
        Pixel::YUVJ422P if odd => (Pixel::YUVJ422P, 8, false),
        Pixel::YUV420P10LE => (Pixel::YUV422P10LE, 10, true),
        Pixel::YUV422P10LE => (Pixel::YUV422P10LE, 10, false),
        Pixel::YUV420P12LE => (Pixel::YUV422P12LE, 12, true),
        Pixel::YUV422P12LE => (Pixel::YUV422P12LE, 12, false),
        _ => return None,
    };
    Some(Source {
        resampled,
        bits,
        half_rows,
    })
}

/// Where a frame's chroma samples sit, in 1/256 of a luma sample from the top-left luma sample
/// (libavutil's convention), from its `chroma_location`; a frame that names none is centred, as
/// 8.1 takes it.
fn siting(location: ff::ffi::AVChromaLocation) -> (i64, i64) {
    use ff::ffi::AVChromaLocation::*;
    match location {
        AVCHROMA_LOC_LEFT => (0, 128),
        AVCHROMA_LOC_TOPLEFT => (0, 0),
        AVCHROMA_LOC_TOP => (128, 0),
        AVCHROMA_LOC_BOTTOMLEFT => (0, 256),
        AVCHROMA_LOC_BOTTOM => (128, 256),
        _ => (128, 128),
    }
}

/// swscale's `get_local_pos`: a chroma position relative to the ideal left (top) edge, in
/// 1/256 of a sample of a plane subsampled by `2^subsample`.
fn local_pos(subsample: u32, pos: Option<i64>) -> i64 {
    let pos = pos.unwrap_or((128 << subsample) - 128);
    (pos + 128) >> subsample
}

/// libswscale's `initFilter` for SWS_BILINEAR, upscaling or same size (all this module needs):
/// per output sample its first source sample and weights in `1/one`, after swscale's trimming
/// of near-zero taps, folding of taps past either edge and normalisation with carried error.
#[derive(Debug, PartialEq)]
struct Filter {
    first: Vec<usize>,
    weights: Vec<i32>,
    taps: usize,
}

impl Filter {
    fn new(src: usize, dst: usize, one: i64, src_pos: i64, dst_pos: i64) -> Filter {
        let (src_n, dst_n) = (src as i64, dst as i64);
        let x_inc = ((src_n << 16) + (dst_n >> 1)) / dst_n;
        debug_assert!(x_inc <= 1 << 16, "only upscaling is reproduced");
        if (x_inc - 0x10000).abs() < 10 && src_pos == dst_pos {
            return Filter {
                first: (0..dst).collect(),
                weights: vec![one as i32; dst],
                taps: 1,
            };
        }
        // The filter's own unit: 1 << (54 - log2(src / dst)), and src <= dst here.
        let unit: i64 = 1 << 54;
        // Bilinear: 2 taps either side of the centre, at most src - 2 (at least 1).
        let taps = 3.min(src_n - 2).max(1) as usize;
        let mut x = ((dst_pos * x_inc) >> 7) - ((src_pos * 0x10000) >> 7);
        let mut first = vec![0i64; dst];
        let mut filter = vec![0i64; dst * taps];
        for i in 0..dst {
            // C's division: toward zero.
            first[i] = (x - (taps as i64 - 2) * (1 << 16)) / (1 << 17);
            for j in 0..taps {
                let d = (((first[i] + j as i64) * (1 << 17)) - x).abs() << 13;
                filter[i * taps + j] = ((1i64 << 30) - d).max(0) * (unit >> 30);
            }
            x += 2 * x_inc;
        }
        // Trim near-zero taps: shift left while the dropped ones stay under the cutoff, then
        // count those on the right.
        let cutoff = 0.002 * unit as f64;
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
        // (swscale then pads the size for its SIMD code with zero taps: no weight changes.)
        let mut weights = vec![0i64; dst * kept];
        for i in 0..dst {
            let row = &mut weights[i * kept..(i + 1) * kept];
            row.copy_from_slice(&filter[i * taps..i * taps + kept]);
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
            let sum = ((row.iter().sum::<i64>() + one / 2) / one).max(1);
            let mut error = 0;
            for w in row.iter_mut() {
                let v = *w + error;
                let rounded = if v >= 0 { v + sum / 2 } else { v - sum / 2 } / sum;
                *w = rounded;
                error = v - rounded * sum;
            }
        }
        Filter {
            first: first.into_iter().map(|f| f as usize).collect(),
            // Each weight is at most `one` (1 << 14).
            weights: weights.into_iter().map(|w| w as i32).collect(),
            taps: kept,
        }
    }

    /// Output sample `i`'s first source sample and its weights, without the trailing zero taps
    /// (which may name samples past the edge).
    fn taps_of(&self, i: usize) -> (usize, &[i32]) {
        let weights = &self.weights[i * self.taps..(i + 1) * self.taps];
        let used = weights
            .iter()
            .rposition(|w| *w != 0)
            .map_or(0, |last| last + 1);
        (self.first[i], &weights[..used])
    }

    /// Output sample `i`: `Σ sample(first + j) · weight_j`.
    fn apply(&self, i: usize, sample: impl Fn(usize) -> i32) -> i32 {
        let (first, weights) = self.taps_of(i);
        weights
            .iter()
            .enumerate()
            .map(|(j, w)| sample(first + j) * w)
            .sum()
    }
}

/// Frames of one format, size and siting made into their resampled 4:2:2 form.
pub(super) struct Resampler {
    key: (ff::format::Pixel, u32, u32, ff::ffi::AVChromaLocation),
    source: Source,
    /// Chroma samples to the ones the RGB output reads, `None` where the output interpolates
    /// them itself (an odd width: swscale's full-chroma output, the same in both).
    columns: Option<Filter>,
    rows: Filter,
    frame: ff::frame::Video,
    /// One chroma plane after `columns`, at swscale's 15 bits.
    filtered: Vec<i32>,
}

impl Resampler {
    /// `frame` as the frame to convert instead, where that changes the pixels; made in `slot`
    /// (kept for the clip's next frames).
    pub(super) fn resample<'a>(
        slot: &'a mut Option<Resampler>,
        frame: &'a ff::frame::Video,
    ) -> &'a ff::frame::Video {
        let (w, h) = (frame.width(), frame.height());
        let Some(source) = source(frame.format(), h) else {
            return frame;
        };
        // SAFETY: a plain field of a decoded frame.
        let location = unsafe { (*frame.as_ptr()).chroma_location };
        let key = (frame.format(), w, h, location);
        if slot.as_ref().map(|r| r.key) != Some(key) {
            *slot = Some(Resampler::new(key, source));
        }
        let resampler = slot.as_mut().expect("set above");
        resampler.run(frame);
        &resampler.frame
    }

    fn new(key: (ff::format::Pixel, u32, u32, ff::ffi::AVChromaLocation), source: Source) -> Self {
        let (_, w, h, location) = key;
        let (x, y) = siting(location);
        let (cw, h) = (w.div_ceil(2) as usize, h as usize);
        let ch = if source.half_rows { h.div_ceil(2) } else { h };
        // The RGB output reads a chroma sample per two pixels (centred on them) from each row.
        let columns = (w % 2 == 0)
            .then(|| Filter::new(cw, cw, 1 << 14, local_pos(1, Some(x)), local_pos(1, None)));
        let src_row = if source.half_rows {
            local_pos(1, Some(y))
        } else {
            local_pos(0, None)
        };
        let rows = Filter::new(ch, h, 1 << 12, src_row, local_pos(0, None));
        Resampler {
            key,
            source,
            columns,
            rows,
            frame: ff::frame::Video::new(source.resampled, w, h as u32),
            filtered: vec![0; ch * cw],
        }
    }

    fn run(&mut self, frame: &ff::frame::Video) {
        let (w, h) = (frame.width() as usize, frame.height() as usize);
        let bytes = if self.source.bits > 8 { 2 } else { 1 };
        let (from, to) = (frame.stride(0), self.frame.stride(0));
        for y in 0..h {
            self.frame.data_mut(0)[y * to..][..w * bytes]
                .copy_from_slice(&frame.data(0)[y * from..][..w * bytes]);
        }
        let cw = w.div_ceil(2);
        let ch = self.filtered.len() / cw;
        // hScale: 8 bits are read as value << 7, more as value << (15 - bits).
        let shift = if self.source.bits > 8 {
            self.source.bits - 1
        } else {
            7
        };
        let mut samples = vec![0i32; cw];
        for plane in 1..3 {
            let stride = frame.stride(plane);
            let data = frame.data(plane);
            for r in 0..ch {
                let row = &data[r * stride..][..cw * bytes];
                for (k, s) in samples.iter_mut().enumerate() {
                    *s = if bytes == 2 {
                        i32::from(u16::from_le_bytes([row[2 * k], row[2 * k + 1]]))
                    } else {
                        i32::from(row[k])
                    };
                }
                let out = &mut self.filtered[r * cw..(r + 1) * cw];
                match &self.columns {
                    Some(f) => {
                        for (k, o) in out.iter_mut().enumerate() {
                            *o = (f.apply(k, |j| samples[j]) >> shift).min(32767);
                        }
                    }
                    None => {
                        for (o, s) in out.iter_mut().zip(&samples) {
                            *o = s << (15 - self.source.bits);
                        }
                    }
                }
            }
            let stride = self.frame.stride(plane);
            let out = self.frame.data_mut(plane);
            for y in 0..h {
                let row = &mut out[y * stride..][..cw * bytes];
                let (first, weights) = self.rows.taps_of(y);
                for k in 0..cw {
                    let acc: i32 = weights
                        .iter()
                        .enumerate()
                        .map(|(j, w)| self.filtered[(first + j) * cw + k] * w)
                        .sum();
                    // 8.1's RGB output: (Σ row · weight + 2^18) >> 19, the 8-bit chroma it reads.
                    let v = ((acc + (1 << 18)) >> 19).clamp(0, 255) as u16;
                    if bytes == 2 {
                        row[2 * k..2 * k + 2]
                            .copy_from_slice(&(v << (self.source.bits - 8)).to_le_bytes());
                    } else {
                        row[k] = v as u8;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weights(f: &Filter) -> Vec<(usize, Vec<i32>)> {
        (0..f.first.len())
            .map(|i| (f.first[i], f.weights[i * f.taps..(i + 1) * f.taps].to_vec()))
            .collect()
    }

    #[test]
    fn rows_are_swscales_bilinear_weights() {
        // 7 rows from 4, centre siting (the weights PyAV's pixels show for a 7-row frame).
        let f = Filter::new(4, 7, 4096, local_pos(1, Some(128)), local_pos(0, None));
        let want: Vec<(usize, Vec<i32>)> = vec![
            (0, vec![4096, 0]),
            (0, vec![2633, 1463]),
            (0, vec![293, 3803]),
            (1, vec![2048, 2048]),
            (2, vec![3803, 293]),
            (2, vec![1463, 2633]),
            (2, vec![0, 4096]),
        ];
        assert_eq!(weights(&f), want);
        // Top siting: even rows sit on chroma rows, odd ones halfway.
        let f = Filter::new(4, 8, 4096, local_pos(1, Some(0)), local_pos(0, None));
        assert_eq!(
            weights(&f)[..3],
            [
                (0, vec![4096, 0]),
                (0, vec![2048, 2048]),
                (1, vec![4096, 0])
            ]
        );
        // Every row's weights sum to one and stay within the source, whatever the size.
        for dst in 1..200usize {
            let src = dst.div_ceil(2);
            for (first, w) in weights(&Filter::new(src, dst, 4096, 128, 128)) {
                assert_eq!(w.iter().sum::<i32>(), 4096, "{dst} rows");
                assert!(w
                    .iter()
                    .enumerate()
                    .all(|(j, w)| *w == 0 || first + j < src));
            }
        }
        // One or two chroma rows: swscale's filter is a single tap (src - 2 < 1).
        assert_eq!(
            weights(&Filter::new(1, 1, 4096, 128, 128)),
            vec![(0, vec![4096])]
        );
        let f = Filter::new(2, 3, 4096, 128, 128);
        assert_eq!(
            weights(&f),
            vec![(0, vec![4096]), (1, vec![4096]), (1, vec![4096])]
        );
    }

    #[test]
    fn left_siting_shifts_columns_a_quarter_sample_and_centre_leaves_them() {
        let f = Filter::new(4, 4, 1 << 14, local_pos(1, Some(0)), local_pos(1, None));
        let want: Vec<(usize, Vec<i32>)> = vec![
            (0, vec![12288, 4096]),
            (1, vec![12288, 4096]),
            (2, vec![12288, 4096]),
            (2, vec![0, 16384]),
        ];
        assert_eq!(weights(&f), want);
        let f = Filter::new(4, 4, 1 << 14, local_pos(1, Some(128)), local_pos(1, None));
        assert_eq!((f.taps, f.first), (1, vec![0, 1, 2, 3]));
    }

    #[test]
    fn only_frames_8_1_scales_are_resampled() {
        use ff::format::Pixel;
        assert_eq!(source(Pixel::YUV420P, 64), None);
        assert_eq!(
            source(Pixel::YUV420P, 63).map(|s| s.resampled),
            Some(Pixel::YUV422P)
        );
        assert_eq!(
            source(Pixel::YUVJ420P, 63).map(|s| s.resampled),
            Some(Pixel::YUVJ422P)
        );
        assert_eq!(source(Pixel::YUV422P, 64), None);
        assert!(source(Pixel::YUV420P10LE, 64).is_some_and(|s| s.bits == 10 && s.half_rows));
        assert!(source(Pixel::YUV422P10LE, 64).is_some_and(|s| !s.half_rows));
        assert!(source(Pixel::YUV420P12LE, 64).is_some_and(|s| s.bits == 12));
        assert_eq!(source(Pixel::YUV444P, 63), None);
    }

    /// A frame of `format` with every sample of plane p set by `value(p, x, y)`.
    fn frame(
        format: ff::format::Pixel,
        w: u32,
        h: u32,
        value: impl Fn(usize, usize, usize) -> u16,
    ) -> ff::frame::Video {
        let mut f = ff::frame::Video::new(format, w, h);
        let wide = format == ff::format::Pixel::YUV420P10LE;
        for p in 0..3 {
            let (pw, ph) = (f.plane_width(p) as usize, f.plane_height(p) as usize);
            let stride = f.stride(p);
            let data = f.data_mut(p);
            for y in 0..ph {
                for x in 0..pw {
                    let v = value(p, x, y);
                    if wide {
                        data[y * stride + 2 * x..][..2].copy_from_slice(&v.to_le_bytes());
                    } else {
                        data[y * stride + x] = v as u8;
                    }
                }
            }
        }
        f
    }

    #[test]
    fn a_resampled_frame_keeps_luma_and_rounds_chroma_as_swscale_8_1() {
        let mut slot = None;
        // 8 bits, 4x7: chroma rows 10, 20, 30, 40 (U) and 200 (V) in every column.
        let f = frame(ff::format::Pixel::YUV420P, 4, 7, |p, x, y| match p {
            0 => (16 + x + 4 * y) as u16,
            1 => 10 * (y as u16 + 1),
            _ => 200,
        });
        let out = Resampler::resample(&mut slot, &f);
        assert_eq!(out.format(), ff::format::Pixel::YUV422P);
        assert_eq!(out.data(0)[..4], [16, 17, 18, 19]);
        let u: Vec<u8> = (0..7).map(|y| out.data(1)[y * out.stride(1)]).collect();
        // (10·2633 + 20·1463 + 2048) >> 12 = 14; (10·293 + 20·3803 + 2048) >> 12 = 19; …
        assert_eq!(u, [10, 14, 19, 25, 31, 36, 40]);
        assert!((0..7).all(|y| out.data(2)[y * out.stride(2)] == 200));
        // 10 bits: luma as it is, chroma the 8-bit value 8.1 reads, in 10 bits.
        let f = frame(ff::format::Pixel::YUV420P10LE, 4, 2, |p, _, _| {
            if p == 0 {
                1023
            } else {
                514
            }
        });
        let out = Resampler::resample(&mut slot, &f);
        assert_eq!(out.format(), ff::format::Pixel::YUV422P10LE);
        assert_eq!(out.data(0)[..2], 1023u16.to_le_bytes());
        // 514 << 5 = 16448; (16448 · 4096 + 2^18) >> 19 = 129 (128.5 rounded up) → 516.
        assert_eq!(out.data(1)[..2], 516u16.to_le_bytes());
    }
}
