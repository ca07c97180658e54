//! The operator's own /metrics (docs/metrics.md) and health endpoints.

use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};
use std::sync::Arc;
use std::time::Duration;

pub struct OperatorMetrics {
    registry: Registry,
    reconciles: IntCounterVec,
    reconcile_seconds: HistogramVec,
    pub scale_decisions: IntCounterVec,
    pub desired: IntGaugeVec,
    pub ready: IntGaugeVec,
    pub max_workers: IntGaugeVec,
    pub target_wait_ratio: GaugeVec,
    pub metrics_available: IntGaugeVec,
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
            &["namespace", "pipeline", "direction"],
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
        let per_pipeline = |name: &str, help: &str| {
            IntGaugeVec::new(Opts::new(name, help), &["namespace", "pipeline"]).expect("metric")
        };
        let ready = per_pipeline(
            "stoker_operator_ready_workers",
            "Worker pods ready to serve, per pipeline.",
        );
        let max_workers = per_pipeline(
            "stoker_operator_max_workers",
            "The autoscaler's maxReplicas (or the fixed count without autoscaling).",
        );
        let metrics_available = per_pipeline(
            "stoker_operator_metrics_available",
            "1 when every trainer rank's wait counters were read at the last evaluation.",
        );
        let target_wait_ratio = GaugeVec::new(
            Opts::new(
                "stoker_operator_target_wait_ratio",
                "The pipeline's target wait ratio (what the autoscaler holds the worst rank to).",
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
            Box::new(ready.clone()),
            Box::new(max_workers.clone()),
            Box::new(metrics_available.clone()),
            Box::new(target_wait_ratio.clone()),
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
            ready,
            max_workers,
            target_wait_ratio,
            metrics_available,
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

    /// Records one pipeline's state after a decision.
    pub fn record_pipeline(&self, p: PipelineGauges<'_>) {
        let l = [p.namespace, p.pipeline];
        self.desired.with_label_values(&l).set(p.desired as i64);
        self.ready.with_label_values(&l).set(p.ready as i64);
        self.max_workers.with_label_values(&l).set(p.max as i64);
        if let Some(t) = p.target {
            self.target_wait_ratio.with_label_values(&l).set(t);
        }
        if let Some(a) = p.metrics_available {
            self.metrics_available
                .with_label_values(&l)
                .set(i64::from(a));
        }
        for direction in ["up", "down"] {
            self.scale_decisions
                .with_label_values(&[p.namespace, p.pipeline, direction]);
        }
    }

    pub fn count_scale(&self, namespace: &str, pipeline: &str, up: bool) {
        let direction = if up { "up" } else { "down" };
        self.scale_decisions
            .with_label_values(&[namespace, pipeline, direction])
            .inc();
    }

    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding never fails");
        String::from_utf8(out).expect("utf-8")
    }
}

/// One pipeline's numbers for [`OperatorMetrics::record_pipeline`].
pub struct PipelineGauges<'a> {
    pub namespace: &'a str,
    pub pipeline: &'a str,
    pub desired: i32,
    pub ready: i32,
    pub max: i32,
    pub target: Option<f64>,
    pub metrics_available: Option<bool>,
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
