"""The conformance suite for the engine-facing modes, on every transport (inproc, tcp, shm):
engine-allocated pools, start/poll/cancel, layer-wise pulls (including a sender that dies
between layers), and push into reserved blocks (including aborts mid-write).

The sender runs in a child process for tcp/shm (see conftest), in this process for inproc.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

import base64
import dataclasses

from kvbridge import (Action, BadHandle, IntegrityError, KVHandle, KVLayout, PeerUnavailable, PoolError,
                      StaleHandle, Timeout, TransferCancelled, TransferState)

from ._peer import LISTEN, RemotePeer, mismatched_blocks, reference_pool, snapshot, wait_until

pytestmark = pytest.mark.timeout(60)

L4 = KVLayout.vllm_flash(4, 2, 4, block_size=4, dtype="float16")


def bytes_equal(a, b) -> bool:
    """Bitwise (random fills hold NaN patterns, which never compare equal as floats)."""
    return bool(a.contiguous().view(-1).view(torch.uint8).equal(b.contiguous().view(-1).view(torch.uint8)))


def same(dst_pool, dst, snd, src) -> bool:
    return mismatched_blocks(dst_pool, dst, reference_pool(snd.layout, snd.num_blocks, snd.seed), src) == []


# -- engine-allocated pools ---------------------------------------------------------------------
def test_engine_allocated_pools(make_sender, make_receiver):
    snd = make_sender(L4, 16, allocator="engine")
    recv, pool = make_receiver(L4, 16, allocator="engine")
    src, dst = [7, 2, 11], [9, 0, 4]                     # the engines' schedulers chose these
    h = snd.publish(src)
    st = snd.state()
    assert [st["refcounts"][b] for b in src] == [1, 1, 1] and st["num_free"] == 0   # pinned, no free list
    res = recv.fetch(h, dst)
    assert res.ok, res.error
    assert same(pool, dst, snd, src)
    assert wait_until(lambda: ["req", "released", src] in snd.state()["events"])
    st = snd.state()
    assert [st["refcounts"][b] for b in src] == [0, 0, 0]
    # unpinned, not retired: the engine still owns the content and may publish it again
    assert res.ok and recv.fetch(snd.publish(src, request_id="again"), [1, 3, 5]).ok


def test_engine_retires_a_published_block(make_sender, make_receiver):
    snd = make_sender(L4, 16, allocator="engine")
    recv, pool = make_receiver(L4, 16, allocator="engine")
    h = snd.publish([3, 4], request_id="reused")
    gen = snd.state()["generations"][4]
    assert snd.retire([4, 12]) == [4]                    # 4 was pinned by the handle, 12 was not
    assert snd.state()["generations"][4] == gen + 1
    assert wait_until(lambda: any(e[1] == "retired" for e in snd.state()["events"]))
    res = recv.fetch(h, [0, 1])
    assert not res.ok and isinstance(res.error, StaleHandle) and res.action is Action.REPREFILL
    assert res.failed_block_ids == [0, 1]


def test_retiring_a_block_two_handles_share_ends_both():
    """Prefix caching publishes one block in several handles: retiring it ends every one."""
    from kvbridge import KVPool, KVSender
    pool = KVPool.allocate(L4, 8, allocator="engine")
    ended: list[tuple[str, str]] = []
    with KVSender(pool, "inproc://", leases=False, on_free=lambda h, why: ended.append((h.request_id, why))) as snd:
        snd.publish("a", [0, 1], 2 * L4.block_size)
        snd.publish("b", [0, 2], 2 * L4.block_size)
        pool.retire([0])
        assert wait_until(lambda: sorted(ended) == [("a", "retired"), ("b", "retired")])


def test_retired_destination_fails_the_transfer(make_sender, make_receiver):
    snd = make_sender(L4, 16)
    recv, pool = make_receiver(L4, 16, allocator="engine")
    h = snd.publish([1, 2], layers_ready=0)
    t = recv.start_fetch(h, [5, 6])
    pool.retire([6])                                     # the engine reused a destination block
    snd.mark_ready(h.id, 4)
    res = t.result(10)
    assert not res.ok and isinstance(res.error, TransferCancelled) and res.failed_block_ids == [5, 6]


def test_kvbridge_pool_refuses_engine_calls():
    from kvbridge import KVPool
    p = KVPool.allocate(L4, 4)
    with pytest.raises(PoolError):
        p.retire([0])
    e = KVPool.allocate(L4, 4, allocator="engine")
    with pytest.raises(PoolError):
        e.alloc(1)


# -- start / poll / cancel ----------------------------------------------------------------------
def test_start_fetch_polled_from_a_scheduler_thread(make_sender, make_receiver):
    snd = make_sender(L4, 32)
    recv, pool = make_receiver(L4, 32)
    rng = random.Random(5)
    srcs = rng.sample(range(32), 24)                     # disjoint: each block published once
    jobs = [(srcs[3 * i:3 * i + 3], [3 * i, 3 * i + 1, 3 * i + 2]) for i in range(8)]
    handles = [snd.publish(src, request_id=f"r{i}") for i, (src, _) in enumerate(jobs)]
    seen: dict[str, object] = {}

    def scheduler() -> None:                             # one loop: start all, then poll
        ts = [recv.start_fetch(h, dst) for h, (_, dst) in zip(handles, jobs)]
        end = time.monotonic() + 20
        while len(seen) < len(ts) and time.monotonic() < end:
            for t in ts:
                if t.done() and t.request_id not in seen:
                    seen[t.request_id] = t.result(0)
            time.sleep(0.001)
    th = threading.Thread(target=scheduler)
    th.start()
    th.join(30)
    assert len(seen) == 8
    for i, (src, dst) in enumerate(jobs):
        res = seen[f"r{i}"]
        assert res.ok, res.error
        assert same(pool, dst, snd, src)


def test_start_fetch_result_and_await(make_sender, make_receiver):
    import asyncio
    snd = make_sender(L4, 8)
    recv, pool = make_receiver(L4, 8)
    t = recv.start_fetch(snd.publish([1, 2]), [3, 4])
    assert t.result(10).ok and t.state is TransferState.DONE and t.layers_done == 4
    assert t.wait_layer(3, 0) and not t.cancel()        # too late to cancel: the result stands
    res = asyncio.run(recv.afetch(snd.publish([5]), [6]))
    assert res.ok and same(pool, [6], snd, [5])


def test_wait_and_result_honour_their_timeout_on_a_pending_layerwise_transfer(make_sender, make_receiver):
    """A waiter with a timeout never runs the transfer itself (its layers may be far off): it
    returns at the timeout, and the transfer goes on to succeed."""
    snd = make_sender(L4, 8)
    recv, pool = make_receiver(L4, 8, workers=1)
    busy = snd.publish([5], request_id="busy", layers_ready=0)
    first = recv.start_fetch(busy, [6])              # takes the one worker: the next one waits, untaken
    assert wait_until(lambda: first._taken)
    h = snd.publish([1, 2], request_id="pending", layers_ready=0)
    t = recv.start_fetch(h, [3, 4])
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        t.result(timeout=0.05)
    assert not t.wait(0.05)
    assert time.monotonic() - t0 < 1.0
    snd.mark_ready(busy.id, 4)
    snd.mark_ready(h.id, 4)
    assert first.result(10).ok and t.result(10).ok and same(pool, [3, 4], snd, [1, 2])


def test_mark_ready_after_the_handle_ended_returns_false():
    """Nothing waits for the layers of an ended handle: mark_ready says so (the prefill may stop)."""
    from kvbridge import KVPool, KVSender
    pool = KVPool.allocate(L4, 4)
    with KVSender(pool, "inproc://", leases=False) as snd:
        h = snd.publish("r", pool.alloc(2), 2 * L4.block_size, layers_ready=1)
        assert snd.mark_ready(h, 2)
        assert snd.revoke(h)
        assert snd.mark_ready(h, 3) is False


def test_publish_on_a_closed_sender_leaves_the_blocks_to_the_caller():
    """A refused publish takes nothing: the caller still holds its blocks (and frees them once)."""
    from kvbridge import ConfigError, KVPool, KVSender
    pool = KVPool.allocate(L4, 4)
    snd = KVSender(pool, "inproc://", leases=False)
    snd.close()
    ids = pool.alloc(2)
    with pytest.raises(ConfigError, match="closed"):
        snd.publish("r", ids, L4.block_size)
    assert [pool.refcount(b) for b in ids] == [1, 1]
    pool.free(ids)


def test_cancel_while_waiting_for_a_layer(make_sender, make_receiver):
    snd = make_sender(L4, 8)
    recv, pool = make_receiver(L4, 8)
    h = snd.publish([1, 2], request_id="waiting", layers_ready=1)
    before = snapshot(pool)
    t = recv.start_fetch(h, [3, 4])
    assert t.wait_layer(0, 10) and not t.wait_layer(1, 0.05)
    t0 = time.monotonic()
    assert t.cancel(timeout=5)
    assert time.monotonic() - t0 < 2.0                   # the wait on the sender is bounded
    res = t.result(0)
    assert isinstance(res.error, TransferCancelled) and res.action is Action.REPREFILL
    assert t.state is TransferState.CANCELLED
    # the claim was aborted: the sender frees at once
    assert wait_until(lambda: ["waiting", "aborted", [1, 2]] in snd.state()["events"])
    snd.mark_ready(h.id, 4)                              # late layers never land
    time.sleep(0.3)
    # layer 0 had landed before the cancel; layers 1..3 must still hold the old bytes
    for layer in range(1, 4):
        assert bytes_equal(pool.buffers[layer][:, [3, 4]], before[layer][:, [3, 4]])


def test_cancel_mid_bytes(scheme, make_sender, make_receiver, peer):
    if scheme != "tcp":
        pytest.skip("only tcp moves bytes slowly enough to cancel mid-stream (a throttled socket)")
    big = KVLayout.vllm_flash(2, 8, 64, block_size=16, dtype="float16")   # 64 KiB a block
    snd = make_sender(big, 64)
    recv, pool = make_receiver(big, 64)
    h = snd.publish(list(range(64)), request_id="slow")
    peer.slow(on=True, chunk=64 << 10, pause=0.02, done_delay=0.0)
    try:
        t = recv.start_fetch(h, list(range(64)))
        time.sleep(0.2)
        assert not t.done()
        assert t.cancel(timeout=5)
        assert isinstance(t.result(0).error, TransferCancelled)
    finally:
        peer.slow(on=False)
    assert wait_until(lambda: ["slow", "aborted", list(range(64))] in snd.state()["events"])


# -- layer-wise pull ----------------------------------------------------------------------------
def test_layerwise_pull_layer_by_layer(make_sender, make_receiver):
    snd = make_sender(L4, 16)
    recv, pool = make_receiver(L4, 16)
    src, dst = [9, 1, 14], [2, 7, 0]
    h = snd.publish(src, request_id="lw", layers_ready=0)
    assert h.layerwise and h.checksums == ()
    t = recv.start_fetch(h, dst)
    assert not t.wait_layer(0, 0.1) and t.layers_done == 0
    for n in range(1, 5):
        snd.mark_ready(h.id, n)
        assert t.wait_layer(n - 1, 10)
        assert t.layers_done <= n                        # never ahead of what the sender marked
    res = t.result(10)
    assert res.ok, res.error
    assert res.nbytes == 3 * L4.block_nbytes
    assert same(pool, dst, snd, src)


def test_layerwise_corruption_refetched_then_refused(make_sender, make_receiver):
    snd = make_sender(L4, 8)
    recv, pool = make_receiver(L4, 8)
    h = snd.publish([1, 2], layers_ready=0)
    snd.mark_ready(h.id, 4)                              # checksums of every layer taken now
    snd.corrupt([2])                                     # then the bytes change
    res = recv.fetch(h, [5, 6])
    assert isinstance(res.error, IntegrityError) and res.action is Action.REFETCH
    assert res.failed_block_ids == [6]
    assert recv.stats.refetches == 1


def test_layerwise_sender_dies_between_layers(scheme, make_receiver):
    if scheme == "inproc":
        pytest.skip("inproc has no sender process to kill")
    victim = RemotePeer()
    try:
        info = victim.new_sender(layout=L4.to_dict(), num_blocks=8, listen=LISTEN[scheme], seed=3, reserve_all=True)
        h = KVHandle.from_bytes(base64.b64decode(victim.publish(
            sid=info["sid"], request_id="dies", block_ids=[3, 4], num_tokens=8, layers_ready=2)))
        recv, pool = make_receiver(L4, 8, timeout=Timeout(connect=1, transfer=3))
        t = recv.start_fetch(h, [0, 1])
        assert t.wait_layer(1, 10) and not t.wait_layer(2, 0.1)
        victim.kill()
        res = t.result(20)
        assert not res.ok and isinstance(res.error, PeerUnavailable) and res.action is Action.RETRY
        assert t.layers_done == 2 and res.failed_block_ids == [0, 1]
        assert t.state is TransferState.FAILED
    finally:
        victim.kill()
        victim.reap_orphans()


# -- push ---------------------------------------------------------------------------------------
def test_push_layer_by_layer(scheme, make_sender, make_receiver):
    snd = make_sender(L4, 16)
    recv, pool = make_receiver(L4, 16, listen=LISTEN[scheme])
    src, dst = [4, 11, 0], [8, 2, 13]
    rt = recv.reserve(dst, "pushed-req")
    assert rt.reservation is not None and rt.reservation.reservation
    pid = snd.push(rt.reservation, src, layers_ready=1)
    assert rt.wait_layer(0, 10) and not rt.wait_layer(1, 0.1)
    for n in (3, 4):
        snd.mark_ready(pid, n)
        assert rt.wait_layer(n - 1, 10)
    res = rt.result(10)
    assert res.ok, res.error
    assert res.nbytes == 3 * L4.block_nbytes and same(pool, dst, snd, src)
    out = snd.push_result(pid)
    assert out["ok"] and out["layers_done"] == 4
    assert wait_until(lambda: ["pushed-req", "pushed", src] in snd.state()["events"])


def test_push_cancelled_by_receiver_mid_push(scheme, make_sender, make_receiver):
    snd = make_sender(L4, 16)
    recv, pool = make_receiver(L4, 16, listen=LISTEN[scheme])
    rt = recv.reserve([1, 2], "cancelled-push")
    pid = snd.push(rt.reservation, [5, 6], layers_ready=2)
    assert rt.wait_layer(1, 10)
    assert rt.cancel(timeout=5)                          # returns once no write is in flight
    after = snapshot(pool)
    snd.mark_ready(pid, 4)                               # the writer tries the rest: refused
    out = snd.push_result(pid)
    assert not out["ok"] and out["error"] in ("LeaseExpired", "HandleNotFound", "StaleHandle")
    assert all(bytes_equal(a, b) for a, b in zip(after, pool.buffers))      # nothing landed after the cancel
    assert isinstance(rt.result(0).error, TransferCancelled)
    assert wait_until(lambda: ["cancelled-push", "aborted", [5, 6]] in snd.state()["events"])


def test_push_aborted_by_writer_mid_push(scheme, make_sender, make_receiver):
    snd = make_sender(L4, 16)
    recv, pool = make_receiver(L4, 16, listen=LISTEN[scheme])
    rt = recv.reserve([1, 2], "writer-aborts")
    pid = snd.push(rt.reservation, [5, 6], layers_ready=1)
    assert rt.wait_layer(0, 10)
    snd.peer.revoke(sid=snd.sid, handle_id=pid)          # the prefill side drops the request
    res = rt.result(10)
    assert not res.ok and isinstance(res.error, StaleHandle) and res.action is Action.REPREFILL
    assert res.failed_block_ids == [1, 2]
    assert not snd.push_result(pid)["ok"]


def test_push_refusals(scheme, make_sender, make_receiver):
    snd = make_sender(L4, 16)
    recv, pool = make_receiver(L4, 16, listen=LISTEN[scheme])
    rt = recv.reserve([1, 2], "guarded")
    res = rt.reservation
    # an altered reservation (other destination blocks) is refused before any claim or write
    tampered = dataclasses.replace(res, block_ids=(3, 4)).signed(b"not the receiver's key")
    with pytest.raises(Exception, match="AccessDenied|altered or forged"):
        snd.push(tampered, [5, 6])
    # re-signed with another key, contents intact: the receiver refuses the bytes
    other = recv.reserve([9], "other")
    before = snapshot(pool)
    resigned = dataclasses.replace(other.reservation).signed(b"not the receiver's key")
    out = snd.push_result(snd.push(resigned, [10]))
    assert not out["ok"] and out["error"] == "BadHandle"
    assert all(bytes_equal(a, b) for a, b in zip(before, pool.buffers))
    # a second writer while the first holds the claim: claim-once
    first = snd.push(res, [5, 6], layers_ready=0)
    time.sleep(0.2)
    second = snd.push_result(snd.push(res, [7, 8]))
    assert not second["ok"] and second["error"] == "LeaseConflict"
    snd.mark_ready(first, 4)
    assert snd.push_result(first)["ok"] and rt.result(10).ok
    assert same(pool, [1, 2], snd, [5, 6])
    with pytest.raises(BadHandle):
        recv.fetch(res, [1, 2])                          # a reservation is not a handle to fetch


def test_reservation_expires_without_a_writer(scheme, make_receiver):
    recv, pool = make_receiver(L4, 8, listen=LISTEN[scheme])
    rt = recv.reserve([1], "nobody", ttl=0.3)
    res = rt.result(10)
    assert not res.ok and res.action is Action.REPREFILL and rt.state is TransferState.FAILED



def test_layer_chunks_larger_than_a_control_frame(make_sender, make_receiver):
    """A layer read's reply carries data: it may exceed the 16 MiB cap of control frames."""
    big = KVLayout.vllm_flash(2, 8, 128, block_size=16, dtype="float16")   # 64 KiB per block and layer
    snd = make_sender(big, 300)
    recv, pool = make_receiver(big, 300)
    h = snd.publish(list(range(300)), layers_ready=2)                       # ~19 MiB in one chunk
    res = recv.fetch(h, list(range(300)))
    assert res.ok, res.error
    assert same(pool, list(range(300)), snd, list(range(300)))
