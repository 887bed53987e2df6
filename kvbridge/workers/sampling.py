"""Sampling parameters and token sampling: greedy, temperature, top-k, top-p, seeded.

A seeded request draws token ``i`` of its output from a generator seeded with
``(seed, i)``, so the same request gives the same tokens whichever process samples
which token (the prefill side samples token 0, the decode side the rest).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Optional, Sequence

import torch

from ..errors import ConfigError

__all__ = ["SamplingParams", "sample_token", "sample_batch", "token_generator"]

_MASK64 = (1 << 63) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` is greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0
    seed: Optional[int] = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError("max_tokens must be >= 1")
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"bad sampling params: temperature={self.temperature}, "
                              f"top_k={self.top_k}, top_p={self.top_p}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown SamplingParams fields {sorted(unknown)}")
        return cls(**{**d, "stop_token_ids": tuple(d.get("stop_token_ids", ()))})


def token_generator(seed: int, index: int, generator: Optional[torch.Generator] = None) -> torch.Generator:
    """A CPU generator seeded for output token ``index`` of a request seeded with ``seed``."""
    g = generator if generator is not None else torch.Generator()
    g.manual_seed((seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) & _MASK64)
    return g


def sample_token(logits: torch.Tensor, params: SamplingParams, index: int = 0,
                 generator: Optional[torch.Generator] = None) -> int:
    """Pick one token from ``logits`` (vocab,) for output position ``index``.

    Seeded requests reseed ``generator`` (a per-request ``torch.Generator``) for
    ``(params.seed, index)``; unseeded ones draw from torch's default generator.
    """
    if params.greedy:
        return int(torch.argmax(logits))
    x = logits.detach().float().cpu() / params.temperature
    if params.top_k and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sx, order = torch.sort(x, descending=True)
        p = torch.softmax(sx, dim=-1)
        drop = (torch.cumsum(p, dim=-1) - p) > params.top_p  # mass before this token exceeds top_p
        drop[0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    g = token_generator(params.seed, index, generator) if params.seed is not None else None
    return int(torch.multinomial(probs, 1, generator=g))


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams], indices: Sequence[int],
                 generators: Sequence[Optional[torch.Generator]]) -> list[int]:
    """Sample one token per row of ``logits`` (B, vocab)."""
    if all(p.greedy for p in params):
        return [int(t) for t in torch.argmax(logits, dim=-1).tolist()]
    return [sample_token(logits[i], p, indices[i], generators[i]) for i, p in enumerate(params)]
