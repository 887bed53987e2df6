"""Boundaries: what errors leave the library, what a failed constructor leaves behind, the
backend author's surface, counters under concurrency, read-only peer mappings."""

from __future__ import annotations

import socket
import threading

import pytest

import kvbridge
from kvbridge import Claim, ConfigError, ConnectionLost, KVLayout, KVPool, KVReceiver, KVSender, TransferTimeout
from kvbridge.metrics import ReceiverStats
from kvbridge.transports.wire import map_os_error

L = KVLayout.vllm_flash(2, 1, 4, block_size=2, dtype="float16")


def _port_open(url: str) -> bool:
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port))) == 0


def test_failed_sender_start_raises_the_real_error_and_closes_what_it_opened():
    pool = KVPool.allocate(L, 4)
    with KVSender(pool, "tcp://127.0.0.1:0", leases=False) as taken:
        busy = taken.url
        before = {t.name for t in threading.enumerate()}
        with pytest.raises(ConfigError, match="cannot listen"):
            KVSender(pool, ["tcp://127.0.0.1:0", busy])           # the second URL is taken
        leftover = {t.name for t in threading.enumerate()} - before
        assert not [n for n in leftover if n.startswith("kvb-")], leftover   # nothing left serving


def test_failed_receiver_start_raises_the_real_error():
    with pytest.raises(ConfigError, match="cannot listen"):
        KVReceiver(KVPool.allocate(L, 4), listen="tcp://256.1.1.1:0")


def test_only_socket_errors_are_mapped():
    assert isinstance(map_os_error(ConnectionResetError("reset"), "read"), ConnectionLost)
    assert isinstance(map_os_error(socket.timeout("slow"), "read"), TransferTimeout)
    with pytest.raises(TypeError):             # a programming error is not a dead peer
        map_os_error(TypeError("bug"), "read")
    with pytest.raises(KeyboardInterrupt):
        map_os_error(KeyboardInterrupt(), "read")


def test_public_surface():
    assert {"Claim", "Transfer", "TransferState", "FetchResult"} <= set(kvbridge.__all__)
    import kvbridge.transports as tr
    assert {"Transport", "Spans", "ReadOp", "BlockSource", "BlockSink", "register"} <= set(tr.__all__)
    c = Claim("me", 1, 2)
    assert c.fence == kvbridge.lease.Fence(1, 2)


def test_claim_returns_the_exported_claim():
    src, dst = KVPool.allocate(L, 4), KVPool.allocate(L, 4)
    src.alloc(4)
    with KVSender(src, "inproc://") as snd, KVReceiver(dst) as rcv:
        h = snd.publish("r", [0, 1], 4)
        c = rcv.claim(h)
        assert isinstance(c, Claim) and c.claimer == rcv.claimer
        assert rcv.fetch(h, [2, 3]).ok                     # the fetch reuses the claim


def test_stats_are_exact_under_threads():
    s = ReceiverStats()

    def bump() -> None:
        for _ in range(20_000):
            s.add(ok=1, bytes=3)
    ts = [threading.Thread(target=bump) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    d = s.as_dict()
    assert d["ok"] == 160_000 and d["bytes"] == 480_000


def test_shm_reader_maps_the_sender_read_only():
    src = KVPool.allocate(L, 4, shared=True)
    dst = KVPool.allocate(L, 4)
    src.alloc(4)
    with KVSender(src, "shm://", leases=False) as snd, KVReceiver(dst, leases=False) as rcv:
        assert rcv.fetch(snd.publish("r", [0, 1], 4), [2, 3]).ok
        tr = rcv.transport(snd.url)
        segs = list(tr._maps.values()) + [seg for m in tr._senders.values() if m is not None
                                          for seg in (m.segment, m.table)]   # MAP/DONE and one-sided maps
        assert segs and all(not seg.writable and seg.view.readonly for seg in segs)
        with pytest.raises(TypeError):
            segs[0].view[0] = 1
