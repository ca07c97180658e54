//! `stoker-lab bench scale`: the trainer client's real scheduler at full job size, in virtual time.
//!
//! Every rank is a real [`Scheduler`] (the state machine the loader runs), fed events at
//! virtual instants; its actions (connect, send, cancel, close) go to simulated workers and
//! come back as the events a socket would produce. What is simulated is only what is outside
//! our client: a worker is its connection limit, its per-connection in-flight limit, its
//! sample budget (the limits of `stoker worker`, with the same defaults) and a few cores
//! whose per-sample service time is drawn from a distribution; a node is a NIC that carries
//! one batch at a time; the trainer is a synchronous step with a barrier across ranks.
//! Batches carry the real plan's sample ids ([`Plan::rank_slice`]), and every delivery is
//! checked: each rank gets every position once, in order, with the plan's samples.
//!
//! Deterministic from `--seed`: one thread, one event queue ordered by (time, sequence).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stoker_client::scheduler::{Action, Event, LinkId, Policy, Scheduler, Shared};
use stoker_client::{AlignedBuf, ClientMetrics, Depth, Discovery, LoaderConfig, WorkerSet};
use stoker_config::{DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_INFLIGHT_PER_CONN};
use stoker_wire::{BatchHead, BatchRequest, ErrorCode, ErrorFrame, Welcome};
use stoker_worker::plan::Plan;

#[derive(clap::Args, Clone)]
pub struct ScaleArgs {
    /// Job sizes as RANKSxWORKERS, comma-separated.
    #[arg(long, default_value = "4096x1024,4096x256")]
    sizes: String,
    /// Scenarios: steady, restart (a worker killed at the middle step, back 10 s later),
    /// drain (one drained), scale-up (+25 % workers), slow (a worker 20x slower from then on).
    #[arg(long, default_value = "steady,restart,drain,scale-up,slow")]
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
    /// Bytes of one prepared sample on the wire (u8 pixels of a ~1 MP image and its tokens).
    #[arg(long, default_value_t = 5_000_000)]
    sample_bytes: u64,
    /// A node's NIC, in Gbit/s, shared by `workers_per_node` workers.
    #[arg(long, default_value_t = 25.0)]
    nic_gbit: f64,
    #[arg(long, default_value_t = 8)]
    workers_per_node: usize,
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
    restart_efficiency: Option<f64>,
    steps_below_0_9_after_event: Option<usize>,
    refused_connects_per_worker_s: f64,
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
        let n = self.per_sample_s.len();
        let mean = self.per_sample_s.iter().sum::<f64>() / n.max(1) as f64;
        anyhow::ensure!(
            n > 0 && mean > 0.0 && self.per_sample_s.iter().all(|t| t.is_finite() && *t >= 0.0),
            "expected at least one non-negative time and a positive mean"
        );
        Ok(self.per_sample_s.iter().map(|t| t / mean).collect())
    }
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
                let report = Sim::new(&a, &shape, ranks, workers, policy, scenario).run();
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
        "{:>11} {:>9} {:>9} {:>8} {:>11} {:>8} {:>8} {:>8} {:>9} {:>8} {:>8} {:>9} {:>7}",
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
        "event eff",
        "<0.9"
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
            "{:>11} {:>9} {:>9} {:>8} {:>11} {:>8} {:>8.1} {:>8.3} {:>10.3} {:>8} {:>8.2} {:>9} {:>7}",
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
            opt(r.restart_efficiency),
            r.steps_below_0_9_after_event.map_or("-".into(), |n| n.to_string()),
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
}

impl Scenario {
    fn parse(s: &str) -> anyhow::Result<Scenario> {
        Ok(match s {
            "steady" => Scenario::Steady,
            "restart" => Scenario::Restart,
            "drain" => Scenario::Drain,
            "scale-up" => Scenario::ScaleUp,
            "slow" => Scenario::Slow,
            s => anyhow::bail!("scenario {s:?}: expected steady, restart, drain, scale-up or slow"),
        })
    }

    fn name(self) -> &'static str {
        match self {
            Scenario::Steady => "steady",
            Scenario::Restart => "restart",
            Scenario::Drain => "drain",
            Scenario::ScaleUp => "scale-up",
            Scenario::Slow => "slow",
        }
    }
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
}

#[derive(Clone, Copy)]
struct Job {
    conn: (u32, LinkId),
    req: BatchRequest,
    samples: u32,
}

/// A request holding its sample budget: its samples run on the worker's cores side by side
/// (the worker loads a request's samples concurrently, each on its CPU pool).
struct Running {
    job: Job,
    unstarted: u32,
    unfinished: u32,
    /// Cancelled: samples not started are dropped, those running are wasted.
    cancelled: bool,
}

struct Conn {
    worker: usize,
    incarnation: u32,
    preparing: usize,
    waiting: VecDeque<BatchRequest>,
}

struct Worker {
    addr: String,
    node: usize,
    up: bool,
    draining: bool,
    incarnation: u32,
    connections: usize,
    free_cores: usize,
    /// Service times are this many times the profile's (a sick node: `slow`).
    slowdown: f64,
    /// Requests holding their budget, by id; `ready` holds those with samples not started,
    /// in the order cores take them.
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
    conns: HashMap<(u32, LinkId), Conn>,
    nic_free: Vec<T>,
    /// The service-time profile, scaled to this fleet's mean (ns per sample).
    sample_ns: Vec<f64>,
    max_samples_budget: u32,
    // The trainer's barrier.
    step_started: Vec<T>,
    /// Workers listed when each step began (the mean of its load is over them).
    listed_at_step: Vec<usize>,
    ready_count: Vec<u32>,
    compute_done: T,
    failed: bool,
    load: Vec<Vec<u32>>,
    max_conns: usize,
    refused: u64,
    event_step: Option<u64>,
}

impl Sim {
    fn new(
        a: &ScaleArgs,
        shape: &[f64],
        ranks: u32,
        workers: usize,
        policy: Policy,
        scenario: Scenario,
    ) -> Sim {
        let global = ranks * a.samples_per_rank;
        let batches = a.steps + 8;
        let plan = Plan::new(global as u64 * batches, global, a.seed);
        let welcome = Welcome {
            plan_id: 0x5ca1e,
            dataset_version: 1,
            num_samples: plan.num_samples,
            global_batch_size: global,
            batches_per_epoch: plan.batches_per_epoch(),
            description: "simulated".into(),
            max_connections: a.max_connections,
            links_per_rank: 0,
            // Simulated answers carry no tensors: nothing for the media check to read.
            media: stoker_wire::MediaTokens {
                image_token: 151655,
                video_token: 151656,
                merge_size: 2,
            },
        };
        let demand = global as f64 / a.step_s;
        let per_worker = demand / workers as f64;
        let mean_sample_ns = CORES_PER_WORKER as f64 * a.utilization / per_worker * 1e9;
        let metrics = ClientMetrics::new("scale", 0);
        let mut sim = Sim {
            a: a.clone(),
            policy,
            scenario,
            base: Instant::now(),
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            rng: ChaCha8Rng::seed_from_u64(a.seed),
            plan,
            welcome,
            metrics,
            ranks: Vec::new(),
            workers: Vec::new(),
            listed: WorkerSet::new(),
            by_addr: HashMap::new(),
            conns: HashMap::new(),
            nic_free: Vec::new(),
            sample_ns: shape.iter().map(|x| x * mean_sample_ns).collect(),
            // The worker's default: 8 per preprocessing thread, at least 32.
            max_samples_budget: (8 * CORES_PER_WORKER as u32).max(32),
            step_started: Vec::new(),
            listed_at_step: Vec::new(),
            ready_count: vec![0; a.steps as usize + 1],
            compute_done: 0,
            failed: false,
            load: vec![Vec::new(); a.steps as usize + 1],
            max_conns: 0,
            refused: 0,
            event_step: None,
        };
        for _ in 0..workers {
            sim.add_worker();
        }
        for rank in 0..ranks {
            let mut cfg = LoaderConfig::new(Discovery::Static(Vec::new()), rank, ranks);
            cfg.policy = policy;
            cfg.depth = Depth::Auto { max: 16 };
            let shared = Shared::new();
            let core = Scheduler::new(cfg, shared.clone(), sim.metrics.clone(), sim.base);
            sim.ranks.push(Rank {
                core,
                shared,
                timer: None,
                started: false,
                channel: VecDeque::new(),
                taken: 0,
                view: WorkerSet::new(),
                no_worker: false,
                exact: true,
                counted: None,
            });
            let start = (sim.rng.gen::<f64>() * a.start_skew_s * 1e9) as T;
            sim.at(start, Ev::RankStart(rank));
        }
        sim
    }

    fn add_worker(&mut self) -> usize {
        let i = self.workers.len();
        let addr = format!("10.{}.{}.{}:7700", i / 65536, (i / 256) % 256, i % 256);
        let node = i / self.a.workers_per_node;
        if self.nic_free.len() <= node {
            self.nic_free.push(0);
        }
        self.workers.push(Worker {
            addr: addr.clone(),
            node,
            up: true,
            draining: false,
            incarnation: 0,
            connections: 0,
            free_cores: CORES_PER_WORKER,
            slowdown: 1.0,
            running: HashMap::new(),
            ready: VecDeque::new(),
            next_job: 0,
            free_budget: self.max_samples_budget,
            budget_queue: VecDeque::new(),
        });
        self.by_addr.insert(addr.clone(), i);
        self.listed.insert(addr);
        i
    }

    fn at(&mut self, t: T, ev: Ev) {
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.slots[s] = Some(ev);
                s
            }
            None => {
                self.slots.push(Some(ev));
                self.slots.len() - 1
            }
        };
        self.seq += 1;
        self.queue.push(Reverse((t, self.seq, slot)));
    }

    fn instant(&self) -> Instant {
        self.base + Duration::from_nanos(self.now)
    }

    fn run(mut self) -> Report {
        let wall = Instant::now();
        let steps = self.a.steps;
        // Nothing may run past the time the job should take, plus generous slack.
        let horizon = ns(Duration::from_secs_f64(
            self.a.start_skew_s + steps as f64 * self.a.step_s * 4.0 + 300.0,
        ));
        while let Some(Reverse((t, _, slot))) = self.queue.pop() {
            if t > horizon || self.failed || self.step_started.len() as u64 > steps {
                break;
            }
            self.now = t;
            let ev = self.slots[slot].take().expect("an event");
            self.free_slots.push(slot);
            self.handle(ev);
        }
        self.report(wall.elapsed().as_secs_f64())
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::RankStart(r) => {
                self.ranks[r as usize].started = true;
                self.discover(r);
            }
            Ev::Discover(r) => self.discover(r),
            Ev::RankTimer(r) => {
                let rank = &mut self.ranks[r as usize];
                if rank.timer == Some(self.now) {
                    rank.timer = None;
                    self.wake(r);
                }
            }
            Ev::Connect { rank, link, worker } => self.connect(rank, link, worker),
            Ev::ToRank { rank, event } => {
                let now = self.instant();
                self.ranks[rank as usize].core.on_event(now, event);
                self.wake(rank);
            }
            Ev::Request { conn, req } => self.request(conn, req),
            Ev::Cancel { conn, request_id } => self.cancel(conn, request_id),
            Ev::Close { conn } => {
                if let Some(c) = self.conns.remove(&conn) {
                    if self.workers[c.worker].incarnation == c.incarnation {
                        self.workers[c.worker].connections -= 1;
                    }
                }
            }
            Ev::SampleDone {
                worker,
                incarnation,
                job,
            } => self.sample_done(worker, incarnation, job),
            Ev::Sent {
                worker,
                incarnation,
                job,
            } => self.sent(worker, incarnation, job),
            Ev::Barrier(k) => {
                let ready = self.ready_count[k as usize] == self.ranks.len() as u32;
                if self.step_started.len() as u64 == k && ready {
                    self.start_step(k);
                }
            }
            Ev::WorkerBack(w) => self.workers[w].up = true,
            Ev::Drain(w) => {
                self.workers[w].draining = true;
                let addr = self.workers[w].addr.clone();
                self.listed.remove(&addr);
                self.at(self.now + ns(DRAIN_EXIT), Ev::DrainExit(w));
            }
            Ev::DrainExit(w) => {
                self.worker_down(w);
                self.workers[w].up = false;
            }
            Ev::ScaleUp => {
                let add = self.workers.len().div_ceil(4);
                for _ in 0..add {
                    self.add_worker();
                }
            }
        }
    }

    /// The rank's DNS answer: the listed workers; it asks again in five seconds.
    fn discover(&mut self, r: u32) {
        let now = self.instant();
        let rank = &mut self.ranks[r as usize];
        if rank.view != self.listed {
            rank.view = self.listed.clone();
            rank.core.set_workers(now, rank.view.clone());
        }
        self.at(self.now + ns(DISCOVERY_EVERY), Ev::Discover(r));
        self.wake(r);
    }

    /// Runs the rank's scheduler at the current instant and carries out what it asks.
    fn wake(&mut self, r: u32) {
        let now = self.instant();
        let rank = &mut self.ranks[r as usize];
        if !rank.started {
            return;
        }
        rank.core.step(now);
        let actions = rank.core.take_actions();
        if let Some(Err(_)) = rank.core.take_identity() {
            // Loader::new fails: that rank's process exits, and the job with it.
            rank.no_worker = true;
            self.failed = true;
        }
        let capacity = rank.core.max_depth() + 1;
        while rank.channel.len() < capacity {
            let Some(d) = rank.core.poll_delivery() else {
                break;
            };
            match d.result {
                Ok(b) => rank.channel.push_back(b),
                Err(e) => {
                    if e.kind() == "no_worker" {
                        rank.no_worker = true;
                    }
                    // A trainer gets an exception here: the job stops.
                    self.failed = true;
                }
            }
        }
        let timer = rank
            .core
            .next_timer()
            .map(|t| ns(t.duration_since(self.base)));
        if let Some(t) = timer.map(|t| t.max(self.now + 1)) {
            if rank.timer.is_none_or(|old| t < old || old <= self.now) {
                rank.timer = Some(t);
                self.at(t, Ev::RankTimer(r));
            }
        }
        for action in actions {
            self.act(r, action);
        }
        self.check_barrier(r);
    }

    fn act(&mut self, r: u32, action: Action) {
        let later = self.now + ns(ONE_WAY);
        match action {
            Action::Connect { link, addr } => {
                let worker = self.by_addr[&addr];
                self.at(
                    later,
                    Ev::Connect {
                        rank: r,
                        link,
                        worker,
                    },
                );
            }
            Action::Send { link, request } => self.at(
                later,
                Ev::Request {
                    conn: (r, link),
                    req: request,
                },
            ),
            Action::Cancel { link, request_id } => self.at(
                later,
                Ev::Cancel {
                    conn: (r, link),
                    request_id,
                },
            ),
            Action::Close { link } => self.at(later, Ev::Close { conn: (r, link) }),
        }
    }

    fn tell_rank(&mut self, rank: u32, event: Event) {
        self.at(self.now + ns(ONE_WAY), Ev::ToRank { rank, event });
    }

    fn connect(&mut self, rank: u32, link: LinkId, w: usize) {
        let worker = &mut self.workers[w];
        if !worker.up {
            let error = "connection refused".to_string();
            return self.tell_rank(rank, Event::Down { link, error });
        }
        if worker.connections >= self.a.max_connections as usize {
            self.refused += 1;
            let error = ErrorFrame {
                request_id: 0,
                code: ErrorCode::Unavailable,
                message: format!(
                    "worker at its limit of {} connections; retry on another worker",
                    self.a.max_connections
                ),
            };
            self.tell_rank(rank, Event::Refused { link, error });
            let error = "closed by the worker".to_string();
            return self.tell_rank(rank, Event::Down { link, error });
        }
        worker.connections += 1;
        self.max_conns = self.max_conns.max(worker.connections);
        let incarnation = worker.incarnation;
        self.conns.insert(
            (rank, link),
            Conn {
                worker: w,
                incarnation,
                preparing: 0,
                waiting: VecDeque::new(),
            },
        );
        let welcome = self.welcome.clone();
        self.tell_rank(rank, Event::Up { link, welcome });
    }

    fn request(&mut self, conn: (u32, LinkId), req: BatchRequest) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return; // closed meanwhile
        };
        let w = c.worker;
        if self.workers[w].draining {
            let error = ErrorFrame {
                request_id: req.request_id,
                code: ErrorCode::Unavailable,
                message: "worker is draining; retry on another worker".into(),
            };
            let (rank, link) = conn;
            let answer = Err(error);
            let request_id = req.request_id;
            return self.tell_rank(
                rank,
                Event::Answer {
                    link,
                    request_id,
                    answer,
                },
            );
        }
        c.waiting.push_back(req);
        self.admit(conn);
    }

    /// Moves a connection's waiting requests into the worker's budget queue, within its
    /// per-connection limit.
    fn admit(&mut self, conn: (u32, LinkId)) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let w = c.worker;
        while c.preparing < DEFAULT_MAX_INFLIGHT_PER_CONN as usize {
            let Some(req) = c.waiting.pop_front() else {
                break;
            };
            c.preparing += 1;
            let step = self.welcome.position(req.epoch, req.global_batch);
            if let Some(l) = step.and_then(|s| self.load.get_mut(s as usize)) {
                if l.len() < self.workers.len() {
                    l.resize(self.workers.len(), 0);
                }
                l[w] += 1;
            }
            let samples = self.a.samples_per_rank.min(self.max_samples_budget);
            self.workers[w]
                .budget_queue
                .push_back(Job { conn, req, samples });
        }
        self.run_worker(w);
    }

    /// Grants budget in FIFO order and starts waiting samples on free cores.
    fn run_worker(&mut self, w: usize) {
        loop {
            let worker = &mut self.workers[w];
            let Some(job) = worker.budget_queue.front() else {
                break;
            };
            if job.samples > worker.free_budget {
                break;
            }
            worker.free_budget -= job.samples;
            let job = worker.budget_queue.pop_front().expect("front");
            let id = worker.next_job;
            worker.next_job += 1;
            worker.running.insert(
                id,
                Running {
                    job,
                    unstarted: job.samples,
                    unfinished: job.samples,
                    cancelled: false,
                },
            );
            worker.ready.push_back(id);
        }
        while self.workers[w].free_cores > 0 {
            let worker = &mut self.workers[w];
            let Some(&id) = worker.ready.front() else {
                break;
            };
            let Some(r) = worker.running.get_mut(&id).filter(|r| r.unstarted > 0) else {
                worker.ready.pop_front(); // all started, or cancelled
                continue;
            };
            r.unstarted -= 1;
            worker.free_cores -= 1;
            let incarnation = worker.incarnation;
            let t = self.sample_ns[self.rng.gen_range(0..self.sample_ns.len())] * worker.slowdown;
            self.at(
                self.now + t as T,
                Ev::SampleDone {
                    worker: w,
                    incarnation,
                    job: id,
                },
            );
        }
    }

    fn sample_done(&mut self, w: usize, incarnation: u32, id: u64) {
        let worker = &mut self.workers[w];
        if worker.incarnation != incarnation {
            return;
        }
        worker.free_cores += 1;
        let r = worker
            .running
            .get_mut(&id)
            .expect("a sample of a running job");
        r.unfinished -= 1;
        if r.unfinished == 0 && r.unstarted == 0 {
            let r = worker.running.remove(&id).expect("running");
            if r.cancelled {
                self.finish(w, r.job);
            } else {
                let node = self.workers[w].node;
                let bytes = r.job.samples as u64 * self.a.sample_bytes;
                let transfer = bytes as f64 * 8.0 / (self.a.nic_gbit * 1e9) * 1e9;
                let start = self.nic_free[node].max(self.now);
                self.nic_free[node] = start + transfer as T;
                self.at(
                    self.nic_free[node],
                    Ev::Sent {
                        worker: w,
                        incarnation,
                        job: r.job,
                    },
                );
            }
        }
        self.run_worker(w);
    }

    fn sent(&mut self, w: usize, incarnation: u32, job: Job) {
        if self.workers[w].incarnation != incarnation {
            return;
        }
        let live = self
            .conns
            .get(&job.conn)
            .is_some_and(|c| c.incarnation == incarnation);
        if live {
            let slice = self
                .plan
                .rank_slice(
                    job.req.epoch,
                    job.req.global_batch,
                    job.req.rank,
                    job.req.world_size,
                )
                .expect("a valid request");
            let head = BatchHead {
                request: job.req,
                sample_ids: slice.samples,
                skipped: Vec::new(),
                tensors: Vec::new(),
                payload_len: 0,
            };
            let (rank, link) = job.conn;
            let answer = Ok((head, AlignedBuf::zeroed(0)));
            let request_id = job.req.request_id;
            self.tell_rank(
                rank,
                Event::Answer {
                    link,
                    request_id,
                    answer,
                },
            );
        }
        self.finish(w, job);
    }

    /// A request's budget and connection slot are free again.
    fn finish(&mut self, w: usize, job: Job) {
        self.workers[w].free_budget += job.samples;
        if let Some(c) = self.conns.get_mut(&job.conn) {
            c.preparing -= 1;
        }
        self.admit(job.conn);
        self.run_worker(w);
    }

    fn cancel(&mut self, conn: (u32, LinkId), request_id: u64) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let w = c.worker;
        if let Some(i) = c.waiting.iter().position(|r| r.request_id == request_id) {
            c.waiting.remove(i);
            return;
        }
        let worker = &mut self.workers[w];
        if let Some(i) = worker
            .budget_queue
            .iter()
            .position(|j| j.conn == conn && j.req.request_id == request_id)
        {
            let job = worker.budget_queue.remove(i).expect("found");
            worker.free_budget += job.samples; // finish() gives back what it never took
            return self.finish(w, job);
        }
        // Being prepared: the worker aborts it (as its task is): samples not started are
        // dropped, running ones finish unused. Once sending, it goes out.
        let Some((&id, r)) = worker
            .running
            .iter_mut()
            .find(|(_, r)| r.job.conn == conn && r.job.req.request_id == request_id)
        else {
            return;
        };
        r.cancelled = true;
        r.unfinished -= r.unstarted;
        r.unstarted = 0;
        if r.unfinished == 0 {
            let job = worker.running.remove(&id).expect("running").job;
            self.finish(w, job);
        }
    }

    /// The process dies: every connection drops, nothing in it is answered.
    fn worker_down(&mut self, w: usize) {
        let worker = &mut self.workers[w];
        worker.up = false;
        worker.incarnation += 1;
        worker.connections = 0;
        worker.free_cores = CORES_PER_WORKER;
        worker.running.clear();
        worker.ready.clear();
        worker.budget_queue.clear();
        worker.free_budget = self.max_samples_budget;
        worker.draining = false;
        let dropped: Vec<(u32, LinkId)> = self
            .conns
            .iter()
            .filter(|(_, c)| c.worker == w)
            .map(|(k, _)| *k)
            .collect();
        for key in dropped {
            self.conns.remove(&key);
            let (rank, link) = key;
            let error = "connection reset by peer".to_string();
            self.tell_rank(rank, Event::Down { link, error });
        }
    }

    /// Step k starts once every rank holds batch k and step k-1's compute is done; then
    /// every rank takes it, and the scenario's event fires at the middle step.
    fn check_barrier(&mut self, r: u32) {
        let k = self.step_started.len() as u64;
        if k as usize >= self.ready_count.len() {
            return;
        }
        let rank = &mut self.ranks[r as usize];
        if rank.taken == k && !rank.channel.is_empty() && rank.counted != Some(k) {
            rank.counted = Some(k);
            self.ready_count[k as usize] += 1;
            if self.ready_count[k as usize] == self.ranks.len() as u32 {
                let at = self.compute_done.max(self.now);
                self.at(at, Ev::Barrier(k));
            }
        }
    }

    fn start_step(&mut self, k: u64) {
        let interval = self
            .step_started
            .last()
            .map(|s| Duration::from_nanos(self.now - s));
        self.step_started.push(self.now);
        self.listed_at_step.push(self.listed.len());
        self.compute_done = self.now + ns(Duration::from_secs_f64(self.a.step_s));
        let bpe = self.welcome.batches_per_epoch;
        let world = self.ranks.len() as u32;
        for r in 0..world {
            let rank = &mut self.ranks[r as usize];
            let b = rank.channel.pop_front().expect("counted as ready");
            let want = self
                .plan
                .rank_slice(k / bpe, k % bpe, r, world)
                .expect("in the plan");
            if (b.epoch, b.global_batch) != (k / bpe, k % bpe) || b.sample_ids != want.samples {
                rank.exact = false;
            }
            rank.taken = k + 1;
            rank.shared.took(k + 1, interval);
        }
        let middle = self.a.steps / 2;
        if k == middle && self.event_step.is_none() {
            self.event_step = Some(k);
            match self.scenario {
                Scenario::Steady => self.event_step = None,
                Scenario::Restart => {
                    self.worker_down(0);
                    self.at(self.now + ns(RESTART_DOWN), Ev::WorkerBack(0));
                }
                Scenario::Drain => self.at(self.now + ns(DRAIN_UNLIST), Ev::Drain(0)),
                Scenario::ScaleUp => self.at(self.now, Ev::ScaleUp),
                Scenario::Slow => self.workers[0].slowdown = SLOW_WORKER,
            }
        }
        for r in 0..self.ranks.len() as u32 {
            self.wake(r);
        }
    }

    fn report(self, wall_s: f64) -> Report {
        let steps_completed = self.step_started.len().saturating_sub(1) as u64;
        let step = self.a.step_s;
        let efficiency_by_step: Vec<f64> = self
            .step_started
            .windows(2)
            .map(|w| step / ((w[1] - w[0]) as f64 / 1e9))
            .collect();
        // Requests per listed worker in each step: the busiest over the mean.
        let load_by_step: Vec<f64> = (0..steps_completed as usize)
            .map(|k| {
                let l = &self.load[k];
                let live = self
                    .listed_at_step
                    .get(k)
                    .copied()
                    .unwrap_or(self.workers.len()) as f64;
                let total: u32 = l.iter().sum();
                if total == 0 {
                    return 0.0;
                }
                *l.iter().max().unwrap_or(&0) as f64 / (total as f64 / live)
            })
            .collect();
        let max_over_mean = load_by_step.iter().copied().fold(0.0, f64::max);
        let (restart_efficiency, below) = match self.event_step {
            Some(k) => {
                let after: Vec<f64> = efficiency_by_step
                    .iter()
                    .skip(k as usize)
                    .copied()
                    .collect();
                let min = after.iter().copied().fold(f64::INFINITY, f64::min);
                (
                    Some(if min.is_finite() { min } else { 0.0 }),
                    Some(after.iter().filter(|e| **e < 0.9).count()),
                )
            }
            None => (None, None),
        };
        let deadline = self.metrics.retries.with_label_values(&["deadline"]).get();
        let hedges = self.metrics.hedges.with_label_values(&["sent"]).get();
        let end_s = self.now as f64 / 1e9;
        let exact =
            self.ranks.iter().all(|r| r.exact) && (!self.failed || self.policy == Policy::FullMesh);
        Report {
            ranks: self.ranks.len() as u32,
            workers: self.workers.len(),
            policy: match self.policy {
                Policy::Subset => "subset",
                Policy::FullMesh => "full-mesh",
            },
            scenario: self.scenario.name().into(),
            // Refused everywhere (no worker serves it), or told so by its loader.
            ranks_without_worker: self
                .ranks
                .iter()
                .filter(|r| r.no_worker || (r.started && r.core.live_workers() == 0))
                .count(),
            max_connections_per_worker: self.max_conns,
            connection_limit: self.a.max_connections,
            steps_completed,
            start_stall_s: self.step_started.first().map_or(end_s, |t| *t as f64 / 1e9)
                - self.a.start_skew_s,
            efficiency_by_step,
            max_over_mean_worker_load: max_over_mean,
            max_over_mean_load_by_step: load_by_step,
            requests_past_deadline: deadline,
            hedges_per_step: hedges as f64 / steps_completed.max(1) as f64,
            restart_efficiency,
            steps_below_0_9_after_event: below,
            refused_connects_per_worker_s: self.refused as f64
                / self.workers.len() as f64
                / end_s.max(1e-9),
            exact_delivery: exact,
            wall_s,
        }
    }
}
