"""Transports: the backend author's surface.

A backend is one class implementing :class:`Transport` (client side: read, read_layers,
write, abort_write, release; ``serve`` for the server side), registered by URL scheme
with :func:`register` or the entry-point group ``kvbridge.transports``. Servers call
into a :class:`BlockSource` (the sender) or :class:`BlockSink` (a receiver that
reserved blocks) and move the memory a :class:`Spans` describes.
"""

from .base import (BlockSink, BlockSource, Chunk, Claim, ReadGrant, ReadOp, Run, Server, Spans, SpansFor, Transport,
                   WriteGrant, copy_runs)
from .registry import get_transport_class, known_implementations, register, scheme_of

__all__ = ["Transport", "Server", "Spans", "ReadOp", "Chunk", "SpansFor", "Run", "BlockSource", "BlockSink",
           "ReadGrant", "WriteGrant", "Claim", "copy_runs", "register", "get_transport_class",
           "known_implementations", "scheme_of"]
