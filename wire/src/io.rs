//! Async frame I/O over any tokio stream (feature `tokio`), shared by workers and clients.
//!
//! Every read names the largest payload its caller accepts: a peer's header never decides on
//! its own how much memory the reader commits (a worker accepts a Hello or a Request of a few
//! KiB before and after authentication; only a client reading batches accepts large frames).

use crate::{
    ErrorFrame, FrameHeader, Hello, Kind, Welcome, WireError, HEADER_LEN, MAX_CONTROL_PAYLOAD,
};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("reading a frame: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("a {kind:?} frame of {len} bytes is more than the {limit} bytes accepted here")]
    TooLarge { kind: Kind, len: u64, limit: u64 },
}

/// Reads and validates one frame header; `Ok(None)` on a clean end of stream before it.
pub async fn read_header<R: AsyncRead + Unpin>(
    r: &mut R,
) -> Result<Option<FrameHeader>, ReadError> {
    let mut h = [0u8; HEADER_LEN];
    match r.read_exact(&mut h).await {
        Ok(_) => Ok(Some(FrameHeader::decode(&h)?)),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Reads a header and refuses a payload over `limit` bytes before reading any of it.
async fn read_bounded_header<R: AsyncRead + Unpin>(
    r: &mut R,
    limit: u64,
) -> Result<Option<FrameHeader>, ReadError> {
    match read_header(r).await? {
        Some(h) if h.len > limit => Err(ReadError::TooLarge {
            kind: h.kind,
            len: h.len,
            limit,
        }),
        h => Ok(h),
    }
}

/// Reads one frame of at most `limit` payload bytes into `payload` (reusing its memory);
/// `Ok(None)` on a clean end of stream before a header.
pub async fn read_frame_into<R: AsyncRead + Unpin>(
    r: &mut R,
    payload: &mut Vec<u8>,
    limit: u64,
) -> Result<Option<Kind>, ReadError> {
    let Some(header) = read_bounded_header(r, limit).await? else {
        return Ok(None);
    };
    payload.resize(header.len as usize, 0);
    r.read_exact(payload).await?;
    Ok(Some(header.kind))
}

/// Reads one frame of at most `limit` payload bytes; `Ok(None)` on a clean end of stream
/// before a header. Memory grows with the bytes that arrive, not with what the header claims.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    limit: u64,
) -> Result<Option<(Kind, Vec<u8>)>, ReadError> {
    let Some(header) = read_bounded_header(r, limit).await? else {
        return Ok(None);
    };
    let mut payload = Vec::new();
    let got = (&mut *r).take(header.len).read_to_end(&mut payload).await?;
    if (got as u64) < header.len {
        let short = std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!(
                "the stream ended {got} bytes into a {:?} frame of {}",
                header.kind, header.len
            ),
        );
        return Err(short.into());
    }
    Ok(Some((header.kind, payload)))
}

pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    kind: Kind,
    payload: &[u8],
) -> std::io::Result<()> {
    let h = FrameHeader {
        kind,
        len: payload.len() as u64,
    };
    w.write_all(&h.encode()).await?;
    w.write_all(payload).await
}

/// Why the requesting side's handshake did not end in a Welcome.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The worker answered the Hello with an Error frame (a wrong token, the connection
    /// limit, another protocol version) and closes the connection.
    #[error("refused by the worker ({:?}): {}", .0.code, .0.message)]
    Refused(ErrorFrame),
    #[error(transparent)]
    Read(#[from] ReadError),
    /// The answer was a Welcome or an Error frame that does not decode.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// Sending the Hello failed.
    #[error("sending the Hello: {0}")]
    Io(#[from] std::io::Error),
    #[error("no answer to the handshake after {0:?}")]
    TimedOut(Duration),
    #[error("unexpected {0:?} frame during the handshake")]
    Unexpected(Kind),
    #[error("connection closed during the handshake")]
    Closed,
}

/// The requesting side of the handshake on a fresh connection: sends the Hello (the pipeline
/// `token`, and `client`, a name for the worker's logs), and reads the worker's Welcome, or
/// the Error frame refusing it. The whole exchange is bounded by `timeout`, so a peer that
/// accepts the connection but never answers cannot hold the caller.
pub async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    token: &str,
    client: &str,
    timeout: Duration,
) -> Result<Welcome, HandshakeError> {
    let exchange = async {
        let hello = Hello {
            token: token.into(),
            client: client.into(),
        };
        write_frame(stream, Kind::Hello, &hello.encode()).await?;
        stream.flush().await?;
        match read_frame(stream, MAX_CONTROL_PAYLOAD).await? {
            Some((Kind::Welcome, p)) => Ok(Welcome::decode(&p)?),
            Some((Kind::Error, p)) => Err(HandshakeError::Refused(ErrorFrame::decode(&p)?)),
            Some((kind, _)) => Err(HandshakeError::Unexpected(kind)),
            None => Err(HandshakeError::Closed),
        }
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or(Err(HandshakeError::TimedOut(timeout)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(kind: Kind, len: u64) -> Vec<u8> {
        FrameHeader { kind, len }.encode().to_vec()
    }

    #[tokio::test]
    async fn a_header_over_the_limit_is_refused_before_its_payload() {
        // 1 MiB announced, 4 KiB accepted: refused without waiting for (or allocating) it.
        let bytes = header(Kind::Request, 1 << 20);
        let err = read_frame(&mut bytes.as_slice(), 4096).await.unwrap_err();
        assert!(
            matches!(err, ReadError::TooLarge { len, limit: 4096, .. } if len == 1 << 20),
            "{err}"
        );
        let mut buf = Vec::new();
        let err = read_frame_into(&mut bytes.as_slice(), &mut buf, 4096).await;
        assert!(matches!(err, Err(ReadError::TooLarge { .. })));
        assert_eq!(buf.capacity(), 0);
    }

    #[tokio::test]
    async fn a_frame_cut_short_is_an_error_and_a_whole_one_reads() {
        let mut bytes = header(Kind::Request, 10);
        bytes.extend_from_slice(b"12345");
        let err = read_frame(&mut bytes.as_slice(), 4096).await.unwrap_err();
        assert!(
            err.to_string()
                .contains("5 bytes into a Request frame of 10"),
            "{err}"
        );
        bytes.extend_from_slice(b"67890");
        let (kind, payload) = read_frame(&mut bytes.as_slice(), 4096)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (kind, payload.as_slice()),
            (Kind::Request, &b"1234567890"[..])
        );
        assert!(read_frame(&mut &b""[..], 4096).await.unwrap().is_none());
    }

    /// A worker's side of the handshake over an in-memory pipe: reads the Hello, answers with
    /// `answer` (kind and payload), or closes when `answer` is `None`.
    async fn worker_answers(answer: Option<(Kind, Vec<u8>)>) -> Result<Welcome, HandshakeError> {
        let (mut client, mut worker) = tokio::io::duplex(4096);
        let peer = tokio::spawn(async move {
            let (kind, p) = read_frame(&mut worker, 4096).await.unwrap().unwrap();
            assert_eq!(kind, Kind::Hello);
            let hello = Hello::decode(&p).unwrap();
            assert_eq!(
                (hello.token.as_str(), hello.client.as_str()),
                ("tok", "test")
            );
            if let Some((kind, payload)) = answer {
                write_frame(&mut worker, kind, &payload).await.unwrap();
            }
        });
        let r = handshake(&mut client, "tok", "test", Duration::from_secs(60)).await;
        peer.await.unwrap();
        r
    }

    #[tokio::test]
    async fn the_handshake_ends_in_a_welcome_or_says_why_not() {
        let welcome = Welcome {
            plan_id: 1,
            dataset_version: 2,
            num_samples: 3,
            global_batch_size: 4,
            batches_per_epoch: 1,
            description: "d".into(),
            max_connections: 8,
            links_per_rank: 2,
            media: crate::MediaTokens {
                image_token: 5,
                video_token: 6,
                merge_size: 2,
            },
        };
        let got = worker_answers(Some((Kind::Welcome, welcome.encode()))).await;
        assert_eq!(got.unwrap(), welcome);

        let refusal = ErrorFrame {
            request_id: 0,
            code: crate::ErrorCode::Unauthorized,
            message: "wrong pipeline token".into(),
        };
        let err = worker_answers(Some((Kind::Error, refusal.encode())))
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "refused by the worker (Unauthorized): wrong pipeline token"
        );
        assert!(matches!(err, HandshakeError::Refused(e) if e == refusal));

        let err = worker_answers(Some((Kind::Batch, Vec::new())))
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "unexpected Batch frame during the handshake"
        );
        let err = worker_answers(None).await.unwrap_err();
        assert_eq!(err.to_string(), "connection closed during the handshake");
        let err = worker_answers(Some((Kind::Welcome, vec![1, 2])))
            .await
            .unwrap_err();
        assert!(matches!(err, HandshakeError::Wire(_)), "{err}");
    }

    #[tokio::test]
    async fn a_silent_peer_times_the_handshake_out() {
        // The peer never answers, so the outcome does not depend on how long the wait is.
        let (mut client, _silent) = tokio::io::duplex(4096);
        let wait = Duration::from_millis(1);
        let err = handshake(&mut client, "tok", "test", wait)
            .await
            .unwrap_err();
        assert!(matches!(err, HandshakeError::TimedOut(d) if d == wait));
        assert_eq!(err.to_string(), "no answer to the handshake after 1ms");
    }
}
