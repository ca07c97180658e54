//! One connection to one worker: handshake, then a writer that sends the scheduler's
//! requests and a reader that turns every answer into an event. Batch payloads are read
//! straight into the aligned (pooled) buffer that becomes the tensors' memory (the only copy
//! is the kernel's, from the socket).

use crate::buffer::{AlignedBuf, BufferPool};
use std::time::Duration;
use stoker_wire::io::{read_frame, read_header, write_frame, ReadError};
use stoker_wire::{
    BatchHead, BatchRequest, ErrorFrame, Hello, Kind, Welcome, WireError, MAX_CONTROL_PAYLOAD,
};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::mpsc;

pub type LinkId = u64;

/// Requests queued for one worker's socket.
pub const LINK_QUEUE: usize = 256;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

pub enum Event {
    /// The worker accepted the token and serves `welcome`'s plan.
    Up {
        link: LinkId,
        welcome: Welcome,
        requests: mpsc::Sender<BatchRequest>,
    },
    /// The worker refused the connection (e.g. a wrong token).
    Refused { link: LinkId, error: ErrorFrame },
    /// An answer to one request.
    Answer {
        link: LinkId,
        request_id: u64,
        answer: Result<(BatchHead, AlignedBuf), ErrorFrame>,
    },
    /// The connection failed or closed; its unanswered requests are lost.
    Down { link: LinkId, error: String },
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
    #[error("{0}")]
    Protocol(String),
}

/// Runs one connection until it fails or the scheduler drops its request sender.
pub async fn run(
    link: LinkId,
    addr: String,
    token: String,
    events: mpsc::Sender<Event>,
    pool: BufferPool,
) {
    let error = match session(link, &addr, &token, &events, &pool).await {
        Ok(()) => "closed by the worker".to_string(),
        Err(e) => format!("{e:#}"),
    };
    let _ = events.send(Event::Down { link, error }).await;
}

async fn session(
    link: LinkId,
    addr: &str,
    token: &str,
    events: &mpsc::Sender<Event>,
    pool: &BufferPool,
) -> Result<(), LinkError> {
    let mut stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| {
            LinkError::Protocol(format!("connect timed out after {CONNECT_TIMEOUT:?}"))
        })??;
    stream.set_nodelay(true)?;
    let hello = Hello {
        token: token.into(),
        client: format!("stoker-client/{}", env!("CARGO_PKG_VERSION")),
    };
    write_frame(&mut stream, Kind::Hello, &hello.encode()).await?;
    let welcome = match tokio::time::timeout(
        CONNECT_TIMEOUT,
        read_frame(&mut stream, MAX_CONTROL_PAYLOAD),
    )
    .await
    {
        Err(_) => {
            return Err(LinkError::Protocol(format!(
                "no answer to the handshake after {CONNECT_TIMEOUT:?}"
            )))
        }
        Ok(r) => match r? {
            Some((Kind::Welcome, p)) => Welcome::decode(&p)?,
            Some((Kind::Error, p)) => {
                let error = ErrorFrame::decode(&p)?;
                let _ = events.send(Event::Refused { link, error }).await;
                return Ok(());
            }
            Some((k, _)) => {
                return Err(LinkError::Protocol(format!(
                    "unexpected {k:?} frame during the handshake"
                )))
            }
            None => {
                return Err(LinkError::Protocol(
                    "connection closed during the handshake".into(),
                ))
            }
        },
    };
    let (tx, mut rx) = mpsc::channel::<BatchRequest>(LINK_QUEUE);
    if events
        .send(Event::Up {
            link,
            welcome,
            requests: tx,
        })
        .await
        .is_err()
    {
        return Ok(());
    }
    let (mut rd, mut wr) = stream.into_split();
    let writer = async move {
        while let Some(req) = rx.recv().await {
            write_frame(&mut wr, Kind::Request, &req.encode()).await?;
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
