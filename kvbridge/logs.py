"""Log lines that would repeat (a lease server down, a peer failing every call) are
rate-limited: the first one is logged, then at most one per ``every`` seconds, saying how
many were suppressed."""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, every: float = 30.0) -> None:
        self.logger = logger
        self.every = every
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}
        self._lock = threading.Lock()

    def log(self, level: int, key: str, msg: str, *args: object) -> bool:
        """Log ``msg`` unless a line with ``key`` went out less than ``every`` seconds ago."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.every:
                self._dropped[key] = self._dropped.get(key, 0) + 1
                return False
            self._last[key] = now
            dropped = self._dropped.pop(key, 0)
        if dropped:
            msg += f" ({dropped} more like this in the last {self.every:.0f} s)"
        self.logger.log(level, msg, *args)
        return True
