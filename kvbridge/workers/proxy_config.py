"""What the HTTP front door (:mod:`kvbridge.workers.proxy`) is told: its workers and how to treat them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigError

__all__ = ["ProxyConfig"]


@dataclass
class ProxyConfig:
    """Where the workers are and how to treat them."""

    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    colocated: Optional[str] = None
    routing: str = "least-loaded"          # or "round-robin"
    on_decode_failure: str = "retry"       # or "reprefill"
    ttft_slo: Optional[float] = 2.0        # seconds, for goodput
    tpot_slo: Optional[float] = 0.1
    worker_timeout: float = 30.0           # longest silence from a worker before it counts as failed
    request_timeout: float = 300.0
    max_attempts: int = 4                  # decode attempts per request
    model_name: str = "kvbridge"
    max_body_bytes: int = 8 << 20          # larger request bodies get 413 before they are read
    max_model_len: Optional[int] = None    # None: ask the workers (their model's context, capped by the pool)
    health_internal: bool = False          # /health shows worker and KV listener URLs (trusted networks only)
    chat_max_tokens: int = 512             # a chat request's max_tokens when it names none (capped by the context)
    shutdown_grace: float = 5.0            # seconds for in-flight requests to get their error on close
    max_connections: Optional[int] = None  # client connections open at once (None: http.default_max_connections)
    worker_connections: int = 512          # connections to the workers open at once (all workers together)
    worker_pool_timeout: float = 5.0       # a call that finds none free this long gets 503 (overloaded)

    def __post_init__(self) -> None:
        self.prefill = [u.rstrip("/") for u in self.prefill]
        self.decode = [u.rstrip("/") for u in self.decode]
        self.colocated = self.colocated.rstrip("/") if self.colocated else None
        if self.colocated is None and (not self.prefill or not self.decode):
            raise ConfigError("the proxy needs --prefill and --decode URLs, or --colocated URL")
        for u in self.prefill + self.decode + ([self.colocated] if self.colocated else []):
            if not u.startswith(("http://", "https://")):
                raise ConfigError(f"worker URL must be http://host:port, got {u!r}")
        if self.routing not in ("least-loaded", "round-robin"):
            raise ConfigError(f"routing must be least-loaded or round-robin, not {self.routing!r}")
        if self.on_decode_failure not in ("retry", "reprefill"):
            raise ConfigError(f"on_decode_failure must be retry or reprefill, not {self.on_decode_failure!r}")
        if self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes must be at least 1024")
        if self.max_connections is not None and self.max_connections < 1:
            raise ConfigError("max_connections must be at least 1")
        if self.worker_connections < 1 or not self.worker_pool_timeout > 0:
            raise ConfigError("worker_connections must be at least 1 and worker_pool_timeout above 0")
        if self.chat_max_tokens < 1:
            raise ConfigError("chat_max_tokens must be at least 1")

    @property
    def mode(self) -> str:
        return "colocated" if self.colocated else "disaggregated"
