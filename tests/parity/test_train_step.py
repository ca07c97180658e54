"""A real training step fed by Stoker (`benches/train_step.py`, the CPU variant with a tiny
Qwen2-VL): every sample of the epoch arrives once, the loss is finite, and the DataLoader and
serial feeders train on the same batches to the same first loss (same weights, same data: the
u8 + rank-side lookup is the processor's float32). The README's training-script example is
the benchmark's loop, line for line."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from served import STOKER, TOKENIZER, synth  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benches/train_step.py"
SAMPLES, BATCH = 16, 4


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return synth(tmp_path_factory.mktemp("train-step") / "ds", SAMPLES, 8, 56, 200)


def train(dataset: Path, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "train.json"
    env = {**os.environ, "STOKER_BIN": STOKER, "STOKER_TOKENIZER": str(TOKENIZER)}
    run = subprocess.run(
        [sys.executable, str(BENCH), "--data", str(dataset), "--model", "tiny", "--batch", str(BATCH),
         "--loader-workers", "1", "--device", "cpu", "--json", str(out), *args],
        capture_output=True, text=True, env=env, timeout=900,
    )
    print(run.stdout, run.stderr[-3000:], file=sys.stderr)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def test_three_feeders_train_on_every_sample_once_to_the_same_loss(dataset, tmp_path, torch):
    steps = SAMPLES // BATCH  # one epoch
    result = train(dataset, tmp_path, "--steps", str(steps))
    feeders = result["feeders"]
    assert list(feeders) == ["stoker", "dataloader", "serial"]
    order = feeders["stoker"]["sample_ids"]
    assert sorted(i for ids in order for i in ids) == list(range(SAMPLES)), "every sample once"
    for name, r in feeders.items():
        assert r["steps"] == steps
        assert r["sample_ids"] == order, f"{name} trained on other batches"
        assert all(math.isfinite(loss) for loss in r["losses"]), f"{name}: {r['losses']}"
        assert 0.0 <= r["wait_ratio"] <= 1.0 and r["samples_per_s"] > 0
    # Same weights, same samples, same pixels and tokens: the first step's loss agrees.
    first = feeders["stoker"]["losses"][0]
    for name in ("dataloader", "serial"):
        assert feeders[name]["losses"][0] == pytest.approx(first, rel=1e-4), name


def test_packed_batches_train_as_varlen_forwards(dataset, tmp_path, torch):
    result = train(dataset, tmp_path, "--steps", "3", "--packed", "--feeders", "stoker")
    r = result["feeders"]["stoker"]
    ids = [i for step in r["sample_ids"] for i in step]
    assert len(ids) == len(set(ids)) and ids, "no sample twice"
    assert all(math.isfinite(loss) for loss in r["losses"])


def test_the_readme_example_is_the_benchmarks_loop():
    """Every line of the README's example from `image_token = ...` on is a line of
    `train_stoker`, in order, spacing aside (the benchmark adds its meter and the packed
    variant between)."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## In a training script", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    lines = [" ".join(ln.split()) for ln in block.splitlines() if ln.strip()]
    example = lines[next(i for i, ln in enumerate(lines) if ln.startswith("image_token ="))]
    example_lines = lines[lines.index(example):]
    source = BENCH.read_text()
    body = source.split("def train_stoker(", 1)[1].split("\ndef ", 1)[0]
    bench_lines = [" ".join(ln.split()) for ln in body.splitlines()]
    at = 0
    for line in example_lines:
        assert line in bench_lines[at:], f"README line not in the benchmark's loop (in order): {line!r}"
        at = bench_lines.index(line, at) + 1
    assert len(example_lines) >= 8
