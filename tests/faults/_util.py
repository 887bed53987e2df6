"""Helpers of the lifecycle fault suite (no relative imports: the child process imports this too).

* tiny layouts and per-block byte helpers (every published block gets fresh random bytes, so a
  stale read -- bytes reported ok that are not the published ones -- is always detectable);
* :class:`FaultSender`, a real :class:`KVSender` with a *read gate*: a read that reaches the
  owner can be held before it is authorized (``hold_before``) or after it is authorized and
  counted in flight (``hold_after``), so a test can kill Redis, let a lease expire, revoke or
  close while a read is provably in flight. At the moment a held read is let go and again
  when it finishes sending, it checks that its blocks are still owned, with the generation
  the handle names (invariant 2); every breach is counted in ``violations``;
* :class:`Child`, a JSON-lines driven child process (``_child.py``) that hosts a sender or a
  receiver and can be SIGKILLed.
"""

from __future__ import annotations

from jsonchild import JsonLinesChild
import base64
import os
import signal
import subprocess
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch

from kvbridge import KVHandle, KVLayout, KVPool, KVSender
from kvbridge import Claim

HERE = os.path.dirname(os.path.abspath(__file__))
# 1 layer x 4 tokens x 8 latent dims x fp16 = 64 bytes per block
LAYOUT = KVLayout.mla(1, 8, block_size=4, dtype="float16")
SENTINEL = 0x5A


# -- block bytes -------------------------------------------------------------------------------
def _parts(pool: KVPool, b: int) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for layer in range(pool.layout.num_layers):
        v = pool.block(layer, b)
        out.extend(v if isinstance(v, tuple) else [v])
    return out


def block_bytes(pool: KVPool, b: int) -> bytes:
    return b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in _parts(pool, b))


def write_block(pool: KVPool, b: int, data: bytes) -> None:
    off = 0
    for p in _parts(pool, b):
        flat = p.view(torch.uint8).view(-1)
        n = flat.numel()
        flat.copy_(torch.frombuffer(bytearray(data[off:off + n]), dtype=torch.uint8))
        off += n
    assert off == len(data)


def fill_random(pool: KVPool, ids: Sequence[int]) -> list[bytes]:
    """Fresh random bytes in each block; returns what was written."""
    out = []
    for b in ids:
        data = os.urandom(pool.layout.block_nbytes)
        write_block(pool, b, data)
        out.append(data)
    return out


def fill_sentinel(pool: KVPool, ids: Sequence[int]) -> None:
    for b in ids:
        write_block(pool, b, bytes([SENTINEL]) * pool.layout.block_nbytes)


def untouched(pool: KVPool, ids: Sequence[int]) -> bool:
    return all(block_bytes(pool, b) == bytes([SENTINEL]) * pool.layout.block_nbytes for b in ids)


def wait_until(cond: Callable[[], bool], timeout: float, interval: float = 0.01) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(interval)
    return bool(cond())


class Bounded:
    """Run ``fn`` in a daemon thread; ``result(timeout)`` returns its value or raises ``Hang``."""

    class Hang(AssertionError):
        pass

    def __init__(self, fn: Callable[[], Any], name: str = "bounded") -> None:
        self._value: Any = None
        self._exc: Optional[BaseException] = None
        self._t = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._t.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as exc:  # handed to the test thread
            self._exc = exc

    def done(self) -> bool:
        return not self._t.is_alive()

    def result(self, timeout: float) -> Any:
        self._t.join(timeout)
        if self._t.is_alive():
            raise Bounded.Hang(f"did not finish within {timeout}s")
        if self._exc is not None:
            raise self._exc
        return self._value


# -- the owner, with a read gate ---------------------------------------------------------------
class _HeldGrant:
    def __init__(self, owner: "FaultSender", inner: Any) -> None:
        self._owner, self._inner = owner, inner
        self.spans, self.layers, self.sums, self.claim = inner.spans, inner.layers, inner.sums, inner.claim

    def still_valid(self) -> bool:
        return bool(self._inner.still_valid())

    def vouch(self) -> Any:
        return self._inner.vouch()

    def close(self) -> None:
        self._owner._check_owned(self._inner.rec)   # the bytes have just been sent
        self._inner.close()


class FaultSender(KVSender):
    """A KVSender whose reads can be held in flight. ``frees``: (request_id, reason, monotonic)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        self.frees: list[tuple[str, str, float]] = []
        self.violations = 0
        self.hold_before = False          # hold reads before authorization (lease check)
        self.hold_after = False           # hold reads after authorization (counted in flight)
        self.hold_claimer: Optional[str] = None   # hold only this claimer's reads (None: all)
        self.entered = threading.Event()  # a read is being held
        self.gate = threading.Event()     # set: held reads go on
        self.gate_timeout = 20.0
        user = kw.pop("on_free", None)

        def on_free(h: KVHandle, reason: str) -> None:
            self.frees.append((h.request_id, reason, time.monotonic()))
            if user is not None:
                user(h, reason)
        super().__init__(*args, on_free=on_free, **kw)

    def _held(self, claim: Optional[Claim]) -> bool:
        return self.hold_claimer is None or (claim is not None and claim.claimer == self.hold_claimer)

    def _hold(self) -> None:
        self.entered.set()
        if not self.gate.wait(self.gate_timeout):
            raise AssertionError("read gate was never opened")

    def _check_owned(self, rec: Any) -> None:
        if rec.freed or self.pool.generations(rec.block_ids) != list(rec.handle.generations) \
                or any(self.pool.refcount(b) <= 0 for b in rec.block_ids):
            self.violations += 1

    def open_read(self, handle_bytes: bytes, indices: Optional[Sequence[int]],
                  claim: Optional[Claim] = None, layers: Optional[tuple[int, int]] = None) -> Any:
        if self.hold_before and self._held(claim):
            self._hold()
        grant = super().open_read(handle_bytes, indices, claim, layers)
        if self.hold_after and self._held(claim):
            try:
                self._hold()
                self._check_owned(grant.rec)  # still in flight: the owner must not have freed
            except BaseException:
                grant.close()
                raise
        return _HeldGrant(self, grant)

    def freed_reasons(self, request_id: str) -> list[str]:
        return [r for q, r, _ in self.frees if q == request_id]

    def freed_at(self, request_id: str) -> Optional[float]:
        return next((t for q, _, t in self.frees if q == request_id), None)


def publish_fresh(sender: KVSender, n: int, request_id: str, ttl: Optional[float] = None
                  ) -> tuple[KVHandle, list[bytes]]:
    """Allocate ``n`` blocks, fill them with fresh random bytes, publish them."""
    ids = sender.pool.alloc(n)
    data = fill_random(sender.pool, ids)
    return sender.publish(request_id, ids, n * sender.pool.layout.block_size, ttl=ttl), data


# -- a sender or receiver in a child process ----------------------------------------------------
class ChildError(RuntimeError):
    pass


class Child(JsonLinesChild):
    """``_child.py`` driven by JSON lines; ``kill()`` SIGKILLs it."""

    error = ChildError

    def __init__(self, reply_timeout: float = 30.0) -> None:
        super().__init__(os.path.join(HERE, "_child.py"), reply_timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


def handle_from_b64(s: str) -> KVHandle:
    return KVHandle.from_bytes(base64.b64decode(s))


def handle_to_b64(h: KVHandle) -> str:
    return base64.b64encode(h.to_bytes()).decode()
