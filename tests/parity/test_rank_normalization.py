"""u8 pixels on the wire, normalized on the rank: bit-identical to Hugging Face's float32.

A worker serving u8 pixel_values (resized and patchified, not normalized) sends its
normalization table with every batch; `Batch.pixel_values()` looks each value up in it. The
reference is transformers' Qwen2-VL image processor on the same files, per sample. A second
worker normalizing to bfloat16 itself shows the rank's bfloat16 rounding is the worker's.
The torch path (`Batch.pixel_values(device=...)`, `stoker.torch.to_torch`) indexes the same
float32 table on the device (no arithmetic there, so no fused or reordered float operation can
change a bit); its test runs on CPU where torch is installed and on a GPU where one is present,
and is skipped otherwise.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import stoker

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
from hf_reference import hf_messages, jsonl_samples, load_rgb  # noqa: E402
from served import LAB, STOKER, TOKENIZER, epoch, serve  # noqa: E402

SAMPLES = 12


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rank-norm") / "ds"
    subprocess.run(
        [LAB, "synth", "--out", str(out), "--samples", str(SAMPLES),
         "--seed", "21", "--max-side", "700"],
        check=True, capture_output=True,
    )
    return out


@pytest.fixture(scope="module")
def served(dataset):
    """One epoch from a u8 worker and one from a bf16 worker of the same dataset."""
    workers = [serve(dataset, "--pixel-dtype", dtype) for dtype in ("u8", "bf16")]
    try:
        return [epoch(addr) for _, addr in workers]
    finally:
        for proc, _ in workers:
            proc.kill()


def test_u8_normalized_on_the_rank_is_the_processors_float32_bit_for_bit(dataset, served):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(max_pixels=12845056)  # Qwen2-VL's Hub config
    samples = list(jsonl_samples(dataset))
    u8_batches, bf16_batches = served
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


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_lookup_on_a_torch_device_is_the_numpy_lookup_bit_for_bit(served, device, torch):
    """The numpy lookup is the processor's float32 (above); the torch one, on CPU or GPU,
    must give the same bits, and so must its bfloat16 and `to_torch`'s model inputs."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU here")
    from stoker.torch import pinned_pool, pixels_to_device, to_torch

    u8_batches, bf16_batches = served
    # The host pass into (pinned) pooled memory and an asynchronous copy: the same bits.
    pool = pinned_pool() if device == "cuda" else stoker.BufferPool()
    values = 0
    for u8, bf16 in zip(u8_batches, bf16_batches):
        want = u8.pixel_values()
        got = u8.pixel_values(device=device)
        assert got.device.type == device and got.dtype == torch.float32
        assert torch.equal(got.cpu(), torch.from_numpy(want)), f"batch {u8.global_batch}"
        got_bf16 = u8.pixel_values(device=device, dtype="bfloat16")
        bits = got_bf16.cpu().view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(bits, bf16.tensors["pixel_values"].view(np.uint16))
        inputs = to_torch(u8, device)
        assert inputs["input_ids"].device.type == device
        assert torch.equal(inputs["input_ids"].cpu(), torch.from_numpy(u8.tensors["input_ids"]))
        assert torch.equal(inputs["pixel_values"].cpu(), got.cpu())
        copied = pixels_to_device(u8, device, pool)
        assert copied.device.type == device and torch.equal(copied.cpu(), torch.from_numpy(want))
        values += want.size
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"\n{values} pixel values on {name}: torch lookup == numpy lookup", file=sys.stderr)
    assert values > 0


def test_inspect_saves_what_the_model_sees(dataset, tmp_path):
    """`stoker dataset inspect --out` with u8 pixels saves model-ready float32 (the rank's
    lookup), the bits an f32 worker computes; `--wire-pixels` saves the u8 bytes and the table."""
    from safetensors.numpy import load_file

    def inspect(name, *args):
        out = tmp_path / f"{name}.safetensors"
        subprocess.run([STOKER, "dataset", "inspect", str(dataset), "--sample", "1", "--tokenizer",
                        str(TOKENIZER), "--out", str(out), *args], check=True, capture_output=True)
        return load_file(str(out))

    default, f32, wire = inspect("u8"), inspect("f32", "--pixel-dtype", "f32"), inspect("wire", "--wire-pixels")
    assert default["pixel_values"].dtype == np.float32 and "pixel_lut" not in default
    assert default["pixel_values"].size > 0
    assert np.array_equal(default["pixel_values"].view(np.uint32), f32["pixel_values"].view(np.uint32))
    assert wire["pixel_values"].dtype == np.uint8 and wire["pixel_lut"].shape == (3, 256)
    columns = wire["pixel_values"].shape[1]
    channel = np.arange(columns) // (columns // 3)
    assert np.array_equal(wire["pixel_lut"][channel[None, :], wire["pixel_values"]], f32["pixel_values"])
