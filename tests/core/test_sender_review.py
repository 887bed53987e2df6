"""The sender's lifecycle under races: close() against publish and reads, handles in bulk."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import pytest

import kvbridge.sender as sender_mod
from kvbridge import ConfigError, KVLayout, KVPool, KVReceiver, KVSender
from kvbridge.published import Grant
from kvbridge.transports.tcp import TCPTransport
from kvbridge.transports.wire import Kind, encode_request, pack

from ._peer import wait_until

pytestmark = pytest.mark.timeout(60)

L = KVLayout.vllm_flash(1, 1, 8, block_size=4, dtype="float16")


@pytest.mark.parametrize("allocator", ["kvbridge", "engine"])
def test_a_publish_that_close_overtakes_is_refused_and_the_blocks_stay_the_callers(
        allocator: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() landing while a publish runs (here: while it hashes the blocks) makes the publish
    refuse, as on a sender already closed: nothing freed, no on_free for a handle the caller never
    got. It used to end the handle -- freeing the caller's reference, telling on_free "closed" --
    and then raise, so the caller freed the blocks again (double free, or a free of blocks
    another request had meanwhile been given)."""
    pool = KVPool.allocate(L, 8, allocator=allocator)
    freed: list[str] = []
    snd = KVSender(pool, "tcp://127.0.0.1:0", leases=False, on_free=lambda h, why: freed.append(why))
    ids = pool.alloc(2) if allocator == "kvbridge" else [0, 1]
    real = sender_mod.block_checksums

    def closing(*a: Any) -> Any:
        snd.close()
        return real(*a)
    monkeypatch.setattr(sender_mod, "block_checksums", closing)
    with pytest.raises(ConfigError, match="closed"):
        snd.publish("r", ids, 8)
    assert freed == []
    assert [pool.refcount(b) for b in ids] == ([1, 1] if allocator == "kvbridge" else [0, 0])
    if allocator == "kvbridge":
        pool.free(ids)                      # the caller's own free, as after any refusal
        assert pool.num_free == 8


@pytest.mark.parametrize("end", ["revoke", "close"])
def test_a_push_holds_its_blocks_until_its_write_has_ended(end: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A push reads its blocks for the wire: a revoke or close() meanwhile frees them (and tells
    on_free, the engine's licence to reuse them) only once the write has ended, and close()
    returns after that. They used to be freed at once, under the write still sending them."""
    lay = KVLayout.vllm_flash(2, 1, 8, block_size=4, dtype="float16")
    spool, rpool = KVPool.allocate(lay, 8), KVPool.allocate(lay, 8)
    events: list[str] = []
    real = TCPTransport.write

    def slow_write(self: TCPTransport, *a: Any, **kw: Any) -> int:
        events.append("write starts")
        try:
            time.sleep(0.5)                              # a slow link: the blocks are on their way
            return real(self, *a, **kw)                  # (close() cancels the push: its write is cut)
        finally:
            events.append("write ended")
    monkeypatch.setattr(TCPTransport, "write", slow_write)
    with KVReceiver(rpool, listen="tcp://127.0.0.1:0", leases=False) as rcv, \
            KVSender(spool, "tcp://127.0.0.1:0", leases=False, on_free=lambda h, why: events.append(why)) as snd:
        rt = rcv.reserve(rpool.alloc(2), "p")
        t = snd.push(rt.reservation, spool.alloc(2))
        assert wait_until(lambda: "write starts" in events, 5.0)
        if end == "revoke":
            snd.revoke(t.handle)   # type: ignore[arg-type]
            assert spool.num_free == 6
        else:
            snd.close()
            events.append("close returned")
        assert t.result(10) is not None
        assert wait_until(lambda: spool.num_free == 8, 5.0)
    want = ["write starts", "write ended", "revoked"] if end == "revoke" else \
        ["write starts", "write ended", "closed", "close returned"]
    assert events[:len(want)] == want


def test_close_returns_once_the_reads_in_flight_have_drained(monkeypatch: pytest.MonkeyPatch) -> None:
    """close() with a read in flight: the read ends (its connection shut), then its blocks are
    freed -- before close() returns, so an engine that tears down after close() gets every
    on_free first. The worker serving the read is slowed here to notice, as on a loaded host;
    close() used to return at once and the blocks went later, from that worker."""
    lay = KVLayout.vllm_flash(8, 8, 128, block_size=16, dtype="float16")    # 512 KiB a block
    pool = KVPool.allocate(lay, 16)
    freed: list[str] = []
    real = Grant.close

    def slow_close(self: Grant) -> None:
        time.sleep(0.3)
        real(self)
    monkeypatch.setattr(Grant, "close", slow_close)
    snd = KVSender(pool, "tcp://127.0.0.1:0", leases=False, on_free=lambda h, why: freed.append(why))
    h = snd.publish("slow", pool.alloc(16), 16 * 16)
    host, port = snd.url.removeprefix("tcp://").rsplit(":", 1)
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((host, int(port)))
        s.settimeout(5)
        s.sendall(pack(Kind.READ, 1, encode_request(h.to_bytes())))
        assert s.recv(4096)                                    # the reply has begun: the read is in flight
        t0 = time.monotonic()
        snd.close()
        assert freed == ["closed"] and pool.num_free == 16
        assert time.monotonic() - t0 < 5.0
    finally:
        s.close()


@pytest.mark.parametrize("end", ["release", "release_many", "expiry"])
def test_blocks_the_caller_freed_behind_a_handle_are_not_freed_again(end: str) -> None:
    """A caller that frees a block it published (its bug) and hands it to another request: when
    the handle ends, the sender must not free that block again -- it used to, silently, putting
    the other request's block back on the free list under it (the next alloc would share it)."""
    pool = KVPool.allocate(L, 1)
    with KVSender(pool, "tcp://127.0.0.1:0", leases=False) as snd:
        h = snd.publish("a", pool.alloc(1), 4, ttl=0.2 if end == "expiry" else 60.0)
        pool.free([0])                                     # freed behind the handle's back ...
        assert pool.alloc(1) == [0]                        # ... and now another request's block
        if end == "release":
            snd.release_remote(h.to_bytes())
        elif end == "release_many":
            assert snd.release_many([h.to_bytes()]) == [None]
        assert wait_until(lambda: snd.num_live == 0, 5.0)
        assert pool.refcount(0) == 1 and pool.num_free == 0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="counts descriptors in Linux /proc")
def test_close_leaves_no_connection_open_that_a_worker_never_took() -> None:
    """close() while a burst of connections waits for the server's workers: each is closed too.
    Those still queued for a worker were left open for good (hundreds of descriptors a close)."""
    pool = KVPool.allocate(L, 4)
    KVSender(pool, "tcp://127.0.0.1:0", leases=False).close()        # lazy imports and state settled
    base = _fds()
    for _ in range(2):
        snd = KVSender(pool, "tcp://127.0.0.1:0", leases=False)
        host, port = snd.url.removeprefix("tcp://").rsplit(":", 1)
        socks = [socket.create_connection((host, int(port)), timeout=5) for _ in range(300)]
        for s in socks:
            s.sendall(pack(Kind.PING, 1, b""))
        snd.close()
        for s in socks:
            s.close()
    assert wait_until(lambda: _fds() <= base, 5.0), _fds() - base


def test_close_with_the_lease_server_down_does_not_wait_on_each_handle() -> None:
    """close() with 40 leased handles live and the lease server killed: each revoke waited out the
    store's retries in turn (about 0.2 s a handle with the connection refused; far more where
    packets are dropped). After one revoke finds the server down, the others are not tried for a
    moment: every handle is freed at its local deadline, which is safe (docs/LEASES.md)."""
    from kvbridge.lease import EmbeddedRedis
    with EmbeddedRedis(unix_socket=False) as srv:
        pool = KVPool.allocate(L, 64)
        freed: list[str] = []
        snd = KVSender(pool, "tcp://127.0.0.1:0", leases=srv.url, lease_namespace="down" + os.urandom(4).hex(),
                       clock_margin=0.2, on_free=lambda h, why: freed.append(why))
        for i in range(40):
            snd.publish(f"r{i}", pool.alloc(1), 4, ttl=1.5)
        srv.kill()
        t0 = time.monotonic()
        snd.close()
        assert time.monotonic() - t0 < 3.0
        assert freed == [] and pool.num_free == 24       # Redis may still hold the leases: kept until the deadline
        assert wait_until(lambda: pool.num_free == 64, 10.0) and freed == ["closed"] * 40


def test_a_push_that_close_overtakes_fails_in_its_transfer() -> None:
    """close() landing between a push's publish and the hand-over to the sender's workers: the
    push returns its Transfer, failed (its handle ended "closed", on_free told once), never a raw
    RuntimeError("workers are closed") after the blocks were already freed -- a caller taking
    that for a refusal freed them again."""
    lay = KVLayout.vllm_flash(2, 1, 8, block_size=4, dtype="float16")
    spool, rpool = KVPool.allocate(lay, 8), KVPool.allocate(lay, 8)
    freed: list[str] = []
    with KVReceiver(rpool, listen="tcp://127.0.0.1:0", leases=False) as rcv:
        snd = KVSender(spool, "tcp://127.0.0.1:0", leases=False, on_free=lambda h, why: freed.append(why))
        rt = rcv.reserve(rpool.alloc(2), "p")
        real = snd.stats.add

        def closing(**kw: Any) -> None:
            if "pushes" in kw:
                snd.close()            # close() lands between the push's publish and its submit
            real(**kw)
        snd.stats.add = closing        # type: ignore[method-assign]
        t = snd.push(rt.reservation, spool.alloc(2))   # type: ignore[arg-type]
        res = t.result(10)
        assert res is not None and not res.ok and res.error is not None
        assert freed == ["closed"] and spool.num_free == 8


@pytest.mark.parametrize("ttl", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_ttl_that_means_nothing_is_refused_before_anything_is_taken(ttl: float) -> None:
    """publish(ttl=nan or inf) raised a raw ValueError or OverflowError; without leases a TTL of 0
    or less was taken, handing out a handle already expired (leased ones refused it). Now each is
    a ConfigError, the blocks stay the caller's; KVSender(ttl=...) and renew() check it too."""
    pool = KVPool.allocate(L, 4)
    with KVSender(pool, "tcp://127.0.0.1:0", leases=False) as snd:
        ids = pool.alloc(1)
        with pytest.raises(ConfigError, match="ttl"):
            snd.publish("r", ids, 4, ttl=ttl)
        assert pool.refcount(ids[0]) == 1 and snd.num_live == 0
        h = snd.publish("r", ids, 4)
        with pytest.raises(ConfigError, match="ttl"):
            snd.renew(h, ttl)
    with pytest.raises(ConfigError, match="ttl"):
        KVSender(pool, "tcp://127.0.0.1:0", leases=False, ttl=ttl)
    # a claim TTL of 0 or less made every leased fetch lapse its claim and report re-prefill (nan and
    # inf raised raw ValueError / OverflowError from the fetch); a clock margin must be a duration
    from kvbridge import KVReceiver
    for make in (lambda **kw: KVReceiver(pool, **kw), lambda **kw: KVSender(pool, "tcp://127.0.0.1:0", leases=False,
                                                                            **kw)):
        with pytest.raises(ConfigError, match="claim_ttl"):
            make(claim_ttl=ttl)
        if ttl != 0.0:
            with pytest.raises(ConfigError, match="clock_margin"):
                make(clock_margin=ttl)
    pool.close()


def test_a_lease_ttl_too_large_for_the_server_is_refused_before_any_write() -> None:
    """A store given a TTL past what PEXPIREAT takes ran its script's first writes and then failed:
    a lease key with no expiry, a fence consumed, the id unusable. Refused before the call now."""
    import redis

    from kvbridge.lease import EmbeddedRedis, RedisLeaseStore
    with EmbeddedRedis() as server, RedisLeaseStore(server.url, namespace="bigttl") as store:
        with pytest.raises(ConfigError, match="at most"):
            store.publish("big", "own", 1e16)
        assert not redis.Redis.from_url(server.auth_url).keys("{bigttl}:*")
        assert store.publish("big", "own", 10).ttl_ms_left > 0


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0?foo=bar", "http://127.0.0.1:1/"])
def test_a_reservation_naming_an_unusable_lease_server_fails_the_push_and_frees_its_blocks(url: str) -> None:
    """The lease server a leased reservation names is outside its lease digest: whoever made the
    reservation chose it. One no store can use made push() report ConfigError ("fix your
    configuration") from before the push's own error handling, so the push's handle never ended
    and its blocks stayed pinned until their TTL. It is the reservation's fault: BadHandle, the
    blocks freed at once ("aborted")."""
    import dataclasses

    from kvbridge import BadHandle

    why: list[str] = []
    spool, rpool = KVPool.allocate(L, 8), KVPool.allocate(L, 8)
    with KVReceiver(rpool, listen="inproc://bad-lease-push", leases=False) as rcv, \
            KVSender(spool, "inproc://bad-lease-push-src", leases=None, ttl=600,
                     on_free=lambda h, reason: why.append(reason)) as snd:
        res = rcv.reserve(rpool.alloc(2), "p").reservation
        assert res is not None
        forged = dataclasses.replace(res, lease_url=url, lease_id="x")
        forged = dataclasses.replace(forged, lease_id=forged.lease_digest())
        t = snd.push(forged, spool.alloc(2))
        out = t.result(10)
        assert isinstance(out.error, BadHandle) and "lease server" in str(out.error)
        assert why == ["aborted"] and spool.num_free == 8
