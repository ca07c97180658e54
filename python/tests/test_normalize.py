"""The rank-side normalization pass (`Batch.pixel_values` with u8 on the wire): the native
lookup against numpy's, into caller-provided and pooled memory, and what it refuses."""

import numpy as np
import pytest

import stoker
from stoker import _native

COLUMNS = 1176


def u8_batch(rows: int, seed: int = 0) -> stoker.Batch:
    rng = np.random.default_rng(seed)
    px = rng.integers(0, 256, size=(rows, COLUMNS), dtype=np.uint8)
    # Every channel its own table; values with every kind of low bits (bfloat16 rounding).
    lut = rng.standard_normal((3, 256)).astype(np.float32) * 3
    return stoker.Batch(epoch=0, global_batch=0, sample_ids=[], skipped=[],
                        tensors={"pixel_values": px, "pixel_lut": lut},
                        dtypes={"pixel_values": "uint8", "pixel_lut": "float32"},
                        worker="", payload=None)


def numpy_lookup(batch: stoker.Batch) -> np.ndarray:
    px, lut = batch.tensors["pixel_values"], batch.tensors["pixel_lut"]
    channel = np.arange(px.shape[1]) // (px.shape[1] // 3)
    return lut[channel[None, :], px]


def bf16_bits(values: np.ndarray) -> np.ndarray:
    bits = values.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.mark.parametrize("rows", [0, 1, 7, 1000])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_native_pass_is_numpys_lookup_bit_for_bit(rows, threads):
    batch = u8_batch(rows)
    want = numpy_lookup(batch)
    got = batch.pixel_values(threads=threads)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    bf16 = batch.pixel_values(dtype="bfloat16", threads=threads)
    assert np.array_equal(bf16.view(np.uint16), bf16_bits(want))


def test_out_is_written_and_returned():
    batch = u8_batch(50)
    out = np.full((50, COLUMNS), np.nan, dtype=np.float32)
    assert batch.pixel_values(out=out) is out
    assert np.array_equal(out, numpy_lookup(batch))
    out16 = np.zeros((50, COLUMNS), dtype=np.uint16)
    batch.pixel_values(dtype="bfloat16", out=out16)
    assert np.array_equal(out16, bf16_bits(numpy_lookup(batch)))


@pytest.mark.parametrize("bad", [
    np.zeros((49, COLUMNS), np.float32),             # shape
    np.zeros((50, COLUMNS), np.float64),             # dtype
    np.zeros((COLUMNS, 50), np.float32).T,           # not C-contiguous
])
def test_an_out_that_does_not_fit_is_refused_by_name(bad):
    with pytest.raises(stoker.ConfigError, match="out="):
        u8_batch(50).pixel_values(out=bad)


def test_a_read_only_or_overlapping_output_is_refused():
    batch = u8_batch(4)
    readonly = np.zeros((4, COLUMNS), np.float32)
    readonly.flags.writeable = False
    with pytest.raises(stoker.ConfigError):
        batch.pixel_values(out=readonly)
    # Straight to the native function: the output may not share memory with the input.
    memory = np.zeros(4 * COLUMNS * 4, np.uint8)
    px = memory[: 4 * COLUMNS]
    with pytest.raises(BufferError, match="overlaps"):
        _native.normalize_u8(px, COLUMNS, batch.tensors["pixel_lut"], memory.view(np.float32), False, 1)
    with pytest.raises(ValueError, match="columns"):
        _native.normalize_u8(px, 5, batch.tensors["pixel_lut"], np.zeros(4 * COLUMNS, np.float32), False, 1)
    with pytest.raises(ValueError, match="3 x 256"):
        _native.normalize_u8(px, COLUMNS, np.zeros(10, np.float32), np.zeros(4 * COLUMNS, np.float32), False, 1)


def test_the_pool_reuses_a_buffer_only_once_nothing_views_it():
    pool = stoker.BufferPool(slots=2)
    batch = u8_batch(20)
    first = batch.pixel_values(pool=pool)
    address = first.ctypes.data
    assert np.array_equal(first, numpy_lookup(batch))
    del first
    again = batch.pixel_values(pool=pool)
    again_address = again.ctypes.data
    assert again_address == address and pool.reuses == 1
    # `again` is alive: the next batch gets other memory, and `again` keeps its values.
    kept = again[3:5]
    del again
    other = u8_batch(20, seed=1)
    second = other.pixel_values(pool=pool)
    second_address = second.ctypes.data
    assert second_address != address
    assert np.array_equal(kept, numpy_lookup(batch)[3:5])
    assert np.array_equal(second, numpy_lookup(other))
    # Both slots busy: fresh memory, not pooled.
    third = u8_batch(10, seed=2).pixel_values(pool=pool)
    third_address = third.ctypes.data
    assert third_address not in (address, second_address)
    assert pool.allocations == 3
    # A smaller batch fits a free larger buffer.
    del kept, second, third
    small_address = u8_batch(5, seed=3).pixel_values(pool=pool).ctypes.data
    assert small_address == address


def test_a_torch_tensor_made_from_pooled_memory_keeps_it_in_use(torch):
    pool = stoker.BufferPool(slots=1)
    t = torch.from_numpy(u8_batch(8).pixel_values(pool=pool))
    address = t.data_ptr()
    while_used = u8_batch(8, seed=1).pixel_values(pool=pool).ctypes.data
    assert while_used != address
    del t
    after = u8_batch(8, seed=2).pixel_values(pool=pool).ctypes.data
    assert after == address


def test_the_cpu_torch_path_is_the_native_pass(torch):
    batch = u8_batch(30)
    out = torch.empty((30, COLUMNS), dtype=torch.bfloat16)
    got = batch.pixel_values(device="cpu", dtype="bfloat16", out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == torch.bfloat16
    assert np.array_equal(out.view(torch.int16).numpy().view(np.uint16), bf16_bits(numpy_lookup(batch)))
    f32 = batch.pixel_values(device="cpu")
    assert torch.equal(f32, torch.from_numpy(numpy_lookup(batch)))


def test_a_loaders_batches_write_into_its_pool_by_default(worker):
    w = worker()  # u8 on the wire by default
    batch = next(stoker.Loader(w.addr))
    assert "pixel_lut" in batch.tensors and batch.pool is not None
    first = batch.pixel_values()
    address = first.ctypes.data
    del first
    again = batch.pixel_values().ctypes.data
    assert again == address and batch.pool.reuses == 1
    assert next(stoker.Loader(w.addr, pixel_buffers=0)).pool is None


class FakeEvent:
    """A device event: done when the test says so."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_a_buffer_an_asynchronous_copy_still_reads_is_not_reused():
    pool = stoker.BufferPool(slots=1)
    batch = u8_batch(12)
    host = batch.pixel_values(pool=pool)
    address = host.ctypes.data
    copy = FakeEvent()
    pool.keep_until(host, copy)
    del host  # no view left, but the copy has not finished
    while_copying = u8_batch(12, seed=1).pixel_values(pool=pool).ctypes.data
    assert while_copying != address
    copy.done = True
    after = u8_batch(12, seed=2).pixel_values(pool=pool).ctypes.data
    assert after == address


def test_pixels_to_device_on_the_cpu_is_the_host_pass(torch):
    from stoker.torch import pixels_to_device

    batch = u8_batch(6)
    pool = stoker.BufferPool()
    got = pixels_to_device(batch, "cpu", pool)
    assert torch.equal(got, torch.from_numpy(numpy_lookup(batch)))
    bf16 = pixels_to_device(batch, "cpu", pool, pixel_dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16
    assert np.array_equal(bf16.view(torch.int16).numpy().view(np.uint16), bf16_bits(numpy_lookup(batch)))
