"""Review of the cancel that cuts connections (kvbridge.transports.deadline, Transfer.cancel):
a cancel from a signal handler, a connection armed after the cancel, the clean-up exchanges
of a cancelled push, and shm:// senders forgotten under one URL but kept under another."""

from __future__ import annotations

import socket
import threading
import time

import pytest

import kvbridge.transfer as transfer_mod
from kvbridge.transfer import Flag
from kvbridge.transports.deadline import Watchdog, serving

pytestmark = pytest.mark.timeout(60)


def test_a_cancel_from_a_signal_handler_does_not_deadlock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal handler runs on the thread it interrupts, between two bytecodes -- perhaps inside
    the watchdog's lock (an arm() rousing it, a disarm() learning a verdict): an engine's SIGTERM
    handler that cancels its transfers then took that lock again on the same thread, and hung."""
    wd = Watchdog(tick=0.05)
    monkeypatch.setattr(transfer_mod, "WATCHDOG", wd)
    a, b = socket.socketpair()
    flag, other = Flag(), Flag()
    done = threading.Event()

    def interrupted() -> None:
        with serving(other):
            wd.arm(a, time.monotonic() + 30)     # something armed: cancel() looks at its owners
        with wd._lock:                            # the thread is inside the lock when the signal comes
            flag.set()                            # ... and the handler cancels a transfer
        done.set()
    th = threading.Thread(target=interrupted, daemon=True)
    th.start()
    try:
        assert done.wait(2.0), "Flag.set() from inside the watchdog's lock (a signal handler) deadlocked"
        assert wd.disarm(a) is False              # the other transfer's exchange was not cut
    finally:
        a.close()
        b.close()
