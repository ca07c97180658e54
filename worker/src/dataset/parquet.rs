//! Parquet shards (`*.parquet`): a sample per row, its conversation in one column (`messages`,
//! `conversations`, or one named by `--columns`) and its images embedded beside it, as the
//! `datasets` library's `Image` feature stores them (`struct{bytes, path}`, one or a list).
//!
//! Read through arrow-rs's async reader over ranged GETs: the index records each file's row
//! groups and each valid sample's row, so sample *i* is addressed like a JSONL line; a worker
//! reads one row by a row selection, which arrow-rs turns into the pages that hold it where
//! the file has a page index (offset index), else into its row group's column chunks. No read
//! is larger than a cap (a whole file is never read), and every read goes through the worker's
//! range cache, so the neighbouring rows of a request share their pages.
//!
//! A row becomes the JSON sample the text formats read (`{"messages": …, "images": …}`), its
//! images named by their position in the row: so every format rule (placeholders, counts,
//! roles) is the JSONL one.

use super::sample::{Conversation, SampleError};
use super::shard::{BadLine, FormatTally, MediaObjects, Shard, ShardPart, MAX_LISTED_BAD_LINES};
pub use super::shard::{Columns, ParquetShard};
use crate::source::{media_key, FetchError, ObjectInfo, Store};
use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type,
    UInt64Type, UInt8Type,
};
use arrow_array::{Array, RecordBatch};
use arrow_schema::{DataType, Schema};
use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt};
use futures::TryStreamExt;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, RowSelection, RowSelector,
};
use parquet::arrow::async_reader::{AsyncFileReader, ParquetRecordBatchStreamBuilder};
use parquet::arrow::ProjectionMask;
use parquet::errors::ParquetError;
use parquet::file::metadata::{PageIndexPolicy, ParquetMetaData, ParquetMetaDataReader};
use serde_json::{Map, Value};
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// How a row's JSON names the row's own images: `"\0"` and the image's position. A NUL never
/// starts a stored path (keys with control characters are refused), so a path a typed part
/// names in the text column still reads as a path.
const EMBEDDED: char = '\0';
/// The conversation columns found without `--columns`, in this order.
const CONVERSATION_COLUMNS: [&str; 2] = ["messages", "conversations"];
/// The image columns found without `--columns`, in this order.
const IMAGE_COLUMNS: [&str; 2] = ["images", "image"];
/// The largest single read while indexing (a row group's column chunk of a file without a
/// page index is read whole).
const INDEX_READ_CAP: u64 = 512 << 20;
/// The most bytes read between two ranges to make them one request: less than a request's own
/// cost in time at a store's bandwidth (object_store's own rule merges up to 1 MiB).
const COALESCE_GAP: u64 = 256 << 10;
/// Rows decoded at once while indexing: a batch holds their images.
const INDEX_BATCH_ROWS: usize = 32;

/// The columns asked for (`--columns messages=conversations,images=images`); what is not
/// named is found by the Hub's usual names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ColumnRequest {
    pub conversation: Option<String>,
    pub images: Option<String>,
}

impl std::str::FromStr for ColumnRequest {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut req = ColumnRequest::default();
        for pair in s.split(',').filter(|p| !p.is_empty()) {
            let (role, column) = pair
                .split_once('=')
                .ok_or_else(|| format!("{pair:?}: expected ROLE=COLUMN"))?;
            let slot = match role {
                "messages" | "conversations" => &mut req.conversation,
                "images" => &mut req.images,
                other => {
                    return Err(format!(
                        "{other:?}: the roles are messages (the conversation) and images"
                    ))
                }
            };
            *slot = Some(column.to_string());
        }
        Ok(req)
    }
}

impl From<&Columns> for ColumnRequest {
    fn from(c: &Columns) -> Self {
        ColumnRequest {
            conversation: Some(c.conversation.clone()),
            images: c.images.clone(),
        }
    }
}

impl ColumnRequest {
    /// The columns of a file with `schema`: those named, else the usual names.
    fn resolve(&self, schema: &Schema) -> Result<Columns, String> {
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        let has = |name: &str| names.contains(&name);
        let named = |name: &Option<String>, what: &str| match name {
            Some(n) if !has(n) => Err(format!(
                "no column {n:?} for {what} (columns: {})",
                names.join(", ")
            )),
            _ => Ok(name.clone()),
        };
        let conversation = match named(&self.conversation, "messages")? {
            Some(c) => c,
            None => CONVERSATION_COLUMNS
                .into_iter()
                .find(|c| has(c))
                .ok_or_else(|| {
                    format!(
                        "no \"messages\" or \"conversations\" column (columns: {}); name the \
                         conversation's with --columns messages=COLUMN",
                        names.join(", ")
                    )
                })?
                .to_string(),
        };
        let images = match named(&self.images, "images")? {
            Some(i) => Some(i),
            None => IMAGE_COLUMNS
                .into_iter()
                .find(|c| has(c))
                .map(str::to_string),
        };
        let system = (has("system") && conversation != "system").then(|| "system".to_string());
        Ok(Columns {
            conversation,
            images,
            system,
        })
    }
}

/// An image of a row: its embedded bytes, or the path it names (the `Image` feature's `path`
/// where `bytes` is null).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowImage {
    Bytes(Bytes),
    Path(String),
}

/// One row as a sample: the JSON the text formats read, and the row's images by position.
#[derive(Debug, Clone)]
pub struct Row {
    pub json: Vec<u8>,
    pub images: Vec<RowImage>,
}

impl Row {
    /// The row's image a media path names, if it names one (`None`: a path of its own).
    pub fn image(&self, path: &str) -> Option<Result<&RowImage, String>> {
        let at = path.strip_prefix(EMBEDDED)?;
        Some(
            at.parse::<usize>()
                .ok()
                .and_then(|i| self.images.get(i))
                .ok_or_else(|| format!("the row has no image {at:?}")),
        )
    }

    /// How messages name image `i` of row `row` of `shard`.
    pub fn image_name(shard: &str, row: u64, path: &str) -> String {
        let at = path.trim_start_matches(EMBEDDED);
        format!("{shard}:{row}:images[{at}]")
    }
}

/// Reads a stored file's byte ranges for arrow-rs: `read(start, len)`.
pub type ReadRange =
    Arc<dyn Fn(u64, u64) -> BoxFuture<'static, Result<Bytes, FetchError>> + Send + Sync>;

/// A Parquet file in a store, as arrow-rs's async reader reads it: every range at most
/// `max_read` bytes; the store's own failure kept apart from the file's (one is retried, the
/// other is the data's).
pub struct StoreFile {
    size: u64,
    read: ReadRange,
    max_read: (u64, &'static str),
    metadata: Option<Arc<ParquetMetaData>>,
    failure: Failure,
}

/// A file's name and the store's last failure reading it: what tells a row's error apart.
#[derive(Clone)]
struct Failure {
    name: String,
    store: Arc<Mutex<Option<FetchError>>>,
}

impl Failure {
    /// The store's failure behind `err` if there was one, else the file's fault, named.
    fn error(&self, err: ParquetError) -> RowError {
        match self.store.lock().expect("failure").take() {
            Some(f) => RowError::Fetch(f),
            None => self.data(err),
        }
    }

    /// The file's fault, named.
    fn data(&self, err: impl std::fmt::Display) -> RowError {
        RowError::Data(format!("{}: {err}", self.name))
    }
}

impl StoreFile {
    pub fn new(name: String, size: u64, read: ReadRange, max_read: (u64, &'static str)) -> Self {
        StoreFile {
            size,
            read,
            max_read,
            metadata: None,
            failure: Failure {
                name,
                store: Arc::default(),
            },
        }
    }

    /// A file of `store` read directly (indexing).
    fn of_store(store: &Store, obj: &ObjectInfo) -> Self {
        let name = store.describe(&obj.key);
        let (store, key) = (store.clone(), obj.key.clone());
        let read: ReadRange = Arc::new(move |start, len| {
            let (store, key) = (store.clone(), key.clone());
            async move { store.get_range(&key, start, len).await }.boxed()
        });
        Self::new(
            name,
            obj.size,
            read,
            (INDEX_READ_CAP, "the index's read cap"),
        )
    }

    /// The file's metadata with its page index (where it has one), read from its footer.
    pub async fn load_metadata(&mut self) -> Result<ArrowReaderMetadata, RowError> {
        let options = reader_options();
        let meta = self.get_metadata(Some(&options)).await;
        let meta = meta.map_err(|e| self.failure.error(e))?;
        ArrowReaderMetadata::try_new(meta, options).map_err(|e| self.failure.error(e))
    }
}

fn reader_options() -> ArrowReaderOptions {
    ArrowReaderOptions::new().with_page_index_policy(PageIndexPolicy::Optional)
}

impl StoreFile {
    /// One range, within the cap.
    fn read(&self, range: Range<u64>) -> BoxFuture<'static, parquet::errors::Result<Bytes>> {
        let len = range.end.saturating_sub(range.start);
        let (max, limit) = self.max_read;
        if len > max {
            let err = format!(
                "a read of {len} bytes (at {}) is over {max} ({limit}): a row group's column \
                 chunk read whole, in a file without a page index? Rewrite it with smaller row \
                 groups and a page index (pyarrow: write_page_index=True)",
                range.start
            );
            return futures::future::ready(Err(ParquetError::General(err))).boxed();
        }
        let (read, failure) = (self.read.clone(), self.failure.store.clone());
        async move {
            read(range.start, len).await.map_err(|e| {
                let msg = e.to_string();
                *failure.lock().expect("failure") = Some(e);
                ParquetError::General(msg)
            })
        }
        .boxed()
    }
}

impl AsyncFileReader for StoreFile {
    fn get_bytes(&mut self, range: Range<u64>) -> BoxFuture<'_, parquet::errors::Result<Bytes>> {
        self.read(range)
    }

    /// All at once (arrow-rs asks for each column's pages of a row together), neighbours merged
    /// into one read where that reads at most twice their bytes ([`coalesce`]).
    fn get_byte_ranges(
        &mut self,
        ranges: Vec<Range<u64>>,
    ) -> BoxFuture<'_, parquet::errors::Result<Vec<Bytes>>> {
        let spans = coalesce(&ranges, self.max_read.0);
        let reads: Vec<_> = spans.iter().map(|s| self.read(s.clone())).collect();
        async move {
            let read = futures::future::try_join_all(reads).await?;
            Ok(ranges
                .iter()
                .map(|r| {
                    let (span, bytes) = (spans.iter().zip(&read))
                        .find(|(s, _)| s.start <= r.start && r.end <= s.end)
                        .expect("every range lies in a span");
                    let from = (r.start - span.start) as usize;
                    bytes.slice(from..from + (r.end - r.start) as usize)
                })
                .collect())
        }
        .boxed()
    }

    fn get_metadata<'a>(
        &'a mut self,
        _options: Option<&'a ArrowReaderOptions>,
    ) -> BoxFuture<'a, parquet::errors::Result<Arc<ParquetMetaData>>> {
        async move {
            if let Some(m) = &self.metadata {
                return Ok(m.clone());
            }
            let size = self.size;
            let reader =
                ParquetMetaDataReader::new().with_page_index_policy(PageIndexPolicy::Optional);
            let meta = Arc::new(reader.load_and_finish(&mut *self, size).await?);
            self.metadata = Some(meta.clone());
            Ok(meta)
        }
        .boxed()
    }
}

/// The reads that fetch `ranges`: sorted, each grown over the next while the gap to it is at
/// most [`COALESCE_GAP`] or the span stays within twice the bytes wanted from it (a row's pages
/// of its small text columns, which lie in neighbouring column chunks), and within `max`.
fn coalesce(ranges: &[Range<u64>], max: u64) -> Vec<Range<u64>> {
    let mut sorted: Vec<Range<u64>> = ranges.to_vec();
    sorted.sort_by_key(|r| r.start);
    let mut spans: Vec<(Range<u64>, u64)> = Vec::new();
    for r in sorted {
        let len = r.end.saturating_sub(r.start);
        if let Some((span, wanted)) = spans.last_mut() {
            let end = span.end.max(r.end);
            let near = r.start.saturating_sub(span.end) <= COALESCE_GAP
                || end - span.start <= 2 * (*wanted + len);
            if (near && end - span.start <= max) || r.end <= span.end {
                span.end = end;
                *wanted += len;
                continue;
            }
        }
        spans.push((r, len));
    }
    spans.into_iter().map(|(s, _)| s).collect()
}

/// Why a row could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowError {
    /// The store failed (retried as any read).
    Fetch(FetchError),
    /// The file or the row is not what a sample needs: named.
    Data(String),
}

impl From<RowError> for crate::failure::Cause {
    fn from(e: RowError) -> Self {
        match e {
            RowError::Fetch(f) => f.into(),
            RowError::Data(d) => SampleError::Parquet(d).into(),
        }
    }
}

/// The projection of `columns` in a file of `meta`: every leaf of their columns, but the image
/// column's `path` only `with_paths` (a file whose images are all embedded has its rows read
/// without that column's pages).
fn projection(
    meta: &ArrowReaderMetadata,
    columns: &Columns,
    with_paths: bool,
) -> Result<ProjectionMask, String> {
    let schema = meta.schema();
    let roots = columns
        .names()
        .map(|n| {
            schema
                .index_of(n)
                .map_err(|_| format!("no column {n:?} (indexed with it: index again)"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let images = (columns.images.as_deref()).and_then(|n| schema.index_of(n).ok());
    let descr = meta.metadata().file_metadata().schema_descr();
    let leaves = (0..descr.num_columns()).filter(|&leaf| {
        let root = descr.get_column_root_idx(leaf);
        let column = descr.column(leaf);
        let is_path = column.path().parts().last().is_some_and(|p| p == "path");
        roots.contains(&root) && (with_paths || Some(root) != images || !is_path)
    });
    Ok(ProjectionMask::leaves(descr, leaves))
}

/// Row `row` (of row group `group`, at `in_group` in it) of a file: only what a row selection of
/// that one row reads.
pub async fn read_row(
    file: StoreFile,
    meta: ArrowReaderMetadata,
    layout: &ParquetShard,
    (group, in_group): (usize, u64),
) -> Result<Row, RowError> {
    let failure = file.failure.clone();
    let fail = |e| failure.error(e);
    let mask =
        projection(&meta, &layout.columns, layout.image_paths).map_err(|e| failure.data(e))?;
    let selection = RowSelection::from(vec![
        RowSelector::skip(in_group as usize),
        RowSelector::select(1),
    ]);
    let mut stream = ParquetRecordBatchStreamBuilder::new_with_metadata(file, meta)
        .with_projection(mask)
        .with_row_groups(vec![group])
        .with_row_selection(selection)
        .with_batch_size(1)
        .build()
        .map_err(&fail)?;
    let batch = stream.try_next().await.map_err(&fail)?;
    let batch = batch.filter(|b| b.num_rows() == 1).ok_or_else(|| {
        failure.data(format_args!(
            "row {in_group} of row group {group} is not in the file"
        ))
    })?;
    row_of(&batch, 0, &layout.columns).map_err(|e| failure.data(e))
}

/// Row `i` of a batch holding `columns`.
fn row_of(batch: &RecordBatch, i: usize, columns: &Columns) -> Result<Row, String> {
    let column = |name: &str| {
        batch
            .column_by_name(name)
            .ok_or_else(|| format!("no column {name:?}"))
    };
    let mut obj = Map::new();
    let conversation = column(&columns.conversation)?;
    let value = match json_value(conversation.as_ref(), i)? {
        // A conversation stored as JSON text.
        Value::String(s) => serde_json::from_str(&s)
            .map_err(|e| format!("column {:?} is not JSON: {e}", columns.conversation))?,
        v => v,
    };
    let key = match columns.conversation.as_str() {
        "conversations" => "conversations",
        _ => "messages",
    };
    obj.insert(key.into(), value);
    if let Some(system) = &columns.system {
        let v = json_value(column(system)?.as_ref(), i)?;
        if !v.is_null() {
            obj.insert("system".into(), v);
        }
    }
    let mut images = Vec::new();
    if let Some(name) = &columns.images {
        images = row_images(column(name)?.as_ref(), i).map_err(|e| format!("{name}{e}"))?;
        let named = (0..images.len()).map(|k| Value::String(format!("{EMBEDDED}{k}")));
        obj.insert("images".into(), Value::Array(named.collect()));
    }
    let json = serde_json::to_vec(&Value::Object(obj)).expect("a JSON value serializes");
    Ok(Row { json, images })
}

/// Value `i` of an Arrow array as JSON: struct fields that are null left out (the `datasets`
/// library writes every part with every field), binary refused (only image columns hold it).
fn json_value(a: &dyn Array, i: usize) -> Result<Value, String> {
    if a.is_null(i) {
        return Ok(Value::Null);
    }
    let number = |x: f64| serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number);
    Ok(match a.data_type() {
        DataType::Null => Value::Null,
        DataType::Boolean => Value::Bool(a.as_boolean().value(i)),
        DataType::Int8 => a.as_primitive::<Int8Type>().value(i).into(),
        DataType::Int16 => a.as_primitive::<Int16Type>().value(i).into(),
        DataType::Int32 => a.as_primitive::<Int32Type>().value(i).into(),
        DataType::Int64 => a.as_primitive::<Int64Type>().value(i).into(),
        DataType::UInt8 => a.as_primitive::<UInt8Type>().value(i).into(),
        DataType::UInt16 => a.as_primitive::<UInt16Type>().value(i).into(),
        DataType::UInt32 => a.as_primitive::<UInt32Type>().value(i).into(),
        DataType::UInt64 => a.as_primitive::<UInt64Type>().value(i).into(),
        DataType::Float32 => number(a.as_primitive::<Float32Type>().value(i).into()),
        DataType::Float64 => number(a.as_primitive::<Float64Type>().value(i)),
        DataType::Utf8 => a.as_string::<i32>().value(i).into(),
        DataType::LargeUtf8 => a.as_string::<i64>().value(i).into(),
        DataType::Utf8View => a.as_string_view().value(i).into(),
        DataType::List(_) => list_values(a.as_list::<i32>().value(i).as_ref())?,
        DataType::LargeList(_) => list_values(a.as_list::<i64>().value(i).as_ref())?,
        DataType::Struct(fields) => {
            let s = a.as_struct();
            let mut obj = Map::new();
            for (f, col) in fields.iter().zip(s.columns()) {
                let v = json_value(col.as_ref(), i)?;
                if !v.is_null() {
                    obj.insert(f.name().clone(), v);
                }
            }
            Value::Object(obj)
        }
        other => return Err(format!("a {other} value where text is expected")),
    })
}

fn list_values(items: &dyn Array) -> Result<Value, String> {
    (0..items.len())
        .map(|j| json_value(items, j))
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

/// The images of row `i` of an image column: a list of images, or one (null: none). An image is
/// the `Image` feature's `struct{bytes, path}`, bytes, or a path. Errors start with the
/// position (`[2]: …`) for the column's name to precede.
fn row_images(a: &dyn Array, i: usize) -> Result<Vec<RowImage>, String> {
    if a.is_null(i) {
        return Ok(Vec::new());
    }
    let each = |items: &dyn Array| {
        (0..items.len())
            .map(|j| image(items, j).map_err(|e| format!("[{j}]: {e}")))
            .collect::<Result<Vec<_>, _>>()
    };
    match a.data_type() {
        DataType::List(_) => each(a.as_list::<i32>().value(i).as_ref()),
        DataType::LargeList(_) => each(a.as_list::<i64>().value(i).as_ref()),
        _ => image(a, i)
            .map(|one| vec![one])
            .map_err(|e| format!(": {e}")),
    }
}

fn image(a: &dyn Array, i: usize) -> Result<RowImage, String> {
    if a.is_null(i) {
        return Err("a null image".into());
    }
    let bytes = |a: &dyn Array| -> Option<Bytes> {
        let b: &[u8] = match a.data_type() {
            DataType::Binary => a.as_binary::<i32>().value(i),
            DataType::LargeBinary => a.as_binary::<i64>().value(i),
            DataType::BinaryView => a.as_binary_view().value(i),
            _ => return None,
        };
        Some(Bytes::copy_from_slice(b))
    };
    let path = |a: &dyn Array| match json_value(a, i) {
        Ok(Value::String(s)) => Some(s),
        _ => None,
    };
    if let Some(b) = bytes(a) {
        return Ok(RowImage::Bytes(b));
    }
    if let Some(p) = path(a) {
        return Ok(RowImage::Path(p));
    }
    let DataType::Struct(_) = a.data_type() else {
        return Err(format!("a {} value, not an image", a.data_type()));
    };
    let s = a.as_struct();
    let field = |name: &str| s.column_by_name(name).filter(|c| !c.is_null(i));
    if let Some(b) = field("bytes").and_then(|c| bytes(c.as_ref())) {
        return Ok(RowImage::Bytes(b));
    }
    match field("path").and_then(|c| path(c.as_ref())) {
        Some(p) => Ok(RowImage::Path(p)),
        None => Err("an image with neither \"bytes\" nor a \"path\"".into()),
    }
}

/// Reads every row of a Parquet shard into its part of the index: each validated as a JSONL
/// sample is (its format, its placeholders against its images, the paths it names present in
/// the store), its row recorded. Memory: the file's metadata and [`INDEX_BATCH_ROWS`] rows.
pub(crate) async fn index_parquet(
    store: &Store,
    obj: ObjectInfo,
    media: &MediaObjects,
    request: &ColumnRequest,
) -> anyhow::Result<ShardPart> {
    let mut file = StoreFile::of_store(store, &obj);
    let name = file.failure.name.clone();
    let meta = match file.load_metadata().await {
        Ok(m) => m,
        Err(RowError::Fetch(f)) => return Err(f.into()),
        Err(RowError::Data(d)) => anyhow::bail!("{d}"),
    };
    let columns = request
        .resolve(meta.schema())
        .map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
    let row_groups = meta
        .metadata()
        .row_groups()
        .iter()
        .map(|g| u32::try_from(g.num_rows()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| anyhow::anyhow!("{name}: a row group of over 4 billion rows"))?;
    let mut layout = ParquetShard {
        row_groups,
        columns,
        image_paths: false,
    };
    anyhow::ensure!(
        layout.rows() <= u64::from(u32::MAX),
        "{name}: {} rows, over the index's 4 billion per shard; split it",
        layout.rows()
    );
    let mask =
        projection(&meta, &layout.columns, true).map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
    let mut stream = ParquetRecordBatchStreamBuilder::new_with_metadata(file, meta)
        .with_projection(mask)
        .with_batch_size(INDEX_BATCH_ROWS)
        .build()?;
    let mut rows = Vec::new();
    let mut bad = Vec::new();
    let mut bad_count = 0u64;
    let mut tally = FormatTally::default();
    let mut row = 0u64;
    while let Some(batch) = stream.try_next().await? {
        for i in 0..batch.num_rows() {
            let verdict = row_of(&batch, i, &layout.columns).and_then(|r| {
                let by_path = |m: &RowImage| matches!(m, RowImage::Path(_));
                layout.image_paths |= r.images.iter().any(by_path);
                let (conv, formats) = Conversation::parse_detect(&r.json).map_err(|e| {
                    if let SampleError::UnknownFormat(keys) = &e {
                        tally.unknown(keys);
                    }
                    e.to_string()
                })?;
                check_media(&conv, &r, &obj.key, media)?;
                Ok((formats, r.json))
            });
            match verdict {
                Ok((formats, json)) => {
                    tally.add(row, formats, &json);
                    rows.push(row as u32);
                }
                Err(reason) => {
                    bad_count += 1;
                    if bad.len() < MAX_LISTED_BAD_LINES {
                        bad.push(BadLine {
                            shard: obj.key.clone(),
                            line: row as u32,
                            reason,
                        });
                    }
                }
            }
            row += 1;
        }
    }
    let formats = tally.finish(&obj.key, rows.len(), "row")?;
    Ok(ShardPart {
        shard: Shard {
            key: obj.key.clone(),
            size: obj.size,
            version: obj.version.clone(),
            samples: rows.len() as u32,
            formats,
            bad_lines: bad_count,
            skipped: Vec::new(),
            lengths: Vec::new(),
            media_root: media.root.clone(),
            parquet: Some(layout),
        },
        offsets: rows,
        bad,
    })
}

/// The images a row's conversation names are the row's (or, by path, present in the store).
fn check_media(
    conv: &Conversation,
    row: &Row,
    shard: &str,
    media: &MediaObjects,
) -> Result<(), String> {
    for path in conv.object_paths() {
        let path = match row.image(path) {
            None => path,
            Some(Err(e)) => return Err(e),
            Some(Ok(RowImage::Bytes(_))) => continue,
            Some(Ok(RowImage::Path(p))) => p,
        };
        let key = media_key(shard, &media.root, path).map_err(|e| e.to_string())?;
        if (media.keys.as_ref()).is_some_and(|keys| !keys.contains(key.as_str())) {
            return Err(format!("object {path:?} (key {key}) does not exist"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neighbouring_ranges_are_read_together_within_the_gap_and_the_cap() {
        // A row's small text pages, then its image page far away in the image column.
        let ranges = [4..40, 40..90, 900..1000, 2_000_000..2_100_000, 100..120];
        assert_eq!(coalesce(&ranges, 1 << 30), [4..1000, 2_000_000..2_100_000]);
        // Overlapping and contained ranges become one; a span never grows past the cap.
        let whole = Range { start: 0, end: 20 };
        assert_eq!(coalesce(&[0..10, 5..8, 8..20], 1 << 30), [whole]);
        assert_eq!(coalesce(&[0..600, 700..1300], 1000), [0..600, 700..1300]);
        assert_eq!(coalesce(&[], 10), Vec::<Range<u64>>::new());
    }

    #[test]
    fn columns_are_named_by_role_or_found_by_the_hubs_names() {
        let req: ColumnRequest = "messages=dialogue,images=pictures".parse().unwrap();
        assert_eq!(req.conversation.as_deref(), Some("dialogue"));
        assert_eq!(req.images.as_deref(), Some("pictures"));
        assert!("audio=x"
            .parse::<ColumnRequest>()
            .unwrap_err()
            .contains("the roles are"));
        assert!("messages"
            .parse::<ColumnRequest>()
            .unwrap_err()
            .contains("ROLE=COLUMN"));
        let field = |n: &str| arrow_schema::Field::new(n, DataType::Utf8, true);
        let schema = Schema::new(vec![
            field("conversations"),
            field("image"),
            field("system"),
        ]);
        let found = ColumnRequest::default().resolve(&schema).unwrap();
        assert_eq!(
            found.to_string(),
            "messages=conversations,images=image,system=system"
        );
        let e = req.resolve(&schema).unwrap_err();
        assert!(e.contains("no column \"dialogue\" for messages"), "{e}");
    }

    #[test]
    fn a_row_is_found_in_its_row_group() {
        let layout = ParquetShard {
            row_groups: vec![3, 0, 2],
            columns: Columns {
                conversation: "messages".into(),
                images: None,
                system: None,
            },
            image_paths: false,
        };
        assert_eq!(layout.rows(), 5);
        assert_eq!(layout.group_of(2), Some((0, 2)));
        assert_eq!(layout.group_of(3), Some((2, 0)));
        assert_eq!(layout.group_of(5), None);
    }
}
