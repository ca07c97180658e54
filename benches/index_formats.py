"""Indexing the same samples as JSONL and as a pretty-printed JSON array (LLaMA-Factory's own
files): `stoker dataset index --dry-run` on each, side by side, in one run.

    python benches/index_formats.py [--samples 100000] [--rounds 3]

Each sample is LLaMA-Factory's OpenAI style with one image (the same object for all, so the
listing stays one object and what is measured is reading, splitting and validating the text).
Prints each format's best time, samples/s, the index's bytes in memory, and the ratio.
"""

import argparse
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

CACHE = Path(os.environ.get("STOKER_CACHE") or Path.home() / ".cache/stoker")
STOKER = os.environ.get("STOKER_BIN", str(CACHE / "target/release/stoker"))
# The image only has to exist: the index checks that each medium is there, not its pixels.
IMAGE = b"\xff\xd8\xff\xd9"


def sample(i: int) -> dict:
    return {"messages": [
        {"role": "user", "content": f"<image>Question {i}: what is in the picture, and why?"},
        {"role": "assistant", "content": f"Answer {i}: " + "a few words of explanation " * 4}],
        "images": ["img/a.jpg"]}


def index_once(ds: Path) -> tuple[float, str]:
    t = time.perf_counter()
    r = subprocess.run([STOKER, "dataset", "index", str(ds), "--dry-run"],
                       capture_output=True, text=True, check=True)
    return time.perf_counter() - t, r.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    samples = [sample(i) for i in range(args.samples)]
    with tempfile.TemporaryDirectory() as tmp:
        datasets = {}
        for name in ("jsonl", "json-array"):
            ds = Path(tmp) / name
            (ds / "img").mkdir(parents=True)
            (ds / "img/a.jpg").write_bytes(IMAGE)
            if name == "jsonl":
                (ds / "data.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
            else:
                (ds / "data.json").write_text(json.dumps(samples, indent=2))
            datasets[name] = ds
        best = {name: float("inf") for name in datasets}
        out = {}
        for _ in range(args.rounds):  # alternating, so drift on a shared machine hits both
            for name, ds in datasets.items():
                secs, out[name] = index_once(ds)
                best[name] = min(best[name], secs)
        print(f"{'format':12} {'shard MB':>9} {'best s':>7} {'samples/s':>10} {'index bytes':>12}")
        for name, ds in datasets.items():
            size = sum(f.stat().st_size for f in ds.glob("data.*")) / 1e6
            memory = re.search(r"(\d+) bytes in memory", out[name]).group(1)
            assert f"{args.samples} samples, 0 bad lines" in out[name], out[name]
            print(f"{name:12} {size:9.1f} {best[name]:7.2f} {args.samples / best[name]:10.0f} {memory:>12}")
        print(f"json-array / jsonl time: {best['json-array'] / best['jsonl']:.2f}x")


if __name__ == "__main__":
    main()
