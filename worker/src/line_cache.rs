//! Sample text read in spans and cut into lines. A span is what one ranged GET reads from a
//! shard: a 1 MiB block when the dataset's text fits the cache, a run of the `runs` order, or
//! a line itself, each merged with the neighbouring spans of its request when that reads at
//! most as many bytes again as the lines need ([`merge_spans`]). Spans stay in a cache bounded
//! in bytes, oldest out first, and a line within one already read (or being read) costs no
//! request; requests for a span being read wait for that one read. The bytes are the shard's
//! bytes either way, so cached or not, any worker serves identical lines.

use crate::source::FetchError;
use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt, Shared};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

/// Bytes of a shard read at once when the text fits the cache.
pub const BLOCK_BYTES: u64 = 1 << 20;

type SpanRead = Shared<BoxFuture<'static, Result<Bytes, FetchError>>>;
/// A span's shard and first byte.
type SpanKey = (Arc<str>, u64);

/// Bytes `start .. start + len` of a shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub start: u64,
    pub len: u64,
}

impl Span {
    pub fn end(&self) -> u64 {
        self.start + self.len
    }

    fn holds(&self, offset: u64, len: u64) -> bool {
        offset >= self.start && offset + len <= self.end()
    }
}

pub struct LineCache {
    /// Bytes of spans kept at most (0: none, every line read on its own).
    capacity: u64,
    spans: Mutex<Spans>,
}

#[derive(Default)]
struct Spans {
    reads: BTreeMap<SpanKey, Entry>,
    /// Oldest first, with the entry's number: the first evicted (unless it went already).
    order: VecDeque<(SpanKey, u64)>,
    bytes: u64,
    next: u64,
}

struct Entry {
    len: u64,
    number: u64,
    read: SpanRead,
}

/// Whether a line came from a span already read (or being read).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    Hit,
    Miss,
}

impl LineCache {
    /// A cache of at most `capacity_bytes` of shard text (0: none).
    pub fn new(capacity_bytes: u64) -> Self {
        LineCache {
            capacity: capacity_bytes,
            spans: Mutex::default(),
        }
    }

    /// The bytes of the spans held now.
    pub fn held(&self) -> u64 {
        self.spans.lock().expect("line cache").bytes
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The line at `offset`, `len` bytes long, of `shard`: cut from a cached span that holds
    /// it, else from `span` (which must hold it), read by `read(start, len)` and kept.
    pub async fn line(
        &self,
        shard: &str,
        span: Span,
        (offset, len): (u64, u64),
        read: impl FnOnce(u64, u64) -> BoxFuture<'static, Result<Bytes, FetchError>>,
    ) -> Result<(Bytes, Lookup), FetchError> {
        debug_assert!(span.holds(offset, len), "{span:?} holds {offset}+{len}");
        let (at, pending, lookup) = self.span(shard, span, (offset, len), read);
        let bytes = match pending.clone().await {
            Ok(bytes) => bytes,
            Err(e) => {
                // Not kept: the next request for these lines reads them again.
                self.forget(shard, at.start, &pending);
                return Err(e);
            }
        };
        let from = (offset - at.start) as usize;
        match bytes.get(from..from + len as usize) {
            Some(_) => Ok((bytes.slice(from..from + len as usize), lookup)),
            None => Err(FetchError::Io(
                format!("{shard} bytes {}..{}", at.start, at.end()),
                format!("{} bytes, too short for the line at {offset}", bytes.len()),
            )),
        }
    }

    /// The read holding the line: a cached one, else `span`'s (kept if it fits).
    fn span(
        &self,
        shard: &str,
        span: Span,
        (offset, len): (u64, u64),
        read: impl FnOnce(u64, u64) -> BoxFuture<'static, Result<Bytes, FetchError>>,
    ) -> (Span, SpanRead, Lookup) {
        let shard: Arc<str> = Arc::from(shard);
        let mut spans = self.spans.lock().expect("line cache");
        let from = (shard.clone(), 0)..=(shard.clone(), offset);
        if let Some(((_, start), e)) = spans.reads.range(from).next_back() {
            let cached = Span {
                start: *start,
                len: e.len,
            };
            if cached.holds(offset, len) {
                return (cached, e.read.clone(), Lookup::Hit);
            }
        }
        let r = read(span.start, span.len).shared();
        if span.len > self.capacity {
            return (span, r, Lookup::Miss);
        }
        let key: SpanKey = (shard, span.start);
        let number = spans.next;
        spans.next += 1;
        let entry = Entry {
            len: span.len,
            number,
            read: r.clone(),
        };
        if let Some(old) = spans.reads.insert(key.clone(), entry) {
            spans.bytes -= old.len;
        }
        spans.bytes += span.len;
        spans.order.push_back((key, number));
        while spans.bytes > self.capacity {
            let (oldest, number) = spans.order.pop_front().expect("bytes are held");
            if spans.reads.get(&oldest).is_some_and(|e| e.number == number) {
                let gone = spans.reads.remove(&oldest).expect("just seen");
                spans.bytes -= gone.len;
            }
        }
        (span, r, Lookup::Miss)
    }

    /// Drops the span read at `start` of `shard` if it is still `read` (a failed read).
    fn forget(&self, shard: &str, start: u64, read: &SpanRead) {
        let mut spans = self.spans.lock().expect("line cache");
        let key: SpanKey = (Arc::from(shard), start);
        if spans.reads.get(&key).is_some_and(|e| e.read.ptr_eq(read)) {
            let gone = spans.reads.remove(&key).expect("just seen");
            spans.bytes -= gone.len;
        }
    }
}

/// The spans one request reads: each sample's (`(shard, span)`, in the request's order)
/// grown to take in the neighbours of the same shard it can while reading at most twice the
/// bytes its own spans hold; the result has an entry per sample, the span it reads from.
pub fn merge_spans(wanted: &[(usize, Span)]) -> Vec<Span> {
    let mut order: Vec<usize> = (0..wanted.len()).collect();
    order.sort_by_key(|&i| (wanted[i].0, wanted[i].1.start, wanted[i].1.len));
    let mut merged = vec![Span { start: 0, len: 0 }; wanted.len()];
    let mut group: Vec<usize> = Vec::new();
    // The group's shard and extent, and the bytes its distinct spans hold.
    let (mut shard, mut extent, mut need) = (usize::MAX, Span { start: 0, len: 0 }, 0u64);
    let mut last = None;
    let close = |group: &mut Vec<usize>, extent: Span, merged: &mut Vec<Span>| {
        for i in group.drain(..) {
            merged[i] = extent;
        }
    };
    for i in order {
        let (s, span) = wanted[i];
        let own = match last == Some(wanted[i]) {
            true => 0,
            false => span.len,
        };
        let end = extent.end().max(span.end());
        if s == shard && end - extent.start <= 2 * (need + own) {
            extent.len = end - extent.start;
            need += own;
        } else {
            close(&mut group, extent, &mut merged);
            (shard, extent, need) = (s, span, span.len);
        }
        last = Some(wanted[i]);
        group.push(i);
    }
    close(&mut group, extent, &mut merged);
    merged
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

    fn block(offset: u64) -> Span {
        Span {
            start: offset / BLOCK_BYTES * BLOCK_BYTES,
            len: BLOCK_BYTES,
        }
    }

    #[tokio::test]
    async fn lines_come_from_spans_read_once_and_match_the_shard() {
        let (data, reads) = shard();
        let cache = LineCache::new(8 * BLOCK_BYTES);
        let lines = [
            (0, 100),
            (5000, 4000),
            (BLOCK_BYTES + 7, 300),
            (3 * BLOCK_BYTES, 1000),
        ];
        for round in 0..2 {
            for (offset, len) in lines {
                let mut span = block(offset);
                span.len = span.len.min(data.len() as u64 - span.start);
                let (line, lookup) = cache
                    .line("s.jsonl", span, (offset, len), reader(&data, &reads))
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
        // A line within a span read for others costs nothing, whatever span it would read.
        let (_, lookup) = cache
            .line(
                "s.jsonl",
                Span { start: 10, len: 5 },
                (10, 5),
                reader(&data, &reads),
            )
            .await
            .unwrap();
        assert_eq!((lookup, reads.load(Ordering::SeqCst)), (Lookup::Hit, 3));
    }

    #[tokio::test]
    async fn concurrent_lines_of_one_span_share_one_read_and_the_cache_is_bounded_in_bytes() {
        let (data, reads) = shard();
        let cache = LineCache::new(2 * BLOCK_BYTES);
        let lines = (0..32).map(|i| {
            let at = (i * 1000, 500);
            cache.line("s.jsonl", block(at.0), at, reader(&data, &reads))
        });
        for r in futures::future::join_all(lines).await {
            r.unwrap();
        }
        assert_eq!(reads.load(Ordering::SeqCst), 1);
        // Blocks 1 and 2 fill the cache; block 0, the oldest, is read again.
        for b in [1, 2, 0] {
            let at = (b * BLOCK_BYTES, 10);
            let span = block(at.0);
            cache
                .line("s.jsonl", span, at, reader(&data, &reads))
                .await
                .unwrap();
        }
        assert_eq!(reads.load(Ordering::SeqCst), 4);
        let held = {
            let spans = cache.spans.lock().unwrap();
            (spans.reads.len(), spans.bytes)
        };
        assert_eq!(held, (2, 2 * BLOCK_BYTES));
        // A span larger than the cache is read for its line and not kept.
        let big = Span {
            start: 0,
            len: 3 * BLOCK_BYTES,
        };
        let (line, _) = cache
            .line("t.jsonl", big, (7, 3), reader(&data, &reads))
            .await
            .unwrap();
        assert_eq!(line, data.slice(7..10));
        assert_eq!(cache.spans.lock().unwrap().reads.len(), 2);
    }

    #[test]
    fn a_requests_neighbouring_spans_merge_while_they_read_at_most_twice_their_bytes() {
        let span = |start, len| Span { start, len };
        let wanted = [
            (0, span(1500, 100)), // 595 bytes past [700, 905): not merged
            (0, span(0, 100)),
            (0, span(150, 100)), // 50 bytes from the first: merged
            (0, span(150, 100)), // the same span twice: counted once
            (1, span(260, 100)), // another shard
            (0, span(700, 100)), // 450 bytes past [0, 250): not merged
            (0, span(805, 100)),
        ];
        let merged = merge_spans(&wanted);
        assert_eq!(
            merged,
            [
                span(1500, 100),
                span(0, 250),
                span(0, 250),
                span(0, 250),
                span(260, 100),
                span(700, 205),
                span(700, 205),
            ]
        );
        for ((_, own), m) in wanted.iter().zip(&merged) {
            assert!(m.holds(own.start, own.len));
        }
    }
}
