"""Stopping on SIGINT/SIGTERM without a lock in the signal handler.

A handler that calls ``threading.Event.set()`` can deadlock: Python runs handlers on the
main thread between bytecodes, possibly while that thread is inside ``Event.wait()`` holding
the Event's lock, and the handler then waits for that lock forever (a second Ctrl-C or
SIGTERM makes it likely). Here the handler only records the signal; waiting is sleeping in
short steps and looking at the record."""

from __future__ import annotations

import signal
import time
from types import FrameType
from typing import Any, Optional, Sequence

__all__ = ["StopSignals"]

STEP = 0.05   # seconds between looks at the record: how late a stop may be noticed


class StopSignals:
    """Install handlers for ``signals`` that record the first one; :meth:`restore` undoes them."""

    def __init__(self, signals: Sequence[signal.Signals] = (signal.SIGINT, signal.SIGTERM)) -> None:
        self.received: Optional[int] = None
        self._prev: dict[signal.Signals, Any] = {s: signal.signal(s, self._on) for s in signals}

    def _on(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.received is None:
            self.received = signum

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Sleep until a signal came (True) or ``timeout`` seconds passed (False)."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.received is None:
            left = STEP if end is None else min(STEP, end - time.monotonic())
            if left <= 0:
                return False
            time.sleep(left)
        return True

    def restore(self) -> None:
        for s, h in self._prev.items():
            signal.signal(s, h)
