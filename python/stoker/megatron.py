"""Megatron-LM's training loop fed by Stoker (``--dataloader-type external``).

    import stoker.megatron
    provider = stoker.megatron.dataloaders_provider(workers)
    pretrain(provider, model_provider, ModelType.encoder_or_decoder, forward_step, ...)

Megatron reads data on tensor-parallel rank 0 of the first and last pipeline stages (the first
embeds tokens and images, the last computes the loss) and broadcasts it to the other
tensor-parallel ranks itself; every context-parallel rank reads the whole sequence and keeps
its chunks (``get_batch_on_this_cp_rank``). The provider follows that contract: on those ranks
it returns a :class:`MegatronIterator` over the data-parallel slice
(``parallel_state.get_data_parallel_rank()``), whose readers of one slice form one replica (its
lowest rank reads from the workers and broadcasts, see ``stoker.replica``); elsewhere
``(None, None, None)``. Every rank calls it (``provider.is_distributed``).

Each micro-batch is Megatron's layout, as torch tensors on the host: ``tokens``, ``labels``
(already shifted: token t predicts label t, a valid id where nothing is learnt), ``loss_mask``
(float, 0 where nothing is learnt), ``position_ids``, and the images' ``pixel_values`` and
``image_grid_thw``. A plain Stoker batch is one micro-batch (its sequence padded to a multiple
of 2 x cp); a packed one gives one micro-batch per pack in THD form (micro-batch size 1), each
sample padded to a multiple of 2 x cp as Transformer Engine's context parallelism needs, with
``cu_seqlens``, ``cu_seqlens_padded`` and ``max_seqlen``; :func:`packed_seq_params` makes
Megatron-Core's ``PackedSeqParams`` from them. ``save_state()`` / ``restore_state()`` name the
micro-batch, so a checkpoint taken inside a packed batch resumes at its next pack.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from . import PAD_TOKEN_ID, Batch, ConfigError, Loader, shifted_labels

__all__ = ["MegatronIterator", "dataloaders_provider", "is_dataloader_rank", "packed_seq_params"]

_STATE_VERSION = 1


def is_dataloader_rank(parallel_state: Any) -> bool:
    """Megatron's rule for where data is read: tensor-parallel rank 0 of the first and the last
    pipeline stage."""
    first_or_last = parallel_state.is_pipeline_first_stage(ignore_virtual=True) or \
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    return parallel_state.get_tensor_model_parallel_rank() == 0 and first_or_last


def dataloaders_provider(workers: Any, *, pixel_dtype: str = "float32", **loader_kwargs: Any) -> Callable:
    """A ``train_valid_test_datasets_provider`` for ``pretrain`` with
    ``--dataloader-type external``: ``provider(train_val_test_num_samples)`` returns
    ``(train_iterator, None, None)`` on the ranks that read (:func:`is_dataloader_rank`), else
    ``(None, None, None)``. ``loader_kwargs`` go to :class:`stoker.Loader` (not the rank:
    Megatron's parallel state gives it)."""
    for taken in ("rank", "world_size", "mesh", "dp_dims", "dp_rank", "dp_size", "replica_group"):
        if taken in loader_kwargs:
            raise ConfigError(f"dataloaders_provider: {taken}= comes from Megatron's parallel state")

    def provider(train_val_test_num_samples: Any = None) -> Tuple[Optional["MegatronIterator"], None, None]:
        import torch.distributed as dist
        from megatron.core import parallel_state

        reads = is_dataloader_rank(parallel_state)
        dp_rank = parallel_state.get_data_parallel_rank()
        everyone: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (dp_rank, reads))
        if not reads:
            return None, None, None
        readers = [r for r, (d, r_reads) in enumerate(everyone) if r_reads and d == dp_rank]
        group = None
        if len(readers) > 1:
            group = dist.new_group(readers, backend="gloo", use_local_synchronization=True)
        loader = Loader(workers, dp_rank=dp_rank, dp_size=parallel_state.get_data_parallel_world_size(),
                        replica_group=group, **loader_kwargs)
        cp = parallel_state.get_context_parallel_world_size()
        return MegatronIterator(loader, context_parallel_size=cp, pixel_dtype=pixel_dtype), None, None

    provider.is_distributed = True
    return provider


class MegatronIterator:
    """Megatron micro-batches from a :class:`stoker.Loader`, epoch after epoch (Megatron's
    cyclic iterator): a plain batch is one micro-batch, a packed batch one per pack."""

    def __init__(
        self,
        loader: Loader,
        *,
        context_parallel_size: int = 1,
        pixel_dtype: str = "float32",
        pad_token_id: int = PAD_TOKEN_ID,
    ) -> None:
        if context_parallel_size < 1:
            raise ConfigError(f"context_parallel_size {context_parallel_size}: at least 1")
        self.loader = loader
        self._multiple = 2 * context_parallel_size if context_parallel_size > 1 else 1
        self._pixel_dtype = pixel_dtype
        self._pad = pad_token_id
        self._pending: List[Dict[str, Any]] = []
        # The loader's position before the batch being handed out, and its micro-batches taken.
        self._at: Dict[str, Any] = loader.state_dict()
        self._taken = 0
        self._skip = 0

    def __iter__(self) -> "MegatronIterator":
        return self

    def __next__(self) -> Dict[str, Any]:
        while not self._pending:
            self._at = self.loader.state_dict()
            try:
                batch = next(self.loader)
            except StopIteration:
                batch = next(self.loader)  # the next epoch (Megatron's iterators never end)
            self._pending = self.micro_batches(batch)[self._skip:]
            self._taken = self._skip
            self._skip = 0
        self._taken += 1
        return self._pending.pop(0)

    def save_state(self) -> Dict[str, Any]:
        """Where the next micro-batch is: the Stoker batch and the micro-batches of it taken
        (small, JSON-safe; the same on every reading rank of a slice, any world size)."""
        if not self._pending:
            return {"version": _STATE_VERSION, "loader": self.loader.state_dict(), "micro_batches": self._skip}
        return {"version": _STATE_VERSION, "loader": self._at, "micro_batches": self._taken}

    def restore_state(self, state: Dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ConfigError(f"unsupported stoker.megatron state version {state.get('version')!r}")
        self.loader.load_state_dict(state["loader"])
        self._pending = []
        self._skip = int(state["micro_batches"])

    def micro_batches(self, batch: Batch) -> List[Dict[str, Any]]:
        if batch.packed:
            return [self._thd(pack) for pack in batch.packs(device="cpu", pixel_dtype=self._pixel_dtype)]
        return [self._plain(batch)]

    def _plain(self, batch: Batch) -> Dict[str, Any]:
        ids = batch["input_ids"]
        rows, width = ids.shape
        padded = width + (-width % self._multiple)
        tokens = np.full((rows, padded), self._pad, dtype=np.int64)
        tokens[:, :width] = ids
        labels = np.full((rows, padded), -100, dtype=np.int64)
        labels[:, :width] = batch["labels"]
        out = self._targets(tokens, shifted_labels(labels))
        out["position_ids"] = torch.arange(padded, dtype=torch.int64).expand(rows, padded).contiguous()
        out["pixel_values"] = batch.pixel_values(device="cpu", dtype=self._pixel_dtype)
        out["image_grid_thw"] = torch.from_numpy(np.array(batch["image_grid_thw"]))
        return out

    def _thd(self, pack: Dict[str, Any]) -> Dict[str, Any]:
        bounds = pack["cu_seq_lens_q"].tolist()
        lengths = np.diff(bounds)
        padded = lengths + (-lengths % self._multiple)
        starts = np.concatenate([[0], np.cumsum(padded)]).astype(np.int64)
        total = int(starts[-1])
        tokens = np.full((1, total), self._pad, dtype=np.int64)
        labels = np.full((1, total), -100, dtype=np.int64)
        positions = np.zeros((1, total), dtype=np.int64)
        ids = pack["input_ids"].numpy()[0]
        # Shifted within the pack before the samples are spread out: a sample's first label
        # is -100, so each sample's last token learns nothing from the next.
        shifted = shifted_labels(pack["labels"].numpy())[0]
        for (lo, hi), start, span in zip(zip(bounds, bounds[1:]), starts, padded):
            n = hi - lo
            tokens[0, start : start + n] = ids[lo:hi]
            labels[0, start : start + n] = shifted[lo:hi]
            positions[0, start : start + span] = np.arange(span)
        out = self._targets(tokens, labels)
        out["position_ids"] = torch.from_numpy(positions)
        out["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32)
        out["cu_seqlens_padded"] = torch.from_numpy(starts.astype(np.int32))
        out["max_seqlen"] = torch.tensor([int(padded.max()) if len(padded) else 0], dtype=torch.int32)
        out["pixel_values"] = pack["pixel_values"]
        out["image_grid_thw"] = pack["image_grid_thw"]
        return out

    def _targets(self, tokens: np.ndarray, target: np.ndarray) -> Dict[str, Any]:
        """tokens, labels as Megatron reads them from shifted labels ``target`` (token t
        predicts label t; a valid id where the loss mask is 0, since Megatron's cross-entropy
        indexes every label), loss_mask."""
        mask = target != -100
        return {
            "tokens": torch.from_numpy(tokens),
            "labels": torch.from_numpy(np.where(mask, target, self._pad)),
            "loss_mask": torch.from_numpy(mask.astype(np.float32)),
        }


def packed_seq_params(micro_batch: Dict[str, Any]) -> Any:
    """Megatron-Core's ``PackedSeqParams`` (THD) for a packed micro-batch."""
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = int(micro_batch["max_seqlen"][0])
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=micro_batch["cu_seqlens"],
        cu_seqlens_kv=micro_batch["cu_seqlens"],
        cu_seqlens_q_padded=micro_batch["cu_seqlens_padded"],
        cu_seqlens_kv_padded=micro_batch["cu_seqlens_padded"],
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
