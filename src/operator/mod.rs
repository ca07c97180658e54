//! `stoker operator` and `stoker crd`: the Kubernetes side. CRD types (`crd`) are apart from
//! the pure resource builders and the reconcile loop.

pub mod build;
pub mod crd;

use kube::CustomResourceExt;

/// The DataPipeline CustomResourceDefinition as YAML (what `crds/` holds).
pub fn crd_yaml() -> anyhow::Result<String> {
    Ok(serde_yaml::to_string(&crd::DataPipeline::crd())?)
}
