//! Leader election on a coordination.k8s.io Lease, so that two operator replicas are safe:
//! only the holder reconciles. The holder renews every `renew`; a Lease not renewed within its
//! duration may be taken over. Updates carry the resourceVersion read, so two candidates
//! never both win a race (the API server rejects the stale write with 409).

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use std::time::Duration;

pub struct LeaderElection {
    pub api: Api<Lease>,
    pub name: String,
    pub identity: String,
    pub duration: Duration,
}

impl LeaderElection {
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
        let expired = cur.renew_time.as_ref().is_none_or(|t| {
            let held = Duration::from_secs(cur.lease_duration_seconds.unwrap_or(15).max(1) as u64);
            let age = now.0.duration_since(t.0);
            age.as_secs_f64() > held.as_secs_f64()
        });
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

    fn election() -> (
        LeaderElection,
        tower_test::mock::Handle<Request<Body>, Response<Body>>,
    ) {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(service, "ops");
        let e = LeaderElection {
            api: Api::namespaced(client, "ops"),
            name: "stoker-operator".into(),
            identity: "me".into(),
            duration: Duration::from_secs(15),
        };
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

    #[tokio::test]
    async fn a_fresh_lease_of_another_holder_is_respected_an_expired_one_taken() {
        let path = "/apis/coordination.k8s.io/v1/namespaces/ops/leases/stoker-operator";
        // Held by another replica, renewed 3 s ago: not ours.
        let (e, mut h) = election();
        let server = tokio::spawn(async move {
            let (req, send) = h.next_request().await.unwrap();
            assert_eq!((req.method(), req.uri().path()), (&Method::GET, path));
            send.send_response(respond(&lease("other", 3)));
        });
        assert!(!e.try_acquire().await.unwrap());
        server.await.unwrap();

        // Renewed 60 s ago: expired; taken over with the resourceVersion read.
        let (e, mut h) = election();
        let server = tokio::spawn(async move {
            let (_, send) = h.next_request().await.unwrap();
            send.send_response(respond(&lease("other", 60)));
            let (req, send) = h.next_request().await.unwrap();
            assert_eq!((req.method(), req.uri().path()), (&Method::PUT, path));
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
        let server = tokio::spawn(async move {
            let (_, send) = h.next_request().await.unwrap();
            send.send_response(respond(&lease("other", 60)));
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
