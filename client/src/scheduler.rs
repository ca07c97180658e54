//! The request scheduler: one task that owns every decision about which batch is requested
//! from which worker, and delivers answers to the trainer strictly in plan order.
//!
//! Positions number the batches of all epochs in plan order: position `p` is global batch
//! `p % B` of epoch `p / B` (B batches per epoch). The scheduler keeps the positions
//! `[consumed, consumed + depth)` requested or ready, sends each to the live worker with the
//! fewest outstanding requests, sends it again elsewhere when its worker fails, drains or
//! refuses, hedges a straggler at the head of the line, and abandons a request unanswered
//! past its deadline. The first answer for a position wins; later ones are dropped, so the
//! trainer sees every position exactly once.

use crate::batch::Batch;
use crate::discovery::WorkerSet;
use crate::error::Error;
use crate::link::{self, Event, LinkId};
use crate::metrics::ClientMetrics;
use crate::policy::{auto_depth, Depth, LatencyWindow};
use crate::LoaderConfig;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stoker_wire::{BatchRequest, ErrorCode, ErrorFrame, Welcome};
use tokio::sync::{mpsc, oneshot, watch, Notify};

/// What every worker must serve for its batches to be interchangeable: exactly the worker's
/// handshake (equal plan ids mean identical batch bytes).
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

/// What the scheduler hands the trainer side, tagged with the seek generation it belongs to.
pub struct Delivery {
    pub generation: u64,
    pub result: Result<Batch, Error>,
}

pub enum Control {
    /// Restart delivery at `position` (load_state_dict); older deliveries are stale.
    Seek { position: u64, generation: u64 },
}

struct WorkerLink {
    addr: String,
    /// Set once the handshake succeeded and the plan matched; `None` while connecting.
    requests: Option<mpsc::Sender<BatchRequest>>,
    task: tokio::task::JoinHandle<()>,
    outstanding: usize,
    latency_ewma: Option<f64>,
    /// The worker said it is draining: send it nothing more.
    draining: bool,
}

#[derive(Default)]
struct Pending {
    /// Request ids sent for this position and not yet answered.
    attempts: Vec<u64>,
    /// Workers that failed this position (avoided on retry while others exist).
    failed_on: Vec<String>,
    failures: u32,
    hedged: bool,
}

struct InFlight {
    link: LinkId,
    position: u64,
    sent: Instant,
    hedge: bool,
}

pub struct Scheduler {
    cfg: LoaderConfig,
    shared: Arc<Shared>,
    metrics: Arc<ClientMetrics>,
    identity: Option<PlanIdentity>,
    identity_tx: Option<oneshot::Sender<Result<PlanIdentity, Error>>>,
    links: HashMap<LinkId, WorkerLink>,
    next_link: LinkId,
    wanted: WorkerSet,
    /// Why each address is not serving, for error messages.
    problems: BTreeMap<String, Error>,
    reconnect_at: BTreeMap<String, (Instant, Duration)>,
    events_tx: mpsc::Sender<Event>,
    next_request: u64,
    in_flight: HashMap<u64, InFlight>,
    pending: BTreeMap<u64, Pending>,
    /// Answered positions waiting for their turn: a batch, or why it could not be had
    /// (delivered in plan order too, so an error never overtakes an earlier batch).
    ready: BTreeMap<u64, Result<Batch, Error>>,
    /// Errors for the trainer that concern no one batch (no worker, a refused token).
    notices: std::collections::VecDeque<Error>,
    next_issue: u64,
    next_deliver: u64,
    generation: u64,
    out: mpsc::Sender<Delivery>,
    latencies: LatencyWindow,
    no_worker_since: Option<Instant>,
    pool: crate::buffer::BufferPool,
}

/// Events from all links at once.
const EVENT_QUEUE: usize = 1024;
/// Errors kept for the trainer while the delivery channel is full.
const NOTICE_CAPACITY: usize = 4;
const RECONNECT_MIN: Duration = Duration::from_millis(200);
const RECONNECT_MAX: Duration = Duration::from_secs(5);

pub struct Handles {
    pub identity: oneshot::Receiver<Result<PlanIdentity, Error>>,
    pub deliveries: mpsc::Receiver<Delivery>,
    pub control: mpsc::Sender<Control>,
}

impl Scheduler {
    /// Spawns the scheduler on the current runtime.
    pub fn spawn(
        cfg: LoaderConfig,
        workers: watch::Receiver<WorkerSet>,
        shared: Arc<Shared>,
        metrics: Arc<ClientMetrics>,
    ) -> Handles {
        let (s, handles, events_rx, control_rx) = Scheduler::new(cfg, shared, metrics);
        tokio::spawn(s.run(workers, events_rx, control_rx));
        handles
    }

    /// The scheduler and its channels, not yet running (the state-machine tests drive it
    /// event by event).
    fn new(
        cfg: LoaderConfig,
        shared: Arc<Shared>,
        metrics: Arc<ClientMetrics>,
    ) -> (
        Scheduler,
        Handles,
        mpsc::Receiver<Event>,
        mpsc::Receiver<Control>,
    ) {
        // Deliveries never exceed the window, so this capacity is never the binding limit.
        let (out, deliveries) = mpsc::channel(cfg.depth.max() + 1);
        let (control_tx, control_rx) = mpsc::channel(4);
        let (identity_tx, identity) = oneshot::channel();
        let (events_tx, events_rx) = mpsc::channel(EVENT_QUEUE);
        let s = Scheduler {
            next_issue: 0,
            next_deliver: 0,
            cfg,
            shared,
            metrics,
            identity: None,
            identity_tx: Some(identity_tx),
            links: HashMap::new(),
            next_link: 1,
            wanted: WorkerSet::new(),
            problems: BTreeMap::new(),
            reconnect_at: BTreeMap::new(),
            events_tx,
            next_request: 1,
            in_flight: HashMap::new(),
            pending: BTreeMap::new(),
            ready: BTreeMap::new(),
            notices: Default::default(),
            generation: 0,
            out,
            latencies: LatencyWindow::default(),
            no_worker_since: Some(Instant::now()),
            // Enough to recycle what the trainer releases while the window refills.
            pool: crate::buffer::BufferPool::new(4),
        };
        let handles = Handles {
            identity,
            deliveries,
            control: control_tx,
        };
        (s, handles, events_rx, control_rx)
    }

    async fn run(
        mut self,
        mut workers: watch::Receiver<WorkerSet>,
        mut events: mpsc::Receiver<Event>,
        mut control: mpsc::Receiver<Control>,
    ) {
        let shared = self.shared.clone();
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.apply_worker_set(workers.borrow_and_update().clone());
        loop {
            self.step();
            if self.out.is_closed() {
                break; // the loader is gone
            }
            tokio::select! {
                Some(ev) = events.recv() => self.on_event(ev),
                changed = workers.changed() => match changed {
                    Ok(()) => self.apply_worker_set(workers.borrow_and_update().clone()),
                    Err(_) => self.apply_worker_set(WorkerSet::new()),
                },
                Some(c) = control.recv() => self.on_control(c),
                _ = shared.wake.notified() => {}
                _ = tick.tick() => {}
            }
        }
        for l in self.links.values() {
            l.task.abort();
        }
    }

    /// Everything that follows from the current state: connect, expire, issue, hedge,
    /// deliver.
    fn step(&mut self) {
        self.reconnect_due();
        self.check_no_worker();
        if self.identity.is_some() {
            self.expire();
            self.issue();
            self.hedge();
            self.deliver();
        }
        self.metrics.in_flight.set(self.in_flight.len() as i64);
        self.metrics.workers.set(self.live_links().count() as i64);
    }

    fn live_links(&self) -> impl Iterator<Item = (&LinkId, &WorkerLink)> {
        self.links
            .iter()
            .filter(|(_, l)| l.requests.is_some() && !l.draining)
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
                auto_depth(self.latencies.quantile(0.9), interval, max)
            }
        }
    }

    fn issue(&mut self) {
        let depth = self.depth();
        self.metrics.depth.set(depth as i64);
        let consumed = self.shared.consumed.load(Ordering::Acquire);
        while self.next_issue < consumed + depth as u64 {
            self.pending.insert(self.next_issue, Pending::default());
            self.next_issue += 1;
        }
        let unassigned: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| p.attempts.is_empty())
            .map(|(pos, _)| *pos)
            .collect();
        for pos in unassigned {
            if !self.send(pos, false) {
                break; // no live worker; try again on the next event
            }
        }
    }

    /// Requests unanswered past `request_timeout` are abandoned (a late answer is dropped as
    /// unknown) and count as failed attempts: each is asked again, elsewhere first, until
    /// `max_attempts` turns it into the trainer's error.
    fn expire(&mut self) {
        let timeout = self.cfg.request_timeout;
        let now = Instant::now();
        let expired: Vec<u64> = self
            .in_flight
            .iter()
            .filter(|(_, f)| now.duration_since(f.sent) > timeout)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            let f = self.in_flight.remove(&id).expect("listed");
            let addr = self.release_link(f.link);
            self.metrics.retries.with_label_values(&["deadline"]).inc();
            let why = format!("no answer within {timeout:?} (request_timeout)");
            self.count_failure(f.position, id, &addr, &why);
        }
    }

    fn hedge(&mut self) {
        let Some(policy) = self.cfg.hedge else {
            return;
        };
        let Some(threshold) = policy.threshold(&self.latencies) else {
            return;
        };
        if self.live_links().count() < 2 {
            return;
        }
        let now = Instant::now();
        let stragglers: Vec<u64> = self
            .pending
            .iter()
            .take(policy.head_positions)
            .filter(|(_, p)| !p.hedged && p.attempts.len() == 1)
            .filter(|(_, p)| {
                self.in_flight
                    .get(&p.attempts[0])
                    .is_some_and(|f| now.duration_since(f.sent) > threshold)
            })
            .map(|(pos, _)| *pos)
            .collect();
        for pos in stragglers {
            if self.send(pos, true) {
                self.metrics.hedges.with_label_values(&["sent"]).inc();
            }
        }
    }

    /// Picks a worker for `pos` and sends the request; false when no worker can take it.
    fn send(&mut self, pos: u64, hedge: bool) -> bool {
        let identity = self.identity.as_ref().expect("issued only with a plan");
        let p = &self.pending[&pos];
        let busy_links: Vec<LinkId> = p
            .attempts
            .iter()
            .filter_map(|id| self.in_flight.get(id).map(|f| f.link))
            .collect();
        let candidates = || self.live_links().filter(|(id, _)| !busy_links.contains(id));
        // Avoid workers that already failed this position, unless nothing else is left.
        let fresh = candidates()
            .filter(|(_, l)| !p.failed_on.contains(&l.addr))
            .min_by(|a, b| load_order(a.1, b.1).then(a.0.cmp(b.0)));
        let chosen =
            fresh.or_else(|| candidates().min_by(|a, b| load_order(a.1, b.1).then(a.0.cmp(b.0))));
        let Some((&link_id, _)) = chosen else {
            return false;
        };
        let bpe = identity.batches_per_epoch;
        let request_id = self.next_request;
        self.next_request += 1;
        let req = BatchRequest {
            request_id,
            plan_id: identity.plan_id,
            epoch: pos / bpe,
            global_batch: pos % bpe,
            rank: self.cfg.rank,
            world_size: self.cfg.world_size,
        };
        let link = self.links.get_mut(&link_id).expect("chosen from links");
        let sent = link
            .requests
            .as_ref()
            .is_some_and(|tx| tx.try_send(req).is_ok());
        if !sent {
            // Its queue is full or its connection is gone: the Down event will follow.
            link.draining = true;
            return false;
        }
        link.outstanding += 1;
        self.in_flight.insert(
            request_id,
            InFlight {
                link: link_id,
                position: pos,
                sent: Instant::now(),
                hedge,
            },
        );
        let p = self.pending.get_mut(&pos).expect("pending");
        p.attempts.push(request_id);
        p.hedged |= hedge;
        true
    }

    fn deliver(&mut self) {
        while self.out.capacity() > 0 {
            // Errors that concern no one batch go first and take no position.
            if let Some(e) = self.notices.pop_front() {
                let _ = self.out.try_send(Delivery {
                    generation: self.generation,
                    result: Err(e),
                });
                continue;
            }
            let Some(result) = self.ready.remove(&self.next_deliver) else {
                break;
            };
            let d = Delivery {
                generation: self.generation,
                result,
            };
            // Only this task sends, and there is room: this cannot fail but by a closed loader.
            let _ = self.out.try_send(d);
            self.next_deliver += 1;
        }
    }

    /// The trainer gets `error` on its next call, ahead of any batch and without taking a
    /// position: queued when the delivery channel is full, never dropped for it (the queue
    /// keeps the first few; more of the same condition add nothing).
    fn fail_trainer(&mut self, error: Error) {
        tracing::error!("{error}");
        if self.notices.len() < NOTICE_CAPACITY {
            self.notices.push_back(error);
        }
        self.deliver();
    }

    fn on_control(&mut self, c: Control) {
        match c {
            Control::Seek {
                position,
                generation,
            } => {
                // Answers for the old window still arrive; they find no pending position.
                self.pending.clear();
                self.ready.clear();
                self.notices.clear();
                self.next_issue = position;
                self.next_deliver = position;
                self.generation = generation;
            }
        }
    }

    fn on_event(&mut self, ev: Event) {
        match ev {
            Event::Up {
                link,
                welcome,
                requests,
            } => self.on_up(link, welcome, requests),
            Event::Refused { link, error } => {
                let Some(l) = self.links.get(&link) else {
                    return;
                };
                let addr = l.addr.clone();
                self.metrics.errors.with_label_values(&["refused"]).inc();
                let refusal = Error::Unauthorized {
                    worker: addr.clone(),
                    reason: error.message,
                };
                self.problems.insert(addr, refusal.clone());
                if error.code == ErrorCode::Unauthorized {
                    // Retrying cannot fix a token; say so at once.
                    self.fail_identity(refusal.clone());
                    self.fail_trainer(refusal);
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

    fn fail_identity(&mut self, error: Error) {
        if let Some(tx) = self.identity_tx.take() {
            let _ = tx.send(Err(error));
        }
    }

    fn on_up(&mut self, link: LinkId, offered: Welcome, requests: mpsc::Sender<BatchRequest>) {
        let Some(l) = self.links.get_mut(&link) else {
            return;
        };
        let mismatch = match (&self.identity, self.cfg.state.map(|s| s.plan_id)) {
            (Some(have), _) if *have != offered => Some(have.plan_id),
            (None, Some(want)) if want != offered.plan_id => Some(want),
            _ => None,
        };
        if let Some(want) = mismatch {
            // Batches from another plan or dataset version would corrupt the order: never
            // use this worker (its sender is dropped, which closes the connection).
            let msg = format!(
                "worker {} serves plan {:016x} ({}), this loader needs plan {want:016x}",
                l.addr, offered.plan_id, offered.description
            );
            tracing::warn!("{msg}");
            self.metrics
                .errors
                .with_label_values(&["plan_mismatch"])
                .inc();
            self.problems
                .insert(l.addr.clone(), Error::PlanMismatch(msg));
            l.task.abort();
            return;
        }
        tracing::debug!("worker {} is up", l.addr);
        l.requests = Some(requests);
        self.problems.remove(&l.addr);
        self.reconnect_at.remove(&l.addr);
        if self.identity.is_none() {
            let (epoch, batch) = self.cfg.state.map_or((0, 0), |s| (s.epoch, s.next_batch));
            self.next_issue = epoch * offered.batches_per_epoch + batch;
            self.next_deliver = self.next_issue;
            self.shared
                .consumed
                .store(self.next_issue, Ordering::Release);
            self.identity = Some(offered.clone());
            if let Some(tx) = self.identity_tx.take() {
                let _ = tx.send(Ok(offered));
            }
        }
    }

    fn on_answer(
        &mut self,
        link: LinkId,
        request_id: u64,
        answer: Result<(stoker_wire::BatchHead, crate::buffer::AlignedBuf), ErrorFrame>,
    ) {
        let Some(f) = self.in_flight.remove(&request_id) else {
            if let Err(e) = answer {
                // request id 0: about the connection itself.
                tracing::warn!("worker error: {}", e.message);
            }
            return;
        };
        let addr = self.release_link(link);
        let elapsed = f.sent.elapsed();
        match answer {
            Ok((head, buf)) => {
                self.metrics.payload_bytes.inc_by(buf.len() as u64);
                self.latencies.record(elapsed);
                self.metrics
                    .worker_latency
                    .with_label_values(&[&addr])
                    .observe(elapsed.as_secs_f64());
                if let Some(l) = self.links.get_mut(&link) {
                    let s = elapsed.as_secs_f64();
                    l.latency_ewma = Some(l.latency_ewma.map_or(s, |e| 0.8 * e + 0.2 * s));
                }
                let checked = match self.wrong_answer(&head.request, f.position) {
                    Some(why) => Err(("wrong_batch", why)),
                    None => {
                        Batch::new(head, buf, addr.clone()).map_err(|why| ("malformed_batch", why))
                    }
                };
                let batch = match checked {
                    Ok(batch) => batch,
                    Err((kind, why)) => {
                        // Never deliver it: this worker is not trusted again, the batch is
                        // asked for elsewhere.
                        self.metrics.errors.with_label_values(&[kind]).inc();
                        if let Some(l) = self.links.get_mut(&link) {
                            l.draining = true;
                        }
                        self.count_failure(f.position, request_id, &addr, &why);
                        return;
                    }
                };
                let Some(p) = self.pending.remove(&f.position) else {
                    return; // a hedge lost the race, or a seek made it stale
                };
                if f.hedge {
                    self.metrics.hedges.with_label_values(&["won"]).inc();
                }
                // A duplicate still in flight will find no pending position and be dropped.
                drop(p);
                self.ready.insert(f.position, Ok(batch));
            }
            Err(e) if !self.pending.contains_key(&f.position) => {
                // A hedge already won, or a seek made it stale: nothing to do.
                tracing::debug!("late error from {addr}: {}", e.message);
            }
            Err(e) => match e.code {
                ErrorCode::Unavailable | ErrorCode::PlanMismatch => {
                    // Draining, or it restarted with another plan: never ask it again.
                    if let Some(l) = self.links.get_mut(&link) {
                        l.draining = true;
                    }
                    let reason = if e.code == ErrorCode::Unavailable {
                        "draining"
                    } else {
                        "plan_mismatch"
                    };
                    self.metrics.retries.with_label_values(&[reason]).inc();
                    self.count_failure(f.position, request_id, &addr, &e.message);
                }
                ErrorCode::Transient => {
                    // The store failed, not the data: ask again (elsewhere first).
                    self.metrics.retries.with_label_values(&["transient"]).inc();
                    self.count_failure(f.position, request_id, &addr, &e.message);
                }
                ErrorCode::Unauthorized | ErrorCode::BadRequest | ErrorCode::Failed => {
                    // Another worker would answer the same: tell the trainer.
                    self.metrics.errors.with_label_values(&["answer"]).inc();
                    self.give_up(f.position, &addr, &e.message);
                }
            },
        }
    }

    /// Why a batch head does not answer `position` (plan, epoch, batch, rank or world size
    /// differ), if it does not.
    fn wrong_answer(&self, got: &BatchRequest, position: u64) -> Option<String> {
        let plan = self.identity.as_ref()?;
        let bpe = plan.batches_per_epoch.max(1);
        let want = (
            plan.plan_id,
            position / bpe,
            position % bpe,
            self.cfg.rank,
            self.cfg.world_size,
        );
        let have = (
            got.plan_id,
            got.epoch,
            got.global_batch,
            got.rank,
            got.world_size,
        );
        (have != want).then(|| {
            format!(
                "answered (plan {:016x}, epoch {}, batch {}, rank {}/{}) for (plan {:016x}, epoch {}, batch {}, rank {}/{})",
                have.0, have.1, have.2, have.3, have.4, want.0, want.1, want.2, want.3, want.4
            )
        })
    }

    /// One request fewer outstanding on `link`; its address (empty if the link is gone).
    fn release_link(&mut self, link: LinkId) -> String {
        match self.links.get_mut(&link) {
            Some(l) => {
                l.outstanding = l.outstanding.saturating_sub(1);
                l.addr.clone()
            }
            None => String::new(),
        }
    }

    /// `request_id` no longer stands for `position`, and `addr` is avoided for it from now
    /// on; the position, if it is still pending.
    fn drop_attempt(&mut self, position: u64, request_id: u64, addr: &str) -> Option<&mut Pending> {
        let p = self.pending.get_mut(&position)?;
        p.attempts.retain(|id| *id != request_id);
        p.failed_on.push(addr.to_string());
        Some(p)
    }

    /// One failed attempt at `position` on `addr`: asked again elsewhere, or given up after
    /// `max_attempts` (then true: the trainer gets `why`).
    fn count_failure(&mut self, position: u64, request_id: u64, addr: &str, why: &str) -> bool {
        let max_attempts = self.cfg.max_attempts.max(1);
        let Some(p) = self.drop_attempt(position, request_id, addr) else {
            return false;
        };
        p.failures += 1;
        let exhausted = p.failures >= max_attempts;
        if exhausted {
            self.give_up(position, addr, why);
        }
        exhausted
    }

    /// The trainer gets an error for `position`, in its turn.
    fn give_up(&mut self, position: u64, addr: &str, message: &str) {
        self.pending.remove(&position);
        let bpe = self.identity.as_ref().map_or(1, |i| i.batches_per_epoch);
        let error = Error::BatchFailed {
            epoch: position / bpe,
            batch: position % bpe,
            rank: self.cfg.rank,
            world_size: self.cfg.world_size,
            worker: addr.to_string(),
            reason: message.to_string(),
        };
        tracing::error!("{error}");
        self.ready.insert(position, Err(error));
    }

    fn on_down(&mut self, link: LinkId, error: String, loss: Loss) {
        let Some(l) = self.links.remove(&link) else {
            return;
        };
        let was_up = l.requests.is_some();
        let lost: Vec<u64> = self
            .in_flight
            .iter()
            .filter(|(_, f)| f.link == link)
            .map(|(id, _)| *id)
            .collect();
        // A request that kills or stalls every worker it reaches would otherwise be retried
        // forever: a crash while it was in flight counts as an attempt.
        let poison = format!(
            "the connection to the worker was lost {} times while this batch was being \
             prepared (last: {error}); a sample of it may crash or stall workers",
            self.cfg.max_attempts.max(1)
        );
        for id in &lost {
            let f = self.in_flight.remove(id).expect("listed");
            if !self.pending.contains_key(&f.position) {
                continue; // answered elsewhere already
            }
            self.metrics
                .retries
                .with_label_values(&["worker_lost"])
                .inc();
            match loss {
                Loss::Crashed => {
                    if self.count_failure(f.position, *id, &l.addr, &poison) {
                        self.metrics.errors.with_label_values(&["poison"]).inc();
                    }
                }
                Loss::Removed => {
                    self.drop_attempt(f.position, *id, &l.addr);
                }
            }
        }
        let kind = if was_up { "lost" } else { "connect" };
        self.metrics.errors.with_label_values(&[kind]).inc();
        if was_up {
            tracing::warn!(
                "worker {} lost ({error}); {} requests go to other workers",
                l.addr,
                lost.len()
            );
        }
        self.problems
            .entry(l.addr.clone())
            .or_insert_with(|| Error::Internal(format!("worker {}: {error}", l.addr)));
        if self.wanted.contains(&l.addr) {
            let backoff = self
                .reconnect_at
                .get(&l.addr)
                .map_or(RECONNECT_MIN, |(_, b)| (*b * 2).min(RECONNECT_MAX));
            self.reconnect_at
                .insert(l.addr.clone(), (Instant::now() + backoff, backoff));
        }
    }

    fn apply_worker_set(&mut self, set: WorkerSet) {
        let gone: Vec<LinkId> = self
            .links
            .iter()
            .filter(|(_, l)| !set.contains(&l.addr))
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            if let Some(l) = self.links.get(&id) {
                l.task.abort();
            }
            self.on_down(id, "removed from discovery".into(), Loss::Removed);
        }
        self.reconnect_at.retain(|a, _| set.contains(a));
        self.problems.retain(|a, _| set.contains(a));
        let have: WorkerSet = self.links.values().map(|l| l.addr.clone()).collect();
        for addr in set.iter().filter(|a| !have.contains(*a)) {
            if !self.reconnect_at.contains_key(addr) {
                self.connect(addr.clone());
            }
        }
        self.wanted = set;
    }

    fn connect(&mut self, addr: String) {
        let id = self.next_link;
        self.next_link += 1;
        let task = tokio::spawn(link::run(
            id,
            addr.clone(),
            self.cfg.token.clone(),
            self.events_tx.clone(),
            self.pool.clone(),
        ));
        self.links.insert(
            id,
            WorkerLink {
                addr,
                requests: None,
                task,
                outstanding: 0,
                latency_ewma: None,
                draining: false,
            },
        );
    }

    fn reconnect_due(&mut self) {
        let now = Instant::now();
        let due: Vec<String> = self
            .reconnect_at
            .iter()
            .filter(|(a, (at, _))| *at <= now && !self.links.values().any(|l| &l.addr == *a))
            .map(|(a, _)| a.clone())
            .collect();
        for addr in due {
            // Keep the backoff entry: it grows if this attempt fails too.
            if let Some((at, b)) = self.reconnect_at.get_mut(&addr) {
                *at = now + *b;
            }
            self.connect(addr);
        }
    }

    fn check_no_worker(&mut self) {
        if self.live_links().next().is_some() {
            self.no_worker_since = None;
            return;
        }
        let since = *self.no_worker_since.get_or_insert_with(Instant::now);
        if since.elapsed() < self.cfg.no_worker_timeout {
            return;
        }
        self.no_worker_since = Some(Instant::now());
        let error = self.no_worker_error();
        self.fail_identity(error.clone());
        if self.identity.is_some() && !self.pending.is_empty() {
            self.fail_trainer(error);
        }
    }

    /// Why no worker can be used: a plan mismatch when that is every worker's problem (a
    /// misconfiguration to fix, not an outage to wait out), else each worker's problem.
    fn no_worker_error(&self) -> Error {
        let why = |problems: Vec<String>| problems.join("; ");
        let all_mismatched = !self.problems.is_empty()
            && self
                .problems
                .values()
                .all(|p| matches!(p, Error::PlanMismatch(_)));
        if all_mismatched {
            return Error::PlanMismatch(why(self
                .problems
                .values()
                .map(Error::to_string)
                .collect()));
        }
        Error::NoWorker {
            timeout: self.cfg.no_worker_timeout,
            why: if self.problems.is_empty() {
                "discovery lists no workers".to_string()
            } else {
                why(self.problems.values().map(Error::to_string).collect())
            },
        }
    }
}

/// How a connection went away, for counting attempts.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Loss {
    /// Closed or failed under us (a crash, a reset, a worker that stalled until killed).
    Crashed,
    /// Removed from discovery (scale-down): not the request's fault.
    Removed,
}

/// The lower expected wait first: (outstanding + 1) × recent latency, so a slow worker gets
/// fewer requests; a worker with no latency yet goes first (it has to be tried), then the
/// fewer outstanding requests.
fn load_order(a: &WorkerLink, b: &WorkerLink) -> std::cmp::Ordering {
    let cost = |l: &WorkerLink| (l.outstanding + 1) as f64 * l.latency_ewma.unwrap_or(0.0);
    cost(a)
        .total_cmp(&cost(b))
        .then(a.outstanding.cmp(&b.outstanding))
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
