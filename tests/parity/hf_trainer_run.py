"""One rank of a Stoker-fed Hugging Face Trainer run (examples/hf_trainer.py's `train`, started
under torchrun by tests/parity/test_hf_trainer.py), or with `--readme` the README's loop on the
same batches in one process. Both train the tiny Qwen2-VL of benches/train_step.py from the
same weights with the same optimizer (AdamW, constant learning rate, no clipping) and write
one JSON line per optimizer step to OUT/record-rank{r}.jsonl: its sample ids (one list per
micro-batch) and, on rank 0, its loss. `--kill-at N` ends the process after step N is logged,
before anything else is saved, as a preempted job ends. `--form attach` trains through
examples/hf_trainer.py's `train_existing` instead: a stand-in for LLaMA-Factory's trainer,
built as LLaMA-Factory builds it, then attached."""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, TrainerCallback

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benches"))
sys.path.insert(0, str(ROOT / "examples"))
import hf_trainer  # noqa: E402
import stoker  # noqa: E402
import stoker.torch  # noqa: E402
from train_step import new_model  # noqa: E402


class Record(TrainerCallback):
    def __init__(self, path: Path, kill_at: int) -> None:
        self.path, self.kill_at = path, kill_at
        self.step = None

    def on_step_end(self, args, state, control, train_dataloader=None, **kwargs):
        self.step = {"step": state.global_step, "sample_ids": train_dataloader.dataset.take_sample_ids()}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.step is None or "loss" not in (logs or {}):
            return
        write(self.path, {**self.step, "loss": logs["loss"]})
        self.step = None
        if state.global_step == self.kill_at:
            os._exit(3)


class CustomSeq2SeqTrainer(Seq2SeqTrainer):
    """A stand-in for LLaMA-Factory's trainer of this name (llamafactory/train/sft/trainer.py;
    LLaMA-Factory is not in the test venv): a Seq2SeqTrainer subclass taking arguments of its
    own and a dataset of its own, with its own sampler and loss."""

    def __init__(self, finetuning_args, processor, **kwargs):
        super().__init__(**kwargs)
        self.finetuning_args = finetuning_args
        self.processor = processor

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)

    def compute_loss(self, model, inputs, *args, **kwargs):
        return super().compute_loss(model, inputs, *args, **kwargs)


def write(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def readme_loop(workers: str, steps: int, accumulation: int, path: Path) -> None:
    """The README's loop (world size 1), with `accumulation` batches per optimizer step; with
    several forwards per step (packs, accumulation) the loss is each forward's mean token loss
    weighted by its label tokens over all the step's label tokens (the Trainer's
    `num_items_in_batch` rule)."""
    device = torch.device("cpu")
    model, optimizer = new_model("tiny", device)
    loader = stoker.Loader(workers, rank=0, world_size=1)
    image_token = model.config.image_token_id
    batches = iter(())
    for step in range(1, steps + 1):
        ids, losses = [], []
        for _ in range(accumulation):
            batch = next(batches, None)
            if batch is None:
                batches = iter(loader)  # the next epoch
                batch = next(batches)
            ids.append(batch.sample_ids)
            if batch.packed:
                forwards = batch.packs(device)
            else:
                forwards = [stoker.torch.model_inputs(batch, device, image_token_id=image_token)]
            losses += [(model(**f).loss, int((f["labels"][..., 1:] != -100).sum())) for f in forwards]
        if len(losses) == 1:
            loss = losses[0][0]  # the README's loop as it is
        else:
            loss = sum(mean * n for mean, n in losses) / sum(n for _, n in losses)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        write(path, {"step": step, "sample_ids": ids, "loss": float(loss)})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--resume", default=None, help="a checkpoint folder")
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--readme", action="store_true")
    p.add_argument("--form", choices=("class", "attach"), default="class")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", 0))
    record = a.out / f"record-rank{rank}.jsonl"
    if a.readme:
        return readme_loop(a.workers, a.steps, a.accumulation, record)
    model, optimizer = new_model("tiny", torch.device("cpu"))
    callbacks, optimizers = [Record(record, a.kill_at)], (optimizer, None)
    training = dict(
        lr_scheduler_type="constant", max_grad_norm=0.0, use_cpu=True, logging_steps=1,
        save_steps=a.save_steps, gradient_accumulation_steps=a.accumulation, disable_tqdm=True,
    )
    if a.form == "class":
        hf_trainer.train(a.workers, model, str(a.out / "ckpt"), a.steps, resume=a.resume, callbacks=callbacks,
                         optimizers=optimizers, **training)
        return hf_trainer.end_process_group()
    args = Seq2SeqTrainingArguments(output_dir=str(a.out / "ckpt"), max_steps=a.steps, report_to="none", **training)
    own_dataset = [{"input_ids": [0], "labels": [0]}]  # what LLaMA-Factory would have tokenized
    trainer = CustomSeq2SeqTrainer(finetuning_args=argparse.Namespace(), processor=None, model=model, args=args,
                                   train_dataset=own_dataset, callbacks=callbacks, optimizers=optimizers)
    hf_trainer.train_existing(trainer, a.workers, resume=a.resume)
    hf_trainer.end_process_group()


if __name__ == "__main__":
    main()
    # Training and its records are done; C++ threads of torch's can still abort the
    # interpreter's teardown now and then (SIGABRT after a successful run, seen under load
    # even with the process group ended), which is not what this test checks.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
