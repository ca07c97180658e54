"""What the rank pays for u8 pixels on the wire: the normalization lookup, three ways.

    python benches/rank_normalize.py kernel [--rows 40000] [--repeats 7]
    python benches/rank_normalize.py epoch --data DS [--rounds 2] [--cpu-threads 2]
    python benches/rank_normalize.py gpu ADDR [--batches 4]

kernel: one process, one batch-sized array (rows x 1176 u8, the shape of Qwen2-VL's patches):
    a plain float32 copy of the output's size (the memory-speed bound the issue sets: >= 50 %),
    against `Batch.pixel_values`' native pass (into a reused buffer, into fresh memory, on 1..4
    threads, float32 and bfloat16) and the numpy lookup it replaced. Median of --repeats.
epoch: a `stoker worker` (u8) on DS and one rank reading whole epochs (a new loader each,
    after the last one's prefetched requests drained), alternating: tensors untouched,
    `batch.pixel_values()` (the native pass into the loader's pool), the same into fresh
    memory (`Loader(pixel_buffers=0)`), bfloat16, and the numpy lookup it replaced.
    Samples/s per mode (median over rounds) and the ratio to untouched (goal >= 0.85).
gpu: needs torch and a GPU; ADDR is a u8 worker. Per batch, bytes that crossed and the median
    time until the model-ready float32 tensor is on the GPU: u8 + lookup on the GPU, the host
    pass into pinned memory + an async copy, and float32 copied from pinned and from pageable
    memory (what a float32 worker would have sent).
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import stoker

COLUMNS = 1176  # 3 channels x 2 frames x 14 x 14


def numpy_lookup(px: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """The rank's lookup before the native pass: a gather through uint16 indices."""
    index = (np.arange(px.shape[1], dtype=np.uint16) // (px.shape[1] // 3)) * np.uint16(256)
    return lut.reshape(-1)[px.astype(np.uint16) + index]


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class FakeBatch(stoker.Batch):
    """A batch around arrays made here (the kernel benchmark needs no worker)."""

    def __init__(self, px: np.ndarray, lut: np.ndarray) -> None:
        super().__init__(epoch=0, global_batch=0, sample_ids=[], skipped=[],
                         tensors={"pixel_values": px, "pixel_lut": lut},
                         dtypes={"pixel_values": "uint8", "pixel_lut": "float32"},
                         worker="", payload=None)


def kernel(opts) -> None:
    rng = np.random.default_rng(0)
    px = rng.integers(0, 256, size=(opts.rows, COLUMNS), dtype=np.uint8)
    lut = ((np.arange(768, dtype=np.float32).reshape(3, 256) % 256) / 255.0 - 0.48) / 0.27
    batch = FakeBatch(px, lut)
    src = np.ones(px.shape, dtype=np.float32)
    dst = np.empty_like(src)
    values = px.size
    copy_s = median_s(lambda: np.copyto(dst, src), opts.repeats)
    rows = [("plain float32 copy of the output size (bound)", copy_s)]
    pool = stoker.BufferPool(slots=1)
    bf16_pool = stoker.BufferPool(slots=1)
    for threads in (1, 2, 4):
        rows.append((f"pixel_values(pool=...), float32, {threads} thread(s)",
                     median_s(lambda: batch.pixel_values(pool=pool, threads=threads), opts.repeats)))
    rows.append(("pixel_values(pool=...), bfloat16, 2 threads",
                 median_s(lambda: batch.pixel_values(dtype="bfloat16", pool=bf16_pool, threads=2),
                          opts.repeats)))
    rows.append(("pixel_values(), fresh memory, 2 threads",
                 median_s(lambda: batch.pixel_values(threads=2), opts.repeats)))
    rows.append(("numpy lookup (before)", median_s(lambda: numpy_lookup(px, lut), opts.repeats)))
    assert np.array_equal(batch.pixel_values(), numpy_lookup(px, lut))
    print(f"\nRank-side normalization, {opts.rows} x {COLUMNS} u8 -> {values * 4 / 1e6:.0f} MB float32,"
          f" {os.cpu_count()} cores, median of {opts.repeats}")
    print(f"{'pass':<50}{'ms':>9}{'G values/s':>12}{'vs copy':>9}")
    for name, s in rows:
        print(f"{name:<50}{s * 1e3:>9.1f}{values / s / 1e9:>12.2f}{copy_s / s:>8.0%}")


def serve(data: Path, cpu_threads: int, batch: int):
    stoker_bin = os.environ.get("STOKER_BIN", str(Path(__file__).resolve().parents[1] / "target/release/stoker"))
    cache = os.environ.get("STOKER_CACHE") or str(Path.home() / ".cache/stoker")
    tok = os.environ.get("STOKER_TOKENIZER") or str(Path(cache) / "qwen-tokenizer")
    proc = subprocess.Popen(
        [stoker_bin, "worker", "--data", str(data), "--listen", "127.0.0.1:0", "--metrics-listen",
         "127.0.0.1:0", "--no-auth", "--insecure-plaintext", "--global-batch-size", str(batch), "--cpu-threads",
         str(cpu_threads), "--tokenizer", tok, "--pixel-dtype", "u8"],
        stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("listening "):
            return proc, line.split()[1]
    raise SystemExit("the worker exited before listening")


def epoch(opts) -> None:
    proc, addr = serve(opts.data, opts.cpu_threads, opts.batch)
    modes = {  # name: (loader keywords, what the rank does with each batch)
        "u8 untouched": ({}, lambda b: b.tensors["pixel_values"]),
        "pixel_values() (loader's pool)": ({}, lambda b: b.pixel_values()),
        "pixel_values(), fresh memory": ({"pixel_buffers": 0}, lambda b: b.pixel_values()),
        "pixel_values(dtype=bfloat16)": ({}, lambda b: b.pixel_values(dtype="bfloat16")),
        "numpy lookup (before)": ({}, lambda b: numpy_lookup(b.tensors["pixel_values"], b.tensors["pixel_lut"])),
    }
    rates = {name: [] for name in modes}
    try:
        for _ in stoker.Loader(addr, rank=0, world_size=1, insecure_plaintext=True):  # warms the worker's caches
            pass
        for _ in range(opts.rounds):
            for name, (kwargs, consume) in modes.items():
                # A loader per epoch: one that read an epoch slowly has the next one prefetched.
                time.sleep(opts.settle_s)  # the last loader's prefetched requests drain
                loader = stoker.Loader(addr, rank=0, world_size=1, insecure_plaintext=True, **kwargs)
                start, samples = time.perf_counter(), 0
                for b in loader:
                    consume(b)
                    samples += len(b.sample_ids)
                rates[name].append(samples / (time.perf_counter() - start))
                del loader, b
    finally:
        proc.kill()
    base = statistics.median(rates["u8 untouched"])
    print(f"\nOne rank reading whole epochs of {opts.data} from a u8 worker (--cpu-threads "
          f"{opts.cpu_threads}), {opts.rounds} rounds, modes alternating")
    print(f"{'rank does with each batch':<34}{'samples/s':>11}{'vs untouched':>14}  runs")
    for name, r in rates.items():
        print(f"{name:<34}{statistics.median(r):>11.1f}{statistics.median(r) / base:>14.2f}  "
              + " ".join(f"{x:.1f}" for x in r))


def gpu(opts) -> None:
    import torch

    import stoker.torch

    def median_ms(fn, repeats: int = 20) -> float:
        def synced():
            fn()
            torch.cuda.synchronize()
        return 1e3 * median_s(synced, repeats)

    loader = stoker.Loader(opts.addr, rank=0, world_size=1, prefetch=2, insecure_plaintext=True)
    pinned = stoker.torch.pinned_pool()
    print(f"{'batch':>5} {'u8 MB':>8} {'f32 MB':>8} {'u8+lookup ms':>13} {'host+pinned ms':>15} "
          f"{'f32 pinned ms':>14} {'f32 pageable ms':>16}")
    for _, batch in zip(range(opts.batches), loader):
        f32 = np.ascontiguousarray(batch.pixel_values())  # what a float32 worker would send
        pinned_f32 = torch.from_numpy(f32).pin_memory()
        u8_ms = median_ms(lambda: batch.pixel_values(device="cuda"))
        host_ms = median_ms(lambda: stoker.torch.pixels_to_device(batch, "cuda", pinned))
        pinned_ms = median_ms(lambda: pinned_f32.to("cuda", non_blocking=True))
        pageable_ms = median_ms(lambda: torch.from_numpy(f32).to("cuda"))
        px = batch.tensors["pixel_values"]
        print(f"{batch.global_batch:>5} {px.nbytes / 1e6:>8.1f} {f32.nbytes / 1e6:>8.1f} {u8_ms:>13.2f} "
              f"{host_ms:>15.2f} {pinned_ms:>14.2f} {pageable_ms:>16.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernel")
    k.add_argument("--rows", type=int, default=40000)
    k.add_argument("--repeats", type=int, default=7)
    e = sub.add_parser("epoch")
    e.add_argument("--data", type=Path, required=True)
    e.add_argument("--rounds", type=int, default=2)
    e.add_argument("--cpu-threads", type=int, default=2)
    e.add_argument("--batch", type=int, default=16)
    e.add_argument("--settle-s", type=float, default=3.0)
    g = sub.add_parser("gpu")
    g.add_argument("addr")
    g.add_argument("--batches", type=int, default=4)
    opts = ap.parse_args()
    {"kernel": kernel, "epoch": epoch, "gpu": gpu}[opts.what](opts)


if __name__ == "__main__":
    sys.exit(main())
