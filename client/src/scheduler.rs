//! The request scheduler: the one state machine that decides which batch is requested from
//! which worker, and delivers answers to the trainer strictly in plan order.
//!
//! It does no I/O and reads no clock: its driver (`driver.rs`, over tokio and TCP) or the scale
//! simulator (`stoker-lab bench scale`, in virtual time) feeds it events with the time they
//! happened, executes the [`Action`]s it returns and takes its deliveries. Both run exactly
//! these rules.
//!
//! Positions number the batches of all epochs in plan order: position `p` is global batch
//! `p % B` of epoch `p / B` (B batches per epoch). The scheduler keeps the positions
//! `[consumed, consumed + depth)` requested or ready. Under [`Policy::Subset`] each position
//! goes to one of the rank's home workers (`topology.rs`), to a spare when no home can take it,
//! and again elsewhere when its worker fails, drains or refuses; a straggler at the head of the
//! line is hedged within a budget, and abandoned requests are cancelled. The first answer for a
//! position wins; later ones are dropped, so the trainer sees every position exactly once.
//!
//! The bookkeeping (links, positions, delivery) is here; the rules are apart: `choice.rs`
//! (which link takes a position, hedging), `answers.rs` (what an answer does), `failures.rs`
//! (attempts, lost links, no worker) and `refusals.rs` (one worker's refusal is its own).

use crate::batch::Batch;
use crate::config::LoaderConfig;
pub use crate::config::Policy;
use crate::discovery::WorkerSet;
use crate::error::Error;
use crate::metrics::{ClientMetrics, HedgeOutcome, RejectReason, RetryReason, WorkerErrorKind};
use crate::policy::{auto_depth, legacy_auto_depth, Depth, HedgeBudget, LatencyWindow};
use crate::topology::{self, Members};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stoker_wire::{BatchHead, BatchRequest, ErrorCode, ErrorFrame, Welcome};
use tokio::sync::Notify;

pub type LinkId = u64;

/// What every worker must serve for its batches to be interchangeable: the worker's handshake
/// (equal plans, per [`Welcome::same_plan`], mean identical batch bytes).
pub type PlanIdentity = Welcome;

/// State shared with the consuming side.
pub struct Shared {
    /// The next position the trainer will take; the window starts here.
    pub consumed: AtomicU64,
    /// Mean time between the trainer's requests, in ns (0 = unknown).
    pub interval_ns: AtomicU64,
    /// The trainer is blocked waiting for a batch (what `Depth::OnDemand` requests on).
    pub asking: std::sync::atomic::AtomicBool,
    /// Woken when the trainer takes a batch or starts waiting for one.
    pub wake: Notify,
}

impl Shared {
    pub fn new() -> Arc<Shared> {
        Arc::new(Shared {
            consumed: Default::default(),
            interval_ns: Default::default(),
            asking: Default::default(),
            wake: Default::default(),
        })
    }

    /// The trainer took the batch before `position`, `interval` after the one before (the
    /// pace the adaptive depth follows: a moving average over about eight steps).
    pub fn took(&self, position: u64, interval: Option<Duration>) {
        if let Some(i) = interval {
            let interval = i.as_nanos() as u64;
            let old = self.interval_ns.load(Ordering::Relaxed);
            let ewma = if old == 0 {
                interval
            } else {
                (old * 7 + interval) / 8
            };
            self.interval_ns.store(ewma.max(1), Ordering::Relaxed);
        }
        self.consumed.store(position, Ordering::Release);
        self.wake.notify_one();
    }
}

/// What the scheduler hands the trainer side, tagged with the seek generation it belongs to.
pub struct Delivery {
    pub generation: u64,
    pub result: Result<Batch, Error>,
}

pub enum Control {
    /// Restart delivery at `position` (load_state_dict); older deliveries are stale.
    Seek { position: u64, generation: u64 },
}

/// What happened on a link, as the driver reports it.
pub enum Event {
    /// The worker accepted the token and serves `welcome`'s plan.
    Up { link: LinkId, welcome: Welcome },
    /// The worker refused the connection (a wrong token, its connection limit).
    Refused { link: LinkId, error: ErrorFrame },
    /// An answer to one request.
    Answer {
        link: LinkId,
        request_id: u64,
        answer: Result<(BatchHead, crate::buffer::AlignedBuf), ErrorFrame>,
    },
    /// The connection failed or closed; its unanswered requests are lost.
    Down { link: LinkId, error: String },
}

/// What the scheduler asks its driver to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Open a connection to `addr` and handshake; report as `link`.
    Connect { link: LinkId, addr: String },
    /// Send a request on a link that is up.
    Send { link: LinkId, request: BatchRequest },
    /// Tell the worker its answer to `request_id` is no longer wanted.
    Cancel { link: LinkId, request_id: u64 },
    /// Close the connection (no Down event follows).
    Close { link: LinkId },
}

struct WorkerLink {
    addr: String,
    /// The handshake succeeded and the plan matched.
    up: bool,
    outstanding: usize,
    latency_ewma: Option<f64>,
    /// When the estimate was last refreshed (it decays towards the neutral value after).
    measured: Instant,
    /// The worker said it is draining (or misbehaved): send it nothing more.
    draining: bool,
    /// Requests it may hold at once: grows with its answers (slow start), halves on a failure.
    window: usize,
    /// Since when nothing is outstanding (idle spares are released).
    idle_since: Instant,
    /// When it last answered anything (or came up): a link that holds requests and says
    /// nothing for long is silent (`choice.rs`).
    heard: Instant,
    /// It lost a hedge race or answered lagging, and has not answered in time since: it is
    /// probed with one request at a time (others go elsewhere meanwhile).
    suspect: bool,
    /// Dialled before the plan was known, only to learn it: released as soon as it is idle
    /// and not one of this rank's links.
    probe: bool,
}

#[derive(Default)]
struct Pending {
    /// Request ids sent for this position and not yet answered.
    attempts: Vec<u64>,
    /// Workers that failed this position (avoided on retry while others exist).
    failed_on: Vec<String>,
    failures: u32,
    hedged: bool,
    /// Workers that refused or failed this position for a reason of their own or of the
    /// batch's (`refusals.rs`): never asked for it again.
    refused_by: BTreeMap<String, Refusal>,
}

struct InFlight {
    link: LinkId,
    position: u64,
    sent: Instant,
    hedge: bool,
}

/// Requests one link may hold at most (the driver's per-link queue).
pub const LINK_QUEUE: usize = 256;
/// Errors kept for the trainer while the delivery channel is full.
const NOTICE_CAPACITY: usize = 4;
const RECONNECT_MIN: Duration = Duration::from_millis(200);
const RECONNECT_MAX: Duration = Duration::from_secs(5);
/// A spare (or a former member) with nothing outstanding this long is closed.
const LINK_IDLE: Duration = Duration::from_secs(30);
/// An estimate loses half its distance to the neutral value per this much time unmeasured,
/// so a link judged slow once is tried again.
const ESTIMATE_HALF_LIFE: Duration = Duration::from_secs(30);
/// A new link's window: requests before its first answer.
const INITIAL_WINDOW: usize = 2;
/// A link this many times slower than the rank's median is lagging: its home role lapses
/// until it catches up (requests go to a spare).
const LAG_FACTOR: f64 = 4.0;
/// ... judged only once the median rests on this many answers.
const LAG_OBSERVATIONS: usize = 8;
/// A link holding requests is silent once it has answered nothing for this many times the
/// longest of the rank's recent latencies (and the lag limit).
const SILENT_FACTOR: f64 = 1.5;

pub struct Scheduler {
    cfg: LoaderConfig,
    shared: Arc<Shared>,
    metrics: Arc<ClientMetrics>,
    now: Instant,
    identity: Option<PlanIdentity>,
    identity_result: Option<Result<PlanIdentity, Error>>,
    identity_taken: bool,
    links: HashMap<LinkId, WorkerLink>,
    by_addr: HashMap<String, LinkId>,
    live: usize,
    next_link: LinkId,
    wanted: WorkerSet,
    members: Members,
    /// Links per rank from the workers' hints and the loader's setting.
    links_per_rank: usize,
    /// Why each address is not serving, for error messages.
    problems: BTreeMap<String, Error>,
    /// Not before this time, and the backoff that got it there.
    reconnect_at: BTreeMap<String, (Instant, Duration)>,
    /// The same gates by time, so a step finds the due ones without a scan.
    gates: std::collections::BTreeSet<(Instant, String)>,
    next_request: u64,
    in_flight: HashMap<u64, InFlight>,
    pending: BTreeMap<u64, Pending>,
    /// Answered positions waiting for their turn: a batch, or why it could not be had
    /// (delivered in plan order too, so an error never overtakes an earlier batch).
    ready: BTreeMap<u64, Result<Batch, Error>>,
    /// Errors for the trainer that concern no one batch (no worker, a refused token).
    notices: VecDeque<Error>,
    next_issue: u64,
    next_deliver: u64,
    generation: u64,
    latencies: LatencyWindow,
    /// Mean payload bytes of an answer (for the prefetch byte cap).
    batch_bytes: Option<f64>,
    hedges: HedgeBudget,
    /// The trainer's last take as this scheduler saw it: (position it takes next, when).
    last_take: Option<(u64, Instant)>,
    no_worker_since: Option<Instant>,
    /// A position waits for a spare: no home can take it.
    spill: bool,
    actions: Vec<Action>,
}

impl Scheduler {
    /// The scheduler at time `now`, before any worker is known.
    pub fn new(
        cfg: LoaderConfig,
        shared: Arc<Shared>,
        metrics: Arc<ClientMetrics>,
        now: Instant,
    ) -> Self {
        let hedges = HedgeBudget::new(cfg.hedge.unwrap_or_default());
        Scheduler {
            next_issue: 0,
            next_deliver: 0,
            shared,
            metrics,
            now,
            identity: None,
            identity_result: None,
            identity_taken: false,
            links: HashMap::new(),
            by_addr: HashMap::new(),
            live: 0,
            next_link: 1,
            wanted: WorkerSet::new(),
            members: Members::default(),
            links_per_rank: cfg.links_per_rank,
            problems: BTreeMap::new(),
            reconnect_at: BTreeMap::new(),
            gates: Default::default(),
            next_request: 1,
            in_flight: HashMap::new(),
            pending: BTreeMap::new(),
            ready: BTreeMap::new(),
            notices: Default::default(),
            generation: 0,
            latencies: LatencyWindow::default(),
            batch_bytes: None,
            hedges,
            last_take: None,
            no_worker_since: Some(now),
            spill: false,
            actions: Vec::new(),
            cfg,
        }
    }

    /// The most batches the trainer side can have been handed and not yet taken.
    pub fn max_depth(&self) -> usize {
        self.cfg.depth.max()
    }

    /// The plan, once a worker offered it, or why none could be had. Given once.
    pub fn take_identity(&mut self) -> Option<Result<PlanIdentity, Error>> {
        let r = self.identity_result.take();
        self.identity_taken |= r.is_some();
        r
    }

    /// The next delivery in plan order, if it is ready: errors that concern no one batch
    /// first (they take no position), then the batch at the head.
    pub fn poll_delivery(&mut self) -> Option<Delivery> {
        let generation = self.generation;
        if let Some(e) = self.notices.pop_front() {
            return Some(Delivery {
                generation,
                result: Err(e),
            });
        }
        let result = self.ready.remove(&self.next_deliver)?;
        self.next_deliver += 1;
        Some(Delivery { generation, result })
    }

    /// What the driver must do, in order.
    pub fn take_actions(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.actions)
    }

    /// The earliest time at which [`Scheduler::step`] has something to do without a new
    /// event (a deadline, a hedge, a reconnect, a release, the no-worker timeout).
    pub fn next_timer(&self) -> Option<Instant> {
        let mut t: Option<Instant> = None;
        // Only what lies ahead: a time already passed that the last step did not act on (a
        // hedge over budget, a position with nowhere to go) waits for an event instead.
        let now = self.now;
        let mut at = |x: Instant| {
            if x > now {
                t = Some(t.map_or(x, |t| t.min(x)));
            }
        };
        if let Some(since) = self.no_worker_since {
            at(since + self.cfg.no_worker_timeout);
        }
        // Every backoff still running for a worker this rank wants a link to: a spare's gate
        // leaves `gates` once due even if no spare was dialled then, and the first gate may
        // lie in the past while a later one is what wakes the rank (a rank refused by every
        // worker otherwise slept forever, and lock-step ranks with it).
        for (addr, (when, _)) in &self.reconnect_at {
            if !self.by_addr.contains_key(addr) && self.wants_link(addr) {
                at(*when);
            }
        }
        if self.identity.is_some() {
            if let Some(f) = self.in_flight.values().map(|f| f.sent).min() {
                at(f + self.cfg.request_timeout);
            }
            for silent in self.silent_at().into_values() {
                at(silent);
            }
            if let Some(threshold) = self.hedge_threshold() {
                for (pos, p) in self.pending.iter().take(self.hedge_head()) {
                    if let Some(f) = p.attempts.first().and_then(|id| self.in_flight.get(id)) {
                        at(self.hedge_due(*pos, f.sent, threshold));
                    }
                }
            }
        }
        if self.cfg.policy == Policy::Subset {
            for l in self.links.values() {
                if l.outstanding == 0 && !self.members.is_home(&l.addr) {
                    at(l.idle_since + LINK_IDLE);
                }
            }
        }
        t
    }

    /// Everything that follows from the current state at `now`: connect, expire, issue,
    /// hedge, release.
    pub fn step(&mut self, now: Instant) {
        self.now = now.max(self.now);
        let consumed = self.shared.consumed.load(Ordering::Acquire);
        if self.last_take.is_none_or(|(c, _)| c != consumed) {
            self.last_take = Some((consumed, self.now));
        }
        if self.identity.is_none() && self.cfg.policy == Policy::Subset {
            // No plan yet, so no position to spill: when no home can answer, a spare is
            // dialled anyway, so a rank whose homes refuse it is never stranded.
            self.spill = !self.members.homes.iter().any(|a| self.home_healthy(a));
        }
        self.ensure_links();
        self.check_no_worker();
        if self.identity.is_some() {
            self.expire();
            self.give_up_refused_everywhere();
            self.issue();
            self.fail_over_silent();
            self.hedge();
        }
        self.release_idle();
        self.metrics.in_flight.set(self.in_flight.len() as i64);
    }

    pub fn on_event(&mut self, now: Instant, ev: Event) {
        self.now = now.max(self.now);
        match ev {
            Event::Up { link, welcome } => self.on_up(link, welcome),
            Event::Refused { link, error } => {
                let Some(l) = self.links.get(&link) else {
                    return;
                };
                let addr = l.addr.clone();
                self.metrics.error(WorkerErrorKind::Refused);
                if error.code == ErrorCode::Unauthorized {
                    self.token_refused(addr, error.message);
                } else {
                    // Full or draining: the connection closes next, and the rank finds
                    // capacity elsewhere meanwhile.
                    let why = format!("worker {addr} refused the connection: {}", error.message);
                    self.problems.insert(addr, Error::Internal(why));
                }
            }
            Event::Answer {
                link,
                request_id,
                answer,
            } => self.on_answer(link, request_id, answer),
            Event::Down { link, error } => self.on_down(link, error, Loss::Crashed),
        }
    }

    pub fn on_control(&mut self, now: Instant, c: Control) {
        self.now = now.max(self.now);
        match c {
            Control::Seek {
                position,
                generation,
            } => {
                // Answers for the old window still arrive; they find no pending position.
                let stale: Vec<u64> = self.in_flight.keys().copied().collect();
                for id in stale {
                    self.abandon(id);
                }
                self.pending.clear();
                self.ready.clear();
                self.notices.clear();
                self.next_issue = position;
                self.next_deliver = position;
                self.generation = generation;
            }
        }
    }

    /// The discovered workers changed: recompute this rank's members, drop links to workers
    /// that are gone, connect to new homes.
    pub fn set_workers(&mut self, now: Instant, set: WorkerSet) {
        self.now = now.max(self.now);
        let gone: Vec<LinkId> = self
            .links
            .iter()
            .filter(|(_, l)| !set.contains(&l.addr))
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.actions.push(Action::Close { link: id });
            self.on_down(id, "removed from discovery".into(), Loss::Removed);
        }
        self.reconnect_at.retain(|a, _| set.contains(a));
        self.gates.retain(|(_, a)| set.contains(a));
        self.problems.retain(|a, _| set.contains(a));
        self.wanted = set;
        self.recompute_members();
        self.dial_homes();
        self.ensure_links();
    }

    /// Connects every home without a link whose backoff has passed (after the members
    /// changed; later, due gates do it one address at a time).
    fn dial_homes(&mut self) {
        let now = self.now;
        let due: Vec<String> = self
            .members
            .homes
            .iter()
            .filter(|a| !self.by_addr.contains_key(*a))
            .filter(|a| self.reconnect_at.get(*a).is_none_or(|(at, _)| *at <= now))
            .cloned()
            .collect();
        for addr in due {
            self.connect(addr);
        }
    }

    fn recompute_members(&mut self) {
        self.members = match self.cfg.policy {
            Policy::FullMesh => Members::new(
                self.wanted.iter().cloned().collect(),
                Vec::new(),
                Vec::new(),
            ),
            // Before any Welcome the workers' connection limit is unknown: one link (this
            // rank's first home, then one spare at a time while it cannot answer) learns the
            // plan and the limit. Dialling every worker from every rank at once would take
            // W x R slots while the job needs a fraction of them, and lock the ranks that come
            // last out of every worker.
            Policy::Subset if self.identity.is_none() => {
                topology::members(&self.wanted, self.cfg.rank, self.cfg.world_size, 1)
            }
            Policy::Subset => {
                let max_connections = self.identity.as_ref().map_or(0, |w| w.max_connections);
                let hint = self
                    .identity
                    .as_ref()
                    .map_or(0, |w| w.links_per_rank as usize);
                let wanted = if self.cfg.links_per_rank > 0 {
                    self.cfg.links_per_rank
                } else {
                    hint
                };
                self.links_per_rank = topology::links_per_rank(
                    self.wanted.len(),
                    self.cfg.world_size,
                    max_connections,
                    wanted,
                );
                topology::members(
                    &self.wanted,
                    self.cfg.rank,
                    self.cfg.world_size,
                    self.links_per_rank,
                )
            }
        };
    }

    /// This rank's members, homes first (what `stoker-lab bench scale` reports).
    pub fn members(&self) -> &Members {
        &self.members
    }

    /// Workers linked, serving this plan and not draining.
    pub fn live_workers(&self) -> usize {
        self.live
    }

    /// Connections open or opening.
    pub fn link_count(&self) -> usize {
        self.links.len()
    }

    /// A home that is up and serving, or connecting for the first time.
    fn home_healthy(&self, addr: &str) -> bool {
        let Some(l) = self.by_addr.get(addr).map(|id| &self.links[id]) else {
            return false;
        };
        !l.draining && (l.up || !self.problems.contains_key(addr))
    }

    /// Should a link to `addr` exist now: a home always; a spare (or, when every spare
    /// failed, any other worker) while a position waits for one.
    fn wants_link(&self, addr: &str) -> bool {
        self.members.is_home(addr) || (self.spill && self.wanted.contains(addr))
    }

    fn ensure_links(&mut self) {
        let now = self.now;
        let gate_open = |s: &Self, a: &str| s.reconnect_at.get(a).is_none_or(|(at, _)| *at <= now);
        // Homes whose backoff just ended (the entry stays: the backoff grows if this fails).
        while let Some((at, addr)) = self.gates.first().cloned() {
            if at > now {
                break;
            }
            self.gates.pop_first();
            if self.members.is_home(&addr) && !self.by_addr.contains_key(&addr) {
                self.connect(addr);
            }
        }
        if !self.spill {
            return;
        }
        // One spare at a time: the first that is not linked, not refusing lately.
        let opening = self
            .links
            .values()
            .any(|l| !l.up && !self.members.is_home(&l.addr));
        if opening {
            return;
        }
        let usable_spare = self.links.values().any(|l| {
            l.up && !l.draining && l.outstanding < l.window && !self.members.is_home(&l.addr)
        });
        if usable_spare {
            return;
        }
        let next = self
            .members
            .spares
            .iter()
            .chain(&self.members.rest)
            .find(|a| !self.by_addr.contains_key(*a) && gate_open(self, a))
            .cloned();
        if let Some(addr) = next {
            self.connect(addr);
        }
    }

    fn connect(&mut self, addr: String) {
        let id = self.next_link;
        self.next_link += 1;
        self.actions.push(Action::Connect {
            link: id,
            addr: addr.clone(),
        });
        self.by_addr.insert(addr.clone(), id);
        let window = match self.cfg.policy {
            Policy::Subset => INITIAL_WINDOW,
            Policy::FullMesh => LINK_QUEUE,
        };
        self.links.insert(
            id,
            WorkerLink {
                addr,
                up: false,
                outstanding: 0,
                latency_ewma: None,
                measured: self.now,
                draining: false,
                window,
                idle_since: self.now,
                heard: self.now,
                suspect: false,
                probe: self.identity.is_none(),
            },
        );
    }

    /// Spares and former members idle past [`LINK_IDLE`] are closed (their slots on the
    /// worker go back to the ranks whose home it is).
    fn release_idle(&mut self) {
        if self.cfg.policy != Policy::Subset {
            return;
        }
        let now = self.now;
        let idle: Vec<LinkId> = self
            .links
            .iter()
            .filter(|(_, l)| {
                l.outstanding == 0
                    && !self.members.is_home(&l.addr)
                    && (now.duration_since(l.idle_since) >= LINK_IDLE
                        || !self.wanted.contains(&l.addr)
                        || (l.probe && self.identity.is_some()))
                    && (l.up || !self.wanted.contains(&l.addr))
            })
            .map(|(id, _)| *id)
            .collect();
        for id in idle {
            self.actions.push(Action::Close { link: id });
            self.remove_link(id);
        }
    }

    fn remove_link(&mut self, id: LinkId) -> Option<WorkerLink> {
        let l = self.links.remove(&id)?;
        if self.by_addr.get(&l.addr) == Some(&id) {
            self.by_addr.remove(&l.addr);
        }
        if l.up && !l.draining {
            self.live -= 1;
            self.metrics.workers.set(self.live as i64);
        }
        Some(l)
    }

    /// No new requests for `link` (it drains, or misbehaved).
    fn stop_using(&mut self, link: LinkId) {
        if let Some(l) = self.links.get_mut(&link) {
            if l.up && !l.draining {
                self.live -= 1;
                self.metrics.workers.set(self.live as i64);
            }
            l.draining = true;
        }
    }

    fn depth(&self) -> usize {
        match self.cfg.depth {
            Depth::OnDemand => usize::from(self.shared.asking.load(Ordering::Acquire)),
            Depth::Fixed(n) => n.max(1),
            Depth::Auto { max } => {
                let interval = match self.shared.interval_ns.load(Ordering::Relaxed) {
                    0 => None,
                    ns => Some(Duration::from_nanos(ns)),
                };
                let latency = self.latencies.quantile(0.9);
                match self.cfg.policy {
                    Policy::FullMesh => legacy_auto_depth(latency, interval, max),
                    Policy::Subset => {
                        let by_count = auto_depth(latency, interval, max);
                        let by_bytes = self.batch_bytes.map_or(by_count, |b| {
                            ((self.cfg.max_prefetch_bytes as f64 / b.max(1.0)) as usize).max(1)
                        });
                        by_count.min(by_bytes)
                    }
                }
            }
        }
    }

    fn issue(&mut self) {
        let depth = self.depth();
        self.metrics.depth.set(depth as i64);
        let consumed = self.shared.consumed.load(Ordering::Acquire);
        while self.next_issue < consumed.saturating_add(depth as u64) {
            self.pending.insert(self.next_issue, Pending::default());
            self.next_issue += 1;
        }
        let unassigned: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| p.attempts.is_empty())
            .map(|(pos, _)| *pos)
            .collect();
        let mut spill = false;
        for pos in unassigned {
            match self.choose(pos, false) {
                Choice::Link(link) => {
                    let probe = !self.members.spares.is_empty()
                        && self.links.get(&link).is_some_and(|l| l.suspect)
                        && self.may_duplicate();
                    self.send(pos, link, false);
                    // A suspect is probed with a position that also goes elsewhere: the first
                    // answer is delivered, so probing a worker still slow never makes the
                    // trainer wait. The duplicate is a hedge, paid from the budget (while it is
                    // empty `choose` gives a suspect a position only as a last resort, alone).
                    if probe {
                        if let Choice::Link(other) = self.choose(pos, true) {
                            self.send(pos, other, true);
                            self.spend_duplicate();
                            self.metrics.hedge(HedgeOutcome::Sent);
                        }
                    }
                }
                Choice::Wait => break,
                Choice::Spill => {
                    spill = true;
                    break;
                }
            }
        }
        let was = std::mem::replace(&mut self.spill, spill);
        if spill && !was {
            self.ensure_links();
        }
    }

    /// Requests unanswered past `request_timeout` are abandoned (cancelled; a late answer is
    /// dropped as unknown) and count as failed attempts: each is asked again, elsewhere first,
    /// until `max_attempts` turns it into the trainer's error.
    fn expire(&mut self) {
        let timeout = self.cfg.request_timeout;
        let now = self.now;
        let expired: Vec<u64> = self
            .in_flight
            .iter()
            .filter(|(_, f)| now.duration_since(f.sent) >= timeout)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            let Some((f, addr)) = self.abandon(id) else {
                continue;
            };
            self.shrink_window(f.link);
            self.metrics.retry(RetryReason::Deadline);
            let why = format!("no answer within {timeout:?} (request_timeout)");
            self.count_failure(f.position, id, &addr, &why);
        }
    }

    /// Forgets request `id` (telling its worker, under the subset policy); the request and
    /// its worker's address.
    fn abandon(&mut self, id: u64) -> Option<(InFlight, String)> {
        let f = self.in_flight.remove(&id)?;
        let addr = self.release_link(f.link);
        if self.cfg.policy == Policy::Subset && self.links.get(&f.link).is_some_and(|l| l.up) {
            self.actions.push(Action::Cancel {
                link: f.link,
                request_id: id,
            });
        }
        Some((f, addr))
    }

    fn send(&mut self, pos: u64, link_id: LinkId, hedge: bool) {
        let identity = self.identity.as_ref().expect("issued only with a plan");
        let bpe = identity.batches_per_epoch;
        let request_id = self.next_request;
        self.next_request += 1;
        let request = BatchRequest {
            request_id,
            plan_id: identity.plan_id,
            epoch: pos / bpe,
            global_batch: pos % bpe,
            rank: self.cfg.rank,
            world_size: self.cfg.world_size,
        };
        self.actions.push(Action::Send {
            link: link_id,
            request,
        });
        let link = self.links.get_mut(&link_id).expect("chosen from links");
        link.outstanding += 1;
        self.in_flight.insert(
            request_id,
            InFlight {
                link: link_id,
                position: pos,
                sent: self.now,
                hedge,
            },
        );
        let p = self.pending.get_mut(&pos).expect("pending");
        p.attempts.push(request_id);
        p.hedged |= hedge;
    }
}

mod answers;
mod choice;
mod failures;
mod refusals;
use choice::Choice;
use failures::Loss;
use refusals::Refusal;

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
