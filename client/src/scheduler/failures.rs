//! The bookkeeping of failures: attempts counted per position and given up after
//! `max_attempts`, lost links (their requests asked again, the worker dialled again with
//! backoff), and the errors that reach the trainer when no worker can serve.

use super::*;

impl Scheduler {
    /// The trainer gets `error` on its next call, ahead of any batch and without taking a
    /// position: queued, never dropped for a full channel (the queue keeps the first few; more
    /// of the same condition add nothing).
    pub(super) fn fail_trainer(&mut self, error: Error) {
        tracing::error!("{error}");
        if self.notices.len() < NOTICE_CAPACITY {
            self.notices.push_back(error);
        }
    }

    pub(super) fn fail_identity(&mut self, error: Error) {
        if !self.identity_taken && self.identity.is_none() && self.identity_result.is_none() {
            self.identity_result = Some(Err(error));
        }
    }

    /// `request_id` no longer stands for `position`, and `addr` is avoided for it from now
    /// on; the position, if it is still pending.
    pub(super) fn drop_attempt(
        &mut self,
        position: u64,
        request_id: u64,
        addr: &str,
    ) -> Option<&mut Pending> {
        let p = self.pending.get_mut(&position)?;
        p.attempts.retain(|id| *id != request_id);
        p.failed_on.push(addr.to_string());
        Some(p)
    }

    /// One failed attempt at `position` on `addr`: asked again elsewhere, or given up after
    /// `max_attempts` (then true: the trainer gets `why`).
    pub(super) fn count_failure(
        &mut self,
        position: u64,
        request_id: u64,
        addr: &str,
        why: &str,
    ) -> bool {
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
    pub(super) fn give_up(&mut self, position: u64, addr: &str, message: &str) {
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

    pub(super) fn on_down(&mut self, link: LinkId, error: String, loss: Loss) {
        let Some(l) = self.remove_link(link) else {
            return;
        };
        let was_up = l.up;
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
            self.metrics.retry(RetryReason::WorkerLost);
            match loss {
                Loss::Crashed => {
                    if self.count_failure(f.position, *id, &l.addr, &poison) {
                        self.metrics.error(WorkerErrorKind::Poison);
                    }
                }
                Loss::Removed => {
                    self.drop_attempt(f.position, *id, &l.addr);
                }
            }
        }
        let kind = if was_up {
            WorkerErrorKind::Lost
        } else {
            WorkerErrorKind::Connect
        };
        self.metrics.error(kind);
        if was_up && loss == Loss::Crashed {
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
            let at = self.now + backoff;
            if let Some((old, _)) = self.reconnect_at.insert(l.addr.clone(), (at, backoff)) {
                self.gates.remove(&(old, l.addr.clone()));
            }
            self.gates.insert((at, l.addr.clone()));
        }
    }

    /// Every position whose attempts are all on silent links (`Scheduler::silent_at`) is
    /// asked again elsewhere, as a lost worker's are, while the hedge budget allows: the
    /// attempts stay in flight (one wins if its worker answers after all), so each is a
    /// duplicate, and in a brownout every link looks silent. A silent link lags, so it is
    /// given nothing new; once its socket fails its positions move outside the budget.
    /// `retries_total{reason="silent"}`.
    pub(super) fn fail_over_silent(&mut self) {
        let now = self.now;
        let silent: Vec<LinkId> = self
            .silent_at()
            .into_iter()
            .filter(|(_, at)| *at <= now)
            .map(|(id, _)| id)
            .collect();
        if silent.is_empty() {
            return;
        }
        let on_silent = |id: &u64| {
            self.in_flight
                .get(id)
                .is_some_and(|f| silent.contains(&f.link))
        };
        let stranded: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| !p.attempts.is_empty() && p.attempts.iter().all(on_silent))
            .map(|(pos, _)| *pos)
            .collect();
        for pos in stranded {
            if !self.may_duplicate() {
                self.metrics.hedge(HedgeOutcome::OverBudget);
                return;
            }
            if self.send_elsewhere(pos) {
                self.spend_duplicate();
                self.metrics.retry(RetryReason::Silent);
            }
        }
    }

    pub(super) fn check_no_worker(&mut self) {
        if self.live > 0 {
            self.no_worker_since = None;
            return;
        }
        let since = *self.no_worker_since.get_or_insert(self.now);
        if self.now.duration_since(since) < self.cfg.no_worker_timeout {
            return;
        }
        self.no_worker_since = Some(self.now);
        let error = self.no_worker_error();
        self.fail_identity(error.clone());
        if self.identity.is_some() && !self.pending.is_empty() {
            self.fail_trainer(error);
        }
    }

    /// Why no worker can be used: a plan mismatch when that is every worker's problem (a
    /// misconfiguration to fix, not an outage to wait out), else each worker's problem.
    pub(super) fn no_worker_error(&self) -> Error {
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
pub(super) enum Loss {
    /// Closed or failed under us (a crash, a reset, a worker that stalled until killed).
    Crashed,
    /// Removed from discovery (scale-down): not the request's fault.
    Removed,
}
