"""Every preset against Hugging Face: qwen2.5-vl and qwen3-vl (qwen2-vl: test_qwen2vl_parity.py).

The reference image processor is transformers' Qwen2VLImageProcessorPil configured as each
model's Hub preprocessor config (the class both models' configs name):

- Qwen2.5-VL: patch 14, merge 2, CLIP mean/std, min_pixels 3,136, max_pixels 12,845,056.
- Qwen3-VL: patch 16, merge 2, mean/std 0.5, min_pixels 65,536, max_pixels 16,777,216.

Our presets are run with their defaults, so the test also shows they are the Hub's.

The expected token ids are written out from each model's documented chat format, not from our
template files: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, an image as
`<|vision_start|>` + grid.prod() / merge² `<|image_pad|>` + `<|vision_end|>`; Qwen2.5-VL puts
`You are a helpful assistant.` first when a conversation has no system message, Qwen3-VL
inserts no default system prompt. Labels follow Qwen's fine-tuning rule. Pixels: bit-identical.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
from hf_reference import hf_messages, jsonl_samples, load_rgb, reference_labels  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from served import LAB, STOKER, TOKENIZER  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
HUB = {
    "qwen2.5-vl": dict(patch_size=14, merge_size=2, temporal_patch_size=2, image_mean=CLIP_MEAN,
                       image_std=CLIP_STD, min_pixels=3136, max_pixels=12845056),
    "qwen3-vl": dict(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                     image_std=[0.5] * 3, min_pixels=65536, max_pixels=16777216),
}
DEFAULT_SYSTEM = {"qwen2.5-vl": "You are a helpful assistant.", "qwen3-vl": None}


def documented_chat(messages, grids, merge_size: int, default_system) -> str:
    """The conversation in the model's documented chat format, image pads expanded."""
    grids = iter(grids)
    text = ""
    if default_system is not None and messages[0]["role"] != "system":
        text += f"<|im_start|>system\n{default_system}<|im_end|>\n"
    for m in messages:
        text += f"<|im_start|>{m['role']}\n"
        for part in m["content"]:
            if part["type"] == "image":
                pads = int(np.prod(next(grids))) // merge_size ** 2
                text += "<|vision_start|>" + "<|image_pad|>" * pads + "<|vision_end|>"
            else:
                text += part["text"]
        text += "<|im_end|>\n"
    return text


@pytest.mark.parametrize("preset", ["qwen2.5-vl", "qwen3-vl"])
def test_preset_matches_its_hub_processor_and_chat_format(preset, tmp_path):
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hub = HUB[preset]
    processor = Qwen2VLImageProcessorPil(**hub)
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    ds = tmp_path / "ds"
    subprocess.run(
        [LAB, "synth", "--out", str(ds), "--samples", "10", "--format", "messages",
         "--seed", "31", "--max-side", "1400"],
        check=True, capture_output=True,
    )
    images = multi_image = multi_turn = 0
    for i, sample in enumerate(jsonl_samples(ds)):
        out = tmp_path / f"{i}.safetensors"
        subprocess.run(
            [STOKER, "dataset", "inspect", str(ds), "--sample", str(i), "--preset", preset,
             "--pixel-dtype", "f32",
             "--tokenizer", str(TOKENIZER), "--out", str(out)],
            check=True, capture_output=True,
        )
        ours = load_file(str(out))
        msgs, paths = hf_messages(sample)
        grids = []
        if paths:
            ref = processor(images=[load_rgb(ds / p) for p in paths], return_tensors="np")
            grids = ref["image_grid_thw"]
            np.testing.assert_array_equal(ours["image_grid_thw"], grids)
            assert np.array_equal(ours["pixel_values"], ref["pixel_values"]), f"{preset} sample {i}: pixels"
        text = documented_chat(msgs, grids, hub["merge_size"], DEFAULT_SYSTEM[preset])
        ids = np.array(tokenizer(text)["input_ids"])
        assert ours["input_ids"][0].tolist() == ids.tolist(), f"{preset} sample {i}: token ids"
        assert ours["labels"][0].tolist() == reference_labels(ids).tolist(), f"{preset} sample {i}: labels"
        images += len(paths)
        multi_image += len(paths) > 1
        multi_turn += sum(m["role"] == "assistant" for m in msgs) > 1
    print(f"\n[{preset}] {images} images bit-identical; {multi_image} multi-image, "
          f"{multi_turn} multi-turn samples", file=sys.stderr)
    assert images >= 10 and multi_image >= 1 and multi_turn >= 1
