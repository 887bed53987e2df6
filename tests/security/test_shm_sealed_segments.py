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
import time

import pytest
import torch
from loopback import held_descriptors

from kvbridge import KVLayout, KVPool, KVReceiver, KVSender
from kvbridge.segments import close_fds
from kvbridge.transports.shm_server import _path_of
from kvbridge.transports.wire import (Kind, decode_error, encode_request, pack, recv_exact, recv_header_fds,
                                      unpack_header)

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
            k, body, fds = _call(a, Kind.SEGFD, 6, b"\x02" + name)       # a flag that is neither
            assert k is Kind.ERROR and fds == []
            table = snd.servers[0].table                                 # type: ignore[attr-defined]
            k, body, fds = _call(a, Kind.SEGFD, 7, b"\x01" + table.segment.name.encode())
            assert k is Kind.ERROR and fds == [] and "may only read" in str(decode_error(body))
            k, body, fds = _call(b, Kind.MAP, 8, encode_request(h.to_bytes(), None, None))   # a MAP shows it
            assert k is Kind.MAPPED and fds == []                        # read-only too
            k, body, fds = _call(b, Kind.SEGFD, 9, b"\x01" + name)
            assert k is Kind.ERROR and fds == [] and "may only read" in str(decode_error(body))
            held = 0
            for rid in (10, 11, 12, 13):                                 # each a duplicate the server closes
                k, body, fds = _call(b, Kind.SEGFD, rid, b"\x00" + name)
                assert k is Kind.OK and len(fds) == 1
                close_fds(fds)
                time.sleep(0.05)                # the server closes its duplicate just after the send
                held = held or len(held_descriptors(src.segment.name))  # after the first: its read-only one made
                assert len(held_descriptors(src.segment.name)) == held
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


def test_a_segment_is_its_users_alone_and_a_closed_one_lends_no_descriptor() -> None:
    """Mode 0600 (a memfd is born 0777: another user holding any descriptor of it could reopen
    it writable through /proc); each descriptor handed out is a duplicate the caller closes, so
    closing the segment meanwhile cannot make the number it sends another file's; once closed,
    none is handed out."""
    from kvbridge.errors import StaleHandle
    pool = KVPool.allocate(L, 4, shared=True)
    seg = pool.segment
    assert seg is not None
    assert os.fstat(seg.fd).st_mode & 0o777 == 0o600
    import fcntl
    seals = fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SEAL and seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
    from kvbridge import ProtocolError
    from kvbridge.segments import SharedSegment
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(ProtocolError, match="not shared memory"):
        SharedSegment.adopt(r, "kvb-1-000000000000", False)           # a pipe: refused, and closed
    with pytest.raises(OSError):
        os.fstat(r)
    a, b = seg.peer_fd(False), seg.peer_fd(False)
    assert len({a, b, seg.fd}) == 3                       # duplicates, not the segment's own numbers
    os.close(a)
    os.close(b)
    assert len(held_descriptors(seg.name)) == 3                      # its own, its read-only one, its mapping's
    pool.close()
    assert held_descriptors(seg.name) == []                          # every one closed, once
    with pytest.raises(StaleHandle):
        seg.peer_fd(False)


CHILD = r"""
import array, socket, struct, sys
path = bytes.fromhex(sys.argv[1])
open_frame, segfd_frame, hfmt = bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3]), sys.argv[4]
H = struct.Struct(hfmt)
s = socket.socket(socket.AF_UNIX)
s.settimeout(10)
s.connect(path)
def reply():
    msg, anc, _, _ = s.recvmsg(H.size, socket.CMSG_SPACE(16), socket.MSG_WAITALL)
    fds = [fd for lvl, typ, d in anc for fd in array.array("i", d[:len(d) - len(d) % 4])]
    fields = H.unpack(msg)
    n = fields[-1]
    body = b""
    while len(body) < n:
        body += s.recv(n - len(body))
    return fields, body, fds
s.sendall(open_frame)
f1, _, fds1 = reply()
s.sendall(segfd_frame)
f2, body2, fds2 = reply()
print(f1[2], f2[2], len(fds1), len(fds2), body2[2:].decode(errors="replace"))
"""


def _python_for_nobody() -> "str | None":
    """An interpreter uid 65534 can run (a virtualenv under /root is not one): the child needs
    only the standard library."""
    import shutil
    import subprocess
    import sys
    for cand in (sys.executable, getattr(sys, "_base_executable", None), shutil.which("python3"), "/usr/bin/python3"):
        try:
            if cand and subprocess.run([cand, "-I", "-c", "pass"], user=65534, group=65534,
                                       capture_output=True, timeout=30).returncode == 0:
                return cand
        except OSError:             # not executable for that user
            pass
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a peer as another user")
def test_another_users_process_gets_no_descriptor() -> None:
    """A process of another user holding a valid handle may OPEN (the handle authorizes the read),
    but SEGFD refuses it (AccessDenied): a sender's segments are its own user's, as 0600 files
    in /dev/shm were."""
    import subprocess
    from kvbridge.transports.wire import HEADER
    src = _sender_pool()
    with KVSender(src, "shm://", leases=False) as snd:
        h = snd.publish("r", src.alloc(2), 4)
        assert src.segment is not None
        open_frame = pack(Kind.OPEN, 1, encode_request(h.to_bytes(), None, None))
        segfd = pack(Kind.SEGFD, 2, b"\x00" + src.segment.name.encode())
        python = _python_for_nobody()
        if python is None:
            pytest.skip("no Python interpreter that uid 65534 may run")
        r = subprocess.run([python, "-I", "-c", CHILD, _path_of(h.urls[0]).encode().hex(), open_frame.hex(),
                            segfd.hex(), HEADER.format], user=65534, group=65534, capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0, r.stderr[-2000:]
        kinds = r.stdout.split()
        assert kinds[:4] == [str(int(Kind.MAPPED)), str(int(Kind.ERROR)), "0", "0"], r.stdout
        assert "uid 65534" in r.stdout, r.stdout


def test_a_segment_dropped_from_the_map_cache_stays_mapped_for_whoever_holds_it(monkeypatch) -> None:
    """A reader keeps its last MAX_MAPPED peer segments mapped; one dropped from that cache while
    a copy on another thread still reads it by address (the MAP path of many coded handles) must
    stay mapped until its last holder lets go -- closing it there unmapped it under the copy."""
    from kvbridge.segments import SharedSegment
    from kvbridge.transports.shm import MAX_MAPPED, ShmTransport
    from kvbridge.transports.shm_onesided import Peer
    own = [SharedSegment(f"kvb-{os.getpid()}-{i:012x}", 4096) for i in range(MAX_MAPPED + 2)]
    by_name = {s.name: s for s in own}
    own[0].view[:4] = b"KEEP"
    tr = ShmTransport()
    monkeypatch.setattr(tr, "_peer_segment",
                        lambda peer, name, writable: SharedSegment.adopt(by_name[name].peer_fd(False), name, False))
    peer = Peer(os.getpid(), os.getuid(), None, None, "test")          # type: ignore[arg-type]
    try:
        held = tr._segment(own[0].name, False, peer)                   # a copy holds it ...
        for seg in own[1:]:                                            # ... while others push it out
            tr._segment(seg.name, False, peer)
        assert (own[0].name, False, os.getuid()) not in tr._maps
        assert held.mmap is not None and not held.mmap.closed and bytes(held.view[:4]) == b"KEEP"
        # one mapping per (segment, writable, peer user): a read-only one is never lent to a writer
        calls = []
        monkeypatch.setattr(tr, "_peer_segment", lambda peer, name, writable: calls.append((name, writable, peer.uid))
                            or SharedSegment.adopt(by_name[name].peer_fd(writable), name, writable))
        name = own[-1].name
        assert not tr._segment(name, False, peer).writable and calls == []          # mapped above
        assert tr._segment(name, True, peer).writable and len(calls) == 1
        other = Peer(os.getpid(), os.getuid() + 1, None, None, "test")            # type: ignore[arg-type]
        tr._segment(name, False, other)
        assert len(calls) == 2 and calls[-1][2] == os.getuid() + 1
    finally:
        tr.close()
        for seg in own:
            seg.close()


def test_a_connection_may_ask_only_for_the_latest_segments_it_was_shown_and_forgets_them_on_close() -> None:
    """The server keeps, per connection, the last MAX_SHOWN segments its replies named (a reader of
    many coded handles sees one frames segment each): an older one is refused, a write right once
    given (a WMAP) is kept when a MAP names the same segment again, and a closed connection's list
    goes with it."""
    from kvbridge.segments import SharedSegment
    from kvbridge.transports.shm_server import MAX_SHOWN
    src = _sender_pool()
    segs = [SharedSegment(f"kvb-{os.getpid()}-{i:012x}", 4096) for i in range(MAX_SHOWN + 1)]
    with KVSender(src, "shm://", leases=False) as snd:
        srv = snd.servers[0]
        a, b = socket.socketpair(socket.AF_UNIX)
        b.settimeout(5)

        def ask(seg: SharedSegment, flag: bytes) -> tuple[Kind, list[int]]:
            srv._segfd(a, 1, flag + seg.name.encode())           # type: ignore[attr-defined]
            head, fds = recv_header_fds(b)
            k, _, n = unpack_header(head, data_ok=False)
            if n:
                recv_exact(b, n)
            close_fds(list(fds))                                   # closed; the caller sees how many came
            return k, fds
        try:
            for seg in segs:
                srv._show(a, seg, False)                          # type: ignore[attr-defined]
            srv._show(a, segs[-1], True)                          # type: ignore[attr-defined]
            srv._show(a, segs[-1], False)                         # type: ignore[attr-defined]
            assert ask(segs[0], b"\x00") == (Kind.ERROR, [])      # pushed out by the newer ones
            k, fds = ask(segs[1], b"\x00")
            assert k is Kind.OK and len(fds) == 1
            k, fds = ask(segs[-1], b"\x01")                       # still writable after the MAP
            assert k is Kind.OK and len(fds) == 1
            assert ask(segs[1], b"\x01") == (Kind.ERROR, [])
            srv.connection_closed(a)                              # type: ignore[attr-defined]
            assert a not in srv._shown                            # type: ignore[attr-defined]
            assert ask(segs[1], b"\x00") == (Kind.ERROR, [])
        finally:
            a.close()
            b.close()
            for seg in segs:
                seg.close()


def test_no_proc_to_reopen_a_segment_through_is_a_clear_error(monkeypatch) -> None:
    """The read-only descriptor is opened through /proc/self/fd: without /proc a reader gets a
    ConfigError that says so, not a segment 'gone' or a writable descriptor instead."""
    import kvbridge.segments as segments
    from kvbridge.errors import ConfigError
    seg = segments.SharedSegment(f"kvb-{os.getpid()}-{'ab' * 6}", 4096)
    real = os.open

    def no_proc(path, *a, **k):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(2, "No such file or directory", path)
        return real(path, *a, **k)
    monkeypatch.setattr(segments.os, "open", no_proc)
    try:
        with pytest.raises(ConfigError, match="/proc/self/fd"):
            seg.peer_fd(False)
        w = seg.peer_fd(True)                      # a writer's needs no /proc
        os.close(w)
    finally:
        seg.close()
