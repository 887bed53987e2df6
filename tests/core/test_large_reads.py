"""A tcp read too large for the one-piece path (over 64 KiB) is received straight into whole
blocks by one C call (``blockcopy.recv_blocks``), each block hashed as its pieces land: the
same bytes and digests however the peer splits its sends, nothing landed outside the blocks
named, and a clear outcome for a peer that closes, stalls, or a transfer cancelled."""

from __future__ import annotations

import random
import socket
import struct
import threading
import time
from typing import Any

import pytest
import torch

from kvbridge import KVLayout, KVPool, KVReceiver, KVSender, blockcopy
from kvbridge.blockcopy import planes
from kvbridge.errors import IntegrityError
from kvbridge.integrity import block_checksums
from kvbridge.transports.base import Spans

from ._pools import LAYOUTS, filled

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(blockcopy.recv_blocks is None, reason="recv_blocks needs the C extension")]


def _wire(pool: KVPool, ids: list[int]) -> bytes:
    """The blocks' bytes in wire order (what a DATA reply carries)."""
    return b"".join(bytes(v) for v in Spans.of_blocks(pool, ids).views())


def _send_in_pieces(sock: socket.socket, data: bytes, sizes: list[int], close: bool = True) -> threading.Thread:
    def run() -> None:
        at = 0
        for n in sizes:
            sock.sendall(data[at:at + n])
            at += n
            time.sleep(0.001)                 # each piece its own receive
        if close:
            sock.shutdown(socket.SHUT_WR)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _pieces(total: int, rng: random.Random, part: int) -> list[int]:
    """Cuts that land on, just before and just after part boundaries, single bytes and runs."""
    out, at = [], 0
    while at < total:
        n = rng.choice([1, 7, part - 1, part, part + 1, 3 * part + 5, rng.randint(1, 4 * part)])
        n = min(n, total - at)
        out.append(n)
        at += n
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_blocks_land_hashed_however_the_bytes_arrive(name: str, seed: int) -> None:
    layout = LAYOUTS[name]
    src, dst = filled(layout, 9, seed), filled(layout, 7, 100 + seed)
    sid, did = [8, 2, 5, 0], [4, 1, 6, 0]
    wire = _wire(src, sid)
    untouched = block_checksums(dst, [2, 3, 5])
    rng = random.Random(seed)
    for hash_ in (True, False):
        mine, theirs = socket.socketpair()
        with mine, theirs:
            t = _send_in_pieces(theirs, wire, _pieces(len(wire), rng, layout.part_nbytes), close=False)
            code, got, sums = blockcopy.recv_blocks(mine.fileno(), planes(dst), did, layout.part_nbytes, hash_, None)
            t.join()
        assert (code, got) == (0, len(wire))
        assert sums == (block_checksums(src, sid) if hash_ else None)
        assert block_checksums(dst, did) == block_checksums(src, sid)
        assert block_checksums(dst, [2, 3, 5]) == untouched               # nothing else written
        dst = filled(layout, 7, 100 + seed)                              # start over for the next round


def test_a_peer_that_closes_early_says_how_much_landed() -> None:
    layout = LAYOUTS["kv_first"]
    src, dst = filled(layout, 4, 1), filled(layout, 4, 2)
    wire = _wire(src, [0, 1])
    mine, theirs = socket.socketpair()
    with mine, theirs:
        _send_in_pieces(theirs, wire[:len(wire) // 2 + 3], [len(wire) // 2 + 3]).join()
        code, got, sums = blockcopy.recv_blocks(mine.fileno(), planes(dst), [2, 3], layout.part_nbytes, True, None)
    assert (code, got, sums) == (1, len(wire) // 2 + 3, None)


def test_a_cancelled_read_stops_between_receives() -> None:
    """The flag is asked after each receive: the peer sends one piece, then the next only once
    the flag was asked (and said no); the second answer stops the read with 200 bytes landed."""
    layout = LAYOUTS["kv_first"]
    src, dst = filled(layout, 4, 1), filled(layout, 4, 2)
    wire = _wire(src, [0, 1])
    asked = [threading.Event(), threading.Event()]

    class Flag:
        n = 0

        def is_set(self) -> bool:
            asked[self.n].set()
            self.n += 1
            return self.n >= 2

    def peer() -> None:
        theirs.sendall(wire[:100])
        asked[0].wait(10)
        theirs.sendall(wire[100:200])
        asked[1].wait(10)
        theirs.sendall(wire[200:])

    flag = Flag()
    mine, theirs = socket.socketpair()
    with mine, theirs:
        t = threading.Thread(target=peer, daemon=True)
        t.start()
        code, got, sums = blockcopy.recv_blocks(mine.fileno(), planes(dst), [2, 3], layout.part_nbytes, True, flag)
        t.join()
    assert (code, got, sums, flag.n) == (2, 200, None, 2)
    assert bytes(Spans.of_blocks(dst, [2]).views()[0][:100]) == wire[:100]


def test_a_silent_peer_times_out_on_the_sockets_own_timeout() -> None:
    layout = LAYOUTS["kv_first"]
    dst = filled(layout, 4, 2)
    mine, theirs = socket.socketpair()
    with mine, theirs:
        mine.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 200_000))
        theirs.sendall(b"x" * 10)
        t0 = time.monotonic()
        with pytest.raises(BlockingIOError):
            blockcopy.recv_blocks(mine.fileno(), planes(dst), [0], layout.part_nbytes, True, None)
        assert time.monotonic() - t0 < 5


def test_blocks_outside_the_pool_are_refused_before_a_byte_is_read() -> None:
    layout = LAYOUTS["kv_first"]
    dst = filled(layout, 4, 2)
    before = block_checksums(dst, range(4))
    mine, theirs = socket.socketpair()
    with mine, theirs:
        theirs.sendall(b"y" * 64)
        for ids in ([0, 4], [-1], [1 << 40]):
            with pytest.raises(ValueError):
                blockcopy.recv_blocks(mine.fileno(), planes(dst), ids, layout.part_nbytes, True, None)
        assert mine.recv(100) == b"y" * 64                               # the bytes are still there
    assert block_checksums(dst, range(4)) == before


BIG = KVLayout.vllm_flash(2, 4, 64, block_size=16, dtype="float16")    # 32 KiB per block


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The blocks of each one-call receive: the pipeline's (recv_blocks) and the usual fetch's
    (fetch_whole, which receives a large reply's blocks straight into place too)."""
    calls: list[int] = []
    for name, ids_at in (("recv_blocks", 2), ("fetch_whole", 6)):
        real = getattr(blockcopy, name)
        assert real is not None

        def counted(*a: Any, real: Any = real, ids_at: int = ids_at) -> Any:
            calls.append(len(a[ids_at]))
            return real(*a)
        monkeypatch.setattr(blockcopy, name, counted)
    return calls


def test_a_verified_large_fetch_takes_the_one_call_and_lands_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_calls(monkeypatch)
    src, dst = filled(BIG, 12, 3), KVPool.allocate(BIG, 12)
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as s, KVReceiver(dst, leases=False) as r:
        res = r.fetch(s.publish("r", [3, 7, 1, 10, 5], 80), [0, 2, 4, 6, 8])
        assert res.ok, res.error
    assert calls == [5]
    assert block_checksums(dst, [0, 2, 4, 6, 8]) == block_checksums(src, [3, 7, 1, 10, 5])


def test_bytes_that_are_not_the_handles_are_refetched_then_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's block changed under the handle without a new generation (a bug or a bad
    disk on its side): the digests of what landed disagree, the block is fetched again, and the
    fetch fails naming it -- the hash taken in the receive loop is what is compared."""
    calls = _count_calls(monkeypatch)
    src, dst = filled(BIG, 12, 3), KVPool.allocate(BIG, 12)
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as s, KVReceiver(dst, leases=False) as r:
        h = s.publish("r", [3, 7, 1, 10, 5], 80)
        src.buffers[1][0, 7].view(torch.uint8).view(-1)[5] ^= 0xFF       # block 7: layer 1's K
        res = r.fetch(h, [0, 2, 4, 6, 8])
    assert not res.ok and isinstance(res.error, IntegrityError)
    assert res.failed_block_ids == [2]
    assert calls[0] == 5


def test_a_layerwise_read_of_every_layer_is_hashed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer-wise handle whose layers are all ready is read in one piece, but its checksums are
    per (layer, block): its own stream verifier hashes it as it lands, and no second pass over
    the landed blocks runs (the one-call receive, whose digests are per block, is not taken)."""
    import kvbridge.receiver_pipeline as pipeline_mod
    calls = _count_calls(monkeypatch)
    second: list[int] = []
    real = pipeline_mod.layer_checksums

    def counted(*a: Any, **k: Any) -> Any:
        second.append(1)
        return real(*a, **k)
    monkeypatch.setattr(pipeline_mod, "layer_checksums", counted)
    src, dst = filled(BIG, 12, 3), KVPool.allocate(BIG, 12)
    with KVSender(src, "tcp://127.0.0.1:0", leases=False) as s, KVReceiver(dst, leases=False) as r:
        h = s.publish("r", [3, 7, 1, 10, 5], 80, layers_ready=1)
        assert s.mark_ready(h, BIG.num_layers)
        res = r.fetch(h, [0, 2, 4, 6, 8])
        assert res.ok, res.error
    assert block_checksums(dst, [0, 2, 4, 6, 8]) == block_checksums(src, [3, 7, 1, 10, 5])
    assert (calls, second) == ([], [])
