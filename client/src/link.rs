//! One connection to one worker: handshake, then a writer that sends the scheduler's requests
//! and cancels, and a reader that turns every answer into an event. Batch payloads are read
//! straight into the aligned (pooled) buffer that becomes the tensors' memory (the only copy
//! is the kernel's, from the socket).

use crate::buffer::BufferPool;
use crate::scheduler::{Event, LinkId, LINK_QUEUE};
use std::time::Duration;
use stoker_tls::Dial;
use stoker_wire::io::{handshake, read_header, write_frame, HandshakeError, ReadError};
use stoker_wire::{BatchHead, BatchRequest, Cancel, ErrorFrame, Kind, WireError};
use tokio::io::AsyncReadExt;
use tokio::sync::mpsc;

/// Frames queued for one worker's socket: its requests (at most [`LINK_QUEUE`] outstanding)
/// and as many cancels.
pub const QUEUE: usize = 2 * LINK_QUEUE;
/// TCP, TLS and the Hello/Welcome exchange, each.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A worker that takes no bytes of a request for this long (it stopped reading, or the path
/// to it is gone with data unacknowledged) loses the link; its requests go elsewhere.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// What the scheduler sends a worker.
pub enum Outbound {
    Request(BatchRequest),
    Cancel(u64),
}

/// Why a connection ended (the reason the scheduler records for the worker).
#[derive(Debug, thiserror::Error)]
enum LinkError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error(transparent)]
    Handshake(#[from] HandshakeError),
    #[error("{0}")]
    Protocol(String),
}

/// Runs one connection until it fails, or the scheduler drops its queue or aborts it.
pub async fn run(
    link: LinkId,
    addr: String,
    dial: Dial,
    token: String,
    frames: mpsc::Receiver<Outbound>,
    events: mpsc::Sender<Event>,
    pool: BufferPool,
) {
    let error = match session(link, &addr, &dial, &token, frames, &events, &pool).await {
        Ok(()) => "closed by the worker".to_string(),
        Err(e) => format!("{e:#}"),
    };
    let _ = events.send(Event::Down { link, error }).await;
}

async fn session(
    link: LinkId,
    addr: &str,
    dial: &Dial,
    token: &str,
    mut frames: mpsc::Receiver<Outbound>,
    events: &mpsc::Sender<Event>,
    pool: &BufferPool,
) -> Result<(), LinkError> {
    // TCP and TLS: the worker proves its name before the token is sent.
    let mut stream = tokio::time::timeout(CONNECT_TIMEOUT, dial.connect(addr))
        .await
        .map_err(|_| {
            LinkError::Protocol(format!("connect timed out after {CONNECT_TIMEOUT:?}"))
        })??;
    let client = format!("stoker-client/{}", env!("CARGO_PKG_VERSION"));
    let welcome = match handshake(&mut stream, token, &client, CONNECT_TIMEOUT).await {
        Ok(w) => w,
        Err(HandshakeError::Refused(error)) => {
            let _ = events.send(Event::Refused { link, error }).await;
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    if events.send(Event::Up { link, welcome }).await.is_err() {
        return Ok(());
    }
    let (mut rd, mut wr) = tokio::io::split(stream);
    let writer = async move {
        while let Some(frame) = frames.recv().await {
            let (kind, payload) = match frame {
                Outbound::Request(req) => (Kind::Request, req.encode()),
                Outbound::Cancel(request_id) => (Kind::Cancel, Cancel { request_id }.encode()),
            };
            tokio::time::timeout(WRITE_TIMEOUT, write_frame(&mut wr, kind, &payload))
                .await
                .map_err(|_| {
                    LinkError::Protocol(format!(
                        "the worker took no bytes of a {kind:?} frame for {WRITE_TIMEOUT:?}"
                    ))
                })??;
        }
        // The scheduler let go of this worker.
        Ok::<(), LinkError>(())
    };
    let reader = async {
        loop {
            let Some(header) = read_header(&mut rd).await? else {
                return Ok::<(), LinkError>(());
            };
            let answer = match header.kind {
                Kind::Batch => {
                    let mut buf = pool.take(header.len as usize);
                    rd.read_exact(buf.as_mut_slice()).await?;
                    let head = BatchHead::decode(buf.as_slice(), header.len)?;
                    (head.request.request_id, Ok((head, buf)))
                }
                Kind::Error => {
                    let mut p = vec![0u8; header.len as usize];
                    rd.read_exact(&mut p).await?;
                    let e = ErrorFrame::decode(&p)?;
                    (e.request_id, Err(e))
                }
                k => {
                    return Err(LinkError::Protocol(format!(
                        "unexpected {k:?} frame from a worker"
                    )))
                }
            };
            let (request_id, answer) = answer;
            let event = Event::Answer {
                link,
                request_id,
                answer,
            };
            if events.send(event).await.is_err() {
                return Ok(());
            }
        }
    };
    tokio::select! {
        r = writer => r,
        r = reader => r,
    }
}
