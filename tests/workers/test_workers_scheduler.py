"""Continuous batching, chunked-prefill scheduling, disaggregated decode, tokenizers."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from kvbridge.errors import PoolError
from kvbridge.pool import KVPool
from kvbridge.workers.engine import Engine, FinishReason, Request, RequestState, Scheduler
from kvbridge.workers.sampling import SamplingParams
from kvbridge.workers.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

Prompts = Callable[..., list[list[int]]]
Copy = Callable[[KVPool, list[int], KVPool, list[int]], None]


def fake_clock() -> Callable[[], float]:
    c = itertools.count()
    return lambda: float(next(c))


def reference(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    return engine.generate(prompt, params, eos_id=engine.model.config.eos_id)


@pytest.mark.timeout(60)
def test_continuous_batching_matches_one_at_a_time(make_engine: Callable[..., Engine],
                                                   random_prompts: Prompts) -> None:
    e, ref = make_engine(num_blocks=256), make_engine(num_blocks=64)
    prompts = random_prompts(12, seed=20, lo=1, hi=40)
    params = [SamplingParams(max_tokens=1 + (i * 5) % 13) for i in range(len(prompts))]
    sched = Scheduler(e, clock=fake_clock())
    reqs = [Request(p, sp) for p, sp in zip(prompts, params)]
    for r in reqs[:6]:
        sched.add_request(r)
    for _ in range(3):
        sched.step()
    sched.run(reqs[6:])  # arrive while the first ones are decoding
    for r, p, sp in zip(reqs, prompts, params):
        assert r.finished and r.output_ids == reference(ref, p, sp)
        assert r.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        assert r.arrival_time is not None and r.ttft is not None and r.ttft > 0
        assert r.token_times == sorted(r.token_times) and len(r.token_times) == len(r.output_ids)
        if len(r.output_ids) > 1:
            assert r.tpot is not None and r.tpot > 0 and len(r.itl) == len(r.output_ids) - 1
    assert e.pool.num_free == e.pool.num_blocks


@pytest.mark.timeout(60)
def test_chunked_prefill_interleaves_with_decode(make_engine: Callable[..., Engine],
                                                 random_prompts: Prompts) -> None:
    e, ref = make_engine(num_blocks=256), make_engine(num_blocks=64)
    short = random_prompts(3, seed=21, lo=2, hi=6)
    long = random_prompts(3, seed=22, lo=40, hi=60)
    sched = Scheduler(e, chunk_size=8, clock=fake_clock())
    reqs = [sched.add_request(Request(p, SamplingParams(max_tokens=12))) for p in short]
    sched.step()  # some short prompts prefilled (8-token budget; the first chunk always runs)
    reqs += [sched.add_request(Request(p, SamplingParams(max_tokens=6))) for p in long]
    interleaved = False
    while sched.has_work:
        out = sched.step()
        decoding = any(r in out and len(r.output_ids) > 1 for r in reqs[:3])
        partial = any(r.state is RequestState.PREFILL and 0 < r.num_computed for r in reqs[3:])
        interleaved |= decoding and partial
    assert interleaved, "decode steps should run between the prompt chunks of long requests"
    for r in reqs:
        assert r.output_ids == reference(ref, r.prompt_ids, r.params)


@pytest.mark.timeout(60)
def test_scheduler_prefill_kv_is_bitwise_engine_prefill(make_engine: Callable[..., Engine],
                                                       random_prompts: Prompts) -> None:
    """The prefill-worker use: max_tokens=1, keep_blocks; the KV equals Engine.prefill's."""
    e, ref = make_engine(num_blocks=256), make_engine(num_blocks=64)
    sched = Scheduler(e, chunk_size=16, max_batched_tokens=24)
    reqs = [sched.add_request(Request(p, SamplingParams(max_tokens=1), keep_blocks=True))
            for p in random_prompts(5, seed=23, lo=10, hi=50)]
    sched.run()
    for r in reqs:
        assert r.finished and len(r.output_ids) == 1 and r.block_ids
        b = ref.pool.alloc(len(r.block_ids))
        first = int(ref.prefill(r.prompt_ids, b, chunk_size=16).argmax())
        assert first == r.output_ids[0]
        for layer in range(e.model.config.num_layers):
            for x, y in zip(e.pool.layer_kv(layer), ref.pool.layer_kv(layer)):
                n = len(r.prompt_ids)
                assert torch.equal(x[r.block_ids].flatten(0, 1)[:n], y[b].flatten(0, 1)[:n])
        ref.pool.free(b)
        e.pool.free(r.block_ids)
    assert e.pool.num_free == e.pool.num_blocks


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sampled", [False, True])
def test_disaggregated_decode_equals_colocated(make_engine: Callable[..., Engine], random_prompts: Prompts,
                                               copy_blocks: Copy, sampled: bool) -> None:
    prompts = random_prompts(6, seed=24, lo=3, hi=40)

    def params(i: int) -> SamplingParams:
        if sampled:
            return SamplingParams(max_tokens=10, temperature=0.9, top_k=50, top_p=0.95, seed=100 + i)
        return SamplingParams(max_tokens=10)

    colo = Scheduler(make_engine(num_blocks=128), chunk_size=8)
    want = colo.run([Request(p, params(i)) for i, p in enumerate(prompts)])

    pre = Scheduler(make_engine(num_blocks=128), chunk_size=8)
    pre_reqs = [Request(p, SamplingParams(**{**params(i).to_dict(), "max_tokens": 1}), keep_blocks=True)
                for i, p in enumerate(prompts)]
    pre.run(pre_reqs)
    dec_engine = make_engine(num_blocks=128)
    dec_engine.pool.alloc(7)  # different block ids on the decode side
    dec = Scheduler(dec_engine, clock=fake_clock())
    got = []
    for i, (p, r) in enumerate(zip(prompts, pre_reqs)):
        n_blocks = dec_engine.blocks_needed(len(p))
        dst = dec_engine.pool.alloc(n_blocks)
        copy_blocks(pre.engine.pool, r.block_ids[:n_blocks], dec_engine.pool, dst)
        pre.engine.pool.free(r.block_ids)
        got.append(dec.add_prefilled(Request(p, params(i)), dst, len(p), r.output_ids[0],
                                     first_token_time=-1.0))
    dec.run()
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert all(r.token_times[0] == -1.0 and r.finished for r in got)
    assert dec_engine.pool.num_free == dec_engine.pool.num_blocks - 7


@pytest.mark.timeout(60)
def test_stop_tokens_eos_and_ignore_eos(make_engine: Callable[..., Engine]) -> None:
    e = make_engine(num_blocks=64)
    p = [5, 6, 7, 8, 9]
    free_run = e.generate(p, SamplingParams(max_tokens=12))
    stop = free_run[3]
    cut = free_run.index(stop) + 1
    r = Scheduler(e).run([Request(p, SamplingParams(max_tokens=12, stop_token_ids=(stop,)))])[0]
    assert r.output_ids == free_run[:cut] and r.finish_reason is FinishReason.STOP
    s = Scheduler(e, eos_id=stop)
    r1, r2 = s.run([Request(p, SamplingParams(max_tokens=12)),
                    Request(p, SamplingParams(max_tokens=12, ignore_eos=True))])
    assert r1.output_ids == free_run[:cut] and r2.output_ids == free_run
    assert r2.finish_reason is FinishReason.LENGTH
    assert e.pool.num_free == e.pool.num_blocks


@pytest.mark.timeout(60)
def test_small_pool_admits_as_blocks_free(make_engine: Callable[..., Engine], random_prompts: Prompts) -> None:
    e, ref = make_engine(num_blocks=20, block_size=4), make_engine(num_blocks=64)
    prompts = random_prompts(6, seed=25, lo=20, hi=24)
    sched = Scheduler(e, chunk_size=8)
    reqs = [sched.add_request(Request(p, SamplingParams(max_tokens=8))) for p in prompts]
    peak = 0
    while sched.has_work:
        sched.step()
        peak = max(peak, len(sched.running))
        assert e.pool.num_free >= 0
    assert 1 <= peak <= 2  # each needs 7-8 of the 20 blocks
    for r in reqs:
        assert r.output_ids == reference(ref, r.prompt_ids, r.params)
    assert e.pool.num_free == e.pool.num_blocks
    with pytest.raises(PoolError):
        sched.add_request(Request(list(range(100)), SamplingParams(max_tokens=1)))


@pytest.mark.timeout(60)
def test_abort_frees_blocks(make_engine: Callable[..., Engine]) -> None:
    e = make_engine(num_blocks=64)
    sched = Scheduler(e, chunk_size=4)
    a = sched.add_request(Request(list(range(30)), SamplingParams(max_tokens=20)))
    b = sched.add_request(Request(list(range(10)), SamplingParams(max_tokens=20)))
    sched.step()
    assert a.state is RequestState.PREFILL and a.block_ids
    assert sched.abort(a.request_id) and sched.abort(b.request_id)
    assert not sched.abort("nope")
    ready = e.pool.alloc(3)
    c = sched.add_prefilled(Request([1, 2, 3]), ready, 3, first_token=9)
    assert sched.abort(c.request_id)
    for r in (a, b, c):
        assert r.finished and r.finish_reason is FinishReason.ABORTED
    assert not sched.has_work and e.pool.num_free == e.pool.num_blocks


@pytest.mark.timeout(60)
def test_abort_during_a_step_takes_effect_after_it(make_engine: Callable[..., Engine]) -> None:
    e = make_engine(num_blocks=64)
    sched = Scheduler(e)
    r = sched.add_request(Request(list(range(12)), SamplingParams(max_tokens=50)))
    sched.step()
    real_forward = e.forward

    def forward_then_abort(pieces):  # type: ignore[no-untyped-def]
        assert sched.abort(r.request_id)  # as another thread would, mid-step
        assert not r.finished and r.block_ids  # blocks stay while the step may use them
        return real_forward(pieces)

    e.forward = forward_then_abort  # type: ignore[method-assign]
    assert r in sched.step()
    assert r.finished and r.finish_reason is FinishReason.ABORTED and not r.block_ids
    assert e.pool.num_free == e.pool.num_blocks and not sched.has_work


@pytest.mark.timeout(60)
def test_add_prefilled_from_another_thread(make_engine: Callable[..., Engine], copy_blocks: Copy) -> None:
    src, dst = make_engine(num_blocks=64), make_engine(num_blocks=64)
    sched = Scheduler(dst)
    prompts = [[i, i + 1, i + 2, i + 3, i + 4] for i in range(8)]
    firsts = []
    for p in prompts:
        b = src.pool.alloc(2)
        firsts.append(int(src.prefill(p, b).argmax()))
        src.pool.free(b)

    def feed() -> None:
        for p, f in zip(prompts, firsts):
            b = src.pool.alloc(2)
            src.prefill(p, b)
            d = dst.pool.alloc(2)
            copy_blocks(src.pool, b, dst.pool, d)
            src.pool.free(b)
            added.append(sched.add_prefilled(Request(p, SamplingParams(max_tokens=5)), d, len(p), f))

    added: list[Request] = []

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while (t.is_alive() or sched.has_work) and time.monotonic() < deadline:
        if not sched.step():
            time.sleep(0.001)
    t.join(timeout=5)
    assert len(added) == len(prompts) and not sched.has_work
    for r, p, f in zip(added, prompts, firsts):
        assert r.finished and r.output_ids[0] == f
        assert r.output_ids == src.generate(p, SamplingParams(max_tokens=5), eos_id=257)
    assert dst.pool.num_free == dst.pool.num_blocks


@pytest.mark.timeout(30)
def test_byte_tokenizer() -> None:
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer)
    ids = tok.encode("héllo ✓")
    assert ids[0] == tok.bos_id == 256 and tok.eos_id == 257 and max(ids[1:]) < 256
    assert tok.decode(ids + [tok.eos_id]) == "héllo ✓"
    assert tok.decode([256, 104, 257], skip_special=False) == "<bos>h<eos>"
    assert tok.encode("a", add_bos=False) == [97]


@pytest.mark.timeout(60)
def test_hf_tokenizer_from_local_dir(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.save_pretrained(str(tmp_path))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 5)
    assert tok.encode("hello world") == [0, 3, 4]
    assert tok.encode("hello zzz", add_bos=False) == [3, 2]
    assert "world" in tok.decode([0, 3, 4, 1])
