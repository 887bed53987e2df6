"""kvbridge driven the way a serving engine drives it.

Two engines run the reference model (real attention) on caches they allocate themselves
(``allocator="engine"``: their schedulers pick block ids). The prefill engine saves KV layer
by layer -- ``mark_ready`` from a hook after each decoder layer, as vLLM's ``save_kv_layer`` --
and the decode engine loads layer by layer -- ``wait_layer`` from a hook before each decoder
layer, as ``wait_for_layer_load`` -- while its scheduler thread starts transfers and polls
them. Greedy tokens must equal the same model run in one process.

Only public names are used here (``test_public_imports`` checks it).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

import pytest

from kvbridge import KVPool, KVReceiver, KVSender, Transfer, TransferState
from kvbridge.workers.engine import Engine
from kvbridge.workers.model import CausalLM

pytestmark = pytest.mark.timeout(120)

BLOCKS = 64


class BlockTable:
    """The engine's own allocator: kvbridge never sees it, only the ids it hands out."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.free = list(range(pool.num_blocks))[::-1]

    def alloc(self, n: int) -> list[int]:
        out = [self.free.pop() for _ in range(n)]
        return out

    def release(self, ids: list[int]) -> None:
        self.pool.retire(ids)          # the engine reuses them: kvbridge must know
        self.free.extend(ids)


class LayerHooks:
    """Calls ``after(i)`` when decoder layer ``i`` finished and ``before(i)`` when it starts."""

    def __init__(self, model: CausalLM) -> None:
        self.after: Optional[Any] = None
        self.before: Optional[Any] = None
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_hook(lambda m, a, out, i=i: self._call(self.after, i))
            layer.register_forward_pre_hook(lambda m, a, i=i: self._call(self.before, i))

    @staticmethod
    def _call(fn: Optional[Any], i: int) -> None:
        if fn is not None:
            fn(i)


def reference_tokens(model: CausalLM, prompt: list[int], n: int) -> list[int]:
    pool = KVPool.allocate(model.kv_layout(block_size=4), BLOCKS)
    eng = Engine(model, pool)
    blocks = pool.alloc(eng.blocks_needed(len(prompt) + n))
    out = [int(eng.prefill(prompt, blocks).argmax())]
    for k in range(n - 1):
        out.append(int(eng.decode_step([(blocks, len(prompt) + k, out[-1])])[0].argmax()))
    return out


def decode_from(eng: Engine, table: list[int], prompt_len: int, first: int, n: int) -> list[int]:
    out = [first]
    for k in range(n - 1):
        out.append(int(eng.decode_step([(table, prompt_len + k, out[-1])])[0].argmax()))
    return out


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return CausalLM.from_seed("tiny", seed=99)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("listen", ["tcp://127.0.0.1:0", "shm://", "inproc://"])
def test_layerwise_handoff_like_an_engine(model: CausalLM, mode: str, listen: str) -> None:
    layout = model.kv_layout(block_size=4)
    shared = listen.startswith("shm")
    p_pool = KVPool.allocate(layout, BLOCKS, shared=shared, allocator="engine")
    d_pool = KVPool.allocate(layout, BLOCKS, shared=shared, allocator="engine")
    p_table, d_table = BlockTable(p_pool), BlockTable(d_pool)
    p_eng, d_eng = Engine(model, p_pool), Engine(model, d_pool)
    freed: list[tuple[str, str]] = []
    prompts = [list(range(3, 40)), list(range(50, 61)), [7] * 23]
    n_out = 6
    with KVSender(p_pool, listen, on_free=lambda h, r: freed.append((h.request_id, r))) as snd, \
            KVReceiver(d_pool, listen=listen) as rcv:
        p_hooks = LayerHooks(model)
        for r, prompt in enumerate(prompts):
            rid = f"req-{r}"
            blocks = p_table.alloc(p_eng.blocks_needed(len(prompt)))
            need = d_eng.blocks_needed(len(prompt) + n_out)
            dst = d_table.alloc(need)
            dst_kv = dst[:len(blocks)]
            transfers: dict[str, Transfer] = {}
            # decode side first: a reservation to push into, or a scheduler that fetches
            if mode == "push":
                transfers[rid] = rcv.reserve(dst_kv, rid)
                tr = snd.push(transfers[rid].reservation, blocks, len(prompt), layers_ready=0)
                handle: Any = tr
            else:
                handle = snd.publish(rid, blocks, len(prompt), layers_ready=0)
            polled = threading.Event()

            def scheduler() -> None:
                if mode == "pull":
                    transfers[rid] = rcv.start_fetch(handle, dst_kv)
                t = transfers[rid]
                while not t.done():               # a scheduler loop polls, never blocks
                    time.sleep(0.0005)
                polled.set()
            th = threading.Thread(target=scheduler)
            th.start()
            # prefill with the layer-wise save hook
            seen_layers: list[int] = []

            def save(i: int) -> None:
                snd.mark_ready(handle, i + 1)
                seen_layers.append(i)
            p_hooks.after = save
            logits = p_eng.prefill(prompt, blocks)
            p_hooks.after = None
            assert seen_layers == list(range(layout.num_layers))
            first = int(logits.argmax())
            th.join(30)
            assert polled.is_set()
            t = transfers[rid]
            res = t.result(10)
            assert res.ok, res.error
            assert t.state is TransferState.DONE and t.layers_done == layout.num_layers
            # decode with the layer-wise load hook (every layer is there: waits return at once)
            p_hooks.before = lambda i: t.wait_layer(i, 10) or pytest.fail(f"layer {i} never landed")
            toks = decode_from(d_eng, dst, len(prompt), first, n_out)
            p_hooks.before = None
            assert toks == reference_tokens(model, prompt, n_out)
            if mode == "push":
                assert tr.result(10).ok
            # both engines give their blocks back to their own allocators
            deadline = time.monotonic() + 10
            while (rid, "pushed" if mode == "push" else "released") not in freed and time.monotonic() < deadline:
                time.sleep(0.01)
            assert (rid, "pushed" if mode == "push" else "released") in freed
            p_table.release(blocks)
            d_table.release(dst)
        assert snd.num_live == 0
        assert all(p_pool.refcount(b) == 0 for b in range(BLOCKS))


def test_decode_overlaps_prefill_layers(model: CausalLM) -> None:
    """Layer 0 is in the decode pool while the prefill is still computing later layers."""
    layout = model.kv_layout(block_size=4)
    p_pool = KVPool.allocate(layout, BLOCKS, allocator="engine")
    d_pool = KVPool.allocate(layout, BLOCKS, allocator="engine")
    prompt = list(range(5, 45))
    blocks = list(range(10, 20))
    with KVSender(p_pool, "tcp://127.0.0.1:0") as snd, KVReceiver(d_pool) as rcv:
        h = snd.publish("overlap", blocks, len(prompt), layers_ready=0)
        t = rcv.start_fetch(h, list(range(30, 40)))
        landed_during: list[int] = []
        hooks = LayerHooks(model)

        def save(i: int) -> None:
            snd.mark_ready(h, i + 1)
            if i == 0:
                assert t.wait_layer(0, 10)      # layer 0 crossed while layer 1.. are to come
                landed_during.append(t.layers_done)
        hooks.after = save
        Engine(model, p_pool).prefill(prompt, blocks)
        hooks.after = None
        assert landed_during and landed_during[0] < layout.num_layers
        assert t.result(10).ok
