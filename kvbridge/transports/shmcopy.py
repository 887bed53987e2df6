"""The copy loop of shm:// reads: memoryview slice assignment (one C memcpy, less call
overhead than ``ctypes.memmove``), in chunks small enough to stay in L2, each chunk hashed
by the verifier right after it lands -- so verification reads it from cache, not memory."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..errors import ProtocolError

__all__ = ["CHUNK", "copy_into"]

CHUNK = 128 << 10   # bytes copied between two verifier calls (measured: bench/transport.py --chunk)


def copy_into(dst: Sequence[memoryview], src: memoryview, runs: Sequence[tuple[int, int]],
              landed: Optional[Callable[[int], None]] = None, chunk: int = 0) -> int:
    """Copy the stream of ``src[o:o + n]`` for each run in ``runs`` into the ``dst`` views (the
    same total); with ``landed``, call ``landed(bytes so far)`` after every ``chunk`` bytes."""
    chunk = chunk or CHUNK
    total = 0
    for _, n in runs:
        total += n
    if total != sum(len(v) for v in dst):
        raise ProtocolError(f"size mismatch: destination {sum(len(v) for v in dst)} bytes, source {total} bytes")
    if len(dst) == len(runs):
        if landed is None:
            for d, (o, n) in zip(dst, runs):
                if len(d) != n:
                    break
                d[:] = src[o:o + n]
            else:
                return total
        elif all(len(d) == n <= chunk for d, (_, n) in zip(dst, runs)):
            moved = since = 0
            for d, (o, n) in zip(dst, runs):     # scattered blocks on both sides: the tightest loop
                d[:] = src[o:o + n]
                moved += n
                since += n
                if since >= chunk:
                    landed(moved)
                    since = 0
            if since:
                landed(moved)
            return moved
    i = doff = soff = moved = 0
    j = 0
    step = chunk if landed is not None else 1 << 62
    while i < len(dst) and j < len(runs):
        d = dst[i]
        so, sn = runs[j]
        n = min(len(d) - doff, sn - soff, step)
        if n:
            d[doff:doff + n] = src[so + soff:so + soff + n]
            moved += n
            if landed is not None:
                landed(moved)
        doff += n
        soff += n
        if doff == len(d):
            i, doff = i + 1, 0
        if soff == sn:
            j, soff = j + 1, 0
    return moved
