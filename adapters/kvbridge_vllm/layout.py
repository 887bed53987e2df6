"""vLLM's paged KV cache tensors -> a kvbridge layout and pool, and the geometry both sides compare.

vLLM hands ``register_kv_caches`` one tensor per attention layer. Their physical order
depends on the attention backend:

* CPU (``CPU_ATTN``, layout ``LBHNC``): ``(num_blocks, num_kv_heads, block_size, 2 * head_dim)``
  whose memory is ``(num_blocks, num_kv_heads, 2 * block_size, head_dim)``: per block and
  head, ``block_size`` K rows then ``block_size`` V rows. kvbridge's KVLayout has no order
  with K and V interleaved per head inside a block, so a block is moved as one opaque part
  (a one-part layout, ``KVLayout.mla`` with ``latent_dim = 2 * num_kv_heads * head_dim``):
  the bytes of a block are the same on both sides; the geometry below, checked at first
  contact, says what they mean.
* FlashAttention-style ``(2, num_blocks, block_size, num_kv_heads, head_dim)``: ``KVLayout.vllm_flash``.
* FlashInfer-style ``(num_blocks, 2, block_size, num_kv_heads, head_dim)``: ``KVLayout.flashinfer``.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from kvbridge import KVLayout, KVPool
from kvbridge.errors import ConfigError, LayoutMismatch

__all__ = ["Geometry", "geometry_from_spec", "pool_from_kv_caches", "layer_index"]

Geometry = dict[str, Any]   # JSON-safe: travels in kv_transfer_params


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def layer_index(name: str) -> int:
    """``model.layers.3.self_attn.attn`` -> 3 (the last integer component of a layer name)."""
    nums = re.findall(r"\.(\d+)\.", f".{name}.")
    if not nums:
        raise ConfigError(f"cannot tell the layer index of attention layer {name!r}")
    return int(nums[-1])


def geometry_from_spec(vllm_config: Any, kv_cache_config: Any) -> Geometry:
    """What the scheduler knows of its own cache (no tensors there): from the KV cache spec."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        raise ConfigError(f"kvbridge's vLLM connector supports models with one KV cache group, got {len(groups)}"
                          " (hybrid attention / sliding-window mixes are not supported)")
    spec = groups[0].kv_cache_spec
    return {"layers": len(groups[0].layer_names), "kv_heads": int(spec.num_kv_heads),
            "head_dim": int(spec.head_size), "block_size": int(spec.block_size), "dtype": _dtype_name(spec.dtype),
            "tp_size": int(vllm_config.parallel_config.tensor_parallel_size)}


def pool_from_kv_caches(kv_caches: dict[str, torch.Tensor], vllm_config: Any,
                        cpu_backend: bool) -> tuple[KVPool, list[str], Geometry]:
    """Wrap vLLM's per-layer tensors (no copy) as an engine-allocated pool.

    Returns the pool, the layer names in layer order, and the geometry."""
    if not kv_caches:
        raise ConfigError("register_kv_caches got no KV cache tensors")
    names = sorted(kv_caches, key=layer_index)
    tensors = [kv_caches[n] for n in names]
    first = tensors[0]
    if any(t.shape != first.shape or t.dtype != first.dtype for t in tensors):
        raise LayoutMismatch("kvbridge's vLLM connector needs every attention layer's cache to have one shape "
                             f"and dtype; got {sorted({(tuple(t.shape), str(t.dtype)) for t in tensors})}")
    dtype = _dtype_name(first.dtype)
    block_size = int(vllm_config.cache_config.block_size)
    L = len(tensors)
    if cpu_backend:
        if first.dim() != 4:
            raise LayoutMismatch(f"vLLM CPU cache of shape {tuple(first.shape)}: expected "
                                 "(num_blocks, num_kv_heads, block_size, 2 * head_dim)")
        nb, heads, bs, two_d = first.shape
        head_dim = two_d // 2
        layout = KVLayout.mla(L, latent_dim=heads * two_d, block_size=bs, dtype=dtype)
        bufs = [t.view(nb, bs, heads * two_d) for t in tensors]
        order = "cpu_lbhnc"
    else:
        if first.dim() != 5:
            raise LayoutMismatch(f"vLLM cache of shape {tuple(first.shape)}: expected 5 dimensions "
                                 "(2, blocks, block_size, heads, dim) or (blocks, 2, block_size, heads, dim)")
        if first.shape[0] == 2:
            _, nb, bs, heads, head_dim = first.shape
            layout = KVLayout.vllm_flash(L, heads, head_dim, bs, dtype)
            order = "kv_first_nhd"
        elif first.shape[1] == 2:
            nb, _, bs, heads, head_dim = first.shape
            layout = KVLayout.flashinfer(L, heads, head_dim, bs, dtype)
            order = "block_first_nhd"
        else:
            raise LayoutMismatch(f"vLLM cache of shape {tuple(first.shape)}: no K/V axis of size 2 where expected")
        bufs = tensors
    if bs != block_size:
        raise LayoutMismatch(f"vLLM's cache blocks hold {bs} tokens but cache_config.block_size is {block_size}; "
                             "kvbridge moves whole scheduler blocks, so the two must be equal")
    for t in bufs:
        if not t.is_contiguous():
            raise LayoutMismatch("vLLM's KV cache tensors are not contiguous; kvbridge needs them to be")
    pool = KVPool.wrap(layout, bufs, allocator="engine")
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    geometry = {"layers": L, "kv_heads": int(heads), "head_dim": int(head_dim), "block_size": int(bs),
                "dtype": dtype, "tp_size": tp, "order": order, "layout_hash": layout.compat_hash}
    return pool, names, geometry


def compare(mine: Geometry, theirs: Geometry) -> list[str]:
    """Fields of ``mine`` that ``theirs`` gives otherwise, or not at all."""
    return [f"{k}: here {mine[k]!r}, producer {theirs[k]!r}" if k in theirs else f"{k}: here {mine[k]!r}, producer "
            "does not say" for k in sorted(mine) if k not in theirs or mine[k] != theirs[k]]
