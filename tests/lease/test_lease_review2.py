"""Second review of the lease store and its embedded server: each test failed before its fix."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Iterator

import pytest
import redis

from kvbridge.errors import ConfigError, KVBridgeError, LeaseStoreUnavailable
from kvbridge.lease import EmbeddedRedis, LeaseState, RedisLeaseStore
from kvbridge.policy import Retry

pytestmark = pytest.mark.timeout(30)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(10)
    return p.pid


@pytest.fixture
def live() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as srv:
        yield srv


@pytest.mark.skipif(sys.platform != "linux" or not hasattr(os, "pidfd_open"),
                    reason="the sweep stops orphans through /proc and pidfds (Linux)")
def test_sweep_does_not_follow_a_link_to_a_live_servers_folder(live: EmbeddedRedis) -> None:
    """Anyone may create ``kvbridge-redis-<dead pid>-x`` in the shared temp directory. Before: a
    link of that name to a live server's (private) folder made the next sweep -- any
    EmbeddedRedis of this user -- read that server's pid through it and SIGKILL it, as the
    'orphan of a dead owner': every lease of the victim gone. Now only real folders of this
    user are swept."""
    link = os.path.join(tempfile.gettempdir(), f"kvbridge-redis-{_dead_pid()}-link")
    os.symlink(live._dir, link)
    try:
        with EmbeddedRedis():         # its constructor sweeps dead owners' folders
            pass
        assert live.running, "the sweep killed a live server through a link to its folder"
        assert os.path.isdir(live._dir)
    finally:
        os.unlink(link)


ONE_TRY = Retry(attempts=1, deadline=2.0)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that takes connections and never answers (the kernel's backlog accepts them)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield s.getsockname()[1]


def _outcome(url: str) -> tuple[BaseException, str]:
    """The error a store on ``url`` raises (when built, or on its first call) and its repr."""
    shown = ""
    try:
        store = RedisLeaseStore(url, retry=ONE_TRY, socket_timeout=0.5, connect_timeout=0.5)
        shown = repr(store)
        try:
            store.claim("x", "dec", 5)
        finally:
            store.close()
    except Exception as exc:
        return exc, shown
    raise AssertionError(f"no error from {url}")


@pytest.mark.parametrize("query", ["foo=bar", "db=0&path=/tmp/x", "socket_keepalive_options=1"])
def test_unknown_url_options_are_a_config_error(silent_port: int, query: str) -> None:
    """A lease URL comes from a handle (a peer's, maybe forged). Before: an option redis-py does
    not know was handed to its connection class and every call raised a raw TypeError."""
    exc, _ = _outcome(f"redis://127.0.0.1:{silent_port}/0?{query}")
    assert isinstance(exc, ConfigError), repr(exc)


@pytest.mark.parametrize("query", ["socket_timeout=6", "socket_connect_timeout=6&timeout=6",
                                   "retry_on_timeout=yes&socket_timeout=6", "protocol=3"])
def test_url_options_do_not_override_the_stores_deadlines(silent_port: int, query: str) -> None:
    """Before: URL options win over keyword arguments in redis-py, so a handle whose lease URL
    says ``?socket_timeout=6`` made each call on a server that never answers wait 6 s, past
    the store's socket_timeout (0.5 s here) and its retry deadline. The store's own settings
    are the only ones."""
    t0 = time.monotonic()
    exc, _ = _outcome(f"redis://127.0.0.1:{silent_port}/0?{query}")
    assert isinstance(exc, KVBridgeError), repr(exc)
    assert time.monotonic() - t0 < 3.0


@pytest.mark.parametrize("url", ["redis://127.0.0.1:{port}/0?password=hunter2",
                                 "redis://127.0.0.1:{port}/0?db=0&password=hunter2",
                                 "rediss://127.0.0.1:{port}/0?ssl_password=hunter2&password=hunter2"])
def test_password_in_url_query_never_shown(silent_port: int, url: str) -> None:
    """Before: ``redact`` masked only the password before the host, so one in the query string
    (redis-py takes it there too) was in the store's repr and in every error message."""
    exc, shown = _outcome(url.format(port=silent_port))
    assert isinstance(exc, KVBridgeError), repr(exc)
    assert "hunter2" not in str(exc) and "hunter2" not in shown


@pytest.mark.parametrize("url", ["redis://[zz/0", "redis://127.0.0.1:1:2/0", "unix://%zz"])
def test_unparsable_url_is_a_config_error(url: str) -> None:
    """Before: a URL that urllib cannot split raised a raw ValueError from the constructor."""
    exc, _ = _outcome(url)
    assert isinstance(exc, KVBridgeError), repr(exc)


def _failed_snapshot(srv: EmbeddedRedis) -> None:
    """Make the server refuse writes with MISCONF: a snapshot that cannot be written."""
    raw = redis.Redis.from_url(srv.auth_url)
    try:
        raw.bgsave()
        deadline = time.monotonic() + 5
        while raw.info("persistence")["rdb_last_bgsave_status"] == "ok" and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        raw.close()


@pytest.mark.parametrize("args", [("--min-replicas-to-write", "1"), ("--save", "3600 1", "--dir", "/proc")],
                         ids=["NOREPLICAS", "MISCONF"])
def test_server_refusing_writes_for_now_is_unavailable(args: tuple[str, ...]) -> None:
    """A server that refuses writes until its replicas are back (min-replicas-to-write) or its
    snapshots work again (stop-writes-on-bgsave-error) says "not now". Before: both replies
    became a final ConfigError "rejected a script: needs Redis >= 6.2 or Valkey", so a fetch
    failed for good and sent its user to check the server version. Now LeaseStoreUnavailable
    (retryable), as READONLY, LOADING and BUSY are."""
    with EmbeddedRedis(extra_args=args) as srv:
        if "--save" in args:
            _failed_snapshot(srv)
        try:
            with RedisLeaseStore(srv.url, retry=ONE_TRY) as s:
                with pytest.raises(LeaseStoreUnavailable) as got:
                    s.publish("a", "owner", ttl_s=5)
                assert got.value.retryable
        finally:       # no snapshot at shutdown either (it would fail and hold the stop 5 s)
            raw = redis.Redis.from_url(srv.auth_url)
            raw.config_set("save", "")
            raw.close()


def test_release_after_the_holders_own_abort_is_refused(server: EmbeddedRedis, ns: str) -> None:
    """A release is the read's validation: it succeeds only while the lease is claimed by this
    claimer with this fence. A claim is re-entrant, so two fetches of one handle by one receiver
    share it; one fails and aborts (the owner frees the blocks on that event), the other then
    releases. Before: the release answered OK ("already done") after the abort -- the second
    fetch's bytes passed as validated although the owner may have reused the blocks. Now it is
    refused; a repeated release (a retry) and an abort after a release still answer OK."""
    from kvbridge.errors import LeaseExpired

    with RedisLeaseStore(server.url, namespace=ns, retry=ONE_TRY) as s:
        s.publish("a", "owner", ttl_s=30)
        c = s.claim("a", "dec", 30)
        s.abort("a", "dec", c.fence)
        with pytest.raises(LeaseExpired, match="aborted"):
            s.release("a", "dec", c.fence)
        assert isinstance(s.release_many("dec", [("a", c.fence)])[0], LeaseExpired)
        s.abort("a", "dec", c.fence)                           # repeated abort: fine
        s.publish("b", "owner", ttl_s=30)
        d = s.claim("b", "dec", 30)
        s.release("b", "dec", d.fence)
        s.release("b", "dec", d.fence)                         # a retry of the release
        s.abort("b", "dec", d.fence)                           # nothing left to abort: fine
        assert s.sweep("owner", ["a", "b"]) == {"a": LeaseState.ABORTED, "b": LeaseState.RELEASED}


def test_async_calls_from_two_event_loops_keep_their_connections(server: EmbeddedRedis, ns: str) -> None:
    """One store, awaited from two event loops in two threads (e.g. an engine's loop and a
    connector's): before, the store kept one async client, for the loop that called last, so
    every call from the other loop built a new client and a new authenticated connection and
    dropped the previous one unclosed -- a connect per call and a ResourceWarning each. Now each
    loop keeps its own client: two connections for forty calls."""
    raw = redis.Redis.from_url(server.auth_url)
    loops = [asyncio.new_event_loop() for _ in range(2)]
    threads = [threading.Thread(target=lp.run_forever, daemon=True) for lp in loops]
    for t in threads:
        t.start()
    s = RedisLeaseStore(server.url, namespace=ns, retry=ONE_TRY)
    try:
        s.publish("a", "owner", ttl_s=30)
        before = raw.info("stats")["total_connections_received"]
        for i in range(40):
            got = asyncio.run_coroutine_threadsafe(s.aget("a"), loops[i % 2]).result(5)
            assert got is not None and got.ref == s.ref("a")
        opened = raw.info("stats")["total_connections_received"] - before
        assert opened <= 2, f"{opened} connections opened for 40 calls from two loops"
    finally:
        for lp in loops:
            asyncio.run_coroutine_threadsafe(s.aclose(), lp).result(5)
            lp.call_soon_threadsafe(lp.stop)
        for t, lp in zip(threads, loops):
            t.join(5)
            lp.close()
        s.close()
        raw.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open descriptors in /proc")
def test_tickets_naming_many_lease_servers_do_not_pile_up_connections(server: EmbeddedRedis) -> None:
    """A receiver with ``leases=None`` claims each ticket in the lease server the ticket names,
    and a peer chooses what its tickets name. Before: every distinct lease URL opened a store
    that was kept, with its connection, until the receiver closed -- 300 forged tickets, 300
    sockets, until the process ran out of descriptors. Now the stores opened for tickets are
    few (the least recently used is closed)."""
    from dataclasses import replace

    from kvbridge import KVLayout
    from kvbridge.handle import KVHandle
    from kvbridge.stores import StoreCache

    layout = KVLayout.vllm_flash(2, 1, 8, block_size=4, dtype="float16")
    base = KVHandle(handle_id=os.urandom(16), request_id="r", layout_hash=layout.compat_hash,
                    urls=("tcp://127.0.0.1:9",), block_ids=(0,), generations=(0,), checksums=(),
                    num_tokens=4, token=os.urandom(16), mac=os.urandom(16))
    tickets = StoreCache(None)
    try:
        before = _open_fds()
        for i in range(300):
            h = replace(base, lease_id=f"l{i}", lease_url=f"{server.url}?client_name=peer{i}")
            store = tickets.for_ticket(h)
            assert store is not None
            with pytest.raises(KVBridgeError):
                store.claim(h.lease_id, "dec", 5)          # never published: NOTFOUND, connection kept
        grown = _open_fds() - before
        assert grown < 100, f"{grown} descriptors still open after 300 tickets' lease servers"
        same = replace(base, lease_id="x", lease_url=f"{server.url}?client_name=peer299")
        assert tickets.for_ticket(same) is tickets.for_ticket(same)      # still one store per URL
    finally:
        tickets.close()


def test_readers_of_one_owners_events_on_several_threads_get_each_event_once(store: RedisLeaseStore) -> None:
    """events() reads from the owner's position in its stream and moves it: two threads reading
    at once read from the same position, and both got the same events (the owner freed a block
    twice, or counted a release twice). The position only moves forward: each event reaches one
    reader."""
    n = 60
    for i in range(n):
        store.publish(f"l{i}", "owner", 30)
        c = store.claim(f"l{i}", "dec", 30)
        store.release(f"l{i}", "dec", c.fence)
    got: list[list[str]] = [[], [], []]
    start = threading.Barrier(3)

    def reader(k: int) -> None:
        start.wait()
        for _ in range(20):
            got[k] += [e.ref for e in store.events("owner", timeout_s=0.01)]
    ts = [threading.Thread(target=reader, args=(k,)) for k in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    every = [r for g in got for r in g]
    assert sorted(every) == sorted(store.ref(f"l{i}") for i in range(n))     # each once, none lost
    raw = [("k", [("5-1", {"k": "released", "id": "x"})])]
    store._cursors["other"] = "5-1"
    assert store._parse_events("other", raw) == []        # a reader that read the same entries late


def test_a_malformed_stream_id_is_a_malformed_reply(store: RedisLeaseStore) -> None:
    with pytest.raises(KVBridgeError):
        store._parse_events("owner", [("k", [("garbage", {"k": "released", "id": "x"})])])
