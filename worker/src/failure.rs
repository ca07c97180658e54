//! Why a sample could not be served: one cause per kind of fault, its metric label (the
//! `SampleErrorKind` set, held to docs/metrics.md), and whether another attempt may succeed.

use crate::dataset::sample::SampleError;
use crate::limits::{LimitError, SampleLimits};
use crate::metrics::SampleErrorKind;
use crate::preprocess::text::TextError;
use crate::preprocess::video_error::VideoError;
use crate::preprocess::vision::ImageError;
use crate::source::{FetchError, PathError};

/// Why one sample failed; `kind` is the metric label, the message names the object or line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("sample {sample_id} ({location}): {message}")]
pub struct SampleFailure {
    pub sample_id: u64,
    pub location: String,
    pub kind: &'static str,
    pub message: String,
    /// The store failed, not the data: retrying may succeed, so the sample is never skipped
    /// for it (two workers would serve different bytes for one request).
    pub transient: bool,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum Cause {
    #[error(transparent)]
    Fetch(#[from] FetchError),
    #[error(transparent)]
    Sample(#[from] SampleError),
    #[error(transparent)]
    Path(#[from] PathError),
    #[error("image {key}: {err}")]
    Image { key: String, err: ImageError },
    #[error("video {key}: {err}")]
    Video { key: String, err: VideoError },
    #[error(transparent)]
    Text(#[from] TextError),
    #[error(transparent)]
    Limit(#[from] LimitError),
    #[error("sample id is not in the index")]
    NoSuchSample,
    #[error("preprocessing panicked: {0}")]
    Panicked(String),
    /// The runtime is going away (the worker stops or is killed) and cancelled the sample's
    /// work: not the data's fault, so never a skip.
    #[error("the worker is shutting down; the sample was not prepared")]
    ShuttingDown,
    /// Nobody waits for the sample any more: its preparation stopped part way
    /// (`crate::cancel`). Never served, so never a skip.
    #[error("the request went away; the sample's preparation stopped")]
    Cancelled,
}

impl Cause {
    pub(crate) fn kind(&self) -> SampleErrorKind {
        use SampleErrorKind as K;
        match self {
            Cause::Fetch(FetchError::NotFound(_)) => K::ObjectMissing,
            Cause::Fetch(FetchError::Io(..) | FetchError::Throttled(..)) => K::ObjectStore,
            Cause::Fetch(FetchError::TooLarge { .. }) => K::ObjectTooLarge,
            Cause::Fetch(FetchError::OverByteBudget { .. }) => K::SampleOverByteBudget,
            Cause::Sample(SampleError::NotUtf8(_)) => K::NotUtf8,
            Cause::Sample(SampleError::Json(_)) => K::InvalidJson,
            Cause::Sample(
                SampleError::Schema(_) | SampleError::UnknownFormat(_) | SampleError::Parquet(_),
            ) => K::InvalidSample,
            Cause::Path(_) | Cause::Fetch(FetchError::Refused(..)) => K::PathRefused,
            Cause::Image { err, .. } => match err {
                ImageError::Unsupported => K::ImageUnsupported,
                ImageError::Corrupt(_) => K::ImageCorrupt,
                ImageError::TooLarge { .. } => K::ImageTooLarge,
                ImageError::AspectRatio { .. } => K::ImageAspectRatio,
                ImageError::OverBudget(_) => K::ImageOverBudget,
                ImageError::TooManyScans { .. } => K::ImageTooManyScans,
                ImageError::OverWorkBudget { .. } => K::SampleOverWorkBudget,
            },
            Cause::Video { err, .. } => match err {
                VideoError::Unsupported
                | VideoError::NoVideoStream
                | VideoError::UnsupportedContainer => K::VideoUnsupported,
                VideoError::Corrupt(_) => K::VideoCorrupt,
                VideoError::FrameTooLarge { .. } => K::VideoTooLarge,
                VideoError::TooManyFrames { .. } => K::VideoTooLong,
                VideoError::Sampling(_) => K::VideoSampling,
                VideoError::SamplePixels { .. } => K::SampleTooLarge,
                VideoError::OverWorkBudget { .. } => K::SampleOverWorkBudget,
                VideoError::Cancelled { .. } => K::Cancelled,
            },
            Cause::Text(TextError::TooLong { .. }) => K::TooLong,
            Cause::Text(_) => K::Text,
            Cause::Limit(e) => e.kind(),
            Cause::NoSuchSample => K::NoSuchSample,
            Cause::Panicked(_) => K::Panic,
            Cause::ShuttingDown => K::ShuttingDown,
            Cause::Cancelled => K::Cancelled,
        }
    }

    /// The store or the worker failed, not the data: another attempt may succeed.
    pub(crate) fn is_transient(&self) -> bool {
        matches!(
            self,
            Cause::Fetch(FetchError::Io(..) | FetchError::Throttled(..))
                | Cause::ShuttingDown
                | Cause::Cancelled
        )
    }
}

/// Runs `work` on the blocking pool. A panic there (a bug, or a decoder's) becomes this
/// sample's failure, named and counted like any other, never a request left unanswered.
pub(crate) async fn on_blocking_pool<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, Cause> + Send + 'static,
) -> Result<T, Cause> {
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|e| Err(blocking_failure(e)))
}

/// Why blocking work did not finish: it panicked, or shutdown cancelled it (a killed
/// worker's last answers once served such samples as skipped).
fn blocking_failure(e: tokio::task::JoinError) -> Cause {
    match e.try_into_panic() {
        Ok(payload) => Cause::Panicked(
            payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-text panic".into()),
        ),
        Err(_) => Cause::ShuttingDown,
    }
}

/// An image's error as a sample failure: the image's own fault, or (refused only because of
/// the sample's pixel budget) the sample's.
pub(crate) fn image_cause(limits: &SampleLimits, key: &str, err: ImageError) -> Cause {
    match limits.classify(key.to_string(), err) {
        Ok(err) => Cause::Image {
            key: key.to_string(),
            err,
        },
        Err(over) => Cause::Limit(over),
    }
}

pub(crate) fn video_cause(key: &str, err: VideoError) -> Cause {
    Cause::Video {
        key: key.to_string(),
        err,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_in_preprocessing_becomes_the_samples_named_failure() {
        let err = on_blocking_pool::<()>(|| panic!("decoder bug in x.jpg"))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), SampleErrorKind::Panic);
        assert_eq!(
            err.to_string(),
            "preprocessing panicked: decoder bug in x.jpg"
        );
        assert_eq!(on_blocking_pool(|| Ok(7)).await.unwrap(), 7);
    }

    /// A killed worker's runtime cancels the blocking work still to start; the sample must
    /// fail as transient (asked again elsewhere), never be skipped as if its data were bad.
    #[tokio::test]
    async fn preprocessing_cancelled_by_shutdown_is_transient_never_a_skip() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let handle = rt.handle().clone();
        rt.shutdown_background();
        let cancelled = handle.spawn_blocking(|| ()).await.unwrap_err();
        assert!(cancelled.is_cancelled());
        let cause = blocking_failure(cancelled);
        assert_eq!(cause.kind(), SampleErrorKind::ShuttingDown);
        assert!(cause.is_transient());
        assert!(!Cause::Panicked("bug".into()).is_transient());
    }
}
