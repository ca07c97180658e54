//! Async frame I/O over any tokio stream (feature `tokio`), shared by workers and clients.

use crate::{FrameHeader, Kind, HEADER_LEN};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Reads and validates one frame header; `Ok(None)` on a clean end of stream before it.
pub async fn read_header<R: AsyncRead + Unpin>(r: &mut R) -> anyhow::Result<Option<FrameHeader>> {
    let mut h = [0u8; HEADER_LEN];
    match r.read_exact(&mut h).await {
        Ok(_) => Ok(Some(FrameHeader::decode(&h)?)),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Reads one frame's payload into `payload` (reusing its memory); `Ok(None)` on a clean end
/// of stream before a header.
pub async fn read_frame_into<R: AsyncRead + Unpin>(
    r: &mut R,
    payload: &mut Vec<u8>,
) -> anyhow::Result<Option<Kind>> {
    let Some(header) = read_header(r).await? else {
        return Ok(None);
    };
    payload.resize(header.len as usize, 0);
    r.read_exact(payload).await?;
    Ok(Some(header.kind))
}

/// Reads one frame; `Ok(None)` on a clean end of stream before a header.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
) -> anyhow::Result<Option<(Kind, Vec<u8>)>> {
    let mut payload = Vec::new();
    Ok(read_frame_into(r, &mut payload)
        .await?
        .map(|kind| (kind, payload)))
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
