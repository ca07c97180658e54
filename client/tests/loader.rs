//! The client against real workers (embedded S3, real preprocessing), each worker on its own
//! runtime so that a test can kill it outright (every connection drops, as with a dead pod).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use stoker_client::{Depth, Dial, Discovery, HedgePolicy, Loader, LoaderConfig, LoaderState};
use stoker_config::WorkerConfig;
use stoker_testkit::embedded_s3::{EmbeddedS3, Faults, StoreBehaviour};
use stoker_testkit::http;
use stoker_testkit::synth::{generate, SynthFormat, SynthOptions};
use stoker_worker::metrics::Metrics;
use stoker_worker::open::open_pipeline;
use stoker_worker::server::{Server, ServerConfig};

const TOKEN: &str = "client-test-token";
const SAMPLES: usize = 40;

/// A dataset on disk.
struct Fixture {
    root: tempfile::TempDir,
}

fn fixture() -> Fixture {
    let root = tempfile::tempdir().unwrap();
    let o = SynthOptions {
        samples: SAMPLES,
        format: SynthFormat::Llava,
        samples_per_shard: 10,
        min_side: 64,
        max_side: 200,
        ..SynthOptions::default()
    };
    generate(&root.path().join("bucket/data"), &o, &|| {}).unwrap();
    Fixture { root }
}

/// A worker with its own store and runtime; dropping it kills both.
struct TestWorker {
    addr: String,
    s3: EmbeddedS3,
    rt: Option<tokio::runtime::Runtime>,
}

impl TestWorker {
    fn kill(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for TestWorker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A worker with global batches of 8 on one thread; `seed` fixes its plan.
fn start_worker(f: &Fixture, seed: u64, store: StoreBehaviour) -> TestWorker {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    // A stalled body is given up on after a second (20 s by default).
    let read_timeout_s = match store.faults.every_nth_stall_body {
        0 => stoker_config::DEFAULT_S3_READ_TIMEOUT_S,
        _ => 1,
    };
    let (addr, s3) = rt.block_on(async {
        let s3 = EmbeddedS3::start_with(f.root.path(), "127.0.0.1:0", store)
            .await
            .unwrap();
        let mut cfg = WorkerConfig {
            data: "s3://bucket/data".into(),
            s3: s3.s3_options(),
            ..WorkerConfig::default()
        };
        cfg.s3.read_timeout_s = read_timeout_s;
        cfg.sampling.global_batch_size = 8;
        cfg.sampling.seed = seed;
        cfg.concurrency.cpu_threads = Some(1);
        let pipeline = open_pipeline(&cfg, Metrics::new()).await.unwrap();
        let server = Server::new(
            pipeline,
            ServerConfig {
                token: Some(TOKEN.into()),
                max_inflight_per_conn: 8,
                max_connections: 64,
                idle_timeout: Duration::from_secs(600),
                max_inflight_samples: 64,
                drain_timeout: Duration::from_secs(5),
                links_per_rank: 0,
                ..ServerConfig::default()
            },
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(server.serve(listener, std::future::pending()));
        (addr, s3)
    });
    TestWorker {
        addr,
        s3,
        rt: Some(rt),
    }
}

fn worker(f: &Fixture) -> TestWorker {
    start_worker(f, 0, StoreBehaviour::default())
}

fn config(workers: &[&TestWorker], rank: u32, world: u32) -> LoaderConfig {
    let list = workers.iter().map(|w| w.addr.clone()).collect();
    let mut c = LoaderConfig::new(Discovery::Static(list), rank, world);
    c.dial = Some(Dial::InsecurePlaintext); // in-process servers
    c.token = TOKEN.into();
    c.no_worker_timeout = Duration::from_secs(10);
    c
}

/// What a rank saw of one global batch: sample ids and each sample's unpadded tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    epoch: u64,
    global_batch: u64,
    samples: Vec<(u64, Vec<i64>)>,
}

fn seen(b: &stoker_client::Batch) -> Seen {
    let ids = b.tensor("input_ids").unwrap();
    let mask = b.tensor("attention_mask").unwrap();
    let l = ids.shape[1] as usize;
    let i64s = |x: &[u8]| -> Vec<i64> {
        x.chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let (ids, mask) = (i64s(ids.bytes), i64s(mask.bytes));
    let samples = b
        .sample_ids
        .iter()
        .enumerate()
        .map(|(row, id)| {
            let toks = (0..l)
                .filter(|c| mask[row * l + c] == 1)
                .map(|c| ids[row * l + c])
                .collect();
            (*id, toks)
        })
        .collect();
    Seen {
        epoch: b.epoch,
        global_batch: b.global_batch,
        samples,
    }
}

fn payload_hash(b: &stoker_client::Batch) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    b.payload.as_slice()[stoker_wire::BatchRequest::LEN..].hash(&mut h);
    h.finish()
}

/// Takes `n` batches (crossing epoch ends, which must come exactly at B, 2B, ...).
fn take(loader: &mut Loader, n: usize) -> Vec<stoker_client::Batch> {
    let bpe = loader.plan().batches_per_epoch;
    let mut out = Vec::new();
    while out.len() < n {
        match loader.next_batch().unwrap() {
            Some(b) => out.push(b),
            // (With nothing taken yet, this is the end of the epoch a previous call finished.)
            None => {
                if let Some(last) = out.last() {
                    assert_eq!(last.global_batch, bpe - 1, "an epoch ended early");
                }
            }
        }
    }
    out
}

fn expected_slices(world: u32, epochs: u64) -> Vec<Vec<Vec<u64>>> {
    let plan = stoker_worker::plan::Plan::new(SAMPLES as u64, 8, 0);
    (0..epochs)
        .flat_map(|e| (0..plan.batches_per_epoch()).map(move |g| (e, g)))
        .map(|(e, g)| {
            (0..world)
                .map(|r| plan.rank_slice(e, g, r, world).unwrap().samples)
                .collect()
        })
        .collect()
}

#[test]
fn every_rank_gets_its_planned_slices_in_order_across_epochs() {
    let f = fixture();
    let (a, b) = (worker(&f), worker(&f));
    let expected = expected_slices(2, 2);
    let mut used = BTreeSet::new();
    for rank in 0..2 {
        let mut loader = Loader::new(config(&[&a, &b], rank, 2)).unwrap();
        let bpe = loader.plan().batches_per_epoch;
        assert_eq!(bpe, 5);
        let batches = take(&mut loader, 2 * bpe as usize);
        for (i, batch) in batches.iter().enumerate() {
            assert_eq!(
                (batch.epoch, batch.global_batch),
                (i as u64 / bpe, i as u64 % bpe)
            );
            assert_eq!(batch.sample_ids, expected[i][rank as usize]);
            used.insert(batch.worker.clone());
        }
        // After the second epoch's last batch, the epoch ends once.
        assert!(loader.next_batch().unwrap().is_none());
        assert_eq!(loader.state().epoch, 2);
        assert_eq!(loader.state().next_batch, 0);
        let stats = loader.stats();
        assert_eq!(stats.batches, 2 * bpe);
        assert!(stats.wait_s > 0.0);
    }
    assert_eq!(used.len(), 2, "load spread over both workers: {used:?}");
}

#[test]
fn resume_reproduces_the_uninterrupted_run_on_any_world_size() {
    let f = fixture();
    let w = worker(&f);
    // Uninterrupted: 1 rank, one epoch and a half.
    let mut full = Loader::new(config(&[&w], 0, 1)).unwrap();
    let reference: Vec<(Seen, u64)> = take(&mut full, 8)
        .iter()
        .map(|b| (seen(b), payload_hash(b)))
        .collect();
    drop(full);

    // Interrupted after 3 batches; a new loader resumes from the state.
    let mut first = Loader::new(config(&[&w], 0, 1)).unwrap();
    let mut got: Vec<(Seen, u64)> = take(&mut first, 3)
        .iter()
        .map(|b| (seen(b), payload_hash(b)))
        .collect();
    let state = first.state();
    assert_eq!(
        state,
        LoaderState {
            plan_id: first.plan().plan_id,
            epoch: 0,
            next_batch: 3
        }
    );
    drop(first);
    let mut cfg = config(&[&w], 0, 1);
    cfg.state = Some(state);
    let mut resumed = Loader::new(cfg).unwrap();
    got.extend(
        take(&mut resumed, 5)
            .iter()
            .map(|b| (seen(b), payload_hash(b))),
    );
    assert_eq!(got, reference, "resume changed the batches (hashes differ)");

    // load_state on a running loader rewinds too (prefetched batches are discarded).
    resumed.load_state(state).unwrap();
    let again = seen(&resumed.next_batch().unwrap().unwrap());
    assert_eq!(again, reference[3].0);

    // World size 1 -> 3 at batch 3: the three ranks together see the same global batches.
    for rank in 0..3 {
        let mut cfg = config(&[&w], rank, 3);
        cfg.state = Some(state);
        let mut l = Loader::new(cfg).unwrap();
        for (i, b) in take(&mut l, 5).iter().enumerate() {
            let s = seen(b);
            let whole = &reference[3 + i].0;
            assert_eq!((s.epoch, s.global_batch), (whole.epoch, whole.global_batch));
            let n = whole.samples.len();
            let (lo, hi) = (n * rank as usize / 3, n * (rank as usize + 1) / 3);
            assert_eq!(s.samples, whole.samples[lo..hi], "rank {rank} batch {i}");
        }
    }
}

#[test]
fn wrong_token_or_another_plan_fails_with_the_reason() {
    let f = fixture();
    let w = worker(&f);
    let mut cfg = config(&[&w], 0, 1);
    cfg.token = "wrong".into();
    let e = Loader::new(cfg)
        .err()
        .expect("a wrong token must fail")
        .to_string();
    assert!(e.contains("refused") && e.contains(&w.addr), "{e}");

    let plan_id = Loader::new(config(&[&w], 0, 1)).unwrap().plan().plan_id;
    let mut cfg = config(&[&w], 0, 1);
    cfg.no_worker_timeout = Duration::from_secs(1);
    cfg.state = Some(LoaderState {
        plan_id: plan_id ^ 1,
        epoch: 0,
        next_batch: 0,
    });
    let e = Loader::new(cfg)
        .err()
        .expect("another plan must fail")
        .to_string();
    assert!(e.contains("serves plan") && e.contains(&w.addr), "{e}");

    let mut cfg = config(&[&w], 0, 1);
    cfg.no_worker_timeout = Duration::from_millis(500);
    cfg.workers = Discovery::Static(vec!["127.0.0.1:1".into()]);
    let e = Loader::new(cfg).err().expect("nobody listens").to_string();
    assert!(e.contains("127.0.0.1:1"), "{e}");
}

#[test]
fn a_worker_serving_another_plan_is_never_used() {
    let f = fixture();
    let good = worker(&f);
    let other = start_worker(&f, 7, StoreBehaviour::default());
    let plan_id = Loader::new(config(&[&good], 0, 1)).unwrap().plan().plan_id;
    // Resuming pins the plan: the other worker's batches would break the order.
    let mut cfg = config(&[&good, &other], 0, 1);
    cfg.state = Some(LoaderState {
        plan_id,
        epoch: 0,
        next_batch: 0,
    });
    let mut loader = Loader::new(cfg).unwrap();
    let expected = expected_slices(1, 1);
    for (b, want) in take(&mut loader, 5).iter().zip(&expected) {
        assert_eq!(b.worker, good.addr);
        assert_eq!(b.sample_ids, want[0]);
    }
    let mismatches = loader
        .metrics()
        .errors
        .with_label_values(&["plan_mismatch"])
        .get();
    assert!(mismatches >= 1, "the other plan's worker was not flagged");
}

/// A store that throttles every 7th request (503 SlowDown), cuts every 5th body short and
/// stalls every 23rd half way (never closing), behind three workers of which two are killed during the run: the workers retry the store,
/// the client asks again for what died with a worker, and two epochs arrive byte for byte as
/// from one worker on a fault-free store, none short, none lost or duplicated.
#[test]
fn a_faulty_store_and_killed_workers_change_no_byte_and_skip_no_sample() {
    let f = fixture();
    let faulty = || {
        let faults = Faults {
            every_nth_slow_down: 7,
            every_nth_cut_body: 5,
            every_nth_stall_body: 23,
            ..Faults::default()
        };
        let store = StoreBehaviour {
            faults,
            ..StoreBehaviour::default()
        };
        start_worker(&f, 0, store)
    };
    let mut workers: Vec<TestWorker> = (0..3).map(|_| faulty()).collect();
    let clean = worker(&f);
    let want = take(&mut Loader::new(config(&[&clean], 0, 1)).unwrap(), 10);
    let mut cfg = config(&workers.iter().collect::<Vec<_>>(), 0, 1);
    cfg.depth = Depth::Fixed(4);
    let mut loader = Loader::new(cfg).unwrap();
    let mut got = Vec::new();
    while got.len() < want.len() {
        match got.len() {
            2 => workers[0].kill(),
            6 => workers[1].kill(),
            _ => {}
        }
        got.extend(loader.next_batch().unwrap());
    }
    for (g, w) in got.iter().zip(&want) {
        assert_eq!((g.epoch, g.global_batch), (w.epoch, w.global_batch));
        assert!(
            g.skipped.is_empty(),
            "skipped under faults: {:?}",
            g.skipped
        );
        assert_eq!(g.sample_ids, w.sample_ids);
        assert_eq!(payload_hash(g), payload_hash(w), "batch {}", g.global_batch);
    }
    let injected: u64 = workers.iter().map(|w| w.s3.faults_injected()).sum();
    let lost = loader.metrics().retries.with_label_values(&["worker_lost"]);
    println!(
        "{injected} faults injected over two epochs, {} requests lost with killed workers",
        lost.get()
    );
    assert!(injected >= 20, "only {injected} faults injected");
}

#[test]
fn killed_workers_lose_and_duplicate_nothing() {
    let f = fixture();
    // A store slower than the loop takes batches: every kill lands on requests in flight
    // (with an instant store, a loaded machine could kill a worker that had answered all).
    let slow = || StoreBehaviour {
        first_byte_latency: Duration::from_millis(40),
        ..StoreBehaviour::default()
    };
    let mut workers: Vec<TestWorker> = (0..3).map(|_| start_worker(&f, 0, slow())).collect();
    let mut cfg = config(&workers.iter().collect::<Vec<_>>(), 0, 1);
    cfg.depth = Depth::Fixed(6);
    let mut loader = Loader::new(cfg).unwrap();
    let expected = expected_slices(1, 3);
    let mut got = Vec::new();
    while got.len() < 15 {
        // Kill a worker while requests are in flight on it, twice.
        match got.len() {
            2 => workers[0].kill(),
            8 => workers[1].kill(),
            _ => {}
        }
        if let Some(b) = loader.next_batch().unwrap() {
            got.push(b.sample_ids.clone());
        }
    }
    let want: Vec<Vec<u64>> = expected.iter().map(|s| s[0].clone()).collect();
    assert_eq!(got, want[..got.len()]);
    assert_eq!(got.len(), 15);
    let retries = loader
        .metrics()
        .retries
        .with_label_values(&["worker_lost"])
        .get();
    assert!(retries > 0, "no request was in flight on a killed worker");
}

#[test]
fn a_straggler_is_hedged_on_another_worker() {
    let f = fixture();
    // Every image from this worker's store takes 1.5 s more: its answers are stragglers.
    let slow_store = StoreBehaviour {
        slow_objects: ["jpg", "png"]
            .iter()
            .map(|e| (e.to_string(), Duration::from_millis(1500)))
            .collect(),
        ..StoreBehaviour::default()
    };
    let fast = worker(&f);
    let slow = start_worker(&f, 0, slow_store);
    // Learn normal latencies from the fast worker alone, then add the slow one: as the
    // worker with no latency yet, it gets the next request, which turns into a straggler.
    let (tx, rx) = tokio::sync::watch::channel(BTreeSet::from([fast.addr.clone()]));
    let mut cfg = config(&[], 0, 1);
    cfg.workers = Discovery::Watch(rx);
    cfg.depth = Depth::Fixed(2);
    cfg.hedge = Some(HedgePolicy {
        min_observations: 3,
        ..HedgePolicy::default()
    });
    let mut loader = Loader::new(cfg).unwrap();
    let expected = expected_slices(1, 2);
    let mut got = take(&mut loader, 5);
    tx.send_modify(|s| {
        s.insert(slow.addr.clone());
    });
    std::thread::sleep(Duration::from_millis(200)); // let it connect
    got.extend(take(&mut loader, 5));
    for (b, want) in got.iter().zip(&expected) {
        assert_eq!(b.sample_ids, want[0]);
    }
    let won = loader.metrics().hedges.with_label_values(&["won"]).get();
    assert!(won > 0, "no hedge won against a 1.5 s straggler");
}

#[test]
fn workers_that_appear_are_used_and_metrics_are_served() {
    let f = fixture();
    let first = worker(&f);
    let (tx, rx) = tokio::sync::watch::channel(BTreeSet::from([first.addr.clone()]));
    let mut cfg = config(&[], 0, 1);
    cfg.workers = Discovery::Watch(rx);
    cfg.depth = Depth::Fixed(4);
    cfg.metrics_listen = Some("127.0.0.1:0".into());
    cfg.pipeline = "unit".into();
    let mut loader = Loader::new(cfg).unwrap();
    take(&mut loader, 2);
    let second = worker(&f);
    tx.send_modify(|s| {
        s.insert(second.addr.clone());
    });
    let mut by_worker: BTreeMap<String, usize> = BTreeMap::new();
    for b in take(&mut loader, 12) {
        *by_worker.entry(b.worker.clone()).or_default() += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        by_worker.contains_key(&second.addr),
        "the new worker got no requests: {by_worker:?}"
    );

    let addr = loader.metrics_addr().unwrap();
    let text = http::get_ok(&addr.to_string(), "/metrics").unwrap();
    // (Label order in the exposition is not fixed.)
    let series = |name: &str| -> Option<String> {
        text.lines()
            .find(|l| {
                l.starts_with(&format!("{name}{{"))
                    && l.contains("pipeline=\"unit\"")
                    && l.contains("rank=\"0\"")
            })
            .and_then(|l| l.rsplit(' ').next())
            .map(String::from)
    };
    assert_eq!(
        series("stoker_trainer_batches_total").as_deref(),
        Some("14"),
        "{text}"
    );
    for name in [
        "stoker_trainer_wait_seconds_total",
        "stoker_trainer_step_seconds_total",
        "stoker_trainer_request_seconds_count",
        "stoker_trainer_requests_in_flight",
        "stoker_trainer_wait_ratio",
    ] {
        assert!(series(name).is_some(), "missing {name} in:\n{text}");
    }
}
