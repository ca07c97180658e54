"""Model-parallel trainers: the ranks of one replica get byte-identical batches, the
data-parallel coordinate alone picks the slice (DeviceMesh-aware loader, gloo processes)."""

import json
import pathlib

import numpy as np
import pytest

import stoker
from conftest import launch, packed_worker
from stoker.replica import replica_in_mesh

RANK_SCRIPT = pathlib.Path(__file__).with_name("replica_rank.py")


def test_the_replica_spans_every_dimension_but_the_data_parallel_ones():
    # pp x dp x tp, as init_device_mesh lays ranks out.
    mesh = np.arange(8).reshape(2, 2, 2)
    r = replica_in_mesh(mesh, ("pp", "dp", "tp"), ("dp",), 5)  # coordinate (1, 0, 1)
    assert (r.dp_rank, r.dp_size, r.ranks, r.leader) == (0, 2, (0, 1, 4, 5), 0)
    assert replica_in_mesh(mesh, ("pp", "dp", "tp"), ("dp",), 6).ranks == (2, 3, 6, 7)
    # HSDP: two data-parallel dimensions, flattened in the order given.
    mesh = np.arange(8).reshape(2, 2, 2)
    names = ("dp_replicate", "dp_shard", "tp")
    assert replica_in_mesh(mesh, names, ("dp_replicate", "dp_shard"), 6).dp_rank == 3
    assert replica_in_mesh(mesh, names, ("dp_shard", "dp_replicate"), 6).dp_rank == 3
    # Rank 2 is at (dp_replicate 0, dp_shard 1).
    assert replica_in_mesh(mesh, names, ("dp_replicate", "dp_shard"), 2).dp_rank == 1
    assert replica_in_mesh(mesh, names, ("dp_shard", "dp_replicate"), 2).dp_rank == 2
    # Pure data parallelism: every rank is its own replica.
    r = replica_in_mesh(np.arange(4), ("dp",), ("dp",), 3)
    assert (r.dp_rank, r.dp_size, r.ranks) == (3, 4, (3,))
    with pytest.raises(stoker.ConfigError, match="dp_dims"):
        replica_in_mesh(mesh, names, ("dp",), 0)
    with pytest.raises(stoker.ConfigError, match="dp_dims"):
        replica_in_mesh(mesh, names, ("tp", "tp"), 0)
    with pytest.raises(stoker.ConfigError, match="not in the mesh"):
        replica_in_mesh(mesh, names, ("tp",), 9)
    with pytest.raises(stoker.ConfigError, match="mesh_dim_names"):
        replica_in_mesh(mesh, None, ("dp",), 0)


def test_a_replica_is_given_one_way(worker):
    w = worker()
    with pytest.raises(stoker.ConfigError, match="not rank/world_size and dp_rank/dp_size"):
        stoker.Loader(w.addr, rank=0, world_size=2, dp_rank=0, dp_size=2)
    with pytest.raises(stoker.ConfigError, match="dp_rank and dp_size together"):
        stoker.Loader(w.addr, dp_rank=0)
    with pytest.raises(stoker.ConfigError, match="give mesh= too"):
        stoker.Loader(w.addr, dp_dims=("dp",))
    with pytest.raises(stoker.ConfigError, match="replica_reads"):
        stoker.Loader(w.addr, replica_reads="all")
    # Without a group, a process given its slice reads it itself.
    loader = stoker.Loader(w.addr, dp_rank=1, dp_size=2)
    assert (loader.rank, loader.world_size) == (1, 2)
    assert next(loader).sample_ids == next(stoker.Loader(w.addr, rank=1, world_size=2)).sample_ids


def test_packs_padded_for_context_parallelism_keep_each_sample_as_it_was(worker, dataset):
    w = packed_worker(worker, dataset)
    batch = next(stoker.Loader(w.addr))
    plain = batch.packs()
    padded = batch.packs(pad_to_multiple_of=8, shift_labels=True)
    assert "shift_labels" not in plain
    grew = 0
    for p, q in zip(plain, padded):
        t, u = p["input_ids"].shape[1], q["input_ids"].shape[1]
        assert u % 8 == 0 and t <= u < t + 8
        grew += u - t
        # The samples are untouched; the padding is a sample of its own that nothing learns.
        assert np.array_equal(q["input_ids"][:, :t], p["input_ids"])
        assert np.array_equal(q["labels"][:, :t], p["labels"])
        assert np.array_equal(q["position_ids"][:, :, :t], p["position_ids"])
        assert (q["input_ids"][:, t:] == stoker.PAD_TOKEN_ID).all()
        assert (q["labels"][:, t:] == -100).all()
        assert (q["position_ids"][:, 0, t:] == np.arange(u - t)).all()
        expect_cu = list(p["cu_seq_lens_q"]) + ([u] if u > t else [])
        assert list(q["cu_seq_lens_q"]) == expect_cu and list(q["cu_seq_lens_k"]) == expect_cu
        assert q["max_length_q"] == max(p["max_length_q"], u - t)
        # Each position's target is the next token's label; a sample's last token has none.
        shifted = q["shift_labels"][0]
        assert list(shifted[:-1]) == list(q["labels"][0, 1:]) and shifted[-1] == -100
        for end in q["cu_seq_lens_q"][1:]:
            assert shifted[end - 1] == -100
    assert grew > 0  # the check can fail: some pack was not a multiple of 8
    with pytest.raises(stoker.ConfigError, match="pad_to_multiple_of"):
        batch.packs(pad_to_multiple_of=0)
    assert list(stoker.shifted_labels(np.array([[-100, 5, 6], [1, 2, -100]]))[1]) == [2, -100, -100]


def by_global_batch(ranks, dp_size):
    """Sorted sample ids of each global batch, over the dp ranks."""
    heads = [r for r in ranks if r["rank"] == r["replica"][0]] if len(ranks) > dp_size else ranks
    assert sorted(r["dp_rank"] for r in heads) == list(range(dp_size))
    union = {}
    for r in heads:
        for b in r["batches"]:
            union.setdefault((b["epoch"], b["global_batch"]), []).extend(b["sample_ids"])
    return {k: sorted(v) for k, v in union.items()}


@pytest.mark.parametrize("reads", ["leader", "each"])
def test_dp2_by_cp2_replicas_get_identical_batches_and_dp_alone_splits_them(worker, dataset, tmp_path, torch, reads):
    from replica_rank import PAD_TO, digest

    w = packed_worker(worker, dataset)
    ranks = launch(tmp_path, "mesh", 4, RANK_SCRIPT, addr=w.addr, shape=[2, 2], names=["dp", "cp"], dp_dims=["dp"], reads=reads)
    assert [(r["dp_rank"], r["replica"]) for r in ranks] == [(0, [0, 1]), (0, [0, 1]), (1, [2, 3]), (1, [2, 3])]
    for a, b in (ranks[0:2], ranks[2:4]):
        assert len(a["batches"]) == 5
        assert a["batches"] == b["batches"]  # sample ids and digests of tensors and padded packs
        assert a["state"] == b["state"]
    assert [r["refused"] for r in ranks] == ["PlanMismatch"] * 4
    if reads == "leader":
        # Only the leader holds worker connections (and serves metrics).
        assert ranks[1]["stats"]["batches"] == 5 and ranks[1]["metrics_addr"] is None
    # Each replica's batches are byte for byte those of a plain two-rank data-parallel run.
    for dp in range(2):
        alone = [digest(b, PAD_TO) for b in stoker.Loader(w.addr, rank=dp, world_size=2)]
        assert [b["digest"] for b in ranks[2 * dp]["batches"]] == alone
    # And together they are the whole global batch.
    reference = {(b.epoch, b.global_batch): sorted(b.sample_ids) for b in stoker.Loader(w.addr)}
    assert by_global_batch(ranks, 2) == reference


def test_a_dp2_by_cp2_run_resumes_at_dp4_with_the_same_global_batches(worker, dataset, tmp_path, torch):
    w = packed_worker(worker, dataset)
    first = launch(tmp_path, "before", 4, RANK_SCRIPT, addr=w.addr, shape=[2, 2], names=["dp", "cp"], dp_dims=["dp"],
                   reads="leader", batches=2)
    states = {json.dumps(r["state"], sort_keys=True) for r in first}
    assert len(states) == 1  # every rank saves the same position
    state = first[0]["state"]
    assert (state["epoch"], state["next_batch"]) == (0, 2)
    after = launch(tmp_path, "after", 4, RANK_SCRIPT, addr=w.addr, shape=[4], names=["dp"], dp_dims=["dp"],
                   reads="leader", state=state)
    reference = {(b.epoch, b.global_batch): sorted(b.sample_ids) for b in stoker.Loader(w.addr)}
    got = {**by_global_batch(first, 2), **by_global_batch(after, 4)}
    assert got == reference


def test_shifted_labels_give_transformers_own_loss(torch):
    from transformers.loss.loss_utils import ForCausalLMLoss

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=gen)
    labels = torch.randint(0, 11, (2, 7), generator=gen)
    labels[:, :2] = -100
    shifted = torch.from_numpy(stoker.shifted_labels(labels.numpy()))
    own = ForCausalLMLoss(logits, labels, 11)
    given = ForCausalLMLoss(logits, None, 11, shift_labels=shifted)
    assert torch.equal(own, given)
