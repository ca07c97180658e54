//! An S3-compatible server in-process (s3s-fs over a local folder): the object store of the
//! demo, the benchmarks and the tests, reached through the real aws-sdk-s3 over HTTP.
//!
//! Each top-level folder of the root is a bucket. A configurable delay before every response
//! stands in for an object store's time to first byte, and a per-connection bandwidth for its
//! transfer time (a response of n bytes is held n / bandwidth longer; one HTTP/1.1 connection
//! carries one response at a time, so this caps each connection's throughput).

use futures::StreamExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder as ConnBuilder;
use s3s::auth::SimpleAuth;
use s3s::service::S3ServiceBuilder;
use std::path::Path;
use std::time::Duration;
use stoker_config::S3Connection;
use tokio::net::TcpListener;

pub const ACCESS_KEY: &str = "stoker-embedded";
pub const SECRET_KEY: &str = "stoker-embedded-secret";

/// How the embedded store behaves, to stand in for a real object store.
#[derive(Debug, Clone, Default)]
pub struct StoreBehaviour {
    /// Delay before every response (time to first byte).
    pub first_byte_latency: Duration,
    /// Extra delay for objects whose path ends with the given suffix (a straggler).
    pub slow_objects: Vec<(String, Duration)>,
    /// Bytes per second one connection delivers; `None` = as fast as loopback.
    pub bandwidth_bytes_per_s: Option<u64>,
    /// Injected faults, as a real store has them now and then.
    pub faults: Faults,
}

/// Faults injected by request count (deterministic: request k of the server's life), so a
/// test under faults is reproducible. 0 disables a kind.
#[derive(Debug, Clone, Copy, Default)]
pub struct Faults {
    /// Every n-th request is answered 503 SlowDown (what S3 says when throttling).
    pub every_nth_slow_down: u64,
    /// The first n requests are answered 503 SlowDown (a prefix the store throttles until
    /// it has scaled up).
    pub first_slow_downs: u64,
    /// Every n-th GET delivers half its body and then closes the connection (a reset
    /// mid-body: the headers promised more).
    pub every_nth_cut_body: u64,
    /// Every n-th GET delivers half its body and then nothing, never closing (a stalled
    /// store or a dead network path).
    pub every_nth_stall_body: u64,
}

impl Faults {
    fn hits(every: u64, k: u64) -> bool {
        every > 0 && k % every == every - 1
    }
}

/// The 503 S3 answers when a client should slow down.
fn slow_down() -> hyper::Response<s3s::Body> {
    let xml = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>\
               <Message>Please reduce your request rate.</Message></Error>";
    let mut resp = hyper::Response::new(s3s::Body::from(xml.to_string()));
    *resp.status_mut() = hyper::StatusCode::SERVICE_UNAVAILABLE;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/xml"),
    );
    resp
}

/// What a faulty GET does after the first half of its body (Content-Length unchanged).
#[derive(Clone, Copy)]
enum BodyFault {
    /// The connection closes, as when a store resets it mid-body.
    Cut,
    /// Nothing more ever comes, and the connection stays open.
    Stall,
}

impl Faults {
    /// The body fault of GET `k`, if any (a cut wins when both hit).
    fn body_fault(&self, k: u64) -> Option<BodyFault> {
        if Faults::hits(self.every_nth_cut_body, k) {
            Some(BodyFault::Cut)
        } else if Faults::hits(self.every_nth_stall_body, k) {
            Some(BodyFault::Stall)
        } else {
            None
        }
    }
}

/// `resp` with only the first half of its body, then `fault`.
async fn half_body(
    resp: hyper::Response<s3s::Body>,
    fault: BodyFault,
) -> hyper::Response<s3s::Body> {
    let (parts, mut body) = resp.into_parts();
    let Ok(full) = body.store_all_unlimited().await else {
        return hyper::Response::from_parts(parts, s3s::Body::empty());
    };
    let half = full.slice(..full.len() / 2);
    let body = match fault {
        BodyFault::Cut => s3s::Body::from(half),
        BodyFault::Stall => {
            let first =
                futures::stream::iter([Ok::<_, std::io::Error>(hyper::body::Frame::data(half))]);
            let frames = first.chain(futures::stream::pending());
            s3s::Body::http_body(http_body_util::StreamBody::new(frames))
        }
    };
    hyper::Response::from_parts(parts, body)
}

impl StoreBehaviour {
    fn delay(&self, path: &str) -> Duration {
        let extra = self
            .slow_objects
            .iter()
            .filter(|(suffix, _)| path.ends_with(suffix.as_str()))
            .map(|(_, d)| *d)
            .sum::<Duration>();
        self.first_byte_latency + extra
    }
}

pub struct EmbeddedS3 {
    pub endpoint: String,
    requests: std::sync::Arc<std::sync::atomic::AtomicU64>,
    injected: std::sync::Arc<std::sync::atomic::AtomicU64>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl EmbeddedS3 {
    /// Serves `root` on `addr` (e.g. "127.0.0.1:0") until dropped.
    pub async fn start(
        root: &Path,
        addr: &str,
        first_byte_latency: Duration,
    ) -> anyhow::Result<Self> {
        let behaviour = StoreBehaviour {
            first_byte_latency,
            ..StoreBehaviour::default()
        };
        Self::start_with(root, addr, behaviour).await
    }

    pub async fn start_with(
        root: &Path,
        addr: &str,
        behaviour: StoreBehaviour,
    ) -> anyhow::Result<Self> {
        let behaviour = std::sync::Arc::new(behaviour);
        let fs = s3s_fs::FileSystem::new(root)
            .map_err(|e| anyhow::anyhow!("embedded S3 over {}: {e:?}", root.display()))?;
        let mut builder = S3ServiceBuilder::new(fs);
        builder.set_auth(SimpleAuth::from_single(ACCESS_KEY, SECRET_KEY));
        let service = builder.build().into_shared();
        let listener = TcpListener::bind(addr).await?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        let requests = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let injected = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = injected.clone();
        let served = requests.clone();
        tokio::spawn(async move {
            let http = ConnBuilder::new(TokioExecutor::new());
            loop {
                let socket = tokio::select! {
                    r = listener.accept() => match r {
                        Ok((s, _)) => s,
                        Err(_) => continue,
                    },
                    _ = &mut rx => break,
                };
                let _ = socket.set_nodelay(true);
                let svc = service.clone();
                let behaviour = behaviour.clone();
                let requests = requests.clone();
                let injected = counted.clone();
                let delayed = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let svc = svc.clone();
                        let delay = behaviour.delay(req.uri().path());
                        let bandwidth = behaviour.bandwidth_bytes_per_s;
                        let faults = behaviour.faults;
                        let k = requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let is_get = req.method() == hyper::Method::GET;
                        let injected = injected.clone();
                        async move {
                            if !delay.is_zero() {
                                tokio::time::sleep(delay).await;
                            }
                            let inject =
                                || injected.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            if Faults::hits(faults.every_nth_slow_down, k)
                                || k < faults.first_slow_downs
                            {
                                inject();
                                return Ok(slow_down());
                            }
                            let mut resp = hyper::service::Service::call(&svc, req).await?;
                            let ok_get = is_get && resp.status().is_success();
                            if let Some(fault) = faults.body_fault(k).filter(|_| ok_get) {
                                inject();
                                resp = half_body(resp, fault).await;
                            }
                            let size = hyper::body::Body::size_hint(resp.body()).exact();
                            if let (Some(bw), Some(n)) = (bandwidth, size) {
                                let secs = n as f64 / bw.max(1) as f64;
                                tokio::time::sleep(Duration::from_secs_f64(secs)).await;
                            }
                            Ok::<_, s3s::S3Error>(resp)
                        }
                    },
                );
                let conn = http
                    .serve_connection(TokioIo::new(socket), delayed)
                    .into_owned();
                tokio::spawn(conn);
            }
        });
        Ok(EmbeddedS3 {
            endpoint,
            requests: served,
            injected,
            shutdown: Some(tx),
        })
    }

    /// Requests received so far (what a store bills and rate-limits).
    pub fn requests_received(&self) -> u64 {
        self.requests.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Faults injected so far (see [`Faults`]).
    pub fn faults_injected(&self) -> u64 {
        self.injected.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Client settings that reach this server.
    pub fn s3_options(&self) -> S3Connection {
        S3Connection {
            endpoint: Some(self.endpoint.clone()),
            region: Some("us-east-1".into()),
            path_style: true,
            static_credentials: Some((ACCESS_KEY.into(), SECRET_KEY.into())),
            ..S3Connection::default()
        }
    }

    /// The same settings as environment variables, for child processes.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        client_env(&self.endpoint)
    }
}

/// The environment that points a child process's S3 client at an embedded server listening
/// on `endpoint` (http://host:port), perhaps in another process.
pub fn client_env(endpoint: &str) -> Vec<(&'static str, String)> {
    vec![
        ("AWS_ENDPOINT_URL", endpoint.to_string()),
        ("AWS_REGION", "us-east-1".into()),
        ("AWS_ACCESS_KEY_ID", ACCESS_KEY.into()),
        ("AWS_SECRET_ACCESS_KEY", SECRET_KEY.into()),
    ]
}

impl Drop for EmbeddedS3 {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}
