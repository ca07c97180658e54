//! Shared fixtures: a synthetic dataset behind the embedded S3 server, a worker on loopback,
//! and a minimal protocol client.
#![allow(dead_code, unused_imports)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
pub use stoker_config::{PixelDtype, WorkerConfig};
pub use stoker_testkit::embedded_s3::{EmbeddedS3, StoreBehaviour};
use stoker_testkit::synth::{generate, SynthFormat, SynthOptions};
use stoker_wire::{BatchHead, BatchRequest, ErrorFrame, Welcome};
pub use stoker_worker::connection::{Answer, Connection};
use stoker_worker::metrics::Metrics;
use stoker_worker::open::open_pipeline;
use stoker_worker::server::{Server, ServerConfig};

pub const TOKEN: &str = "test-token";

/// A dataset in `root/bucket/data/`, served by an embedded S3 server.
pub struct Dataset {
    pub root: tempfile::TempDir,
    pub s3: EmbeddedS3,
    pub uri: String,
}

impl Dataset {
    pub fn dir(&self) -> std::path::PathBuf {
        self.root.path().join("bucket/data")
    }

    /// Serves the dataset from a new store that behaves as `behaviour` (stragglers, stalls).
    pub async fn restart_store(&mut self, behaviour: StoreBehaviour) {
        self.s3 = EmbeddedS3::start_with(self.root.path(), "127.0.0.1:0", behaviour)
            .await
            .unwrap();
    }

    /// A worker configuration for this dataset with global batches of `global_batch_size`.
    pub fn config(&self, global_batch_size: u32) -> WorkerConfig {
        let mut c = WorkerConfig {
            data: self.uri.clone(),
            s3: self.s3.s3_options(),
            ..WorkerConfig::default()
        };
        c.sampling.global_batch_size = global_batch_size;
        c
    }
}

pub async fn synth_dataset(samples: usize, format: SynthFormat) -> Dataset {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("bucket/data");
    let o = SynthOptions {
        samples,
        format,
        samples_per_shard: 10,
        min_side: 64,
        max_side: 360,
        ..SynthOptions::default()
    };
    generate(&dir, &o, &|| {}).unwrap();
    let s3 = EmbeddedS3::start(root.path(), "127.0.0.1:0", Duration::ZERO)
        .await
        .unwrap();
    Dataset {
        root,
        s3,
        uri: "s3://bucket/data".into(),
    }
}

pub struct Worker {
    pub addr: SocketAddr,
    pub server: Arc<Server>,
    pub metrics: Arc<Metrics>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    pub task: tokio::task::JoinHandle<()>,
}

impl Worker {
    /// Triggers the SIGTERM path: not ready, finish in-flight, stop.
    pub fn terminate(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// A worker serving `cfg` on loopback (its sample budget: `max_inflight_samples`, else 64).
pub async fn start_worker(cfg: &WorkerConfig) -> Worker {
    let metrics = Metrics::new();
    let pipeline = open_pipeline(cfg, metrics.clone()).await.unwrap();
    let limits = &cfg.serving.limits;
    let server = Server::new(
        pipeline,
        ServerConfig {
            transport: stoker_tls::Serve::InsecurePlaintext,
            token: Some(TOKEN.into()),
            max_inflight_per_conn: limits.max_inflight_per_conn as usize,
            max_connections: limits.max_connections as usize,
            idle_timeout: Duration::from_secs(limits.idle_timeout_s),
            max_inflight_samples: cfg.serving.max_inflight_samples.unwrap_or(64),
            max_worker_bytes: limits.max_worker_bytes,
            send_timeout: Duration::from_secs(limits.send_timeout_s),
            drain_timeout: Duration::from_secs(30),
            links_per_rank: limits.links_per_rank,
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server.clone().serve(listener, async {
        let _ = rx.await;
    }));
    Worker {
        addr,
        server,
        metrics,
        stop: Some(tx),
        task,
    }
}

/// Test-side view of an answer, with assertions.
pub trait AnswerExt {
    fn batch(self) -> (BatchHead, Vec<u8>);
    fn error(self) -> ErrorFrame;
}

impl AnswerExt for Answer {
    fn batch(self) -> (BatchHead, Vec<u8>) {
        match self {
            Answer::Batch(h, p) => (h, p),
            Answer::Error(e) => panic!("expected a batch, got {e:?}"),
        }
    }
    fn error(self) -> ErrorFrame {
        match self {
            Answer::Error(e) => e,
            Answer::Batch(h, _) => panic!("expected an error, got batch {:?}", h.sample_ids),
        }
    }
}

pub struct Client(pub Connection);

impl Client {
    pub async fn connect(addr: SocketAddr, token: &str) -> Result<(Client, Welcome), ErrorFrame> {
        let c = Connection::open(&addr.to_string(), token).await.unwrap()?;
        let w = c.welcome.clone();
        Ok((Client(c), w))
    }
    pub async fn send(&mut self, req: BatchRequest) {
        self.0.send(&req).await.unwrap();
    }
    pub async fn cancel(&mut self, request_id: u64) {
        self.0.cancel(request_id).await.unwrap();
    }
    pub async fn recv(&mut self) -> Answer {
        self.0.recv().await.unwrap()
    }
    pub async fn get(&mut self, req: BatchRequest) -> Answer {
        self.send(req).await;
        self.recv().await
    }
}

pub fn request(w: &Welcome, epoch: u64, g: u64, rank: u32, world: u32) -> BatchRequest {
    BatchRequest {
        request_id: g * 1000 + rank as u64,
        plan_id: w.plan_id,
        epoch,
        global_batch: g,
        rank,
        world_size: world,
    }
}

/// A tensor's bytes inside a batch payload.
pub fn tensor<'a>(head: &BatchHead, payload: &'a [u8], name: &str) -> &'a [u8] {
    let t = head
        .tensor(name)
        .unwrap_or_else(|| panic!("no tensor {name}"));
    &payload[t.offset as usize..(t.offset + t.nbytes) as usize]
}

pub fn i64s(b: &[u8]) -> Vec<i64> {
    b.chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Appends a PNG chunk: length, type, data and the CRC of type and data.
pub fn png_chunk(out: &mut Vec<u8>, kind: &[u8], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let mut crc = flate2::Crc::new();
    crc.update(&out[start..]);
    out.extend_from_slice(&crc.sum().to_be_bytes());
}

/// A `w`×`h` PNG of a gradient.
pub fn png(w: u32, h: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, 7]));
    let mut out = std::io::Cursor::new(Vec::new());
    image::DynamicImage::from(img)
        .write_to(&mut out, image::ImageFormat::Png)
        .unwrap();
    out.into_inner()
}
