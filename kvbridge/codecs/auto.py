"""``auto``: pick the codec that makes a transfer fastest end to end, from measured figures.

The model, per byte of raw KV, with link bandwidth ``B`` and a codec of ratio ``r``
(raw bytes per wire byte), encode and decode throughputs ``E`` and ``D`` (raw bytes per
second)::

    raw      t = 1 / B                                  (transports move the blocks themselves)
    serial   t = 1/E + 1/(r B) + 1/D                    (encode, then send, then decode)
    overlap  t = max(1/E, 1/(r B), 1/D)                 (layer-wise streaming pipelines the three)

A codec is chosen only when its estimate beats raw by ``min_gain`` (5% by default), so
a codec never makes the transfer slower by the model's own measure; ``serial`` is the
default because it is the conservative one. Lossy codecs are considered only with
``allow_lossy=True``. The break-even bandwidth is the ``B`` below which a codec wins::

    serial   B* = (1 - 1/r) / (1/E + 1/D)               (0 when r <= 1)
    overlap  B* = min(E, D)                             (when r > 1)
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from ..errors import BackendUnavailable, ConfigError
from ..pool import KVPool
from .registry import available_codecs, get_codec

__all__ = ["CodecSpeed", "CodecChoice", "transfer_seconds", "break_even_gbps", "choose_codec",
           "measure_codec_speeds"]


@dataclass(frozen=True)
class CodecSpeed:
    """Measured figures of one codec on some KV: ratio and throughputs in GB/s of raw KV."""

    name: str
    ratio: float
    encode_gbps: float
    decode_gbps: float
    lossless: bool = True


@dataclass(frozen=True)
class CodecChoice:
    """The chosen codec, why, and the estimated seconds per GB of raw KV with it and without."""

    codec: str
    reason: str
    seconds_per_gb: float
    raw_seconds_per_gb: float

    @property
    def speedup(self) -> float:
        return self.raw_seconds_per_gb / self.seconds_per_gb


def transfer_seconds(speed: CodecSpeed, link_gbps: float, overlap: bool = False) -> float:
    """Estimated seconds to move 1 GB of raw KV with ``speed``'s codec over the link."""
    if speed.name == "raw":
        return 1.0 / link_gbps
    enc, wire, dec = 1.0 / speed.encode_gbps, 1.0 / (speed.ratio * link_gbps), 1.0 / speed.decode_gbps
    return max(enc, wire, dec) if overlap else enc + wire + dec


def break_even_gbps(speed: CodecSpeed, overlap: bool = False) -> float:
    """Link bandwidth (GB/s) below which the codec makes the transfer faster; 0 if never."""
    if speed.name == "raw" or speed.ratio <= 1.0:
        return 0.0
    if overlap:
        return min(speed.encode_gbps, speed.decode_gbps)
    return (1.0 - 1.0 / speed.ratio) / (1.0 / speed.encode_gbps + 1.0 / speed.decode_gbps)


def choose_codec(link_gbps: float, speeds: Iterable[CodecSpeed], *, allow_lossy: bool = False,
                 overlap: bool = False, min_gain: float = 0.05) -> CodecChoice:
    """The codec with the lowest estimated transfer time over a ``link_gbps`` link, or ``raw``.

    ``speeds`` are measured figures (:func:`measure_codec_speeds`, or ``bench/codecs.py``).
    The reason string says what was compared; put it in metrics or a fetch result.
    """
    if not link_gbps > 0 or math.isinf(link_gbps):
        raise ConfigError(f"link bandwidth must be a positive finite GB/s figure, got {link_gbps!r}")
    if not 0 <= min_gain < 1:
        raise ConfigError(f"min_gain must be a fraction in [0, 1), got {min_gain!r}")
    raw_t = 1.0 / link_gbps
    best: Optional[tuple[float, CodecSpeed]] = None
    skipped_lossy: list[str] = []
    for s in speeds:
        if s.name == "raw" or not all(v > 0 for v in (s.ratio, s.encode_gbps, s.decode_gbps)):
            continue                     # zero, negative or NaN (unmeasured): nothing to compare
        if not s.lossless and not allow_lossy:
            skipped_lossy.append(s.name)
            continue
        t = transfer_seconds(s, link_gbps, overlap)
        if best is None or t < best[0]:
            best = (t, s)
    mode = "overlapped" if overlap else "serial"
    lossy_note = f"; lossy codecs not allowed ({', '.join(sorted(skipped_lossy))})" if skipped_lossy else ""
    if best is None:
        return CodecChoice("raw", f"raw: no measured codec to compare at {link_gbps:.3g} GB/s{lossy_note}",
                           raw_t, raw_t)
    t, s = best
    figures = (f"{s.name}: ratio {s.ratio:.2f}, encode {s.encode_gbps:.3g} GB/s, decode {s.decode_gbps:.3g} GB/s, "
               f"{mode} estimate {t:.3g} s/GB vs raw {raw_t:.3g} s/GB over a {link_gbps:.3g} GB/s link")
    if t <= raw_t * (1.0 - min_gain):
        return CodecChoice(s.name, f"{figures} ({raw_t / t:.2f}x faster){lossy_note}", t, raw_t)
    return CodecChoice("raw", f"raw: the best codec does not pay ({figures}; break-even "
                              f"{break_even_gbps(s, overlap):.3g} GB/s){lossy_note}", raw_t, raw_t)


def measure_codec_speeds(pool: KVPool, block_ids: Sequence[int], names: Optional[Iterable[str]] = None,
                         repeats: int = 3) -> list[CodecSpeed]:
    """Time each codec's encode and decode on blocks of ``pool`` (real KV: ratios depend on the
    data) and return medians over ``repeats`` rounds. Decodes go to a scratch pool of the same
    layout; codecs whose optional package is missing, or that cannot code this pool's dtype (the
    8-bit quantizers offered an fp8 or int8 pool), are left out."""
    scratch = KVPool.allocate(pool.layout, len(block_ids), device=pool.device)
    dst = list(range(len(block_ids)))
    raw_bytes = len(block_ids) * pool.layout.block_nbytes
    out: list[CodecSpeed] = []
    cuda = pool.device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(pool.device)
    for name in (names if names is not None else available_codecs()):
        try:
            codec = get_codec(name)
            codec.check_layout(pool.layout)    # a quantizer offered an already 8-bit pool: not a choice
        except (BackendUnavailable, ConfigError):
            continue
        enc_t, dec_t = [], []
        frame = codec.encode(pool, block_ids)
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            frame = codec.encode(pool, block_ids)
            sync()
            t1 = time.perf_counter()
            codec.decode(frame, scratch, dst)
            sync()
            t2 = time.perf_counter()
            enc_t.append(t1 - t0)
            dec_t.append(t2 - t1)
        out.append(CodecSpeed(name, raw_bytes / frame.nbytes, raw_bytes / statistics.median(enc_t) / 1e9,
                              raw_bytes / statistics.median(dec_t) / 1e9, codec.lossless))
    return out
