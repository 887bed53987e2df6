"""The connector's settings, read once from ``kv_transfer_config.kv_connector_extra_config``.

Every key is optional; the defaults work for a producer and a consumer on one machine:

=================  ==========================  ===============================================
key                default                     meaning
=================  ==========================  ===============================================
``listen``         ``["tcp://127.0.0.1:0"]``   where the producer's worker serves blocks (a
                                               host address decode machines can reach, or
                                               ``shm://`` + tcp on one host); str or list
``leases``         ``None``                    lease server: a ``redis://`` URL; None = the
                                               producer process's embedded server; False = none
``lease_namespace`` ``"kvb"``                  key prefix on a shared lease server
``ttl``            ``60``                      seconds a published handle lives unclaimed
``claim_ttl``      ``30``                      seconds a consumer's claim lives between renewals
``connect_timeout`` ``5``                      seconds to connect to a producer
``transfer_timeout`` ``30``                    seconds a transfer may go without progress
``handle_wait``    ``10``                      seconds ``request_finished`` waits for the
                                               worker's handle before giving up on the request
``secret``         unset                       hex HMAC key shared by both sides (optional)
``load``           ``"async"``                 consumer: ``"async"`` (the request waits until
                                               its KV has landed) or ``"layerwise"`` (it is
                                               scheduled at once; each attention layer waits
                                               for that layer's blocks; the partial last block
                                               is recomputed locally)
=================  ==========================  ===============================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from kvbridge import Timeout
from kvbridge.errors import ConfigError

__all__ = ["ConnectorConfig"]

# kv_transfer_params keys this connector reads and writes
HANDLE_KEY = "kvbridge_handle"
GEOMETRY_KEY = "kvbridge_geometry"
PROMPT_KEY = "kvbridge_prompt"        # digest of the prompt tokens whose KV the handle holds


@dataclass(frozen=True)
class ConnectorConfig:
    listen: tuple[str, ...] = ("tcp://127.0.0.1:0",)
    leases: Union[str, bool, None] = None
    lease_namespace: str = "kvb"
    ttl: float = 60.0
    claim_ttl: float = 30.0
    connect_timeout: float = 5.0
    transfer_timeout: float = 30.0
    handle_wait: float = 10.0
    secret: Optional[bytes] = field(default=None, repr=False)
    load: str = "async"

    @classmethod
    def from_extra(cls, extra: Optional[dict[str, Any]]) -> "ConnectorConfig":
        d = dict(extra or {})
        known = {"listen", "leases", "lease_namespace", "ttl", "claim_ttl", "connect_timeout", "transfer_timeout",
                 "handle_wait", "secret", "load"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"kvbridge connector: unknown kv_connector_extra_config keys {unknown}; "
                              f"known: {sorted(known)}")
        kw: dict[str, Any] = {}
        if "listen" in d:
            ls = d["listen"]
            if not (isinstance(ls, str) or (isinstance(ls, (list, tuple)) and all(isinstance(u, str) for u in ls))):
                raise ConfigError(f"kvbridge connector: 'listen' is a URL or a list of URLs, not {ls!r:.80}")
            kw["listen"] = (ls,) if isinstance(ls, str) else tuple(ls)
            if not kw["listen"]:
                raise ConfigError("kvbridge connector: 'listen' needs at least one URL")
        if "leases" in d:
            if not (d["leases"] is None or isinstance(d["leases"], (bool, str))):
                raise ConfigError("kvbridge connector: 'leases' is a redis:// URL, true or false, "
                                  f"not {d['leases']!r:.80}")
            kw["leases"] = d["leases"]
        for k in ("ttl", "claim_ttl", "connect_timeout", "transfer_timeout", "handle_wait"):
            if k in d:
                v = d[k]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                    raise ConfigError(f"kvbridge connector: {k} must be a finite number of seconds > 0, got {v!r:.80}")
                kw[k] = float(v)
        if "lease_namespace" in d:
            kw["lease_namespace"] = str(d["lease_namespace"])
        if "load" in d:
            if d["load"] not in ("async", "layerwise"):
                raise ConfigError(f"kvbridge connector: load must be 'async' or 'layerwise', got {d['load']!r}")
            kw["load"] = d["load"]
        if d.get("secret"):
            try:
                kw["secret"] = bytes.fromhex(str(d["secret"]))
            except ValueError:
                raise ConfigError("kvbridge connector: 'secret' must be hex") from None
        return cls(**kw)

    @property
    def timeout(self) -> Timeout:
        return Timeout(connect=self.connect_timeout, transfer=self.transfer_timeout, lease=self.claim_ttl)
