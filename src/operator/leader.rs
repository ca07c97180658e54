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
