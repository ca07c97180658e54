//! Batch payload memory: one allocation per batch, 64-byte aligned, filled once from the
//! socket and then shared read-only by every tensor view (Rust slices, numpy, torch).
//!
//! Buffers come from a small pool: when the trainer drops a batch (and every view of it),
//! its memory goes back to the pool for a later frame. Fresh memory costs a page fault per
//! 4 KiB and the kernel's zeroing; at loopback speeds that is more than the copy out of the
//! socket itself, so reuse keeps the transport near the plain-TCP bound.

use std::sync::{Arc, Mutex};
use stoker_wire::ALIGN;

pub struct AlignedBuf {
    raw: Vec<u8>,
    start: usize,
    len: usize,
    /// Where the memory goes when this buffer is dropped.
    pool: Option<BufferPool>,
}

impl AlignedBuf {
    /// `len` zeroed bytes at a 64-byte aligned address, not pooled. The over-allocation is at
    /// most 63 bytes; `vec![0; n]` maps fresh zero pages for large sizes (no memset).
    pub fn zeroed(len: usize) -> Self {
        Self::with_raw(vec![0u8; len + ALIGN - 1], len, None)
    }

    fn with_raw(raw: Vec<u8>, len: usize, pool: Option<BufferPool>) -> Self {
        let start = raw.as_ptr().align_offset(ALIGN);
        debug_assert!(start + len <= raw.len());
        AlignedBuf {
            raw,
            start,
            len,
            pool,
        }
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

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.give(std::mem::take(&mut self.raw));
        }
    }
}

/// Recycled payload memory, bounded in count.
#[derive(Clone)]
pub struct BufferPool {
    free: Arc<Mutex<Vec<Vec<u8>>>>,
    capacity: usize,
}

impl BufferPool {
    pub fn new(capacity: usize) -> Self {
        BufferPool {
            free: Arc::new(Mutex::new(Vec::with_capacity(capacity))),
            capacity,
        }
    }

    /// A buffer of `len` bytes whose contents are unspecified (the caller overwrites them
    /// all): a recycled one that fits (at most twice the size, so memory is not wasted), or
    /// fresh zeroed memory.
    pub fn take(&self, len: usize) -> AlignedBuf {
        let need = len + ALIGN - 1;
        let recycled = {
            let mut free = self.free.lock().expect("pool lock");
            free.iter()
                .position(|b| b.len() >= need && b.len() <= 2 * need)
                .map(|i| free.swap_remove(i))
        };
        match recycled {
            Some(raw) => AlignedBuf::with_raw(raw, len, Some(self.clone())),
            None => AlignedBuf::with_raw(vec![0u8; need], len, Some(self.clone())),
        }
    }

    fn give(&self, raw: Vec<u8>) {
        let mut free = self.free.lock().expect("pool lock");
        if free.len() == self.capacity {
            free.remove(0); // the oldest goes back to the allocator
        }
        free.push(raw);
    }

    /// Buffers waiting for reuse.
    pub fn idle(&self) -> usize {
        self.free.lock().expect("pool lock").len()
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

    #[test]
    fn dropped_buffers_are_reused_within_bounds() {
        let pool = BufferPool::new(2);
        let a = pool.take(1 << 20);
        let addr = a.address();
        drop(a);
        assert_eq!(pool.idle(), 1);
        // Same size class: the same memory, still aligned.
        let b = pool.take((1 << 20) - 100);
        assert_eq!(b.address(), addr);
        assert_eq!(b.address() % ALIGN, 0);
        // Far smaller: not worth holding 1 MiB for it.
        let c = pool.take(1000);
        assert_ne!(c.address(), addr);
        drop((b, c));
        for _ in 0..5 {
            drop(pool.take(3 << 20));
        }
        assert!(pool.idle() <= 2);
    }
}
