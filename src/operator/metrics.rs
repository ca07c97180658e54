//! The operator's own /metrics (docs/metrics.md) and health endpoints.

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};
use std::sync::Arc;
use std::time::Duration;

pub struct OperatorMetrics {
    registry: Registry,
    reconciles: IntCounterVec,
    reconcile_seconds: HistogramVec,
    pub scale_decisions: IntCounterVec,
    pub desired: IntGaugeVec,
    pub leader: IntGauge,
}

impl OperatorMetrics {
    pub fn new() -> Arc<Self> {
        let registry = Registry::new();
        let reconciles = IntCounterVec::new(
            Opts::new(
                "stoker_operator_reconciles_total",
                "Reconciles of DataPipelines, by result (ok, error).",
            ),
            &["result"],
        )
        .expect("metric");
        let reconcile_seconds = HistogramVec::new(
            HistogramOpts::new(
                "stoker_operator_reconcile_seconds",
                "Time one reconcile took (API calls and metric scrapes included).",
            )
            .buckets(prometheus::exponential_buckets(0.005, 2.0, 12).expect("buckets")),
            &[],
        )
        .expect("metric");
        let scale_decisions = IntCounterVec::new(
            Opts::new(
                "stoker_operator_scale_decisions_total",
                "Changes of a pipeline's worker count, by direction (up, down).",
            ),
            &["direction"],
        )
        .expect("metric");
        let desired = IntGaugeVec::new(
            Opts::new(
                "stoker_operator_desired_workers",
                "Workers the operator wants per pipeline.",
            ),
            &["namespace", "pipeline"],
        )
        .expect("metric");
        let leader = IntGauge::new(
            "stoker_operator_leader",
            "1 while this replica holds the leader Lease and reconciles.",
        )
        .expect("metric");
        for c in [
            Box::new(reconciles.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(reconcile_seconds.clone()),
            Box::new(scale_decisions.clone()),
            Box::new(desired.clone()),
            Box::new(leader.clone()),
        ] {
            registry.register(c).expect("unique metric");
        }
        Arc::new(OperatorMetrics {
            registry,
            reconciles,
            reconcile_seconds,
            scale_decisions,
            desired,
            leader,
        })
    }

    pub fn observe_reconcile(&self, took: Duration, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.reconciles.with_label_values(&[result]).inc();
        self.reconcile_seconds
            .with_label_values(&[])
            .observe(took.as_secs_f64());
    }

    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding never fails");
        String::from_utf8(out).expect("utf-8")
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
