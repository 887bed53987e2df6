"""Push mode, the writing side: a sender writes a handle's blocks into blocks that a decode
side reserved (:meth:`KVSender.push`), layer batch by layer batch as they become ready."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Optional

from .errors import KVBridgeError, ProtocolError, StaleHandle, TransferCancelled, TransferTimeout
from .handle import KVHandle
from .integrity import pack_sums
from .lease import Claim, LeaseStore
from .transfer import FetchResult, Transfer
from .transports.base import Spans

if TYPE_CHECKING:
    from .sender import KVSender

__all__ = ["run_push"]

log = logging.getLogger("kvbridge.sender")


def run_push(snd: "KVSender", t: Transfer, h: KVHandle, res: KVHandle) -> FetchResult:
    """One push: claim the reservation's lease as its own writer, write each batch of ready
    layers as it becomes ready, release (or abort) the claim, end the handle."""
    t0 = time.perf_counter()
    out = FetchResult(res, list(res.block_ids))
    rec = snd._records.get(h.handle_id)
    store: Optional[LeaseStore] = None
    claim: Optional[Claim] = None
    own = False    # the transport is one of the push's own (close() took the sender's): closed here
    url = res.urls[0]
    L = snd.pool.layout.num_layers
    try:
        # inside: a reservation naming a lease server no store can use (BadHandle) ends the push
        # and its handle like any other failure, never leaves its blocks pinned until their TTL
        store = snd._push_stores.for_ticket(res)
        if rec is None:
            if t.cancel_event.is_set():    # cancelled before it started (sender.close(), cancel())
                raise TransferCancelled(f"push of {res.request_id!r} cancelled")
            raise StaleHandle(f"push of {res.request_id!r}: its blocks were freed before it started")
        if store is not None:
            # Each push is its own claimer: a second push of the same reservation, even from
            # this sender, is a second writer and loses the claim.
            who = f"{snd.owner}/push-{h.id[:12]}"
            lease = snd.retry.call(lambda: store.claim(res.lease_id, who, snd.claim_ttl))
            claim = Claim(who, lease.fence.epoch, lease.fence.counter)
        transport, own = snd._transport_after_close(url)
        done = 0
        idle_until = time.monotonic() + snd.timeout.transfer
        while done < L:
            if t.cancel_event.is_set():
                raise TransferCancelled(f"push of {res.request_id!r} cancelled")
            hi = snd._wait_layers(rec, done, L)
            if not rec.live:
                raise StaleHandle(f"push of {res.request_id!r}: its handle was {rec.reason}")
            if hi == done:
                if time.monotonic() > idle_until:
                    raise TransferTimeout(f"push of {res.request_id!r}: layer {done} not ready "
                                          f"within {snd.timeout.transfer} s")
                continue
            src = Spans.of_blocks(snd.pool, rec.block_ids, range(done, hi))
            sums = pack_sums([x for layer in rec.sums[done:hi] for x in layer]) if snd.checksums else b""
            lo, c = done, claim

            def attempt() -> int:
                if t.cancel_event.is_set():    # no retry after a cancel
                    raise TransferCancelled(f"push of {res.request_id!r} cancelled")
                out.attempts += 1
                return transport.write(url, res, src, (lo, hi), c, sums, hi == L)
            out.nbytes += snd.retry.call(attempt)
            done = hi
            t._layer_ready(done)
            idle_until = time.monotonic() + snd.timeout.transfer
        if store is not None and claim is not None:
            c = claim
            snd.retry.call(lambda: store.release(res.lease_id, c.claimer, c.fence))
        out.ok = True
    except Exception as exc:    # whatever ends a push, its handle ends and the receiver hears of it
        if not isinstance(exc, KVBridgeError):
            log.exception("push of %r failed", res.request_id)
        out.error = exc if isinstance(exc, KVBridgeError) else ProtocolError(f"push failed: {exc!r}")
        out.failed_block_ids = list(res.block_ids)
        if store is None or claim is not None:   # a writer that never won the claim ends nothing
            # telling the receiver is not part of the (perhaps cancelled) push: it runs once the
            # push has ended, so a silent receiver cannot hold cancel() for its timeout
            t._then = lambda: _abort_push(snd, res, store, claim, url)
    finally:
        if own:
            transport.close()
    out.seconds = time.perf_counter() - t0
    if rec is not None:
        snd._end(rec, "pushed" if out.ok else "aborted")
    if out.ok:
        snd.stats.add(bytes_pushed=out.nbytes)
    return out

def _abort_push(snd: "KVSender", res: KVHandle, store: Optional[LeaseStore], claim: Optional[Claim], url: str) -> None:
    """Tell the receiver this writer gives up (best effort: its reservation expires anyway)."""
    tr, own = snd._transport_after_close(url)
    try:
        tr.abort_write(url, res, claim)
    except KVBridgeError as exc:
        log.info("abort of push %r: %s", res.request_id, exc)
    finally:
        if own:
            tr.close()
    if store is not None and claim is not None:
        try:
            store.abort(res.lease_id, claim.claimer, claim.fence)
        except KVBridgeError as exc:
            log.info("abort of reservation lease %s: %s", res.lease_id, exc)
