"""shm:// segments are memfds sealed against shrinking and growing, passed by descriptor: no
process -- the sender included -- can cut a pool or a handle table from under a reader's mapping
(a copy past a shrunk file's end is SIGBUS, which would kill the reader); a descriptor is handed
only for a segment a reply on the same connection named, read-only to a reader. (A reply that
carries the wrong descriptors: ``test_shm_receiver_defenses.py``.)"""

from __future__ import annotations

import errno
import mmap
import os
import socket

import pytest
import torch

from kvbridge import KVLayout, KVPool, KVReceiver, KVSender
from kvbridge.transports.shm_server import _path_of
from kvbridge.transports.wire import (Kind, close_fds, decode_error, encode_request, pack, recv_exact,
                                      recv_header_fds, unpack_header)

pytestmark = pytest.mark.timeout(60)
L = KVLayout.vllm_flash(2, 1, 8, block_size=2, dtype="float16")


def _sender_pool() -> KVPool:
    p = KVPool.allocate(L, 8, shared=True)
    for b in p.buffers:
        b.view(-1).view(torch.uint8).fill_(0x6B)
    return p


def test_no_process_can_shrink_or_grow_a_segment_a_reader_maps() -> None:
    src = _sender_pool()
    with KVSender(src, "shm://", leases=False) as snd, KVReceiver(KVPool.allocate(L, 8), leases=False) as rcv:
        h = snd.publish("r", src.alloc(2), 4)
        assert rcv.fetch(h, [0, 1]).ok                       # mapped one-sided: the pool and the table
        assert src.segment is not None
        table = snd.servers[0].table                   # type: ignore[attr-defined]
        assert table is not None
        segs = [src.segment, table.segment]
        for seg in segs:
            again = os.open(f"/proc/self/fd/{seg.fd}", os.O_RDWR)   # any process of the user could open it so
            try:
                for fd in (seg.fd, again):
                    for size in (0, seg.size // 2, seg.size + 4096):
                        with pytest.raises(PermissionError) as ei:
                            os.ftruncate(fd, size)
                        assert ei.value.errno == errno.EPERM
            finally:
                os.close(again)
        h2 = snd.publish("r2", src.alloc(2), 4)
        r = rcv.fetch(h2, [2, 3])
        assert r.ok, r.error
        assert bool((rcv.pool.block(0, 2)[0].view(torch.uint8) == 0x6B).all())


def _call(sock: socket.socket, kind: Kind, rid: int, payload: bytes) -> tuple[Kind, bytes, list[int]]:
    sock.sendall(pack(kind, rid, payload))
    head, fds = recv_header_fds(sock)
    k, _, n = unpack_header(head, data_ok=False)
    return k, recv_exact(sock, n) if n else b"", fds


def test_a_descriptor_is_handed_only_for_a_segment_named_on_that_connection_and_read_only() -> None:
    src = _sender_pool()
    with KVSender(src, "shm://", leases=False) as snd:
        h = snd.publish("r", src.alloc(2), 4)
        assert src.segment is not None
        name = src.segment.name.encode()
        path = _path_of(h.urls[0])
        a, b = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
        a.connect(path)
        b.connect(path)
        a.settimeout(5)
        b.settimeout(5)
        try:
            k, body, fds = _call(a, Kind.SEGFD, 1, b"\x00" + name)       # nothing named yet: refused
            assert k is Kind.ERROR and fds == [] and "names no segment" in str(decode_error(body))
            k, body, fds = _call(a, Kind.OPEN, 2, encode_request(h.to_bytes(), None, None))
            assert k is Kind.MAPPED and fds == []
            k, body, fds = _call(a, Kind.SEGFD, 3, b"\x01" + name)       # a reader asking to write
            assert k is Kind.ERROR and fds == [] and "may only read" in str(decode_error(body))
            k, body, fds = _call(b, Kind.SEGFD, 4, b"\x00" + name)       # named on another connection
            assert k is Kind.ERROR and fds == []
            k, body, fds = _call(a, Kind.SEGFD, 5, b"\x00" + name)
            assert k is Kind.OK and len(fds) == 1
            try:
                with pytest.raises(OSError) as ei:
                    os.write(fds[0], b"x")
                assert ei.value.errno == errno.EBADF                     # a read-only descriptor
                with pytest.raises(PermissionError):
                    mmap.mmap(fds[0], src.segment.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                m = mmap.mmap(fds[0], src.segment.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                assert m[:4] == b"\x6b" * 4
                m.close()
            finally:
                close_fds(fds)
        finally:
            a.close()
            b.close()
