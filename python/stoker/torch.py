"""PyTorch adapter: batches as torch tensors sharing memory with the received bytes.

    from stoker.torch import StokerIterableDataset
    ds = StokerIterableDataset("dns:workers.ns.svc:7700")
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)

Use ``batch_size=None`` (Stoker batches already) and ``num_workers=0`` (Stoker's workers do
the work; DataLoader worker processes would pickle every batch).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator

import numpy as np
import torch

from . import Batch, Loader

__all__ = ["StokerIterableDataset", "to_torch"]


def to_torch(batch: Batch) -> Dict[str, Any]:
    """The batch's tensors as torch tensors viewing the same memory, plus its metadata."""
    out: Dict[str, Any] = {}
    for name, arr in batch.tensors.items():
        t = torch.from_numpy(arr)
        if batch.dtypes[name] == "bfloat16" and arr.dtype == np.uint16:
            t = t.view(torch.bfloat16)
        out[name] = t
    out["sample_ids"] = batch.sample_ids
    out["epoch"] = batch.epoch
    out["global_batch"] = batch.global_batch
    return out


class StokerIterableDataset(torch.utils.data.IterableDataset):
    """One epoch per iteration, like a map-style dataset under a DataLoader.

    Rank and world size default to torch.distributed's when it is initialized."""

    def __init__(self, workers, **loader_kwargs: Any) -> None:
        super().__init__()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            loader_kwargs.setdefault("rank", torch.distributed.get_rank())
            loader_kwargs.setdefault("world_size", torch.distributed.get_world_size())
        self.loader = Loader(workers, **loader_kwargs)

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        for batch in self.loader:
            yield to_torch(batch)

    def state_dict(self) -> Dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
