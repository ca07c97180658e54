//! Pure decisions of the scheduler, unit-tested apart from any I/O: how deep to prefetch and
//! when a request is a straggler worth hedging.

use std::collections::VecDeque;
use std::time::Duration;

/// How many batches to keep requested ahead of the trainer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Depth {
    /// No prefetch: a batch is requested only when the trainer asks for it.
    OnDemand,
    /// Exactly this many requested ahead of the trainer.
    Fixed(usize),
    /// Follow Little's law on observed latency and the trainer's pace, up to `max`.
    Auto { max: usize },
}

impl Depth {
    pub fn max(self) -> usize {
        match self {
            Depth::OnDemand => 1,
            Depth::Fixed(n) => n.max(1),
            Depth::Auto { max } => max.max(2),
        }
    }
}

/// Batches that must be in flight so one is ready whenever the trainer asks: the latency of
/// a request (a high percentile) divided by the time between the trainer's requests, plus one
/// for the batch being consumed and one of slack. Until both are known, two: a job's first
/// steps must not ask every worker for a deep window at once (that herd stalled the start).
pub fn auto_depth(latency: Option<Duration>, interval: Option<Duration>, max: usize) -> usize {
    let max = max.max(2);
    match (latency, interval) {
        (Some(l), Some(i)) if !i.is_zero() => {
            let need = (l.as_secs_f64() / i.as_secs_f64()).ceil() as usize + 2;
            need.clamp(2, max)
        }
        _ => 2,
    }
}

/// The depth rule before bounded subsets (the scale benchmark's baseline): a middle value
/// before anything is seen, the cap as soon as a latency is.
pub fn legacy_auto_depth(
    latency: Option<Duration>,
    interval: Option<Duration>,
    max: usize,
) -> usize {
    let max = max.max(2);
    match (latency, interval) {
        (Some(_), Some(i)) if !i.is_zero() => auto_depth(latency, interval, max),
        (Some(_), _) => max,
        _ => 4.min(max),
    }
}

/// The most recent request latencies, for percentiles.
#[derive(Debug, Default)]
pub struct LatencyWindow {
    recent: VecDeque<Duration>,
}

impl LatencyWindow {
    const CAPACITY: usize = 256;

    pub fn record(&mut self, d: Duration) {
        if self.recent.len() == Self::CAPACITY {
            self.recent.pop_front();
        }
        self.recent.push_back(d);
    }

    pub fn len(&self) -> usize {
        self.recent.len()
    }

    pub fn is_empty(&self) -> bool {
        self.recent.is_empty()
    }

    /// The `q` quantile (0..=1) of the window, by the nearest-rank method.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        if self.recent.is_empty() {
            return None;
        }
        let mut v: Vec<Duration> = self.recent.iter().copied().collect();
        v.sort_unstable();
        let rank = ((q.clamp(0.0, 1.0) * v.len() as f64).ceil() as usize).clamp(1, v.len());
        Some(v[rank - 1])
    }
}

/// When to send a duplicate of a slow request to another worker.
#[derive(Debug, Clone, Copy)]
pub struct HedgePolicy {
    /// A request older than this quantile of recent latencies is a straggler.
    pub quantile: f64,
    /// ... times this factor (1 = the quantile itself).
    pub factor: f64,
    /// No hedging before this many latencies were observed.
    pub min_observations: usize,
    /// Hedge only the oldest this-many positions (those that block delivery).
    pub head_positions: usize,
    /// Hedges allowed per answered request, on average (0.05: at most 5 % extra work).
    pub budget: f64,
    /// Hedges that may be sent at once before any answer earned them: four, about the
    /// requests a worker that turns slow holds for one rank (its depth).
    pub burst: f64,
}

impl Default for HedgePolicy {
    fn default() -> Self {
        HedgePolicy {
            quantile: 0.95,
            factor: 1.5,
            min_observations: 8,
            head_positions: 2,
            budget: 0.05,
            burst: 4.0,
        }
    }
}

impl HedgePolicy {
    /// Age past which a request is hedged, if enough is known.
    pub fn threshold(&self, window: &LatencyWindow) -> Option<Duration> {
        if window.len() < self.min_observations {
            return None;
        }
        window
            .quantile(self.quantile)
            .map(|q| q.mul_f64(self.factor.max(1.0)))
    }
}

/// A token bucket for hedges: each answer earns `budget` of a hedge, up to `burst`; a hedge
/// spends one. A slow phase of the whole fleet cannot double the load by hedging everything.
#[derive(Debug, Clone, Copy)]
pub struct HedgeBudget {
    /// In thousandths of a hedge, so sums are exact.
    tokens: u64,
    earn: u64,
    burst: u64,
}

impl HedgeBudget {
    const ONE: u64 = 1000;

    pub fn new(policy: HedgePolicy) -> Self {
        let milli = |x: f64| (x.max(0.0) * Self::ONE as f64).round() as u64;
        HedgeBudget {
            tokens: milli(policy.burst),
            earn: milli(policy.budget),
            burst: milli(policy.burst),
        }
    }

    pub fn available(&self) -> bool {
        self.tokens >= Self::ONE
    }

    pub fn spend(&mut self) {
        self.tokens = self.tokens.saturating_sub(Self::ONE);
    }

    pub fn earn(&mut self) {
        self.tokens = (self.tokens + self.earn).min(self.burst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn depth_follows_littles_law() {
        // 1 s latency, a batch wanted every 250 ms: 4 in flight + consumed + slack.
        assert_eq!(auto_depth(Some(ms(1000)), Some(ms(250)), 32), 6);
        // Fast workers, slow trainer: one in flight, one consumed, one of slack.
        assert_eq!(auto_depth(Some(ms(10)), Some(ms(1000)), 32), 3);
        // Capped.
        assert_eq!(auto_depth(Some(ms(10_000)), Some(ms(10)), 16), 16);
        // Until the step time is known: two, however fast the workers look.
        assert_eq!(auto_depth(None, None, 32), 2);
        assert_eq!(auto_depth(Some(ms(5)), None, 8), 2);
        // The old rule jumped: a middle value, then the cap on the first latency.
        assert_eq!(legacy_auto_depth(None, None, 32), 4);
        assert_eq!(legacy_auto_depth(Some(ms(5)), None, 8), 8);
        assert_eq!(legacy_auto_depth(Some(ms(1000)), Some(ms(250)), 32), 6);
    }

    #[test]
    fn hedges_stay_within_their_budget() {
        let mut b = HedgeBudget::new(HedgePolicy::default());
        // The burst: four at once, then one per twenty answers.
        for _ in 0..4 {
            assert!(b.available());
            b.spend();
        }
        assert!(!b.available());
        for _ in 0..19 {
            b.earn();
        }
        assert!(!b.available());
        b.earn();
        assert!(b.available());
        // Earning stops at the burst.
        for _ in 0..1000 {
            b.earn();
        }
        for _ in 0..4 {
            b.spend();
        }
        assert!(!b.available());
    }

    #[test]
    fn quantiles_by_nearest_rank() {
        let mut w = LatencyWindow::default();
        assert_eq!(w.quantile(0.5), None);
        for v in 1..=100 {
            w.record(ms(v));
        }
        assert_eq!(w.quantile(0.5), Some(ms(50)));
        assert_eq!(w.quantile(0.95), Some(ms(95)));
        assert_eq!(w.quantile(1.0), Some(ms(100)));
        // The window forgets the oldest beyond its capacity.
        for _ in 0..LatencyWindow::CAPACITY {
            w.record(ms(7));
        }
        assert_eq!(w.quantile(1.0), Some(ms(7)));
    }

    #[test]
    fn hedging_waits_for_evidence() {
        let p = HedgePolicy::default();
        let mut w = LatencyWindow::default();
        for _ in 0..p.min_observations - 1 {
            w.record(ms(100));
        }
        assert_eq!(p.threshold(&w), None);
        w.record(ms(100));
        assert_eq!(p.threshold(&w), Some(ms(150)));
    }
}
