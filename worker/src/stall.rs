//! A peer that stops reading: the writer notes when its peer last took bytes, and a watch
//! says when it has taken none for too long while an answer waited.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::AsyncWrite;
use tokio::time::Instant;

/// When the peer last made progress, in milliseconds since `start`.
#[derive(Clone)]
pub struct Watch {
    start: Instant,
    last_ms: Arc<AtomicU64>,
}

impl Watch {
    pub fn new() -> Self {
        Watch {
            start: Instant::now(),
            last_ms: Arc::default(),
        }
    }

    /// Progress now (an answer is ready: the time before it was the worker's, not the peer's).
    pub fn touch(&self) {
        let ms = self.start.elapsed().as_millis() as u64;
        self.last_ms.fetch_max(ms, Ordering::Relaxed);
    }

    /// Resolves once `limit` has passed without progress.
    pub async fn stalled_for(&self, limit: Duration) {
        loop {
            let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
            let deadline = self.start + last + limit;
            if Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep_until(deadline).await;
        }
    }

    /// `inner`, noting each write the peer takes.
    pub fn writer<W>(&self, inner: W) -> Watched<W> {
        Watched {
            inner,
            watch: self.clone(),
        }
    }
}

pub struct Watched<W> {
    inner: W,
    watch: Watch,
}

impl<W: AsyncWrite + Unpin> AsyncWrite for Watched<W> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r {
            if n > 0 {
                self.watch.touch();
            }
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_peer_taking_nothing_is_stalled_and_one_taking_bytes_is_not() {
        let limit = Duration::from_millis(300);
        // A pipe the peer never reads: its buffer takes 64 bytes, then nothing.
        let watch = Watch::new();
        let (w, _peer) = tokio::io::duplex(64);
        let mut w = watch.writer(w);
        let t = Instant::now();
        tokio::select! {
            _ = w.write_all(&[0; 1000]) => panic!("the peer took everything"),
            () = watch.stalled_for(limit) => {}
        }
        assert!(t.elapsed() >= limit);

        // A peer taking 64 bytes every 20 ms takes longer than the limit in all, and never
        // stalls.
        let watch = Watch::new();
        let (w, mut peer) = tokio::io::duplex(64);
        let mut w = watch.writer(w);
        let reader = tokio::spawn(async move {
            let mut buf = [0; 64];
            let mut total = 0;
            while total < 1000 {
                tokio::time::sleep(Duration::from_millis(20)).await;
                total += peer.read(&mut buf).await.unwrap();
            }
        });
        let slow = limit * 10;
        tokio::select! {
            r = w.write_all(&[0; 1000]) => r.unwrap(),
            () = watch.stalled_for(slow) => panic!("a peer taking bytes stalled"),
        }
        reader.await.unwrap();
    }
}
