"""StopSignals: handlers that record, a wait that sleeps and looks."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvbridge.workers.signals import StopSignals

pytestmark = pytest.mark.timeout(30)


def test_wait_times_out_then_sees_a_signal_and_restores() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    stop = StopSignals((signal.SIGUSR1,))
    try:
        t0 = time.monotonic()
        assert stop.wait(0.1) is False and time.monotonic() - t0 >= 0.09
        threading.Timer(0.05, lambda: [os.kill(os.getpid(), signal.SIGUSR1) for _ in range(20)]).start()
        assert stop.wait(5) is True
        assert stop.received == signal.SIGUSR1
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGUSR1) == before
