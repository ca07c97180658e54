"""Stoker's trainer client: prefetched, zero-copy batches from Stoker workers.

    import stoker
    loader = stoker.Loader("dns:my-pipeline-workers.ns.svc:7700", rank=rank, world_size=world)
    for batch in loader:                      # one epoch; iterate again for the next
        loss = model(**batch.tensors)         # numpy arrays viewing the received bytes
    torch.save({"data": loader.state_dict()}, path)   # exact resume, any world size

Each batch's tensors are numpy views of the one buffer its frame was read into: nothing is
copied between the socket and your arrays (``stoker.torch`` wraps them as torch tensors,
again without copying). The time ``next()`` blocks is the trainer's wait; ``stats()`` and the
Prometheus endpoint (``metrics_port=``) report it as the wait ratio the operator scales on.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _native
from . import replica as replica_mod
from ._native import (
    BatchFailed,
    ConfigError,
    NoWorker,
    PlanMismatch,
    StokerError,
    Unauthorized,
)

__all__ = [
    "Loader",
    "Batch",
    "BufferPool",
    "bfloat16_dtype",
    "StokerError",
    "ConfigError",
    "Unauthorized",
    "PlanMismatch",
    "NoWorker",
    "BatchFailed",
    "shifted_labels",
    "PAD_TOKEN_ID",
]

_STATE_VERSION = 1

# The id the workers pad with: Qwen-VL's ``<|endoftext|>`` (every preset's tokenizer).
PAD_TOKEN_ID = 151643


def shifted_labels(labels: np.ndarray) -> np.ndarray:
    """Labels shifted left by one along the last axis, -100 at the end: position t holds the
    label that token t predicts. A trainer that splits the sequence across context-parallel
    ranks passes these (transformers' loss takes ``shift_labels=``): a rank's chunk cannot
    shift across into the next chunk. A packed sample's first label is -100, so no target
    crosses from one sample into the next."""
    out = np.full(labels.shape, -100, dtype=labels.dtype)
    out[..., :-1] = labels[..., 1:]
    return out


def bfloat16_dtype() -> Optional[np.dtype]:
    """numpy's bfloat16 if ``ml_dtypes`` is installed, else None (then bfloat16 tensors are
    returned as uint16 views holding the same bits; ``stoker.torch`` reinterprets them)."""
    try:
        import ml_dtypes  # type: ignore

        return np.dtype(ml_dtypes.bfloat16)
    except ImportError:
        return None


_BF16 = bfloat16_dtype()


def _numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        return _BF16 if _BF16 is not None else np.dtype(np.uint16)
    return np.dtype(name)


_PackRanges = Tuple[int, int, List[int], int, Tuple[int, int], Tuple[int, int], Tuple[int, int], Tuple[int, int]]


@dataclass
class Batch:
    """One rank's slice of one global batch.

    ``tensors`` maps names (input_ids, labels, attention_mask, pixel_values, image_grid_thw;
    batches holding a video add pixel_values_videos, video_grid_thw and, for Qwen2.5-VL,
    second_per_grid_ts; packed batches add position_ids, cu_seqlens and pack_images, see
    :meth:`packs`) to numpy
    arrays that view ``payload``; ``dtypes`` gives each tensor's wire dtype (it differs from
    the array's for bfloat16 without ml_dtypes).
    """

    epoch: int
    global_batch: int
    sample_ids: List[int]
    skipped: List[Tuple[int, str]]
    tensors: Dict[str, np.ndarray]
    dtypes: Dict[str, str]
    worker: str
    payload: Any = field(repr=False)
    # A packed batch's packs as the native client checked them against the tensors: (row,
    # tokens, cu_seqlens, max_seqlen, image rows, pixel rows, video rows, video pixel rows);
    # None for a plain batch.
    pack_ranges: Optional[List[_PackRanges]] = field(default=None, repr=False)
    # Where pixel_values() writes by default: the loader's pool (reused once nothing views
    # a buffer), or fresh memory.
    pool: Optional["BufferPool"] = field(default=None, repr=False)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.tensors[name]

    def pixel_values(
        self,
        device: Any = None,
        dtype: str = "float32",
        *,
        out: Any = None,
        pool: Optional["BufferPool"] = None,
        threads: Optional[int] = None,
    ) -> Any:
        """``pixel_values`` ready for the model: normalized as the Hugging Face processor does.

        With u8 pixels on the wire (resized and patchified, a quarter of float32's bytes) the
        batch carries the worker's normalization table (``pixel_lut``, float32 per channel and
        8-bit value, computed with the processor's arithmetic); looking each value up in it
        gives float32 values bit-identical to the processor's, wherever the lookup runs. On
        the host it is one native pass (read a byte, write a value) on up to ``threads``
        threads with the GIL released. Pixels normalized on the worker (f32 or bf16 on the
        wire) are only converted.

        Args:
            device: ``None`` returns a numpy array; a torch device returns a torch tensor:
                ``"cpu"`` runs the host pass (into ``out`` or ``pool`` if given), another
                device (``"cuda:0"``) runs the lookup there (only the u8 bytes cross).
            dtype: ``"float32"`` or ``"bfloat16"`` (rounded to nearest even from float32, as
                torch's ``.to(torch.bfloat16)`` does).
            out: write into this C-contiguous array of the pixels' shape and ``dtype`` (numpy,
                or a CPU torch tensor) instead of allocating; returned.
            pool: take the output from this :class:`BufferPool` (reused memory, optionally
                pinned for a fast host-to-device copy); default the loader's own pool
                (``Loader(pixel_buffers=...)``).
            threads: threads of the host pass; default ``STOKER_NORMALIZE_THREADS`` or
                ``min(4, usable cores)``.
        """
        return self._normalized("pixel_values", "pixel_lut", device, dtype, out, pool, threads)

    def pixel_values_videos(
        self,
        device: Any = None,
        dtype: str = "float32",
        *,
        out: Any = None,
        pool: Optional["BufferPool"] = None,
        threads: Optional[int] = None,
    ) -> Any:
        """``pixel_values_videos`` ready for the model, as :meth:`pixel_values` (with the
        video processors' own table, ``pixel_lut_videos``: they normalize in float32 in one
        step). Only batches holding a video have them (``"pixel_values_videos" in batch``)."""
        return self._normalized("pixel_values_videos", "pixel_lut_videos", device, dtype, out, pool, threads)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def _normalized(self, name, lut_name, device, dtype, out, pool, threads):
        if dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"{name} dtype {dtype!r}: use 'float32' or 'bfloat16'")
        px = self.tensors[name]
        lut = self.tensors.get(lut_name)
        wire = self.dtypes[name]
        host = _HostOutput(out, pool, threads, fallback=self.pool)
        if device is None:
            return _pixels_numpy(px, lut, wire, dtype, host)
        return _pixels_torch(px, lut, wire, device, dtype, host)

    def keys(self):
        return self.tensors.keys()

    @property
    def packed(self) -> bool:
        """Whether the worker packs (``--pack-max-tokens``): then each row of the token
        tensors is one pack of samples, not one sample."""
        return self.pack_ranges is not None

    def packs(
        self,
        device: Any = None,
        pixel_dtype: str = "float32",
        pool: Optional["BufferPool"] = None,
        *,
        pad_to_multiple_of: Optional[int] = None,
        shift_labels: bool = False,
        pad_token_id: int = PAD_TOKEN_ID,
    ) -> List[Dict[str, Any]]:
        """A packed batch's packs, each the keyword arguments of one varlen forward pass.

        Every rank gets the same number of packs per global batch (a synchronous step runs
        as many micro-batches on every rank). Each pack holds ``input_ids`` and ``labels``
        ``[1, T]`` (a sample's first label is -100: no loss term crosses into the next
        sample), ``position_ids`` ``[4, 1, T]`` (a text row restarting at each sample, as
        Hugging Face's packed-sequence detection reads it, then Qwen-VL's three rope rows as
        the model's ``get_rope_index`` gives them for each sample alone), its images'
        ``pixel_values`` (normalized, see :meth:`pixel_values`) and ``image_grid_thw``, and
        ``cu_seq_lens_q``/``cu_seq_lens_k`` (int32 sample boundaries) with
        ``max_length_q``/``max_length_k``, the names transformers' flash-attention path takes,
        and ``use_cache=False`` (transformers keeps packed samples apart only without a KV
        cache). ``model(**pack)`` trains on it with any attention implementation (the model
        masks across samples from the text position row; flash-attention takes the boundaries
        as they are); a custom kernel takes ``cu_seq_lens_q`` as its ``cu_seqlens``. ``batch.sample_ids``
        lists the samples pack after pack. Arrays are numpy views of the received bytes, or
        torch tensors on ``device``. A pack can be empty (T = 0) only in a final partial
        global batch with fewer samples than ranks.

        For context parallelism: ``pad_to_multiple_of`` (2 x cp for a load-balanced split)
        pads each pack to a multiple of it with a sample of its own (``pad_token_id``, labels
        -100, positions from 0, its own ``cu_seq_lens`` boundary: attention keeps it apart and
        no loss term reads it); ``shift_labels=True`` adds ``shift_labels``
        (:func:`stoker.shifted_labels` of the pack's labels) to pass the loss when the sequence
        is split across ranks. Plain data parallelism keeps neither: Hugging Face models shift
        the labels themselves.
        """
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ConfigError(f"pad_to_multiple_of {pad_to_multiple_of}: at least 1")
        if not self.packed:
            raise ConfigError("not a packed batch: start the workers with --pack-max-tokens")
        t = self.tensors
        pixels = self.pixel_values(device=device, dtype=pixel_dtype, pool=pool)
        videos = self.pixel_values_videos(device=device, dtype=pixel_dtype) if "pixel_values_videos" in t else None
        out = []
        for row, tokens, bounds, longest, images, rows, vids, video_rows in self.pack_ranges:
            cu = np.asarray(bounds, dtype=np.int32)
            pack = {
                "input_ids": t["input_ids"][row : row + 1, :tokens],
                "labels": t["labels"][row : row + 1, :tokens],
                "position_ids": t["position_ids"][:, row : row + 1, :tokens],
                "image_grid_thw": t["image_grid_thw"][slice(*images)],
                "cu_seq_lens_q": cu,
                "cu_seq_lens_k": cu,
            }
            padding = -tokens % pad_to_multiple_of if pad_to_multiple_of else 0
            if padding:
                _pad_pack(pack, padding, pad_token_id)
                longest = max(longest, padding)
            if shift_labels:
                pack["shift_labels"] = shifted_labels(pack["labels"])
            if videos is not None:
                pack["video_grid_thw"] = t["video_grid_thw"][slice(*vids)]
                if "second_per_grid_ts" in t:
                    pack["second_per_grid_ts"] = t["second_per_grid_ts"][slice(*vids)]
            if device is not None:
                import torch

                pack = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in pack.items()}
            pack["pixel_values"] = pixels[slice(*rows)]
            if videos is not None:
                pack["pixel_values_videos"] = videos[slice(*video_rows)]
            pack["max_length_q"] = pack["max_length_k"] = longest
            # transformers separates packed samples only without a KV cache (training).
            pack["use_cache"] = False
            out.append(pack)
        return out


def _pad_pack(pack: Dict[str, Any], padding: int, pad_token_id: int) -> None:
    """Appends ``padding`` tokens to ``pack`` as a sample of its own."""
    ids = pack["input_ids"]
    pack["input_ids"] = np.concatenate([ids, np.full((1, padding), pad_token_id, ids.dtype)], axis=1)
    labels = pack["labels"]
    pack["labels"] = np.concatenate([labels, np.full((1, padding), -100, labels.dtype)], axis=1)
    positions = pack["position_ids"]
    steps = np.broadcast_to(np.arange(padding, dtype=positions.dtype), (positions.shape[0], 1, padding))
    pack["position_ids"] = np.concatenate([positions, steps], axis=2)
    cu = pack["cu_seq_lens_q"]
    pack["cu_seq_lens_q"] = pack["cu_seq_lens_k"] = np.append(cu, np.int32(cu[-1] + padding))


def _default_threads() -> int:
    env = os.environ.get("STOKER_NORMALIZE_THREADS")
    if env:
        return max(1, int(env))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, cores or 1))


class BufferPool:
    """Output memory for :meth:`Batch.pixel_values` (``pool=``), reused across steps.

    Fresh memory costs a page fault and the kernel's zeroing per 4 KiB, as much as the
    lookup itself; a pooled buffer is written hot. A buffer is handed out again only once
    nothing views it any more (no array, no torch tensor made from it), so keeping a batch's
    pixels alive across steps is safe: the pool then allocates. It keeps at most ``slots``
    buffers, each grown to the largest batch it served.

    An asynchronous copy out of a buffer (``non_blocking=True``) still reads it after every
    view is gone: :meth:`keep_until` holds the buffer until an event says the copy is done
    (``stoker.torch.pixels_to_device`` does this).

    Args:
        slots: buffers kept (2 covers a step in flight plus the next batch being prepared).
        pin_memory: page-locked memory (torch with CUDA), so a copy to the GPU runs at full
            speed and asynchronously.
    """

    def __init__(self, slots: int = 2, pin_memory: bool = False) -> None:
        if slots < 1:
            raise ConfigError(f"BufferPool slots {slots}: at least 1")
        self.slots = slots
        self.pin_memory = pin_memory
        self._buffers: List[_PooledBuffer] = []
        self.allocations = 0
        self.reuses = 0

    def take(self, shape: Sequence[int], dtype: Any) -> np.ndarray:
        """A C-contiguous array of ``shape`` and ``dtype`` over a free pooled buffer."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        free = [b for b in self._buffers if not b.in_use()]
        fits = [b for b in free if b.flat.nbytes >= nbytes]
        if fits:
            self.reuses += 1
            buf = fits[0]
        else:
            buf = _PooledBuffer(nbytes, self.pin_memory)
            self.allocations += 1
            if free:  # replace a free one that is too small
                self._buffers[self._buffers.index(free[0])] = buf
            elif len(self._buffers) < self.slots:
                self._buffers.append(buf)
        buf.pending = None
        return buf.flat[:nbytes].view(dtype).reshape(shape)

    def keep_until(self, array: np.ndarray, event: Any) -> None:
        """Hold the pooled buffer under ``array`` until ``event.query()`` is true (a
        ``torch.cuda.Event`` recorded after a copy out of it was enqueued)."""
        owner = array if array.base is None else array.base
        for buf in self._buffers:
            if buf.owner is owner:
                buf.pending = event
                return
        # Not pooled (all slots were busy): its memory lives as long as the copy holds it.


class _PooledBuffer:
    """One pooled allocation: ``owner`` holds the memory; every view made from ``flat`` (and
    every torch tensor made from such a view) holds a reference to it, so its reference count
    says whether anything still uses it."""

    def __init__(self, nbytes: int, pin_memory: bool) -> None:
        if pin_memory:
            import torch

            self.owner: Any = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
            self.flat = self.owner.numpy()
        else:
            self.owner = np.empty(max(nbytes, 1), dtype=np.uint8)
            self.flat = self.owner
        # An asynchronous reader (a copy to a device) not known to be done yet.
        self.pending: Any = None
        self._idle_refs = self._refs()

    def _refs(self) -> int:
        return sys.getrefcount(self.owner)

    def in_use(self) -> bool:
        if self.pending is not None:
            if not self.pending.query():
                return True
            self.pending = None
        return self._refs() > self._idle_refs


class _HostOutput:
    """Where a host-side pass writes: the caller's ``out`` or ``pool``, else the loader's
    pool (``fallback``), else new memory."""

    def __init__(
        self,
        out: Any,
        pool: Optional[BufferPool],
        threads: Optional[int],
        fallback: Optional[BufferPool] = None,
    ) -> None:
        if out is not None and pool is not None:
            raise ConfigError("pixel_values: give out= or pool=, not both")
        self.out = out
        self.pool = pool
        self.fallback = fallback
        self.threads = _default_threads() if threads is None else max(1, int(threads))

    @property
    def given(self) -> bool:
        """Whether the caller named the memory (else views need no copy)."""
        return self.out is not None or self.pool is not None

    def array(self, shape: Tuple[int, ...], dtype: str) -> np.ndarray:
        want = np.dtype(np.float32) if dtype == "float32" else _numpy_dtype("bfloat16")
        if self.out is None:
            pool = self.pool or self.fallback
            return pool.take(shape, want) if pool is not None else np.empty(shape, want)
        out = self.out
        if type(out).__module__.startswith("torch"):
            out = _torch_as_numpy(out)
        fits = {want, np.dtype(np.uint16), np.dtype(np.int16)} if dtype == "bfloat16" else {want}
        if not isinstance(out, np.ndarray) or out.shape != tuple(shape) or out.dtype not in fits \
                or not out.flags.c_contiguous or not out.flags.writeable:
            raise ConfigError(
                f"pixel_values out=: need a writable C-contiguous {dtype} array of shape "
                f"{tuple(shape)}, got {getattr(out, 'dtype', type(out).__name__)} "
                f"{getattr(out, 'shape', '')}"
            )
        return out


def _torch_as_numpy(t: Any) -> np.ndarray:
    import torch

    if t.device.type != "cpu":
        raise ConfigError(f"pixel_values out=: a host array, not a tensor on {t.device}")
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bits, rounded to nearest even (torch's and the worker's rule)."""
    bits = values.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return rounded.astype(np.uint16)


def _pixels_numpy(
    px: np.ndarray, lut: Optional[np.ndarray], wire: str, dtype: str, host: _HostOutput
) -> np.ndarray:
    if lut is not None:
        out = host.array(px.shape, dtype)
        if px.size:
            bf16 = dtype == "bfloat16"
            target = out.view(np.uint16) if bf16 else out
            _native.normalize_u8(px, px.shape[1], lut, target, bf16, host.threads)
        return out
    # Normalized on the worker: only converted (no copy unless asked for one).
    if wire == "bfloat16":
        bits = px.view(np.uint16)
        values = bits.view(_BF16) if _BF16 is not None else bits
        if dtype == "float32":
            values = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    else:
        values = px
        if dtype == "bfloat16":
            bits = _bf16_bits(np.ascontiguousarray(values, dtype=np.float32))
            values = bits.view(_BF16) if _BF16 is not None else bits
    if not host.given:
        return values
    out = host.array(px.shape, dtype)
    np.copyto(out.view(np.uint16) if dtype == "bfloat16" else out,
              values.view(np.uint16) if dtype == "bfloat16" else values)
    return out


def _pixels_torch(
    px: np.ndarray, lut: Optional[np.ndarray], wire: str, device: Any, dtype: str, host: _HostOutput
):
    import torch

    device = torch.device(device)
    want = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    if device.type == "cpu":
        values = _pixels_numpy(px, lut, wire, dtype, host)
        if dtype == "bfloat16":
            return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(values)
    if host.given:
        raise ConfigError(
            "pixel_values: out= and pool= are host memory; for a host pass and a copy use "
            "stoker.torch.pixels_to_device(batch, device, pool)"
        )
    if lut is not None:
        # int32 indices (half of int64's bytes; index_select takes them) built on the device:
        # only the u8 bytes cross.
        columns = px.shape[1]
        channel = (np.arange(columns, dtype=np.int32) // (columns // 3)) * np.int32(256)
        table = torch.from_numpy(lut).to(device).reshape(-1)
        index = torch.from_numpy(px).to(device).int()
        index += torch.from_numpy(channel).to(device)
        values = table.index_select(0, index.reshape(-1)).reshape(px.shape)
    elif wire == "bfloat16":
        values = torch.from_numpy(px.view(np.uint16)).view(torch.bfloat16).to(device)
    else:
        values = torch.from_numpy(px).to(device)
    return values.to(want)


def _batch(raw: Dict[str, Any], pool: Optional[BufferPool]) -> Batch:
    payload = raw["payload"]
    tensors: Dict[str, np.ndarray] = {}
    dtypes: Dict[str, str] = {}
    for name, dtype, shape, offset, nbytes in raw["tensors"]:
        dt = _numpy_dtype(dtype)
        count = nbytes // dt.itemsize
        # A view of the payload: frombuffer keeps the payload alive and copies nothing.
        arr = np.frombuffer(payload, dtype=dt, count=count, offset=offset)
        tensors[name] = arr.reshape(shape)
        dtypes[name] = dtype
    return Batch(
        epoch=raw["epoch"],
        global_batch=raw["global_batch"],
        sample_ids=raw["sample_ids"],
        skipped=raw["skipped"],
        tensors=tensors,
        dtypes=dtypes,
        worker=raw["worker"],
        payload=payload,
        pack_ranges=raw["packs"],
        pool=pool,
    )


class Loader:
    """Batches of one rank, in plan order, prefetched from Stoker workers.

    Args:
        workers: ``"dns:HOST:PORT"`` (re-resolved every 5 s: a Kubernetes headless Service
            lists every ready worker pod), or ``"HOST:PORT,HOST:PORT"``, or a list of those.
        rank, world_size: this process's data-parallel rank; default from ``RANK`` /
            ``WORLD_SIZE`` (torchrun sets them), else 0 / 1. Each process is its own model
            replica; with tensor, context, sequence or pipeline parallelism give the replica
            instead (``mesh`` or ``dp_rank``), see ``stoker.replica``.
        mesh, dp_dims: a ``torch.distributed.DeviceMesh`` with ``mesh_dim_names`` and the
            names of its data-parallel dimensions (``("dp",)``, ``("dp_replicate",
            "dp_shard")``): the data-parallel coordinate selects the slice, every other
            dimension spans one replica, whose ranks all get byte-identical batches.
        dp_rank, dp_size, replica_group: the same given plainly: this replica's slice and a
            process group holding its ranks (broadcasting host tensors: gloo); without a
            group each process is its own replica.
        replica_reads: ``"leader"``: the replica's lowest rank reads from the workers and
            broadcasts each batch to the others (over ``replica_group``, or a gloo group made
            from the mesh; only the leader serves metrics); ``"each"``: every rank reads the
            same slice itself (no collective; the workers prepare it once per rank).
        tls_ca: the CA bundle (PEM file) that signed the workers' certificates; default
            ``$STOKER_TLS_CA`` (on Kubernetes, the pipeline's CA Secret mounted in the trainer).
            Each worker must prove its name before the token is sent: the ``dns:`` name, else
            the host dialled, else ``tls_server_name``.
        tls_server_name: the name every worker's certificate must hold, whatever address is
            dialled.
        insecure_plaintext: dial workers run with ``--insecure-plaintext`` without TLS: the
            token travels in the clear and anything that listens at a worker's address can
            serve batches (docs/security.md). Without it and without a CA bundle, ``ConfigError``.
        token: the pipeline token; default ``$STOKER_TOKEN``, else none (workers run with
            ``--no-auth``).
        prefetch: batches kept requested ahead; ``None`` adapts to latency and your step
            time (up to ``max_prefetch``); ``0`` disables prefetching.
        hedge: re-request a straggler from another worker past the p95 latency, once it
            would otherwise be late for your step.
        no_worker_timeout_s: with no usable worker for this long, raise ``NoWorker``.
        request_timeout_s: a batch request unanswered for this long counts as a failed
            attempt and is asked again, elsewhere first (a stalled worker never holds a
            batch forever); after 5 attempts the batch raises ``BatchFailed``.
        metrics_port: serve Prometheus ``/metrics`` on this port (0 picks one, see
            ``metrics_addr``); labels ``pipeline`` and ``rank``.
        state: a ``state_dict()`` to resume from.
        pixel_buffers: buffers of the pool ``Batch.pixel_values()`` writes into on the host
            (:class:`BufferPool`: a buffer is reused only once nothing views it, so fresh
            memory's page faults are paid once); 0 allocates every time.
    """

    def __init__(
        self,
        workers: Union[str, Sequence[str]],
        *,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        mesh: Any = None,
        dp_dims: Optional[Sequence[str]] = None,
        dp_rank: Optional[int] = None,
        dp_size: Optional[int] = None,
        replica_group: Any = None,
        replica_reads: str = "leader",
        tls_ca: Optional[str] = None,
        tls_server_name: Optional[str] = None,
        insecure_plaintext: bool = False,
        token: Optional[str] = None,
        prefetch: Optional[int] = None,
        max_prefetch: int = 16,
        hedge: bool = True,
        metrics_port: Optional[int] = None,
        metrics_host: str = "0.0.0.0",
        pipeline: str = "default",
        no_worker_timeout_s: float = 60.0,
        request_timeout_s: float = 120.0,
        state: Optional[Dict[str, Any]] = None,
        pixel_buffers: int = 2,
    ) -> None:
        if not isinstance(workers, str):
            workers = ",".join(workers)
        self.replica = _replica(rank, world_size, mesh, dp_dims, dp_rank, dp_size, replica_group)
        if replica_reads not in replica_mod.REPLICA_READS:
            raise ConfigError(f"replica_reads {replica_reads!r}: one of {replica_mod.REPLICA_READS}")
        token = os.environ.get("STOKER_TOKEN", "") if token is None else token
        metrics_addr = None if metrics_port is None else f"{metrics_host}:{metrics_port}"
        channel = None
        if replica_reads == "leader" and len(self.replica.ranks) > 1:
            channel = replica_mod.Channel(replica_mod.broadcast_group(self.replica, replica_group), self.replica.leader)
            if _process_rank() != self.replica.leader:
                self._native = replica_mod.Follower(channel)
                self._finish_init(pixel_buffers)
                return
        native_args = (
            workers,
            self.replica.dp_rank,
            self.replica.dp_size,
            None if tls_ca is None else os.fspath(tls_ca),
            tls_server_name,
            insecure_plaintext,
            token,
            prefetch,
            max_prefetch,
            hedge,
            metrics_addr,
            pipeline,
            no_worker_timeout_s,
            request_timeout_s,
            None if state is None else _state_tuple(state),
        )
        if channel is None:
            self._native = _native.NativeLoader(*native_args)
        else:
            try:
                native = _native.NativeLoader(*native_args)
            except StokerError as e:
                replica_mod.Leader.failed(channel, e)
                raise
            self._native = replica_mod.Leader(native, channel)
        self._finish_init(pixel_buffers)

    def _finish_init(self, pixel_buffers: int) -> None:
        # rank / world_size: the data-parallel slice this process trains on.
        self.rank = self.replica.dp_rank
        self.world_size = self.replica.dp_size
        self._pixel_pool = BufferPool(pixel_buffers) if pixel_buffers else None

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return _batch(self._native.next_batch(), self._pixel_pool)

    def state_dict(self) -> Dict[str, Any]:
        """Where this loader is: (plan, epoch, next global batch). Small and JSON-safe."""
        plan_id, epoch, next_batch = self._native.state()
        return {
            "version": _STATE_VERSION,
            "plan_id": plan_id,
            "epoch": epoch,
            "next_batch": next_batch,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue exactly where ``state`` was taken (with any world size)."""
        self._native.load_state(*_state_tuple(state))

    @property
    def plan(self) -> Dict[str, Any]:
        return self._native.plan()

    def __len__(self) -> int:
        """Batches per epoch."""
        return self._native.plan()["batches_per_epoch"]

    def stats(self) -> Dict[str, float]:
        """wait_s, step_s, wait_ratio, batches, samples since the start."""
        return self._native.stats()

    @property
    def metrics_addr(self) -> Optional[str]:
        return self._native.metrics_addr()


def _process_rank() -> int:
    """This process's global rank: torch.distributed's once initialized, else ``RANK``."""
    if "torch" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def _replica(rank, world_size, mesh, dp_dims, dp_rank, dp_size, group) -> replica_mod.Replica:
    """This process's replica from whichever of the three ways it was given."""
    given = [name for name, v in (("rank/world_size", rank if rank is not None else world_size),
                                  ("mesh", mesh), ("dp_rank/dp_size", dp_rank if dp_rank is not None else dp_size))
             if v is not None]
    if len(given) > 1:
        raise ConfigError(f"give one of rank/world_size, mesh, dp_rank/dp_size, not {' and '.join(given)}")
    if mesh is not None:
        if not dp_dims:
            raise ConfigError(f"mesh= needs dp_dims=: which of {mesh.mesh_dim_names} are data-parallel")
        return replica_mod.replica_in_mesh(mesh.mesh.tolist(), mesh.mesh_dim_names, dp_dims, _process_rank())
    if dp_dims is not None:
        raise ConfigError("dp_dims= names dimensions of a mesh: give mesh= too")
    if dp_rank is not None or dp_size is not None:
        if dp_rank is None or dp_size is None:
            raise ConfigError("give dp_rank and dp_size together")
        return replica_mod.replica_of_group(dp_rank, dp_size, group, _process_rank())
    if group is not None:
        raise ConfigError("replica_group= goes with dp_rank= and dp_size=")
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    return replica_mod.Replica(rank, world_size, (_process_rank(),))


def _state_tuple(state: Dict[str, Any]) -> Tuple[int, int, int]:
    if state.get("version") != _STATE_VERSION:
        raise ValueError(f"unsupported stoker state version {state.get('version')!r}")
    return int(state["plan_id"]), int(state["epoch"]), int(state["next_batch"])
