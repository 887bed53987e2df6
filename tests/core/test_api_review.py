"""The engine-facing API as a hurried engine author calls it, and the handle as a peer forges it:
every wrong argument is a kvbridge error that says what to fix, refused before anything is taken."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from kvbridge import KVHandle, KVLayout, KVPool
from kvbridge.errors import BadHandle, ConfigError, LayoutMismatch, PoolError

pytestmark = pytest.mark.timeout(30)

L = KVLayout.vllm_flash(2, 2, 8, block_size=4, dtype="float16")


def _kvb_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("kvb")}


# -- handles ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("data", ["KVH\x01\x00", None, 1 << 40, 3.5, [1, 2, 3], {"a": 1}])
def test_handle_bytes_of_the_wrong_type_are_a_bad_handle(data: Any) -> None:
    """from_bytes(str or None) raised a raw TypeError, and from_bytes(int n) built n zero bytes
    first (a terabyte for 1 << 40) before calling them a bad magic."""
    with pytest.raises(BadHandle, match="bytes"):
        KVHandle.from_bytes(data)


@pytest.mark.parametrize("version", [True, 1.0, "1"])
def test_a_handle_dict_version_must_be_the_integer(version: Any) -> None:
    key = b"k" * 32
    h = KVHandle(b"\1" * 16, "r", "00" * 8, ("tcp://x:1",), (1,), (0,), (), 3).signed(key)
    d = h.to_dict()
    d["kvbridge_handle"] = version
    with pytest.raises(BadHandle, match="kvbridge_handle"):
        KVHandle.from_dict(d, key)


# -- layouts ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [{}, {"num_layers": 2}, None, [("num_layers", 2)], "num_layers"])
def test_a_layout_dict_missing_fields_or_not_a_dict_is_a_config_error(d: Any) -> None:
    with pytest.raises(ConfigError):
        KVLayout.from_dict(d)


@pytest.mark.parametrize("dtype", [["float16"], {"x": 1}, 16])
def test_a_layout_dtype_of_the_wrong_type_is_a_config_error(dtype: Any) -> None:
    with pytest.raises(ConfigError, match="dtype"):
        KVLayout(2, 2, 8, 4, dtype=dtype)


def test_a_layout_whose_block_bytes_overflow_is_refused() -> None:
    """Dims whose product no tensor can hold (torch's sizes are int64) were accepted and failed
    later, in allocate, as a raw TypeError."""
    with pytest.raises(ConfigError, match="bytes"):
        KVLayout(2, 2, 1 << 62, 4)


# -- pools -----------------------------------------------------------------------------------------
def test_a_pool_too_large_to_allocate_is_a_pool_error() -> None:
    with pytest.raises(PoolError, match="allocate"):
        KVPool.allocate(L, 1 << 46)


@pytest.mark.parametrize("case", ["same_tensor", "k_is_v", "overlap"])
def test_wrap_refuses_buffers_that_share_memory(case: str) -> None:
    """Two layers (or K and V) over the same memory were accepted: the engine's bug then showed
    as one layer's KV overwriting another's on the receiver, with no error anywhere."""
    if case == "same_tensor":
        a = torch.zeros(L.buffer_shape(4), dtype=torch.float16)
        layout, tensors = L, [a, a]
    elif case == "k_is_v":
        layout = KVLayout.split_kv(2, 2, 8, 4, dtype="float16")
        k = torch.zeros(layout.buffer_shape(4), dtype=torch.float16)
        layout, tensors = layout, [(k, k), (torch.zeros_like(k), torch.zeros_like(k))]
    else:
        flat = torch.zeros(2 * 2 * 4 * 64 + 64, dtype=torch.float16)
        n = 2 * 4 * 64
        tensors = [flat[:n].view(L.buffer_shape(4)), flat[64:64 + n].view(L.buffer_shape(4))]
        layout = L
    with pytest.raises(LayoutMismatch, match="overlap"):
        KVPool.wrap(layout, tensors)


def test_wrap_refuses_tensors_without_memory_and_takes_any_iterable() -> None:
    meta = [torch.empty(L.buffer_shape(4), dtype=torch.float16, device="meta") for _ in range(2)]
    with pytest.raises(LayoutMismatch, match="meta"):
        KVPool.wrap(L, meta)
    good = [torch.zeros(L.buffer_shape(4), dtype=torch.float16) for _ in range(2)]
    assert KVPool.wrap(L, iter(good)).num_blocks == 4        # a generator of layers is a list of them


@pytest.mark.parametrize("n", [-1, 1.5, "2", None])
def test_alloc_of_a_count_that_is_not_a_whole_number_is_refused(n: Any) -> None:
    """alloc(-1) returned [] (the engine's bug hidden), alloc(1.5) and alloc('2') raised TypeError."""
    pool = KVPool.allocate(L, 4)
    with pytest.raises(PoolError, match="whole number"):
        pool.alloc(n)
    assert pool.num_free == 4
    assert pool.alloc(np.int64(2)) == [0, 1] and pool.alloc(0) == []


def test_block_queries_outside_the_pool_are_refused_not_wrapped_around() -> None:
    """refcount(-1) answered for the last block and generation(99) raised IndexError."""
    pool = KVPool.allocate(L, 4)
    for bad in (-1, 4, 1.0, "0"):
        with pytest.raises(PoolError):
            pool.refcount(bad)                               # type: ignore[arg-type]
        with pytest.raises(PoolError):
            pool.generation(bad)                             # type: ignore[arg-type]


def test_numpy_block_ids_are_block_ids_everywhere() -> None:
    """publish takes numpy and 0-d tensor ids; ref, free and pin refused them as 'outside the
    pool', and retire(['a']) or retire([1.5]) raised TypeError."""
    pool = KVPool.allocate(L, 4)
    ids = pool.alloc(2)
    pool.ref([np.int64(ids[0]), torch.tensor(ids[1])])
    assert pool.free([np.int32(ids[0]), ids[1]]) == []
    assert pool.free(ids) == ids
    eng = KVPool.allocate(L, 4, allocator="engine")
    eng.pin([np.int64(1)])
    assert eng.refcount(1) == 1
    assert eng.retire([np.int64(1)]) == [1]
    for bad in ("a", 1.5):
        with pytest.raises(PoolError, match="integers"):
            eng.retire([bad])                                # type: ignore[list-item]
        with pytest.raises(PoolError, match="integers"):
            pool.free([bad])                                 # type: ignore[list-item]
    assert eng.generation(1) == 1
