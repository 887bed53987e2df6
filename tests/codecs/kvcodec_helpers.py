"""Helpers of the codec tests: pools of every layout kind filled with KV-like values."""

from __future__ import annotations

from typing import Callable

import torch

from kvbridge.layout import KVLayout
from kvbridge.pool import KVPool

# (name, constructor): every physical order kvbridge knows, NHD and HND.
LAYOUTS: dict[str, Callable[..., KVLayout]] = {
    "vllm_flash": lambda dt, bs=4: KVLayout.vllm_flash(3, 2, 16, bs, dt),
    "vllm_flash_hnd": lambda dt, bs=4: KVLayout.vllm_flash(3, 2, 16, bs, dt, hnd=True),
    "flashinfer": lambda dt, bs=4: KVLayout.flashinfer(3, 2, 16, bs, dt),
    "flashinfer_hnd": lambda dt, bs=4: KVLayout.flashinfer(3, 2, 16, bs, dt, hnd=True),
    "split_kv": lambda dt, bs=4: KVLayout.split_kv(3, 2, 16, bs, dt),
    "split_kv_hnd": lambda dt, bs=4: KVLayout.split_kv(3, 2, 16, bs, dt, hnd=True),
    "mla": lambda dt, bs=4: KVLayout.mla(3, 24, bs, dt),
}
FLOAT_DTYPES = ["float32", "float16", "bfloat16"]


def fill_pool(pool: KVPool, seed: int, zero_rows: float = 0.05) -> None:
    """KV-like values: per-head scales spread over 2**-6..2**6, outlier channels, some zero rows."""
    g = torch.Generator().manual_seed(seed)
    for buf in pool.buffers:
        x = torch.randn(buf.shape, generator=g)
        x *= torch.exp2(torch.randint(-6, 7, buf.shape[:-1], generator=g).float()).unsqueeze(-1)
        x[..., 0] *= 8.0  # an outlier channel, as rotary keys have
        x *= (torch.rand(buf.shape[:-1], generator=g) >= zero_rows).float().unsqueeze(-1)
        buf.copy_(x.to(buf.dtype))


def parts_of(pool: KVPool, layer: int, ids: list[int]) -> list[torch.Tensor]:
    """Copies of the parts of blocks ``ids`` of one layer, in canonical part order."""
    kv = pool.layer_kv(layer)
    return [p[torch.tensor(ids)].clone() for p in (kv if isinstance(kv, tuple) else (kv,))]


def make_pool(kind: str = "vllm_flash", dtype: str = "bfloat16", num_blocks: int = 12, seed: int = 0,
              block_size: int = 4) -> KVPool:
    pool = KVPool.allocate(LAYOUTS[kind](dtype, block_size), num_blocks)
    fill_pool(pool, seed)
    return pool


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bitwise equality (NaN payloads and signed zeros included)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    ia = a.contiguous().view(torch.uint8)
    ib = b.contiguous().view(torch.uint8)
    assert torch.equal(ia, ib)
