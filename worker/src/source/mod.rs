//! Where a dataset lives: an S3 bucket prefix (through aws-sdk-s3) or a local folder.
//!
//! Keys are always relative to the dataset root and use `/`; [`media_key`] is the one place
//! that turns a path written inside a sample into a key (beside its shard, or under the
//! dataset's [`MediaRoot`], whose keys are the root's URI and the path), and it refuses any
//! path that would leave the root. Keys read from elsewhere (a stored index) pass
//! [`check_key`]; a local file is read only when no component of its key is a symbolic link
//! (the listing behind the index never follows one), and every whole-object read has a
//! [`ReadCap`].

use crate::byte_budget::ByteBudget;
use crate::metrics::StoreRequest;
use aws_sdk_s3::error::{DisplayErrorContext, ProvideErrorMetadata};
use bytes::Bytes;
use std::path::{Path, PathBuf};
use stoker_config::S3Connection;

mod paths;
pub use paths::{common_root, media_key, resolve_relative, PathError};

/// Reads of one object before its failure counts (each after the SDK's own retries).
pub const FETCH_ATTEMPTS: u32 = 4;
/// The first pause between them; each next one is 4x longer (50, 200, 800 ms).
pub const FETCH_BACKOFF: std::time::Duration = std::time::Duration::from_millis(50);

/// How long a read the store keeps throttling (503 SlowDown) is retried before it fails: as
/// long as a rank waits for an answer (the client's default `request_timeout`). Throttling is
/// the store asking for a slower rate, not a fault: failing the request would only send it
/// to another worker of the same store, sooner.
pub const THROTTLED_FOR: std::time::Duration = std::time::Duration::from_secs(120);

/// The pause after the `n`-th round of throttled attempts (0-based): 1 s doubling up to
/// 20 s, each between half and all of that (jitter, so that a fleet throttled together does
/// not come back together).
pub fn throttled_pause(n: u32, rng: &mut impl rand::Rng) -> std::time::Duration {
    let cap = std::time::Duration::from_secs(1 << n.min(5)).min(std::time::Duration::from_secs(20));
    cap.mul_f64(rng.gen_range(0.5..=1.0))
}

/// The S3 client's own retries inside each of those attempts: the SDK's standard mode (3
/// attempts, the i-th retry after a random pause below min(1 s x 2^(i-1), 20 s)), named here
/// so that the simulator's store (`stoker-lab bench scale`) retries as the worker does.
pub fn sdk_retry() -> aws_sdk_s3::config::retry::RetryConfig {
    aws_sdk_s3::config::retry::RetryConfig::standard()
}

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum FetchError {
    #[error("object {0} does not exist")]
    NotFound(String),
    #[error("object {what} is {len} bytes, over the limit of {max} ({limit}); not read")]
    TooLarge {
        what: String,
        len: u64,
        max: u64,
        limit: &'static str,
    },
    /// A key that would leave the root, or a local path through a symbolic link.
    #[error("object {0} is not read: {1}")]
    Refused(String, String),
    /// The store asked to slow down (503 SlowDown) through every one of the SDK's retries:
    /// retried by `Store` for up to `THROTTLED_FOR`, then a failure like `Io`.
    #[error("object {0}: the store asks to slow down ({1})")]
    Throttled(String, String),
    /// Reads that share a budget (one sample's objects) came to more than it. The message
    /// names no object: which read went over depends on timing, that one did does not.
    #[error(
        "its images and frames come to more than {max} bytes ({limit}); reading stopped there"
    )]
    OverByteBudget { max: u64, limit: &'static str },
    #[error("fetching {0}: {1}")]
    Io(String, String),
}

/// A bound on an object read whole, and the name a refusal gives it.
#[derive(Debug, Clone, Copy)]
pub struct ReadCap {
    pub bytes: u64,
    pub name: &'static str,
}

/// A tokenizer.json, or a JSON file holding a chat template (Qwen's are 7 MB and 5 KB).
pub const TOKENIZER_CAP: ReadCap = ReadCap {
    bytes: 64 << 20,
    name: "a tokenizer's 64 MiB cap",
};
/// A chat template's own file (`.jinja`).
pub const TEMPLATE_CAP: ReadCap = ReadCap {
    bytes: 1 << 20,
    name: "a chat template's 1 MiB cap",
};

/// Why `key` (read from outside: a stored index) is not a key under a root: empty, absolute,
/// a `.` or `..` segment, a backslash or a NUL.
pub fn check_key(key: &str) -> Result<(), &'static str> {
    if key.is_empty() {
        return Err("an empty key");
    }
    if key.starts_with('/') {
        return Err("an absolute path");
    }
    if key.contains('\\') || key.contains('\0') {
        return Err("a backslash or NUL in a key");
    }
    if key.split('/').any(|seg| seg == "." || seg == "..") {
        return Err("a '.' or '..' segment would leave the root");
    }
    Ok(())
}

/// A local file read whole, at most `cap` bytes of it (a tokenizer or template the worker's
/// flags name).
pub fn read_file_at_most(path: &Path, cap: ReadCap) -> anyhow::Result<Vec<u8>> {
    use std::io::Read;
    let file = std::fs::File::open(path)?;
    let mut out = Vec::new();
    file.take(cap.bytes + 1).read_to_end(&mut out)?;
    anyhow::ensure!(
        out.len() as u64 <= cap.bytes,
        "over {} bytes ({}); not read",
        cap.bytes,
        cap.name
    );
    Ok(out)
}

/// Chunks read from a local file at once.
const FILE_CHUNK_BYTES: u64 = 1 << 20;

/// An object being read.
struct Body {
    /// The object's full name, for errors.
    what: String,
    /// What the store says the body holds.
    len: Option<u64>,
    received: u64,
    chunks: Chunks,
}

enum Chunks {
    File {
        file: tokio::fs::File,
        left: u64,
    },
    S3 {
        stream: aws_sdk_s3::primitives::ByteStream,
        read_timeout: std::time::Duration,
    },
}

impl Body {
    /// The next chunk, `None` at the end; a body that ends short of its length is an error.
    async fn next_chunk(&mut self) -> Result<Option<Bytes>, FetchError> {
        let chunk = self.read_chunk().await?;
        match (&chunk, self.len) {
            (Some(c), _) => self.received += c.len() as u64,
            (None, Some(len)) if self.received < len => {
                let why = format!("the body ended after {} of {len} bytes", self.received);
                return Err(FetchError::Io(self.what.clone(), why));
            }
            (None, _) => {}
        }
        Ok(chunk)
    }

    async fn read_chunk(&mut self) -> Result<Option<Bytes>, FetchError> {
        let io = |why: String| FetchError::Io(self.what.clone(), why);
        match &mut self.chunks {
            Chunks::File { left: 0, .. } => Ok(None),
            Chunks::File { file, left } => {
                use tokio::io::AsyncReadExt;
                let mut buf = Vec::with_capacity((*left).min(FILE_CHUNK_BYTES) as usize);
                let n = (&mut *file)
                    .take((*left).min(FILE_CHUNK_BYTES))
                    .read_to_end(&mut buf)
                    .await
                    .map_err(|e| io(e.to_string()))?;
                // A file that shrank while read ends here (and `next_chunk` says so).
                *left = if n == 0 { 0 } else { *left - n as u64 };
                Ok((n > 0).then(|| buf.into()))
            }
            Chunks::S3 {
                stream,
                read_timeout,
            } => match tokio::time::timeout(*read_timeout, stream.try_next()).await {
                Ok(chunk) => chunk.map_err(|e| io(format!("reading body: {e}"))),
                Err(_) => Err(io(format!(
                    "the body stalled: no byte for {read_timeout:?} after {} bytes",
                    self.received
                ))),
            },
        }
    }
}

/// A folder or bucket prefix holding a dataset's media apart from its shards (`--media-root`):
/// the paths in its lines are resolved under it, as LLaVA's `image_folder` and LLaMA-Factory's
/// `media_dir` do. Read with the dataset's S3 connection; any bucket it reaches.
#[derive(Clone)]
pub struct MediaRoot {
    /// The root's full name, ending in '/': what its media keys start with.
    pub uri: String,
    pub store: Store,
}

impl MediaRoot {
    pub async fn open(uri: &str, s3: &S3Connection) -> anyhow::Result<MediaRoot> {
        let store = Store::open(uri, s3)
            .await
            .map_err(|e| e.context(format!("media root {uri}")))?;
        let mut uri = store.describe("");
        if !uri.ends_with('/') {
            uri.push('/');
        }
        Ok(MediaRoot { uri, store })
    }

    /// The same root, its requests counted (see [`Store::counted`]).
    pub fn counted(self, requests: &prometheus::IntCounterVec) -> MediaRoot {
        MediaRoot {
            store: self.store.counted(requests),
            ..self
        }
    }

    /// The store and its key for a media key under this root, if it is.
    pub fn split<'k>(&self, key: &'k str) -> Option<(&Store, &'k str)> {
        key.strip_prefix(self.uri.as_str())
            .map(|k| (&self.store, k))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    pub key: String,
    pub size: u64,
    /// ETag for S3, mtime+size for a local file: changes when the content does.
    pub version: String,
}

/// A dataset's store, counting its requests when given a counter.
#[derive(Clone)]
pub struct Store {
    backend: Backend,
    requests: Option<prometheus::IntCounterVec>,
}

#[derive(Clone)]
enum Backend {
    Local {
        root: PathBuf,
    },
    S3 {
        client: aws_sdk_s3::Client,
        bucket: String,
        /// Empty, or ends with '/'.
        prefix: String,
        /// Longest wait for a response to start or a body's next byte.
        read_timeout: std::time::Duration,
    },
}

impl From<Backend> for Store {
    fn from(backend: Backend) -> Store {
        Store {
            backend,
            requests: None,
        }
    }
}

impl Store {
    /// Opens `s3://bucket/prefix`, `file:///path` or a plain path.
    pub async fn open(uri: &str, s3: &S3Connection) -> anyhow::Result<Store> {
        if let Some(rest) = uri.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            anyhow::ensure!(!bucket.is_empty(), "{uri}: no bucket name");
            let mut prefix = prefix.trim_end_matches('/').to_string();
            if !prefix.is_empty() {
                prefix.push('/');
            }
            let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest());
            if let Some(e) = &s3.endpoint {
                loader = loader.endpoint_url(e);
            }
            let region = s3.region.clone().unwrap_or_else(|| "us-east-1".into());
            loader = loader.region(aws_config::Region::new(region));
            if let Some((ak, sk)) = &s3.static_credentials {
                loader = loader.credentials_provider(aws_sdk_s3::config::Credentials::new(
                    ak, sk, None, None, "stoker",
                ));
            }
            let conf = loader.load().await;
            let s3conf = aws_sdk_s3::config::Builder::from(&conf)
                .force_path_style(s3.path_style)
                .retry_config(sdk_retry())
                // A CRC over every image body costs CPU the preprocessing needs, and a
                // corrupt body fails decoding anyway (reported, never served). Checksums are
                // still validated when an object requires it.
                .response_checksum_validation(
                    aws_sdk_s3::config::ResponseChecksumValidation::WhenRequired,
                )
                .build();
            return Ok(Store::from(Backend::S3 {
                client: aws_sdk_s3::Client::from_conf(s3conf),
                bucket: bucket.to_string(),
                prefix,
                read_timeout: std::time::Duration::from_secs(s3.read_timeout_s.max(1)),
            }));
        }
        let path = uri.strip_prefix("file://").unwrap_or(uri);
        let root = PathBuf::from(path);
        anyhow::ensure!(root.is_dir(), "{uri}: not a folder (and not an s3:// URI)");
        Ok(Store::from(Backend::Local {
            root: root.canonicalize()?,
        }))
    }

    /// The same store, its requests counted by kind in `requests` (label `kind`).
    pub fn counted(self, requests: &prometheus::IntCounterVec) -> Store {
        Store {
            requests: Some(requests.clone()),
            ..self
        }
    }

    fn count(&self, kind: StoreRequest) {
        if let Some(c) = &self.requests {
            c.with_label_values(&[kind.as_str()]).inc();
        }
    }

    /// The full name of a key, for messages.
    pub fn describe(&self, key: &str) -> String {
        match &self.backend {
            Backend::Local { root } => root.join(key).display().to_string(),
            Backend::S3 { bucket, prefix, .. } => format!("s3://{bucket}/{prefix}{key}"),
        }
    }

    /// Every object under the root, sorted by key.
    pub async fn list(&self) -> anyhow::Result<Vec<ObjectInfo>> {
        let all = self.list_at_most(u64::MAX).await?;
        Ok(all.expect("no more than u64::MAX objects"))
    }

    /// Every object under the root, sorted by key, if there are at most `max`: the listing
    /// stops at the page (or, for a folder, the file) that goes past it (`None`).
    pub async fn list_at_most(&self, max: u64) -> anyhow::Result<Option<Vec<ObjectInfo>>> {
        let mut out = Vec::new();
        match &self.backend {
            Backend::Local { root } => {
                self.count(StoreRequest::List);
                if !list_local(root, root, &mut out, max)? {
                    return Ok(None);
                }
            }
            Backend::S3 {
                client,
                bucket,
                prefix,
                ..
            } => {
                let mut pages = client
                    .list_objects_v2()
                    .bucket(bucket)
                    .prefix(prefix.as_str())
                    .into_paginator()
                    .send();
                while let Some(page) = pages.next().await {
                    self.count(StoreRequest::List);
                    let page = page.map_err(|e| {
                        anyhow::anyhow!(
                            "listing {}: {}",
                            self.describe(""),
                            DisplayErrorContext(&e)
                        )
                    })?;
                    for o in page.contents() {
                        let key = o.key().unwrap_or_default();
                        out.push(ObjectInfo {
                            key: key[prefix.len()..].to_string(),
                            size: o.size().unwrap_or(0) as u64,
                            version: o.e_tag().unwrap_or_default().to_string(),
                        });
                    }
                    if out.len() as u64 > max {
                        return Ok(None);
                    }
                }
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(Some(out))
    }

    /// One object's size and version (one HEAD request): what the index's freshness check
    /// compares, shard by shard, instead of listing the dataset.
    pub async fn head(&self, key: &str) -> Result<ObjectInfo, FetchError> {
        self.retrying(|| self.head_once(key)).await
    }

    async fn head_once(&self, key: &str) -> Result<ObjectInfo, FetchError> {
        self.count(StoreRequest::Head);
        match &self.backend {
            Backend::Local { root } => {
                let (_, meta) = self.local_file(root, key, false).await?;
                Ok(local_info(key.to_string(), &meta))
            }
            Backend::S3 {
                client,
                bucket,
                prefix,
                read_timeout,
            } => {
                let sent = client
                    .head_object()
                    .bucket(bucket)
                    .key(format!("{prefix}{key}"))
                    .send();
                let stalled = || self.io_error(key, format!("no response within {read_timeout:?}"));
                let head = tokio::time::timeout(*read_timeout, sent)
                    .await
                    .map_err(|_| stalled())?
                    .map_err(|e| {
                        let not_found = e
                            .as_service_error()
                            .is_some_and(|s| s.is_not_found() || s.code() == Some("NotFound"))
                            || e.raw_response().is_some_and(|r| r.status().as_u16() == 404);
                        self.s3_failure(key, &e, not_found)
                    })?;
                Ok(ObjectInfo {
                    key: key.to_string(),
                    size: head.content_length().unwrap_or(0).max(0) as u64,
                    version: head.e_tag().unwrap_or_default().to_string(),
                })
            }
        }
    }

    /// A whole object of at most `cap` bytes: a bigger one is refused from its length, and a
    /// body that grows past it (a length that lied) stops being read there.
    pub async fn get_at_most(&self, key: &str, cap: ReadCap) -> Result<Bytes, FetchError> {
        self.retrying(|| self.read_once(key, None, cap, None)).await
    }

    /// [`Self::get_at_most`], its bytes also taken from `budget` as they arrive.
    pub(crate) async fn get_within(
        &self,
        key: &str,
        cap: ReadCap,
        budget: &ByteBudget,
        limit: &'static str,
    ) -> Result<Bytes, FetchError> {
        self.retrying(|| self.read_once(key, None, cap, Some((budget, limit))))
            .await
    }

    /// Bytes `start .. start + len` of an object.
    pub async fn get_range(&self, key: &str, start: u64, len: u64) -> Result<Bytes, FetchError> {
        let cap = ReadCap {
            bytes: len,
            name: "the range asked for",
        };
        self.retrying(|| self.read_once(key, Some((start, len)), cap, None))
            .await
    }

    /// Folds an object chunk by chunk (memory: one chunk and the state), starting over from
    /// `init()` when a read fails part way.
    pub async fn fold_chunks<S>(
        &self,
        key: &str,
        init: impl Fn() -> S,
        step: impl Fn(&mut S, &[u8]),
    ) -> Result<S, FetchError> {
        self.retrying(|| async {
            let mut body = self.open_object(key, None).await?;
            let mut state = init();
            while let Some(chunk) = body.next_chunk().await? {
                step(&mut state, &chunk);
            }
            Ok(state)
        })
        .await
    }

    /// Runs a read, retrying what may be transient (5xx the SDK gave up on, a reset, a body
    /// cut short) with backoff; a missing or oversized object is final at once. A throttled
    /// read is retried apart, for up to `THROTTLED_FOR` (`throttled_pause`). What still
    /// fails is `FetchError::Io`: the request fails (Transient), it is never a skip.
    async fn retrying<T, F: std::future::Future<Output = Result<T, FetchError>>>(
        &self,
        read: impl Fn() -> F,
    ) -> Result<T, FetchError> {
        let mut backoff = FETCH_BACKOFF;
        let mut attempt = 1;
        let started = std::time::Instant::now();
        let mut throttled = 0;
        loop {
            match read().await {
                Err(FetchError::Throttled(what, why)) if started.elapsed() < THROTTLED_FOR => {
                    let pause = throttled_pause(throttled, &mut rand::thread_rng());
                    tracing::debug!("{what}: throttled ({why}); retrying in {pause:?}");
                    tokio::time::sleep(pause).await;
                    throttled += 1;
                }
                Err(FetchError::Throttled(what, why)) => {
                    return Err(FetchError::Io(
                        what,
                        format!("the store asks to slow down ({why}), for {THROTTLED_FOR:?}"),
                    ))
                }
                Err(FetchError::Io(what, why)) if attempt < FETCH_ATTEMPTS => {
                    tracing::debug!("{what}: {why}; retrying in {backoff:?}");
                    tokio::time::sleep(backoff).await;
                    backoff *= 4;
                    attempt += 1;
                }
                Err(FetchError::Io(what, why)) => {
                    return Err(FetchError::Io(
                        what,
                        format!("{why} (after {FETCH_ATTEMPTS} attempts)"),
                    ))
                }
                other => return other,
            }
        }
    }

    fn io_error(&self, key: &str, why: String) -> FetchError {
        FetchError::Io(self.describe(key), why)
    }

    /// A failed S3 request for `key`: the object missing (`not_found`, as the operation tells
    /// it), the store throttling (503, S3's SlowDown: too many requests on the prefix), else
    /// an I/O failure.
    fn s3_failure<E: std::error::Error + 'static>(
        &self,
        key: &str,
        e: &aws_sdk_s3::error::SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
        not_found: bool,
    ) -> FetchError {
        let why = DisplayErrorContext(e).to_string();
        if not_found {
            FetchError::NotFound(self.describe(key))
        } else if e.raw_response().is_some_and(|r| r.status().as_u16() == 503) {
            FetchError::Throttled(self.describe(key), why)
        } else {
            self.io_error(key, why)
        }
    }

    /// One read of at most `cap` bytes into memory, taken from `budget` (named `limit`) as
    /// they arrive: the length the store gives first, then what the body holds past it. A
    /// failed read gives its bytes back to the budget.
    async fn read_once(
        &self,
        key: &str,
        range: Option<(u64, u64)>,
        cap: ReadCap,
        budget: Option<(&ByteBudget, &'static str)>,
    ) -> Result<Bytes, FetchError> {
        let mut body = self.open_object(key, range).await?;
        let max = cap.bytes;
        let too_large = |len| FetchError::TooLarge {
            what: self.describe(key),
            len,
            max,
            limit: cap.name,
        };
        if let Some(len) = body.len.filter(|&len| len > max) {
            return Err(too_large(len));
        }
        let mut claim = budget.map(|(b, limit)| (b.claim(), limit));
        let mut take = |total: u64| match &mut claim {
            Some((claim, limit)) => claim.grow_to(total).map_err(|over| {
                let limit = *limit;
                FetchError::OverByteBudget {
                    max: over.max,
                    limit,
                }
            }),
            None => Ok(()),
        };
        take(body.len.unwrap_or(0))?;
        let mut buf = bytes::BytesMut::with_capacity(body.len.unwrap_or(0) as usize);
        while let Some(chunk) = body.next_chunk().await? {
            let total = (buf.len() + chunk.len()) as u64;
            if total > max {
                return Err(too_large(total));
            }
            take(total)?;
            buf.extend_from_slice(&chunk);
        }
        if let Some((claim, _)) = claim {
            claim.keep();
        }
        Ok(buf.freeze())
    }

    /// Starts reading an object (or a range of it): its length, when known, and its body.
    async fn open_object(&self, key: &str, range: Option<(u64, u64)>) -> Result<Body, FetchError> {
        let io = |e: String| self.io_error(key, e);
        self.count(match range {
            Some(_) => StoreRequest::GetRange,
            None => StoreRequest::Get,
        });
        match &self.backend {
            Backend::Local { root } => {
                use tokio::io::AsyncSeekExt;
                let (file, meta) = self.local_file(root, key, true).await?;
                let mut file = tokio::fs::File::from_std(file.expect("opened"));
                let size = meta.len();
                let left = match range {
                    None => size,
                    Some((start, len)) => {
                        file.seek(std::io::SeekFrom::Start(start))
                            .await
                            .map_err(|e| io(e.to_string()))?;
                        len.min(size.saturating_sub(start))
                    }
                };
                Ok(Body {
                    what: self.describe(key),
                    len: Some(left),
                    received: 0,
                    chunks: Chunks::File { file, left },
                })
            }
            Backend::S3 {
                client,
                bucket,
                prefix,
                read_timeout,
            } => {
                let mut req = client
                    .get_object()
                    .bucket(bucket)
                    .key(format!("{prefix}{key}"));
                if let Some((start, len)) = range {
                    req = req.range(format!("bytes={start}-{}", start + len.max(1) - 1));
                }
                let stalled = || io(format!("no response within {read_timeout:?}"));
                let sent = tokio::time::timeout(*read_timeout, req.send());
                let resp = sent.await.map_err(|_| stalled())?.map_err(|e| {
                    let not_found = e
                        .as_service_error()
                        .is_some_and(|s| s.is_no_such_key() || s.code() == Some("NotFound"));
                    self.s3_failure(key, &e, not_found)
                })?;
                Ok(Body {
                    what: self.describe(key),
                    len: resp.content_length().map(|l| l.max(0) as u64),
                    received: 0,
                    chunks: Chunks::S3 {
                        stream: resp.body,
                        read_timeout: *read_timeout,
                    },
                })
            }
        }
    }

    /// The regular file `key` names under `root` (opened when `open`) and its metadata, never
    /// through a symbolic link: each component is looked at without following it, as the
    /// listing does, so a link placed after indexing is refused rather than read.
    async fn local_file(
        &self,
        root: &Path,
        key: &str,
        open: bool,
    ) -> Result<(Option<std::fs::File>, std::fs::Metadata), FetchError> {
        check_key(key).map_err(|why| FetchError::Refused(self.describe(key), why.into()))?;
        let (root, owned_key) = (root.to_path_buf(), key.to_string());
        let walked = tokio::task::spawn_blocking(move || -> std::io::Result<_> {
            let mut path = root;
            let mut meta = None;
            for seg in owned_key.split('/').filter(|s| !s.is_empty()) {
                path.push(seg);
                let m = std::fs::symlink_metadata(&path)?;
                if m.file_type().is_symlink() {
                    return Ok(Err(path));
                }
                meta = Some(m);
            }
            let meta = meta.expect("a checked key has a segment");
            if !meta.is_file() {
                return Err(std::io::ErrorKind::NotFound.into());
            }
            // A link swapped in between the walk and the open is not followed either.
            let file = open
                .then(|| {
                    use std::os::unix::fs::OpenOptionsExt;
                    std::fs::OpenOptions::new()
                        .read(true)
                        .custom_flags(libc::O_NOFOLLOW)
                        .open(&path)
                })
                .transpose()?;
            Ok(Ok((file, meta)))
        })
        .await
        .map_err(|e| self.io_error(key, e.to_string()))?;
        match walked {
            Ok(Ok(found)) => Ok(found),
            Ok(Err(link)) => Err(FetchError::Refused(
                self.describe(key),
                format!(
                    "{} is a symbolic link (links are not followed)",
                    link.display()
                ),
            )),
            // A component that is a file, not a folder, leaves nothing to find either.
            Err(e)
                if e.kind() == std::io::ErrorKind::NotFound
                    || e.raw_os_error() == Some(libc::ENOTDIR) =>
            {
                Err(FetchError::NotFound(self.describe(key)))
            }
            Err(e) => Err(self.io_error(key, e.to_string())),
        }
    }

    pub async fn put(&self, key: &str, data: Vec<u8>) -> anyhow::Result<()> {
        self.count(StoreRequest::Put);
        match &self.backend {
            Backend::Local { root } => {
                let path = root.join(key);
                if let Some(dir) = path.parent() {
                    tokio::fs::create_dir_all(dir).await?;
                }
                tokio::fs::write(&path, data).await?;
            }
            Backend::S3 {
                client,
                bucket,
                prefix,
                ..
            } => {
                client
                    .put_object()
                    .bucket(bucket)
                    .key(format!("{prefix}{key}"))
                    .body(data.into())
                    .send()
                    .await
                    .map_err(|e| {
                        anyhow::anyhow!(
                            "writing {}: {}",
                            self.describe(key),
                            DisplayErrorContext(&e)
                        )
                    })?;
            }
        }
        Ok(())
    }
}

/// Lists the files under `dir` into `out` while it holds at most `max` (false: it went past).
fn list_local(
    root: &Path,
    dir: &Path,
    out: &mut Vec<ObjectInfo>,
    max: u64,
) -> anyhow::Result<bool> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        let path = entry.path();
        if meta.is_dir() {
            if !list_local(root, &path, out, max)? {
                return Ok(false);
            }
        } else if meta.is_file() {
            let rel = path
                .strip_prefix(root)?
                .to_string_lossy()
                .replace('\\', "/");
            out.push(local_info(rel, &meta));
            if out.len() as u64 > max {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

/// A local file's size and version (mtime and size: changes when the content does).
fn local_info(key: String, meta: &std::fs::Metadata) -> ObjectInfo {
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    ObjectInfo {
        key,
        size: meta.len(),
        version: format!("{mtime}-{}", meta.len()),
    }
}
