"""Real `stoker worker` processes for the parity tests, and one epoch read from one."""

import importlib
import os
import subprocess
from pathlib import Path

import pytest

import stoker

ROOT = Path(__file__).resolve().parents[2]
STOKER = os.environ.get("STOKER_BIN", str(ROOT / "target/release/stoker"))
# Synthetic datasets come from the lab binary, built beside the product.
LAB = os.environ.get("STOKER_LAB", str(Path(STOKER).with_name("stoker-lab")))
CACHE = Path(os.environ.get("STOKER_CACHE") or Path.home() / ".cache/stoker")
TOKENIZER = Path(os.environ.get("STOKER_TOKENIZER") or CACHE / "qwen-tokenizer")
# scripts/test.sh installs every module the parity tests import (PyAV, torch, deepspeed …) and
# sets STOKER_REQUIRE_TORCH: there a missing one fails, naming what installs it; elsewhere the
# tests that need it skip.
REQUIRED = bool(os.environ.get("STOKER_REQUIRE_TORCH"))
MISSING = "{} is not installed (scripts/setup-test-deps.sh installs it)"


def required_module(name):
    """Module `name`, imported; missing, the calling test module skips (fails under test.sh)."""
    if not REQUIRED:
        return pytest.importorskip(name, reason=MISSING.format(name))
    try:
        return importlib.import_module(name)
    except ImportError as e:
        pytest.fail(f"{MISSING.format(name)}: {e}", pytrace=False)


def synth(out: Path, samples: int, seed: int, min_side: int, max_side: int, lengths: bool = False) -> Path:
    """`stoker-lab synth`'s messages-format dataset at `out`; with `lengths`, also its
    `stoker-lengths.bin` for the real tokenizer (what packing and token-aware plans read)."""
    subprocess.run(
        [LAB, "synth", "--out", str(out), "--samples", str(samples), "--seed", str(seed),
         "--format", "messages", "--min-side", str(min_side), "--max-side", str(max_side)],
        check=True, capture_output=True,
    )
    if lengths:
        subprocess.run(
            [STOKER, "dataset", "stats", str(out), "--tokenizer", str(TOKENIZER), "--write-lengths"],
            check=True, capture_output=True,
        )
    return out


def serve(ds: Path, *args: str, global_batch: int = 4):
    """A worker serving `ds` with the real Qwen tokenizer: (process, address)."""
    proc = subprocess.Popen(
        [STOKER, "worker", "--data", str(ds), "--listen", "127.0.0.1:0",
         "--metrics-listen", "127.0.0.1:0", "--no-auth", "--global-batch-size",
         str(global_batch), "--cpu-threads", "1", "--tokenizer", str(TOKENIZER), *args],
        stdout=subprocess.PIPE, text=True,
    )
    for line in proc.stdout:
        if line.startswith("listening "):
            return proc, line.split()[1]
    proc.kill()
    raise AssertionError(f"the worker {' '.join(args)} exited before listening")


def epoch(addr: str, rank: int = 0, world_size: int = 1):
    """One epoch of one rank's batches."""
    loader = stoker.Loader(addr, rank=rank, world_size=world_size, prefetch=2)
    return [loader.__next__() for _ in range(len(loader))]
