//! The dataset index: every valid sample of every shard, addressable by sample id.
//!
//! A shard is a JSONL file (a sample per line) or a JSON array file (`.json`, a sample per
//! element: LLaMA-Factory's data files). Building the index streams each shard once, parses
//! and validates every sample (JSON, format, media paths inside the root and present in the
//! store) and records the bad ones as shard:line with the reason (an array element's line is
//! the line it starts on). Sample ids number the valid samples in (shard key, position) order.
//! Each shard holds one format (docs/preprocessing.md, "Dataset formats"): a shard that mixes
//! two, or holds no sample of any, is refused naming what it saw. Memory is a chunk and one
//! sample per shard being read, whatever the shards' sizes: a sample longer than
//! [`MAX_INDEXED_LINE_BYTES`] is a bad line, never held whole.
//!
//! Stored compact (`stoker-index.bin`): 4 bytes per sample (its offset in its shard), the
//! sample's length implied by the next sample's offset and its line number by the lines skipped
//! before it, both kept sparsely for the few samples where they are not (for a JSONL shard; an
//! array's elements, pretty-printed over many lines, cost up to 16 bytes more each). The shards'
//! keys, sizes and versions are in it, so a worker checks it is fresh with one HEAD per shard:
//! it never lists the dataset (whose images may be 10^8 objects).

use super::le_u32s::LeU32s;
use super::parquet::{index_parquet, ColumnRequest, Columns, ParquetShard};
use super::sample::Formats;
use super::shard::{index_lines, Framing, MediaObjects, ShardPart};
pub use super::shard::{
    BadLine, Shard, DATASET_INFO, MAX_INDEXED_LINE_BYTES, MAX_LISTED_BAD_LINES,
};
use crate::source::{check_key, MediaRoot, ObjectInfo, ReadCap, Store};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use std::sync::Arc;

/// Where `stoker dataset index` writes the index, at the dataset root.
pub const INDEX_KEY: &str = "stoker-index.bin";
/// The largest index a worker reads: ~4 bytes a JSONL sample, ~20 a JSON array element, so a
/// billion JSONL samples (200 million in arrays).
pub const INDEX_CAP: ReadCap = ReadCap {
    bytes: 4 << 30,
    name: "an index's 4 GiB cap",
};
const MAGIC: &[u8; 8] = b"STKIDX\0\x05";
/// Shards read at once while indexing (each parsed on its own thread).
const SHARD_FETCH_CONCURRENCY: usize = 8;
/// Shards whose freshness is checked (one HEAD each) at once.
const SHARD_HEAD_CONCURRENCY: usize = 32;
/// One shard's part of the index: a JSONL or JSON array shard's lines, or a Parquet shard's rows
/// (its columns as `columns` asks).
async fn index_shard(
    store: &Store,
    obj: ObjectInfo,
    media: &MediaObjects,
    columns: &ColumnRequest,
) -> anyhow::Result<ShardPart> {
    match Framing::of(&obj.key) {
        Some(Framing::Parquet) => index_parquet(store, obj, media, columns).await,
        _ => index_lines(store, obj, media).await,
    }
}

/// Where a long index build reports how far it got (the CLI draws a bar; `()` ignores it).
pub trait Progress: Sync {
    /// The amount of work there is.
    fn total(&self, _amount: u64) {}
    /// `amount` more is done.
    fn advance(&self, _amount: u64) {}
}

impl Progress for () {}

/// Where a sample is: its 1-based line number, byte offset and length (without the newline; a
/// CRLF line's `\r` is in it, which JSON reads as whitespace; an array element's own bytes).
/// A Parquet shard's sample is its row (0-based, as pyarrow and `datasets` number them), in
/// both `line` and `offset`, with no length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleLine {
    pub line: u32,
    pub offset: u64,
    pub len: u64,
}

#[derive(Debug, Clone)]
pub struct DatasetIndex {
    /// Fingerprint of the shards (keys, sizes, versions): changes when the data does.
    pub version: u64,
    pub shards: Vec<Shard>,
    /// The first [`MAX_LISTED_BAD_LINES`] bad lines, in shard order.
    pub bad_lines: Vec<BadLine>,
    /// Bad lines in all (listed or not).
    pub bad_line_count: u64,
    /// Each sample's line offset in its shard, by sample id: where a stored index holds them.
    offsets: LeU32s,
    /// Each shard's first sample id.
    starts: Vec<u64>,
}

/// FNV-1a: a stable 64-bit fingerprint (std's hasher may change between Rust releases).
pub fn fingerprint<P: AsRef<[u8]>>(parts: &[P]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.as_ref().iter().chain(&[0xff]) {
            h ^= *b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The version of an index of `parts`: their shards' keys, sizes, versions and media roots
/// (the same lines name other images under another root), and which shards were re-read
/// without checking their media (`unchecked`, by key).
fn version_of(parts: &[ShardPart], unchecked: &[String]) -> u64 {
    let versions: Vec<Vec<u8>> = parts
        .iter()
        .map(|p| {
            let s = &p.shard;
            let checked = match unchecked.contains(&s.key) {
                true => "\0media unchecked",
                false => "",
            };
            // A Parquet shard's samples are what its columns hold.
            let columns = match &s.parquet {
                Some(p) => format!("\0columns {}", p.columns),
                None => String::new(),
            };
            format!(
                "{}\0{}\0{}\0{}{checked}{columns}",
                s.key, s.size, s.version, s.media_root
            )
            .into_bytes()
        })
        .collect();
    fingerprint(&versions)
}

/// A shard no longer as the index recorded it: its position, and what the store holds now
/// (`None`: gone).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaleShard {
    pub shard: usize,
    pub now: Option<ObjectInfo>,
}

/// A dataset without a usable `stoker-index.bin` that is too large for a worker to index:
/// the worker is not ready until the index is written.
#[derive(Debug, thiserror::Error)]
#[error(
    "{dataset}{INDEX_KEY} is missing and the dataset holds more than --self-index-max-objects \
     ({max_objects}) objects: a worker does not list and read a dataset that size on its own. \
     Run `stoker dataset index {dataset}` once (it writes {INDEX_KEY}); workers wait for it"
)]
pub struct NeedsIndex {
    pub dataset: String,
    pub max_objects: u64,
}

impl DatasetIndex {
    fn assemble(parts: Vec<ShardPart>, version: u64) -> Self {
        let total: usize = parts.iter().map(|p| p.offsets.len()).sum();
        let mut offsets = Vec::with_capacity(4 * total);
        let mut idx = DatasetIndex {
            version,
            shards: Vec::with_capacity(parts.len()),
            bad_lines: Vec::new(),
            bad_line_count: 0,
            offsets: LeU32s::default(),
            starts: Vec::with_capacity(parts.len()),
        };
        for part in parts {
            idx.starts.push(offsets.len() as u64 / 4);
            offsets.extend(part.offsets.iter().flat_map(|o| o.to_le_bytes()));
            idx.bad_line_count += part.shard.bad_lines;
            idx.shards.push(part.shard);
            let room = MAX_LISTED_BAD_LINES - idx.bad_lines.len();
            idx.bad_lines.extend(part.bad.into_iter().take(room));
        }
        idx.offsets = LeU32s::from_bytes(offsets.into());
        idx
    }

    /// Several datasets' indexes as one, for a store rooted at their common folder: each
    /// part's shard keys get its folder relative to that root (`prefix`, empty or ending in
    /// '/'), its sample ids follow the previous part's.
    pub fn concat(parts: Vec<(String, DatasetIndex)>) -> DatasetIndex {
        let versions: Vec<Vec<u8>> = parts
            .iter()
            .map(|(prefix, part)| format!("{prefix}\0{}", part.version).into_bytes())
            .collect();
        let mut idx = Self::assemble(Vec::new(), fingerprint(&versions));
        let mut offsets = Vec::with_capacity(parts.len());
        let mut first = 0;
        for (prefix, part) in parts {
            idx.starts.extend(part.starts.iter().map(|s| first + s));
            first += part.num_samples();
            offsets.push(part.offsets);
            idx.shards.extend(part.shards.into_iter().map(|s| Shard {
                key: format!("{prefix}{}", s.key),
                ..s
            }));
            idx.bad_line_count += part.bad_line_count;
            let room = MAX_LISTED_BAD_LINES - idx.bad_lines.len();
            idx.bad_lines
                .extend(part.bad_lines.into_iter().take(room).map(|b| BadLine {
                    shard: format!("{prefix}{}", b.shard),
                    ..b
                }));
        }
        idx.offsets = LeU32s::concat(offsets);
        idx
    }

    pub fn num_samples(&self) -> u64 {
        self.offsets.len() as u64
    }

    /// The index's memory: what a worker holds per sample (4 bytes) and per shard.
    pub fn resident_bytes(&self) -> u64 {
        let shards: usize = self
            .shards
            .iter()
            .map(|s| {
                std::mem::size_of::<Shard>()
                    + s.key.len()
                    + s.version.len()
                    + s.media_root.len()
                    + 8 * (s.skipped.len() + s.lengths.len())
                    + s.parquet
                        .as_ref()
                        .map_or(0, |p| 4 * p.row_groups.len() + p.columns.to_string().len())
            })
            .sum();
        self.offsets.resident_bytes() + (self.starts.len() * 8 + shards) as u64
    }

    /// The position in `shards` of the shard holding a sample id.
    pub fn shard_of(&self, sample_id: u64) -> Option<usize> {
        let i = self
            .starts
            .partition_point(|&s| s <= sample_id)
            .checked_sub(1)?;
        (sample_id - self.starts[i] < self.shards[i].samples.into()).then_some(i)
    }

    /// The sample ids of shard `i` (by position in `shards`).
    pub fn shard_ids(&self, i: usize) -> std::ops::Range<u64> {
        self.starts[i]..self.starts[i] + u64::from(self.shards[i].samples)
    }

    /// The shard and line of a sample id.
    pub fn locate(&self, sample_id: u64) -> Option<(&Shard, SampleLine)> {
        let i = self.shard_of(sample_id)?;
        let shard = &self.shards[i];
        let j = sample_id - self.starts[i];
        let (id, j) = (sample_id as usize, j as u32);
        let offset = u64::from(self.offsets.get(id));
        if shard.parquet.is_some() {
            let line = self.offsets.get(id);
            return Some((
                shard,
                SampleLine {
                    line,
                    offset,
                    len: 0,
                },
            ));
        }
        let next = match j + 1 < shard.samples {
            true => u64::from(self.offsets.get(id + 1)),
            false => shard.size,
        };
        Some((
            shard,
            SampleLine {
                line: shard.line_number(j),
                offset,
                len: shard.length(j, next.saturating_sub(offset + 1)),
            },
        ))
    }

    /// The stored form: little endian, the offsets as one run of u32.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = Writer(Vec::with_capacity(self.offsets.len() * 4 + 4096));
        w.0.extend_from_slice(MAGIC);
        w.u64(self.version);
        w.u32(self.shards.len() as u32);
        for s in &self.shards {
            w.str(&s.key);
            w.u64(s.size);
            w.str(&s.version);
            w.u32(s.samples);
            w.u32(s.formats.bits().into());
            w.u64(s.bad_lines);
            w.pairs(&s.skipped);
            w.pairs(&s.lengths);
            w.str(&s.media_root);
            match &s.parquet {
                None => w.u32(0),
                Some(p) => {
                    w.u32(1);
                    w.u32(p.row_groups.len() as u32);
                    p.row_groups.iter().for_each(|&n| w.u32(n));
                    w.str(&p.columns.conversation);
                    w.str(p.columns.images.as_deref().unwrap_or(""));
                    w.str(p.columns.system.as_deref().unwrap_or(""));
                    w.u32(p.image_paths.into());
                }
            }
        }
        w.u64(self.bad_line_count);
        w.u32(self.bad_lines.len() as u32);
        for b in &self.bad_lines {
            w.str(&b.shard);
            w.u32(b.line);
            w.str(&b.reason);
        }
        for o in self.offsets.iter() {
            w.u32(o);
        }
        w.0
    }

    /// Reads the stored form; a truncated or foreign file is an error naming what is wrong,
    /// never a panic or an allocation its length does not back. The offsets stay in `data`.
    pub fn from_bytes(data: impl Into<Bytes>) -> anyhow::Result<Self> {
        let data: Bytes = data.into();
        let mut r = Reader { data: &data, at: 0 };
        anyhow::ensure!(
            r.take(MAGIC.len())? == MAGIC,
            "not a stoker index of this format (rebuild it with `stoker dataset index`)"
        );
        let version = r.u64()?;
        let n = r.u32()? as usize;
        let mut shards = Vec::with_capacity(n.min(r.left() / 28));
        let mut starts = Vec::with_capacity(shards.capacity());
        let mut total = 0u64;
        for _ in 0..n {
            let key = r.str()?;
            // A hand-written index must not name a file outside the dataset.
            check_key(&key).map_err(|why| anyhow::anyhow!("shard key {key:?}: {why}"))?;
            let shard = Shard {
                key,
                size: r.u64()?,
                version: r.str()?,
                samples: r.u32()?,
                formats: Formats::from_bits(r.u32()?)?,
                bad_lines: r.u64()?,
                skipped: r.pairs()?,
                lengths: r.pairs()?,
                media_root: r.str()?,
                parquet: r.parquet()?,
            };
            starts.push(total);
            total += u64::from(shard.samples);
            shards.push(shard);
        }
        let bad_line_count = r.u64()?;
        let listed = r.u32()? as usize;
        let mut bad_lines = Vec::with_capacity(listed.min(r.left() / 12));
        for _ in 0..listed {
            bad_lines.push(BadLine {
                shard: r.str()?,
                line: r.u32()?,
                reason: r.str()?,
            });
        }
        let body = data.slice(r.at..);
        anyhow::ensure!(
            body.len() as u64 == total * 4,
            "the index's shards hold {total} samples but it has {} bytes of offsets",
            body.len()
        );
        let offsets = LeU32s::from_bytes(body);
        Ok(DatasetIndex {
            version,
            shards,
            bad_lines,
            bad_line_count,
            offsets,
            starts,
        })
    }

    /// Reads and validates every shard of the store, telling `progress` how many shard bytes
    /// there are and each shard's size once it is read. Media paths resolve beside their shard,
    /// or under `media_root` (listed once, for the objects present). Shards are parsed in
    /// parallel, each on a blocking thread (a worker indexing at start keeps answering its
    /// probes).
    pub async fn build(
        store: &Store,
        media_root: Option<&MediaRoot>,
        progress: &dyn Progress,
    ) -> anyhow::Result<Self> {
        let columns = ColumnRequest::default();
        Self::build_within(store, media_root, &columns, progress, u64::MAX).await
    }

    /// [`DatasetIndex::build`], Parquet shards' conversation and image columns as `columns`
    /// names them (the usual names for what it does not).
    pub async fn build_with_columns(
        store: &Store,
        media_root: Option<&MediaRoot>,
        columns: &ColumnRequest,
        progress: &dyn Progress,
    ) -> anyhow::Result<Self> {
        Self::build_within(store, media_root, columns, progress, u64::MAX).await
    }

    /// [`DatasetIndex::build`] for a dataset (and media root) of at most `max_objects`
    /// objects each: a larger one is not listed past that, and is a [`NeedsIndex`] error.
    async fn build_within(
        store: &Store,
        media_root: Option<&MediaRoot>,
        columns: &ColumnRequest,
        progress: &dyn Progress,
        max_objects: u64,
    ) -> anyhow::Result<Self> {
        let too_many = || NeedsIndex {
            dataset: store.describe(""),
            max_objects,
        };
        let objects = store
            .list_at_most(max_objects)
            .await?
            .ok_or_else(too_many)?;
        let (shards, others): (Vec<ObjectInfo>, Vec<ObjectInfo>) = objects
            .into_iter()
            .filter(|o| o.key != INDEX_KEY)
            .partition(|o| Framing::of(&o.key).is_some());
        anyhow::ensure!(
            !shards.is_empty(),
            "no .jsonl, .json or .parquet shards under {}",
            store.describe("")
        );
        let media = Arc::new(match media_root {
            None => MediaObjects {
                root: String::new(),
                keys: Some(others.into_iter().map(|o| o.key.into()).collect()),
            },
            Some(m) => {
                drop(others);
                let listed = m.store.list_at_most(max_objects).await?;
                MediaObjects {
                    keys: Some(
                        listed
                            .ok_or_else(too_many)?
                            .into_iter()
                            .map(|o| format!("{}{}", m.uri, o.key).into())
                            .collect(),
                    ),
                    root: m.uri.clone(),
                }
            }
        });
        progress.total(shards.iter().map(|s| s.size).sum());
        let handle = tokio::runtime::Handle::current();
        let parts: Vec<ShardPart> = futures::stream::iter(shards)
            .map(|obj| {
                let (store, media, handle) = (store.clone(), media.clone(), handle.clone());
                let columns = columns.clone();
                async move {
                    let size = obj.size;
                    let part = tokio::task::spawn_blocking(move || {
                        handle.block_on(index_shard(&store, obj, &media, &columns))
                    })
                    .await??;
                    progress.advance(size);
                    anyhow::Ok(part)
                }
            })
            .buffered(SHARD_FETCH_CONCURRENCY)
            .try_collect()
            .await?;
        let version = version_of(&parts, &[]);
        Ok(Self::assemble(parts, version))
    }

    /// Shards no longer as indexed (size or version changed, or gone), by one HEAD per shard
    /// (32 at once), in shard order; empty when all are as they were.
    pub async fn stale_shards(&self, store: &Store) -> anyhow::Result<Vec<StaleShard>> {
        let checks = futures::stream::iter(self.shards.iter().enumerate())
            .map(|(i, s)| async move {
                match store.head(&s.key).await {
                    Ok(now) if now.size == s.size && now.version == s.version => Ok(None),
                    Ok(now) => Ok(Some(StaleShard {
                        shard: i,
                        now: Some(now),
                    })),
                    Err(crate::source::FetchError::NotFound(_)) => Ok(Some(StaleShard {
                        shard: i,
                        now: None,
                    })),
                    Err(e) => Err(anyhow::Error::from(e)),
                }
            })
            .buffered(SHARD_HEAD_CONCURRENCY);
        let stale: Vec<Option<StaleShard>> = checks.try_collect().await?;
        Ok(stale.into_iter().flatten().collect())
    }

    /// What a stale shard is now, for messages.
    pub fn describe(&self, stale: &StaleShard) -> String {
        let was = &self.shards[stale.shard];
        match &stale.now {
            None => format!("{} is gone", was.key),
            Some(now) => format!(
                "{} is {} bytes, version {} (indexed: {} bytes, version {})",
                was.key, now.size, now.version, was.size, was.version
            ),
        }
    }

    /// This index with its `stale` shards (from [`DatasetIndex::stale_shards`]) re-read
    /// alone, the others' entries kept: a gone shard's samples leave it. Re-reading a shard
    /// does not check that its media exist (that needs a listing of them all): a missing one
    /// is a named skip when its sample is served, and the index's version says its media were
    /// not checked, so a worker of this index never shares a plan id with one whose index
    /// `stoker dataset index` built.
    pub async fn with_shards_reindexed(
        &self,
        store: &Store,
        stale: &[StaleShard],
    ) -> anyhow::Result<Self> {
        let mut parts = Vec::with_capacity(self.shards.len());
        let mut unchecked = Vec::new();
        for (i, shard) in self.shards.iter().enumerate() {
            match stale.iter().find(|s| s.shard == i) {
                None => parts.push(self.part(i)),
                Some(StaleShard { now: None, .. }) => {}
                Some(StaleShard { now: Some(now), .. }) => {
                    let media = MediaObjects {
                        root: shard.media_root.clone(),
                        keys: None,
                    };
                    unchecked.push(now.key.clone());
                    let columns = (shard.parquet.as_ref())
                        .map_or_else(ColumnRequest::default, |p| ColumnRequest::from(&p.columns));
                    parts.push(index_shard(store, now.clone(), &media, &columns).await?);
                }
            }
        }
        let version = version_of(&parts, &unchecked);
        Ok(Self::assemble(parts, version))
    }

    /// Shard `i`'s part, as its build gave it.
    fn part(&self, i: usize) -> ShardPart {
        let shard = self.shards[i].clone();
        let ids = self.shard_ids(i);
        let offsets = (ids.start as usize..ids.end as usize)
            .map(|id| self.offsets.get(id))
            .collect();
        let bad = (self.bad_lines.iter())
            .filter(|b| b.shard == shard.key)
            .cloned()
            .collect();
        ShardPart {
            shard,
            offsets,
            bad,
        }
    }

    /// The stored index if its shards are still as indexed (checked shard by shard: the
    /// dataset is never listed) with this media root; with stale shards, the index with those
    /// re-read alone. Without an index (or for another media root) a fresh one, but only of a
    /// dataset of at most `max_objects` objects: a larger one is a [`NeedsIndex`] error
    /// (listing it and reading every shard on every worker is what `stoker dataset index`
    /// does once). Shards added after indexing are served once `stoker dataset index` runs
    /// again.
    pub async fn load_or_build(
        store: &Store,
        media_root: Option<&MediaRoot>,
        max_objects: u64,
    ) -> anyhow::Result<Self> {
        let root = media_root.map_or("", |m| m.uri.as_str());
        let at = store.describe(INDEX_KEY);
        match store.get_at_most(INDEX_KEY, INDEX_CAP).await {
            Ok(data) => {
                let idx = Self::from_bytes(data).map_err(|e| e.context(at.clone()))?;
                match idx.shards.iter().find(|s| s.media_root != root) {
                    Some(s) => tracing::warn!(
                        "{at} is stale (its media root is {:?}, not {root:?}); re-indexing",
                        s.media_root
                    ),
                    None => {
                        let stale = idx.stale_shards(store).await?;
                        if stale.is_empty() {
                            return Ok(idx);
                        }
                        let named: Vec<String> = stale.iter().map(|s| idx.describe(s)).collect();
                        tracing::warn!(
                            "{at} is stale ({}); re-reading {} of its {} shards (their media \
                             are checked when served; `stoker dataset index` checks them all)",
                            named.join("; "),
                            stale.len(),
                            idx.shards.len()
                        );
                        return idx.with_shards_reindexed(store, &stale).await;
                    }
                }
            }
            Err(crate::source::FetchError::NotFound(_)) => tracing::warn!(
                "{at} does not exist; indexing (run `stoker dataset index` once, so that workers start without reading every shard)"
            ),
            Err(e) => return Err(e.into()),
        }
        let columns = ColumnRequest::default();
        Self::build_within(store, media_root, &columns, &(), max_objects).await
    }

    /// The media roots its shards' paths resolve under (none: all beside their shards).
    pub fn media_roots(&self) -> Vec<&str> {
        let mut roots: Vec<&str> = self
            .shards
            .iter()
            .map(|s| s.media_root.as_str())
            .filter(|r| !r.is_empty())
            .collect();
        roots.sort_unstable();
        roots.dedup();
        roots
    }
}

struct Writer(Vec<u8>);

impl Writer {
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.0.extend_from_slice(s.as_bytes());
    }
    fn pairs(&mut self, v: &[(u32, u32)]) {
        self.u32(v.len() as u32);
        for &(a, b) in v {
            self.u32(a);
            self.u32(b);
        }
    }
}

struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn left(&self) -> usize {
        self.data.len() - self.at
    }
    fn take(&mut self, n: usize) -> anyhow::Result<&'a [u8]> {
        anyhow::ensure!(
            n <= self.left(),
            "the index is cut short at byte {}",
            self.at
        );
        self.at += n;
        Ok(&self.data[self.at - n..self.at])
    }
    fn u32(&mut self) -> anyhow::Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into()?))
    }
    fn u64(&mut self) -> anyhow::Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into()?))
    }
    fn str(&mut self) -> anyhow::Result<String> {
        let n = self.u32()? as usize;
        Ok(String::from_utf8(self.take(n)?.to_vec())?)
    }
    fn parquet(&mut self) -> anyhow::Result<Option<ParquetShard>> {
        match self.u32()? {
            0 => return Ok(None),
            1 => {}
            other => anyhow::bail!("unknown shard kind {other} at byte {}", self.at),
        }
        let n = self.u32()? as usize;
        let groups = self.take(n.saturating_mul(4))?;
        let row_groups = groups
            .chunks_exact(4)
            .map(|g| u32::from_le_bytes(g.try_into().expect("4 bytes")))
            .collect();
        let optional = |s: String| (!s.is_empty()).then_some(s);
        Ok(Some(ParquetShard {
            row_groups,
            columns: Columns {
                conversation: self.str()?,
                images: optional(self.str()?),
                system: optional(self.str()?),
            },
            image_paths: self.u32()? != 0,
        }))
    }
    fn pairs(&mut self) -> anyhow::Result<Vec<(u32, u32)>> {
        let n = self.u32()? as usize;
        let bytes = self.take(n.saturating_mul(8))?;
        Ok(bytes
            .chunks_exact(8)
            .map(|p| {
                let (a, b) = p.split_at(4);
                (
                    u32::from_le_bytes(a.try_into().expect("4 bytes")),
                    u32::from_le_bytes(b.try_into().expect("4 bytes")),
                )
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::sample::Conversation;
    use crate::dataset::shard::ShardLines;

    fn object(key: &str, data: &[u8]) -> ObjectInfo {
        ObjectInfo {
            key: key.into(),
            size: data.len() as u64,
            version: "1".into(),
        }
    }

    /// A dataset with no media objects: every media path names a missing object.
    fn no_media() -> MediaObjects {
        MediaObjects {
            root: String::new(),
            keys: Some(Default::default()),
        }
    }

    /// One shard named `key` holding `data`, fed in chunks of `chunk` bytes, read.
    fn read_shard(key: &str, data: &[u8], chunk: usize) -> anyhow::Result<ShardPart> {
        let (obj, media) = (object(key, data), no_media());
        let mut lines = ShardLines::new(&obj, &media);
        data.chunks(chunk).for_each(|c| lines.feed(c));
        lines.finish()
    }

    /// An index of one JSONL shard holding `data`, fed in chunks of `chunk` bytes.
    fn index_of(data: &[u8], chunk: usize) -> DatasetIndex {
        DatasetIndex::assemble(vec![read_shard("s.jsonl", data, chunk).unwrap()], 0)
    }

    fn lines(idx: &DatasetIndex) -> Vec<SampleLine> {
        (0..idx.num_samples())
            .map(|id| idx.locate(id).unwrap().1)
            .collect()
    }

    const GOOD: &[u8] =
        br#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"}]}"#;

    #[test]
    fn shard_lines_are_indexed_and_bad_ones_reported() {
        let data = b"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"},{\"role\":\"assistant\",\"content\":\"yo\"}]}\n\
not json\n\
\n\
{\"image\":\"../x.jpg\",\"conversations\":[{\"from\":\"human\",\"value\":\"<image>\"},{\"from\":\"gpt\",\"value\":\"a\"}]}\n\
{\"image\":\"gone.jpg\",\"conversations\":[{\"from\":\"human\",\"value\":\"<image>\"},{\"from\":\"gpt\",\"value\":\"a\"}]}\n";
        let idx = index_of(data, data.len());
        assert_eq!(idx.num_samples(), 1);
        assert_eq!(idx.locate(0).unwrap().1.line, 1);
        let bad = &idx.bad_lines;
        let where_: Vec<(u32, bool)> = bad
            .iter()
            .map(|b| {
                (
                    b.line,
                    b.to_string().starts_with(&format!("s.jsonl:{}:", b.line)),
                )
            })
            .collect();
        assert_eq!(where_, vec![(2, true), (4, true), (5, true)]);
        assert_eq!(idx.bad_line_count, 3);
        assert!(bad[1].reason.contains("escapes the dataset root"));
        assert!(bad[2].reason.contains("does not exist"));
    }

    /// How a shard arrives in chunks changes nothing; a line over the index's limit is a bad
    /// line named with its length, and the lines after it keep their offsets, numbers and
    /// lengths (a CRLF line keeps its `\r`).
    #[test]
    fn chunking_changes_nothing_and_long_lines_are_named() {
        let long = vec![b' '; MAX_INDEXED_LINE_BYTES as usize + 1];
        let mut data = Vec::new();
        for part in [GOOD, b"\r\n", &long, b"\n\n", GOOD, b"\n", GOOD] {
            data.extend_from_slice(part);
        }
        let idx = index_of(&data, data.len());
        let g = GOOD.len() as u64;
        let long_end = g + 2 + long.len() as u64 + 1;
        let at = |line, offset, len| SampleLine { line, offset, len };
        assert_eq!(
            lines(&idx),
            vec![
                at(1, 0, g + 1),
                at(4, long_end + 1, g),
                at(5, long_end + 1 + g + 1, g)
            ]
        );
        assert_eq!(idx.bad_lines.len(), 1);
        assert_eq!(idx.bad_lines[0].line, 2);
        assert!(
            idx.bad_lines[0]
                .reason
                .contains("sample of 16777217 bytes is over"),
            "{}",
            idx.bad_lines[0]
        );
        for chunk in [1 << 20, 4096, 7] {
            let again = index_of(&data, chunk);
            assert_eq!(lines(&again), lines(&idx), "chunks of {chunk}");
            assert_eq!(again.bad_lines, idx.bad_lines, "chunks of {chunk}");
        }
        // Two exceptions only: the line before the long one, and the last (no newline).
        assert_eq!(idx.shards[0].lengths.len(), 2);
        assert_eq!(idx.shards[0].skipped, vec![(1, 2)]);
    }

    /// Every sample's line read back through `locate` is exactly the valid line, whatever
    /// mix of blank, bad and CRLF lines surrounds it; the stored form reads back the same.
    #[test]
    fn locate_gives_each_line_exactly_and_the_stored_form_round_trips() {
        let mut data = Vec::new();
        let mut want = Vec::new();
        for i in 0..200u32 {
            let start = data.len() as u64;
            match i % 7 {
                0 => data.extend_from_slice(b"\n"),
                1 => data.extend_from_slice(b"{broken\n"),
                _ => {
                    data.extend_from_slice(GOOD);
                    let crlf = i % 5 == 0;
                    want.push((i, start, GOOD.len() as u64 + u64::from(crlf)));
                    data.extend_from_slice(if crlf { b"\r\n" } else { b"\n" });
                }
            }
        }
        let idx = index_of(&data, 13);
        let got: Vec<(u32, u64, u64)> = lines(&idx)
            .iter()
            .map(|l| (l.line - 1, l.offset, l.len))
            .collect();
        assert_eq!(got, want);
        for l in lines(&idx) {
            let text = &data[l.offset as usize..(l.offset + l.len) as usize];
            assert!(Conversation::parse(text).is_ok());
        }
        let back = DatasetIndex::from_bytes(idx.to_bytes()).unwrap();
        assert_eq!(lines(&back), lines(&idx));
        assert_eq!(back.bad_lines, idx.bad_lines);
        assert_eq!(back.bad_line_count, idx.bad_line_count);
        assert_eq!(back.shards, idx.shards);
        // About 4 bytes per sample: the sparse exceptions are a few per shard.
        assert!(idx.resident_bytes() < idx.num_samples() * 4 + 1024);
        // A cut or foreign file is an error, not a panic.
        let bytes = idx.to_bytes();
        for cut in [0, 5, 20, bytes.len() - 1] {
            assert!(
                DatasetIndex::from_bytes(bytes[..cut].to_vec()).is_err(),
                "cut at {cut}"
            );
        }
        let e = DatasetIndex::from_bytes(&b"{\"format\":1}"[..]).unwrap_err();
        assert!(e.to_string().contains("not a stoker index"), "{e}");
    }

    #[test]
    fn locate_maps_ids_across_shards_and_concat_prefixes_keys() {
        let shard = |key: &str, n: usize| {
            let data: Vec<u8> = std::iter::repeat_n([GOOD, b"\n"].concat(), n)
                .flatten()
                .collect();
            let (obj, media) = (object(key, &data), no_media());
            let mut lines = ShardLines::new(&obj, &media);
            lines.feed(&data);
            lines.finish().unwrap()
        };
        let idx = DatasetIndex::assemble(vec![shard("a", 3), shard("b", 0), shard("c", 2)], 0);
        assert_eq!(idx.num_samples(), 5);
        assert_eq!(idx.locate(2).unwrap().0.key, "a");
        let (s, l) = idx.locate(3).unwrap();
        assert_eq!((s.key.as_str(), l.line), ("c", 1));
        assert!(idx.locate(5).is_none());
        let both = DatasetIndex::concat(vec![("x/".into(), idx.clone()), ("y/".into(), idx)]);
        assert_eq!(both.num_samples(), 10);
        let (s, l) = both.locate(8).unwrap();
        assert_eq!((s.key.as_str(), l.line), ("y/c", 1));
    }

    /// A JSON array file (LLaMA-Factory's `mllm_demo.json`, pretty-printed): each element is a
    /// sample at its own byte range and line, read back exactly through `locate`, whatever
    /// the chunking; a bad element is named by the line it starts on.
    #[test]
    fn a_json_array_shard_indexes_each_element() {
        let elements = [
            r#"{"messages": [{"role": "user", "content": "a, [b] {c} \"q\" \\"}, {"role": "assistant", "content": "x"}]}"#,
            "{\n    \"messages\": [\n      {\"role\": \"user\", \"content\": \"hi\"},\n      {\"role\": \"assistant\", \"content\": \"yo\"}\n    ]\n  }",
            r#"{"messages": [{"role": "user", "content": "no answer"}]}"#,
            r#"{"messages":[{"role":"user","content":"]"},{"role":"assistant","content":"}"}]}"#,
        ];
        let mut data = b"\n[\n  ".to_vec();
        let mut want = Vec::new(); // (line, offset, len) of the valid ones
        let mut bad_line = 0;
        for (i, e) in elements.iter().enumerate() {
            let line = 3 + data[5..].iter().filter(|&&b| b == b'\n').count() as u32;
            match i {
                2 => bad_line = line,
                _ => want.push((line, data.len() as u64, e.len() as u64)),
            }
            data.extend_from_slice(e.as_bytes());
            data.extend_from_slice(if i + 1 < elements.len() {
                b",\n  "
            } else {
                b"\n]\n"
            });
        }
        let idx = DatasetIndex::assemble(
            vec![read_shard("d/demo.json", &data, data.len()).unwrap()],
            0,
        );
        let got: Vec<(u32, u64, u64)> = lines(&idx)
            .iter()
            .map(|l| (l.line, l.offset, l.len))
            .collect();
        assert_eq!(got, want);
        for l in lines(&idx) {
            let text = &data[l.offset as usize..(l.offset + l.len) as usize];
            assert!(
                Conversation::parse(text).is_ok(),
                "{}",
                String::from_utf8_lossy(text)
            );
        }
        assert_eq!(idx.bad_lines.len(), 1);
        assert_eq!(bad_line, 10);
        assert_eq!(idx.bad_lines[0].line, bad_line, "{}", idx.bad_lines[0]);
        assert!(idx.bad_lines[0].reason.contains("no assistant turn"));
        assert_eq!(idx.shards[0].format_name(), "llamafactory-openai");
        assert_eq!(idx.shards[0].bad_lines, 1);
        for chunk in [1, 2, 7, 64, 4096] {
            let again =
                DatasetIndex::assemble(vec![read_shard("d/demo.json", &data, chunk).unwrap()], 0);
            assert_eq!(lines(&again), lines(&idx), "chunks of {chunk}");
            assert_eq!(again.bad_lines, idx.bad_lines, "chunks of {chunk}");
        }
        let back = DatasetIndex::from_bytes(idx.to_bytes()).unwrap();
        assert_eq!(lines(&back), lines(&idx));
        assert_eq!(back.shards, idx.shards);
        // An empty array is a shard without samples.
        let empty = read_shard("e.json", b" [ ] ", 1).unwrap();
        assert_eq!(empty.shard.samples(), 0);
        assert_eq!(empty.shard.format_name(), "none");
    }

    /// A .json file that is not one array of samples is refused whole, naming where.
    #[test]
    fn a_broken_json_array_shard_is_refused_naming_where() {
        let err = |data: &[u8]| {
            let e = read_shard("d/x.json", data, 3).err().expect("refused");
            let e = e.to_string();
            assert!(e.starts_with("d/x.json: "), "{e}");
            e
        };
        let one = String::from_utf8(GOOD.to_vec()).unwrap();
        assert!(err(GOOD).contains("must be a JSON array of samples"));
        assert!(err(format!("[{one}, {one}").as_bytes()).contains("ends without its `]`"));
        assert!(err(format!("[{one}, {one}] x").as_bytes()).contains("data after the array"));
        assert!(err(format!("[{one} {one}]").as_bytes()).contains("expected `,` or `]`"));
        assert!(err(format!("[{one},]").as_bytes()).contains("a comma before"));
        assert!(Framing::of("data/dataset_info.json").is_none());
        assert_eq!(Framing::of("data/mllm_demo.json"), Some(Framing::Array));
        assert_eq!(Framing::of("a/b.jsonl"), Some(Framing::Lines));
        assert!(Framing::of("a/b.jpg").is_none());
    }

    /// One shard, one format: a shard mixing two is refused naming both lines and their keys;
    /// one with no sample in any known format names the keys it saw. Text-only lines join
    /// whichever format the shard's media lines show.
    #[test]
    fn a_shard_holds_one_format() {
        let llava = r#"{"image": "a.jpg", "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}]}"#;
        let sharegpt = r#"{"images": ["a.jpg"], "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}]}"#;
        let plain = r#"{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]}"#;
        let shard = |lines: &[&str]| {
            let obj = object("s.jsonl", lines.join("\n").as_bytes());
            let media = MediaObjects {
                root: String::new(),
                keys: Some(["a.jpg".into()].into_iter().collect()),
            };
            let mut reader = ShardLines::new(&obj, &media);
            reader.feed(lines.join("\n").as_bytes());
            reader.finish()
        };
        let ok = shard(&[plain, llava, plain]).unwrap();
        assert_eq!(ok.shard.format_name(), "llava");
        assert_eq!(
            shard(&[plain, plain]).unwrap().shard.format_name(),
            "llamafactory-sharegpt"
        );
        let e = shard(&[plain, llava, sharegpt]).err().unwrap().to_string();
        assert!(
            e.contains("s.jsonl mixes dataset formats: line 1 is llava (keys: conversations)")
                && e.contains("line 3 is llamafactory-sharegpt (keys: conversations, images)"),
            "{e}"
        );
        let e = shard(&[r#"{"instruction": "hi", "output": "yo"}"#])
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("s.jsonl: no sample in a dataset format")
                && e.contains("keys: instruction, output"),
            "{e}"
        );
        // Beside valid samples, an unknown line is one bad line.
        let mixed = shard(&[plain, r#"{"text": "x"}"#]).unwrap();
        assert_eq!(mixed.shard.bad_lines, 1);
        assert!(mixed.bad[0].reason.contains("(keys: text)"));
    }
}
