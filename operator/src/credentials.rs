//! A pipeline's credentials as objects, pure: the token Secret, the CA Secret, the workers'
//! certificate Secret, the CA ConfigMap trainers mount, and when a worker certificate is
//! issued again (docs/security.md). The I/O is `secrets`.

use crate::crd::DataPipeline;
use crate::labels::{meta, names};
use crate::validate::Valid;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::ByteString;
use kube::ResourceExt;
use std::collections::BTreeMap;
use std::time::Duration;

const DAY: u64 = 86_400;
/// The pipeline's CA: long-lived, since every rank trusts it for the pipeline's life.
pub const CA_VALIDITY: Duration = Duration::from_secs(3650 * DAY);
/// A worker certificate: renewed with [`RENEW_BEFORE`] left, so a worker restarted up to then
/// still serves a valid one.
pub const WORKER_VALIDITY: Duration = Duration::from_secs(90 * DAY);
pub const RENEW_BEFORE: Duration = Duration::from_secs(30 * DAY);

/// On the workers' Secret and their pod template: when the certificate expires (Unix
/// seconds). A new value rolls the workers onto the new certificate.
pub const NOT_AFTER: &str = "stoker.dev/tls-not-after";
/// On the workers' Secret: the names its certificate holds, comma-separated.
const CERT_NAMES: &str = "stoker.dev/tls-names";

/// Keys of the CA Secret (the CA's subject name is kept too: the signer is rebuilt from it).
const CA_CERT: &str = "ca.crt";
const CA_KEY: &str = "ca.key";
const CA_NAME: &str = "name";

/// The names ranks dial a pipeline's workers by: the headless Service, qualified up to the
/// cluster domain.
pub fn worker_names(dp: &DataPipeline, cluster_domain: &str) -> Vec<String> {
    let (svc, ns) = (names(dp).service, dp.namespace().unwrap_or_default());
    vec![
        svc.clone(),
        format!("{svc}.{ns}"),
        format!("{svc}.{ns}.svc"),
        format!("{svc}.{ns}.svc.{}", cluster_domain.trim_end_matches('.')),
    ]
}

/// The generated pipeline token (created once; the operator never overwrites it).
pub fn token_secret(p: &Valid, token: &str) -> Secret {
    let dp = p.dp;
    Secret {
        metadata: meta(dp, &names(dp).token_secret),
        string_data: Some(BTreeMap::from([("token".into(), token.into())])),
        type_: Some("Opaque".into()),
        ..Secret::default()
    }
}

fn bytes(pairs: &[(&str, &str)]) -> BTreeMap<String, ByteString> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
        .collect()
}

/// The pipeline's CA: its certificate, key and subject name. Only the operator reads it.
pub fn ca_secret(dp: &DataPipeline, name: &str, cert_pem: &str, key_pem: &str) -> Secret {
    Secret {
        metadata: meta(dp, &names(dp).ca_secret),
        data: Some(bytes(&[
            (CA_CERT, cert_pem),
            (CA_KEY, key_pem),
            (CA_NAME, name),
        ])),
        type_: Some("Opaque".into()),
        ..Secret::default()
    }
}

/// The CA as kept: (subject name, certificate, key), or what is wrong with the Secret.
pub fn read_ca(secret: &Secret) -> Result<(String, String, String), String> {
    let field = |key: &str| {
        let v = secret
            .data
            .as_ref()
            .and_then(|d| d.get(key))
            .ok_or_else(|| format!("no key {key}"))?;
        String::from_utf8(v.0.clone()).map_err(|_| format!("{key} is not text"))
    };
    Ok((field(CA_NAME)?, field(CA_CERT)?, field(CA_KEY)?))
}

/// The workers' certificate (a `kubernetes.io/tls` Secret), with the CA certificate beside it
/// and, as annotations, when it expires and the names it holds.
pub fn worker_secret(
    dp: &DataPipeline,
    ca_pem: &str,
    cert_pem: &str,
    key_pem: &str,
    worker_names: &[String],
    not_after: u64,
) -> Secret {
    let mut metadata = meta(dp, &names(dp).tls_secret);
    metadata.annotations = Some(BTreeMap::from([
        (NOT_AFTER.into(), not_after.to_string()),
        (CERT_NAMES.into(), worker_names.join(",")),
    ]));
    Secret {
        metadata,
        data: Some(bytes(&[
            ("tls.crt", cert_pem),
            ("tls.key", key_pem),
            (CA_CERT, ca_pem),
        ])),
        type_: Some("kubernetes.io/tls".into()),
        ..Secret::default()
    }
}

/// The CA certificate for trainers to mount (`ca.crt`): public, so a ConfigMap.
pub fn ca_config_map(dp: &DataPipeline, ca_pem: &str) -> ConfigMap {
    ConfigMap {
        metadata: meta(dp, &names(dp).ca_config_map),
        data: Some(BTreeMap::from([(CA_CERT.into(), ca_pem.into())])),
        ..ConfigMap::default()
    }
}

/// Whether the workers' certificate Secret `existing` can stay: `Ok(not_after)` when it holds
/// a certificate of this CA for exactly these names with more than [`RENEW_BEFORE`] left at
/// `now` (Unix seconds), else `Err(why it is issued again)`.
pub fn keep_worker_cert(
    existing: Option<&Secret>,
    ca_pem: &str,
    worker_names: &[String],
    now: u64,
) -> Result<u64, String> {
    let s = existing.ok_or("none yet")?;
    let annotation = |k: &str| s.annotations().get(k).map(String::as_str);
    let ca = s.data.as_ref().and_then(|d| d.get(CA_CERT));
    if ca.is_none_or(|c| c.0 != ca_pem.as_bytes()) {
        return Err("signed by another CA".into());
    }
    if annotation(CERT_NAMES) != Some(worker_names.join(",").as_str()) {
        return Err(format!("names changed to {}", worker_names.join(",")));
    }
    let not_after = annotation(NOT_AFTER)
        .and_then(|v| v.parse::<u64>().ok())
        .ok_or("no expiry recorded")?;
    let left = not_after.saturating_sub(now);
    if left <= RENEW_BEFORE.as_secs() {
        return Err(format!("{} days left", left / DAY));
    }
    Ok(not_after)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::example;
    use crate::labels::owned_by;

    #[test]
    fn workers_are_named_as_ranks_dial_them() {
        assert_eq!(
            worker_names(&example(), "cluster.local."),
            [
                "qwen-sft-workers",
                "qwen-sft-workers.ml",
                "qwen-sft-workers.ml.svc",
                "qwen-sft-workers.ml.svc.cluster.local"
            ]
        );
    }

    #[test]
    fn a_worker_certificate_is_kept_until_a_month_before_it_expires() {
        let dp = example();
        let names = worker_names(&dp, "cluster.local");
        let now = 1_000_000_000;
        let expires = now + WORKER_VALIDITY.as_secs();
        let secret = worker_secret(&dp, "CA", "CERT", "KEY", &names, expires);
        assert_eq!(secret.metadata.name.as_deref(), Some("qwen-sft-tls"));
        assert!(owned_by(&secret.metadata, dp.uid().as_deref()));
        let keep = |s: &Secret, ca: &str, names: &[String], now: u64| {
            keep_worker_cert(Some(s), ca, names, now)
        };
        assert_eq!(keep(&secret, "CA", &names, now), Ok(expires));
        let renew_at = expires - RENEW_BEFORE.as_secs();
        assert_eq!(keep(&secret, "CA", &names, renew_at - 1), Ok(expires));
        assert_eq!(
            keep(&secret, "CA", &names, renew_at),
            Err("30 days left".into())
        );
        assert_eq!(
            keep(&secret, "another CA", &names, now),
            Err("signed by another CA".into())
        );
        let fewer = &names[..3];
        assert!(keep(&secret, "CA", fewer, now)
            .unwrap_err()
            .starts_with("names changed"));
        assert_eq!(
            keep_worker_cert(None, "CA", &names, now),
            Err("none yet".into())
        );
    }

    #[test]
    fn the_ca_secret_reads_back_and_nothing_else_counts_as_owned() {
        let dp = example();
        let secret = ca_secret(&dp, "stoker ml/qwen-sft CA", "CERT", "KEY");
        assert_eq!(secret.metadata.name.as_deref(), Some("qwen-sft-tls-ca"));
        assert_eq!(
            read_ca(&secret),
            Ok(("stoker ml/qwen-sft CA".into(), "CERT".into(), "KEY".into()))
        );
        let mut foreign = secret.clone();
        foreign.metadata.owner_references = None;
        assert!(!owned_by(&foreign.metadata, dp.uid().as_deref()));
        foreign.data.as_mut().unwrap().remove("ca.key");
        assert_eq!(read_ca(&foreign), Err("no key ca.key".into()));
        let cm = ca_config_map(&dp, "CERT");
        assert_eq!(cm.metadata.name.as_deref(), Some("qwen-sft-ca"));
        assert_eq!(cm.data.unwrap()["ca.crt"], "CERT");
    }
}
