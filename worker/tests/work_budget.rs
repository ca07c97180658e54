//! A sample's decoding work is bounded (`--max-sample-work`, in pixel passes): charged from
//! each medium's header before it is decoded — an image's pixels times its passes (a
//! progressive JPEG, whose scans libjpeg-turbo decodes without reporting progress, is charged
//! the scan limit, 100), a clip's frame pixels times the frames decoded up to the last one
//! sampled — summed over the sample. Over it, the sample is skipped by name
//! (`sample_over_work_budget`), served or measured alike, the same on every worker.

use stoker_config::WorkerConfig;
use stoker_control::exposition::metric_value_with;
use stoker_worker::identity::plan_id;
use stoker_worker::metrics::Metrics;
use stoker_worker::open::open_pipeline;
use stoker_worker::pipeline::Pipeline;

const CLIP: &[u8] = include_bytes!("fixtures/clip.mp4");

fn jpeg(side: u16, progressive: bool) -> Vec<u8> {
    let n = side as usize * side as usize * 3;
    let px: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
    let mut out = Vec::new();
    let mut enc = jpeg_encoder::Encoder::new(&mut out, 90);
    enc.set_progressive(progressive);
    enc.encode(&px, side, side, jpeg_encoder::ColorType::Rgb)
        .unwrap();
    out
}

fn line(media: &[serde_json::Value]) -> String {
    let mut content = media.to_vec();
    content.push(serde_json::json!({"type": "text", "text": "What is it?"}));
    serde_json::json!({"messages": [
        {"role": "user", "content": content},
        {"role": "assistant", "content": "A test."},
    ]})
    .to_string()
}

fn image(path: &str) -> serde_json::Value {
    serde_json::json!({"type": "image", "image": path})
}

/// 0: a baseline 64² JPEG, 1: the same progressive, 2: two baseline ones, 3: the clip.
fn dataset() -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path();
    std::fs::write(dir.join("base.jpg"), jpeg(64, false)).unwrap();
    std::fs::write(dir.join("prog.jpg"), jpeg(64, true)).unwrap();
    std::fs::write(dir.join("clip.mp4"), CLIP).unwrap();
    let lines = [
        line(&[image("base.jpg")]),
        line(&[image("prog.jpg")]),
        line(&[image("base.jpg"), image("base.jpg")]),
        line(&[serde_json::json!({"type": "video", "video": "clip.mp4"})]),
    ];
    std::fs::write(dir.join("s.jsonl"), lines.join("\n") + "\n").unwrap();
    root
}

async fn pipeline(root: &tempfile::TempDir, work: u64) -> std::sync::Arc<Pipeline> {
    let mut cfg = WorkerConfig {
        data: root.path().display().to_string(),
        ..WorkerConfig::default()
    };
    cfg.preprocessing.max_sample_work = work;
    open_pipeline(&cfg, Metrics::new()).await.unwrap()
}

/// Each sample served and measured: `None` when both succeed, else the skip's message (the
/// kind must be `sample_over_work_budget` and both must agree).
async fn outcomes(p: &std::sync::Arc<Pipeline>) -> Vec<Option<String>> {
    let mut out = Vec::new();
    for id in 0..p.index.num_samples() {
        let served = p.load_sample(id).await.err();
        let measured = p.measure_sample(id).await.err();
        assert_eq!(
            served.as_ref().map(|e| e.kind),
            measured.as_ref().map(|e| e.kind),
            "sample {id}: served {served:?}, measured {measured:?}"
        );
        if let Some(e) = &served {
            assert_eq!(e.kind, "sample_over_work_budget", "{e}");
            assert!(!e.transient, "{e}");
        }
        out.push(served.map(|e| e.message));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decoding_work_over_the_budget_is_a_named_skip_served_or_measured() {
    let root = dataset();
    let image = 64 * 64;
    // The default budget holds them all.
    let all = outcomes(&pipeline(&root, stoker_config::DEFAULT_MAX_SAMPLE_WORK).await).await;
    assert_eq!(all, vec![None; 4]);

    // One baseline image's work, and not a pixel pass more.
    let got = outcomes(&pipeline(&root, image).await).await;
    assert!(got[0].is_none(), "{got:?}");
    let prog = got[1].as_deref().unwrap();
    assert!(
        prog.contains("image prog.jpg: decoding 64x64 pixels in 100 passes")
            && prog.contains("its budget, 4096 pixel passes (max-sample-work)"),
        "{prog}"
    );
    // Two images: the second is over what the sample has left.
    let two = got[2].as_deref().unwrap();
    assert!(
        two.contains("in 1 passes") && two.contains("its budget, 0 pixel"),
        "{two}"
    );
    let clip = got[3].as_deref().unwrap();
    assert!(
        clip.contains("video clip.mp4: decoding its first "),
        "{clip}"
    );

    // The clip is charged every frame up to the last sampled, at the header's size: exactly
    // that much passes, one pass less is refused.
    let frames: u64 = clip
        .split("its first ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{clip}"));
    assert!(clip.contains(" frames of 64x48 "), "{clip}");
    assert!((2..=30).contains(&frames), "{clip}");
    let charge = frames * 64 * 48;
    assert!(outcomes(&pipeline(&root, charge).await).await[3].is_none());
    assert!(outcomes(&pipeline(&root, charge - 1).await).await[3].is_some());
    // A progressive image is charged 100 passes, exactly.
    let at = outcomes(&pipeline(&root, 100 * image).await).await;
    assert!(at[1].is_none() && at[2].is_none(), "{at:?}");
    assert!(outcomes(&pipeline(&root, 100 * image - 1).await).await[1].is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_budget_is_counted_and_part_of_the_plan() {
    let root = dataset();
    let p = pipeline(&root, 64 * 64).await;
    assert!(p.load_sample(1).await.is_err());
    let m = p.metrics.render();
    let got = metric_value_with(
        &m,
        "stoker_worker_sample_errors_total",
        &[("kind", "sample_over_work_budget")],
    );
    assert_eq!(got, Some(1.0), "{m}");
    let other = pipeline(&root, 64 * 64 + 1).await;
    assert_ne!(plan_id(&p), plan_id(&other), "another budget, another plan");
}
