"""What the lease server's keyspace gives away: nothing that acts on a lease, no request ids.

A process that can read the whole keyspace (SCAN, then GET/HGETALL/ZRANGE/XRANGE of every
key) but holds no handle tries every string it found as a lease id, with every owner,
claimer and fence it found, through the store's API and through the scripts directly. Every
lease must be exactly as it was. And every script call keeps its keys on one hash tag, so
the scripts run on Redis Cluster: checked on the key lists, and on a server in cluster mode,
which refuses keys of two slots in one call.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import redis

from kvbridge import KVLayout, KVPool, KVReceiver, KVSender
from kvbridge.errors import KVBridgeError, LeaseError
from kvbridge.lease import EmbeddedRedis, Fence, LeaseState, RedisLeaseStore
from kvbridge.lease import _scripts, embedded

L = KVLayout.vllm_flash(2, 1, 8, block_size=4, dtype="float16")
REQUESTS = [f"req-{os.urandom(6).hex()}" for _ in range(6)]


def _harvest(raw: "redis.Redis[str]") -> tuple[list[str], list[str]]:
    """(key names, every string stored under them), as a keyspace reader sees them."""
    keys, values = [], []
    for k in raw.scan_iter(count=1000):
        keys.append(k)
        t = raw.type(k)
        if t == "string":
            values.append(raw.get(k) or "")
        elif t == "hash":
            for f, v in raw.hgetall(k).items():
                values += [f, v]
        elif t == "zset":
            values += raw.zrange(k, 0, -1)
        elif t == "stream":
            for _id, fields in raw.xrange(k):
                for f, v in fields.items():
                    values += [f, v]
    return keys, values


def _states(store: RedisLeaseStore, lease_ids: list[str]) -> list[Any]:
    out = []
    for i in lease_ids:
        got = store.get(i)
        out.append(None if got is None else (got.state, got.fence, got.claimer))
    return out


def _ttls(store: RedisLeaseStore, lease_ids: list[str]) -> list[int]:
    return [(x.ttl_ms_left + x.claim_ms_left) if (x := store.get(i)) else 0 for i in lease_ids]


@pytest.fixture
def scene(own_server: EmbeddedRedis) -> Iterator[tuple[EmbeddedRedis, KVSender, list[str]]]:
    """Six published handles: two fetched and released, one claimed ahead, three waiting."""
    src, dst = KVPool.allocate(L, 16), KVPool.allocate(L, 16)
    with KVSender(src, "tcp://127.0.0.1:0", leases=own_server.url, lease_namespace="kvb") as snd, \
            KVReceiver(dst, leases=own_server.url, lease_namespace="kvb") as rcv:
        hs = [snd.publish(r, src.alloc(1), 4) for r in REQUESTS]
        for h in hs[:2]:
            assert rcv.fetch(h, dst.alloc(1)).ok
        assert rcv.claim(hs[2]) is not None
        # a fetch's release reaches the store after the fetch returns (through the owner): the
        # scene is still until both are released (else one lands mid-test, as a change the attack made)
        with RedisLeaseStore(own_server.url, namespace="kvb") as look:
            deadline = time.monotonic() + 10
            while any((x := look.get(h.lease_id)) is not None and x.state is not LeaseState.RELEASED
                      for h in hs[:2]) and time.monotonic() < deadline:
                time.sleep(0.01)
        yield own_server, snd, [h.lease_id for h in hs]


def test_keyspace_holds_no_lease_or_request_ids(scene: tuple[EmbeddedRedis, KVSender, list[str]]) -> None:
    srv, snd, lease_ids = scene
    keys, values = _harvest(redis.Redis.from_url(srv.auth_url, decode_responses=True))
    assert len(keys) >= 6 + 3, keys                     # the leases, epoch, fence, index (+ events)
    text = "\n".join(keys + values)
    for secret in REQUESTS + lease_ids:
        assert secret not in text, f"{secret} readable in the keyspace"
    assert snd.leases is not None
    refs = {snd.leases.ref(i) for i in lease_ids}
    assert refs <= {k.rsplit(":", 1)[-1] for k in keys}   # each lease is there, under its ref only


def test_keyspace_reader_cannot_act(scene: tuple[EmbeddedRedis, KVSender, list[str]]) -> None:
    srv, snd, lease_ids = scene
    raw = redis.Redis.from_url(srv.auth_url, decode_responses=True)
    doc = (Path(__file__).resolve().parents[2] / "docs" / "LEASES.md").read_text()
    line = re.search(r"`(ACL SETUSER monitor [^`]+)`", doc.replace("\n", " "))
    assert line, "docs/LEASES.md lost its read-only ACL line"
    raw.execute_command(*line.group(1).replace("PASSWORD", "m0n").split())
    reader = redis.Redis(host="127.0.0.1", port=srv.port, username="monitor", password="m0n",
                         decode_responses=True)
    keys, values = _harvest(reader)                       # the documented read-only user sees it all
    with pytest.raises(redis.exceptions.NoPermissionError):
        reader.evalsha("0" * 40, 0)
    with RedisLeaseStore(srv.url, namespace="kvb") as honest, RedisLeaseStore(srv.url, namespace="kvb") as evil:
        before, ttls = _states(honest, lease_ids), _ttls(honest, lease_ids)
        hashes = [raw.hgetall(k) for k in keys if ":lease:" in k]
        names = sorted({h["ow"] for h in hashes} | {h["cl"] for h in hashes if h["cl"]} | {"evil"})
        fences = sorted({Fence(int(h["ep"]), int(h["fc"])) for h in hashes})
        guesses = sorted(set(keys) | {k.rsplit(":", 1)[-1] for k in keys} | set(values))[:300]
        tries = refused = 0

        def attempt(fn: Callable[[], Any]) -> None:
            nonlocal tries, refused
            tries += 1
            try:
                if fn() is None:     # revoke of an unknown lease answers None: it ended nothing
                    refused += 1
            except LeaseError:
                refused += 1

        for g in guesses:
            if not g or len(g) > 512:
                continue
            for who in names:
                attempt(lambda: evil.claim(g, who, 60))
                attempt(lambda: evil.renew(g, who, 600))
                attempt(lambda: evil.revoke(g, who))
            for f in fences:
                for who in names:
                    attempt(lambda: evil.release(g, who, f))
                    attempt(lambda: evil.abort(g, who, f))
                    attempt(lambda: evil.renew(g, who, 600, fence=f))
        assert tries > 1000 and refused == tries, (tries, refused)
        # the scripts themselves, called with a lease key read from the keyspace
        claim_sha = raw.script_load(_scripts.CLAIM)
        common = ["{kvb}:epoch", "{kvb}:fence", "{kvb}:index"]
        for k in [k for k in keys if ":lease:" in k]:
            for g in (k.rsplit(":", 1)[-1], k, ""):
                reply = raw.evalsha(claim_sha, 4, *common, k, "1", 30000, "{kvb}:", 100, g, "evil", 60000)
                assert reply == ["BADKEY"], (k, g, reply)
        assert _states(honest, lease_ids) == before
        assert all(after <= t for after, t in zip(_ttls(honest, lease_ids), ttls))   # nothing extended
        assert [s[0] for s in before if s] == [LeaseState.RELEASED] * 2 + [LeaseState.CLAIMED] + \
            [LeaseState.PUBLISHED] * 3


def test_refs_are_one_way_and_per_namespace(server: EmbeddedRedis) -> None:
    with RedisLeaseStore(server.url, namespace="a") as a, RedisLeaseStore(server.url, namespace="b") as b:
        lid = os.urandom(16).hex()
        assert a.ref(lid) != b.ref(lid) and lid not in a.ref(lid)
        assert a.ref(lid) == hashlib.sha1(f"{{a}}:lease:{lid}".encode()).hexdigest()
        assert re.fullmatch(r"[0-9a-f]{40}", a.ref(lid))


# -- Redis Cluster: one hash tag per call ----------------------------------------------------
def _slot_tag(key: str) -> str:
    """The part of a key Redis Cluster hashes (its rule: the first non-empty {...})."""
    i = key.find("{")
    if i >= 0:
        j = key.find("}", i + 1)
        if j > i + 1:
            return key[i + 1:j]
    return key


def _every_op(store: RedisLeaseStore) -> list[Any]:
    f = Fence(1, 2)
    return [store._op_publish("x", "o", 5, 1, {"m": "1"}), store._op_claim("x", "c", 5),
            store._op_validate("x", "c", f), store._op_release("x", "c", f),
            store._op_release("x", "c", f, notify=False), store._op_abort("x", "c", f),
            store._op_renew("x", "c", 5, f), store._op_renew("x", "o", 5, None), store._op_revoke("x", "o"),
            store._op_get("x"), store._op_sweep("o", ["x", "y", "z"]), store._op_list(None, 10)]


def test_every_script_call_uses_one_hash_tag(server: EmbeddedRedis) -> None:
    with RedisLeaseStore(server.url, namespace="ns1") as store:
        ops = _every_op(store)
        assert {op.script for op in ops} == set(_scripts.ALL)
        for op in ops:
            assert {_slot_tag(k) for k in op.keys} == {"ns1"}, (op.script, op.keys)
        # keys the scripts build themselves (events, list's lease keys) start with the same tag
        assert store._prefix == "{ns1}:" and store._events_prefix.startswith("{ns1}:")
        assert "ARGV[3] .. 'lease:'" in _scripts.PRELUDE and "ARGV[3] .. 'events:'" in _scripts.PRELUDE


@pytest.mark.timeout(60)
def test_lifecycle_on_a_cluster_mode_server(tmp_path: Any) -> None:
    """A cluster-mode node that serves only the namespace's slot: it refuses any call whose
    keys (declared, or built inside a script) fall in another slot."""
    with EmbeddedRedis(extra_args=("--cluster-enabled", "yes", "--cluster-require-full-coverage", "no",
                                   "--cluster-config-file", str(tmp_path / "nodes.conf"))) as srv:
        admin = redis.Redis.from_url(srv.auth_url)
        slot = int(admin.execute_command("CLUSTER", "KEYSLOT", "{kvc}:x"))
        admin.execute_command("CLUSTER", "ADDSLOTS", slot)
        for _ in range(100):
            if "cluster_state:ok" in admin.execute_command("CLUSTER", "INFO").decode():
                break
            time.sleep(0.05)
        admin.set("{kvc}:probe", 1)
        with pytest.raises(redis.exceptions.ResponseError):
            admin.get("{other}:probe")                    # another slot: not served here
        with pytest.raises(redis.exceptions.ResponseError):   # nor when a script builds the key
            admin.eval("return redis.call('GET', '{other}:' .. KEYS[1])", 1, "{kvc}:probe")
        with RedisLeaseStore(srv.url, namespace="kvc") as s:
            s.publish("l1", "owner", 10, num_blocks=1)
            c = s.claim("l1", "dec", 5)
            s.validate("l1", "dec", c.fence)
            s.renew("l1", "dec", 5, fence=c.fence)
            s.renew("l1", "owner", 10)
            s.release("l1", "dec", c.fence)
            assert [e.ref for e in s.events("owner", timeout_s=0.5)] == [s.ref("l1")]
            s.publish("l2", "owner", 10)
            c2 = s.claim("l2", "dec", 5)
            s.abort("l2", "dec", c2.fence)
            s.publish("l3", "owner", 10)
            assert s.revoke("l3", "owner") is LeaseState.PUBLISHED
            assert s.sweep("owner", ["l1", "l2", "l3"]) == {"l1": LeaseState.RELEASED, "l2": LeaseState.ABORTED,
                                                           "l3": None}
            assert {x.ref for x in s.list("owner")} == {s.ref("l1"), s.ref("l2")}
            got = s.batch().claim("l1", "x", 5).get("l2").execute()
            assert isinstance(got[0], KVBridgeError) and got[1].state is LeaseState.ABORTED


def test_a_cluster_mode_server_gets_a_port_with_room_for_its_bus() -> None:
    """A cluster-mode server also binds its port + 10000 and refuses a port over 55535 ("port
    number too high"). Before: the kernel's ephemeral pick (up to 60999 here) was taken as it
    came, and a cluster-mode start failed about one time in five."""
    cluster = ("--cluster-enabled", "yes", "--cluster-require-full-coverage", "no")
    assert embedded._cluster_enabled(cluster) and not embedded._cluster_enabled(("--cluster-enabled", "no"))
    assert not embedded._cluster_enabled(("--cluster-enabled",))
    ports = [embedded._free_port(embedded.CLUSTER_MAX_PORT) for _ in range(300)]
    assert max(ports) <= embedded.CLUSTER_MAX_PORT
    srv = EmbeddedRedis(extra_args=cluster)          # not started: its port is chosen here
    try:
        assert srv.port <= embedded.CLUSTER_MAX_PORT
    finally:
        srv.close()
