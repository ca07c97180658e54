"""The reference preprocessing: Hugging Face transformers' Qwen2-VL image processor (PIL
backend) and the real Qwen tokenizer, applied to Stoker's JSONL samples. Used by the parity
test (tests/parity) and by the preprocessing benchmark's Python baseline."""

import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps


class Reference:
    """transformers' Qwen2-VL image processor and the Qwen tokenizer, combined the way
    Qwen2VLProcessor combines them (its constructor needs torchvision's video processor, so the
    few lines of glue are repeated here: each `<|image_pad|>` becomes grid.prod() // merge² pads)."""

    def __init__(self, tokenizer: Path, template: Path):
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        # As Qwen2-VL's Hub preprocessor config sets it (the class default is 1,003,520).
        self.image_processor = Qwen2VLImageProcessorPil(max_pixels=12845056)
        self.template = Path(template).read_text()

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


def load_rgb(path: Path) -> Image.Image:
    return ImageOps.exif_transpose(Image.open(path)).convert("RGB")




def jsonl_samples(ds: Path):
    """Every sample of a dataset folder, in (shard, line) order."""
    for shard in sorted(ds.glob("*.jsonl")):
        for line in shard.read_text().splitlines():
            if line.strip():
                yield json.loads(line)


IM_START, IM_END, NEWLINE, ASSISTANT = 151644, 151645, 198, 77091


def reference_labels(ids: np.ndarray) -> np.ndarray:
    labels = np.full_like(ids, -100)
    i = 0
    while i < len(ids):
        # <|im_start|> "assistant" "\n" — "assistant" is one token in the Qwen vocabulary.
        if ids[i] == IM_START and i + 2 < len(ids) and ids[i + 2] == NEWLINE and ids[i + 1] == ASSISTANT:
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
