//! One protocol connection to a worker, from the requesting side: handshake, pipelined
//! requests, answers. The benchmarks and tests drive workers with it; the trainer client
//! adds discovery, retries and hedging on top of the same frames.

use std::time::Duration;
use stoker_tls::{Dial, Stream};
use stoker_wire::io::{handshake, read_frame, read_frame_into, write_frame, HandshakeError};
use stoker_wire::{BatchHead, BatchRequest, Cancel, ErrorFrame, Kind, Welcome, MAX_PAYLOAD};

/// A worker answers a Hello at once; this only bounds a peer that never does.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// An answer to a request: the batch head and its whole payload, or an error frame.
pub enum Answer {
    Batch(BatchHead, Vec<u8>),
    Error(ErrorFrame),
}

pub struct Connection {
    stream: Stream,
    pub welcome: Welcome,
}

impl Connection {
    /// Connects in plaintext (a worker run with --insecure-plaintext, or an in-process
    /// server) and authenticates; a refusal comes back as the worker's error frame.
    pub async fn open(addr: &str, token: &str) -> anyhow::Result<Result<Connection, ErrorFrame>> {
        Self::open_with(&Dial::InsecurePlaintext, addr, token).await
    }

    /// [`Connection::open`], dialled as `dial` says (TLS checks the worker's name before the
    /// token is sent).
    pub async fn open_with(
        dial: &Dial,
        addr: &str,
        token: &str,
    ) -> anyhow::Result<Result<Connection, ErrorFrame>> {
        let mut stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, dial.connect(addr))
            .await
            .map_err(|_| anyhow::anyhow!("{addr}: no connection within {HANDSHAKE_TIMEOUT:?}"))?
            .map_err(|e| anyhow::anyhow!("{addr}: {e}"))?;
        let client = format!("stoker/{}", env!("CARGO_PKG_VERSION"));
        match handshake(&mut stream, token, &client, HANDSHAKE_TIMEOUT).await {
            Ok(welcome) => Ok(Ok(Connection { stream, welcome })),
            Err(HandshakeError::Refused(e)) => Ok(Err(e)),
            Err(e) => anyhow::bail!("{addr}: {e}"),
        }
    }

    /// A request for this worker's plan.
    pub fn request(
        &self,
        request_id: u64,
        epoch: u64,
        global_batch: u64,
        rank: u32,
        world_size: u32,
    ) -> BatchRequest {
        BatchRequest {
            request_id,
            plan_id: self.welcome.plan_id,
            epoch,
            global_batch,
            rank,
            world_size,
        }
    }

    pub async fn send(&mut self, req: &BatchRequest) -> anyhow::Result<()> {
        write_frame(&mut self.stream, Kind::Request, &req.encode()).await?;
        Ok(())
    }

    /// Tells the worker the answer to `request_id` is no longer wanted.
    pub async fn cancel(&mut self, request_id: u64) -> anyhow::Result<()> {
        write_frame(
            &mut self.stream,
            Kind::Cancel,
            &Cancel { request_id }.encode(),
        )
        .await?;
        Ok(())
    }

    /// Like [`Connection::recv`], but reads a batch into `payload`, reusing its memory (a
    /// consumer that is done with each batch before the next avoids re-faulting fresh pages).
    pub async fn recv_into(
        &mut self,
        payload: &mut Vec<u8>,
    ) -> anyhow::Result<Result<BatchHead, ErrorFrame>> {
        match read_frame_into(&mut self.stream, payload, MAX_PAYLOAD).await? {
            Some(Kind::Batch) => Ok(Ok(BatchHead::decode(payload, payload.len() as u64)?)),
            Some(Kind::Error) => Ok(Err(ErrorFrame::decode(payload)?)),
            Some(k) => anyhow::bail!("unexpected {k:?} frame"),
            None => anyhow::bail!("worker closed the connection"),
        }
    }

    pub async fn recv(&mut self) -> anyhow::Result<Answer> {
        match read_frame(&mut self.stream, MAX_PAYLOAD).await? {
            Some((Kind::Batch, p)) => Ok(Answer::Batch(BatchHead::decode(&p, p.len() as u64)?, p)),
            Some((Kind::Error, p)) => Ok(Answer::Error(ErrorFrame::decode(&p)?)),
            Some((k, _)) => anyhow::bail!("unexpected {k:?} frame"),
            None => anyhow::bail!("worker closed the connection"),
        }
    }
}
