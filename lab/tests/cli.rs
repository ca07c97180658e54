//! The `stoker` binary end to end: dataset commands against the embedded S3 server, and a
//! worker process that serves over TLS, reports health, and drains on SIGTERM.

use std::io::Write;
use std::process::Command;
use std::time::Duration;
use stoker_client::Dial;
use stoker_config::WorkerConfig;
use stoker_testkit::embedded_s3::EmbeddedS3;
use stoker_testkit::http;
use stoker_testkit::local_worker::{write_sample_lengths, LocalWorker};
use stoker_testkit::tls::serve_tls;
use stoker_worker::connection::{Answer, Connection};
use stoker_worker::dataset::lengths::SampleLengths;

mod common;
use common::{json_lines, LAB, STOKER};

/// Runs a command of the binary that has it: the lab's synth, bench and demo, else the product's.
fn stoker(s3: &EmbeddedS3, args: &[&str]) -> std::process::Output {
    let lab = matches!(args.first(), Some(&("synth" | "bench" | "demo")));
    Command::new(if lab { LAB.as_ref() } else { STOKER.as_path() })
        .args(args)
        .envs(s3.env())
        .output()
        .expect("run stoker")
}

/// A worker with a token, serving TLS with a certificate for 127.0.0.1; how to dial it.
fn spawn_worker(s3: &EmbeddedS3, token_file: &std::path::Path) -> (LocalWorker, Dial) {
    let mut cfg = WorkerConfig {
        data: "s3://bucket/data".into(),
        ..WorkerConfig::default()
    };
    cfg.s3.path_style = true;
    cfg.sampling.global_batch_size = 6;
    cfg.serving.token_file = Some(token_file.display().to_string());
    let tls_dir = token_file.with_file_name("tls");
    let trust = serve_tls(&tls_dir, &["127.0.0.1"], &mut cfg).unwrap();
    let w = LocalWorker::spawn(STOKER.as_ref(), &cfg, &s3.env()).unwrap();
    (w, Dial::Tls(trust))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dataset_commands_and_worker_lifecycle_over_s3() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("bucket/data");
    let s3 = EmbeddedS3::start(root.path(), "127.0.0.1:0", Duration::ZERO)
        .await
        .unwrap();
    let out = stoker(
        &s3,
        &[
            "synth",
            "--out",
            data.to_str().unwrap(),
            "--samples",
            "12",
            "--max-side",
            "300",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A bad line makes `index` fail loudly, naming it; --allow-bad writes the index anyway.
    let mut shard = std::fs::OpenOptions::new()
        .append(true)
        .open(data.join("shard-00000.jsonl"))
        .unwrap();
    shard.write_all(b"{\"image\": 1}\n").unwrap();
    let out = stoker(
        &s3,
        &["dataset", "index", "s3://bucket/data", "--s3-path-style"],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad line shard-00000.jsonl:13:"), "{err}");
    let out = stoker(
        &s3,
        &[
            "dataset",
            "index",
            "s3://bucket/data",
            "--s3-path-style",
            "--allow-bad",
        ],
    );
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("12 samples, 1 bad lines"), "{text}");
    assert!(data.join("stoker-index.bin").exists());

    let st = root.path().join("s.safetensors");
    let out = stoker(
        &s3,
        &[
            "dataset",
            "inspect",
            "s3://bucket/data",
            "--s3-path-style",
            "--sample",
            "3",
            "--out",
            st.to_str().unwrap(),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let inspected = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(inspected.contains("grid_thw [1, "));
    assert!(std::fs::metadata(&st).unwrap().len() > 1000);

    // No tokenizer given: it comes from $STOKER_CACHE (the scripts' cache, one definition), and
    // an empty cache is refused naming what is missing and the script that installs it.
    let cache = root.path().join("empty-cache");
    let inspect_with_cache = || {
        Command::new(&*STOKER)
            .args(["dataset", "inspect", "s3://bucket/data", "--s3-path-style"])
            .args(["--sample", "0"])
            .envs(s3.env())
            .env("STOKER_CACHE", &cache)
            .env_remove("STOKER_TOKENIZER")
            .output()
            .unwrap()
    };
    let out = inspect_with_cache();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let missing = cache.join("qwen-tokenizer");
    assert!(
        err.contains(&missing.display().to_string()) && err.contains("scripts/setup-tokenizer.sh"),
        "{err}"
    );
    let real = stoker_worker::tokenizer_source::local_path(&Default::default()).unwrap();
    std::fs::create_dir_all(&cache).unwrap();
    std::os::unix::fs::symlink(std::fs::canonicalize(real).unwrap(), &missing).unwrap();
    let out = inspect_with_cache();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // `stats` runs every sample through the same pipeline: sample 3's length is inspect's.
    let lengths_file = root.path().join("lengths.json");
    let out = stoker(
        &s3,
        &[
            "dataset",
            "stats",
            "s3://bucket/data",
            "--s3-path-style",
            "--json",
            "--lengths-out",
            lengths_file.to_str().unwrap(),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(stats["samples"], 12, "{stats}");
    let lengths: Vec<u64> = serde_json::from_slice(&std::fs::read(&lengths_file).unwrap()).unwrap();
    assert_eq!(lengths.len(), 12);
    let tokens_of_3 = inspected
        .lines()
        .find_map(|l| {
            l.strip_prefix("tokens: ")?
                .split(' ')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .unwrap();
    assert_eq!(lengths[3], tokens_of_3, "{inspected}");
    let histogram_total: u64 = stats["histogram"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h[2].as_u64().unwrap())
        .sum();
    assert_eq!(histogram_total, 12, "{stats}");

    let token_file = root.path().join("token");
    std::fs::write(&token_file, "s3cret\n").unwrap();
    let (mut w, dial) = spawn_worker(&s3, &token_file);
    assert_eq!(http::get(&w.metrics_addr, "/healthz").unwrap().status, 200);
    w.wait_ready(Duration::from_secs(30)).unwrap();

    let mut conn = Connection::open_with(&dial, &w.addr, "s3cret")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(conn.welcome.num_samples, 12);
    let req = conn.request(1, 0, 0, 0, 1);
    conn.send(&req).await.unwrap();
    // SIGTERM once the worker has the request in flight: it still completes, then the process
    // exits 0. (A request still unread in the socket gets end-of-stream, and the client
    // retries it elsewhere.)
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !http::get_ok(&w.metrics_addr, "/metrics")
        .unwrap()
        .lines()
        .any(|l| l.starts_with("stoker_worker_requests_in_flight{") && l.ends_with(" 1"))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the request never showed in flight"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    w.terminate().unwrap();
    match conn.recv().await.unwrap() {
        Answer::Batch(head, _) => assert_eq!(head.sample_ids.len(), 6),
        Answer::Error(e) => panic!("in-flight request failed: {e:?}"),
    }
    let status = w.wait().unwrap();
    assert!(status.success(), "worker exit {status}");
}

/// `stoker-lab bench balance --json`: one object per world size (8, 64, 512) with the fields the
/// benchmark documents; the token-aware assignment and packing beat naive slicing and plain
/// batches on the same global batches (pure arithmetic, no timing).
/// A dataset past `--self-index-max-objects` without an index: the worker stays alive and
/// unready, /readyz naming the command to run, and becomes ready once the index is written
/// (no restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_waits_unready_for_the_index_of_a_large_dataset() {
    use std::io::BufRead;
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("bucket/data");
    let s3 = EmbeddedS3::start(root.path(), "127.0.0.1:0", Duration::ZERO)
        .await
        .unwrap();
    let synth = ["--samples", "6", "--min-side", "32", "--max-side", "100"];
    let out = stoker(
        &s3,
        &[&["synth", "--out", data.to_str().unwrap()], &synth[..]].concat(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut cfg = WorkerConfig {
        data: "s3://bucket/data".into(),
        ..WorkerConfig::default()
    };
    cfg.s3.path_style = true;
    cfg.sampling.global_batch_size = 2;
    cfg.concurrency.self_index_max_objects = 3;
    cfg.serving.insecure_plaintext = true;
    cfg.serving.listen = "127.0.0.1:0".into();
    cfg.serving.metrics_listen = "127.0.0.1:0".into();
    let mut child = Command::new(&*STOKER)
        .arg("worker")
        .args(cfg.to_args())
        .envs(s3.env())
        .env("STOKER_TOKEN", "t")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = std::io::BufReader::new(stdout).lines();
    let metrics = loop {
        let line = lines.next().expect("a metrics line").unwrap();
        if let Some(addr) = line.strip_prefix("metrics ") {
            break addr.to_string();
        }
    };
    let readyz = || loop {
        if let Ok(r) = http::get(&metrics, "/readyz") {
            if r.status == 200 || r.body.contains("stoker dataset index") {
                return r;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let waiting = readyz();
    assert_eq!(waiting.status, 503);
    assert!(
        waiting
            .body
            .contains("Run `stoker dataset index s3://bucket/data/` once"),
        "{}",
        waiting.body
    );
    assert_eq!(http::get(&metrics, "/healthz").unwrap().status, 200);
    let out = stoker(
        &s3,
        &["dataset", "index", "s3://bucket/data", "--s3-path-style"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while http::get(&metrics, "/readyz").map_or(true, |r| r.status != 200) {
        assert!(
            std::time::Instant::now() < deadline,
            "not ready after the index"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn bench_balance_prints_one_json_object_per_world_size() {
    let rows = json_lines(
        std::process::Command::new(LAB).args(["bench", "balance", "--json", "--steps", "3"]),
    );
    let worlds: Vec<u64> = rows
        .iter()
        .map(|r| r["world_size"].as_u64().unwrap())
        .collect();
    assert_eq!(worlds, [8, 64, 512]);
    for r in &rows {
        let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} in {r}"));
        assert!(f("balanced_max_over_mean") >= 1.0, "{r}");
        assert!(
            f("balanced_max_over_mean") < f("naive_max_over_mean"),
            "{r}"
        );
        assert!(f("padding_packed") < f("padding_plain"), "{r}");
        assert!(f("padding_bucketed") < f("padding_plain"), "{r}");
        assert!(f("step_time_naive_over_balanced") >= 1.0, "{r}");
    }
}

/// `--balance-ranks`: a worker refuses to start without the dataset's lengths (naming the
/// command that writes them); with them it serves every global batch with the same samples as
/// a plain worker, equal counts per rank, chosen by cost (another plan id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn balanced_ranks_need_the_datasets_lengths_and_keep_every_global_batch() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("bucket/data");
    let s3 = EmbeddedS3::start(root.path(), "127.0.0.1:0", Duration::ZERO)
        .await
        .unwrap();
    let synth = [
        "synth",
        "--out",
        data.to_str().unwrap(),
        "--samples",
        "24",
        "--max-side",
        "500",
    ];
    assert!(stoker(&s3, &synth).status.success());
    let config = |balance: bool| {
        let mut cfg = WorkerConfig {
            data: "s3://bucket/data".into(),
            ..WorkerConfig::default()
        };
        cfg.s3.path_style = true;
        cfg.serving.no_auth = true;
        cfg.serving.insecure_plaintext = true;
        cfg.sampling.global_batch_size = 8;
        cfg.sampling.balance_ranks = balance;
        cfg
    };
    let mut refused = Command::new(&*STOKER)
        .arg("worker")
        .args(config(true).to_args())
        .envs(s3.env())
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let why = String::from_utf8_lossy(&std::mem::take(&mut refused.stderr)).to_string();
    assert!(
        why.contains("stoker dataset stats DATA --write-lengths"),
        "{why}"
    );

    let stored =
        write_sample_lengths(STOKER.as_ref(), "s3://bucket/data", &s3.env(), &data).unwrap();
    let tokens: Vec<u32> = (SampleLengths::from_bytes(stored).unwrap().tokens.iter()).collect();
    assert_eq!(tokens.len(), 24);
    // Measured at index time from text and image headers (EXIF-rotated JPEGs among them):
    // the lengths the whole decoding pipeline gives.
    let decoded = root.path().join("decoded.json");
    let stats = [
        "dataset",
        "stats",
        "s3://bucket/data",
        "--s3-path-style",
        "--decode",
        "--lengths-out",
        decoded.to_str().unwrap(),
    ];
    assert!(stoker(&s3, &stats).status.success());
    let decoded: Vec<u32> = serde_json::from_slice(&std::fs::read(&decoded).unwrap()).unwrap();
    assert_eq!(decoded, tokens);
    // Packs smaller than a sample: refused, naming the longest sample.
    let mut tiny = config(false);
    tiny.sampling.pack_max_tokens = Some(10);
    let refused = Command::new(&*STOKER)
        .arg("worker")
        .args(tiny.to_args())
        .envs(s3.env())
        .output()
        .unwrap();
    let why = String::from_utf8_lossy(&refused.stderr);
    let longest = tokens.iter().max().unwrap();
    assert!(
        !refused.status.success()
            && why.contains(&format!(
                "is {longest} tokens, longer than --pack-max-tokens 10"
            )),
        "{why}"
    );

    let plain = LocalWorker::spawn(STOKER.as_ref(), &config(false), &s3.env()).unwrap();
    let balanced = LocalWorker::spawn(STOKER.as_ref(), &config(true), &s3.env()).unwrap();
    let mut plain_conn = Connection::open(&plain.addr, "").await.unwrap().unwrap();
    let mut balanced_conn = Connection::open(&balanced.addr, "").await.unwrap().unwrap();
    assert_ne!(plain_conn.welcome.plan_id, balanced_conn.welcome.plan_id);
    let heaviest = |ranks: &[Vec<u64>]| {
        ranks
            .iter()
            .map(|r| {
                r.iter()
                    .map(|&i| u64::from(tokens[i as usize]))
                    .sum::<u64>()
            })
            .max()
            .unwrap()
    };
    let (mut plain_steps, mut balanced_steps) = (0, 0);
    for g in 0..3 {
        let mut global = sample_ids(&mut plain_conn, g, 0, 1).await;
        let plain_ranks = [
            sample_ids(&mut plain_conn, g, 0, 2).await,
            sample_ids(&mut plain_conn, g, 1, 2).await,
        ];
        let ranks = [
            sample_ids(&mut balanced_conn, g, 0, 2).await,
            sample_ids(&mut balanced_conn, g, 1, 2).await,
        ];
        assert_eq!((ranks[0].len(), ranks[1].len()), (4, 4));
        let mut union = ranks.concat();
        union.sort_unstable();
        global.sort_unstable();
        assert_eq!(union, global, "batch {g}: the same samples");
        plain_steps += heaviest(&plain_ranks);
        balanced_steps += heaviest(&ranks);
    }
    assert!(
        balanced_steps <= plain_steps,
        "{balanced_steps} vs {plain_steps}"
    );
}

/// The sample ids of (epoch 0, batch `g`, `rank` of `world`) from a worker.
async fn sample_ids(conn: &mut Connection, g: u64, rank: u32, world: u32) -> Vec<u64> {
    let req = conn.request(g * 10 + u64::from(rank), 0, g, rank, world);
    conn.send(&req).await.unwrap();
    match conn.recv().await.unwrap() {
        Answer::Batch(head, _) => head.sample_ids,
        Answer::Error(e) => panic!("batch {g} rank {rank}: {e:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mix_serves_each_dataset_by_weight_and_counts_it() {
    let root = tempfile::tempdir().unwrap();
    let s3 = EmbeddedS3::start(root.path(), "127.0.0.1:0", Duration::ZERO)
        .await
        .unwrap();
    // A large dataset and a small one (drawn twice an epoch: its own epochs run on).
    for (name, samples, format) in [("chat", "24", "messages"), ("vqa", "8", "llava")] {
        let out = root.path().join("bucket/sft").join(name);
        let synth = [
            "synth",
            "--out",
            out.to_str().unwrap(),
            "--samples",
            samples,
            "--format",
            format,
            "--max-side",
            "300",
        ];
        assert!(stoker(&s3, &synth).status.success());
    }
    let mut cfg = WorkerConfig {
        data: "s3://bucket/sft/chat".into(),
        ..WorkerConfig::default()
    };
    cfg.s3.path_style = true;
    cfg.serving.no_auth = true;
    cfg.serving.insecure_plaintext = true;
    cfg.sampling.global_batch_size = 8;
    cfg.sampling.mix = vec!["s3://bucket/sft/vqa=1".parse().unwrap()];
    let worker = LocalWorker::spawn(STOKER.as_ref(), &cfg, &s3.env()).unwrap();
    let mut conn = Connection::open(&worker.addr, "").await.unwrap().unwrap();
    assert_eq!(conn.welcome.num_samples, 32);
    let mut per_epoch = Vec::new();
    for epoch in 0..2 {
        let (mut chat, mut vqa) = (Vec::new(), Vec::new());
        for g in 0..4 {
            let req = conn.request(epoch * 10 + g + 1, epoch, g, 0, 1);
            conn.send(&req).await.unwrap();
            let head = match conn.recv().await.unwrap() {
                Answer::Batch(head, _) => head,
                Answer::Error(e) => panic!("epoch {epoch} batch {g}: {e:?}"),
            };
            // Every sample of both datasets loads: the shared store finds both folders.
            assert!(head.skipped.is_empty(), "{:?}", head.skipped);
            for id in head.sample_ids {
                if id < 24 {
                    chat.push(id)
                } else {
                    vqa.push(id)
                }
            }
        }
        // Equal weights: 16 draws each; the 8-sample dataset comes twice, each time whole.
        assert_eq!((chat.len(), vqa.len()), (16, 16), "epoch {epoch}");
        for own in vqa.chunks(8) {
            let mut own = own.to_vec();
            own.sort_unstable();
            assert_eq!(own, (24..32).collect::<Vec<u64>>());
        }
        per_epoch.push(chat);
    }
    // The large dataset continues where it stopped: its 24 samples over 1.5 epochs, once each.
    let mut first_24: Vec<u64> = per_epoch.concat()[..24].to_vec();
    first_24.sort_unstable();
    assert_eq!(first_24, (0..24).collect::<Vec<u64>>());
    let metrics = http::get_ok(&worker.metrics_addr, "/metrics").unwrap();
    for dataset in ["s3://bucket/sft/chat", "s3://bucket/sft/vqa"] {
        let served = stoker_control::exposition::metric_value_with(
            &metrics,
            "stoker_worker_dataset_samples_served_total",
            &[("dataset", dataset)],
        );
        assert_eq!(served, Some(32.0), "{dataset}");
    }
}
