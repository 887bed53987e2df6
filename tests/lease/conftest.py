"""Fixtures for lease tests: real Redis-protocol servers started by the tests themselves."""

from __future__ import annotations

import uuid
from typing import Iterator

import pytest

from kvbridge.lease import EmbeddedRedis, RedisLeaseStore
from kvbridge.policy import Backoff, Retry

FAST_RETRY = Retry(attempts=3, backoff=Backoff(base=0.01, cap=0.05), deadline=1.0)
DEFAULT_TIMEOUT_S = 60


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every lease test is bounded, even one that forgot its own timeout mark."""
    for item in items:
        if "tests/lease" in str(item.fspath) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_TIMEOUT_S))


@pytest.fixture(scope="session")
def server() -> Iterator[EmbeddedRedis]:
    """One shared server; tests isolate themselves by namespace."""
    with EmbeddedRedis() as srv:
        yield srv


@pytest.fixture
def own_server() -> Iterator[EmbeddedRedis]:
    """A private server that the test may kill or restart."""
    with EmbeddedRedis() as srv:
        yield srv


@pytest.fixture
def ns() -> str:
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def store(server: EmbeddedRedis, ns: str) -> Iterator[RedisLeaseStore]:
    with RedisLeaseStore(server.url, namespace=ns, retry=FAST_RETRY) as s:
        yield s


@pytest.fixture
def store2(server: EmbeddedRedis, ns: str) -> Iterator[RedisLeaseStore]:
    """A second client (own connection pool) on the same namespace."""
    with RedisLeaseStore(server.url, namespace=ns, retry=FAST_RETRY) as s:
        yield s


@pytest.fixture
def make_store(ns: str) -> Iterator["object"]:
    """Factory: ``make_store(url, namespace=ns, retry=FAST_RETRY, **kw)``; all closed at teardown."""
    made: list[RedisLeaseStore] = []

    def factory(url: str, namespace: str = ns, retry: Retry = FAST_RETRY,
                **kw: object) -> RedisLeaseStore:
        s = RedisLeaseStore(url, namespace=namespace, retry=retry, **kw)  # type: ignore[arg-type]
        made.append(s)
        return s

    yield factory
    for s in made:
        s.close()
