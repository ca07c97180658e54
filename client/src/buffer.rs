//! Batch payload memory: one allocation per batch, 64-byte aligned, filled once from the
//! socket and then shared read-only by every tensor view (Rust slices, numpy, torch).

use stoker_wire::ALIGN;

pub struct AlignedBuf {
    raw: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    /// `len` zeroed bytes at a 64-byte aligned address. The over-allocation is at most 63
    /// bytes; `vec![0; n]` maps fresh zero pages for large sizes, so nothing is memset.
    pub fn zeroed(len: usize) -> Self {
        let raw = vec![0u8; len + ALIGN - 1];
        let start = raw.as_ptr().align_offset(ALIGN);
        AlignedBuf { raw, start, len }
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.raw[self.start..self.start + self.len]
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.raw[self.start..self.start + self.len]
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Address of the first byte (what the socket read wrote to): tests use it to prove that
    /// views are not copies.
    pub fn address(&self) -> usize {
        self.as_slice().as_ptr() as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_sized() {
        for len in [0, 1, 63, 64, 65, 1 << 20] {
            let mut b = AlignedBuf::zeroed(len);
            assert_eq!(b.address() % ALIGN, 0);
            assert_eq!(b.len(), len);
            assert!(b.as_slice().iter().all(|&x| x == 0));
            b.as_mut_slice().fill(7);
            assert!(b.as_slice().iter().all(|&x| x == 7));
        }
    }
}
