//! The batch server: a framed TCP protocol (docs/protocol.md).
//!
//! A connection starts with the TLS handshake (unless the worker serves plaintext, asked for by
//! name), then the client's Hello (the pipeline token) and the worker's Welcome
//! (the plan it serves). Until its Hello is checked a connection is one of the handshakes
//! budgeted in `crate::handshake`; only then does it take one of the trainers' connection
//! slots. Then the client pipelines Requests; each is prepared as its own task
//! and its Batch (or Error) is written as soon as it is ready, so answers may come out of
//! order (they echo the request id). Per connection at most `max_inflight_per_conn` requests
//! are prepared at once and up to [`READ_AHEAD`] more wait for a slot; beyond that the server
//! stops reading, and TCP pushes back. A Cancel frame aborts a waiting or running request.

use crate::batch::Batch;
use crate::batch_frame::{check_frame_size, write_batch};
use crate::handshake::{Handshakes, HANDSHAKE_TIMEOUT, MAX_HANDSHAKES, MAX_HANDSHAKES_PER_ADDRESS};
use crate::identity::plan_id;
use crate::memory::{self, Account, ConnMemory, MemoryPool};
use crate::metrics::{Queue, RefusalReason, Stage};
use crate::pipeline::Pipeline;
use crate::stall::{Watch, Watched};
use futures::StreamExt;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stoker_tls::{Serve, Stream};
use stoker_wire::io::{read_frame, write_frame, ReadError};
use stoker_wire::{BatchRequest, Cancel, ErrorCode, ErrorFrame, Hello, Kind, Welcome, WireError};
use tokio::io::{AsyncWrite, AsyncWriteExt, BufWriter, ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::{AbortHandle, JoinError, JoinSet};

/// How long the accept loop pauses when accepting fails (out of file descriptors): it retries
/// rather than spins.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// The largest Hello accepted (a token and a client name), before authentication.
pub const MAX_HELLO_BYTES: u64 = 4 << 10;
/// The largest frame accepted after it: a Request is 40 bytes, a Cancel 8.
pub const MAX_REQUEST_BYTES: u64 = 1 << 10;
/// Answers waiting for the socket, per connection.
const OUTBOX_CAPACITY: usize = 4;
/// Requests read ahead of a free slot, per connection. They hold no budget (a few dozen bytes
/// each), and reading on while every slot is busy is what lets a Cancel arrive when it
/// matters most; beyond this many the server stops reading and TCP pushes back.
pub const READ_AHEAD: usize = 256;

pub struct ServerConfig {
    /// TLS with the worker's certificate, or plaintext (`stoker worker` serves plaintext only
    /// when given --insecure-plaintext).
    pub transport: Serve,
    /// The pipeline token clients must present; `None` disables the check (local use only).
    pub token: Option<String>,
    pub max_inflight_per_conn: usize,
    /// Connections open at once; one more is refused (Unavailable) and closed.
    pub max_connections: usize,
    /// How long a connection may go without completing a frame from its peer or a request of
    /// its own (a request in preparation longer than this ends it too).
    pub idle_timeout: Duration,
    /// Samples started and not yet built into a batch, across all connections (a request
    /// of more takes them all): with the byte budget, the bound on the worker's memory.
    pub max_inflight_samples: usize,
    /// Bytes of samples being prepared and batches waiting to be sent, across connections:
    /// a request starts only below it, and below its connection's share (crate::memory).
    pub max_worker_bytes: u64,
    /// A connection whose peer takes no bytes for this long while an answer waits is closed,
    /// its answers dropped (their bytes freed).
    pub send_timeout: Duration,
    /// How long a drain waits for in-flight requests before giving up.
    pub drain_timeout: Duration,
    /// Told to clients in the Welcome: the most workers one trainer rank should connect to
    /// (0 = the client decides).
    pub links_per_rank: u32,
}

impl Default for ServerConfig {
    /// The worker command's limits, in plaintext and without a token (in-process tests; the
    /// worker command sets `transport` and `token`).
    fn default() -> Self {
        let d = stoker_config::ServingLimits::default();
        ServerConfig {
            transport: Serve::InsecurePlaintext,
            token: None,
            max_inflight_per_conn: d.max_inflight_per_conn as usize,
            max_connections: d.max_connections as usize,
            idle_timeout: Duration::from_secs(d.idle_timeout_s),
            max_inflight_samples: 64,
            max_worker_bytes: d.max_worker_bytes,
            send_timeout: Duration::from_secs(d.send_timeout_s),
            drain_timeout: Duration::from_secs(stoker_config::DEFAULT_DRAIN_TIMEOUT_S),
            links_per_rank: d.links_per_rank,
        }
    }
}

pub struct Server {
    pub pipeline: Arc<Pipeline>,
    pub welcome: Welcome,
    config: ServerConfig,
    draining: AtomicBool,
    inflight: AtomicUsize,
    idle: Notify,
    memory: Arc<MemoryPool>,
    connections: Arc<Semaphore>,
    handshakes: Arc<Handshakes>,
}

/// An Error frame about the connection itself rather than one request (request id 0).
fn connection_error(code: ErrorCode, message: String) -> ErrorFrame {
    ErrorFrame {
        request_id: 0,
        code,
        message,
    }
}

/// Equal-time comparison, so the token cannot be guessed byte by byte from response times.
fn token_matches(expected: &str, given: &str) -> bool {
    let (a, b) = (expected.as_bytes(), given.as_bytes());
    let mut diff = (a.len() != b.len()) as u8;
    for (i, x) in a.iter().enumerate() {
        diff |= x ^ b.get(i).copied().unwrap_or(0);
    }
    diff == 0
}

/// A prepared batch on its way to the socket.
struct Ready {
    request: BatchRequest,
    batch: Batch,
    started: Instant,
    /// The batch's bytes, held until it is sent (or thrown away).
    _bytes: Arc<Account>,
}

enum Outgoing {
    Error(ErrorFrame),
    Batch(Box<Ready>),
}

/// An answer for the writer, with the in-flight guard of its request (none for errors about
/// the connection).
type Answer = (Outgoing, Option<InflightGuard>);

/// A frame a client may send after the handshake.
enum Incoming {
    Request(BatchRequest),
    Cancel(u64),
}

impl Incoming {
    /// `Ok(None)` at the end of the stream; `Err` says why the frame ends the connection.
    fn from_frame(
        frame: Result<Option<(Kind, Vec<u8>)>, ReadError>,
    ) -> Result<Option<Self>, String> {
        match frame.map_err(|e| e.to_string())? {
            None => Ok(None),
            Some((Kind::Request, p)) => BatchRequest::decode(&p)
                .map(|r| Some(Incoming::Request(r)))
                .map_err(|e| e.to_string()),
            Some((Kind::Cancel, p)) => Cancel::decode(&p)
                .map(|c| Some(Incoming::Cancel(c.request_id)))
                .map_err(|e| format!("Cancel: {e}")),
            Some((kind, _)) => Err(format!("unexpected {kind:?} frame")),
        }
    }
}

/// One connection's requests: read and waiting for a slot, or being prepared.
#[derive(Default)]
struct ConnRequests {
    waiting: VecDeque<BatchRequest>,
    /// The tasks preparing requests; each returns its request id.
    running: JoinSet<u64>,
    /// The running tasks by request id, for Cancel. Each entry is a running task, so there are
    /// at most `max_inflight_per_conn`; a task's entry goes when it is joined.
    tasks: HashMap<u64, AbortHandle>,
}

impl ConnRequests {
    /// Drops every waiting request with this id and aborts the running one; whether there was
    /// one to cancel (an unknown or finished id is a no-op).
    fn cancel(&mut self, request_id: u64) -> bool {
        let waiting = self.waiting.len();
        self.waiting.retain(|r| r.request_id != request_id);
        let mut cancelled = self.waiting.len() < waiting;
        if let Some(task) = self.tasks.remove(&request_id) {
            // A finished task has handed its answer to the writer already: it goes out.
            if !task.is_finished() {
                task.abort();
                cancelled = true;
            }
        }
        cancelled
    }

    fn finished(&mut self, done: Result<(tokio::task::Id, u64), JoinError>) {
        match done {
            // Only its own entry: a client reusing an id in flight has the later task there.
            Ok((task, request_id)) => {
                if self.tasks.get(&request_id).is_some_and(|t| t.id() == task) {
                    self.tasks.remove(&request_id);
                }
            }
            Err(e) => {
                if e.is_panic() {
                    tracing::error!("a request's task panicked: {e}");
                }
                self.tasks.retain(|_, t| t.id() != e.id());
            }
        }
    }
}

/// Counts a request from the moment it is read until its answer is written, so a drain waits
/// for answers to reach the socket, not just to be computed.
struct InflightGuard(Arc<Server>);

impl InflightGuard {
    fn new(server: Arc<Server>) -> Self {
        server.inflight.fetch_add(1, Ordering::SeqCst);
        server.pipeline.metrics.requests_in_flight.inc();
        InflightGuard(server)
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        if self.0.inflight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
        self.0.pipeline.metrics.requests_in_flight.dec();
    }
}

impl Server {
    pub fn new(pipeline: Arc<Pipeline>, config: ServerConfig) -> Arc<Self> {
        let plan = &pipeline.plan;
        let welcome = Welcome {
            plan_id: plan_id(&pipeline),
            dataset_version: pipeline.index.version,
            num_samples: plan.num_samples,
            global_batch_size: plan.global_batch_size,
            batches_per_epoch: plan.batches_per_epoch(),
            description: format!(
                "{} {:?} seed={}",
                pipeline.config.preset.label(),
                pipeline.config.preset.pixel_dtype,
                plan.seed
            ),
            max_connections: u32::try_from(config.max_connections).unwrap_or(u32::MAX),
            links_per_rank: config.links_per_rank,
            media: pipeline.media_tokens(),
        };
        Arc::new(Server {
            memory: MemoryPool::new(
                config.max_worker_bytes,
                config.max_inflight_samples,
                pipeline.metrics.memory_held_bytes.clone(),
            ),
            connections: Arc::new(Semaphore::new(config.max_connections.max(1))),
            handshakes: Handshakes::new(
                MAX_HANDSHAKES,
                MAX_HANDSHAKES_PER_ADDRESS,
                pipeline.metrics.handshakes.clone(),
            ),
            pipeline,
            welcome,
            config,
            draining: AtomicBool::new(false),
            inflight: AtomicUsize::new(0),
            idle: Notify::new(),
        })
    }

    /// Samples prepared at once (`--max-inflight-samples`).
    pub fn max_inflight_samples(&self) -> usize {
        self.config.max_inflight_samples.max(1)
    }

    fn refuse(&self, reason: RefusalReason) {
        self.pipeline
            .metrics
            .requests_refused_total
            .with_label_values(&[reason.as_str()])
            .inc();
    }

    /// Accepts connections until `shutdown` resolves, then drains: stops accepting, answers
    /// new requests with Unavailable, and waits for in-flight requests to finish.
    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        self.pipeline.metrics.set_ready(true);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                r = listener.accept() => match r {
                    Ok((stream, peer)) => {
                        tokio::spawn(self.clone().admit(stream, peer));
                    }
                    Err(e) => {
                        tracing::warn!("accepting a connection: {e}; retrying in {ACCEPT_BACKOFF:?}");
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                    }
                },
                _ = &mut shutdown => break,
            }
        }
        drop(listener);
        self.drain().await;
    }

    pub async fn drain(&self) {
        self.pipeline.metrics.set_ready(false);
        self.draining.store(true, Ordering::SeqCst);
        let deadline = tokio::time::Instant::now() + self.config.drain_timeout;
        loop {
            let idle = self.idle.notified();
            if self.inflight.load(Ordering::SeqCst) == 0 {
                return;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                tracing::warn!(
                    "drain timed out with {} requests in flight",
                    self.inflight.load(Ordering::SeqCst)
                );
                return;
            }
        }
    }

    /// Trainer slots taken (each by an authenticated connection until it closes).
    pub fn slots_taken(&self) -> usize {
        self.config.max_connections.max(1) - self.connections.available_permits()
    }

    /// Connections not yet authenticated.
    pub fn handshakes_in_progress(&self) -> usize {
        self.handshakes.in_progress()
    }

    /// Serves one connection: its handshake within the handshake budget (TLS and a valid
    /// Hello within [`HANDSHAKE_TIMEOUT`]), then, authenticated, within the connection limit.
    /// Over a limit the peer is refused, by an Error frame naming it once the handshake got
    /// that far, and the refusal is counted. The slot is held by this function's frame: every
    /// way out of it gives the slot back.
    async fn admit(self: Arc<Self>, tcp: TcpStream, peer: std::net::SocketAddr) {
        let (ticket, evicted) = match self.handshakes.enter(peer.ip()) {
            Ok(entered) => entered,
            Err(over) => {
                self.refuse(RefusalReason::HandshakeLimit);
                tracing::debug!("connection from {peer} closed: {over}");
                return;
            }
        };
        if evicted {
            // The oldest handshake made room for this one (and closes).
            self.refuse(RefusalReason::HandshakeLimit);
        }
        let deadline = tokio::time::Instant::now() + HANDSHAKE_TIMEOUT;
        let greeted = tokio::select! {
            greeted = self.greet(tcp, deadline) => greeted,
            () = ticket.evicted() => {
                tracing::debug!("handshake from {peer} closed: the oldest of a full budget");
                return;
            }
        };
        drop(ticket);
        let (rd, mut wr) = match greeted {
            Ok(halves) => halves,
            Err(e) => {
                tracing::debug!("connection from {peer}: {e:#}");
                return;
            }
        };
        let Ok(slot) = self.connections.clone().try_acquire_owned() else {
            self.refuse(RefusalReason::ConnectionLimit);
            let e = connection_error(
                ErrorCode::Unavailable,
                format!(
                    "worker at its limit of {} connections; retry on another worker",
                    self.config.max_connections
                ),
            );
            let _ = write_frame(&mut wr, Kind::Error, &e.encode()).await;
            self.close(&mut wr).await;
            return;
        };
        let open = self.pipeline.metrics.connections.clone();
        open.inc();
        if let Err(e) = self.serve_requests(rd, wr).await {
            tracing::debug!("connection from {peer}: {e:#}");
        }
        open.dec();
        drop(slot);
    }

    /// The TLS handshake (none in plaintext) and the client's Hello, both by `deadline`: the
    /// connection's halves once its token is accepted. A refused Hello is answered with an
    /// Error frame naming why, and the connection closed.
    async fn greet(
        &self,
        tcp: TcpStream,
        deadline: tokio::time::Instant,
    ) -> anyhow::Result<(ReadHalf<Stream>, BufWriter<WriteHalf<Stream>>)> {
        stoker_tls::tune_link_socket(&tcp)?;
        let stream =
            match tokio::time::timeout_at(deadline, self.config.transport.accept(tcp)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => {
                    self.refuse(RefusalReason::Tls);
                    anyhow::bail!("TLS handshake: {e}")
                }
                Err(_) => {
                    self.refuse(RefusalReason::Tls);
                    anyhow::bail!("no TLS handshake within {HANDSHAKE_TIMEOUT:?}")
                }
            };
        let (mut rd, wr) = tokio::io::split(stream);
        let mut wr = BufWriter::with_capacity(64 << 10, wr);
        if let Err(refusal) = self.hello(&mut rd, deadline).await {
            write_frame(&mut wr, Kind::Error, &refusal.encode()).await?;
            self.close(&mut wr).await;
            anyhow::bail!("refused: {}", refusal.message);
        }
        Ok((rd, wr))
    }

    /// An authenticated connection: the Welcome, then requests until either side ends it.
    async fn serve_requests(
        self: &Arc<Self>,
        mut rd: ReadHalf<Stream>,
        mut wr: BufWriter<WriteHalf<Stream>>,
    ) -> anyhow::Result<()> {
        write_frame(&mut wr, Kind::Welcome, &self.welcome.encode()).await?;
        wr.flush().await?;
        let (tx, rx) = mpsc::channel::<Answer>(OUTBOX_CAPACITY);
        let watch = Watch::new();
        let wr = BufWriter::with_capacity(64 << 10, watch.writer(wr.into_inner()));
        let writer = tokio::spawn(self.clone().write_answers(wr, rx, watch));
        self.read_requests(&mut rd, tx, self.memory.connection())
            .await;
        writer.await??;
        Ok(())
    }

    /// Reads the client's Hello (bounded in size, and in time by `deadline`) and checks its
    /// token; the Error frame to send back when the client is refused.
    async fn hello(
        &self,
        rd: &mut ReadHalf<Stream>,
        deadline: tokio::time::Instant,
    ) -> Result<(), ErrorFrame> {
        let hello = tokio::time::timeout_at(deadline, read_frame(rd, MAX_HELLO_BYTES)).await;
        let no_hello = |why: String| (RefusalReason::NoHello, why);
        let hello = match hello {
            Ok(Ok(Some((Kind::Hello, p)))) => {
                Hello::decode(&p).map_err(|e| no_hello(e.to_string()))
            }
            // A peer of another protocol version is told both versions, and counted apart
            // (a rollout mixing versions, not a hostile peer).
            Ok(Err(ReadError::Wire(e @ WireError::Version(_)))) => {
                Err((RefusalReason::Version, e.to_string()))
            }
            Ok(Err(e)) => Err(no_hello(e.to_string())),
            Err(_) => Err(no_hello(format!("no Hello within {HANDSHAKE_TIMEOUT:?}"))),
            Ok(Ok(_)) => Err(no_hello("expected a Hello frame first".to_string())),
        };
        let hello = hello.map_err(|(reason, why)| {
            self.refuse(reason);
            connection_error(ErrorCode::BadRequest, why)
        })?;
        match &self.config.token {
            Some(expected) if !token_matches(expected, &hello.token) => {
                self.refuse(RefusalReason::Unauthorized);
                let message = if hello.token.is_empty() {
                    "this worker requires a pipeline token and none was sent"
                } else {
                    "wrong pipeline token"
                };
                Err(connection_error(ErrorCode::Unauthorized, message.into()))
            }
            _ => Ok(()),
        }
    }

    /// Writes answers as they become ready; each request's in-flight guard (and bytes) is
    /// released once its answer is on the socket. A peer that takes no bytes for
    /// `send_timeout` while an answer waits loses the connection.
    async fn write_answers(
        self: Arc<Self>,
        mut wr: BufWriter<Watched<WriteHalf<Stream>>>,
        mut rx: mpsc::Receiver<Answer>,
        watch: Watch,
    ) -> anyhow::Result<()> {
        while let Some((out, _guard)) = rx.recv().await {
            watch.touch();
            tokio::select! {
                written = self.write_answer(&mut wr, out) => written?,
                () = watch.stalled_for(self.config.send_timeout) => {
                    self.refuse(RefusalReason::Stalled);
                    anyhow::bail!(
                        "the peer took no bytes for {:?} while an answer waited; closing \
                         the connection",
                        self.config.send_timeout
                    );
                }
            }
        }
        self.close(&mut wr).await;
        Ok(())
    }

    /// Flushes and ends the connection with a FIN (TLS: close_notify first), so that the peer
    /// reads the last frame before the socket closes; bounded by the send timeout.
    async fn close<W: AsyncWrite + Unpin>(&self, w: &mut W) {
        let _ = tokio::time::timeout(self.config.send_timeout, w.shutdown()).await;
    }

    async fn write_answer(
        &self,
        wr: &mut BufWriter<Watched<WriteHalf<Stream>>>,
        out: Outgoing,
    ) -> std::io::Result<()> {
        let pixel_dtype = self.pipeline.pixel_dtype();
        let metrics = &self.pipeline.metrics;
        match out {
            Outgoing::Error(e) => write_frame(wr, Kind::Error, &e.encode()).await?,
            Outgoing::Batch(ready) => {
                // `_bytes` stays bound (held) until the batch is written.
                let Ready {
                    request,
                    batch,
                    started,
                    _bytes,
                } = *ready;
                let t = Instant::now();
                let luts = (self.pipeline.pixel_lut(), self.pipeline.video_pixel_lut());
                let n = write_batch(wr, request, &batch, pixel_dtype, luts).await?;
                metrics.observe_stage(Stage::Send, t.elapsed());
                metrics
                    .request_seconds
                    .observe(started.elapsed().as_secs_f64());
                metrics.bytes_sent_total.inc_by(n);
                metrics.batches_total.inc();
                metrics.samples_total.inc_by(batch.sample_ids.len() as u64);
                for (dataset, n) in self.pipeline.samples_by_dataset(&batch.sample_ids) {
                    metrics
                        .dataset_samples_served
                        .with_label_values(&[dataset])
                        .inc_by(n);
                }
            }
        }
        wr.flush().await
    }

    /// Reads Requests and Cancels (each at most [`MAX_REQUEST_BYTES`]) until the client
    /// closes: each Request is prepared as its own task, at most `max_inflight_per_conn` at
    /// once, and up to [`READ_AHEAD`] more wait for a slot (reading goes on meanwhile, so a
    /// Cancel is read while every slot is busy). Anything else ends the connection with an
    /// Error frame naming it.
    async fn read_requests(
        self: &Arc<Self>,
        rd: &mut ReadHalf<Stream>,
        tx: mpsc::Sender<Answer>,
        memory: Arc<ConnMemory>,
    ) {
        let slots = Arc::new(Semaphore::new(self.config.max_inflight_per_conn.max(1)));
        let mut conn = ConnRequests::default();
        // A stream keeps a frame that is half read across the select below (a bare
        // read_frame future dropped by another branch would lose the bytes read so far).
        let frames = futures::stream::unfold(rd, |rd| async move {
            let frame = read_frame(rd, MAX_REQUEST_BYTES).await;
            Some((frame, rd))
        });
        let mut frames = std::pin::pin!(frames);
        let mut reading = true;
        // The connection moves when a frame arrives or a request's answer is handed over:
        // requests in flight on a connection where neither happens for the idle timeout (a
        // preparation stuck, with nothing read meanwhile) do not keep it open.
        let mut moved = tokio::time::Instant::now();
        while reading || !conn.waiting.is_empty() {
            tokio::select! {
                biased;
                Some(done) = conn.running.join_next_with_id(), if !conn.running.is_empty() => {
                    moved = tokio::time::Instant::now();
                    conn.finished(done);
                }
                permit = slots.clone().acquire_owned(), if !conn.waiting.is_empty() => {
                    let req = conn.waiting.pop_front().expect("a request waits");
                    self.start(req, permit.expect("never closed"), &tx, &memory, &mut conn);
                }
                frame = frames.next(), if reading && conn.waiting.len() < READ_AHEAD => {
                    moved = tokio::time::Instant::now();
                    match Incoming::from_frame(frame.expect("the stream never ends")) {
                        Ok(None) => reading = false,
                        Ok(Some(Incoming::Request(req))) => conn.waiting.push_back(req),
                        Ok(Some(Incoming::Cancel(id))) => {
                            if conn.cancel(id) {
                                self.pipeline.metrics.requests_cancelled_total.inc();
                            }
                        }
                        Err(message) => {
                            self.refuse(RefusalReason::BadRequest);
                            let e = connection_error(ErrorCode::BadRequest, message);
                            let _ = tx.send((Outgoing::Error(e), None)).await;
                            break;
                        }
                    }
                }
                // The writer is gone (the peer stalled or reset): nothing prepared now
                // would reach it.
                () = tx.closed() => {
                    conn.running.abort_all();
                    return;
                }
                () = tokio::time::sleep_until(moved + self.config.idle_timeout), if reading => {
                    self.refuse(RefusalReason::Idle);
                    let e = connection_error(
                        ErrorCode::Unavailable,
                        format!(
                            "nothing read and no answer ready for {:?}; closing the connection",
                            self.config.idle_timeout
                        ),
                    );
                    let _ = tx.send((Outgoing::Error(e), None)).await;
                    break;
                }
            }
        }
        // Requests already being prepared are still answered (a client may half-close), and
        // counted in flight until then, so a drain waits for them.
        conn.running.detach_all();
    }

    /// Prepares `req` as its own task, holding one of the connection's slots until its
    /// answer is handed to the writer.
    fn start(
        self: &Arc<Self>,
        req: BatchRequest,
        slot: OwnedSemaphorePermit,
        tx: &mpsc::Sender<Answer>,
        memory: &Arc<ConnMemory>,
        conn: &mut ConnRequests,
    ) {
        let guard = InflightGuard::new(self.clone());
        let (this, tx, memory) = (self.clone(), tx.clone(), memory.clone());
        // Aborting the task drops this future with everything it holds: the in-flight guard,
        // the slot, the sample budget and the fetches under way.
        let task = conn.running.spawn(async move {
            let out = this.answer(req, &memory).await;
            let _ = tx.send((out, Some(guard))).await;
            drop(slot);
            req.request_id
        });
        conn.tasks.insert(req.request_id, task);
    }

    /// Whether a built batch may be sent: it fits in a frame, and its media agree with its
    /// pad tokens (a batch that does not is a bug of this build: refused and counted, never
    /// sent; every worker of the plan builds the same batch, so it is not retried).
    fn check_batch(&self, batch: &Batch) -> Result<(), String> {
        check_frame_size(batch, stoker_wire::MAX_PAYLOAD)?;
        (self.welcome.media.check(&batch.media())).map_err(|e| {
            self.refuse(RefusalReason::InconsistentBatch);
            tracing::error!("refused to send a batch whose media and tokens disagree: {e}");
            format!("media and tokens disagree: {e} (refused by the worker: a bug, report it)")
        })
    }

    async fn answer(&self, req: BatchRequest, memory: &Arc<ConnMemory>) -> Outgoing {
        let started = Instant::now();
        let err = |code, message: String| {
            Outgoing::Error(ErrorFrame {
                request_id: req.request_id,
                code,
                message,
            })
        };
        if self.draining.load(Ordering::SeqCst) {
            self.refuse(RefusalReason::Draining);
            return err(
                ErrorCode::Unavailable,
                "worker is draining; retry on another worker".into(),
            );
        }
        if req.plan_id != self.welcome.plan_id {
            self.refuse(RefusalReason::PlanMismatch);
            return err(
                ErrorCode::PlanMismatch,
                format!(
                    "request is for plan {:016x}; this worker serves plan {:016x} ({})",
                    req.plan_id, self.welcome.plan_id, self.welcome.description
                ),
            );
        }
        let slice = match self
            .pipeline
            .plan
            .serve_slice(req.epoch, req.global_batch, req.rank, req.world_size)
            .await
        {
            Ok(slice) => slice,
            Err(e) => {
                self.refuse(RefusalReason::BadRequest);
                return err(ErrorCode::BadRequest, e.to_string());
            }
        };
        // A slice of more samples than the worker starts at once waits for all of them.
        let queued = self.pipeline.metrics.queued(Queue::Requests);
        let bytes = memory.admit(slice.samples.len()).await;
        drop(queued);
        let built = memory::with_account(bytes.clone(), self.pipeline.build_batch(&slice)).await;
        match built {
            Ok(batch) => match self.check_batch(&batch) {
                Ok(()) => {
                    bytes.settle(slice.samples.len(), batch.tensor_bytes());
                    Outgoing::Batch(Box::new(Ready {
                        request: req,
                        batch,
                        started,
                        _bytes: bytes,
                    }))
                }
                Err(why) => err(
                    ErrorCode::Failed,
                    format!("batch {}/{}: {why}", req.epoch, req.global_batch),
                ),
            },
            Err(f) if f.transient => err(ErrorCode::Transient, f.to_string()),
            Err(f) => err(ErrorCode::Failed, f.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_comparison() {
        assert!(token_matches("s3cret", "s3cret"));
        assert!(!token_matches("s3cret", "s3cre"));
        assert!(!token_matches("s3cret", "s3cretX"));
        assert!(!token_matches("s3cret", ""));
    }
}
