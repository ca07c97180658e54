//! Bicubic resize that reproduces Pillow's `Image.resize(..., BICUBIC)` bit for bit.
//!
//! Pillow resamples separably (horizontal pass, then vertical) with a convolution whose
//! support widens with the downscale factor (antialiasing), and runs the 8-bit path in fixed
//! point: coefficients are rounded to 22 fractional bits and every pass rounds and clamps to
//! u8. Matching that exactly — coefficient generation in f64, the same rounding, the same
//! intermediate u8 image — makes our pixels identical to what the reference processor feeds
//! the model, instead of "close" (a different bicubic differs by up to 8 levels).

/// Fractional bits of the fixed-point coefficients (Pillow: 32 - 8 - 2).
const PRECISION_BITS: u32 = 22;

fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}
const BICUBIC_SUPPORT: f64 = 2.0;

/// Per output pixel: first input index and the fixed-point weights of the inputs it reads.
struct Coeffs {
    ksize: usize,
    bounds: Vec<(usize, usize)>,
    weights: Vec<i32>,
}

fn precompute(in_size: usize, out_size: usize) -> Coeffs {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = BICUBIC_SUPPORT * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(out_size);
    let mut weights = vec![0i32; out_size * ksize];
    let mut k = vec![0f64; ksize];
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        // `as` truncates toward zero like Pillow's (int) cast.
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize - xmin;
        let mut ww = 0.0;
        for (x, kx) in k.iter_mut().enumerate().take(xmax) {
            let w = bicubic((x as f64 + xmin as f64 - center + 0.5) * ss);
            *kx = w;
            ww += w;
        }
        let row = &mut weights[xx * ksize..(xx + 1) * ksize];
        for x in 0..xmax {
            let w = if ww != 0.0 { k[x] / ww } else { k[x] };
            let f = w * (1u32 << PRECISION_BITS) as f64;
            row[x] = if w < 0.0 {
                (-0.5 + f) as i32
            } else {
                (0.5 + f) as i32
            };
        }
        bounds.push((xmin, xmax));
    }
    Coeffs {
        ksize,
        bounds,
        weights,
    }
}

#[inline(always)]
fn clip8(v: i32) -> u8 {
    (v >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Horizontal pass over rows `y0..y1` of `src` (width `w`) to width `ow`.
fn horizontal(src: &[u8], w: usize, y0: usize, y1: usize, c: &Coeffs, ow: usize) -> Vec<u8> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { horizontal_avx2(src, w, y0, y1, c, ow) };
    }
    horizontal_kernel(src, w, y0, y1, c, ow)
}

/// Two output pixels per step: lanes 0–3 accumulate pixel A's (R, G, B, spare), lanes 4–7
/// pixel B's. Both run over the longer of their two tap lists; the shorter one's extra taps
/// have zero weight (coefficient rows are zero-padded to `ksize`) and read into the row's
/// zero padding, so the sums are exactly the scalar ones.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn horizontal_avx2(
    src: &[u8],
    w: usize,
    y0: usize,
    y1: usize,
    c: &Coeffs,
    ow: usize,
) -> Vec<u8> {
    use std::arch::x86_64::*;
    let ks = c.ksize;
    // Not zero-filled: every pixel of every row is stored below (plus one spare byte after
    // the last, for the 4-byte stores), then the length is set.
    let len = ow * (y1 - y0) * 3;
    let mut out: Vec<u8> = Vec::with_capacity(len + 1);
    // `ksize` pixels of zero padding (extra taps) plus one byte (4-byte loads).
    let mut padded = vec![0u8; (w + ks) * 3 + 1];
    let init = _mm256_set1_epi32(1 << (PRECISION_BITS - 1));
    let load = |row: *const u8, x: usize| (row.add(x * 3) as *const i32).read_unaligned();
    for ty in 0..y1 - y0 {
        padded[..w * 3].copy_from_slice(&src[(ty + y0) * w * 3..(ty + y0 + 1) * w * 3]);
        let row = padded.as_ptr();
        let out_row = out.as_mut_ptr().add(ty * ow * 3);
        let mut xx = 0;
        while xx + 1 < ow {
            let ((xa, na), (xb, nb)) = (c.bounds[xx], c.bounds[xx + 1]);
            let ka = &c.weights[xx * ks..(xx + 1) * ks];
            let kb = &c.weights[(xx + 1) * ks..(xx + 2) * ks];
            let mut acc = init;
            for i in 0..na.max(nb) {
                // SAFETY: xa + i, xb + i < w + ks: inside the padded row.
                let v =
                    _mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, load(row, xb + i), load(row, xa + i)));
                let k = _mm256_set_m128i(_mm_set1_epi32(kb[i]), _mm_set1_epi32(ka[i]));
                acc = _mm256_add_epi32(acc, _mm256_mullo_epi32(v, k));
            }
            let v = _mm256_srai_epi32::<{ PRECISION_BITS as i32 }>(acc);
            // Per 128-bit lane: i32 → i16 → u8 with saturation, i.e. clip8.
            let packed = _mm256_packus_epi16(_mm256_packs_epi32(v, v), _mm256_setzero_si256());
            let a = _mm256_castsi256_si128(packed);
            let b = _mm256_extracti128_si256::<1>(packed);
            // 4-byte stores; B's overwrites A's spare byte, the next step B's.
            (out_row.add(xx * 3) as *mut i32).write_unaligned(_mm_cvtsi128_si32(a));
            (out_row.add(xx * 3 + 3) as *mut i32).write_unaligned(_mm_cvtsi128_si32(b));
            xx += 2;
        }
        if xx < ow {
            let (xmin, n) = c.bounds[xx];
            let px = tap_pixel(&padded, xmin, &c.weights[xx * ks..xx * ks + n]);
            std::ptr::copy_nonoverlapping(px.as_ptr(), out_row.add(xx * 3), 3);
        }
    }
    // SAFETY: rows 0..y1-y0 each had all `ow` pixels (3 bytes each) written above.
    out.set_len(len);
    out
}

/// One output pixel of the horizontal pass: taps `k` over pixels `xmin..` of `row`.
#[inline(always)]
fn tap_pixel(row: &[u8], xmin: usize, k: &[i32]) -> [u8; 3] {
    let mut acc = [1i32 << (PRECISION_BITS - 1); 3];
    for (i, &kw) in k.iter().enumerate() {
        let p = &row[(xmin + i) * 3..(xmin + i) * 3 + 3];
        for (a, &v) in acc.iter_mut().zip(p) {
            *a += v as i32 * kw;
        }
    }
    acc.map(clip8)
}

/// Portable horizontal pass (the reference for the SIMD ones).
fn horizontal_kernel(src: &[u8], w: usize, y0: usize, y1: usize, c: &Coeffs, ow: usize) -> Vec<u8> {
    let mut out = vec![0u8; ow * (y1 - y0) * 3];
    for (ty, out_row) in out.chunks_exact_mut(ow * 3).enumerate() {
        let row = &src[(ty + y0) * w * 3..(ty + y0 + 1) * w * 3];
        for (xx, px) in out_row.chunks_exact_mut(3).enumerate() {
            let (xmin, n) = c.bounds[xx];
            px.copy_from_slice(&tap_pixel(
                row,
                xmin,
                &c.weights[xx * c.ksize..xx * c.ksize + n],
            ));
        }
    }
    out
}

/// Vertical pass over `src` (width `w`, whose first row is input row `row_off`).
fn vertical(src: &[u8], w: usize, row_off: usize, c: &Coeffs, oh: usize) -> Vec<u8> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { vertical_avx2(src, w, row_off, c, oh) };
    }
    vertical_kernel(src, w, row_off, c, oh)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn vertical_avx2(src: &[u8], w: usize, row_off: usize, c: &Coeffs, oh: usize) -> Vec<u8> {
    vertical_kernel(src, w, row_off, c, oh)
}

#[inline(always)]
fn vertical_kernel(src: &[u8], w: usize, row_off: usize, c: &Coeffs, oh: usize) -> Vec<u8> {
    let stride = w * 3;
    // Appended row by row: no zero-fill of the output.
    let mut out = Vec::with_capacity(stride * oh);
    let mut acc = vec![0i32; stride];
    for yy in 0..oh {
        let (ymin, n) = c.bounds[yy];
        let k = &c.weights[yy * c.ksize..yy * c.ksize + n];
        acc.fill(1i32 << (PRECISION_BITS - 1));
        // Row-major accumulation: the inner loop runs over a contiguous row (vectorizes).
        for (i, &kw) in k.iter().enumerate() {
            let r = ymin + i - row_off;
            for (a, &p) in acc.iter_mut().zip(&src[r * stride..(r + 1) * stride]) {
                *a += p as i32 * kw;
            }
        }
        out.extend(acc.iter().map(|&a| clip8(a)));
    }
    out
}

/// Resizes packed RGB8 (`w`×`h`) to `ow`×`oh`, exactly as Pillow's BICUBIC does for mode RGB,
/// including its choice of pass order (Pillow ≥ 11 runs the vertical pass first when the
/// height shrinks by more than twice as many pixels as the width; the order changes the
/// rounding of the intermediate image).
pub fn resize_rgb8(src: &[u8], w: usize, h: usize, ow: usize, oh: usize) -> Vec<u8> {
    assert_eq!(src.len(), w * h * 3);
    let (need_h, need_v) = (ow != w, oh != h);
    let horizontal_first = !(h > oh && (h - oh) as i64 > (w as i64 - ow as i64) * 2);
    let vert = precompute(h, oh);
    let horiz = precompute(w, ow);
    if horizontal_first {
        if !need_h {
            return if need_v {
                vertical(src, w, 0, &vert, oh)
            } else {
                src.to_vec()
            };
        }
        // Only the input rows the vertical pass reads go through the horizontal pass.
        let y_first = vert.bounds[0].0;
        let y_last = vert.bounds[oh - 1].0 + vert.bounds[oh - 1].1;
        let tmp = horizontal(src, w, y_first, y_last, &horiz, ow);
        if need_v {
            vertical(&tmp, ow, y_first, &vert, oh)
        } else {
            tmp
        }
    } else {
        let tmp = vertical(src, w, 0, &vert, oh);
        if need_h {
            horizontal(&tmp, w, 0, oh, &horiz, ow)
        } else {
            tmp
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_size_is_a_copy() {
        let src: Vec<u8> = (0..4 * 3 * 3).map(|i| i as u8).collect();
        assert_eq!(resize_rgb8(&src, 4, 3, 4, 3), src);
    }

    #[test]
    fn constant_image_stays_constant_up_and_down() {
        let src = vec![77u8; 50 * 30 * 3];
        for (ow, oh) in [(28, 28), (112, 56), (50, 84), (7, 30)] {
            let out = resize_rgb8(&src, 50, 30, ow, oh);
            assert_eq!(out.len(), ow * oh * 3);
            assert!(out.iter().all(|&v| v == 77), "{ow}x{oh}");
        }
    }

    #[test]
    fn simd_pass_equals_the_portable_one() {
        let (w, h) = (53, 9);
        let src: Vec<u8> = (0..w * h * 3).map(|i| (i * 37 % 256) as u8).collect();
        for ow in [5, 20, 30, 45, 80, 200] {
            let c = precompute(w, ow);
            assert_eq!(
                horizontal(&src, w, 1, h, &c, ow),
                horizontal_kernel(&src, w, 1, h, &c, ow),
                "{w}->{ow}"
            );
        }
    }

    #[test]
    fn weights_sum_to_one_in_fixed_point() {
        for (i, o) in [(561, 560), (1600, 644), (300, 812)] {
            let c = precompute(i, o);
            for (xx, &(_, n)) in c.bounds.iter().enumerate() {
                let s: i64 = c.weights[xx * c.ksize..xx * c.ksize + n]
                    .iter()
                    .map(|&w| w as i64)
                    .sum();
                assert!(
                    (s - (1 << PRECISION_BITS)).abs() <= n as i64,
                    "{i}->{o} @{xx}"
                );
            }
        }
    }
}
