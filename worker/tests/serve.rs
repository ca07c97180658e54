//! The worker end to end: embedded S3 → aws-sdk-s3 → preprocessing → framed TCP → client.

mod common;
use stoker_control::exposition::{metric_value, metric_value_with};

use common::*;
use stoker_testkit::synth::SynthFormat;
use stoker_wire::{BatchRequest, DType, ErrorCode};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_planned_slices_with_consistent_tensors() {
    let ds = synth_dataset(24, SynthFormat::Llava).await;
    let w = start_worker(&ds.config(8)).await;
    let (mut c, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
    assert_eq!(welcome.num_samples, 24);
    assert_eq!(welcome.batches_per_epoch, 3);

    let mut seen = Vec::new();
    for g in 0..3 {
        for rank in 0..2 {
            let (head, payload) = c.get(request(&welcome, 0, g, rank, 2)).await.batch();
            let planned = w
                .server
                .pipeline
                .plan
                .rank_slice(0, g, rank, 2)
                .unwrap()
                .samples;
            assert_eq!(head.sample_ids, planned, "batch {g} rank {rank}");
            assert!(head.skipped.is_empty(), "{:?}", head.skipped);
            let b = head.sample_ids.len() as u64;
            let ids = head.tensor("input_ids").unwrap();
            assert_eq!(ids.shape[0], b);
            let l = ids.shape[1];
            let input_ids = i64s(tensor(&head, &payload, "input_ids"));
            let mask = i64s(tensor(&head, &payload, "attention_mask"));
            let labels = i64s(tensor(&head, &payload, "labels"));
            // Image pad tokens in the text equal the patches / merge² of the images.
            let grid = i64s(tensor(&head, &payload, "image_grid_thw"));
            let patches: i64 = grid.chunks(3).map(|g| g[0] * g[1] * g[2]).sum();
            let pads = input_ids.iter().filter(|&&t| t == 151655).count() as i64;
            assert_eq!(pads * 4, patches);
            let pv = head.tensor("pixel_values").unwrap();
            assert_eq!(pv.dtype, DType::U8, "u8 is the default");
            assert_eq!(pv.shape, vec![patches as u64, 1176]);
            let lut = head.tensor("pixel_lut").unwrap();
            assert_eq!((lut.dtype, lut.shape.clone()), (DType::F32, vec![3, 256]));
            // Padding is masked and never trained on; every sample trains on something.
            for row in 0..b as usize {
                let r = row * l as usize..(row + 1) * l as usize;
                assert!(labels[r.clone()].iter().any(|&x| x >= 0));
                for i in r {
                    if mask[i] == 0 {
                        assert_eq!((input_ids[i], labels[i]), (151643, -100));
                    }
                }
            }
            seen.extend(head.sample_ids);
        }
    }
    seen.sort();
    assert_eq!(seen, (0..24).collect::<Vec<u64>>());
    let metrics = w.metrics.render();
    assert_eq!(
        metric_value(&metrics, "stoker_worker_samples_total"),
        Some(24.0),
        "{metrics}"
    );
    for stage in ["fetch", "decode", "resize", "tokenize", "collate", "send"] {
        let count = metric_value_with(
            &metrics,
            "stoker_worker_stage_seconds_count",
            &[("stage", stage)],
        );
        assert!(count.is_some_and(|c| c > 0.0), "{stage}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_request_gives_same_bytes_on_any_worker() {
    let ds = synth_dataset(12, SynthFormat::Messages).await;
    let mut cfg = ds.config(4);
    cfg.sampling.seed = 5;
    let a = start_worker(&cfg).await;
    let b = start_worker(&cfg).await;
    let (mut ca, wa) = Client::connect(a.addr, TOKEN).await.unwrap();
    let (mut cb, wb) = Client::connect(b.addr, TOKEN).await.unwrap();
    assert_eq!(wa, wb);
    for g in 0..3 {
        let (_, pa) = ca.get(request(&wa, 1, g, 0, 1)).await.batch();
        let (_, pb) = cb.get(request(&wb, 1, g, 0, 1)).await.batch();
        let (_, pa2) = ca.get(request(&wa, 1, g, 0, 1)).await.batch();
        assert_eq!(pa, pb, "batch {g} differs between workers");
        assert_eq!(pa, pa2, "batch {g} differs between calls");
    }
    // Another seed is another plan: refused with a clear error, not silently served.
    cfg.sampling.seed = 6;
    let c = start_worker(&cfg).await;
    let (mut cc, _) = Client::connect(c.addr, TOKEN).await.unwrap();
    let e = cc.get(request(&wa, 0, 0, 0, 1)).await.error();
    assert_eq!(e.code, ErrorCode::PlanMismatch);
    assert!(
        e.message.contains("this worker serves plan"),
        "{}",
        e.message
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_or_missing_token_is_refused() {
    let ds = synth_dataset(4, SynthFormat::Llava).await;
    let w = start_worker(&ds.config(32)).await;
    let e = Client::connect(w.addr, "nope").await.err().unwrap();
    assert_eq!(e.code, ErrorCode::Unauthorized);
    assert_eq!(e.message, "wrong pipeline token");
    let e = Client::connect(w.addr, "").await.err().unwrap();
    assert!(
        e.message.contains("requires a pipeline token"),
        "{}",
        e.message
    );
    let refused = metric_value_with(
        &w.metrics.render(),
        "stoker_worker_requests_refused_total",
        &[("reason", "unauthorized")],
    );
    assert_eq!(refused, Some(2.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_and_out_of_range_batches() {
    let ds = synth_dataset(10, SynthFormat::Llava).await;
    let w = start_worker(&ds.config(5)).await;
    let (mut c, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
    for g in 0..2 {
        c.send(request(&welcome, 0, g, 0, 1)).await;
    }
    c.send(request(&welcome, 0, 2, 0, 1)).await;
    let mut got = Vec::new();
    for _ in 0..3 {
        match c.recv().await {
            Answer::Batch(h, _) => got.push(h.request.global_batch),
            Answer::Error(e) => {
                assert_eq!(e.code, ErrorCode::BadRequest);
                assert!(e.message.contains("beyond the 2 batches"), "{}", e.message);
                got.push(99);
            }
        }
    }
    got.sort();
    assert_eq!(got, vec![0, 1, 99]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pixel_dtypes_shrink_the_payload() {
    let ds = synth_dataset(4, SynthFormat::Llava).await;
    let mut sizes = Vec::new();
    for dtype in [PixelDtype::F32, PixelDtype::Bf16, PixelDtype::U8] {
        let mut cfg = ds.config(4);
        cfg.preprocessing.pixel_dtype = Some(dtype);
        let w = start_worker(&cfg).await;
        let (mut c, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
        let (head, _) = c.get(request(&welcome, 0, 0, 0, 1)).await.batch();
        sizes.push(head.tensor("pixel_values").unwrap().nbytes);
        // Only unnormalized pixels travel with their normalization table.
        assert_eq!(head.tensor("pixel_lut").is_some(), dtype == PixelDtype::U8);
    }
    assert_eq!(sizes[0], sizes[1] * 2);
    assert_eq!(sizes[0], sizes[2] * 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_requests_then_refuses() {
    let ds = synth_dataset(8, SynthFormat::Llava).await;
    let mut w = start_worker(&ds.config(8)).await;
    let (mut c, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
    c.send(request(&welcome, 0, 0, 0, 1)).await;
    // Let the request start, then terminate: it must still complete.
    while w.metrics.requests_in_flight.get() == 0 {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    w.terminate();
    let (head, _) = c.recv().await.batch();
    assert_eq!(head.sample_ids.len(), 8);
    (&mut w.task).await.unwrap();
    assert!(!w.metrics.ready.load(std::sync::atomic::Ordering::SeqCst));
    // The open connection now gets "draining", a retryable refusal.
    let e = c.get(request(&welcome, 0, 0, 0, 1)).await.error();
    assert_eq!(e.code, ErrorCode::Unavailable);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_object_delays_only_its_own_batch() {
    use std::time::Duration;
    let mut ds = synth_dataset(8, SynthFormat::Llava).await;
    // Find a sample of batch 0 and make its first image a straggler.
    let probe = start_worker(&ds.config(4)).await;
    let victim = probe
        .server
        .pipeline
        .plan
        .rank_slice(0, 0, 0, 1)
        .unwrap()
        .samples[0];
    let (shard, line) = probe.server.pipeline.index.locate(victim).unwrap();
    let text = std::fs::read(ds.dir().join(&shard.key)).unwrap();
    let raw = &text[line.offset as usize..(line.offset + line.len) as usize];
    let conv = stoker_worker::dataset::sample::Conversation::parse(raw).unwrap();
    let slow = conv.image_paths().next().unwrap().to_string();
    let behaviour = StoreBehaviour {
        slow_objects: vec![(slow, Duration::from_secs(3))],
        ..Default::default()
    };
    ds.restart_store(behaviour).await;

    let mut cfg = ds.config(4);
    cfg.concurrency.max_fetches = 2;
    let w = start_worker(&cfg).await;
    let (mut c, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
    c.send(request(&welcome, 0, 0, 0, 1)).await;
    c.send(request(&welcome, 0, 1, 0, 1)).await;
    // Batch 1 overtakes batch 0, which waits on its straggler, and both arrive complete.
    let (first, _) = c.recv().await.batch();
    let (second, _) = c.recv().await.batch();
    assert_eq!(
        (first.request.global_batch, second.request.global_batch),
        (1, 0)
    );
    assert!(second.sample_ids.contains(&victim) && second.skipped.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sample_budget_smaller_than_a_batch_still_serves_everything() {
    let ds = synth_dataset(12, SynthFormat::Llava).await;
    // Slices of 4 samples against a budget of 3: each takes the whole budget, one at a time.
    let mut cfg = ds.config(4);
    cfg.serving.max_inflight_samples = Some(3);
    let w = start_worker(&cfg).await;
    let (mut c, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
    for g in 0..3 {
        c.send(request(&welcome, 0, g, 0, 1)).await;
    }
    let mut served = Vec::new();
    for _ in 0..3 {
        served.extend(c.recv().await.batch().0.sample_ids);
    }
    served.sort();
    assert_eq!(served, (0..12).collect::<Vec<u64>>());
}

/// `--tokenizer s3://…`: the worker fetches, checks and caches the tokenizer from the same
/// store as the data (no tokenizer in the image); a wrong object is refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetches_its_tokenizer_from_the_object_store() {
    let ds = synth_dataset(8, SynthFormat::Llava).await;
    let local = stoker_worker::tokenizer_source::local_path(&ds.config(4).preprocessing).unwrap();
    let local = if local.is_dir() {
        local.join("tokenizer.json")
    } else {
        local
    };
    let tok_dir = ds.root.path().join("bucket/models/qwen");
    std::fs::create_dir_all(&tok_dir).unwrap();
    std::fs::copy(&local, tok_dir.join("tokenizer.json")).unwrap();
    std::fs::write(tok_dir.join("wrong.json"), br#"{"version": "1.0"}"#).unwrap();

    let mut cfg = ds.config(4);
    cfg.preprocessing.tokenizer = Some("s3://bucket/models/qwen/tokenizer.json".into());
    let w = start_worker(&cfg).await;
    let (mut c, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
    let (head, _) = c.get(request(&welcome, 0, 0, 0, 1)).await.batch();
    assert_eq!(head.sample_ids.len(), 4);

    cfg.preprocessing.tokenizer = Some("s3://bucket/models/qwen/wrong.json".into());
    let e = stoker_worker::open::open_pipeline(&cfg, stoker_worker::metrics::Metrics::new())
        .await
        .err()
        .expect("a JSON that is no tokenizer is refused");
    let msg = format!("{e:#}");
    assert!(
        msg.contains("tokenizer s3://bucket/models/qwen/wrong.json: not a tokenizer.json"),
        "{msg}"
    );
}

/// With the line cache a sample costs one GET per image: each shard's text (here less than one
/// 1 MiB block) is read once. Without it, each line is one more GET. The bytes are the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_line_cache_reads_each_shard_block_once_and_changes_no_byte() {
    let ds = synth_dataset(24, SynthFormat::Llava).await; // 3 shards
    let mut epochs = Vec::new();
    for line_cache_mib in [256, 0] {
        let mut cfg = ds.config(8);
        cfg.concurrency.line_cache_mib = line_cache_mib;
        let w = start_worker(&cfg).await;
        let (mut c, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
        let before = ds.s3.requests_received();
        let (mut payloads, mut images) = (Vec::new(), 0u64);
        for g in 0..3 {
            let (head, payload) = c.get(request(&welcome, 0, g, 0, 1)).await.batch();
            images += i64s(tensor(&head, &payload, "image_grid_thw")).len() as u64 / 3;
            payloads.push(payload);
        }
        let gets = ds.s3.requests_received() - before;
        let m = w.metrics.render();
        let hits = metric_value_with(&m, "stoker_worker_line_cache_total", &[("result", "hit")]);
        epochs.push((payloads, images, gets, hits));
    }
    let (cached, uncached) = (&epochs[0], &epochs[1]);
    assert_eq!(cached.0, uncached.0, "the cache changes no byte");
    assert_eq!(
        cached.2,
        cached.1 + 3,
        "one GET per image and one per shard"
    );
    assert_eq!(cached.3, Some(21.0), "24 lines, 3 blocks read");
    assert_eq!(
        uncached.2,
        uncached.1 + 24,
        "one GET per image and one per line"
    );
}

/// A peer of another protocol version is refused by name (both versions), and counted apart
/// from garbage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_of_another_protocol_version_is_refused_by_name() {
    use stoker_wire::{ErrorFrame, FrameHeader, Hello, Kind};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ds = synth_dataset(4, SynthFormat::Llava).await;
    let w = start_worker(&ds.config(4)).await;
    let hello = Hello {
        token: TOKEN.into(),
        client: "stoker/0.0 (v1)".into(),
    }
    .encode();
    let mut frame = FrameHeader {
        kind: Kind::Hello,
        len: hello.len() as u64,
    }
    .encode()
    .to_vec();
    frame[4] = 2; // what a build speaking version 2 sends
    frame.extend_from_slice(&hello);
    let mut s = tokio::net::TcpStream::connect(w.addr).await.unwrap();
    s.write_all(&frame).await.unwrap();
    let mut got = Vec::new();
    s.read_to_end(&mut got).await.unwrap();
    let h = FrameHeader::decode(got[..16].try_into().unwrap()).unwrap();
    assert_eq!(h.kind, Kind::Error);
    let e = ErrorFrame::decode(&got[16..16 + h.len as usize]).unwrap();
    assert_eq!(e.code, ErrorCode::BadRequest);
    assert_eq!(
        e.message,
        "protocol v2 peer: upgrade it to v3 (this build speaks v3)"
    );
    let m = w.metrics.render();
    let refused = |reason| {
        metric_value_with(
            &m,
            "stoker_worker_requests_refused_total",
            &[("reason", reason)],
        )
    };
    assert_eq!(refused("version"), Some(1.0), "{m}");
    assert_eq!(refused("no_hello"), Some(0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_welcome_carries_the_connection_hints() {
    let ds = synth_dataset(4, SynthFormat::Llava).await;
    let mut cfg = ds.config(4);
    cfg.serving.limits.max_connections = 77;
    cfg.serving.limits.links_per_rank = 3;
    let w = start_worker(&cfg).await;
    let (_, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
    assert_eq!((welcome.max_connections, welcome.links_per_rank), (77, 3));
    // Another worker of the same plan with other hints serves interchangeable batches.
    cfg.serving.limits.max_connections = 1024;
    cfg.serving.limits.links_per_rank = 0;
    let other = start_worker(&cfg).await;
    let (_, other) = Client::connect(other.addr, TOKEN).await.unwrap();
    assert!(welcome.same_plan(&other) && welcome != other);
}

/// With one slot per connection and a sample budget of one batch, a request stalled on its
/// object holds both. Requests read behind it wait; a Cancel read meanwhile drops a waiting
/// one and aborts the stalled one, which frees the slot and the budget, and neither is
/// answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_request_is_not_answered_and_frees_its_slot_and_budget() {
    use std::time::Duration;
    let mut ds = synth_dataset(12, SynthFormat::Llava).await;
    let probe = start_worker(&ds.config(4)).await;
    let plan = &probe.server.pipeline.plan;
    let victim = plan.rank_slice(0, 0, 0, 1).unwrap().samples[0];
    let (shard, line) = probe.server.pipeline.index.locate(victim).unwrap();
    let text = std::fs::read(ds.dir().join(&shard.key)).unwrap();
    let raw = &text[line.offset as usize..(line.offset + line.len) as usize];
    let conv = stoker_worker::dataset::sample::Conversation::parse(raw).unwrap();
    let stalled = conv.image_paths().next().unwrap().to_string();
    // Batch 0 never completes on its own: its image is not answered for a day, and the
    // worker's read timeout is longer still.
    let behaviour = StoreBehaviour {
        slow_objects: vec![(stalled, Duration::from_secs(86_400))],
        ..Default::default()
    };
    ds.restart_store(behaviour).await;
    let mut cfg = ds.config(4);
    cfg.s3.read_timeout_s = 2 * 86_400;
    cfg.serving.limits.max_inflight_per_conn = 1;
    cfg.serving.max_inflight_samples = Some(4);
    let w = start_worker(&cfg).await;
    let (mut c, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();

    let stuck = request(&welcome, 0, 0, 0, 1);
    c.send(stuck).await;
    // Wait until it is being prepared: it holds the slot and the whole sample budget.
    while w.metrics.fetches_in_flight.get() == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let b = request(&welcome, 0, 1, 0, 1);
    let waiting = request(&welcome, 0, 2, 0, 1);
    c.send(b).await;
    c.send(waiting).await;
    // Read while the only slot is busy: one cancels a waiting request, one the running one.
    c.cancel(waiting.request_id).await;
    c.cancel(stuck.request_id).await;
    let (head, _) = c.recv().await.batch();
    assert_eq!(
        head.request, b,
        "the stalled request's slot and budget went to the next"
    );
    // The cancelled waiting request is not answered either: a later one (same batch, another
    // id) is the next answer, though it was read after it on a one-slot connection.
    let later = BatchRequest {
        request_id: 4242,
        ..waiting
    };
    let (head, _) = c.get(later).await.batch();
    assert_eq!(head.request, later);
    let m = w.metrics.render();
    assert_eq!(
        metric_value(&m, "stoker_worker_requests_cancelled_total"),
        Some(2.0),
        "{m}"
    );
    assert_eq!(
        metric_value_with(
            &m,
            "stoker_worker_requests_refused_total",
            &[("reason", "bad_request")]
        ),
        Some(0.0)
    );
    // Nothing stays in flight: the aborted request released its guard, and its stalled fetch
    // (dropped with it) its count.
    while w.metrics.requests_in_flight.get() != 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(w.metrics.fetches_in_flight.get(), 0);
    for queue in ["fetch", "cpu", "requests"] {
        let depth = w.metrics.queue_depth.with_label_values(&[queue]).get();
        assert_eq!(depth, 0, "{queue}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_an_unknown_or_answered_request_is_harmless() {
    let ds = synth_dataset(8, SynthFormat::Llava).await;
    let w = start_worker(&ds.config(4)).await;
    let (mut c, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
    let first = request(&welcome, 0, 0, 0, 1);
    let (head, _) = c.get(first).await.batch();
    assert_eq!(head.request, first);
    c.cancel(first.request_id).await; // answered already
    c.cancel(987_654).await; // never asked
    let second = request(&welcome, 0, 1, 0, 1);
    let (head, _) = c.get(second).await.batch();
    assert_eq!(head.request, second);
    let m = w.metrics.render();
    assert_eq!(
        metric_value(&m, "stoker_worker_requests_cancelled_total"),
        Some(0.0)
    );
    assert_eq!(
        metric_value_with(
            &m,
            "stoker_worker_requests_refused_total",
            &[("reason", "bad_request")]
        ),
        Some(0.0)
    );
}

/// `--order feistel` is its own plan (another plan id), served as its plan says, every
/// sample once per epoch across epochs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_feistel_order_is_served_as_planned_under_its_own_plan_id() {
    let ds = synth_dataset(24, SynthFormat::Llava).await;
    let mut cfg = ds.config(8);
    let shuffle = start_worker(&cfg).await;
    cfg.sampling.order = stoker_config::SampleOrder::Feistel;
    let w = start_worker(&cfg).await;
    assert_ne!(w.server.welcome.plan_id, shuffle.server.welcome.plan_id);
    let (mut c, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
    let plan = &w.server.pipeline.plan;
    for epoch in 0..2 {
        let mut seen = Vec::new();
        for g in 0..3 {
            let (head, _) = c.get(request(&welcome, epoch, g, 0, 1)).await.batch();
            assert_eq!(
                head.sample_ids,
                plan.rank_slice(epoch, g, 0, 1).unwrap().samples
            );
            seen.extend(head.sample_ids);
        }
        let order = seen.clone();
        seen.sort();
        assert_eq!(seen, (0..24).collect::<Vec<u64>>(), "epoch {epoch}");
        let other: Vec<u64> = (0..3)
            .flat_map(|g| {
                shuffle
                    .server
                    .pipeline
                    .plan
                    .rank_slice(epoch, g, 0, 1)
                    .unwrap()
                    .samples
            })
            .collect();
        assert_ne!(order, other, "not the shuffle order");
    }
}
