//! One shard of a dataset read into its part of the index: split into samples (JSONL lines,
//! or the elements of a JSON array), each validated, its format tallied, its bad samples
//! named (the index module's docs say what the index holds).

use super::sample::{top_level_keys, Conversation, Formats, SampleError};
use crate::source::{media_key, ObjectInfo, PathError, Store};
use std::collections::HashSet;

/// LLaMA-Factory's description of its data files, found beside them: not a shard (its column
/// renames are not read: the formats are detected from the samples themselves).
pub const DATASET_INFO: &str = "dataset_info.json";
/// The longest line the index takes; a worker's `max-line-bytes` (default 4 MiB) may only
/// lower it.
pub const MAX_INDEXED_LINE_BYTES: u64 = 16 << 20;
/// Bad lines listed with their reason (all are counted): a hostile or broken dataset's
/// report stays bounded.
pub const MAX_LISTED_BAD_LINES: usize = 10_000;

/// One indexed shard: what the freshness check compares, and what its samples' lines need
/// beyond their offsets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    pub key: String,
    pub size: u64,
    pub version: String,
    pub(crate) samples: u32,
    /// The format its samples are written in (several where nothing tells them apart).
    pub formats: Formats,
    /// Its bad samples, listed or not.
    pub bad_lines: u64,
    /// (sample index in the shard, lines skipped before it in all): where a run of blank or
    /// bad lines ends. Empty for a clean shard.
    pub(crate) skipped: Vec<(u32, u32)>,
    /// (sample index, length) of lines whose length is not the next sample's offset − 1 (a
    /// bad or blank line follows, or the shard ends without a newline).
    pub(crate) lengths: Vec<(u32, u32)>,
    /// Where its samples' media paths resolve: its dataset's media root
    /// ([`MediaRoot::uri`](crate::source::MediaRoot::uri)), or empty for beside the shard.
    pub media_root: String,
    /// A Parquet shard's row groups and columns; its samples' offsets are their rows.
    pub parquet: Option<ParquetShard>,
}

impl Shard {
    /// The key of a media path written in one of its samples (see [`media_key`]).
    pub fn media_key(&self, path: &str) -> Result<String, PathError> {
        media_key(&self.key, &self.media_root, path)
    }

    pub fn samples(&self) -> u32 {
        self.samples
    }

    /// Its samples' text format's name, as `stoker dataset index` prints it ("none" without a
    /// sample).
    pub fn format_name(&self) -> &'static str {
        match self.samples {
            0 => "none",
            _ => self.formats.name(),
        }
    }

    pub(crate) fn line_number(&self, i: u32) -> u32 {
        let after = self.skipped.partition_point(|&(at, _)| at <= i);
        let skipped = after.checked_sub(1).map_or(0, |k| self.skipped[k].1);
        i + 1 + skipped
    }

    pub(crate) fn length(&self, i: u32, implied: u64) -> u64 {
        match self.lengths.binary_search_by_key(&i, |&(at, _)| at) {
            Ok(k) => self.lengths[k].1.into(),
            Err(_) => implied,
        }
    }
}

/// Which columns hold a Parquet shard's conversation and images, as `stoker dataset index`
/// found or was told them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Columns {
    pub conversation: String,
    pub images: Option<String>,
    /// A `system` string column, read as the JSON formats' top-level `system`.
    pub system: Option<String>,
}

impl Columns {
    /// The columns a row is read from.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.conversation.as_str())
            .chain(self.images.as_deref())
            .chain(self.system.as_deref())
    }
}

impl std::fmt::Display for Columns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "messages={}", self.conversation)?;
        if let Some(images) = &self.images {
            write!(f, ",images={images}")?;
        }
        if let Some(system) = &self.system {
            write!(f, ",system={system}")?;
        }
        Ok(())
    }
}

/// A Parquet shard's layout in the index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParquetShard {
    /// Rows in each row group, in file order.
    pub row_groups: Vec<u32>,
    pub columns: Columns,
    /// Some image is a path (its `bytes` null): rows are read with the image column's `path`.
    pub image_paths: bool,
}

impl ParquetShard {
    pub fn rows(&self) -> u64 {
        self.row_groups.iter().map(|&n| u64::from(n)).sum()
    }

    /// The row group holding `row`, and the row's position in it.
    pub fn group_of(&self, row: u64) -> Option<(usize, u64)> {
        let mut first = 0;
        for (g, &n) in self.row_groups.iter().enumerate() {
            if row < first + u64::from(n) {
                return Some((g, row - first));
            }
            first += u64::from(n);
        }
        None
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
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

/// One shard's part of an index, as its build gives it.
pub(crate) struct ShardPart {
    pub(crate) shard: Shard,
    pub(crate) offsets: Vec<u32>,
    pub(crate) bad: Vec<BadLine>,
}

/// How a shard holds its samples, from its name; `None`: not a shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    /// JSONL: a sample per line.
    Lines,
    /// A JSON array: a sample per element.
    Array,
    /// Parquet: a sample per row.
    Parquet,
}

impl Framing {
    pub(crate) fn of(key: &str) -> Option<Framing> {
        let name = key.rsplit('/').next().unwrap_or(key);
        if name.ends_with(".jsonl") {
            Some(Framing::Lines)
        } else if name.ends_with(".json") && name != DATASET_INFO {
            Some(Framing::Array)
        } else if name.ends_with(".parquet") {
            Some(Framing::Parquet)
        } else {
            None
        }
    }
}

/// The media a dataset's samples may name: where their paths resolve (as
/// [`Shard::media_root`]) and the keys present there (`None`: not checked).
#[derive(Debug)]
pub(crate) struct MediaObjects {
    pub root: String,
    pub keys: Option<HashSet<Box<str>>>,
}

/// Streams one JSONL or JSON array shard through [`ShardLines`].
pub(crate) async fn index_lines(
    store: &Store,
    obj: ObjectInfo,
    media: &MediaObjects,
) -> anyhow::Result<ShardPart> {
    anyhow::ensure!(
        obj.size <= u32::MAX as u64,
        "{}: {} bytes, over the index's 4 GiB per shard; split it",
        store.describe(&obj.key),
        obj.size
    );
    let lines = store
        .fold_chunks(
            &obj.key,
            || ShardLines::new(&obj, media),
            |lines, chunk| lines.feed(chunk),
        )
        .await?;
    lines.finish()
}

/// Where a JSON array shard's reader is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ArrayAt {
    /// Before the `[`.
    Start,
    /// After `[` (`first`) or a `,`: an element comes (or `]`, after `[`).
    BeforeElement { first: bool },
    /// Inside an element: nesting depth, and where a string is.
    Element {
        depth: u32,
        in_string: bool,
        escaped: bool,
    },
    /// After an element: `,` or `]` comes.
    AfterElement,
    /// After the `]`: only whitespace may follow.
    Done,
}

/// Splits a shard, fed chunk by chunk, into samples (lines, or an array's elements) and
/// validates each.
pub(crate) struct ShardLines<'a> {
    obj: &'a ObjectInfo,
    media: &'a MediaObjects,
    framing: Framing,
    /// An array shard's reader position.
    array: ArrayAt,
    /// Why an array shard cannot be read (its structure, not one sample): refused whole.
    broken: Option<String>,
    /// The current sample so far; empty while `over_limit`.
    line: Vec<u8>,
    over_limit: bool,
    /// Offset of the current sample's first byte, and of the next byte fed.
    line_start: u64,
    offset: u64,
    /// 1-based number of the current text line, and of the line the current sample starts on.
    line_no: u64,
    sample_line: u64,
    offsets: Vec<u32>,
    /// The last valid sample's length, until the next one tells whether it is implied.
    last_len: u64,
    skipped: Vec<(u32, u32)>,
    lengths: Vec<(u32, u32)>,
    bad: Vec<BadLine>,
    bad_count: u64,
    tally: FormatTally,
}

/// The format a shard's samples share, told sample by sample.
pub(crate) struct FormatTally {
    /// The formats every valid sample so far is written in; the first sample's line and keys.
    formats: Formats,
    first: Option<(u64, String)>,
    /// A sample in another format than those before it: its line, formats and keys.
    mixed: Option<(u64, Formats, String)>,
    /// The keys of the first sample in no known format.
    unknown: Option<String>,
}

impl Default for FormatTally {
    fn default() -> Self {
        FormatTally {
            formats: Formats::ANY,
            first: None,
            mixed: None,
            unknown: None,
        }
    }
}

impl FormatTally {
    /// A sample in no known format, with these keys.
    pub(crate) fn unknown(&mut self, keys: &str) {
        self.unknown.get_or_insert_with(|| keys.to_string());
    }

    /// Keeps the formats all samples so far share; the first sample that shares none (at line
    /// or row `at`) is remembered, and refuses the shard.
    pub(crate) fn add(&mut self, at: u64, formats: Formats, sample: &[u8]) {
        if self.first.is_none() {
            self.first = Some((at, top_level_keys(sample)));
        }
        let both = self.formats.and(formats);
        if !both.is_empty() {
            self.formats = both;
        } else if self.mixed.is_none() {
            self.mixed = Some((at, formats, top_level_keys(sample)));
        }
    }

    /// The shard's formats, once its `samples` valid ones are told; a shard that mixes formats
    /// or holds no sample of any is refused (`unit`: "line" or "row").
    pub(crate) fn finish(&self, key: &str, samples: usize, unit: &str) -> anyhow::Result<Formats> {
        if let (Some((at, formats, keys)), Some((first, first_keys))) = (&self.mixed, &self.first) {
            anyhow::bail!(
                "{key} mixes dataset formats: {unit} {first} is {} (keys: {first_keys}), {unit} \
                 {at} is {formats} (keys: {keys}); one shard holds one format (\"Dataset \
                 formats\" in docs/preprocessing.md)",
                self.formats,
            );
        }
        if let (0, Some(keys)) = (samples, &self.unknown) {
            anyhow::bail!(
                "{key}: no sample in a dataset format Stoker reads (keys: {keys}); see \
                 \"Dataset formats\" in docs/preprocessing.md"
            );
        }
        Ok(self.formats)
    }
}

impl<'a> ShardLines<'a> {
    pub(crate) fn new(obj: &'a ObjectInfo, media: &'a MediaObjects) -> Self {
        ShardLines {
            obj,
            media,
            framing: Framing::of(&obj.key).unwrap_or(Framing::Lines),
            array: ArrayAt::Start,
            broken: None,
            line: Vec::new(),
            over_limit: false,
            line_start: 0,
            offset: 0,
            line_no: 1,
            sample_line: 1,
            offsets: Vec::new(),
            last_len: 0,
            skipped: Vec::new(),
            lengths: Vec::new(),
            bad: Vec::new(),
            bad_count: 0,
            tally: FormatTally::default(),
        }
    }

    pub(crate) fn feed(&mut self, chunk: &[u8]) {
        match self.framing {
            Framing::Lines | Framing::Parquet => self.feed_lines(chunk),
            Framing::Array => self.feed_array(chunk),
        }
    }

    fn feed_lines(&mut self, mut chunk: &[u8]) {
        while let Some(i) = chunk.iter().position(|&b| b == b'\n') {
            self.extend(&chunk[..i]);
            self.end_sample();
            self.offset += 1;
            self.line_no += 1;
            self.line_start = self.offset;
            self.sample_line = self.line_no;
            chunk = &chunk[i + 1..];
        }
        self.extend(chunk);
    }

    /// An array shard, byte by byte: only the structure between elements and the nesting
    /// inside one are followed here; each element is then parsed as a whole sample.
    fn feed_array(&mut self, chunk: &[u8]) {
        let mut run = 0; // where the current element's bytes start in `chunk`
        for (i, &b) in chunk.iter().enumerate() {
            if self.broken.is_some() {
                return;
            }
            if let ArrayAt::Element {
                depth,
                in_string,
                escaped,
            } = &mut self.array
            {
                let ends = if *in_string {
                    match (*escaped, b) {
                        (true, _) => *escaped = false,
                        (false, b'\\') => *escaped = true,
                        (false, b'"') => *in_string = false,
                        _ => {}
                    }
                    None
                } else {
                    match b {
                        b'"' => {
                            *in_string = true;
                            None
                        }
                        b'{' | b'[' => {
                            *depth += 1;
                            None
                        }
                        b'}' | b']' if *depth > 1 => {
                            *depth -= 1;
                            None
                        }
                        // The element's own closing bracket: it ends with this byte.
                        b'}' | b']' if *depth == 1 => Some(i + 1),
                        // A bare scalar ends at what follows it.
                        b',' | b']' | b' ' | b'\t' | b'\r' | b'\n' if *depth == 0 => Some(i),
                        _ => None,
                    }
                };
                if let Some(end) = ends {
                    self.extend(&chunk[run..end]);
                    self.end_sample();
                    self.array = ArrayAt::AfterElement;
                    if end == i + 1 {
                        continue; // the closing bracket was the element's last byte
                    }
                } else {
                    if b == b'\n' {
                        self.line_no += 1;
                    }
                    continue;
                }
            }
            match (self.array, b) {
                (_, b' ' | b'\t' | b'\r' | b'\n') => {}
                (ArrayAt::Start, b'[') => self.array = ArrayAt::BeforeElement { first: true },
                (ArrayAt::BeforeElement { first: true }, b']') | (ArrayAt::AfterElement, b']') => {
                    self.array = ArrayAt::Done
                }
                (ArrayAt::AfterElement, b',') => {
                    self.array = ArrayAt::BeforeElement { first: false }
                }
                (ArrayAt::BeforeElement { .. }, b']') => {
                    self.break_at(b, "a comma before the array's `]`")
                }
                (ArrayAt::BeforeElement { .. }, _) => {
                    // Its bytes are counted into `offset` when the element ends (or the
                    // chunk does), with `extend`.
                    self.line_start = self.offset;
                    self.sample_line = self.line_no;
                    run = i;
                    self.array = ArrayAt::Element {
                        depth: u32::from(matches!(b, b'{' | b'[')),
                        in_string: b == b'"',
                        escaped: false,
                    };
                    continue;
                }
                (ArrayAt::Start, _) => self.break_at(
                    b,
                    "a .json shard must be a JSON array of samples (JSONL: name it .jsonl)",
                ),
                (ArrayAt::AfterElement, _) => {
                    self.break_at(b, "expected `,` or `]` after a sample")
                }
                (ArrayAt::Done, _) => self.break_at(b, "data after the array's `]`"),
                (ArrayAt::Element { .. }, _) => unreachable!("handled above"),
            }
            self.advance(b);
        }
        if let ArrayAt::Element { .. } = self.array {
            self.extend(&chunk[run..]);
        }
    }

    /// One structural byte (not part of an element) is read.
    fn advance(&mut self, b: u8) {
        self.offset += 1;
        if b == b'\n' {
            self.line_no += 1;
        }
    }

    fn break_at(&mut self, b: u8, what: &str) {
        self.broken = Some(format!(
            "{what}: found {:?} at line {}, byte {}",
            char::from(b),
            self.line_no,
            self.offset
        ));
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

    fn end_sample(&mut self) {
        let line = std::mem::take(&mut self.line);
        let verdict = if self.over_limit {
            Err(format!(
                "sample of {} bytes is over the index's limit of {MAX_INDEXED_LINE_BYTES}",
                self.offset - self.line_start
            ))
        } else {
            let text = line.strip_suffix(b"\r").unwrap_or(&line);
            if text.iter().all(u8::is_ascii_whitespace) {
                Ok(None)
            } else {
                self.validate(text).map(Some)
            }
        };
        match verdict {
            Ok(Some(formats)) => {
                self.tally.add(self.sample_line, formats, &line);
                self.push_sample();
            }
            Ok(None) => {}
            Err(reason) => {
                self.bad_count += 1;
                if self.bad.len() < MAX_LISTED_BAD_LINES {
                    self.bad.push(BadLine {
                        shard: self.obj.key.clone(),
                        line: self.sample_line as u32,
                        reason,
                    });
                }
            }
        }
        self.line = line; // its allocation serves the next sample
        self.line.clear();
        self.over_limit = false;
    }

    /// A sample's formats, its media present in the store.
    fn validate(&mut self, line: &[u8]) -> Result<Formats, String> {
        let (conv, formats) = match Conversation::parse_detect(line) {
            Ok(parsed) => parsed,
            Err(SampleError::UnknownFormat(keys)) => {
                self.tally.unknown(&keys);
                return Err(SampleError::UnknownFormat(keys).to_string());
            }
            Err(e) => return Err(e.to_string()),
        };
        for path in conv.object_paths() {
            let key = media_key(&self.obj.key, &self.media.root, path);
            let key = key.map_err(|e| e.to_string())?;
            if (self.media.keys.as_ref()).is_some_and(|keys| !keys.contains(key.as_str())) {
                return Err(format!("object {path:?} (key {key}) does not exist"));
            }
        }
        Ok(formats)
    }

    /// The current sample is valid.
    fn push_sample(&mut self) {
        let i = self.offsets.len() as u32;
        let skipped = (self.sample_line - 1 - u64::from(i)) as u32;
        if self.skipped.last().map_or(0, |&(_, s)| s) != skipped {
            self.skipped.push((i, skipped));
        }
        self.close_previous(self.line_start);
        self.offsets.push(self.line_start as u32);
        self.last_len = self.offset - self.line_start;
    }

    /// Records the previous sample's length unless `next_start` implies it.
    fn close_previous(&mut self, next_start: u64) {
        if let Some(&start) = self.offsets.last() {
            let implied = next_start.saturating_sub(u64::from(start) + 1);
            if self.last_len != implied {
                let i = self.offsets.len() as u32 - 1;
                self.lengths.push((i, self.last_len as u32));
            }
        }
    }

    /// The valid samples and the bad ones, once the last chunk is fed; a shard whose
    /// structure is broken, that mixes formats or holds no sample of any is refused.
    pub(crate) fn finish(mut self) -> anyhow::Result<ShardPart> {
        let key = &self.obj.key;
        match self.framing {
            Framing::Lines | Framing::Parquet => {
                if self.over_limit || !self.line.is_empty() {
                    self.end_sample();
                }
            }
            Framing::Array => {
                if let Some(broken) = &self.broken {
                    anyhow::bail!("{key}: {broken}");
                }
                anyhow::ensure!(
                    self.array == ArrayAt::Done,
                    "{key}: the JSON array ends without its `]` at line {} (cut short?)",
                    self.line_no
                );
            }
        }
        anyhow::ensure!(
            self.line_no <= u32::MAX as u64,
            "{key}: more than {} lines in one shard; split it",
            u32::MAX
        );
        anyhow::ensure!(
            self.offset == self.obj.size,
            "{key}: read {} bytes, listed as {}: it changed while being indexed; index again",
            self.offset,
            self.obj.size
        );
        let formats = self.tally.finish(key, self.offsets.len(), "line")?;
        self.close_previous(self.obj.size);
        Ok(ShardPart {
            shard: Shard {
                key: key.clone(),
                size: self.obj.size,
                version: self.obj.version.clone(),
                samples: self.offsets.len() as u32,
                formats,
                bad_lines: self.bad_count,
                skipped: self.skipped,
                lengths: self.lengths,
                media_root: self.media.root.clone(),
                parquet: None,
            },
            offsets: self.offsets,
            bad: self.bad,
        })
    }
}
