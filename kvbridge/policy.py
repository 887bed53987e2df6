"""Retry and timeout policies: values passed in, never read from globals."""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional, TypeVar

from .errors import ConfigError, RetryableError, TransferTimeout

__all__ = ["Backoff", "Retry", "Timeout", "Deadline", "NO_RETRY"]

T = TypeVar("T")
NAP = 0.02    # seconds between two looks at the cancel flag while a retry backs off


def _back_off(delay: float) -> None:
    """Sleep ``delay`` seconds, or less once the transfer this thread runs is cancelled (its
    next try then says so at once instead of after the back-off)."""
    from .transports.deadline import cancelled     # here: the transports import this module
    end = time.monotonic() + delay
    while not cancelled():
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, NAP))


def _seconds(owner: str, name: str, value: object, *, zero: bool = False) -> None:
    """Refuse a duration that is not a finite number of seconds, positive (or ``zero`` allowed):
    a policy is checked where it is built, not where a socket or ``sleep`` first chokes on it."""
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
            or value < 0 or (value == 0 and not zero)):
        raise ConfigError(f"{owner}.{name} must be a finite number of seconds "
                          f"{'>= 0' if zero else '> 0'}, got {value!r}")


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter: sleep ~ U(0, min(cap, base * 2**attempt))."""

    base: float = 0.01
    cap: float = 1.0
    jitter: bool = True

    def __post_init__(self) -> None:
        _seconds("Backoff", "base", self.base, zero=True)
        _seconds("Backoff", "cap", self.cap, zero=True)

    def delay(self, attempt: int, rng: Optional[random.Random] = None) -> float:
        d: float = min(self.cap, self.base * (2.0 ** attempt))
        if self.jitter:
            d = float((rng or random).uniform(0, d))
        return d


@dataclass(frozen=True)
class Timeout:
    """Per-phase limits in seconds: connect, one transfer, and lease TTL. Each a finite
    number of seconds above 0 (:class:`~kvbridge.errors.ConfigError` otherwise).

    ``lease`` is not read by :class:`~kvbridge.KVSender` or :class:`~kvbridge.KVReceiver`:
    a handle's TTL is ``KVSender(ttl=...)`` / ``publish(ttl=...)`` and a claim's
    ``KVReceiver(claim_ttl=...)``."""

    connect: float = 5.0
    transfer: float = 30.0
    lease: float = 30.0

    def __post_init__(self) -> None:
        for name in ("connect", "transfer", "lease"):
            _seconds("Timeout", name, getattr(self, name))


class Deadline:
    """An absolute point in monotonic time; ``remaining()`` never goes negative."""

    def __init__(self, seconds: Optional[float]) -> None:
        self.at = None if seconds is None else time.monotonic() + seconds

    def remaining(self, default: float = 3600.0) -> float:
        if self.at is None:
            return default
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def check(self, what: str = "operation") -> None:
        if self.expired():
            raise TransferTimeout(f"{what} passed its deadline")


@dataclass(frozen=True)
class Retry:
    """Retry retryable errors with backoff, at most ``attempts`` tries within ``deadline`` seconds.

    Only :class:`~kvbridge.errors.RetryableError` (plus ``retry_on``) is retried;
    final errors propagate at once.
    """

    attempts: int = 3
    backoff: Backoff = field(default_factory=Backoff)
    deadline: Optional[float] = 30.0
    retry_on: tuple[type[BaseException], ...] = (RetryableError,)

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or isinstance(self.attempts, bool) or self.attempts < 1:
            raise ConfigError(f"Retry.attempts must be an int >= 1 (1: no retry), got {self.attempts!r}")
        if not isinstance(self.backoff, Backoff):
            raise ConfigError(f"Retry.backoff must be a Backoff, got {type(self.backoff).__name__}")
        if self.deadline is not None:
            _seconds("Retry", "deadline", self.deadline)
        if not (isinstance(self.retry_on, tuple)
                and all(isinstance(c, type) and issubclass(c, BaseException) for c in self.retry_on)):
            raise ConfigError(f"Retry.retry_on must be a tuple of exception classes, got {self.retry_on!r}")

    def _should_retry(self, exc: BaseException, attempt: int, dl: Deadline) -> float | None:
        if not isinstance(exc, self.retry_on) or attempt + 1 >= self.attempts:
            return None
        delay = self.backoff.delay(attempt)
        if dl.at is not None and dl.remaining() <= delay:
            return None
        return delay

    def call(self, fn: Callable[[], T], on_retry: Optional[Callable[[BaseException, int], None]] = None) -> T:
        start = time.monotonic()
        dl: Optional[Deadline] = None
        attempt = 0
        while True:
            try:
                return fn()
            except Exception as exc:
                if dl is None:            # made on the first failure (most calls never fail), from the start
                    dl = Deadline(None)
                    dl.at = None if self.deadline is None else start + self.deadline
                delay = self._should_retry(exc, attempt, dl)
                if delay is None:
                    raise
                if on_retry:
                    on_retry(exc, attempt)
                _back_off(delay)
                attempt += 1

    async def acall(self, fn: Callable[[], Awaitable[T]],
                    on_retry: Optional[Callable[[BaseException, int], None]] = None) -> T:
        dl = Deadline(self.deadline)
        attempt = 0
        while True:
            try:
                return await fn()
            except Exception as exc:
                delay = self._should_retry(exc, attempt, dl)
                if delay is None:
                    raise
                if on_retry:
                    on_retry(exc, attempt)
                await asyncio.sleep(delay)
                attempt += 1


NO_RETRY = Retry(attempts=1)
