//! A worker becomes ready with one GET of the index and one HEAD per shard, behind the
//! embedded S3 server: the requests grow with the shards, never with the objects (images)
//! beside them. A changed shard is still noticed and re-read alone; a missing index is built
//! by the worker only for a dataset of at most `--self-index-max-objects` objects.

use std::path::Path;
use std::time::Duration;
use stoker_testkit::embedded_s3::EmbeddedS3;
use stoker_worker::dataset::index::{DatasetIndex, NeedsIndex, StaleShard, INDEX_KEY};
use stoker_worker::source::Store;

const LINE: &str = r#"{"image":"img/00000.png","conversations":[{"from":"human","value":"<image>\nhi"},{"from":"gpt","value":"yo"}]}"#;

/// `shards` shards of 5 lines each and `images` image objects, in `root`/bucket/data.
fn write_dataset(root: &Path, shards: usize, images: usize) {
    let dir = root.join("bucket/data");
    std::fs::create_dir_all(dir.join("img")).unwrap();
    for i in 0..images {
        std::fs::write(dir.join(format!("img/{i:05}.png")), b"not decoded here").unwrap();
    }
    for s in 0..shards {
        let text = format!("{LINE}\n").repeat(5);
        std::fs::write(dir.join(format!("s{s:03}.jsonl")), text).unwrap();
    }
}

/// The dataset in `root` behind an embedded S3 server: the server and the store.
async fn served(root: &Path) -> (EmbeddedS3, Store) {
    let s3 = EmbeddedS3::start(root, "127.0.0.1:0", Duration::ZERO)
        .await
        .unwrap();
    let store = Store::open("s3://bucket/data", &s3.s3_options())
        .await
        .unwrap();
    (s3, store)
}

/// [`served`], indexed as `stoker dataset index` does: with the index built.
async fn indexed(root: &Path) -> (EmbeddedS3, Store, DatasetIndex) {
    let (s3, store) = served(root).await;
    let built = DatasetIndex::build(&store, None, &()).await.unwrap();
    store.put(INDEX_KEY, built.to_bytes()).await.unwrap();
    (s3, store, built)
}

/// Requests the embedded S3 server answered while a worker's index loaded, and the index.
async fn requests_to_load(shards: usize, images: usize) -> (u64, DatasetIndex) {
    let root = tempfile::tempdir().unwrap();
    write_dataset(root.path(), shards, images);
    let (s3, store, _) = indexed(root.path()).await;
    let before = s3.requests_received();
    let idx = DatasetIndex::load_or_build(&store, None, 10).await.unwrap();
    (s3.requests_received() - before, idx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_takes_one_request_per_shard_whatever_the_objects() {
    // 2,500 images are three pages of a listing: listing would show here.
    for (shards, images) in [(3, 1), (3, 2500), (12, 1), (12, 2500)] {
        let (requests, idx) = requests_to_load(shards, images).await;
        assert_eq!(idx.num_samples(), 5 * shards as u64);
        assert_eq!(
            requests,
            1 + shards as u64,
            "{shards} shards, {images} images: one GET of the index and a HEAD per shard"
        );
    }
}

/// A re-uploaded shard is re-read alone (one GET of it, no listing), a removed one leaves
/// the index; the others keep their entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_or_removed_shard_is_re_read_alone() {
    let root = tempfile::tempdir().unwrap();
    write_dataset(root.path(), 3, 2500);
    let (s3, store, built) = indexed(root.path()).await;
    assert_eq!(built.stale_shards(&store).await.unwrap(), []);

    let shard = root.path().join("bucket/data/s001.jsonl");
    let other = r#"{"image":"img/00001.png","conversations":[{"from":"human","value":"<image>\nwhat?"},{"from":"gpt","value":"this"}]}"#;
    std::fs::write(&shard, format!("{other}\n").repeat(7)).unwrap();
    let stale = built.stale_shards(&store).await.unwrap();
    assert!(
        matches!(
            stale[..],
            [StaleShard {
                shard: 1,
                now: Some(_)
            }]
        ),
        "{stale:?}"
    );
    assert!(built.describe(&stale[0]).starts_with("s001.jsonl is "));
    let before = s3.requests_received();
    let idx = DatasetIndex::load_or_build(&store, None, 10).await.unwrap();
    assert_eq!(
        s3.requests_received() - before,
        1 + 3 + 1,
        "the index, a HEAD per shard, the changed shard: no listing"
    );
    assert_eq!(idx.num_samples(), 5 + 7 + 5);
    assert_eq!(idx.shards[1].samples(), 7);
    // Each sample's line is where the shard has it: the new shard's and the others'.
    for (id, text) in [(0, LINE), (5, other), (11, other), (12, LINE), (16, LINE)] {
        let (shard, line) = idx.locate(id).unwrap();
        let bytes = std::fs::read(root.path().join("bucket/data").join(&shard.key)).unwrap();
        let at = line.offset as usize;
        assert_eq!(
            &bytes[at..at + line.len as usize],
            text.as_bytes(),
            "sample {id}"
        );
    }
    // Another index than both the old one and what `stoker dataset index` writes now (whose
    // media were checked): another plan id.
    let full = DatasetIndex::build(&store, None, &()).await.unwrap();
    assert_eq!(full.num_samples(), idx.num_samples());
    assert_ne!(idx.version, built.version);
    assert_ne!(idx.version, full.version);

    std::fs::remove_file(&shard).unwrap();
    let stale = built.stale_shards(&store).await.unwrap();
    assert_eq!(built.describe(&stale[0]), "s001.jsonl is gone");
    let before = s3.requests_received();
    let idx = DatasetIndex::load_or_build(&store, None, 10).await.unwrap();
    assert_eq!(idx.num_samples(), 10);
    assert_eq!(s3.requests_received() - before, 1 + 3);
}

/// Without an index a worker indexes a dataset of at most `max_objects` objects, and refuses a
/// larger one after one page of its listing, naming the command that writes the index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_index_is_built_only_for_a_small_dataset() {
    let root = tempfile::tempdir().unwrap();
    write_dataset(root.path(), 3, 2500);
    let (s3, store) = served(root.path()).await;
    let before = s3.requests_received();
    let e = DatasetIndex::load_or_build(&store, None, 100)
        .await
        .unwrap_err();
    assert_eq!(
        s3.requests_received() - before,
        1 + 1,
        "the index's GET, the listing's first page (past 100 objects)"
    );
    let needs = e.downcast_ref::<NeedsIndex>().expect("NeedsIndex");
    assert_eq!(needs.dataset, "s3://bucket/data/");
    let msg = e.to_string();
    assert!(
        msg.contains("more than --self-index-max-objects (100) objects")
            && msg.contains("Run `stoker dataset index s3://bucket/data/` once"),
        "{msg}"
    );
    // 2,503 objects are within 2,503: indexed as before.
    let idx = DatasetIndex::load_or_build(&store, None, 2503)
        .await
        .unwrap();
    assert_eq!(idx.num_samples(), 15);
}

/// A local folder works the same way (HEAD is a stat).
#[tokio::test]
async fn a_local_index_is_checked_shard_by_shard() {
    let root = tempfile::tempdir().unwrap();
    write_dataset(root.path(), 2, 3);
    let dir = root.path().join("bucket/data");
    let store = Store::open(dir.to_str().unwrap(), &Default::default())
        .await
        .unwrap();
    let built = DatasetIndex::build(&store, None, &()).await.unwrap();
    store.put(INDEX_KEY, built.to_bytes()).await.unwrap();
    assert_eq!(built.stale_shards(&store).await.unwrap(), []);
    // Images may change or go without the index noticing: they are never listed.
    std::fs::remove_file(dir.join("img/00002.png")).unwrap();
    assert_eq!(built.stale_shards(&store).await.unwrap(), []);
    std::fs::write(dir.join("s000.jsonl"), format!("{LINE}\n")).unwrap();
    assert_eq!(built.stale_shards(&store).await.unwrap().len(), 1);
}
