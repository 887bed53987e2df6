"""Handles naming ever new sender URLs -- unsigned ones from a hostile source, or one sender's
socket under many spellings -- do not grow a receiver's tables without bound: a transport keeps
``MAX_PEERS`` clients (the oldest retired: their idle connections closed), an shm:// reader maps
each sender once whatever URL names it, and the receiver's URL cache is bounded."""

from __future__ import annotations

import dataclasses
import secrets

import pytest

import kvbridge.receiver as receiver_mod
import kvbridge.transports.shm_onesided as shm_onesided_mod
import kvbridge.transports.sockets as sockets_mod
from kvbridge import BadHandle, KVLayout, KVPool, KVReceiver, KVSender, Retry, Timeout
from kvbridge.transports.tcp import TCPTransport

pytestmark = pytest.mark.timeout(60)
L = KVLayout.vllm_flash(2, 1, 8, block_size=2, dtype="float16")
PEERS = 4


@pytest.fixture
def few_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sockets_mod, "MAX_PEERS", PEERS)
    monkeypatch.setattr(shm_onesided_mod, "MAX_PEERS", PEERS)
    monkeypatch.setattr(receiver_mod, "MAX_URLS", 4 * PEERS)


def test_one_shm_sender_under_many_urls_keeps_the_tables_bounded(few_peers: None) -> None:
    name = f"kvbtest-{secrets.token_hex(6)}"
    with KVSender(KVPool.allocate(L, 8, shared=True), f"shm://@{name}", leases=False) as snd:
        h = snd.publish("r", snd.pool.alloc(2), 4)
        rcv = KVReceiver(KVPool.allocate(L, 8), leases=False, timeout=Timeout(connect=2, transfer=2),
                         retry=Retry(attempts=1))
        try:
            dst = rcv.pool.alloc(2)
            assert rcv.fetch(h, dst, release=False).ok                        # maps the sender
            tr = rcv.transport(h.urls[0])
            mapped = tr._senders[h.urls[0]]                                   # type: ignore[attr-defined]
            assert mapped is not None
            for i in range(6 * PEERS):
                # the same socket spelled anew (a query the address ignores): the sender refuses the
                # altered handle, and the reader asks it through the mapping it has
                hi = dataclasses.replace(h, urls=(f"shm://@{name}?n={i}",))
                assert isinstance(rcv.fetch(hi, dst, release=False).error, BadHandle)
            assert len(tr._by_url) <= 4 * PEERS                               # type: ignore[attr-defined]
            assert len(rcv._by_url) <= 4 * PEERS
            assert {id(m) for m in tr._senders.values()} == {id(mapped)}      # type: ignore[attr-defined]
            assert len(tr._senders) <= PEERS                                  # type: ignore[attr-defined]
            assert list(tr._by_path.values()) == [mapped]                     # type: ignore[attr-defined]
            assert len(tr._clients) == 1                                      # type: ignore[attr-defined]
            assert not tr._opening                                            # type: ignore[attr-defined]
            assert rcv.fetch(snd.publish("r2", snd.pool.alloc(2), 4), rcv.pool.alloc(2)).ok
        finally:
            rcv.close()


def test_tcp_clients_beyond_the_cap_are_retired_and_their_connections_closed(few_peers: None) -> None:
    with KVSender(KVPool.allocate(L, 8), "tcp://127.0.0.1:0", leases=False) as snd:
        h = snd.publish("r", snd.pool.alloc(2), 4)
        rcv = KVReceiver(KVPool.allocate(L, 8), leases=False)
        try:
            assert rcv.fetch(h, rcv.pool.alloc(2), release=False).ok
            tr = rcv.transport(h.urls[0])
            assert isinstance(tr, TCPTransport)
            first = tr._client(h.urls[0])
            idle = list(first._idle)
            assert idle and all(s.fileno() >= 0 for s in idle)   # the fetch's connection, pooled
            for port in range(1, 1 + 10 * PEERS):                # addresses nothing listens on: never dialled
                tr._client(f"tcp://127.0.0.2:{port}")
            assert len(tr._clients) <= PEERS
            assert len(tr._by_url) <= 4 * PEERS
            assert first._retired and not first._idle
            assert all(s.fileno() == -1 for s in idle)           # closed, not left to the garbage collector
            # the sender is still reachable: a new client, a new connection
            assert rcv.fetch(snd.publish("r2", snd.pool.alloc(2), 4), rcv.pool.alloc(2)).ok
        finally:
            rcv.close()
