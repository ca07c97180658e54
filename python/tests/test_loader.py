"""The Python package against real workers: zero-copy views, order, resume, wait accounting."""

import hashlib
import os
import subprocess
import threading
import time
import urllib.request

import numpy as np
import pytest

import stoker
from conftest import stoker_bin


def digest(batch: stoker.Batch) -> str:
    h = hashlib.sha256()
    for name in sorted(batch.tensors):
        h.update(name.encode())
        h.update(np.ascontiguousarray(batch.tensors[name]).tobytes())
    return h.hexdigest()


def test_tensors_are_views_of_the_buffer_the_socket_filled(worker):
    w = worker()
    loader = stoker.Loader(w.addr)
    batch = next(loader)
    payload = batch.payload
    # The payload is where the client's socket read wrote the frame.
    assert payload.address == payload.filled_at
    lo, hi = payload.address, payload.address + len(payload)
    copies = 0
    for name, arr in batch.tensors.items():
        start = arr.__array_interface__["data"][0]
        inside = lo <= start and start + arr.nbytes <= hi
        copies += 0 if inside else 1
        assert arr.base is not None
        assert start % 64 == 0, f"{name} is not 64-byte aligned"
    assert copies == 0
    # The check can fail: a copy lives elsewhere.
    copied = np.array(batch["pixel_values"])
    assert not (lo <= copied.__array_interface__["data"][0] < hi)
    # Views are writable (each batch owns its buffer) and keep the payload alive.
    ids = batch["input_ids"]
    assert ids.flags.writeable
    del batch, payload
    assert ids.shape[0] == 8 and ids.sum() > 0


def test_shapes_dtypes_and_bfloat16(worker):
    w = worker("--pixel-dtype", "bf16")
    batch = next(stoker.Loader(w.addr))
    b, l = batch["input_ids"].shape
    assert batch["labels"].shape == (b, l) and batch["attention_mask"].shape == (b, l)
    assert batch["input_ids"].dtype == np.int64
    assert batch.dtypes["pixel_values"] == "bfloat16"
    grid = batch["image_grid_thw"]
    assert batch["pixel_values"].shape[0] == int(np.prod(grid, axis=1).sum())
    assert batch["pixel_values"].shape[1] == 3 * 2 * 14 * 14
    assert len(batch.sample_ids) == b


def test_an_epoch_holds_every_sample_once_then_the_next_begins(worker):
    w = worker()
    loader = stoker.Loader(w.addr)
    assert len(loader) == 5
    first = list(loader)
    assert [b.global_batch for b in first] == list(range(5))
    ids = [i for b in first for i in b.sample_ids]
    assert sorted(ids) == list(range(40))
    second = list(loader)
    assert [b.epoch for b in second] == [1] * 5
    assert [i for b in second for i in b.sample_ids] != ids  # reshuffled
    assert loader.state_dict()["epoch"] == 2


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_resume_is_exact_and_keeps_global_order_on_another_world_size(worker, dataset, packed):
    args = []
    if packed:
        subprocess.run([stoker_bin(), "dataset", "index", str(dataset), "--write-lengths"],
                       check=True, capture_output=True)
        args = ["--pack-max-tokens", "2048"]
    w = worker(*args)
    reference = [digest(b) for b in stoker.Loader(w.addr)]
    reference_ids = [b.sample_ids for b in stoker.Loader(w.addr)]

    loader = stoker.Loader(w.addr)
    got = [digest(next(loader)) for _ in range(2)]
    state = loader.state_dict()
    assert state["next_batch"] == 2 and state["epoch"] == 0
    resumed = stoker.Loader(w.addr, state=state)
    got += [digest(b) for b in resumed]
    assert got == reference

    # load_state_dict rewinds a running loader too.
    resumed.load_state_dict(state)
    assert digest(next(resumed)) == reference[2]

    # Two ranks resuming the one-rank state split the same global batches (packed: into as
    # many packs each, chosen by cost).
    ranks = [stoker.Loader(w.addr, rank=r, world_size=2, state=state) for r in range(2)]
    for g, (a, b) in enumerate(zip(*ranks)):
        if packed:
            assert a.packed and len(a.packs()) == len(b.packs())
            assert sorted(a.sample_ids + b.sample_ids) == sorted(reference_ids[2 + g])
        else:
            assert a.sample_ids + b.sample_ids == reference_ids[2 + g]

    with pytest.raises(stoker.PlanMismatch, match="plan"):
        loader.load_state_dict({**state, "plan_id": state["plan_id"] ^ 1})
    # A state past the last position a loader counts (epoch x batches overflows) is refused
    # by name, resumed or loaded.
    past = {**state, "epoch": 2**64 - 1}
    with pytest.raises(stoker.PlanMismatch, match="past the last position"):
        loader.load_state_dict(past)
    with pytest.raises(stoker.PlanMismatch, match="past the last position"):
        stoker.Loader(w.addr, state=past)


def test_wait_accounting_stats_and_metrics_endpoint(worker):
    w = worker()
    loader = stoker.Loader(w.addr, metrics_port=0, metrics_host="127.0.0.1", pipeline="py")
    for _ in range(4):
        next(loader)
        time.sleep(0.05)  # the trainer's step
    next(loader)
    s = loader.stats()
    assert s["batches"] == 5 and s["samples"] == 40
    assert s["step_s"] >= 0.2
    assert 0.0 < s["wait_ratio"] < 1.0
    text = urllib.request.urlopen(f"http://{loader.metrics_addr}/metrics").read().decode()
    lines = [l for l in text.splitlines() if l.startswith("stoker_trainer_batches_total{")]
    assert lines and 'pipeline="py"' in lines[0] and lines[0].endswith(" 5")
    assert "stoker_trainer_wait_seconds_total{" in text


def test_the_gil_is_released_while_waiting(worker):
    ticks = 0
    stop = threading.Event()

    def count():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    # Nobody listens: construction waits for a worker (GIL released), then fails clearly.
    t = threading.Thread(target=count)
    t.start()
    try:
        with pytest.raises(stoker.NoWorker, match="127.0.0.1:9"):
            stoker.Loader("127.0.0.1:9", no_worker_timeout_s=1.0)
    finally:
        stop.set()
        t.join()
    assert ticks > 1000


def test_wrong_token_is_refused_with_the_reason(worker):
    w = worker(token="right")
    with pytest.raises(stoker.Unauthorized, match="refused"):
        stoker.Loader(w.addr, token="wrong", no_worker_timeout_s=5.0)
    # Every kind is a StokerError, and a RuntimeError for code written before the kinds.
    assert issubclass(stoker.Unauthorized, stoker.StokerError)
    assert issubclass(stoker.StokerError, RuntimeError)
    with pytest.raises(stoker.ConfigError, match="rank 3"):
        stoker.Loader(w.addr, token="right", rank=3, world_size=2)
    assert next(stoker.Loader(w.addr, token="right")).sample_ids


def test_workers_prove_their_name_and_plaintext_is_asked_for_by_name(worker, tmp_path, monkeypatch):
    # The fixtures' workers serve TLS (conftest: STOKER_TLS_CERT/KEY), loaders trust
    # $STOKER_TLS_CA; a CA bundle given by path works the same.
    w = worker()
    ca = os.environ["STOKER_TLS_CA"]
    assert next(stoker.Loader(w.addr, tls_ca=ca)).sample_ids
    # A worker whose certificate another CA signed is not trusted: the reason names it.
    other = tmp_path / "other"
    subprocess.run([stoker_bin(), "certs", "--name", "127.0.0.1", "--out", str(other)], check=True,
                   capture_output=True)
    with pytest.raises(stoker.NoWorker, match="UnknownIssuer"):
        stoker.Loader(w.addr, tls_ca=str(other / "ca.crt"), no_worker_timeout_s=2.0)
    # ...nor one dialled by a name its certificate does not hold.
    with pytest.raises(stoker.NoWorker, match="not valid for name"):
        stoker.Loader(w.addr, tls_server_name="elsewhere.example", no_worker_timeout_s=2.0)

    # Plaintext only when both ends ask for it.
    plain = worker("--insecure-plaintext")
    assert next(stoker.Loader(plain.addr, insecure_plaintext=True)).sample_ids
    with pytest.raises(stoker.NoWorker):
        stoker.Loader(plain.addr, no_worker_timeout_s=2.0)
    with pytest.raises(stoker.ConfigError, match="insecure_plaintext"):
        stoker.Loader(plain.addr, insecure_plaintext=True, tls_ca=ca)
    monkeypatch.delenv("STOKER_TLS_CA")
    with pytest.raises(stoker.ConfigError, match="no CA bundle"):
        stoker.Loader(w.addr)


def test_torch_adapter_shares_memory(worker, torch):
    from stoker.torch import StokerIterableDataset

    w = worker("--pixel-dtype", "bf16")
    ds = StokerIterableDataset(w.addr, pixel_dtype="bfloat16")
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)))
    assert batch["pixel_values"].dtype == torch.bfloat16
    assert batch["input_ids"].dtype == torch.int64
