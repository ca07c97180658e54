"""Host → device cost of a batch's pixel_values: u8 on the wire, normalized on the rank
(`Batch.pixel_values(device=...)`: the u8 bytes cross, the lookup runs on the device) vs
float32 normalized by the worker (the float32 bytes cross). Needs torch and a GPU.

    python benches/rank_normalize.py ADDR [--batches N]

ADDR is a u8 worker (`stoker worker ... --pixel-dtype u8`). Prints one table: per batch,
bytes that crossed and the median time until the model-ready float32 tensor is on the GPU
(float32 from pinned memory, the best case, and from ordinary memory, what a loader has).
"""

import argparse
import statistics
import time

import numpy as np
import torch

import stoker


def median_ms(fn, repeats: int = 20) -> float:
    fn()  # warm-up: allocator, kernels
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    args = argparse.ArgumentParser()
    args.add_argument("addr")
    args.add_argument("--batches", type=int, default=4)
    opts = args.parse_args()
    loader = stoker.Loader(opts.addr, rank=0, world_size=1, prefetch=2)
    print(
        f"{'batch':>5} {'u8 MB':>8} {'f32 MB':>8} {'u8+lookup ms':>13} "
        f"{'f32 pinned ms':>14} {'f32 pageable ms':>16}"
    )
    for _, batch in zip(range(opts.batches), loader):
        f32 = np.ascontiguousarray(batch.pixel_values())  # what a float32 worker would send
        pinned_f32 = torch.from_numpy(f32).pin_memory()
        u8_ms = median_ms(lambda: batch.pixel_values(device="cuda"))
        pinned_ms = median_ms(lambda: pinned_f32.to("cuda", non_blocking=True))
        pageable_ms = median_ms(lambda: torch.from_numpy(f32).to("cuda"))
        px = batch.tensors["pixel_values"]
        print(
            f"{batch.global_batch:>5} {px.nbytes / 1e6:>8.1f} {f32.nbytes / 1e6:>8.1f} "
            f"{u8_ms:>13.2f} {pinned_ms:>14.2f} {pageable_ms:>16.2f}"
        )


if __name__ == "__main__":
    main()
