//! `stoker._native`: the Rust trainer client as a Python extension. The pure-Python layer
//! (`stoker/__init__.py`) turns each batch's payload into numpy views; nothing is copied
//! between the socket and the arrays.

use pyo3::buffer::PyBuffer;
use pyo3::create_exception;
use pyo3::exceptions::{PyBufferError, PyRuntimeError, PyStopIteration, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::os::raw::{c_int, c_void};
use std::sync::Arc;
use std::time::Duration;
use stoker_client::{
    ca_from_env, normalize_pixels, AlignedBuf, ClientTls, Depth, Dial, Discovery, HedgePolicy,
    LoaderConfig, LoaderState, PixelLut, PixelOut, TlsError,
};

/// The memory of one batch, exported through the buffer protocol: numpy arrays made with
/// `numpy.frombuffer(payload, ...)` view it and keep it alive.
#[pyclass(module = "stoker._native")]
struct Payload {
    buf: AlignedBuf,
    /// Where the socket read wrote the bytes (equal to `address` unless someone copied).
    filled_at: usize,
}

#[pymethods]
impl Payload {
    /// Address of the first byte.
    #[getter]
    fn address(&self) -> usize {
        self.buf.address()
    }

    /// Address the client's socket read wrote to.
    #[getter]
    fn filled_at(&self) -> usize {
        self.filled_at
    }

    fn __len__(&self) -> usize {
        self.buf.len()
    }

    /// Writable: each batch has its own buffer, so a trainer may normalize in place.
    unsafe fn __getbuffer__(
        mut slf: PyRefMut<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("null Py_buffer"));
        }
        let len = slf.buf.len();
        let ptr = slf.buf.as_mut_slice().as_mut_ptr() as *mut c_void;
        // Fills shape/strides/format per `flags` and takes a reference on `obj`, so the
        // payload outlives every view.
        let rc = pyo3::ffi::PyBuffer_FillInfo(view, slf.as_ptr(), ptr, len as isize, 0, flags);
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}
}

/// How the loader dials: plaintext when asked for (and then nothing of TLS may be given),
/// TLS trusting `tls_ca`, else TLS trusting $STOKER_TLS_CA (the client crate's default).
fn dial(
    tls_ca: Option<String>,
    server_name: Option<String>,
    insecure_plaintext: bool,
) -> PyResult<Option<Dial>> {
    let tls_error = |e: TlsError| ConfigError::new_err(e.to_string());
    if insecure_plaintext {
        if tls_ca.is_some() || server_name.is_some() {
            return Err(ConfigError::new_err(
                "insecure_plaintext=True dials without TLS: tls_ca and tls_server_name would \
                 not be used",
            ));
        }
        return Ok(Some(Dial::InsecurePlaintext));
    }
    let tls = match tls_ca {
        Some(path) => Some(ClientTls::from_ca_file(path).map_err(tls_error)?),
        None => ca_from_env().map_err(py_error)?,
    };
    // Neither: the loader says what is missing.
    let Some(mut tls) = tls else {
        return Ok(None);
    };
    if let Some(name) = server_name {
        tls = tls.with_server_name(&name).map_err(tls_error)?;
    }
    Ok(Some(Dial::Tls(tls)))
}

/// The trainer client (see `stoker.Loader` for the documented Python API).
#[pyclass(module = "stoker._native")]
struct NativeLoader {
    inner: stoker_client::Loader,
}

#[pymethods]
impl NativeLoader {
    #[new]
    #[pyo3(signature = (workers, rank, world_size, tls_ca, tls_server_name, insecure_plaintext, token, prefetch, max_prefetch, hedge, metrics_addr, pipeline, no_worker_timeout_s, request_timeout_s, state))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        workers: &str,
        rank: u32,
        world_size: u32,
        tls_ca: Option<String>,
        tls_server_name: Option<String>,
        insecure_plaintext: bool,
        token: String,
        prefetch: Option<usize>,
        max_prefetch: usize,
        hedge: bool,
        metrics_addr: Option<String>,
        pipeline: String,
        no_worker_timeout_s: f64,
        request_timeout_s: f64,
        state: Option<(u64, u64, u64)>,
    ) -> PyResult<Self> {
        let discovery = Discovery::parse(workers).map_err(py_error)?;
        let mut cfg = LoaderConfig::new(discovery, rank, world_size);
        cfg.dial = dial(tls_ca, tls_server_name, insecure_plaintext)?;
        cfg.token = token;
        cfg.depth = match prefetch {
            Some(0) => Depth::OnDemand,
            Some(n) => Depth::Fixed(n),
            None => Depth::Auto { max: max_prefetch },
        };
        cfg.hedge = hedge.then(HedgePolicy::default);
        cfg.metrics_listen = metrics_addr;
        cfg.pipeline = pipeline;
        cfg.no_worker_timeout = Duration::from_secs_f64(no_worker_timeout_s.max(0.0));
        cfg.request_timeout = Duration::from_secs_f64(request_timeout_s.max(0.001));
        cfg.state = state.map(|(plan_id, epoch, next_batch)| LoaderState {
            plan_id,
            epoch,
            next_batch,
        });
        let inner = py
            .allow_threads(|| stoker_client::Loader::new(cfg))
            .map_err(py_error)?;
        Ok(NativeLoader { inner })
    }

    /// The next batch as a dict of metadata and tensor descriptions plus its `Payload`;
    /// raises StopIteration at the end of each epoch. The GIL is released while waiting.
    fn next_batch(&mut self, py: Python<'_>) -> PyResult<PyObject> {
        let inner = &mut self.inner;
        let batch = py.allow_threads(|| inner.next_batch()).map_err(py_error)?;
        let Some(batch) = batch else {
            return Err(PyStopIteration::new_err(()));
        };
        let d = PyDict::new(py);
        d.set_item("epoch", batch.epoch)?;
        d.set_item("global_batch", batch.global_batch)?;
        d.set_item("sample_ids", batch.sample_ids.clone())?;
        let skipped: Vec<(u64, String)> = batch
            .skipped
            .iter()
            .map(|s| (s.sample_id, s.reason.clone()))
            .collect();
        d.set_item("skipped", skipped)?;
        d.set_item("worker", batch.worker.clone())?;
        let tensors: Vec<(String, &str, Vec<u64>, u64, u64)> = batch
            .tensors
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    t.dtype.name(),
                    t.shape.clone(),
                    t.offset,
                    t.nbytes,
                )
            })
            .collect();
        d.set_item("tensors", tensors)?;
        // A packed batch's packs, as the client checked them against the tensors.
        let packs: Option<Vec<PackRanges>> = batch
            .packs
            .as_ref()
            .map(|packs| packs.iter().map(pack_ranges).collect());
        d.set_item("packs", packs)?;
        // The scheduler let go of the batch: this Arc is the only owner.
        let buf = Arc::try_unwrap(batch.payload)
            .map_err(|_| PyRuntimeError::new_err("batch payload still shared"))?;
        let filled_at = buf.address();
        d.set_item("payload", Payload { buf, filled_at })?;
        Ok(d.into_any().unbind())
    }

    /// (plan_id, epoch, next_batch)
    fn state(&self) -> (u64, u64, u64) {
        let s = self.inner.state();
        (s.plan_id, s.epoch, s.next_batch)
    }

    fn load_state(
        &mut self,
        py: Python<'_>,
        plan_id: u64,
        epoch: u64,
        next_batch: u64,
    ) -> PyResult<()> {
        let inner = &mut self.inner;
        py.allow_threads(|| {
            inner.load_state(LoaderState {
                plan_id,
                epoch,
                next_batch,
            })
        })
        .map_err(py_error)
    }

    /// The plan the workers serve.
    fn plan<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let p = self.inner.plan();
        let d = PyDict::new(py);
        d.set_item("plan_id", p.plan_id)?;
        d.set_item("dataset_version", p.dataset_version)?;
        d.set_item("num_samples", p.num_samples)?;
        d.set_item("global_batch_size", p.global_batch_size)?;
        d.set_item("batches_per_epoch", p.batches_per_epoch)?;
        d.set_item("description", p.description.clone())?;
        Ok(d)
    }

    /// Blocked vs. stepping time so far.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("wait_s", s.wait_s)?;
        d.set_item("step_s", s.step_s)?;
        d.set_item("wait_ratio", s.wait_ratio())?;
        d.set_item("batches", s.batches)?;
        d.set_item("samples", s.samples)?;
        Ok(d)
    }

    /// "host:port" of the /metrics endpoint, if enabled.
    fn metrics_addr(&self) -> Option<String> {
        self.inner.metrics_addr().map(|a| a.to_string())
    }
}

/// `out[i] = lut[channel(i)][pixels[i]]` for u8 `pixels` of `columns` columns, into `out`
/// (float32, or with `bf16` its bfloat16 bits as uint16), on up to `threads` threads with the GIL released.
/// Every buffer must be C-contiguous; `out` writable and as long as `pixels`.
#[pyfunction]
#[pyo3(signature = (pixels, columns, lut, out, bf16, threads))]
fn normalize_u8(
    py: Python<'_>,
    pixels: PyBuffer<u8>,
    columns: usize,
    lut: PyBuffer<f32>,
    out: &Bound<'_, PyAny>,
    bf16: bool,
    threads: usize,
) -> PyResult<()> {
    let lut = PixelLut::new(&lut.to_vec(py)?).map_err(|e| PyValueError::new_err(e.to_string()))?;
    if !pixels.is_c_contiguous() {
        return Err(PyBufferError::new_err("pixel_values must be C-contiguous"));
    }
    // SAFETY: the buffer is contiguous, of `item_count` u8, and stays exported (the owner
    // can neither free nor resize it) until `pixels` drops at the end of this call.
    let px =
        unsafe { std::slice::from_raw_parts(pixels.buf_ptr() as *const u8, pixels.item_count()) };
    let result = if !bf16 {
        let buf = writable::<f32>(out, &pixels)?;
        // SAFETY: as above, plus writable and aligned for f32 (checked by PyBuffer::get);
        // no other slice of it exists in this call.
        let o =
            unsafe { std::slice::from_raw_parts_mut(buf.buf_ptr() as *mut f32, buf.item_count()) };
        py.allow_threads(|| normalize_pixels(px, columns, &lut, PixelOut::F32(o), threads))
    } else {
        let buf = writable::<u16>(out, &pixels)?;
        // SAFETY: as for f32.
        let o =
            unsafe { std::slice::from_raw_parts_mut(buf.buf_ptr() as *mut u16, buf.item_count()) };
        py.allow_threads(|| normalize_pixels(px, columns, &lut, PixelOut::Bf16(o), threads))
    };
    result.map_err(|e| PyValueError::new_err(e.to_string()))
}

/// A writable C-contiguous buffer of `T` that shares no byte with `input`.
fn writable<T: pyo3::buffer::Element>(
    obj: &Bound<'_, PyAny>,
    input: &PyBuffer<u8>,
) -> PyResult<PyBuffer<T>> {
    let buf = PyBuffer::<T>::get(obj)?;
    if buf.readonly() || !buf.is_c_contiguous() {
        return Err(PyBufferError::new_err(
            "the output must be a writable C-contiguous array",
        ));
    }
    let (out_start, in_start) = (buf.buf_ptr() as usize, input.buf_ptr() as usize);
    if out_start < in_start + input.len_bytes() && in_start < out_start + buf.len_bytes() {
        return Err(PyBufferError::new_err(
            "the output overlaps pixel_values: give a buffer of its own",
        ));
    }
    Ok(buf)
}

// One exception class per kind of client error, so a training script can tell a
// misconfiguration (fix and restart) from an outage (wait, or let the job restart).
create_exception!(
    _native,
    StokerError,
    PyRuntimeError,
    "Base of every error the Stoker client raises."
);
create_exception!(
    _native,
    ConfigError,
    StokerError,
    "The loader was configured wrongly (rank outside the world, a bad worker list)."
);
create_exception!(
    _native,
    Unauthorized,
    StokerError,
    "A worker refused the pipeline token."
);
create_exception!(
    _native,
    PlanMismatch,
    StokerError,
    "The workers serve another plan than the loader (or its saved state) needs."
);
create_exception!(
    _native,
    NoWorker,
    StokerError,
    "No worker could be used within no_worker_timeout_s; the message names each one's problem."
);
create_exception!(
    _native,
    BatchFailed,
    StokerError,
    "A batch could not be served; the message names the epoch, batch, rank and worker."
);

/// (row, tokens, cu_seqlens, max_seqlen, images, pixel rows, videos, video pixel rows): a
/// pack for `Batch.packs()`.
type PackRanges = (
    usize,
    usize,
    Vec<i32>,
    i32,
    (usize, usize),
    (usize, usize),
    (usize, usize),
    (usize, usize),
);

fn pack_ranges(p: &stoker_client::Pack) -> PackRanges {
    let range = |r: &std::ops::Range<usize>| (r.start, r.end);
    (
        p.row,
        p.tokens,
        p.cu_seqlens.clone(),
        p.max_seqlen,
        range(&p.images),
        range(&p.pixel_rows),
        range(&p.videos),
        range(&p.video_rows),
    )
}

/// The Python exception of a client error's kind.
fn py_error(e: stoker_client::Error) -> PyErr {
    use stoker_client::Error as E;
    let message = e.to_string();
    match e {
        E::Config(_) => ConfigError::new_err(message),
        E::Unauthorized { .. } => Unauthorized::new_err(message),
        E::PlanMismatch(_) => PlanMismatch::new_err(message),
        E::NoWorker { .. } => NoWorker::new_err(message),
        E::BatchFailed { .. } => BatchFailed::new_err(message),
        E::Internal(_) => StokerError::new_err(message),
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeLoader>()?;
    m.add_class::<Payload>()?;
    m.add_function(wrap_pyfunction!(normalize_u8, m)?)?;
    let py = m.py();
    m.add("StokerError", py.get_type::<StokerError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("Unauthorized", py.get_type::<Unauthorized>())?;
    m.add("PlanMismatch", py.get_type::<PlanMismatch>())?;
    m.add("NoWorker", py.get_type::<NoWorker>())?;
    m.add("BatchFailed", py.get_type::<BatchFailed>())?;
    Ok(())
}
