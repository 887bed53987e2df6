"""Fixtures for the reference engine tests: the tiny seeded model and pools for it."""

from __future__ import annotations

import random
from typing import Callable, Iterator

import pytest
import torch

from kvbridge.pool import KVPool
from kvbridge.workers.engine import Engine
from kvbridge.workers.model import CausalLM


@pytest.fixture(scope="session")
def tiny() -> CausalLM:
    return CausalLM.from_seed("tiny", seed=1234)


@pytest.fixture
def make_engine(tiny: CausalLM) -> Callable[..., Engine]:
    def make(num_blocks: int = 64, block_size: int = 4, dtype: str = "float32",
             model: CausalLM | None = None, **kw: object) -> Engine:
        m = model or tiny
        return Engine(m, KVPool.allocate(m.kv_layout(block_size, dtype, **kw), num_blocks))
    return make


def _random_prompts(n: int, seed: int, lo: int = 1, hi: int = 24, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _copy_blocks(src: KVPool, src_ids: list[int], dst: KVPool, dst_ids: list[int]) -> None:
    """What a transport does: copy each block's K and V, layer by layer, through pool.block views."""
    for layer in range(src.layout.num_layers):
        for s, d in zip(src_ids, dst_ids):
            sk, sv = src.block(layer, s)
            dk, dv = dst.block(layer, d)
            dk.copy_(sk)
            dv.copy_(sv)


@pytest.fixture
def random_prompts() -> Callable[..., list[list[int]]]:
    return _random_prompts


@pytest.fixture
def copy_blocks() -> Callable[[KVPool, list[int], KVPool, list[int]], None]:
    return _copy_blocks


@pytest.fixture(autouse=True)
def _seed_and_one_thread() -> Iterator[None]:
    """The tiny model gains nothing from threads, and on a loaded 2-core box torch's
    spinning worker threads slow it down 5-10x; restore the caller's setting after."""
    torch.manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
