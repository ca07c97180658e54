//! Videos: a good clip becomes its tensors and tokens; a bad one — cut short, not a video, over a
//! limit, a part holding no frame, a frame list of mixed sizes — fails by name with its kind
//! counted, whether served or measured from its header; the worker goes on.

mod common;

use common::png;
use stoker_config::WorkerConfig;
use stoker_worker::metrics::Metrics;
use stoker_worker::open::open_pipeline;

/// One second of 64x48 H.264 at 30 fps (moov first, so a cut keeps the header).
const CLIP: &[u8] = include_bytes!("fixtures/clip.mp4");

fn line(video: &str) -> String {
    format!(
        r#"{{"messages": [{{"role": "user", "content": [{video}, {{"type": "text", "text": "What happens?"}}]}}, {{"role": "assistant", "content": "Colours move."}}]}}"#
    )
}

fn dataset() -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    let clips = root.path().join("clips");
    std::fs::create_dir_all(&clips).unwrap();
    std::fs::write(clips.join("good.mp4"), CLIP).unwrap();
    std::fs::write(clips.join("cut.mp4"), &CLIP[..CLIP.len() / 2]).unwrap();
    std::fs::write(clips.join("notes.mp4"), b"a shopping list, not a video").unwrap();
    std::fs::write(clips.join("a.png"), png(40, 30)).unwrap();
    std::fs::write(clips.join("b.png"), png(30, 40)).unwrap();
    let lines = [
        line(r#"{"type": "video", "video": "clips/good.mp4"}"#),
        line(r#"{"type": "video", "video": "clips/cut.mp4"}"#),
        line(r#"{"type": "video", "video": "clips/notes.mp4"}"#),
        line(r#"{"type": "video", "video": "clips/good.mp4", "video_start": 5, "video_end": 6}"#),
        line(r#"{"type": "video", "video": ["clips/a.png", "clips/b.png"]}"#),
        line(r#"{"type": "video", "video": ["clips/a.png", "clips/a.png", "clips/a.png"]}"#),
    ];
    std::fs::write(root.path().join("data.jsonl"), lines.join("\n") + "\n").unwrap();
    root
}

fn config(root: &tempfile::TempDir) -> WorkerConfig {
    let mut c = WorkerConfig {
        data: root.path().to_str().unwrap().to_string(),
        ..WorkerConfig::default()
    };
    c.sampling.global_batch_size = 1;
    c
}

#[tokio::test]
async fn bad_videos_fail_by_name_and_kind_and_good_ones_make_their_tensors() {
    let root = dataset();
    let metrics = Metrics::new();
    let p = open_pipeline(&config(&root), metrics.clone())
        .await
        .unwrap();

    // The good clip: 30 frames at 30 fps, qwen2-vl samples 4 (min_frames), resized per frame.
    let s = p.load_sample(0).await.unwrap();
    let v = &s.videos[0];
    assert_eq!(v.indices, [0, 7, 15, 22]);
    let [t, h, w] = v.grid_thw;
    assert_eq!(t, 2);
    let pads = s.input_ids.iter().filter(|&&id| id == 151_656).count() as i64;
    assert_eq!(pads, t * h * w / 4, "one <|video_pad|> per merged patch");
    let shape = p.measure_sample(0).await.unwrap();
    assert_eq!(
        shape.tokens,
        s.input_ids.len() as u64,
        "measured from the header alone"
    );
    assert_eq!((shape.videos, shape.vision_tokens), (1, pads as u64));

    // A frame list of three frames is padded to four (the last repeated).
    let s = p.load_sample(5).await.unwrap();
    assert_eq!(s.videos[0].indices, [0, 1, 2]);
    assert_eq!(s.videos[0].grid_thw[0], 2);

    let cases = [
        (
            1,
            "video_corrupt",
            "clips/cut.mp4: corrupt video: decoding frame",
        ),
        (
            2,
            "video_corrupt",
            "clips/notes.mp4: corrupt video: opening the container",
        ),
        (3, "video_sampling", "holds no frame"),
        (4, "video_corrupt", "sizes may not change"),
    ];
    for (id, kind, says) in cases {
        let e = p.load_sample(id).await.err().expect("a bad video fails");
        assert_eq!(e.kind, kind, "sample {id}: {e}");
        assert!(e.to_string().contains(says), "sample {id}: {e}");
        assert!(
            !e.transient,
            "the data's fault: skipped under on_error skip"
        );
        if id != 1 {
            // Measured from the header: the same refusal.
            let m = (p.measure_sample(id).await).expect_err("refused from the header");
            assert_eq!(m.kind, kind, "measured sample {id}: {m}");
        }
    }
    let count = |kind: &str| metrics.sample_errors_total.with_label_values(&[kind]).get();
    assert!(count("video_corrupt") >= 3 && count("video_sampling") >= 1);
}

#[tokio::test]
async fn clips_over_the_frame_and_size_limits_are_refused_from_the_header() {
    let root = dataset();
    let mut c = config(&root);
    c.preprocessing.max_video_frames = 29;
    let p = open_pipeline(&c, Metrics::new()).await.unwrap();
    let e = p.load_sample(0).await.err().unwrap();
    assert_eq!(e.kind, "video_too_long");
    assert!(
        e.to_string().contains("30 frames are over the limit of 29"),
        "{e}"
    );
    assert_eq!(
        p.measure_sample(0).await.err().unwrap().kind,
        "video_too_long"
    );

    let mut c = config(&root);
    c.preprocessing.max_image_side = 48;
    let p = open_pipeline(&c, Metrics::new()).await.unwrap();
    let e = p.load_sample(0).await.err().unwrap();
    assert_eq!(e.kind, "video_too_large");
    assert!(e.to_string().contains("frames of 64x48"), "{e}");

    // Sampled frames bounded by the sample's pixel budget: 4 frames scaled up to qwen2-vl's
    // 100,352 pixels each are over 300,000.
    let mut c = config(&root);
    c.preprocessing.max_sample_pixels = 300_000;
    let p = open_pipeline(&c, Metrics::new()).await.unwrap();
    let e = p.load_sample(0).await.err().unwrap();
    assert_eq!(e.kind, "sample_too_large", "{e}");
}

/// Through S3 (aws-sdk-s3 against the embedded server) a clip is read by ranges as it is
/// decoded, and gives the tensors the local folder gives; measuring it reads its header's
/// ranges, never more than the object.
#[tokio::test]
async fn a_clip_read_by_ranges_from_s3_is_the_clip_read_locally() {
    use stoker_testkit::embedded_s3::EmbeddedS3;
    let local = dataset();
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("bucket/data");
    std::fs::create_dir_all(data.join("clips")).unwrap();
    std::fs::write(data.join("clips/good.mp4"), CLIP).unwrap();
    let lines = std::fs::read_to_string(local.path().join("data.jsonl")).unwrap();
    std::fs::write(
        data.join("data.jsonl"),
        lines.lines().next().unwrap().to_string() + "\n",
    )
    .unwrap();
    let s3 = EmbeddedS3::start(root.path(), "127.0.0.1:0", std::time::Duration::ZERO)
        .await
        .unwrap();
    let mut c = WorkerConfig {
        data: "s3://bucket/data".into(),
        s3: s3.s3_options(),
        ..WorkerConfig::default()
    };
    c.sampling.global_batch_size = 1;
    let metrics = Metrics::new();
    let remote = open_pipeline(&c, metrics.clone()).await.unwrap();
    let here = open_pipeline(&config(&local), Metrics::new())
        .await
        .unwrap();
    let before = metrics.object_bytes_total.get();
    let shape = remote.measure_sample(0).await.unwrap();
    let measured = metrics.object_bytes_total.get() - before;
    assert_eq!(shape, here.measure_sample(0).await.unwrap());
    assert!(
        measured <= CLIP.len() as u64 + 4096,
        "measuring read {measured} bytes"
    );
    let (a, b) = (
        remote.load_sample(0).await.unwrap(),
        here.load_sample(0).await.unwrap(),
    );
    assert_eq!(a.input_ids, b.input_ids);
    assert_eq!(a.videos[0].grid_thw, b.videos[0].grid_thw);
    assert_eq!(a.videos[0].pixels.as_bytes(), b.videos[0].pixels.as_bytes());
}
