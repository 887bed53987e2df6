"""The README's ACL line for a shared Redis is enough for every lease operation, and keeps the
user away from other keys."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis

from kvbridge.lease import EmbeddedRedis, Fence, RedisLeaseStore

README = Path(__file__).resolve().parents[2] / "README.md"
LEASES_DOC = Path(__file__).resolve().parents[2] / "docs" / "LEASES.md"


def test_docs_carry_the_same_acl_line() -> None:
    pat = r"`(ACL SETUSER kvbridge [^`]+)`"
    got = [re.search(pat, p.read_text()) for p in (README, LEASES_DOC)]
    assert got[0] and got[1] and got[0].group(1) == got[1].group(1)


def test_readme_acl_line_suffices(own_server: EmbeddedRedis) -> None:
    line = re.search(r"`(ACL SETUSER kvbridge [^`]+)`", README.read_text())
    assert line, "README lost its ACL line"
    admin = redis.Redis.from_url(own_server.auth_url)
    admin.execute_command(*line.group(1).replace("PASSWORD", "s3cret").split())
    url = f"redis://kvbridge:s3cret@127.0.0.1:{own_server.port}/0"
    with RedisLeaseStore(url, namespace="kvb") as store:
        lease = store.publish("lease-a", "owner", 5, num_blocks=2)
        c = store.claim("lease-a", "dec", 5)
        store.validate("lease-a", "dec", c.fence)
        store.release("lease-a", "dec", c.fence)
        assert [e.kind for e in store.events("owner", timeout_s=0.5)] == ["released"]
        assert store.sweep("owner", ["lease-a"])
        store.publish("lease-b", "owner", 5)
        assert {x.ref for x in store.list("owner")} >= {store.ref("lease-b")}
        assert store.revoke("lease-b", "owner") is not None
        assert lease.fence > Fence.ZERO
    user = redis.Redis.from_url(url)
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.get("someone-else:key")


def test_readme_acl_line_takes_a_client_name(own_server: EmbeddedRedis) -> None:
    """A lease URL may carry ``client_name`` (the README): the line allows naming the connection."""
    line = re.search(r"`(ACL SETUSER kvbridge [^`]+)`", README.read_text())
    assert line
    redis.Redis.from_url(own_server.auth_url).execute_command(*line.group(1).replace("PASSWORD", "s3").split())
    url = f"redis://kvbridge:s3@127.0.0.1:{own_server.port}/0?client_name=decode-7"
    with RedisLeaseStore(url, namespace="kvb") as store:
        store.publish("lease-n", "owner", 5)
        assert store.claim("lease-n", "dec", 5).fence > Fence.ZERO


def test_a_revoke_the_server_refuses_frees_at_the_deadline_and_the_sweeper_lives_on(
        own_server: EmbeddedRedis) -> None:
    """The lease server loses kvbridge's user (a restart after a runtime ``ACL SETUSER``): a revoke
    at a handle's deadline is refused with a ConfigError. The handle is still freed at its deadline
    (the lease ends at its TTL in Redis), and handles published once the user is back are freed
    at theirs: the one thread that frees at deadlines survives the refusal."""
    import time

    from kvbridge import KVLayout, KVPool, KVSender
    from kvbridge.policy import Backoff, Retry
    line = re.search(r"`(ACL SETUSER kvbridge [^`]+)`", README.read_text())
    assert line
    setuser = line.group(1).replace("PASSWORD", "pw").split()
    admin = redis.Redis.from_url(own_server.auth_url)
    admin.execute_command(*setuser)
    freed: list[tuple[str, str]] = []
    pool = KVPool.allocate(KVLayout.vllm_flash(2, 1, 8, block_size=4, dtype="float16"), 8)
    store = RedisLeaseStore(f"redis://kvbridge:pw@127.0.0.1:{own_server.port}/0",
                            retry=Retry(attempts=2, backoff=Backoff(0.01, 0.05), deadline=1))
    snd = KVSender(pool, "tcp://127.0.0.1:0", leases=store, ttl=0.6, clock_margin=0.1,
                   on_free=lambda h, r: freed.append((h.request_id, r)))
    try:
        b1 = pool.alloc(2)
        snd.publish("r1", b1, 8)
        admin.execute_command("ACL", "DELUSER", "kvbridge")
        deadline = time.monotonic() + 5
        while not freed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert freed == [("r1", "expired")] and [pool.refcount(b) for b in b1] == [0, 0]
        admin.execute_command(*setuser)
        b2 = pool.alloc(2)
        snd.publish("r2", b2, 8)
        deadline = time.monotonic() + 5
        while len(freed) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert freed[1:] == [("r2", "expired")] and [pool.refcount(b) for b in b2] == [0, 0]
    finally:
        snd.close()
        store.close()
        pool.close()
