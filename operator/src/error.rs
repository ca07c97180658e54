//! Why a reconcile failed: the error, its metric label and the step that failed (as
//! kube-rs controller-rs labels them).

use crate::metrics::{ReconcileErrorKind, Step};
use kube::Resource;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `object` is "Kind namespace/name".
    #[error("{} {object}: {source}", .step.as_str())]
    Kube {
        step: Step,
        object: String,
        #[source]
        source: kube::Error,
    },
    /// The operator cannot honour the spec; the status and an Event say why.
    #[error("invalid spec: {}", .0.join("; "))]
    InvalidSpec(Vec<String>),
    #[error("DataPipeline without a namespace")]
    NoNamespace,
    /// The pipeline's certificates cannot be kept or made: a Secret or ConfigMap of their name
    /// that the pipeline does not own, a CA Secret that does not parse.
    #[error("tls {object}: {why}")]
    Credentials { object: String, why: String },
}

impl Error {
    /// The `kind` label of stoker_operator_reconcile_errors_total.
    pub fn metric_label(&self) -> ReconcileErrorKind {
        match self {
            Error::Kube {
                source: kube::Error::Api(_),
                ..
            } => ReconcileErrorKind::KubeApi,
            Error::Kube { .. } => ReconcileErrorKind::KubeClient,
            Error::InvalidSpec(_) => ReconcileErrorKind::InvalidSpec,
            Error::NoNamespace => ReconcileErrorKind::NoNamespace,
            Error::Credentials { .. } => ReconcileErrorKind::Credentials,
        }
    }

    /// The `step` label: where it failed.
    pub fn step_label(&self) -> Step {
        match self {
            Error::Kube { step, .. } => *step,
            Error::InvalidSpec(_) | Error::NoNamespace => Step::Validate,
            Error::Credentials { .. } => Step::Tls,
        }
    }
}

/// What failed, at which step, on which object.
pub fn at<K: Resource<DynamicType = ()>>(step: Step, obj: &K) -> impl FnOnce(kube::Error) -> Error {
    let meta = obj.meta();
    at_name::<K>(
        step,
        meta.namespace.as_deref().unwrap_or_default(),
        meta.name.as_deref().unwrap_or_default(),
    )
}

/// [`at`] for an object known by its name only (a read that found nothing yet).
pub fn at_name<K: Resource<DynamicType = ()>>(
    step: Step,
    ns: &str,
    name: &str,
) -> impl FnOnce(kube::Error) -> Error {
    let object = object_name::<K>(ns, name);
    move |source| Error::Kube {
        step,
        object,
        source,
    }
}

/// "Kind namespace/name", as errors name objects.
pub fn object_name<K: Resource<DynamicType = ()>>(ns: &str, name: &str) -> String {
    format!("{} {ns}/{name}", K::kind(&()))
}
