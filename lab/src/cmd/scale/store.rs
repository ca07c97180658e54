//! The object store the simulated workers read from: a read's latency drawn from a profile
//! measured through the worker's own store on the embedded S3 server (`stoker-lab bench
//! store`), a request rate past which the store answers 503 SlowDown (as S3 does per prefix),
//! and the worker's retries of a throttled read: the SDK's standard retries, then the
//! worker's own pauses (`stoker_worker::source::throttled_pause`) for up to
//! `THROTTLED_FOR`, after which the read fails.

use rand::Rng;
use std::time::Duration;
use stoker_worker::source::{sdk_retry, throttled_pause, THROTTLED_FOR};

/// Seconds per read, measured.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct StoreProfile {
    /// How and on what it was measured.
    pub what: String,
    pub per_get_s: Vec<f64>,
}

/// Measured here with `stoker-lab bench store --write-store-profile`.
const EMBEDDED: &str = include_str!("store_profile.json");

impl StoreProfile {
    pub fn embedded() -> StoreProfile {
        serde_json::from_str(EMBEDDED).expect("the embedded store profile parses")
    }

    /// The read times, if they are a distribution.
    pub fn times(&self) -> anyhow::Result<&[f64]> {
        super::measured_times(&self.per_get_s)
    }
}

/// The store's request rate: a bucket holding one second of requests, refilled at the rate;
/// a request that finds it empty is answered 503 SlowDown. `None`: unlimited.
pub struct RateLimit {
    per_s: Option<f64>,
    tokens: f64,
    /// Virtual nanoseconds of the last refill.
    at: u64,
}

impl RateLimit {
    pub fn new(per_s: f64) -> RateLimit {
        let per_s = (per_s > 0.0).then_some(per_s);
        RateLimit {
            per_s,
            tokens: per_s.unwrap_or(0.0),
            at: 0,
        }
    }

    /// Whether a request arriving at `now` is served (else it is throttled).
    pub fn admit(&mut self, now: u64) -> bool {
        let Some(rate) = self.per_s else {
            return true;
        };
        let elapsed = now.saturating_sub(self.at) as f64 / 1e9;
        self.tokens = (self.tokens + elapsed * rate).min(rate);
        self.at = self.at.max(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            return true;
        }
        false
    }
}

/// The pause after a read's `made`-th attempt was throttled, `since` its first, before the
/// next, as the worker makes them: the SDK's standard retries (its i-th after a uniform draw
/// in 0..min(initial × 2^(i-1), max)), and after each round of them the worker's own pause.
/// `None` once the read has been throttled for `THROTTLED_FOR`: it fails, and with it the
/// request (a transient error the rank retries elsewhere).
pub fn retry_pause(made: u32, since: Duration, rng: &mut impl Rng) -> Option<Duration> {
    let sdk = sdk_retry();
    let per_round = sdk.max_attempts().max(1);
    let round = (made - 1) / per_round;
    let within = made - round * per_round;
    if within < per_round {
        let cap = sdk
            .initial_backoff()
            .saturating_mul(1 << (within - 1).min(16))
            .min(sdk.max_backoff());
        return Some(cap.mul_f64(rng.gen::<f64>()));
    }
    (since < THROTTLED_FOR).then(|| throttled_pause(round, rng))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn a_throttled_read_backs_off_as_the_worker_does_then_fails() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let early = Duration::from_secs(1);
        let s = |d: Duration| d.as_secs_f64();
        // The SDK's retries (below 1 s, then below 2 s), then the worker's pause (0.5-1 s
        // after the first round, 1-2 s after the second), again and again.
        assert!(s(retry_pause(1, early, &mut rng).unwrap()) < 1.0);
        assert!(s(retry_pause(2, early, &mut rng).unwrap()) < 2.0);
        let first = s(retry_pause(3, early, &mut rng).unwrap());
        assert!((0.5..=1.0).contains(&first), "{first}");
        let second = s(retry_pause(6, early, &mut rng).unwrap());
        assert!((1.0..=2.0).contains(&second), "{second}");
        let late = s(retry_pause(60, early, &mut rng).unwrap());
        assert!((10.0..=20.0).contains(&late), "{late}");
        // Throttled for as long as a rank waits: the read fails.
        assert_eq!(retry_pause(9, THROTTLED_FOR, &mut rng), None);
        // Within a round the SDK retries whatever the time.
        assert!(retry_pause(8, THROTTLED_FOR, &mut rng).is_some());
    }

    #[test]
    fn the_store_serves_its_rate_and_throttles_the_rest() {
        let mut store = RateLimit::new(100.0);
        // One second's burst, then the rate.
        let served = (0..150).filter(|_| store.admit(0)).count();
        assert_eq!(served, 100);
        let half_s = 500_000_000;
        let served = (0..150).filter(|_| store.admit(half_s)).count();
        assert_eq!(served, 50);
        let mut unlimited = RateLimit::new(0.0);
        assert!((0..10_000).all(|_| unlimited.admit(0)));
    }
}
