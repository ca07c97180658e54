//! What identifies a pipeline's objects: their names, the labels they carry, the selectors
//! that find them (one definition for the builders, the caches and the status).

use crate::crd::DataPipeline;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};
use std::collections::BTreeMap;

/// The field manager of every apply, and the `managed-by` label's value.
pub const FIELD_MANAGER: &str = "stoker-operator";

/// The longest DataPipeline name: every name derived from it is a DNS-1035 label of at most 63
/// characters, the longest `<name>-workers` (the CRD's CEL rule says the same).
pub const MAX_NAME_LEN: usize = 63 - "-workers".len();

/// Names of everything a pipeline owns.
pub struct Names {
    pub workers: String,
    pub service: String,
    pub token_secret: String,
    /// The pipeline's CA (certificate and key: the operator's alone).
    pub ca_secret: String,
    /// The workers' certificate and key.
    pub tls_secret: String,
    /// The CA certificate, for trainers.
    pub ca_config_map: String,
}

pub fn names(dp: &DataPipeline) -> Names {
    let name = dp.name_any();
    Names {
        workers: format!("{name}-workers"),
        service: format!("{name}-workers"),
        token_secret: dp
            .spec
            .token_secret
            .clone()
            .unwrap_or_else(|| format!("{name}-token")),
        ca_secret: format!("{name}-tls-ca"),
        tls_secret: format!("{name}-tls"),
        ca_config_map: format!("{name}-ca"),
    }
}

/// The label naming the pipeline a worker pod belongs to.
pub const INSTANCE: &str = "app.kubernetes.io/instance";

/// Labels that select this pipeline's worker pods.
pub fn selector_labels(dp: &DataPipeline) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".into(), "stoker-worker".into()),
        (INSTANCE.into(), dp.name_any()),
    ])
}

/// The selector as a string (status.selector, for the scale subresource).
pub fn selector_string(dp: &DataPipeline) -> String {
    label_selector_string(&selector_labels(dp))
}

/// `k=v,k=v`: a label selector for list calls.
pub fn label_selector_string(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

const MANAGED_BY: &str = "app.kubernetes.io/managed-by";

/// Selects everything the operator applies (every object carries [`labels`]): the watches of
/// owned objects and worker pods.
pub fn managed_selector() -> String {
    format!("{MANAGED_BY}={FIELD_MANAGER}")
}

pub fn labels(dp: &DataPipeline) -> BTreeMap<String, String> {
    let mut l = selector_labels(dp);
    l.insert(MANAGED_BY.into(), FIELD_MANAGER.into());
    l.insert("app.kubernetes.io/component".into(), "worker".into());
    l
}

/// An owned object's metadata: its name in the pipeline's namespace, the pipeline's labels, the
/// pipeline as its controlling owner (garbage-collected with it).
pub fn meta(dp: &DataPipeline, name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: dp.namespace(),
        labels: Some(labels(dp)),
        owner_references: Some(vec![owner(dp)]),
        ..ObjectMeta::default()
    }
}

/// Whether the pipeline of uid `pipeline_uid` owns the object of `meta`: the operator writes
/// only into what it created.
pub fn owned_by(meta: &ObjectMeta, pipeline_uid: Option<&str>) -> bool {
    pipeline_uid.is_some_and(|uid| meta.owner_references.iter().flatten().any(|o| o.uid == uid))
}

/// The pipeline an object built with [`meta`] belongs to: its owner's uid and name.
pub fn pipeline_of(meta: &ObjectMeta) -> Option<(&str, &str)> {
    let o = meta.owner_references.as_ref()?.first()?;
    Some((o.uid.as_str(), o.name.as_str()))
}

fn owner(dp: &DataPipeline) -> OwnerReference {
    dp.controller_owner_ref(&())
        .expect("a DataPipeline from the API server has a name and uid")
}
