//! `stoker-lab bench spread`: the NIC-bound placement experiment on one machine.
//!
//! Builds a network of its own from Linux network namespaces: K "nodes" for workers, one for
//! the trainer ranks, one for the object store, each joined by a veth pair to a bridge that
//! lives in a namespace of its own. Every node's link is capped with tbf in both directions;
//! the store and trainer links are not (the ranks stand for many GPU nodes). Only addresses
//! of 10.77.0.0/24 inside these namespaces are used, no namespace has a default route, and
//! everything is deleted on exit, also on failure (a guard's Drop, and stale namespaces of a
//! killed run are removed first).
//!
//! Runs the real binaries (`stoker worker`, the client in `stoker-lab bench trainer`) with the
//! same workers packed on one node vs spread over K nodes, network-bound (a fast step) and
//! not (a slow step), and the head-node hop (every batch relayed by one process on node 0).

use super::local::{demo_preprocessing, ensure_demo_dataset};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use stoker_config::{cache_root, Preprocessing, Serving, WorkerConfig};
use stoker_testkit::embedded_s3::{client_env, EmbeddedS3};
use stoker_testkit::local_worker::LocalWorker;
use stoker_testkit::netns::{self, in_ns, Namespaces};

#[derive(clap::Args)]
pub struct SpreadArgs {
    /// Worker nodes (network namespaces).
    #[arg(long, default_value_t = 4)]
    nodes: usize,
    /// Workers (packed on node 0, or one per node round-robin).
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Trainer ranks (threads with their own client, in the trainer namespace).
    #[arg(long, default_value_t = 4)]
    ranks: u32,
    /// Cap of each node's link, in Mbit/s, each direction (tbf). The default gives each rank
    /// 125 Mbit/s of one link, the ratio of a 25 Gb/s NIC feeding 200 ranks.
    #[arg(long, default_value_t = 500)]
    link_mbit: u64,
    /// Seconds measured per run (after 3 s of warm-up).
    #[arg(long, default_value_t = 12)]
    duration_s: u64,
    /// Trainer step when network-bound: asks for more than one link carries.
    #[arg(long, default_value_t = 20)]
    fast_step_ms: u64,
    /// Trainer step when not network-bound: one link carries the demand easily. (Those runs
    /// last twice --duration-s: with few steps, one burst would weigh too much.)
    #[arg(long, default_value_t = 2500)]
    slow_step_ms: u64,
    /// Samples per rank per step.
    #[arg(long, default_value_t = 2)]
    batch_size: u32,
    /// Samples in the synthetic dataset (shared with `stoker-lab demo`'s cache).
    #[arg(long, default_value_t = 400)]
    samples: usize,
    /// Write the results as JSON here (docs/spread.json keeps the committed run).
    #[arg(long)]
    json_out: Option<PathBuf>,
    #[command(flatten)]
    pre: Preprocessing,
}

const PREFIX: &str = "stk-";
const BRIDGE_NS: &str = "stk-br";
const STORE_NS: &str = "stk-store";
const TRAINER_NS: &str = "stk-trainer";
const STORE_IP: &str = "10.77.0.2";
const TRAINER_IP: &str = "10.77.0.3";

fn node_ns(i: usize) -> String {
    format!("stk-n{i}")
}

fn node_ip(i: usize) -> String {
    format!("10.77.0.{}", 10 + i)
}

/// The namespaces and links (`stoker_testkit::netns`: deleted on drop).
struct Topology {
    _namespaces: Namespaces,
}

impl Topology {
    fn build(nodes: usize, link_mbit: u64) -> anyhow::Result<Topology> {
        let mut namespaces = Namespaces::new(PREFIX);
        let bridge = namespaces.add(&BRIDGE_NS[PREFIX.len()..])?;
        in_ns(&bridge, &["ip", "link", "add", "br0", "type", "bridge"])?;
        in_ns(&bridge, &["ip", "link", "set", "br0", "up"])?;
        let mut ends: Vec<(String, String, Option<u64>)> = vec![
            (STORE_NS.into(), STORE_IP.into(), None),
            (TRAINER_NS.into(), TRAINER_IP.into(), None),
        ];
        ends.extend((0..nodes).map(|i| (node_ns(i), node_ip(i), Some(link_mbit))));
        for (k, (ns, addr, cap)) in ends.iter().enumerate() {
            namespaces.add(&ns[PREFIX.len()..])?;
            let (inside, outside) = (format!("sk{k}"), format!("sk{k}b"));
            let cidr = format!("{addr}/24");
            namespaces.veth(
                (ns.as_str(), inside.as_str(), Some(cidr.as_str())),
                (BRIDGE_NS, outside.as_str(), None),
            )?;
            in_ns(BRIDGE_NS, &["ip", "link", "set", &outside, "master", "br0"])?;
            if let Some(mbit) = cap {
                // Both directions: the node's own egress, and what the bridge sends it.
                let tbf = |ns: &str, dev: &str| {
                    in_ns(
                        ns,
                        &[
                            "tc",
                            "qdisc",
                            "add",
                            "dev",
                            dev,
                            "root",
                            "tbf",
                            "rate",
                            &format!("{mbit}mbit"),
                            "burst",
                            "256kb",
                            "latency",
                            "100ms",
                        ],
                    )
                };
                tbf(ns, &inside)?;
                tbf(BRIDGE_NS, &outside)?;
            }
        }
        Ok(Topology {
            _namespaces: namespaces,
        })
    }

    /// Bytes the node has sent on its link so far (read on the bridge side).
    fn node_tx_bytes(node: usize) -> anyhow::Result<u64> {
        let dev = format!("sk{}b", node + 2);
        let s = in_ns(
            BRIDGE_NS,
            &["cat", &format!("/sys/class/net/{dev}/statistics/rx_bytes")],
        )?;
        Ok(s.trim().parse()?)
    }
}

/// A child process killed on drop.
struct Guarded(Child);

impl Drop for Guarded {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_in(ns: &str, args: &[String]) -> anyhow::Result<Guarded> {
    let exe = std::env::current_exe()?;
    let child = Command::new("ip")
        .args(["netns", "exec", ns])
        .arg(exe)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    Ok(Guarded(child))
}

/// Waits for a `listening ADDR` line.
fn listening(g: &mut Guarded) -> anyhow::Result<String> {
    use std::io::{BufRead, BufReader};
    let out = g.0.stdout.take().expect("piped");
    for line in BufReader::new(out).lines() {
        let line = line?;
        if let Some(a) = line.strip_prefix("listening ") {
            return Ok(a.to_string());
        }
    }
    anyhow::bail!("process exited before listening")
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, serde::Serialize)]
#[serde(rename_all = "lowercase")]
enum Placement {
    Pack,
    Spread,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct RunResult {
    pub placement: String,
    pub scale: String,
    pub path: String,
    pub samples_per_s: f64,
    pub wait_ratio: f64,
    /// MB/s each node sent on its link.
    pub node_mb_per_s: Vec<f64>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct SpreadReport {
    pub nodes: usize,
    pub workers: usize,
    pub ranks: u32,
    pub link_mbit: u64,
    pub runs: Vec<RunResult>,
    /// Batch egress of one busy worker, measured in the spread network-bound run (Gb/s).
    pub worker_egress_gbps: f64,
}

pub async fn run(a: SpreadArgs) -> anyhow::Result<()> {
    tokio::task::spawn_blocking(move || run_blocking(a)).await?
}

fn run_blocking(mut a: SpreadArgs) -> anyhow::Result<()> {
    netns::check_available("stoker-lab bench spread")?;
    demo_preprocessing(&mut a.pre);
    let root = cache_root().join("demo");
    let bucket = ensure_demo_dataset(&root, a.samples, 1024)?;
    let topo = Topology::build(a.nodes, a.link_mbit)?;
    let mut store = spawn_in(
        STORE_NS,
        &[
            "bench".into(),
            "s3-server".into(),
            "--root".into(),
            root.display().to_string(),
            "--listen".into(),
            format!("{STORE_IP}:9000"),
        ],
    )?;
    listening(&mut store)?;
    let env = client_env(&format!("http://{STORE_IP}:9000"));
    let runs = [
        (Placement::Pack, "network-bound", a.fast_step_ms, false),
        (Placement::Spread, "network-bound", a.fast_step_ms, false),
        (Placement::Spread, "network-bound", a.fast_step_ms, true),
        (Placement::Pack, "small", a.slow_step_ms, false),
        (Placement::Spread, "small", a.slow_step_ms, false),
    ];
    let mut results = Vec::new();
    for (placement, scale, step_ms, relay) in runs {
        eprintln!(
            "run: {placement:?} {scale}{}",
            if relay { " via relay" } else { "" }
        );
        let r = one_run(&a, &bucket, &env, placement, step_ms, relay)?;
        results.push(RunResult {
            placement: format!("{placement:?}").to_lowercase(),
            scale: scale.into(),
            path: if relay { "relay on node 0" } else { "direct" }.into(),
            ..r
        });
    }
    drop(store);
    drop(topo);

    let spread = &results[1];
    let busy: Vec<f64> = spread
        .node_mb_per_s
        .iter()
        .copied()
        .filter(|v| *v > 0.1)
        .collect();
    let per_worker_mb = busy.iter().sum::<f64>() / a.workers.max(1) as f64;
    let report = SpreadReport {
        nodes: a.nodes,
        workers: a.workers,
        ranks: a.ranks,
        link_mbit: a.link_mbit,
        worker_egress_gbps: per_worker_mb * 8.0 / 1000.0,
        runs: results,
    };
    print_report(&report);
    if let Some(path) = &a.json_out {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)?;
    }
    Ok(())
}

fn one_run(
    a: &SpreadArgs,
    bucket: &str,
    env: &[(&'static str, String)],
    placement: Placement,
    step_ms: u64,
    relay: bool,
) -> anyhow::Result<RunResult> {
    let exe = std::env::current_exe()?;
    let product = super::local::product_binary()?;
    let mut config = WorkerConfig {
        data: format!("s3://{bucket}"),
        preprocessing: a.pre.clone(),
        serving: Serving {
            no_auth: true,
            insecure_plaintext: true,
            pipeline: "spread".into(),
            ..Serving::default()
        },
        ..WorkerConfig::default()
    };
    config.s3.path_style = true;
    config.sampling.global_batch_size = a.ranks * a.batch_size;
    config.concurrency.cpu_threads = Some(1);
    let mut workers = Vec::new();
    for w in 0..a.workers {
        let node = match placement {
            Placement::Pack => 0,
            Placement::Spread => w % a.nodes,
        };
        workers.push(LocalWorker::spawn_in_netns(
            &node_ns(node),
            &product,
            &node_ip(node),
            &config,
            env,
        )?);
    }
    let addrs: Vec<String> = workers.iter().map(|w| w.addr.clone()).collect();
    let mut relay_proc = None;
    let targets = if relay {
        let mut r = spawn_in(
            &node_ns(0),
            &[
                "bench".into(),
                "relay".into(),
                "--listen-host".into(),
                node_ip(0),
                "--upstream".into(),
                addrs.join(","),
            ],
        )?;
        let addrs = listening(&mut r)?;
        relay_proc = Some(r);
        addrs.split(',').map(String::from).collect()
    } else {
        addrs
    };
    let duration_s = if step_ms == a.slow_step_ms {
        2 * a.duration_s
    } else {
        a.duration_s
    };
    let before: Vec<u64> = (0..a.nodes)
        .map(Topology::node_tx_bytes)
        .collect::<Result<_, _>>()?;
    let t0 = std::time::Instant::now();
    let trainer = Command::new("ip")
        .args(["netns", "exec", TRAINER_NS])
        .arg(&exe)
        .args(["bench", "trainer", "--workers", &targets.join(",")])
        .args(["--ranks", &a.ranks.to_string()])
        .args(["--step-ms", &step_ms.to_string()])
        .args(["--duration-s", &duration_s.to_string()])
        .stderr(Stdio::inherit())
        .output()?;
    let elapsed = t0.elapsed().as_secs_f64();
    anyhow::ensure!(trainer.status.success(), "the trainer failed");
    let after: Vec<u64> = (0..a.nodes)
        .map(Topology::node_tx_bytes)
        .collect::<Result<_, _>>()?;
    drop(relay_proc);
    drop(workers);
    let stats: serde_json::Value = serde_json::from_slice(&trainer.stdout)?;
    Ok(RunResult {
        placement: String::new(),
        scale: String::new(),
        path: String::new(),
        samples_per_s: stats["samples_per_s"].as_f64().unwrap_or(0.0),
        wait_ratio: stats["wait_ratio_worst"].as_f64().unwrap_or(1.0),
        node_mb_per_s: before
            .iter()
            .zip(&after)
            .map(|(b, a)| (a - b) as f64 / elapsed / 1e6)
            .collect(),
    })
}

fn print_report(r: &SpreadReport) {
    println!(
        "\nPlacement on {} nodes capped at {} Mbit/s each way, {} workers, {} ranks",
        r.nodes, r.link_mbit, r.workers, r.ranks
    );
    println!(
        "{:<8} {:<14} {:<16} {:>10} {:>11}  MB/s sent per node link",
        "placement", "scale", "path", "samples/s", "wait ratio"
    );
    for run in &r.runs {
        let links: Vec<String> = run
            .node_mb_per_s
            .iter()
            .map(|v| format!("{v:.1}"))
            .collect();
        println!(
            "{:<8} {:<14} {:<16} {:>10.1} {:>11.3}  {}",
            run.placement,
            run.scale,
            run.path,
            run.samples_per_s,
            run.wait_ratio,
            links.join(" / ")
        );
    }
    let rate = |p: &str, s: &str, path: &str| {
        r.runs
            .iter()
            .find(|x| x.placement == p && x.scale == s && x.path == path)
            .map_or(0.0, |x| x.samples_per_s)
    };
    let bound = rate("spread", "network-bound", "direct") / rate("pack", "network-bound", "direct");
    let small = rate("spread", "small", "direct") / rate("pack", "small", "direct");
    let relay = rate("spread", "network-bound", "relay on node 0")
        / rate("spread", "network-bound", "direct");
    println!("spread / pack, network-bound: {bound:.2}x (target >= 1.5x)");
    println!("spread / pack, small scale:   {small:.3}x (target within 0.95-1.05)");
    println!("relay through one node / direct (spread): {relay:.2}x");
    println!(
        "measured egress per busy worker: {:.3} Gb/s -> workers per {:.1} Gb/s node: {}",
        r.worker_egress_gbps,
        r.link_mbit as f64 / 1000.0,
        ((r.link_mbit as f64 / 1000.0) / r.worker_egress_gbps)
            .floor()
            .max(1.0)
    );
}

/// `stoker-lab bench trainer`: simulated ranks through the real client, for a fixed time; prints
/// one JSON object (samples/s, worst and mean wait ratio, and the loaders' retries and lost
/// links); with `--record`, each batch first, as it is taken.
#[derive(clap::Args)]
pub struct TrainerArgs {
    /// Workers (HOST:PORT,...).
    #[arg(long)]
    workers: String,
    #[arg(long, default_value_t = 4)]
    ranks: u32,
    #[arg(long, default_value_t = 20)]
    step_ms: u64,
    #[arg(long, default_value_t = 12)]
    duration_s: u64,
    /// Seconds before measuring.
    #[arg(long, default_value_t = 3)]
    warmup_s: u64,
    /// Print one JSON object per batch taken (rank, epoch, batch, sample ids, seconds since
    /// the start, seconds the rank waited for it), so a test can check every delivery.
    #[arg(long)]
    record: bool,
}

pub fn trainer(a: TrainerArgs) -> anyhow::Result<()> {
    use stoker_client::{Dial, Discovery, Loader, LoaderConfig};
    let t0 = std::time::Instant::now();
    let ranks: Vec<_> = (0..a.ranks)
        .map(|rank| {
            let mut cfg = LoaderConfig::new(Discovery::parse(&a.workers)?, rank, a.ranks);
            cfg.dial = Some(Dial::InsecurePlaintext); // the bench's plaintext workers
            cfg.no_worker_timeout = Duration::from_secs(20);
            let mut loader = Loader::new(cfg)?;
            let (step, warm, dur, record) = (
                Duration::from_millis(a.step_ms),
                Duration::from_secs(a.warmup_s),
                Duration::from_secs(a.duration_s),
                a.record,
            );
            Ok(std::thread::spawn(
                move || -> anyhow::Result<(f64, f64, u64, Loader)> {
                    let mut take = || -> anyhow::Result<(f64, u64)> {
                        let t = std::time::Instant::now();
                        let b = loader.next_batch()?;
                        let waited = t.elapsed().as_secs_f64();
                        let Some(b) = b else {
                            return Ok((waited, 0));
                        };
                        if record {
                            let line = serde_json::json!({
                                "rank": rank,
                                "epoch": b.epoch,
                                "batch": b.global_batch,
                                "samples": b.sample_ids,
                                "t": t0.elapsed().as_secs_f64(),
                                "waited": waited,
                            });
                            println!("{line}");
                        }
                        std::thread::sleep(step);
                        Ok((waited, b.sample_ids.len() as u64))
                    };
                    let begin = std::time::Instant::now();
                    while begin.elapsed() < warm {
                        take()?;
                    }
                    let (start, mut wait, mut samples) = (std::time::Instant::now(), 0.0, 0u64);
                    while start.elapsed() < dur {
                        let (w, n) = take()?;
                        wait += w;
                        samples += n;
                    }
                    Ok((wait, start.elapsed().as_secs_f64(), samples, loader))
                },
            ))
        })
        .collect::<anyhow::Result<_>>()?;
    let mut worst: f64 = 0.0;
    let (mut mean, mut samples, mut wall) = (0.0, 0u64, 0.0f64);
    let (mut retries, mut lost) = (std::collections::BTreeMap::new(), 0u64);
    for r in ranks {
        let (w, t, s, loader) = r.join().expect("rank thread")?;
        worst = worst.max(w / t);
        mean += w / t / a.ranks as f64;
        samples += s;
        wall = wall.max(t);
        let m = loader.metrics();
        for reason in ["worker_lost", "deadline", "silent"] {
            *retries.entry(reason).or_insert(0) += m.retries.with_label_values(&[reason]).get();
        }
        lost += m.errors.with_label_values(&["lost"]).get();
    }
    println!(
        "{}",
        serde_json::json!({
            "samples_per_s": samples as f64 / wall,
            "wait_ratio_worst": worst,
            "wait_ratio_mean": mean,
            "retries": retries,
            "links_lost": lost,
        })
    );
    Ok(())
}

/// `stoker-lab bench relay`: the head-node hop — every byte between clients and workers passes
/// through this process. One listening port per upstream worker, so a client spreads its
/// requests over the workers exactly as it would directly.
#[derive(clap::Args)]
pub struct RelayArgs {
    /// Host to listen on (one port per upstream worker).
    #[arg(long)]
    listen_host: String,
    /// Workers (HOST:PORT,...).
    #[arg(long)]
    upstream: String,
}

pub async fn relay(a: RelayArgs) -> anyhow::Result<()> {
    let mut addrs = Vec::new();
    for target in a.upstream.split(',').map(String::from) {
        let listener = tokio::net::TcpListener::bind(format!("{}:0", a.listen_host)).await?;
        addrs.push(listener.local_addr()?.to_string());
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let target = target.clone();
                tokio::spawn(async move {
                    if let Ok(mut worker) = tokio::net::TcpStream::connect(&target).await {
                        let _ = client.set_nodelay(true);
                        let _ = worker.set_nodelay(true);
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut worker).await;
                    }
                });
            }
        });
    }
    println!("listening {}", addrs.join(","));
    std::future::pending::<()>().await;
    Ok(())
}

/// `stoker-lab bench s3-server`: the embedded S3 server on its own (the spread experiment's store).
#[derive(clap::Args)]
pub struct S3ServerArgs {
    /// Folder whose subfolders are buckets.
    #[arg(long)]
    root: PathBuf,
    #[arg(long, default_value = "127.0.0.1:9000")]
    listen: String,
    #[arg(long, default_value_t = 0)]
    first_byte_latency_ms: u64,
}

pub async fn s3_server(a: S3ServerArgs) -> anyhow::Result<()> {
    let s3 = EmbeddedS3::start(
        Path::new(&a.root),
        &a.listen,
        Duration::from_millis(a.first_byte_latency_ms),
    )
    .await?;
    println!("listening {}", s3.endpoint.trim_start_matches("http://"));
    std::future::pending::<()>().await;
    Ok(())
}
