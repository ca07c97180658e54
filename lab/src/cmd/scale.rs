//! `stoker-lab bench scale`: the trainer client's real scheduler at full job size, in virtual time.
//!
//! Every rank is a real [`Scheduler`] (the state machine the loader runs), fed events at
//! virtual instants; its actions (connect, send, cancel, close) go to simulated workers and
//! come back as the events a socket would produce. What is simulated is only what is outside
//! our client: a worker is its connection limit, its per-connection in-flight limit, its
//! sample budget (the limits of `stoker worker`, with the same defaults) and a few cores
//! whose per-sample service time is drawn from a distribution; a sample's reads go to an
//! object store first (their latency drawn from a measured one, a request rate past which it
//! throttles, the worker's retries); a node is a NIC that carries one batch at a time; the
//! trainer is a synchronous step with a barrier across ranks.
//! Batches carry the real plan's sample ids ([`Plan::rank_slice`]), and every delivery is
//! checked: each rank gets every position once, in order, with the plan's samples.
//!
//! Faults are modelled as the sockets and Kubernetes would show them: a crash resets every
//! connection; a silent worker (a partition, a lost node) answers nothing and closes nothing,
//! so a rank's link fails only by keepalive or by its unacknowledged-bytes timeout; a node's
//! pods leave the endpoints once it is NotReady; a rolling update replaces 10 % at a time, each
//! replacement listed after its start-up; workers close connections idle past their timeout.
//!
//! Deterministic from `--seed`: one thread, one event queue ordered by (time, sequence).
//! `sim.rs` runs the events and the ranks, `fleet.rs` the workers, `store.rs` the object
//! store, `scenario.rs` the events of each scenario.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stoker_client::scheduler::{Action, Event, LinkId, Policy, Scheduler, Shared};
use stoker_client::{
    AlignedBuf, ClientMetrics, Depth, Discovery, LoaderConfig, WorkerSet, CONNECT_TIMEOUT,
};
use stoker_config::{
    DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_INFLIGHT_PER_CONN,
};
use stoker_tls::{KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_PROBES};
use stoker_wire::{BatchHead, BatchRequest, ErrorCode, ErrorFrame, Welcome};
use stoker_worker::plan::Plan;

mod fleet;
mod scenario;
mod sim;
pub mod store;
use store::StoreProfile;

#[derive(clap::Args, Clone)]
pub struct ScaleArgs {
    /// Job sizes as RANKSxWORKERS, comma-separated.
    #[arg(long, default_value = "4096x1024,4096x256")]
    sizes: String,
    /// Scenarios, each at the middle step: steady (nothing), restart (a worker killed, back
    /// 10 s later), drain (one drained), scale-up (+25 % workers), slow (a worker 20x slower
    /// from then on), blackhole (a worker stops answering without closing and stays listed: a
    /// partition), blackhole-node (the same for a node's workers), node-loss (a node's workers
    /// silent, unlisted once the node is NotReady), rollout (every worker replaced, 10 % at a
    /// time, each replacement listed after its start-up), trainer-pause (one step's compute
    /// lasts `--pause-s`, past the workers' idle timeout), brownout (every worker, its reads
    /// and its cores, 5x slower for 20 steps).
    #[arg(
        long,
        default_value = "steady,restart,drain,scale-up,slow,blackhole,blackhole-node,node-loss,rollout,trainer-pause,brownout"
    )]
    scenarios: String,
    /// Policies: subset (ours), full-mesh (the rules before it, for the ratio).
    #[arg(long, default_value = "subset,full-mesh")]
    policies: String,
    /// Trainer steps per scenario.
    #[arg(long, default_value_t = 50)]
    steps: u64,
    /// The trainer's compute per step, in seconds (the ideal step time).
    #[arg(long, default_value_t = 4.0)]
    step_s: f64,
    /// Samples per rank per step (global batch = ranks × this).
    #[arg(long, default_value_t = 4)]
    samples_per_rank: u32,
    /// Workers' connection limit (`--max-connections`).
    #[arg(long, default_value_t = DEFAULT_MAX_CONNECTIONS as u32)]
    max_connections: u32,
    /// Ranks start uniformly within this many seconds.
    #[arg(long, default_value_t = 20.0)]
    start_skew_s: f64,
    /// The fleet's load at full speed: each worker's cores are sized so the job uses this
    /// share of them.
    #[arg(long, default_value_t = 0.5)]
    utilization: f64,
    /// Per-sample service times measured from the pipeline (`stoker-lab bench preprocess
    /// --write-service-profile`): a sample's time is drawn from them, scaled so their mean
    /// is the one `--utilization` sets [default: the profile measured on this project's
    /// benchmark dataset, embedded].
    #[arg(long)]
    service_profile: Option<std::path::PathBuf>,
    /// Read times measured through the worker's store (`stoker-lab bench store
    /// --write-store-profile`): each read of a sample takes one drawn from them [default: the
    /// profile measured on the embedded S3 server, embedded].
    #[arg(long)]
    store_profile: Option<std::path::PathBuf>,
    /// Store reads per sample, on average: its image and, with `--order runs`, a share of its
    /// text's (1.07 measured by `bench dataset-scale --read`; 2.05 with each line read alone).
    #[arg(long, default_value_t = 1.07)]
    gets_per_sample: f64,
    /// Requests per second the store serves to the whole fleet before it answers 503
    /// SlowDown: 5,500 is what S3 serves one prefix; a dataset spread over N prefixes gets N
    /// times that [default: 0, unlimited].
    #[arg(long, default_value_t = 0.0)]
    store_gets_per_s: f64,
    /// Bytes of one prepared sample on the wire (u8 pixels of a ~1 MP image and its tokens).
    #[arg(long, default_value_t = 5_000_000)]
    sample_bytes: u64,
    /// A node's NIC, in Gbit/s, shared by `workers_per_node` workers.
    #[arg(long, default_value_t = 25.0)]
    nic_gbit: f64,
    #[arg(long, default_value_t = 8)]
    workers_per_node: usize,
    /// `rollout`: a replacement's start-up until it is listed (pod start, index GET, shard
    /// HEADs, lengths, order build, readiness probe), drawn within ±25 % of this.
    #[arg(long, default_value_t = 30.0)]
    startup_s: f64,
    /// `trainer-pause`: the pause (an evaluation, a checkpoint).
    #[arg(long, default_value_t = 900.0)]
    pause_s: f64,
    /// The workers' `--idle-timeout-s`: a connection asked nothing this long is closed.
    #[arg(long, default_value_t = DEFAULT_IDLE_TIMEOUT_S as f64)]
    idle_timeout_s: f64,
    /// How long a link's socket holds bytes unacknowledged before it fails (the links'
    /// TCP_USER_TIMEOUT). 924 is Linux's retransmission limit without it (tcp_retries2 =
    /// 15): the links before it was set.
    #[arg(long, default_value_t = stoker_tls::USER_TIMEOUT.as_secs_f64())]
    unacked_timeout_s: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// One JSON object per scenario instead of the table.
    #[arg(long)]
    json: bool,
}

const CORES_PER_WORKER: usize = 4;
const ONE_WAY: Duration = Duration::from_micros(100);
const RESTART_DOWN: Duration = Duration::from_secs(10);
/// A drained worker leaves discovery after this, and exits after its drain timeout.
const DRAIN_UNLIST: Duration = Duration::from_secs(2);
const DRAIN_EXIT: Duration = Duration::from_secs(30);
/// `slow`: one worker's samples take this many times longer from the middle step on.
const SLOW_WORKER: f64 = 20.0;
/// Ranks re-resolve the workers' DNS name this often (the loader's default).
const DISCOVERY_EVERY: Duration = Duration::from_secs(5);
/// `node-loss`: the node is NotReady, and its pods leave the Service's endpoints, after
/// kube-controller-manager's `--node-monitor-grace-period` (50 s) and one monitor period (5 s).
const NODE_NOT_READY: Duration = Duration::from_secs(55);
/// A rolling update replaces this share of the workers at once (the operator's
/// `maxUnavailable`, no surge).
const ROLLOUT_SHARE: f64 = 0.1;
/// How often workers look for idle connections.
const IDLE_SWEEP: Duration = Duration::from_secs(5);
/// `brownout`: every worker's reads and cores this many times slower, for this many steps.
const BROWNOUT_SLOWDOWN: f64 = 5.0;
const BROWNOUT_STEPS: u64 = 20;

#[derive(serde::Serialize)]
struct Report {
    ranks: u32,
    workers: usize,
    policy: &'static str,
    scenario: String,
    ranks_without_worker: usize,
    max_connections_per_worker: usize,
    connection_limit: u32,
    steps_completed: u64,
    start_stall_s: f64,
    efficiency_by_step: Vec<f64>,
    max_over_mean_worker_load: f64,
    max_over_mean_load_by_step: Vec<f64>,
    requests_past_deadline: u64,
    hedges_per_step: f64,
    /// Duplicates (hedges, probes' duplicates, silent links' positions) per request answered
    /// with a batch: the hedge budget is 0.05 an answer, plus a burst of 4 per rank.
    duplicates_per_answer: f64,
    /// Requests answered with a batch (a hedge's loser included).
    answers: u64,
    /// Store requests per sample prepared (retries of throttled reads included).
    store_gets_per_sample: f64,
    /// Store requests answered 503 SlowDown, per step.
    throttled_per_step: f64,
    /// Reads that failed after every retry (each failed its request: a transient error).
    failed_reads: u64,
    /// Positions asked again because their link went silent (`retries_total{reason="silent"}`).
    silent_retries_per_step: f64,
    restart_efficiency: Option<f64>,
    steps_below_0_9_after_event: Option<usize>,
    refused_connects_per_worker_s: f64,
    links_closed_idle: u64,
    exact_delivery: bool,
    wall_s: f64,
}

/// Per-sample service times measured from the pipeline: their spread and tail are what the
/// simulator keeps, their scale is the fleet's sizing.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct ServiceProfile {
    /// How and on what it was measured.
    pub what: String,
    pub per_sample_s: Vec<f64>,
}

/// Measured here with `stoker-lab bench preprocess --ceiling-only --write-service-profile`.
const EMBEDDED_PROFILE: &str = include_str!("service_profile.json");

impl ServiceProfile {
    /// The times divided by their mean (a distribution of mean 1).
    fn shape(&self) -> anyhow::Result<Vec<f64>> {
        let times = measured_times(&self.per_sample_s)?;
        let mean = times.iter().sum::<f64>() / times.len() as f64;
        anyhow::ensure!(mean > 0.0, "expected a positive mean");
        Ok(times.iter().map(|t| t / mean).collect())
    }
}

/// A profile's times, if they are a distribution: at least one, each finite and
/// non-negative.
fn measured_times(times: &[f64]) -> anyhow::Result<&[f64]> {
    anyhow::ensure!(
        !times.is_empty() && times.iter().all(|t| t.is_finite() && *t >= 0.0),
        "expected at least one non-negative time"
    );
    Ok(times)
}

pub fn run(a: ScaleArgs) -> anyhow::Result<()> {
    let (text, source) = match &a.service_profile {
        Some(path) => (
            std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("service profile {}: {e}", path.display()))?,
            path.display().to_string(),
        ),
        None => (EMBEDDED_PROFILE.to_string(), "(embedded)".to_string()),
    };
    let shape = serde_json::from_str::<ServiceProfile>(&text)
        .map_err(anyhow::Error::from)
        .and_then(|p| p.shape())
        .map_err(|e| anyhow::anyhow!("service profile {source}: {e}"))?;
    let store_profile = match &a.store_profile {
        Some(path) => std::fs::read_to_string(path)
            .map_err(anyhow::Error::from)
            .and_then(|t| Ok(serde_json::from_str::<StoreProfile>(&t)?))
            .map_err(|e| anyhow::anyhow!("store profile {}: {e}", path.display()))?,
        None => StoreProfile::embedded(),
    };
    let reads = store_profile
        .times()
        .map_err(|e| anyhow::anyhow!("store profile: {e}"))?
        .to_vec();
    anyhow::ensure!(
        a.gets_per_sample.is_finite() && a.gets_per_sample >= 0.0,
        "--gets-per-sample {}: expected a non-negative number",
        a.gets_per_sample
    );
    let mut reports = Vec::new();
    for size in a.sizes.split(',') {
        let (r, w) = size
            .split_once('x')
            .ok_or_else(|| anyhow::anyhow!("size {size:?}: expected RANKSxWORKERS"))?;
        let (ranks, workers): (u32, usize) = (r.trim().parse()?, w.trim().parse()?);
        // A policy whose job fails before the middle step never meets the scenario's event.
        let mut failed: Vec<Policy> = Vec::new();
        for scenario in a.scenarios.split(',') {
            let scenario = Scenario::parse(scenario.trim())?;
            for policy in a.policies.split(',') {
                let policy = match policy.trim() {
                    "subset" => Policy::Subset,
                    "full-mesh" => Policy::FullMesh,
                    p => anyhow::bail!("policy {p:?}: expected subset or full-mesh"),
                };
                if failed.contains(&policy) {
                    continue;
                }
                let report = Sim::new(&a, &shape, &reads, ranks, workers, policy, scenario).run();
                if report.steps_completed <= a.steps / 2 {
                    failed.push(policy);
                }
                if a.json {
                    println!("{}", serde_json::to_string(&report)?);
                }
                reports.push(report);
            }
        }
    }
    if !a.json {
        print_table(&reports);
    }
    let inexact: Vec<String> = reports
        .iter()
        .filter(|r| !r.exact_delivery)
        .map(|r| format!("{}x{} {} {}", r.ranks, r.workers, r.policy, r.scenario))
        .collect();
    anyhow::ensure!(inexact.is_empty(), "delivery was not exact in: {inexact:?}");
    Ok(())
}

fn print_table(reports: &[Report]) {
    println!(
        "{:>11} {:>9} {:>9} {:>8} {:>11} {:>8} {:>8} {:>8} {:>9} {:>8} {:>8} {:>9} {:>9} {:>7} {:>9} {:>8}",
        "size",
        "policy",
        "scenario",
        "no-wkr",
        "conns/lim",
        "steps",
        "stall s",
        "eff≥1",
        "load max/μ",
        "late",
        "hedge/st",
        "dup/ans",
        "event eff",
        "<0.9",
        "GET/smpl",
        "503/st"
    );
    for r in reports {
        let eff = r
            .efficiency_by_step
            .iter()
            .skip(1)
            .copied()
            .fold(f64::INFINITY, f64::min);
        let eff = if eff.is_finite() { eff } else { 0.0 };
        let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
        println!(
            "{:>11} {:>9} {:>9} {:>8} {:>11} {:>8} {:>8.1} {:>8.3} {:>10.3} {:>8} {:>8.2} {:>9.4} {:>9} {:>7} {:>9.3} {:>8.1}",
            format!("{}x{}", r.ranks, r.workers),
            r.policy,
            r.scenario,
            r.ranks_without_worker,
            format!("{}/{}", r.max_connections_per_worker, r.connection_limit),
            r.steps_completed,
            r.start_stall_s,
            eff,
            r.max_over_mean_worker_load,
            r.requests_past_deadline,
            r.hedges_per_step,
            r.duplicates_per_answer,
            opt(r.restart_efficiency),
            r.steps_below_0_9_after_event.map_or("-".into(), |n| n.to_string()),
            r.store_gets_per_sample,
            r.throttled_per_step,
        );
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Steady,
    Restart,
    Drain,
    ScaleUp,
    Slow,
    Blackhole,
    BlackholeNode,
    NodeLoss,
    Rollout,
    TrainerPause,
    Brownout,
}

/// Virtual nanoseconds since the start.
type T = u64;

fn ns(d: Duration) -> T {
    d.as_nanos() as T
}

enum Ev {
    RankStart(u32),
    RankTimer(u32),
    Discover(u32),
    /// A rank's connect reaches a worker.
    Connect {
        rank: u32,
        link: LinkId,
        worker: usize,
    },
    /// Something a worker says reaches a rank.
    ToRank {
        rank: u32,
        event: Event,
    },
    Request {
        conn: (u32, LinkId),
        req: BatchRequest,
    },
    Cancel {
        conn: (u32, LinkId),
        request_id: u64,
    },
    Close {
        conn: (u32, LinkId),
    },
    /// A core finished one sample of a request (if the worker's incarnation still matches).
    SampleDone {
        worker: usize,
        incarnation: u32,
        job: u64,
    },
    /// The batch left the node's NIC: the budget is released, the rank gets it.
    Sent {
        worker: usize,
        incarnation: u32,
        job: Job,
    },
    /// Step k's compute ends; every rank may hold batch k by now.
    Barrier(u64),
    WorkerBack(usize),
    Drain(usize),
    DrainExit(usize),
    ScaleUp,
    /// A rank's socket to a silent worker fails: after keepalive's probes if it holds
    /// nothing unacknowledged, else after the unacknowledged-bytes timeout.
    LinkTimeout {
        conn: (u32, LinkId),
        unacked: bool,
    },
    /// Workers close connections idle past their idle timeout.
    IdleSweep,
    /// A node's pods leave the endpoints (`node-loss`).
    NodeNotReady(usize),
    /// A rollout's replacement passes its readiness probe and is listed.
    Ready(usize),
    /// A read of a sample of request `job` reaches the store: after `made` attempts
    /// throttled since `since`; `reads_left` of the sample's reads remain, this one
    /// included.
    Get {
        worker: usize,
        incarnation: u32,
        job: u64,
        reads_left: u32,
        made: u32,
        since: T,
    },
    /// A sample's reads are done (`ok`), or one failed after every retry.
    Fetched {
        worker: usize,
        incarnation: u32,
        job: u64,
        ok: bool,
    },
}

#[derive(Clone, Copy)]
struct Job {
    conn: (u32, LinkId),
    req: BatchRequest,
    samples: u32,
}

/// A request holding its sample budget: its samples are read side by side, then run on the
/// worker's cores side by side (the worker loads a request's samples concurrently, each on
/// its CPU pool).
struct Running {
    job: Job,
    /// Samples whose reads are under way.
    fetching: u32,
    /// Samples read, waiting for a core.
    unstarted: u32,
    unfinished: u32,
    /// Cancelled: samples not started are dropped, those running are wasted.
    cancelled: bool,
    /// A read failed after every retry: the request fails (a transient error).
    failed: bool,
}

struct Conn {
    worker: usize,
    incarnation: u32,
    preparing: usize,
    waiting: VecDeque<BatchRequest>,
    /// When the worker last read a frame or sent an answer on it (its idle timeout).
    moved: T,
    /// The rank sent something to a silent worker: its socket waits for an acknowledgement.
    unacked: bool,
}

struct Worker {
    addr: String,
    node: usize,
    up: bool,
    draining: bool,
    /// Running, but nothing it sends or receives arrives (a partition, a black hole).
    silent: bool,
    incarnation: u32,
    connections: usize,
    free_cores: usize,
    /// Service times are this many times the profile's (a sick node: `slow`).
    slowdown: f64,
    /// Requests holding their budget, by id; `ready` holds one entry per sample read and
    /// not started, in the order cores take them.
    running: HashMap<u64, Running>,
    ready: VecDeque<u64>,
    next_job: u64,
    free_budget: u32,
    /// Requests waiting for sample budget (FIFO, as the worker's semaphore).
    budget_queue: VecDeque<Job>,
}

struct Rank {
    core: Scheduler,
    shared: Arc<Shared>,
    timer: Option<T>,
    started: bool,
    /// Deliveries taken from the scheduler (the trainer's channel), in order.
    channel: VecDeque<stoker_client::Batch>,
    /// The next position the trainer takes.
    taken: u64,
    /// Its workers as its last DNS answer listed them.
    view: WorkerSet,
    no_worker: bool,
    exact: bool,
    /// The step whose batch this rank was last counted as holding.
    counted: Option<u64>,
}

struct Sim {
    a: ScaleArgs,
    policy: Policy,
    scenario: Scenario,
    /// Trainer steps in this run: `--steps`, or more for a scenario that lasts longer.
    steps: u64,
    base: Instant,
    now: T,
    seq: u64,
    queue: BinaryHeap<Reverse<(T, u64, usize)>>,
    slots: Vec<Option<Ev>>,
    free_slots: Vec<usize>,
    rng: ChaCha8Rng,
    plan: Plan,
    welcome: Welcome,
    metrics: Arc<ClientMetrics>,
    ranks: Vec<Rank>,
    workers: Vec<Worker>,
    /// The workers discovery lists now.
    listed: WorkerSet,
    by_addr: HashMap<String, usize>,
    /// Ordered, so what happens to every connection of a worker happens in one order on
    /// every run.
    conns: BTreeMap<(u32, LinkId), Conn>,
    nic_free: Vec<T>,
    /// The service-time profile, scaled to this fleet's mean (ns per sample).
    sample_ns: Vec<f64>,
    /// The store's read times (ns per read), as measured.
    read_ns: Vec<f64>,
    store: store::RateLimit,
    store_gets: u64,
    throttled: u64,
    failed_reads: u64,
    /// Requests answered with a batch.
    answers: u64,
    samples_prepared: u64,
    max_samples_budget: u32,
    // The trainer's barrier.
    step_started: Vec<T>,
    /// Each started step's compute, in seconds (its ideal duration).
    compute_s: Vec<f64>,
    /// Workers listed when each step began (the mean of its load is over them).
    listed_at_step: Vec<usize>,
    ready_count: Vec<u32>,
    compute_done: T,
    failed: bool,
    load: Vec<Vec<u32>>,
    max_conns: usize,
    refused: u64,
    /// Connections workers closed for their idle timeout.
    idle_closed: u64,
    event_step: Option<u64>,
    /// `rollout`: the workers of the old version not yet replaced, in order.
    rollout: VecDeque<usize>,
}
