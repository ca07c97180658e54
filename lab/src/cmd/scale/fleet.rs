//! The simulated workers: connections, budgets, cores and NICs.

use super::*;

impl Sim {
    /// A worker on `node` (its NIC is the node's), in discovery at once if `listed`.
    pub(super) fn add_worker(&mut self, node: usize, listed: bool) -> usize {
        let i = self.workers.len();
        let addr = format!("10.{}.{}.{}:7700", i / 65536, (i / 256) % 256, i % 256);
        if self.nic_free.len() <= node {
            self.nic_free.resize(node + 1, 0);
        }
        self.workers.push(Worker {
            addr: addr.clone(),
            node,
            up: true,
            draining: false,
            silent: false,
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
        if listed {
            self.listed.insert(addr);
        }
        i
    }

    pub(super) fn connect(&mut self, rank: u32, link: LinkId, w: usize) {
        let worker = &mut self.workers[w];
        if worker.silent {
            // The SYN is dropped: the rank's connect times out.
            let error = format!("connect timed out after {CONNECT_TIMEOUT:?}");
            let at = self.now + ns(CONNECT_TIMEOUT - ONE_WAY);
            return self.at(
                at,
                Ev::ToRank {
                    rank,
                    event: Event::Down { link, error },
                },
            );
        }
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
                moved: self.now,
                unacked: false,
            },
        );
        let welcome = self.welcome.clone();
        self.tell_rank(rank, Event::Up { link, welcome });
    }

    pub(super) fn request(&mut self, conn: (u32, LinkId), req: BatchRequest) {
        if self.lost_to_silence(conn) {
            return;
        }
        let Some(c) = self.conns.get_mut(&conn) else {
            return; // closed meanwhile
        };
        c.moved = self.now;
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
    pub(super) fn admit(&mut self, conn: (u32, LinkId)) {
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

    /// Grants budget in FIFO order (each granted request's samples start their reads) and
    /// starts samples read on free cores.
    pub(super) fn run_worker(&mut self, w: usize) {
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
                    fetching: job.samples,
                    unstarted: 0,
                    unfinished: job.samples,
                    cancelled: false,
                    failed: false,
                },
            );
            let incarnation = worker.incarnation;
            for _ in 0..job.samples {
                let whole = self.a.gets_per_sample.floor();
                let extra = self.rng.gen::<f64>() < self.a.gets_per_sample - whole;
                let reads_left = whole as u32 + extra as u32;
                let ev = match reads_left {
                    0 => Ev::Fetched {
                        worker: w,
                        incarnation,
                        job: id,
                        ok: true,
                    },
                    _ => Ev::Get {
                        worker: w,
                        incarnation,
                        job: id,
                        reads_left,
                        made: 0,
                        since: self.now,
                    },
                };
                self.at(self.now, ev);
            }
        }
        while self.workers[w].free_cores > 0 {
            let worker = &mut self.workers[w];
            let Some(id) = worker.ready.pop_front() else {
                break;
            };
            let Some(r) = worker.running.get_mut(&id).filter(|r| r.unstarted > 0) else {
                continue; // cancelled
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

    pub(super) fn sample_done(&mut self, w: usize, incarnation: u32, id: u64) {
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
        self.samples_prepared += 1;
        self.complete(w, id);
        self.run_worker(w);
    }

    /// A read of a sample reaches the store, after `made` attempts throttled since `since`:
    /// served (the next read, or the sample joins the cores' queue, once its time has
    /// passed) or throttled (tried again after the worker's pause; the sample fails once it
    /// has been throttled too long).
    pub(super) fn get(&mut self, w: usize, incarnation: u32, id: u64, read: (u32, u32, T)) {
        let (reads_left, made, since) = read;
        let worker = &self.workers[w];
        let live = worker.incarnation == incarnation
            && worker.running.get(&id).is_some_and(|r| !r.cancelled);
        if !live {
            return; // the request was cancelled or its worker died: the read was dropped
        }
        let slowdown = worker.slowdown;
        self.store_gets += 1;
        let took = self.read_ns[self.rng.gen_range(0..self.read_ns.len())] * slowdown;
        let then = self.now + took as T;
        let fetched = |ok| Ev::Fetched {
            worker: w,
            incarnation,
            job: id,
            ok,
        };
        let get = |reads_left, made, since| Ev::Get {
            worker: w,
            incarnation,
            job: id,
            reads_left,
            made,
            since,
        };
        if self.store.admit(self.now) {
            return match reads_left {
                1 => self.at(then, fetched(true)),
                _ => self.at(then, get(reads_left - 1, 0, then)),
            };
        }
        self.throttled += 1;
        let made = made + 1;
        let waited = Duration::from_nanos(then - since);
        match store::retry_pause(made, waited, &mut self.rng) {
            Some(pause) => self.at(then + ns(pause), get(reads_left, made, since)),
            None => {
                self.failed_reads += 1;
                self.at(then, fetched(false));
            }
        }
    }

    /// A sample's reads are over: it waits for a core, or (a read failed) it is done and
    /// fails its request.
    pub(super) fn fetched(&mut self, w: usize, incarnation: u32, id: u64, ok: bool) {
        let worker = &mut self.workers[w];
        if worker.incarnation != incarnation {
            return;
        }
        let Some(r) = worker.running.get_mut(&id).filter(|r| !r.cancelled) else {
            return;
        };
        r.fetching -= 1;
        if ok {
            r.unstarted += 1;
            worker.ready.push_back(id);
        } else {
            r.failed = true;
            r.unfinished -= 1;
            self.complete(w, id);
        }
        self.run_worker(w);
    }

    /// Request `id` is done once none of its samples is read or prepared any more: dropped
    /// if cancelled, a transient error if a read failed, else its batch goes to the NIC.
    fn complete(&mut self, w: usize, id: u64) {
        let worker = &mut self.workers[w];
        let incarnation = worker.incarnation;
        if worker.running.get(&id).is_none_or(|r| r.unfinished > 0) {
            return;
        }
        let r = worker.running.remove(&id).expect("running");
        if r.cancelled {
            self.finish(w, r.job);
        } else if r.failed {
            let error = ErrorFrame {
                request_id: r.job.req.request_id,
                code: ErrorCode::Transient,
                message: "reading a sample: the store throttled it past every retry".into(),
            };
            self.answer(w, incarnation, r.job, Err(error));
            self.finish(w, r.job);
        } else {
            let node = self.workers[w].node;
            let bytes = r.job.samples as u64 * self.a.sample_bytes;
            let transfer = bytes as f64 * 8.0 / (self.a.nic_gbit * 1e9) * 1e9;
            let start = self.nic_free[node].max(self.now);
            self.nic_free[node] = start + transfer as T;
            let ev = Ev::Sent {
                worker: w,
                incarnation,
                job: r.job,
            };
            self.at(self.nic_free[node], ev);
        }
    }

    pub(super) fn sent(&mut self, w: usize, incarnation: u32, job: Job) {
        if self.workers[w].incarnation != incarnation {
            return;
        }
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
        if self.answer(w, incarnation, job, Ok((head, AlignedBuf::zeroed(0)))) {
            self.answers += 1;
        }
        self.finish(w, job);
    }

    /// Worker `w` answers `job`'s request; whether the answer reaches the rank.
    fn answer(
        &mut self,
        w: usize,
        incarnation: u32,
        job: Job,
        answer: Result<(BatchHead, AlignedBuf), ErrorFrame>,
    ) -> bool {
        if !self.reaches_rank(w, incarnation, job.conn) {
            return false;
        }
        let (rank, link) = job.conn;
        let request_id = job.req.request_id;
        let event = Event::Answer {
            link,
            request_id,
            answer,
        };
        self.tell_rank(rank, event);
        true
    }

    /// Whether what worker `w` sends on `conn` now arrives (the connection is this
    /// incarnation's, the worker not silent); it counts as the connection's activity.
    fn reaches_rank(&mut self, w: usize, incarnation: u32, conn: (u32, LinkId)) -> bool {
        let now = self.now;
        !self.workers[w].silent
            && self
                .conns
                .get_mut(&conn)
                .filter(|c| c.incarnation == incarnation)
                .map(|c| c.moved = now)
                .is_some()
    }

    /// A request's budget and connection slot are free again.
    pub(super) fn finish(&mut self, w: usize, job: Job) {
        self.workers[w].free_budget += job.samples;
        if let Some(c) = self.conns.get_mut(&job.conn) {
            c.preparing -= 1;
        }
        self.admit(job.conn);
        self.run_worker(w);
    }

    pub(super) fn cancel(&mut self, conn: (u32, LinkId), request_id: u64) {
        if self.lost_to_silence(conn) {
            return;
        }
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        c.moved = self.now;
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
        // Being prepared: the worker aborts it (as its task is): reads under way and samples
        // not started are dropped, running ones finish unused. Once sending, it goes out.
        let Some((&id, r)) = worker
            .running
            .iter_mut()
            .find(|(_, r)| r.job.conn == conn && r.job.req.request_id == request_id)
        else {
            return;
        };
        r.cancelled = true;
        r.unfinished -= r.unstarted + r.fetching;
        r.unstarted = 0;
        r.fetching = 0;
        if r.unfinished == 0 {
            let job = worker.running.remove(&id).expect("running").job;
            self.finish(w, job);
        }
    }

    /// The process dies: every connection drops, nothing in it is answered.
    pub(super) fn worker_down(&mut self, w: usize) {
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
        for key in self.conns_of(w) {
            self.conns.remove(&key);
            let (rank, link) = key;
            let error = "connection reset by peer".to_string();
            self.tell_rank(rank, Event::Down { link, error });
        }
    }

    /// The worker goes on running but nothing reaches it or leaves it, and no connection of
    /// it is closed: each rank's socket notices the silence by keepalive (if it holds nothing
    /// unacknowledged by then) or by its unacknowledged-bytes timeout.
    pub(super) fn silence(&mut self, w: usize) {
        self.workers[w].silent = true;
        let keepalive = KEEPALIVE_IDLE + KEEPALIVE_INTERVAL * KEEPALIVE_PROBES;
        let conns: Vec<(u32, LinkId)> = self.conns_of(w);
        for conn in conns {
            let unacked = false;
            self.at(self.now + ns(keepalive), Ev::LinkTimeout { conn, unacked });
        }
    }

    /// A frame from a rank to a silent worker is dropped (true); the rank's socket now waits
    /// for its acknowledgement.
    fn lost_to_silence(&mut self, conn: (u32, LinkId)) -> bool {
        let Some(c) = self.conns.get_mut(&conn) else {
            return false;
        };
        if !self.workers[c.worker].silent {
            return false;
        }
        if !std::mem::replace(&mut c.unacked, true) {
            let at = self.now + ns(Duration::from_secs_f64(self.a.unacked_timeout_s));
            self.at(
                at,
                Ev::LinkTimeout {
                    conn,
                    unacked: true,
                },
            );
        }
        true
    }

    /// A rank's socket to a silent worker gives up (keepalive defers to the unacknowledged
    /// timeout once something is unacknowledged).
    pub(super) fn link_timeout(&mut self, conn: (u32, LinkId), unacked: bool) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        if !self.workers[c.worker].silent || c.unacked != unacked {
            return;
        }
        self.drop_conn(conn);
        let (rank, link) = conn;
        let error = "connection timed out".to_string();
        self.at(
            self.now,
            Ev::ToRank {
                rank,
                event: Event::Down { link, error },
            },
        );
    }

    /// Each worker closes the connections on which it read nothing and had nothing to send
    /// for its idle timeout (`Server::read_requests`); the next sweep is scheduled.
    pub(super) fn idle_sweep(&mut self) {
        let idle = ns(Duration::from_secs_f64(self.a.idle_timeout_s));
        let now = self.now;
        let workers = &self.workers;
        let closed: Vec<(u32, LinkId)> = self
            .conns
            .iter()
            .filter(|(_, c)| {
                let worker = &workers[c.worker];
                worker.up
                    && !worker.silent
                    && worker.incarnation == c.incarnation
                    && c.preparing == 0
                    && c.waiting.is_empty()
                    && now.saturating_sub(c.moved) >= idle
            })
            .map(|(k, _)| *k)
            .collect();
        for conn in closed {
            self.drop_conn(conn);
            self.idle_closed += 1;
            let (rank, link) = conn;
            let error = "closed by the worker: nothing read and no answer ready".to_string();
            self.tell_rank(rank, Event::Down { link, error });
        }
        self.at(self.now + ns(IDLE_SWEEP), Ev::IdleSweep);
    }

    /// The connection is gone at the worker's end (its slot free) and at the rank's.
    pub(super) fn drop_conn(&mut self, conn: (u32, LinkId)) {
        if let Some(c) = self.conns.remove(&conn) {
            if self.workers[c.worker].incarnation == c.incarnation {
                self.workers[c.worker].connections -= 1;
            }
        }
    }

    fn conns_of(&self, w: usize) -> Vec<(u32, LinkId)> {
        self.conns
            .iter()
            .filter(|(_, c)| c.worker == w)
            .map(|(k, _)| *k)
            .collect()
    }
}
