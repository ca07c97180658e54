"""The Hugging Face Trainer fed by Stoker (`stoker.hf.StokerTrainer`, examples/hf_trainer.py),
two and three processes on the CPU (torchrun, gloo), a tiny Qwen2-VL trained from the same
weights as the README's loop (tests/parity/hf_trainer_run.py).

- Each rank's micro-batches are `stoker.Loader(rank=r)`'s, in order: every rank its own stream.
- The loss of every step equals the README loop's on the same global batches (float32, relative
  1e-5; DDP averages the ranks' gradients, the Trainer normalises by the step's label tokens
  on every rank, so two ranks train as one process on the whole batch).
- A run killed after step 3 (its last checkpoint at step 2) and resumed from that checkpoint
  trains the uninterrupted run's steps 3.. on the same sample ids to the same losses; resumed
  on three processes it keeps the global batch sequence.
- A Trainer subclass built by other code (a stand-in for LLaMA-Factory's CustomSeq2SeqTrainer)
  and attached (`stoker.hf.attach`, examples/hf_trainer.py's `train_existing`) is fed, saves and
  resumes the same way.
- Packed batches under gradient accumulation (2 batches per step) train to the README loop's
  token-normalised loss, within the same relative 1e-5 (measured here: 8e-8 at most; the
  forwards run pack by pack on each rank and their losses are summed in another order).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stoker  # noqa: E402
from served import TOKENIZER, serve, synth  # noqa: E402

RUN = Path(__file__).resolve().parent / "hf_trainer_run.py"
SAMPLES, BATCH, STEPS = 16, 4, 6  # 4 batches per epoch: the run crosses an epoch boundary


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return synth(tmp_path_factory.mktemp("hf-trainer") / "ds", SAMPLES, 8, 56, 200, lengths=True)


@pytest.fixture(scope="module")
def workers(dataset):
    """(plain worker address, packing worker address): u8 pixels, as the README's loop reads."""
    plain, plain_addr = serve(dataset, "--pixel-dtype", "u8", global_batch=BATCH)
    packed, packed_addr = serve(dataset, "--pixel-dtype", "u8", "--pack-max-tokens", "2048",
                                global_batch=BATCH)
    yield plain_addr, packed_addr
    plain.kill()
    packed.kill()


def run(out: Path, addr: str, procs: int, *args: str, killed: bool = False) -> dict:
    """One run (`procs` ranks under torchrun, or 0: the README's loop); each rank's records by
    step."""
    if procs:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(procs), str(RUN)]
    else:
        cmd = [sys.executable, str(RUN), "--readme"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STOKER_TOKENIZER": str(TOKENIZER)}
    r = subprocess.run([*cmd, "--workers", addr, "--out", str(out), *args],
                       capture_output=True, text=True, env=env, timeout=600)
    assert (r.returncode != 0) == killed, r.stderr[-4000:]
    ranks = {}
    for path in sorted(out.glob("record-rank*.jsonl")):
        rank = int(path.stem.removeprefix("record-rank"))
        ranks[rank] = {row["step"]: row for row in map(json.loads, path.read_text().splitlines())}
    return ranks


def loader_order(addr: str, rank: int, world: int, batches: int) -> list:
    """The sample ids of `stoker.Loader(rank=r)`'s first batches, epoch after epoch."""
    loader = stoker.Loader(addr, rank=rank, world_size=world, prefetch=2)
    order = []
    while len(order) < batches:
        order += [b.sample_ids for b in loader]
    return order[:batches]


def global_batches(ranks: dict) -> dict:
    """Each step's samples over every rank."""
    steps = ranks[0].keys()
    return {s: sorted(i for r in ranks.values() for mb in r[s]["sample_ids"] for i in mb) for s in steps}


def losses(ranks: dict) -> dict:
    return {s: row["loss"] for s, row in ranks[0].items()}


def test_each_rank_its_own_stream_to_the_readme_loops_loss_and_an_exact_resume(workers, tmp_path, torch):
    addr = workers[0]
    full = run(tmp_path / "full", addr, 2, "--steps", str(STEPS))
    readme = run(tmp_path / "readme", addr, 0, "--steps", str(STEPS))
    assert sorted(full) == [0, 1] and all(sorted(r) == list(range(1, STEPS + 1)) for r in full.values())

    # Every rank its own stream: rank r's micro-batches are stoker.Loader(rank=r)'s.
    for rank, rows in full.items():
        want = loader_order(addr, rank, 2, STEPS)
        assert [rows[s]["sample_ids"] for s in sorted(rows)] == [[ids] for ids in want], f"rank {rank}"
    # Two ranks train as the README's loop does on the whole batch.
    assert global_batches(full) == global_batches(readme)
    for step, loss in losses(readme).items():
        assert losses(full)[step] == pytest.approx(loss, rel=1e-5), f"step {step}"

    # Killed after step 3; its last checkpoint is step 2's.
    killed = run(tmp_path / "killed", addr, 2, "--steps", str(STEPS), "--kill-at", "3", killed=True)
    assert sorted(killed[0]) == [1, 2, 3]
    ckpt = tmp_path / "killed/ckpt/checkpoint-2"
    assert sorted(p.name for p in ckpt.glob("stoker_state_rank*.json")) == [
        "stoker_state_rank0.json", "stoker_state_rank1.json"]
    state = json.loads((ckpt / "stoker_state_rank0.json").read_text())
    assert (state["epoch"], state["next_batch"]) == (0, 2)

    for procs in (2, 3):
        out = tmp_path / f"resumed-{procs}"
        resumed = run(out, addr, procs, "--steps", str(STEPS), "--resume", str(ckpt))
        assert sorted(resumed[0]) == list(range(3, STEPS + 1)), f"{procs} ranks"
        want = {s: b for s, b in global_batches(full).items() if s >= 3}
        assert global_batches(resumed) == want, f"{procs} ranks: the global batch sequence"
        if procs == 2:
            assert all(resumed[r][s]["sample_ids"] == full[r][s]["sample_ids"] for r in (0, 1) for s in want)
        for step in want:
            assert losses(resumed)[step] == pytest.approx(losses(full)[step], rel=1e-5), f"{procs} ranks, step {step}"


def test_an_existing_trainer_subclass_attached_trains_saves_and_resumes_the_same(workers, tmp_path, torch):
    addr, form = workers[0], ("--form", "attach")
    full = run(tmp_path / "full", addr, 2, "--steps", str(STEPS), *form)
    readme = run(tmp_path / "readme", addr, 0, "--steps", str(STEPS))
    for rank, rows in full.items():
        want = loader_order(addr, rank, 2, STEPS)
        assert [rows[s]["sample_ids"] for s in sorted(rows)] == [[ids] for ids in want], f"rank {rank}"
    for step, loss in losses(readme).items():
        assert losses(full)[step] == pytest.approx(loss, rel=1e-5), f"step {step}"

    run(tmp_path / "killed", addr, 2, "--steps", str(STEPS), "--kill-at", "3", *form, killed=True)
    ckpt = tmp_path / "killed/ckpt/checkpoint-2"
    resumed = run(tmp_path / "resumed", addr, 2, "--steps", str(STEPS), "--resume", str(ckpt), *form)
    assert sorted(resumed[0]) == list(range(3, STEPS + 1))
    for step in range(3, STEPS + 1):
        assert all(resumed[r][step]["sample_ids"] == full[r][step]["sample_ids"] for r in (0, 1)), f"step {step}"
        assert losses(resumed)[step] == pytest.approx(losses(full)[step], rel=1e-5), f"step {step}"


def test_packed_batches_under_accumulation_train_to_the_token_normalised_loss(workers, tmp_path, torch):
    addr = workers[1]
    trainer = run(tmp_path / "trainer", addr, 2, "--steps", "3", "--accumulation", "2")
    readme = run(tmp_path / "readme", addr, 0, "--steps", "3", "--accumulation", "2")
    assert global_batches(trainer) == global_batches(readme)
    assert all(len(r[s]["sample_ids"]) == 2 for r in trainer.values() for s in r), "2 batches per step"
    for step, loss in losses(readme).items():
        assert losses(trainer)[step] == pytest.approx(loss, rel=1e-5), f"step {step}"


@pytest.mark.parametrize("block, function", [(0, "train"), (1, "train_existing")])
def test_the_docs_code_is_the_examples(block, function):
    """docs/client.md's "With your trainer" shows `train` and `train_existing` of
    examples/hf_trainer.py, line for line."""
    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs/client.md").read_text().split("## With your trainer", 1)[1].split("\n## ", 1)[0]
    code = doc.split("```python")[1 + block].split("```", 1)[0]
    shown = [ln.strip() for ln in code.splitlines() if ln.strip()]
    example = (root / "examples/hf_trainer.py").read_text()
    body = [ln.strip() for ln in example.split(f"\ndef {function}(", 1)[1].split("\ndef ", 1)[0].splitlines()]
    assert len(shown) >= 2 and all(ln in body for ln in shown), shown
