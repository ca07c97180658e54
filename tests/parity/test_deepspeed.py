"""DeepSpeed ZeRO-3 fed by Stoker (examples/deepspeed_train.py), two processes on the CPU
(torchrun, gloo; tests/parity/deepspeed_run.py):

- the loader is not DeepSpeed's (no `training_data`): each rank's micro-batches are
  `stoker.Loader(rank=r)`'s, in order, across an epoch boundary;
- ZeRO-3 holds about half of each parameter on each of the two ranks;
- a run stopped after step 2 (its checkpoint, with the loader's state in `client_state`) and
  resumed trains the uninterrupted run's steps 3.. on the same samples to the same losses.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from served import TOKENIZER, required_module, serve, synth  # noqa: E402
from test_hf_trainer import loader_order  # noqa: E402

required_module("deepspeed")

RUN = Path(__file__).resolve().parent / "deepspeed_run.py"
SAMPLES, BATCH, STEPS = 16, 4, 6  # 4 batches per epoch: the run crosses an epoch boundary


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    dataset = synth(tmp_path_factory.mktemp("deepspeed") / "ds", SAMPLES, 8, 56, 200)
    proc, addr = serve(dataset, "--pixel-dtype", "u8", global_batch=BATCH)
    yield addr
    proc.kill()


def run(out: Path, addr: str, steps: int, *args: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(RUN),
           "--workers", addr, "--out", str(out), "--steps", str(steps), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STOKER_TOKENIZER": str(TOKENIZER), "DS_ACCELERATOR": "cpu"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    ranks = {}
    for rank in range(2):
        rows = (out / f"record-rank{rank}.jsonl").read_text().splitlines()
        ranks[rank] = {row["step"]: row for row in map(json.loads, rows)}
        ranks[rank]["engine"] = json.loads((out / f"engine-rank{rank}.json").read_text())
    return ranks


def test_zero3_trains_on_each_ranks_own_stream_and_resumes_from_its_checkpoint(worker, tmp_path, torch):
    whole = run(tmp_path / "whole", worker, STEPS)
    for rank in range(2):
        engine = whole[rank]["engine"]
        assert engine["stage"] == 3 and not engine["training_dataloader"]
        assert engine["held"] < 0.6 * engine["full"]  # the parameters are sharded over the two ranks
        got = [whole[rank][s]["sample_ids"] for s in range(1, STEPS + 1)]
        assert got == loader_order(worker, rank, 2, STEPS)
    # Stopped after step 2 (checkpointed there), then resumed from the checkpoint.
    out = tmp_path / "resumed"
    run(out, worker, 2)
    resumed = run(out, worker, STEPS, "--resume")
    for rank in range(2):
        for step in range(3, STEPS + 1):
            assert resumed[rank][step]["sample_ids"] == whole[rank][step]["sample_ids"], (rank, step)
            assert resumed[rank][step]["loss"] == pytest.approx(whole[rank][step]["loss"], rel=1e-5), (rank, step)
    assert whole[0][STEPS]["loss"] != whole[0][1]["loss"]  # it trains


def test_the_docs_code_is_the_example():
    """docs/client.md's "DeepSpeed" shows examples/deepspeed_train.py's `train`, line for line."""
    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs/client.md").read_text().split("### DeepSpeed", 1)[1]
    code = doc.split("```python", 1)[1].split("```", 1)[0]
    shown = [ln.strip() for ln in code.splitlines() if ln.strip()]
    example = (root / "examples/deepspeed_train.py").read_text()
    body = [ln.strip() for ln in example.split("\ndef train(", 1)[1].split("\ndef ", 1)[0].splitlines()]
    assert len(shown) >= 5 and all(ln in body for ln in shown), [ln for ln in shown if ln not in body]
