"""A lease the sender claimed inside the read (tcp's CLAIM_ME) is released through that sender:
the receiver hands it the release (a CRELEASES entry riding behind a later request, or alone
after a linger) and the sender makes it in the store for the claim it made -- no release
round trip of the receiver's, and no event for the owner to wake on. Only the exact claim the
sender made ends the lease: a holder of the handle bytes with another claimer or fence ends
nothing. Counted on the lease server."""

from __future__ import annotations

import socket
import time

import pytest

from kvbridge import KVLayout, KVPool, KVReceiver, KVSender
from kvbridge.errors import LeaseConflict, LeaseExpired
from kvbridge.lease import Claim, EmbeddedRedis, LeaseState, RedisLeaseStore
from kvbridge.transports.tcp import TCPTransport
from kvbridge.transports.wire import (CLAIM_ME, HEADER, Kind, decode_error, encode_releases, encode_request, pack,
                                      recv_exact, unpack_header)
from tests.lease.test_round_trips import _script_calls, _state
from tests.waiting import wait_until as _wait

L = KVLayout.vllm_flash(2, 1, 8, block_size=4, dtype="float16")


@pytest.mark.timeout(60)
def test_the_sender_releases_the_leases_it_claimed(own_server: EmbeddedRedis) -> None:
    with RedisLeaseStore(own_server.url) as sls, RedisLeaseStore(own_server.url) as rls, \
            KVSender(KVPool.allocate(L, 32, allocator="engine"), "tcp://127.0.0.1:0", leases=sls) as snd, \
            KVReceiver(KVPool.allocate(L, 8), leases=rls) as rcv:
        assert rcv.fetch(snd.publish("warm", [0], 4), [0]).ok            # scripts loaded
        assert _wait(lambda: snd.num_live == 0)
        events = sls._events_prefix + snd.owner
        before_events = sls._redis.xlen(events)
        hs = [snd.publish(f"r{i}", [i + 1], 4) for i in range(20)]
        before = _script_calls(own_server)
        for i, h in enumerate(hs):
            assert rcv.fetch(h, [i % 8]).ok
        assert _wait(lambda: all(_state(sls, h.lease_id) is LeaseState.RELEASED for h in hs))
        assert _wait(lambda: snd.num_live == 0)                           # the sender freed every block
        assert _script_calls(own_server) - before == 2 * len(hs)          # per fetch: its claim, its release
        assert rls.stats.released == 0 and rls.stats.claimed == 0        # none of them by the receiver
        assert sls.stats.released == len(hs) + 1                          # all by the sender (warm-up too)
        assert sls._redis.xlen(events) == before_events                  # no event to wake the owner
        assert rcv.stats.released_later == len(hs) + 1 and rcv.stats.release_failures == 0
        with pytest.raises(LeaseExpired, match="already released"):       # consumed: refused here at once
            rcv.claim(hs[0])
        res = rcv.fetch(hs[-1], [0])
        assert not res.ok and isinstance(res.error, LeaseExpired)


@pytest.mark.timeout(60)
def test_only_the_claim_the_sender_made_releases_its_lease(own_server: EmbeddedRedis) -> None:
    with RedisLeaseStore(own_server.url) as ls, \
            KVSender(KVPool.allocate(L, 8, allocator="engine"), "tcp://127.0.0.1:0", leases=ls) as snd, \
            KVReceiver(KVPool.allocate(L, 8), leases=ls) as rcv, TCPTransport() as tr:
        h = snd.publish("r", [1, 2], 8)
        plain = KVSender(KVPool.allocate(L, 4, allocator="engine"), "tcp://127.0.0.1:0", leases=False)
        try:
            unleased = plain.publish("u", [0], 4)
            assert rcv.fetch(h, [3, 4], release=False).ok                  # claimed by the sender, kept
            lease = ls.get(h.lease_id)
            assert lease is not None and lease.state is LeaseState.CLAIMED
            real = Claim(rcv.claimer, lease.fence.epoch, lease.fence.counter)
            url = h.urls[0]
            refused = snd.stats.as_dict().get("refused", 0)
            forged = [Claim("mallory", real.epoch, real.counter),           # another claimer
                      Claim(real.claimer, real.epoch, real.counter + 1),    # another fence
                      Claim(real.claimer, 0, 0)]                            # CLAIM_ME itself
            for c in forged:
                assert tr.release_claimed(url, h, c)
            tr.release_claimed(plain.servers[0].url, unleased, real)      # a handle without a lease
            tr._client(url).flush()
            tr._client(plain.servers[0].url).flush()
            # bytes that are no entry at all, then a handle with a flipped bit
            sock = tr._client(url).acquire()
            sock.sendall(pack(Kind.CRELEASES, 0, b"\x00\x00\x00\x09garbage"))
            bad = bytearray(h.to_bytes())
            bad[len(bad) // 2] ^= 1
            sock.sendall(encode_releases([encode_request(bytes(bad), None, real)], Kind.CRELEASES))
            assert _wait(lambda: snd.stats.as_dict().get("refused", 0) >= refused + 4), snd.stats.as_dict()
            time.sleep(0.2)
            assert _state(ls, h.lease_id) is LeaseState.CLAIMED and snd.num_live == 1
            assert plain.num_live == 1                                     # the unleased handle: not ended either
            tr.release_claimed(url, h, real)                                # the claim it made: released
            tr._client(url).flush()
            assert _wait(lambda: _state(ls, h.lease_id) is LeaseState.RELEASED)
            assert _wait(lambda: snd.num_live == 0)
            sock.close()
        finally:
            plain.close()


@pytest.mark.timeout(60)
def test_a_receiver_closed_right_after_its_fetches_still_releases_them(own_server: EmbeddedRedis) -> None:
    """The claimed releases still waiting to ride are sent when the receiver closes."""
    with RedisLeaseStore(own_server.url) as ls, \
            KVSender(KVPool.allocate(L, 16, allocator="engine"), "tcp://127.0.0.1:0", leases=ls) as snd:
        rcv = KVReceiver(KVPool.allocate(L, 8), leases=ls)
        hs = [snd.publish(f"c{i}", [i], 4) for i in range(6)]
        assert all(rcv.fetch(h, [i]).ok for i, h in enumerate(hs))
        rcv.close()
        assert _wait(lambda: all(_state(ls, h.lease_id) is LeaseState.RELEASED for h in hs))
        assert _wait(lambda: snd.num_live == 0)


def _ask(sock: socket.socket, frame: bytes) -> tuple[Kind, bytes]:
    sock.sendall(frame)
    kind, _, n = unpack_header(recv_exact(sock, HEADER.size))
    return kind, recv_exact(sock, n)


@pytest.mark.timeout(60)
def test_a_peer_with_the_handle_learns_no_claimer_to_release_as(own_server: EmbeddedRedis) -> None:
    """A peer holding only the handle bytes asks to read while the genuine reader holds the
    claim: the refusal does not name the holder (a claimer's name is its claim's credential:
    with it the peer would claim re-entrantly, get the holder's fence and release it)."""
    with RedisLeaseStore(own_server.url) as ls, \
            KVSender(KVPool.allocate(L, 8, allocator="engine"), "tcp://127.0.0.1:0", leases=ls) as snd, \
            KVReceiver(KVPool.allocate(L, 8), leases=ls) as rcv:
        h = snd.publish("r", [1, 2], 8)
        assert rcv.fetch(h, [3, 4], release=False).ok                      # the genuine reader holds it
        host, port = h.urls[0][len("tcp://"):].rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            kind, body = _ask(s, pack(Kind.READ, 1, encode_request(h.to_bytes(), None, CLAIM_ME("mallory", 30))))
            assert kind is Kind.ERROR
            err = decode_error(body)
            assert isinstance(err, LeaseConflict) and rcv.claimer not in str(err)
        assert _state(ls, h.lease_id) is LeaseState.CLAIMED and snd.num_live == 1


@pytest.mark.timeout(60)
def test_a_claimed_release_sent_many_times_is_made_once(own_server: EmbeddedRedis) -> None:
    with RedisLeaseStore(own_server.url) as ls, \
            KVSender(KVPool.allocate(L, 8, allocator="engine"), "tcp://127.0.0.1:0", leases=ls) as snd, \
            KVReceiver(KVPool.allocate(L, 8), leases=ls) as rcv, TCPTransport() as tr:
        assert rcv.fetch(snd.publish("warm", [0], 4), [0]).ok            # the release script loaded
        assert _wait(lambda: snd.num_live == 0)
        h = snd.publish("r", [1, 2], 8)
        assert rcv.fetch(h, [3, 4], release=False).ok
        lease = ls.get(h.lease_id)
        assert lease is not None
        real = Claim(rcv.claimer, lease.fence.epoch, lease.fence.counter)
        refused = snd.stats.as_dict()["refused"]
        before = _script_calls(own_server)
        sock = tr._client(h.urls[0]).acquire()
        sock.sendall(encode_releases([encode_request(h.to_bytes(), None, real)] * 256, Kind.CRELEASES))
        assert _wait(lambda: _state(ls, h.lease_id) is LeaseState.RELEASED and snd.num_live == 0)
        time.sleep(0.2)
        assert _script_calls(own_server) - before == 1                   # one release, not 256
        assert snd.stats.as_dict()["refused"] == refused + 255
        sock.close()


@pytest.mark.timeout(60)
def test_the_release_goes_to_the_url_that_served_the_read(own_server: EmbeddedRedis) -> None:
    """The handle's first URL is down: the read is served at its second, and so is the release."""
    with RedisLeaseStore(own_server.url) as ls, \
            KVSender(KVPool.allocate(L, 8, allocator="engine"), ["tcp://127.0.0.1:0", "tcp://127.0.0.1:0"],
                     leases=ls) as snd, \
            KVReceiver(KVPool.allocate(L, 8), leases=ls) as rcv:
        h = snd.publish("r", [1], 4)
        snd.servers[0].close()
        assert rcv.fetch(h, [3]).ok
        assert _wait(lambda: _state(ls, h.lease_id) is LeaseState.RELEASED and snd.num_live == 0)
        assert ls.stats.released == 1                                      # by the sender (one store here)
