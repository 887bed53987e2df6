"""Paged prefill/decode of the reference engine: chunking, batching, handoff between pools."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from typing import Callable

import pytest
import torch

from kvbridge.errors import ConfigError, PoolError
from kvbridge.layout import KVLayout
from kvbridge.pool import KVPool
from kvbridge.workers.engine import Engine
from kvbridge.workers.model import CausalLM, ModelConfig
from kvbridge.workers.sampling import SamplingParams, sample_token

Prompts = Callable[..., list[list[int]]]
Copy = Callable[[KVPool, list[int], KVPool, list[int]], None]


def kv_of(pool: KVPool, blocks: list[int], num_tokens: int) -> torch.Tensor:
    """All layers' K and V of the first ``num_tokens`` tokens in ``blocks``, float32, (L, 2, T, h, d)."""
    out = []
    for layer in range(pool.layout.num_layers):
        k, v = pool.layer_kv(layer)
        idx = torch.tensor(blocks)
        out.append(torch.stack([k[idx].flatten(0, 1)[:num_tokens], v[idx].flatten(0, 1)[:num_tokens]]))
    return torch.stack(out).float()


def decode_greedy(engine: Engine, blocks: list[int], num_tokens: int, first: int, steps: int
                  ) -> tuple[list[int], list[torch.Tensor]]:
    toks, logits = [first], []
    for i in range(steps):
        lg = engine.decode_step([(blocks, num_tokens + i, toks[-1])])[0]
        logits.append(lg)
        toks.append(int(lg.argmax()))
    return toks, logits


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pool_dtype", ["float32", "bfloat16", "float16"])
def test_chunked_prefill_matches_unchunked(make_engine: Callable[..., Engine], random_prompts: Prompts,
                                           pool_dtype: str) -> None:
    e = make_engine(num_blocks=64, block_size=4, dtype=pool_dtype)
    tol = 1e-4 if pool_dtype == "float32" else 2e-2
    for p in random_prompts(6, seed=10, lo=20, hi=45):
        ref_blocks = e.pool.alloc(e.blocks_needed(len(p)))
        ref = e.prefill(p, ref_blocks)
        for chunk in (1, 3, 4, 7, 16):
            b = e.pool.alloc(e.blocks_needed(len(p)))
            got = e.prefill(p, b, chunk_size=chunk)
            assert int(got.argmax()) == int(ref.argmax())
            assert float((got - ref).abs().max()) < tol * max(1.0, float(ref.abs().max()))
            assert float((kv_of(e.pool, b, len(p)) - kv_of(e.pool, ref_blocks, len(p))).abs().max()) < tol * 10
            e.pool.free(b)
        e.pool.free(ref_blocks)


@pytest.mark.timeout(60)
def test_same_chunking_is_bitwise_identical(make_engine: Callable[..., Engine], random_prompts: Prompts) -> None:
    e = make_engine(num_blocks=64, block_size=4)
    for p in random_prompts(4, seed=11, lo=10, hi=40):
        for chunk in (None, 5):
            a, b = e.pool.alloc(e.blocks_needed(len(p))), e.pool.alloc(e.blocks_needed(len(p)))
            la, lb = e.prefill(p, a, chunk), e.prefill(p, b, chunk)
            assert torch.equal(la, lb)
            assert torch.equal(kv_of(e.pool, a, len(p)), kv_of(e.pool, b, len(p)))
            e.pool.free(a + b)


_CHILD = """
import hashlib, sys, torch
torch.set_num_threads(int(sys.argv[1]))
from kvbridge.pool import KVPool
from kvbridge.workers.engine import Engine
from kvbridge.workers.model import CausalLM
m = CausalLM.from_seed("tiny", seed=1234)
pool = KVPool.allocate(m.kv_layout(4, "float32"), 16)
e = Engine(m, pool)
logits = e.prefill(list(range(3, 40)), list(range(10)), chunk_size=8)
h = hashlib.sha256(logits.numpy().tobytes())
for b in pool.buffers:
    h.update(b.numpy().tobytes())
print(h.hexdigest())
"""


@pytest.mark.timeout(60)
def test_prefill_bitwise_identical_across_processes(tiny: CausalLM) -> None:
    """A prefill worker and a recomputing decode worker write the same bytes."""
    threads = torch.get_num_threads()
    pool = KVPool.allocate(tiny.kv_layout(4, "float32"), 16)
    logits = Engine(tiny, pool).prefill(list(range(3, 40)), list(range(10)), chunk_size=8)
    h = hashlib.sha256(logits.numpy().tobytes())
    for b in pool.buffers:
        h.update(b.numpy().tobytes())
    out = subprocess.run([sys.executable, "-c", _CHILD, str(threads)], capture_output=True, text=True,
                         timeout=50, check=True)
    assert out.stdout.strip() == h.hexdigest()


@pytest.mark.timeout(60)
def test_batched_decode_equals_each_alone(make_engine: Callable[..., Engine], random_prompts: Prompts,
                                          copy_blocks: Copy) -> None:
    e = make_engine(num_blocks=128, block_size=4)
    alone = make_engine(num_blocks=128, block_size=4)
    prompts = [p for p in random_prompts(5, seed=12, lo=1, hi=40)] + [[7], list(range(33))]
    steps = 8
    reqs = []
    for p in prompts:
        b = e.pool.alloc(e.blocks_needed(len(p) + steps))
        first = int(e.prefill(p, b).argmax())
        ab = alone.pool.alloc(len(b))
        copy_blocks(e.pool, b, alone.pool, ab)
        reqs.append((p, b, ab, first))
    # each alone
    ref = [decode_greedy(alone, ab, len(p), first, steps) for p, _, ab, first in reqs]
    # all together, lengths differ at every step
    toks = [[first] for *_, first in reqs]
    for i in range(steps):
        lg = e.decode_step([(b, len(p) + i, toks[j][-1]) for j, (p, b, _, _) in enumerate(reqs)])
        assert lg.shape == (len(reqs), e.model.config.vocab_size)
        for j in range(len(reqs)):
            assert float((lg[j] - ref[j][1][i]).abs().max()) < 1e-4
            toks[j].append(int(lg[j].argmax()))
    assert toks == [r[0] for r in ref]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dst_kind", ["vllm", "flashinfer", "split"])
def test_handoff_to_another_pool_continues_exactly(make_engine: Callable[..., Engine], tiny: CausalLM,
                                                  random_prompts: Prompts, copy_blocks: Copy,
                                                  dst_kind: str) -> None:
    """Prefill into pool A, copy only the request's blocks into other ids of pool B,
    decode from B: the same tokens and bitwise the same logits as decoding in A."""
    a = make_engine(num_blocks=64, block_size=4)
    c = tiny.config
    lay = {"vllm": KVLayout.vllm_flash(c.num_layers, c.num_kv_heads, c.head_dim, 4, "float32"),
           "flashinfer": KVLayout.flashinfer(c.num_layers, c.num_kv_heads, c.head_dim, 4, "float32"),
           "split": KVLayout.split_kv(c.num_layers, c.num_kv_heads, c.head_dim, 4, "float32")}[dst_kind]
    b = Engine(tiny, KVPool.allocate(lay, 64))
    steps = 10
    for p in random_prompts(4, seed=13, lo=5, hi=30):
        a.pool.alloc(3)  # make A's and B's ids differ
        b.pool.alloc(5)
        src = a.pool.alloc(a.blocks_needed(len(p) + steps))
        first = int(a.prefill(p, src, chunk_size=8).argmax())
        n_prompt_blocks = a.blocks_needed(len(p))
        dst = list(reversed(b.pool.alloc(len(src))))
        copy_blocks(a.pool, src[:n_prompt_blocks], b.pool, dst[:n_prompt_blocks])
        toks_a, lg_a = decode_greedy(a, src, len(p), first, steps)
        toks_b, lg_b = decode_greedy(b, dst, len(p), first, steps)
        a.pool.layout.check_compatible(b.pool.layout)
        assert toks_a == toks_b
        assert all(torch.equal(x, y) for x, y in zip(lg_a, lg_b))
        a.pool.free(src)
        b.pool.free(dst)


@pytest.mark.timeout(60)
def test_hnd_pool_gives_same_tokens(make_engine: Callable[..., Engine], random_prompts: Prompts) -> None:
    nhd, hnd = make_engine(block_size=4), make_engine(block_size=4, hnd=True)
    assert hnd.pool.layout.token_order.value == "HND"
    for p in random_prompts(4, seed=16, lo=3, hi=30):
        params = SamplingParams(max_tokens=8)
        assert nhd.generate(p, params, chunk_size=5) == hnd.generate(p, params, chunk_size=5)


@pytest.mark.timeout(60)
def test_prefix_reuse_with_num_cached(make_engine: Callable[..., Engine], random_prompts: Prompts) -> None:
    e = make_engine(num_blocks=32, block_size=4)
    p = random_prompts(1, seed=14, lo=30, hi=30)[0]
    b = e.pool.alloc(e.blocks_needed(len(p)))
    full = e.prefill(p, b, chunk_size=12)
    again = e.prefill(p, b, chunk_size=12, num_cached=12)  # recompute everything after token 12
    assert torch.equal(full, again)


@pytest.mark.timeout(60)
def test_bf16_model_runs_close_to_float32(tiny: CausalLM, random_prompts: Prompts) -> None:
    m16 = CausalLM.from_seed(ModelConfig.preset("tiny", dtype="bfloat16"), seed=1234)
    e16 = Engine(m16, KVPool.allocate(m16.kv_layout(4), 32))
    e32 = Engine(tiny, KVPool.allocate(tiny.kv_layout(4, "float32"), 32))
    assert e16.pool.layout.dtype == "bfloat16"
    for p in random_prompts(3, seed=15, lo=5, hi=20):
        b16, b32 = e16.pool.alloc(5), e32.pool.alloc(5)
        l16, l32 = e16.prefill(p, b16), e32.prefill(p, b32)
        assert l16.dtype == torch.float32
        assert float((l16 - l32).abs().max()) < 0.5
        lg = e16.decode_step([(b16, len(p), 3)])
        assert torch.isfinite(lg).all()
        e16.pool.free(b16)
        e32.pool.free(b32)


@pytest.mark.timeout(30)
def test_errors(make_engine: Callable[..., Engine], tiny: CausalLM) -> None:
    e = make_engine(num_blocks=8, block_size=4)
    with pytest.raises(PoolError):
        e.prefill(list(range(10)), [0, 1])  # 2 blocks hold 8 tokens
    with pytest.raises(ConfigError):
        e.prefill([], [0])
    with pytest.raises(ConfigError):
        e.decode_step([([0], 4, 1)])  # position 4 needs a second block
    other = KVLayout.vllm_flash(3, 2, 16, 4, "float32")
    with pytest.raises(ConfigError):
        Engine(tiny, KVPool.allocate(other, 4))
    assert e.blocks_needed(0) == 0 and e.blocks_needed(4) == 1 and e.blocks_needed(5) == 2


@pytest.mark.timeout(30)
def test_from_seed_is_deterministic_and_leaves_global_rng(tiny: CausalLM) -> None:
    state = torch.get_rng_state()
    again = CausalLM.from_seed("tiny", seed=1234)
    assert torch.equal(state, torch.get_rng_state())
    assert all(torch.equal(a, b) for a, b in zip(tiny.state_dict().values(), again.state_dict().values()))
    other = CausalLM.from_seed("tiny", seed=1235)
    assert not torch.equal(other.lm_head.weight, tiny.lm_head.weight)


@pytest.mark.timeout(30)
def test_sampling_seeded_topk_topp() -> None:
    logits = torch.randn(258, generator=torch.Generator().manual_seed(0)) * 3
    assert sample_token(logits, SamplingParams()) == int(logits.argmax())
    p = SamplingParams(temperature=0.8, seed=42)
    g = torch.Generator()
    draws = [sample_token(logits, p, i, g) for i in range(50)]
    assert draws == [sample_token(logits, p, i, torch.Generator()) for i in range(50)]
    assert len(set(draws)) > 3
    k3 = SamplingParams(temperature=2.0, top_k=3, seed=1)
    top3 = set(torch.topk(logits, 3).indices.tolist())
    assert {sample_token(logits, k3, i, g) for i in range(60)} <= top3
    tp = SamplingParams(temperature=1.0, top_p=1e-6, seed=1)
    assert {sample_token(logits, tp, i, g) for i in range(20)} == {int(logits.argmax())}
    assert SamplingParams.from_dict(k3.to_dict()) == k3
    with pytest.raises(ConfigError):
        SamplingParams(top_p=0.0)


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pool_and_model_match_cpu(random_prompts: Prompts) -> None:
    cpu = CausalLM.from_seed("tiny", seed=1234)
    gpu = CausalLM.from_seed("tiny", seed=1234).to("cuda")
    e_cpu = Engine(cpu, KVPool.allocate(cpu.kv_layout(4, "float32"), 64))
    e_gpu = Engine(gpu, KVPool.allocate(gpu.kv_layout(4, "float32"), 64, device="cuda"))
    for p in random_prompts(6, seed=17, lo=3, hi=30):
        b_cpu, b_gpu = e_cpu.pool.alloc(12), e_gpu.pool.alloc(12)
        l_cpu, l_gpu = e_cpu.prefill(p, b_cpu, chunk_size=8), e_gpu.prefill(p, b_gpu, chunk_size=8)
        assert float((l_cpu - l_gpu.cpu()).abs().max()) < 1e-3
        d_cpu = e_cpu.decode_step([(b_cpu, len(p), 5)])
        d_gpu = e_gpu.decode_step([(b_gpu, len(p), 5)])
        assert float((d_cpu - d_gpu.cpu()).abs().max()) < 1e-3
        e_cpu.pool.free(b_cpu)
        e_gpu.pool.free(b_gpu)
