//! A real `stoker worker` process with small budgets, driven with its worst inputs at once —
//! samples whose images and frames come to 32–40 MiB (one 32 MiB PNG named 40 times, 40
//! distinct frames), four ranks that ask for hundreds of batches and read none, and one that
//! reads — keeps its peak RSS (VmHWM) within docs/reliability.md's formula: what it holds
//! after start, plus `--max-worker-bytes`, plus `--max-inflight-samples` samples of the most
//! one sample may hold, plus a margin for the allocator.

use std::time::Duration;
use stoker_config::WorkerConfig;
use stoker_control::exposition::metric_value_with;
use stoker_testkit::http;
use stoker_testkit::local_worker::LocalWorker;
use stoker_testkit::synth::noise_png;
use stoker_wire::BatchRequest;
use stoker_worker::connection::{Answer, Connection};
use stoker_worker::limits::SampleLimits;

mod common;
use common::STOKER;

const BUDGET: u64 = 16 << 20;
const INFLIGHT: usize = 2;
const SAMPLE_BYTES: u64 = 8 << 20;
const MAX_PIXELS: u64 = 256 * 256;
const LINES: usize = 32;
const GLOBAL_BATCH: u32 = 4;
/// What the allocator may hold past what the worker counts: glibc's per-thread arenas keep
/// freed buffers for reuse (crate::alloc never trims them).
const ALLOCATOR_MARGIN: u64 = 64 << 20;

/// Every fourth line is hostile (in turn: big.png named by a frame list of 40, 40 distinct
/// frames, big.png as 4 images); the others ask about two 700² photos.
fn dataset(dir: &std::path::Path) {
    let big = noise_png(3360, 1);
    assert!(big.len() as u64 >= 32 << 20, "{} bytes", big.len());
    std::fs::write(dir.join("big.png"), big).unwrap();
    for k in 0..40 {
        std::fs::write(dir.join(format!("f{k}.png")), noise_png(600, 100 + k)).unwrap();
    }
    for k in 0..8 {
        std::fs::write(dir.join(format!("n{k}.png")), noise_png(700, 200 + k)).unwrap();
    }
    let ask = |media: Vec<serde_json::Value>| {
        let mut content = media;
        content.push(serde_json::json!({"type": "text", "text": "What is this?"}));
        serde_json::json!({"messages": [
            {"role": "user", "content": content},
            {"role": "assistant", "content": "Noise."},
        ]})
        .to_string()
    };
    let image = |p: String| serde_json::json!({"type": "image", "image": p});
    let frames = |ps: Vec<String>| serde_json::json!({"type": "video", "video": ps});
    let lines: Vec<String> = (0..LINES)
        .map(|i| match (i % 4, i / 4 % 3) {
            (0, 0) => ask(vec![frames(vec!["big.png".into(); 40])]),
            (0, 1) => ask(vec![frames((0..40).map(|k| format!("f{k}.png")).collect())]),
            (0, _) => ask(vec![image("big.png".into()); 4]),
            _ => ask(vec![
                image(format!("n{}.png", i % 8)),
                image(format!("n{}.png", (i + 3) % 8)),
            ]),
        })
        .collect();
    std::fs::write(dir.join("s.jsonl"), lines.join("\n") + "\n").unwrap();
}

/// A figure of /proc/PID/status, in bytes.
fn status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("no {field} in {status}"));
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb << 10
}

fn request(id: u64, plan_id: u64, batches: u64, n: u64) -> BatchRequest {
    BatchRequest {
        request_id: id,
        plan_id,
        epoch: n / batches,
        global_batch: n % batches,
        rank: 0,
        world_size: 1,
    }
}

#[test]
fn a_worker_under_its_worst_inputs_stays_within_its_memory_formula() {
    let root = tempfile::tempdir().unwrap();
    dataset(root.path());
    let mut cfg = WorkerConfig {
        data: root.path().display().to_string(),
        ..WorkerConfig::default()
    };
    cfg.sampling.global_batch_size = GLOBAL_BATCH;
    cfg.concurrency.cpu_threads = Some(2);
    cfg.serving.no_auth = true;
    cfg.serving.insecure_plaintext = true;
    cfg.serving.max_inflight_samples = Some(INFLIGHT);
    cfg.serving.limits.max_worker_bytes = BUDGET;
    cfg.serving.limits.send_timeout_s = 3600;
    let p = &mut cfg.preprocessing;
    p.max_pixels = Some(MAX_PIXELS);
    p.max_image_pixels = 1 << 20;
    p.max_sample_pixels = 2 << 20;
    p.max_images_per_sample = 4;
    p.max_sample_bytes = SAMPLE_BYTES;
    p.max_line_bytes = 64 << 10;
    let per_sample = SampleLimits::from_config(&cfg.preprocessing).peak_sample_bytes(MAX_PIXELS, 4);

    let w = LocalWorker::spawn(STOKER.as_ref(), &cfg, &[]).unwrap();
    let pid = w.pid();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let open = || async { Connection::open(&w.addr, "").await.unwrap().unwrap() };
    let mut honest = rt.block_on(open());
    let (plan_id, batches) = (honest.welcome.plan_id, honest.welcome.batches_per_epoch);
    let get = |c: &mut Connection, r: BatchRequest| {
        rt.block_on(async {
            c.send(&r).await.unwrap();
            tokio::time::timeout(Duration::from_secs(120), c.recv())
                .await
                .expect("answered")
                .unwrap()
        })
    };
    // Every hostile sample is skipped by name.
    let mut skipped = 0;
    let mut read = |c: &mut Connection, n| match get(c, request(n, plan_id, batches, n)) {
        Answer::Batch(h, _) => {
            for s in &h.skipped {
                assert!(s.reason.contains("max-sample-bytes"), "{s:?}");
            }
            skipped += h.skipped.len() as u64;
        }
        Answer::Error(e) => panic!("{e:?}"),
    };
    // What it holds after start: the tokenizer, the index, the runtime.
    let base = status_bytes(pid, "VmRSS:");
    read(&mut honest, 0);

    // Four ranks ask for 300 batches each (more than a connection reads ahead) and read none.
    let _slow: Vec<Connection> = (0..4)
        .map(|_| {
            let mut c = rt.block_on(open());
            rt.block_on(async {
                for n in 0..300 {
                    c.send(&request(n, plan_id, batches, n)).await.unwrap();
                }
            });
            c
        })
        .collect();
    // The honest rank reads four epochs meanwhile.
    for n in 1..4 * batches {
        read(&mut honest, n);
    }
    assert_eq!(
        skipped,
        4 * LINES as u64 / 4,
        "each hostile line, each epoch"
    );
    let waiting = || {
        let m = http::get_ok(&w.metrics_addr, "/metrics").unwrap();
        let q = metric_value_with(&m, "stoker_worker_queue_depth", &[("queue", "requests")]);
        q.unwrap_or(0.0)
    };
    let t = std::time::Instant::now();
    while waiting() < 4.0 {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "the slow ranks never filled their shares"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    let peak = status_bytes(pid, "VmHWM:");
    let formula = base + BUDGET + INFLIGHT as u64 * per_sample;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!(
        "peak RSS {:.1} MiB; formula {:.1} MiB = after start {:.1} + budget {:.1} + {INFLIGHT} x \
         {:.1} a sample; margin {:.1} MiB",
        mib(peak),
        mib(formula),
        mib(base),
        mib(BUDGET),
        mib(per_sample),
        mib(ALLOCATOR_MARGIN)
    );
    assert!(
        peak <= formula + ALLOCATOR_MARGIN,
        "peak RSS {peak} bytes is over the formula's {formula} and the allocator's margin"
    );
}
