"""Review findings on the lease store and its embedded server, each a test that failed before its fix."""

from __future__ import annotations

import glob
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from kvbridge.errors import ConfigError, LeaseExpired, StaleFence
from kvbridge.lease import EmbeddedRedis, RedisLeaseStore, default_lease_url
from kvbridge.lease import embedded

pytestmark = pytest.mark.timeout(60)


def _server_children() -> list[int]:
    """Pids of this process's live children running a Redis-protocol server."""
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = Path(stat).read_text()
        except OSError:
            continue
        name, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        if rest[0] != "Z" and int(rest[1]) == os.getpid() and "server" in name:
            out.append(int(stat.split("/")[2]))
    return out


def _our_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"kvbridge-redis-{os.getpid()}-*")))


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to list child processes")
def test_failed_start_leaves_no_server_or_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A credentials folder that cannot be trusted (here: group/world-accessible) refuses the start;
    the server already spawned is stopped and its folder removed, also when a caller retries.
    Before: every failed start left a running valkey-server and a temp folder behind."""
    bad = tmp_path / f"kvbridge-leases-{os.getuid()}"
    bad.mkdir(mode=0o755)
    bad.chmod(0o755)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(embedded, "_default", None)
    servers, dirs = set(_server_children()), _our_dirs()
    for _ in range(2):
        with pytest.raises(ConfigError, match="mode 0700"):
            default_lease_url()
    with pytest.raises(ConfigError, match="mode 0700"):
        with EmbeddedRedis():
            pass
    srv = EmbeddedRedis()
    try:
        with pytest.raises(ConfigError):
            srv.start()
        assert not srv.running
    finally:
        srv.close()
    assert set(_server_children()) <= servers
    assert _our_dirs() <= dirs


def test_restart_from_an_older_snapshot_starts_a_new_epoch(make_store: Any) -> None:
    """A restart that loads a snapshot older than the last writes (a stock Redis with RDB, killed)
    restores the epoch *and* an older fence counter. Before: the released lease came back as
    published, the next claimer got the very fence the first one had held, and validated a
    lease whose blocks the owner had freed on the release. After: the epoch is new (it belongs
    to the server process too), so the revived lease is over and no fence repeats."""
    srv = EmbeddedRedis().start()
    try:
        s: RedisLeaseStore = make_store(srv.url)
        s.publish("a", "owner", ttl_s=30)
        raw = redis.Redis.from_url(srv.auth_url)
        try:
            raw.save()                                   # the snapshot: "a" published, counter 1
        finally:
            raw.close()
        a = s.claim("a", "A", 30)
        s.release("a", "A", a.fence)                     # the owner frees the blocks on this
        srv.kill()
        srv.restart()                                    # same folder: the server loads the snapshot
        with pytest.raises(LeaseExpired):
            s.claim("a", "B", 30)
        with pytest.raises(StaleFence):
            s.validate("a", "A", a.fence)
        assert s.sweep("owner", ["a"]) == {"a": None}
        s.publish("b", "owner", ttl_s=30)
        b = s.claim("b", "B", 30)
        assert b.fence.epoch != a.fence.epoch and b.fence != a.fence
        s.validate("b", "B", b.fence)                    # and the new epoch holds while the process does
    finally:
        srv.close()


def test_list_never_blocks_the_server_for_long(server: EmbeddedRedis, ns: str, make_store: Any) -> None:
    """A script blocks every other client while it runs. Before: ``list(owner)`` scanned the whole
    index in one script (about 1 s per 100k leases here), stalling every claim, validate and
    release of every worker, and ``kvbridge leases`` on a busy server could time them all out.
    Now one script looks at one page of the index; the server's slow log shows no long call."""
    raw = redis.Redis.from_url(server.auth_url, decode_responses=True)
    n = 100_000         # leases of another owner, written straight into the keyspace (fast)
    try:
        raw.eval("""for i = 1, tonumber(ARGV[1]) do
                      local ref = 'r' .. i
                      redis.call('HSET', KEYS[1] .. ref, 'st', 'P', 'ow', 'other', 'cl', '', 'ep', '1', 'fc', i,
                                 'cu', 0, 'ex', 9e12, 'nb', 0, 'mt', '', 'pn', '')
                      redis.call('ZADD', KEYS[2], 9e12, ref)
                    end""", 2, "{%s}:lease:" % ns, "{%s}:index" % ns, n)
        s: RedisLeaseStore = make_store(server.url)
        s.publish("mine", "me", ttl_s=600)
        slow_us = raw.config_get("slowlog-log-slower-than")["slowlog-log-slower-than"]
        raw.config_set("slowlog-log-slower-than", 100_000)      # calls over 100 ms
        raw.slowlog_reset()
        try:
            assert [x.ref for x in s.list("me")] == [s.ref("mine")]
            slow = [e for e in raw.slowlog_get(128) if "evalsha" in str(e.get("command", "")).lower()]
        finally:
            raw.config_set("slowlog-log-slower-than", slow_us)
        assert not slow, f"{len(slow)} lease script call(s) over 100 ms: {slow[0]['duration']} us"
    finally:
        raw.eval("for i = 1, tonumber(ARGV[1]) do redis.call('UNLINK', KEYS[1] .. 'r' .. i) end",
                 1, "{%s}:lease:" % ns, n)
        raw.close()


def test_list_pages_return_every_lease_once(store: RedisLeaseStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages of 7 entries over leases that share expiry times (one pipelined publish_many):
    every lease of the owner exactly once, other owners' skipped, the limit kept."""
    import asyncio

    from kvbridge.lease import redis as redis_store

    monkeypatch.setattr(redis_store, "LIST_PAGE", 7, raising=False)
    mine = [f"m{i}" for i in range(45)]
    store.publish_many("me", mine[:30], ttl_s=60)
    store.publish_many("other", [f"o{i}" for i in range(20)], ttl_s=60)
    store.publish_many("me", mine[30:], ttl_s=60)
    want = sorted(store.ref(i) for i in mine)
    assert sorted(x.ref for x in store.list("me")) == want
    assert sorted(x.ref for x in asyncio.run(store.alist("me"))) == want
    assert len(store.list()) == 65
    some = store.list("me", limit=10)
    assert len(some) == 10 and len({x.ref for x in some}) == 10 and {x.ref for x in some} <= set(want)


def test_password_not_offered_once_its_server_died(make_store: Any) -> None:
    """Before: a password file lived as long as the process that started the server, so after the
    server alone died (crashed, OOM-killed) a store opened on its address still sent its password
    there -- to whoever holds 127.0.0.1:port next -- and a later server of another process of this
    user on that port could get the wrong one. Now the file lives as long as the server."""
    import signal

    from kvbridge.lease.credentials import with_password

    srv = EmbeddedRedis().start()
    try:
        assert with_password(srv.url) != srv.url and with_password(srv.unix_url) != srv.unix_url
        assert srv.pid is not None
        os.kill(srv.pid, signal.SIGKILL)
        for _ in range(200):
            if with_password(srv.url) == srv.url:
                break
            time.sleep(0.01)
        assert with_password(srv.url) == srv.url and with_password(srv.unix_url) == srv.unix_url
        again = EmbeddedRedis(port=srv.port).start()     # a new server there: its own password
        try:
            make_store(again.url).publish("x", "owner", ttl_s=5)
        finally:
            again.close()
    finally:
        srv.close()


def test_server_busy_with_a_long_script_is_retryable(make_store: Any) -> None:
    """Before: while the server ran someone's long script, its BUSY reply became a final
    ConfigError ("rejected a script: needs Redis >= 6.2"): the fetch failed for good and told
    the user to check their Redis version. It is "not now": retried, then served."""
    import threading

    from kvbridge.policy import Backoff, Retry

    with EmbeddedRedis(extra_args=("--busy-reply-threshold", "50")) as srv:
        s: RedisLeaseStore = make_store(srv.url, retry=Retry(attempts=100, backoff=Backoff(0.02, 0.1),
                                                            deadline=20.0))
        s.publish("a", "owner", ttl_s=30)
        raw = redis.Redis.from_url(srv.auth_url)
        started = threading.Event()

        def long_script() -> None:
            started.set()
            raw.eval("local t = redis.call('TIME')[1] + 0 while redis.call('TIME')[1] - t < 1 do end", 0)
        t = threading.Thread(target=long_script)
        t.start()
        try:
            started.wait(5)
            time.sleep(0.2)                     # past the busy threshold: others get BUSY
            c = s.claim("a", "dec", 5)
            s.validate("a", "dec", c.fence)
        finally:
            t.join(10)
            raw.close()


def test_a_temp_directory_too_deep_for_a_socket_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A temp directory whose path leaves no room for the server's unix socket (108 bytes at most
    on Linux): the server's folder goes to /tmp instead, and the server starts. Before: the
    server exited at start ("unix socket path too long"), as under a test runner's deep
    per-worker temp folder."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with EmbeddedRedis() as srv:
        assert srv.unix_path is not None and len(srv.unix_path.encode()) <= embedded.MAX_SOCKET_PATH
        assert os.path.dirname(os.path.dirname(srv.unix_path)) == embedded.SHORT_TMP
        assert redis.Redis.from_url(srv.unix_url, password=srv.password).ping()
        folder = os.path.dirname(srv.unix_path)
    assert not os.path.exists(folder)
