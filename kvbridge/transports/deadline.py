"""Whole-reply deadlines for pooled client sockets.

A socket's kernel timeouts (``SO_RCVTIMEO``/``SO_SNDTIMEO``, :func:`.wire.set_os_timeouts`)
bound each receive or send alone: a peer that trickles a byte just inside each of them holds
a request for hours, and no flag checked between receives can stop a C call blocked in one.
So every request/reply exchange on a pooled client connection is *armed* with an absolute
deadline (Timeout.transfer plus the reply's bytes at the minimum rate), and one daemon thread
per process, :data:`WATCHDOG`, ``shutdown(SHUT_RDWR)``\\ s a socket still armed past its
deadline: any receive or send blocked on it, in Python or in C, returns at once (EOF or
EPIPE), and the owner, told by :meth:`Watchdog.disarm` that its socket was cut, reports
:class:`~kvbridge.errors.TransferTimeout` instead of a lost connection.

The owner's fast path is a dict store (``arm``) and a dict pop (``disarm``) under the GIL, no
lock: an entry is claimed by whoever pops it first. The watchdog pops an expired entry, and
shuts the socket down, holding its lock; an owner whose pop finds nothing (the watchdog took
it) waits on that lock to learn the verdict, so a socket is never shut down after its owner
disarmed it (and then perhaps closed it, its descriptor reused). The thread starts at the
first ``arm``; it wakes at most every ``TICK`` seconds (sooner for a deadline nearer) while
anything is armed, and waits to be woken once a tick finds nothing armed."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Optional

__all__ = ["Watchdog", "WATCHDOG", "TICK", "CANCELLED", "cancelled", "serving"]

log = logging.getLogger("kvbridge.deadline")
TICK = 0.25    # seconds between the watchdog's looks while a socket is armed, at most
CANCELLED = 2  # disarm's verdict on a socket cut because the transfer it served was cancelled

_local = threading.local()     # .flag: the cancel flag of the transfer this thread runs (:func:`serving`)


def cancelled() -> bool:
    """Is the transfer this thread runs (:class:`serving`) cancelled?"""
    flag = getattr(_local, "flag", None)
    return flag is not None and bool(flag.is_set())


class serving:
    """``with serving(flag):`` exchanges armed on this thread serve the transfer whose cancel
    flag is ``flag``: :meth:`Watchdog.cancel` of it cuts them at once."""

    __slots__ = ("flag", "outer")

    def __init__(self, flag: object) -> None:
        self.flag = flag

    def __enter__(self) -> None:
        self.outer = getattr(_local, "flag", None)
        _local.flag = self.flag

    def __exit__(self, *exc: object) -> None:
        _local.flag = self.outer


class Watchdog:
    """Cuts armed sockets past their deadline (see the module doc)."""

    def __init__(self, tick: float = TICK) -> None:
        self.tick = tick
        self.due: dict[socket.socket, float] = {}      # armed sockets -> monotonic deadline
        self.fired: dict[socket.socket, int] = {}      # cut (True or CANCELLED), their owner not yet told
        self.owners: dict[socket.socket, Any] = {}     # armed sockets -> the cancel flag they serve
        self.sleeping = True                           # the thread waits for _wake (or is not started)
        self.cuts = 0                                  # sockets cut so far
        # reentrant: a signal handler runs on the thread it interrupts, perhaps inside this lock,
        # and one that cancels a transfer (Flag.set -> cancel) takes it again there
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def arm(self, sock: socket.socket, deadline: float) -> None:
        """``sock``'s exchange must end by ``deadline`` (``time.monotonic()``); arming an armed
        socket moves its deadline."""
        flag = getattr(_local, "flag", None)
        if flag is not None:
            self.owners[sock] = flag
            if flag.is_set():             # armed after its transfer's cancel: cut now, as cancel() would
                self._cut_cancelled(sock)
                return
        self.due[sock] = deadline
        if self.sleeping:
            self._rouse()

    def disarm(self, sock: socket.socket) -> int:
        """The exchange on ``sock`` ended: true when the watchdog cut it (the socket is shut
        down: close it, report a timeout -- or, where the verdict is ``CANCELLED``, that the
        transfer was cancelled), false otherwise (also for a socket never armed)."""
        self.owners.pop(sock, None)
        if self.due.pop(sock, None) is not None and sock not in self.fired:
            return False                # ours: the watchdog can no longer take it
        with self._lock:                # taken (or being taken) by the watchdog: its verdict
            self.due.pop(sock, None)
            return self.fired.pop(sock, False)

    def cancel(self, flag: object) -> None:
        """The transfer whose cancel flag is ``flag`` was cancelled: the exchanges armed for it
        (:class:`serving`) are cut now, not at their deadline."""
        if not self.owners:
            return
        with self._lock:
            for sock in [s for s, f in list(self.owners.items()) if f is flag]:
                at = self.due.pop(sock, None)
                if at is None:                           # its owner disarmed it meanwhile
                    continue
                if self.owners.get(sock) is not flag:    # ... and armed it again for another transfer
                    self.due[sock] = at
                    continue
                self._cut_cancelled(sock)

    def _cut_cancelled(self, sock: socket.socket) -> None:
        with self._lock:
            self.due.pop(sock, None)
            self._shut(sock, CANCELLED)

    def _shut(self, sock: socket.socket, verdict: int) -> None:
        """Cut ``sock`` (this lock held, its entry out of ``due``): its owner learns ``verdict``."""
        self.fired[sock] = verdict
        try:
            sock.shutdown(socket.SHUT_RDWR)   # wakes a receive or send blocked on it, in C too
        except OSError:
            pass

    def _rouse(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvbridge-deadlines", daemon=True)
                self._thread.start()
            self.sleeping = False
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            while True:
                now = time.monotonic()
                due = self.due.copy()             # one C call under the GIL: a consistent snapshot
                if not due:                       # nothing armed: wait to be woken (armed after the
                    self._wake.clear()            # clear, an arm() sees sleeping and wakes us)
                    self.sleeping = True
                    if not self.due:
                        break
                    self.sleeping = False
                    continue
                first = min(due.values())
                for sock, at in due.items():
                    if at <= now:
                        try:
                            self._cut(sock, now)
                        except Exception:      # a bug: say so, and go on keeping the others' deadlines
                            log.exception("cutting a connection past its deadline failed")
                time.sleep(min(self.tick, max(0.005, first - now)) if first > now else self.tick)

    def _cut(self, sock: socket.socket, now: float) -> None:
        with self._lock:
            at = self.due.pop(sock, None)
            if at is None:                        # its owner disarmed it meanwhile
                return
            if at > now:                          # re-armed meanwhile for a later deadline
                self.due[sock] = at
                return
            self.cuts += 1
            self._shut(sock, True)

    def _after_fork(self) -> None:
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._thread = None
        self.due, self.fired, self.owners, self.sleeping = {}, {}, {}, True


WATCHDOG = Watchdog()
os.register_at_fork(after_in_child=WATCHDOG._after_fork)
