//! Leader election on a coordination.k8s.io Lease, so that two operator replicas are safe:
//! only the holder reconciles, and two never overlap.
//!
//! - A candidate judges a Lease expired on its own monotonic clock: by how long the record
//!   (holder, renew time) it read has stayed the same since it first read it, never by
//!   comparing the holder's renew time with its own wall clock (clocks of two nodes differ).
//! - The holder counts from the start of its last successful renew and steps down (stops, and
//!   the process exits) [`STEP_DOWN_MARGIN`] before a candidate could take over; a renew that
//!   hangs (an API server stalled) cannot hold it past that.
//! - Updates carry the resourceVersion read, so two candidates never both win a race (the API
//!   server rejects the stale write with 409).

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// How long before a candidate could take the Lease its holder stops: more than a write in
/// flight takes to land.
pub const STEP_DOWN_MARGIN: Duration = Duration::from_secs(3);

pub struct LeaderElection {
    pub api: Api<Lease>,
    pub name: String,
    pub identity: String,
    pub duration: Duration,
    /// The Lease record last read, and when it was first read so.
    observed: Mutex<Option<(LeaseRecord, Instant)>>,
}

/// What changes when a holder renews.
#[derive(Clone, PartialEq)]
struct LeaseRecord {
    holder: Option<String>,
    renewed: Option<MicroTime>,
}

/// Why a holder stopped holding.
#[derive(Debug, PartialEq, Eq)]
pub enum StepDown {
    /// Another replica holds the Lease.
    Lost,
    /// No renew succeeded in time: stepped down before the Lease could be taken.
    NotRenewed(String),
}

impl LeaderElection {
    pub fn new(api: Api<Lease>, name: String, identity: String, duration: Duration) -> Self {
        LeaderElection {
            api,
            name,
            identity,
            duration,
            observed: Mutex::new(None),
        }
    }

    /// Tries once to hold the Lease; true while this identity holds it.
    pub async fn try_acquire(&self) -> Result<bool, kube::Error> {
        let read_at = Instant::now();
        let now = MicroTime(Timestamp::now());
        let spec = |acquired: Option<MicroTime>, transitions: i32| LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.duration.as_secs() as i32),
            acquire_time: acquired,
            renew_time: Some(now.clone()),
            lease_transitions: Some(transitions),
            ..LeaseSpec::default()
        };
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(spec(Some(now.clone()), 0)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(e),
            };
        };
        let cur = lease.spec.clone().unwrap_or_default();
        let mine = cur.holder_identity.as_deref() == Some(self.identity.as_str());
        let held = Duration::from_secs(cur.lease_duration_seconds.unwrap_or(15).max(1) as u64);
        let unchanged_for = self.unchanged_for(
            LeaseRecord {
                holder: cur.holder_identity.clone(),
                renewed: cur.renew_time.clone(),
            },
            read_at,
        );
        let expired = cur.holder_identity.is_none() || unchanged_for > held;
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
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// How long `record` has been what this candidate reads (0 when it just changed).
    fn unchanged_for(&self, record: LeaseRecord, read_at: Instant) -> Duration {
        let mut observed = self.observed.lock().expect("observed lease");
        match &*observed {
            Some((seen, since)) if *seen == record => read_at.duration_since(*since),
            _ => {
                *observed = Some((record, read_at));
                Duration::ZERO
            }
        }
    }

    /// Waits until this replica holds the Lease, trying every `every`.
    pub async fn acquire(&self, every: Duration) {
        loop {
            match self.try_acquire().await {
                Ok(true) => return,
                Ok(false) => {}
                Err(e) => tracing::warn!("leader election: {e}"),
            }
            tokio::time::sleep(every).await;
        }
    }

    /// Holds the Lease (acquired just before), renewing every `every`, until it is lost or
    /// could not be renewed in time: then it returns, [`STEP_DOWN_MARGIN`] before a candidate
    /// could take over, and the caller must stop writing.
    pub async fn hold(&self, every: Duration) -> StepDown {
        let mut renewed = Instant::now();
        loop {
            tokio::time::sleep(every).await;
            let started = Instant::now();
            let deadline = renewed + self.duration.saturating_sub(STEP_DOWN_MARGIN);
            match tokio::time::timeout_at(deadline, self.try_acquire()).await {
                Ok(Ok(true)) => renewed = started,
                Ok(Ok(false)) => return StepDown::Lost,
                Ok(Err(e)) if Instant::now() >= deadline => {
                    return StepDown::NotRenewed(e.to_string())
                }
                Ok(Err(e)) => tracing::warn!("renewing the leader Lease: {e}"),
                Err(_) => {
                    return StepDown::NotRenewed(format!(
                        "no renew answered within {:?} of the last",
                        deadline - renewed
                    ))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{Method, Request, Response};
    use kube::client::Body;
    use serde_json::{json, Value};

    fn election() -> (
        LeaderElection,
        tower_test::mock::Handle<Request<Body>, Response<Body>>,
    ) {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(service, "ops");
        let e = LeaderElection::new(
            Api::namespaced(client, "ops"),
            "stoker-operator".into(),
            "me".into(),
            Duration::from_secs(15),
        );
        (e, handle)
    }

    fn lease(holder: &str, renewed_secs_ago: i64) -> Value {
        let renew =
            Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(renewed_secs_ago);
        json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "stoker-operator", "namespace": "ops", "resourceVersion": "7"},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15,
                     "renewTime": MicroTime(renew), "leaseTransitions": 2}})
    }

    fn respond(v: &Value) -> Response<Body> {
        Response::builder()
            .body(Body::from(serde_json::to_vec(v).unwrap()))
            .unwrap()
    }

    const PATH: &str = "/apis/coordination.k8s.io/v1/namespaces/ops/leases/stoker-operator";

    /// Answers the next request (a GET) with `lease`.
    async fn serve_lease(h: &mut Handle, lease: &Value) {
        let (req, send) = h.next_request().await.unwrap();
        assert_eq!((req.method(), req.uri().path()), (&Method::GET, PATH));
        send.send_response(respond(lease));
    }

    /// Answers the next request (a PUT) with what it sent; returns that.
    async fn serve_put(h: &mut Handle) -> Value {
        let (req, send) = h.next_request().await.unwrap();
        assert_eq!((req.method(), req.uri().path()), (&Method::PUT, PATH));
        let body: Value =
            serde_json::from_slice(&req.into_body().collect_bytes().await.unwrap()).unwrap();
        send.send_response(respond(&body));
        body
    }

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    /// The holder's renew time says an hour ago (its clock is off, or ours): that is not
    /// expiry. The record must stand still for the Lease's duration on the candidate's own
    /// clock; a renew in between starts the count again.
    #[tokio::test(start_paused = true)]
    async fn a_lease_is_taken_only_after_its_record_stood_still_for_its_duration() {
        let (e, mut h) = election();
        let server = tokio::spawn(async move {
            serve_lease(&mut h, &lease("other", 3600)).await;
            serve_lease(&mut h, &lease("other", 3600)).await;
            // Renewed meanwhile: a new record.
            serve_lease(&mut h, &lease("other", 3500)).await;
            serve_lease(&mut h, &lease("other", 3500)).await;
            serve_put(&mut h).await
        });
        assert!(!e.try_acquire().await.unwrap(), "first read: never expired");
        tokio::time::advance(Duration::from_secs(16)).await;
        assert!(
            !e.try_acquire().await.unwrap(),
            "not renewed for 16 s, but renewed now"
        );
        assert!(
            !e.try_acquire().await.unwrap(),
            "the count starts again at the renew"
        );
        tokio::time::advance(Duration::from_secs(16)).await;
        assert!(
            e.try_acquire().await.unwrap(),
            "16 s without a renew: taken"
        );
        let put = server.await.unwrap();
        assert_eq!(put["spec"]["holderIdentity"], "me");
        assert_eq!(put["spec"]["leaseTransitions"], 3);
        assert_eq!(put["metadata"]["resourceVersion"], "7");
    }

    #[tokio::test(start_paused = true)]
    async fn a_fresh_lease_of_another_holder_is_respected_and_a_lost_race_is_not_won() {
        let (e, mut h) = election();
        let server = tokio::spawn(async move {
            serve_lease(&mut h, &lease("other", 3)).await;
            serve_lease(&mut h, &lease("other", 3)).await;
            let (_, send) = h.next_request().await.unwrap();
            let conflict = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "reason": "Conflict", "code": 409, "message": "the object has been modified"});
            send.send_response(
                Response::builder()
                    .status(409)
                    .body(Body::from(serde_json::to_vec(&conflict).unwrap()))
                    .unwrap(),
            );
        });
        assert!(!e.try_acquire().await.unwrap());
        tokio::time::advance(Duration::from_secs(20)).await;
        // Expired, but a concurrent writer won the race (409): not ours.
        assert!(!e.try_acquire().await.unwrap());
        server.await.unwrap();
    }

    /// The API server stalls after one renew: the holder steps down at 5 + 12 = 17 s, before
    /// the earliest takeover by a candidate that read the renewed record (after 5 + 15 s).
    #[tokio::test(start_paused = true)]
    async fn a_holder_whose_renews_stall_steps_down_before_the_lease_can_be_taken() {
        let (e, mut h) = election();
        let start = Instant::now();
        let server = tokio::spawn(async move {
            serve_lease(&mut h, &lease("me", 0)).await;
            serve_put(&mut h).await;
            // The next renew is never answered.
            let stalled = h.next_request().await.unwrap();
            (h, stalled)
        });
        let step_down = e.hold(Duration::from_secs(5)).await;
        let held = start.elapsed();
        assert!(
            matches!(step_down, StepDown::NotRenewed(_)),
            "{step_down:?}"
        );
        assert_eq!(held, Duration::from_secs(17));
        let earliest_takeover = Duration::from_secs(5) + e.duration;
        assert!(held + STEP_DOWN_MARGIN <= earliest_takeover);
        drop(server);
    }
}
