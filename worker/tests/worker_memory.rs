//! The worker's byte budget (`--max-worker-bytes`): a rank that stops reading fills only its
//! connection's share and the others keep being served; one that takes no bytes for
//! `--send-timeout-s` loses its connection and what it held.

mod common;
use common::*;
use std::time::Duration;
use stoker_control::exposition::metric_value_with;
use stoker_testkit::synth::SynthFormat;
use stoker_wire::BatchRequest;

/// Waits (up to a minute, a guard against a hang and not a measure) for `done`.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let t = std::time::Instant::now();
    while !done() {
        assert!(t.elapsed() < Duration::from_secs(60), "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Requests for every batch of `epochs` epochs, ids starting at `first_id`.
fn requests(w: &stoker_wire::Welcome, epochs: u64, first_id: u64) -> Vec<BatchRequest> {
    (0..epochs)
        .flat_map(|e| (0..w.batches_per_epoch).map(move |g| (e, g)))
        .enumerate()
        .map(|(i, (e, g))| BatchRequest {
            request_id: first_id + i as u64,
            ..request(w, e, g, 0, 1)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_stops_reading_fills_only_its_own_share() {
    let ds = synth_dataset(64, SynthFormat::Llava).await;
    let mut cfg = ds.config(4);
    cfg.serving.max_inflight_samples = Some(8);
    cfg.serving.limits.send_timeout_s = 3600; // the shares alone keep the honest rank served
                                              // The size of a batch, from a worker without limits.
    let probe = start_worker(&cfg).await;
    let (mut c, welcome) = Client::connect(probe.addr, TOKEN).await.unwrap();
    let mut batch = 0;
    for r in requests(&welcome, 1, 0) {
        batch = batch.max(c.get(r).await.batch().1.len() as u64);
    }
    // Room for 16 of the largest batches; five connections get a sixth each.
    let budget = 16 * batch;
    cfg.serving.limits.max_worker_bytes = budget;
    let w = start_worker(&cfg).await;
    let (mut honest, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
    honest.get(request(&welcome, 0, 0, 0, 1)).await.batch();

    // Four connections ask for four epochs each and read nothing: each would hold 64 batches.
    let mut slow = Vec::new();
    for _ in 0..4 {
        let (mut c, _) = Client::connect(w.addr, TOKEN).await.unwrap();
        for r in requests(&welcome, 4, 0) {
            c.send(r).await;
        }
        slow.push(c);
    }
    let memory = || w.metrics.queue_depth.with_label_values(&["requests"]).get();
    until("every slow connection waits for its share", || {
        memory() >= 4
    })
    .await;

    // The honest rank is served every batch of an epoch meanwhile.
    for r in requests(&welcome, 1, 100) {
        let answer = tokio::time::timeout(Duration::from_secs(60), honest.get(r)).await;
        let (head, _) = answer.expect("the honest rank is served").batch();
        assert_eq!(head.request, r);
    }
    let held = w.metrics.memory_held_bytes.get() as u64;
    assert!(
        held <= budget,
        "{held} bytes held, over the budget of {budget}"
    );
    let m = w.metrics.render();
    let stalled = metric_value_with(
        &m,
        "stoker_worker_requests_refused_total",
        &[("reason", "stalled")],
    );
    assert_eq!(stalled, Some(0.0), "no connection was closed");
    drop(slow);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_takes_no_bytes_loses_its_connection_and_what_it_held() {
    let ds = synth_dataset(64, SynthFormat::Llava).await;
    let mut cfg = ds.config(4);
    cfg.serving.limits.send_timeout_s = 1;
    let w = start_worker(&cfg).await;
    let (mut stuck, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
    for r in requests(&welcome, 4, 0) {
        stuck.send(r).await;
    }
    let stalled = || {
        metric_value_with(
            &w.metrics.render(),
            "stoker_worker_requests_refused_total",
            &[("reason", "stalled")],
        )
    };
    until("the connection is closed", || stalled() == Some(1.0)).await;
    // What its requests held is given back, and nothing stays in flight.
    until("its bytes are freed", || {
        w.metrics.memory_held_bytes.get() == 0 && w.metrics.requests_in_flight.get() == 0
    })
    .await;
    // The peer reads what the socket held, then the end of the connection.
    let mut answers = 0;
    while let Ok(Ok(a)) = tokio::time::timeout(Duration::from_secs(60), stuck.0.recv()).await {
        a.batch();
        answers += 1;
    }
    assert!(answers < 4 * welcome.batches_per_epoch, "{answers} answers");
    // Another rank is served.
    let (mut c, _) = Client::connect(w.addr, TOKEN).await.unwrap();
    c.get(request(&welcome, 0, 1, 0, 1)).await.batch();
}
