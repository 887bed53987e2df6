"""Coded transfers against a sender that lies, and against a prefill that races itself.

A real handle is published with a codec on an in-process sender; its URL is then pointed at a
loopback socket that answers every READ with a crafted LDATA reply (fence, layer range, frame
bytes, trailer). Each test runs the real receiver and the real codecs, bounded in time and memory.
"""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading
import time
import tracemalloc
from typing import Callable, Iterator, Optional

import pytest
from loopback import Listener
import torch
import xxhash

from kvbridge import (ConfigError, FetchResult, IntegrityError, KVHandle, KVLayout, KVPool, KVReceiver, KVSender,
                      ProtocolError, Timeout, TransferTimeout)
from kvbridge.codecs import get_codec
from kvbridge.codecs.base import FrameHeader, read_header
from kvbridge.codecs.lossless import CHUNK_SHIFT
from kvbridge.transports.wire import FENCE, HEADER, LAYERS, TRAILER, Kind, decode_request, pack, recv_exact, \
    unpack_header

pytestmark = pytest.mark.timeout(60)

# (first, end) asked -> (lo, hi, frame bytes) served
Reply = Callable[[int, int], tuple[int, int, bytes]]


class LyingSender(Listener):
    """A loopback tcp:// peer answering every READ, on every connection, with ``reply``."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.reads = 0
        super().__init__(socket.create_server(("127.0.0.1", 0)))

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"

    def _conn(self, conn: socket.socket) -> None:
        conn.settimeout(0.2)
        with conn:
            while not self.stop.is_set():
                try:
                    _, rid, length = unpack_header(recv_exact(conn, HEADER.size))
                    first, end = decode_request(recv_exact(conn, length)).layers  # type: ignore[misc]
                    self.reads += 1
                    lo, hi, frames = self.reply(first, end)
                    body = FENCE.pack(0, 0) + LAYERS.pack(lo, hi, 0) + frames + TRAILER.pack(0, 0, 0)
                    conn.sendall(pack(Kind.LDATA, rid, body))
                except TimeoutError:
                    continue
                except Exception:
                    return


@pytest.fixture
def lying() -> Iterator[Callable[[Reply], LyingSender]]:
    made: list[LyingSender] = []

    def make(reply: Reply) -> LyingSender:
        made.append(LyingSender(reply))
        return made[-1]
    yield make
    for s in made:
        s.close()


def _real_handle(L: KVLayout, codec: str, nblocks: int = 2, layerwise: bool = False) -> KVHandle:
    with KVSender(KVPool.allocate(L, nblocks), "inproc://", leases=False) as snd:
        ids = snd.pool.alloc(nblocks)
        for b in snd.pool.buffers:
            b.copy_(torch.randn(b.shape))
        return snd.publish("real", ids, nblocks * L.block_size, codec=codec,
                           **({"layers_ready": 0} if layerwise else {}))  # type: ignore[arg-type]


def _frame(L: KVLayout, codec: str, body: bytes, nblocks: int, layers: range, aux: int,
           body_hash: Optional[int] = None) -> bytes:
    hdr = FrameHeader.for_pool(codec, L, nblocks, layers, len(body), aux)
    hdr = dataclasses.replace(hdr, body_hash=xxhash.xxh3_64_intdigest(body) if body_hash is None else body_hash)
    return hdr.pack() + body


def _fetch(h: KVHandle, url: str, L: KVLayout, nblocks: int = 2, transfer: float = 5.0,
           verify: bool = True) -> tuple[FetchResult, KVPool]:
    h = dataclasses.replace(h, urls=(url,))
    dst = KVPool.allocate(L, max(8, nblocks))
    with KVReceiver(dst, leases=False, verify=verify, timeout=Timeout(connect=2.0, transfer=transfer)) as rcv:
        res = rcv.fetch(h, list(range(nblocks)), release=False)
    return res, dst


def _untouched(pool: KVPool) -> bool:
    return not any(bool(b.view(-1).view(torch.uint8).any()) for b in pool.buffers)


# -- 1. zstd decompression bomb ------------------------------------------------------------------

@pytest.mark.parametrize("declared", [True, False], ids=["declares-64MiB", "declares-nothing"])
def test_zstd_bomb_is_refused_before_it_expands(lying: Callable[[Reply], LyingSender], declared: bool) -> None:
    """One ~2 KB zstd chunk holding 64 MiB of zeros, in a frame whose header (and body hash) are
    valid for a 256 KiB handle: refused before decompressing (declared size) or bounded by the
    chunk's size (no declared size); the receiver's memory stays where it was."""
    zstandard = pytest.importorskip("zstandard")
    L = KVLayout.vllm_flash(2, 8, 128, block_size=16, dtype="float16")     # 2 blocks: 256 KiB, one chunk
    h = _real_handle(L, "zstd")
    bomb_mib = 64
    comp = zstandard.ZstdCompressor(level=1, write_content_size=declared).compressobj(
        size=bomb_mib << 20 if declared else -1)
    zeros = bytes(1 << 20)
    bomb = b"".join([comp.compress(zeros) for _ in range(bomb_mib)] + [comp.flush()])
    assert len(bomb) < 16 << 10
    if declared:
        assert zstandard.frame_content_size(bomb) == bomb_mib << 20
    body = struct.pack("<IB3x", len(bomb), 1) + bomb
    fr = _frame(L, "zstd", body, 2, range(0, 2), CHUNK_SHIFT << 8)
    peer = lying(lambda first, end: (0, 2, fr))
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        t0 = time.monotonic()
        res, dst = _fetch(h, peer.url, L)
        took = time.monotonic() - t0
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"receiver allocated {peak >> 20} MiB for a {len(fr)}-byte frame"
    assert took < 5.0
    assert not res.ok and isinstance(res.error, IntegrityError), res.error
    if declared:
        assert "declares" in str(res.error), res.error
    assert _untouched(dst)


# -- 2. concurrent and failing mark_ready on a layer-wise coded handle --------------------------

def _reference(src: KVPool, ids: list[int], codec: str) -> KVPool:
    """What a decode of ``codec``'s frame of ``ids`` writes into blocks 0..n-1 of a fresh pool."""
    ref = KVPool.allocate(src.layout, len(ids))
    get_codec(codec).decode(get_codec(codec).encode(src, ids), ref, list(range(len(ids))))
    return ref


def _parts(pool: KVPool, layer: int) -> tuple[torch.Tensor, ...]:
    kv = pool.layer_kv(layer)
    return kv if isinstance(kv, tuple) else (kv,)


def _same_blocks(a: KVPool, a_ids: list[int], b: KVPool, b_ids: list[int]) -> bool:
    return all(torch.equal(x[a_ids].view(torch.uint8), y[b_ids].view(torch.uint8))
               for layer in range(a.layout.num_layers) for x, y in zip(_parts(a, layer), _parts(b, layer)))


@pytest.mark.parametrize("codec", ["int8", "lz4"])
def test_concurrent_mark_ready_on_a_coded_handle(codec: str) -> None:
    """Two threads mark layers ready at once (2 and 4 of 4): each layer is encoded once, in its
    own slot, the handle ends with every layer ready and a receiver gets exactly the frames."""
    L = KVLayout.vllm_flash(4, 8, 64, block_size=16, dtype="float16")
    for trial in range(4):
        with KVSender(KVPool.allocate(L, 16), "inproc://", leases=False) as snd:
            ids = snd.pool.alloc(16)
            for b in snd.pool.buffers:
                b.copy_(torch.randn(b.shape))
            h = snd.publish(f"r{trial}", ids, 16 * 16, codec=codec, layers_ready=0)
            bar = threading.Barrier(2)
            errors: list[BaseException] = []

            def mark(n: int) -> None:
                bar.wait(5)
                try:
                    snd.mark_ready(h, n)
                except BaseException as exc:    # noqa: BLE001 -- reported below
                    errors.append(exc)
            ts = [threading.Thread(target=mark, args=(n,)) for n in (2, 4)]
            for th in ts:
                th.start()
            for th in ts:
                th.join(10)
            assert errors == []
            with KVReceiver(KVPool.allocate(L, 16), leases=False, timeout=Timeout(transfer=5.0)) as rcv:
                res = rcv.fetch(h, list(range(16)), release=False)  # no further mark_ready: 4 are ready
                assert res.ok, res.error
                assert _same_blocks(rcv.pool, list(range(16)), _reference(snd.pool, ids, codec), list(range(16)))


def test_failed_mark_ready_leaves_the_frames_consistent() -> None:
    """mark_ready(3) fails at layer 1 (int8 cannot scale NaN): nothing is marked ready, layer 0's
    frame stays in its slot, and once the KV is fixed mark_ready(4) encodes from layer 1 on."""
    L = KVLayout.vllm_flash(4, 2, 16, block_size=4, dtype="float16")
    with KVSender(KVPool.allocate(L, 4), "inproc://", leases=False) as snd:
        ids = snd.pool.alloc(4)
        for b in snd.pool.buffers:
            b.copy_(torch.randn(b.shape))
        h = snd.publish("nan", ids, 16, codec="int8", layers_ready=0)
        k1 = snd.pool.layer_kv(1)[0]
        good = k1[ids[0]].clone()
        k1[ids[0]] = float("nan")
        with pytest.raises(ConfigError, match="non-finite"):
            snd.mark_ready(h, 3)
        k1[ids[0]] = good
        assert snd.mark_ready(h, 4)
        with KVReceiver(KVPool.allocate(L, 4), leases=False, timeout=Timeout(transfer=5.0)) as rcv:
            res = rcv.fetch(h, list(range(4)), release=False)
            assert res.ok, res.error
            assert _same_blocks(rcv.pool, list(range(4)), _reference(snd.pool, ids, "int8"), list(range(4)))


# -- 3. every frame carries a body hash; none is accepted without one -----------------------------

@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_frames_without_a_body_hash_are_refused(lying: Callable[[Reply], LyingSender], layerwise: bool) -> None:
    """A frame without a body hash (what a device pool's lossy frames were) is refused even when
    nothing in it was damaged: a receiver cannot tell damaged bytes from good ones without it."""
    L = KVLayout.vllm_flash(2, 2, 8, block_size=4, dtype="float16")
    h = _real_handle(L, "int8", layerwise=layerwise)
    src = KVPool.allocate(L, 2)
    for b in src.buffers:
        b.fill_(1.0)
    codec = get_codec("int8")

    def reply(first: int, end: int) -> tuple[int, int, bytes]:
        hi = first + 1 if layerwise else 2
        enc = codec.encode(src, [0, 1], range(first, hi), checksum=False)
        assert enc.header.body_hash is None
        return first, hi, bytes(enc.data.numpy())
    peer = lying(reply)
    res, dst = _fetch(h, peer.url, L)
    assert not res.ok and isinstance(res.error, ProtocolError), res.error
    assert "body hash" in str(res.error)
    assert _untouched(dst)


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="device frames need a CUDA device (runs on the GPU machine)")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["int8", "fp8", "int4", "lz4"])
def test_every_published_frame_carries_a_body_hash(codec: str, device: str) -> None:
    """Whole and layer-wise, host and device pools: each frame a sender publishes is hashed
    (device frames as they are encoded), and a receiver on the same device decodes them."""
    L = KVLayout.vllm_flash(3, 2, 16, block_size=4, dtype="float16")
    pool = KVPool.allocate(L, 8, device=device)
    with KVSender(pool, "inproc://", leases=False) as snd, \
            KVReceiver(KVPool.allocate(L, 8, device=device), leases=False, timeout=Timeout(transfer=5.0)) as rcv:
        ids = snd.pool.alloc(4)
        for b in snd.pool.buffers:
            b.copy_(torch.randn(b.shape))
        whole = snd.publish("whole", ids[:2], 8, codec=codec)
        lw = snd.publish("lw", ids[2:], 8, codec=codec, layers_ready=0)
        snd.mark_ready(lw, 3)
        for h in (whole, lw):
            frames = snd._records[h.handle_id].frames
            assert frames is not None and len(frames.pieces) == (3 if h.layerwise else 1)
            for off, n in frames.pieces:
                assert read_header(frames.data[off:off + n].cpu()).body_hash is not None
            res = rcv.fetch(h, [0, 1] if h is whole else [2, 3], release=False)
            assert res.ok, res.error


# -- 4. empty and partial replies ------------------------------------------------------------------

def test_instant_empty_replies_do_not_spin_the_receiver(lying: Callable[[Reply], LyingSender]) -> None:
    """A sender that answers "no layer ready yet" at once, forever: the receiver asks again no
    sooner than an honest sender would answer (its LAYER_WAIT) and gives up at Timeout.transfer."""
    from kvbridge.sender import LAYER_WAIT
    L = KVLayout.vllm_flash(2, 2, 8, block_size=4, dtype="float16")
    h = _real_handle(L, "int8", layerwise=True)
    peer = lying(lambda first, end: (first, first, b""))
    t0 = time.monotonic()
    res, dst = _fetch(h, peer.url, L, transfer=1.0)
    took = time.monotonic() - t0
    assert not res.ok and isinstance(res.error, TransferTimeout), res.error
    assert 1.0 <= took < 3.0
    assert peer.reads <= 1.0 / LAYER_WAIT + 3, f"{peer.reads} READs in {took:.1f} s"
    assert _untouched(dst)


@pytest.mark.parametrize("serve", ["empty", "one-layer"])
def test_whole_coded_handle_takes_only_its_whole_frame(lying: Callable[[Reply], LyingSender], serve: str) -> None:
    """A coded handle published whole is one frame for all layers, served in one reply: an empty
    reply, or one layer at a time (which stretched a fetch to num_layers x Timeout.transfer), is
    refused at the first reply."""
    L = KVLayout.vllm_flash(8, 2, 8, block_size=4, dtype="float16")
    h = _real_handle(L, "lz4")
    src = KVPool.allocate(L, 2)
    for b in src.buffers:
        b.fill_(0.5)
    codec = get_codec("lz4")

    def reply(first: int, end: int) -> tuple[int, int, bytes]:
        if serve == "empty":
            return first, first, b""
        time.sleep(0.2)
        return first, first + 1, bytes(codec.encode(src, [0, 1], range(first, first + 1)).data.numpy())
    peer = lying(reply)
    t0 = time.monotonic()
    res, dst = _fetch(h, peer.url, L, transfer=1.0)
    assert not res.ok and isinstance(res.error, ProtocolError), res.error
    assert "published whole" in str(res.error)
    assert time.monotonic() - t0 < 1.0 and peer.reads == 1
    assert _untouched(dst)


# -- 5. decoded values are checked -----------------------------------------------------------------

@pytest.mark.parametrize("src_dtype", [torch.float32, torch.uint8])
def test_lossless_frame_of_another_dtype_is_refused(lying: Callable[[Reply], LyingSender],
                                                    src_dtype: torch.dtype) -> None:
    """An lz4 frame holding float32 (or uint8) KV for a float16 handle: refused, nothing written
    (float32 bytes would land as inf in a float16 pool)."""
    L = KVLayout.vllm_flash(2, 2, 8, block_size=4, dtype="float16")
    h = _real_handle(L, "lz4")
    other = dataclasses.replace(L, dtype=str(src_dtype).removeprefix("torch."))
    src = KVPool.allocate(other, 2)
    for b in src.buffers:
        b.fill_(200)
    fr = bytes(get_codec("lz4").encode(src, [0, 1]).data.numpy())
    peer = lying(lambda first, end: (0, 2, fr))
    res, dst = _fetch(h, peer.url, L)
    assert not res.ok and isinstance(res.error, ProtocolError), res.error
    assert "float16" in str(res.error)
    assert _untouched(dst)


def _bad_lossy_frame(L: KVLayout, codec: str, case: str) -> bytes:
    """A genuine frame of 2 blocks, edited as ``case`` says and re-hashed (header and body)."""
    src = KVPool.allocate(L, 2)
    for b in src.buffers:
        b.copy_(torch.randn(b.shape))
    c = get_codec(codec)
    enc = c.encode(src, [0, 1])
    body = bytearray(bytes(enc.data.numpy())[96:])
    if codec == "int4":
        kp = c._sizes(L, 2, L.num_layers)[0]
        body[:kp] = torch.full((kp // 2,), float("nan"), dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    else:
        s, _ = c.sizes(L, 2, L.num_layers)
        n = 4 * (c.sizes(L, 2, L.num_layers)[1] // c.group(L))
        if case in ("nan", "inf", "negative"):
            v = {"nan": float("nan"), "inf": float("inf"), "negative": -1.0}[case]
            body[:n] = torch.full((n // 4,), v, dtype=torch.float32).view(torch.uint8).numpy().tobytes()
        else:
            code = 0x7F if codec.startswith("fp8") else 0x80     # e4m3 NaN; int8 -128
            body[s:] = bytes([code]) * (len(body) - s)
    return _frame(L, codec, bytes(body), 2, range(L.num_layers), enc.header.aux)


@pytest.mark.parametrize("codec,case", [("int8", "nan"), ("int8", "inf"), ("int8", "negative"), ("int8", "code"),
                                        ("fp8", "nan"), ("fp8", "negative"), ("fp8", "code"),
                                        ("fp8-block", "inf"), ("int4", "nan")])
def test_lossy_frames_with_impossible_values_are_refused(lying: Callable[[Reply], LyingSender], codec: str,
                                                         case: str) -> None:
    """Scales or parameters no encoder writes (NaN, inf, negative) and codes it never writes
    (int8 -128, e4m3 NaN), hashed as if genuine: IntegrityError, nothing written."""
    L = KVLayout.vllm_flash(2, 2, 8, block_size=4, dtype="float16")
    h = _real_handle(L, codec)
    fr = _bad_lossy_frame(L, codec, case)
    peer = lying(lambda first, end: (0, 2, fr))
    res, dst = _fetch(h, peer.url, L)
    assert not res.ok and isinstance(res.error, IntegrityError), res.error
    assert _untouched(dst)
