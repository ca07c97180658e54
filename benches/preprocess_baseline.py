"""Python baselines for `stoker-lab bench preprocess` (run by it; prints one JSON line per mode).

(a) loop:       transformers' Qwen2-VL processor + tokenizer in a Python loop, PIL decoding.
(b) dataloader: the same inside a torch DataLoader with worker processes (only if torch is
                installed), collating with numpy like a typical VLM collator.
Rates are per core: samples per CPU-second of the processes doing the work.
"""

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_reference import Reference, hf_messages, jsonl_samples, load_rgb  # noqa: E402


def cpu_seconds(children: bool = False) -> float:
    who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def process(ref, ds: Path, sample: dict):
    msgs, paths = hf_messages(sample)
    return ref(msgs, [load_rgb(ds / p) for p in paths]), len(paths)


def run_loop(ref, ds, samples):
    t0, c0 = time.perf_counter(), cpu_seconds()
    images = 0
    for s in samples:
        images += process(ref, ds, s)[1]
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    return {"mode": "loop", "samples": len(samples), "images": images, "wall_s": wall, "cpu_s": cpu}


def run_dataloader(ref, ds, samples, workers, batch):
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Samples(Dataset):
        def __len__(self):
            return len(samples)

        def __getitem__(self, i):
            return process(ref, ds, samples[i])[0]

    def collate(items):
        ids = [it["input_ids"][0] for it in items]
        width = max(len(x) for x in ids)
        out = {"input_ids": np.stack([np.pad(x, (0, width - len(x))) for x in ids])}
        pv = [it["pixel_values"] for it in items if "pixel_values" in it]
        if pv:
            out["pixel_values"] = np.concatenate(pv)
        return out

    loader = DataLoader(Samples(), batch_size=batch, num_workers=workers, collate_fn=collate)
    t0, c0, k0 = time.perf_counter(), cpu_seconds(), cpu_seconds(children=True)
    n = 0
    for b in loader:
        n += len(b["input_ids"])
    wall = time.perf_counter() - t0
    cpu = (cpu_seconds() - c0) + (cpu_seconds(children=True) - k0)
    return {"mode": "dataloader", "samples": n, "wall_s": wall, "cpu_s": cpu, "workers": workers}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--template", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    ref = Reference(args.tokenizer, args.template)
    samples = []
    for s in jsonl_samples(args.data):
        samples.append(s)
        if len(samples) == args.samples:
            break
    process(ref, args.data, samples[0])  # warm caches and lazy imports
    print(json.dumps(run_loop(ref, args.data, samples)), flush=True)
    try:
        import torch  # noqa: F401
    except ImportError:
        print(json.dumps({"mode": "dataloader", "skipped": "torch is not installed"}), flush=True)
        return
    print(json.dumps(run_dataloader(ref, args.data, samples, os.cpu_count() or 2, args.batch)), flush=True)


if __name__ == "__main__":
    main()
