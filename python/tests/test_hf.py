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
