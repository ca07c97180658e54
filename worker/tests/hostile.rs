//! Hostile peers on the batch port: headers announcing huge frames before and after
//! authentication, random bytes, many connections at once, floods of silent connections. The
//! worker never sizes memory from a header it has not bounded, answers each with an Error
//! frame naming what it refused, counts it, and keeps serving an honest client meanwhile; a
//! connection takes a trainer's slot only once its Hello is accepted, and gives it back on
//! every way out.

mod common;

use common::*;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use stoker_control::exposition::metric_value_with;
use stoker_testkit::synth::SynthFormat;
use stoker_wire::{ErrorCode, ErrorFrame, FrameHeader, Hello, Kind};
use stoker_worker::handshake::{MAX_HANDSHAKES, MAX_HANDSHAKES_PER_ADDRESS};
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

/// Connects from `source`, another loopback address than the honest clients' 127.0.0.1.
async fn connect_from(source: Ipv4Addr, addr: SocketAddr) -> TcpStream {
    let s = tokio::net::TcpSocket::new_v4().unwrap();
    s.bind((source, 0).into()).unwrap();
    s.connect(addr).await.unwrap()
}

/// Attackers take turns among 64 loopback addresses, so that many at once stay within each
/// address's share of the handshake budget (what is under test is what they send).
fn attacker_address() -> Ipv4Addr {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed) % 64;
    Ipv4Addr::new(127, 0, 3, 1 + n as u8)
}

/// Sends `bytes`, then reads what the worker answers until it closes: the Error frame.
async fn attack(addr: SocketAddr, bytes: Vec<u8>) -> ErrorFrame {
    let mut s = connect_from(attacker_address(), addr).await;
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
    // Three idle peers hold every slot: authenticated, then silent.
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(Client::connect(w.addr, TOKEN).await.unwrap());
    }
    let e = attack(w.addr, hello(TOKEN)).await;
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
            e.message
                .starts_with("nothing read and no answer ready for 1s"),
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

/// Requests in flight do not keep a connection open when nothing moves on it: a request whose
/// image the store never answers, and nothing else read, ends it after the idle timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_where_nothing_moves_is_closed_with_a_request_in_flight() {
    let mut ds = synth_dataset(4, SynthFormat::Llava).await;
    let behaviour = StoreBehaviour {
        slow_objects: vec![("jpg".into(), Duration::from_secs(86_400))],
        ..Default::default()
    };
    ds.restart_store(behaviour).await;
    let mut cfg = ds.config(4);
    cfg.s3.read_timeout_s = 2 * 86_400;
    cfg.serving.limits.idle_timeout_s = 1;
    let w = start_worker(&cfg).await;
    let (mut c, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
    c.send(request(&welcome, 0, 0, 0, 1)).await;
    let e = c.recv().await.error();
    assert_eq!((e.request_id, e.code), (0, ErrorCode::Unavailable));
    assert!(
        e.message
            .starts_with("nothing read and no answer ready for 1s"),
        "{}",
        e.message
    );
    assert_eq!(refused(&w, "idle"), 1.0);
}

/// Waits until the worker is quiet (no handshake, no request in flight) and then holds
/// exactly `held` slots, counted three ways: the semaphore, the gauge and the test's own
/// open connections.
async fn slots_agree(w: &Worker, held: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let taken = w.server.slots_taken();
        let gauge = w.metrics.connections.get();
        let quiet =
            w.server.handshakes_in_progress() == 0 && w.metrics.requests_in_flight.get() == 0;
        if quiet && taken == held && gauge == held as i64 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "slots taken {taken}, connections gauge {gauge}, open {held}, handshakes {}, \
             requests in flight {}",
            w.server.handshakes_in_progress(),
            w.metrics.requests_in_flight.get()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Slots are taken by authenticated connections only and given back on every way out:
/// after rounds of churn (served, killed with requests in flight, cancelled, refused for
/// the token, for a bad frame, for the connection limit, silent until the handshake
/// timeout), the slots taken equal the connections open, exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_agree_with_open_connections_after_churn_refusals_and_kills() {
    let ds = synth_dataset(8, SynthFormat::Llava).await;
    let mut cfg = ds.config(4);
    cfg.serving.limits.max_connections = 4;
    let w = start_worker(&cfg).await;
    // Silent until the handshake timeout: no slot, ever.
    let silent = connect_from(Ipv4Addr::new(127, 0, 4, 1), w.addr).await;
    while w.server.handshakes_in_progress() == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    slots_agree(&w, 0).await;
    assert_eq!(refused(&w, "no_hello"), 1.0);
    drop(silent);
    for round in 0..4u64 {
        let mut kept = Vec::new();
        for g in 0..2 {
            let (mut c, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
            let (head, _) = c.get(request(&welcome, round % 2, g, 0, 1)).await.batch();
            assert_eq!(head.sample_ids.len(), 4);
            kept.push(c);
        }
        // Killed with requests in flight, and cancelled then closed.
        let (mut killed, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
        killed.send(request(&welcome, 0, 0, 0, 1)).await;
        killed.send(request(&welcome, 0, 1, 0, 1)).await;
        drop(killed);
        let (mut cancelled, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
        let r = request(&welcome, 1, 1, 0, 1);
        cancelled.send(r).await;
        cancelled.cancel(r.request_id).await;
        drop(cancelled);
        // Refused: the token, a frame over its limit after the Hello.
        let e = Client::connect(w.addr, "wrong").await.err().unwrap();
        assert_eq!(e.code, ErrorCode::Unauthorized);
        // (Once the killed and cancelled connections are gone: the bad frame needs a slot.)
        slots_agree(&w, 2).await;
        let mut bad = hello(TOKEN);
        bad.extend(header(Kind::Request, 512 << 10));
        assert_eq!(attack(w.addr, bad).await.code, ErrorCode::BadRequest);
        slots_agree(&w, 2).await;
        // Over the limit: two more fill it, the fifth is refused by name.
        for _ in 0..2 {
            kept.push(Client::connect(w.addr, TOKEN).await.unwrap().0);
        }
        let e = Client::connect(w.addr, TOKEN).await.err().unwrap();
        assert_eq!(e.code, ErrorCode::Unavailable, "{}", e.message);
        slots_agree(&w, 4).await;
        kept.truncate(1);
        slots_agree(&w, 1).await;
        drop(kept);
        slots_agree(&w, 0).await;
    }
    assert_eq!(refused(&w, "connection_limit"), 4.0);
    assert_eq!(refused(&w, "unauthorized"), 4.0);
}

/// 1,024 silent connections (from 16 other addresses, 64 each: twice the handshake budget)
/// and one address beyond its share take no trainer slot and keep no rank out: the address
/// over its share is refused at once, the oldest silent handshakes make room for newer ones,
/// and honest clients are served while the flood is still open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_silent_connections_takes_no_slot_and_keeps_no_rank_out() {
    let ds = synth_dataset(8, SynthFormat::Llava).await;
    let mut cfg = ds.config(4);
    cfg.serving.limits.max_connections = 2;
    let w = start_worker(&cfg).await;
    let mut silent = Vec::new();
    for i in 0..1024 {
        let source = Ipv4Addr::new(127, 0, 1, 1 + (i / MAX_HANDSHAKES_PER_ADDRESS) as u8);
        silent.push(connect_from(source, w.addr).await);
    }
    let greedy = Ipv4Addr::new(127, 0, 2, 1);
    for _ in 0..MAX_HANDSHAKES_PER_ADDRESS + 8 {
        silent.push(connect_from(greedy, w.addr).await);
    }
    // Every connection past the budget evicted the oldest; 8 over one address's share were
    // refused.
    let expected = (1024 + MAX_HANDSHAKES_PER_ADDRESS - MAX_HANDSHAKES + 8) as f64;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while refused(&w, "handshake_limit") < expected {
        assert!(
            std::time::Instant::now() < deadline,
            "the flood was not counted"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(w.server.handshakes_in_progress(), MAX_HANDSHAKES);
    assert_eq!(
        w.server.slots_taken(),
        0,
        "a silent connection holds a slot"
    );
    // Honest clients on 127.0.0.1 get in while the flood is open and are served.
    let mut honest = Vec::new();
    for g in 0..2 {
        let (mut c, welcome) = Client::connect(w.addr, TOKEN).await.unwrap();
        let (head, _) = c.get(request(&welcome, 0, g, 0, 1)).await.batch();
        assert_eq!(head.sample_ids.len(), 4);
        honest.push(c);
    }
    assert!(
        w.server.handshakes_in_progress() >= MAX_HANDSHAKES - 2,
        "the flood ended before the honest clients were served"
    );
    assert_eq!(
        (w.server.slots_taken(), w.metrics.connections.get()),
        (2, 2)
    );
    // The flood ends by the handshake timeout; the honest connections keep their slots.
    slots_agree(&w, 2).await;
    drop(silent);
}
