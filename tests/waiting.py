"""Polling for a condition with a deadline, and running a function on several threads at once,
shared by the test directories."""

from __future__ import annotations

import threading
import time
from typing import Callable


def wait_until(cond: Callable[[], bool], timeout: float = 5.0, interval: float = 0.01) -> bool:
    """True as soon as ``cond()`` holds; False if it still does not after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(interval)
    return cond()


def in_threads(fn: Callable[[int], None], n: int) -> list[BaseException]:
    """Run ``fn(0) .. fn(n - 1)`` on ``n`` threads at once; what they raised (none: [])."""
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            fn(k)
        except BaseException as exc:   # noqa: BLE001 -- returned to the test
            errors.append(exc)
    ts = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return errors
