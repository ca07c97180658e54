//! The dataset index: every valid JSONL line of every shard, addressable by sample id.
//!
//! Building it streams each shard once, parses and validates every line (JSON, schema, image
//! paths inside the root and present in the store) and records the bad ones as shard:line
//! with the reason. Sample ids number the valid lines in (shard key, line) order. Memory is a
//! chunk and one line per shard being read, whatever the shards' sizes: a line longer than
//! [`MAX_INDEXED_LINE_BYTES`] is a bad line, never held whole.

use super::sample::Conversation;
use crate::source::{resolve_relative, ObjectInfo, Store};
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;

/// Where `stoker dataset index` writes the index, at the dataset root.
pub const INDEX_KEY: &str = "stoker-index.json";
const FORMAT: u32 = 1;
/// Shards read at once while indexing.
const SHARD_FETCH_CONCURRENCY: usize = 8;
/// The longest line the index takes; a worker's `max-line-bytes` (default 4 MiB) may only
/// lower it.
pub const MAX_INDEXED_LINE_BYTES: u64 = 16 << 20;

/// Where a long index build reports how far it got (the CLI draws a bar; `()` ignores it).
pub trait Progress: Sync {
    /// The amount of work there is.
    fn total(&self, _amount: u64) {}
    /// `amount` more is done.
    fn advance(&self, _amount: u64) {}
}

impl Progress for () {}

/// A valid line: 1-based line number, byte offset and length (without the newline).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineRef(pub u32, pub u64, pub u32);

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShardIndex {
    pub key: String,
    pub size: u64,
    pub version: String,
    pub lines: Vec<LineRef>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BadLine {
    pub shard: String,
    pub line: u32,
    pub reason: String,
}

impl std::fmt::Display for BadLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}: {}", self.shard, self.line, self.reason)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DatasetIndex {
    pub format: u32,
    /// Fingerprint of the shards (keys, sizes, versions): changes when the data does.
    pub version: u64,
    pub shards: Vec<ShardIndex>,
    pub bad_lines: Vec<BadLine>,
    #[serde(skip)]
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

impl DatasetIndex {
    fn finish(mut self) -> Self {
        let mut acc = 0;
        self.starts = self
            .shards
            .iter()
            .map(|s| {
                let start = acc;
                acc += s.lines.len() as u64;
                start
            })
            .collect();
        self
    }

    /// Several datasets' indexes as one, for a store rooted at their common folder: each
    /// part's shard keys get its folder relative to that root (`prefix`, empty or ending in
    /// '/'), its sample ids follow the previous part's.
    pub fn concat(parts: Vec<(String, DatasetIndex)>) -> DatasetIndex {
        let (mut versions, mut shards, mut bad_lines) = (Vec::new(), Vec::new(), Vec::new());
        for (prefix, part) in parts {
            versions.push(format!("{prefix}\0{}", part.version).into_bytes());
            shards.extend(part.shards.into_iter().map(|s| ShardIndex {
                key: format!("{prefix}{}", s.key),
                ..s
            }));
            bad_lines.extend(part.bad_lines.into_iter().map(|b| BadLine {
                shard: format!("{prefix}{}", b.shard),
                ..b
            }));
        }
        Self::assemble(shards, bad_lines, &versions)
    }

    /// An index of these shards, its version the fingerprint of `parts`.
    fn assemble(shards: Vec<ShardIndex>, bad_lines: Vec<BadLine>, parts: &[Vec<u8>]) -> Self {
        DatasetIndex {
            format: FORMAT,
            version: fingerprint(parts),
            shards,
            bad_lines,
            starts: Vec::new(),
        }
        .finish()
    }

    pub fn num_samples(&self) -> u64 {
        self.shards.iter().map(|s| s.lines.len() as u64).sum()
    }

    /// The shard and line of a sample id.
    pub fn locate(&self, sample_id: u64) -> Option<(&ShardIndex, LineRef)> {
        let i = self
            .starts
            .partition_point(|&s| s <= sample_id)
            .checked_sub(1)?;
        let shard = &self.shards[i];
        let line = *shard.lines.get((sample_id - self.starts[i]) as usize)?;
        Some((shard, line))
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("index serializes")
    }

    pub fn from_json(data: &[u8]) -> anyhow::Result<Self> {
        let idx: DatasetIndex = serde_json::from_slice(data)?;
        anyhow::ensure!(
            idx.format == FORMAT,
            "index format {} is not {FORMAT}",
            idx.format
        );
        Ok(idx.finish())
    }

    /// Reads and validates every shard of the store, telling `progress` how many shard bytes
    /// there are and each shard's size once it is read.
    pub async fn build(store: &Store, progress: &dyn Progress) -> anyhow::Result<Self> {
        let objects = store.list().await?;
        let keys: HashSet<&str> = objects.iter().map(|o| o.key.as_str()).collect();
        let shards: Vec<&ObjectInfo> = objects
            .iter()
            .filter(|o| o.key.ends_with(".jsonl"))
            .collect();
        anyhow::ensure!(
            !shards.is_empty(),
            "no .jsonl shards under {}",
            store.describe("")
        );
        progress.total(shards.iter().map(|s| s.size).sum());
        let keys = &keys;
        let results: Vec<(ShardIndex, Vec<BadLine>)> = futures::stream::iter(shards)
            .map(|obj| async move {
                let lines = store
                    .fold_chunks(
                        &obj.key,
                        || ShardLines::new(obj, keys),
                        |lines, chunk| lines.feed(chunk),
                    )
                    .await?;
                progress.advance(obj.size);
                lines.finish()
            })
            .buffered(SHARD_FETCH_CONCURRENCY)
            .try_collect()
            .await?;
        let (mut parts, mut shards, mut bad_lines) = (Vec::new(), Vec::new(), Vec::new());
        for (shard, bad) in results {
            parts.push(format!("{}\0{}\0{}", shard.key, shard.size, shard.version).into_bytes());
            shards.push(shard);
            bad_lines.extend(bad);
        }
        Ok(Self::assemble(shards, bad_lines, &parts))
    }

    /// The stored index if it still describes the store's shards, else a fresh one.
    pub async fn load_or_build(store: &Store) -> anyhow::Result<Self> {
        if let Ok(data) = store.get(INDEX_KEY).await {
            let idx = Self::from_json(&data)?;
            let current: Vec<ObjectInfo> = store.list().await?;
            let fresh = idx.shards.iter().all(|s| {
                current
                    .iter()
                    .any(|o| o.key == s.key && o.size == s.size && o.version == s.version)
            }) && current.iter().filter(|o| o.key.ends_with(".jsonl")).count()
                == idx.shards.len();
            if fresh {
                return Ok(idx);
            }
            tracing::warn!(
                "{} is stale (shards changed); re-indexing",
                store.describe(INDEX_KEY)
            );
        }
        Self::build(store, &()).await
    }
}

/// Splits a shard, fed chunk by chunk, into lines and validates each.
struct ShardLines<'a> {
    obj: &'a ObjectInfo,
    keys: &'a HashSet<&'a str>,
    /// The current line so far; empty while `over_limit`.
    line: Vec<u8>,
    over_limit: bool,
    /// Offset of the current line's first byte, and of the next byte fed.
    line_start: u64,
    offset: u64,
    /// 1-based number of the current line.
    line_no: u64,
    lines: Vec<LineRef>,
    bad: Vec<BadLine>,
}

impl<'a> ShardLines<'a> {
    fn new(obj: &'a ObjectInfo, keys: &'a HashSet<&'a str>) -> Self {
        ShardLines {
            obj,
            keys,
            line: Vec::new(),
            over_limit: false,
            line_start: 0,
            offset: 0,
            line_no: 1,
            lines: Vec::new(),
            bad: Vec::new(),
        }
    }

    fn feed(&mut self, mut chunk: &[u8]) {
        while let Some(i) = chunk.iter().position(|&b| b == b'\n') {
            self.extend(&chunk[..i]);
            self.end_line();
            self.offset += 1;
            self.line_start = self.offset;
            chunk = &chunk[i + 1..];
        }
        self.extend(chunk);
    }

    fn extend(&mut self, part: &[u8]) {
        self.offset += part.len() as u64;
        if self.over_limit {
            return;
        }
        if (self.line.len() + part.len()) as u64 > MAX_INDEXED_LINE_BYTES {
            self.over_limit = true;
            self.line = Vec::new();
            return;
        }
        self.line.extend_from_slice(part);
    }

    fn end_line(&mut self) {
        let line_no = self.line_no as u32;
        let verdict = if self.over_limit {
            Err(format!(
                "line of {} bytes is over the index's limit of {MAX_INDEXED_LINE_BYTES}",
                self.offset - self.line_start
            ))
        } else {
            let line = self.line.strip_suffix(b"\r").unwrap_or(&self.line);
            if line.iter().all(u8::is_ascii_whitespace) {
                Ok(None)
            } else {
                validate_line(&self.obj.key, line, self.keys)
                    .map(|()| Some(LineRef(line_no, self.line_start, line.len() as u32)))
            }
        };
        match verdict {
            Ok(Some(line)) => self.lines.push(line),
            Ok(None) => {}
            Err(reason) => self.bad.push(BadLine {
                shard: self.obj.key.clone(),
                line: line_no,
                reason,
            }),
        }
        self.line.clear();
        self.over_limit = false;
        self.line_no += 1;
    }

    /// The valid lines and the bad ones, once the last chunk is fed.
    fn finish(mut self) -> anyhow::Result<(ShardIndex, Vec<BadLine>)> {
        if self.over_limit || !self.line.is_empty() {
            self.end_line();
        }
        anyhow::ensure!(
            self.line_no <= u32::MAX as u64,
            "{}: more than {} lines in one shard; split it",
            self.obj.key,
            u32::MAX
        );
        let shard = ShardIndex {
            key: self.obj.key.clone(),
            size: self.obj.size,
            version: self.obj.version.clone(),
            lines: self.lines,
        };
        Ok((shard, self.bad))
    }
}

fn validate_line(shard: &str, line: &[u8], keys: &HashSet<&str>) -> Result<(), String> {
    let conv = Conversation::parse(line).map_err(|e| e.to_string())?;
    for path in conv.image_paths() {
        let key = resolve_relative(shard, path).map_err(|e| e.to_string())?;
        if !keys.contains(key.as_str()) {
            return Err(format!("image {path:?} (key {key}) does not exist"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_lines_are_indexed_and_bad_ones_reported() {
        let data = b"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"},{\"role\":\"assistant\",\"content\":\"yo\"}]}\n\
not json\n\
\n\
{\"image\":\"../x.jpg\",\"conversations\":[{\"from\":\"human\",\"value\":\"<image>\"},{\"from\":\"gpt\",\"value\":\"a\"}]}\n\
{\"image\":\"gone.jpg\",\"conversations\":[{\"from\":\"human\",\"value\":\"<image>\"},{\"from\":\"gpt\",\"value\":\"a\"}]}\n";
        let obj = ObjectInfo {
            key: "s.jsonl".into(),
            size: data.len() as u64,
            version: "1".into(),
        };
        let keys = HashSet::new();
        let mut lines = ShardLines::new(&obj, &keys);
        lines.feed(data);
        let (shard, bad) = lines.finish().unwrap();
        assert_eq!(shard.lines.len(), 1);
        assert_eq!(shard.lines[0].0, 1);
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
        assert!(bad[1].reason.contains("escapes the dataset root"));
        assert!(bad[2].reason.contains("does not exist"));
    }

    /// How a shard arrives in chunks changes nothing; a line over the index's limit is a bad
    /// line named with its length, and the lines after it keep their offsets.
    #[test]
    fn chunking_changes_nothing_and_long_lines_are_named() {
        let good =
            br#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"}]}"#;
        let long = vec![b' '; MAX_INDEXED_LINE_BYTES as usize + 1];
        let mut data = Vec::new();
        for part in [&good[..], b"\r\n", &long, b"\n\n", good, b"\n", good] {
            data.extend_from_slice(part);
        }
        let obj = ObjectInfo {
            key: "s.jsonl".into(),
            size: data.len() as u64,
            version: "1".into(),
        };
        let keys = HashSet::new();
        let index_in = |chunk: usize| {
            let mut lines = ShardLines::new(&obj, &keys);
            data.chunks(chunk).for_each(|c| lines.feed(c));
            let (shard, bad) = lines.finish().unwrap();
            (shard.lines, bad)
        };
        let (lines, bad) = index_in(data.len());
        let g = good.len() as u64;
        let long_end = g + 2 + long.len() as u64 + 1;
        assert_eq!(
            lines,
            vec![
                LineRef(1, 0, g as u32),
                LineRef(4, long_end + 1, g as u32),
                LineRef(5, long_end + 1 + g + 1, g as u32)
            ]
        );
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].line, 2);
        assert!(
            bad[0].reason.contains("line of 16777217 bytes is over"),
            "{}",
            bad[0]
        );
        for chunk in [1 << 20, 4096, 7] {
            assert_eq!(
                index_in(chunk),
                (lines.clone(), bad.clone()),
                "chunks of {chunk}"
            );
        }
    }

    #[test]
    fn locate_maps_ids_across_shards() {
        let shard = |key: &str, n: u32| ShardIndex {
            key: key.into(),
            size: 0,
            version: String::new(),
            lines: (0..n).map(|i| LineRef(i + 1, i as u64 * 10, 9)).collect(),
        };
        let idx = DatasetIndex {
            format: FORMAT,
            version: 0,
            shards: vec![shard("a", 3), shard("b", 0), shard("c", 2)],
            bad_lines: vec![],
            starts: vec![],
        }
        .finish();
        assert_eq!(idx.num_samples(), 5);
        assert_eq!(idx.locate(2).unwrap().0.key, "a");
        let (s, l) = idx.locate(3).unwrap();
        assert_eq!((s.key.as_str(), l.0), ("c", 1));
        assert!(idx.locate(5).is_none());
    }
}
