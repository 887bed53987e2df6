"""A serving process freezes its start-up heap before it says it is ready, so that a full
collection while requests are in flight walks only what was made since (with torch loaded a
full collection of the start-up objects takes tens of milliseconds)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

CHILD = textwrap.dedent("""
    import gc, sys
    import torch  # noqa: F401  -- what a worker has loaded
    from kvbridge.workers.server import run_until_signal

    class Served:
        url = "http://127.0.0.1:1"

    class Worker:            # the worker is not under test: run_until_signal's start-up is
        role = "test"
        def serve(self, host, port):
            print("frozen-before-ready", gc.get_freeze_count(), flush=True)
            return Served()
        def close(self):
            print("frozen", gc.get_freeze_count(), "tracked", len(gc.get_objects()), flush=True)

    sys.exit(run_until_signal(Worker(), "127.0.0.1", 0))
""")


def test_a_worker_freezes_its_startup_heap_before_it_is_ready() -> None:
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        first = p.stdout.readline().split()
        assert first == ["frozen-before-ready", "0"]
        ready = json.loads(p.stdout.readline())
        assert ready["event"] == "ready"
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
        words = out.split()
        frozen, tracked = int(words[1]), int(words[3])
        assert frozen > 50_000 and tracked < frozen // 10     # torch's start-up objects are out of reach
        assert p.returncode == 0
    finally:
        if p.poll() is None:
            p.kill()


UP_CHILD = textwrap.dedent("""
    import gc, os, signal, sys, threading, time
    from kvbridge.cli import main
    from kvbridge.workers.launch import Cluster
    from kvbridge.workers.signals import StopSignals

    ready = threading.Event()
    say = Cluster._say

    def spy(self, msg):      # `kvbridge up` runs its proxy in this process: what it has frozen
        if msg.startswith("ready in"):  # when it says it is ready
            print("frozen-when-ready", gc.get_freeze_count(), flush=True)
            ready.set()
        say(self, msg)

    def stop():              # then Ctrl-C, once up waits for it
        if ready.wait(120):
            while not isinstance(getattr(signal.getsignal(signal.SIGINT), "__self__", None), StopSignals):
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)

    Cluster._say = spy
    threading.Thread(target=stop, daemon=True).start()
    sys.exit(main(["up", "--port", "0", "--colocated", "--model", "tiny", "--num-blocks", "64", "--no-progress"]))
""")


def test_up_freezes_its_proxys_startup_heap_before_it_is_ready() -> None:
    """``kvbridge up`` serves the proxy in its own process: it froze nothing (230,000 objects,
    torch's among them, walked by every full collection: 88 ms), though ``kvbridge proxy`` and
    every worker freeze theirs."""
    p = subprocess.Popen([sys.executable, "-c", UP_CHILD], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        out, _ = p.communicate(timeout=50)
        frozen = [int(line.split()[1]) for line in out.splitlines() if line.startswith("frozen-when-ready")]
        assert frozen and frozen[0] > 50_000, out[-2000:]
        assert p.returncode == 0, out[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
