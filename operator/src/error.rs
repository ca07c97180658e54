//! Why a reconcile failed: the error, its metric label and the step that failed (as
//! kube-rs controller-rs labels them).

use crate::labels::owned_by;
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
    /// The pipeline's certificates cannot be kept or made: a CA Secret that does not parse.
    #[error("tls {object}: {why}")]
    Credentials { object: String, why: String },
    /// An object of a name the pipeline's objects take exists and is not the pipeline's: it
    /// is never written (the status and an Event name it).
    #[error(
        "{} {object}: exists and is not owned by DataPipeline {pipeline}: the operator writes \
         only into what it created (rename or delete it)",
        .step.as_str()
    )]
    NotOwned {
        step: Step,
        object: String,
        pipeline: String,
    },
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
            Error::NotOwned { .. } => ReconcileErrorKind::NotOwned,
        }
    }

    /// The `step` label: where it failed.
    pub fn step_label(&self) -> Step {
        match self {
            Error::Kube { step, .. } => *step,
            Error::InvalidSpec(_) | Error::NoNamespace => Step::Validate,
            Error::Credentials { .. } => Step::Tls,
            Error::NotOwned { step, .. } => *step,
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

/// `Ok` unless `existing`, the object `ns/name` of kind `K`, is there and not owned by the
/// pipeline `(uid, name)`: the operator writes only into what it created.
pub fn ensure_owned<K: Resource<DynamicType = ()>>(
    step: Step,
    ns: &str,
    name: &str,
    existing: Option<&K>,
    (uid, pipeline): (Option<&str>, &str),
) -> Result<(), Error> {
    match existing {
        Some(obj) if !owned_by(obj.meta(), uid) => Err(Error::NotOwned {
            step,
            object: object_name::<K>(ns, name),
            pipeline: pipeline.into(),
        }),
        _ => Ok(()),
    }
}

/// "Kind namespace/name", as errors name objects.
pub fn object_name<K: Resource<DynamicType = ()>>(ns: &str, name: &str) -> String {
    format!("{} {ns}/{name}", K::kind(&()))
}
