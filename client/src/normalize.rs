//! The rank's last preprocessing step when pixels cross the wire as u8: each value looked up
//! in the worker's normalization table (`pixel_lut`, `[3, 256]` float32, computed with the
//! processor's arithmetic), so the result is the processor's float32 bit for bit.
//!
//! One pass: read a byte, write a float (or its bfloat16), nothing in between. A row of
//! `pixel_values` is (channel, temporal, patch row, patch column), so the first third of the
//! columns is channel 0, the next channel 1, the last channel 2; each third is a run through one
//! 256-entry table that stays in L1. Large batches are split by rows over scoped threads.

use std::fmt;

/// Values one thread is given at least: below that, starting a thread costs more than the
/// lookup it would take over (~100 µs of work at a few G values per second).
const MIN_VALUES_PER_THREAD: usize = 1 << 18;

/// A worker's normalization table, as float32 and as bfloat16 bits (rounded to nearest even,
/// the worker's and torch's rule, so a bfloat16 rank gets the bits a bfloat16 worker sends).
pub struct PixelLut {
    f32: [[f32; 256]; 3],
    bf16: [[u16; 256]; 3],
}

impl PixelLut {
    /// The `[3, 256]` table in row-major order (768 values).
    pub fn new(values: &[f32]) -> Result<Self, NormalizeError> {
        if values.len() != 3 * 256 {
            return Err(NormalizeError::LutShape(values.len()));
        }
        let mut f32 = [[0f32; 256]; 3];
        let mut bf16 = [[0u16; 256]; 3];
        for (c, chunk) in values.chunks_exact(256).enumerate() {
            f32[c].copy_from_slice(chunk);
            for (bits, &v) in bf16[c].iter_mut().zip(chunk) {
                *bits = half::bf16::from_f32(v).to_bits();
            }
        }
        Ok(PixelLut { f32, bf16 })
    }
}

/// Where the normalized values go: same element count as the u8 input.
pub enum PixelOut<'a> {
    F32(&'a mut [f32]),
    /// bfloat16 bits.
    Bf16(&'a mut [u16]),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NormalizeError {
    LutShape(usize),
    Columns(usize),
    Ragged { values: usize, columns: usize },
    OutLen { values: usize, out: usize },
}

impl fmt::Display for NormalizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::LutShape(n) => write!(f, "pixel_lut has {n} values, not 3 x 256"),
            Self::Columns(c) => write!(
                f,
                "pixel_values has {c} columns: not a positive multiple of 3 channels"
            ),
            Self::Ragged { values, columns } => write!(
                f,
                "pixel_values has {values} values: not whole rows of {columns} columns"
            ),
            Self::OutLen { values, out } => write!(
                f,
                "output holds {out} values, pixel_values has {values}: give an array of the same shape"
            ),
        }
    }
}

impl std::error::Error for NormalizeError {}

/// Looks every value of `pixels` (`rows × columns` u8) up in `lut`, writing `out`, on up to
/// `threads` threads (fewer for small inputs; at least one: the caller's).
pub fn normalize_pixels(
    pixels: &[u8],
    columns: usize,
    lut: &PixelLut,
    out: PixelOut<'_>,
    threads: usize,
) -> Result<(), NormalizeError> {
    if columns == 0 || !columns.is_multiple_of(3) {
        return Err(NormalizeError::Columns(columns));
    }
    if !pixels.len().is_multiple_of(columns) {
        return Err(NormalizeError::Ragged {
            values: pixels.len(),
            columns,
        });
    }
    let out_len = match &out {
        PixelOut::F32(o) => o.len(),
        PixelOut::Bf16(o) => o.len(),
    };
    if out_len != pixels.len() {
        return Err(NormalizeError::OutLen {
            values: pixels.len(),
            out: out_len,
        });
    }
    match out {
        PixelOut::F32(o) => split_rows(pixels, o, columns, &lut.f32, threads),
        PixelOut::Bf16(o) => split_rows(pixels, o, columns, &lut.bf16, threads),
    }
    Ok(())
}

fn split_rows<T: Copy + Send + Sync>(
    pixels: &[u8],
    out: &mut [T],
    columns: usize,
    table: &[[T; 256]; 3],
    threads: usize,
) {
    let rows = pixels.len() / columns;
    let threads = threads
        .min(pixels.len() / MIN_VALUES_PER_THREAD)
        .clamp(1, rows.max(1));
    if threads == 1 {
        return lookup_rows(pixels, out, columns, table);
    }
    let chunk = rows.div_ceil(threads) * columns;
    std::thread::scope(|scope| {
        let mut parts = pixels.chunks(chunk).zip(out.chunks_mut(chunk));
        let (first_px, first_out) = parts.next().expect("at least one row");
        for (px, o) in parts {
            scope.spawn(move || lookup_rows(px, o, columns, table));
        }
        lookup_rows(first_px, first_out, columns, table);
    });
}

fn lookup_rows<T: Copy>(pixels: &[u8], out: &mut [T], columns: usize, table: &[[T; 256]; 3]) {
    let third = columns / 3;
    for (px_row, out_row) in pixels
        .chunks_exact(columns)
        .zip(out.chunks_exact_mut(columns))
    {
        for ((px, o), channel) in px_row
            .chunks_exact(third)
            .zip(out_row.chunks_exact_mut(third))
            .zip(table)
        {
            // u8 indices into 256 entries: no bounds check survives.
            for (v, &p) in o.iter_mut().zip(px) {
                *v = channel[p as usize];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lut() -> PixelLut {
        let values: Vec<f32> = (0..768)
            .map(|i| ((i % 256) as f32 / 255.0 - 0.5) / (0.2 + (i / 256) as f32 * 0.01))
            .collect();
        PixelLut::new(&values).unwrap()
    }

    fn pixels(rows: usize, columns: usize) -> Vec<u8> {
        (0..rows * columns)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8)
            .collect()
    }

    /// Channel of a column: its third of the row.
    fn expected(px: &[u8], columns: usize, lut: &PixelLut) -> Vec<f32> {
        px.iter()
            .enumerate()
            .map(|(i, &p)| lut.f32[(i % columns) / (columns / 3)][p as usize])
            .collect()
    }

    #[test]
    fn every_value_is_its_channels_table_entry_on_any_number_of_threads() {
        let lut = lut();
        // Row counts that do not divide by the threads; more values than one thread takes.
        for (rows, columns) in [(1, 3), (7, 1176), (1_001, 1176)] {
            let px = pixels(rows, columns);
            let want = expected(&px, columns, &lut);
            for threads in [1, 2, 3, 8] {
                let mut out = vec![f32::NAN; px.len()];
                normalize_pixels(&px, columns, &lut, PixelOut::F32(&mut out), threads).unwrap();
                assert!(
                    out.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{rows}x{columns} on {threads} threads"
                );
                let mut bits = vec![0u16; px.len()];
                normalize_pixels(&px, columns, &lut, PixelOut::Bf16(&mut bits), threads).unwrap();
                assert!(bits
                    .iter()
                    .zip(&want)
                    .all(|(&b, &f)| b == half::bf16::from_f32(f).to_bits()));
            }
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1 + 2^-8 is halfway between two bfloat16 values: even mantissa wins (down).
        let mut values = vec![0f32; 768];
        values[0] = 1.0 + 1.0 / 256.0;
        values[1] = 1.0 + 3.0 / 256.0; // halfway, odd below: rounds up
        let lut = PixelLut::new(&values).unwrap();
        assert_eq!(lut.bf16[0][0], 0x3F80);
        assert_eq!(lut.bf16[0][1], 0x3F82);
    }

    #[test]
    fn shapes_that_do_not_fit_are_errors_not_panics() {
        let lut = lut();
        let px = pixels(2, 6);
        let mut out = vec![0f32; 12];
        let run = |columns, out: &mut [f32]| {
            normalize_pixels(&px, columns, &lut, PixelOut::F32(out), 2).unwrap_err()
        };
        assert_eq!(run(0, &mut out), NormalizeError::Columns(0));
        assert_eq!(run(4, &mut out), NormalizeError::Columns(4));
        assert_eq!(
            run(9, &mut out),
            NormalizeError::Ragged {
                values: 12,
                columns: 9
            }
        );
        assert_eq!(
            run(6, &mut out[..11]),
            NormalizeError::OutLen {
                values: 12,
                out: 11
            }
        );
        assert_eq!(
            PixelLut::new(&[0.0; 767]).err(),
            Some(NormalizeError::LutShape(767))
        );
    }
}
