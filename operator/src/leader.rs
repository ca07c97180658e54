//! Leader election on a coordination.k8s.io Lease, so that two operator replicas are safe:
//! only the holder reconciles. The holder renews every `renew`; a Lease not renewed within its
//! duration may be taken over. Updates carry the resourceVersion read, so two candidates
//! never both win a race (the API server rejects the stale write with 409).
//!
//! A Lease's age is measured on each candidate's own monotonic clock, from when it last saw the
//! Lease's resourceVersion change (client-go's rule), never from the holder's `renewTime`: that
//! is another machine's wall clock, and a candidate whose clock runs ahead would take a live
//! Lease early.
//!
//! The leader counts from when it *sent* its last successful renewal: without another within
//! [`RENEW_DEADLINE`] it steps down, and its writes are fenced ([`crate::fence`]) on the same
//! clock. A candidate saw that renewal no earlier than it was sent and waits
//! [`LEASE_DURATION`] after it: the margin between the two is what a write may take.

use crate::fence::Fence;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// How long a Lease not renewed stands: a candidate takes it after seeing it unchanged this
/// long.
pub const LEASE_DURATION: Duration = Duration::from_secs(15);
/// How often the leader renews, and a candidate tries.
pub const RENEW_EVERY: Duration = Duration::from_secs(5);
/// A leader without a successful renewal sent within this long steps down; its writes start
/// only within it.
pub const RENEW_DEADLINE: Duration = Duration::from_secs(10);

pub struct LeaderElection {
    pub api: Api<Lease>,
    pub name: String,
    pub identity: String,
    pub duration: Duration,
    /// The Lease's resourceVersion as last seen, and when it was first seen (this process's
    /// monotonic clock).
    observed: Mutex<Option<(String, Instant)>>,
    /// The Lease as this replica's last successful write left it: the next renewal writes
    /// over it directly (one request, not a read and a write), its resourceVersion the
    /// precondition; a 409 (someone else wrote since) goes back to reading it.
    written: Mutex<Option<Lease>>,
    /// The wall clock the Lease's timestamps are written with (for people reading the Lease;
    /// never compared). Tests set a skewed one.
    wall_clock: fn() -> Timestamp,
}

impl LeaderElection {
    pub fn new(api: Api<Lease>, name: &str, identity: &str, duration: Duration) -> Self {
        LeaderElection {
            api,
            name: name.into(),
            identity: identity.into(),
            duration,
            observed: Mutex::new(None),
            written: Mutex::new(None),
            wall_clock: Timestamp::now,
        }
    }

    /// Campaigns until this identity holds the Lease; returns when the winning request was
    /// sent.
    pub async fn acquire(&self) -> Instant {
        loop {
            let sent = Instant::now();
            match self.try_acquire().await {
                Ok(true) => return sent,
                Ok(false) => {}
                Err(e) => tracing::warn!("leader election: {e}"),
            }
            tokio::time::sleep(RENEW_EVERY).await;
        }
    }

    /// Keeps the Lease won by the request sent at `won`, opening `fence` from each successful
    /// renewal; returns, with the fence closed, why this replica stepped down: the Lease lost,
    /// or not renewed by the renew deadline (a slow API server, a paused process).
    pub async fn keep(&self, won: Instant, fence: &Fence) -> String {
        let mut last_ok = won;
        fence.renewed(won);
        let why = loop {
            let renewal = async {
                tokio::time::sleep(RENEW_EVERY).await;
                let sent = Instant::now();
                (sent, self.try_acquire().await)
            };
            match tokio::time::timeout_at(last_ok + RENEW_DEADLINE, renewal).await {
                Ok((sent, Ok(true))) => {
                    last_ok = sent;
                    fence.renewed(sent);
                }
                Ok((_, Ok(false))) => break "another replica holds the leader Lease".to_string(),
                Ok((_, Err(e))) => tracing::warn!("renewing the leader Lease: {e}"),
                Err(_) => {
                    break format!(
                        "the Lease was not renewed within {RENEW_DEADLINE:?} of the last renewal \
                         (candidates may take it {LEASE_DURATION:?} after it)"
                    )
                }
            }
        };
        fence.close();
        why
    }

    /// How long the Lease of `resource_version` has stood unchanged, as this process saw it
    /// (0 when it just changed, or is seen for the first time).
    fn unchanged_for(&self, resource_version: &str) -> Duration {
        let now = Instant::now();
        let mut observed = self.observed.lock().expect("observed lease");
        match &*observed {
            Some((seen, at)) if seen == resource_version => now.duration_since(*at),
            _ => {
                *observed = Some((resource_version.to_string(), now));
                Duration::ZERO
            }
        }
    }

    /// Tries once to hold the Lease; true while this identity holds it.
    pub async fn try_acquire(&self) -> Result<bool, kube::Error> {
        let now = MicroTime((self.wall_clock)());
        let spec = |acquired: Option<MicroTime>, transitions: i32| LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.duration.as_secs() as i32),
            acquire_time: acquired,
            renew_time: Some(now.clone()),
            lease_transitions: Some(transitions),
            ..LeaseSpec::default()
        };
        let written = self.written.lock().expect("written lease").take();
        if let Some(mut lease) = written {
            let cur = lease.spec.clone().unwrap_or_default();
            lease.spec = Some(spec(cur.acquire_time, cur.lease_transitions.unwrap_or(0)));
            match self.replace(&lease).await {
                Err(kube::Error::Api(e)) if e.code == 409 => {} // someone else wrote: read it
                written => return self.held(written),
            }
        }
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(spec(Some(now.clone()), 0)),
            };
            let created = self.api.create(&PostParams::default(), &lease).await;
            return self.held(created);
        };
        let cur = lease.spec.clone().unwrap_or_default();
        let mine = cur.holder_identity.as_deref() == Some(self.identity.as_str());
        let held = Duration::from_secs(cur.lease_duration_seconds.unwrap_or(15).max(1) as u64);
        let age = self.unchanged_for(lease.metadata.resource_version.as_deref().unwrap_or(""));
        let expired = cur.holder_identity.as_deref().is_none_or(str::is_empty) || age > held;
        if !mine && !expired {
            return Ok(false);
        }
        let transitions = cur.lease_transitions.unwrap_or(0) + i32::from(!mine);
        let acquired = if mine {
            cur.acquire_time
        } else {
            Some(now.clone())
        };
        lease.spec = Some(spec(acquired, transitions));
        // `lease.metadata.resource_version` is the one read: a concurrent writer makes this 409.
        self.held(self.replace(&lease).await)
    }

    async fn replace(&self, lease: &Lease) -> Result<Lease, kube::Error> {
        (self.api)
            .replace(&self.name, &PostParams::default(), lease)
            .await
    }

    /// Whether a write of the Lease made this replica its holder (409: another writer won);
    /// the Lease as written is kept for the next renewal.
    fn held(&self, written: Result<Lease, kube::Error>) -> Result<bool, kube::Error> {
        match written {
            Ok(lease) => {
                *self.written.lock().expect("written lease") = Some(lease);
                Ok(true)
            }
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests;
