//! Scenarios: what happens to the fleet or the trainer at the middle step, and how the fleet
//! around it behaves (Kubernetes' rolling update, its node lifecycle).

use super::*;

const NAMES: [(Scenario, &str); 11] = [
    (Scenario::Steady, "steady"),
    (Scenario::Restart, "restart"),
    (Scenario::Drain, "drain"),
    (Scenario::ScaleUp, "scale-up"),
    (Scenario::Slow, "slow"),
    (Scenario::Blackhole, "blackhole"),
    (Scenario::BlackholeNode, "blackhole-node"),
    (Scenario::NodeLoss, "node-loss"),
    (Scenario::Rollout, "rollout"),
    (Scenario::TrainerPause, "trainer-pause"),
    (Scenario::Brownout, "brownout"),
];

impl Scenario {
    pub(super) fn parse(s: &str) -> anyhow::Result<Scenario> {
        match NAMES.iter().find(|(_, name)| *name == s) {
            Some((scenario, _)) => Ok(*scenario),
            None => {
                let names: Vec<&str> = NAMES.iter().map(|(_, n)| *n).collect();
                anyhow::bail!("scenario {s:?}: expected one of {}", names.join(", "))
            }
        }
    }

    pub(super) fn name(self) -> &'static str {
        NAMES.iter().find(|(s, _)| *s == self).expect("named").1
    }

    /// Steps in a run: `--steps`, or enough after the middle one for a rollout or a brownout
    /// to end (a rollout's waves, each a start-up at most 25 % over `--startup-s`) and ten
    /// more.
    pub(super) fn steps(self, a: &ScaleArgs, workers: usize) -> u64 {
        if self == Scenario::Brownout {
            return a.steps.max(event_at(a) + BROWNOUT_STEPS + 10);
        }
        if self != Scenario::Rollout {
            return a.steps;
        }
        let waves = workers.div_ceil(rollout_batch(workers)) as f64;
        let span = (waves * a.startup_s * 1.25 + DRAIN_EXIT.as_secs_f64()) / a.step_s;
        a.steps.max(event_at(a) + span.ceil() as u64 + 10)
    }
}

/// The step at which the scenario's event happens: the middle of `--steps` (a longer run adds
/// its steps after it).
pub(super) fn event_at(a: &ScaleArgs) -> u64 {
    a.steps / 2
}

/// Workers a rolling update replaces at once: the share, rounded down as Kubernetes rounds
/// `maxUnavailable`, and at least one.
fn rollout_batch(workers: usize) -> usize {
    ((workers as f64 * ROLLOUT_SHARE) as usize).max(1)
}

impl Sim {
    /// Step `k`'s compute, in seconds: the trainer's step, and the pause at the middle one.
    pub(super) fn compute_s(&self, k: u64) -> f64 {
        let pause = self.scenario == Scenario::TrainerPause && k == event_at(&self.a);
        self.a.step_s + if pause { self.a.pause_s } else { 0.0 }
    }

    /// The scenario's event, at the middle step.
    pub(super) fn fire(&mut self) {
        match self.scenario {
            Scenario::Steady => self.event_step = None,
            Scenario::Restart => {
                self.worker_down(0);
                self.at(self.now + ns(RESTART_DOWN), Ev::WorkerBack(0));
            }
            Scenario::Drain => self.at(self.now + ns(DRAIN_UNLIST), Ev::Drain(0)),
            Scenario::ScaleUp => self.at(self.now, Ev::ScaleUp),
            Scenario::Slow => self.workers[0].slowdown = SLOW_WORKER,
            Scenario::Blackhole => self.silence(0),
            Scenario::BlackholeNode => {
                let node = self.workers[0].node;
                self.workers_on(node)
                    .into_iter()
                    .for_each(|w| self.silence(w));
            }
            Scenario::NodeLoss => {
                let node = self.workers[0].node;
                self.workers_on(node)
                    .into_iter()
                    .for_each(|w| self.silence(w));
                self.at(self.now + ns(NODE_NOT_READY), Ev::NodeNotReady(node));
            }
            Scenario::Rollout => {
                self.rollout = (0..self.workers.len()).collect();
                for _ in 0..rollout_batch(self.workers.len()) {
                    self.replace_next();
                }
            }
            Scenario::TrainerPause => {} // in the step's compute
            Scenario::Brownout => self.set_slowdown(BROWNOUT_SLOWDOWN),
        }
    }

    /// `brownout`: the fleet is back to its speed, `BROWNOUT_STEPS` after the event.
    pub(super) fn end_brownout(&mut self) {
        if self.scenario == Scenario::Brownout {
            self.set_slowdown(1.0);
        }
    }

    fn set_slowdown(&mut self, factor: f64) {
        for w in &mut self.workers {
            w.slowdown = factor;
        }
    }

    /// The next worker of the old version is deleted (it leaves the endpoints and drains) and
    /// its replacement starts on its node, listed once ready (then the next goes).
    pub(super) fn replace_next(&mut self) {
        let Some(old) = self.rollout.pop_front() else {
            return;
        };
        self.at(self.now + ns(DRAIN_UNLIST), Ev::Drain(old));
        let node = self.workers[old].node;
        let new = self.add_worker(node, false);
        let startup = self.a.startup_s * self.rng.gen_range(0.75..1.25);
        self.at(
            self.now + ns(Duration::from_secs_f64(startup)),
            Ev::Ready(new),
        );
    }

    /// A node's pods leave the Service's endpoints (they stay silent).
    pub(super) fn node_not_ready(&mut self, node: usize) {
        for w in self.workers_on(node) {
            let addr = self.workers[w].addr.clone();
            self.listed.remove(&addr);
        }
    }

    /// The workers on `node`.
    fn workers_on(&self, node: usize) -> Vec<usize> {
        (0..self.workers.len())
            .filter(|w| self.workers[*w].node == node)
            .collect()
    }
}
