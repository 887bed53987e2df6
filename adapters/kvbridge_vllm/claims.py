"""The consumer scheduler's claims, kept on a thread of their own.

vLLM's scheduler thread must never wait on a lease server or a producer: a claim or a renewal
that meets a hung server waits for its connect timeout on every retry. So the scheduler only
queues what it wants (claim this handle, stop renewing it, give it up) and returns at once; the
thread does the network calls, renews live claims every ``claim_ttl / 3`` seconds, and hands a
handle nobody will read back to its producer (the lease aborted, or an unleased handle released)
so the producer frees its blocks now instead of at the handle's ``ttl``.

The worker's fetch claims under the same claimer name; a claim is re-entrant for its claimer,
so a fetch that starts before (or while) this thread claims reuses the same claim.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Optional

from kvbridge import Claim, KVHandle, KVReceiver
from kvbridge.errors import KVBridgeError

__all__ = ["ClaimKeeper"]

log = logging.getLogger("kvbridge_vllm")

_Job = tuple[str, str, Optional[KVHandle]]     # (what, request id, handle)


class ClaimKeeper:
    """Claims, renews and gives up consumer claims off the scheduler thread."""

    def __init__(self, make_receiver: Callable[[], KVReceiver], claim_ttl: float) -> None:
        self._make_receiver = make_receiver
        self._rcv: Optional[KVReceiver] = None
        self._every = claim_ttl / 3
        self._q: "queue.SimpleQueue[Optional[_Job]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._wanted: set[str] = set()          # requests whose claim is kept (scheduler's view)
        # the thread's own: request id -> (handle, claim, last claim or renewal)
        self._held: dict[str, tuple[KVHandle, Optional[Claim], float]] = {}
        self._thread: Optional[threading.Thread] = None
        self.gave_up = 0                         # handles handed back (for tests and stats)

    # -- the scheduler's side: each returns at once ----------------------------------------
    def claim(self, rid: str, handle: KVHandle) -> None:
        """Claim ``handle`` for request ``rid`` and keep the claim renewed until :meth:`drop`."""
        with self._lock:
            self._wanted.add(rid)
        self._put(("claim", rid, handle))

    def drop(self, rid: str) -> None:
        """Stop renewing: the worker's fetch takes the claim over."""
        with self._lock:
            self._wanted.discard(rid)
        self._put(("drop", rid, None))

    def give_up(self, rid: str, handle: KVHandle) -> None:
        """Nothing will be read from ``handle``: hand it back to its producer."""
        with self._lock:
            self._wanted.discard(rid)
        self._put(("give_up", rid, handle))

    def close(self, timeout: float = 2.0) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout)
        if self._rcv is not None and (self._thread is None or not self._thread.is_alive()):
            self._rcv.close()

    def _put(self, job: _Job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvbridge-vllm-claims", daemon=True)
            self._thread.start()
        self._q.put(job)

    # -- the thread ---------------------------------------------------------------------
    def _receiver(self) -> KVReceiver:
        if self._rcv is None:
            self._rcv = self._make_receiver()
        return self._rcv

    def _loop(self) -> None:
        while True:
            due = min((at + self._every for _, _, at in self._held.values()), default=None)
            wait = None if due is None else max(0.0, due - time.monotonic())
            try:
                job = self._q.get(timeout=wait)
            except queue.Empty:
                job = ("renew", "", None)
            if job is None:
                return
            try:
                self._run(*job)
                self._renew_due()
            except Exception:      # a bug here must not stop the claims of every later request
                log.exception("kvbridge: claim keeper failed on %s", job[:2])

    def _run(self, what: str, rid: str, handle: Optional[KVHandle]) -> None:
        if what == "claim":
            assert handle is not None
            with self._lock:
                if rid not in self._wanted:       # dropped or given up while queued
                    return
            try:
                c = self._receiver().claim(handle)
            except KVBridgeError as exc:          # the worker's fetch meets the same fate and reports it
                log.warning("kvbridge: claim of %s failed: %s", rid, exc)
                return
            if c is not None:
                self._held[rid] = (handle, c, time.monotonic())
        elif what == "drop":
            self._held.pop(rid, None)
        elif what == "give_up":
            assert handle is not None
            held = self._held.pop(rid, None)
            self._hand_back(rid, handle, held[1] if held is not None else None)

    def _renew_due(self) -> None:
        now = time.monotonic()
        for rid, (h, c, at) in list(self._held.items()):
            with self._lock:
                wanted = rid in self._wanted
            if not wanted:
                self._held.pop(rid, None)
                continue
            if now - at < self._every or c is None:
                continue
            try:
                self._receiver().renew(h, c)
                self._held[rid] = (h, c, time.monotonic())
            except KVBridgeError as exc:
                log.warning("kvbridge: renewing the claim of %s failed: %s", rid, exc)
                self._held.pop(rid, None)

    def _hand_back(self, rid: str, h: KVHandle, claim: Optional[Claim]) -> None:
        rcv = self._receiver()
        try:
            if not h.lease_id:
                rcv.release(h, wait=False)
                self.gave_up += 1
                return
            store = rcv.lease_store(h)
            if store is None:
                return
            if claim is None:            # never claimed (or it failed): claim to learn the fence
                claim = rcv.claim(h)
            if claim is not None:
                store.abort(h.lease_id, claim.claimer, claim.fence)   # the owner frees its blocks
                self.gave_up += 1
        except KVBridgeError as exc:      # the producer still frees at the handle's expiry
            log.info("kvbridge: handing back %s failed (freed at its expiry): %s", rid, exc)
