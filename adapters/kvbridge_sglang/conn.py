"""SGLang transfer backend on kvbridge: ``KVBridgeKVManager``, ``KVBridgeKVSender``,
``KVBridgeKVReceiver``, ``KVBridgeKVBootstrapServer`` (``sglang.srt.disaggregation.base``).

**Push mode**, SGLang's own model: the decode side pre-allocates pages for a request and
offers them (``send_metadata`` -> ``KVReceiver.reserve``: a signed, leased reservation); the
prefill side writes its pages into them (``send`` of the last chunk -> ``KVSender.push``),
and the decode side learns completion from its reservation's :class:`Transfer`. Push fits
because SGLang's decode scheduler already allocates before the transfer and polls
``KVPoll`` per request; the reservation's lease makes exactly one writer win and lets the
decode side revoke a write on abort before its pages are reused.

The reservation and the request's aux data (first output token, logprobs: SGLang's
metadata buffers, a few KB) travel through the bootstrap server (:mod:`.mailbox`); KV bytes
move over kvbridge's transports (``tcp://`` by default; ``inproc://`` when both sides share a
process). ``KVPoll`` comes from the transfers: Bootstrapping until the reservation arrived
(prefill) / until ``init`` (decode), WaitingForInput until the last chunk is sent (prefill) /
until ``send_metadata`` (decode), Transferring while the push runs, then Success or Failed,
with the reason in ``failure_exception()``.

Settings are read once, when the manager is built: ``KVBRIDGE_SGLANG_LISTEN`` (the
transport URL this rank listens on, default ``tcp://<host>:0`` with SGLang's ``host``),
``KVBRIDGE_SGLANG_LEASES`` (a ``redis://`` URL; default: this process's embedded lease
server), ``KVBRIDGE_SGLANG_TIMEOUT`` (seconds a transfer may go without progress, default 30),
``KVBRIDGE_SGLANG_RESERVATION_TTL`` (seconds a decode rank's reservation waits for its push,
default 60: more than the prefill side's queue wait plus its prefill), and SGLang's own
``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` (seconds a prefill request may wait for its
reservation, default 300 as in SGLang's mooncake backend).

One rank per side: tensor parallelism (``--tp-size`` > 1) is refused when the manager is built;
every rank of a TP group would share one bootstrap room here. A failure on either side is posted
to the room (best effort), so the other side fails too instead of waiting for its timeout.
"""

from __future__ import annotations

import base64
import ctypes
import logging
import os
import threading
import time
from typing import Any, Optional

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import (BaseKVBootstrapServer, BaseKVManager, BaseKVReceiver,
                                                  BaseKVSender, KVArgs, KVPoll, KVTransferMetric)
from sglang.srt.disaggregation.utils import DisaggregationMode

from kvbridge import KVLayout, KVPool, KVReceiver, KVSender, Timeout, Transfer
from kvbridge.errors import ConfigError, KVBridgeError

from .mailbox import Mailbox, MailboxClient

__all__ = ["KVBridgeKVManager", "KVBridgeKVSender", "KVBridgeKVReceiver", "KVBridgeKVBootstrapServer",
           "KVBridgeTransferError"]

log = logging.getLogger("kvbridge_sglang")
POLL_EVERY = 0.01     # seconds between mailbox lookups of one request


class KVBridgeTransferError(RuntimeError):
    """A transfer of one bootstrap room failed; the message says why."""

    def __init__(self, bootstrap_room: int, reason: str) -> None:
        super().__init__(f"kvbridge transfer of room {bootstrap_room} failed: {reason}")
        self.bootstrap_room = bootstrap_room
        self.reason = reason


def _host_tensor(ptr: int, nbytes: int) -> torch.Tensor:
    """The ``nbytes`` of host memory at ``ptr`` as a uint8 tensor (no copy). SGLang hands its
    buffers to transfer backends as raw pointers."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


def pool_from_kv_args(args: KVArgs, is_mla: bool) -> KVPool:
    """Wrap SGLang's KV buffers (K of every layer, then V; one latent buffer per layer for MLA)
    as an engine-allocated pool whose blocks are SGLang's pages. Moved as bytes: the layout's
    dtype is uint8 and its head_dim the bytes per head."""
    ptrs, lens, items = list(args.kv_data_ptrs), list(args.kv_data_lens), list(args.kv_item_lens)
    if not ptrs or len(set(items)) != 1 or len(set(lens)) != 1:
        raise ValueError("kvbridge's SGLang backend needs KV buffers of one size and page size "
                         f"(got item lengths {sorted(set(items))})")
    page, item = int(args.page_size), items[0]
    num_pages = lens[0] // item
    if is_mla:
        layers = len(ptrs)
        layout = KVLayout.mla(layers, latent_dim=item // page, block_size=page, dtype="uint8")
        bufs: list[Any] = [_host_tensor(p, num_pages * item).view(num_pages, page, item // page) for p in ptrs]
    else:
        if len(ptrs) % 2:
            raise ValueError(f"expected K and V buffers per layer, got {len(ptrs)} buffers")
        layers, heads = len(ptrs) // 2, int(args.kv_head_num)
        if item % (page * heads):
            raise ValueError(f"page of {item} bytes does not split into {page} tokens x {heads} heads")
        hb = item // (page * heads)
        layout = KVLayout.split_kv(layers, heads, hb, block_size=page, dtype="uint8")
        view = [_host_tensor(p, num_pages * item).view(num_pages, page, heads, hb) for p in ptrs]
        bufs = [(view[i], view[layers + i]) for i in range(layers)]
    return KVPool.wrap(layout, bufs, allocator="engine")


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        v = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds") from None
    if v <= 0:
        raise ConfigError(f"{name} must be positive, got {raw!r}")
    return v


def _tell(box: MailboxClient, room: int, reason: str) -> None:
    """Post a failure to the room for the other side (best effort: it times out otherwise)."""
    try:
        box.put("fail", room, {"reason": reason})
    except ConnectionError as exc:
        log.info("kvbridge: cannot tell the other side of room %s that it failed: %s", room, exc)


class KVBridgeKVManager(BaseKVManager):
    """One per scheduler rank and role: the pool over SGLang's KV buffers, and a kvbridge
    sender (prefill) or listening receiver (decode)."""

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: Optional[bool] = False) -> None:
        self.kv_args = args
        self.mode = disaggregation_mode
        self.server_args = server_args
        tp = int(getattr(server_args, "tp_size", 1) or 1)
        rank = int(getattr(args, "engine_rank", 0) or 0)
        if tp != 1 or rank != 0:
            raise ConfigError(f"kvbridge's SGLang backend supports one rank per side (--tp-size 1); got "
                              f"tp_size={tp}, engine_rank={rank}. Use --disaggregation-transfer-backend mooncake "
                              "or nixl for tensor parallelism")
        host = getattr(server_args, "host", None) or "127.0.0.1"
        listen = os.environ.get("KVBRIDGE_SGLANG_LISTEN") or f"tcp://{host}:0"
        leases = os.environ.get("KVBRIDGE_SGLANG_LEASES") or None
        self.timeout = Timeout(transfer=_seconds("KVBRIDGE_SGLANG_TIMEOUT", 30.0))
        self.reservation_ttl = _seconds("KVBRIDGE_SGLANG_RESERVATION_TTL", 60.0)
        self.bootstrap_timeout = _seconds("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0)
        self.kv_dtype = str(getattr(args, "kv_cache_dtype_str", ""))
        self.pool = pool_from_kv_args(args, bool(is_mla_backend))
        self.aux = list(zip(args.aux_data_ptrs, args.aux_item_lens))
        self.sender: Optional[KVSender] = None
        self.receiver: Optional[KVReceiver] = None
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.sender = KVSender(self.pool, listen, leases=leases, timeout=self.timeout)
        elif disaggregation_mode == DisaggregationMode.DECODE:
            self.receiver = KVReceiver(self.pool, listen=listen, leases=leases, timeout=self.timeout,
                                       reservation_ttl=self.reservation_ttl)
        else:
            raise ValueError(f"unsupported disaggregation mode {disaggregation_mode}")

    def register_to_bootstrap(self) -> None:
        """Nothing to register: each request's reservation names this rank's URL itself."""
        return None

    # aux data: SGLang's per-request metadata buffers (slot ``aux_index`` of each)
    def read_aux(self, aux_index: int) -> list[str]:
        out = []
        for ptr, n in self.aux:
            out.append(base64.b64encode(ctypes.string_at(ptr + aux_index * n, n)).decode())
        return out

    def write_aux(self, aux_index: int, data: list[str]) -> None:
        if len(data) != len(self.aux):
            raise ValueError(f"aux data has {len(data)} buffers, this rank {len(self.aux)}")
        for (ptr, n), b in zip(self.aux, data):
            raw = base64.b64decode(b)
            if len(raw) != n:
                raise ValueError(f"aux item of {len(raw)} bytes, this rank's is {n}")
            ctypes.memmove(ptr + aux_index * n, raw, n)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()


class KVBridgeKVSender(BaseKVSender):
    """Prefill side of one request: waits for the decode side's reservation, pushes its pages
    into it when the last chunk is sent."""

    def __init__(self, mgr: KVBridgeKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        self.mgr = mgr
        self.room = int(bootstrap_room)
        self.box = MailboxClient(bootstrap_addr)
        self.num_pages = 0
        self.aux_index: Optional[int] = None
        self.pages: list[int] = []
        self.reservation: Optional[dict[str, Any]] = None
        self.transfer: Optional[Transfer] = None
        self.failed: Optional[str] = None
        self._next_look = 0.0
        self._since = time.monotonic()       # bootstrapping since (SGLang's timeout counts from here)
        self.metric = KVTransferMetric()

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        self.num_pages = int(num_kv_indices)
        self.aux_index = aux_index

    def _fail(self, reason: str, tell: bool = True) -> KVPoll:
        """Fail the request; ``tell``: post it to the room so the decode side fails too."""
        if self.failed is None:
            self.failed = reason
            log.warning("kvbridge: room %s failed: %s", self.room, reason)
            if tell:
                _tell(self.box, self.room, reason)
        return KVPoll.Failed  # type: ignore[return-value]

    def _look(self) -> None:
        """Fetch the reservation (or a failure) from the mailbox, at most every POLL_EVERY s."""
        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + POLL_EVERY
        try:
            fail = self.box.get("fail", self.room)
            if fail is not None:
                self._fail(f"decode side: {fail.get('reason')}", tell=False)
                return
            if self.reservation is None:
                msg = self.box.get("reservation", self.room)
                if msg is not None:
                    if msg.get("kv_dtype") != self.mgr.kv_dtype:
                        self._fail(f"KV dtype differs: decode {msg.get('kv_dtype')!r}, prefill {self.mgr.kv_dtype!r}")
                        return
                    self.reservation = msg
        except ConnectionError as exc:
            self._fail(str(exc), tell=False)

    def send(self, kv_indices: Any, state_indices: Optional[list[Any]] = None,
             num_kv_tokens: Optional[int] = None) -> None:
        """Collect the chunk's pages; once every page of the request is in (and the decode side's
        reservation is known) start the push. Never blocks the scheduler: a reservation that
        has not arrived yet makes ``poll()`` start the push when it does."""
        if state_indices:
            self._fail("extra state (mamba/SWA/DSA) is not supported by the kvbridge backend")
            return
        self.pages.extend(int(i) for i in np.asarray(kv_indices).reshape(-1))
        self._maybe_start()

    def _maybe_start(self) -> None:
        if (self.transfer is not None or self.failed is not None or self.num_pages <= 0
                or len(self.pages) < self.num_pages):
            return
        if self.reservation is None:
            self._look()
            if self.reservation is None:
                return
        assert self.mgr.sender is not None
        if len(self.pages) != self.num_pages:
            self._fail(f"sent {len(self.pages)} pages for a request of {self.num_pages}")
            return
        try:
            if self.aux_index is not None and self.reservation.get("aux_index") is not None:
                self.box.put("aux", self.room, {"aux": self.mgr.read_aux(self.aux_index)})
            self.transfer = self.mgr.sender.push(self.reservation["ticket"], self.pages)
        except (KVBridgeError, ConnectionError, ValueError) as exc:
            self._fail(f"{type(exc).__name__}: {exc}")

    def poll(self) -> KVPoll:
        if self.failed is not None:
            return KVPoll.Failed  # type: ignore[return-value]
        if self.transfer is not None:
            if not self.transfer.done():
                return KVPoll.Transferring  # type: ignore[return-value]
            res = self.transfer.result(0)
            if not res.ok:
                return self._fail(f"{type(res.error).__name__}: {res.error}")
            self.metric = KVTransferMetric(transfer_latency_s=res.seconds, transfer_total_bytes=res.nbytes)
            return KVPoll.Success  # type: ignore[return-value]
        self._look()
        self._maybe_start()                # the last chunk came before the reservation
        if self.failed is not None:
            return KVPoll.Failed  # type: ignore[return-value]
        if self.transfer is not None:
            return KVPoll.Transferring  # type: ignore[return-value]
        if self.reservation is None:
            if time.monotonic() - self._since > self.mgr.bootstrap_timeout:
                return self._fail(f"no reservation from the decode side within {self.mgr.bootstrap_timeout:g} s "
                                  "(SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)")
            return KVPoll.Bootstrapping  # type: ignore[return-value]
        return KVPoll.WaitingForInput  # type: ignore[return-value]

    def get_transfer_metric(self) -> KVTransferMetric:
        return self.metric

    def failure_exception(self) -> None:
        raise KVBridgeTransferError(self.room, self.failed or "unknown")

    def abort(self) -> None:
        if self.transfer is not None:
            self.transfer.cancel(timeout=self.mgr.timeout.transfer)
        self._fail("aborted on the prefill side")     # posted to the room: the decode side fails too


class KVBridgeKVReceiver(BaseKVReceiver):
    """Decode side of one request: reserves its pre-allocated pages, learns completion from the
    reservation's transfer, then copies the aux data into its metadata slot."""

    def __init__(self, mgr: KVBridgeKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None) -> None:
        self.mgr = mgr
        self.room = int(bootstrap_room or 0)
        self.box = MailboxClient(bootstrap_addr)
        self.bootstrapped = False
        self.transfer: Optional[Transfer] = None
        self.aux_index: Optional[int] = None
        self.aux_done = False
        self.failed: Optional[str] = None
        self.done = False
        self._next_look = 0.0
        self._lock = threading.Lock()

    def init(self, prefill_dp_rank: int = 0) -> None:
        self.bootstrapped = True

    def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None,
                      state_indices: Optional[list[Any]] = None, decode_prefix_len: Optional[int] = None,
                      destination: Any = None) -> None:
        assert self.mgr.receiver is not None
        if state_indices:
            self._fail("extra state (mamba/SWA/DSA) is not supported by the kvbridge backend")
            return
        if decode_prefix_len:
            self._fail("decode-side prefix reuse is not supported by the kvbridge backend")
            return
        pages = [int(i) for i in np.asarray(kv_indices).reshape(-1)]
        self.aux_index = aux_index
        try:
            self.transfer = self.mgr.receiver.reserve(pages, str(self.room))
            assert self.transfer.reservation is not None
            self.box.put("reservation", self.room, {"ticket": self.transfer.reservation.to_dict(),
                                                    "aux_index": aux_index, "kv_dtype": self.mgr.kv_dtype})
        except (KVBridgeError, ConnectionError) as exc:
            self._fail(f"{type(exc).__name__}: {exc}")

    def _fail(self, reason: str, tell: bool = True) -> KVPoll:
        """Fail the request; ``tell``: post it to the room so the prefill side fails too."""
        if self.failed is None:
            self.failed = reason
            log.warning("kvbridge: room %s failed: %s", self.room, reason)
            if tell:
                _tell(self.box, self.room, reason)
        return KVPoll.Failed  # type: ignore[return-value]

    def poll(self) -> KVPoll:
        if self.failed is not None:
            return KVPoll.Failed  # type: ignore[return-value]
        if self.done:
            return KVPoll.Success  # type: ignore[return-value]
        if not self.bootstrapped:
            return KVPoll.Bootstrapping  # type: ignore[return-value]
        if self.transfer is None:
            return KVPoll.WaitingForInput  # type: ignore[return-value]
        if self.transfer.done():
            res = self.transfer.result(0)
            if not res.ok:
                return self._fail(f"{type(res.error).__name__}: {res.error}")
        now = time.monotonic()
        if now >= self._next_look:
            self._next_look = now + POLL_EVERY
            try:
                fail = self.box.get("fail", self.room)
                if fail is not None:
                    self.transfer.cancel(timeout=self.mgr.timeout.transfer)
                    return self._fail(f"prefill side: {fail.get('reason')}", tell=False)
                if not self.aux_done and self.aux_index is not None and self.transfer.done():
                    aux = self.box.get("aux", self.room)
                    if aux is not None:
                        self.mgr.write_aux(self.aux_index, aux["aux"])
                        self.aux_done = True
            except ConnectionError as exc:
                return self._fail(str(exc), tell=False)
            except ValueError as exc:
                return self._fail(str(exc))
        if self.transfer.done() and (self.aux_done or self.aux_index is None):
            self.done = True
            self.box.drop(self.room)
            return KVPoll.Success  # type: ignore[return-value]
        return KVPoll.Transferring  # type: ignore[return-value]

    def failure_exception(self) -> None:
        raise KVBridgeTransferError(self.room, self.failed or "unknown")

    def abort(self) -> None:
        """Revoke the reservation first (no write lands after this returns), then tell the prefill."""
        if self.transfer is not None:
            self.transfer.cancel(timeout=self.mgr.timeout.transfer)
        self._fail("aborted on the decode side")      # posted to the room: the prefill side fails too

    def clear(self) -> None:
        if self.transfer is not None and not self.transfer.done():
            self.transfer.cancel(timeout=self.mgr.timeout.transfer)


class KVBridgeKVBootstrapServer(BaseKVBootstrapServer):
    """SGLang starts one on the prefill host at ``--disaggregation-bootstrap-port``."""

    def __init__(self, host: str, port: int) -> None:
        self.mailbox = Mailbox(host or "0.0.0.0", int(port))

    @property
    def address(self) -> str:
        return self.mailbox.address

    def close(self) -> None:
        self.mailbox.close()
