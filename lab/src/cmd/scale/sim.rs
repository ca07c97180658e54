//! The event loop, the ranks (each a real scheduler) and the trainer's barrier.

use super::*;

impl Sim {
    pub(super) fn new(
        a: &ScaleArgs,
        shape: &[f64],
        reads: &[f64],
        ranks: u32,
        workers: usize,
        policy: Policy,
        scenario: Scenario,
    ) -> Sim {
        let global = ranks * a.samples_per_rank;
        let steps = scenario.steps(a, workers);
        let batches = steps + 8;
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
            steps,
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
            conns: BTreeMap::new(),
            nic_free: Vec::new(),
            sample_ns: shape.iter().map(|x| x * mean_sample_ns).collect(),
            read_ns: reads.iter().map(|s| s * 1e9).collect(),
            store: store::RateLimit::new(a.store_gets_per_s),
            store_gets: 0,
            throttled: 0,
            failed_reads: 0,
            answers: 0,
            samples_prepared: 0,
            // The worker's default: 8 per preprocessing thread, at least 32.
            max_samples_budget: (8 * CORES_PER_WORKER as u32).max(32),
            step_started: Vec::new(),
            compute_s: Vec::new(),
            listed_at_step: Vec::new(),
            ready_count: vec![0; steps as usize + 1],
            compute_done: 0,
            failed: false,
            load: vec![Vec::new(); steps as usize + 1],
            max_conns: 0,
            refused: 0,
            idle_closed: 0,
            event_step: None,
            rollout: VecDeque::new(),
        };
        for i in 0..workers {
            sim.add_worker(i / a.workers_per_node, true);
        }
        sim.at(ns(IDLE_SWEEP), Ev::IdleSweep);
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

    pub(super) fn at(&mut self, t: T, ev: Ev) {
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

    pub(super) fn instant(&self) -> Instant {
        self.base + Duration::from_nanos(self.now)
    }

    pub(super) fn run(mut self) -> Report {
        let wall = Instant::now();
        let steps = self.steps;
        // Nothing may run past the time the job should take, plus generous slack.
        let compute: f64 = (0..steps).map(|k| self.compute_s(k)).sum();
        let horizon = ns(Duration::from_secs_f64(
            self.a.start_skew_s + compute * 4.0 + 300.0,
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

    pub(super) fn handle(&mut self, ev: Ev) {
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
                self.drop_conn(conn);
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
                    let node = self.workers.len() / self.a.workers_per_node;
                    self.add_worker(node, true);
                }
            }
            Ev::LinkTimeout { conn, unacked } => self.link_timeout(conn, unacked),
            Ev::IdleSweep => self.idle_sweep(),
            Ev::NodeNotReady(node) => self.node_not_ready(node),
            Ev::Ready(w) => {
                let addr = self.workers[w].addr.clone();
                self.listed.insert(addr);
                self.replace_next();
            }
            Ev::Get {
                worker,
                incarnation,
                job,
                reads_left,
                made,
                since,
            } => self.get(worker, incarnation, job, (reads_left, made, since)),
            Ev::Fetched {
                worker,
                incarnation,
                job,
                ok,
            } => self.fetched(worker, incarnation, job, ok),
        }
    }

    /// The rank's DNS answer: the listed workers; it asks again in five seconds.
    pub(super) fn discover(&mut self, r: u32) {
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
    pub(super) fn wake(&mut self, r: u32) {
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

    pub(super) fn act(&mut self, r: u32, action: Action) {
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

    pub(super) fn tell_rank(&mut self, rank: u32, event: Event) {
        self.at(self.now + ns(ONE_WAY), Ev::ToRank { rank, event });
    }
    /// Step k starts once every rank holds batch k and step k-1's compute is done; then
    /// every rank takes it, and the scenario's event fires at the middle step.
    pub(super) fn check_barrier(&mut self, r: u32) {
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

    pub(super) fn start_step(&mut self, k: u64) {
        let interval = self
            .step_started
            .last()
            .map(|s| Duration::from_nanos(self.now - s));
        self.step_started.push(self.now);
        self.listed_at_step.push(self.listed.len());
        let compute = self.compute_s(k);
        self.compute_s.push(compute);
        self.compute_done = self.now + ns(Duration::from_secs_f64(compute));
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
        if k == scenario::event_at(&self.a) && self.event_step.is_none() {
            self.event_step = Some(k);
            self.fire();
        }
        if self.event_step.is_some_and(|e| k == e + BROWNOUT_STEPS) {
            self.end_brownout();
        }
        for r in 0..self.ranks.len() as u32 {
            self.wake(r);
        }
    }

    pub(super) fn report(self, wall_s: f64) -> Report {
        let steps_completed = self.step_started.len().saturating_sub(1) as u64;
        let efficiency_by_step: Vec<f64> = self
            .step_started
            .windows(2)
            .zip(&self.compute_s)
            .map(|(w, compute)| compute / ((w[1] - w[0]) as f64 / 1e9))
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
        let steps = steps_completed.max(1) as f64;
        let silent = self.metrics.retries.with_label_values(&["silent"]).get();
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
            hedges_per_step: hedges as f64 / steps,
            duplicates_per_answer: (hedges + silent) as f64 / self.answers.max(1) as f64,
            answers: self.answers,
            store_gets_per_sample: self.store_gets as f64 / self.samples_prepared.max(1) as f64,
            throttled_per_step: self.throttled as f64 / steps,
            failed_reads: self.failed_reads,
            silent_retries_per_step: silent as f64 / steps,
            restart_efficiency,
            steps_below_0_9_after_event: below,
            refused_connects_per_worker_s: self.refused as f64
                / self.workers.len() as f64
                / end_s.max(1e-9),
            links_closed_idle: self.idle_closed,
            exact_delivery: exact,
            wall_s,
        }
    }
}
