"""The Hugging Face Trainer fed by Stoker (docs/client.md, "With your trainer").

    torchrun --nproc_per_node 8 examples/hf_trainer.py --workers dns:my-pipeline-workers.ns.svc:7700 \
        --model Qwen/Qwen2-VL-2B-Instruct --output-dir ckpt --max-steps 1000 [--resume]

Each rank reads its own slice of every global batch from the workers; every checkpoint holds
each rank's loader state, and `--resume` continues from the last one exactly, at any world size.
`train_existing` feeds a Trainer subclass that other code builds (LLaMA-Factory's, ms-swift's)
without changing its class. tests/parity/test_hf_trainer.py runs both (two and three processes
on the CPU).
"""

import argparse

from transformers import TrainingArguments

import stoker
import stoker.hf


def train(workers, model, output_dir, max_steps, resume=None, callbacks=(), optimizers=(None, None), **training):
    args = TrainingArguments(output_dir=output_dir, max_steps=max_steps, report_to="none", **training)
    loader = stoker.Loader(workers)            # rank and world size from torchrun's RANK, WORLD_SIZE
    trainer = stoker.hf.StokerTrainer(model=model, args=args, loader=loader,
                                      callbacks=list(callbacks), optimizers=optimizers)
    return trainer.train(resume_from_checkpoint=resume)  # None, True (the last checkpoint) or a path


def train_existing(trainer, workers, resume=None):
    # `trainer` as its own code builds it: LLaMA-Factory's CustomSeq2SeqTrainer, ms-swift's trainers
    stoker.hf.attach(trainer, stoker.Loader(workers))  # its class unchanged; its train_dataset unread
    return trainer.train(resume_from_checkpoint=resume)


def end_process_group() -> None:
    # Call once training is over: a process that exits with its Gloo process group alive can
    # abort (SIGABRT) in the interpreter's teardown, after a run that succeeded. The Trainer's
    # DDP wrapper holds the group too: collect it first, while the interpreter is whole.
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", required=True, help="dns:HOST:PORT or HOST:PORT,HOST:PORT")
    p.add_argument("--model", required=True, help="a Qwen-VL checkpoint (Hub id or folder)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--save-steps", type=int, default=500)
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output-dir")
    a = p.parse_args()
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(a.model, dtype="auto")
    train(a.workers, model, a.output_dir, a.max_steps, resume=a.resume or None,
          save_steps=a.save_steps, bf16=model.dtype == torch.bfloat16)
    end_process_group()


if __name__ == "__main__":
    main()
