"""A real training step as the consumer: a Qwen2-VL-architecture model (random init) trained for
N steps on the same samples, in the same batches, fed three ways:

  (a) stoker      `stoker.Loader` -> `stoker.torch.model_inputs`: u8 pixels from a `stoker
                  worker` (started here), normalized on the model's device (the README's
                  training-script example, line for line)
  (b) DataLoader  `torch.utils.data.DataLoader`, transformers' processor (Qwen2-VL image
                  processor + the Qwen tokenizer) in worker processes, padded collate
  (c) serial      the same preprocessing in the training process, batch by batch

(a) runs first; (b) and (c) train on the sample ids (a) received, batch for batch, from the
same initial weights, so their losses agree with (a)'s. Printed per feeder: time to the first
batch, wait and step per step (the wait is everything between two steps: receiving or
preprocessing, collating, moving to the device), the wait ratio, samples/s and the loss; on a
GPU also its utilisation, sampled from NVML during the timed steps.

    python benches/train_step.py --data DS [--model none|tiny|small|2b] [--steps N] [--batch B]
        [--device cpu|cuda] [--packed] [--loader-workers W] [--json PATH]

STOKER_BIN and STOKER_TOKENIZER (or --stoker / --tokenizer) name the binary and the tokenizer.
`--packed` has the worker pack samples (`--pack-max-tokens`) and (a) trains on `batch.packs()`
(one varlen forward per pack, gradients accumulated over a batch's packs); (b) and (c) then
train on the same samples per step, padded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

import stoker
import stoker.torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_reference import Reference, hf_messages, jsonl_samples, load_rgb, reference_labels  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "worker/templates/qwen2-vl.jinja"
IMAGE_TOKEN = 151655  # <|image_pad|>
PAD = 151643  # <|endoftext|>


def model_config(size: str):
    """Qwen2-VL's architecture at three widths: `tiny` for a CPU test, `small` for a CPU
    benchmark, `2b` the shape of Qwen2-VL-2B (for a GPU)."""
    from transformers import Qwen2VLConfig

    text, vision = {
        "tiny": (dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=32, mrope=[4, 2, 2]),
                 dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2)),
        "small": (dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=688, mrope=[16, 8, 8]),
                  dict(depth=4, embed_dim=128, hidden_size=256, num_heads=4)),
        "2b": (dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                    intermediate_size=8960, mrope=[16, 24, 24]),
               dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16)),
    }[size]
    mrope = text.pop("mrope")
    return Qwen2VLConfig(
        text_config=dict(**text, vocab_size=152064,
                         rope_parameters={"rope_type": "default", "mrope_section": mrope,
                                          "rope_theta": 1000000.0}),
        vision_config=vision,
    )


class FeedOnly(torch.nn.Module):
    """`--model none`: a step that costs nothing, so the table shows what each feeder can
    deliver (the end a fast accelerator sits at). It reads every pixel value, so a lookup
    queued on a GPU is paid inside the step, as a real model would pay it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.config = SimpleNamespace(image_token_id=IMAGE_TOKEN)

    def forward(self, input_ids, pixel_values=None, **_: Any):
        touched = input_ids.sum() * 0 + (pixel_values.sum() * 0 if pixel_values is not None else 0)
        return SimpleNamespace(loss=self.weight * 0 + touched)


def new_model(size: str, device: torch.device):
    """The same initial weights for every feeder."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    if size == "none":
        model = FeedOnly().to(device)
        return model, torch.optim.SGD(model.parameters(), lr=0.0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Qwen2VLForConditionalGeneration(model_config(size)).to(device=device, dtype=dtype).train()
    assert model.config.image_token_id == IMAGE_TOKEN
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


class StopTraining(Exception):
    pass


class Meter:
    """Wait (from the end of one step to the start of the next: receiving or preprocessing,
    collating, moving to the device) and step time (forward, backward, optimizer; the device
    synchronized) per step; the first `warmup` steps are left out of the rates."""

    def __init__(self, steps: int, warmup: int, device: torch.device) -> None:
        self.steps, self.warmup, self.device = steps, warmup, device
        self.start = self.mark = time.perf_counter()
        self.first_batch_s = 0.0
        self.wait_s = self.step_s = 0.0
        self.losses: List[float] = []
        self.sample_ids: List[List[int]] = []
        self.timed_samples = 0
        self.gpu = GpuSampler(device)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def fed(self, sample_ids: List[int]) -> None:
        now = self._now()
        if not self.losses:
            self.first_batch_s = now - self.start
        elif len(self.losses) >= self.warmup:
            self.wait_s += now - self.mark
            self.timed_samples += len(sample_ids)
        if len(self.losses) == self.warmup:
            self.gpu.start()
        self.sample_ids.append(list(sample_ids))
        self.mark = now

    def stepped(self, loss: torch.Tensor) -> None:
        now = self._now()
        if len(self.losses) >= self.warmup:
            self.step_s += now - self.mark
        self.losses.append(float(loss.detach().float()))
        self.mark = now
        if len(self.losses) == self.steps:
            raise StopTraining

    def row(self) -> Dict[str, Any]:
        timed = max(1, self.steps - self.warmup)
        busy = self.wait_s + self.step_s
        return {
            "steps": len(self.losses),
            "first_batch_s": self.first_batch_s,
            "wait_ms": 1e3 * self.wait_s / timed,
            "step_ms": 1e3 * self.step_s / timed,
            "wait_ratio": self.wait_s / busy if busy else 0.0,
            "samples_per_s": self.timed_samples / busy if busy else 0.0,
            "loss_first": self.losses[0] if self.losses else math.nan,
            "loss_last": self.losses[-1] if self.losses else math.nan,
            "losses": self.losses,
            "gpu_util": self.gpu.stop(),
            "sample_ids": self.sample_ids,
        }


class GpuSampler:
    """Mean GPU utilisation (NVML through ctypes: the driver's libnvidia-ml, no Python
    package), sampled every 50 ms over the timed steps; None on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.samples: List[int] = []
        self.thread: Optional[threading.Thread] = None
        self.running = False

    def start(self) -> None:
        if self.device.type != "cuda" or self.thread:
            return
        import ctypes

        class Utilization(ctypes.Structure):
            _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]

        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        handle = ctypes.c_void_p()
        if nvml.nvmlInit_v2() or nvml.nvmlDeviceGetHandleByIndex_v2(self.device.index or 0, ctypes.byref(handle)):
            raise SystemExit("NVML did not start: no GPU utilisation to sample")
        self.running = True

        def sample() -> None:
            util = Utilization()
            while self.running:
                if nvml.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(util)) == 0:
                    self.samples.append(util.gpu)
                time.sleep(0.05)

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()

    def stop(self) -> Optional[float]:
        if not self.thread:
            return None
        self.running = False
        self.thread.join()
        return float(np.mean(self.samples)) if self.samples else None


# (a) Stoker ------------------------------------------------------------------------------------


def serve(args) -> Tuple[subprocess.Popen, str]:
    """A `stoker worker` on the dataset, u8 pixels, batches of `--batch`."""
    extra = ["--pack-max-tokens", str(args.pack_max_tokens)] if args.packed else []
    if args.packed:
        subprocess.run([args.stoker, "dataset", "stats", str(args.data), "--tokenizer",
                        str(args.tokenizer), "--write-lengths"], check=True, capture_output=True)
    proc = subprocess.Popen(
        [args.stoker, "worker", "--data", str(args.data), "--listen", "127.0.0.1:0",
         "--metrics-listen", "127.0.0.1:0", "--no-auth", "--insecure-plaintext", "--global-batch-size", str(args.batch),
         "--cpu-threads", str(args.loader_workers), "--tokenizer", str(args.tokenizer),
         "--pixel-dtype", "u8", *extra],
        stdout=subprocess.PIPE, text=True,
    )
    for line in proc.stdout:
        if line.startswith("listening "):
            return proc, line.split()[1]
    proc.kill()
    raise SystemExit("the stoker worker exited before listening")


def train_stoker(args, model, optimizer, meter: Meter, addr: str, device: torch.device) -> Dict[str, Any]:
    """(a): the README's training-script example (tests/parity/test_train_step.py holds the
    README to these lines), with the meter's two calls and the packed variant added."""
    loader = stoker.Loader(addr, rank=0, world_size=1, insecure_plaintext=True)  # the bench's loopback worker
    epochs = math.ceil(args.steps / len(loader))
    ckpt: Dict[str, Any] = {}
    try:
        image_token = model.config.image_token_id
        for epoch in range(epochs):
            for batch in loader:                   # one epoch per iteration, in plan order
                if batch.packed:                   # --pack-max-tokens: a varlen forward per pack
                    packs = batch.packs(device)
                    meter.fed(batch.sample_ids)
                    loss = sum(model(**pack).loss for pack in packs) / len(packs)
                else:
                    inputs = stoker.torch.model_inputs(batch, device, image_token_id=image_token)
                    meter.fed(batch.sample_ids)
                    loss = model(**inputs).loss    # pixels normalized on `device`, as HF does
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                meter.stepped(loss)
            ckpt["data"] = loader.state_dict()     # exact resume, also with another world size
    except StopTraining:
        pass
    return {"loader_wait_ratio": loader.stats()["wait_ratio"], "batches_per_epoch": len(loader)}


# (b) and (c): transformers' processor ------------------------------------------------------------


class HfSamples(torch.utils.data.Dataset):
    """Sample id -> transformers' processor output for it (tokens, labels, pixels, grids)."""

    def __init__(self, data: Path, tokenizer: Path) -> None:
        self.data = data
        self.samples = list(jsonl_samples(data))
        self.reference = Reference(tokenizer, TEMPLATE)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, sid: int) -> Dict[str, Any]:
        msgs, paths = hf_messages(self.samples[sid])
        out = self.reference(msgs, [load_rgb(self.data / p) for p in paths])
        ids = out["input_ids"][0]
        return {"id": sid, "input_ids": ids, "labels": reference_labels(ids),
                "pixel_values": out.get("pixel_values"), "image_grid_thw": out.get("image_grid_thw")}


def collate(samples: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Right-padded to the longest sample, as the worker pads; images in sample order."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = np.full((len(samples), longest), PAD, dtype=np.int64)
    labels = np.full((len(samples), longest), -100, dtype=np.int64)
    mask = np.zeros((len(samples), longest), dtype=np.int64)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[row, :n], labels[row, :n], mask[row, :n] = s["input_ids"], s["labels"], 1
    batch = {"ids": [s["id"] for s in samples], "input_ids": torch.from_numpy(ids),
             "attention_mask": torch.from_numpy(mask), "labels": torch.from_numpy(labels)}
    pixels = [s["pixel_values"] for s in samples if s["pixel_values"] is not None]
    if pixels:
        batch["pixel_values"] = torch.from_numpy(np.concatenate(pixels)).float()
        batch["image_grid_thw"] = torch.from_numpy(
            np.concatenate([s["image_grid_thw"] for s in samples if s["image_grid_thw"] is not None]))
    return batch


def to_device(batch: Dict[str, Any], device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    inputs = {k: v.to(device) for k, v in batch.items() if k != "ids"}
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == IMAGE_TOKEN).int()
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    return inputs


def train_hf(model, optimizer, meter: Meter, batches: Iterator[Dict[str, Any]], device) -> None:
    dtype = next(model.parameters()).dtype
    try:
        for batch in batches:
            inputs = to_device(batch, device, dtype)
            meter.fed(batch["ids"])
            loss = model(**inputs).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            meter.stepped(loss)
    except StopTraining:
        pass


def dataloader_batches(dataset: HfSamples, order: List[List[int]], workers: int):
    return iter(torch.utils.data.DataLoader(dataset, batch_sampler=order, collate_fn=collate,
                                            num_workers=workers, prefetch_factor=2 if workers else None))


def serial_batches(dataset: HfSamples, order: List[List[int]]):
    for ids in order:
        yield collate([dataset[i] for i in ids])


# -------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="a dataset folder (stoker-lab synth)")
    ap.add_argument("--model", choices=["none", "tiny", "small", "2b"], default="tiny",
                    help="none: no model (what each feeder delivers); tiny: CI; 2b: a GPU")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1, help="steps left out of the rates")
    ap.add_argument("--batch", type=int, default=4, help="samples per step")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--packed", action="store_true", help="(a) trains on batch.packs()")
    ap.add_argument("--pack-max-tokens", type=int, default=4096)
    ap.add_argument("--loader-workers", type=int, default=2,
                    help="the stoker worker's --cpu-threads and (b)'s DataLoader processes")
    ap.add_argument("--torch-threads", type=int, default=0, help="torch's CPU threads (0: its default)")
    ap.add_argument("--feeders", default="stoker,dataloader,serial")
    ap.add_argument("--stoker", default=os.environ.get("STOKER_BIN", str(ROOT / "target/release/stoker")))
    cache = Path(os.environ.get("STOKER_CACHE") or Path.home() / ".cache/stoker")
    ap.add_argument("--tokenizer", type=Path,
                    default=Path(os.environ.get("STOKER_TOKENIZER") or cache / "qwen-tokenizer"))
    ap.add_argument("--json", type=Path, help="write every figure (and each step's sample ids) here")
    args = ap.parse_args()
    if args.warmup >= args.steps:
        ap.error("--warmup must be below --steps")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    device = torch.device(args.device)
    feeders = args.feeders.split(",")
    if feeders[0] != "stoker":
        ap.error("--feeders starts with stoker: the others train on the batches it received")

    results: Dict[str, Dict[str, Any]] = {}
    proc, addr = serve(args)
    try:
        model, optimizer = new_model(args.model, device)
        meter = Meter(args.steps, args.warmup, device)
        extra = train_stoker(args, model, optimizer, meter, addr, device)
        results["stoker"] = {**meter.row(), **extra}
    finally:
        proc.kill()
        proc.wait()
    order = results["stoker"]["sample_ids"]
    dataset = HfSamples(args.data, args.tokenizer) if len(feeders) > 1 else None
    for name in feeders[1:]:
        del model, optimizer
        model, optimizer = new_model(args.model, device)
        meter = Meter(args.steps, args.warmup, device)
        if name == "dataloader":
            batches = dataloader_batches(dataset, order, args.loader_workers)
        elif name == "serial":
            batches = serial_batches(dataset, order)
        else:
            ap.error(f"unknown feeder {name}")
        train_hf(model, optimizer, meter, batches, device)
        results[name] = meter.row()
        if meter.sample_ids != order:
            raise SystemExit(f"{name} trained on other batches than stoker")

    print(f"\nTraining step, Qwen2-VL architecture ({args.model}), {args.device}, batch {args.batch}"
          f"{', packed' if args.packed else ''}, {args.steps} steps ({args.warmup} warm-up left out)")
    print(f"{'feeder':<12}{'first batch s':>14}{'wait ms':>10}{'step ms':>10}{'wait ratio':>12}"
          f"{'samples/s':>11}{'loss first':>12}{'loss last':>11}{'GPU util %':>12}")
    for name, r in results.items():
        util = "-" if r["gpu_util"] is None else f"{r['gpu_util']:.0f}"
        print(f"{name:<12}{r['first_batch_s']:>14.2f}{r['wait_ms']:>10.1f}{r['step_ms']:>10.1f}"
              f"{r['wait_ratio']:>12.3f}{r['samples_per_s']:>11.1f}{r['loss_first']:>12.4f}"
              f"{r['loss_last']:>11.4f}{util:>12}")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "device": args.device, "batch": args.batch,
                                         "packed": args.packed, "feeders": results}) + "\n")


if __name__ == "__main__":
    main()
