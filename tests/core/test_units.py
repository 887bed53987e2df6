"""Unit tests: layout compatibility, KVPool.wrap, the error tree, Retry, the transport registry."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Optional

import pytest
import torch

import kvbridge
from kvbridge import errors as E
from kvbridge import (Action, BackendUnavailable, BadHandle, ConfigError, KVBridgeError, KVHandle, KVLayout,
                      KVPool, KVReceiver, KVSender, LayoutMismatch, Retry)
from kvbridge.policy import Backoff, Deadline
from kvbridge.transports import registry
from kvbridge.transports.base import Server, Transport, copy_runs
from kvbridge.transports.wire import decode_error, encode_error

pytestmark = pytest.mark.timeout(30)


# -- layout compatibility --------------------------------------------------------------------------
@pytest.mark.parametrize("hnd", [False, True])
def test_compat_hash_same_geometry_any_arrangement(hnd):
    a = KVLayout.vllm_flash(4, 8, 128, block_size=16, dtype="bfloat16", hnd=hnd)
    b = KVLayout.flashinfer(4, 8, 128, block_size=16, dtype="bfloat16", hnd=hnd)
    c = KVLayout.split_kv(4, 8, 128, block_size=16, dtype="bfloat16", hnd=hnd)
    assert a.compat_hash == b.compat_hash == c.compat_hash
    assert len(a.compat_hash) == 16 and int(a.compat_hash, 16) >= 0
    a.check_compatible(b)
    b.check_compatible(c)
    # stable: the same value on every call and for an equal layout rebuilt from its dict
    assert KVLayout.from_dict(a.to_dict()).compat_hash == a.compat_hash == a.compat_hash


BASE = KVLayout(4, 1, 64, 16, "float16", "kv_first", "NHD", 0, 2)
CHANGES = {
    "num_layers": dict(num_layers=5), "num_kv_heads": dict(num_kv_heads=2), "head_dim": dict(head_dim=32),
    "block_size": dict(block_size=32), "dtype": dict(dtype="bfloat16"),
    "latent": dict(kv_order="latent"), "tp_rank": dict(tp_rank=1), "tp_size": dict(tp_size=4),
}


@pytest.mark.parametrize("field", list(CHANGES))
def test_compat_hash_differs_per_field(field):
    other = dataclasses.replace(BASE, **CHANGES[field])
    assert other.compat_hash != BASE.compat_hash
    with pytest.raises(LayoutMismatch) as ei:
        BASE.check_compatible(other)
    msg = str(ei.value)
    assert f"{field}:" in msg
    named = [f for f in CHANGES if f != field and f"{f}:" in msg]
    assert named == [], f"check_compatible named fields that do not differ: {msg}"


def test_token_order_counts_from_two_heads():
    # two heads: NHD (block_size, 2, head_dim) and HND (2, block_size, head_dim) order the bytes differently
    two = dataclasses.replace(BASE, num_kv_heads=2)
    two_hnd = dataclasses.replace(two, token_order="HND")
    assert two_hnd.compat_hash != two.compat_hash
    with pytest.raises(LayoutMismatch, match="token_order") as ei:
        two.check_compatible(two_hnd)
    assert "num_kv_heads" not in str(ei.value)
    # one head against two, both HND: the heads differ, the order is not named as differing
    with pytest.raises(LayoutMismatch) as ei:
        one_hnd_ = dataclasses.replace(BASE, token_order="HND")
        one_hnd_.check_compatible(two_hnd)
    assert "num_kv_heads" in str(ei.value) and "token_order" not in str(ei.value)
    # one head: the same bytes in the same order either way, so the layouts exchange blocks
    one_hnd = dataclasses.replace(BASE, token_order="HND")
    assert one_hnd.compat_hash == BASE.compat_hash
    BASE.check_compatible(one_hnd)
    a, b = KVPool.allocate(BASE, 3), KVPool.allocate(one_hnd, 3)
    for x, y in zip(a.buffers, b.buffers):
        assert x.shape != y.shape and x.numel() == y.numel()
        x.view(-1).copy_(torch.arange(x.numel(), dtype=x.dtype))
        y.view(-1).copy_(torch.arange(y.numel(), dtype=y.dtype))
    for layer in range(BASE.num_layers):     # token t of block k, one head: the same values at the same bytes
        for pa, pb in zip(a.layer_kv(layer), b.layer_kv(layer)):
            assert torch.equal(pa[:, :, 0, :], pb[:, 0, :, :])


def test_check_compatible_names_every_differing_field():
    other = dataclasses.replace(BASE, head_dim=32, dtype="float32")
    with pytest.raises(LayoutMismatch) as ei:
        BASE.check_compatible(other)
    assert "head_dim" in str(ei.value) and "dtype" in str(ei.value)
    assert ei.value.action is Action.FIX


@pytest.mark.parametrize("bad", [dict(num_layers=0), dict(head_dim=-1), dict(block_size=1.5), dict(dtype="float64"),
                                 dict(kv_order="nope"), dict(token_order="XYZ"), dict(tp_rank=2, tp_size=2),
                                 dict(num_kv_heads=True)])
def test_layout_validation(bad):
    kw = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    kw.update(bad)
    with pytest.raises(ConfigError):
        KVLayout(**kw)


def test_layout_from_dict_unknown_field():
    d = BASE.to_dict()
    d["bogus"] = 1
    with pytest.raises(ConfigError):
        KVLayout.from_dict(d)


# -- KVPool.wrap --------------------------------------------------------------------------------------
def _engine_tensors(layout: KVLayout, nb: int) -> list[Any]:
    shape = layout.buffer_shape(nb)
    if layout.buffers_per_layer == 2:
        return [(torch.zeros(shape, dtype=layout.torch_dtype), torch.zeros(shape, dtype=layout.torch_dtype))
                for _ in range(layout.num_layers)]
    return [torch.zeros(shape, dtype=layout.torch_dtype) for _ in range(layout.num_layers)]


@pytest.mark.parametrize("make", [KVLayout.vllm_flash, KVLayout.flashinfer, KVLayout.split_kv, "mla"])
def test_wrap_is_zero_copy(make):
    layout = KVLayout.mla(2, 8, block_size=4, dtype="float32") if make == "mla" else \
        make(2, 2, 4, block_size=4, dtype="float32")
    eng = _engine_tensors(layout, 6)
    pool = KVPool.wrap(layout, eng)
    assert pool.num_blocks == 6
    flat = [t for pair in eng for t in (pair if isinstance(pair, tuple) else (pair,))]
    assert [b.data_ptr() for b in pool.buffers] == [t.data_ptr() for t in flat]
    # engine writes are visible through the pool (torch views and byte views) ...
    layer, blk = 1, 4
    kv = pool.layer_kv(layer)
    k_engine = kv[0] if isinstance(kv, tuple) else kv
    k_engine[blk].fill_(3.5)
    part = pool.block(layer, blk)
    part0 = part[0] if isinstance(part, tuple) else part
    assert torch.all(part0 == 3.5)
    buf, off, n = layout.segment(layer, blk, 0, 6)
    assert bytes(pool.host_views()[buf][off:off + n]) == torch.full((n // 4,), 3.5).numpy().tobytes()
    # ... and pool writes are visible to the engine
    pool.host_views()[buf][off:off + 4] = torch.tensor([-1.0]).numpy().tobytes()
    assert flat[buf].view(-1)[off // 4].item() == -1.0


@pytest.mark.parametrize("case", ["shape", "dtype", "layers", "noncontig", "split_single", "single_pair",
                                  "one_dim", "not_tensor", "mixed_blocks"])
def test_wrap_refuses_wrong_tensors(case):
    fl = KVLayout.vllm_flash(2, 2, 4, block_size=4, dtype="float16")
    sp = KVLayout.split_kv(2, 2, 4, block_size=4, dtype="float16")
    good = _engine_tensors(fl, 6)
    layout, tensors = fl, good
    if case == "shape":
        tensors = [good[0], torch.zeros((2, 6, 4, 2, 8), dtype=torch.float16)]
    elif case == "dtype":
        tensors = [good[0], good[1].float()]
    elif case == "layers":
        tensors = good[:1]
    elif case == "noncontig":
        big = torch.zeros((2, 6, 4, 4, 4), dtype=torch.float16)
        tensors = [good[0], big[..., :2, :]]
        assert tuple(tensors[1].shape) == fl.buffer_shape(6)
    elif case == "split_single":
        layout, tensors = sp, [torch.zeros(sp.buffer_shape(6), dtype=torch.float16)] * 2
    elif case == "single_pair":
        layout, tensors = fl, [(good[0], good[0]), good[1]]
    elif case == "one_dim":
        tensors = [torch.zeros(10, dtype=torch.float16), good[1]]
    elif case == "not_tensor":
        layout, tensors = sp, [(1, 2), (3, 4)]
    elif case == "mixed_blocks":
        tensors = [good[0], torch.zeros(fl.buffer_shape(7), dtype=torch.float16)]
    with pytest.raises(LayoutMismatch):
        KVPool.wrap(layout, tensors)


# -- errors --------------------------------------------------------------------------------------------
ALL_ERRORS = [getattr(E, n) for n in E.__all__ if isinstance(getattr(E, n), type)
              and issubclass(getattr(E, n), Exception)]


def test_error_tree_shape():
    assert len(ALL_ERRORS) >= 22
    codes = [c.code for c in ALL_ERRORS]
    assert len(codes) == len(set(codes)), "error codes must be unique"
    for cls in ALL_ERRORS:
        assert issubclass(cls, KVBridgeError)
        assert isinstance(cls.action, Action) and isinstance(cls.code, int) and cls.code > 0
        if cls is not KVBridgeError:
            assert issubclass(cls, (E.RetryableError, E.FinalError)), cls
            assert cls.__doc__, f"{cls.__name__} has no docstring"
        if issubclass(cls, E.RetryableError):
            assert cls.action is Action.RETRY and cls().retryable
        elif cls is not KVBridgeError:
            assert not cls().retryable
    assert E.StaleHandle.action is E.LeaseExpired.action is E.HandleNotFound.action is Action.REPREFILL
    assert E.IntegrityError.action is Action.REFETCH
    assert E.BadHandle.action is E.LayoutMismatch.action is E.ConfigError.action is Action.FIX
    assert issubclass(E.ConnectionLost, E.PeerUnavailable) and issubclass(E.FrameTooLarge, E.ProtocolError)
    assert all(n in kvbridge.__all__ for n in E.__all__)


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_error_code_round_trip(cls):
    exc = cls("something broke")
    back = E.error_from_code(exc.code, exc.message)
    assert type(back) is cls and back.message == "something broke"
    wired = decode_error(encode_error(exc))
    assert type(wired) is cls and wired.message == "something broke" and wired.action is exc.action
    if cls.hint:
        assert cls.hint in str(exc)


def test_error_from_unknown_code():
    assert type(E.error_from_code(9999, "x")) is E.ProtocolError
    assert type(decode_error(b"\x01")) is E.ProtocolError


# -- Retry, Backoff, Deadline -----------------------------------------------------------------------------
NOW = Backoff(base=0.0, cap=0.0)


class Flaky:
    def __init__(self, errors: list[BaseException], result: str = "ok") -> None:
        self.errors, self.result, self.calls = list(errors), result, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.result

    async def acall(self) -> str:
        return self()


def test_retry_retries_only_retryable():
    f = Flaky([E.ConnectionLost("a"), E.TransferTimeout("b")])
    seen: list = []
    assert Retry(attempts=3, backoff=NOW).call(f, lambda e, i: seen.append((type(e), i))) == "ok"
    assert f.calls == 3 and seen == [(E.ConnectionLost, 0), (E.TransferTimeout, 1)]
    for final in (E.BadHandle("x"), E.IntegrityError("y"), E.LeaseExpired("z")):
        f = Flaky([final])
        with pytest.raises(type(final)):
            Retry(attempts=5, backoff=NOW).call(f)
        assert f.calls == 1


def test_retry_honours_attempts():
    f = Flaky([E.PeerUnavailable(str(i)) for i in range(10)])
    with pytest.raises(E.PeerUnavailable) as ei:
        Retry(attempts=4, backoff=NOW).call(f)
    assert f.calls == 4 and ei.value.message == "3"
    f = Flaky([E.PeerUnavailable("x")])
    with pytest.raises(E.PeerUnavailable):
        kvbridge.policy.NO_RETRY.call(f)
    assert f.calls == 1


def test_retry_honours_deadline():
    f = Flaky([E.PeerUnavailable(str(i)) for i in range(1000)])
    t0 = time.monotonic()
    with pytest.raises(E.PeerUnavailable):
        Retry(attempts=1000, backoff=Backoff(base=0.05, cap=0.05, jitter=False), deadline=0.3).call(f)
    took = time.monotonic() - t0
    assert took < 0.6 and 3 <= f.calls <= 8
    # a backoff longer than what is left of the deadline: give up at once instead of sleeping past it
    f = Flaky([E.PeerUnavailable("x"), E.PeerUnavailable("y")])
    t0 = time.monotonic()
    with pytest.raises(E.PeerUnavailable):
        Retry(attempts=5, backoff=Backoff(base=5, cap=5, jitter=False), deadline=1.0).call(f)
    assert time.monotonic() - t0 < 0.5 and f.calls == 1


def test_retry_async():
    f = Flaky([E.ConnectionLost("a")])
    assert asyncio.run(Retry(attempts=2, backoff=NOW).acall(f.acall)) == "ok" and f.calls == 2
    f = Flaky([E.ConnectionLost("a"), E.ConnectionLost("b")])
    with pytest.raises(E.ConnectionLost):
        asyncio.run(Retry(attempts=2, backoff=NOW).acall(f.acall))
    f = Flaky([E.AccessDenied("no")])
    with pytest.raises(E.AccessDenied):
        asyncio.run(Retry(attempts=3, backoff=NOW).acall(f.acall))
    assert f.calls == 1


def test_retry_on_other_exception_types():
    """``retry_on`` is typed as any exception class; a listed non-kvbridge error is retried too."""
    f = Flaky([TimeoutError("t")])
    assert Retry(attempts=2, backoff=NOW, retry_on=(TimeoutError,)).call(f) == "ok"
    assert f.calls == 2


def test_backoff_bounds():
    b = Backoff(base=0.01, cap=0.1)
    for attempt in range(20):
        assert 0 <= b.delay(attempt) <= min(0.1, 0.01 * 2 ** attempt)
    nj = Backoff(base=0.01, cap=0.1, jitter=False)
    assert [nj.delay(i) for i in range(5)] == [0.01, 0.02, 0.04, 0.08, 0.1]


def test_deadline():
    d = Deadline(0.05)
    assert 0 < d.remaining() <= 0.05 and not d.expired()
    d.check()
    time.sleep(0.06)
    assert d.remaining() == 0 and d.expired()
    with pytest.raises(E.TransferTimeout):
        d.check("thing")
    assert Deadline(None).remaining(7.0) == 7.0 and not Deadline(None).expired()


# -- handle: altered copies ---------------------------------------------------------------------------------
def test_handle_replace_does_not_keep_stale_bytes():
    """``dataclasses.replace`` of a handle must not carry the original's cached bytes and MAC check."""
    key = b"s" * 32
    h = KVHandle(b"i" * 16, "r", "0" * 16, ("tcp://h:1",), (1, 2), (0, 0), (), 32,
                 token=b"t" * 16).signed(key)
    h2 = dataclasses.replace(h, block_ids=(7, 8))
    assert KVHandle.from_bytes(h2.to_bytes()).block_ids == (7, 8), "to_bytes() returned the old handle's bytes"
    with pytest.raises(BadHandle):
        h2.verify(key)


# -- registry --------------------------------------------------------------------------------------------
def test_registry_unknown_scheme():
    with pytest.raises(ConfigError) as ei:
        registry.get_transport_class("nosuch")
    assert "nosuch" in str(ei.value)
    with pytest.raises(ConfigError):
        registry.get_transport_class("nosuch://x")
    with pytest.raises(ConfigError):
        registry.scheme_of("no-scheme-here")
    pool = KVPool.allocate(KVLayout.mla(1, 4, block_size=1), 2)
    with pytest.raises(ConfigError):
        KVSender(pool, "nosuch://x", leases=False)


def test_registry_builtin_schemes():
    for scheme in ("inproc", "tcp"):
        cls = registry.get_transport_class(scheme)
        assert issubclass(cls, Transport) and cls.scheme == scheme
        assert registry.get_transport_class(f"{scheme}://x") is cls


def test_registry_missing_module_names_hint(monkeypatch):
    monkeypatch.setattr(registry, "known_implementations", dict(registry.known_implementations))
    monkeypatch.setattr(registry, "_loaded", dict(registry._loaded))
    registry.register("fakeucx", "kvbridge_no_such_module.transport:Fake", err="pip install kvbridge[fakeucx]")
    with pytest.raises(BackendUnavailable) as ei:
        registry.get_transport_class("fakeucx")
    assert "pip install kvbridge[fakeucx]" in str(ei.value) and "fakeucx" in str(ei.value)
    assert ei.value.action is Action.FIX
    pool = KVPool.allocate(KVLayout.mla(1, 4, block_size=1), 2)
    with pytest.raises(BackendUnavailable):
        KVSender(pool, "fakeucx://h:1", leases=False)


def test_registry_missing_class_is_a_kvbridge_error(monkeypatch):
    monkeypatch.setattr(registry, "known_implementations", dict(registry.known_implementations))
    monkeypatch.setattr(registry, "_loaded", dict(registry._loaded))
    registry.register("halfthere", "kvbridge.transports.inproc:NoSuchTransport")
    with pytest.raises((BackendUnavailable, ConfigError)):
        registry.get_transport_class("halfthere")


class _DictServer(Server):
    def __init__(self, url: str, source: Any) -> None:
        self.url, self.source = url, source

    def close(self) -> None:
        DictTransport.servers.pop(self.url, None)


class DictTransport(Transport):
    """A third-party backend, defined outside kvbridge."""

    scheme = "kvtestdict"
    servers: dict[str, _DictServer] = {}

    @classmethod
    def serve(cls, url: str, source: Any, timeout: Any = None) -> Server:
        srv = _DictServer(f"kvtestdict://s{len(cls.servers) + 1}", source)
        cls.servers[srv.url] = srv
        return srv

    def read(self, url: str, handle: KVHandle, dst: Any, indices: Optional[list[int]] = None,
             claim: Any = None) -> int:
        g = self.servers[url].source.open_read(handle.to_bytes(), indices, claim)
        try:
            return copy_runs(dst.runs(), g.spans.runs())
        finally:
            g.close()

    def release(self, url: str, handle: KVHandle, wait: bool = True) -> None:
        self.servers[url].source.release_remote(handle.to_bytes())


def test_registry_register_custom_class(monkeypatch):
    monkeypatch.setattr(registry, "_loaded", dict(registry._loaded))
    registry.register("kvtestdict", DictTransport)
    assert registry.get_transport_class("kvtestdict://anything") is DictTransport
    layout = KVLayout.vllm_flash(2, 1, 4, block_size=2, dtype="float32")
    spool, rpool = KVPool.allocate(layout, 8), KVPool.allocate(layout, 8)
    for i, b in enumerate(spool.buffers):
        b.copy_(torch.arange(b.numel(), dtype=torch.float32).view(b.shape) + 1000 * i)
    freed: list = []
    with KVSender(spool, "kvtestdict://", leases=False, on_free=lambda h, r: freed.append(r)) as snd:
        assert snd.url.startswith("kvtestdict://")
        ids = spool.alloc(3)
        h = snd.publish("custom", ids[::-1], 5)
        with KVReceiver(rpool, leases=False) as recv:
            res = recv.fetch(h, [7, 0, 4])
        assert res.ok, res.error
        for layer in range(2):
            for d, s in zip([7, 0, 4], ids[::-1]):
                for a, b in zip(rpool.block(layer, d), spool.block(layer, s)):
                    assert torch.equal(a, b)
        assert freed == ["released"] and spool.num_free == 8


def test_an_extension_speaking_another_frame_version_is_refused_at_import(monkeypatch):
    """A stale build of the C extension (its socket calls write and check the frame version)
    would talk past every peer: loading the wire module with one refuses it, naming the fix."""
    import importlib.util

    import kvbridge.blockcopy as bc
    import kvbridge.transports.wire as wire
    if bc.NATIVE:
        assert bc.NATIVE_WIRE_VERSION == wire.VERSION
    monkeypatch.setattr(bc, "NATIVE_WIRE_VERSION", wire.VERSION - 1)
    spec = importlib.util.spec_from_file_location("kvbridge.transports._wire_again", wire.__file__)
    assert spec is not None and spec.loader is not None
    again = importlib.util.module_from_spec(spec)
    with pytest.raises(ImportError, match="rebuild the extension"):
        spec.loader.exec_module(again)
