//! A sample's images and frames are read within a byte budget (`--max-sample-bytes`): each
//! object once however often the sample names it, every frame of a frame list counted, the
//! reads stopped where the budget is spent; over it the sample is skipped by name
//! (`sample_over_byte_budget`), the same on every worker. Media past the sample's truncation
//! are never decoded: the truncation is decided from their headers.

use stoker_config::WorkerConfig;
use stoker_control::exposition::metric_value_with;
use stoker_testkit::synth::noise_png;
use stoker_worker::identity::plan_id;
use stoker_worker::metrics::Metrics;
use stoker_worker::open::open_pipeline;
use stoker_worker::pipeline::Pipeline;

/// A PNG whose header is whole and whose pixel data is cut short: it can be measured, not
/// decoded.
fn cut_png() -> Vec<u8> {
    let png = noise_png(28, 9);
    let idat = png.windows(4).position(|w| w == b"IDAT").unwrap();
    png[..idat + 4 + 16].to_vec()
}

fn turn(role: &str, content: serde_json::Value) -> serde_json::Value {
    serde_json::json!({"role": role, "content": content})
}

fn image(path: &str) -> serde_json::Value {
    serde_json::json!({"type": "image", "image": path})
}

fn text(t: &str) -> serde_json::Value {
    serde_json::json!({"type": "text", "text": t})
}

fn frames(paths: Vec<String>) -> serde_json::Value {
    serde_json::json!({"type": "video", "video": paths})
}

fn line(turns: Vec<serde_json::Value>) -> String {
    serde_json::json!({ "messages": turns }).to_string()
}

const FRAMES: usize = 40;

/// 0: big.png named by 40 image parts; 1: a frame list of 40 distinct frames; 2: of 10 of
/// them; 3: two turns, the second's image cut short; 4: the first of those turns alone.
fn dataset() -> (tempfile::TempDir, u64, u64) {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path();
    let big = noise_png(600, 1);
    std::fs::write(dir.join("big.png"), &big).unwrap();
    let mut frame_bytes = 0;
    for k in 0..FRAMES {
        let f = noise_png(128, 100 + k as u64);
        frame_bytes = frame_bytes.max(f.len() as u64);
        std::fs::write(dir.join(format!("f{k}.png")), f).unwrap();
    }
    std::fs::write(dir.join("small.png"), noise_png(28, 3)).unwrap();
    std::fs::write(dir.join("cut.png"), cut_png()).unwrap();
    let ask = |media: Vec<serde_json::Value>, q: &str| {
        let mut content = media;
        content.push(text(q));
        turn("user", serde_json::Value::Array(content))
    };
    let answer = |a: &str| turn("assistant", serde_json::json!(a));
    let names = |n: usize| (0..n).map(|k| format!("f{k}.png")).collect();
    let first_turns = vec![ask(vec![image("small.png")], "Look."), answer("Fine.")];
    let mut both = first_turns.clone();
    both.extend([ask(vec![image("cut.png")], "And this?"), answer("Broken.")]);
    let lines = [
        line(vec![
            ask(vec![image("big.png"); FRAMES], "Forty times?"),
            answer("Yes."),
        ]),
        line(vec![
            ask(vec![frames(names(FRAMES))], "Moving?"),
            answer("Yes."),
        ]),
        line(vec![
            ask(vec![frames(names(10))], "Moving?"),
            answer("Yes."),
        ]),
        line(both),
        line(first_turns),
    ];
    std::fs::write(dir.join("s.jsonl"), lines.join("\n") + "\n").unwrap();
    (root, big.len() as u64, frame_bytes)
}

async fn pipeline(
    root: &tempfile::TempDir,
    bytes: u64,
    max_length: Option<u32>,
) -> std::sync::Arc<Pipeline> {
    let mut cfg = WorkerConfig {
        data: root.path().display().to_string(),
        ..WorkerConfig::default()
    };
    cfg.preprocessing.max_sample_bytes = bytes;
    cfg.preprocessing.max_length = max_length;
    cfg.concurrency.line_cache_mib = 0; // each line read alone: the bytes fetched are exact
    open_pipeline(&cfg, Metrics::new()).await.unwrap()
}

fn fetched(p: &Pipeline) -> u64 {
    p.metrics.object_bytes_total.get()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sample_is_read_within_its_byte_budget_each_object_once() {
    let (root, big, frame) = dataset();
    let lines: Vec<u64> = std::fs::read_to_string(root.path().join("s.jsonl"))
        .unwrap()
        .lines()
        .map(|l| l.len() as u64)
        .collect();

    // big.png named 40 times is read once: a budget of 1.5 of it holds the sample (its 40
    // images' tokens need a longer max_length than the preset's).
    let p = pipeline(&root, big * 3 / 2, Some(32_768)).await;
    let before = fetched(&p);
    let s = p.load_sample(0).await.unwrap();
    assert_eq!(s.images.len(), FRAMES);
    assert_eq!(fetched(&p) - before, lines[0] + big, "one read of big.png");

    // 40 frames of up to `frame` bytes, a budget of 10 of them: skipped by name, and the
    // reads stopped at the budget.
    let budget = 10 * frame;
    let p = pipeline(&root, budget, None).await;
    let before = fetched(&p);
    let e = p.load_sample(1).await.err().unwrap();
    assert_eq!(e.kind, "sample_over_byte_budget", "{e}");
    assert!(!e.transient, "{e}");
    assert!(
        e.message.contains(&format!(
            "its images and frames come to more than {budget} bytes (max-sample-bytes)"
        )),
        "{e}"
    );
    assert!(e.to_string().contains("s.jsonl:2"), "{e}");
    let read = fetched(&p) - before;
    assert!(
        read <= lines[1] + budget,
        "read {read} bytes past the budget"
    );
    // Decided the same on another try, and counted.
    assert_eq!(p.load_sample(1).await.err().unwrap().kind, e.kind);
    let m = p.metrics.render();
    let counted = metric_value_with(
        &m,
        "stoker_worker_sample_errors_total",
        &[("kind", "sample_over_byte_budget")],
    );
    assert_eq!(counted, Some(2.0), "{m}");
    // 10 frames fit.
    let ten = p.load_sample(2).await.unwrap();
    assert_eq!(ten.videos.len(), 1);

    let other = pipeline(&root, budget + 1, None).await;
    assert_ne!(plan_id(&p), plan_id(&other), "another budget, another plan");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn media_past_the_truncation_are_never_decoded() {
    let (root, _, _) = dataset();
    let p = pipeline(&root, stoker_config::DEFAULT_MAX_SAMPLE_BYTES, None).await;
    // Whole, the sample decodes cut.png, which fails.
    let e = p.load_sample(3).await.err().unwrap();
    assert_eq!(e.kind, "image_corrupt", "{e}");
    assert!(e.message.contains("image cut.png"), "{e}");
    // Measured from headers, it has tokens; its first turn alone has fewer.
    let whole = p.measure_sample(3).await.unwrap();
    let first = p.measure_sample(4).await.unwrap();
    assert!(first.tokens < whole.tokens);

    // Truncated after its first turn, cut.png is dropped before it is decoded.
    let p = pipeline(
        &root,
        stoker_config::DEFAULT_MAX_SAMPLE_BYTES,
        Some(first.tokens as u32),
    )
    .await;
    let s = p.load_sample(3).await.unwrap();
    assert!(s.truncated);
    assert_eq!(s.images.len(), 1);
    assert_eq!(s.input_ids.len() as u64, first.tokens);
    let measured = p.measure_sample(3).await.unwrap();
    assert_eq!((measured.tokens, measured.images), (first.tokens, 1));
}
