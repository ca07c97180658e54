//! A worker becomes ready with one GET of the index and one HEAD per shard, behind the
//! embedded S3 server: the requests grow with the shards, never with the objects (images)
//! beside them. A changed shard is still noticed, and the index rebuilt.

use std::path::Path;
use std::time::Duration;
use stoker_testkit::embedded_s3::EmbeddedS3;
use stoker_worker::dataset::index::{DatasetIndex, INDEX_KEY};
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

/// The dataset in `root` behind an embedded S3 server, indexed as `stoker dataset index`
/// does: the server, the store and the index built.
async fn indexed(root: &Path) -> (EmbeddedS3, Store, DatasetIndex) {
    let s3 = EmbeddedS3::start(root, "127.0.0.1:0", Duration::ZERO)
        .await
        .unwrap();
    let store = Store::open("s3://bucket/data", &s3.s3_options())
        .await
        .unwrap();
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
    let idx = DatasetIndex::load_or_build(&store, None).await.unwrap();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_or_removed_shard_is_noticed_and_the_index_rebuilt() {
    let root = tempfile::tempdir().unwrap();
    write_dataset(root.path(), 3, 1);
    let (_s3, store, built) = indexed(root.path()).await;
    assert_eq!(built.stale_shard(&store).await.unwrap(), None);

    let shard = root.path().join("bucket/data/s001.jsonl");
    std::fs::write(&shard, format!("{LINE}\n").repeat(7)).unwrap();
    let stale = built.stale_shard(&store).await.unwrap().expect("stale");
    assert!(stale.starts_with("s001.jsonl is "), "{stale}");
    let idx = DatasetIndex::load_or_build(&store, None).await.unwrap();
    assert_eq!(idx.num_samples(), 5 + 7 + 5);
    assert_ne!(idx.version, built.version);

    std::fs::remove_file(&shard).unwrap();
    let stale = idx.stale_shard(&store).await.unwrap().expect("gone");
    assert_eq!(stale, "s001.jsonl is gone");
    assert_eq!(
        DatasetIndex::load_or_build(&store, None)
            .await
            .unwrap()
            .num_samples(),
        10
    );
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
    assert_eq!(built.stale_shard(&store).await.unwrap(), None);
    // Images may change or go without the index noticing: they are never listed.
    std::fs::remove_file(dir.join("img/00002.png")).unwrap();
    assert_eq!(built.stale_shard(&store).await.unwrap(), None);
    std::fs::write(dir.join("s000.jsonl"), format!("{LINE}\n")).unwrap();
    assert!(built.stale_shard(&store).await.unwrap().is_some());
}
