//! Bad input gets a clear error naming the thing, a counted metric, and loses nothing: one
//! test per kind, all in one hand-made dataset served through the embedded S3 server.

mod common;
use stoker_control::exposition::{metric_value, metric_value_with};

use common::*;
use std::time::Duration;
use stoker_testkit::embedded_s3::EmbeddedS3;
use stoker_wire::ErrorCode;
use stoker_worker::dataset::index::{DatasetIndex, INDEX_KEY};
use stoker_worker::source::Store;

/// A well-formed PNG header announcing 60000×60000 pixels: 10.8 GB once decoded.
fn png_bomb() -> Vec<u8> {
    let mut v = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&60_000u32.to_be_bytes());
    ihdr.extend_from_slice(&60_000u32.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    png_chunk(&mut v, b"IHDR", &ihdr);
    png_chunk(
        &mut v,
        b"IDAT",
        &[0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01],
    );
    png_chunk(&mut v, b"IEND", &[]);
    v
}

fn small_png() -> Vec<u8> {
    let img = image::RgbImage::from_fn(60, 40, |x, y| image::Rgb([x as u8 * 4, y as u8 * 6, 90]));
    let mut out = std::io::Cursor::new(Vec::new());
    image::DynamicImage::from(img)
        .write_to(&mut out, image::ImageFormat::Png)
        .unwrap();
    out.into_inner()
}

fn jpeg(w: u16, h: u16) -> Vec<u8> {
    let px: Vec<u8> = (0..w as usize * h as usize * 3)
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    let mut out = Vec::new();
    jpeg_encoder::Encoder::new(&mut out, 90)
        .encode(&px, w, h, jpeg_encoder::ColorType::Rgb)
        .unwrap();
    out
}

fn llava(image: &str) -> String {
    format!(
        r#"{{"image": "{image}", "conversations": [{{"from": "human", "value": "<image>\nWhat is it?"}}, {{"from": "gpt", "value": "A test."}}]}}"#
    )
}

struct BadDataset {
    _root: tempfile::TempDir,
    ds: Dataset,
}

/// Lines 1–6 pass the index (their problems show only when served); 7–10 do not.
async fn bad_dataset() -> BadDataset {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("bucket/data");
    std::fs::create_dir_all(dir.join("img")).unwrap();
    let full = jpeg(64, 48);
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("img/good.png", small_png()),
        ("img/truncated.jpg", full[..full.len() / 2].to_vec()),
        (
            "img/garbage.jpg",
            [&[0xffu8, 0xd8, 0xff, 0xe0][..], &[0x13; 300][..]].concat(),
        ),
        (
            "img/notes.jpg",
            b"just some text, not an image at all".to_vec(),
        ),
        ("img/bomb.png", png_bomb()),
        ("img/deleted.png", small_png()),
    ];
    for (name, bytes) in &files {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    let mut lines: Vec<String> = files.iter().map(|(n, _)| llava(n)).collect();
    lines.push(r#"{"image": "img/good.png", "conversations": [oops"#.into()); // 7: invalid JSON
    lines.push(llava("img/absent.png")); // 8: image absent
    lines.push(String::new()); // 9: placeholder for the non-UTF-8 line
    lines.push(llava("../../../etc/passwd")); // 10: path traversal
    let mut shard = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        if i == 8 {
            shard.extend_from_slice(
                b"{\"messages\": [{\"role\": \"user\", \"content\": \"caf\xe9\"}]}",
            );
        } else {
            shard.extend_from_slice(l.as_bytes());
        }
        shard.push(b'\n');
    }
    std::fs::write(dir.join("s.jsonl"), shard).unwrap();

    let s3 = EmbeddedS3::start(root.path(), "127.0.0.1:0", Duration::ZERO)
        .await
        .unwrap();
    let store = Store::open("s3://bucket/data", &s3.s3_options())
        .await
        .unwrap();
    let idx = DatasetIndex::build(&store, None, &()).await.unwrap();
    store.put(INDEX_KEY, idx.to_bytes()).await.unwrap();
    // Missing object: present when indexed, gone when served.
    std::fs::remove_file(dir.join("img/deleted.png")).unwrap();
    let ds = Dataset {
        root: tempfile::tempdir().unwrap(),
        s3,
        uri: "s3://bucket/data".into(),
    };
    BadDataset { _root: root, ds }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_reports_each_bad_line_as_shard_line_with_reason() {
    let b = bad_dataset().await;
    let store = Store::open(&b.ds.uri, &b.ds.s3.s3_options()).await.unwrap();
    let idx = DatasetIndex::build(&store, None, &()).await.unwrap();
    let report: Vec<String> = idx.bad_lines.iter().map(|l| l.to_string()).collect();
    assert_eq!(idx.num_samples(), 5, "{report:?}"); // deleted.png now fails at index time too
    let expect = [
        ("s.jsonl:6:", "img/deleted.png"),
        ("s.jsonl:7:", "invalid JSON"),
        ("s.jsonl:8:", "img/absent.png"),
        ("s.jsonl:9:", "not UTF-8"),
        ("s.jsonl:10:", "escapes the dataset root"),
    ];
    assert_eq!(report.len(), expect.len(), "{report:?}");
    for (line, (at, why)) in report.iter().zip(expect) {
        assert!(
            line.starts_with(at) && line.contains(why),
            "{line} should be {at} … {why}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skip_policy_serves_the_rest_and_names_every_skipped_sample() {
    let b = bad_dataset().await;
    let mut cfg = b.ds.config(6);
    cfg.sampling.on_error = stoker_config::OnError::Skip;
    let w = start_worker(&cfg).await;
    let (mut c, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
    assert_eq!(welcome.num_samples, 6);
    let (head, payload) = c.get(request(&welcome, 0, 0, 0, 1)).await.batch();
    assert_eq!(head.sample_ids, vec![0], "only the good sample is served");
    assert_eq!(i64s(tensor(&head, &payload, "image_grid_thw")).len(), 3);
    let mut skipped: Vec<(u64, String)> = head
        .skipped
        .iter()
        .map(|s| (s.sample_id, s.reason.clone()))
        .collect();
    skipped.sort();
    let expect = [
        (1, "s.jsonl:2", "img/truncated.jpg", "corrupt or truncated"),
        (2, "s.jsonl:3", "img/garbage.jpg", "corrupt or truncated"),
        (3, "s.jsonl:4", "img/notes.jpg", "unsupported image format"),
        (4, "s.jsonl:5", "img/bomb.png", "exceeds the decode limits"),
        (5, "s.jsonl:6", "img/deleted.png", "does not exist"),
    ];
    assert_eq!(skipped.len(), expect.len(), "{skipped:?}");
    for ((id, reason), (eid, line, key, why)) in skipped.iter().zip(expect) {
        assert_eq!(*id, eid);
        for part in [line, key, why] {
            assert!(reason.contains(part), "reason {reason:?} lacks {part:?}");
        }
    }
    let m = w.metrics.render();
    for (kind, n) in [
        ("image_corrupt", 2),
        ("image_unsupported", 1),
        ("image_too_large", 1),
        ("object_missing", 1),
    ] {
        let got = metric_value_with(&m, "stoker_worker_sample_errors_total", &[("kind", kind)]);
        assert_eq!(got, Some(n as f64), "{kind} in {m}");
    }
    assert_eq!(
        metric_value(&m, "stoker_worker_dataset_bad_lines"),
        Some(4.0),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lengths_from_headers_and_a_packed_batch_without_its_skipped_samples() {
    use stoker_worker::dataset::lengths::{SampleLengths, LENGTHS_KEY};
    let b = bad_dataset().await;
    let mut cfg = b.ds.config(6);
    cfg.sampling.on_error = stoker_config::OnError::Skip;
    // Measured from headers: the good image and the truncated one (its header is whole; its
    // pixels fail only when decoded) have lengths, the others fail by name.
    let plain = start_worker(&cfg).await;
    let p = &plain.server.pipeline;
    let mut tokens = Vec::new();
    for id in 0..6 {
        match p.measure_sample(id).await {
            Ok(shape) => tokens.push(shape.tokens as u32),
            Err(e) => {
                assert!(id >= 2, "sample {id}: {e}");
                tokens.push(0);
            }
        }
    }
    assert!(tokens[0] > 0 && tokens[1] > 0, "{tokens:?}");
    let lengths = SampleLengths {
        index_version: p.index.version,
        preprocessing: stoker_worker::identity::preprocessing_id(&p.config, p.text.fingerprint),
        tokens: tokens.clone().into(),
    };
    p.store.put(LENGTHS_KEY, lengths.to_bytes()).await.unwrap();

    cfg.sampling.pack_max_tokens = Some(4096);
    let w = start_worker(&cfg).await;
    let (mut c, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
    let (head, payload) = c.get(request(&welcome, 0, 0, 0, 1)).await.batch();
    // One pack of six planned; five skipped by name, the pack holds the good sample alone.
    assert_eq!(head.sample_ids, vec![0]);
    assert_eq!(head.skipped.len(), 5, "{:?}", head.skipped);
    let cu: Vec<i32> = tensor(&head, &payload, "cu_seqlens")
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(head.tensor("cu_seqlens").unwrap().shape, [1, 2]);
    assert_eq!(cu, [0, tokens[0] as i32]);
    assert_eq!(i64s(tensor(&head, &payload, "pack_images")), [1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_policy_fails_the_request_naming_the_sample() {
    let b = bad_dataset().await;
    let mut cfg = b.ds.config(6);
    cfg.sampling.on_error = stoker_config::OnError::Fail;
    let w = start_worker(&cfg).await;
    let (mut c, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
    let e = c.get(request(&welcome, 0, 0, 0, 1)).await.error();
    assert_eq!(e.code, ErrorCode::Failed);
    // The first failure in plan order: "sample N (s.jsonl:N+1): … img/…".
    let id: u64 = e.message["sample ".len()..]
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=5).contains(&id), "{}", e.message);
    assert!(
        e.message.contains(&format!("(s.jsonl:{}): ", id + 1)),
        "{}",
        e.message
    );
    assert!(e.message.contains("img/"), "{}", e.message);
    // The worker is still healthy and serves the next request.
    let (mut c2, _) = Client::connect(w.addr, TOKEN).await.unwrap();
    assert_eq!(
        c2.get(request(&welcome, 0, 0, 0, 1)).await.error().code,
        ErrorCode::Failed
    );
}

fn messages(turns: &[(&str, &str)], images: &[&str]) -> String {
    let msgs: Vec<serde_json::Value> = turns
        .iter()
        .enumerate()
        .map(|(i, (role, text))| {
            let mut parts: Vec<serde_json::Value> = match i {
                0 => images
                    .iter()
                    .map(|p| serde_json::json!({"type": "image", "image": p}))
                    .collect(),
                _ => vec![],
            };
            parts.push(serde_json::json!({"type": "text", "text": text}));
            serde_json::json!({"role": role, "content": parts})
        })
        .collect();
    serde_json::json!({ "messages": msgs }).to_string()
}

/// One sample over each per-sample work limit, and one within all of them. Two workers with
/// the same limits skip the same samples with the same named reasons; a worker with other
/// limits is of another plan (a trainer never mixes their batches).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn samples_over_a_work_limit_are_skipped_by_name_on_every_worker() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("bucket/data");
    std::fs::create_dir_all(dir.join("img")).unwrap();
    std::fs::write(dir.join("img/a.png"), small_png()).unwrap(); // 60x40
    std::fs::write(dir.join("img/b.png"), small_png()).unwrap();
    std::fs::write(dir.join("img/big.jpg"), jpeg(400, 400)).unwrap();
    let qa = [("user", "What?"), ("assistant", "A test.")];
    let long_answer = "word ".repeat(600);
    let lines = [
        messages(&qa, &["img/a.png"]),
        messages(&qa, &["img/a.png", "img/b.png", "img/a.png"]),
        messages(&[qa[0], qa[1], qa[0], qa[1], qa[0], qa[1]], &[]),
        messages(&[qa[0], ("assistant", &long_answer)], &[]),
        messages(&qa, &["img/big.jpg"]),
        messages(&qa, &["img/a.png", "img/b.png"]),
    ];
    std::fs::write(dir.join("s.jsonl"), lines.join("\n")).unwrap();
    let s3 = EmbeddedS3::start(root.path(), "127.0.0.1:0", Duration::ZERO)
        .await
        .unwrap();
    let ds = Dataset {
        root,
        s3,
        uri: "s3://bucket/data".into(),
    };
    let mut cfg = ds.config(6);
    let pre = &mut cfg.preprocessing;
    pre.max_images_per_sample = 2;
    pre.max_turns = 4;
    pre.max_line_bytes = 2000;
    pre.max_object_bytes = 20_000;
    pre.max_sample_pixels = 4000; // one 60x40 image is 2400 pixels
    let expect = [
        (
            1,
            "too_many_images",
            "3 images and videos are over the limit of 2",
        ),
        (2, "too_many_turns", "6 messages are over the limit of 4"),
        (
            3,
            "line_too_long",
            "over the limit of 2000 (max-line-bytes)",
        ),
        (4, "object_too_large", "img/big.jpg is "),
        (5, "sample_too_large", "image img/b.png (60x40) would bring"),
    ];
    let mut answers = Vec::new();
    for _ in 0..2 {
        let w = start_worker(&cfg).await;
        let (mut c, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
        let (head, payload) = c.get(request(&welcome, 0, 0, 0, 1)).await.batch();
        assert_eq!(head.sample_ids, vec![0]);
        let mut skipped = head.skipped.clone();
        skipped.sort_by_key(|s| s.sample_id);
        assert_eq!(skipped.len(), expect.len(), "{skipped:?}");
        for (s, (id, _, why)) in skipped.iter().zip(expect) {
            assert_eq!(s.sample_id, id);
            assert!(s.reason.contains(why), "{:?} lacks {why:?}", s.reason);
        }
        let m = w.metrics.render();
        for (_, kind, _) in expect {
            let got = metric_value_with(&m, "stoker_worker_sample_errors_total", &[("kind", kind)]);
            assert_eq!(got, Some(1.0), "{kind}");
        }
        answers.push((welcome.plan_id, skipped, payload));
    }
    assert_eq!(answers[0], answers[1], "two workers, one answer");
    cfg.preprocessing.max_turns = 6;
    let other = start_worker(&cfg).await;
    let (_, welcome) = Client::connect(other.addr, TOKEN).await.unwrap();
    assert_ne!(welcome.plan_id, answers[0].0, "other limits, another plan");
}
