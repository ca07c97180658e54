//! The operator's own /metrics (docs/metrics.md) and health endpoints: the autoscaler's
//! per-pipeline series (shared with `stoker-lab demo`, from stoker-control) plus reconciles,
//! reconcile errors by kind, leadership and fenced writes.

use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};
use std::sync::Arc;
use std::time::Duration;
use stoker_control::metrics::ScalerMetrics;

stoker_wire::label_set! {
    /// How a reconcile ended: `stoker_operator_reconciles_total`'s `result`.
    ReconcileResult {
        Ok => "ok",
        Error => "error",
    }
}

stoker_wire::label_set! {
    /// What failed a reconcile: `stoker_operator_reconcile_errors_total`'s `kind`.
    ReconcileErrorKind {
        KubeApi => "kube_api",
        KubeClient => "kube_client",
        InvalidSpec => "invalid_spec",
        NoNamespace => "no_namespace",
        Credentials => "credentials",
        NotOwned => "not_owned",
    }
}

stoker_wire::label_set! {
    /// The reconcile step that failed: `stoker_operator_reconcile_errors_total`'s `step`.
    Step {
        Validate => "validate",
        Token => "token",
        Tls => "tls",
        Apply => "apply",
        Status => "status",
    }
}

pub struct OperatorMetrics {
    registry: Registry,
    reconciles: IntCounterVec,
    reconcile_errors: IntCounterVec,
    reconcile_seconds: HistogramVec,
    pub scaler: ScalerMetrics,
    pub leader: IntGauge,
    pub writes_fenced: IntCounter,
}

impl OperatorMetrics {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::register(Registry::new()).expect("unique metric names"))
    }

    fn register(registry: Registry) -> prometheus::Result<Self> {
        let reconciles = IntCounterVec::new(
            Opts::new(
                "stoker_operator_reconciles_total",
                "Reconciles of DataPipelines, by result (ok, error).",
            ),
            &["result"],
        )?;
        let reconcile_errors = IntCounterVec::new(
            Opts::new(
                "stoker_operator_reconcile_errors_total",
                "Failed reconciles by error kind (invalid_spec, kube_api, ...) and the step \
                 that failed (validate, token, tls, apply, status).",
            ),
            &["kind", "step"],
        )?;
        let reconcile_seconds = HistogramVec::new(
            HistogramOpts::new(
                "stoker_operator_reconcile_seconds",
                "Time one reconcile took (API calls and metric scrapes included).",
            )
            .buckets(prometheus::exponential_buckets(0.005, 2.0, 12)?),
            &[],
        )?;
        let leader = IntGauge::new(
            "stoker_operator_leader",
            "1 while this replica holds the leader Lease and reconciles.",
        )?;
        let writes_fenced = IntCounter::new(
            "stoker_operator_writes_fenced_total",
            "Writes not sent, or cut off, because this replica no longer held the leader Lease \
             with the margin left (paused or cut off past its renew deadline).",
        )?;
        registry.register(Box::new(reconciles.clone()))?;
        for result in ReconcileResult::ALL {
            reconciles.with_label_values(&[result.as_str()]);
        }
        registry.register(Box::new(reconcile_errors.clone()))?;
        registry.register(Box::new(reconcile_seconds.clone()))?;
        registry.register(Box::new(leader.clone()))?;
        registry.register(Box::new(writes_fenced.clone()))?;
        let scaler = ScalerMetrics::register(&registry)?;
        Ok(OperatorMetrics {
            registry,
            reconciles,
            reconcile_errors,
            reconcile_seconds,
            scaler,
            leader,
            writes_fenced,
        })
    }

    /// One reconcile's outcome: `Err((kind, step))` counts an error of that kind at that step.
    pub fn observe_reconcile(
        &self,
        took: Duration,
        result: Result<(), (ReconcileErrorKind, Step)>,
    ) {
        let label = match result {
            Ok(()) => ReconcileResult::Ok,
            Err((kind, step)) => {
                self.reconcile_errors
                    .with_label_values(&[kind.as_str(), step.as_str()])
                    .inc();
                ReconcileResult::Error
            }
        };
        self.reconciles.with_label_values(&[label.as_str()]).inc();
        self.reconcile_seconds
            .with_label_values(&[])
            .observe(took.as_secs_f64());
    }

    pub fn render(&self) -> String {
        stoker_control::metrics::render(&self.registry)
    }
}

/// /metrics, /healthz (the process runs) and /readyz (same: a standby replica is healthy).
pub async fn serve(listener: tokio::net::TcpListener, metrics: Arc<OperatorMetrics>) {
    use axum::routing::get;
    let app = axum::Router::new()
        .route("/metrics", get(move || async move { metrics.render() }))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(|| async { "ok" }));
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!("operator metrics endpoint: {e}");
    }
}

#[cfg(test)]
mod label_set_tests {
    use super::*;
    use stoker_testkit::docs::assert_documented;

    const DOCS: &str = include_str!("../../docs/metrics.md");

    #[test]
    fn the_docs_list_every_label_value_and_no_other() {
        assert_documented(
            DOCS,
            "stoker_operator_reconciles_total",
            "result",
            ReconcileResult::ALL.iter().map(|v| v.as_str()),
        );
        assert_documented(
            DOCS,
            "stoker_operator_reconcile_errors_total",
            "kind",
            ReconcileErrorKind::ALL.iter().map(|v| v.as_str()),
        );
        assert_documented(
            DOCS,
            "stoker_operator_reconcile_errors_total",
            "step",
            Step::ALL.iter().map(|v| v.as_str()),
        );
    }
}
