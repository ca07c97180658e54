//! The pipeline's credentials, kept: the token Secret (created once, its value never read) and
//! the TLS material (a CA per pipeline, the workers' certificate renewed before it expires, the
//! CA certificate for trainers). The operator may not watch Secrets (docs/security.md), so it
//! reads them: once per pipeline, then again about hourly (someone may have deleted one), and
//! sooner while some of the pipeline's workers are not ready — which a deleted Secret causes,
//! its pods unable to mount it: a minute after the last check, then 2, 4, ... minutes while
//! they stay unready for another reason (a pipeline stuck unready costs ~6 checks an hour,
//! not 60). A settled pipeline costs 4 reads an hour, not one on every reconcile. The objects
//! are `credentials`.

use crate::crd::{DataPipeline, TlsMode};
use crate::credentials::{self as cred, CA_VALIDITY, WORKER_VALIDITY};
use crate::error::{at, at_name, ensure_owned, object_name, Error};
use crate::labels::{names, FIELD_MANAGER};
use crate::metrics::Step;
use crate::validate::Valid;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Resource, ResourceExt};
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use stoker_tls::issue::{unique_name, Authority};

/// How often a settled pipeline's credentials are read again, each pipeline at its own time
/// within ±25 % of it (pipelines created together are not all read together again).
const CHECK_EVERY: Duration = Duration::from_secs(3600);
/// The first wait before a check while some of the pipeline's workers are not ready; it
/// doubles with each check made while they are, up to [`CHECK_EVERY`].
const CHECK_UNREADY_FIRST: Duration = Duration::from_secs(60);

/// What was last made sure of, per pipeline ("namespace/name").
pub struct Credentials {
    /// The cluster's DNS domain: the last of the workers' certificate names.
    cluster_domain: String,
    tokens: Mutex<HashMap<String, Checked>>,
    /// When the TLS material was checked, and when the workers' certificate expires.
    certs: Mutex<HashMap<String, (Checked, u64)>>,
}

/// When a pipeline's credential was last made sure of, when it is next due, and how long
/// after the last check unready workers make it due.
#[derive(Clone, Copy, Debug)]
struct Checked {
    at: Instant,
    due: Instant,
    unready_wait: Duration,
}

impl Checked {
    /// A check made now (`before`: the last one), with the pipeline's workers unready or not.
    fn made(before: Option<Checked>, workers_unready: bool) -> Self {
        let at = Instant::now();
        let unready_wait = match before {
            Some(b) if workers_unready => (b.unready_wait * 2).min(CHECK_EVERY),
            _ => CHECK_UNREADY_FIRST,
        };
        Checked {
            at,
            due: at + CHECK_EVERY.mul_f64(0.75 + 0.5 * rand::random::<f64>()),
            unready_wait,
        }
    }

    fn fresh(&self, workers_unready: bool) -> bool {
        Instant::now() < self.due && !(workers_unready && self.at.elapsed() >= self.unready_wait)
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The pipeline as owner of what it writes: its uid and name.
fn owner(dp: &DataPipeline) -> (Option<&str>, &str) {
    (
        dp.metadata.uid.as_deref(),
        dp.metadata.name.as_deref().unwrap_or_default(),
    )
}

impl Credentials {
    pub fn new(cluster_domain: &str) -> Self {
        Credentials {
            cluster_domain: cluster_domain.into(),
            tokens: Mutex::default(),
            certs: Mutex::default(),
        }
    }

    /// Forgets pipelines that are gone (`live`: the keys of those that are not).
    pub fn retain(&self, live: &HashSet<String>) {
        (self.tokens.lock().expect("tokens")).retain(|k, _| live.contains(k));
        (self.certs.lock().expect("certs")).retain(|k, _| live.contains(k));
    }

    /// Creates the token Secret unless it exists: written once, and never rotated under
    /// running trainers. Its value is never read: a check reads its metadata only (is it
    /// there, is it the pipeline's); a create that finds it made meanwhile (409, another
    /// replica) is as good.
    pub async fn ensure_token(
        &self,
        valid: &Valid<'_>,
        client: &kube::Client,
        key: &str,
        workers_unready: bool,
    ) -> Result<(), Error> {
        let dp = valid.dp;
        let before = self.tokens.lock().expect("tokens").get(key).copied();
        if dp.spec.token_secret.is_some() || before.is_some_and(|c| c.fresh(workers_unready)) {
            return Ok(());
        }
        let ns = dp.namespace().unwrap_or_default();
        let name = names(dp).token_secret;
        let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
        let existing = (secrets.get_metadata_opt(&name).await).map_err(at_name::<Secret>(
            Step::Token,
            &ns,
            &name,
        ))?;
        ensure_owned(Step::Token, &ns, &name, existing.as_ref(), owner(dp))?;
        if existing.is_none() {
            let secret = cred::token_secret(valid, &random_token());
            match secrets.create(&PostParams::default(), &secret).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => return Err(at(Step::Token, &secret)(e)),
            }
        }
        let checked = Checked::made(before, workers_unready);
        (self.tokens.lock().expect("tokens")).insert(key.into(), checked);
        Ok(())
    }

    /// Makes sure of the pipeline's CA, the workers' certificate (issued again when absent,
    /// of another CA or other names, or within a month of expiry) and the trainers' ConfigMap;
    /// when the workers' certificate expires (`None`: the pipeline asked for plaintext).
    pub async fn ensure_tls(
        &self,
        dp: &DataPipeline,
        client: &kube::Client,
        key: &str,
        workers_unready: bool,
    ) -> Result<Option<u64>, Error> {
        if dp.spec.tls.mode == TlsMode::InsecurePlaintext {
            return Ok(None);
        }
        let now = unix_now();
        let before = self.certs.lock().expect("certs").get(key).copied();
        if let Some((checked, not_after)) = before {
            let renew = not_after.saturating_sub(cred::RENEW_BEFORE.as_secs()) <= now;
            if checked.fresh(workers_unready) && !renew {
                return Ok(Some(not_after));
            }
        }
        let ns = dp.namespace().unwrap_or_default();
        let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
        let ca = ensure_ca(dp, &secrets, &ns).await?;
        let n = names(dp);
        let existing = (secrets.get_opt(&n.tls_secret).await).map_err(at_name::<Secret>(
            Step::Tls,
            &ns,
            &n.tls_secret,
        ))?;
        ensure_owned(Step::Tls, &ns, &n.tls_secret, existing.as_ref(), owner(dp))?;
        let worker_names = cred::worker_names(dp, &self.cluster_domain);
        let not_after =
            match cred::keep_worker_cert(existing.as_ref(), ca.cert_pem(), &worker_names, now) {
                Ok(not_after) => not_after,
                Err(why) => {
                    let not_after = now + WORKER_VALIDITY.as_secs();
                    let issued = (ca.issue(&worker_names, WORKER_VALIDITY))
                        .map_err(|e| credentials_error::<Secret>(&ns, &n.tls_secret, e))?;
                    let secret = cred::worker_secret(
                        dp,
                        ca.cert_pem(),
                        &issued.cert_pem,
                        &issued.key_pem,
                        &worker_names,
                        not_after,
                    );
                    apply(&secrets, &secret).await?;
                    tracing::info!(
                        "{key}: issued the workers' certificate ({why}); valid 90 days, the \
                         workers roll onto it"
                    );
                    not_after
                }
            };
        ensure_ca_config_map(dp, client, &ns, ca.cert_pem()).await?;
        let checked = Checked::made(before.map(|(c, _)| c), workers_unready);
        (self.certs.lock().expect("certs")).insert(key.into(), (checked, not_after));
        Ok(Some(not_after))
    }
}

fn credentials_error<K: Resource<DynamicType = ()>>(
    ns: &str,
    name: &str,
    why: impl std::fmt::Display,
) -> Error {
    Error::Credentials {
        object: object_name::<K>(ns, name),
        why: why.to_string(),
    }
}

/// Server-side apply of an object the pipeline owns (checked by the caller).
async fn apply<K>(api: &Api<K>, obj: &K) -> Result<(), Error>
where
    K: Resource<DynamicType = ()> + Clone + serde::Serialize + serde::de::DeserializeOwned,
    K: std::fmt::Debug,
{
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    (api.patch(&obj.name_any(), &pp, &Patch::Apply(obj)).await).map_err(at(Step::Tls, obj))?;
    Ok(())
}

/// The pipeline's CA from its Secret, made and stored on first use.
async fn ensure_ca(dp: &DataPipeline, secrets: &Api<Secret>, ns: &str) -> Result<Authority, Error> {
    let name = names(dp).ca_secret;
    let get = || async {
        (secrets.get_opt(&name).await).map_err(at_name::<Secret>(Step::Tls, ns, &name))
    };
    let stored = match get().await? {
        Some(s) => s,
        None => {
            let subject = unique_name(&format!("stoker {ns}/{} CA", dp.name_any()));
            let ca = Authority::new(&subject, CA_VALIDITY)
                .map_err(|e| credentials_error::<Secret>(ns, &name, e))?;
            let secret = cred::ca_secret(dp, &subject, ca.cert_pem(), &ca.key_pem());
            match secrets.create(&PostParams::default(), &secret).await {
                Ok(_) => {
                    tracing::info!("{ns}/{}: made the pipeline's CA", dp.name_any());
                    return Ok(ca);
                }
                // Another replica made it first: use theirs.
                Err(kube::Error::Api(e)) if e.code == 409 => get()
                    .await?
                    .ok_or_else(|| credentials_error::<Secret>(ns, &name, "gone"))?,
                Err(e) => return Err(at_name::<Secret>(Step::Tls, ns, &name)(e)),
            }
        }
    };
    ensure_owned(Step::Tls, ns, &name, Some(&stored), owner(dp))?;
    let (subject, cert, key) =
        cred::read_ca(&stored).map_err(|e| credentials_error::<Secret>(ns, &name, e))?;
    Authority::from_pem(&subject, &cert, &key)
        .map_err(|e| credentials_error::<Secret>(ns, &name, e))
}

/// The trainers' copy of the CA certificate, applied unless a ConfigMap of its name is not
/// the pipeline's.
async fn ensure_ca_config_map(
    dp: &DataPipeline,
    client: &kube::Client,
    ns: &str,
    ca_pem: &str,
) -> Result<(), Error> {
    let name = names(dp).ca_config_map;
    let api = Api::<ConfigMap>::namespaced(client.clone(), ns);
    let wanted = cred::ca_config_map(dp, ca_pem);
    let existing =
        (api.get_opt(&name).await).map_err(at_name::<ConfigMap>(Step::Tls, ns, &name))?;
    ensure_owned(Step::Tls, ns, &name, existing.as_ref(), owner(dp))?;
    match existing {
        Some(cm) if cm.data == wanted.data => Ok(()),
        _ => apply(&api, &wanted).await,
    }
}

/// 256 random bits, hex.
fn random_token() -> String {
    // ThreadRng is a CSPRNG seeded from the OS.
    let b: [u8; 32] = rand::random();
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unready_workers_bring_checks_sooner_and_less_often_the_longer_they_stay() {
        let mut c = Checked::made(None, true);
        let mut waits = vec![c.unready_wait.as_secs()];
        for _ in 0..8 {
            c = Checked::made(Some(c), true);
            waits.push(c.unready_wait.as_secs());
        }
        assert_eq!(waits, [60, 120, 240, 480, 960, 1920, 3600, 3600, 3600]);
        // Ready again: the next unready spell starts at a minute.
        assert_eq!(Checked::made(Some(c), false).unready_wait.as_secs(), 60);
        let due = c.due.duration_since(c.at).as_secs_f64();
        assert!((2700.0..=4500.0).contains(&due), "{due}");
        // Just checked: fresh, unready or not.
        assert!(c.fresh(false) && c.fresh(true));
    }
}
