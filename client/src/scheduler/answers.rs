//! What an answer does: a worker coming up (the plan checked, the members and depth learned),
//! a batch checked and put in its place in plan order, an error frame turned into a retry
//! elsewhere or the trainer's error.

use super::*;

impl Scheduler {
    pub(super) fn on_up(&mut self, link: LinkId, offered: Welcome) {
        let Some(l) = self.links.get_mut(&link) else {
            return;
        };
        let mismatch = match (&self.identity, self.cfg.state.map(|s| s.plan_id)) {
            (Some(have), _) if !have.same_plan(&offered) => Some(have.plan_id),
            (None, Some(want)) if want != offered.plan_id => Some(want),
            _ => None,
        };
        if let Some(want) = mismatch {
            // Batches from another plan or dataset version would corrupt the order: never
            // use this worker.
            let msg = format!(
                "worker {} serves plan {:016x} ({}), this loader needs plan {want:016x}",
                l.addr, offered.plan_id, offered.description
            );
            tracing::warn!("{msg}");
            self.metrics.error(WorkerErrorKind::PlanMismatch);
            let addr = l.addr.clone();
            self.problems.insert(addr, Error::PlanMismatch(msg));
            // Kept as a link that is never used (so it is not dialled again), closed.
            l.draining = true;
            l.up = true;
            self.actions.push(Action::Close { link });
            return;
        }
        tracing::debug!("worker {} is up", l.addr);
        l.up = true;
        l.idle_since = self.now;
        l.heard = self.now;
        let addr = l.addr.clone();
        self.live += 1;
        self.metrics.workers.set(self.live as i64);
        self.problems.remove(&addr);
        if let Some((at, _)) = self.reconnect_at.remove(&addr) {
            self.gates.remove(&(at, addr));
        }
        if self.identity.is_none() {
            let (epoch, batch) = self.cfg.state.map_or((0, 0), |s| (s.epoch, s.next_batch));
            // A state past the last position is refused by the loader before it takes a
            // batch (`check_state`); until then the scheduler must not overflow on it.
            self.next_issue = offered.position(epoch, batch).unwrap_or(u64::MAX);
            self.next_deliver = self.next_issue;
            self.shared
                .consumed
                .store(self.next_issue, Ordering::Release);
            self.identity = Some(offered.clone());
            if !self.identity_taken {
                self.identity_result = Some(Ok(offered));
            }
            // The workers' hints (connection limit, links per rank) are known now.
            self.recompute_members();
            self.dial_homes();
        }
    }

    pub(super) fn on_answer(
        &mut self,
        link: LinkId,
        request_id: u64,
        answer: Result<(BatchHead, crate::buffer::AlignedBuf), ErrorFrame>,
    ) {
        if let Some(l) = self.links.get_mut(&link) {
            l.heard = self.now;
        }
        let Some(f) = self.in_flight.remove(&request_id) else {
            if let Err(e) = answer {
                // request id 0: about the connection itself.
                tracing::warn!("worker error: {}", e.message);
            }
            return;
        };
        let addr = self.release_link(link);
        let elapsed = self.now.duration_since(f.sent);
        match answer {
            Ok((head, buf)) => {
                self.metrics.payload_bytes.inc_by(buf.len() as u64);
                self.latencies.record(elapsed);
                self.hedges.earn();
                let bytes = buf.len() as f64;
                self.batch_bytes = Some(self.batch_bytes.map_or(bytes, |b| 0.8 * b + 0.2 * bytes));
                self.metrics.request_latency.observe(elapsed.as_secs_f64());
                self.measured(link, elapsed, false);
                if let Some(l) = self.links.get_mut(&link) {
                    if l.window < LINK_QUEUE {
                        l.window += 1;
                    }
                }
                let checked = match (self.wrong_answer(&head.request, f.position), &self.identity) {
                    (Some(why), _) => Err((RejectReason::WrongBatch, why)),
                    (None, Some(plan)) => Batch::new(head, buf, addr.clone(), &plan.media),
                    (None, None) => {
                        Err((RejectReason::WrongBatch, "an answer before a plan".into()))
                    }
                };
                let batch = match checked {
                    Ok(batch) => batch,
                    Err((reason, why)) => {
                        // Never deliver it: this worker is not trusted again, the batch is
                        // asked for elsewhere.
                        self.metrics.reject(reason);
                        self.metrics.error(match reason {
                            RejectReason::WrongBatch => WorkerErrorKind::WrongBatch,
                            _ => WorkerErrorKind::MalformedBatch,
                        });
                        self.stop_using(link);
                        self.count_failure(f.position, request_id, &addr, &why);
                        return;
                    }
                };
                let Some(p) = self.pending.remove(&f.position) else {
                    return; // a hedge lost the race, or a seek made it stale
                };
                if f.hedge {
                    self.metrics.hedge(HedgeOutcome::Won);
                }
                // The other attempts lost: their workers can stop preparing them. Each took at
                // least this long, which its link's estimate learns (else a worker that turned
                // slow, never answering, would look as quick as before and be asked again).
                for id in p.attempts.iter().filter(|id| **id != request_id) {
                    if let Some((lost, _)) = self.abandon(*id) {
                        if self.cfg.policy == Policy::Subset {
                            self.measured(lost.link, self.now.duration_since(lost.sent), true);
                        }
                    }
                }
                self.ready.insert(f.position, Ok(batch));
            }
            Err(e) if !self.pending.contains_key(&f.position) => {
                // A hedge already won, or a seek made it stale: nothing to do.
                tracing::debug!("late error from {addr}: {}", e.message);
            }
            Err(e) => match e.code {
                ErrorCode::Unavailable | ErrorCode::PlanMismatch => {
                    // Draining, or it restarted with another plan: never ask it again.
                    self.stop_using(link);
                    let reason = if e.code == ErrorCode::Unavailable {
                        RetryReason::Draining
                    } else {
                        RetryReason::PlanMismatch
                    };
                    self.metrics.retry(reason);
                    self.count_failure(f.position, request_id, &addr, &e.message);
                }
                ErrorCode::Transient => {
                    // The store failed, not the data: ask again (elsewhere first).
                    self.shrink_window(link);
                    self.metrics.retry(RetryReason::Transient);
                    self.count_failure(f.position, request_id, &addr, &e.message);
                }
                ErrorCode::Unauthorized | ErrorCode::BadRequest | ErrorCode::Failed => {
                    self.metrics.error(WorkerErrorKind::Answer);
                    self.shrink_window(link);
                    self.batch_refused(f.position, request_id, &addr, e);
                }
            },
        }
    }

    pub(super) fn shrink_window(&mut self, link: LinkId) {
        if self.cfg.policy == Policy::Subset {
            if let Some(l) = self.links.get_mut(&link) {
                l.window = (l.window / 2).max(1);
            }
        }
    }

    /// Why a batch head does not answer `position` (plan, epoch, batch, rank or world size
    /// differ), if it does not.
    pub(super) fn wrong_answer(&self, got: &BatchRequest, position: u64) -> Option<String> {
        let plan = self.identity.as_ref()?;
        let bpe = plan.batches_per_epoch;
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
    pub(super) fn release_link(&mut self, link: LinkId) -> String {
        let now = self.now;
        match self.links.get_mut(&link) {
            Some(l) => {
                l.outstanding = l.outstanding.saturating_sub(1);
                if l.outstanding == 0 {
                    l.idle_since = now;
                }
                l.addr.clone()
            }
            None => String::new(),
        }
    }
}
