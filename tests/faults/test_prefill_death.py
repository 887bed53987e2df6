"""Prefill dies after publishing (the sender process is SIGKILLed): the fetch ends with a clear
final error within a bound -- a retryable error exhausted within the Retry deadline while the
lease is still alive, ``Action.REPREFILL`` at once once it has expired -- and nothing hangs."""

from __future__ import annotations

import time

import pytest

import os
import signal

from kvbridge import Action, LeaseExpired, PeerUnavailable, Retry, Timeout, TransferTimeout
from kvbridge.lease import LeaseState, RedisLeaseStore
from kvbridge.policy import Backoff

from ._util import Bounded, Child, handle_from_b64, untouched

pytestmark = pytest.mark.timeout(30, method="signal")
RETRY = Retry(attempts=4, backoff=Backoff(base=0.05, cap=0.2), deadline=2.0)


def _prefill(url: str, ns: str, ttl: float, hold_after: bool = False) -> Child:
    child = Child()
    child.call("sender", num_blocks=8, leases=url, ns=ns, ttl=ttl, hold_after=hold_after)
    return child


def test_prefill_killed_lease_alive_fetch_fails_retryable_within_deadline(
        shared_redis, ns, make_receiver, tally) -> None:
    tally.scenario()
    url = shared_redis.url
    child = _prefill(url, ns, ttl=20.0)
    try:
        h = handle_from_b64(child.call("publish", n=2, request_id="req-dead-owner")["handle"])
    finally:
        child.kill()
    r, pool = make_receiver(url, claimer="decode", retry=RETRY)
    t0 = time.monotonic()
    res = Bounded(lambda: r.fetch(h, [0, 1])).result(RETRY.deadline + 5)
    took = time.monotonic() - t0
    tally.result(res, [], pool)
    assert not res.ok and isinstance(res.error, PeerUnavailable), res.error
    assert res.action is Action.RETRY and res.attempts == RETRY.attempts
    assert res.failed_block_ids == [0, 1] and untouched(pool, [0, 1])
    assert took < RETRY.deadline + 1.0, took
    # the claim was aborted, not left to lapse: Redis no longer lists it as claimed
    with RedisLeaseStore(url, namespace=ns) as s:
        lease = s.get(h.lease_id)
        assert lease is None or lease.state is LeaseState.ABORTED


def test_prefill_killed_lease_expired_fetch_is_reprefill_at_once(shared_redis, ns, make_receiver,
                                                                 tally) -> None:
    tally.scenario()
    url = shared_redis.url
    child = _prefill(url, ns, ttl=0.4)
    try:
        h = handle_from_b64(child.call("publish", n=2, request_id="req-expired")["handle"])
    finally:
        child.kill()
    r, pool = make_receiver(url, claimer="decode", retry=RETRY)
    time.sleep(0.5)   # no heartbeat from the dead owner: Redis expires the lease
    t0 = time.monotonic()
    res = Bounded(lambda: r.fetch(h, [0, 1])).result(5)
    took = time.monotonic() - t0
    tally.result(res, [], pool)
    assert not res.ok and isinstance(res.error, LeaseExpired), res.error
    # final at once: the claim travels with the first read; that read finds no sender, and the
    # claim made in the lease store instead finds the lease gone -- no retries
    assert res.action is Action.REPREFILL and res.attempts <= 1
    assert res.failed_block_ids == [0, 1] and untouched(pool, [0, 1])
    assert took < 0.5, took


def test_prefill_killed_mid_read(shared_redis, ns, make_receiver, tally) -> None:
    tally.scenario()
    url = shared_redis.url
    child = _prefill(url, ns, ttl=20.0, hold_after=True)
    try:
        h = handle_from_b64(child.call("publish", n=2, request_id="req-mid-read")["handle"])
        r, pool = make_receiver(url, claimer="decode", retry=RETRY)
        t0 = time.monotonic()
        fut = Bounded(lambda: r.fetch(h, [0, 1]))
        assert child.call("wait_entered", timeout=10), "the read never reached the sender"
    finally:
        child.kill()   # the owner dies with the read authorized and in flight
    res = fut.result(RETRY.deadline + 5)
    took = time.monotonic() - t0
    tally.result(res, [], pool)
    assert not res.ok and isinstance(res.error, PeerUnavailable), res.error   # ConnectionLost or refused
    assert res.action is Action.RETRY and res.failed_block_ids == [0, 1]
    assert took < RETRY.deadline + 1.5, took


def test_prefill_frozen_mid_read_times_out(shared_redis, ns, make_receiver, tally) -> None:
    """A sender that stops answering (SIGSTOP) with a read in flight: the transfer timeout
    bounds every attempt; the fetch ends retryable-exhausted, not hung."""
    tally.scenario()
    url = shared_redis.url
    child = _prefill(url, ns, ttl=20.0, hold_after=True)
    try:
        h = handle_from_b64(child.call("publish", n=2, request_id="req-frozen")["handle"])
        r, pool = make_receiver(url, claimer="decode", timeout=Timeout(connect=0.5, transfer=0.5),
                                retry=Retry(attempts=2, backoff=Backoff(0.01, 0.02), deadline=3.0))
        t0 = time.monotonic()
        fut = Bounded(lambda: r.fetch(h, [0, 1]))
        assert child.call("wait_entered", timeout=10)
        os.kill(child.proc.pid, signal.SIGSTOP)
        res = fut.result(10)
        took = time.monotonic() - t0
    finally:
        child.kill()
    tally.result(res, [], pool)
    assert not res.ok and isinstance(res.error, (TransferTimeout, PeerUnavailable)), res.error
    assert res.action is Action.RETRY and res.failed_block_ids == [0, 1] and untouched(pool, [0, 1])
    assert took < 3.0, took
