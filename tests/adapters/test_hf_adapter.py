"""The Hugging Face adapter: a transformers cache crosses kvbridge and ``generate`` continues.

The model is a tiny random-weight LlamaForCausalLM (kvbridge's seeded ``tiny`` weights,
float32). The reference is ``model.generate(prompt)`` from scratch, greedy; every hand-off
must give the same tokens. A check that zeroing the fetched KV changes the tokens shows
the comparison would notice corrupted KV.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
from typing import Any, Iterator

import pytest
import torch

pytest.importorskip("transformers")

from _hf_prefill_child import NEW_TOKENS, build_hf_model, serve

from kvbridge_hf import (HFKVExporter, aload_cache, cache_layers, generate_from_cache, layout_for_config,
                         layout_for_model, load_cache, prefill_for_handoff, publish_cache, read_blocks,
                         write_blocks)
from kvbridge import KVLayout, KVPool, KVReceiver, KVSender
from kvbridge.errors import ConfigError, LayoutMismatch
from kvbridge.layout import KVOrder

GEN = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)


def prompts(n: int, seed: int, lo: int = 2, hi: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@torch.no_grad()
def reference(model: Any, p: list[int]) -> list[int]:
    ids = torch.tensor([p])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **GEN)
    return out[0, len(p):].tolist()


@torch.no_grad()
def continue_from(model: Any, p: list[int], cache: Any) -> list[int]:
    return generate_from_cache(model, p, cache, **GEN)[0, len(p):].tolist()


@pytest.fixture
def pair(hf_model: Any) -> Iterator[tuple[KVSender, KVReceiver]]:
    """Sender and receiver in this process over inproc://, embedded lease server."""
    layout = layout_for_model(hf_model, block_size=4)
    sender = KVSender(KVPool.allocate(layout, 128), "inproc://")
    receiver = KVReceiver(KVPool.allocate(layout, 128))
    yield sender, receiver
    receiver.close()
    sender.close()


def wait_all_free(sender: KVSender, timeout: float = 5.0) -> None:
    """Releases reach the sender through the lease event stream; give them a moment."""
    import time
    deadline = time.monotonic() + timeout
    while sender.num_live and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sender.num_live == 0
    assert sender.pool.num_free == sender.pool.num_blocks


# -- layout and block copies --------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_layout_from_config_and_model(hf_model: Any) -> None:
    from transformers import LlamaConfig

    L = layout_for_model(hf_model, block_size=8)
    assert (L.num_layers, L.num_kv_heads, L.head_dim, L.block_size, L.dtype) == (2, 2, 16, 8, "float32")
    assert L.kv_order is KVOrder.KV_FIRST and L.token_order.value == "NHD"
    assert L == KVLayout.vllm_flash(2, 2, 16, 8, "float32")
    # head_dim derived from hidden/heads; kv heads default to the attention heads (MHA)
    cfg = LlamaConfig(hidden_size=96, num_attention_heads=6, num_hidden_layers=3, intermediate_size=64)
    L2 = layout_for_config(cfg, block_size=16, dtype=torch.bfloat16, hnd=True, kv_order="split")
    assert (L2.num_layers, L2.num_kv_heads, L2.head_dim, L2.dtype) == (3, 6, 16, "bfloat16")
    assert L2.token_order.value == "HND" and L2.kv_order is KVOrder.SPLIT
    with pytest.raises(ConfigError):
        layout_for_config(cfg, kv_order="latent")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kv_order", ["kv_first", "block_first", "split"])
@pytest.mark.parametrize("hnd", [False, True])
def test_blocks_roundtrip_exact(kv_order: str, hnd: bool) -> None:
    """Any token count, block size and (scattered) block ids: bytes out == bytes in; tails zeroed."""
    g = torch.Generator().manual_seed(7)
    for bs in (1, 4, 5):
        L = KVLayout(3, 2, 8, bs, "float32", kv_order, "HND" if hnd else "NHD")
        pool = KVPool.allocate(L, 40)
        pool.buffers[0].fill_(123.0)          # stale bytes that must not survive in a tail
        for n in (1, bs, 2 * bs + 1, 17):
            layers = [(torch.randn(2, 2, n + 3, 8, generator=g), torch.randn(2, 2, n + 3, 8, generator=g))
                      for _ in range(3)]
            nb = -(-n // bs)
            ids = list(range(39, 39 - 2 * nb, -2))   # descending, non-adjacent
            write_blocks(pool, ids, layers, n, batch_index=1)
            back = read_blocks(pool, ids, n)
            for (k, v), (k2, v2) in zip(layers, back):
                assert torch.equal(k[1:2, :, :n], k2) and torch.equal(v[1:2, :, :n], v2)
            if n % bs:
                K = pool.layer_kv(0)[0][ids[-1]]
                tail = K[:, n % bs:] if hnd else K[n % bs:]
                assert not tail.any()


# -- same process, inproc:// ------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_inproc_prefix_handoff_matches_generate(hf_model: Any, pair: tuple[KVSender, KVReceiver]) -> None:
    """Publish the KV of prompt[:-1]; generate(prompt, cache) gives the from-scratch tokens."""
    sender, receiver = pair
    for i, p in enumerate(prompts(8, seed=1)):
        pre = prefill_for_handoff(hf_model, p)
        assert pre.num_tokens == len(p) - 1
        handle = publish_cache(sender, f"r{i}", pre.cache)
        cache = load_cache(receiver, handle.to_bytes(), hf_model.config)
        for (k, v), (k2, v2) in zip(cache_layers(pre.cache), cache_layers(cache)):
            assert torch.equal(k, k2) and torch.equal(v, v2)
        assert continue_from(hf_model, p, cache) == reference(hf_model, p), f"prompt {p}"
        assert receiver.pool.num_free == receiver.pool.num_blocks   # landing blocks given back
    wait_all_free(sender)


@pytest.mark.timeout(60)
def test_inproc_pd_handoff_first_token_from_prefill(hf_model: Any, pair: tuple[KVSender, KVReceiver]) -> None:
    """PD convention: prefill runs the whole prompt and samples t0; decode continues from prompt + [t0]."""
    sender, receiver = pair
    for i, p in enumerate(prompts(5, seed=2, lo=1)):
        pre = prefill_for_handoff(hf_model, p, include_last=True)
        assert pre.num_tokens == len(p) and pre.next_token_logits is not None
        first = int(pre.next_token_logits.argmax())
        handle = publish_cache(sender, f"pd{i}", pre.cache)
        cache = load_cache(receiver, handle, hf_model.config)
        out = generate_from_cache(hf_model, p + [first], cache, **{**GEN, "max_new_tokens": NEW_TOKENS - 1})
        assert [first] + out[0, len(p) + 1:].tolist() == reference(hf_model, p), f"prompt {p}"
    wait_all_free(sender)


@pytest.mark.timeout(60)
def test_hnd_layout_and_async_load(hf_model: Any) -> None:
    layout = layout_for_model(hf_model, block_size=16, hnd=True)
    with KVSender(KVPool.allocate(layout, 16), "inproc://") as sender, \
            KVReceiver(KVPool.allocate(layout, 16)) as receiver:
        for i, p in enumerate(prompts(3, seed=3, lo=10, hi=40)):
            handle = HFKVExporter(sender, hf_model.config).publish(f"h{i}", prefill_for_handoff(hf_model, p).cache)
            cache = asyncio.run(aload_cache(receiver, handle.to_bytes(), hf_model.config))
            assert continue_from(hf_model, p, cache) == reference(hf_model, p)
        wait_all_free(sender)


@pytest.mark.timeout(60)
def test_comparison_detects_corrupted_kv(hf_model: Any, pair: tuple[KVSender, KVReceiver]) -> None:
    """The token comparison is sensitive: the same hand-off with the fetched KV zeroed diverges."""
    sender, receiver = pair
    differs = 0
    for i, p in enumerate(prompts(4, seed=4, lo=8)):
        cache = load_cache(receiver, publish_cache(sender, f"c{i}", prefill_for_handoff(hf_model, p).cache))
        for k, v in cache_layers(cache):
            k.zero_()
            v.zero_()
        differs += continue_from(hf_model, p, cache) != reference(hf_model, p)
    assert differs >= 3


@pytest.mark.timeout(30)
def test_cache_as_long_as_input_is_refused(hf_model: Any) -> None:
    """transformers 5 would silently re-run the whole prompt after itself; the helper refuses."""
    p = prompts(1, seed=5, lo=6)[0]
    full = prefill_for_handoff(hf_model, p, include_last=True).cache
    with pytest.raises(ConfigError, match="strict prefix"):
        generate_from_cache(hf_model, p, full, **GEN)
    with pytest.raises(ConfigError):
        prefill_for_handoff(hf_model, [5])          # a one-token prompt has no prefix KV


# -- across a process boundary, tcp:// ----------------------------------------------------------------

@pytest.mark.timeout(60)
def test_cross_process_tcp_handoff(hf_model: Any) -> None:
    """Prefill in a spawned process (its own model, sender and lease server) -> handle bytes over a
    pipe -> fetch over tcp here -> generate: the from-scratch tokens; the child frees every block."""
    ps = prompts(6, seed=6)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(there, ps, 4, False), daemon=True)
    proc.start()
    there.close()
    try:
        assert here.poll(45), "prefill process sent nothing"
        kind, info = here.recv()
        assert kind == "ready", info
        assert info["pid"] != mp.current_process().pid and info["url"].startswith("tcp://127.0.0.1:")
        layout = layout_for_model(hf_model, block_size=4)
        with KVReceiver(KVPool.allocate(layout, 64)) as receiver:
            for p, (raw, _) in zip(ps, info["items"]):
                cache = load_cache(receiver, raw, hf_model.config)
                assert cache.get_seq_length() == len(p) - 1
                assert continue_from(hf_model, p, cache) == reference(hf_model, p), f"prompt {p}"
        here.send("stop")
        assert here.poll(15)
        kind, stats = here.recv()
        assert kind == "stats", stats
        assert stats["live"] == 0 and stats["released"] == len(ps)
        assert stats["free"] == stats["total"]
    finally:
        here.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    assert proc.exitcode == 0


# -- refusals ---------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_other_geometry_refused_with_layout_mismatch(hf_model: Any, pair: tuple[KVSender, KVReceiver]) -> None:
    sender, receiver = pair
    other = build_hf_model(num_kv_heads=4)                 # same sizes, 4 KV heads instead of 2
    p = prompts(1, seed=7, lo=9)[0]
    other_cache = prefill_for_handoff(other, p).cache
    # a decode side built for the other model refuses our handle, before taking any blocks ...
    handle = publish_cache(sender, "g0", prefill_for_handoff(hf_model, p).cache)
    with KVReceiver(KVPool.allocate(layout_for_model(other, block_size=4), 32)) as wrong:
        with pytest.raises(LayoutMismatch):
            load_cache(wrong, handle.to_bytes(), other.config)
        assert wrong.pool.num_free == wrong.pool.num_blocks
    # ... and the refusal did not burn the handle: the right receiver still continues from it
    assert continue_from(hf_model, p, load_cache(receiver, handle.to_bytes(), hf_model.config)) == \
        reference(hf_model, p)
    # the exporter refuses a cache of another geometry, leaking no blocks
    free = sender.pool.num_free
    with pytest.raises(LayoutMismatch):
        publish_cache(sender, "g1", other_cache)
    assert sender.pool.num_free == free
    # a pool that does not fit the model config is refused on both sides
    with pytest.raises(LayoutMismatch):
        load_cache(receiver, handle.to_bytes(), other.config)
    with pytest.raises(LayoutMismatch):
        HFKVExporter(sender, other.config)
    wait_all_free(sender)


# -- interoperability: HF prefill, kvbridge reference engine decode ------------------------------------

@pytest.mark.timeout(60)
def test_hf_prefill_feeds_reference_engine_decode(hf_model: Any) -> None:
    """HF's K (after rotary) and V in NHD blocks mean the same to kvbridge's reference engine
    (the same seeded weights): an HF-published handle decodes there to the same greedy tokens."""
    from kvbridge.workers.engine import Engine
    from kvbridge.workers.model import CausalLM
    from kvbridge.workers.sampling import SamplingParams

    from _hf_prefill_child import SEED

    engine = Engine(CausalLM.from_seed("tiny", seed=SEED), KVPool.allocate(layout_for_model(hf_model, 4), 64))
    with KVSender(KVPool.allocate(layout_for_model(hf_model, 4), 64), "inproc://") as sender, \
            KVReceiver(engine.pool) as receiver:
        for i, p in enumerate(prompts(4, seed=8)):
            pre = prefill_for_handoff(hf_model, p, include_last=True)
            handle = publish_cache(sender, f"e{i}", pre.cache)
            blocks = engine.pool.alloc(engine.blocks_needed(len(p) + NEW_TOKENS))
            receiver.fetch(handle, blocks[:handle.num_blocks]).raise_for_error()
            toks = [int(pre.next_token_logits.argmax())]
            for j in range(NEW_TOKENS - 1):
                toks.append(int(engine.decode_step([(blocks, len(p) + j, toks[-1])])[0].argmax()))
            engine.pool.free(blocks)
            assert toks == reference(hf_model, p) == engine.generate(p, SamplingParams(max_tokens=NEW_TOKENS))
        wait_all_free(sender)


# -- generate's other modes, dtypes, codecs, and what is not a handle -------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [dict(num_beams=2), dict(num_beams=3, num_return_sequences=2),
                                  dict(do_sample=True, top_k=5, num_return_sequences=2)])
def test_beam_search_and_several_sequences_continue_from_a_handed_off_cache(
        hf_model: Any, pair: tuple[KVSender, KVReceiver], mode: dict[str, Any]) -> None:
    """generate expands the prompt to one row per beam (or per sequence); the one-row cache was not
    expanded with it and generate failed inside torch.cat. Now the same tokens as from scratch."""
    sender, receiver = pair
    p = prompts(1, 21, lo=9, hi=14)[0]
    ids = torch.tensor([p])
    g = {**GEN, **mode}
    torch.manual_seed(3)
    ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), **g)
    h = publish_cache(sender, "beams", prefill_for_handoff(hf_model, ids).cache)
    cache = load_cache(receiver, h, hf_model.config)
    torch.manual_seed(3)
    assert torch.equal(generate_from_cache(hf_model, p, cache, **g), ref)
    with pytest.raises(ConfigError, match="rows"):
        generate_from_cache(hf_model, torch.tensor([p, p]), cache, **GEN)


@pytest.mark.timeout(60)
def test_a_cache_is_read_in_the_models_dtype_when_the_config_names_it(hf_model: Any) -> None:
    """A float32 pool read for a bfloat16 model: the cache came back float32 and generate failed in
    attention (query and key dtypes differ). The model config's dtype is the cache's default."""
    import copy
    model = copy.deepcopy(hf_model).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16              # as a checkpoint saved in bfloat16 says
    layout = layout_for_model(hf_model, block_size=4, dtype=torch.float32)
    with KVSender(KVPool.allocate(layout, 32), "inproc://", leases=False) as sender, \
            KVReceiver(KVPool.allocate(layout, 32), leases=False) as receiver:
        p = prompts(1, 22, lo=9, hi=14)[0]
        h = publish_cache(sender, "dt", prefill_for_handoff(hf_model, torch.tensor([p])).cache)
        cache = load_cache(receiver, h, model.config)
        assert cache.layers[0].keys.dtype == torch.bfloat16
        assert generate_from_cache(model, p, cache, **GEN).shape[1] == len(p) + NEW_TOKENS


@pytest.mark.timeout(60)
def test_a_codec_can_be_named_and_a_lossless_one_stays_token_exact(hf_model: Any,
                                                                   pair: tuple[KVSender, KVReceiver]) -> None:
    sender, receiver = pair
    for p in prompts(3, 23, lo=6, hi=20):
        h = HFKVExporter(sender).publish("lz", prefill_for_handoff(hf_model, torch.tensor([p])).cache, codec="lz4")
        assert h.codec == "lz4"
        assert continue_from(hf_model, p, load_cache(receiver, h, hf_model.config)) == reference(hf_model, p)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", ["not-a-handle", None, 7])
def test_what_is_not_a_handle_is_refused_clearly(pair: tuple[KVSender, KVReceiver], bad: Any) -> None:
    from kvbridge.errors import BadHandle
    _, receiver = pair
    with pytest.raises(BadHandle, match="KVHandle"):
        load_cache(receiver, bad)
    assert receiver.pool.num_free == receiver.pool.num_blocks
