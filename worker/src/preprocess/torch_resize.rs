//! torchvision's `resize(frames, size, BICUBIC, antialias=True)` on uint8, bit for bit: what
//! the Qwen-VL *video* processors run (the image processors use Pillow's, in `resample`).
//!
//! PyTorch's uint8 antialiased path (`_upsample_bicubic2d_aa` on the CPU, the AVX2 kernels and
//! the generic ones alike) is Pillow's algorithm with its own arithmetic: the Keys cubic
//! (a = −0.5) in PyTorch's operation order, weights normalized in f64 and then rounded to
//! int16 at the largest precision under which the axis's largest weight still fits, an int32
//! dot product plus half an LSB, shifted and clamped to u8; horizontal pass first, each pass
//! skipped when its axis keeps its size. Same inputs, same arithmetic, same bytes.

/// PyTorch's `HelperInterpCubic::aa_filter` (`cubic_convolution1/2`, a = −0.5), in its order.
fn aa_cubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A
    } else {
        0.0
    }
}

/// One axis: per output index the first input index and its taps, all `taps` wide, in fixed
/// point of `precision` bits.
struct Axis {
    first: Vec<usize>,
    len: Vec<usize>,
    taps: usize,
    weights: Vec<i32>,
    precision: u32,
}

/// `_compute_indices_min_size_weights_aa` then `_compute_index_ranges_int16_weights`.
fn axis(input: usize, output: usize) -> Axis {
    let scale = input as f64 / output as f64;
    let support = if scale >= 1.0 { 2.0 * scale } else { 2.0 };
    let taps = support.ceil() as usize * 2 + 1;
    let invscale = if scale >= 1.0 { 1.0 / scale } else { 1.0 };
    let mut first = Vec::with_capacity(output);
    let mut len = Vec::with_capacity(output);
    let mut real = vec![0f64; output * taps];
    let mut wt_max = 0f64;
    for i in 0..output {
        let center = scale * (i as f64 + 0.5);
        // `static_cast<int64_t>` truncates toward zero, as `as` does.
        let xmin = ((center - support + 0.5) as i64).max(0);
        let xsize = ((center + support + 0.5) as i64).min(input as i64) - xmin;
        let xsize = xsize.clamp(0, taps as i64) as usize;
        let row = &mut real[i * taps..(i + 1) * taps];
        let mut total = 0f64;
        for (j, w) in row.iter_mut().enumerate().take(xsize) {
            *w = aa_cubic(((j as i64 + xmin) as f64 - center + 0.5) * invscale);
            total += *w;
        }
        if total != 0.0 {
            for w in row.iter_mut().take(xsize) {
                *w /= total;
                wt_max = wt_max.max(*w);
            }
        }
        first.push(xmin as usize);
        len.push(xsize);
    }
    let mut precision = 0u32;
    while precision < 22 {
        let next = (0.5 + wt_max * f64::from(1i32 << (precision + 1))) as i32;
        if next >= 1 << 15 {
            break;
        }
        precision += 1;
    }
    let unit = f64::from(1i32 << precision);
    let weights = real
        .iter()
        .map(|&w| {
            let v = w * unit;
            // Rounded half away from zero, then stored as int16.
            let r = if v < 0.0 {
                (-0.5 + v) as i32
            } else {
                (0.5 + v) as i32
            };
            i32::from(r as i16)
        })
        .collect();
    Axis {
        first,
        len,
        taps,
        weights,
        precision,
    }
}

#[inline(always)]
fn finish(acc: i32, precision: u32) -> u8 {
    (acc >> precision).clamp(0, 255) as u8
}

/// Width pass of packed RGB rows.
fn horizontal(src: &[u8], w: usize, h: usize, a: &Axis) -> Vec<u8> {
    let ow = a.first.len();
    let mut out = Vec::with_capacity(ow * h * 3);
    let half = 1i32 << (a.precision - 1);
    for y in 0..h {
        let row = &src[y * w * 3..(y + 1) * w * 3];
        for x in 0..ow {
            let (start, n) = (a.first[x], a.len[x]);
            let k = &a.weights[x * a.taps..x * a.taps + n];
            let mut acc = [half; 3];
            for (j, &wj) in k.iter().enumerate() {
                let p = &row[(start + j) * 3..(start + j) * 3 + 3];
                acc[0] += i32::from(p[0]) * wj;
                acc[1] += i32::from(p[1]) * wj;
                acc[2] += i32::from(p[2]) * wj;
            }
            out.extend(acc.map(|v| finish(v, a.precision)));
        }
    }
    out
}

/// Height pass of packed RGB rows of `w` pixels.
fn vertical(src: &[u8], w: usize, a: &Axis) -> Vec<u8> {
    let oh = a.first.len();
    let stride = w * 3;
    let mut out = Vec::with_capacity(oh * stride);
    let half = 1i32 << (a.precision - 1);
    let mut acc = vec![0i32; stride];
    for y in 0..oh {
        let (start, n) = (a.first[y], a.len[y]);
        acc.fill(half);
        for (j, &wj) in a.weights[y * a.taps..y * a.taps + n].iter().enumerate() {
            let row = &src[(start + j) * stride..(start + j + 1) * stride];
            for (s, &p) in acc.iter_mut().zip(row) {
                *s += i32::from(p) * wj;
            }
        }
        out.extend(acc.iter().map(|&v| finish(v, a.precision)));
    }
    out
}

/// Precomputed passes for frames of one size to another: a clip's frames share them.
pub struct FrameResizer {
    from: (usize, usize),
    to: (usize, usize),
    horizontal: Option<Axis>,
    vertical: Option<Axis>,
}

impl FrameResizer {
    /// Frames of `from` = (height, width) to `to` = (height, width).
    pub fn new(from: (usize, usize), to: (usize, usize)) -> Self {
        FrameResizer {
            from,
            to,
            horizontal: (from.1 != to.1).then(|| axis(from.1, to.1)),
            vertical: (from.0 != to.0).then(|| axis(from.0, to.0)),
        }
    }

    /// One packed RGB frame of the `from` size, resized.
    pub fn resize(&self, rgb: Vec<u8>) -> Vec<u8> {
        let (h, w) = self.from;
        assert_eq!(
            rgb.len(),
            h * w * 3,
            "frame of the size the resizer was made for"
        );
        let wide = match &self.horizontal {
            Some(a) => horizontal(&rgb, w, h, a),
            None => rgb,
        };
        match &self.vertical {
            Some(a) => vertical(&wide, self.to.1, a),
            None => wide,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_sum_to_one_in_fixed_point_and_precision_fits_int16() {
        for (i, o) in [(1920, 448), (100, 333), (37, 36), (640, 640)] {
            let a = axis(i, o);
            assert!(a.precision <= 22 && a.precision > 0);
            for x in 0..o {
                let k = &a.weights[x * a.taps..x * a.taps + a.len[x]];
                let sum: i32 = k.iter().sum();
                let unit = 1i32 << a.precision;
                assert!(
                    (sum - unit).abs() <= a.len[x] as i32,
                    "{i}->{o} at {x}: {sum} vs {unit}"
                );
                assert!(k.iter().all(|&w| w.abs() < 1 << 15));
            }
        }
    }

    #[test]
    fn a_flat_frame_stays_flat_and_sizes_are_kept() {
        let r = FrameResizer::new((90, 160), (56, 112));
        let out = r.resize(vec![77; 90 * 160 * 3]);
        assert_eq!(out.len(), 56 * 112 * 3);
        assert!(out.iter().all(|&v| v == 77));
        let same = FrameResizer::new((4, 4), (4, 4));
        let data: Vec<u8> = (0..48).collect();
        assert_eq!(same.resize(data.clone()), data);
    }
}
