"""Transports by URL scheme, imported lazily (fsspec-style), plus entry points.

Third-party backends register in the entry-point group ``kvbridge.transports``
(name = scheme, value = ``module:Class``) or call :func:`register`.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Optional
from urllib.parse import urlsplit

from ..errors import BackendUnavailable, ConfigError
from .base import Transport

__all__ = ["known_implementations", "register", "get_transport_class", "scheme_of"]

known_implementations: dict[str, dict[str, str]] = {
    "inproc": {"class": "kvbridge.transports.inproc:InprocTransport"},
    "tcp": {"class": "kvbridge.transports.tcp:TCPTransport"},
    "shm": {"class": "kvbridge.transports.shm:ShmTransport"},
    "ucx": {"class": "kvbridge.transports.ucx:UCXTransport",
            "err": "ucx:// needs ucxx: pip install 'kvbridge[ucx]' (installs ucxx-cu12)"},
    # CUDA IPC through CuPy: the module imports without it; serving or mapping a CUDA pool
    # without CuPy raises BackendUnavailable naming the extra.
    "nvlink": {"class": "kvbridge.transports.nvlink:NVLinkTransport",
               "err": "nvlink:// needs CuPy: pip install 'kvbridge[cupy]' (cupy-cuda12x or cupy-cuda13x, "
                      "matching the CUDA of your torch)"},
}

_loaded: dict[str, type[Transport]] = {}


def register(scheme: str, target: str | type[Transport], err: Optional[str] = None) -> None:
    """Register a backend class, or ``"module:Class"`` imported on first use."""
    if isinstance(target, str):
        known_implementations[scheme] = {"class": target, **({"err": err} if err else {})}
        _loaded.pop(scheme, None)
    else:
        _loaded[scheme] = target


def scheme_of(url: str) -> str:
    scheme = urlsplit(url).scheme
    if not scheme:
        raise ConfigError(f"URL {url!r} has no scheme; use one of {sorted(known_implementations)}")
    return scheme


def _from_entry_points(scheme: str) -> Optional[str]:
    for ep in entry_points(group="kvbridge.transports"):
        if ep.name == scheme:
            return str(ep.value)
    return None


def get_transport_class(scheme_or_url: str) -> type[Transport]:
    scheme = scheme_of(scheme_or_url) if "://" in scheme_or_url else scheme_or_url
    if scheme in _loaded:
        return _loaded[scheme]
    spec = known_implementations.get(scheme)
    target = spec["class"] if spec else _from_entry_points(scheme)
    if target is None:
        raise ConfigError(f"no transport for scheme {scheme!r}; known: {sorted(known_implementations)}")
    mod_name, _, cls_name = target.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        hint = (spec or {}).get("err", f"the backend module {mod_name} could not be imported")
        raise BackendUnavailable(f"{scheme}:// is not available: {exc}", hint=hint) from None
    cls = getattr(mod, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise BackendUnavailable(f"{scheme}:// backend {target!r} names no Transport class")
    _loaded[scheme] = cls
    return cls
