"""Store requests and bytes per sample for a shuffled epoch: Parquet with embedded images against
JSONL + image files of the same samples, all served by a worker from the embedded S3 server.

    python benches/parquet_reads.py            # --samples 512

The same conversations (one image each, 150–700 px JPEGs, a few hundred words) are written as
JSONL beside their image files, and as Parquet three ways: as the `datasets` library writes a Hub
dataset (its Image feature, its row groups, no page index); by pyarrow with a page index (its
defaults otherwise: a page closes only every 1,024 rows, its write batch, so a page holds them
all); and as docs/preprocessing.md advises (a page index, `write_batch_size=1` so pages close at
32 KiB, no dictionary pages). Each is indexed, then one
worker (`--seed 3`, global batch 8) serves one epoch to a Loader; the worker's own counters give
the epoch's GET requests and bytes read (its start's index and HEAD reads left out), without a
line cache by default (each sample's reads its own, as where the dataset dwarfs the cache). A
sample's own bytes are its JSONL line plus its image.
"""

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests/parity"))
from served import LAB, STOKER, TOKENIZER  # noqa: E402

import stoker  # noqa: E402

BUCKET = "data"
WORDS = "the a red small image shows of and with on near two people cat tree house sky".split()


def samples(n, seed=7):
    rng = np.random.default_rng(seed)
    for i in range(n):
        h, w = rng.integers(150, 700, 2)
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8)).resize((w, h), Image.BILINEAR)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=85)
        text = " ".join(rng.choice(WORDS, int(rng.integers(100, 400))))
        yield f"img/{i:06}.jpg", buf.getvalue(), f"Describe image {i}.", text


def hub_rows(data):
    return [{"messages": [
        {"role": "user", "content": [{"type": "image", "text": None, "index": 0},
                                     {"type": "text", "text": q, "index": None}]},
        {"role": "assistant", "content": [{"type": "text", "text": a, "index": None}]}],
        "images": [{"bytes": b, "path": None}]} for _, b, q, a in data]


def write_layouts(root: Path, data):
    own = 0
    jsonl = root / "jsonl" / BUCKET
    (jsonl / "img").mkdir(parents=True)
    with open(jsonl / "data.jsonl", "w") as f:
        for path, b, q, a in data:
            (jsonl / path).write_bytes(b)
            line = json.dumps({"messages": [
                {"role": "user", "content": [{"type": "image", "image": path}, {"type": "text", "text": q}]},
                {"role": "assistant", "content": a}]}) + "\n"
            f.write(line)
            own += len(line.encode()) + len(b)
    rows = hub_rows(data)
    image = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    table = pa.Table.from_pylist(rows)
    table = table.set_column(1, "images", table.column("images").cast(image))
    layouts = {"jsonl + image files": jsonl}
    try:
        import datasets
        d = datasets.Dataset.from_list(rows).cast_column("images", datasets.List(datasets.Image()))
        out = root / "hub" / BUCKET
        out.mkdir(parents=True)
        d.to_parquet(str(out / "data.parquet"))
        layouts["Parquet as `datasets` writes it"] = out
    except ImportError:
        print("datasets is not installed: its layout is left out", file=sys.stderr)
    for name, options in [
        ("Parquet, page index (pyarrow defaults)", dict(write_page_index=True)),
        ("Parquet, page index, pages closed per row, no dictionary",
         dict(write_page_index=True, write_batch_size=1, data_page_size=32 << 10, use_dictionary=False)),
        ("the same in row groups of 32 rows (docs/preprocessing.md's advice)",
         dict(write_page_index=True, write_batch_size=1, data_page_size=32 << 10, use_dictionary=False,
              row_group_size=32)),
    ]:
        out = root / re.sub(r"\W+", "-", name) / BUCKET
        out.mkdir(parents=True)
        pq.write_table(table, out / "data.parquet", **options)
        layouts[name] = out
    return layouts, own


def metrics(addr):
    text = urllib.request.urlopen(f"http://{addr}/metrics").read().decode()
    gets = sum(float(v) for _, v in re.findall(r'^stoker_worker_store_requests_total\{kind="(get|get_range)",\S*\} (\S+)', text, re.M))
    read = float(re.search(r"^stoker_worker_object_store_read_bytes_total\{\S*\} (\S+)", text, re.M).group(1))
    return gets, read


def run(layout: Path, n: int, cache_mib: int):
    s3 = subprocess.Popen([LAB, "bench", "s3-server", "--root", str(layout.parent), "--listen", "127.0.0.1:0"],
                          stdout=subprocess.PIPE, text=True)
    endpoint = s3.stdout.readline().split()[1]
    env = dict(os.environ, AWS_ENDPOINT_URL=f"http://{endpoint}", AWS_REGION="us-east-1",
               AWS_ACCESS_KEY_ID="stoker-embedded", AWS_SECRET_ACCESS_KEY="stoker-embedded-secret")
    uri = f"s3://{BUCKET}"
    try:
        subprocess.run([STOKER, "dataset", "index", uri, "--s3-path-style"], env=env, check=True, capture_output=True)
        worker = subprocess.Popen(
            [STOKER, "worker", "--data", uri, "--s3-path-style", "--listen", "127.0.0.1:0",
             "--metrics-listen", "127.0.0.1:0", "--no-auth", "--insecure-plaintext", "--global-batch-size", "8",
             "--seed", "3", "--line-cache-mib", str(cache_mib), "--tokenizer", str(TOKENIZER)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            metrics_addr = addr = None
            for line in worker.stdout:
                if line.startswith("metrics "):
                    metrics_addr = line.split()[1]
                if line.startswith("listening "):
                    addr = line.split()[1]
                    break
            before = metrics(metrics_addr)
            loader = stoker.Loader(addr, prefetch=2, insecure_plaintext=True)
            batches = [next(loader) for _ in range(len(loader))]
            served = sum(len(b.sample_ids) for b in batches)
            skipped = [s for b in batches for s in b.skipped]
            after = metrics(metrics_addr)
        finally:
            worker.kill()
    finally:
        s3.kill()
    if served < n:
        why = re.search(r"a read of (\d+) bytes", skipped[0][1]) if skipped else None
        assert why, f"{served} of {n} samples served ({len(batches)} batches; skipped {skipped[:3]})"
        return f"{n - served} samples refused: a read of {int(why.group(1)) / 2**20:.0f} MiB is over --max-object-bytes"
    return (after[0] - before[0]) / n, (after[1] - before[1]) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=512)
    # 0: each sample's reads on their own, as on a dataset much larger than the cache (a
    # shuffled epoch finds a neighbour's page cached only by chance).
    ap.add_argument("--line-cache-mib", type=int, default=0)
    args = ap.parse_args()
    data = list(samples(args.samples))
    with tempfile.TemporaryDirectory() as tmp:
        layouts, own = write_layouts(Path(tmp), data)
        own /= args.samples
        print(f"{args.samples} samples, {own / 1024:.1f} KiB of own bytes per sample (line + image)\n")
        print("| layout | file MiB | GETs per sample | KiB read per sample | read / own bytes |")
        print("|---|---|---|---|---|")
        for name, path in layouts.items():
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20
            got = run(path, args.samples, args.line_cache_mib)
            if isinstance(got, str):
                print(f"| {name} | {size:.1f} | {got} | | |")
                continue
            gets, read = got
            print(f"| {name} | {size:.1f} | {gets:.2f} | {read / 1024:.1f} | {read / own:.2f} |")


if __name__ == "__main__":
    main()
