//! Parquet shards on the embedded S3 server: indexed row by row (row groups, the column mapping,
//! bad rows named, the layout kept through the stored index), and a row read by its own pages.

use arrow_array::{ArrayRef, BinaryArray, ListArray, RecordBatch, StringArray, StructArray};
use arrow_buffer::OffsetBuffer;
use arrow_schema::{DataType, Field, Fields};
use bytes::Bytes;
use futures::FutureExt;
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use stoker_testkit::embedded_s3::EmbeddedS3;
use stoker_worker::dataset::index::DatasetIndex;
use stoker_worker::dataset::parquet::{
    read_row, Columns, ParquetShard, ReadRange, RowImage, StoreFile,
};
use stoker_worker::source::Store;

const ROWS: usize = 5;
const IMAGE_BYTES: usize = 200 << 10;

fn image(row: usize) -> Vec<u8> {
    (0..IMAGE_BYTES).map(|i| (i * 31 + row * 7) as u8).collect()
}

/// Five rows in row groups of two, a page per row, no dictionary: LLaMA-Factory's OpenAI style
/// stored as JSON text, one embedded image each; row 3 has two images for its one tag.
fn parquet_file() -> Vec<u8> {
    let messages: Vec<String> = (0..ROWS)
        .map(|r| {
            serde_json::json!([
                {"role": "user", "content": format!("<image>What is row {r}?")},
                {"role": "assistant", "content": "A pattern."}
            ])
            .to_string()
        })
        .collect();
    let lengths: Vec<usize> = (0..ROWS).map(|r| if r == 3 { 2 } else { 1 }).collect();
    let blobs: Vec<Vec<u8>> = (0..ROWS)
        .flat_map(|r| std::iter::repeat_n(image(r), lengths[r]))
        .collect();
    let fields = Fields::from(vec![
        Field::new("bytes", DataType::Binary, true),
        Field::new("path", DataType::Utf8, true),
    ]);
    let images = StructArray::new(
        fields.clone(),
        vec![
            Arc::new(BinaryArray::from_iter_values(blobs.iter())) as ArrayRef,
            Arc::new(StringArray::from(vec![None::<&str>; blobs.len()])),
        ],
        None,
    );
    let item = Arc::new(Field::new("item", DataType::Struct(fields), true));
    let offsets = OffsetBuffer::from_lengths(lengths.iter().copied());
    let images = ListArray::new(item, offsets, Arc::new(images), None);
    let batch = RecordBatch::try_from_iter([
        (
            "messages",
            Arc::new(StringArray::from(messages)) as ArrayRef,
        ),
        ("images", Arc::new(images)),
    ])
    .unwrap();
    let props = WriterProperties::builder()
        .set_max_row_group_row_count(Some(2))
        .set_write_batch_size(1)
        .set_data_page_size_limit(32 << 10)
        .set_dictionary_enabled(false)
        .build();
    let mut out = Vec::new();
    let mut w = ArrowWriter::try_new(&mut out, batch.schema(), Some(props)).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    out
}

/// `data.parquet`'s reads from `store`, their bytes added to `counted`.
fn counted_reads(store: &Store, counted: &Arc<AtomicU64>) -> ReadRange {
    let (counted, store) = (counted.clone(), store.clone());
    Arc::new(move |start, len| {
        let (counted, store) = (counted.clone(), store.clone());
        async move {
            counted.fetch_add(len, Ordering::Relaxed);
            store.get_range("data.parquet", start, len).await
        }
        .boxed()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parquet_shard_is_indexed_by_row_and_a_row_read_by_its_pages() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("bucket/data");
    std::fs::create_dir_all(&dir).unwrap();
    let file = parquet_file();
    std::fs::write(dir.join("data.parquet"), &file).unwrap();
    let s3 = EmbeddedS3::start(root.path(), "127.0.0.1:0", Duration::ZERO)
        .await
        .unwrap();
    let store = Store::open("s3://bucket/data", &s3.s3_options())
        .await
        .unwrap();

    let idx = DatasetIndex::build(&store, None, &()).await.unwrap();
    let shard = &idx.shards[0];
    let layout = ParquetShard {
        row_groups: vec![2, 2, 1],
        columns: Columns {
            conversation: "messages".into(),
            images: Some("images".into()),
            system: None,
        },
        image_paths: false,
    };
    assert_eq!(shard.parquet.as_ref(), Some(&layout));
    assert_eq!(shard.format_name(), "llamafactory-openai");
    assert_eq!(idx.num_samples(), 4);
    let bad: Vec<String> = idx.bad_lines.iter().map(|b| b.to_string()).collect();
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(
        bad[0].starts_with("data.parquet:3: 1 <image> and 0 <video> tags in the text but 2 images"),
        "{bad:?}"
    );
    // Sample 3 is row 4 (row 3 is bad), and the stored index keeps the layout.
    assert_eq!(idx.locate(3).unwrap().1.offset, 4);
    let stored = DatasetIndex::from_bytes(idx.to_bytes()).unwrap();
    assert_eq!(stored.shards, idx.shards);

    // Row 4 alone: its text pages and its image's page, never the file.
    let read_bytes = Arc::new(AtomicU64::new(0));
    let read = counted_reads(&store, &read_bytes);
    let mut f = StoreFile::new(
        "data.parquet".into(),
        file.len() as u64,
        read,
        (1 << 20, "test"),
    );
    let meta = f.load_metadata().await.unwrap();
    let footer = read_bytes.swap(0, Ordering::Relaxed);
    assert!(footer < 64 << 10, "{footer} bytes of footer");
    let row = read_row(f, meta, &layout, (2, 0)).await.unwrap();
    assert_eq!(row.images, [RowImage::Bytes(Bytes::from(image(4)))]);
    assert!(String::from_utf8(row.json)
        .unwrap()
        .contains("What is row 4?"));
    let read = read_bytes.load(Ordering::Relaxed);
    assert!(
        read < IMAGE_BYTES as u64 + (64 << 10) && (file.len() as u64) > 5 * IMAGE_BYTES as u64,
        "{read} bytes read for one row of a {}-byte file",
        file.len()
    );

    // A read over the cap is refused by name, never asked of the store.
    let read = counted_reads(&store, &read_bytes);
    let mut f = StoreFile::new(
        "data.parquet".into(),
        file.len() as u64,
        read,
        (64 << 10, "max-object-bytes"),
    );
    let meta = f.load_metadata().await.unwrap();
    read_bytes.store(0, Ordering::Relaxed);
    let e = read_row(f, meta, &layout, (0, 1)).await.unwrap_err();
    assert!(format!("{e:?}").contains("(max-object-bytes)"), "{e:?}");
    assert!(read_bytes.load(Ordering::Relaxed) < 64 << 10);
}
