//! The trainer client against real `stoker worker` processes over TLS: workers SIGKILLed at
//! random moments during an epoch (and replaced, as a Deployment would) cost neither a sample nor a
//! duplicate, with plain or token-shaped plans (balanced ranks, length buckets, packs: each
//! delivered pack holds the plan's samples); a flood of silent connections and a worker refusing
//! the token cost ranks nothing; and `stoker-lab demo` prints its ablation.

use rand::{Rng, SeedableRng};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use stoker_client::{Depth, Dial, Discovery, Loader, LoaderConfig, WorkerSet};
use stoker_config::WorkerConfig;
use stoker_control::exposition::metric_value;
use stoker_testkit::embedded_s3::EmbeddedS3;
use stoker_testkit::http;
use stoker_testkit::local_worker::{write_sample_lengths, LocalWorker};
use stoker_testkit::synth::{generate, SynthFormat, SynthOptions};
use stoker_testkit::tls::serve_tls;
use stoker_worker::dataset::lengths::SampleLengths;
use stoker_worker::plan::{Plan, Shaping};

mod common;
use common::{json_lines, LAB, STOKER};
const SAMPLES: usize = 48;
/// The demo compares rates it measures: the flood test (a worker answering 1,024 sockets)
/// does not run beside it.
static TIMED: Mutex<()> = Mutex::new(());
const GLOBAL_BATCH: u32 = 8;

#[test]
fn random_worker_kills_lose_and_duplicate_no_sample() {
    kills_lose_and_duplicate_no_sample(Shaping::default());
}

#[test]
fn random_worker_kills_lose_and_duplicate_no_sample_with_balanced_ranks_and_length_buckets() {
    kills_lose_and_duplicate_no_sample(Shaping {
        balance_ranks: true,
        bucket_by_length: true,
        pack_max_tokens: None,
    });
}

#[test]
fn random_worker_kills_lose_and_duplicate_no_sample_with_packed_ranks() {
    kills_lose_and_duplicate_no_sample(Shaping {
        // A few of the synthetic samples (64–300 px images) per pack.
        pack_max_tokens: Some(2048),
        ..Shaping::default()
    });
}

/// A synthetic dataset under `root/bucket/data`, served by the embedded S3 server (its first
/// byte `delay` late) on a runtime the caller keeps alive.
fn serve_dataset(
    root: &std::path::Path,
    o: &SynthOptions,
    delay: Duration,
) -> (tokio::runtime::Runtime, EmbeddedS3) {
    generate(&root.join("bucket/data"), o, &|| {}).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let s3 = rt
        .block_on(EmbeddedS3::start(root, "127.0.0.1:0", delay))
        .unwrap();
    (rt, s3)
}

/// `samples` conversations of small images in one shard, served by the embedded store.
fn serve_small_images(
    root: &std::path::Path,
    samples: usize,
) -> (tokio::runtime::Runtime, EmbeddedS3) {
    let o = SynthOptions {
        samples,
        format: SynthFormat::Messages,
        samples_per_shard: 48,
        min_side: 32,
        max_side: 96,
        ..SynthOptions::default()
    };
    serve_dataset(root, &o, Duration::ZERO)
}

/// A one-thread worker of that dataset, in plaintext, with global batches of `global`.
fn plaintext_worker(global: u32) -> WorkerConfig {
    let mut cfg = WorkerConfig {
        data: "s3://bucket/data".into(),
        ..WorkerConfig::default()
    };
    cfg.s3.path_style = true;
    cfg.sampling.global_batch_size = global;
    cfg.concurrency.cpu_threads = Some(1);
    cfg.serving.insecure_plaintext = true;
    cfg
}

fn kills_lose_and_duplicate_no_sample(shaping: Shaping) {
    let root = tempfile::tempdir().unwrap();
    let o = SynthOptions {
        samples: SAMPLES,
        format: SynthFormat::Messages,
        samples_per_shard: 16,
        min_side: 64,
        max_side: 300,
        ..SynthOptions::default()
    };
    // Slower than the trainer's step: workers always have requests in flight.
    let (_rt, s3) = serve_dataset(root.path(), &o, Duration::from_millis(40));
    let token = root.path().join("token");
    std::fs::write(&token, "kill-test").unwrap();
    let mut cfg = WorkerConfig {
        data: "s3://bucket/data".into(),
        ..WorkerConfig::default()
    };
    cfg.s3.path_style = true;
    cfg.sampling.global_batch_size = GLOBAL_BATCH;
    cfg.concurrency.cpu_threads = Some(1);
    cfg.serving.token_file = Some(token.display().to_string());
    // Over TLS, as on Kubernetes: every worker proves it is 127.0.0.1 before the token goes.
    let tls = serve_tls(&root.path().join("tls"), &["127.0.0.1"], &mut cfg).unwrap();
    cfg.sampling.balance_ranks = shaping.balance_ranks;
    cfg.sampling.bucket_by_length = shaping.bucket_by_length;
    cfg.sampling.pack_max_tokens = shaping.pack_max_tokens;
    let mut plan = Plan::new(SAMPLES as u64, GLOBAL_BATCH, 0);
    if shaping != Shaping::default() {
        let dir = root.path().join("bucket/data");
        let stored = write_sample_lengths(STOKER.as_ref(), "s3://bucket/data", &s3.env(), &dir);
        let lengths = SampleLengths::from_bytes(stored.unwrap()).unwrap();
        plan = plan.with_lengths(lengths.tokens, shaping);
    }
    let env = s3.env();
    let spawn = move || LocalWorker::spawn(STOKER.as_ref(), &cfg, &env);
    let workers = Arc::new(Mutex::new(
        (0..3).map(|_| spawn().unwrap()).collect::<Vec<_>>(),
    ));
    let addrs = |ws: &[LocalWorker]| -> WorkerSet { ws.iter().map(|w| w.addr.clone()).collect() };
    let (set_tx, set_rx) = tokio::sync::watch::channel(addrs(&workers.lock().unwrap()));

    const WORLD: u32 = 2;
    const EPOCHS: u64 = 3;
    let bpe = plan.batches_per_epoch();
    let progress = Arc::new(AtomicU64::new(0));
    let ranks: Vec<_> = (0..WORLD)
        .map(|rank| {
            let mut cfg = LoaderConfig::new(Discovery::Watch(set_rx.clone()), rank, WORLD);
            cfg.dial = Some(Dial::Tls(tls.clone()));
            cfg.token = "kill-test".into();
            cfg.depth = Depth::Fixed(4);
            let mut loader = Loader::new(cfg).unwrap();
            let progress = progress.clone();
            std::thread::spawn(move || {
                let mut got = Vec::new();
                while (got.len() as u64) < EPOCHS * bpe {
                    if let Some(b) = loader.next_batch().unwrap() {
                        // Packed: how many samples each pack holds, as the client read it.
                        let packs = b
                            .packs
                            .as_ref()
                            .map(|ps| ps.iter().map(|p| p.samples.len()).collect::<Vec<_>>());
                        got.push((b.epoch, b.global_batch, b.sample_ids.clone(), packs));
                        progress.fetch_add(1, Ordering::Release);
                    }
                    // A trainer step, so that kills land mid-epoch.
                    std::thread::sleep(Duration::from_millis(10));
                }
                let lost = loader
                    .metrics()
                    .retries
                    .with_label_values(&["worker_lost"])
                    .get();
                (got, lost)
            })
        })
        .collect();

    // The chaos: at three random points of the run (by batches consumed), SIGKILL a random
    // worker and start a replacement.
    let seed: u64 = rand::random();
    println!("kill schedule seed {seed}");
    let killer = {
        let (workers, progress) = (workers.clone(), progress.clone());
        std::thread::spawn(move || {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let total = EPOCHS * bpe * WORLD as u64;
            let mut points: Vec<u64> = (0..3).map(|_| rng.gen_range(1..total - 4)).collect();
            points.sort_unstable();
            for p in points {
                while progress.load(Ordering::Acquire) < p {
                    std::thread::sleep(Duration::from_millis(1));
                }
                std::thread::sleep(Duration::from_millis(rng.gen_range(0..30)));
                let mut ws = workers.lock().unwrap();
                // A worker with a request in flight, where there is one: a kill of an idle
                // worker tests nothing (and left the retry assertion to chance).
                let busy = |w: &LocalWorker| {
                    http::get_ok(&w.metrics_addr, "/metrics")
                        .ok()
                        .and_then(|m| metric_value(&m, "stoker_worker_requests_in_flight"))
                        .is_some_and(|n| n > 0.0)
                };
                let victim = (0..ws.len())
                    .find(|&i| busy(&ws[i]))
                    .unwrap_or_else(|| rng.gen_range(0..ws.len()));
                ws[victim].kill();
                ws[victim] = spawn().unwrap();
                set_tx.send_replace(addrs(&ws));
            }
        })
    };
    let results: Vec<_> = ranks.into_iter().map(|r| r.join().unwrap()).collect();
    killer.join().unwrap();

    for (rank, (got, _)) in results.iter().enumerate() {
        let want: Vec<_> = (0..EPOCHS)
            .flat_map(|e| (0..bpe).map(move |g| (e, g)))
            .map(|(e, g)| {
                let slice = plan.rank_slice(e, g, rank as u32, WORLD).unwrap();
                (e, g, slice.samples, slice.packs)
            })
            .collect();
        assert_eq!(got, &want, "rank {rank} (seed {seed})");
    }
    // Every sample of each epoch exactly once across ranks.
    for e in 0..EPOCHS {
        let seen: BTreeSet<u64> = results
            .iter()
            .flat_map(|(got, _)| got.iter().filter(|b| b.0 == e).flat_map(|b| b.2.clone()))
            .collect();
        assert_eq!(seen.len(), SAMPLES);
    }
    let lost: u64 = results.iter().map(|(_, l)| l).sum();
    println!("3 kills, {lost} requests retried after a lost worker");
    assert!(lost > 0, "no kill hit a request in flight (seed {seed})");
}

/// The 4,096-rank problem at the size this machine holds: 24 ranks stepping in lock-step
/// against 6 worker processes of 8 connection slots each (48 slots; a full mesh needs 144).
/// Every rank gets exactly its planned batches and no rank is refused into `NoWorker`, also
/// when a worker is SIGKILLed and another added mid-epoch.
#[test]
fn many_ranks_in_lock_step_on_few_connection_slots_get_exactly_their_batches() {
    const RANKS: u32 = 24;
    const WORKERS: usize = 6;
    const SLOTS: u32 = 8;
    const GLOBAL: u32 = 2 * RANKS;
    const SAMPLES: usize = 4 * GLOBAL as usize;
    const EPOCHS: u64 = 2;
    let root = tempfile::tempdir().unwrap();
    let (_rt, s3) = serve_small_images(root.path(), SAMPLES);
    let mut cfg = plaintext_worker(GLOBAL);
    cfg.serving.no_auth = true;
    cfg.serving.limits.max_connections = SLOTS;
    let env = s3.env();
    let spawn = move || LocalWorker::spawn(STOKER.as_ref(), &cfg, &env);
    let workers = Arc::new(Mutex::new(
        (0..WORKERS).map(|_| spawn().unwrap()).collect::<Vec<_>>(),
    ));
    let addrs = |ws: &[LocalWorker]| -> WorkerSet { ws.iter().map(|w| w.addr.clone()).collect() };
    let (set_tx, set_rx) = tokio::sync::watch::channel(addrs(&workers.lock().unwrap()));
    let plan = Plan::new(SAMPLES as u64, GLOBAL, 0);
    let bpe = plan.batches_per_epoch();
    let steps = EPOCHS * bpe;
    let barrier = Arc::new(std::sync::Barrier::new(RANKS as usize + 1));
    let ranks: Vec<_> = (0..RANKS)
        .map(|rank| {
            let set_rx = set_rx.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let mut cfg = LoaderConfig::new(Discovery::Watch(set_rx), rank, RANKS);
                cfg.dial = Some(Dial::InsecurePlaintext);
                cfg.depth = Depth::Fixed(2);
                let fail = |e: stoker_client::Error| -> ! {
                    // The other ranks and the controller wait at the barrier for this one:
                    // end the test process, or it would hang instead of failing.
                    eprintln!("rank {rank}: {e}");
                    std::process::exit(101)
                };
                let mut loader = Loader::new(cfg).unwrap_or_else(|e| fail(e));
                let mut got = Vec::new();
                while (got.len() as u64) < steps {
                    let b = loader.next_batch().unwrap_or_else(|e| fail(e));
                    if let Some(b) = b {
                        got.push((b.epoch, b.global_batch, b.sample_ids.clone()));
                        // The synchronous step: every rank waits for the slowest.
                        barrier.wait();
                    }
                }
                got
            })
        })
        .collect();
    // The controller side of the barrier: after step 2 a worker dies, after step 4 one more
    // joins (as a Deployment replaces and scales).
    for step in 0..steps {
        barrier.wait();
        let mut ws = workers.lock().unwrap();
        if step == 2 {
            ws[0].kill();
            ws.remove(0);
            set_tx.send_replace(addrs(&ws));
        }
        if step == 4 {
            ws.push(spawn().unwrap());
            set_tx.send_replace(addrs(&ws));
        }
    }
    let results: Vec<_> = ranks.into_iter().map(|r| r.join().unwrap()).collect();
    for (rank, got) in results.iter().enumerate() {
        let want: Vec<_> = (0..EPOCHS)
            .flat_map(|e| (0..bpe).map(move |g| (e, g)))
            .map(|(e, g)| {
                (
                    e,
                    g,
                    plan.rank_slice(e, g, rank as u32, RANKS).unwrap().samples,
                )
            })
            .collect();
        assert_eq!(got, &want, "rank {rank}");
    }
    for e in 0..EPOCHS {
        let seen: BTreeSet<u64> = results
            .iter()
            .flat_map(|got| got.iter().filter(|b| b.0 == e).flat_map(|b| b.2.clone()))
            .collect();
        assert_eq!(seen.len(), SAMPLES, "epoch {e}: every sample once");
    }
    // No worker ever held more connections than its slots, and ranks were refused (the
    // limit was real) or fit (the subset kept them within it): either way nobody starved.
    for w in workers.lock().unwrap().iter() {
        let m = http::get_ok(&w.metrics_addr, "/metrics").unwrap();
        let open = metric_value(&m, "stoker_worker_connections").unwrap_or(0.0);
        assert!(open <= SLOTS as f64, "{} holds {open} connections", w.addr);
    }
}

/// One bad peer is that peer's problem, with real processes: a worker beside 1,024 silent
/// connections (from other loopback addresses: twice the worker's handshake budget) and a
/// second worker that refuses the ranks' token, both given to the same ranks. Every rank gets
/// the whole epoch, every sample exactly once, and the flood is counted by the worker.
#[test]
fn ranks_beside_a_flood_and_a_refusing_worker_get_every_sample_exactly_once() {
    let _quiet = TIMED.lock().unwrap_or_else(|e| e.into_inner());
    const RANKS: u32 = 4;
    const SILENT: usize = 1024;
    let root = tempfile::tempdir().unwrap();
    let (rt, s3) = serve_small_images(root.path(), SAMPLES);
    let spawn_with_token = |token: &str| {
        let file = root.path().join(format!("token-{token}"));
        std::fs::write(&file, token).unwrap();
        let mut cfg = plaintext_worker(GLOBAL_BATCH);
        cfg.serving.token_file = Some(file.to_str().unwrap().into());
        LocalWorker::spawn(STOKER.as_ref(), &cfg, &s3.env()).unwrap()
    };
    let worker = spawn_with_token("the-ranks-token");
    let refusing = spawn_with_token("another-token");
    let silent: Vec<tokio::net::TcpStream> = rt.block_on(async {
        let mut silent = Vec::new();
        for i in 0..SILENT {
            let s = tokio::net::TcpSocket::new_v4().unwrap();
            let source = std::net::Ipv4Addr::new(127, 0, 1 + (i / 250) as u8, 1 + (i % 250) as u8);
            s.bind((source, 0).into()).unwrap();
            silent.push(s.connect(worker.addr.parse().unwrap()).await.unwrap());
        }
        silent
    });
    let plan = Plan::new(SAMPLES as u64, GLOBAL_BATCH, 0);
    let bpe = plan.batches_per_epoch();
    let addrs = vec![worker.addr.clone(), refusing.addr.clone()];
    let ranks: Vec<_> = (0..RANKS)
        .map(|rank| {
            let addrs = addrs.clone();
            std::thread::spawn(move || {
                let mut cfg = LoaderConfig::new(Discovery::Static(addrs), rank, RANKS);
                cfg.dial = Some(Dial::InsecurePlaintext);
                cfg.token = "the-ranks-token".into();
                let mut loader = Loader::new(cfg).unwrap();
                let mut got = Vec::new();
                while (got.len() as u64) < bpe {
                    let b = loader
                        .next_batch()
                        .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                    if let Some(b) = b {
                        got.push((b.global_batch, b.sample_ids.clone()));
                    }
                }
                got
            })
        })
        .collect();
    let mut seen = Vec::new();
    for (rank, r) in ranks.into_iter().enumerate() {
        let got = r.join().unwrap();
        let want: Vec<_> = (0..bpe)
            .map(|g| {
                (
                    g,
                    plan.rank_slice(0, g, rank as u32, RANKS).unwrap().samples,
                )
            })
            .collect();
        assert_eq!(got, want, "rank {rank}");
        seen.extend(got.into_iter().flat_map(|(_, ids)| ids));
    }
    let distinct: BTreeSet<u64> = seen.iter().copied().collect();
    assert_eq!(
        (seen.len(), distinct.len()),
        (SAMPLES, SAMPLES),
        "every sample once"
    );
    let m = http::get_ok(&worker.metrics_addr, "/metrics").unwrap();
    let flood = stoker_control::exposition::metric_value_with(
        &m,
        "stoker_worker_requests_refused_total",
        &[("reason", "handshake_limit")],
    );
    assert!(
        flood.unwrap_or(0.0) >= (SILENT / 2) as f64,
        "the flood was not counted: {flood:?}"
    );
    let m = http::get_ok(&refusing.metrics_addr, "/metrics").unwrap();
    let refused = stoker_control::exposition::metric_value_with(
        &m,
        "stoker_worker_requests_refused_total",
        &[("reason", "unauthorized")],
    );
    assert!(
        refused.unwrap_or(0.0) >= 1.0,
        "no rank was refused: {refused:?}"
    );
    drop(silent);
}

#[test]
fn demo_prints_the_ablation_as_json() {
    let _quiet = TIMED.lock().unwrap_or_else(|e| e.into_inner());
    let cache = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(LAB)
        .args([
            "demo",
            "--json",
            "--samples",
            "48",
            "--steps",
            "4",
            "--warmup-steps",
            "1",
        ])
        .args(["--max-workers", "2", "--settle-timeout-s", "8"])
        .arg("--cache")
        .arg(cache.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let stages: Vec<&str> = rows.iter().map(|r| r["stage"].as_str().unwrap()).collect();
    assert_eq!(
        stages,
        [
            "serial baseline",
            "+ concurrency",
            "+ prefetch",
            "+ zero-copy hand-over",
            "+ autoscaled workers"
        ]
    );
    for r in &rows {
        for f in ["wait_ratio", "samples_per_s", "data_s_per_batch"] {
            assert!(r[f].as_f64().unwrap() >= 0.0, "{f} in {r}");
        }
        assert!(r["workers"].as_u64().unwrap() >= 1);
    }
    // Every fix waits less than the serial baseline, and the full design less than any
    // partial one. (The rows' strict order holds on a quiet or one-core-loaded machine —
    // docs/benchmarks.md has the runs — but here other tests may take both cores, and a
    // CPU-starved worker hides what the zero-copy stage removes.)
    let wait = |i: usize| rows[i]["wait_ratio"].as_f64().unwrap();
    for i in 1..rows.len() {
        assert!(
            wait(i) < wait(0),
            "row {i} waits no less than the baseline:\n{stdout}"
        );
    }
    for i in 0..rows.len() - 1 {
        assert!(
            wait(4) < wait(i),
            "the full design waits no less than row {i}:\n{stdout}"
        );
    }
}

/// `stoker-lab bench scale` at a size CI affords (virtual time: deterministic, no wall clock):
/// the bounded-link policy meets the issue's targets in every scenario, the full mesh does
/// not, and both deliver exactly (the command fails otherwise).
#[test]
fn the_scale_simulator_shows_bounded_links_meeting_their_targets() {
    let rows = ci_scale_rows(&["--scenarios", "steady,restart,drain,scale-up,slow"]);
    let subset: Vec<_> = rows.iter().filter(|r| r["policy"] == "subset").collect();
    assert_eq!(subset.len(), 5, "five scenarios: {rows:?}");
    for r in &subset {
        let name = &r["scenario"];
        assert_eq!(r["ranks_without_worker"], 0, "{name}");
        assert_eq!(r["requests_past_deadline"], 0, "{name}");
        assert_eq!(r["exact_delivery"], true, "{name}");
        assert!(
            r["max_connections_per_worker"].as_u64().unwrap() <= 192,
            "{name}: 25 % headroom"
        );
        let eff: Vec<f64> = r["efficiency_by_step"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_f64().unwrap())
            .collect();
        assert_eq!(eff.len(), 20, "{name}: every step ran");
        let below = eff.iter().skip(1).filter(|e| **e < 0.9).count();
        assert!(below <= 1, "{name}: {eff:?}");
        if name == "steady" {
            assert!(eff.iter().skip(1).all(|e| *e >= 0.95), "{eff:?}");
            assert!(r["max_over_mean_worker_load"].as_f64().unwrap() <= 1.25);
        }
    }
    let mesh = rows.iter().find(|r| r["policy"] == "full-mesh").unwrap();
    let mesh_eff = mesh["efficiency_by_step"].as_array().unwrap();
    let worst = mesh_eff
        .iter()
        .map(|e| e.as_f64().unwrap())
        .fold(1.0, f64::min);
    // Half the ranks find no slot anywhere (the job fails), or the herd stalls it.
    let starved = mesh["ranks_without_worker"].as_u64().unwrap();
    assert!(starved > 0 || worst < 0.5, "the full mesh: {mesh}");
}

/// `stoker-lab bench scale` at CI size (512 ranks × 128 workers of 256 connections, 20 steps)
/// with `extra` arguments: one JSON row per scenario.
fn ci_scale_rows(extra: &[&str]) -> Vec<serde_json::Value> {
    json_lines(
        std::process::Command::new(LAB)
            .args([
                "bench", "scale", "--sizes", "512x128", "--steps", "20", "--json",
            ])
            .args(["--max-connections", "256"])
            .args(extra)
            .env("RUST_LOG", "error"),
    )
}

/// The headroom rows at CI size (docs/benchmarks.md, "Headroom"; the sizing rule in
/// docs/design.md): with the fleet at 0.7 of its cores a worker restarted or drained costs at
/// most one step below 0.9 efficiency; at 0.9 a drain costs more. The simulator is seeded and
/// in virtual time, so each row is the same on every run.
#[test]
fn the_scale_simulator_shows_the_headroom_routine_events_need() {
    let after_event = |utilization: &str| -> Vec<(String, u64)> {
        let args = ["--policies", "subset", "--scenarios", "restart,drain"];
        ci_scale_rows(&[&args[..], &["--utilization", utilization]].concat())
            .into_iter()
            .map(|r| {
                assert_eq!(r["exact_delivery"], true, "{r}");
                let below = r["steps_below_0_9_after_event"].as_u64().unwrap();
                (r["scenario"].as_str().unwrap().to_string(), below)
            })
            .collect()
    };
    let at_07 = after_event("0.7");
    assert_eq!(at_07.len(), 2, "{at_07:?}");
    assert!(at_07.iter().all(|(_, below)| *below <= 1), "{at_07:?}");
    let drain = |rows: &[(String, u64)]| rows.iter().find(|r| r.0 == "drain").unwrap().1;
    let at_09 = after_event("0.9");
    assert!(
        drain(&at_09) > drain(&at_07),
        "0.7: {at_07:?}, 0.9: {at_09:?}"
    );
}

/// The faults that send no RST, the rolling update and the trainer's pause at CI size
/// (docs/benchmarks.md, "Silent workers, rollouts, pauses"): a worker and a whole node that
/// stop answering without closing (still listed, or unlisted once the node is NotReady), every
/// worker replaced 10 % at a time, a pause past the workers' idle timeout — each costs at most
/// one step below 0.9 efficiency, and every rank gets exactly its batches.
#[test]
fn the_scale_simulator_shows_silent_workers_rollouts_and_pauses_cost_at_most_a_step() {
    let scenarios = "blackhole,blackhole-node,node-loss,rollout,trainer-pause";
    let rows = ci_scale_rows(&["--policies", "subset", "--scenarios", scenarios]);
    assert_eq!(rows.len(), 5, "{rows:?}");
    let row = |name: &str| rows.iter().find(|r| r["scenario"] == name).unwrap();
    for r in &rows {
        let name = &r["scenario"];
        assert_eq!(r["exact_delivery"], true, "{name}");
        assert_eq!(r["ranks_without_worker"], 0, "{name}");
        let eff = r["efficiency_by_step"].as_array().unwrap();
        assert!(eff.len() >= 20, "{name}: every step ran: {eff:?}");
        let below = r["steps_below_0_9_after_event"].as_u64().unwrap();
        assert!(below <= 1, "{name}: {below} steps below 0.9: {eff:?}");
    }
    // The silent workers' positions were asked elsewhere (the client's silent-link rule), and
    // a silent node held more of them than one worker.
    let silent = |name: &str| row(name)["silent_retries_per_step"].as_f64().unwrap();
    assert!(silent("blackhole") > 0.0, "{rows:?}");
    assert!(silent("blackhole-node") > silent("blackhole"), "{rows:?}");
    // Every one of the 128 workers was replaced, and the run lasted until the last was listed.
    let rollout = row("rollout");
    assert_eq!(rollout["workers"], 256, "{rollout}");
    // The pause outlasted the workers' idle timeout: they closed the ranks' links, and the
    // ranks dialled again without a step lost.
    assert!(row("trainer-pause")["links_closed_idle"].as_u64().unwrap() >= 512);
}

/// The object store in the simulator at CI size (docs/benchmarks.md, "The object store in the
/// simulator"). `brownout`: every worker, its reads and its cores, 5x slower for 20 steps —
/// every duplicate a rank sends (hedges, probes' duplicates, silent links' positions) stays
/// within the hedge budget (0.05 per answer and a burst of 4 per rank), and once the
/// brownout ends the steps are back at full speed. Throttling: the store serves the 512 ranks
/// what one S3 prefix serves 4,096 (5,500 requests/s ÷ 8); reads it throttles are retried,
/// never failed, so every step runs and every rank gets exactly its batches, and reading each
/// line alone (2.05 requests a sample) costs more steps than with `--order runs` (1.07).
#[test]
fn the_scale_simulator_keeps_duplicates_in_budget_in_a_brownout_and_rides_out_throttling() {
    let rows = ci_scale_rows(&["--policies", "subset", "--scenarios", "brownout"]);
    let [brownout] = &rows[..] else {
        panic!("{rows:?}")
    };
    assert_eq!(brownout["exact_delivery"], true, "{brownout}");
    let answers = brownout["answers"].as_f64().unwrap();
    let duplicates = brownout["duplicates_per_answer"].as_f64().unwrap() * answers;
    assert!(
        duplicates <= 0.05 * answers + 4.0 * 512.0,
        "{duplicates} duplicates for {answers} answers: {brownout}"
    );
    let eff = brownout["efficiency_by_step"].as_array().unwrap();
    // The brownout runs from step 10 to step 30 of 40: it slowed steps, and its end let go.
    assert_eq!(eff.len(), 40, "{brownout}");
    let eff: Vec<f64> = eff.iter().map(|e| e.as_f64().unwrap()).collect();
    assert!(eff[10..30].iter().any(|e| *e < 0.9), "{eff:?}");
    assert!(eff[33..].iter().all(|e| *e >= 0.9), "{eff:?}");

    let throttled = |gets: &str| {
        let args = ["--policies", "subset", "--scenarios", "steady"];
        let store = ["--store-gets-per-s", "687.5", "--gets-per-sample", gets];
        let rows = ci_scale_rows(&[&args[..], &store[..]].concat());
        let [row] = &rows[..] else { panic!("{rows:?}") };
        assert_eq!(row["exact_delivery"], true, "{row}");
        assert_eq!(row["steps_completed"], 20, "{row}");
        assert_eq!(row["failed_reads"], 0, "{row}");
        assert!(row["throttled_per_step"].as_f64().unwrap() > 0.0, "{row}");
        let eff = row["efficiency_by_step"].as_array().unwrap();
        eff.iter().map(|e| 1.0 / e.as_f64().unwrap()).sum::<f64>()
    };
    let (runs, lines) = (throttled("1.07"), throttled("2.05"));
    assert!(
        lines > runs,
        "steps of 4 s took {lines} with lines, {runs} with runs"
    );
}

/// A service-time or store profile that is no distribution is refused by name, before any
/// run.
#[test]
fn the_scale_simulator_refuses_a_profile_without_times() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("profile.json");
    std::fs::write(&path, r#"{"what": "nothing measured", "per_sample_s": []}"#).unwrap();
    let refusal = |flag: &str| {
        let out = std::process::Command::new(LAB)
            .args(["bench", "scale", "--sizes", "8x2", "--steps", "2", flag])
            .arg(&path)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = refusal("--service-profile");
    assert!(
        err.contains("service profile") && err.contains("profile.json"),
        "{err}"
    );
    let err = refusal("--store-profile");
    assert!(
        err.contains("store profile") && err.contains("per_get_s"),
        "{err}"
    );
}
