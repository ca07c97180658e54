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

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[2]
STOKER = os.environ.get("STOKER_BIN", str(ROOT / "target/release/stoker"))
TOKENIZER = Path(os.environ.get("STOKER_TOKENIZER", Path.home() / ".cache/stoker/qwen-tokenizer"))
TEMPLATE = ROOT / "worker/templates/qwen2-vl.jinja"
IM_START, IM_END, NEWLINE = 151644, 151645, 198


class Reference:
    """transformers' Qwen2-VL image processor and the Qwen tokenizer, combined the way
    Qwen2VLProcessor combines them (its constructor needs torchvision's video processor, so the
    few lines of glue are repeated here: each `<|image_pad|>` becomes grid.prod() // merge² pads)."""

    def __init__(self):
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
        self.image_processor = Qwen2VLImageProcessorPil()
        self.template = TEMPLATE.read_text()

    def __call__(self, messages, images):
        text = self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False)
        out = {}
        if images:
            out = dict(self.image_processor(images=images, return_tensors="np"))
            merge2 = self.image_processor.merge_size ** 2
            for thw in out["image_grid_thw"]:
                text = text.replace("<|image_pad|>", "<|placeholder|>" * (int(np.prod(thw)) // merge2), 1)
            text = text.replace("<|placeholder|>", "<|image_pad|>")
        out["input_ids"] = np.array([self.tokenizer(text)["input_ids"]])
        return out


@pytest.fixture(scope="module")
def processor():
    return Reference()


def synth(tmp: Path, fmt: str, n: int, seed: int) -> Path:
    out = tmp / fmt
    subprocess.run(
        [STOKER, "dataset", "synth", "--out", str(out), "--samples", str(n), "--format", fmt,
         "--seed", str(seed), "--max-side", "1000"],
        check=True, capture_output=True,
    )
    return out


def lines(ds: Path):
    for shard in sorted(ds.glob("*.jsonl")):
        for line in shard.read_text().splitlines():
            if line.strip():
                yield json.loads(line)


def hf_messages(sample: dict):
    """The sample in transformers' chat format, and its image paths in order."""
    if "messages" in sample:
        msgs, paths = [], []
        for m in sample["messages"]:
            if isinstance(m["content"], str):
                msgs.append({"role": m["role"], "content": [{"type": "text", "text": m["content"]}]})
                continue
            content = []
            for part in m["content"]:
                if part["type"] == "image":
                    paths.append(part["image"])
                    content.append({"type": "image"})
                else:
                    content.append({"type": "text", "text": part["text"]})
            msgs.append({"role": m["role"], "content": content})
        return msgs, paths
    images = sample["image"] if isinstance(sample["image"], list) else [sample["image"]]
    role = {"human": "user", "gpt": "assistant", "system": "system"}
    msgs = []
    for turn in sample["conversations"]:
        content = []
        for k, piece in enumerate(turn["value"].split("<image>")):
            if k > 0:
                content.append({"type": "image"})
            if piece:
                content.append({"type": "text", "text": piece})
        msgs.append({"role": role[turn["from"]], "content": content})
    return msgs, images


def reference_labels(ids: np.ndarray) -> np.ndarray:
    labels = np.full_like(ids, -100)
    i = 0
    while i < len(ids):
        # <|im_start|> "assistant" "\n" — "assistant" is one token in the Qwen vocabulary.
        if ids[i] == IM_START and i + 2 < len(ids) and ids[i + 2] == NEWLINE and ids[i + 1] == 77091:
            j = i + 3
            while j < len(ids) and ids[j] != IM_END:
                labels[j] = ids[j]
                j += 1
            for k in (j, j + 1):
                if k < len(ids):
                    labels[k] = ids[k]
            i = j
        i += 1
    return labels


def image_kind(path: Path) -> str:
    im = Image.open(path)
    fmt = "jpeg" if im.format == "JPEG" else "png"
    if im.getexif().get(0x0112, 1) != 1:
        return f"{fmt}-exif-rotated"
    return f"{fmt}-" + {"L": "gray", "CMYK": "cmyk"}.get(im.mode, "rgb")


def load_rgb(path: Path) -> Image.Image:
    return ImageOps.exif_transpose(Image.open(path)).convert("RGB")


@pytest.mark.parametrize("fmt,n,seed", [("llava", 24, 11), ("messages", 16, 12)])
def test_tokens_labels_and_pixels_match_transformers(processor, tmp_path, fmt, n, seed):
    ds = synth(tmp_path, fmt, n, seed)
    kinds = set()
    images_checked = 0
    for i, sample in enumerate(lines(ds)):
        out = tmp_path / f"{fmt}-{i}.safetensors"
        subprocess.run(
            [STOKER, "dataset", "inspect", str(ds), "--sample", str(i), "--preset", "qwen2-vl",
             "--tokenizer", str(TOKENIZER), "--out", str(out)],
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
