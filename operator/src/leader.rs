//! Leader election on a coordination.k8s.io Lease, so that two operator replicas are safe:
//! only the holder reconciles. The holder renews every `renew`; a Lease not renewed within its
//! duration may be taken over. Updates carry the resourceVersion read, so two candidates
//! never both win a race (the API server rejects the stale write with 409).
//!
//! A Lease's age is measured on each candidate's own monotonic clock, from when it last saw the
//! Lease's resourceVersion change (client-go's rule), never from the holder's `renewTime`: that
//! is another machine's wall clock, and a candidate whose clock runs ahead would take a live
//! Lease early.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

pub struct LeaderElection {
    pub api: Api<Lease>,
    pub name: String,
    pub identity: String,
    pub duration: Duration,
    /// The Lease's resourceVersion as last seen, and when it was first seen (this process's
    /// monotonic clock).
    observed: Mutex<Option<(String, Instant)>>,
}

impl LeaderElection {
    pub fn new(api: Api<Lease>, name: &str, identity: &str, duration: Duration) -> Self {
        LeaderElection {
            api,
            name: name.into(),
            identity: identity.into(),
            duration,
            observed: Mutex::new(None),
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{Method, Request, Response};
    use kube::client::Body;
    use serde_json::{json, Value};

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    fn election() -> (LeaderElection, Handle) {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(service, "ops");
        let api = Api::namespaced(client, "ops");
        let e = LeaderElection::new(api, "stoker-operator", "me", Duration::from_secs(15));
        (e, handle)
    }

    /// The Lease at `resource_version`, held by `holder`, whose `renewTime` (the holder's wall
    /// clock) says `renewed_secs_ago`.
    fn lease(holder: &str, renewed_secs_ago: i64, resource_version: &str) -> Value {
        let renew =
            Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(renewed_secs_ago);
        json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "stoker-operator", "namespace": "ops",
                         "resourceVersion": resource_version},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15,
                     "renewTime": MicroTime(renew), "leaseTransitions": 2}})
    }

    const PATH: &str = "/apis/coordination.k8s.io/v1/namespaces/ops/leases/stoker-operator";

    /// One try against a Lease answered as `answer`: whether it was taken (the PUT echoed).
    async fn try_once(e: &LeaderElection, h: &mut Handle, answer: Value) -> bool {
        let serve = async {
            let (req, send) = h.next_request().await.unwrap();
            assert_eq!((req.method(), req.uri().path()), (&Method::GET, PATH));
            send.send_response(respond(&answer));
            // A PUT follows only when the Lease is taken.
            if let Ok(Some((req, send))) =
                tokio::time::timeout(Duration::from_millis(100), h.next_request()).await
            {
                assert_eq!(req.method(), Method::PUT);
                let body = req.into_body().collect_bytes().await.unwrap();
                let mut put: Value = serde_json::from_slice(&body).unwrap();
                put["metadata"]["resourceVersion"] = json!("8");
                send.send_response(respond(&put));
            }
        };
        let (taken, ()) = tokio::join!(e.try_acquire(), serve);
        taken.unwrap()
    }

    /// Elections on the candidate's own clock: a Lease is taken only after this process saw
    /// it unchanged for its whole duration, whatever the holder's timestamps say — a holder
    /// whose clock is 30 s behind (its renewTime "60 s ago") keeps the Lease while it renews,
    /// and one whose clock is 30 s ahead loses it once it stops.
    #[tokio::test(start_paused = true)]
    async fn a_lease_is_taken_only_after_this_candidate_saw_it_unchanged_for_its_duration() {
        let (e, mut h) = election();
        // Renewed "60 s ago" by the holder's clock, first seen now: not taken.
        assert!(!try_once(&e, &mut h, lease("other", 60, "7")).await);
        // The holder renews (a new resourceVersion) every 5 s: never taken, for a minute.
        for rv in 8..20 {
            tokio::time::advance(Duration::from_secs(5)).await;
            assert!(!try_once(&e, &mut h, lease("other", 60, &rv.to_string())).await);
        }
        // It stops renewing (its renewTime says "in 30 s", a clock ahead): taken only once
        // this candidate saw the same version for more than 15 s.
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(!try_once(&e, &mut h, lease("other", -30, "19")).await);
        tokio::time::advance(Duration::from_secs(6)).await;
        assert!(try_once(&e, &mut h, lease("other", -30, "19")).await);
    }

    fn respond(v: &Value) -> Response<Body> {
        Response::builder()
            .body(Body::from(serde_json::to_vec(v).unwrap()))
            .unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn an_expired_lease_is_taken_with_the_version_read_and_a_race_is_lost_on_409() {
        // Seen unchanged for more than its duration: taken over with the resourceVersion read.
        let (e, mut h) = election();
        assert!(!try_once(&e, &mut h, lease("other", 0, "7")).await);
        tokio::time::advance(Duration::from_secs(16)).await;
        let server = tokio::spawn(async move {
            let (_, send) = h.next_request().await.unwrap();
            send.send_response(respond(&lease("other", 0, "7")));
            let (req, send) = h.next_request().await.unwrap();
            assert_eq!((req.method(), req.uri().path()), (&Method::PUT, PATH));
            let body: Value =
                serde_json::from_slice(&req.into_body().collect_bytes().await.unwrap()).unwrap();
            send.send_response(respond(&body));
            body
        });
        assert!(e.try_acquire().await.unwrap());
        let put = server.await.unwrap();
        assert_eq!(put["spec"]["holderIdentity"], "me");
        assert_eq!(put["spec"]["leaseTransitions"], 3);
        assert_eq!(put["metadata"]["resourceVersion"], "7");

        // A concurrent writer won the race (409): not ours.
        let (e, mut h) = election();
        assert!(!try_once(&e, &mut h, lease("other", 0, "7")).await);
        tokio::time::advance(Duration::from_secs(16)).await;
        let server = tokio::spawn(async move {
            let (_, send) = h.next_request().await.unwrap();
            send.send_response(respond(&lease("other", 0, "7")));
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
        server.await.unwrap();
    }
}
