"""Faults on purpose: claimer death, owner death, lease expiry, Redis kill/restart, lost scripts."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import pytest
import redis

from kvbridge.errors import (ConfigError, LeaseConflict, LeaseExpired, LeaseNotFound,
                             LeaseStoreUnavailable, StaleFence)
from kvbridge.lease import (EmbeddedRedis, Fence, LeaseEvent, LeaseState, RedisLeaseStore,
                            default_lease_url, open_lease_store, owner_deadline,
                            resolve_lease_url)
from kvbridge.lease.embedded import _free_port

pytestmark = pytest.mark.timeout(60)


def test_claimer_death_takeover_and_late_calls_refused(store: RedisLeaseStore) -> None:
    store.publish("a", "owner", ttl_s=30)
    first = store.claim("a", "A", claim_ttl_s=0.2)
    time.sleep(0.3)  # A died mid-fetch: its claim lapses, the lease is claimable again
    got = store.get("a")
    assert got is not None and got.state is LeaseState.PUBLISHED and got.claimer is None
    second = store.claim("a", "B", claim_ttl_s=30)
    assert second.fence > first.fence and second.fence.epoch == first.fence.epoch
    # A's late validate, release, abort, renew, re-claim: all refused
    with pytest.raises(LeaseConflict):
        store.validate("a", "A", first.fence)
    with pytest.raises(LeaseConflict):
        store.release("a", "A", first.fence)
    with pytest.raises(LeaseConflict):
        store.abort("a", "A", first.fence)
    with pytest.raises(LeaseConflict):
        store.renew("a", "A", 10, fence=first.fence)
    with pytest.raises(LeaseConflict):
        store.claim("a", "A", 10)
    store.validate("a", "B", second.fence)
    store.release("a", "B", second.fence)
    assert store.events("owner") == [LeaseEvent("released", store.ref("a"))]


def test_lapsed_claimer_without_takeover_is_stale(store: RedisLeaseStore) -> None:
    store.publish("a", "owner", ttl_s=30)
    first = store.claim("a", "A", claim_ttl_s=0.1)
    time.sleep(0.2)
    with pytest.raises(StaleFence, match="lapsed"):
        store.validate("a", "A", first.fence)
    with pytest.raises(StaleFence):
        store.release("a", "A", first.fence)
    again = store.claim("a", "A", 30)  # A may claim afresh: a new fence
    assert again.fence > first.fence
    with pytest.raises(StaleFence):
        store.validate("a", "A", first.fence)
    store.validate("a", "A", again.fence)


def test_owner_death_fetch_fails_fast(store: RedisLeaseStore) -> None:
    store.publish("a", "owner", ttl_s=0.2)  # the owner dies: no heartbeat renews the lease
    time.sleep(0.3)
    t0 = time.monotonic()
    with pytest.raises(LeaseExpired):
        store.claim("a", "dec", 5)
    assert time.monotonic() - t0 < 0.5  # final at once, not retried


def test_slow_read_past_lease_expiry_rejected() -> None:
    """Simulated owner/claimer pair: counts of stale reads and leaked blocks are zero."""
    with EmbeddedRedis() as srv, RedisLeaseStore(srv.url, namespace="slow") as s:
        freed: set[str] = set()
        stale_reads = 0
        for i in range(5):
            lid = f"l{i}"
            sent = time.monotonic()
            s.publish(lid, "owner", ttl_s=0.3)
            deadline = owner_deadline(sent, 0.3, margin_s=0.05)
            c = s.claim(lid, "dec", 5)
            time.sleep(0.4)  # slow read; the owner frees at its local deadline meanwhile
            while time.monotonic() < deadline:
                time.sleep(0.01)
            freed.add(lid)
            try:
                s.validate(lid, "dec", c.fence)
                stale_reads += 1  # validate said "valid" after the free: a stale read
            except LeaseExpired:
                pass
        assert stale_reads == 0 and freed == {f"l{i}" for i in range(5)}


def _assert_unavailable_fast(fn: Callable[[], Any]) -> None:
    t0 = time.monotonic()
    with pytest.raises(LeaseStoreUnavailable):
        fn()
    assert time.monotonic() - t0 < 3.0


def test_redis_restart_with_data_loss(own_server: EmbeddedRedis, make_store: Any) -> None:
    s: RedisLeaseStore = make_store(own_server.url)
    s.publish("a", "owner", ttl_s=30)
    old = s.claim("a", "dec", 30)
    own_server.kill()
    # downtime: every operation fails retryably, after the retry policy, quickly
    _assert_unavailable_fast(lambda: s.validate("a", "dec", old.fence))
    _assert_unavailable_fast(lambda: s.publish("b", "owner", ttl_s=30))
    _assert_unavailable_fast(lambda: s.claim_many("dec", ["a", "b"], 30))
    _assert_unavailable_fast(lambda: s.events("owner", timeout_s=0.1))
    _assert_unavailable_fast(lambda: s.sweep("owner", ["a"]))
    own_server.restart()  # same port, empty dataset
    with pytest.raises(StaleFence, match="epoch"):
        s.validate("a", "dec", old.fence)
    with pytest.raises(StaleFence):
        s.release("a", "dec", old.fence)
    with pytest.raises(LeaseNotFound):
        s.claim("a", "dec", 30)
    assert s.sweep("owner", ["a"]) == {"a": None}  # the owner frees after its deadline
    # the same id republished and claimed: the fence never repeats, the old one stays refused
    p = s.publish("a", "owner", ttl_s=30)
    new = s.claim("a", "dec", 30)
    assert new.fence.epoch != old.fence.epoch
    assert new.fence != old.fence and p.fence != old.fence
    with pytest.raises(StaleFence):
        s.validate("a", "dec", old.fence)
    s.validate("a", "dec", new.fence)


def test_operations_recover_after_restart_within_retry(own_server: EmbeddedRedis,
                                                       make_store: Any) -> None:
    from kvbridge.policy import Backoff, Retry

    s: RedisLeaseStore = make_store(
        own_server.url, retry=Retry(attempts=50, backoff=Backoff(0.05, 0.1, jitter=False),
                                    deadline=10.0))
    s.publish("a", "owner", ttl_s=30)
    own_server.stop()
    import threading

    threading.Timer(0.3, own_server.restart).start()
    lease = s.publish("b", "owner", ttl_s=30)  # retried until the server is back
    assert lease.state is LeaseState.PUBLISHED
    assert s.get("a") is None


def test_connection_refused_is_unavailable(make_store: Any) -> None:
    s: RedisLeaseStore = make_store(f"redis://127.0.0.1:{_free_port()}/0")
    _assert_unavailable_fast(lambda: s.publish("a", "owner", 1))
    with pytest.raises(LeaseStoreUnavailable) as info:
        s.get("a")
    assert info.value.retryable and not isinstance(info.value.__cause__, LeaseStoreUnavailable)


def test_unix_socket_url(server: EmbeddedRedis, make_store: Any) -> None:
    s: RedisLeaseStore = make_store(server.unix_url)
    tcp: RedisLeaseStore = make_store(server.url)
    s.publish("u", "owner", ttl_s=10)
    c = tcp.claim("u", "dec", 5)  # same dataset through both transports
    s.validate("u", "dec", c.fence)


def test_script_flush_reloads(server: EmbeddedRedis, store: RedisLeaseStore) -> None:
    raw = redis.Redis.from_url(server.auth_url)
    try:
        store.publish("a", "owner", ttl_s=10)
        raw.script_flush()
        c = store.claim("a", "dec", 5)  # NoScriptError -> SCRIPT LOAD -> EVALSHA
        raw.script_flush()
        res = store.publish_many("owner", ["b", "c"], ttl_s=10)
        assert [x.state for x in res] == [LeaseState.PUBLISHED] * 2  # type: ignore[union-attr]
        raw.script_flush()
        store.release("a", "dec", c.fence)
    finally:
        raw.close()


def test_epoch_key_loss_detected(server: EmbeddedRedis, store: RedisLeaseStore, ns: str) -> None:
    """Even if only the epoch key vanished, old leases and fences are refused."""
    store.publish("a", "owner", ttl_s=10)
    c = store.claim("a", "dec", 5)
    raw = redis.Redis.from_url(server.auth_url)
    try:
        raw.delete("{" + ns + "}:epoch")
    finally:
        raw.close()
    with pytest.raises(StaleFence):
        store.validate("a", "dec", c.fence)
    with pytest.raises(LeaseExpired):
        store.claim("a", "dec", 5)
    assert store.get("a") is None


def test_embedded_server_lifecycle() -> None:
    srv = EmbeddedRedis(unix_socket=False)
    try:
        srv.start()
        assert srv.running and srv.url.startswith("redis://127.0.0.1:")
        with pytest.raises(ConfigError):
            srv.unix_url
        port = srv.port
        srv.restart()
        assert srv.port == port and srv.running
        srv.kill()
        assert not srv.running
    finally:
        srv.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to see a pin")
def test_an_embedded_server_started_by_a_pinned_process_is_not_pinned() -> None:
    """An engine worker bound to one core (vLLM's CPU workers are) started its lease server pinned
    beside its busy threads: every lease call of every process waited for that core (handoffs
    failed with lease timeouts). The server runs on every CPU the machine allows."""
    import subprocess
    import sys
    code = ("import os\nfrom kvbridge.lease import EmbeddedRedis\n"
            "with EmbeddedRedis() as s:\n    print(sorted(os.sched_getaffinity(s.pid)), flush=True)\n")
    one = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: os.sched_setaffinity(0, {one}))
    assert out.returncode == 0, out.stderr[-2000:]
    assert eval(out.stdout.strip()) == sorted(os.sched_getaffinity(0)), out.stdout


def test_default_url_is_shared_and_resolved() -> None:
    url = default_lease_url()
    assert resolve_lease_url(None) == url == default_lease_url()
    assert resolve_lease_url("redis://h:1/0") == "redis://h:1/0"
    with pytest.raises(ConfigError):
        resolve_lease_url("http://h:1")
    with open_lease_store(None, namespace="dflt") as s:
        lease = s.publish("x", "owner", ttl_s=5)
        assert lease.fence != Fence.ZERO


def test_an_owner_cut_off_after_a_stalled_publish_frees_only_after_redis_expired_the_lease(
        own_server: EmbeddedRedis) -> None:
    """The lease server stalls 1.5 s while a publish (ttl 1 s) waits in it, so it starts the TTL
    1.5 s after the owner sent the call; then the owner loses the server (its ACL user deleted:
    every call refused). The owner frees the blocks at its local deadline -- counted from the
    publish's answer, not its send -- and by then the server has expired the lease: no claimer
    can claim what was freed."""
    import os
    import signal
    import threading

    from kvbridge import KVLayout, KVPool, KVSender
    from kvbridge.policy import Backoff, Retry
    admin = redis.Redis.from_url(own_server.auth_url)
    admin.execute_command("ACL", "SETUSER", "owner", "on", ">pw", "~*", "&*", "+@all")
    owner = RedisLeaseStore(f"redis://owner:pw@127.0.0.1:{own_server.port}/0",
                            retry=Retry(attempts=2, backoff=Backoff(0.01, 0.05), deadline=1))
    claimer = RedisLeaseStore(own_server.url)
    freed: list[tuple[str, bool]] = []
    pool = KVPool.allocate(KVLayout.vllm_flash(2, 1, 8, block_size=4, dtype="float16"), 8)

    def on_free(h: Any, reason: str) -> None:   # is the lease still live in the server as the blocks go?
        freed.append((reason, claimer.get(h.lease_id) is not None))

    snd = KVSender(pool, "tcp://127.0.0.1:0", leases=owner, ttl=1.0, clock_margin=0.1, on_free=on_free)
    try:
        owner.get("warm-up")                          # the owner's connection is made
        os.kill(own_server.pid, signal.SIGSTOP)
        threading.Timer(1.5, os.kill, (own_server.pid, signal.SIGCONT)).start()
        h = snd.publish("req", pool.alloc(2), 8)      # run by the server about 1.5 s after it was sent
        admin.execute_command("ACL", "DELUSER", "owner")
        deadline = time.monotonic() + 8
        while not freed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert freed == [("expired", False)], freed   # freed, and the lease was gone by then
        with pytest.raises((LeaseNotFound, LeaseExpired)):
            claimer.claim(h.lease_id, "decoder", 30)
    finally:
        snd.close()
        owner.close()
        claimer.close()
        pool.close()


def test_a_database_the_server_does_not_have_is_named_as_such(server: EmbeddedRedis) -> None:
    """It said 'rejected a script ... needs Redis >= 6.2', pointing at the server's version."""
    with RedisLeaseStore(server.url.rsplit("/", 1)[0] + "/99") as store:
        with pytest.raises(ConfigError, match="no such database"):
            store.get("x")
