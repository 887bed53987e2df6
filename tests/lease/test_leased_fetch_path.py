"""The usual leased tcp fetch in one C call (``KVReceiver._fetch_leased``): the READ asks the
owner to claim as it serves (CLAIM_ME), the reply's fence comes back with the bytes, and the
pipeline's end follows (validate-after-read by the owner's trailer, the release through the
owner). Every other outcome goes on in the pipeline from where the C call left it, under the
claim the owner reported: a checksum that differs is refetched under that fence, a
destination retired meanwhile fails and aborts the claim, a reply without a fence is refused
and the claim the owner made is learnt and aborted. On a real Redis-protocol server."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest

from kvbridge import KVHandle, KVLayout, KVPool, KVReceiver, KVSender, blockcopy
from kvbridge.errors import AccessDenied, PoolError, ProtocolError
from kvbridge.lease import EmbeddedRedis, LeaseState, RedisLeaseStore
from kvbridge.transports.base import Spans
from kvbridge.transports.tcp import TCPTransport
from tests.core._pools import filled
from tests.lease.test_round_trips import _state
from tests.waiting import wait_until as _wait

L = KVLayout.vllm_flash(2, 1, 8, block_size=4, dtype="float16")

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(blockcopy.fetch_whole is None,
                                 reason="the native extension (kvbridge._kvcopy) is not built")]


@contextlib.contextmanager
def _one_handle(server: EmbeddedRedis,
                request_id: str) -> Iterator[tuple[RedisLeaseStore, KVPool, KVReceiver, KVHandle]]:
    """A leased sender's pool, a receiver, and a handle of blocks [2, 3] on one lease store."""
    src = filled(L, 8, 1)
    with RedisLeaseStore(server.url) as ls, KVSender(src, "tcp://127.0.0.1:0", leases=ls) as snd, \
            KVReceiver(KVPool.allocate(L, 8), leases=ls) as rcv:
        yield ls, src, rcv, snd.publish(request_id, [2, 3], 8)


def _blocks(pool: KVPool, ids: list[int]) -> bytes:
    return b"".join(bytes(v) for v in Spans.of_blocks(pool, ids).views())


def _after_fetch_whole(monkeypatch: pytest.MonkeyPatch, then: Any) -> list[Any]:
    """``blockcopy.fetch_whole`` made to return ``then(what it returned, its arguments, call
    number)``; the arguments of each call."""
    real, calls = blockcopy.fetch_whole, []
    assert real is not None

    def fetch_whole(*args: Any) -> Any:
        calls.append(args)
        return then(real(*args), args, len(calls))

    monkeypatch.setattr(blockcopy, "fetch_whole", fetch_whole)
    return calls


def _fetch_turned(monkeypatch: pytest.MonkeyPatch, rcv: KVReceiver, h: KVHandle, then: Any) -> tuple[Any, list[Any]]:
    """``rcv.fetch(h, [5, 6])`` with its C call's outcome turned into ``then(what it returned,
    its arguments, the generations as it began)`` (a leased landing leaves the blocks marked,
    as a fallback does); the result and the calls' arguments."""
    dst = rcv.pool
    gens = dst.generations([5, 6])

    def turned(got: Any, args: Any, n: int) -> Any:
        assert dst.landing() == [5, 6]
        return then(got, args, gens)
    calls = _after_fetch_whole(monkeypatch, turned)
    return rcv.fetch(h, [5, 6]), calls


def test_a_leased_fetch_is_one_c_call_and_released_through_its_owner(own_server: EmbeddedRedis,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    src = filled(L, 16, 1)
    with RedisLeaseStore(own_server.url) as sls, RedisLeaseStore(own_server.url) as rls, \
            KVSender(src, "tcp://127.0.0.1:0", leases=sls) as snd, KVReceiver(KVPool.allocate(L, 8), leases=rls) as rcv:
        reads: list[int] = []
        real_read = TCPTransport.read
        monkeypatch.setattr(TCPTransport, "read", lambda self, *a, **k: reads.append(1) or real_read(self, *a, **k))
        calls = _after_fetch_whole(monkeypatch, lambda got, args, n: got)
        hs = [snd.publish(f"r{i}", [i, i + 8], 8) for i in range(6)]
        for i, h in enumerate(hs):
            dst = [i, 7 - i] if i != 3 else [6, 7]
            res = rcv.fetch(h, dst)
            assert res.ok and res.attempts == 1 and res.nbytes == 2 * L.block_nbytes, res.error
            assert rcv.pool.landing() == [] and _blocks(rcv.pool, dst) == _blocks(src, [i, i + 8])
        assert len(calls) == len(hs) and reads == []                  # one C call each, never the pipeline's read
        assert all(len(args) == 14 and any(args[-1]) for args in calls)  # leased: the owner's fence came back
        assert rcv.stats.claimed == len(hs) and rls.stats.claimed == 0   # claimed by the owner, inside the read
        assert _wait(lambda: all(_state(sls, h.lease_id) is LeaseState.RELEASED for h in hs))
        assert _wait(lambda: snd.num_live == 0) and rls.stats.released == 0


def test_a_leased_fetch_whose_checksum_differs_is_refetched_under_the_owners_claim(
        own_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    with _one_handle(own_server, "flip") as (ls, src, rcv, h):
        def flipped(got: Any, args: Any, gens: list[int]) -> Any:
            assert got is True and any(args[-1])                      # landed, and the fence is known
            return 0, gens, [h.checksums[0], h.checksums[1] ^ 1]      # as if block 1 changed in transit
        res, calls = _fetch_turned(monkeypatch, rcv, h, flipped)
        dst = rcv.pool
        assert len(calls) == 1 and res.ok and rcv.stats.refetches == 1 and rcv.stats.integrity_failures == 0
        assert _blocks(dst, [5, 6]) == _blocks(src, [2, 3])
        assert rcv.stats.claimed == 1 and dst.landing() == []         # the refetch went under the owner's claim
        assert _wait(lambda: _state(ls, h.lease_id) is LeaseState.RELEASED)


def test_a_destination_retired_during_a_leased_fetch_fails_it_and_aborts_the_claim(
        own_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    with _one_handle(own_server, "moved") as (ls, _, rcv, h):
        dst = rcv.pool

        def retired(got: Any, args: Any, gens: list[int]) -> Any:
            dst._gens[6] += 1                                         # the engine reused a destination block
            return 4, gens, None
        res, _ = _fetch_turned(monkeypatch, rcv, h, retired)
        assert not res.ok and "freed or retired during the transfer" in str(res.error), repr(res.error)
        assert res.failed_block_ids == [5, 6] and dst.landing() == [] and rcv.stats.aborted == 1
        assert _state(ls, h.lease_id) == "A"                            # the claim the owner made, aborted


def test_a_leased_reply_without_the_owners_fence_is_refused_and_its_claim_aborted(
        own_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    """An owner that claims but serves the read without the fence (its grant's claim dropped
    here): ProtocolError, nothing landed; the receiver claims itself to learn the fence the
    owner took (claims are re-entrant for their claimer) and aborts it."""
    import dataclasses

    from kvbridge.sender_serving import SenderServing
    real_open = SenderServing.open_read
    monkeypatch.setattr(SenderServing, "open_read",
                        lambda self, *a, **k: dataclasses.replace(real_open(self, *a, **k), claim=None))
    with _one_handle(own_server, "nofence") as (ls, _, rcv, h):
        before = _blocks(rcv.pool, [5, 6])
        res = rcv.fetch(h, [5, 6])
        assert not res.ok and isinstance(res.error, ProtocolError) and "without its claim" in str(res.error)
        assert _blocks(rcv.pool, [5, 6]) == before and rcv.pool.landing() == []
        assert rcv.stats.aborted == 1 and _state(ls, h.lease_id) == "A"


def test_a_receiver_without_leases_refuses_a_leased_handle_and_claims_nothing(own_server: EmbeddedRedis) -> None:
    """``leases=False``: a leased handle is refused (AccessDenied, from the sender: the read
    carries no claim), never read under a claim the receiver could not release."""
    with _one_handle(own_server, "nolease") as (ls, _, _rcv, h), \
            KVReceiver(KVPool.allocate(L, 8), leases=False) as rcv:
        res = rcv.fetch(h, [5, 6])
        assert not res.ok and isinstance(res.error, AccessDenied), repr(res.error)
        assert rcv.stats.claimed == 0 and rcv.pool.landing() == []
        assert _state(ls, h.lease_id) is LeaseState.PUBLISHED


def test_a_leased_fetch_holds_its_destination_until_its_release_is_made(own_server: EmbeddedRedis) -> None:
    """Where validate-after-read needs the store (a claim clock margin longer than the claim:
    the release is made before ``fetch`` returns), the destination stays marked until it is:
    another fetch into the same blocks meanwhile is refused, and the bytes stay the handle's."""
    src = filled(L, 8, 1)
    with RedisLeaseStore(own_server.url) as ls, RedisLeaseStore(own_server.url) as rls, \
            KVSender(src, "tcp://127.0.0.1:0", leases=ls) as snd, \
            KVSender(filled(L, 8, 7), "tcp://127.0.0.1:0", leases=False) as other, \
            KVReceiver(KVPool.allocate(L, 8), leases=rls, clock_margin=60.0) as rcv:
        seen: dict[str, Any] = {}
        real = rls.release

        def release(lease_id: str, claimer: str, fence: Any) -> Any:
            seen["landing"] = rcv.pool.landing()
            try:
                seen["other"] = rcv.fetch(other.publish("x", [0, 1], 8), [6, 7])   # into the same blocks, meanwhile
            except PoolError as exc:
                seen["other"] = exc
            return real(lease_id, claimer, fence)
        rls.release = release                                        # type: ignore[method-assign]
        res = rcv.fetch(snd.publish("held", [2, 3], 8), [6, 7])
        assert res.ok and seen["landing"] == [6, 7], (res.error, seen)
        assert isinstance(seen["other"], PoolError) and "another fetch" in str(seen["other"])
        assert _blocks(rcv.pool, [6, 7]) == _blocks(src, [2, 3]) and rcv.pool.landing() == []
