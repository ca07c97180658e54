"""stoker.megatron against Megatron-Core's own parallel state and types (gloo, CPU): the
iterators on Megatron's data ranks, one slice per data-parallel rank, THD packs, exact resume."""

import json
import os
import pathlib
from types import SimpleNamespace

import numpy as np
import pytest

import stoker
from conftest import launch, packed_worker

try:
    import torch
    import megatron.core  # noqa: F401
except ImportError as e:
    # scripts/test.sh installs both and sets STOKER_REQUIRE_TORCH=1: there, missing fails.
    if os.environ.get("STOKER_REQUIRE_TORCH"):
        raise
    pytest.skip(f"torch and megatron-core are needed: {e}", allow_module_level=True)
import stoker.megatron as sm  # noqa: E402

RANK_SCRIPT = pathlib.Path(__file__).with_name("megatron_rank.py")


def test_data_is_read_on_tensor_rank_0_of_the_first_and_last_stages():
    def state(tp, first, last):
        return SimpleNamespace(get_tensor_model_parallel_rank=lambda: tp,
                               is_pipeline_first_stage=lambda ignore_virtual: first,
                               is_pipeline_last_stage=lambda ignore_virtual: last)

    assert sm.is_dataloader_rank(state(0, True, False))
    assert sm.is_dataloader_rank(state(0, False, True))
    assert not sm.is_dataloader_rank(state(0, False, False))  # a middle stage
    assert not sm.is_dataloader_rank(state(1, True, True))
    with pytest.raises(stoker.ConfigError, match="parallel state"):
        sm.dataloaders_provider("127.0.0.1:1", rank=0)



def test_packs_become_thd_micro_batches_padded_per_sample_and_resume_inside_a_batch(worker, dataset):
    w = packed_worker(worker, dataset, max_tokens=512)
    cp = 2
    reference = [p for b in stoker.Loader(w.addr) for p in b.packs(device="cpu")]
    it = sm.MegatronIterator(stoker.Loader(w.addr), context_parallel_size=cp)
    got = [next(it) for _ in range(len(reference) + 2)]  # and on into the next epoch
    for mb, pack in zip(got, reference):
        bounds = pack["cu_seq_lens_q"].tolist()
        lengths, padded = np.diff(bounds), np.diff(mb["cu_seqlens_padded"].numpy())
        assert mb["cu_seqlens"].tolist() == bounds
        assert (padded % (2 * cp) == 0).all() and (padded >= lengths).all() and (padded < lengths + 2 * cp).all()
        assert mb["tokens"].shape == (1, int(mb["cu_seqlens_padded"][-1]))
        assert int(mb["max_seqlen"][0]) == padded.max()
        # Each sample where the padded layout puts it, its labels shifted within it.
        shifted = stoker.shifted_labels(pack["labels"].numpy())[0]
        ids = pack["input_ids"].numpy()[0]
        for lo, hi, start, span in zip(bounds, bounds[1:], mb["cu_seqlens_padded"].tolist(), padded):
            n = hi - lo
            assert mb["tokens"][0, start:start + n].tolist() == ids[lo:hi].tolist()
            mask = mb["loss_mask"][0, start:start + span].numpy()
            assert mask.tolist() == np.concatenate([shifted[lo:hi] != -100, np.zeros(span - n, bool)]).tolist()
            learnt = mask == 1
            assert (mb["labels"][0, start:start + n].numpy()[learnt[:n]] == shifted[lo:hi][learnt[:n]]).all()
            assert mb["position_ids"][0, start:start + span].tolist() == list(range(span))
        assert (mb["labels"] >= 0).all()  # a valid id everywhere: Megatron's loss indexes each
        assert torch.equal(mb["pixel_values"], pack["pixel_values"])
        assert torch.equal(mb["image_grid_thw"], pack["image_grid_thw"])
        params = sm.packed_seq_params(mb)
        assert params.qkv_format == "thd" and params.max_seqlen_q == int(mb["max_seqlen"][0])
        assert torch.equal(params.cu_seqlens_q, mb["cu_seqlens"]) and torch.equal(params.cu_seqlens_kv_padded, mb["cu_seqlens_padded"])
    assert sum(int(mb["loss_mask"].sum()) for mb in got[:len(reference)]) == \
        sum(int((stoker.shifted_labels(p["labels"].numpy()) != -100).sum()) for p in reference)

    # A checkpoint inside a packed batch (after its first pack) resumes at its second pack,
    # also through a save taken right after the restore.
    it = sm.MegatronIterator(stoker.Loader(w.addr), context_parallel_size=cp)
    next(it)
    state = json.loads(json.dumps(it.save_state()))
    assert state["micro_batches"] == 1 and state["loader"]["next_batch"] == 0
    resumed = sm.MegatronIterator(stoker.Loader(w.addr), context_parallel_size=cp)
    resumed.restore_state(state)
    assert resumed.save_state() == state
    for want in got[1:6]:
        mb = next(resumed)
        assert all(torch.equal(mb[k], want[k]) for k in want)


def test_a_megatron_job_reads_on_its_data_ranks_one_slice_per_data_parallel_rank(worker, dataset, tmp_path):
    w = worker()
    # tp=2 x cp=2 x dp=2 on 8 processes: data on tensor-parallel rank 0; both context-parallel
    # ranks of a data-parallel rank read the same slice (its lowest reads, then broadcasts).
    ranks = launch(tmp_path, "mlm", 8, RANK_SCRIPT, addr=w.addr, tp=2, pp=1, cp=2,
                   micro_batches=4, save_at=2)
    readers = [r for r in ranks if r["reads"]]
    assert [r["rank"] for r in readers] == [r["rank"] for r in ranks if r["tp"] == 0] and len(readers) == 4
    assert all(r["others"] == [None, None] for r in ranks)
    by_dp = {}
    for r in readers:
        by_dp.setdefault(r["dp"], []).append(r)
    assert sorted(by_dp) == [0, 1]
    for dp, (a, b) in by_dp.items():
        assert [m["digest"] for m in a["micro_batches"]] == [m["digest"] for m in b["micro_batches"]]
        assert a["state"] == b["state"]
        # Each slice is a plain two-rank run's.
        alone = sm.MegatronIterator(stoker.Loader(w.addr, rank=dp, world_size=2), context_parallel_size=2)
        assert [m["tokens"] for m in a["micro_batches"]] == [next(alone)["tokens"].tolist() for _ in range(4)]
        # Megatron's context-parallel split: rank 0 keeps chunks 0 and 3 of 4, rank 1 chunks 1 and 2.
        for ma, mb in zip(a["micro_batches"], b["micro_batches"]):
            full = np.array(ma["tokens"])
            chunks = np.split(full, 4, axis=1)
            mine = {x["cp"]: np.array(m["cp_tokens"]) for x, m in ((a, ma), (b, mb))}
            assert np.array_equal(mine[0], np.concatenate([chunks[0], chunks[3]], axis=1))
            assert np.array_equal(mine[1], np.concatenate([chunks[1], chunks[2]], axis=1))
    # Resumed from the state saved before the third micro-batch, on dp=4 (tp=2): the same
    # global batches go on.
    state = readers[0]["state"]
    after = launch(tmp_path, "mlm-after", 8, RANK_SCRIPT, addr=w.addr, tp=2, pp=1, cp=1,
                   micro_batches=2, state=state)
    got = {r["dp"]: [m["tokens"] for m in r["micro_batches"]] for r in after if r["reads"]}
    assert sorted(got) == [0, 1, 2, 3]
    for dp, tokens in got.items():
        it = sm.MegatronIterator(stoker.Loader(w.addr, rank=dp, world_size=4, state=state["loader"]))
        assert tokens == [next(it)["tokens"].tolist() for _ in range(2)]
