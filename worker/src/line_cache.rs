//! Shard text read once per worker. A sample's JSONL line is cut from a 1 MiB block of its
//! shard, and blocks stay in a bounded cache: once a block is read, its samples cost one GET
//! each (their images) instead of two. Requests for a block being read wait for that one read.
//! The bytes are the shard's bytes either way, so cached or not, any worker serves identical
//! lines.

use crate::source::FetchError;
use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt, Shared};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// Bytes of a shard read at once.
pub const BLOCK_BYTES: u64 = 1 << 20;

type BlockRead = Shared<BoxFuture<'static, Result<Bytes, FetchError>>>;
type BlockKey = (Arc<str>, u64);

pub struct LineCache {
    /// Blocks kept at most.
    capacity: usize,
    blocks: Mutex<Blocks>,
}

#[derive(Default)]
struct Blocks {
    reads: HashMap<BlockKey, BlockRead>,
    /// Oldest first: the first evicted.
    order: VecDeque<BlockKey>,
}

/// Whether a line came from a block already read (or being read).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    Hit,
    Miss,
}

impl LineCache {
    /// A cache of at most `capacity_bytes` of shard text (0: none).
    pub fn new(capacity_bytes: u64) -> Self {
        LineCache {
            capacity: (capacity_bytes / BLOCK_BYTES) as usize,
            blocks: Mutex::default(),
        }
    }

    /// Whether the line at `offset`, `len` bytes long, is served from a block (it lies within
    /// one); a line across blocks is read on its own.
    pub fn covers(&self, offset: u64, len: u64) -> bool {
        self.capacity > 0 && len > 0 && offset / BLOCK_BYTES == (offset + len - 1) / BLOCK_BYTES
    }

    /// The line at `offset`, `len` bytes long, of `shard` (`shard_size` bytes), cut from its
    /// block; `read(start, len)` reads a block that is neither cached nor being read.
    pub async fn line(
        &self,
        shard: &str,
        shard_size: u64,
        (offset, len): (u64, u64),
        read: impl FnOnce(u64, u64) -> BoxFuture<'static, Result<Bytes, FetchError>>,
    ) -> Result<(Bytes, Lookup), FetchError> {
        let block = offset / BLOCK_BYTES;
        let key: BlockKey = (Arc::from(shard), block);
        let (pending, lookup) = self.block(key.clone(), || {
            let start = block * BLOCK_BYTES;
            read(start, BLOCK_BYTES.min(shard_size.saturating_sub(start)))
        });
        let bytes = match pending.clone().await {
            Ok(bytes) => bytes,
            Err(e) => {
                // Not kept: the next request for this block reads it again.
                let mut blocks = self.blocks.lock().expect("line cache");
                if blocks.reads.get(&key).is_some_and(|r| r.ptr_eq(&pending)) {
                    blocks.reads.remove(&key);
                }
                return Err(e);
            }
        };
        let at = (offset - block * BLOCK_BYTES) as usize;
        match bytes.get(at..at + len as usize) {
            Some(_) => Ok((bytes.slice(at..at + len as usize), lookup)),
            None => Err(FetchError::Io(
                format!("{shard} block {block}"),
                format!("{} bytes, too short for the line at {offset}", bytes.len()),
            )),
        }
    }

    /// The read of `key`: the one cached or under way, else a new one (evicting the oldest).
    fn block(
        &self,
        key: BlockKey,
        read: impl FnOnce() -> BoxFuture<'static, Result<Bytes, FetchError>>,
    ) -> (BlockRead, Lookup) {
        let mut blocks = self.blocks.lock().expect("line cache");
        if let Some(r) = blocks.reads.get(&key) {
            return (r.clone(), Lookup::Hit);
        }
        let r = read().shared();
        blocks.reads.insert(key.clone(), r.clone());
        blocks.order.push_back(key);
        while blocks.order.len() > self.capacity {
            let oldest = blocks.order.pop_front().expect("longer than capacity");
            blocks.reads.remove(&oldest);
        }
        (r, Lookup::Miss)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A shard of 3.5 blocks whose byte i is i % 251, and a reader counting its reads.
    fn shard() -> (Bytes, Arc<AtomicUsize>) {
        let data: Vec<u8> = (0..BLOCK_BYTES * 7 / 2).map(|i| (i % 251) as u8).collect();
        (data.into(), Arc::new(AtomicUsize::new(0)))
    }

    fn reader(
        data: &Bytes,
        reads: &Arc<AtomicUsize>,
    ) -> impl FnOnce(u64, u64) -> BoxFuture<'static, Result<Bytes, FetchError>> {
        let (data, reads) = (data.clone(), reads.clone());
        move |start, len| {
            async move {
                reads.fetch_add(1, Ordering::SeqCst);
                tokio::task::yield_now().await;
                Ok(data.slice(start as usize..(start + len) as usize))
            }
            .boxed()
        }
    }

    #[tokio::test]
    async fn lines_come_from_blocks_read_once_and_match_the_shard() {
        let (data, reads) = shard();
        let cache = LineCache::new(8 * BLOCK_BYTES);
        let size = data.len() as u64;
        let lines = [
            (0, 100),
            (5000, 4000),
            (BLOCK_BYTES + 7, 300),
            (3 * BLOCK_BYTES, 1000),
        ];
        for round in 0..2 {
            for (offset, len) in lines {
                assert!(cache.covers(offset, len));
                let (line, lookup) = cache
                    .line("s.jsonl", size, (offset, len), reader(&data, &reads))
                    .await
                    .unwrap();
                assert_eq!(line, data.slice(offset as usize..(offset + len) as usize));
                if round == 1 {
                    assert_eq!(lookup, Lookup::Hit);
                }
            }
        }
        assert_eq!(
            reads.load(Ordering::SeqCst),
            3,
            "blocks 0, 1 and 3, once each"
        );
        assert!(
            !cache.covers(BLOCK_BYTES - 10, 20),
            "across two blocks: read on its own"
        );
    }

    #[tokio::test]
    async fn concurrent_lines_of_one_block_share_one_read_and_the_cache_is_bounded() {
        let (data, reads) = shard();
        let cache = LineCache::new(2 * BLOCK_BYTES);
        let size = data.len() as u64;
        let lines =
            (0..32).map(|i| cache.line("s.jsonl", size, (i * 1000, 500), reader(&data, &reads)));
        for r in futures::future::join_all(lines).await {
            r.unwrap();
        }
        assert_eq!(reads.load(Ordering::SeqCst), 1);
        // Blocks 1 and 2 fill the cache; block 0, the oldest, is read again.
        for block in [1, 2, 0] {
            let at = (block * BLOCK_BYTES, 10);
            cache
                .line("s.jsonl", size, at, reader(&data, &reads))
                .await
                .unwrap();
        }
        assert_eq!(reads.load(Ordering::SeqCst), 4);
        assert_eq!(cache.blocks.lock().unwrap().reads.len(), 2);
    }
}
