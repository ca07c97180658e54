"""u8 pixels on the wire, normalized on the rank: bit-identical to Hugging Face's float32.

A worker serving u8 pixel_values (resized and patchified, not normalized) sends its
normalization table with every batch; `Batch.pixel_values()` looks each value up in it. The
reference is transformers' Qwen2-VL image processor on the same files, per sample. A second
worker normalizing to bfloat16 itself shows the rank's bfloat16 rounding is the worker's.
The torch path (`Batch.pixel_values(device=...)`) indexes the same float32 table on the device
(no arithmetic there, so no fused or reordered float operation can change a bit); it is not
run here, where torch is not installed.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import stoker

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
from hf_reference import hf_messages, jsonl_samples, load_rgb  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STOKER = os.environ.get("STOKER_BIN", str(ROOT / "target/release/stoker"))
TOKENIZER = Path(os.environ.get("STOKER_TOKENIZER", Path.home() / ".cache/stoker/qwen-tokenizer"))
SAMPLES = 12


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rank-norm") / "ds"
    subprocess.run(
        [STOKER, "dataset", "synth", "--out", str(out), "--samples", str(SAMPLES),
         "--seed", "21", "--max-side", "700"],
        check=True, capture_output=True,
    )
    return out


def serve(ds: Path, pixel_dtype: str):
    proc = subprocess.Popen(
        [STOKER, "worker", "--data", str(ds), "--listen", "127.0.0.1:0",
         "--metrics-listen", "127.0.0.1:0", "--no-auth", "--global-batch-size", "4",
         "--cpu-threads", "1", "--tokenizer", str(TOKENIZER), "--pixel-dtype", pixel_dtype],
        stdout=subprocess.PIPE, text=True,
    )
    for line in proc.stdout:
        if line.startswith("listening "):
            return proc, line.split()[1]
    proc.kill()
    raise AssertionError(f"the {pixel_dtype} worker exited before listening")


def epoch(addr: str):
    loader = stoker.Loader(addr, rank=0, world_size=1, prefetch=2)
    return [loader.__next__() for _ in range(len(loader))]


def test_u8_normalized_on_the_rank_is_the_processors_float32_bit_for_bit(dataset):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(max_pixels=12845056)  # Qwen2-VL's Hub config
    samples = list(jsonl_samples(dataset))
    workers = [serve(dataset, "u8"), serve(dataset, "bf16")]
    try:
        u8_batches, bf16_batches = (epoch(addr) for _, addr in workers)
    finally:
        for proc, _ in workers:
            proc.kill()
    images = 0
    for u8, bf16 in zip(u8_batches, bf16_batches):
        assert u8.dtypes["pixel_values"] == "uint8" and "pixel_lut" in u8.tensors
        assert u8.sample_ids == bf16.sample_ids
        ours = u8.pixel_values()
        assert ours.dtype == np.float32
        refs = []
        for sid in u8.sample_ids:
            _, paths = hf_messages(samples[sid])
            if paths:
                imgs = [load_rgb(dataset / p) for p in paths]
                refs.append(processor(images=imgs, return_tensors="np")["pixel_values"])
                images += len(paths)
        ref = np.concatenate(refs)
        assert ours.shape == ref.shape
        assert np.array_equal(ours, ref), f"batch {u8.global_batch}: max |Δ| {np.abs(ours - ref).max()}"
        # The rank's bfloat16 rounding is the worker's.
        rank_bf16 = u8.pixel_values(dtype="bfloat16").view(np.uint16)
        assert np.array_equal(rank_bf16, bf16.tensors["pixel_values"].view(np.uint16))
    print(f"\n{images} images: u8 + rank normalization == transformers float32", file=sys.stderr)
    assert images >= SAMPLES
