"""PyTorch adapter: batches as torch tensors sharing memory with the received bytes.

    from stoker.torch import StokerIterableDataset
    ds = StokerIterableDataset("dns:workers.ns.svc:7700")
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)

Use ``batch_size=None`` (Stoker batches already) and ``num_workers=0`` (Stoker's workers do
the work; DataLoader worker processes would pickle every batch).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Optional

import numpy as np
import torch

from . import Batch, BufferPool, ConfigError, Loader

__all__ = ["StokerIterableDataset", "model_inputs", "pinned_pool", "pixels_to_device", "to_torch"]

# Tensors a plain (unpacked) batch hands to a Qwen-VL model's forward as they are.
_MODEL_TENSORS = ("input_ids", "attention_mask", "labels", "image_grid_thw", "video_grid_thw",
                  "second_per_grid_ts")


def model_inputs(
    batch: Batch,
    device: Any = None,
    *,
    image_token_id: int,
    video_token_id: Optional[int] = None,
    pixel_dtype: str = "float32",
    pool: Optional[BufferPool] = None,
) -> Dict[str, Any]:
    """A plain batch as the keyword arguments of one forward pass: ``model(**inputs)``.

    ``input_ids``, ``attention_mask``, ``labels`` and ``image_grid_thw`` view the received
    memory (moved to ``device``), ``pixel_values`` are normalized as the processor does (on
    ``device``, see :meth:`stoker.Batch.pixel_values`), and ``mm_token_type_ids`` marks the
    image tokens as the processor marks them (1, video tokens 2; 0 for text), which
    transformers' Qwen-VL models need to place the multimodal rope. ``image_token_id`` is
    ``model.config.image_token_id`` (``video_token_id``, ``model.config.video_token_id``, is
    needed for batches holding a video: they add ``pixel_values_videos``, normalized on
    ``device`` too, ``video_grid_thw`` and, for Qwen2.5-VL, ``second_per_grid_ts``). A packed
    batch: use ``batch.packs(device)``.
    """
    if batch.packed:
        raise ConfigError("a packed batch: give model(**pack) for each pack in batch.packs(device)")
    out: Dict[str, Any] = {}
    for name in _MODEL_TENSORS:
        if name in batch.tensors:
            t = torch.from_numpy(batch.tensors[name])
            out[name] = t if device is None else t.to(device)
    kinds = (out["input_ids"] == image_token_id).int()
    if "pixel_values_videos" in batch.tensors:
        if video_token_id is None:
            raise ConfigError("the batch holds a video: give video_token_id=model.config.video_token_id")
        kinds = kinds + 2 * (out["input_ids"] == video_token_id).int()
        out["pixel_values_videos"] = batch.pixel_values_videos(device=device or "cpu", dtype=pixel_dtype)
    out["mm_token_type_ids"] = kinds
    if "pixel_values" in batch.tensors and batch.tensors["pixel_values"].shape[0]:
        out["pixel_values"] = batch.pixel_values(device=device or "cpu", dtype=pixel_dtype, pool=pool)
    else:
        out.pop("image_grid_thw", None)  # no image: the vision tower sees none
    return out


def pinned_pool(slots: int = 2) -> BufferPool:
    """A :class:`stoker.BufferPool` of page-locked memory, for :func:`pixels_to_device`."""
    return BufferPool(slots=slots, pin_memory=True)


def pixels_to_device(
    batch: Batch, device: Any, pool: BufferPool, pixel_dtype: str = "float32"
) -> torch.Tensor:
    """``pixel_values`` normalized on the host (one native pass) into ``pool``'s memory
    (pinned: :func:`pinned_pool`), then copied to ``device`` asynchronously on the current
    stream; the pool reuses that memory only once the copy is done. The alternative to the
    lookup on the device (``batch.pixel_values(device=...)``) when the device should get
    model-ready values without running a kernel."""
    host = batch.pixel_values(dtype=pixel_dtype, pool=pool)
    t = torch.from_numpy(host.view(np.int16)).view(torch.bfloat16) if pixel_dtype == "bfloat16" \
        else torch.from_numpy(host)
    on_device = t.to(device, non_blocking=True)
    if on_device.device.type == "cuda":
        done = torch.cuda.Event()
        done.record()
        pool.keep_until(host, done)
    return on_device


def to_torch(
    batch: Batch, device: Any = None, pixel_dtype: str = "float32", pool: Optional[BufferPool] = None
) -> Dict[str, Any]:
    """The batch as torch tensors: every tensor viewing the received memory (moved to
    ``device`` if given), ``pixel_values`` normalized as the Hugging Face processor does
    (``Batch.pixel_values``: with u8 on the wire, the lookup runs on ``device``; on the CPU
    into ``pool`` if given), plus the batch's metadata; a packed batch adds ``packs``, one
    varlen forward's inputs each (``Batch.packs``). For ``model(**...)``: :func:`model_inputs`."""
    out: Dict[str, Any] = {}
    for name, arr in batch.tensors.items():
        if name in ("pixel_values", "pixel_lut", "pixel_values_videos", "pixel_lut_videos"):
            continue
        t = torch.from_numpy(arr)
        out[name] = t if device is None else t.to(device)
    out["pixel_values"] = batch.pixel_values(device=device or "cpu", dtype=pixel_dtype, pool=pool)
    if "pixel_values_videos" in batch.tensors:
        out["pixel_values_videos"] = batch.pixel_values_videos(device=device or "cpu", dtype=pixel_dtype)
    if batch.packed:
        out["packs"] = batch.packs(device=device or "cpu", pixel_dtype=pixel_dtype)
    out["sample_ids"] = batch.sample_ids
    out["epoch"] = batch.epoch
    out["global_batch"] = batch.global_batch
    return out


class StokerIterableDataset(torch.utils.data.IterableDataset):
    """One epoch per iteration, like a map-style dataset under a DataLoader.

    Rank and world size default to torch.distributed's when it is initialized (and no
    replica is given: ``mesh=`` or ``dp_rank=``, see :class:`stoker.Loader`)."""

    def __init__(
        self, workers, device: Any = None, pixel_dtype: str = "float32", **loader_kwargs: Any
    ) -> None:
        super().__init__()
        self.device = device
        self.pixel_dtype = pixel_dtype
        replica_given = any(loader_kwargs.get(k) is not None for k in ("mesh", "dp_rank"))
        if torch.distributed.is_available() and torch.distributed.is_initialized() and not replica_given:
            loader_kwargs.setdefault("rank", torch.distributed.get_rank())
            loader_kwargs.setdefault("world_size", torch.distributed.get_world_size())
        self.loader = Loader(workers, **loader_kwargs)

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        for batch in self.loader:
            yield to_torch(batch, self.device, self.pixel_dtype)

    def state_dict(self) -> Dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
