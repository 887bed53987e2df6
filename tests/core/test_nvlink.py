"""nvlink:// on this machine: the control channel, grants, row copies, checksums and errors.

Without a GPU the transport runs in one process with pools marked as device memory
(``_staged``, as in test_staging.py): the server and client then share the buffers
directly, which is also what nvlink:// does for a sender and receiver in one process.
The CUDA IPC path (two processes, one GPU) is in ``tests/core/test_nvlink_cuda.py`` and in
the conformance suite, both skipped without a CUDA device and CuPy.
"""

from __future__ import annotations

import random
import struct
import sys

import pytest
import torch

from kvbridge import (Action, BackendUnavailable, ConfigError, IntegrityError, KVLayout, KVPool, KVReceiver,
                      KVSender, ProtocolError, StaleHandle)
from kvbridge.transports import get_transport_class, nvlink

from ._peer import wait_until

pytestmark = pytest.mark.timeout(60)
LAYOUTS = [KVLayout.vllm_flash(3, 2, 64, 8, dtype="float16"),
           KVLayout.split_kv(2, 2, 4, block_size=4, dtype="bfloat16"),
           KVLayout.mla(3, 16, block_size=4, dtype="bfloat16"),
           KVLayout.flashinfer(2, 1, 8, block_size=2, dtype="float32")]


def _device_pool(layout: KVLayout, n: int, seed: int = 0) -> KVPool:
    pool = KVPool.allocate(layout, n)
    g = torch.Generator().manual_seed(seed)
    for b in pool.buffers:
        b.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (b.numel() * b.element_size(),),
                                                         dtype=torch.uint8, generator=g))
    pool._staged = True
    return pool


def _same(a: KVPool, ai: list[int], b: KVPool, bi: list[int]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for layer in range(a.layout.num_layers)
               for i, j in zip(ai, bi) for x, y in zip(a.block(layer, i), b.block(layer, j)))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda L: f"{L.kv_order.value}-{L.dtype}")
@pytest.mark.parametrize("leases", [False, None])
def test_fetch_moves_exact_bytes_and_verifies(layout, leases):
    src, dst = _device_pool(layout, 40, 1), _device_pool(layout, 40, 2)
    src.alloc(40)
    ids, out = random.Random(3).sample(range(40), 11), random.Random(4).sample(range(40), 11)
    with KVSender(src, "nvlink://", leases=leases) as snd, KVReceiver(dst, leases=leases) as rcv:
        h = snd.publish("r", ids, 11 * layout.block_size)
        assert len(h.checksums) == 11 and snd.url.startswith("nvlink://@")
        res = rcv.fetch(h, out)
        assert res.ok, res.error
        assert res.nbytes == 11 * layout.block_nbytes and _same(src, ids, dst, out)


def test_subsets_layerwise_host_destination_and_push():
    L = LAYOUTS[0]
    src, dst = _device_pool(L, 40, 5), _device_pool(L, 40, 6)
    src.alloc(40)
    src.ref(list(range(40)))
    ids = random.Random(7).sample(range(40), 8)
    with KVSender(src, "nvlink://", leases=False) as snd, KVReceiver(dst, leases=False, listen="nvlink://") as rcv:
        h = snd.publish("sub", ids, 64)
        res = rcv.fetch(h, [1, 2, 3], indices=[5, 0, 2], release=False)
        assert res.ok and _same(src, [ids[5], ids[0], ids[2]], dst, [1, 2, 3])
        host = KVPool.allocate(L, 8)                 # a host destination: copied down from the device side
        with KVReceiver(host, leases=False) as r2:
            assert r2.fetch(h, list(range(8))).ok and _same(src, ids, host, list(range(8)))
        lw = snd.publish("lw", ids[:4], 32, layers_ready=1)
        t = rcv.start_fetch(lw, [30, 31, 32, 33])
        snd.mark_ready(lw, L.num_layers)
        assert t.result(20).ok and _same(src, ids[:4], dst, [30, 31, 32, 33])
        resv = rcv.reserve([20, 21, 22])
        push = snd.push(resv.reservation, ids[5:8])
        assert push.result(20).ok, push.result(0).error
        assert resv.result(20).ok and _same(src, ids[5:8], dst, [20, 21, 22])


def test_corrupted_blocks_fail_their_checksum():
    L = LAYOUTS[0]
    src, dst = _device_pool(L, 20, 8), _device_pool(L, 20, 9)
    src.alloc(20)
    ids = [4, 9, 1, 16]
    with KVSender(src, "nvlink://", leases=False) as snd, KVReceiver(dst, leases=False) as rcv:
        h = snd.publish("bad", ids, 32)
        src.block(2, 1)[1].view(-1).view(torch.uint8)[0] ^= 0xFF
        res = rcv.fetch(h, [0, 1, 2, 3])
        assert isinstance(res.error, IntegrityError) and res.failed_block_ids == [2]


def test_blocks_freed_during_the_copy_are_discarded(monkeypatch):
    """Validate-after-read: the handle ends while the copy runs; DONE says stale, the fetch fails."""
    L = LAYOUTS[0]
    src, dst = _device_pool(L, 20, 10), _device_pool(L, 20, 11)
    src.alloc(20)
    with KVSender(src, "nvlink://", leases=False) as snd, KVReceiver(dst, leases=False) as rcv:
        h = snd.publish("gone", [3, 4], 16)
        real = nvlink.copy_pieces

        def revoking(*a):
            snd.revoke(h)
            return real(*a)
        monkeypatch.setattr(nvlink, "copy_pieces", revoking)
        res = rcv.fetch(h, [0, 1])
        assert isinstance(res.error, StaleHandle) and res.action is Action.REPREFILL
        # the sender frees once the read's grant ends, just after its stale DONE reply
        assert wait_until(lambda: src.refcount(3) == 0 and src.refcount(4) == 0)


def test_host_pools_are_refused():
    with pytest.raises(ConfigError, match="host memory"):
        KVSender(KVPool.allocate(LAYOUTS[0], 4), "nvlink://", leases=False)


def test_missing_cupy_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert get_transport_class("nvlink://@x") is nvlink.NVLinkTransport     # importing needs no CuPy
    with pytest.raises(BackendUnavailable, match=r"kvbridge\[cupy\]"):
        nvlink.cupy_or_error()


def _mapped(pid: int, bufs: list[tuple[bytes, int]], runs: list[tuple[int, int]]) -> bytes:
    body = nvlink._PROC.pack(bytes(16), pid) + nvlink._EVENT.pack(bytes(16), bytes(64))
    body += struct.pack("!H", len(bufs)) + b"".join(nvlink._BUF.pack(b"e" * 16, h.ljust(64, b"\0"), 0, n)
                                                     for h, n in bufs)
    return body + struct.pack("!I", len(runs)) + b"".join(nvlink._RUN.pack(o, n) for o, n in runs)


def test_mapped_frames_are_parsed_defensively():
    m, runs = nvlink._parse_mapped(_mapped(1, [(b"h", 100), (b"h", 50)], [(120, 30), (0, 10)]), 0, False)
    assert m.pieces(runs).tolist() == [[1, 20, 30], [0, 0, 10]]
    for bad in ([(90, 20)], [(0, 10), (90, 20)], [(150, 1)], [(2 ** 64 - 1, 1)], [(0, 2 ** 64 - 1)],
                [(2 ** 63, 2 ** 63)], [(149, 2 ** 64 - 149)]):       # crosses a buffer end, or wraps around
        with pytest.raises(ProtocolError):
            nvlink._parse_mapped(_mapped(1, [(b"h", 100), (b"h", 50)], bad), 0, False)
    with pytest.raises(ProtocolError):
        nvlink._parse_mapped(_mapped(1, [(b"h", 100)], [(0, 10)])[:-1], 0, False)
    body = _mapped(1, [(b"", 100)], [(0, 10)])                    # another process, nothing CUDA IPC can open
    m, runs = nvlink._parse_mapped(body, 0, False)
    assert not m.local
    with pytest.raises(ConfigError, match="not CUDA memory"):
        nvlink.NVLinkTransport()._flats(m, 0)


_LIAR = r"""
import socket, struct, sys
from kvbridge.transports import nvlink
from kvbridge.transports.wire import FENCE, HEADER, Kind, decode_request, encode_layers, pack, recv_exact, unpack_header
name, token, pid, eid = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3]), bytes.fromhex(sys.argv[4])
size, n = int(sys.argv[5]), int(sys.argv[6])
lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
lst.bind("\0" + name)
lst.listen(8)
print("ready", flush=True)
while True:
    conn, _ = lst.accept()
    try:
        while True:
            kind, rid, length = unpack_header(recv_exact(conn, HEADER.size))
            payload = recv_exact(conn, length) if length else b""
            if kind is Kind.WMAP:   # "I am the process you are": its own export, offset 0
                lo, hi = decode_request(payload).layers
                body = (FENCE.pack(0, 0) + encode_layers(lo, hi, b"") + nvlink._PROC.pack(token, pid)
                        + nvlink._EVENT.pack(bytes(16), bytes(64)) + struct.pack("!H", 1)
                        + nvlink._BUF.pack(eid, bytes(64), 0, size) + struct.pack("!I", 1) + nvlink._RUN.pack(0, n))
                conn.sendall(pack(Kind.MAPPED, rid, body))
            else:
                conn.sendall(pack(Kind.OK, rid))
    except Exception:
        conn.close()
"""


def test_a_peer_process_cannot_pass_for_this_one(tmp_path):
    """Whether MAPPED names this process's own exports (copied directly) is decided by the
    socket's peer (SO_PEERCRED), not by the token and pid the body carries: a peer that learnt
    them from one MAPPED would otherwise have this process push into its own pool where it chose."""
    import os
    import subprocess
    import dataclasses
    L = LAYOUTS[0]
    victim, src = _device_pool(L, 4, 1), _device_pool(L, 4, 2)
    victim.alloc(4)
    before = [b.clone() for b in victim.buffers]
    with KVSender(victim, "nvlink://", leases=False) as served, KVReceiver(_device_pool(L, 4, 3), leases=False) as r:
        assert r.fetch(served.publish("x", [0], L.block_size), [0]).ok       # its buffers are exported now
        (export, *_) = served.servers[0].exports._by_ptr.values()
        name = f"kvb-test-nvlink-liar-{os.getpid()}"
        token = bytes(16)                     # what MAPPED bodies carry now: nothing that says "me"
        liar = subprocess.Popen([sys.executable, "-c", _LIAR, name, token.hex(), str(os.getpid()), export.eid.hex(),
                                 str(export.flat.numel()), str(L.block_nbytes)], stdout=subprocess.PIPE, text=True)
        try:
            assert liar.stdout is not None and liar.stdout.readline().strip() == "ready"
            with KVReceiver(KVPool.allocate(L, 4, shared=True), listen="shm://", leases=False) as rcv:
                resv = dataclasses.replace(rcv.reserve([0], "r").reservation, urls=(f"nvlink://@{name}",))
            src.alloc(4)
            with KVSender(src, "nvlink://", leases=False) as snd:
                res = snd.push(resv, [1]).result(20)
            assert not res.ok
            assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, victim.buffers))
        finally:
            liar.kill()
            liar.wait()


def test_bad_urls():
    with pytest.raises(ConfigError):
        nvlink._path_of("shm://@x")
    with pytest.raises(ConfigError):
        nvlink._path_of("nvlink://@")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine bench.gpu runs for real")
def test_bench_gpu_says_no_gpu_and_exits_0():
    import os
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "bench.gpu"], cwd=root, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": root})
    assert r.returncode == 0 and "no CUDA device" in r.stdout


@pytest.mark.parametrize("in_place", [True, False])
def test_a_pool_whose_buffers_change_is_served_from_the_new_ones(in_place):
    """The sender keeps each pool's MAPPED buffer table; a buffer swapped into the list (or a
    new list) is exported anew, never served from the old memory."""
    L = KVLayout.vllm_flash(2, 2, 8, 4, dtype="float16")
    src, dst = _device_pool(L, 10, 1), _device_pool(L, 10, 2)
    src.alloc(10)
    with KVSender(src, "nvlink://", leases=False, checksums=False) as snd, \
            KVReceiver(dst, leases=False, verify=False) as rcv:
        assert rcv.fetch(snd.publish("a", [1, 2], 8), [3, 4]).ok and _same(src, [1, 2], dst, [3, 4])
        g = torch.Generator().manual_seed(9)
        fresh = [torch.randint(0, 256, (b.numel() * b.element_size(),), dtype=torch.uint8, generator=g)
                 .view(b.dtype).view(b.shape) for b in src.buffers]
        if in_place:
            src.buffers[0] = fresh[0]
        else:
            src.buffers = fresh
        src._views = None
        res = rcv.fetch(snd.publish("b", [5, 6], 8), [7, 8])
        assert res.ok, res.error
        assert _same(src, [5, 6], dst, [7, 8])
