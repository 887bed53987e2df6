"""The lease state machine on a real server: one client, no faults."""

from __future__ import annotations

import time

import pytest

from kvbridge.errors import (ConfigError, LeaseConflict, LeaseExpired, LeaseNotFound,
                             StaleFence)
from kvbridge.lease import Fence, LeaseEvent, LeaseState, RedisLeaseStore

pytestmark = pytest.mark.timeout(30)


def test_publish_returns_lease_with_new_fence(store: RedisLeaseStore) -> None:
    a = store.publish("a", "owner", ttl_s=10, num_blocks=4, meta={"model": "llama"})
    b = store.publish("b", "owner", ttl_s=10)
    assert a.state is LeaseState.PUBLISHED and a.claimer is None
    assert a.num_blocks == 4 and a.meta == {"model": "llama"}
    assert 9000 < a.ttl_ms_left <= 10000
    assert b.fence > a.fence and b.fence.epoch == a.fence.epoch != 0
    got = store.get("a")
    assert got is not None and got.fence == a.fence and got.owner == "owner"


def test_publish_duplicate_id_refused(store: RedisLeaseStore) -> None:
    store.publish("a", "owner", ttl_s=10)
    with pytest.raises(LeaseConflict, match="already exists"):
        store.publish("a", "owner", ttl_s=10)
    with pytest.raises(LeaseConflict):
        store.publish("a", "other", ttl_s=10)


def test_claim_once_and_idempotent_retry(store: RedisLeaseStore) -> None:
    p = store.publish("a", "owner", ttl_s=10)
    c1 = store.claim("a", "dec", claim_ttl_s=5)
    c2 = store.claim("a", "dec", claim_ttl_s=5)
    assert c1.state is LeaseState.CLAIMED and c1.claimer == "dec"
    assert c1.fence > p.fence and c2.fence == c1.fence
    with pytest.raises(LeaseConflict, match="held by another claimer"):
        store.claim("a", "other", claim_ttl_s=5)
    store.validate("a", "dec", c1.fence)


def test_claim_unknown_lease(store: RedisLeaseStore) -> None:
    with pytest.raises(LeaseNotFound):
        store.claim("nope", "dec", 1)
    assert store.get("nope") is None


def test_validate_refusals(store: RedisLeaseStore) -> None:
    store.publish("a", "owner", ttl_s=10)
    c = store.claim("a", "dec", 5)
    with pytest.raises(LeaseConflict):
        store.validate("a", "stranger", c.fence)
    with pytest.raises(StaleFence):
        store.validate("a", "dec", Fence(c.fence.epoch, c.fence.counter - 1))
    with pytest.raises(StaleFence, match="epoch"):
        store.validate("a", "dec", Fence(c.fence.epoch ^ 1, c.fence.counter))
    store.publish("b", "owner", ttl_s=10)
    with pytest.raises(LeaseConflict, match="no claimer"):
        store.validate("b", "dec", c.fence)


def test_double_release_ok_then_everything_refused(store: RedisLeaseStore) -> None:
    store.publish("a", "owner", ttl_s=10)
    c = store.claim("a", "dec", 5)
    store.release("a", "dec", c.fence)
    store.release("a", "dec", c.fence)  # idempotent
    got = store.get("a")
    assert got is not None and got.state is LeaseState.RELEASED
    with pytest.raises(LeaseExpired, match="released"):
        store.validate("a", "dec", c.fence)
    with pytest.raises(LeaseExpired):
        store.claim("a", "other", 5)
    with pytest.raises(LeaseConflict):
        store.release("a", "stranger", c.fence)
    assert store.events("owner") == [LeaseEvent("released", store.ref("a"))]  # one event, not two


def test_release_by_stranger_or_wrong_fence_refused(store: RedisLeaseStore) -> None:
    store.publish("a", "owner", ttl_s=10)
    c = store.claim("a", "dec", 5)
    with pytest.raises(LeaseConflict):
        store.release("a", "stranger", c.fence)
    with pytest.raises(StaleFence):
        store.release("a", "dec", Fence(c.fence.epoch, c.fence.counter + 7))
    with pytest.raises(LeaseConflict):
        store.abort("a", "stranger", c.fence)
    got = store.get("a")
    assert got is not None and got.state is LeaseState.CLAIMED
    assert store.stats.refused == 3


def test_abort(store: RedisLeaseStore) -> None:
    store.publish("a", "owner", ttl_s=10)
    c = store.claim("a", "dec", 5)
    store.abort("a", "dec", c.fence)
    store.abort("a", "dec", c.fence)
    got = store.get("a")
    assert got is not None and got.state is LeaseState.ABORTED
    with pytest.raises(LeaseExpired, match="aborted"):
        store.validate("a", "dec", c.fence)
    assert store.events("owner") == [LeaseEvent("aborted", store.ref("a"))]


def test_revoke_then_validate_fails(store: RedisLeaseStore) -> None:
    store.publish("a", "owner", ttl_s=10)
    c = store.claim("a", "dec", 5)
    with pytest.raises(LeaseConflict, match="owned by"):
        store.revoke("a", "stranger")
    assert store.revoke("a", "owner") is LeaseState.CLAIMED
    # the owner may free now; the claimer's validate-after-read must fail
    with pytest.raises(LeaseExpired, match="revoked"):
        store.validate("a", "dec", c.fence)
    with pytest.raises(LeaseExpired):
        store.release("a", "dec", c.fence)
    with pytest.raises(LeaseExpired):
        store.claim("a", "dec2", 5)
    assert store.get("a") is None
    assert store.revoke("a", "owner") is None  # idempotent: already gone
    assert store.revoke("never", "owner") is None
    assert store.events("owner") == [LeaseEvent("revoked", store.ref("a"))]
    assert store.stats.revoked == 1


def test_revoke_after_release_keeps_released(store: RedisLeaseStore) -> None:
    store.publish("a", "owner", ttl_s=10)
    c = store.claim("a", "dec", 5)
    store.release("a", "dec", c.fence)
    assert store.revoke("a", "owner") is LeaseState.RELEASED
    store.release("a", "dec", c.fence)  # still idempotent


def test_lease_expiry_then_validate_fails(store: RedisLeaseStore) -> None:
    store.publish("a", "owner", ttl_s=0.4)
    c = store.claim("a", "dec", 5)
    assert c.claim_ms_left <= 400  # a claim never outlives its lease
    time.sleep(0.5)  # a slow read
    with pytest.raises(LeaseExpired):
        store.validate("a", "dec", c.fence)
    with pytest.raises(LeaseExpired):
        store.release("a", "dec", c.fence)
    with pytest.raises(LeaseExpired):
        store.claim("a", "other", 5)
    assert store.get("a") is None
    assert store.sweep("owner", ["a"]) == {"a": None}
    assert store.events("owner") == [LeaseEvent("expired", store.ref("a"))]


def test_renew_by_owner(store: RedisLeaseStore) -> None:
    store.publish("a", "owner", ttl_s=0.6)
    for _ in range(4):
        time.sleep(0.2)
        lease = store.renew("a", "owner", ttl_s=0.6)
        assert lease.ttl_ms_left > 400
    c = store.claim("a", "dec", 5)
    store.validate("a", "dec", c.fence)  # alive well past the first TTL
    with pytest.raises(LeaseConflict):
        store.renew("a", "stranger", ttl_s=10)
    with pytest.raises(LeaseNotFound):
        store.renew("nope", "owner", ttl_s=10)


def test_renew_by_claimer_is_capped_by_lease(store: RedisLeaseStore) -> None:
    store.publish("a", "owner", ttl_s=10)
    c = store.claim("a", "dec", 0.6)
    for _ in range(4):
        time.sleep(0.2)
        r = store.renew("a", "dec", 0.6, fence=c.fence)
        assert r.fence == c.fence and r.claim_ms_left > 400
    store.validate("a", "dec", c.fence)
    r = store.renew("a", "dec", 60, fence=c.fence)
    assert r.claim_ms_left <= r.ttl_ms_left <= 10_000
    with pytest.raises(LeaseConflict):
        store.renew("a", "stranger", 1, fence=c.fence)
    with pytest.raises(StaleFence):
        store.renew("a", "dec", 1, fence=Fence(c.fence.epoch, 1))


def test_events_bounded_wait(store: RedisLeaseStore) -> None:
    t0 = time.monotonic()
    assert store.events("owner", timeout_s=0.2) == []
    assert 0.15 < time.monotonic() - t0 < 2.0
    assert store.events("owner", timeout_s=0) == []


def test_events_order_and_cursor(store: RedisLeaseStore) -> None:
    fences = {}
    for i in range(5):
        store.publish(f"l{i}", "owner", ttl_s=10)
        fences[i] = store.claim(f"l{i}", "dec", 5).fence
    store.release("l0", "dec", fences[0])
    store.abort("l1", "dec", fences[1])
    store.revoke("l2", "owner")
    assert store.events("owner", timeout_s=1) == [
        LeaseEvent("released", store.ref("l0")), LeaseEvent("aborted", store.ref("l1")),
        LeaseEvent("revoked", store.ref("l2"))]
    assert store.events("owner") == []
    store.release("l3", "dec", fences[3])
    assert store.events("owner", timeout_s=1) == [LeaseEvent("released", store.ref("l3"))]
    assert store.events("someone-else") == []


def test_sweep(store: RedisLeaseStore) -> None:
    for i in range(4):
        store.publish(f"l{i}", "owner", ttl_s=10)
    store.publish("theirs", "other", ttl_s=10)
    c1 = store.claim("l1", "dec", 5)
    c2 = store.claim("l2", "dec", 5)
    store.release("l2", "dec", c2.fence)
    store.revoke("l3", "owner")
    assert store.sweep("owner", ["l0", "l1", "l2", "l3", "zz", "theirs"]) == {
        "l0": LeaseState.PUBLISHED, "l1": LeaseState.CLAIMED, "l2": LeaseState.RELEASED,
        "l3": None, "zz": None, "theirs": None}
    assert store.sweep("owner", []) == {}
    store.abort("l1", "dec", c1.fence)
    assert store.sweep("owner", ["l1"]) == {"l1": LeaseState.ABORTED}


def test_list(store: RedisLeaseStore) -> None:
    for i in range(3):
        store.publish(f"a{i}", "alice", ttl_s=10)
    store.publish("b0", "bob", ttl_s=10)
    store.publish("gone", "bob", ttl_s=10)
    store.revoke("gone", "bob")
    assert sorted(x.ref for x in store.list()) == sorted(store.ref(i) for i in ["a0", "a1", "a2", "b0"])
    assert sorted(x.ref for x in store.list("alice")) == sorted(store.ref(i) for i in ["a0", "a1", "a2"])
    assert [x.owner for x in store.list("bob")] == ["bob"]
    assert len(store.list(limit=2)) == 2


def test_namespace_isolation(server: object, make_store: object) -> None:
    url = server.url  # type: ignore[attr-defined]
    s1 = make_store(url, namespace="iso1")  # type: ignore[operator]
    s2 = make_store(url, namespace="iso2")  # type: ignore[operator]
    a = s1.publish("same", "o1", ttl_s=10)
    b = s2.publish("same", "o2", ttl_s=10)  # no conflict across namespaces
    assert a.fence.epoch != b.fence.epoch
    c = s1.claim("same", "dec", 5)
    s2.claim("same", "other", 5)
    with pytest.raises(StaleFence):
        s2.validate("same", "dec", c.fence)
    assert [x.owner for x in s1.list()] == ["o1"]


def test_batch_mixed_ops_one_round_trip(store: RedisLeaseStore) -> None:
    ids = [f"b{i}" for i in range(64)]
    pub = store.publish_many("owner", ids, ttl_s=10, num_blocks=2)
    assert all(not isinstance(x, Exception) for x in pub)
    won = store.claim_many("dec", ids, 5)
    lost = store.claim_many("other", ids, 5)
    assert all(isinstance(x, LeaseConflict) for x in lost)
    rel = store.release_many("dec", [(x.lease_id, x.fence) for x in won])  # type: ignore[union-attr]
    assert rel == [None] * 64
    res = (store.batch().publish("x", "owner", 10).claim("x", "dec", 5).claim("x", "other", 5)
           .get("x").revoke("x", "owner").execute())
    assert res[0].state is LeaseState.PUBLISHED and res[1].state is LeaseState.CLAIMED
    assert isinstance(res[2], LeaseConflict)
    assert res[3].claimer == "dec" and res[4] is LeaseState.CLAIMED
    assert store.stats.published == 65 and store.stats.released == 64


def test_bad_arguments(store: RedisLeaseStore, server: object) -> None:
    with pytest.raises(ConfigError):
        store.publish("a", "owner", ttl_s=0)
    with pytest.raises(ConfigError):
        store.publish("", "owner", ttl_s=1)
    with pytest.raises(ConfigError):
        store.claim("a", "dec", claim_ttl_s=-1)
    with pytest.raises(ConfigError):
        store.release("a", "dec", (1, 2))  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        RedisLeaseStore("http://localhost:6379")
    with pytest.raises(ConfigError):
        RedisLeaseStore(server.url, namespace="a{b}")  # type: ignore[attr-defined]


def test_fence_value_type() -> None:
    f = Fence(2**64 - 1, 5)
    assert Fence.parse(str(f)) == f
    assert Fence.ZERO < Fence(0, 1) < Fence(1, 0)
    with pytest.raises(ValueError):
        Fence(-1, 0)
    with pytest.raises(ValueError):
        Fence(0, 2**64)
