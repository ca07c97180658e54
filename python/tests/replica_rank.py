"""One rank of a model-parallel trainer, run by test_replica.py as one of several processes
(gloo on one machine): reads with a DeviceMesh-aware loader and writes what it got as JSON.

    python replica_rank.py '{"addr": ..., "shape": [2, 2], "names": ["dp", "cp"],
                             "dp_dims": ["dp"], "reads": "leader", "state": null,
                             "batches": null, "out": "r{rank}.json"}'
"""

import hashlib
import json
import os
import sys

import numpy as np
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import stoker


# Packs padded for cp=2, as a context-parallel trainer asks for them.
PAD_TO = 4


def digest(batch: stoker.Batch, pad_to_multiple_of) -> str:
    h = hashlib.sha256()
    for name in sorted(batch.tensors):
        h.update(name.encode())
        h.update(np.ascontiguousarray(batch.tensors[name]).tobytes())
    if batch.packed:
        for pack in batch.packs(pad_to_multiple_of=pad_to_multiple_of, shift_labels=True):
            for name in sorted(pack):
                h.update(name.encode())
                h.update(np.ascontiguousarray(pack[name]).tobytes() if isinstance(pack[name], np.ndarray) else repr(pack[name]).encode())
    return h.hexdigest()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", tuple(cfg["shape"]), mesh_dim_names=tuple(cfg["names"]))
    loader = stoker.Loader(cfg["addr"], mesh=mesh, dp_dims=tuple(cfg["dp_dims"]),
                           replica_reads=cfg["reads"], state=cfg.get("state"))
    got = []
    for batch in loader:
        got.append({"epoch": batch.epoch, "global_batch": batch.global_batch,
                    "sample_ids": batch.sample_ids, "digest": digest(batch, PAD_TO)})
        if cfg.get("batches") and len(got) == cfg["batches"]:
            break
    state = loader.state_dict()
    # A state of another plan: the leader's refusal is every rank's.
    try:
        loader.load_state_dict({**state, "plan_id": state["plan_id"] ^ 1})
        refused = None
    except stoker.StokerError as e:
        refused = type(e).__name__
    with open(cfg["out"].format(rank=rank), "w") as f:
        json.dump({"rank": rank, "dp_rank": loader.rank, "dp_size": loader.world_size,
                   "replica": list(loader.replica.ranks), "batches": got, "state": state,
                   "refused": refused, "stats": loader.stats(), "metrics_addr": loader.metrics_addr}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    main()
