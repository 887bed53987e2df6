"""One conformance suite that every transport passes (``scheme`` in inproc, tcp, shm, ucx, nvlink;
nvlink's senders hold CUDA pools and it runs only where a CUDA device and CuPy are).

The sender runs in a child process for tcp/shm (see conftest), in this process for
inproc. Every test asserts outcomes: bytes equal block by block, error types and
actions, which destination blocks failed, and that freed blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import os
import random
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest

from kvbridge import (LeaseStoreUnavailable, AccessDenied, Action, BadHandle, FetchResult, IntegrityError,
                      KVHandle, KVLayout, KVPool, KVSender, LayoutMismatch, PoolError,
                      Retry, RetryableError, StaleHandle, Timeout)
from kvbridge.policy import Backoff
from kvbridge.transports.wire import HEADER, MAX_CONTROL, Kind, decode_error, pack

from ._peer import (LISTEN, RemotePeer, changed_blocks, fill_pool, mismatched_blocks, reference_pool,
                    snapshot, wait_until)

pytestmark = pytest.mark.timeout(60)

LAYOUTS = {
    "flash-nhd-f16": KVLayout.vllm_flash(2, 2, 8, block_size=4, dtype="float16"),
    "flash-hnd-bf16": KVLayout.vllm_flash(3, 2, 4, block_size=8, dtype="bfloat16", hnd=True),
    "flashinfer-nhd-f32": KVLayout.flashinfer(2, 1, 8, block_size=2, dtype="float32"),
    "flashinfer-hnd-f16": KVLayout.flashinfer(1, 4, 4, block_size=4, dtype="float16", hnd=True),
    "split-nhd-bf16": KVLayout.split_kv(2, 2, 4, block_size=4, dtype="bfloat16"),
    "split-hnd-f32": KVLayout.split_kv(2, 1, 8, block_size=2, dtype="float32", hnd=True),
    "mla-bf16": KVLayout.mla(3, 16, block_size=4, dtype="bfloat16"),
    "mla-f32": KVLayout.mla(1, 8, block_size=2, dtype="float32"),
}
SMALL = KVLayout.vllm_flash(2, 2, 4, block_size=4, dtype="float16")


def ids_sample(rng: random.Random, pool_blocks: int, n: int) -> list[int]:
    """n distinct block ids of a pool, in random (non-contiguous, out-of-order) order."""
    return rng.sample(range(pool_blocks), n)


def check_ok(res: FetchResult, ref: KVPool, src: list[int], dst_pool: KVPool, dst: list[int]) -> None:
    assert res.error is None, f"fetch failed: {res.error!r}"
    assert res.ok and res.failed_block_ids == []
    assert mismatched_blocks(dst_pool, dst, ref, src) == []


def expect_refused(fn, *types):
    """Run a fetch; input refusals raise, server refusals come back in the result. Returns the error."""
    try:
        res = fn()
    except types as exc:
        return exc, None
    assert res.error is not None, "fetch of a refused handle succeeded"
    assert isinstance(res.error, types), f"expected one of {types}, got {res.error!r}"
    assert not res.ok
    return res.error, res


# -- data path ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_bytes_equal(name, make_sender, make_receiver):
    layout = LAYOUTS[name]
    rng = random.Random(name)
    snd = make_sender(layout, 40)
    recv, pool = make_receiver(layout, 50)
    src, dst = ids_sample(rng, 40, 13), ids_sample(rng, 50, 13)
    before = snapshot(pool)
    h = snd.publish(src, num_tokens=13 * layout.block_size - 1)
    assert h.num_blocks == 13 and h.layout_hash == layout.compat_hash
    res = recv.fetch(h, dst)
    check_ok(res, reference_pool(layout, 40, snd.seed), src, pool, dst)
    assert res.nbytes == 13 * layout.block_nbytes
    # nothing outside the destination blocks was touched
    assert sorted(changed_blocks(pool, before)) == sorted(dst)


@pytest.mark.parametrize("pair", [("vllm_flash", "split_kv", False), ("flashinfer", "vllm_flash", True),
                                  ("split_kv", "flashinfer", True), ("vllm_flash", "flashinfer", False)])
def test_compatible_arrangements(pair, make_sender, make_receiver):
    a, b, hnd = pair
    sl = getattr(KVLayout, a)(2, 2, 4, block_size=4, dtype="bfloat16", hnd=hnd)
    rl = getattr(KVLayout, b)(2, 2, 4, block_size=4, dtype="bfloat16", hnd=hnd)
    assert sl.compat_hash == rl.compat_hash
    rng = random.Random(str(pair))
    snd = make_sender(sl, 24)
    recv, pool = make_receiver(rl, 30)
    src, dst = ids_sample(rng, 24, 9), ids_sample(rng, 30, 9)
    res = recv.fetch(snd.publish(src), dst)
    check_ok(res, reference_pool(sl, 24, snd.seed), src, pool, dst)


@pytest.mark.parametrize("n", [0, 1])
def test_zero_and_one_block(n, make_sender, make_receiver):
    snd = make_sender(SMALL, 8)
    recv, pool = make_receiver(SMALL, 8)
    before = snapshot(pool)
    src, dst = [5][:n], [2][:n]
    res = recv.fetch(snd.publish(src, num_tokens=0 if n == 0 else 3), dst)
    check_ok(res, reference_pool(SMALL, 8, snd.seed), src, pool, dst)
    assert res.nbytes == n * SMALL.block_nbytes
    assert changed_blocks(pool, before) == dst


@pytest.mark.timeout(60)
def test_ten_thousand_blocks(make_sender, make_receiver):
    tiny = KVLayout.vllm_flash(1, 1, 2, block_size=1, dtype="float16")  # 8 bytes per block
    rng = random.Random(10_000)
    snd = make_sender(tiny, 12_000)
    recv, pool = make_receiver(tiny, 11_000)
    src, dst = ids_sample(rng, 12_000, 10_000), ids_sample(rng, 11_000, 10_000)
    h = snd.publish(src)
    assert len(h.to_bytes()) < 200_000
    res = recv.fetch(h, dst)
    check_ok(res, reference_pool(tiny, 12_000, snd.seed), src, pool, dst)
    assert wait_until(lambda: snd.state()["num_live"] == 0)


def test_indices_subset(make_sender, make_receiver):
    rng = random.Random(3)
    snd = make_sender(SMALL, 20)
    recv, pool = make_receiver(SMALL, 20)
    before = snapshot(pool)
    src = ids_sample(rng, 20, 8)
    h = snd.publish(src)
    idx = [6, 0, 3]
    dst = [11, 2, 17]
    res = recv.fetch(h, dst, indices=idx, release=False)
    check_ok(res, reference_pool(SMALL, 20, snd.seed), [src[i] for i in idx], pool, dst)
    assert sorted(changed_blocks(pool, before)) == sorted(dst)
    # a second subset of the same (unreleased) handle
    res2 = recv.fetch(h, [19], indices=[7])
    check_ok(res2, reference_pool(SMALL, 20, snd.seed), [src[7]], pool, [19])
    with pytest.raises(PoolError):
        recv.fetch(h, [1], indices=[8])    # index outside the handle


@pytest.mark.timeout(60)
def test_concurrent_fetches(make_sender, make_receiver):
    rng = random.Random(4)
    snd = make_sender(SMALL, 64)
    ref = reference_pool(SMALL, 64, snd.seed)
    receivers = [make_receiver(SMALL, 64, seed=i) for i in range(3)]
    perm = ids_sample(rng, 64, 48)
    srcs = [perm[k * 4:(k + 1) * 4] for k in range(12)]
    jobs = []
    for k, src in enumerate(srcs):
        recv, pool = receivers[k % 3]
        dst = list(range((k // 3) * 4, (k // 3) * 4 + 4))[::-1]
        jobs.append((recv, pool, snd.publish(src, request_id=f"r{k}"), src, dst))
    with ThreadPoolExecutor(6) as ex:
        results = list(ex.map(lambda j: j[0].fetch(j[2], j[4]), jobs))
    for (recv, pool, h, src, dst), res in zip(jobs, results):
        check_ok(res, ref, src, pool, dst)
    assert wait_until(lambda: snd.state()["num_free"] == 48)


def test_afetch(make_sender, make_receiver):
    rng = random.Random(5)
    snd = make_sender(SMALL, 16)
    recv, pool = make_receiver(SMALL, 16)
    src, dst = ids_sample(rng, 16, 5), ids_sample(rng, 16, 5)
    res = asyncio.run(asyncio.wait_for(recv.afetch(snd.publish(src), dst), 20))
    check_ok(res, reference_pool(SMALL, 16, snd.seed), src, pool, dst)


def test_fetch_many_and_afetch_many(make_sender, make_receiver):
    rng = random.Random(6)
    snd = make_sender(SMALL, 40)
    ref = reference_pool(SMALL, 40, snd.seed)
    recv, pool = make_receiver(SMALL, 40)
    order = ids_sample(rng, 40, 40)
    dorder = ids_sample(rng, 40, 40)
    srcs = [order[i * 4:(i + 1) * 4] for i in range(10)]
    dsts = [dorder[i * 4:(i + 1) * 4] for i in range(10)]
    hs = [snd.publish(s, request_id=f"m{i}") for i, s in enumerate(srcs)]
    res = recv.fetch_many(list(zip(hs[:5], dsts[:5])))
    assert [r.request_id for r in res] == [f"m{i}" for i in range(5)]
    for r, s, d in zip(res, srcs[:5], dsts[:5]):
        check_ok(r, ref, s, pool, d)
    ares = asyncio.run(asyncio.wait_for(recv.afetch_many(list(zip(hs[5:], dsts[5:]))), 20))
    assert [r.request_id for r in ares] == [f"m{i}" for i in range(5, 10)]
    for r, s, d in zip(ares, srcs[5:], dsts[5:]):
        check_ok(r, ref, s, pool, d)
    assert wait_until(lambda: snd.state()["num_live"] == 0)


# -- lifecycle -------------------------------------------------------------------------------------
def test_release_frees_blocks_once(make_sender, make_receiver):
    snd = make_sender(SMALL, 16, reserve_all=False)
    recv, pool = make_receiver(SMALL, 16)
    assert snd.state()["num_free"] == 16
    src = snd.alloc(6)
    assert snd.state()["num_free"] == 10
    h = snd.publish(src, request_id="rel")
    res = recv.fetch(h, list(range(6)))
    check_ok(res, reference_pool(SMALL, 16, snd.seed), src, pool, list(range(6)))
    assert wait_until(lambda: snd.state()["num_free"] == 16)
    st = snd.state()
    assert st["events"] == [["rel", "released", src]]
    assert st["num_live"] == 0 and all(c == 0 for c in st["refcounts"])
    # a second fetch of the released handle: its KV is gone
    err, res2 = expect_refused(lambda: recv.fetch(h, list(range(6, 12))), StaleHandle)
    assert err.action is Action.REPREFILL
    assert recv.release(h) is False          # releasing again is refused (logged), frees nothing
    time.sleep(0.05)
    assert snd.state()["events"] == [["rel", "released", src]]


def test_unreleased_handle_expires_and_frees(make_sender, make_receiver):
    snd = make_sender(SMALL, 12, reserve_all=False, ttl=0.3)
    recv, pool = make_receiver(SMALL, 12)
    src = snd.alloc(4)
    h = snd.publish(src, request_id="ttl")
    assert snd.state()["num_free"] == 8
    assert wait_until(lambda: snd.state()["num_free"] == 12, timeout=5)
    st = snd.state()
    assert st["events"] == [["ttl", "expired", src]] and st["num_live"] == 0
    before = snapshot(pool)
    err, res = expect_refused(lambda: recv.fetch(h, [0, 1, 2, 3]), StaleHandle)
    assert err.action is Action.REPREFILL
    if res is not None:
        assert res.action is Action.REPREFILL and res.failed_block_ids == [0, 1, 2, 3]
    assert changed_blocks(pool, before) == []


def test_revoked_handle_refused(make_sender, make_receiver):
    snd = make_sender(SMALL, 12, reserve_all=False)
    recv, pool = make_receiver(SMALL, 12)
    src = snd.alloc(3)
    h = snd.publish(src, request_id="rv")
    assert snd.revoke(h) is True
    assert snd.revoke(h) is False
    assert wait_until(lambda: snd.state()["num_free"] == 12)
    assert snd.state()["events"] == [["rv", "revoked", src]]
    before = snapshot(pool)
    res = recv.fetch(h, [7, 3, 9])
    assert isinstance(res.error, StaleHandle), repr(res.error)
    assert res.action is Action.REPREFILL and not res.ok
    assert res.failed_block_ids == [7, 3, 9]
    assert changed_blocks(pool, before) == []


def test_sender_closed(make_sender, make_receiver):
    """A sender that closed cleanly freed its blocks: the fetch fails fast, retry-elsewhere or re-prefill."""
    snd = make_sender(SMALL, 8)
    recv, pool = make_receiver(SMALL, 8, timeout=Timeout(connect=1, transfer=3))
    h = snd.publish([1, 2])
    snd.close()
    before = snapshot(pool)
    t0 = time.monotonic()
    res = recv.fetch(h, [3, 4])
    assert time.monotonic() - t0 < 8
    assert isinstance(res.error, (RetryableError, StaleHandle)), repr(res.error)
    assert res.action in (Action.RETRY, Action.REPREFILL) and not res.ok
    assert res.failed_block_ids == [3, 4]
    assert changed_blocks(pool, before) == []


# -- refusals ----------------------------------------------------------------------------------------
def alter(h: KVHandle, **changes: object) -> KVHandle:
    """A copy of ``h`` with fields changed, its cached bytes dropped (re-encoded, old MAC kept)."""
    new = dataclasses.replace(h, **changes)
    object.__setattr__(new, "_raw", None)
    return new


def _tampered_token(h: KVHandle) -> bytes:
    raw = bytearray(h.to_bytes())
    raw[21] ^= 0x01                      # first byte of the read token (after magic/version/flags/id)
    assert KVHandle.from_bytes(bytes(raw)).token != h.token
    return bytes(raw)


def _altered(h: KVHandle, how: str) -> bytes:
    if how == "flip_token":
        return _tampered_token(h)
    raw = bytearray(h.to_bytes())
    if how == "flip_mac":
        raw[-1] ^= 0x80
        return bytes(raw)
    if how == "flip_request_id":
        raw[raw.index(h.request_id.encode())] ^= 0x20
        return bytes(raw)
    if how == "block_id_reencoded":     # change a block id and re-encode without the key
        return alter(h, block_ids=h.block_ids[:-1] + (h.block_ids[-1] + 1,)).to_bytes()
    assert how == "generation_reencoded"
    return alter(h, generations=h.generations[:-1] + (h.generations[-1] + 1,)).to_bytes()


ALTERATIONS = ["flip_token", "flip_mac", "flip_request_id", "block_id_reencoded", "generation_reencoded"]


@pytest.mark.parametrize("how", ALTERATIONS)
def test_altered_handle_refused(how, make_sender, make_receiver):
    snd = make_sender(SMALL, 16)
    recv, pool = make_receiver(SMALL, 16)
    h = snd.publish([3, 4, 5], request_id="alter")
    before = snapshot(pool)
    expect_refused(lambda: recv.fetch(_altered(h, how), [0, 1, 2]), BadHandle, AccessDenied)
    assert changed_blocks(pool, before) == []


@pytest.mark.parametrize("how", ["flip_token", "block_id_reencoded"])
def test_refused_forgery_leaves_genuine_handle_intact(how, make_sender, make_receiver):
    """Whoever presents an altered copy must not be able to destroy the genuine request's KV."""
    snd = make_sender(SMALL, 16)
    recv, pool = make_receiver(SMALL, 16)
    h = snd.publish([3, 4, 5], request_id="victim")
    expect_refused(lambda: recv.fetch(_altered(h, how), [0, 1, 2]), BadHandle, AccessDenied)
    time.sleep(0.3)   # give a lease watcher time to act on whatever the refusal did
    assert snd.state()["events"] == [], "the refused forgery freed the genuine handle's blocks"
    recv2, pool2 = make_receiver(SMALL, 16)
    check_ok(recv2.fetch(h, [0, 1, 2]), reference_pool(SMALL, 16, snd.seed), [3, 4, 5], pool2, [0, 1, 2])


@pytest.mark.parametrize("leased", [True, False])
def test_forged_handle_refused(leased, make_sender, make_receiver):
    snd = make_sender(SMALL, 16)
    recv, pool = make_receiver(SMALL, 16)
    real = snd.publish([1, 2], request_id="real")
    forged = alter(real, handle_id=os.urandom(16), token=os.urandom(16),
                   lease_id=os.urandom(16).hex() if leased else "").signed(os.urandom(32))
    before = snapshot(pool)
    err, _ = expect_refused(lambda: recv.fetch(forged, [5, 6]), BadHandle, AccessDenied, StaleHandle)
    if not leased or not real.lease_id:
        assert isinstance(err, (BadHandle, AccessDenied)), repr(err)
    assert changed_blocks(pool, before) == []
    assert snd.state()["num_live"] == 1 and snd.state()["events"] == []


def test_shared_secret_wrong_token_access_denied(make_sender, make_receiver):
    """Right key, right id, different token: AccessDenied at the sender; receiver-side MAC check."""
    secret = os.urandom(32)
    snd = make_sender(SMALL, 16, secret=secret)
    recv, pool = make_receiver(SMALL, 16)              # no secret: the sender must refuse
    h = snd.publish([1, 2], request_id="tok")
    other = alter(h, token=os.urandom(16)).signed(secret)
    before = snapshot(pool)
    err, _ = expect_refused(lambda: recv.fetch(other.to_bytes(), [5, 6]), AccessDenied, BadHandle)
    assert isinstance(err, AccessDenied), repr(err)
    assert changed_blocks(pool, before) == []
    # a receiver that knows the secret refuses altered handles before any I/O or claim
    h2 = snd.publish([3, 4], request_id="tok2")
    recv2, pool2 = make_receiver(SMALL, 16, secret=secret)
    before2 = snapshot(pool2)
    with pytest.raises(BadHandle):
        recv2.fetch(_tampered_token(h2), [5, 6])
    with pytest.raises(BadHandle):
        recv2.fetch(alter(h2, token=os.urandom(16)).signed(os.urandom(32)), [5, 6])
    with pytest.raises(BadHandle):
        recv2.fetch(alter(h2, block_ids=(3, 5)), [5, 6])   # fields changed, old MAC kept
    assert changed_blocks(pool2, before2) == []
    check_ok(recv2.fetch(h2, [5, 6]), reference_pool(SMALL, 16, snd.seed), [3, 4], pool2, [5, 6])


def test_layout_mismatch(make_sender, make_receiver):
    snd = make_sender(SMALL, 8)
    h = snd.publish([1])
    for other in (dataclasses.replace(SMALL, head_dim=8), dataclasses.replace(SMALL, dtype="bfloat16"),
                  dataclasses.replace(SMALL, token_order="HND"), dataclasses.replace(SMALL, tp_size=2)):
        recv, pool = make_receiver(other, 8)
        before = snapshot(pool)
        with pytest.raises(LayoutMismatch):
            recv.fetch(h, [0])
        assert changed_blocks(pool, before) == []


def test_wrong_destination_ids(make_sender, make_receiver):
    snd = make_sender(SMALL, 8)
    recv, pool = make_receiver(SMALL, 8)
    h = snd.publish([1, 2, 3])
    before = snapshot(pool)
    for dst in ([0, 1], [0, 1, 2, 3], [0, 0, 1], [0, 1, 8], [-1, 0, 1]):
        with pytest.raises(PoolError):
            recv.fetch(h, dst)
    assert changed_blocks(pool, before) == []
    assert snd.state()["num_live"] == 1


def test_corrupted_source_blocks(make_sender, make_receiver):
    snd = make_sender(SMALL, 16)
    recv, pool = make_receiver(SMALL, 16)
    src = [9, 2, 14, 5, 0, 7]
    dst = [1, 3, 5, 7, 9, 11]
    h = snd.publish(src, request_id="bad")
    assert len(h.checksums) == 6
    snd.corrupt([14, 7])
    res = recv.fetch(h, dst)
    assert isinstance(res.error, IntegrityError), repr(res.error)
    assert res.action is Action.REFETCH and not res.ok
    assert res.failed_block_ids == [5, 11]
    assert recv.stats.refetches == 1 and recv.stats.integrity_failures == 1
    ref = reference_pool(SMALL, 16, snd.seed)
    # the good blocks hold the source's bytes; the bad ones hold the (corrupted) sent bytes
    assert mismatched_blocks(pool, dst, ref, src) == [5, 11]


# -- faults needing a peer process ------------------------------------------------------------------
BIG = KVLayout.vllm_flash(2, 8, 64, block_size=16, dtype="float16")   # 64 KiB per block


@pytest.mark.timeout(60)
def test_peer_killed_mid_transfer(scheme, make_receiver):
    if scheme == "inproc":
        pytest.skip("inproc has no peer process to kill")
    victim = RemotePeer()
    try:
        info = victim.new_sender(layout=BIG.to_dict(), num_blocks=256, listen=LISTEN[scheme], seed=1,
                                 reserve_all=True)
        h = KVHandle.from_bytes(base64.b64decode(victim.publish(
            sid=info["sid"], request_id="big", block_ids=list(range(255, -1, -1)), num_tokens=16 * 256)))
        victim.slow(on=True)            # ~25 MB/s sends, 2 s validate-after-read: 16 MiB takes > 0.6 s
        recv, pool = make_receiver(BIG, 256, timeout=Timeout(connect=1, transfer=3),
                                   retry=Retry(attempts=2, backoff=Backoff(base=0.05, cap=0.1)))
        dst = list(range(256))
        box: dict = {}

        def run() -> None:
            t0 = time.monotonic()
            box["res"] = recv.fetch(h, dst)
            box["t"] = time.monotonic() - t0
        th = threading.Thread(target=run, daemon=True)
        th.start()
        time.sleep(0.35)
        assert th.is_alive(), "transfer finished before the kill; slow mode did not engage"
        victim.kill()
        th.join(timeout=15)
        assert not th.is_alive(), "fetch hung after the peer died"
        res = box["res"]
        assert isinstance(res.error, RetryableError), repr(res.error)
        assert res.action is Action.RETRY and not res.ok
        assert res.failed_block_ids == dst
        # the victim also hosts the embedded lease server the handle names: when the claim that
        # travels with the read cannot be learned from it either, the failure is the lease
        # server's (retryable too), reached before or after the read's retries
        assert res.attempts == 2 or isinstance(res.error, LeaseStoreUnavailable), (res.attempts, res.error)
        assert box["t"] < 1 + 3 + 3
    finally:
        victim.kill()
        victim.reap_orphans()


@pytest.mark.timeout(30)
def test_cancelled_afetch_raises_cancelled(scheme, make_sender, make_receiver, peer):
    """Cancelling an afetch (e.g. the request was aborted) must cancel it, not retry it."""
    if scheme == "inproc":
        pytest.skip("inproc transfers are one memcpy; nothing to cancel mid-way")
    snd = make_sender(BIG, 256)
    h = snd.publish(list(range(256)))
    recv, pool = make_receiver(BIG, 256, retry=Retry(attempts=3, backoff=Backoff(base=0.01, cap=0.02)))
    peer.slow(on=True)
    try:
        async def main() -> object:
            task = asyncio.create_task(recv.afetch(h, list(range(256))))
            await asyncio.sleep(0.3)
            assert not task.done()
            task.cancel()
            try:
                async with asyncio.timeout(15):
                    return await task
            except asyncio.CancelledError:
                return "cancelled"
        out = asyncio.run(main())
    finally:
        peer.slow(on=False)
    cancelled = out == "cancelled"
    assert cancelled, (f"afetch swallowed its cancellation and returned "
                                f"ok={getattr(out, 'ok', None)} attempts={getattr(out, 'attempts', None)}")


# -- malformed frames on the raw socket (socket-based transports) ----------------------------------
def _raw_connect(url: str) -> socket.socket:
    u = urlsplit(url)
    if u.scheme in ("tcp", "ucx"):
        s = socket.create_connection((u.hostname, u.port), timeout=5)
    else:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect("\0" + u.netloc[1:] if u.netloc.startswith("@") else u.path)
    return s


def _reply(s: socket.socket) -> object:
    """'closed', or (Kind, error) of one reply frame."""
    head = b""
    while len(head) < HEADER.size:
        try:
            chunk = s.recv(HEADER.size - len(head))
        except ConnectionResetError:
            return "closed"
        if not chunk:
            return "closed"
        head += chunk
    magic, ver, kind, rid, length = HEADER.unpack(head)
    assert magic == b"KB"
    body = b""
    while len(body) < length:
        chunk = s.recv(length - len(body))
        assert chunk
        body += chunk
    return (Kind(kind), decode_error(body) if kind == Kind.ERROR else body)


MALFORMED = {
    "garbage": os.urandom(16) .replace(b"KB", b"XX") + b"\x00" * 4,
    "bad_magic": struct.pack("!2sBBIQ", b"ZZ", 1, Kind.READ, 1, 4) + b"abcd",
    "bad_version": struct.pack("!2sBBIQ", b"KB", 99, Kind.READ, 1, 4) + b"abcd",
    "unknown_kind": struct.pack("!2sBBIQ", b"KB", 1, 200, 1, 0),
    "oversized_read": struct.pack("!2sBBIQ", b"KB", 1, Kind.READ, 1, MAX_CONTROL + 1),
    "oversized_data": struct.pack("!2sBBIQ", b"KB", 1, Kind.DATA, 1, 1 << 62),
    "truncated_header": b"KB\x01\x01",
    "truncated_payload": struct.pack("!2sBBIQ", b"KB", 1, Kind.READ, 1, 100) + b"x" * 10,
    "bad_read_payload": pack(Kind.READ, 1, b"\xff\xff\xff\xff"),
    "bad_handle": pack(Kind.READ, 1, struct.pack("!I", 40) + os.urandom(40) + b"\0"),
    "reply_kind_from_client": pack(Kind.OK, 1),
}


def check_malformed_answered(s: socket.socket, case: str) -> None:
    """Send ``MALFORMED[case]`` on ``s`` (then closed): within 3 s the server answers an ERROR
    or closes; where framing survives, the connection keeps working."""
    try:
        s.sendall(MALFORMED[case])
        if case.startswith("truncated"):
            s.shutdown(socket.SHUT_WR)
        t0 = time.monotonic()
        rep = _reply(s)
        assert time.monotonic() - t0 < 3
        if rep != "closed":
            kind, err = rep
            assert kind is Kind.ERROR, f"{case}: answered {kind.name}"
            assert err.code in (27, 28, 21, 25, 26), repr(err)
            if case in ("bad_read_payload", "bad_handle", "reply_kind_from_client"):
                # framing intact: the connection keeps working
                s.sendall(pack(Kind.PING, 7, b"hi"))
                assert _reply(s) == (Kind.PONG, b"hi")
    finally:
        s.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_frames(case, scheme, make_receiver, monkeypatch):
    if scheme == "inproc":
        pytest.skip("inproc has no wire")
    crashes: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: crashes.append(args.exc_value))
    pool = KVPool.allocate(SMALL, 8, shared=(scheme == "shm"), device="cuda" if scheme == "nvlink" else "cpu")
    fill_pool(pool, 99)
    pool.alloc(8)
    with KVSender(pool, LISTEN[scheme], timeout=Timeout(transfer=1.0), leases=False) as snd:
        check_malformed_answered(_raw_connect(snd.url), case)
        # the server keeps serving other clients
        recv, dpool = make_receiver(SMALL, 8)
        h = snd.publish("after", [4, 1], num_tokens=5)
        check_ok(recv.fetch(h, [0, 7]), pool, [4, 1], dpool, [0, 7])
        time.sleep(0.05)
    assert crashes == [], f"a server thread died with {crashes!r}"
