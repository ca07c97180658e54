"""One rank of a Stoker-fed DeepSpeed ZeRO-3 run (examples/deepspeed_train.py's `train`, started
under torchrun by tests/parity/test_deepspeed.py on the CPU): the tiny Qwen2-VL of
benches/train_step.py, AdamW, one JSON line per optimizer step to OUT/record-rank{r}.jsonl (its
sample ids and this rank's loss) and, at the end, what the engine was given and how it holds
the parameters (OUT/engine-rank{r}.json)."""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benches"))
sys.path.insert(0, str(ROOT / "examples"))
import deepspeed  # noqa: E402
import deepspeed_train  # noqa: E402
from train_step import new_model  # noqa: E402

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,  # Stoker's global batch (4) over 2 ranks
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3},
    "zero_allow_untested_optimizer": True,  # torch's AdamW: DeepSpeed's own needs a CPU build
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    model, optimizer = new_model("tiny", torch.device("cpu"))
    full = {name: p.numel() for name, p in model.named_parameters()}

    def record(step, batch, loss):
        with open(a.out / f"record-rank{rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "sample_ids": batch.sample_ids, "loss": float(loss.detach())}) + "\n")

    engine = deepspeed_train.train(a.workers, model, optimizer, CONFIG, a.steps, str(a.out / "ckpt"), 2,
                                   resume=a.resume, on_step=record)
    held = {name: p.ds_tensor.numel() for name, p in engine.module.named_parameters()}
    (a.out / f"engine-rank{rank}.json").write_text(json.dumps({
        "stage": engine.zero_optimization_stage(), "training_dataloader": engine.training_dataloader is not None,
        "full": sum(full.values()), "held": sum(held.values()),
    }))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
