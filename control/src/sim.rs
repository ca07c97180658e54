//! A simulated plant for the autoscaler: a synchronous data-parallel trainer fed by workers of
//! noisy capacity that take time to start. Deterministic (seeded), so tests can hold the
//! policy to numbers, and `stoker-lab bench autoscale` prints the rules side by side.

use crate::autoscale::{Autoscaler, Observation, Rule, Spec};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Plant {
    /// Data-parallel ranks; each step every rank consumes `samples_per_rank` samples.
    pub ranks: u32,
    pub samples_per_rank: u32,
    /// Compute time of one step, in seconds (sets the demand).
    pub compute_s: f64,
    /// Samples per second one worker delivers, on average.
    pub per_worker_per_s: f64,
    /// Each worker's capacity varies by up to ± this fraction per interval; the worst rank
    /// waits up to this fraction more than the mean.
    pub noise: f64,
    /// Intervals before a new worker serves.
    pub startup_intervals: usize,
}

impl Plant {
    /// Samples per second the trainer asks for when it never waits.
    pub fn demand(&self) -> f64 {
        (self.ranks * self.samples_per_rank) as f64 / self.compute_s
    }

    /// The fewest workers whose noiseless supply leaves the spec's headroom over the demand
    /// (nobody waits then, so the wait target holds too).
    pub fn optimum(&self, spec: &Spec) -> u32 {
        (self.demand() * (1.0 + spec.headroom) / self.per_worker_per_s).ceil() as u32
    }
}

/// A run: the plant, demand changes (at interval i, the compute time becomes s), how long.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub plant: Plant,
    pub interval: Duration,
    pub intervals: usize,
    pub changes: Vec<(usize, f64)>,
    pub start_replicas: u32,
    pub seed: u64,
}

#[derive(Debug, Clone)]
pub struct Outcome {
    pub replicas: Vec<u32>,
    pub worst_wait: Vec<f64>,
    /// Per constant-demand phase: (intervals until the count reached [optimum, optimum + 1]
    /// and stayed, or None), the optimum, the final count.
    pub phases: Vec<(Option<usize>, u32, u32)>,
    /// Direction reversals of the worker count within constant-demand phases.
    pub oscillations: usize,
    pub worker_hours: f64,
    pub mean_wait: f64,
}

/// A small deterministic generator (xorshift64*): noise without a dependency.
struct Rng(u64);

impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [-1, 1].
    fn symmetric(&mut self) -> f64 {
        2.0 * self.next_f64() - 1.0
    }
}

pub fn run(sc: &Scenario, spec: &Spec) -> Outcome {
    let mut rng = Rng(sc.seed.max(1));
    let mut plant = sc.plant.clone();
    let mut scaler = Autoscaler::default();
    let mut desired = sc.start_replicas;
    // Workers requested at each interval; ready after the startup delay.
    let mut history: Vec<u32> = Vec::new();
    let (mut replicas, mut worst_wait) = (Vec::new(), Vec::new());
    let mut wait_sum = 0.0;
    for i in 0..sc.intervals {
        if let Some((_, c)) = sc.changes.iter().find(|(at, _)| *at == i) {
            plant.compute_s = *c;
        }
        history.push(desired);
        let ready = if i >= plant.startup_intervals {
            history[i - plant.startup_intervals].min(desired)
        } else {
            sc.start_replicas.min(desired)
        };
        let supply: f64 = (0..ready)
            .map(|_| plant.per_worker_per_s * (1.0 + plant.noise * rng.symmetric()))
            .sum();
        let demand = plant.demand();
        let consumed = supply.min(demand);
        let mean = 1.0 - consumed / demand;
        let worst = (mean * (1.0 + plant.noise * rng.next_f64())).min(0.99);
        let obs = Observation {
            worst_wait_ratio: worst,
            mean_wait_ratio: mean,
            consumed_per_s: consumed,
            ready_workers: ready,
            ranks_reporting: 1,
            ranks: 1,
        };
        let now = sc.interval * i as u32;
        desired = scaler.evaluate(spec, now, desired, Some(obs)).replicas;
        replicas.push(desired);
        worst_wait.push(worst);
        wait_sum += worst;
    }
    // Phases between demand changes.
    let mut bounds: Vec<usize> = std::iter::once(0)
        .chain(sc.changes.iter().map(|(at, _)| *at))
        .chain(std::iter::once(sc.intervals))
        .collect();
    bounds.dedup();
    let mut phases = Vec::new();
    let mut oscillations = 0;
    let mut compute = sc.plant.compute_s;
    for w in bounds.windows(2) {
        let (a, b) = (w[0], w[1]);
        if let Some((_, c)) = sc.changes.iter().find(|(at, _)| *at == a) {
            compute = *c;
        }
        let opt = Plant {
            compute_s: compute,
            ..sc.plant.clone()
        }
        .optimum(spec)
        .clamp(spec.min_replicas, spec.max_replicas);
        let r = &replicas[a..b];
        let ok = |n: u32| n >= opt && n <= opt + 1;
        let settled = (0..r.len()).find(|&k| r[k..].iter().all(|&n| ok(n)));
        phases.push((settled.map(|k| k + 1), opt, *r.last().unwrap_or(&0)));
        let mut last_dir = 0i32;
        for pair in r.windows(2) {
            let dir = (pair[1] as i64 - pair[0] as i64).signum() as i32;
            if dir != 0 {
                if last_dir != 0 && dir != last_dir {
                    oscillations += 1;
                }
                last_dir = dir;
            }
        }
    }
    let worker_hours =
        replicas.iter().map(|&n| n as f64).sum::<f64>() * sc.interval.as_secs_f64() / 3600.0;
    Outcome {
        replicas,
        worst_wait,
        phases,
        oscillations,
        worker_hours,
        mean_wait: wait_sum / sc.intervals as f64,
    }
}

/// The standard scenario: 8 ranks x 32 samples, 2 s steps (128 samples/s), workers of 16/s
/// ± 10 % that take one interval to start, 15 s intervals; from 1 worker, then the step gets
/// faster (1.25 s: 205 samples/s) at interval 120, then slower (4 s: 64/s) at 240; 360
/// intervals (1.5 h).
pub fn standard_scenario(seed: u64) -> Scenario {
    Scenario {
        plant: Plant {
            ranks: 8,
            samples_per_rank: 32,
            compute_s: 2.0,
            per_worker_per_s: 16.0,
            noise: 0.1,
            startup_intervals: 1,
        },
        interval: Duration::from_secs(15),
        intervals: 360,
        changes: vec![(120, 1.25), (240, 4.0)],
        start_replicas: 1,
        seed,
    }
}

/// The three rules, each with the same behavior limits.
pub fn rules() -> [(Rule, &'static str); 3] {
    [
        (Rule::FeedForward, "stoker (feed-forward + feedback)"),
        (Rule::HpaProportional, "HPA proportional rule"),
        (Rule::OneStep, "one step at a time (Cachew-style)"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(rule: Rule) -> Spec {
        Spec {
            rule,
            max_replicas: 32,
            ..Spec::default()
        }
    }

    #[test]
    fn ours_converges_fast_holds_and_ends_near_the_optimum() {
        for seed in 1..=20 {
            let sc = standard_scenario(seed);
            let out = run(&sc, &spec(Rule::FeedForward));
            let (first, opt, _) = out.phases[0];
            // 1 -> 5 -> 10 -> 12 at most: the rate limits (4 pods, then 100 %, a period each).
            assert!(
                first.is_some_and(|k| k <= 5),
                "seed {seed}: from 1 worker to {opt} took {first:?} intervals: {:?}",
                &out.replicas[..12]
            );
            // After the demand step up, a few intervals again.
            assert!(
                out.phases[1].0.is_some_and(|k| k <= 4),
                "seed {seed}: {:?}",
                out.phases
            );
            for (_, opt, last) in &out.phases {
                assert!(
                    *last >= *opt && *last <= opt + 1,
                    "seed {seed}: {:?}",
                    out.phases
                );
            }
            assert_eq!(out.oscillations, 0, "seed {seed}: {:?}", out.replicas);
        }
    }

    #[test]
    fn the_alternatives_are_slower_or_oscillate() {
        let sc = standard_scenario(1);
        let ours = run(&sc, &spec(Rule::FeedForward));
        let hpa = run(&sc, &spec(Rule::HpaProportional));
        let step = run(&sc, &spec(Rule::OneStep));
        // One step at a time needs about as many intervals as workers.
        assert!(step.phases[0]
            .0
            .is_none_or(|k| k > ours.phases[0].0.unwrap()));
        // The proportional rule overshoots a saturating signal and swings back.
        assert!(
            hpa.oscillations > ours.oscillations || hpa.mean_wait > ours.mean_wait,
            "hpa {} osc, {:.3} wait",
            hpa.oscillations,
            hpa.mean_wait
        );
    }
}
