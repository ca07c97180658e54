//! Startup and serve-time reads stay inside the dataset and within a size: a symbolic link
//! placed after indexing is refused when the sample is served (as the index refuses one), a
//! hand-written index naming a shard outside the root is refused, and every object or file
//! read whole (index, lengths, tokenizer, template) has a cap.

mod common;

use stoker_config::{Preprocessing, S3Connection, WorkerConfig};
use stoker_worker::dataset::index::{DatasetIndex, INDEX_KEY};
use stoker_worker::metrics::Metrics;
use stoker_worker::open::open_pipeline;
use stoker_worker::source::{
    read_file_at_most, FetchError, ReadCap, Store, TEMPLATE_CAP, TOKENIZER_CAP,
};
use stoker_worker::tokenizer_source::text_processor;

const LINE: &str = r#"{"messages": [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "A."}], "images": ["img/a.png"]}"#;

/// `dir/data/s.jsonl` with two samples of `img/a.png`, and `dir/secret.png` beside the
/// dataset (another picture of the same size).
fn dataset(dir: &std::path::Path) -> std::path::PathBuf {
    let data = dir.join("data");
    std::fs::create_dir_all(data.join("img")).unwrap();
    std::fs::write(data.join("img/a.png"), common::png(32, 24)).unwrap();
    std::fs::write(dir.join("secret.png"), common::png(24, 32)).unwrap();
    std::fs::write(data.join("s.jsonl"), format!("{LINE}\n{LINE}\n")).unwrap();
    data
}

fn config(data: &std::path::Path) -> WorkerConfig {
    WorkerConfig {
        data: data.display().to_string(),
        ..WorkerConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_swapped_for_a_symlink_after_indexing_is_refused_when_served() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let p = open_pipeline(&config(&data), Metrics::new()).await.unwrap();
    assert_eq!(p.load_sample(0).await.unwrap().images.len(), 1);

    // The image becomes a link to a file outside the dataset; so does its folder.
    std::fs::remove_file(data.join("img/a.png")).unwrap();
    std::os::unix::fs::symlink(dir.path().join("secret.png"), data.join("img/a.png")).unwrap();
    let e = p.load_sample(1).await.err().expect("refused");
    assert_eq!(e.kind, "path_refused", "{e}");
    assert!(e.message.contains("img/a.png is a symbolic link"), "{e}");
    assert!(!e.transient, "{e}");

    std::fs::rename(data.join("img"), dir.path().join("elsewhere")).unwrap();
    std::os::unix::fs::symlink(dir.path().join("elsewhere"), data.join("img")).unwrap();
    let e = p.load_sample(1).await.err().expect("refused");
    assert!(e.message.contains("/img is a symbolic link"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_index_naming_a_shard_outside_the_root_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    std::fs::create_dir_all(dir.path().join("other")).unwrap();
    std::fs::write(
        dir.path().join("other/s.jsonl"),
        format!("{LINE}\n{LINE}\n"),
    )
    .unwrap();
    let store = Store::open(data.to_str().unwrap(), &S3Connection::default())
        .await
        .unwrap();
    let built = DatasetIndex::build(&store, None, &()).await.unwrap();
    for bad in [
        "../other/s.jsonl",
        "/etc/passwd",
        "./s.jsonl",
        "a\\..\\s.jsonl",
    ] {
        let mut forged = built.clone();
        forged.shards[0].key = bad.to_string();
        let e = DatasetIndex::from_bytes(forged.to_bytes()).unwrap_err();
        assert!(e.to_string().contains(&format!("shard key {bad:?}")), "{e}");

        // A worker given that index refuses to start, naming it.
        store.put(INDEX_KEY, forged.to_bytes()).await.unwrap();
        let e = match open_pipeline(&config(&data), Metrics::new()).await {
            Ok(_) => panic!("{bad}: served"),
            Err(e) => format!("{e:#}"),
        };
        assert!(
            e.contains(INDEX_KEY) && e.contains(&format!("{bad:?}")),
            "{e}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_object_read_stops_at_its_cap() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("big.bin"), vec![7u8; 4097]).unwrap();
    let store = Store::open(dir.path().to_str().unwrap(), &S3Connection::default())
        .await
        .unwrap();
    let cap = ReadCap {
        bytes: 4096,
        name: "a test's 4 KiB cap",
    };
    match store.get_at_most("big.bin", cap).await {
        Err(e @ FetchError::TooLarge { .. }) => {
            assert!(
                e.to_string()
                    .contains("4097 bytes, over the limit of 4096 (a test's 4 KiB cap)"),
                "{e}"
            )
        }
        other => panic!("{other:?}"),
    }
    let fits = ReadCap { bytes: 4097, ..cap };
    assert_eq!(
        store.get_at_most("big.bin", fits).await.unwrap().len(),
        4097
    );
    match store.get_at_most("../big.bin", fits).await {
        Err(e @ FetchError::Refused(..)) => assert!(e.to_string().contains("'..'"), "{e}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_tokenizer_or_template_past_its_cap_is_not_read() {
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("tokenizer.json");
    let f = std::fs::File::create(&big).unwrap();
    f.set_len(TOKENIZER_CAP.bytes + 1).unwrap(); // sparse: no 64 MiB written
    let e = read_file_at_most(&big, TOKENIZER_CAP).unwrap_err();
    assert!(e.to_string().contains("64 MiB cap"), "{e}");
    let s3 = S3Connection::default();
    let mut pre = Preprocessing {
        tokenizer: Some(dir.path().display().to_string()),
        ..Preprocessing::default()
    };
    let e = text_processor(&pre, &s3).await.err().expect("refused");
    assert!(format!("{e:#}").contains("64 MiB cap"), "{e:#}");

    // The real tokenizer, with a template past its own cap.
    pre.tokenizer = None;
    let template = dir.path().join("t.jinja");
    std::fs::File::create(&template)
        .unwrap()
        .set_len(TEMPLATE_CAP.bytes + 1)
        .unwrap();
    pre.template = Some(template.display().to_string());
    let e = text_processor(&pre, &s3).await.err().expect("refused");
    assert!(format!("{e:#}").contains("1 MiB cap"), "{e:#}");
}
