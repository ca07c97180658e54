//! Hostile peers on the batch port: headers announcing huge frames before and after
//! authentication, random bytes, many connections at once. The worker never sizes memory from
//! a header it has not bounded, answers each with an Error frame naming what it refused,
//! counts it, and keeps serving an honest client meanwhile.

mod common;

use common::*;
use stoker_control::exposition::metric_value_with;
use stoker_testkit::synth::SynthFormat;
use stoker_wire::{ErrorCode, ErrorFrame, FrameHeader, Hello, Kind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Hostile connections of each kind, all open at once.
const PER_KIND: usize = 32;
/// What the attack may add to the process's resident memory (the dataset, the tokenizer and
/// the honest client's batches are loaded before the first measurement).
const RSS_BOUND: u64 = 64 << 20;

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib << 10
}

/// The worker's count of connections or requests refused for `reason`.
fn refused(w: &Worker, reason: &str) -> f64 {
    let text = w.metrics.render();
    metric_value_with(
        &text,
        "stoker_worker_requests_refused_total",
        &[("reason", reason)],
    )
    .unwrap_or(0.0)
}

fn header(kind: Kind, len: u64) -> Vec<u8> {
    FrameHeader { kind, len }.encode().to_vec()
}

fn hello(token: &str) -> Vec<u8> {
    let p = Hello {
        token: token.into(),
        client: "hostile".into(),
    }
    .encode();
    let mut out = header(Kind::Hello, p.len() as u64);
    out.extend_from_slice(&p);
    out
}

/// Sends `bytes`, then reads what the worker answers until it closes: the Error frame.
async fn attack(addr: std::net::SocketAddr, bytes: Vec<u8>) -> ErrorFrame {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&bytes).await.unwrap();
    let mut got = Vec::new();
    // The worker closes after its answer; a reset after it is fine too.
    let _ = s.read_to_end(&mut got).await;
    let welcome_len = if got.get(5) == Some(&(Kind::Welcome as u8)) {
        let h = FrameHeader::decode(got[..16].try_into().unwrap()).unwrap();
        16 + h.len as usize
    } else {
        0
    };
    let rest = &got[welcome_len..];
    let h = FrameHeader::decode(rest[..16].try_into().unwrap()).unwrap();
    assert_eq!(h.kind, Kind::Error);
    ErrorFrame::decode(&rest[16..16 + h.len as usize]).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_headers_and_garbage_are_refused_without_memory_and_honest_clients_are_served() {
    let ds = synth_dataset(8, SynthFormat::Llava).await;
    let w = start_worker(&ds.config(4)).await;
    let (mut honest, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
    assert_eq!(
        honest
            .get(request(&welcome, 0, 0, 0, 1))
            .await
            .batch()
            .0
            .sample_ids
            .len(),
        4
    );
    let before = rss_bytes();

    let mut attacks = Vec::new();
    for i in 0..PER_KIND {
        // Before authentication: a batch-sized frame, a Hello far over its bound, garbage.
        attacks.push(tokio::spawn(attack(w.addr, header(Kind::Batch, 8 << 30))));
        attacks.push(tokio::spawn(attack(w.addr, header(Kind::Hello, 1 << 20))));
        // (16 bytes: the worker reads them all, so its close is a FIN, never a reset.)
        let garbage: Vec<u8> = (0..16u32).map(|b| (b * 31 + i as u32) as u8).collect();
        attacks.push(tokio::spawn(attack(w.addr, garbage)));
        // After authentication: a Request announcing half a MiB (under the protocol's 1 MiB
        // control-frame limit, far over a Request's 40 bytes).
        let mut authed = hello(TOKEN);
        authed.extend(header(Kind::Request, 512 << 10));
        attacks.push(tokio::spawn(attack(w.addr, authed)));
    }
    // The honest client is served while the attack is under way.
    let (head, _) = honest.get(request(&welcome, 0, 1, 0, 1)).await.batch();
    assert_eq!(head.sample_ids.len(), 4);
    let mut messages = Vec::new();
    for a in attacks {
        let e = a.await.unwrap();
        assert_eq!(e.code, ErrorCode::BadRequest, "{}", e.message);
        messages.push(e.message);
    }
    let grew = rss_bytes().saturating_sub(before);
    eprintln!(
        "resident memory grew by {} KiB under {} hostile connections",
        grew >> 10,
        4 * PER_KIND
    );
    assert!(
        grew < RSS_BOUND,
        "resident memory grew by {} MiB under attack",
        grew >> 20
    );
    let named = |what: &str| messages.iter().filter(|m| m.contains(what)).count();
    assert_eq!(named("Batch frame of 8589934592 bytes"), PER_KIND);
    assert_eq!(named("Hello frame of 1048576 bytes"), PER_KIND);
    assert_eq!(named("Request frame of 524288 bytes"), PER_KIND);
    assert_eq!(named("bad magic"), PER_KIND);

    assert_eq!(refused(&w, "no_hello"), (3 * PER_KIND) as f64);
    assert_eq!(refused(&w, "bad_request"), PER_KIND as f64);
    // And the worker still serves.
    let (mut again, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
    let (head, _) = again.get(request(&welcome, 0, 1, 0, 1)).await.batch();
    assert_eq!(head.sample_ids.len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_limit_are_refused_by_name_until_one_closes() {
    let ds = synth_dataset(4, SynthFormat::Llava).await;
    let mut cfg = ds.config(4);
    cfg.serving.limits.max_connections = 3;
    let w = start_worker(&cfg).await;
    // Three idle peers hold every slot (they never say Hello).
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(TcpStream::connect(w.addr).await.unwrap());
    }
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let e = attack(w.addr, Vec::new()).await;
    assert_eq!(e.code, ErrorCode::Unavailable);
    assert!(
        e.message.contains("limit of 3 connections"),
        "{}",
        e.message
    );
    assert_eq!(refused(&w, "connection_limit"), 1.0);
    // One idle peer leaves: its slot frees and an honest client is served.
    drop(idle.pop());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut c = loop {
        // Refused (Unavailable), or reset: the refusal closes without reading the Hello.
        match Connection::open(&w.addr.to_string(), TOKEN).await {
            Ok(Ok(c)) => break Client(c),
            Ok(Err(e)) => assert_eq!(e.code, ErrorCode::Unavailable),
            Err(_) => {}
        }
        assert!(std::time::Instant::now() < deadline, "the slot never freed");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    let welcome = c.0.welcome.clone();
    let (head, _) = c.get(request(&welcome, 0, 0, 0, 1)).await.batch();
    assert_eq!(head.sample_ids.len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_or_drip_feeding_peer_is_closed_by_name_after_the_idle_timeout() {
    let ds = synth_dataset(4, SynthFormat::Llava).await;
    let mut cfg = ds.config(4);
    cfg.serving.limits.idle_timeout_s = 1;
    let w = start_worker(&cfg).await;
    // Authenticated, then silent; authenticated, then half a header and nothing more.
    let silent = tokio::spawn(attack(w.addr, hello(TOKEN)));
    let mut drip = hello(TOKEN);
    drip.extend(&header(Kind::Request, 40)[..8]);
    let drip = tokio::spawn(attack(w.addr, drip));
    for e in [silent.await.unwrap(), drip.await.unwrap()] {
        assert_eq!(e.code, ErrorCode::Unavailable);
        assert!(
            e.message.starts_with("no request completed for 1s"),
            "{}",
            e.message
        );
    }
    assert_eq!(refused(&w, "idle"), 2.0);
    // A client with a request in flight is not idle: it is served.
    let (mut c, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
    let (head, _) = c.get(request(&welcome, 0, 0, 0, 1)).await.batch();
    assert_eq!(head.sample_ids.len(), 4);
}
