"""Transfer: one transfer in flight, as an engine's scheduler holds it.

``KVReceiver.start_fetch``, ``KVReceiver.reserve`` and ``KVSender.push`` return one.
It is usable from any thread, with no event loop: ``done()`` polls, ``wait(timeout)``
blocks, ``result()`` gives the :class:`FetchResult`, ``wait_layer(i)`` returns once
layer ``i`` has landed and verified (layer-wise transfers make layers available one
by one; a whole-handle transfer makes them all available at once), ``cancel()``
returns once no byte of the transfer will land any more. ``await transfer`` works too.

A started transfer runs on its owner's worker threads; a thread that waits for a
transfer no worker has picked up yet runs it itself, so ``start_fetch(...).result()``
costs what ``fetch(...)`` costs.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Optional

from .errors import Action, KVBridgeError, TransferCancelled, TransferTimeout
from .handle import KVHandle
from .transports.deadline import WATCHDOG, serving

__all__ = ["Transfer", "TransferState", "FetchResult", "Workers", "Paced"]

log = logging.getLogger("kvbridge.transfer")


@dataclass(slots=True)
class FetchResult:
    """Outcome of one transfer. ``failed_block_ids`` are destination ids that hold no valid KV.

    For a push, ``handle`` is the reservation and ``dst_block_ids`` its blocks."""

    handle: KVHandle
    dst_block_ids: list[int]
    ok: bool = False
    nbytes: int = 0
    seconds: float = 0.0
    attempts: int = 0
    failed_block_ids: list[int] = field(default_factory=list)
    error: Optional[KVBridgeError] = None

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    @property
    def codec(self) -> str:
        """The codec the bytes crossed in (named by the signed handle)."""
        return self.handle.codec

    @property
    def action(self) -> Optional[Action]:
        return None if self.ok or self.error is None else self.error.action

    def raise_for_error(self) -> "FetchResult":
        if self.error is not None:
            raise self.error
        return self


class Flag:
    """A cancel flag: ``set()`` once, ``is_set()`` from any thread (cheaper than an Event;
    nothing waits on it, transfers check it between chunks)."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True
        WATCHDOG.cancel(self)      # its exchanges in flight cut now (a receive blocked in C returns)

    def is_set(self) -> bool:
        return self._set


class Paced(Flag):
    """What a receiving transport asks between receives (``is_set``): set, or the transfer's
    cancel ``flag`` set, and a guard against a peer that trickles its reply. From the first
    ask (bytes have begun to land) they must all land within ``limit`` seconds plus their time
    at ``min_rate``; past that ``is_set`` raises :class:`TransferTimeout` (the socket's timeout
    bounds each receive alone, which a byte now and then never trips)."""

    __slots__ = ("flag", "_budget", "_until")

    def __init__(self, flag: Optional[Flag], nbytes: int, limit: float, min_rate: float) -> None:
        super().__init__()
        self.flag = flag
        self._budget = limit + nbytes / min_rate
        self._until: Optional[float] = None

    def restart(self) -> None:
        """A new attempt: its clock starts at its first ask."""
        self._until = None

    def is_set(self) -> bool:
        now = time.monotonic()
        if self._until is None:
            self._until = now + self._budget
        elif now > self._until:
            raise TransferTimeout(f"the peer's reply did not land within {self._budget:.1f} s: it trickles")
        return self._set or (self.flag is not None and self.flag.is_set())


class TransferState(str, enum.Enum):
    PENDING = "pending"      # started, not yet picked up by a worker
    RUNNING = "running"
    DONE = "done"            # result().ok
    FAILED = "failed"
    CANCELLED = "cancelled"


class Transfer:
    """One transfer in flight (see the module doc). Built by kvbridge, never by callers."""

    def __init__(self, request_id: str, num_layers: int, job: Optional[Callable[["Transfer"], FetchResult]],
                 on_cancel: Optional[Callable[["Transfer"], None]] = None) -> None:
        self.request_id = request_id
        self.num_layers = num_layers
        self.handle: Optional[KVHandle] = None          # push: the local handle mark_ready() names
        self.reservation: Optional[KVHandle] = None     # reserve: the ticket for the writer
        self.dst_block_ids: Optional[list[int]] = None  # fetch: where its bytes land (else the handle's)
        self._job = job
        self._on_cancel = on_cancel
        self._cv = threading.Condition(threading.Lock())
        self._state = TransferState.PENDING if job is not None else TransferState.RUNNING
        self._taken = job is None
        self._result: Optional[FetchResult] = None
        self._layers = 0
        self._callbacks: list[Callable[["Transfer"], None]] = []
        # run once as it ends, before done() turns True (None once run): see _at_end
        self._ends: Optional[list[Callable[[], None]]] = []
        self.cancel_event = Flag()
        # the job's last word, run by the same thread once the result is out (a failed push
        # telling its receiver, which may be silent for Timeout.transfer)
        self._then: Optional[Callable[[], None]] = None
        # a push: its job ends its handle and tells the receiver, so it runs even when cancelled
        # before a worker took it (then at once, with the cancel set)
        self.ends_itself = False

    # -- the running side ----------------------------------------------------------------
    def _take(self) -> bool:
        with self._cv:
            if self._taken:
                return False
            self._taken = True
            self._state = TransferState.RUNNING
            return True

    def _run(self, inline: bool = False) -> None:
        """Run the job unless another thread has taken it (the worker, or a waiter). ``inline``:
        this is the caller's own thread (a waiter, or a push after close), so the work after the
        end (``_then``) goes to a thread of its own instead of holding the caller."""
        if not self._take():
            return
        assert self._job is not None
        try:
            with serving(self.cancel_event):
                res = self._job(self)
        except BaseException:   # a job reports failures in its result; this is a bug
            log.exception("transfer %s crashed", self.request_id)
            self._fail_crashed()
            raise
        self._finish(res)
        then, self._then = self._then, None
        if then is None:
            return
        if inline:               # the caller's thread: wait() or push() returns without waiting for it
            threading.Thread(target=self._after, args=(then,), name="kvb-after", daemon=True).start()
        else:                    # after the result is out: a cancel() or wait() does not wait for it
            self._after(then)

    def _after(self, then: Callable[[], None]) -> None:
        with serving(None):
            try:
                then()
            except Exception:
                log.exception("transfer %s: the work after its end failed", self.request_id)

    def _fail_crashed(self) -> None:
        self._ending()
        with self._cv:
            self._state = TransferState.FAILED
            self._cv.notify_all()
        self._fire()

    def _layer_ready(self, end: int) -> None:
        """Layers below ``end`` have landed and verified."""
        with self._cv:
            if end > self._layers:
                self._layers = end
                self._cv.notify_all()

    def _finish(self, res: FetchResult) -> None:
        with self._cv:
            if self._result is not None:
                return
            self._result = res
        self._ending()
        with self._cv:
            if res.ok:
                self._state = TransferState.DONE
                self._layers = self.num_layers
            elif isinstance(res.error, TransferCancelled):
                self._state = TransferState.CANCELLED
            else:
                self._state = TransferState.FAILED
            self._cv.notify_all()
        self._fire()

    def _at_end(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once as the transfer ends -- no byte of it lands any more -- before
        ``done()`` turns True, so nothing that sees it ended (``wait``, ``result``, ``cancel``,
        a done-callback) runs before ``fn``; at once if it is ending or has ended."""
        with self._cv:
            if self._ends is not None:
                self._ends.append(fn)
                return
        fn()

    def _ending(self) -> None:
        with self._cv:
            fns, self._ends = self._ends, None
        for fn in fns or ():
            try:
                fn()
            except Exception:
                log.exception("transfer end hook failed")

    def _fire(self) -> None:
        with self._cv:
            cbs, self._callbacks = self._callbacks, []
        for cb in cbs:
            try:
                cb(self)
            except Exception:
                log.exception("transfer done-callback failed")

    # -- the caller's side ---------------------------------------------------------------
    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def layers_done(self) -> int:
        """How many leading layers have landed and verified."""
        return self._layers

    def done(self) -> bool:
        return self._state in (TransferState.DONE, TransferState.FAILED, TransferState.CANCELLED)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the transfer ends (True) or ``timeout`` passes (False). Without a timeout,
        a transfer no worker has picked up yet runs on this thread; with one, it is left to a
        worker (running it here could block past ``timeout``: a layer-wise handle waits for its
        layers)."""
        if timeout is None and not self._taken:
            self._run(inline=True)         # nobody has picked it up: run it here
        with self._cv:
            return self._cv.wait_for(self.done, timeout)

    def result(self, timeout: Optional[float] = None) -> FetchResult:
        """The outcome; blocks until the transfer ends. Raises ``TimeoutError`` if
        ``timeout`` passes first (the transfer goes on)."""
        if not self.wait(timeout):
            raise TimeoutError(f"transfer of {self.request_id!r} still running after {timeout} s")
        if self._result is None:
            raise RuntimeError(f"transfer of {self.request_id!r} crashed; see the log")
        return self._result

    def wait_layer(self, layer: int, timeout: Optional[float] = None) -> bool:
        """Block until layer ``layer`` has landed and verified (True); False if the transfer
        ended without it (``result()`` says why) or ``timeout`` passed."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside 0..{self.num_layers - 1}")
        # Never run the transfer here: this thread wants layer i as soon as it lands, not after
        # the last one. A worker picks it up (``workers=`` bounds how many run at once).
        with self._cv:
            self._cv.wait_for(lambda: self._layers > layer or self.done(), timeout)
            return self._layers > layer and self._state is not TransferState.FAILED \
                and self._state is not TransferState.CANCELLED

    def cancel(self, timeout: Optional[float] = None) -> bool:
        """Stop the transfer. Returns True once it ended cancelled -- no byte of it will land
        in the destination any more -- and False if it had already ended (its result stands)
        or is still winding down after ``timeout``."""
        if self.done():
            return False
        self._stop()
        with self._cv:
            self._cv.wait_for(self.done, timeout)
        return self._state is TransferState.CANCELLED

    def _stop(self) -> None:
        """Ask the transfer to stop, without waiting: one never started ends here, cancelled
        (one that ``ends_itself`` runs its job now, on a thread of its own: the caller may be an
        event loop, and the job's cleanup may wait on a peer)."""
        self.cancel_event.set()
        if self.ends_itself:
            if not self._taken:            # a worker that takes it meanwhile runs it; _run runs it once
                threading.Thread(target=self._run, kwargs={"inline": True}, name="kvb-cancelled",
                                 daemon=True).start()
            return
        if self._take():                   # never started: end it here
            if self._on_cancel is not None:
                self._on_cancel(self)
            self._finish(self._cancelled_result())
        elif self._on_cancel is not None:
            self._on_cancel(self)

    def _cancelled_result(self) -> FetchResult:
        h = self.reservation or self.handle
        assert h is not None
        ids = list(h.block_ids) if self.dst_block_ids is None else list(self.dst_block_ids)
        return FetchResult(h, ids, error=TransferCancelled(f"transfer of {self.request_id!r} cancelled"),
                           failed_block_ids=list(ids))

    def add_done_callback(self, fn: Callable[["Transfer"], None]) -> None:
        """Call ``fn(transfer)`` when it ends (at once if it has), on the thread that ends it."""
        with self._cv:
            if not self.done():
                self._callbacks.append(fn)
                return
        fn(self)

    def __await__(self) -> Generator[Any, None, FetchResult]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def settle() -> None:
            if not fut.done():
                fut.set_result(None)

        def wake(_: "Transfer") -> None:
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:           # the awaiting loop has closed: nobody is left to wake
                pass
        self.add_done_callback(wake)
        try:
            yield from fut.__await__()
        except asyncio.CancelledError:
            # the awaiting task went away: stop moving bytes, and end only once none will land
            # (its caller may hand the destination blocks on as soon as the task has ended) --
            # also when the task is cancelled again meanwhile
            if self._on_cancel is None:
                self._stop()
            else:                          # a reservation's revokes and waits: off the loop
                try:
                    yield from loop.run_in_executor(None, self._stop).__await__()
                except asyncio.CancelledError:
                    pass
            while not self.done():
                fut = loop.create_future()
                self.add_done_callback(wake)
                try:
                    yield from fut.__await__()
                except asyncio.CancelledError:
                    continue
            raise
        return self.result()

    def __repr__(self) -> str:
        return (f"Transfer({self.request_id!r}, {self._state.value}, "
                f"layers {self._layers}/{self.num_layers})")


class Workers:
    """The threads transfers run on: started on demand, up to ``max_workers``; one that has
    been idle for ``idle`` seconds goes away. Submitting is an append and a notify."""

    def __init__(self, name: str, max_workers: int = 32, idle: float = 10.0) -> None:
        self._name = name
        self._max = max_workers
        self._idle = idle
        self._queue: deque[Transfer] = deque()
        self._running: set[Transfer] = set()
        self._cv = threading.Condition(threading.Lock())
        self._threads = 0
        self._waiting = 0
        self._closed = False

    def submit(self, t: Transfer) -> Transfer:
        with self._cv:
            if self._closed:
                raise RuntimeError("workers are closed")
            self._queue.append(t)
            if self._waiting:
                self._cv.notify()
                start = False
            else:
                start = self._threads < self._max
                self._threads += start
        if start:
            try:
                threading.Thread(target=self._loop, name=self._name, daemon=True).start()
            except Exception:
                # no thread ("can't start new thread"): its slot is free again, and where no worker
                # is left to run ``t`` it leaves the queue -- the caller sees this raise and must not
                # find it run later; otherwise a running worker takes it in turn
                with self._cv:
                    self._threads -= 1
                    orphan = self._threads == 0
                    if orphan:
                        try:
                            self._queue.remove(t)
                        except ValueError:
                            pass
                if orphan:
                    raise
        return t

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._waiting += 1
                self._cv.wait_for(lambda: self._queue or self._closed, self._idle)
                self._waiting -= 1
                if not self._queue:             # idle for a while, or closed: the thread goes away
                    self._threads -= 1
                    return
                t = self._queue.popleft()
                self._running.add(t)
            try:
                t._run()
            except Exception:   # logged, and the transfer failed, by _run: this thread serves the next one
                pass
            except BaseException:
                with self._cv:
                    self._threads -= 1
                    self._running.discard(t)
                raise
            with self._cv:
                self._running.discard(t)

    def close(self) -> None:
        """Stop: transfers not started yet end cancelled (nobody would run them: their waiters
        would wait for good), running ones are asked to stop."""
        with self._cv:
            self._closed = True
            left = list(self._queue) + list(self._running)
            self._queue.clear()
            self._cv.notify_all()
        for t in left:
            t._stop()
