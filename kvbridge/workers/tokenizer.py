"""Tokenizers behind one small interface: ``encode``, ``decode``, ``bos_id``, ``eos_id``.

:class:`ByteTokenizer` (bytes 0-255, BOS=256, EOS=257) matches the seeded presets;
:class:`HFTokenizer` wraps ``transformers.AutoTokenizer`` loaded from a local
checkpoint directory, offline. :func:`load_tokenizer` picks one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence, Union, runtime_checkable

from ..errors import BackendUnavailable, ConfigError

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "load_tokenizer"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine and workers need from a tokenizer."""

    @property
    def bos_id(self) -> Optional[int]: ...

    @property
    def eos_id(self) -> Optional[int]: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255, plus BOS=256 and EOS=257."""

    BOS = 256
    EOS = 257

    @property
    def bos_id(self) -> Optional[int]:
        return self.BOS

    @property
    def eos_id(self) -> Optional[int]:
        return self.EOS

    @property
    def vocab_size(self) -> int:
        return 258

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        out = bytearray()
        for t in ids:
            t = int(t)
            if 0 <= t < 256:
                out.append(t)
            elif not skip_special:
                out.extend(b"<bos>" if t == self.BOS else b"<eos>" if t == self.EOS else b"<unk>")
        return out.decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``transformers`` tokenizer from a local directory (``local_files_only``)."""

    def __init__(self, path: Union[str, os.PathLike[str]]) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise BackendUnavailable("HF tokenizers need the transformers package",
                                     hint="pip install transformers") from None
        try:
            self.tok: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load a tokenizer from {path}: {exc}") from None

    @property
    def bos_id(self) -> Optional[int]:
        return self.tok.bos_token_id  # type: ignore[no-any-return]

    @property
    def eos_id(self) -> Optional[int]:
        return self.tok.eos_token_id  # type: ignore[no-any-return]

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(self.tok.encode(text, add_special_tokens=False))
        if add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=skip_special))


def load_tokenizer(path: Union[str, os.PathLike[str], None] = None) -> Tokenizer:
    """The HF tokenizer of checkpoint dir ``path`` if it has tokenizer files, else bytes."""
    if path is not None and any((Path(path) / f).exists() for f in _TOKENIZER_FILES):
        return HFTokenizer(path)
    return ByteTokenizer()
