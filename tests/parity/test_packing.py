"""Packed batches (`--pack-max-tokens`) against unpacked ones and against the model's own rope.

Two ranks read one epoch from a packing worker; a plain worker of the same dataset serves the
same samples one per row. Every sample arrives once, every rank gets as many packs per global
batch, each pack fits, and each sample inside a pack is the plain sample token for token and
pixel for pixel, its first label ignored and its text positions restarting at 0. Its three
rope rows are what transformers' Qwen2-VL `get_rope_index` gives for that sample alone, and a
tiny Qwen2-VL's forward of a whole pack gives each sample the hidden states of its own
forward (both where torch is installed; without it the worker's unit test holds the rope rows
to a fixture the first test writes, `STOKER_WRITE_ROPE_FIXTURE=path`).
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from served import epoch, serve, synth  # noqa: E402

PACK = 4096
WORLD = 2


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return synth(tmp_path_factory.mktemp("packing") / "ds", 20, 3, 60, 500, lengths=True)


@pytest.fixture(scope="module")
def served(dataset):
    """(plain samples by id, each rank's packed epoch)."""
    plain, plain_addr = serve(dataset, global_batch=8)
    packed, packed_addr = serve(dataset, "--pack-max-tokens", str(PACK), global_batch=8)
    try:
        samples = {}
        for b in epoch(plain_addr):
            for row, sid in enumerate(b.sample_ids):
                samples[sid] = one_sample(b, row)
        ranks = [epoch(packed_addr, rank, WORLD) for rank in range(WORLD)]
        return samples, ranks
    finally:
        plain.kill()
        packed.kill()


IMAGE_TOKEN = 151655  # <|image_pad|>


def image_span(grids, image_tokens_before, image_tokens):
    """Which images (and `pixel_values` rows) own a run of image tokens: images follow each
    other in token order, each `t·h·w / 4` tokens and `t·h·w` rows."""
    ends = np.cumsum([0, *(grids.prod(axis=1) // 4)])
    first = int(np.searchsorted(ends, image_tokens_before))
    last = int(np.searchsorted(ends, image_tokens_before + image_tokens))
    rows = np.cumsum([0, *grids.prod(axis=1)])
    return grids[first:last], slice(int(rows[first]), int(rows[last]))


def one_sample(batch, row):
    """Row `row` of a plain batch: its tokens, labels, images' grids and pixels."""
    t = batch.tensors
    n = int(t["attention_mask"][row].sum())
    before = int((t["input_ids"][:row] == IMAGE_TOKEN).sum())
    grids, rows = image_span(
        t["image_grid_thw"], before, int((t["input_ids"][row] == IMAGE_TOKEN).sum())
    )
    return {
        "input_ids": t["input_ids"][row, :n],
        "labels": t["labels"][row, :n],
        "grids": grids,
        "pixels": batch.pixel_values()[rows],
    }


def test_every_sample_once_in_packs_that_fit_with_as_many_packs_per_rank(dataset, served):
    samples, ranks = served
    seen = []
    for step in zip(*ranks):
        assert len({b.global_batch for b in step}) == 1
        counts = {len(b.packs()) for b in step}
        assert len(counts) == 1, f"ranks got {counts} packs"
        for b in step:
            assert b.packed and b.dtypes["cu_seqlens"] == "int32"
            for pack in b.packs():
                assert pack["input_ids"].shape[1] <= PACK
            seen += b.sample_ids
    assert sorted(seen) == sorted(samples)


def packed_samples(served):
    """Every packed sample: (id, its part of its pack)."""
    _, ranks = served
    for batches in ranks:
        for b in batches:
            ids = iter(b.sample_ids)
            for pack in b.packs():
                bounds = pack["cu_seq_lens_q"]
                assert pack["max_length_q"] == max(np.diff(bounds), default=0)
                tokens = pack["input_ids"][0]
                for lo, hi in zip(bounds[:-1], bounds[1:]):
                    grids, rows = image_span(
                        pack["image_grid_thw"],
                        int((tokens[:lo] == IMAGE_TOKEN).sum()),
                        int((tokens[lo:hi] == IMAGE_TOKEN).sum()),
                    )
                    yield next(ids), {
                        "input_ids": tokens[lo:hi],
                        "labels": pack["labels"][0, lo:hi],
                        "positions": pack["position_ids"][:, 0, lo:hi],
                        "grids": grids,
                        "pixels": pack["pixel_values"][rows],
                    }


def test_each_packed_sample_is_the_plain_sample_with_its_own_positions(served):
    samples, _ = served
    checked = 0
    for sid, got in packed_samples(served):
        want = samples[sid]
        np.testing.assert_array_equal(got["input_ids"], want["input_ids"])
        assert got["labels"][0] == -100
        np.testing.assert_array_equal(got["labels"][1:], want["labels"][1:])
        np.testing.assert_array_equal(got["positions"][0], np.arange(len(want["input_ids"])))
        np.testing.assert_array_equal(got["grids"], want["grids"])
        np.testing.assert_array_equal(got["pixels"], want["pixels"])
        checked += 1
    assert checked == len(samples)


@pytest.fixture(scope="module")
def tiny_qwen2vl(torch):
    """A randomly initialized Qwen2-VL small enough for a CPU: the real model code (rope
    index, vision tower, packed-sequence masking), tiny widths."""
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen2VLConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=32, vocab_size=152064,
                         rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2],
                                          "rope_theta": 10000.0}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2),
    )
    assert config.image_token_id == IMAGE_TOKEN
    return Qwen2VLForConditionalGeneration(config).eval()


def test_rope_rows_are_the_models_get_rope_index_on_each_sample_alone(served, tiny_qwen2vl, torch):
    cases = []
    for sid, got in packed_samples(served):
        ids = torch.from_numpy(np.ascontiguousarray(got["input_ids"]))[None]
        want, _ = tiny_qwen2vl.model.get_rope_index(
            ids, (ids == IMAGE_TOKEN).int(), image_grid_thw=torch.from_numpy(got["grids"])
        )
        np.testing.assert_array_equal(got["positions"][1:], want[:, 0].numpy(), f"sample {sid}")
        cases.append((len(got["grids"]), sid, got, want[:, 0].numpy()))
    fixture = os.environ.get("STOKER_WRITE_ROPE_FIXTURE")
    if fixture:
        write_fixture(Path(fixture), cases)


def test_a_packs_forward_is_each_samples_own_forward(served, tiny_qwen2vl, torch):
    """`model(**pack)` as a trainer calls it: the model's packed-sequence masking reads the
    text position row, so each sample attends only to itself and its logits are those of its
    own unpacked forward."""

    _, ranks = served
    pack = next(p for b in ranks[0] for p in b.packs(device="cpu") if len(p["cu_seq_lens_q"]) > 2)
    with torch.no_grad():
        out = tiny_qwen2vl(**pack)
        assert torch.isfinite(out.loss)
        packed = out.logits[0]
        tokens = pack["input_ids"][0]
        bounds = pack["cu_seq_lens_q"].tolist()
        images = 0
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            ids = tokens[lo:hi][None]
            grids, rows = image_span(
                pack["image_grid_thw"].numpy(),
                int((tokens[:lo] == IMAGE_TOKEN).sum()),
                int((tokens[lo:hi] == IMAGE_TOKEN).sum()),
            )
            alone = tiny_qwen2vl(
                input_ids=ids,
                mm_token_type_ids=(ids == IMAGE_TOKEN).int(),
                pixel_values=pack["pixel_values"][rows] if len(grids) else None,
                image_grid_thw=torch.from_numpy(grids) if len(grids) else None,
                use_cache=False,
            ).logits[0]
            torch.testing.assert_close(packed[lo:hi], alone, atol=1e-4, rtol=1e-4)
            images += len(grids)
    assert images > 0, "the pack had no image"


def write_fixture(path: Path, cases):
    """The shortest sample of each image count, for the worker's unit test (run without
    torch)."""
    shortest = {}
    for images, sid, got, want in sorted(cases, key=lambda c: (c[0], len(c[2]["input_ids"]))):
        shortest.setdefault(images, (sid, got, want))
    path.write_text(json.dumps([
        {"sample": sid, "input_ids": got["input_ids"].tolist(),
         "image_grid_thw": got["grids"].tolist(), "rope": want.tolist()}
        for sid, got, want in shortest.values()
    ]) + "\n")
