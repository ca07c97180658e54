//! Reading a sample: its text (a JSONL line through the line cache, or a Parquet row) and
//! its media (read from the store, or embedded in the row).

use super::{Fetched, MediaKey, Pipeline};
use crate::byte_budget::ByteBudget;
use crate::dataset::index::Shard;
use crate::dataset::parquet::{read_row, ParquetShard, ReadRange, Row, RowImage, StoreFile};
use crate::dataset::sample::{Conversation, Media, SampleError, VideoSource};
use crate::failure::Cause;
use crate::line_cache::{Lookup, Span};
use crate::metrics::LineCacheResult;
use crate::source::FetchError;
use bytes::Bytes;
use futures::FutureExt;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// Parquet files whose metadata a worker keeps (then it starts over): a file's footer and page
/// index, read once rather than per sample.
pub(super) const PARQUET_FILES_CACHED: usize = 1024;

impl Pipeline {
    /// Bytes `line` (offset, length) of a shard: from a span the line cache holds, else read
    /// with `span`. A JSONL line, or a Parquet page.
    async fn read_line(
        self: &Arc<Self>,
        shard_key: &str,
        line: (u64, u64),
        span: Span,
    ) -> Result<Bytes, FetchError> {
        let read_span = |start, len| {
            let (this, key) = (self.clone(), shard_key.to_string());
            async move { this.fetch(&key, Some((start, len)), None).await }.boxed()
        };
        let (line, lookup) = self
            .line_cache
            .line(shard_key, span, line, read_span)
            .await?;
        self.metrics.line_cache(match lookup {
            Lookup::Hit => LineCacheResult::Hit,
            Lookup::Miss => LineCacheResult::Miss,
        });
        Ok(line)
    }

    /// A sample's conversation and its images' and videos' keys, limits checked: from its
    /// JSONL line, or its Parquet row (whose embedded images come with it).
    pub(super) async fn read_sample(
        self: &Arc<Self>,
        shard: &Shard,
        line: (u64, u64),
        span: Span,
    ) -> Result<(Conversation, Vec<MediaKey>), Cause> {
        let (text, row) = match &shard.parquet {
            Some(layout) => {
                let mut row = self.read_row(shard, layout, line.0).await?;
                self.config.limits.check_line(row.json.len() as u64)?;
                (Bytes::from(std::mem::take(&mut row.json)), Some(row))
            }
            None => {
                self.config.limits.check_line(line.1)?;
                (self.read_line(&shard.key, line, span).await?, None)
            }
        };
        let conv = Conversation::parse(&text)?;
        self.config.limits.check_conversation(&conv)?;
        let key = |p: &str| shard.media_key(p);
        let image = |p: &str| -> Result<MediaKey, Cause> {
            let Some(row) = &row else {
                return Ok(MediaKey::Image(key(p)?));
            };
            match row.image(p) {
                None => Ok(MediaKey::Image(key(p)?)),
                Some(Ok(RowImage::Path(path))) => Ok(MediaKey::Image(key(path)?)),
                Some(Ok(RowImage::Bytes(b))) => Ok(MediaKey::Embedded(
                    Row::image_name(&shard.key, line.0, p),
                    b.clone(),
                )),
                Some(Err(e)) => Err(SampleError::Parquet(e).into()),
            }
        };
        let keys = conv
            .media()
            .map(|m| {
                Ok(match m {
                    Media::Image(p) => image(p)?,
                    Media::Video(v) => match &v.video {
                        VideoSource::Clip(p) => MediaKey::Clip(key(p)?, v.clone()),
                        VideoSource::Frames(ps) => MediaKey::Frames(
                            ps.iter().map(|p| key(p)).collect::<Result<_, _>>()?,
                            v.clone(),
                        ),
                    },
                })
            })
            .collect::<Result<Vec<_>, Cause>>()?;
        Ok((conv, keys))
    }

    /// Row `row` of a Parquet shard: its metadata from the cache (read once per file), its
    /// pages through the line cache.
    async fn read_row(
        self: &Arc<Self>,
        shard: &Shard,
        layout: &ParquetShard,
        row: u64,
    ) -> Result<Row, Cause> {
        let at = layout.group_of(row).ok_or_else(|| {
            SampleError::Parquet(format!(
                "{}: no row {row} in the indexed row groups",
                shard.key
            ))
        })?;
        let cached = self
            .parquet_files
            .lock()
            .expect("parquet files")
            .get(&shard.key)
            .cloned();
        let meta = match cached {
            Some(m) => m,
            None => {
                let meta = self.parquet_file(shard).load_metadata().await?;
                let mut files = self.parquet_files.lock().expect("parquet files");
                if files.len() >= PARQUET_FILES_CACHED {
                    files.clear();
                }
                files.insert(shard.key.clone(), meta.clone());
                meta
            }
        };
        Ok(read_row(self.parquet_file(shard), meta, layout, at).await?)
    }

    /// A Parquet shard as arrow-rs reads it: each range through the line cache (a request's
    /// rows of one page read it once), at most `max-object-bytes` at once.
    fn parquet_file(self: &Arc<Self>, shard: &Shard) -> StoreFile {
        let (this, key) = (self.clone(), shard.key.clone());
        let read: ReadRange = Arc::new(move |start, len| {
            let (this, key) = (this.clone(), key.clone());
            async move {
                let span = Span { start, len };
                this.read_line(&key, (start, len), span).await
            }
            .boxed()
        });
        let max = (self.config.limits.object_bytes, "max-object-bytes");
        StoreFile::new(self.store.describe(&shard.key), shard.size, read, max)
    }

    /// An embedded image taken into a sample's byte budget, as a read image is.
    fn embedded_within(&self, name: &str, bytes: &Bytes, budget: &ByteBudget) -> Result<(), Cause> {
        let (len, max) = (bytes.len() as u64, self.config.limits.object_bytes);
        if len > max {
            return Err(FetchError::TooLarge {
                what: name.to_string(),
                len,
                max,
                limit: "max-object-bytes",
            }
            .into());
        }
        let mut claim = budget.claim();
        claim
            .grow_to(len)
            .map_err(|over| FetchError::OverByteBudget {
                max: over.max,
                limit: "max-sample-bytes",
            })?;
        claim.keep();
        Ok(())
    }

    /// Every object of a sample's media, read concurrently and once however often the
    /// sample names it, its images and frames within the sample's byte budget; and the bytes
    /// read.
    pub(super) async fn fetch_media(
        &self,
        keys: Vec<MediaKey>,
    ) -> Result<(Vec<Fetched>, u64), Cause> {
        let budget = ByteBudget::new(self.config.limits.sample_bytes);
        let mut whole: Vec<&str> = Vec::new();
        let mut objects: HashMap<String, Bytes> = HashMap::new();
        for m in &keys {
            match m {
                MediaKey::Image(k) => whole.push(k),
                MediaKey::Frames(ks, _) => whole.extend(ks.iter().map(String::as_str)),
                MediaKey::Clip(..) => {}
                MediaKey::Embedded(name, bytes) => {
                    self.embedded_within(name, bytes, &budget)?;
                    objects.insert(name.clone(), bytes.clone());
                }
            }
        }
        let mut seen = HashSet::new();
        whole.retain(|k| seen.insert(*k));
        let clips = keys.iter().filter_map(|m| match m {
            MediaKey::Clip(k, _) => Some(k.as_str()),
            _ => None,
        });
        let (read, sizes) = futures::future::join(
            futures::future::join_all(whole.iter().map(|k| self.fetch(k, None, Some(&budget)))),
            futures::future::join_all(clips.map(|k| self.clip_size(k))),
        )
        .await;
        let mut failures = Vec::new();
        for (k, r) in whole.into_iter().zip(read) {
            match r {
                Ok(b) => drop(objects.insert(k.to_owned(), b)),
                Err(e) => failures.push(e),
            }
        }
        let mut clip_sizes = Vec::new();
        for r in sizes {
            match r {
                Ok(size) => clip_sizes.push(size),
                Err(e) => failures.push(e),
            }
        }
        // The store's failure first (asked again: a read that failed may have held budget
        // another was refused), then going over the budget (which does not depend on which
        // read went over), then the first other: images and frames in the sample's order,
        // then clips.
        let rank = |e: &FetchError| match e {
            FetchError::Io(..) | FetchError::Throttled(..) => 0,
            FetchError::OverByteBudget { .. } => 1,
            _ => 2,
        };
        if let Some(first) = failures.into_iter().min_by_key(rank) {
            return Err(first.into());
        }
        let read: u64 = objects.values().map(|b| b.len() as u64).sum();
        let object = |k: &String| objects[k.as_str()].clone();
        let mut clip_sizes = clip_sizes.into_iter();
        let media = keys
            .into_iter()
            .map(|m| match m {
                MediaKey::Image(k) | MediaKey::Embedded(k, _) => {
                    let b = object(&k);
                    Fetched::Image(k, b)
                }
                MediaKey::Clip(k, part) => {
                    let size = clip_sizes.next().expect("one size per clip");
                    Fetched::Clip(k, size, part)
                }
                MediaKey::Frames(ks, part) => Fetched::Frames(
                    ks.into_iter()
                        .map(|k| {
                            let b = object(&k);
                            (k, b)
                        })
                        .collect(),
                    part,
                ),
            })
            .collect();
        Ok((media, read))
    }
}
