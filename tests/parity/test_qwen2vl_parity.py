"""Parity of Stoker's preprocessing with Hugging Face transformers' Qwen2-VL processor.

For samples of a synthetic dataset (JPEG, PNG, grayscale, CMYK, EXIF-rotated, multi-image,
multi-turn; LLaVA and messages styles), `stoker dataset inspect --out` writes the tensors Stoker
produces; the reference is transformers' Qwen2VLProcessor (the PIL image processor + the real
Qwen tokenizer) on the same files, loaded the way transformers' own `load_image` does (EXIF
transpose, convert to RGB).

- input_ids and image_grid_thw: exactly equal.
- labels: exactly Qwen's fine-tuning rule, computed here independently from the token ids:
  trained = the tokens after each `<|im_start|>assistant\n` through its `<|im_end|>` and `\n`.
- pixel_values: tolerance 0 — bit-identical. Justification: every step is the reference's
  own arithmetic, not an approximation of it. JPEG is decoded by libjpeg-turbo 3.1 (the library
  inside Pillow's wheels) with Pillow's settings (accurate integer IDCT, fancy upsampling);
  CMYK uses Pillow's conversion; the resize reproduces Pillow's fixed-point bicubic including
  its pass order; rescale/normalize use transformers' float64-then-float32 arithmetic. A
  looser bound (transformers accepts max |Δ| 0.1, mean 5e-3 between its own slow and fast
  processors; one 8-bit level is ≈ 0.0146 after CLIP normalization) would hide a regression in
  any of these, so any difference fails. Pillow is pinned by scripts/setup-test-deps.sh.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
from hf_reference import Reference, hf_messages, jsonl_samples, load_rgb, reference_labels  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from served import LAB, STOKER, TOKENIZER  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "worker/templates/qwen2-vl.jinja"


@pytest.fixture(scope="module")
def processor():
    return Reference(TOKENIZER, TEMPLATE)


def synth(tmp: Path, fmt: str, n: int, seed: int) -> Path:
    out = tmp / fmt
    subprocess.run(
        [LAB, "synth", "--out", str(out), "--samples", str(n), "--format", fmt,
         "--seed", str(seed), "--max-side", "1000"],
        check=True, capture_output=True,
    )
    return out


def image_kind(path: Path) -> str:
    im = Image.open(path)
    fmt = "jpeg" if im.format == "JPEG" else "png"
    if im.getexif().get(0x0112, 1) != 1:
        return f"{fmt}-exif-rotated"
    return f"{fmt}-" + {"L": "gray", "CMYK": "cmyk"}.get(im.mode, "rgb")


@pytest.mark.parametrize("fmt,n,seed", [("llava", 24, 11), ("messages", 16, 12)])
def test_tokens_labels_and_pixels_match_transformers(processor, tmp_path, fmt, n, seed):
    ds = synth(tmp_path, fmt, n, seed)
    kinds = set()
    images_checked = 0
    for i, sample in enumerate(jsonl_samples(ds)):
        out = tmp_path / f"{fmt}-{i}.safetensors"
        subprocess.run(
            [STOKER, "dataset", "inspect", str(ds), "--sample", str(i), "--preset", "qwen2-vl",
             "--tokenizer", str(TOKENIZER), "--pixel-dtype", "f32", "--out", str(out)],
            check=True, capture_output=True,
        )
        ours = load_file(str(out))
        msgs, paths = hf_messages(sample)
        imgs = [load_rgb(ds / p) for p in paths]
        ref = processor(msgs, imgs)

        ids = ref["input_ids"][0]
        assert ours["input_ids"][0].tolist() == ids.tolist(), f"sample {i}: token ids differ"
        assert ours["labels"][0].tolist() == reference_labels(ids).tolist(), f"sample {i}: labels"
        if not paths:
            continue
        np.testing.assert_array_equal(ours["image_grid_thw"], ref["image_grid_thw"])

        # Per image: the rows of pixel_values it owns.
        row = 0
        for p, thw in zip(paths, ref["image_grid_thw"]):
            rows = int(np.prod(thw))
            d = np.abs(ours["pixel_values"][row:row + rows] - ref["pixel_values"][row:row + rows])
            row += rows
            assert d.max() == 0.0, f"sample {i} {p}: max |Δ| {d.max()}, mean |Δ| {d.mean()}"
            kinds.add(image_kind(ds / p))
            images_checked += 1
        assert row == len(ref["pixel_values"])
    print(f"\n[{fmt}] {images_checked} images bit-identical, kinds {sorted(kinds)}", file=sys.stderr)
    assert images_checked >= n
    # The seeds are chosen so that every kind of image the generator makes is covered.
    assert kinds >= {"jpeg-rgb", "jpeg-gray", "jpeg-cmyk", "jpeg-exif-rotated", "png-rgb", "png-gray"}, kinds
