"""PyTorch adapter: batches as torch tensors sharing memory with the received bytes.

    from stoker.torch import StokerIterableDataset
    ds = StokerIterableDataset("dns:workers.ns.svc:7700")
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)

Use ``batch_size=None`` (Stoker batches already) and ``num_workers=0`` (Stoker's workers do
the work; DataLoader worker processes would pickle every batch).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator

import torch

from . import Batch, Loader

__all__ = ["StokerIterableDataset", "to_torch"]


def to_torch(batch: Batch, device: Any = None, pixel_dtype: str = "float32") -> Dict[str, Any]:
    """The batch as model inputs: token tensors viewing the received memory (moved to
    ``device`` if given), ``pixel_values`` normalized as the Hugging Face processor does
    (``Batch.pixel_values``: with u8 on the wire, the lookup runs on ``device``), plus the
    batch's metadata; a packed batch adds ``packs``, one varlen forward's inputs each
    (``Batch.packs``)."""
    out: Dict[str, Any] = {}
    for name, arr in batch.tensors.items():
        if name in ("pixel_values", "pixel_lut"):
            continue
        t = torch.from_numpy(arr)
        out[name] = t if device is None else t.to(device)
    out["pixel_values"] = batch.pixel_values(device=device or "cpu", dtype=pixel_dtype)
    if batch.packed:
        out["packs"] = batch.packs(device=device or "cpu", pixel_dtype=pixel_dtype)
    out["sample_ids"] = batch.sample_ids
    out["epoch"] = batch.epoch
    out["global_batch"] = batch.global_batch
    return out


class StokerIterableDataset(torch.utils.data.IterableDataset):
    """One epoch per iteration, like a map-style dataset under a DataLoader.

    Rank and world size default to torch.distributed's when it is initialized."""

    def __init__(
        self, workers, device: Any = None, pixel_dtype: str = "float32", **loader_kwargs: Any
    ) -> None:
        super().__init__()
        self.device = device
        self.pixel_dtype = pixel_dtype
        if torch.distributed.is_available() and torch.distributed.is_initialized():
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
