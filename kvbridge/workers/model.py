"""A Llama-architecture decoder in plain torch, with paged attention over a :class:`KVPool`.

RMSNorm, rotary embeddings (HF ``rotate_half`` convention, optional ``llama3``
scaling), grouped-query attention, SwiGLU MLP, tied or untied ``lm_head``, and
optional q/k/v biases (Qwen2). Parameter names are those of HF
``LlamaForCausalLM`` (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``),
so a state dict moves between the two unchanged.

Weights are seeded random by default (:meth:`CausalLM.from_seed`) or read from a
local HF directory (:func:`load_hf_checkpoint`, offline). The model never owns KV
memory: :meth:`CausalLM.forward` takes a list of :class:`SeqPiece` (block table,
tokens already cached, new tokens), writes the new tokens' K (after rotary) and V
into the pool's blocks, and attends over what the blocks hold.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..layout import DTYPES, KVLayout, TokenOrder

__all__ = ["ModelConfig", "PRESETS", "CausalLM", "SeqPiece", "load_hf_checkpoint",
           "save_hf_checkpoint", "hf_config_dict"]

BYTE_VOCAB = 258  # bytes 0-255, BOS=256, EOS=257 (see tokenizer.ByteTokenizer)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama/Qwen2-style decoder."""

    vocab_size: int = BYTE_VOCAB
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None  # HF rope_scaling / rope_parameters (llama3)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: True
    o_bias: bool = False  # Llama attention_bias=True biases o_proj too
    mlp_bias: bool = False
    max_position_embeddings: int = 8192
    bos_id: Optional[int] = 256
    eos_id: Optional[int] = 257
    dtype: str = "float32"  # compute/weight dtype: float32, bfloat16 or float16
    model_type: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError("head_dim must be even for rotary embeddings")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"model dtype {self.dtype!r} not one of float32, bfloat16, float16")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        """A named preset (``tiny``, ``small``, ``bench``) with optional field overrides."""
        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; one of {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides)

    def kv_layout(self, block_size: int = 16, dtype: Optional[str] = None, **kw: Any) -> KVLayout:
        """The vLLM-FlashAttention (NHD) layout of this model's KV cache."""
        return KVLayout.vllm_flash(self.num_layers, self.num_kv_heads, self.head_dim, block_size,
                                   dtype=dtype or self.dtype, **kw)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown ModelConfig fields {sorted(unknown)}")
        return cls(**d)


PRESETS: dict[str, ModelConfig] = {
    # tests: 0.11M parameters; 2 layers, hidden 64, GQA 4/2, head_dim 16, byte vocab
    "tiny": ModelConfig(),
    # examples and end-to-end tests: 2.9M parameters; a 2,048-token prefill ~0.27 s on one core
    "small": ModelConfig(hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8,
                         num_kv_heads=2, head_dim=32),
    # benchmarks: 9.2M parameters; a 2,048-token prefill ~0.67 s on one core, decode ~4 ms/token
    "bench": ModelConfig(hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=8,
                         num_kv_heads=2, head_dim=64),
}


@dataclass
class SeqPiece:
    """New tokens of one sequence for one forward pass.

    ``block_table[i]`` holds tokens ``i*block_size .. (i+1)*block_size-1``; the
    first ``num_cached`` tokens' KV is already in the pool; ``token_ids`` sit at
    positions ``num_cached ..``. The table must cover ``num_cached + len(token_ids)``.
    """

    block_table: Sequence[int]
    num_cached: int
    token_ids: Sequence[int]
    all_logits: bool = field(default=False)  # return logits of every new token, not only the last


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dt)


class Rotary(nn.Module):
    """cos/sin tables of HF Llama rotary embeddings for given positions."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.head_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        sc = cfg.rope_scaling or {}
        if sc.get("rope_type", sc.get("type", "default")) == "llama3":
            inv = _llama3_inv_freq(inv, sc)
        elif sc.get("rope_type", sc.get("type", "default")) not in ("default", None):
            raise ConfigError(f"rope scaling {sc!r} not supported (default and llama3 are)")
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        freqs = positions.to(torch.float32)[:, None] * inv.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _llama3_inv_freq(inv: torch.Tensor, sc: dict[str, Any]) -> torch.Tensor:
    factor = float(sc["factor"])
    lo, hi = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
    old = float(sc["original_max_position_embeddings"])
    lo_wl, hi_wl = old / lo, old / hi
    wl = 2 * math.pi / inv
    out = torch.where(wl > lo_wl, inv / factor, inv)
    smooth = (old / wl - lo) / (hi - lo)
    smoothed = (1 - smooth) * out / factor + smooth * out
    mid = ~(wl < hi_wl) & ~(wl > lo_wl)
    return torch.where(mid, smoothed, out)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, d); cos/sin: (T, d)."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = self.hd ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: "_PagedCache", layer: int) -> torch.Tensor:
        T = x.shape[0]
        q = _apply_rotary(self.q_proj(x).view(T, self.nh, self.hd), cos, sin)
        k = _apply_rotary(self.k_proj(x).view(T, self.nkv, self.hd), cos, sin)
        v = self.v_proj(x).view(T, self.nkv, self.hd)
        cache.write(layer, k, v)
        out = cache.attend(layer, q, self.scale)
        y: torch.Tensor = self.o_proj(out.reshape(T, self.nh * self.hd))
        return y


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        b = cfg.mlp_bias
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=b)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=b)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return y


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: "_PagedCache", layer: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer)
        y: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return y


class _Body(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = Rotary(cfg)


class _PagedCache:
    """Scatter/gather of one forward pass's K/V into a pool's blocks, and the attention over them.

    Pieces with one new token (decode) are attended together, padded to the longest
    context; each longer piece (a prompt chunk) is attended on its own.
    """

    def __init__(self, pool: Any, pieces: Sequence[SeqPiece], dtype: torch.dtype) -> None:
        L = pool.layout
        self.pool, self.bs, self.dtype = pool, L.block_size, dtype
        self.hnd = L.token_order is TokenOrder.HND
        self.pieces = pieces
        dev = pool.device
        blk: list[int] = []
        slot: list[int] = []
        self.spans: list[tuple[int, int]] = []  # (start, length) of each piece in the flat batch
        start = 0
        for p in pieces:
            n = len(p.token_ids)
            for pos in range(p.num_cached, p.num_cached + n):
                blk.append(p.block_table[pos // self.bs])
                slot.append(pos % self.bs)
            self.spans.append((start, n))
            start += n
        self.w_blk = torch.tensor(blk, dtype=torch.long, device=dev)
        self.w_slot = torch.tensor(slot, dtype=torch.long, device=dev)
        self.dec = [i for i, p in enumerate(pieces) if len(p.token_ids) == 1]
        self.pre = [i for i, p in enumerate(pieces) if len(p.token_ids) != 1]
        if self.dec:  # padded gather index for the decode group
            ctx = [pieces[i].num_cached + 1 for i in self.dec]
            nb = -(-max(ctx) // self.bs)
            tab = torch.zeros(len(self.dec), nb, dtype=torch.long)
            for r, i in enumerate(self.dec):
                need = -(-ctx[r] // self.bs)
                tab[r, :need] = torch.as_tensor(list(pieces[i].block_table[:need]), dtype=torch.long)
            self.d_tab = tab.to(dev)
            self.d_len = max(ctx)
            lens = torch.tensor(ctx, device=dev)
            self.d_mask = torch.arange(self.d_len, device=dev)[None, :] < lens[:, None]  # (B, Lmax)
            self.d_rows = torch.tensor([self.spans[i][0] for i in self.dec], dtype=torch.long, device=dev)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        K, V = self.pool.layer_kv(layer)
        if self.hnd:
            K[self.w_blk, :, self.w_slot] = k.to(K.dtype)
            V[self.w_blk, :, self.w_slot] = v.to(V.dtype)
        else:
            K[self.w_blk, self.w_slot] = k.to(K.dtype)
            V[self.w_blk, self.w_slot] = v.to(V.dtype)

    def _gather(self, X: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
        """Tokens 0..n-1 of the blocks ``table`` (..., nb) as (..., n, kv_heads, d) in model dtype."""
        g = X[table]  # (..., nb, bs, h, d) or (..., nb, h, bs, d)
        if self.hnd:
            g = g.transpose(-3, -2)
        g = g.flatten(-4, -3)[..., :n, :, :]
        return g.to(self.dtype)

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q: (T, heads, d) of the flat batch -> (T, heads, d)."""
        K, V = self.pool.layer_kv(layer)
        out = torch.empty_like(q)
        nh, d = q.shape[1], q.shape[2]
        for i in self.pre:
            p, (s, n) = self.pieces[i], self.spans[i]
            ctx = p.num_cached + n
            tab = torch.as_tensor(list(p.block_table[: -(-ctx // self.bs)]), dtype=torch.long, device=q.device)
            k, v = self._gather(K, tab, ctx), self._gather(V, tab, ctx)  # (ctx, kvh, d)
            qh = q[s:s + n].transpose(0, 1)[None]  # (1, nh, n, d): 4-D takes the flash kernel on CPU
            g = nh // k.shape[1]  # GQA: query head h reads kv head h // g (HF repeat_kv)
            kh = k.transpose(0, 1).repeat_interleave(g, dim=0)[None]
            vh = v.transpose(0, 1).repeat_interleave(g, dim=0)[None]
            if p.num_cached == 0:
                o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
            else:
                qpos = torch.arange(p.num_cached, ctx, device=q.device)
                mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
                o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
            out[s:s + n] = o[0].transpose(0, 1)
        if self.dec:
            B, kvh = len(self.dec), K.shape[-2] if not self.hnd else K.shape[1]
            k = self._gather(K, self.d_tab, self.d_len)  # (B, L, kvh, d)
            v = self._gather(V, self.d_tab, self.d_len)
            qd = q[self.d_rows].view(B, kvh, nh // kvh, d)  # (B, kvh, g, d)
            scores = torch.einsum("bhgd,blhd->bhgl", qd, k) * scale
            scores = scores.masked_fill(~self.d_mask[:, None, None, :], float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            o = torch.einsum("bhgl,blhd->bhgd", probs, v).reshape(B, nh, d)
            out[self.d_rows] = o
        return out


class CausalLM(nn.Module):
    """Llama/Qwen2-style decoder with paged KV. Parameter names follow HF ``LlamaForCausalLM``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        with torch.random.fork_rng(devices=[]):  # torch's default init must not move the caller's RNG
            self.model = _Body(cfg)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.to(cfg.torch_dtype)
        self.model.rotary_emb.inv_freq = self.model.rotary_emb.inv_freq.float()
        self.eval()
        self.requires_grad_(False)

    @classmethod
    def from_seed(cls, cfg: Union[ModelConfig, str], seed: int = 0) -> "CausalLM":
        """Seeded random weights, identical in every process for the same (cfg, seed).

        Scales keep activations O(1) and logits spread (std ~2), so greedy decoding
        is not degenerate: embeddings N(0, 1), linear weights N(0, 1/fan_in),
        biases N(0, 0.1), norm weights 1 + N(0, 0.1), lm_head N(0, 4/hidden). (With tied
        embeddings the lm_head is the N(0, 1) embedding and greedy output tends to repeat
        the current token; the presets are untied.) The caller's torch RNG is untouched.
        """
        if isinstance(cfg, str):
            cfg = ModelConfig.preset(cfg)
        m = cls(cfg)
        g = torch.Generator().manual_seed(seed)
        for name, p in m.named_parameters():  # stable order; tied lm_head appears once
            shape = p.shape
            if name.endswith("embed_tokens.weight"):
                w = torch.randn(shape, generator=g)
            elif name == "lm_head.weight":
                w = torch.randn(shape, generator=g) * (2.0 / math.sqrt(cfg.hidden_size))
            elif name.endswith("norm.weight"):
                w = 1.0 + 0.1 * torch.randn(shape, generator=g)
            elif name.endswith(".bias"):
                w = 0.1 * torch.randn(shape, generator=g)
            else:
                w = torch.randn(shape, generator=g) / math.sqrt(shape[1])
            p.copy_(w.to(p.dtype))
        return m

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def kv_layout(self, block_size: int = 16, dtype: Optional[str] = None, **kw: Any) -> KVLayout:
        return self.config.kv_layout(block_size, dtype, **kw)

    def check_pool(self, pool: Any) -> None:
        """Raise :class:`ConfigError` unless ``pool`` can hold this model's KV."""
        L, c = pool.layout, self.config
        if pool.device != self.device:
            raise ConfigError(f"pool on {pool.device}, model on {self.device}")
        if L.latent or (L.num_layers, L.num_kv_heads, L.head_dim) != (c.num_layers, c.num_kv_heads, c.head_dim):
            raise ConfigError(f"pool layout ({L.num_layers} layers, {L.num_kv_heads} kv heads, head_dim "
                              f"{L.head_dim}, latent={L.latent}) does not fit model ({c.num_layers}, "
                              f"{c.num_kv_heads}, {c.head_dim})")

    @torch.no_grad()
    def forward(self, pieces: Sequence[SeqPiece], pool: Any) -> torch.Tensor:
        """Run new tokens of several sequences, write their KV into ``pool``, return logits.

        Returns (P, vocab) float32 logits of the last new token of each piece, or,
        when a piece has ``all_logits``, a (sum of lengths, vocab) tensor of all of them.
        """
        dev, dt = self.device, self.config.torch_dtype
        ids: list[int] = []
        pos: list[int] = []
        for p in pieces:
            n = len(p.token_ids)
            if n == 0:
                raise ConfigError("a SeqPiece needs at least one new token")
            if len(p.block_table) * pool.layout.block_size < p.num_cached + n:
                raise ConfigError(f"block table of {len(p.block_table)} blocks cannot hold "
                                  f"{p.num_cached + n} tokens")
            ids.extend(int(t) for t in p.token_ids)
            pos.extend(range(p.num_cached, p.num_cached + n))
        x = self.model.embed_tokens(torch.tensor(ids, dtype=torch.long, device=dev))
        cos, sin = self.model.rotary_emb(torch.tensor(pos, device=dev), dt)
        cache = _PagedCache(pool, pieces, dt)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache, i)
        if not any(p.all_logits for p in pieces):
            x = x[torch.tensor([s + n - 1 for s, n in cache.spans], device=dev)]
        logits: torch.Tensor = self.lm_head(self.model.norm(x))
        return logits.float()


# -- Hugging Face checkpoints -----------------------------------------------------------

def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """A HF ``config.json`` dict (LlamaForCausalLM, or Qwen2ForCausalLM for qkv biases)."""
    qwen = cfg.model_type == "qwen2"
    d: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id, "torch_dtype": cfg.dtype,
    }
    if cfg.rope_scaling:
        d["rope_scaling"] = dict(cfg.rope_scaling)
    if not qwen:
        if cfg.qkv_bias != cfg.o_bias:
            raise ConfigError("a Llama config biases q, k, v and o together; use model_type='qwen2'")
        d["attention_bias"] = cfg.qkv_bias
        d["mlp_bias"] = cfg.mlp_bias
    elif not cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias:
        raise ConfigError("a Qwen2 config has q/k/v biases only")
    return d


def _config_from_hf(d: dict[str, Any], dtype: Optional[str]) -> ModelConfig:
    mt = d.get("model_type", "llama")
    if mt not in ("llama", "qwen2", "mistral"):
        raise ConfigError(f"model_type {mt!r} is not a Llama-architecture model (llama, qwen2, mistral)")
    rp = d.get("rope_parameters") or {}
    theta = float(d.get("rope_theta", rp.get("rope_theta", 10000.0)))
    scaling = d.get("rope_scaling") or ({k: v for k, v in rp.items() if k != "rope_theta"} or None)
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    nh = int(d["num_attention_heads"])
    eos = d.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    qwen = mt == "qwen2"
    if qwen and d.get("use_sliding_window"):
        raise ConfigError("Qwen2 sliding-window attention is not supported")
    want_dtype = dtype or "float32"
    return ModelConfig(
        vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]), num_layers=int(d["num_hidden_layers"]),
        num_heads=nh, num_kv_heads=int(d.get("num_key_value_heads") or nh),
        head_dim=int(d.get("head_dim") or d["hidden_size"] // nh), rope_theta=theta,
        rope_scaling=scaling, rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=True if qwen else bool(d.get("attention_bias", False)),
        o_bias=False if qwen else bool(d.get("attention_bias", False)),
        mlp_bias=bool(d.get("mlp_bias", False)),
        max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
        bos_id=d.get("bos_token_id"), eos_id=eos, dtype=want_dtype, model_type="qwen2" if qwen else "llama")


def load_hf_checkpoint(path: Union[str, os.PathLike[str]], dtype: Optional[str] = None) -> CausalLM:
    """Load a local HF Llama/Qwen2-style directory (``config.json`` + ``*.safetensors``), offline.

    ``dtype`` is the compute dtype (default float32, whatever the checkpoint's).
    """
    from safetensors.torch import load_file

    root = Path(path)
    try:
        d = json.loads((root / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {root / 'config.json'}: {exc}") from None
    cfg = _config_from_hf(d, dtype)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in {root}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model = CausalLM(cfg)
    want = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing, extra = want - set(state), set(state) - want
    extra = {k for k in extra if not k.endswith("rotary_emb.inv_freq")}
    if missing or extra:
        raise ConfigError(f"checkpoint {root} does not match the model: missing {sorted(missing)[:5]}, "
                          f"unexpected {sorted(extra)[:5]}")
    with torch.no_grad():
        params = dict(model.named_parameters())
        for k in want:
            params[k].copy_(state[k].to(params[k].dtype))
    return model


def save_hf_checkpoint(model: CausalLM, path: Union[str, os.PathLike[str]]) -> None:
    """Write ``config.json`` and ``model.safetensors`` that HF transformers and
    :func:`load_hf_checkpoint` both read."""
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(hf_config_dict(model.config), indent=2))
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, str(root / "model.safetensors"), metadata={"format": "pt"})
