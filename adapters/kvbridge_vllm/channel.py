"""Worker -> scheduler messages inside one vLLM engine: the handle a worker published.

vLLM calls ``request_finished`` (scheduler side, where ``kv_transfer_params`` are returned)
in the same step whose output the worker just produced, before the scheduler reads the
worker's connector output. The handle is made on the worker (it owns the cache), so it
travels on a side channel: a unix datagram socket in the abstract namespace, named after
the engine. The worker sends before its step returns, so by the time the scheduler handles
that step's output the datagram is queued; the scheduler still waits a bounded time.

A unix datagram socket queues only a few datagrams (``net.unix.max_dgram_qlen``) before
``sendto`` blocks, and the scheduler may run on the worker's own thread (vLLM's in-process
engine): the worker therefore hands messages to a sender thread and never blocks, and the
scheduler drains the socket every step.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
import time
from typing import Any, Optional

__all__ = ["HandleInbox", "HandleOutbox", "channel_name"]

log = logging.getLogger("kvbridge_vllm")
MAX_DATAGRAM = 1 << 20


def channel_name(engine_id: str, dp_rank: int) -> bytes:
    return f"\0kvbridge-vllm-{engine_id}-{dp_rank}".encode()


class HandleInbox:
    """Scheduler side: receives ``(request_id, message)`` datagrams."""

    def __init__(self, name: bytes) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self._sock.bind(name)
        self._got: dict[str, dict[str, Any]] = {}

    def _drain(self, timeout: float) -> None:
        self._sock.settimeout(timeout)
        try:
            while True:
                data = self._sock.recv(MAX_DATAGRAM)
                msg = json.loads(data)
                self._got[str(msg["req"])] = msg
                self._sock.settimeout(0.0)
        except (BlockingIOError, socket.timeout):
            return

    def take(self, request_id: str, wait: float) -> Optional[dict[str, Any]]:
        """The message about ``request_id``, waiting up to ``wait`` seconds for it."""
        deadline = time.monotonic() + wait
        while request_id not in self._got:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._drain(min(left, 0.05))
        return self._got.pop(request_id)

    def poll(self) -> None:
        """Read whatever has arrived (non-blocking)."""
        self._drain(0.0)

    def forget(self, request_id: str) -> None:
        self._drain(0.0)
        self._got.pop(request_id, None)

    def close(self) -> None:
        self._sock.close()


class HandleOutbox:
    """Worker side: sends one datagram per published (or failed) request."""

    def __init__(self, name: bytes) -> None:
        self._name = name
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        self._q: "queue.SimpleQueue[Optional[tuple[str, bytes]]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="kvbridge-vllm-outbox", daemon=True)
        self._thread.start()

    def send(self, request_id: str, **msg: Any) -> None:
        """Queue a message; returns at once."""
        self._q.put((request_id, json.dumps({"req": request_id, **msg}, separators=(",", ":")).encode()))

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            rid, data = item
            try:
                self._sock.sendto(data, self._name)     # blocks while the scheduler's queue is full
            except OSError as exc:   # the scheduler gives up on the request after handle_wait
                log.error("kvbridge: cannot tell the scheduler about %s: %s", rid, exc)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=2)
        self._sock.close()
