"""One rank of a Megatron-Core job (gloo, CPU), run by test_megatron.py as one of several
processes: Megatron's parallel state, stoker.megatron's provider, what this rank got as JSON.

    python megatron_rank.py '{"addr": ..., "tp": 2, "pp": 1, "cp": 2, "micro_batches": 4,
                              "save_at": 2, "state": null, "out": "r{rank}.json"}'
"""

import hashlib
import json
import os
import sys
import warnings

import torch.distributed as dist

warnings.filterwarnings("ignore", module="megatron")  # no Transformer Engine or Apex on CPU
from megatron.core import parallel_state  # noqa: E402
from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: E402

import stoker.megatron  # noqa: E402


def digest(micro_batch) -> str:
    h = hashlib.sha256()
    for name in sorted(micro_batch):
        h.update(name.encode())
        h.update(micro_batch[name].contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg["tp"], pipeline_model_parallel_size=cfg["pp"],
        context_parallel_size=cfg["cp"],
    )
    provider = stoker.megatron.dataloaders_provider(cfg["addr"])
    train, valid, test = provider([0, 0, 0])
    out = {"rank": dist.get_rank(), "tp": parallel_state.get_tensor_model_parallel_rank(),
           "cp": parallel_state.get_context_parallel_rank(), "dp": parallel_state.get_data_parallel_rank(),
           "reads": train is not None, "others": [valid, test], "micro_batches": []}
    if train is not None:
        if cfg.get("state"):
            train.restore_state(cfg["state"])
        for i in range(cfg["micro_batches"]):
            if i == cfg.get("save_at"):
                out["state"] = train.save_state()
            mb = next(train)
            # Megatron's own context-parallel split of the sequence.
            text = {k: mb[k].clone() for k in ("tokens", "labels", "loss_mask", "position_ids")}
            mine = get_batch_on_this_cp_rank(text)
            out["micro_batches"].append({"digest": digest(mb), "tokens": mb["tokens"].tolist(),
                                         "cp_tokens": mine["tokens"].tolist()})
    with open(cfg["out"].format(rank=dist.get_rank()), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    main()
