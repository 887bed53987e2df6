"""A Python child process driven by JSON lines on stdin/stdout (test peers that can be SIGKILLed).

The child prints ``{"ready": true}`` once, then answers each ``{"op": ..., "kw": {...}}``
line with ``{"result": ...}`` or ``{"error": "..."}``.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from typing import Any, Optional


class JsonLinesChild:
    error: type[Exception] = RuntimeError
    what = "child"

    def __init__(self, script: str, reply_timeout: float = 30.0) -> None:
        self.reply_timeout = reply_timeout
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, script], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self._q: "queue.Queue[Optional[bytes]]" = queue.Queue()
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._reader.start()
        self._lock = threading.Lock()
        ready = self._get()
        if ready.get("ready") is not True:
            raise self.error(f"{self.what} did not start: {ready}")

    def _read_loop(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._q.put(line)
        self._q.put(None)

    def _get(self) -> dict:
        try:
            line = self._q.get(timeout=self.reply_timeout)
        except queue.Empty:
            raise self.error(f"{self.what} did not answer in time") from None
        if line is None:
            raise self.error(f"{self.what} exited (rc={self.proc.poll()})")
        return json.loads(line)

    def call(self, op: str, **kw: Any) -> Any:
        with self._lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps({"op": op, "kw": kw}) + "\n").encode())
            self.proc.stdin.flush()
            reply = self._get()
        if "error" in reply:
            raise self.error(reply["error"])
        return reply["result"]
