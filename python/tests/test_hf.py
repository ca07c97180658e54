"""What `stoker.hf` refuses when resuming: a checkpoint without the loader's state, or whose
ranks' states disagree (each must name the same global position)."""

import json

import pytest

pytest.importorskip("transformers")
from stoker import ConfigError  # noqa: E402
from stoker.hf import load_checkpoint_state  # noqa: E402

STATE = {"version": 1, "plan_id": 7, "epoch": 1, "next_batch": 2}


def test_a_checkpoint_without_the_loaders_state_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no stoker_state_rank"):
        load_checkpoint_state(str(tmp_path))


def test_every_ranks_state_must_agree(tmp_path):
    for rank in range(3):
        (tmp_path / f"stoker_state_rank{rank}.json").write_text(json.dumps(STATE))
    assert load_checkpoint_state(str(tmp_path)) == STATE
    (tmp_path / "stoker_state_rank2.json").write_text(json.dumps({**STATE, "next_batch": 3}))
    with pytest.raises(ConfigError, match="stoker_state_rank2.json says"):
        load_checkpoint_state(str(tmp_path))


def test_a_callback_alone_refuses_to_train_on_other_data(tmp_path):
    """StokerCallback in a Trainer that was not attached stops the run at its start, naming
    what to do, rather than train on the Trainer's own dataset."""
    import torch
    from transformers import Trainer, TrainingArguments

    from stoker.hf import StokerCallback

    class Regression(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(1, 1)

        def forward(self, x, labels):
            return {"loss": ((self.w(x) - labels) ** 2).mean()}

    data = [{"x": torch.ones(1), "labels": torch.zeros(1)}] * 4
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True)
    trainer = Trainer(model=Regression(), args=args, train_dataset=data, callbacks=[StokerCallback(loader=None)])
    with pytest.raises(ConfigError, match=r"stoker.hf.attach\(trainer, loader\)"):
        trainer.train()


def test_with_stoker_derives_one_class_and_leaves_the_class_as_it_is():
    from transformers import Seq2SeqTrainer

    from stoker.hf import StokerTrainerMixin, with_stoker

    fed = with_stoker(Seq2SeqTrainer)
    assert fed is with_stoker(Seq2SeqTrainer) and fed.__name__ == "StokerSeq2SeqTrainer"
    assert fed.__mro__[1:3] == (StokerTrainerMixin, Seq2SeqTrainer)
    assert not issubclass(Seq2SeqTrainer, StokerTrainerMixin)
    with pytest.raises(ConfigError, match="is not a transformers.Trainer"):
        with_stoker(dict)
