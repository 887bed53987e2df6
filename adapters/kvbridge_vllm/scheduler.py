"""The scheduler-side half of the vLLM connector (runs in vLLM's engine core, owns no cache).

Producer: marks which requests hand their KV off (``kv_transfer_params["do_remote_decode"]``),
tells the worker to publish them in the step whose forward completes their prompt, and in
``request_finished`` keeps their blocks (``delay_free``) and returns the worker's handle as
``kv_transfer_params``. Consumer: a request arriving with a handle is checked against this
engine's geometry, claimed (the claim is renewed while the request waits in the queue), and
reported as external tokens loaded asynchronously; once vLLM has allocated its blocks the
worker is told to fetch into them. Claims, renewals and handing back a handle nothing will be
loaded from (aborted before its blocks were allocated, refused, nothing left to load) run on
:class:`~kvbridge_vllm.claims.ClaimKeeper`'s thread: ``schedule()`` never waits on the network.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from typing import Any, Optional

from kvbridge import KVHandle, KVLayout, KVPool, KVReceiver
from kvbridge.errors import KVBridgeError

from .channel import HandleInbox, channel_name
from .claims import ClaimKeeper
from .config import GEOMETRY_KEY, HANDLE_KEY, PROMPT_KEY, ConnectorConfig
from .layout import Geometry, compare, geometry_from_spec
from .metadata import KVBridgeMetadata

__all__ = ["SchedulerSide"]

log = logging.getLogger("kvbridge_vllm")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def prompt_digest(token_ids: Any) -> Optional[str]:
    """What ``kvbridge_prompt`` holds: a digest of the prompt tokens (None without token ids)."""
    if token_ids is None:
        return None
    return hashlib.blake2b(array("q", [int(t) for t in token_ids]).tobytes(), digest_size=16).hexdigest()


class SchedulerSide:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig, claimer: str,
                 producer: bool, consumer: bool, engine_key: tuple[str, int]) -> None:
        self.cfg = cfg
        self.claimer = claimer
        self.producer = producer
        self.consumer = consumer
        self.geometry: Geometry = geometry_from_spec(vllm_config, kv_cache_config)
        self.block_size = self.geometry["block_size"]
        self.kv_cache_manager: Any = None
        self.inbox = HandleInbox(channel_name(*engine_key)) if producer else None
        # producer
        self._to_publish: dict[str, Any] = {}          # request id -> Request (prefill not complete)
        self._published: set[str] = set()
        self._preempted: set[str] = set()              # published, then preempted: handle revoked
        self._warned_max_tokens = False
        self._meta = KVBridgeMetadata()
        # consumer
        self._handles: dict[str, KVHandle] = {}
        self._refused: dict[str, str] = {}             # request id -> why (first-contact check)
        self._loading: set[str] = set()
        self.claims = ClaimKeeper(self._claimer_receiver, cfg.claim_ttl)

    # -- consumer ------------------------------------------------------------------------
    def _claimer_receiver(self) -> KVReceiver:
        """A receiver to claim and renew with (on the claim keeper's thread), under the worker's
        claimer name, so the worker's fetch reuses the claim. It holds no cache: one block."""
        layout = KVLayout.mla(1, latent_dim=1, block_size=1, dtype=self.geometry["dtype"])
        return KVReceiver(KVPool.allocate(layout, 1), secret=self.cfg.secret, leases=self.cfg.leases,
                          claimer=self.claimer, claim_ttl=self.cfg.claim_ttl,
                          lease_namespace=self.cfg.lease_namespace, timeout=self.cfg.timeout, workers=1)

    def on_new_request(self, request: Any) -> None:
        params = request.kv_transfer_params
        if not self.consumer or not isinstance(params, dict) or HANDLE_KEY not in params:
            return
        rid = request.request_id
        try:
            h = KVHandle.from_dict(params[HANDLE_KEY], self.cfg.secret)
        except KVBridgeError as exc:
            self._refused[rid] = f"bad kvbridge handle: {exc}"
            log.error("kvbridge: request %s: %s", rid, self._refused[rid])
            return
        ids = getattr(request, "prompt_token_ids", None)
        if params.get(PROMPT_KEY) != prompt_digest(None if ids is None else list(ids)[:h.num_tokens]):
            # KV of other tokens (params kept from another prompt, or from a producer that does not
            # say): computing the prompt here is right, loading it would give wrong tokens
            log.error("kvbridge: request %s: its kv_transfer_params hold the KV of another prompt (or do not "
                      "say which, %r): computing it here", rid, PROMPT_KEY)
            self.claims.give_up(rid, h)
            return
        self._handles[rid] = h
        theirs = params.get(GEOMETRY_KEY)
        if not isinstance(theirs, dict) or not theirs:
            diff = [f"the request carries no {GEOMETRY_KEY!r} (the producer's cache geometry)"]
        else:
            diff = compare({k: v for k, v in self.geometry.items() if k != "order"}, theirs)
        if diff:
            self._refused[rid] = ("the producer's KV cache does not match this engine's: " + "; ".join(diff)
                                  + " (same model, dtype, block_size and tensor parallel size on both sides)")
            log.error("kvbridge: request %s: %s", rid, self._refused[rid])
            self.claims.give_up(rid, h)     # never loaded: the producer frees its blocks now
            return
        if h.lease_id:
            self.claims.claim(rid, h)       # on the keeper's thread; renewed while the request waits

    def _load_end(self, request: Any, h: Optional[KVHandle]) -> int:
        """Prompt tokens this engine takes from the producer: all of them (async; vLLM recomputes
        the last), or (layer-wise) only whole blocks before the block holding the last prompt token,
        so the forward that runs alongside the transfer never writes a block being loaded."""
        n = request.num_prompt_tokens if h is None else min(h.num_tokens, request.num_prompt_tokens)
        if self.cfg.load == "layerwise":
            return ((n - 1) // self.block_size) * self.block_size
        return n

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        h = self._handles.get(rid)
        if rid in self._loading or (h is None and rid not in self._refused):
            return 0, False
        n = self._load_end(request, h) - num_computed_tokens
        return (n, self.cfg.load == "async") if n > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        params = request.kv_transfer_params if isinstance(request.kv_transfer_params, dict) else {}
        if (self.producer and params.get("do_remote_decode") and rid not in self._published
                and rid not in self._preempted):
            if self._single_token(request):
                self._to_publish[rid] = request
        if not self.consumer or rid in self._loading:
            return
        if num_external_tokens <= 0:        # nothing to load (prefix cache, prompt under one block)
            h0 = self._handles.pop(rid, None)
            if h0 is not None and self._refused.pop(rid, None) is None:
                self.claims.give_up(rid, h0)
            return
        ids = list(blocks.get_block_ids()[0])
        h = self._handles.pop(rid, None)
        end = self._load_end(request, h)
        first = (end - num_external_tokens) // self.block_size   # blocks vLLM already had (prefix cache)
        idx = list(range(first, _cdiv(end, self.block_size)))
        sync = self.cfg.load == "layerwise"
        if rid in self._refused:
            self._meta.refuse[rid] = ([ids[i] for i in idx], self._refused.pop(rid))
        elif h is not None:
            self._meta.load[rid] = (request.kv_transfer_params[HANDLE_KEY], [ids[i] for i in idx], idx)
        else:
            return
        if sync:
            self._meta.sync.append(rid)
        else:
            self._loading.add(rid)
        self.claims.drop(rid)               # the worker's fetch takes the claim over

    def _single_token(self, request: Any) -> bool:
        """A producer request hands its KV off after one token (the proxy's ``max_tokens=1``):
        decode tokens written after the publish would change the published last block."""
        sp = getattr(request, "sampling_params", None)
        n = getattr(request, "max_tokens", None) or getattr(sp, "max_tokens", None)
        if n is None or int(n) == 1:
            return True
        (log.debug if self._warned_max_tokens else log.warning)(
            "kvbridge: request %s asks do_remote_decode with max_tokens=%s; the producer hands KV off "
            "only for max_tokens=1 (as vLLM's disaggregated proxies send): not publishing it", request.request_id, n)
        self._warned_max_tokens = True
        return False

    # -- producer ------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> KVBridgeMetadata:
        if self.inbox is not None:
            self.inbox.poll()              # keep the worker's queue short
        for rid, req in list(self._to_publish.items()):
            n = scheduler_output.num_scheduled_tokens.get(rid, 0)
            if n and req.num_computed_tokens + n >= req.num_prompt_tokens:
                ids = list(self.kv_cache_manager.get_block_ids(rid)[0])
                nb = _cdiv(req.num_prompt_tokens, self.block_size)
                self._meta.publish[rid] = (ids[:nb], req.num_prompt_tokens)
                self._published.add(rid)
                del self._to_publish[rid]
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            if rid in self._published:      # vLLM freed its blocks: the handle must end before reuse
                self._published.discard(rid)
                self._preempted.add(rid)
                self._meta.revoke.append(rid)
        meta, self._meta = self._meta, KVBridgeMetadata()
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Optional[dict[str, Any]]]:
        rid = request.request_id
        self._to_publish.pop(rid, None)
        h = self._handles.pop(rid, None)
        refused = self._refused.pop(rid, None) is not None
        if h is not None and not refused and rid not in self._loading:
            self.claims.give_up(rid, h)     # finished (aborted) before anything was loaded
        if rid in self._preempted:          # its handle was revoked; the worker reports it sent
            self._preempted.discard(rid)
            assert self.inbox is not None
            self.inbox.forget(rid)
            return True, None
        if rid in self._loading:            # consumer: finished (aborted) while its KV is on the way
            # vLLM keeps its blocks (delay_free) until the worker reports the cancelled transfer
            # ended (finished_recving): no byte lands in blocks it reused, and vLLM, which frees a
            # finished request on finished_recving, still knows the request then
            self._meta.cancel.append(rid)
            return True, None
        if rid not in self._published:
            return False, None
        self._published.discard(rid)
        assert self.inbox is not None
        msg = self.inbox.take(rid, self.cfg.handle_wait)
        finished_ok = request.status.name in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
        if msg is None or "handle" not in msg or not finished_ok:
            if msg is None:
                log.error("kvbridge: no handle from the worker for %s within %s s", rid, self.cfg.handle_wait)
            elif "error" in msg:
                log.error("kvbridge: publishing %s failed: %s", rid, msg["error"])
            self._meta.revoke.append(rid)   # the worker ends it and reports it finished sending
            return True, None
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      HANDLE_KEY: msg["handle"], GEOMETRY_KEY: msg["geometry"],
                      PROMPT_KEY: prompt_digest(getattr(request, "prompt_token_ids", None))}

    def update_connector_output(self, output: Any) -> None:
        for rid in output.finished_recving or ():
            self._loading.discard(rid)

    def has_pending(self) -> bool:
        return bool(self._loading or self._published or self._preempted)

    def shutdown(self) -> None:
        if self.inbox is not None:
            self.inbox.close()
        self.claims.close()
