//! A sample whose request goes away (cancelled, late, its connection closed) stops being
//! prepared within one image or frame, and its CPU slot serves the next sample: the flag is
//! read between media, between a frame list's frames and before each packet of a clip.

use std::time::{Duration, Instant};
use stoker_config::WorkerConfig;
use stoker_worker::metrics::Metrics;
use stoker_worker::open::open_pipeline;

/// Frames of the costly sample's frame list, each a 1024² JPEG.
const FRAMES: usize = 64;

fn jpeg(side: u16) -> Vec<u8> {
    let n = side as usize * side as usize * 3;
    let px: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
    let mut out = Vec::new();
    jpeg_encoder::Encoder::new(&mut out, 90)
        .encode(&px, side, side, jpeg_encoder::ColorType::Rgb)
        .unwrap();
    out
}

/// 0: a frame list of [`FRAMES`] large frames (costly to decode); 1: text alone.
fn dataset() -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    std::fs::write(root.path().join("frame.jpg"), jpeg(1024)).unwrap();
    let frames = vec!["frame.jpg"; FRAMES];
    let costly = serde_json::json!({"messages": [
        {"role": "user", "content": [{"type": "video", "video": frames}, {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": "A."},
    ]});
    let cheap = serde_json::json!({"messages": [
        {"role": "user", "content": "What?"},
        {"role": "assistant", "content": "A."},
    ]});
    std::fs::write(root.path().join("s.jsonl"), format!("{costly}\n{cheap}\n")).unwrap();
    root
}

/// Polls `done` every millisecond for at most a minute (a bound, not a timing check).
async fn wait_for(what: &str, done: impl Fn() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "waited a minute for {what}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_sample_frees_its_cpu_slot_within_one_frame() {
    let root = dataset();
    let mut cfg = WorkerConfig {
        data: root.path().display().to_string(),
        ..WorkerConfig::default()
    };
    cfg.concurrency.cpu_threads = Some(1);
    cfg.preprocessing.max_length = Some(1 << 16); // the frame list's ~23,000 tokens
    let metrics = Metrics::new();
    let p = open_pipeline(&cfg, metrics.clone()).await.unwrap();
    let full = Instant::now();
    p.load_sample(0).await.unwrap();
    let full = full.elapsed();

    // The costly sample takes the only CPU slot; the cheap one then waits for it.
    let costly = tokio::spawn({
        let p = p.clone();
        async move { p.load_sample(0).await.map(|_| ()) }
    });
    let cpu_waiting = || metrics.queue_depth.with_label_values(&["cpu"]).get();
    // Its frame fetched again, once for all its mentions (its line now comes from the line
    // cache).
    let frame_bytes = std::fs::metadata(root.path().join("frame.jpg"))
        .unwrap()
        .len();
    let fetched = metrics.object_bytes_total.get() + frame_bytes;
    wait_for("the costly sample's frames", || {
        metrics.object_bytes_total.get() >= fetched && metrics.fetches_in_flight.get() == 0
    })
    .await;
    let cheap = tokio::spawn({
        let p = p.clone();
        async move { p.load_sample(1).await.map(|_| Instant::now()) }
    });
    wait_for("the cheap sample to wait for the CPU", || {
        cpu_waiting() == 1
    })
    .await;

    // Its request goes away: the task holding the costly sample is dropped.
    let cancelled_at = Instant::now();
    costly.abort();
    assert!(costly.await.unwrap_err().is_cancelled());
    let served_at = cheap.await.unwrap().unwrap();
    let stopped = || {
        metrics
            .sample_errors_total
            .with_label_values(&["cancelled"])
            .get()
    };
    wait_for("the stopped preparation to be counted", || stopped() == 1).await;
    eprintln!(
        "the cheap sample was served {:?} after the cancel; the costly sample takes {full:?} whole",
        served_at - cancelled_at
    );
    // The slot served the next sample once the costly one stopped part way, not after it
    // finished: one stopped preparation, and the pipeline serves both samples afterwards.
    assert_eq!(stopped(), 1);
    p.load_sample(0).await.unwrap();
    p.load_sample(1).await.unwrap();
}
