"""The vLLM connector's scheduler and worker halves without vLLM (its base classes from
``_engine_stubs`` where it is not installed): real kvbridge senders, receivers, lease server
and sockets; requests and scheduler outputs shaped as vLLM passes them."""

from __future__ import annotations

import os
import socket
import threading
import time
from types import SimpleNamespace as NS
from typing import Any, Iterator

import pytest
from waiting import wait_until as until
import torch

from kvbridge import KVReceiver, KVSender

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("engine_stubs")]

BS, HEADS, DIM, L, NB = 4, 2, 8, 2, 32


def vcfg() -> Any:
    return NS(cache_config=NS(block_size=BS), parallel_config=NS(tensor_parallel_size=1))


def kvcfg() -> Any:
    spec = NS(num_kv_heads=HEADS, head_size=DIM, block_size=BS, dtype=torch.float32)
    return NS(kv_cache_groups=[NS(kv_cache_spec=spec, layer_names=[f"model.layers.{i}.self_attn.attn"
                                                                   for i in range(L)])])


def caches(fill: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shape = (NB, HEADS, BS, 2 * DIM)
    return {f"model.layers.{i}.self_attn.attn": (torch.randn(shape, generator=g) if fill else torch.zeros(shape))
            for i in range(L)}


def key(tag: str) -> tuple[str, int]:
    return (f"test-{tag}-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}", 0)




@pytest.fixture(scope="module")
def producer() -> Iterator[tuple[KVSender, dict[str, Any]]]:
    """A producer's sender with the embedded lease server (the connector's default)."""
    from kvbridge_vllm.layout import pool_from_kv_caches
    src, _, geo = pool_from_kv_caches(caches(), vcfg(), True)
    snd = KVSender(src, "tcp://127.0.0.1:0", ttl=60)
    yield snd, geo
    snd.close()


def request(rid: str, h: Any, geo: Any, prompt: int = 12, status: str = "FINISHED_ABORTED") -> Any:
    from kvbridge_vllm.config import GEOMETRY_KEY, HANDLE_KEY, PROMPT_KEY
    from kvbridge_vllm.scheduler import prompt_digest
    tokens = list(range(3, 3 + prompt))
    params: dict[str, Any] = {HANDLE_KEY: h.to_dict(), PROMPT_KEY: prompt_digest(tokens[:h.num_tokens])}
    if geo is not None:
        params[GEOMETRY_KEY] = geo
    return NS(request_id=rid, kv_transfer_params=params, num_prompt_tokens=prompt, prompt_token_ids=tokens,
              status=NS(name=status))


def consumer(extra: dict[str, Any]) -> Any:
    from kvbridge_vllm.config import ConnectorConfig
    from kvbridge_vllm.scheduler import SchedulerSide
    return SchedulerSide(vcfg(), kvcfg(), ConnectorConfig.from_extra(extra), "vllm-d-dp0", False, True, key("c"))


# -- 1. prefix caching shares blocks between handles --------------------------------------------
def test_ending_one_handle_keeps_a_handle_sharing_its_prefix_blocks() -> None:
    from kvbridge_vllm.channel import HandleInbox, channel_name
    from kvbridge_vllm.config import ConnectorConfig
    from kvbridge_vllm.layout import pool_from_kv_caches
    from kvbridge_vllm.metadata import KVBridgeMetadata
    from kvbridge_vllm.worker import WorkerSide
    k = key("prefix")
    inbox = HandleInbox(channel_name(*k))
    w = WorkerSide(vcfg(), ConnectorConfig.from_extra({"leases": False}), "c", True, False, k, True)
    w.register_kv_caches(caches())
    dst_pool, _, _ = pool_from_kv_caches(caches(False), vcfg(), True)
    rcv = KVReceiver(dst_pool, leases=False)
    try:
        m = KVBridgeMetadata()
        m.publish = {"A": ([0, 1, 2], 12), "B": ([0, 1, 5], 12)}       # blocks 0, 1: a shared prefix
        w.bind(m)
        w.wait_for_save()
        assert w.sender is not None and w.pool is not None
        hB = w._handles["B"]
        gens = w.pool.generations([0, 1, 2, 5])
        m = KVBridgeMetadata()
        m.revoke = ["A"]                                               # A aborted (or released)
        w.bind(m)
        assert until(lambda: "A" in w._sent)
        assert w.sender.num_live == 1
        assert w.pool.generations([0, 1, 2, 5]) == [gens[0], gens[1], gens[2] + 1, gens[3]]   # only A's own
        res = rcv.start_fetch(hB.to_dict(), [10, 11, 12]).result(10)
        assert res.ok, res.error
        assert until(lambda: "B" in w._sent)                             # released by the fetch
        assert w.pool.generations([0, 1, 5]) == [gens[0] + 1, gens[1] + 1, gens[3] + 1]
        assert w._block_users == {} and w._counted == {}
    finally:
        rcv.close()
        w.shutdown()
        inbox.close()


# -- 2. the scheduler thread never waits on a lease server --------------------------------------
def test_a_hung_lease_server_never_blocks_the_scheduler(producer: Any) -> None:
    snd, geo = producer
    hole = socket.socket()            # accepts connections (the kernel does) and never answers
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    s = consumer({"leases": f"redis://127.0.0.1:{hole.getsockname()[1]}", "claim_ttl": 0.3})
    handles = [snd.publish(f"h{i}", [20 + i], 4) for i in range(3)]
    try:
        t0 = time.monotonic()
        for i, h in enumerate(handles):
            s.on_new_request(request(f"h{i}", h, geo, prompt=4))
        for _ in range(3):
            time.sleep(0.15)                 # claims due for renewal
            s.build_connector_meta(NS(num_scheduled_tokens={}))
        assert time.monotonic() - t0 < 0.45 + 1.0, "the scheduler waited on the lease server"
    finally:
        for h in handles:
            snd.revoke(h)
        s.claims.close(timeout=0.1)
        s.inbox is None or s.inbox.close()
        hole.close()


# -- 3. handles nothing is loaded from go back to the producer ----------------------------------
@pytest.mark.parametrize("case", ["aborted_queued", "geometry_differs", "geometry_missing", "nothing_to_load",
                                  "layerwise_under_one_block"])
def test_handles_nothing_loads_from_go_back_to_the_producer(producer: Any, case: str) -> None:
    snd, geo = producer
    s = consumer({"load": "layerwise"} if case == "layerwise_under_one_block" else {})
    live = snd.num_live
    try:
        if case == "layerwise_under_one_block":
            h = snd.publish("r", [6], 3)
            r = request("r", h, geo, prompt=3, status="FINISHED_LENGTH_CAPPED")
        else:
            h = snd.publish("r", [6, 7, 8], 12)
            bad = dict(geo, head_dim=999) if case == "geometry_differs" else None if case == "geometry_missing" else geo
            r = request("r", h, bad)
        assert snd.num_live == live + 1
        t0 = time.monotonic()
        s.on_new_request(r)
        if case in ("nothing_to_load", "layerwise_under_one_block"):
            s.get_num_new_matched_tokens(r, 12 if case == "nothing_to_load" else 0)
            s.update_state_after_alloc(r, NS(get_block_ids=lambda: ([1, 2, 3],)), 0)
            meta = s.build_connector_meta(NS(num_scheduled_tokens={}))
            assert not meta.load and not meta.refuse
        elif case.startswith("geometry"):
            n, _ = s.get_num_new_matched_tokens(r, 0)
            s.update_state_after_alloc(r, NS(get_block_ids=lambda: ([1, 2, 3],)), n)
            meta = s.build_connector_meta(NS(num_scheduled_tokens={}))
            assert list(meta.refuse) == ["r"] and not meta.load    # reported: vLLM recomputes or fails it
        # a refused load is reported from the worker's get_finished: until then vLLM keeps its blocks
        assert s.request_finished(r, []) == (case.startswith("geometry"), None)
        assert time.monotonic() - t0 < 1.0
        assert until(lambda: snd.num_live == live), f"{case}: the producer still holds the handle"
    finally:
        s.shutdown()


# -- 9. producer: one token per hand-off; preempted requests' handles end ----------------------
def producer_sched() -> Any:
    from kvbridge_vllm.config import ConnectorConfig
    from kvbridge_vllm.scheduler import SchedulerSide
    s = SchedulerSide(vcfg(), kvcfg(), ConnectorConfig.from_extra({}), "vllm-p-dp0", True, False, key("p"))
    s.kv_cache_manager = NS(get_block_ids=lambda rid: ([4, 5, 6],))
    return s


def test_producer_hands_off_only_single_token_requests(caplog: Any) -> None:
    s = producer_sched()
    try:
        for rid, mt in (("one", 1), ("many", 16), ("many2", 8)):
            r = NS(request_id=rid, kv_transfer_params={"do_remote_decode": True}, num_prompt_tokens=12,
                   num_computed_tokens=0, sampling_params=NS(max_tokens=mt))
            s.update_state_after_alloc(r, NS(get_block_ids=lambda: ([4, 5, 6],)), 0)
        meta = s.build_connector_meta(NS(num_scheduled_tokens={"one": 12, "many": 12, "many2": 12}))
        assert list(meta.publish) == ["one"]
        assert sum("max_tokens" in rec.getMessage() for rec in caplog.records if rec.levelname == "WARNING") == 1
    finally:
        s.shutdown()


def test_preempted_published_request_has_its_handle_revoked() -> None:
    s = producer_sched()
    try:
        r = NS(request_id="p", kv_transfer_params={"do_remote_decode": True}, num_prompt_tokens=12,
               num_computed_tokens=0, sampling_params=NS(max_tokens=1), status=NS(name="FINISHED_LENGTH_CAPPED"))
        s.update_state_after_alloc(r, NS(get_block_ids=lambda: ([4, 5, 6],)), 0)
        assert list(s.build_connector_meta(NS(num_scheduled_tokens={"p": 12})).publish) == ["p"]
        meta = s.build_connector_meta(NS(num_scheduled_tokens={}, preempted_req_ids={"p"}))
        assert meta.revoke == ["p"]
        s.update_state_after_alloc(r, NS(get_block_ids=lambda: ([7, 8, 9],)), 0)    # resumed: not again
        assert not s.build_connector_meta(NS(num_scheduled_tokens={"p": 12})).publish
        assert s.request_finished(r, []) == (True, None)     # delay_free until the worker freed it
    finally:
        s.shutdown()


# -- 10. consumer: a request aborted while its KV is on the way -----------------------------------
def consumer_worker(extra: dict[str, Any]) -> Any:
    from kvbridge_vllm.config import ConnectorConfig
    from kvbridge_vllm.worker import WorkerSide
    w = WorkerSide(vcfg(), ConnectorConfig.from_extra(extra), "vllm-d-dp0", False, True, key("w"), True)
    w.register_kv_caches(caches(False))
    return w


def test_aborted_mid_fetch_keeps_its_blocks_until_the_transfer_ended(producer: Any) -> None:
    """vLLM frees a finished request's blocks at once unless ``request_finished`` delays it, and
    frees a delayed one when ``finished_recving`` names it (asserting it still knows the request):
    an abort mid-fetch must delay, so no byte lands in reused blocks and the report finds it."""
    snd, geo = producer
    s, w = consumer({}), consumer_worker({})
    live = snd.num_live
    try:
        h = snd.publish("mid", [6, 7, 8], 12, layers_ready=0)     # no layer ready yet: the fetch waits
        r = request("mid", h, geo)
        s.on_new_request(r)
        n, asynchronous = s.get_num_new_matched_tokens(r, 0)
        assert (n, asynchronous) == (12, True)
        s.update_state_after_alloc(r, NS(get_block_ids=lambda: ([1, 2, 3],)), n)
        w.bind(s.build_connector_meta(NS(num_scheduled_tokens={})))
        w.start_load_kv()
        assert w.get_finished(set()) == (None, None)               # in flight
        assert s.request_finished(r, [1, 2, 3]) == (True, None)     # aborted: vLLM keeps the blocks
        t0 = time.monotonic()
        w.bind(s.build_connector_meta(NS(num_scheduled_tokens={})))  # the cancel
        assert time.monotonic() - t0 < 0.5, "the worker waited for the cancelled transfer"
        got: list[Any] = []
        assert until(lambda: got.append(w.get_finished({"mid"})[1]) or got[-1] == {"mid"})   # vLLM frees now
        s.update_connector_output(NS(finished_recving={"mid"}))
        assert not s.has_pending()
        assert until(lambda: snd.num_live == live), "the producer still holds the handle"
    finally:
        s.shutdown()
        w.shutdown()


# -- 11. kv_transfer_params from a client: malformed ones are refused, never crash the engine ------
@pytest.mark.parametrize("case", ["geometry_foreign_keys", "geometry_partial", "params_not_a_dict"])
def test_malformed_kv_transfer_params_are_refused_cleanly(producer: Any, case: str) -> None:
    from kvbridge_vllm.config import HANDLE_KEY
    snd, geo = producer
    s, p = consumer({}), producer_sched()
    live = snd.num_live
    try:
        h = snd.publish("m", [6, 7, 8], 12)
        r = request("m", h, {"foo": 1} if case == "geometry_foreign_keys" else {"layers": geo["layers"]})
        if case == "params_not_a_dict":
            r.kv_transfer_params = f"{HANDLE_KEY}: {h.to_dict()}"     # a string (LLM API extra_args)
            r.num_computed_tokens, r.sampling_params = 0, NS(max_tokens=1)
            p.update_state_after_alloc(r, NS(get_block_ids=lambda: ([1, 2, 3],)), 0)   # producer side too
        s.on_new_request(r)
        n, _ = s.get_num_new_matched_tokens(r, 0)
        s.update_state_after_alloc(r, NS(get_block_ids=lambda: ([1, 2, 3],)), n)
        meta = s.build_connector_meta(NS(num_scheduled_tokens={}))
        assert not meta.load, "loaded with a geometry that does not say it matches"
        if case == "params_not_a_dict":
            assert n == 0 and not meta.refuse                           # no handle: computed here
            snd.revoke(h)
        else:
            assert list(meta.refuse) == ["m"] and "producer does not say" in meta.refuse["m"][1]
        assert s.request_finished(r, []) == (case != "params_not_a_dict", None)   # refused: reported later
        assert until(lambda: snd.num_live == live), "the producer still holds the handle"
    finally:
        s.shutdown()
        p.shutdown()


# -- 12. kv_transfer_params kept from another prompt: computed here, never loaded -----------------
@pytest.mark.parametrize("case", ["other_prompt", "prompt_not_said"])
def test_params_of_another_prompt_are_not_loaded(producer: Any, case: str) -> None:
    from kvbridge_vllm.config import PROMPT_KEY
    snd, geo = producer
    s = consumer({})
    live = snd.num_live
    try:
        h = snd.publish("o", [6, 7, 8], 12)
        r = request("o", h, geo)
        if case == "other_prompt":
            r.prompt_token_ids = [7] + r.prompt_token_ids[1:]       # one token differs
        else:
            del r.kv_transfer_params[PROMPT_KEY]
        s.on_new_request(r)
        assert s.get_num_new_matched_tokens(r, 0) == (0, False)    # vLLM computes the prompt itself
        s.update_state_after_alloc(r, NS(get_block_ids=lambda: ([1, 2, 3],)), 0)
        meta = s.build_connector_meta(NS(num_scheduled_tokens={}))
        assert not meta.load and not meta.refuse
        assert s.request_finished(r, []) == (False, None)
        assert until(lambda: snd.num_live == live), "the producer still holds the handle"
    finally:
        s.shutdown()


def test_producer_params_say_which_prompt() -> None:
    from kvbridge_vllm.config import PROMPT_KEY
    from kvbridge_vllm.scheduler import prompt_digest
    s = producer_sched()
    try:
        r = NS(request_id="q", kv_transfer_params={"do_remote_decode": True}, num_prompt_tokens=12,
               num_computed_tokens=0, sampling_params=NS(max_tokens=1), prompt_token_ids=list(range(12)),
               status=NS(name="FINISHED_LENGTH_CAPPED"))
        s.update_state_after_alloc(r, NS(get_block_ids=lambda: ([4, 5, 6],)), 0)
        s.build_connector_meta(NS(num_scheduled_tokens={"q": 12}))
        s._published.add("q")
        assert s.inbox is not None
        s.inbox._got["q"] = {"req": "q", "handle": {"x": 1}, "geometry": {}}   # what the worker sends
        delay, params = s.request_finished(r, [4, 5, 6])
        assert delay and params is not None and params[PROMPT_KEY] == prompt_digest(list(range(12)))
    finally:
        s.shutdown()
