//! Frame kinds and their payload encodings (specified in docs/protocol.md).

use crate::codec::{Reader, Writer};
use crate::media::MediaTokens;

pub const MAGIC: [u8; 4] = *b"STKR";
/// Bumped on any incompatible change; a peer refuses other versions with a clear error.
/// 2: the Cancel frame, and the Welcome's connection hints. 3: the Welcome's media tokens
/// (what a batch's media are checked against).
pub const VERSION: u8 = 3;
pub const HEADER_LEN: usize = 16;
/// Tensor data (and each tensor) starts at this alignment inside a batch payload.
pub const ALIGN: usize = 64;
/// Upper bound on one frame's payload; a header announcing more is rejected before reading.
pub const MAX_PAYLOAD: u64 = 8 << 30;
/// Upper bound for control frames (everything but batches).
pub const MAX_CONTROL_PAYLOAD: u64 = 1 << 20;
/// Upper bound on the tensors of one batch (a worker sends at most ~16): a head naming more
/// is refused before a table of them is built.
pub const MAX_TENSORS: usize = 64;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum WireError {
    #[error("bad magic {0:02x?}: not a Stoker peer")]
    BadMagic([u8; 4]),
    #[error("protocol v{peer} peer: {} (this build speaks v{VERSION})", upgrade(*.0), peer = .0)]
    Version(u8),
    #[error("unknown frame kind {0}")]
    Kind(u8),
    #[error("frame of {0} bytes exceeds the limit of {1}")]
    TooLarge(u64, u64),
    #[error("truncated: needed {need} bytes at offset {at}")]
    Truncated { at: usize, need: usize },
    #[error("invalid frame: {0}")]
    Invalid(String),
}

/// What a version mismatch asks for: the older side upgraded.
fn upgrade(peer: u8) -> String {
    if peer < VERSION {
        format!("upgrade it to v{VERSION}")
    } else {
        format!("upgrade this build to v{peer}")
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// client → worker, first frame on a connection: authentication.
    Hello = 1,
    /// worker → client: the plan the worker serves.
    Welcome = 2,
    /// client → worker: one rank slice of one global batch.
    Request = 3,
    /// worker → client: the batch.
    Batch = 4,
    /// worker → client: a refusal or failure, for a request or the connection.
    Error = 5,
    /// client → worker: the answer to a request is no longer wanted.
    Cancel = 6,
}

impl TryFrom<u8> for Kind {
    type Error = WireError;
    fn try_from(v: u8) -> Result<Self, WireError> {
        Ok(match v {
            1 => Kind::Hello,
            2 => Kind::Welcome,
            3 => Kind::Request,
            4 => Kind::Batch,
            5 => Kind::Error,
            6 => Kind::Cancel,
            k => return Err(WireError::Kind(k)),
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: Kind,
    pub len: u64,
}

impl FrameHeader {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..4].copy_from_slice(&MAGIC);
        h[4] = VERSION;
        h[5] = self.kind as u8;
        h[8..].copy_from_slice(&self.len.to_le_bytes());
        h
    }

    pub fn decode(h: &[u8; HEADER_LEN]) -> Result<Self, WireError> {
        let magic: [u8; 4] = h[..4].try_into().expect("4 bytes");
        if magic != MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        if h[4] != VERSION {
            return Err(WireError::Version(h[4]));
        }
        let kind = Kind::try_from(h[5])?;
        let len = u64::from_le_bytes(h[8..].try_into().expect("8 bytes"));
        let limit = if kind == Kind::Batch {
            MAX_PAYLOAD
        } else {
            MAX_CONTROL_PAYLOAD
        };
        if len > limit {
            return Err(WireError::TooLarge(len, limit));
        }
        Ok(FrameHeader { kind, len })
    }
}

/// Client greeting: the pipeline token and a free-form client name for logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub token: String,
    pub client: String,
}

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.str16(&self.token);
        w.str16(&self.client);
        w.buf
    }
    pub fn decode(p: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(p);
        Ok(Hello {
            token: r.str16()?,
            client: r.str16()?,
        })
    }
}

/// What a worker serves, and how it would like to be used. Two workers with equal `plan_id`
/// produce identical batch bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Welcome {
    pub plan_id: u64,
    pub dataset_version: u64,
    pub num_samples: u64,
    pub global_batch_size: u32,
    pub batches_per_epoch: u64,
    pub description: String,
    /// Hint: the connections this worker holds open at once (`--max-connections`).
    pub max_connections: u32,
    /// Hint: the most workers one trainer rank should connect to (`--links-per-rank`);
    /// 0 = the client decides.
    pub links_per_rank: u32,
    /// How the plan's media become tokens: every batch is checked against it.
    pub media: MediaTokens,
}

impl Welcome {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u64(self.plan_id);
        w.u64(self.dataset_version);
        w.u64(self.num_samples);
        w.u32(self.global_batch_size);
        w.u64(self.batches_per_epoch);
        w.str16(&self.description);
        w.u32(self.max_connections);
        w.u32(self.links_per_rank);
        w.u32(self.media.image_token);
        w.u32(self.media.video_token);
        w.u32(self.media.merge_size);
        w.buf
    }
    pub fn decode(p: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(p);
        let welcome = Welcome {
            plan_id: r.u64()?,
            dataset_version: r.u64()?,
            num_samples: r.u64()?,
            global_batch_size: r.u32()?,
            batches_per_epoch: r.u64()?,
            description: r.str16()?,
            max_connections: r.u32()?,
            links_per_rank: r.u32()?,
            media: MediaTokens {
                image_token: r.u32()?,
                video_token: r.u32()?,
                merge_size: r.u32()?,
            },
        };
        if welcome.media.merge_size == 0 {
            return Err(WireError::Invalid(format!(
                "the worker's plan {:016x} has a merge size of 0",
                welcome.plan_id
            )));
        }
        // Positions are epoch × batches_per_epoch + batch: a plan without batches has none.
        if welcome.batches_per_epoch == 0 {
            return Err(WireError::Invalid(format!(
                "the worker's plan {:016x} has 0 batches per epoch",
                welcome.plan_id
            )));
        }
        Ok(welcome)
    }

    /// The global position of `batch` of `epoch`; None where it does not fit in a u64 (a
    /// resume state of another plan, or a forged one).
    pub fn position(&self, epoch: u64, batch: u64) -> Option<u64> {
        epoch
            .checked_mul(self.batches_per_epoch)?
            .checked_add(batch)
    }

    /// Whether `other` serves the same plan, so that batches from either are interchangeable.
    /// The connection hints are left out: they may differ between workers of one plan (a
    /// rollout changing `--max-connections`) without changing a byte of a batch.
    pub fn same_plan(&self, other: &Welcome) -> bool {
        // Destructured so that a field added later must be placed on one side or the other.
        let Welcome {
            plan_id,
            dataset_version,
            num_samples,
            global_batch_size,
            batches_per_epoch,
            description,
            max_connections: _,
            links_per_rank: _,
            media,
        } = self;
        *plan_id == other.plan_id
            && *dataset_version == other.dataset_version
            && *num_samples == other.num_samples
            && *global_batch_size == other.global_batch_size
            && *batches_per_epoch == other.batches_per_epoch
            && *description == other.description
            && *media == other.media
    }
}

/// Client → worker: the client no longer wants the answer to `request_id` (it was answered
/// elsewhere, or the client is giving up on it). The worker stops preparing it and answers
/// nothing for it; cancelling an unknown or finished request is a no-op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cancel {
    pub request_id: u64,
}

impl Cancel {
    pub const LEN: usize = 8;
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u64(self.request_id);
        w.buf
    }
    pub fn decode(p: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(p);
        Ok(Cancel {
            request_id: r.u64()?,
        })
    }
}

/// One rank's slice of one global batch of one epoch of one plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BatchRequest {
    /// Chosen by the client; echoed in the answer so requests can be pipelined.
    pub request_id: u64,
    pub plan_id: u64,
    pub epoch: u64,
    pub global_batch: u64,
    pub rank: u32,
    pub world_size: u32,
}

impl BatchRequest {
    pub const LEN: usize = 40;
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u64(self.request_id);
        w.u64(self.plan_id);
        w.u64(self.epoch);
        w.u64(self.global_batch);
        w.u32(self.rank);
        w.u32(self.world_size);
        w.buf
    }
    pub fn decode(p: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(p);
        let req = BatchRequest {
            request_id: r.u64()?,
            plan_id: r.u64()?,
            epoch: r.u64()?,
            global_batch: r.u64()?,
            rank: r.u32()?,
            world_size: r.u32()?,
        };
        if req.world_size == 0 || req.rank >= req.world_size {
            return Err(WireError::Invalid(format!(
                "rank {} is not in world of size {}",
                req.rank, req.world_size
            )));
        }
        Ok(req)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum ErrorCode {
    /// Missing or wrong pipeline token.
    Unauthorized = 1,
    /// The request names a plan this worker does not serve.
    PlanMismatch = 2,
    /// The request is malformed or out of range (e.g. batch beyond the epoch).
    BadRequest = 3,
    /// The worker is draining or overloaded: retry elsewhere.
    Unavailable = 4,
    /// A sample failed under `on_error: fail`, or an internal error.
    Failed = 5,
    /// A transient fault (the object store failed after retries): another worker, or this
    /// one later, may serve the request; it is never turned into a skipped sample.
    Transient = 6,
}

impl ErrorCode {
    fn from_u16(v: u16) -> Result<Self, WireError> {
        Ok(match v {
            1 => ErrorCode::Unauthorized,
            2 => ErrorCode::PlanMismatch,
            3 => ErrorCode::BadRequest,
            4 => ErrorCode::Unavailable,
            5 => ErrorCode::Failed,
            6 => ErrorCode::Transient,
            c => return Err(WireError::Invalid(format!("unknown error code {c}"))),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorFrame {
    /// 0 when the error concerns the connection rather than one request.
    pub request_id: u64,
    pub code: ErrorCode,
    pub message: String,
}

impl ErrorFrame {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u64(self.request_id);
        w.u16(self.code as u16);
        w.str16(&self.message);
        w.buf
    }
    pub fn decode(p: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(p);
        Ok(ErrorFrame {
            request_id: r.u64()?,
            code: ErrorCode::from_u16(r.u16()?)?,
            message: r.str16()?,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum DType {
    U8 = 1,
    I32 = 2,
    I64 = 3,
    F32 = 4,
    BF16 = 5,
    F16 = 6,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::BF16 | DType::F16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 => 8,
        }
    }
    /// numpy's name for the dtype (bf16 has none: clients view it as uint16 or via torch).
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F32 => "float32",
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
        }
    }
    fn from_u8(v: u8) -> Result<Self, WireError> {
        Ok(match v {
            1 => DType::U8,
            2 => DType::I32,
            3 => DType::I64,
            4 => DType::F32,
            5 => DType::BF16,
            6 => DType::F16,
            d => return Err(WireError::Invalid(format!("unknown dtype {d}"))),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    /// Offset of the data from the start of the batch payload; a multiple of [`ALIGN`].
    pub offset: u64,
    pub nbytes: u64,
}

/// A sample the worker could not serve, and why (the batch is short by these).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    pub sample_id: u64,
    pub reason: String,
}

/// Everything in a batch payload before the tensor data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchHead {
    pub request: BatchRequest,
    /// Dataset sample ids, in the order of the rows of the tensors.
    pub sample_ids: Vec<u64>,
    pub skipped: Vec<Skipped>,
    pub tensors: Vec<TensorMeta>,
    /// Total payload length (head, padding and data).
    pub payload_len: u64,
}

/// A tensor to place in a batch: name, dtype, shape and its bytes, as one or more chunks
/// written back to back (so per-image pixel buffers need no concatenation before sending).
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub chunks: Vec<&'a [u8]>,
}

impl TensorRef<'_> {
    pub fn nbytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.len() as u64).sum()
    }
}

fn align_up(n: u64) -> u64 {
    n.div_ceil(ALIGN as u64) * ALIGN as u64
}

impl BatchHead {
    /// Lays out a batch: returns the head bytes (padded to [`ALIGN`]) and, for each tensor, the
    /// zero padding to write before its data. The caller writes head, then pad+data per tensor,
    /// so tensor bytes go to the socket without being copied into one buffer first.
    pub fn layout(
        request: BatchRequest,
        sample_ids: Vec<u64>,
        skipped: Vec<Skipped>,
        tensors: &[TensorRef<'_>],
    ) -> (Vec<u8>, Vec<usize>) {
        // The head's length depends only on names, shapes and counts, so encode once with
        // placeholder offsets to learn it, then again with real ones.
        let mut metas: Vec<TensorMeta> = tensors
            .iter()
            .map(|t| TensorMeta {
                name: t.name.to_string(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                offset: 0,
                nbytes: t.nbytes(),
            })
            .collect();
        let mut head = BatchHead {
            request,
            sample_ids,
            skipped,
            tensors: Vec::new(),
            payload_len: 0,
        };
        head.tensors = metas.clone();
        let head_len = align_up(head.encode_unpadded().len() as u64);
        let mut pos = head_len;
        let mut pads = Vec::with_capacity(metas.len());
        for m in metas.iter_mut() {
            let start = align_up(pos);
            pads.push((start - pos) as usize);
            m.offset = start;
            pos = start + m.nbytes;
        }
        head.tensors = metas;
        head.payload_len = pos;
        let mut bytes = head.encode_unpadded();
        bytes.resize(head_len as usize, 0);
        (bytes, pads)
    }

    fn encode_unpadded(&self) -> Vec<u8> {
        let mut w = Writer {
            buf: self.request.encode(),
        };
        w.u32(self.sample_ids.len() as u32);
        for id in &self.sample_ids {
            w.u64(*id);
        }
        w.u32(self.skipped.len() as u32);
        for s in &self.skipped {
            w.u64(s.sample_id);
            w.str16(&s.reason);
        }
        w.u32(self.tensors.len() as u32);
        for t in &self.tensors {
            w.str16(&t.name);
            w.u8(t.dtype as u8);
            w.u8(t.shape.len() as u8);
            for d in &t.shape {
                w.u64(*d);
            }
            w.u64(t.offset);
            w.u64(t.nbytes);
        }
        w.u64(self.payload_len);
        w.buf
    }

    /// Decodes and validates the head of a batch payload of `payload_len` bytes, of which
    /// `head` holds at least the head part (the whole payload is fine).
    pub fn decode(head: &[u8], payload_len: u64) -> Result<Self, WireError> {
        let mut r = Reader::new(head);
        let request = BatchRequest::decode(r.bytes(BatchRequest::LEN)?)?;
        let n = r.count(8)?;
        let sample_ids = (0..n).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
        let n = r.count(10)?;
        let mut skipped = Vec::with_capacity(n);
        for _ in 0..n {
            skipped.push(Skipped {
                sample_id: r.u64()?,
                reason: r.str16()?,
            });
        }
        let n = r.count(20)?;
        if n > MAX_TENSORS {
            return Err(WireError::Invalid(format!(
                "batch of {n} tensors exceeds the limit of {MAX_TENSORS}"
            )));
        }
        let mut tensors: Vec<TensorMeta> = Vec::with_capacity(n);
        for _ in 0..n {
            let name = r.str16()?;
            // Tensors are looked up by name: a second one of a name would be unreachable, or
            // taken in place of the first by a reader that scans from the end.
            if tensors.iter().any(|t| t.name == name) {
                return Err(WireError::Invalid(format!("tensor {name} appears twice")));
            }
            let dtype = DType::from_u8(r.u8()?)?;
            let ndim = r.u8()? as usize;
            let shape = (0..ndim).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
            let offset = r.u64()?;
            let nbytes = r.u64()?;
            let elems = shape
                .iter()
                .try_fold(1u64, |acc, d| acc.checked_mul(*d))
                .ok_or_else(|| WireError::Invalid(format!("tensor {name}: shape overflows")))?;
            if elems.checked_mul(dtype.size() as u64) != Some(nbytes) {
                return Err(WireError::Invalid(format!(
                    "tensor {name}: {nbytes} bytes do not match shape {shape:?} of {}",
                    dtype.name()
                )));
            }
            if offset % ALIGN as u64 != 0 {
                return Err(WireError::Invalid(format!(
                    "tensor {name}: offset {offset} is not {ALIGN}-byte aligned"
                )));
            }
            tensors.push(TensorMeta {
                name,
                dtype,
                shape,
                offset,
                nbytes,
            });
        }
        let declared_len = r.u64()?;
        if declared_len != payload_len {
            return Err(WireError::Invalid(format!(
                "batch declares {declared_len} payload bytes, frame has {payload_len}"
            )));
        }
        let head_end = r.pos() as u64;
        let mut prev_end = head_end;
        for t in &tensors {
            let end = t.offset.checked_add(t.nbytes).filter(|e| *e <= payload_len);
            match end {
                Some(end) if t.offset >= prev_end => prev_end = end,
                _ => {
                    return Err(WireError::Invalid(format!(
                        "tensor {}: bytes {}..+{} overlap or leave the payload of {payload_len}",
                        t.name, t.offset, t.nbytes
                    )))
                }
            }
        }
        Ok(BatchHead {
            request,
            sample_ids,
            skipped,
            tensors,
            payload_len,
        })
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorMeta> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// Assembles a whole batch payload in memory (tests, relays, and small batches).
pub fn encode_batch(
    request: BatchRequest,
    sample_ids: Vec<u64>,
    skipped: Vec<Skipped>,
    tensors: &[TensorRef<'_>],
) -> Vec<u8> {
    let (mut out, pads) = BatchHead::layout(request, sample_ids, skipped, tensors);
    for (t, pad) in tensors.iter().zip(pads) {
        out.resize(out.len() + pad, 0);
        for c in &t.chunks {
            out.extend_from_slice(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> BatchRequest {
        BatchRequest {
            request_id: 7,
            plan_id: 0xfeed,
            epoch: 2,
            global_batch: 11,
            rank: 1,
            world_size: 4,
        }
    }

    #[test]
    fn batch_roundtrip_keeps_alignment_and_bytes() {
        let ids: Vec<u8> = (0..24u8).collect();
        let px = vec![3u8; 100];
        let tensors = [
            TensorRef {
                name: "input_ids",
                dtype: DType::I64,
                shape: vec![1, 3],
                chunks: vec![&ids[..8], &ids[8..]],
            },
            TensorRef {
                name: "pixel_values",
                dtype: DType::U8,
                shape: vec![10, 10],
                chunks: vec![&px],
            },
        ];
        let skipped = vec![Skipped {
            sample_id: 9,
            reason: "corrupt image".into(),
        }];
        let payload = encode_batch(request(), vec![4, 5], skipped.clone(), &tensors);
        let head = BatchHead::decode(&payload, payload.len() as u64).unwrap();
        assert_eq!(head.request, request());
        assert_eq!(head.sample_ids, vec![4, 5]);
        assert_eq!(head.skipped, skipped);
        for (meta, t) in head.tensors.iter().zip(&tensors) {
            assert_eq!(meta.offset % ALIGN as u64, 0);
            let got = &payload[meta.offset as usize..(meta.offset + meta.nbytes) as usize];
            assert_eq!(got, t.chunks.concat());
        }
    }

    #[test]
    fn header_rejects_garbage() {
        let mut h = FrameHeader {
            kind: Kind::Request,
            len: 40,
        }
        .encode();
        assert_eq!(FrameHeader::decode(&h).unwrap().len, 40);
        h[4] = 9;
        assert_eq!(FrameHeader::decode(&h), Err(WireError::Version(9)));
        let big = FrameHeader {
            kind: Kind::Hello,
            len: MAX_CONTROL_PAYLOAD + 1,
        }
        .encode();
        assert!(matches!(
            FrameHeader::decode(&big),
            Err(WireError::TooLarge(..))
        ));
    }

    #[test]
    fn decode_never_panics_on_truncations_and_bit_flips() {
        let data = vec![1u8; 64];
        let tensors = [TensorRef {
            name: "x",
            dtype: DType::F32,
            shape: vec![4, 4],
            chunks: vec![&data],
        }];
        let payload = encode_batch(request(), vec![1, 2, 3], vec![], &tensors);
        for cut in 0..payload.len() {
            let _ = BatchHead::decode(&payload[..cut], cut as u64);
        }
        // Deterministic pseudo-random corruption (xorshift) of every region of the head.
        let mut x = 0x9e3779b97f4a7c15u64;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mut p = payload.clone();
            let i = (x as usize) % 200.min(p.len());
            p[i] = (x >> 32) as u8;
            let _ = BatchHead::decode(&p, p.len() as u64);
        }
    }

    fn welcome() -> Welcome {
        Welcome {
            plan_id: 0xfeed,
            dataset_version: 3,
            num_samples: 100,
            global_batch_size: 8,
            batches_per_epoch: 13,
            description: "qwen2-vl U8 seed=0".into(),
            max_connections: 1024,
            links_per_rank: 4,
            media: MediaTokens {
                image_token: 151655,
                video_token: 151656,
                merge_size: 2,
            },
        }
    }

    #[test]
    fn welcome_roundtrips_and_plans_ignore_the_hints() {
        let w = welcome();
        let bytes = w.encode();
        assert_eq!(Welcome::decode(&bytes), Ok(w.clone()));
        // A Welcome without its media tokens (a v2 layout) or hints (v1) is truncated, not
        // misread.
        for cut in [12, 20] {
            assert!(matches!(
                Welcome::decode(&bytes[..bytes.len() - cut]),
                Err(WireError::Truncated { .. })
            ));
        }
        let no_merge = Welcome {
            media: MediaTokens {
                merge_size: 0,
                ..w.media
            },
            ..w.clone()
        };
        assert!(Welcome::decode(&no_merge.encode())
            .unwrap_err()
            .to_string()
            .contains("merge size of 0"));
        let rollout = Welcome {
            max_connections: 64,
            links_per_rank: 0,
            ..w.clone()
        };
        assert!(w.same_plan(&rollout) && rollout.same_plan(&w));
        assert_ne!(w, rollout);
        let other_plan = Welcome {
            plan_id: 0xbeef,
            ..w.clone()
        };
        let other_data = Welcome {
            dataset_version: 4,
            ..w.clone()
        };
        assert!(!w.same_plan(&other_plan) && !w.same_plan(&other_data));
        let other_tokens = Welcome {
            media: MediaTokens {
                image_token: 1,
                ..w.media
            },
            ..w.clone()
        };
        assert!(!w.same_plan(&other_tokens));
    }

    #[test]
    fn cancel_roundtrips_and_refuses_truncation() {
        let c = Cancel { request_id: 77 };
        let bytes = c.encode();
        assert_eq!(bytes.len(), Cancel::LEN);
        assert_eq!(Cancel::decode(&bytes), Ok(c));
        for cut in 0..bytes.len() {
            assert!(Cancel::decode(&bytes[..cut]).is_err());
        }
        assert_eq!(Kind::try_from(6), Ok(Kind::Cancel));
    }

    #[test]
    fn another_version_is_refused_by_name() {
        let mut h = FrameHeader {
            kind: Kind::Hello,
            len: 10,
        }
        .encode();
        assert_eq!(h[4], 3);
        h[4] = 2;
        let e = FrameHeader::decode(&h).unwrap_err();
        assert_eq!(
            e.to_string(),
            "protocol v2 peer: upgrade it to v3 (this build speaks v3)"
        );
        h[4] = 4;
        let e = FrameHeader::decode(&h).unwrap_err();
        assert_eq!(
            e.to_string(),
            "protocol v4 peer: upgrade this build to v4 (this build speaks v3)"
        );
    }

    #[test]
    fn request_rank_must_be_in_world() {
        let mut r = request();
        r.rank = 4;
        assert!(BatchRequest::decode(&r.encode()).is_err());
    }

    fn tensors_named<'a>(names: &[&'a str], data: &'a [u8]) -> Vec<TensorRef<'a>> {
        names
            .iter()
            .map(|name| TensorRef {
                name,
                dtype: DType::U8,
                shape: vec![data.len() as u64],
                chunks: vec![data],
            })
            .collect()
    }

    #[test]
    fn a_batch_with_a_tensor_named_twice_is_refused_by_name() {
        let data = [1u8; 8];
        let tensors = tensors_named(&["input_ids", "labels", "input_ids"], &data);
        let payload = encode_batch(request(), vec![1], vec![], &tensors);
        assert_eq!(
            BatchHead::decode(&payload, payload.len() as u64),
            Err(WireError::Invalid("tensor input_ids appears twice".into()))
        );
    }

    #[test]
    fn a_batch_of_more_tensors_than_the_limit_is_refused() {
        let data = [1u8; 1];
        let names: Vec<String> = (0..=MAX_TENSORS).map(|i| format!("t{i}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let payload = encode_batch(request(), vec![1], vec![], &tensors_named(&names, &data));
        assert_eq!(
            BatchHead::decode(&payload, payload.len() as u64),
            Err(WireError::Invalid(format!(
                "batch of {} tensors exceeds the limit of {MAX_TENSORS}",
                MAX_TENSORS + 1
            )))
        );
        let at_limit = &names[..MAX_TENSORS];
        let payload = encode_batch(request(), vec![1], vec![], &tensors_named(at_limit, &data));
        assert!(BatchHead::decode(&payload, payload.len() as u64).is_ok());
    }

    #[test]
    fn a_plan_without_batches_is_refused_and_positions_never_overflow() {
        let empty = Welcome {
            batches_per_epoch: 0,
            ..welcome()
        };
        let e = Welcome::decode(&empty.encode()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid frame: the worker's plan 000000000000feed has 0 batches per epoch"
        );
        let w = welcome(); // 13 batches per epoch
        assert_eq!(w.position(2, 5), Some(31));
        assert_eq!(w.position(u64::MAX / 13, 0), Some(u64::MAX / 13 * 13));
        assert_eq!(w.position(u64::MAX / 13 + 1, 0), None);
        assert_eq!(w.position(u64::MAX / 13, 13), None);
    }
}
