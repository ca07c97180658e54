//! A worker that goes silent without a word — every packet to and from it dropped in the
//! network namespace it runs in, so no RST and no FIN reach anyone — beside a healthy worker.
//! Real processes on a network of the test's own (`stoker_testkit::netns`): two `stoker
//! worker`s, each in a namespace, and two ranks (`stoker-lab bench trainer --record`) in a
//! third, joined by veth pairs; no address outside them is used.
//!
//! The ranks move off the silent worker within the bounds docs/reliability.md states: the
//! batches it held are asked of the other worker once its link has answered nothing for longer
//! than any recent answer took (`retries_total{reason="silent"}`), and the link itself fails
//! within 30 s (TCP_USER_TIMEOUT: a Cancel a rank sent it stays unacknowledged, which
//! keepalive alone would have left for the kernel's ~15 minutes of retransmissions). Every rank
//! gets every position of the plan exactly once.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use stoker_config::WorkerConfig;
use stoker_testkit::local_worker::LocalWorker;
use stoker_testkit::netns::{self, in_ns, Namespaces};
use stoker_testkit::synth::{generate, SynthFormat, SynthOptions};
use stoker_worker::plan::Plan;

mod common;
use common::{LAB, STOKER};

const SAMPLES: usize = 64;
const GLOBAL_BATCH: u32 = 4;
const RANKS: u32 = 2;
/// Batches each rank takes before the worker goes silent.
const BEFORE: usize = 10;
/// How long the ranks train after it: past the link's failure (30 s).
const AFTER: Duration = Duration::from_secs(40);
/// The ranks' time to take `BEFORE` batches: workers index the dataset first, and a cold or
/// busy machine is slow (the trainer's duration counts from its start, so a slow start would
/// shorten the silence below the link's failure).
const START: Duration = Duration::from_secs(20);

#[test]
fn ranks_move_off_a_worker_that_goes_silent_without_a_reset() {
    netns::check_available("the silent-worker test").unwrap();
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    let o = SynthOptions {
        samples: SAMPLES,
        format: SynthFormat::Messages,
        samples_per_shard: 16,
        min_side: 32,
        max_side: 96,
        ..SynthOptions::default()
    };
    generate(&data, &o, &|| {}).unwrap();

    // Declared first, so it is deleted last (after the processes in it are gone).
    let mut ns = Namespaces::new("stk-bh-");
    let trainer = ns.add("t").unwrap();
    let hosts = ["10.78.0.2", "10.78.0.6"];
    let mut worker_ns = Vec::new();
    for (i, host) in hosts.iter().enumerate() {
        let w = ns.add(&format!("w{i}")).unwrap();
        let near = format!("10.78.0.{}/30", 4 * i + 1);
        let far = format!("{host}/30");
        let (a, b) = (format!("bht{i}"), format!("bhw{i}"));
        ns.veth(
            (trainer.as_str(), a.as_str(), Some(near.as_str())),
            (w.as_str(), b.as_str(), Some(far.as_str())),
        )
        .unwrap();
        worker_ns.push(w);
    }
    let mut cfg = WorkerConfig {
        data: data.display().to_string(),
        ..WorkerConfig::default()
    };
    cfg.sampling.global_batch_size = GLOBAL_BATCH;
    cfg.concurrency.cpu_threads = Some(1);
    cfg.serving.insecure_plaintext = true;
    cfg.serving.no_auth = true;
    let workers: Vec<LocalWorker> = worker_ns
        .iter()
        .zip(hosts)
        .map(|(w, host)| LocalWorker::spawn_in_netns(w, &STOKER, host, &cfg, &[]).unwrap())
        .collect();
    let addrs: Vec<String> = workers.iter().map(|w| w.addr.clone()).collect();

    let spawned = Instant::now();
    let mut ranks = Command::new("ip")
        .args(["netns", "exec", &trainer, LAB, "bench", "trainer"])
        .args(["--workers", &addrs.join(",")])
        .args(["--ranks", &RANKS.to_string(), "--step-ms", "100"])
        .args(["--warmup-s", "0", "--record"])
        .args(["--duration-s", &(START + AFTER).as_secs().to_string()])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // Each line with the instant it arrived (the trainer prints a batch as it takes it).
    let (tx, rx) = mpsc::channel();
    let out = ranks.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let v: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
            tx.send((Instant::now(), v)).unwrap();
        }
    });
    let mut lines = Vec::new();
    let mut taken = [0usize; RANKS as usize];
    while taken.iter().any(|n| *n < BEFORE) {
        let (at, v) = rx.recv_timeout(Duration::from_secs(60)).unwrap();
        if let Some(r) = v["rank"].as_u64() {
            taken[r as usize] += 1;
        }
        lines.push((at, v));
    }
    // Silence: worker 0 sends and receives nothing from now on, and closes nothing.
    for chain in ["INPUT", "OUTPUT"] {
        in_ns(&worker_ns[0], &["iptables", "-A", chain, "-j", "DROP"]).unwrap();
    }
    let silent_since = Instant::now();
    let started = silent_since.duration_since(spawned);
    assert!(started < START, "{BEFORE} batches took {started:?}");
    lines.extend(rx.iter());
    reader.join().unwrap();
    assert!(ranks.wait().unwrap().success(), "the trainer failed");

    let (summary, batches): (Vec<_>, Vec<_>) = lines.iter().partition(|(_, v)| v["rank"].is_null());
    let summary = &summary.last().expect("the trainer's summary").1;
    // Exactly once, in order, with the plan's samples.
    let plan = Plan::new(SAMPLES as u64, GLOBAL_BATCH, 0);
    let bpe = plan.batches_per_epoch();
    for rank in 0..RANKS {
        let got: Vec<_> = batches
            .iter()
            .filter(|(_, v)| v["rank"] == rank)
            .map(|(_, v)| v)
            .collect();
        assert!(got.len() > 2 * BEFORE, "rank {rank}: {} batches", got.len());
        for (position, b) in got.iter().enumerate() {
            let (epoch, batch) = (position as u64 / bpe, position as u64 % bpe);
            let want = plan.rank_slice(epoch, batch, rank, RANKS).unwrap().samples;
            assert_eq!(
                (b["epoch"].as_u64(), b["batch"].as_u64()),
                (Some(epoch), Some(batch)),
                "rank {rank}, position {position}"
            );
            let samples: Vec<u64> = serde_json::from_value(b["samples"].clone()).unwrap();
            assert_eq!(samples, want, "rank {rank}, position {position}");
        }
    }
    // Moved off within the bound: the longest any rank waited for a batch after the silence
    // began is under the link's failure (so it was not the link's failure, nor the request
    // timeout, that moved them), by the silent-link rule.
    let longest = batches
        .iter()
        .filter(|(at, _)| *at > silent_since)
        .map(|(_, v)| v["waited"].as_f64().unwrap())
        .fold(0.0, f64::max);
    println!("longest wait after the silence began: {longest:.3} s; {summary}");
    assert!(
        longest < stoker_tls::USER_TIMEOUT.as_secs_f64(),
        "a rank waited {longest:.1} s: {summary}"
    );
    assert!(
        summary["retries"]["silent"].as_u64().unwrap() >= 1,
        "{summary}"
    );
    // And the link to the silent worker failed (the socket's timeout) within the run: the
    // rank whose home it is keeps that link (homes are not released when idle) and sent it
    // Cancels for the positions answered elsewhere, which stay unacknowledged. (A rank that
    // only had a spare link to it may close that one first, as idle.)
    assert!(summary["links_lost"].as_u64().unwrap() >= 1, "{summary}");
}
