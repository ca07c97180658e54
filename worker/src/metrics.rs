//! The worker's Prometheus metrics (names follow docs/metrics.md) and its HTTP endpoint:
//! `/metrics`, `/healthz` (the process is alive) and `/readyz` (it accepts requests).

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub struct Metrics {
    pub registry: Registry,
    /// Per-stage latency: fetch, decode, resize, tokenize, collate, send.
    pub stage_seconds: HistogramVec,
    pub request_seconds: Histogram,
    pub samples_total: IntCounter,
    /// Samples served, by the dataset they come from (one label per dataset of a mix).
    pub dataset_samples_served: IntCounterVec,
    pub batches_total: IntCounter,
    pub bytes_sent_total: IntCounter,
    pub object_bytes_total: IntCounter,
    pub sample_errors_total: IntCounterVec,
    pub requests_refused_total: IntCounterVec,
    /// Requests the client cancelled before their answer was sent (a Cancel frame).
    pub requests_cancelled_total: IntCounter,
    /// Sample lines cut from a text read already made or under way ("hit"), or from one
    /// made for them ("miss").
    pub line_cache: IntCounterVec,
    /// Object-store requests by kind: count them into a store with `Store::counted`.
    pub store_requests: IntCounterVec,
    pub requests_in_flight: IntGauge,
    pub connections: IntGauge,
    pub handshakes: IntGauge,
    pub fetches_in_flight: IntGauge,
    /// Bytes of samples being prepared and batches waiting to be sent (crate::memory).
    pub memory_held_bytes: IntGauge,
    /// Work waiting for a bounded resource: "fetch" (object-store slots), "cpu" (pool).
    pub queue_depth: IntGaugeVec,
    pub dataset_samples: IntGauge,
    pub dataset_bad_lines: IntGauge,
    pub ready: AtomicBool,
    /// Why the worker cannot become ready yet, for /readyz (a missing index it will not
    /// build).
    waiting_for: std::sync::Mutex<Option<String>>,
}

stoker_wire::label_set! {
    /// Why a sample was not served: `stoker_worker_sample_errors_total`'s `kind`.
    SampleErrorKind {
        ObjectMissing => "object_missing",
        ObjectTooLarge => "object_too_large",
        ObjectStore => "object_store",
        NotUtf8 => "not_utf8",
        InvalidJson => "invalid_json",
        InvalidSample => "invalid_sample",
        PathRefused => "path_refused",
        ImageUnsupported => "image_unsupported",
        ImageCorrupt => "image_corrupt",
        ImageTooLarge => "image_too_large",
        ImageAspectRatio => "image_aspect_ratio",
        ImageOverBudget => "image_over_budget",
        ImageTooManyScans => "image_too_many_scans",
        VideoUnsupported => "video_unsupported",
        VideoCorrupt => "video_corrupt",
        VideoTooLarge => "video_too_large",
        VideoTooLong => "video_too_long",
        VideoSampling => "video_sampling",
        TooLong => "too_long",
        Text => "text",
        NoSuchSample => "no_such_sample",
        Panic => "panic",
        ShuttingDown => "shutting_down",
        Cancelled => "cancelled",
        LineTooLong => "line_too_long",
        TooManyTurns => "too_many_turns",
        TooManyImages => "too_many_images",
        SampleTooLarge => "sample_too_large",
        SampleOverWorkBudget => "sample_over_work_budget",
        SampleOverByteBudget => "sample_over_byte_budget",
    }
}

stoker_wire::label_set! {
    /// A pipeline stage: `stoker_worker_stage_seconds`' `stage`.
    Stage {
        Fetch => "fetch",
        Decode => "decode",
        Resize => "resize",
        Tokenize => "tokenize",
        Collate => "collate",
        Send => "send",
    }
}

stoker_wire::label_set! {
    /// What waits for a slot: `stoker_worker_queue_depth`'s `queue`.
    Queue {
        Fetch => "fetch",
        Cpu => "cpu",
        Requests => "requests",
    }
}

stoker_wire::label_set! {
    /// Whether a sample line came from a cached shard block: `stoker_worker_line_cache_total`'s
    /// `result`.
    LineCacheResult {
        Hit => "hit",
        Miss => "miss",
    }
}

stoker_wire::label_set! {
    /// An object-store request (each attempt of a read, each page of a listing):
    /// `stoker_worker_store_requests_total`'s `kind`.
    StoreRequest {
        Get => "get",
        GetRange => "get_range",
        Head => "head",
        List => "list",
        Put => "put",
    }
}

stoker_wire::label_set! {
    /// Why a request or a connection is refused: `stoker_worker_requests_refused_total`'s
    /// `reason`.
    RefusalReason {
        Unauthorized => "unauthorized",
        PlanMismatch => "plan_mismatch",
        BadRequest => "bad_request",
        Draining => "draining",
        NoHello => "no_hello",
        Version => "version",
        ConnectionLimit => "connection_limit",
        HandshakeLimit => "handshake_limit",
        Idle => "idle",
        Stalled => "stalled",
        Tls => "tls",
        InconsistentBatch => "inconsistent_batch",
    }
}

impl Metrics {
    /// Metrics of a worker of the pipeline "default".
    pub fn new() -> Arc<Self> {
        Self::for_pipeline("default")
    }

    /// Every series carries `pipeline`; `stoker_worker_info` adds the node (from $NODE_NAME,
    /// which the operator sets from the downward API, else the hostname) for per-node views.
    pub fn for_pipeline(pipeline: &str) -> Arc<Self> {
        let labels =
            std::collections::HashMap::from([("pipeline".to_string(), pipeline.to_string())]);
        let registry = Registry::new_custom(None, Some(labels)).expect("registry");
        let stage_seconds = HistogramVec::new(
            HistogramOpts::new(
                "stoker_worker_stage_seconds",
                "Time spent per pipeline stage, per sample (fetch, decode, resize, tokenize) or per batch (collate, send).",
            )
            .buckets(prometheus::exponential_buckets(0.0005, 2.0, 16).expect("buckets")),
            &["stage"],
        )
        .expect("metric");
        let request_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "stoker_worker_request_seconds",
                "Time from receiving a batch request to the last byte sent.",
            )
            .buckets(prometheus::exponential_buckets(0.005, 2.0, 14).expect("buckets")),
        )
        .expect("metric");
        let counter = |name: &str, help: &str| IntCounter::new(name, help).expect("metric");
        let gauge = |name: &str, help: &str| IntGauge::new(name, help).expect("metric");
        let m = Metrics {
            stage_seconds,
            request_seconds,
            samples_total: counter("stoker_worker_samples_total", "Samples served in batches."),
            batches_total: counter(
                "stoker_worker_batches_total",
                "Batches (rank slices) served.",
            ),
            bytes_sent_total: counter(
                "stoker_worker_sent_bytes_total",
                "Batch payload bytes sent to clients.",
            ),
            object_bytes_total: counter(
                "stoker_worker_object_store_read_bytes_total",
                "Bytes read from the object store.",
            ),
            dataset_samples_served: IntCounterVec::new(
                Opts::new(
                    "stoker_worker_dataset_samples_served_total",
                    "Samples served in batches, by the dataset they come from (a mix's share).",
                ),
                &["dataset"],
            )
            .expect("metric"),
            sample_errors_total: IntCounterVec::new(
                Opts::new(
                    "stoker_worker_sample_errors_total",
                    "Samples that could not be served, by kind of error.",
                ),
                &["kind"],
            )
            .expect("metric"),
            requests_refused_total: IntCounterVec::new(
                Opts::new(
                    "stoker_worker_requests_refused_total",
                    "Requests and connections refused, by reason.",
                ),
                &["reason"],
            )
            .expect("metric"),
            requests_cancelled_total: counter(
                "stoker_worker_requests_cancelled_total",
                "Requests cancelled by their client before the answer was sent.",
            ),
            line_cache: IntCounterVec::new(
                Opts::new(
                    "stoker_worker_line_cache_total",
                    "Sample lines cut from a text read already made or under way (hit) or from one made for them (miss).",
                ),
                &["result"],
            )
            .expect("metric"),
            store_requests: IntCounterVec::new(
                Opts::new(
                    "stoker_worker_store_requests_total",
                    "Object-store requests (each attempt of a read, each page of a listing), by kind.",
                ),
                &["kind"],
            )
            .expect("metric"),
            requests_in_flight: gauge(
                "stoker_worker_requests_in_flight",
                "Batch requests being prepared or sent.",
            ),
            connections: gauge(
                "stoker_worker_connections",
                "Connections holding one of the --max-connections slots.",
            ),
            handshakes: gauge(
                "stoker_worker_handshakes",
                "Connections in their TLS handshake or before their Hello (no slot held).",
            ),
            fetches_in_flight: gauge(
                "stoker_worker_object_fetches_in_flight",
                "Object-store reads in progress.",
            ),
            memory_held_bytes: gauge(
                "stoker_worker_memory_held_bytes",
                "Bytes of samples being prepared and batches waiting to be sent.",
            ),
            queue_depth: IntGaugeVec::new(
                Opts::new(
                    "stoker_worker_queue_depth",
                    "Tasks waiting for a bounded resource (fetch slots, CPU pool).",
                ),
                &["queue"],
            )
            .expect("metric"),
            dataset_samples: gauge(
                "stoker_worker_dataset_samples",
                "Valid samples in the dataset index.",
            ),
            dataset_bad_lines: gauge(
                "stoker_worker_dataset_bad_lines",
                "JSONL lines excluded by the index as invalid (listed by `stoker dataset index`).",
            ),
            ready: AtomicBool::new(false),
            waiting_for: std::sync::Mutex::new(None),
            registry,
        };
        let r = &m.registry;
        r.register(Box::new(m.stage_seconds.clone()))
            .expect("register");
        r.register(Box::new(m.request_seconds.clone()))
            .expect("register");
        for c in [
            &m.samples_total,
            &m.batches_total,
            &m.bytes_sent_total,
            &m.object_bytes_total,
            &m.requests_cancelled_total,
        ] {
            r.register(Box::new(c.clone())).expect("register");
        }
        r.register(Box::new(m.sample_errors_total.clone()))
            .expect("register");
        r.register(Box::new(m.dataset_samples_served.clone()))
            .expect("register");
        r.register(Box::new(m.requests_refused_total.clone()))
            .expect("register");
        for reason in RefusalReason::ALL {
            m.requests_refused_total
                .with_label_values(&[reason.as_str()]);
        }
        r.register(Box::new(m.line_cache.clone()))
            .expect("register");
        for result in LineCacheResult::ALL {
            m.line_cache.with_label_values(&[result.as_str()]);
        }
        r.register(Box::new(m.store_requests.clone()))
            .expect("register");
        for kind in StoreRequest::ALL {
            m.store_requests.with_label_values(&[kind.as_str()]);
        }
        for g in [
            &m.requests_in_flight,
            &m.connections,
            &m.handshakes,
            &m.fetches_in_flight,
            &m.memory_held_bytes,
            &m.dataset_samples,
            &m.dataset_bad_lines,
        ] {
            r.register(Box::new(g.clone())).expect("register");
        }
        r.register(Box::new(m.queue_depth.clone()))
            .expect("register");
        for queue in Queue::ALL {
            m.queue_depth.with_label_values(&[queue.as_str()]);
        }
        for stage in Stage::ALL {
            m.stage_seconds.with_label_values(&[stage.as_str()]);
        }
        for kind in SampleErrorKind::ALL {
            m.sample_errors_total.with_label_values(&[kind.as_str()]);
        }
        let info = IntGaugeVec::new(
            Opts::new(
                "stoker_worker_info",
                "Always 1; labels name the node the worker runs on and its version.",
            ),
            &["node", "version"],
        )
        .expect("metric");
        info.with_label_values(&[&node_name(), env!("CARGO_PKG_VERSION")])
            .set(1);
        r.register(Box::new(info)).expect("register");
        Arc::new(m)
    }

    pub fn observe_stage(&self, stage: Stage, d: std::time::Duration) {
        self.stage_seconds
            .with_label_values(&[stage.as_str()])
            .observe(d.as_secs_f64());
    }

    /// A task waiting in `queue` until the guard drops.
    pub fn queued(&self, queue: Queue) -> GaugeGuard {
        GaugeGuard::new(&self.queue_depth.with_label_values(&[queue.as_str()]))
    }

    pub fn line_cache(&self, result: LineCacheResult) {
        self.line_cache.with_label_values(&[result.as_str()]).inc();
    }

    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding");
        String::from_utf8(buf).expect("prometheus text is UTF-8")
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    /// What /readyz names while not ready (`None`: nothing but starting or draining).
    pub fn set_waiting_for(&self, why: Option<String>) {
        *self.waiting_for.lock().expect("not poisoned") = why;
    }

    /// /readyz's answer: ready, or not and why.
    fn readiness(&self) -> (bool, String) {
        if self.ready.load(Ordering::SeqCst) {
            return (true, "ready\n".into());
        }
        match &*self.waiting_for.lock().expect("not poisoned") {
            Some(why) => (false, format!("not ready: {why}\n")),
            None => (false, "not ready\n".into()),
        }
    }
}

/// Holds a gauge one up while it lives. Work a cancelled request drops at an await puts its
/// count back too, which an `inc()` ... `dec()` pair around the await would leak.
pub struct GaugeGuard(IntGauge);

impl GaugeGuard {
    pub fn new(gauge: &IntGauge) -> Self {
        gauge.inc();
        GaugeGuard(gauge.clone())
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Serves /metrics, /healthz and /readyz until the listener fails.
pub async fn serve_http(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
) -> anyhow::Result<()> {
    use axum::{http::StatusCode, routing::get, Router};
    let m1 = metrics.clone();
    let m2 = metrics;
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let m = m1.clone();
                async move { ([("content-type", "text/plain; version=0.0.4")], m.render()) }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move || {
                let m = m2.clone();
                async move {
                    match m.readiness() {
                        (true, body) => (StatusCode::OK, body),
                        (false, body) => (StatusCode::SERVICE_UNAVAILABLE, body),
                    }
                }
            }),
        );
    axum::serve(listener, app).await?;
    Ok(())
}

/// The node this process runs on: $NODE_NAME, else the hostname.
fn node_name() -> String {
    std::env::var("NODE_NAME")
        .ok()
        .filter(|n| !n.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

#[cfg(test)]
mod label_set_tests {
    use super::*;
    use stoker_testkit::docs::assert_documented;

    const DOCS: &str = include_str!("../../docs/metrics.md");

    #[test]
    fn the_docs_list_every_sample_error_kind_and_no_other() {
        assert_documented(
            DOCS,
            "stoker_worker_sample_errors_total",
            "kind",
            SampleErrorKind::ALL.iter().map(|v| v.as_str()),
        );
    }

    #[test]
    fn the_docs_list_every_stage_queue_line_cache_result_and_store_request_and_no_other() {
        assert_documented(
            DOCS,
            "stoker_worker_stage_seconds",
            "stage",
            Stage::ALL.iter().map(|v| v.as_str()),
        );
        assert_documented(
            DOCS,
            "stoker_worker_queue_depth",
            "queue",
            Queue::ALL.iter().map(|v| v.as_str()),
        );
        assert_documented(
            DOCS,
            "stoker_worker_line_cache_total",
            "result",
            LineCacheResult::ALL.iter().map(|v| v.as_str()),
        );
        assert_documented(
            DOCS,
            "stoker_worker_store_requests_total",
            "kind",
            StoreRequest::ALL.iter().map(|v| v.as_str()),
        );
    }

    #[test]
    fn the_docs_list_every_refusal_reason_and_no_other() {
        assert_documented(
            DOCS,
            "stoker_worker_requests_refused_total",
            "reason",
            RefusalReason::ALL.iter().map(|v| v.as_str()),
        );
    }

    #[test]
    fn every_labelled_series_exists_from_the_start() {
        let m = Metrics::new();
        let text = m.render();
        for kind in SampleErrorKind::ALL {
            let series = format!("kind=\"{}\"", kind.as_str());
            assert!(text.contains(&series), "{series} missing");
        }
        for reason in RefusalReason::ALL {
            let series = format!("reason=\"{}\"", reason.as_str());
            assert!(text.contains(&series), "{series} missing");
        }
        let more = Stage::ALL
            .iter()
            .map(|s| format!("stage=\"{}\"", s.as_str()))
            .chain(
                Queue::ALL
                    .iter()
                    .map(|q| format!("queue=\"{}\"", q.as_str())),
            )
            .chain(
                LineCacheResult::ALL
                    .iter()
                    .map(|r| format!("result=\"{}\"", r.as_str())),
            )
            .chain(
                StoreRequest::ALL
                    .iter()
                    .map(|k| format!("kind=\"{}\"", k.as_str())),
            );
        for series in more {
            assert!(text.contains(&series), "{series} missing");
        }
    }
}
