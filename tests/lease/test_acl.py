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
