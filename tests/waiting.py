"""Polling for a condition with a deadline, shared by the test directories."""

from __future__ import annotations

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
