//! The autoscaler's Prometheus series (docs/metrics.md), one definition for both of its
//! backends: the operator registers them next to its own reconcile series, `stoker-lab demo`
//! exports them for its local process backend. Labels: namespace, pipeline.

use prometheus::{Encoder, GaugeVec, IntCounterVec, IntGaugeVec, Opts, Registry};

/// `stoker_operator_scale_decisions_total`'s `direction`, defined once: up, then down.
const DIRECTIONS: [&str; 2] = ["up", "down"];

pub struct ScalerMetrics {
    pub scale_decisions: IntCounterVec,
    pub desired: IntGaugeVec,
    pub ready: IntGaugeVec,
    pub max_workers: IntGaugeVec,
    pub target_wait_ratio: GaugeVec,
    pub metrics_available: IntGaugeVec,
}

/// One pipeline's numbers for [`ScalerMetrics::record_pipeline`].
pub struct PipelineGauges<'a> {
    pub namespace: &'a str,
    pub pipeline: &'a str,
    pub desired: i32,
    pub ready: i32,
    pub max: i32,
    pub target: Option<f64>,
    pub metrics_available: Option<bool>,
}

const LABELS: [&str; 2] = ["namespace", "pipeline"];

impl ScalerMetrics {
    /// Creates the series and registers them in `registry`.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let gauge = |name: &str, help: &str| IntGaugeVec::new(Opts::new(name, help), &LABELS);
        let m = ScalerMetrics {
            scale_decisions: IntCounterVec::new(
                Opts::new(
                    "stoker_operator_scale_decisions_total",
                    "Changes of a pipeline's worker count, by direction (up, down).",
                ),
                &["namespace", "pipeline", "direction"],
            )?,
            desired: gauge(
                "stoker_operator_desired_workers",
                "Workers the operator wants per pipeline.",
            )?,
            ready: gauge(
                "stoker_operator_ready_workers",
                "Worker pods ready to serve, per pipeline.",
            )?,
            max_workers: gauge(
                "stoker_operator_max_workers",
                "The autoscaler's maxReplicas (or the fixed count without autoscaling).",
            )?,
            target_wait_ratio: GaugeVec::new(
                Opts::new(
                    "stoker_operator_target_wait_ratio",
                    "The pipeline's target wait ratio (what the autoscaler holds the worst rank to).",
                ),
                &LABELS,
            )?,
            metrics_available: gauge(
                "stoker_operator_metrics_available",
                "1 when every trainer rank's wait counters were read at the last evaluation.",
            )?,
        };
        registry.register(Box::new(m.scale_decisions.clone()))?;
        registry.register(Box::new(m.desired.clone()))?;
        registry.register(Box::new(m.ready.clone()))?;
        registry.register(Box::new(m.max_workers.clone()))?;
        registry.register(Box::new(m.target_wait_ratio.clone()))?;
        registry.register(Box::new(m.metrics_available.clone()))?;
        Ok(m)
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
        // Pre-created at 0, so rate() sees the first decision.
        for direction in DIRECTIONS {
            self.scale_decisions
                .with_label_values(&[p.namespace, p.pipeline, direction]);
        }
    }

    pub fn count_scale(&self, namespace: &str, pipeline: &str, up: bool) {
        let direction = DIRECTIONS[usize::from(!up)];
        self.scale_decisions
            .with_label_values(&[namespace, pipeline, direction])
            .inc();
    }

    /// Drops a deleted pipeline's series (its labels would otherwise report forever).
    pub fn forget_pipeline(&self, namespace: &str, pipeline: &str) {
        let l = [namespace, pipeline];
        for g in [
            &self.desired,
            &self.ready,
            &self.max_workers,
            &self.metrics_available,
        ] {
            let _ = g.remove_label_values(&l);
        }
        let _ = self.target_wait_ratio.remove_label_values(&l);
        for direction in DIRECTIONS {
            let _ = self
                .scale_decisions
                .remove_label_values(&[namespace, pipeline, direction]);
        }
    }
}

/// The registry's series in the text exposition format.
pub fn render(registry: &Registry) -> String {
    let mut out = Vec::new();
    prometheus::TextEncoder::new()
        .encode(&registry.gather(), &mut out)
        .expect("text encoding never fails");
    String::from_utf8(out).expect("prometheus text is UTF-8")
}

#[cfg(test)]
mod direction_tests {
    #[test]
    fn the_docs_list_the_directions() {
        let docs = include_str!("../../docs/metrics.md");
        let row = docs
            .lines()
            .find(|l| l.starts_with("| `stoker_operator_scale_decisions_total`"))
            .expect("a row for stoker_operator_scale_decisions_total");
        let listed = format!("`direction` = {}", super::DIRECTIONS.join(", "));
        assert!(row.contains(&format!("{listed} |")), "{row}");
    }
}
