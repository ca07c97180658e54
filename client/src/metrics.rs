//! The trainer side's Prometheus series (docs/metrics.md) and a minimal /metrics endpoint.
//!
//! The operator's autoscaler reads `stoker_trainer_wait_seconds_total` and
//! `stoker_trainer_step_seconds_total`: the rate of the first over the rate of both is the
//! wait ratio of this rank.

use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

stoker_wire::label_set! {
    /// Problems with workers: `stoker_trainer_worker_errors_total`'s `kind`.
    WorkerErrorKind {
        Connect => "connect",
        Refused => "refused",
        PlanMismatch => "plan_mismatch",
        Lost => "lost",
        Answer => "answer",
        Poison => "poison",
        WrongBatch => "wrong_batch",
        MalformedBatch => "malformed_batch",
    }
}

stoker_wire::label_set! {
    /// Why a batch a worker answered was never delivered:
    /// `stoker_trainer_batches_rejected_total`'s `reason`.
    RejectReason {
        WrongBatch => "wrong_batch",
        MalformedLayout => "malformed_layout",
        MediaMismatch => "media_mismatch",
    }
}

stoker_wire::label_set! {
    /// Why a request is sent again: `stoker_trainer_retries_total`'s `reason`.
    RetryReason {
        WorkerLost => "worker_lost",
        Draining => "draining",
        PlanMismatch => "plan_mismatch",
        Transient => "transient",
        Deadline => "deadline",
        Refused => "refused",
        Failed => "failed",
        Silent => "silent",
    }
}

stoker_wire::label_set! {
    /// What became of a straggler's duplicate: `stoker_trainer_hedges_total`'s `outcome`.
    HedgeOutcome {
        Sent => "sent",
        Won => "won",
        OverBudget => "over_budget",
    }
}

pub struct ClientMetrics {
    pub registry: Registry,
    pub wait_seconds: prometheus::Counter,
    pub step_seconds: prometheus::Counter,
    pub samples: IntCounter,
    pub batches: IntCounter,
    pub payload_bytes: IntCounter,
    pub skipped_samples: IntCounter,
    pub in_flight: IntGauge,
    pub depth: IntGauge,
    pub workers: IntGauge,
    pub retries: IntCounterVec,
    pub hedges: IntCounterVec,
    pub errors: IntCounterVec,
    pub rejected: IntCounterVec,
    /// Request to whole answer, whichever worker answered: no per-worker label, so a rank's
    /// page does not grow with the workers (a worker's own series name a slow one).
    pub request_latency: Histogram,
    pub wait_ratio: Gauge,
    pub next_wait: Histogram,
}

impl ClientMetrics {
    pub fn new(pipeline: &str, rank: u32) -> Arc<Self> {
        let labels = [
            ("pipeline".to_string(), pipeline.to_string()),
            ("rank".to_string(), rank.to_string()),
        ];
        let registry = Registry::new_custom(None, Some(labels.into_iter().collect()))
            .expect("static registry config");
        let counter = |name: &str, help: &str| {
            let c = prometheus::Counter::new(name, help).expect("valid metric");
            registry.register(Box::new(c.clone())).expect("unique");
            c
        };
        let int_counter = |name: &str, help: &str| {
            let c = IntCounter::new(name, help).expect("valid metric");
            registry.register(Box::new(c.clone())).expect("unique");
            c
        };
        let int_gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("valid metric");
            registry.register(Box::new(g.clone())).expect("unique");
            g
        };
        let counter_vec = |name: &str, help: &str, label: &str| {
            let c = IntCounterVec::new(Opts::new(name, help), &[label]).expect("valid metric");
            registry.register(Box::new(c.clone())).expect("unique");
            c
        };
        let latency_buckets = prometheus::exponential_buckets(0.005, 2.0, 14).expect("buckets");
        let request_latency = Histogram::with_opts(
            HistogramOpts::new(
                "stoker_trainer_request_seconds",
                "Time from sending a batch request to having its whole answer.",
            )
            .buckets(latency_buckets.clone()),
        )
        .expect("valid metric");
        registry
            .register(Box::new(request_latency.clone()))
            .expect("unique");
        let next_wait = Histogram::with_opts(
            HistogramOpts::new(
                "stoker_trainer_next_wait_seconds",
                "Time one call for the next batch blocked.",
            )
            .buckets(
                std::iter::once(0.0001)
                    .chain(latency_buckets.iter().copied())
                    .collect(),
            ),
        )
        .expect("valid metric");
        registry
            .register(Box::new(next_wait.clone()))
            .expect("unique");
        let wait_ratio = Gauge::new(
            "stoker_trainer_wait_ratio",
            "Wait ratio over the last steps (about 30 s): blocked time / wall time.",
        )
        .expect("valid metric");
        registry
            .register(Box::new(wait_ratio.clone()))
            .expect("unique");
        let m = ClientMetrics {
            wait_seconds: counter(
                "stoker_trainer_wait_seconds_total",
                "Time the trainer spent blocked waiting for its next batch.",
            ),
            step_seconds: counter(
                "stoker_trainer_step_seconds_total",
                "Time the trainer spent between asking for batches (its own step time).",
            ),
            samples: int_counter(
                "stoker_trainer_samples_total",
                "Samples handed to the trainer.",
            ),
            batches: int_counter(
                "stoker_trainer_batches_total",
                "Batches handed to the trainer.",
            ),
            payload_bytes: int_counter(
                "stoker_trainer_received_bytes_total",
                "Batch payload bytes received from workers (hedged duplicates included).",
            ),
            skipped_samples: int_counter(
                "stoker_trainer_skipped_samples_total",
                "Samples that workers reported as unservable (named in each batch).",
            ),
            in_flight: int_gauge(
                "stoker_trainer_requests_in_flight",
                "Batch requests sent and not yet answered.",
            ),
            depth: int_gauge(
                "stoker_trainer_prefetch_depth",
                "Batches the client keeps requested ahead of the trainer.",
            ),
            workers: int_gauge(
                "stoker_trainer_workers",
                "Workers connected and serving this plan.",
            ),
            retries: counter_vec(
                "stoker_trainer_retries_total",
                "Batch requests sent again to another worker, by reason (worker_lost, draining, plan_mismatch, transient, deadline).",
                "reason",
            ),
            hedges: counter_vec(
                "stoker_trainer_hedges_total",
                "Duplicate requests for stragglers, by outcome (sent, won, over_budget: not sent, the hedge budget was spent).",
                "outcome",
            ),
            errors: counter_vec(
                "stoker_trainer_worker_errors_total",
                "Problems with workers, by kind (connect, refused, plan_mismatch, lost, answer, poison, wrong_batch, malformed_batch).",
                "kind",
            ),
            rejected: counter_vec(
                "stoker_trainer_batches_rejected_total",
                "Batches a worker answered that were never delivered, by reason (wrong_batch, malformed_layout, media_mismatch); each is asked for elsewhere.",
                "reason",
            ),
            request_latency,
            wait_ratio,
            next_wait,
            registry,
        };
        // Every labelled series exists from the start (at 0): dashboards and alerts see them.
        for reason in RetryReason::ALL {
            m.retries.with_label_values(&[reason.as_str()]);
        }
        for outcome in HedgeOutcome::ALL {
            m.hedges.with_label_values(&[outcome.as_str()]);
        }
        for kind in WorkerErrorKind::ALL {
            m.errors.with_label_values(&[kind.as_str()]);
        }
        for reason in RejectReason::ALL {
            m.rejected.with_label_values(&[reason.as_str()]);
        }
        Arc::new(m)
    }

    pub fn error(&self, kind: WorkerErrorKind) {
        self.errors.with_label_values(&[kind.as_str()]).inc();
    }

    pub fn reject(&self, reason: RejectReason) {
        self.rejected.with_label_values(&[reason.as_str()]).inc();
    }

    pub fn retry(&self, reason: RetryReason) {
        self.retries.with_label_values(&[reason.as_str()]).inc();
    }

    pub fn hedge(&self, outcome: HedgeOutcome) {
        self.hedges.with_label_values(&[outcome.as_str()]).inc();
    }

    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding never fails");
        String::from_utf8(out).expect("utf-8")
    }
}

/// Serves GET /metrics on `listener` until the runtime stops. Deliberately tiny (HTTP/1.0,
/// one request per connection) so that the Python extension carries no HTTP stack.
pub async fn serve(listener: tokio::net::TcpListener, metrics: Arc<ClientMetrics>) {
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            continue;
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut req = Vec::with_capacity(1024);
            let mut chunk = [0u8; 1024];
            // Read the request head (bounded: 8 KiB, 5 s).
            let read = tokio::time::timeout(std::time::Duration::from_secs(5), async {
                while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < 8192 {
                    match sock.read(&mut chunk).await {
                        Ok(0) | Err(_) => return false,
                        Ok(n) => req.extend_from_slice(&chunk[..n]),
                    }
                }
                true
            })
            .await;
            if read != Ok(true) {
                return;
            }
            let (status, ctype, body) = if req.starts_with(b"GET /metrics") {
                ("200 OK", "text/plain; version=0.0.4", metrics.render())
            } else {
                ("404 Not Found", "text/plain", "try /metrics\n".to_string())
            };
            let head = format!(
                "HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = sock.write_all(head.as_bytes()).await;
            let _ = sock.write_all(body.as_bytes()).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank's page is the same size whatever the workers it used: what the operator reads
    /// per round at 4,096 ranks. Beside it the layout before (the latency histogram per
    /// worker) at 1,024 workers, rendered by the same library.
    #[test]
    fn a_ranks_page_does_not_grow_with_the_workers() {
        let m = ClientMetrics::new("train", 4095);
        for i in 0..10_000 {
            m.request_latency.observe(0.01 * (i % 300) as f64);
            m.next_wait.observe(0.001);
        }
        let page = m.render().len();
        let before = prometheus::HistogramVec::new(
            HistogramOpts::new("stoker_trainer_request_seconds", "per worker")
                .buckets(prometheus::exponential_buckets(0.005, 2.0, 14).unwrap()),
            &["worker"],
        )
        .unwrap();
        let r = Registry::new_custom(
            None,
            Some(
                [
                    ("pipeline".into(), "train".into()),
                    ("rank".into(), "4095".into()),
                ]
                .into(),
            ),
        )
        .unwrap();
        r.register(Box::new(before.clone())).unwrap();
        for w in 0..1024 {
            before
                .with_label_values(&[&format!("10.1.{}.{}:7700", w / 256, w % 256)])
                .observe(0.1);
        }
        let mut out = Vec::new();
        TextEncoder::new().encode(&r.gather(), &mut out).unwrap();
        eprintln!(
            "page {page} B (x 4,096 ranks: {:.1} MiB a round); per-worker histogram at 1,024 workers: {} B more (x 4,096: {:.2} GiB)",
            (page * 4096) as f64 / (1 << 20) as f64,
            out.len(),
            (out.len() * 4096) as f64 / (1u64 << 30) as f64
        );
        assert!(page < 16 << 10, "{page} bytes");
        assert!(out.len() > 100 * page, "{} vs {page}", out.len());
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
            "stoker_trainer_worker_errors_total",
            "kind",
            WorkerErrorKind::ALL.iter().map(|v| v.as_str()),
        );
        assert_documented(
            DOCS,
            "stoker_trainer_batches_rejected_total",
            "reason",
            RejectReason::ALL.iter().map(|v| v.as_str()),
        );
        assert_documented(
            DOCS,
            "stoker_trainer_retries_total",
            "reason",
            RetryReason::ALL.iter().map(|v| v.as_str()),
        );
        assert_documented(
            DOCS,
            "stoker_trainer_hedges_total",
            "outcome",
            HedgeOutcome::ALL.iter().map(|v| v.as_str()),
        );
    }

    #[test]
    fn every_labelled_series_exists_from_the_start() {
        let text = ClientMetrics::new("p", 0).render();
        let series = WorkerErrorKind::ALL
            .iter()
            .map(|k| format!("kind=\"{}\"", k.as_str()))
            .chain(
                RetryReason::ALL
                    .iter()
                    .map(|r| format!("reason=\"{}\"", r.as_str())),
            )
            .chain(
                HedgeOutcome::ALL
                    .iter()
                    .map(|o| format!("outcome=\"{}\"", o.as_str())),
            );
        for s in series {
            assert!(text.contains(&s), "{s} missing");
        }
    }
}
