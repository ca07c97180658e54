//! Fenced writes. The Kubernetes API has no precondition on another object, so a leader that
//! was paused or cut off past its Lease cannot be stopped by the API server: it must stop
//! itself. Every write the controller sends (any method but GET and HEAD, through the client
//! built with [`FenceLayer`]) is checked at the moment it is dispatched against the leader's
//! own monotonic clock: it starts only while the last successful renewal was sent less than
//! `write_for` ago, and it is cut off once `hold` has passed since that renewal, the earliest
//! a candidate may take the Lease. The Lease's own requests go through a client without it.

use http::{Method, Request};
use prometheus::IntCounter;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::Instant;
use tower::{BoxError, Layer, Service};

/// Whether this replica may write now, on its own monotonic clock.
pub struct Fence {
    /// How long after a successful renewal was sent writes may start.
    write_for: Duration,
    /// How long after it a write must be done: no candidate may take the Lease before.
    hold: Duration,
    /// When the last successful renewal was sent; `None` while not leading.
    renewed: Mutex<Option<Instant>>,
    /// Writes refused or cut off (`stoker_operator_writes_fenced_total`).
    fenced: IntCounter,
}

/// A write refused or cut off by the [`Fence`].
#[derive(Debug, thiserror::Error)]
#[error(
    "{0} not written: this replica no longer holds the leader Lease with the margin left \
     (fenced; another replica may be leading)"
)]
pub struct NotLeading(String);

impl Fence {
    /// Writes start up to `write_for` after a renewal was sent and end by `hold` after it.
    pub fn new(write_for: Duration, hold: Duration, fenced: IntCounter) -> Arc<Self> {
        assert!(
            write_for < hold,
            "writes need a margin before the Lease can be taken"
        );
        Arc::new(Fence {
            write_for,
            hold,
            renewed: Mutex::new(None),
            fenced,
        })
    }

    /// A renewal sent at `sent` succeeded.
    pub fn renewed(&self, sent: Instant) {
        *self.renewed.lock().expect("fence") = Some(sent);
    }

    /// This replica stepped down: no write starts any more.
    pub fn close(&self) {
        *self.renewed.lock().expect("fence") = None;
    }

    /// The instant a write that starts now must be done by, or `None`: it may not start.
    pub fn admit(&self) -> Option<Instant> {
        let sent = (*self.renewed.lock().expect("fence"))?;
        (Instant::now() < sent + self.write_for).then_some(sent + self.hold)
    }
}

/// Wraps the controller's client: every write passes the [`Fence`].
#[derive(Clone)]
pub struct FenceLayer(pub Arc<Fence>);

impl<S> Layer<S> for FenceLayer {
    type Service = Fenced<S>;

    fn layer(&self, inner: S) -> Fenced<S> {
        Fenced {
            inner,
            fence: self.0.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Fenced<S> {
    inner: S,
    fence: Arc<Fence>,
}

impl<S, B> Service<Request<B>> for Fenced<S>
where
    S: Service<Request<B>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        if matches!(*req.method(), Method::GET | Method::HEAD) {
            let read = self.inner.call(req);
            return Box::pin(async move { read.await.map_err(|e| -> BoxError { e.into() }) });
        }
        let write = format!("{} {}", req.method(), req.uri().path());
        let fenced = self.fence.fenced.clone();
        let Some(done_by) = self.fence.admit() else {
            fenced.inc();
            return Box::pin(async move { Err(BoxError::from(NotLeading(write))) });
        };
        let sent = self.inner.call(req);
        Box::pin(async move {
            match tokio::time::timeout_at(done_by, sent).await {
                Ok(answer) => answer.map_err(|e| -> BoxError { e.into() }),
                Err(_) => {
                    fenced.inc();
                    Err(BoxError::from(NotLeading(write)))
                }
            }
        })
    }
}
