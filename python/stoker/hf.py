"""The Hugging Face ``Trainer`` fed by Stoker: every rank its own stream, exact resume.

    import stoker, stoker.hf
    loader = stoker.Loader("dns:my-pipeline-workers.ns.svc:7700")   # rank from torchrun
    trainer = stoker.hf.StokerTrainer(model=model, args=args, loader=loader)
    trainer.train(resume_from_checkpoint=resume)                       # None, True or a path

A Trainer subclass built by other code (LLaMA-Factory's ``CustomSeq2SeqTrainer``, ms-swift's
trainers) is fed as it is, its class unchanged: ``stoker.hf.attach(trainer, loader)`` after
it is built. No ``TrainerCallback`` can do this alone: the Trainer builds its dataloader before
any callback event and hands callbacks no handle on itself, so :class:`StokerCallback` in a
Trainer that was not attached refuses to start rather than train on other data.

Each rank reads its own slice of every global batch from the workers: the dataloader is not
handed to ``accelerator.prepare`` (no rank-0 read-and-broadcast, no rank reading everything to
keep 1/N). One Stoker batch is one micro-batch: ``gradient_accumulation_steps`` of them make an
optimizer step, and the Trainer's length is the plan's batches per epoch. Plain batches reach
``model(**inputs)`` as :func:`stoker.torch.model_inputs` builds them on ``args.device``; a packed
batch (``--pack-max-tokens``) runs one forward and backward per pack, its loss normalised by the
label tokens of every pack of the optimizer step on every rank (the Trainer's
``num_items_in_batch``, as for plain batches). Every checkpoint gets each rank's loader state,
``checkpoint-N/stoker_state_rank{r}.json``; ``resume_from_checkpoint`` restores it, so the
Trainer's skip of the batches already trained reads nothing, at any world size.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import math
import os
from typing import Any, Dict, Iterator, List, Optional

import torch
from transformers import PreTrainedModel, Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from . import Batch, ConfigError, Loader, StokerError
from .torch import model_inputs

__all__ = [
    "StokerTrainer",
    "StokerTrainerMixin",
    "StokerCallback",
    "StokerStream",
    "STATE_FILE",
    "attach",
    "with_stoker",
]

# Each rank's loader state in a checkpoint folder (beside the Trainer's rng_state_{rank}.pth).
STATE_FILE = "stoker_state_rank{rank}.json"


class StokerStream(torch.utils.data.IterableDataset):
    """One epoch of the loader's batches per iteration, each as the model's keyword arguments.

    After a resume the first ``resume_skip`` items are ``None``: stand-ins for the batches
    trained before the checkpoint, which the Trainer skips (``skip_first_batches``) while the
    loader, restored from the checkpoint, already stands after them: nothing is read twice.
    """

    def __init__(self, loader: Loader, to_inputs) -> None:
        super().__init__()
        self.loader = loader
        self.to_inputs = to_inputs
        self.resume_skip = 0
        self._sample_ids: List[List[int]] = []

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Optional[Dict[str, Any]]]:
        skip, self.resume_skip = self.resume_skip, 0
        for _ in range(skip):
            yield None
        per_epoch = len(self.loader)
        for at in range(self.loader.state_dict()["next_batch"], per_epoch):
            batch = next(self.loader)
            if at == per_epoch - 1 and next(self.loader, None) is not None:
                # The loader ends each epoch with one StopIteration, taken here: the Trainer
                # stops asking after the epoch's last batch.
                raise StokerError("the loader went past the end of an epoch")
            # Bounded: a caller that never takes them keeps the last few steps' worth.
            del self._sample_ids[:-1024]
            self._sample_ids.append(list(batch.sample_ids))
            yield self.to_inputs(batch)

    def take_sample_ids(self) -> List[List[int]]:
        """The sample ids of each micro-batch handed to the Trainer since the last call (a
        logging callback calls it in ``on_step_end``)."""
        taken, self._sample_ids = self._sample_ids, []
        return taken


class StokerCallback(TrainerCallback):
    """Saves the loader's state into every checkpoint the Trainer writes (``on_save``), as
    ``checkpoint-N/stoker_state_rank{r}.json`` on each rank. The mixin and :func:`attach`
    add it; in a Trainer neither fed, it stops the run at its start."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        if not isinstance(getattr(train_dataloader, "dataset", None), StokerStream):
            raise ConfigError(
                "StokerCallback is in the Trainer's callbacks but the Trainer does not read the "
                "Stoker loader (a callback cannot feed it): build it as stoker.hf.StokerTrainer, "
                "or call stoker.hf.attach(trainer, loader) once it is built"
            )

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        # Per process: the ranks of one model replica share a data-parallel rank.
        path = os.path.join(folder, STATE_FILE.format(rank=args.process_index))
        with open(path + ".tmp", "w") as f:
            json.dump(self.loader.state_dict(), f)
        os.replace(path + ".tmp", path)


def load_checkpoint_state(checkpoint: str) -> Dict[str, Any]:
    """The loader state saved in ``checkpoint``: every rank's file there must agree (each
    names the same global position, whatever the world size that wrote it)."""
    files = sorted(glob.glob(os.path.join(checkpoint, STATE_FILE.format(rank="*"))))
    if not files:
        raise ConfigError(
            f"{checkpoint}: no {STATE_FILE.format(rank='*')}: the checkpoint was not written by a "
            "Stoker-fed Trainer, so where its data stopped is unknown"
        )
    states = {}
    for path in files:
        with open(path) as f:
            states[path] = json.load(f)
    first = states[files[0]]
    differ = [p for p, s in states.items() if s != first]
    if differ:
        raise ConfigError(f"{checkpoint}: {files[0]} says {first} but {differ[0]} says {states[differ[0]]}")
    return first


class StokerTrainerMixin:
    """Put before ``Trainer`` (or a subclass of it) in the bases: ``class MyTrainer(StokerTrainerMixin,
    Seq2SeqTrainer)``; takes ``loader=`` besides the Trainer's own arguments. The training data
    is the loader's; ``train_dataset`` is not needed."""

    def __init__(self, *args: Any, loader: Loader, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stoker_setup(loader)

    def _stoker_setup(self, loader: Loader) -> None:
        self.stoker_loader = loader
        self.stoker_stream: Optional[StokerStream] = None
        self._stoker_resume: Optional[str] = None
        self.add_callback(StokerCallback(loader))

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any):
        # The Trainer's own rule for `True`: the last checkpoint in output_dir.
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        self._stoker_resume = resume_from_checkpoint or None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        stream = StokerStream(self.stoker_loader, self._stoker_inputs)
        if self._stoker_resume is not None:
            stream.resume_skip = self._stoker_restore(self._stoker_resume)
        self.stoker_stream = stream
        # Not through accelerator.prepare: each rank's loader already reads its own slice.
        return torch.utils.data.DataLoader(stream, batch_size=None, num_workers=0, collate_fn=_as_is)

    def num_examples(self, dataloader) -> int:
        if isinstance(getattr(dataloader, "dataset", None), StokerStream):
            return int(self.stoker_loader.plan["num_samples"])
        return super().num_examples(dataloader)

    def training_step(self, model, inputs, num_items_in_batch=None):
        packs = inputs.get("packs") if isinstance(inputs, dict) else None
        if packs is None:
            return super().training_step(model, inputs, num_items_in_batch)
        # One forward and backward per pack (activations of one pack at a time); gradients are
        # synchronised once, with the last pack's backward.
        losses = []
        for i, pack in enumerate(packs):
            last = i == len(packs) - 1
            with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
                losses.append(super().training_step(model, pack, num_items_in_batch))
        return torch.stack(losses).sum()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        model = self.model if model is None else model
        if not isinstance(model, PreTrainedModel) or self.is_fsdp_enabled or self.is_deepspeed_enabled:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # The weights as from_pretrained reads them: save_pretrained writes some models (Qwen-VL
        # among them) in their checkpoint layout, which the Trainer's own resume loads as it is
        # (transformers 5.23), leaving every weight at its initial value with a warning.
        saved = type(model).from_pretrained(resume_from_checkpoint, dtype=model.dtype)
        model.load_state_dict(saved.state_dict())

    def _stoker_inputs(self, batch: Batch) -> Dict[str, Any]:
        device = self.args.device
        pixel_dtype = "bfloat16" if getattr(self.model, "dtype", None) == torch.bfloat16 else "float32"
        if batch.packed:
            # `labels` lets the Trainer count the step's label tokens; `input_ids` its tokens seen.
            return {
                "packs": batch.packs(device, pixel_dtype=pixel_dtype),
                "labels": torch.from_numpy(batch["labels"]).to(device),
                "input_ids": torch.from_numpy(batch["input_ids"]).to(device),
            }
        config = self.model.config
        return model_inputs(
            batch,
            device,
            image_token_id=config.image_token_id,
            video_token_id=getattr(config, "video_token_id", None),
            pixel_dtype=pixel_dtype,
        )

    def _stoker_restore(self, checkpoint: str) -> int:
        """Restores the loader from ``checkpoint``; returns how many batches of the current
        epoch the Trainer will skip, after checking that they are the ones the loader has
        already handed out."""
        state = load_checkpoint_state(checkpoint)
        self.stoker_loader.load_state_dict(state)
        with open(os.path.join(checkpoint, "trainer_state.json")) as f:
            global_step = int(json.load(f)["global_step"])
        if self.args.ignore_data_skip:
            return 0  # the Trainer skips nothing; the loader continues where it stopped
        per_epoch = len(self.stoker_loader)
        accumulation = self.args.gradient_accumulation_steps
        steps_per_epoch = max(math.ceil(per_epoch / accumulation), 1)
        epoch, skip = divmod(global_step, steps_per_epoch)
        skip *= accumulation
        at = (state["epoch"], state["next_batch"])
        if at != (epoch, skip):
            raise ConfigError(
                f"{checkpoint}: the Trainer stopped after step {global_step}, batch {skip} of epoch "
                f"{epoch} ({accumulation} batches per step, {per_epoch} per epoch), but the Stoker "
                f"state stands at batch {at[1]} of epoch {at[0]}: was gradient_accumulation_steps "
                "or the global batch size changed?"
            )
        return skip


class StokerTrainer(StokerTrainerMixin, Trainer):
    """``transformers.Trainer`` fed by a :class:`stoker.Loader` (see the module's doc)."""


@functools.lru_cache(maxsize=None)
def with_stoker(trainer_class: type) -> type:
    """``trainer_class`` with :class:`StokerTrainerMixin` first in its bases (one class per
    ``trainer_class``); the class itself is left as it is."""
    if not issubclass(trainer_class, Trainer):
        raise ConfigError(f"{trainer_class.__qualname__} is not a transformers.Trainer")
    if issubclass(trainer_class, StokerTrainerMixin):
        return trainer_class
    return type(f"Stoker{trainer_class.__name__}", (StokerTrainerMixin, trainer_class), {})


def attach(trainer: Trainer, loader: Loader) -> Trainer:
    """Feeds ``trainer``, an instance of any Trainer subclass built by its own code, from
    ``loader``: it becomes an instance of :func:`with_stoker` of its class (every method of
    its class still applies) and trains, saves and resumes as :class:`StokerTrainer` does. Call
    it before ``trainer.train``; the ``train_dataset`` it was built with is not read."""
    if isinstance(trainer, StokerTrainerMixin):
        raise ConfigError(f"this {type(trainer).__name__} is already fed by a Stoker loader")
    trainer.__class__ = with_stoker(type(trainer))
    trainer._stoker_setup(loader)
    return trainer


def _as_is(item: Any) -> Any:
    return item
