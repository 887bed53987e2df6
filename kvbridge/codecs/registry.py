"""Codecs by name, imported on first use (as fsspec's ``known_implementations``).

``known_codecs`` maps a name (the string a :class:`~kvbridge.handle.KVHandle` carries in
``codec``) to ``"module:Class"``, constructor arguments, and for optional backends the
module it needs and the extra that installs it. Third-party codecs register with
:func:`register_codec` or in the entry-point group ``kvbridge.codecs``
(``name = "module:Class"``).
"""

from __future__ import annotations

import importlib
import threading
from importlib.metadata import entry_points
from typing import Any, Optional, Union

from ..errors import BackendUnavailable, ConfigError, ProtocolError
from ..pool import KVPool
from .base import Codec, FrameHeader, FrameInput, as_byte_tensor, read_header

__all__ = ["known_codecs", "get_codec", "register_codec", "available_codecs", "codec_names", "decode_frame",
           "is_lossless"]

known_codecs: dict[str, dict[str, Any]] = {
    "raw": {"class": "kvbridge.codecs.base:RawCodec"},
    "lz4": {"class": "kvbridge.codecs.lossless:LZ4Codec", "kwargs": {"shuffle": False}},
    "lz4+shuffle": {"class": "kvbridge.codecs.lossless:LZ4Codec", "kwargs": {"shuffle": True}},
    "zstd": {"class": "kvbridge.codecs.lossless:ZstdCodec", "kwargs": {"shuffle": False},
             "requires": "zstandard", "extra": "zstd"},
    "zstd+shuffle": {"class": "kvbridge.codecs.lossless:ZstdCodec", "kwargs": {"shuffle": True},
                     "requires": "zstandard", "extra": "zstd"},
    "int8": {"class": "kvbridge.codecs.quant:Int8Codec"},
    "fp8": {"class": "kvbridge.codecs.quant:FP8Codec", "kwargs": {"per_block": False}},
    "fp8-block": {"class": "kvbridge.codecs.quant:FP8Codec", "kwargs": {"per_block": True}},
    "int4": {"class": "kvbridge.codecs.kivi:Int4Codec"},
}

_lock = threading.Lock()
_ep_lock = threading.Lock()
_instances: dict[str, Codec] = {}
_entry_points_loaded = False


def _load_entry_points() -> None:
    """Read the ``kvbridge.codecs`` entry points once; a thread that asks meanwhile waits for them."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    with _ep_lock:
        if _entry_points_loaded:
            return
        found = list(entry_points(group="kvbridge.codecs"))
        with _lock:
            for ep in found:
                known_codecs.setdefault(ep.name, {"class": ep.value})
        _entry_points_loaded = True     # only now: a name asked for meanwhile was not missed


def register_codec(name: str, target: Union[str, type[Codec]], *, clobber: bool = False, **kwargs: Any) -> None:
    """Register a codec class (or ``"module:Class"``) under ``name`` (1-12 printable ASCII
    characters, no space: frames carry it NUL-padded)."""
    if not isinstance(name, str) or not (name.isascii() and name.isprintable() and " " not in name
                                         and 0 < len(name) <= 12):
        raise ConfigError(f"codec name {name!r} must be 1-12 ASCII characters, printable, without spaces")
    with _lock:
        if name in known_codecs and not clobber:
            raise ConfigError(f"codec {name!r} already registered (pass clobber=True to replace it)")
        known_codecs[name] = {"class": target, "kwargs": kwargs}
        _instances.pop(name, None)


def codec_names() -> list[str]:
    """Every registered name, installed or not."""
    _load_entry_points()
    return sorted(known_codecs)


def get_codec(name: str) -> Codec:
    """The codec registered as ``name`` (one shared instance per name).

    Unknown names raise :class:`ConfigError` listing the known ones; a codec whose
    optional dependency is missing raises :class:`BackendUnavailable` naming the extra.
    """
    if isinstance(name, Codec):
        return name
    codec = _instances.get(name)
    if codec is not None:
        return codec
    _load_entry_points()
    spec = known_codecs.get(name)
    if spec is None:
        raise ConfigError(f"unknown codec {name!r}; known codecs: {', '.join(sorted(known_codecs))}")
    target = spec["class"]
    try:
        if isinstance(target, str):
            mod, _, cls_name = target.partition(":")
            cls = getattr(importlib.import_module(mod), cls_name)
        else:
            cls = target
        codec = cls(**spec.get("kwargs", {}))
    except ImportError as exc:
        need = spec.get("requires")
        if need and (exc.name == need or need in str(exc)):
            extra = spec.get("extra", need)
            raise BackendUnavailable(f"codec {name!r} needs the optional package {need!r}",
                                     hint=f"pip install 'kvbridge[{extra}]'") from None
        raise
    codec.name = name
    with _lock:
        return _instances.setdefault(name, codec)


def available_codecs() -> list[str]:
    """Names whose dependencies are installed here."""
    out = []
    for name in codec_names():
        try:
            get_codec(name)
        except BackendUnavailable:
            continue
        out.append(name)
    return out


def is_lossless(name: str) -> bool:
    return get_codec(name).lossless


def decode_frame(data: FrameInput, pool: KVPool, block_ids: Any, layers: Union[range, int, None] = None,
                 expect_codec: Optional[str] = None) -> FrameHeader:
    """Decode a frame with the codec its header names (the receiver's entry point).

    ``expect_codec`` is the codec the signed handle names: a frame that says otherwise is
    refused with :class:`ProtocolError`, so a handle's codec cannot be swapped in flight.
    """
    t = as_byte_tensor(data)
    hdr = read_header(t)
    if expect_codec is not None and hdr.codec != expect_codec:
        raise ProtocolError(f"frame encoded with codec {hdr.codec!r}, the handle says {expect_codec!r}")
    _load_entry_points()
    if hdr.codec not in known_codecs:     # the frame's fault, not the caller's (get_codec: ConfigError)
        raise ProtocolError(f"frame names codec {hdr.codec!r}, which this kvbridge does not know; known codecs: "
                            f"{', '.join(sorted(known_codecs))}")
    return get_codec(hdr.codec).decode(t, pool, block_ids, layers)
