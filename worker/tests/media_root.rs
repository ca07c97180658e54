//! A dataset whose media lie apart from its shards (`--media-root`): LLaVA's `image_folder`,
//! in another bucket of the same S3 server, or in another local folder of a mix; read in
//! place, byte for byte what the same samples give with their images beside the shards.

mod common;

use common::synth_dataset;
use stoker_config::WorkerConfig;
use stoker_testkit::synth::SynthFormat;
use stoker_worker::dataset::index::{DatasetIndex, INDEX_CAP, INDEX_KEY};
use stoker_worker::metrics::Metrics;
use stoker_worker::open::open_pipeline;
use stoker_worker::pipeline::Pipeline;
use stoker_worker::source::{MediaRoot, Store};

/// Moves `from`'s `images/` folder to `to` (created), leaving the shards where they are.
fn move_images(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    std::fs::rename(from.join("images"), to.join("images")).unwrap();
}

/// What the model gets for each sample: its tokens, and each image's grid and pixels.
type Loaded = Vec<(Vec<i64>, Vec<([i64; 3], Vec<u8>)>)>;

async fn load_all(p: &std::sync::Arc<Pipeline>) -> Loaded {
    let mut out: Loaded = Vec::new();
    for id in 0..p.index.num_samples() {
        let s = p.load_sample(id).await.unwrap();
        let images = s.images.iter();
        let images = images.map(|i| (i.grid_thw, i.pixels.as_bytes().to_vec()));
        out.push((s.input_ids, images.collect()));
    }
    assert!(
        out.iter().any(|s| !s.1.is_empty()),
        "the samples hold images"
    );
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_in_another_bucket_are_read_in_place() {
    let ds = synth_dataset(12, SynthFormat::Llava).await;
    let beside = open_pipeline(&ds.config(4), Metrics::new()).await.unwrap();
    let (beside_index, beside) = (beside.index.num_samples(), load_all(&beside).await);
    // The same dataset, its images moved to s3://media/coco/images/.
    move_images(&ds.dir(), &ds.root.path().join("media/coco"));
    let store = Store::open(&ds.uri, &ds.s3.s3_options()).await.unwrap();

    // Without the media root every sample with an image names an object that is not there.
    let lost = DatasetIndex::build(&store, None, &()).await.unwrap();
    assert_eq!(lost.bad_line_count, beside_index, "{:?}", lost.bad_lines);
    assert!(
        lost.bad_lines[0].reason.contains("does not exist"),
        "{}",
        lost.bad_lines[0]
    );

    let media = MediaRoot::open("s3://media/coco", &ds.s3.s3_options())
        .await
        .unwrap();
    assert_eq!(media.uri, "s3://media/coco/");
    let idx = DatasetIndex::build(&store, Some(&media), &())
        .await
        .unwrap();
    assert_eq!((idx.num_samples(), idx.bad_line_count), (beside_index, 0));
    assert_eq!(idx.media_roots(), ["s3://media/coco/"]);
    // The stored index records its media root; opened with another, it is built again.
    store.put(INDEX_KEY, idx.to_bytes()).await.unwrap();
    let stored =
        DatasetIndex::from_bytes(store.get_at_most(INDEX_KEY, INDEX_CAP).await.unwrap()).unwrap();
    assert!(stored
        .shards
        .iter()
        .all(|s| s.media_root == "s3://media/coco/"));
    let rebuilt = DatasetIndex::load_or_build(&store, None, 1000)
        .await
        .unwrap();
    assert_eq!(
        rebuilt.num_samples(),
        0,
        "without the root its images are missing"
    );
    assert_ne!(rebuilt.version, idx.version);

    let mut cfg = ds.config(4);
    cfg.media_root = Some("s3://media/coco".into());
    let apart = open_pipeline(&cfg, Metrics::new()).await.unwrap();
    assert!(load_all(&apart).await == beside);
}

/// A path that leaves the media root is a bad line naming it, whatever the format; the rest
/// of the shard is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_that_leaves_the_media_root_is_a_bad_line() {
    let dir = tempfile::tempdir().unwrap();
    let (data, media) = (dir.path().join("data"), dir.path().join("media/coco"));
    std::fs::create_dir_all(media.join("img")).unwrap();
    std::fs::create_dir_all(&data).unwrap();
    let png = common::png(32, 24);
    std::fs::write(media.join("img/a.png"), &png).unwrap();
    std::fs::write(dir.path().join("media/secret.png"), &png).unwrap();
    let line = |path: &str| {
        format!(
            r#"{{"messages": [{{"role": "user", "content": "<image>What?"}}, {{"role": "assistant", "content": "A."}}], "images": ["{path}"]}}"#
        )
    };
    let shard = [
        line("img/a.png"),
        line("../secret.png"),
        line("img/../img/a.png"),
        line("/etc/passwd"),
    ]
    .join("\n");
    std::fs::write(data.join("s.jsonl"), shard).unwrap();
    let s3 = stoker_config::S3Connection::default();
    let store = Store::open(data.to_str().unwrap(), &s3).await.unwrap();
    let root = MediaRoot::open(media.to_str().unwrap(), &s3).await.unwrap();
    let idx = DatasetIndex::build(&store, Some(&root), &()).await.unwrap();
    let report: Vec<String> = idx.bad_lines.iter().map(|b| b.to_string()).collect();
    assert_eq!(idx.num_samples(), 2, "{report:?}");
    assert!(report[0].starts_with("s.jsonl:2:"), "{report:?}");
    assert!(report[0].contains("escapes the media root"), "{report:?}");
    assert!(report[1].starts_with("s.jsonl:4:"), "{report:?}");
    assert!(
        report[1].contains("relative to the media root"),
        "{report:?}"
    );

    let cfg = WorkerConfig {
        data: data.display().to_string(),
        media_root: Some(media.display().to_string()),
        ..WorkerConfig::default()
    };
    let p = open_pipeline(&cfg, Metrics::new()).await.unwrap();
    let (a, b) = (
        p.load_sample(0).await.unwrap(),
        p.load_sample(1).await.unwrap(),
    );
    assert_eq!(a.images[0].pixels.as_bytes(), b.images[0].pixels.as_bytes());
}

/// In a mix each dataset has its own media root (or none): the worker reads each sample's
/// media from its own dataset's root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_mixed_dataset_reads_its_own_media_root() {
    let chat = synth_dataset(6, SynthFormat::Llava).await;
    let vqa = synth_dataset(6, SynthFormat::Messages).await;
    // Both in one parent folder, as a mix of local folders needs.
    let parent = tempfile::tempdir().unwrap();
    for (d, name) in [(&chat, "chat"), (&vqa, "vqa")] {
        copy_dir(&d.dir(), &parent.path().join(name));
    }
    let mut together = WorkerConfig {
        data: parent.path().join("chat").display().to_string(),
        ..WorkerConfig::default()
    };
    together.sampling.global_batch_size = 4;
    let vqa_data = parent.path().join("vqa").display().to_string();
    together.sampling.mix = vec![format!("{vqa_data}=1").parse().unwrap()];
    let beside = load_all(&open_pipeline(&together, Metrics::new()).await.unwrap()).await;

    let apart = tempfile::tempdir().unwrap();
    move_images(&parent.path().join("vqa"), &apart.path().join("vqa-media"));
    together.sampling.mix[0].media_root =
        Some(apart.path().join("vqa-media").display().to_string());
    let mixed = open_pipeline(&together, Metrics::new()).await.unwrap();
    assert!(load_all(&mixed).await == beside);
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}
