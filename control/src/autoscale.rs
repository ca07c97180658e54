//! The wait-ratio autoscaler (docs/design.md, decision 5; docs/operator.md).
//!
//! Signal: the trainer ranks' wait ratio (time blocked on data / wall time). The slowest rank
//! sets the step time, so the policy acts on the worst rank. Each evaluation makes a
//! recommendation in two parts:
//!
//! * feed-forward: the trainer's demand with no waiting is `consumed / (1 - wait)` samples/s
//!   (it spends `1 - wait` of its time computing); divided by the measured per-worker rate
//!   (with headroom) it says how many workers are needed;
//! * feedback: while the wait ratio stays above target, at least one more worker than now;
//!   when the feed-forward says fewer are needed and the wait is well below target, fewer.
//!
//! Then HPA-style `behavior`: recommendations are stabilized (scale up to the lowest
//! recommendation of the up window, down to the highest of the down window), a change waits
//! a full `period` after the previous one (so that its effect is measured before the next)
//! and is limited in size, and the result is clamped to [min, max].

use std::collections::VecDeque;
use std::time::Duration;

/// How a recommendation is made (the behavior limits apply to all alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Rule {
    /// Feed-forward from demand ÷ measured per-worker rate, corrected by feedback (ours).
    #[default]
    FeedForward,
    /// The HPA's proportional rule on the wait ratio: ceil(current × wait / target), held
    /// within a 10 % tolerance.
    HpaProportional,
    /// One worker at a time (Cachew-style): +1 above target, -1 well below it.
    OneStep,
}

/// Capacity kept over the trainers' demand: the feed-forward sizes the fleet so it runs at
/// 1 / (1 + this) of its capacity, 0.71. From `stoker-lab bench scale` at 4,096 ranks × 1,024
/// workers, seeds 1–3 (docs/benchmarks.md, "Headroom"): a worker restarted or drained costs no
/// step below 0.9 efficiency with the fleet at 0.7 of its cores, up to 2 at 0.8 and 5–7 (a
/// drain) at 0.9. The 5 % this was before ran the fleet at 0.95.
pub const DEFAULT_HEADROOM: f64 = 0.4;

/// What the user asks of the autoscaler (the DataPipeline's `spec.autoscaling`).
#[derive(Debug, Clone, PartialEq)]
pub struct Spec {
    pub rule: Rule,
    pub min_replicas: u32,
    pub max_replicas: u32,
    /// Wait ratio to stay under, in (0, 1).
    pub target_wait_ratio: f64,
    /// Extra capacity over the feed-forward estimate (0.1 = 10 %), kept also while the
    /// trainer does not wait.
    pub headroom: f64,
    pub scale_up: Rules,
    pub scale_down: Rules,
}

/// HPA-style limits for one direction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rules {
    /// Recommendations are stabilized over this window.
    pub stabilization: Duration,
    /// One change adds (removes) at most this many replicas ...
    pub max_pods: u32,
    /// ... or this percentage of the current replicas, whichever allows more.
    pub max_percent: u32,
    /// Time after any change before a change in this direction.
    pub period: Duration,
}

impl Default for Spec {
    fn default() -> Self {
        Spec {
            rule: Rule::FeedForward,
            min_replicas: 1,
            max_replicas: 16,
            target_wait_ratio: 0.05,
            headroom: DEFAULT_HEADROOM,
            scale_up: Rules {
                stabilization: Duration::ZERO,
                max_pods: 4,
                max_percent: 100,
                period: Duration::from_secs(15),
            },
            scale_down: Rules {
                stabilization: Duration::from_secs(300),
                max_pods: 1,
                max_percent: 10,
                period: Duration::from_secs(60),
            },
        }
    }
}

/// One evaluation's inputs, from the trainers' metrics over the last interval.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Observation {
    /// Worst rank's wait ratio (what the target applies to: the slowest rank sets the step).
    pub worst_wait_ratio: f64,
    /// Mean over ranks (with the consumed rate, it gives the demand).
    pub mean_wait_ratio: f64,
    /// Samples per second the trainer consumed (all ranks).
    pub consumed_per_s: f64,
    /// Workers ready during the interval.
    pub ready_workers: u32,
    /// Ranks whose counters were read and moved, of all the ranks found.
    pub ranks_reporting: u32,
    pub ranks: u32,
}

/// The share of ranks an observation needs: at 4,096 ranks a few are always restarting or
/// unreachable, and waiting for all would freeze every decision; below 20 ranks it is all.
pub const MIN_RANK_COVERAGE: f64 = 0.95;

/// One rank's client counters, as scraped from its /metrics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankCounters {
    /// stoker_trainer_wait_seconds_total
    pub wait_s: f64,
    /// stoker_trainer_step_seconds_total
    pub step_s: f64,
    /// stoker_trainer_samples_total
    pub samples: f64,
}

impl Observation {
    /// The observation between two scrapes of the same ranks (`None` where a rank could not
    /// be read). Ranks unreadable or idle (no step and no wait) are left out, as long as at
    /// least [`MIN_RANK_COVERAGE`] of them report; otherwise there is no observation (hold).
    /// The worst wait ratio is the worst of those seen; the consumed rate counts the unseen
    /// ranks at the seen ones' mean.
    pub fn between(
        before: &[Option<RankCounters>],
        after: &[Option<RankCounters>],
        ready_workers: u32,
    ) -> Option<Observation> {
        if before.is_empty() || before.len() != after.len() {
            return None;
        }
        let (mut worst, mut sum, mut consumed, mut seen) = (0.0f64, 0.0, 0.0, 0u32);
        for (b, a) in before.iter().zip(after) {
            let (Some(b), Some(a)) = (b, a) else {
                continue;
            };
            let wall = (a.wait_s - b.wait_s) + (a.step_s - b.step_s);
            if wall <= 0.0 {
                continue;
            }
            let wait = (a.wait_s - b.wait_s) / wall;
            worst = worst.max(wait);
            sum += wait;
            consumed += (a.samples - b.samples) / wall;
            seen += 1;
        }
        Self::of_ranks(
            worst,
            sum / seen.max(1) as f64,
            consumed,
            (seen, before.len() as u32),
            ready_workers,
        )
    }

    /// The observation from aggregates over the ranks that reported (`seen` of `ranks`):
    /// worst and mean wait ratio, and what those ranks consumed; `None` below
    /// [`MIN_RANK_COVERAGE`]. The consumed rate counts the unseen at the seen ones' mean.
    pub fn of_ranks(
        worst_wait_ratio: f64,
        mean_wait_ratio: f64,
        consumed_per_s: f64,
        (seen, ranks): (u32, u32),
        ready_workers: u32,
    ) -> Option<Observation> {
        if ranks == 0 || seen > ranks || (seen as f64) < (MIN_RANK_COVERAGE * ranks as f64).ceil() {
            return None;
        }
        Some(Observation {
            worst_wait_ratio,
            mean_wait_ratio,
            consumed_per_s: consumed_per_s * ranks as f64 / seen as f64,
            ready_workers,
            ranks_reporting: seen,
            ranks,
        })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub replicas: u32,
    /// Why, with the numbers (for Events, status and logs).
    pub reason: String,
    /// The measured per-worker rate the decision used, if any.
    pub per_worker_per_s: Option<f64>,
}

/// The autoscaler's memory between evaluations (the operator keeps it per DataPipeline).
#[derive(Debug, Default, Clone)]
pub struct Autoscaler {
    /// (time, recommendation) within the longer stabilization window.
    recommendations: VecDeque<(Duration, u32)>,
    /// When the replica count last changed.
    last_change: Option<Duration>,
    /// Samples/s one worker delivers when the workers are the bottleneck.
    per_worker_per_s: Option<f64>,
}

impl Autoscaler {
    /// Evaluates at time `now` (any monotonic clock) with `current` replicas desired so far.
    /// `None` observation = metrics unavailable: hold.
    pub fn evaluate(
        &mut self,
        spec: &Spec,
        now: Duration,
        current: u32,
        obs: Option<Observation>,
    ) -> Decision {
        let mut d = self.decide(spec, now, current, obs);
        if let Some(o) = obs.filter(|o| o.ranks_reporting < o.ranks) {
            d.reason.push_str(&format!(
                " ({} of {} ranks reporting)",
                o.ranks_reporting, o.ranks
            ));
        }
        d
    }

    fn decide(
        &mut self,
        spec: &Spec,
        now: Duration,
        current: u32,
        obs: Option<Observation>,
    ) -> Decision {
        let Some(obs) = obs else {
            return Decision {
                replicas: current.clamp(spec.min_replicas, spec.max_replicas),
                reason: "metrics unavailable: holding".into(),
                per_worker_per_s: self.per_worker_per_s,
            };
        };
        let wait = obs.worst_wait_ratio.clamp(0.0, 0.999);
        let saturated = wait > spec.target_wait_ratio;
        // An observation that spans a change mixes two worker counts: no rate from it.
        let settled = self
            .last_change
            .is_none_or(|t| now.saturating_sub(t) >= spec.scale_up.period);
        if saturated && settled && obs.ready_workers > 0 && obs.consumed_per_s > 0.0 {
            // Workers are the bottleneck: what they deliver is their capacity.
            let rate = obs.consumed_per_s / obs.ready_workers as f64;
            self.per_worker_per_s = Some(match self.per_worker_per_s {
                Some(old) => 0.5 * old + 0.5 * rate,
                None => rate,
            });
        }
        if saturated && obs.ready_workers < current {
            // Workers asked for are still starting: their effect is not measured yet.
            let raw = current.clamp(spec.min_replicas, spec.max_replicas);
            self.remember(spec, now, raw);
            return Decision {
                replicas: raw,
                reason: format!(
                    "wait ratio {wait:.3} > target {:.3}, waiting for {} of {current} workers to start",
                    spec.target_wait_ratio,
                    current - obs.ready_workers
                ),
                per_worker_per_s: self.per_worker_per_s,
            };
        }
        let (raw, why) = match spec.rule {
            Rule::FeedForward => self.feed_forward(spec, wait, saturated, current, &obs),
            Rule::HpaProportional => hpa_proportional(spec, wait, current),
            Rule::OneStep => one_step(spec, wait, current),
        };
        let raw = raw.clamp(spec.min_replicas, spec.max_replicas);
        self.remember(spec, now, raw);
        let stabilized = if raw > current {
            self.lowest_since(now, spec.scale_up.stabilization)
                .max(current)
        } else if raw < current {
            self.highest_since(now, spec.scale_down.stabilization)
                .min(current)
        } else {
            current
        };
        let limited = self.rate_limited(spec, now, current, stabilized);
        let replicas = limited.clamp(spec.min_replicas, spec.max_replicas);
        if replicas != current {
            self.last_change = Some(now);
        }
        let mut reason = why;
        if replicas != raw {
            reason.push_str(&format!(
                "; recommended {raw}, {replicas} after stabilization and rate limits"
            ));
        }
        Decision {
            replicas,
            reason,
            per_worker_per_s: self.per_worker_per_s,
        }
    }

    /// Ours: demand ÷ measured per-worker rate, at least one more while above target.
    fn feed_forward(
        &self,
        spec: &Spec,
        wait: f64,
        saturated: bool,
        current: u32,
        obs: &Observation,
    ) -> (u32, String) {
        // The trainer computes (1 - mean wait) of the time: without waiting it would consume this.
        let demand = obs.consumed_per_s / (1.0 - obs.mean_wait_ratio.clamp(0.0, 0.999));
        let feed_forward = self
            .per_worker_per_s
            .map(|r| (demand * (1.0 + spec.headroom) / r).ceil() as u32);
        match (saturated, feed_forward) {
            (true, Some(ff)) => (
                ff.max(current + 1),
                format!(
                    "wait ratio {wait:.3} > target {:.3}: demand {demand:.1} samples/s at {:.1} per worker",
                    spec.target_wait_ratio,
                    self.per_worker_per_s.unwrap_or(0.0)
                ),
            ),
            (true, None) => (
                current + 1,
                format!(
                    "wait ratio {wait:.3} > target {:.3}: one more worker (no rate measured yet)",
                    spec.target_wait_ratio
                ),
            ),
            // Within target but hotter than the headroom allows: a restart or a drain would
            // cost steps (DEFAULT_HEADROOM), so the fleet grows before the trainer waits.
            (false, Some(ff)) if ff > current => (
                ff,
                format!(
                    "wait ratio {wait:.3} within target {:.3}, but demand {demand:.1} samples/s at {:.1} per worker needs {ff} to keep {:.0} % headroom",
                    spec.target_wait_ratio,
                    self.per_worker_per_s.unwrap_or(0.0),
                    100.0 * spec.headroom
                ),
            ),
            (false, Some(ff)) if ff < current && wait < spec.target_wait_ratio / 2.0 => (
                ff,
                format!(
                    "wait ratio {wait:.3} well under target {:.3}: demand {demand:.1} samples/s needs {ff} at {:.1} per worker",
                    spec.target_wait_ratio,
                    self.per_worker_per_s.unwrap_or(0.0)
                ),
            ),
            _ => (
                current,
                format!(
                    "wait ratio {wait:.3} within target {:.3}",
                    spec.target_wait_ratio
                ),
            ),
        }
    }

    fn remember(&mut self, spec: &Spec, now: Duration, raw: u32) {
        self.recommendations.push_back((now, raw));
        let keep = spec
            .scale_up
            .stabilization
            .max(spec.scale_down.stabilization);
        while self
            .recommendations
            .front()
            .is_some_and(|(t, _)| now.saturating_sub(*t) > keep)
        {
            self.recommendations.pop_front();
        }
    }

    fn window(&self, now: Duration, w: Duration) -> impl Iterator<Item = u32> + '_ {
        self.recommendations
            .iter()
            .filter(move |(t, _)| now.saturating_sub(*t) <= w)
            .map(|(_, r)| *r)
    }

    fn lowest_since(&self, now: Duration, w: Duration) -> u32 {
        self.window(now, w).min().unwrap_or(0)
    }

    fn highest_since(&self, now: Duration, w: Duration) -> u32 {
        self.window(now, w).max().unwrap_or(u32::MAX)
    }

    /// Applies the behavior's limits: a full period since the last change, and a bounded step.
    fn rate_limited(&self, spec: &Spec, now: Duration, current: u32, want: u32) -> u32 {
        let rules = match want.cmp(&current) {
            std::cmp::Ordering::Greater => &spec.scale_up,
            std::cmp::Ordering::Less => &spec.scale_down,
            std::cmp::Ordering::Equal => return current,
        };
        if self
            .last_change
            .is_some_and(|t| now.saturating_sub(t) < rules.period)
        {
            return current;
        }
        let pct = (current as u64 * rules.max_percent as u64).div_ceil(100) as u32;
        let step = rules.max_pods.max(pct).max(1);
        if want > current {
            want.min(current + step)
        } else {
            want.max(current.saturating_sub(step))
        }
    }
}

fn hpa_proportional(spec: &Spec, wait: f64, current: u32) -> (u32, String) {
    let ratio = wait / spec.target_wait_ratio;
    if (ratio - 1.0).abs() <= 0.1 {
        return (
            current,
            format!("wait ratio {wait:.3} within 10 % of target"),
        );
    }
    let want = (current as f64 * ratio).ceil() as u32;
    (
        want,
        format!(
            "HPA: ceil({current} x {wait:.3} / {:.3})",
            spec.target_wait_ratio
        ),
    )
}

fn one_step(spec: &Spec, wait: f64, current: u32) -> (u32, String) {
    if wait > spec.target_wait_ratio {
        (
            current + 1,
            format!("wait ratio {wait:.3} above target: +1"),
        )
    } else if wait < spec.target_wait_ratio / 2.0 {
        (
            current.saturating_sub(1),
            format!("wait ratio {wait:.3} well below target: -1"),
        )
    } else {
        (current, format!("wait ratio {wait:.3} within target"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A simulated plant: `n` workers of `rate` samples/s each feed a trainer that wants
    /// `demand` samples/s; what it gets and how long it waits follow.
    fn plant(n: u32, rate: f64, demand: f64) -> Observation {
        let supply = n as f64 * rate;
        let consumed = supply.min(demand);
        Observation {
            worst_wait_ratio: 1.0 - consumed / demand,
            mean_wait_ratio: 1.0 - consumed / demand,
            consumed_per_s: consumed,
            ready_workers: n,
            ranks_reporting: 1,
            ranks: 1,
        }
    }

    fn s(v: u64) -> Duration {
        Duration::from_secs(v)
    }

    /// Runs the loop every `every` for `steps`, demand given per step; returns replicas per step.
    fn run(
        spec: &Spec,
        start: u32,
        rate: f64,
        demand: impl Fn(usize) -> f64,
        steps: usize,
    ) -> Vec<u32> {
        let mut a = Autoscaler::default();
        let mut n = start;
        (0..steps)
            .map(|i| {
                let obs = plant(n, rate, demand(i));
                n = a.evaluate(spec, s(10 * i as u64), n, Some(obs)).replicas;
                n
            })
            .collect()
    }

    /// The arithmetic of the tests below at 5 % headroom.
    fn spec_5_percent() -> Spec {
        Spec {
            headroom: 0.05,
            ..Spec::default()
        }
    }

    #[test]
    fn scales_up_to_the_feed_forward_estimate_in_one_step() {
        let spec = spec_5_percent();
        // 1 worker of 50/s, demand 230/s: the estimate is ceil(230 * 1.05 / 50) = 5, one step
        // may add 4 (max_pods): 1 -> 5. 5 x 50 covers 230: the wait is gone, so it holds.
        let n = run(&spec, 1, 50.0, |_| 230.0, 4);
        assert_eq!(n, vec![5, 5, 5, 5]);
        // Slower workers: 1 -> 5, then nothing more within the 15 s period that made that
        // change, then -> 10 = ceil(230 * 1.05 / 25).
        let n = run(&spec, 1, 25.0, |_| 230.0, 4);
        assert_eq!(n, vec![5, 5, 10, 10]);
    }

    #[test]
    fn holds_inside_the_target_and_never_oscillates() {
        let spec = spec_5_percent();
        let n = run(&spec, 1, 50.0, |_| 230.0, 60);
        let changes = n.windows(2).filter(|w| w[0] != w[1]).count();
        assert_eq!(*n.last().unwrap(), 5);
        assert!(changes <= 1, "{n:?}");
    }

    #[test]
    fn scales_down_slowly_after_demand_drops() {
        let spec = spec_5_percent();
        // Demand drops from 230/s to 60/s at step 10 (t = 100 s).
        let n = run(&spec, 1, 50.0, |i| if i < 10 { 230.0 } else { 60.0 }, 80);
        // Not before the 300 s stabilization window has passed...
        assert!(n[..40].iter().all(|&r| r == 5), "{n:?}");
        // ... then one at a time, once a minute, down to ceil(60 * 1.05 / 50) = 2.
        let down: Vec<u32> = n[40..].to_vec();
        for w in down.windows(2) {
            assert!(w[0] - w[1] <= 1, "{n:?}");
        }
        assert_eq!(*n.last().unwrap(), 2, "{n:?}");
    }

    /// The default headroom is kept also where the trainer does not wait: a scale-up the rate
    /// limits cut short is completed, and the fleet then holds at 1 / 1.4 of its capacity.
    #[test]
    fn keeps_its_headroom_while_the_trainer_does_not_wait() {
        let spec = Spec::default();
        // 1 worker of 50/s, demand 230/s: ceil(230 * 1.4 / 50) = 7, reached in two steps (one
        // may add 4); from the second on, 5 x 50 covers 230 and nobody waits.
        let n = run(&spec, 1, 50.0, |_| 230.0, 60);
        assert_eq!(&n[..4], [5, 5, 7, 7]);
        assert!(n[4..].iter().all(|&r| r == 7), "{n:?}");
        let utilization = 230.0 / (f64::from(*n.last().unwrap()) * 50.0);
        assert!(
            utilization <= 1.0 / (1.0 + DEFAULT_HEADROOM),
            "{utilization}"
        );
    }

    #[test]
    fn respects_bounds_and_holds_without_metrics() {
        let spec = Spec {
            max_replicas: 3,
            ..Spec::default()
        };
        let n = run(&spec, 1, 10.0, |_| 1000.0, 5);
        assert_eq!(*n.last().unwrap(), 3);
        let mut a = Autoscaler::default();
        let d = a.evaluate(&spec, s(0), 2, None);
        assert_eq!(d.replicas, 2);
        assert!(d.reason.contains("unavailable"));
        // Below min is raised to min even without metrics.
        let spec = Spec {
            min_replicas: 2,
            ..Spec::default()
        };
        assert_eq!(a.evaluate(&spec, s(1), 1, None).replicas, 2);
    }

    #[test]
    fn observations_come_from_counter_deltas_of_every_rank() {
        let c = |wait_s, step_s, samples| {
            Some(RankCounters {
                wait_s,
                step_s,
                samples,
            })
        };
        let before = [c(1.0, 9.0, 100.0), c(0.0, 10.0, 100.0)];
        let after = [c(3.0, 17.0, 260.0), c(1.0, 19.0, 300.0)];
        let o = Observation::between(&before, &after, 3).unwrap();
        assert!((o.worst_wait_ratio - 0.2).abs() < 1e-9);
        assert!((o.mean_wait_ratio - 0.15).abs() < 1e-9);
        assert!((o.consumed_per_s - (16.0 + 20.0)).abs() < 1e-9);
        // A rank that could not be read, or did not move: no observation (hold).
        assert_eq!(Observation::between(&before, &[after[0], None], 3), None);
        assert_eq!(Observation::between(&before, &before, 3), None);
    }

    /// At scale a few ranks are always unreadable: 95 % reporting is enough, the decision
    /// says how many it saw, and the consumed rate counts the unseen at the seen ones' mean.
    #[test]
    fn a_decision_tolerates_a_few_silent_ranks_and_says_so() {
        let moving = Some(RankCounters {
            wait_s: 5.0,
            step_s: 5.0,
            samples: 100.0,
        });
        let start = Some(RankCounters {
            wait_s: 0.0,
            step_s: 0.0,
            samples: 0.0,
        });
        let before = vec![start; 100];
        let mut after = vec![moving; 100];
        after[..5].iter_mut().for_each(|r| *r = None);
        let o = Observation::between(&before, &after, 4).unwrap();
        assert_eq!((o.ranks_reporting, o.ranks), (95, 100));
        assert!((o.consumed_per_s - 100.0 * 10.0).abs() < 1e-9);
        let d = Autoscaler::default().evaluate(&Spec::default(), s(0), 4, Some(o));
        assert!(
            d.reason.ends_with("(95 of 100 ranks reporting)"),
            "{}",
            d.reason
        );
        after[5] = None;
        assert_eq!(
            Observation::between(&before, &after, 4),
            None,
            "94 % is too few"
        );
    }

    #[test]
    fn reasons_carry_the_numbers() {
        let mut a = Autoscaler::default();
        let d = a.evaluate(&Spec::default(), s(0), 1, Some(plant(1, 50.0, 100.0)));
        assert_eq!(d.replicas, 3);
        assert!(d.reason.contains("wait ratio 0.500"), "{}", d.reason);
        assert!(d.reason.contains("demand 100.0"), "{}", d.reason);
        assert_eq!(d.per_worker_per_s, Some(50.0));
    }
}
