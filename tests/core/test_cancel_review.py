"""Review of the cancel that cuts connections (kvbridge.transports.deadline, Transfer.cancel):
a cancel from a signal handler, a connection armed after the cancel, the clean-up exchanges
of a cancelled push, and shm:// senders forgotten under one URL but kept under another."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

import kvbridge.transfer as transfer_mod
from kvbridge import KVLayout, KVPool, KVReceiver, KVSender, Retry, Timeout, TransferCancelled
from kvbridge.transfer import Flag
from kvbridge.transports.deadline import CANCELLED, Watchdog, serving
from kvbridge.transports.tcp import TCPTransport

pytestmark = pytest.mark.timeout(60)


class _Set:
    """A cancel flag already set (what serving() hands arm() after a transfer's cancel)."""

    def is_set(self) -> bool:
        return True


def test_a_cancel_from_a_signal_handler_does_not_deadlock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal handler runs on the thread it interrupts, between two bytecodes -- perhaps inside
    the watchdog's lock (an arm() rousing it, a disarm() learning a verdict): an engine's SIGTERM
    handler that cancels its transfers then took that lock again on the same thread, and hung."""
    wd = Watchdog(tick=0.05)
    monkeypatch.setattr(transfer_mod, "WATCHDOG", wd)
    a, b = socket.socketpair()
    flag, other = Flag(), Flag()
    done = threading.Event()

    def interrupted() -> None:
        with serving(other):
            wd.arm(a, time.monotonic() + 30)     # something armed: cancel() looks at its owners
        with wd._lock:                            # the thread is inside the lock when the signal comes
            flag.set()                            # ... and the handler cancels a transfer
        done.set()
    th = threading.Thread(target=interrupted, daemon=True)
    th.start()
    try:
        assert done.wait(2.0), "Flag.set() from inside the watchdog's lock (a signal handler) deadlocked"
        assert wd.disarm(a) is False              # the other transfer's exchange was not cut
    finally:
        a.close()
        b.close()


def test_an_exchange_armed_after_its_transfers_cancel_is_cut_at_once_as_cancelled() -> None:
    """Armed after the cancel (a connect under way as it came): cut now, verdict CANCELLED. It was
    given deadline 0 for the watchdog's next look -- up to TICK later while it sleeps between
    looks -- and then cut as a timeout (TransferTimeout, a failed transfer, not a cancelled one)."""
    wd = Watchdog(tick=0.5)
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    try:
        wd.arm(c, time.monotonic() + 30)          # another exchange keeps the watchdog between looks
        time.sleep(0.05)
        with serving(_Set()):
            wd.arm(a, time.monotonic() + 30)
        a.settimeout(2.0)
        t0 = time.monotonic()
        assert a.recv(1) == b""
        took = time.monotonic() - t0
        assert wd.disarm(a) == CANCELLED
        assert took < 0.3, f"cut after {took:.2f} s"   # at once: well before the 0.5 s look
        assert wd.disarm(c) is False
    finally:
        for s in (a, b, c, d):
            s.close()


L = KVLayout.vllm_flash(2, 1, 8, block_size=4, dtype="float16")


def test_a_cancel_during_connect_ends_the_transfer_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cancel lands while a layer read's connection is being opened (nothing armed yet to
    cut): the exchange armed next is cut and the transfer ends CANCELLED, not failed with a
    timeout (a whole read's retry turned that timeout into a cancel; a layer read's did not)."""
    with KVSender(KVPool.allocate(L, 8), "tcp://127.0.0.1:0", leases=False) as snd:
        h = snd.publish("r", snd.pool.alloc(2), 8, layers_ready=L.num_layers)
        assert h.layerwise
        rcv = KVReceiver(KVPool.allocate(L, 8), leases=False, timeout=Timeout(connect=2, transfer=5),
                         retry=Retry(attempts=1))
        try:
            client = rcv.transport(h.urls[0])._client(h.urls[0])   # type: ignore[attr-defined]
            real = client._connect
            box: list[Any] = []
            started = threading.Event()

            def connect(timeout: float) -> socket.socket:
                s = real(timeout)
                assert started.wait(5)            # the worker may get here before start_fetch returns
                box[0].cancel_event.set()         # the cancel comes as the connection opens
                return s
            client._connect = connect
            t = rcv.start_fetch(h, rcv.pool.alloc(2), release=False)
            box.append(t)
            started.set()
            res = t.result(10)
            assert isinstance(res.error, TransferCancelled), repr(res.error)
            assert t.state.value == "cancelled"
        finally:
            rcv.close()


def test_a_cancelled_push_still_tells_the_receiver(monkeypatch: pytest.MonkeyPatch) -> None:
    """A push cancelled mid-way gives the reservation up (WABORT) on its own thread, which still
    serves the cancelled transfer: that exchange was armed under the set flag and cut, so the
    receiver's reserved blocks stayed held until the reservation expired."""
    spool, rpool = KVPool.allocate(L, 8), KVPool.allocate(L, 8)
    real = TCPTransport.write
    started = threading.Event()
    cuts: list[int] = []

    def slow_write(self: TCPTransport, *a: Any, **kw: Any) -> int:
        started.set()
        time.sleep(0.3)
        return real(self, *a, **kw)
    monkeypatch.setattr(TCPTransport, "write", slow_write)
    real_abort = TCPTransport.abort_write

    def abort_write(self: TCPTransport, *a: Any, **kw: Any) -> None:
        try:
            real_abort(self, *a, **kw)
        except Exception:
            cuts.append(1)
            raise
    monkeypatch.setattr(TCPTransport, "abort_write", abort_write)
    with KVReceiver(rpool, listen="tcp://127.0.0.1:0", leases=False) as rcv, \
            KVSender(spool, "tcp://127.0.0.1:0", leases=False) as snd:
        rt = rcv.reserve(rpool.alloc(2), "p")
        t = snd.push(rt.reservation, spool.alloc(2))
        assert started.wait(5)
        t.cancel(5)
        assert isinstance(t.result(5).error, TransferCancelled), repr(t.result(5).error)
        r = rt.result(5)                          # the receiver heard the writer give up (not at expiry)
        assert not r.ok, "the push reports a cancel, but its write landed whole after it"
        assert not cuts, "the push's WABORT was cut by its own transfer's cancel"


def test_an_shm_sender_forgotten_under_one_url_is_forgotten_under_all() -> None:
    """An shm:// sender named by two URLs (one mapping, :meth:`_keep`) that goes away: the read
    through one URL forgets it (its watch socket closed), but the other URL kept the mapping --
    and its liveness check polled the closed descriptor, which the next socket opened reuses: a
    quiet socket of someone else's vouched for the dead sender."""
    import dataclasses
    import secrets
    name = f"kvbtest-{secrets.token_hex(6)}"
    snd = KVSender(KVPool.allocate(L, 8, shared=True), f"shm://@{name}", leases=False)
    rcv = KVReceiver(KVPool.allocate(L, 8), leases=False, timeout=Timeout(connect=2, transfer=2),
                     retry=Retry(attempts=1))
    spare: list[socket.socket] = []
    try:
        h = snd.publish("r", snd.pool.alloc(2), 8)
        u1, u2 = h.urls[0], f"shm://@{name}?again"
        assert rcv.fetch(h, rcv.pool.alloc(2), release=False).ok
        tr: Any = rcv.transport(u1)
        m = tr._senders[u1]
        assert m is not None
        assert tr._sender(u2, dataclasses.replace(h, urls=(u2,)), None) is m    # one mapping, two URLs
        fd = m.watch.fileno()
        tr._forget(m)                             # the sender went away, seen through u1
        assert tr._senders.get(u2) is not m, "the forgotten sender is still read through another URL"
        for _ in range(64):                       # the closed descriptor reused by a quiet socket
            a, b = socket.socketpair()
            spare += [a, b]
            if fd in (a.fileno(), b.fileno()):
                break
        m.poll_after = 0.0
        assert not tr._alive(u2, m), "a closed watch vouched for its sender"
    finally:
        for s in spare:
            s.close()
        rcv.close()
        snd.close()


@pytest.mark.parametrize("leased", [False, True])
def test_a_push_cancelled_before_a_worker_took_it_ends_its_handle_and_tells_the_receiver(leased: bool) -> None:
    """cancel() of a push still queued ended its Transfer there: its job -- which ends the sender's
    handle (on_free "aborted") and gives the reservation up (WABORT) -- never ran, so the source
    blocks stayed pinned and the reserved blocks held until their TTLs, and the cancelled result
    named the local handle and the source ids instead of the reservation and its blocks."""
    from kvbridge.transfer import TransferState, Workers
    spool, rpool = KVPool.allocate(L, 8, allocator="engine"), KVPool.allocate(L, 8)
    freed: list[str] = []
    leases: Any = None if leased else False
    with KVReceiver(rpool, listen="tcp://127.0.0.1:0", leases=leases) as rcv, \
            KVSender(spool, "tcp://127.0.0.1:0", leases=leases, ttl=60,
                     on_free=lambda h, why: freed.append(why)) as snd:
        snd._workers.close()
        snd._workers = Workers("kvb-push-test", max_workers=1)     # one worker: the second push waits
        busy_rt = rcv.reserve(rpool.alloc(1), "busy")
        busy = snd.push(busy_rt.reservation, [0], layers_ready=0)  # holds the worker: no layer is ready
        rt = rcv.reserve(rpool.alloc(2), "queued")
        t = snd.push(rt.reservation, [1, 2])
        assert t.state is TransferState.PENDING
        assert t.cancel(5)
        res = t.result(5)
        assert isinstance(res.error, TransferCancelled), repr(res.error)
        assert res.handle.reservation and res.dst_block_ids == list(rt.reservation.block_ids)
        assert freed == ["aborted"] and spool.refcount(1) == spool.refcount(2) == 0
        r = rt.result(5)                          # told at once, not at the reservation's TTL
        assert not r.ok and rpool.landing() == list(busy_rt.reservation.block_ids)   # the busy one only
        busy.cancel(5)
        assert busy_rt.result(5) is not None


def test_close_with_pushes_still_queued_cancels_them_tells_the_receivers_and_leaves_no_transport() -> None:
    """sender.close() with pushes waiting for a worker: their jobs run cancelled (so each handle
    ends and its receiver hears the writer give up), but on threads of their own, racing the end
    of close(): an abort made a new transport after close() had closed them, kept open (with a
    connection to the receiver) for as long as the sender lived; and they ended FAILED
    (StaleHandle) rather than CANCELLED."""
    from kvbridge.transfer import TransferState, Workers
    spool, rpool = KVPool.allocate(L, 32, allocator="engine"), KVPool.allocate(L, 32)
    with KVReceiver(rpool, listen="tcp://127.0.0.1:0", leases=False) as rcv:
        snd = KVSender(spool, "tcp://127.0.0.1:0", leases=False, ttl=60)
        snd._workers.close()
        snd._workers = Workers("kvb-push-test", max_workers=1)
        busy_rt = rcv.reserve(rpool.alloc(1), "busy")
        snd.push(busy_rt.reservation, [0], layers_ready=0)           # holds the one worker
        rts, ts = [], []
        for i in range(6):
            rt = rcv.reserve(rpool.alloc(2), f"q{i}")
            rts.append(rt)
            ts.append(snd.push(rt.reservation, [1 + 2 * i, 2 + 2 * i]))
        snd.close()
        for t, rt in zip(ts, rts):
            t.wait(5)
            assert t.state is TransferState.CANCELLED, t.state
            r = rt.result(5)                                           # told, not left to its TTL
            assert r is not None and not r.ok
        time.sleep(0.3)                                                 # the last aborts' threads end
        assert snd._transports == {}
        assert all(spool.refcount(b) == 0 for b in range(13))
