"""The worker-side half of the vLLM connector (runs where the KV cache tensors live).

Producer: wraps vLLM's cache as an engine-allocated pool behind a :class:`KVSender`;
publishes a request's blocks layer-wise (``layers_ready=0``) when the step that completes
its prompt begins, marks each layer ready from ``save_kv_layer``, and reports the request
as finished sending once kvbridge frees the blocks (``on_free``: released by the consumer,
expired, or revoked) -- only then may vLLM reuse them, and they are retired first.
Consumer: starts a :class:`Transfer` per request (``start_fetch``) without blocking the
forward, reports it from ``get_finished`` when done, and reports the blocks of a failed
transfer through ``get_block_ids_with_load_errors`` (vLLM then recomputes or fails the
request, per ``kv_load_failure_policy``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

import torch

from kvbridge import KVHandle, KVPool, KVReceiver, KVSender, Transfer
from kvbridge.errors import KVBridgeError

from .channel import HandleOutbox, channel_name
from .config import ConnectorConfig
from .layout import Geometry, pool_from_kv_caches
from .metadata import KVBridgeMetadata

__all__ = ["WorkerSide"]

log = logging.getLogger("kvbridge_vllm")


class WorkerSide:
    def __init__(self, vllm_config: Any, cfg: ConnectorConfig, claimer: str, producer: bool, consumer: bool,
                 engine_key: tuple[str, int], cpu_backend: bool) -> None:
        self.vllm_config = vllm_config
        self.cfg = cfg
        self.claimer = claimer
        self.producer = producer
        self.consumer = consumer
        self.cpu_backend = cpu_backend
        self.outbox = HandleOutbox(channel_name(*engine_key)) if producer else None
        self.pool: Optional[KVPool] = None
        self.sender: Optional[KVSender] = None
        self.receiver: Optional[KVReceiver] = None
        self.geometry: Geometry = {}
        self.layer_of: dict[str, int] = {}
        self._lock = threading.Lock()
        # producer
        self._handles: dict[str, KVHandle] = {}     # live handles by request id
        self._step_handles: list[KVHandle] = []     # published this step: their layers are being computed
        self._sent: set[str] = set()                # freed by kvbridge, to report as finished sending
        self._finished_seen: set[str] = set()       # vLLM said these requests finished
        self._ours: set[str] = set()                # published here, not yet reported finished sending
        # prefix caching gives several requests the same physical blocks: how many of this
        # connector's live handles (or publishes under way) name each block. A block is retired
        # only when the last of them ends; retiring it earlier would end the others' handles.
        self._block_users: dict[int, int] = {}
        self._counted: dict[bytes, list[int]] = {}  # handle id -> the blocks it counts in _block_users
        self._ended_early: set[bytes] = set()       # ended before publish() returned them (counted later)
        # consumer
        self._to_start: dict[str, tuple[dict[str, Any], list[int], list[int]]] = {}
        self._sync_ids: set[str] = set()              # loads this step's forward reads (layer-wise)
        self._transfers: dict[str, tuple[Transfer, list[int]]] = {}
        self._sync: dict[str, tuple[Transfer, list[int]]] = {}
        self._sync_failed: set[str] = set()
        self._recv_done: set[str] = set()
        self._load_errors: set[int] = set()
        self.stats: dict[str, Any] = {"published": 0, "loads": 0, "load_failures": 0, "bytes": 0, "seconds": []}

    # -- setup ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.pool, names, self.geometry = pool_from_kv_caches(kv_caches, self.vllm_config, self.cpu_backend)
        self.layer_of = {n: i for i, n in enumerate(names)}
        cfg = self.cfg
        if self.producer:
            self.sender = KVSender(self.pool, list(cfg.listen), secret=cfg.secret, ttl=cfg.ttl, timeout=cfg.timeout,
                                   on_free=self._on_free, leases=cfg.leases, lease_namespace=cfg.lease_namespace,
                                   claim_ttl=cfg.claim_ttl)
            log.info("kvbridge producer serving %s, layout %s", ", ".join(self.sender.urls), self.geometry)
        if self.consumer:
            self.receiver = KVReceiver(self.pool, secret=cfg.secret, timeout=cfg.timeout, leases=cfg.leases,
                                       claimer=self.claimer, claim_ttl=cfg.claim_ttl,
                                       lease_namespace=cfg.lease_namespace)

    # -- producer ------------------------------------------------------------------------
    def _on_free(self, handle: KVHandle, reason: str) -> None:
        """kvbridge unpinned the blocks (released, expired, revoked...): vLLM may reuse them.
        Retire first the blocks no other live handle of this connector names (prefix caching
        shares blocks between requests), so any copy of this handle is refused from now on."""
        with self._lock:
            ids = self._counted.pop(handle.handle_id, None)
            if ids is None:                  # publish() has not returned it yet: _publish retires
                self._ended_early.add(handle.handle_id)
                retire: list[int] = []
            else:
                retire = self._uncount(ids)
            if self._handles.get(handle.request_id) is handle:
                del self._handles[handle.request_id]
        if retire:
            assert self.pool is not None
            self.pool.retire(retire)
        with self._lock:
            self._sent.add(handle.request_id)
        if reason not in ("released",):
            log.info("kvbridge: blocks of %s freed (%s)", handle.request_id, reason)

    def _uncount(self, ids: list[int]) -> list[int]:
        """Drop one user of each block (under the lock); the blocks no live handle names now."""
        free = []
        for b in ids:
            n = self._block_users.get(b, 0) - 1
            if n > 0:
                self._block_users[b] = n
            else:
                self._block_users.pop(b, None)
                free.append(b)
        return free

    def _publish(self, rid: str, block_ids: list[int], num_tokens: int) -> None:
        assert self.sender is not None and self.outbox is not None
        ids = [int(b) for b in block_ids]
        with self._lock:
            self._ours.add(rid)
            for b in ids:           # counted before the pins: an ending handle sharing them keeps them
                self._block_users[b] = self._block_users.get(b, 0) + 1
        try:
            h = self.sender.publish(rid, ids, num_tokens, layers_ready=0)
        except KVBridgeError as exc:
            with self._lock:
                self._uncount(ids)   # nothing was published: nothing to retire
            log.error("kvbridge: cannot publish %s: %s", rid, exc)
            self.outbox.send(rid, error=str(exc))
            with self._lock:
                self._sent.add(rid)      # nothing holds its blocks: vLLM may free them
            return
        with self._lock:
            early = h.handle_id in self._ended_early
            if early:                    # it ended (e.g. the sender closed) before publish returned
                self._ended_early.discard(h.handle_id)
                retire = self._uncount(ids)
            else:
                self._counted[h.handle_id] = ids
                self._handles[rid] = h
        if early:
            if retire:
                assert self.pool is not None
                self.pool.retire(retire)
            self.outbox.send(rid, error="the handle ended as it was published")
            return
        self._step_handles.append(h)
        self.stats["published"] += 1
        self.outbox.send(rid, handle=h.to_dict(), geometry=self.geometry)

    def _revoke(self, rid: str) -> None:
        with self._lock:
            h = self._handles.get(rid)
        if h is None or not (self.sender is not None and self.sender.revoke(h, "aborted")):
            with self._lock:
                self._sent.add(rid)

    def save_kv_layer(self, layer_name: str) -> None:
        if not self._step_handles or self.sender is None:
            return
        i = self.layer_of.get(layer_name)
        if i is None:
            return
        for h in self._step_handles:
            self.sender.mark_ready(h, i + 1)

    def wait_for_save(self) -> None:
        if self.sender is not None and self._step_handles:
            L = self.geometry["layers"]
            for h in self._step_handles:      # layers whose hook did not run (e.g. fused paths)
                self.sender.mark_ready(h, L)
        self._step_handles = []
        if self._sync:
            self._finish_sync()

    # -- consumer ------------------------------------------------------------------------
    def bind(self, meta: KVBridgeMetadata) -> None:
        for rid, (ids, n) in meta.publish.items():
            self._publish(rid, ids, n)
        for rid in meta.revoke:
            self._revoke(rid)
        for rid, (dst, why) in meta.refuse.items():
            log.error("kvbridge: not loading %s: %s", rid, why)
            with self._lock:
                self._load_errors.update(dst)
                if rid not in meta.sync:     # a layer-wise load is reported in this step only
                    self._recv_done.add(rid)
        self._to_start.update(meta.load)
        self._sync_ids.update(meta.sync)
        for rid in meta.cancel:              # finished (aborted) mid-load; vLLM holds the blocks until
            if self._to_start.pop(rid, None) is not None:      # get_finished reports it: never wait here
                with self._lock:
                    self._recv_done.add(rid)
            t = self._transfers.get(rid)
            if t is not None:
                t[0].cancel(timeout=0)

    def _start_loads(self) -> None:
        """Start this step's transfers (vLLM's start_load_kv; returns at once)."""
        if not self._to_start or self.receiver is None:
            return
        todo, self._to_start = self._to_start, {}
        for rid, (handle, dst, idx) in todo.items():
            try:
                t = self.receiver.start_fetch(handle, dst, indices=idx)
            except KVBridgeError as exc:     # bad handle, layout mismatch: refused before any byte moved
                log.error("kvbridge: cannot load %s: %s", rid, exc)
                self.stats["load_failures"] += 1
                with self._lock:
                    self._load_errors.update(dst)
                    if rid not in self._sync_ids:
                        self._recv_done.add(rid)
                self._sync_ids.discard(rid)
                continue
            if rid in self._sync_ids:
                self._sync_ids.discard(rid)
                self._sync[rid] = (t, dst)
            else:
                self._transfers[rid] = (t, dst)

    def start_load_kv(self) -> None:
        self._start_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise loads (``load="layerwise"``): block until this layer's blocks of every load
        this forward reads have landed and verified. Asynchronous loads never get here: vLLM
        schedules such a request only after its transfer was reported done."""
        if not self._sync:
            return
        i = self.layer_of.get(layer_name)
        if i is None:
            return
        for rid, (t, dst) in self._sync.items():
            if rid not in self._sync_failed and not t.wait_layer(i, self.cfg.transfer_timeout):
                # the forward goes on; vLLM learns of the blocks at the end of this step and
                # recomputes or fails the request (kv_load_failure_policy)
                self._sync_failed.add(rid)

    def _finish_sync(self) -> None:
        """End of a step with layer-wise loads: collect their results (the release after the
        last layer) and report failed blocks in this same step, as vLLM expects of sync loads."""
        for rid, (t, dst) in self._sync.items():
            try:
                res = t.result(self.cfg.transfer_timeout)
            except TimeoutError:
                t.cancel(timeout=self.cfg.transfer_timeout)
                res = t.result(0) if t.done() else None
            self.stats["loads"] += 1
            if res is not None and res.ok and rid not in self._sync_failed:
                self.stats["bytes"] += res.nbytes
                self.stats["seconds"].append(res.seconds)
                continue
            self.stats["load_failures"] += 1
            log.warning("kvbridge: layer-wise load of %s failed (%s): %d block(s) to recompute", rid,
                        res.error if res is not None else "timeout", len(dst))
            with self._lock:
                self._load_errors.update((res.failed_block_ids if res is not None and not res.ok
                                          and rid not in self._sync_failed else None) or dst)
        self._sync = {}
        self._sync_failed = set()

    # -- both ----------------------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        recving: set[str] = set()
        for rid, (t, dst) in list(self._transfers.items()):
            if not t.done():
                continue
            del self._transfers[rid]
            res = t.result(0)
            self.stats["loads"] += 1
            if res.ok:
                self.stats["bytes"] += res.nbytes
                self.stats["seconds"].append(res.seconds)
            else:
                self.stats["load_failures"] += 1
                bad = res.failed_block_ids or dst
                log.warning("kvbridge: loading %s failed (%s, action %s): %d block(s) to recompute", rid,
                            res.error, res.action.value if res.action else None, len(bad))
                with self._lock:
                    self._load_errors.update(bad)
            recving.add(rid)
        with self._lock:
            recving |= self._recv_done
            self._recv_done = set()
            self._finished_seen |= finished_req_ids & self._ours
            sending = self._sent & self._finished_seen   # vLLM accepts only requests it has finished
            self._sent -= sending
            self._finished_seen -= sending
            self._ours -= sending
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        for t, _ in self._transfers.values():
            t.cancel(timeout=1.0)
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
        if self.outbox is not None:
            self.outbox.close()
