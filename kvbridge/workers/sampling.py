"""Sampling parameters and token sampling: greedy, temperature, top-k, top-p, seeded.

A seeded request draws token ``i`` of its output from a generator seeded with
``(seed, i)``, so the same request gives the same tokens whichever process samples
which token (the prefill side samples token 0, the decode side the rest).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from typing import Any, Optional, Sequence

import torch

from ..errors import ConfigError

__all__ = ["SamplingParams", "sample_token", "sample_batch", "token_generator"]

_MASK64 = (1 << 63) - 1
# Below this temperature sampling is greedy: logits / 1e-40 overflow float32 (inf - inf = NaN), and
# at any temperature this small the softmax puts all mass on the arg max anyway.
MIN_TEMPERATURE = 1e-5


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
        for name in ("max_tokens", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{name} must be an integer, not {v!r}")
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"{name} must be a finite number, not {v!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed must be an integer or null, not {self.seed!r}")
        if self.max_tokens < 1:
            raise ConfigError("max_tokens must be >= 1")
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"bad sampling params: temperature={self.temperature}, "
                              f"top_k={self.top_k}, top_p={self.top_p}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise ConfigError("stop_token_ids must be a list of token ids")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self.stop_set  # made here, when the request comes in, not on the engine thread

    @cached_property
    def stop_set(self) -> frozenset[int]:
        """``stop_token_ids`` as a set: a request may name tens of thousands, and a tuple cost a
        scan of them all for each token it made, on the engine thread every request shares."""
        return frozenset(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        """Arg max sampling: ``temperature`` 0, or below :data:`MIN_TEMPERATURE`."""
        return self.temperature < MIN_TEMPERATURE

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        if not isinstance(d, dict):
            raise ConfigError("sampling must be a JSON object")
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
    Probabilities are computed in float64 from the logits less their maximum, so no
    temperature at or above :data:`MIN_TEMPERATURE` overflows; logits that are not finite
    (a broken model) fall back to the arg max of the finite ones rather than NaN probabilities.
    """
    if params.greedy:
        return int(torch.argmax(logits))
    x = logits.detach().cpu().double()
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        if not bool(finite.any()):
            return 0
        return int(torch.argmax(x.masked_fill(~finite, float("-inf"))))
    x = (x - x.max()) / params.temperature
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
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:  # not reached with finite logits
        return int(torch.argmax(x))
    g = token_generator(params.seed, index, generator) if params.seed is not None else None
    return int(torch.multinomial(probs, 1, generator=g))


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams], indices: Sequence[int],
                 generators: Sequence[Optional[torch.Generator]]) -> list[int]:
    """Sample one token per row of ``logits`` (B, vocab)."""
    if all(p.greedy for p in params):
        return [int(t) for t in torch.argmax(logits, dim=-1).tolist()]
    return [sample_token(logits[i], p, indices[i], generators[i]) for i, p in enumerate(params)]
