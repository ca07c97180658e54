//! The rules of where a position goes: which link takes it (a home with room, else a spare,
//! else a lagging home), how a link's latency is judged (a peak-sensitive estimate that decays
//! towards the rank's typical latency), and when a straggler is hedged elsewhere.

use super::*;

impl Scheduler {
    /// A link took `elapsed` for a request (or at least that long, if it `lost` a hedge
    /// race): its estimate moves, up at once under the subset policy (a peak-sensitive
    /// average: one slow answer is believed now, quick ones bring it down gradually), by a
    /// fifth of the way otherwise. Losing, or answering past the lag limit, makes it suspect;
    /// answering in time clears that.
    pub(super) fn measured(&mut self, link: LinkId, elapsed: Duration, lost: bool) {
        let peak = self.cfg.policy == Policy::Subset;
        let typical = self.typical_latency();
        let limit = self.lag_limit(typical);
        let Some(l) = self.links.get(&link) else {
            return;
        };
        // Under the subset policy the estimate has been decaying since it was measured:
        // the new answer moves what it is now.
        let current = match l.latency_ewma {
            Some(_) if peak => Some(self.estimate(l, typical)),
            e => e,
        };
        let l = self.links.get_mut(&link).expect("looked up");
        if peak {
            let late = limit.is_some_and(|limit| elapsed.as_secs_f64() > limit);
            l.suspect = lost || late || (l.suspect && limit.is_none());
        }
        let s = elapsed.as_secs_f64();
        l.latency_ewma = Some(match current {
            Some(e) if !(peak && s > e) => 0.8 * e + 0.2 * s,
            _ => s,
        });
        l.measured = self.now;
    }

    pub(super) fn hedge_threshold(&self) -> Option<Duration> {
        self.cfg.hedge?.threshold(&self.latencies)
    }

    pub(super) fn hedge_head(&self) -> usize {
        self.cfg.hedge.map_or(0, |h| h.head_positions)
    }

    /// When the trainer will ask for `pos`, once its pace is known: the position it takes
    /// next is due one interval after the last take (now, if it is already waiting).
    pub(super) fn needed_at(&self, pos: u64) -> Option<Instant> {
        let (next, at) = self.last_take?;
        let interval = match self.shared.interval_ns.load(Ordering::Relaxed) {
            0 => return None,
            ns => Duration::from_nanos(ns),
        };
        if pos <= next && self.shared.asking.load(Ordering::Acquire) {
            return Some(self.now);
        }
        Some(at + interval * (pos.saturating_sub(next) + 1) as u32)
    }

    /// When a position's request, sent at `sent`, is hedged: once it straggles (older than
    /// `threshold`) and, under the subset policy with the trainer's pace known, only once a
    /// fresh request (at the p90 latency) would no longer arrive before the trainer needs
    /// it. A straggler with time to spare costs no duplicate work: at 4,096 ranks such
    /// hedges, a few per step, met on the same worker and overloaded it.
    pub(super) fn hedge_due(&self, pos: u64, sent: Instant, threshold: Duration) -> Instant {
        let straggling = sent + threshold;
        if self.cfg.policy != Policy::Subset {
            return straggling;
        }
        match (self.needed_at(pos), self.latencies.quantile(0.9)) {
            (Some(need), Some(fresh)) => straggling.max(need.checked_sub(fresh).unwrap_or(need)),
            _ => straggling,
        }
    }

    pub(super) fn hedge(&mut self) {
        let Some(threshold) = self.hedge_threshold() else {
            return;
        };
        let now = self.now;
        let stragglers: Vec<u64> = self
            .pending
            .iter()
            .take(self.hedge_head())
            .filter(|(_, p)| !p.hedged && p.attempts.len() == 1)
            .filter(|(pos, p)| {
                self.in_flight
                    .get(&p.attempts[0])
                    .is_some_and(|f| now >= self.hedge_due(**pos, f.sent, threshold))
            })
            .map(|(pos, _)| *pos)
            .collect();
        for pos in stragglers {
            if !self.may_duplicate() {
                self.metrics.hedge(HedgeOutcome::OverBudget);
                return;
            }
            if self.send_elsewhere(pos) {
                self.spend_duplicate();
                self.metrics.hedge(HedgeOutcome::Sent);
            }
        }
    }

    /// Whether the hedge budget allows one more duplicate of a position now (a hedge, a
    /// suspect's probe, a silent link's position): every duplicate is paid from it, so a
    /// fleet slow everywhere (a brownout) is asked at most `budget` more per answer. The
    /// full-mesh policy (the rules before the budget) is not budgeted.
    pub(super) fn may_duplicate(&self) -> bool {
        self.cfg.policy != Policy::Subset || self.hedges.available()
    }

    pub(super) fn spend_duplicate(&mut self) {
        if self.cfg.policy == Policy::Subset {
            self.hedges.spend();
        }
    }

    /// Sends `pos` once more, to a link other than those holding it, or dials a spare for it
    /// when there is none; whether it was sent.
    pub(super) fn send_elsewhere(&mut self, pos: u64) -> bool {
        match self.choose(pos, true) {
            Choice::Link(link) => {
                self.send(pos, link, true);
                true
            }
            Choice::Spill => {
                self.spill = true;
                self.ensure_links();
                false
            }
            Choice::Wait => false,
        }
    }

    /// Where `pos` goes: a home with room that is not lagging (avoiding workers that failed
    /// it), else the cheaper of a linked spare and a lagging home, else wait for a spare to
    /// connect; a hedge never goes where the position is.
    pub(super) fn choose(&self, pos: u64, hedge: bool) -> Choice {
        let p = &self.pending[&pos];
        let typical = self.typical_latency();
        let lag_limit = self.lag_limit(typical);
        // Slower than the limit by its answers or by what it has not answered yet (a worker
        // that turned slow keeps only what it holds), or a suspect already being probed or
        // not to be probed now. Only
        // a rank with spares reroutes around a lagging link: the rest of the workers is for
        // failures, and a rank with one link (few slots for many ranks) must not take
        // another's slot because it is slow.
        let may_lag = !self.members.spares.is_empty();
        // A suspect is given a position with a duplicate elsewhere (its probe), paid from the
        // hedge budget; while the budget is empty it is passed over for a link not suspect,
        // if the rank has one (when every link is suspect, the whole fleet is slow: a
        // brownout, where moving positions around only unbalances the workers).
        let trusted = || {
            self.links
                .values()
                .any(|l| l.up && !l.draining && !l.suspect)
        };
        let unprobed = |l: &WorkerLink| l.suspect && !self.may_duplicate() && trusted();
        let lagging = |id: &LinkId, l: &WorkerLink| {
            let slow = || {
                lag_limit.is_some_and(|limit| {
                    self.estimate(l, typical)
                        .max(self.oldest_wait(*id).as_secs_f64())
                        > limit
                })
            };
            may_lag && ((l.suspect && l.outstanding > 0) || unprobed(l) || slow())
        };
        let busy: Vec<LinkId> = p
            .attempts
            .iter()
            .filter_map(|id| self.in_flight.get(id).map(|f| f.link))
            .collect();
        let usable = |id: &LinkId, l: &WorkerLink| {
            l.up && !l.draining
                && !busy.contains(id)
                && l.outstanding < l.window
                && !p.refused_by.contains_key(&l.addr)
        };
        let fresh = |l: &WorkerLink| !p.failed_on.contains(&l.addr);
        let home = |l: &WorkerLink| self.members.is_home(&l.addr);
        let best = |filter: &dyn Fn(&LinkId, &WorkerLink) -> bool| {
            self.links
                .iter()
                .filter(|(id, l)| filter(id, l))
                .min_by(|a, b| self.order(a, b, typical))
                .map(|(id, _)| *id)
        };
        if let Some(id) = best(&|id, l| home(l) && usable(id, l) && fresh(l) && !lagging(id, l)) {
            return Choice::Link(id);
        }
        // A healthy home that is only full (or still connecting for the first time) will take
        // it soon: spilling would unbalance the workers.
        let home_will_take = self.members.homes.iter().any(|a| {
            let Some(id) = self.by_addr.get(a) else {
                return false;
            };
            let l = &self.links[id];
            let first_connect = !l.up && !self.problems.contains_key(a);
            !l.draining
                && !busy.contains(id)
                && fresh(l)
                && (l.up || first_connect)
                && !lagging(id, l)
        });
        if home_will_take && !hedge {
            return Choice::Wait;
        }
        // A linked spare, or a lagging home if it is cheaper still; with no spare linked, one
        // is dialled (a lagging home is the last resort below).
        let spare_linked = self
            .links
            .iter()
            .any(|(id, l)| !home(l) && usable(id, l) && fresh(l));
        if spare_linked {
            let cheaper = |id: &LinkId, l: &WorkerLink| {
                (!home(l) || lagging(id, l)) && usable(id, l) && fresh(l) && !unprobed(l)
            };
            if let Some(id) = best(&cheaper) {
                return Choice::Link(id);
            }
        }
        let more_to_try = self
            .members
            .spares
            .iter()
            .chain(&self.members.rest)
            .filter(|a| !p.refused_by.contains_key(*a))
            .any(|a| self.by_addr.get(a).is_none_or(|id| !self.links[id].up));
        if more_to_try && self.cfg.policy == Policy::Subset {
            return Choice::Spill;
        }
        // Nothing else is left: a worker that failed this position, rather than none.
        match best(&|id, l| usable(id, l)) {
            Some(id) => Choice::Link(id),
            None if home_will_take || self.cfg.policy == Policy::FullMesh => Choice::Wait,
            None => Choice::Spill,
        }
    }

    /// Which of two links takes a request first.
    pub(super) fn order(
        &self,
        a: &(&LinkId, &WorkerLink),
        b: &(&LinkId, &WorkerLink),
        typical: f64,
    ) -> std::cmp::Ordering {
        match self.cfg.policy {
            // A link with no latency yet goes first, then the fewer outstanding, then the
            // lowest id: the same on every rank.
            Policy::FullMesh => {
                let cost =
                    |l: &WorkerLink| (l.outstanding + 1) as f64 * l.latency_ewma.unwrap_or(0.0);
                cost(a.1)
                    .total_cmp(&cost(b.1))
                    .then(a.1.outstanding.cmp(&b.1.outstanding))
                    .then(a.0.cmp(b.0))
            }
            // The lower expected wait, (outstanding + 1) × estimate, where a link never
            // measured (or not lately) counts as the rank's typical link, and one whose
            // oldest request has been out longer counts as at least that slow (a worker
            // that turned slow answers nothing that would tell); ties per rank.
            Policy::Subset => {
                let cost = |(id, l): &(&LinkId, &WorkerLink)| {
                    let waited = self.oldest_wait(**id).as_secs_f64();
                    (l.outstanding + 1) as f64 * self.estimate(l, typical).max(waited)
                };
                cost(a).total_cmp(&cost(b)).then_with(|| {
                    topology::tiebreak(self.cfg.rank, &a.1.addr)
                        .cmp(&topology::tiebreak(self.cfg.rank, &b.1.addr))
                })
            }
        }
    }

    /// When each link that holds requests turns silent if nothing changes: it has answered
    /// nothing since its oldest was sent, for longer than any of the rank's recent answers
    /// took (× [`SILENT_FACTOR`]) and than the lag limit. A worker gone without a word (a
    /// partition, a lost node) is noticed here, in seconds, long before its socket's
    /// keepalive or unacknowledged-bytes timeout fails the link (30 s); a slow worker that
    /// still answers is lagging, not silent. (The lag limit alone, 4 × the median, took the
    /// tail of a healthy worker's service times for silence: `stoker-lab bench scale` asked
    /// 0.05 positions a step again in `steady`, none with this rule.) One pass over the
    /// requests in flight, the limit computed once.
    pub(super) fn silent_at(&self) -> HashMap<LinkId, Instant> {
        let limit = self.lag_limit(self.typical_latency()).and_then(|lag| {
            let longest = self.latencies.quantile(1.0)?.as_secs_f64();
            Some(Duration::from_secs_f64(lag.max(SILENT_FACTOR * longest)))
        });
        let Some(limit) = limit else {
            return HashMap::new();
        };
        let mut oldest: HashMap<LinkId, Instant> = HashMap::new();
        for f in self.in_flight.values() {
            let o = oldest.entry(f.link).or_insert(f.sent);
            *o = (*o).min(f.sent);
        }
        oldest
            .into_iter()
            .filter_map(|(id, sent)| Some((id, sent.max(self.links.get(&id)?.heard) + limit)))
            .collect()
    }

    /// How long the oldest request outstanding on `link` has waited.
    pub(super) fn oldest_wait(&self, link: LinkId) -> Duration {
        self.in_flight
            .values()
            .filter(|f| f.link == link)
            .map(|f| self.now.duration_since(f.sent))
            .max()
            .unwrap_or_default()
    }

    /// Past this latency (seconds) a link lags: LAG_FACTOR × the rank's median, under the
    /// subset policy once the median rests on enough answers.
    pub(super) fn lag_limit(&self, typical: f64) -> Option<f64> {
        (self.cfg.policy == Policy::Subset && self.latencies.len() >= LAG_OBSERVATIONS)
            .then_some(typical * LAG_FACTOR)
    }

    /// The rank's typical latency in seconds: what a link never measured (or not lately) is
    /// estimated at. The median of its recent answers (robust to one slow worker: its
    /// estimate decays towards the others', so it is tried again), else the mean of its
    /// links' estimates, else 1 s.
    pub(super) fn typical_latency(&self) -> f64 {
        if let Some(median) = self.latencies.quantile(0.5) {
            return median.as_secs_f64().max(1e-6);
        }
        let known: Vec<f64> = self.links.values().filter_map(|l| l.latency_ewma).collect();
        if known.is_empty() {
            1.0
        } else {
            known.iter().sum::<f64>() / known.len() as f64
        }
    }

    pub(super) fn estimate(&self, l: &WorkerLink, neutral: f64) -> f64 {
        let Some(e) = l.latency_ewma else {
            return neutral;
        };
        let age = self.now.duration_since(l.measured).as_secs_f64();
        let keep = 0.5f64.powf(age / ESTIMATE_HALF_LIFE.as_secs_f64());
        neutral + (e - neutral) * keep
    }
}

/// Where a position can go now.
pub(super) enum Choice {
    Link(LinkId),
    /// A home will take it once it has room: wait.
    Wait,
    /// No home can: a spare must be connected first.
    Spill,
}
