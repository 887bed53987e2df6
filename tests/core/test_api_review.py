"""The engine-facing API as a hurried engine author calls it, and the handle as a peer forges it:
every wrong argument is a kvbridge error that says what to fix, refused before anything is taken."""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
import pytest
import torch

from kvbridge import KVHandle, KVLayout, KVPool, KVReceiver, KVSender
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


# -- the sender ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(num_tokens=3.0), dict(num_tokens="3"), dict(num_tokens=None),
                                dict(num_tokens=True), dict(layers_ready="x"), dict(layers_ready=1.5),
                                dict(layers_ready=True), dict(ttl=1e300), dict(block_ids=3),
                                dict(block_ids=None)])
def test_publish_arguments_of_the_wrong_kind_are_refused_and_take_nothing(kw: dict[str, Any]) -> None:
    """num_tokens=3.0 raised struct.error, '3' or None TypeError, and True was taken as 1;
    layers_ready='x' raised ValueError and 1.5 was taken as 1; ttl=1e300 (no leases) raised
    OverflowError; block_ids=3 or None TypeError."""
    pool = KVPool.allocate(L, 4)
    with KVSender(pool, "tcp://127.0.0.1:0", leases=False) as snd:
        ids = pool.alloc(2)
        args: dict[str, Any] = dict(block_ids=ids, num_tokens=5)
        args.update(kw)
        with pytest.raises((ConfigError, PoolError)):
            snd.publish("r", **args)
        assert [pool.refcount(b) for b in ids] == [1, 1] and snd.num_live == 0
        h = snd.publish("r", ids, np.int64(5), layers_ready=np.int64(1))
        assert h.num_tokens == 5 and snd.mark_ready(h, 2)


def test_a_ttl_beyond_the_limit_is_refused_by_publish_renew_and_the_sender() -> None:
    pool = KVPool.allocate(L, 4)
    with KVSender(pool, "tcp://127.0.0.1:0", leases=False) as snd:
        h = snd.publish("r", pool.alloc(1), 1, ttl=1e9)
        with pytest.raises(ConfigError, match="ttl"):
            snd.renew(h, 1e300)
    with pytest.raises(ConfigError, match="ttl"):
        KVSender(pool, "tcp://127.0.0.1:0", leases=False, ttl=1e12)


def test_revoke_and_renew_take_the_handle_in_any_of_its_forms() -> None:
    """revoke(handle.to_bytes()) returned False -- as if already ended -- and left the blocks
    pinned until the TTL; revoke(dict) or revoke('id') raised TypeError, renew(bytes)
    AttributeError."""
    pool, dst = KVPool.allocate(L, 8), KVPool.allocate(L, 8)
    freed: list[str] = []
    with KVSender(pool, "tcp://127.0.0.1:0", leases=False, on_free=lambda h, why: freed.append(why)) as snd, \
            KVReceiver(dst, leases=False) as rcv:
        forms: list[Callable[[KVHandle], Any]] = [lambda h: h, lambda h: h.to_bytes(), lambda h: h.to_dict(),
                                                  lambda h: h.handle_id]
        for form in forms:
            h = snd.publish("r", pool.alloc(1), 1)
            snd.renew(form(h), 5)                            # type: ignore[arg-type]
            assert snd.revoke(form(h)) is True
            assert snd.revoke(form(h)) is False
        assert freed == ["revoked"] * 4 and pool.num_free == 8
        for bad in ("abc", None, 7, b"\0" * 40):
            with pytest.raises(BadHandle):
                snd.revoke(bad)                              # type: ignore[arg-type]
        h = snd.publish("r", pool.alloc(1), 1, layers_ready=0)
        assert snd.mark_ready(h.to_bytes(), 2) is True       # type: ignore[arg-type]
        assert rcv.fetch(h.to_dict(), dst.alloc(1)).ok


@pytest.mark.parametrize("pool", [None, "pool", "closed"])
def test_a_sender_without_a_usable_pool_opens_nothing(pool: Any) -> None:
    """KVSender(None) opened its server (and the embedded lease server) before the pool was
    looked at, then raised AttributeError outside its cleanup: a listening socket and its
    threads left behind. A closed pool was taken, and publish then said 'not allocated'."""
    if pool == "closed":
        pool = KVPool.allocate(L, 2)
        pool.close()
    before = _kvb_threads()
    with pytest.raises(ConfigError, match="pool"):
        KVSender(pool, "tcp://127.0.0.1:0")
    assert _kvb_threads() <= before


@pytest.mark.parametrize("secret", ["a shared secret", b"", 1234, bytearray()])
def test_a_secret_that_is_not_bytes_is_refused_when_the_sender_is_built(secret: Any) -> None:
    """secret='text' was taken and every publish then failed with a raw TypeError from hmac; an
    empty secret signed handles with an empty key, which any peer can forge."""
    pool = KVPool.allocate(L, 2)
    with pytest.raises(ConfigError, match="secret"):
        KVSender(pool, "tcp://127.0.0.1:0", leases=False, secret=secret)
    with KVSender(pool, "tcp://127.0.0.1:0", leases=False, secret=bytearray(b"k" * 32)) as snd:
        assert snd.publish("r", pool.alloc(1), 1).num_blocks == 1


def test_a_retire_stopped_by_a_bad_id_still_ends_the_handles_of_the_blocks_it_retired() -> None:
    """retire([1, 'a']) moved block 1's generation on, then raised before telling the sender:
    its handle stayed live (every read of it stale) and kept block 1 pinned until its TTL."""
    pool = KVPool.allocate(L, 4, allocator="engine")
    freed: list[str] = []
    with KVSender(pool, "tcp://127.0.0.1:0", leases=False, on_free=lambda h, why: freed.append(why)) as snd:
        snd.publish("r", [1], 1)
        with pytest.raises(PoolError, match="integers"):
            pool.retire([1, "a"])                            # type: ignore[list-item]
        assert freed == ["retired"] and snd.num_live == 0 and pool.refcount(1) == 0


def test_a_layer_read_from_before_layer_0_is_refused() -> None:
    """open_read (what every transport server calls) took a layer range starting at -1 and served
    it: three layers' bytes for a two-layer handle, the first taken from the buffers' far end."""
    from kvbridge.errors import ProtocolError
    pool = KVPool.allocate(L, 4)
    with KVSender(pool, "inproc://", leases=False) as snd:
        h = snd.publish("r", pool.alloc(1), 1, layers_ready=2)
        with pytest.raises(ProtocolError, match="layer -1"):
            snd.open_read(h.to_bytes(), None, None, (-1, 2))
        g = snd.open_read(h.to_bytes(), None, None, (0, 2))
        assert g.layers == (0, 2)
        g.close()


@pytest.mark.parametrize("kw", [dict(num_tokens=3.0), dict(num_tokens="3"), dict(num_tokens=True),
                                dict(ttl=1e300), dict(ttl=float("nan")), dict(ttl=0), dict(ttl=-1.0)])
def test_a_reservation_of_the_wrong_kind_is_refused_and_offers_nothing(kw: dict[str, Any]) -> None:
    """reserve(num_tokens=3.0) raised struct.error, '3' TypeError, True was taken as 1; ttl=nan
    raised ValueError, 1e300 OverflowError, and 0 or -1 offered a reservation already expired."""
    pool = KVPool.allocate(L, 4)
    with KVReceiver(pool, listen="tcp://127.0.0.1:0", leases=False) as rcv:
        with pytest.raises(ConfigError):
            rcv.reserve(pool.alloc(1), "r", **kw)
        assert rcv.stats.reservations == 0 and pool.num_free == 3
        assert rcv.reserve(pool.alloc(1), "r", num_tokens=np.int64(3), ttl=5).reservation.num_tokens == 3
