//! Async frame I/O over any tokio stream (feature `tokio`), shared by workers and clients.
//!
//! Every read names the largest payload its caller accepts: a peer's header never decides on
//! its own how much memory the reader commits (a worker accepts a Hello or a Request of a few
//! KiB before and after authentication; only a client reading batches accepts large frames).

use crate::{FrameHeader, Kind, WireError, HEADER_LEN};
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
}
