"""shm://'s one-sided reads (a base of :class:`~kvbridge.transports.shm.ShmTransport`): the
first read from a sender sends OPEN, authorized like a MAP, and maps what it answers -- the
sender's pool, its block generations and its live-handle table -- read-only; from then on a
whole raw handle into a host pool is read with no message at all: check, copy, re-check,
seqlock-style (:mod:`.shmtable` has the safety argument), in one C call
(``kvbridge.blockcopy.shm_read``) where the geometry allows. The OPEN connection stays as the
sender's liveness watch, polled at most once per ``LIVENESS_EVERY``. Where a read cannot be
vouched for, None sends the caller to the MAP/DONE exchange."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Literal, NamedTuple, Optional, Sequence, Union

from ..blockcopy import copy_blocks, planes
from ..blockcopy import shm_fetch as _shm_fetch
from ..blockcopy import shm_read as _shm_read
from ..errors import ConfigError, KVBridgeError, ProtocolError, StaleHandle, TransferCancelled
from ..handle import KVHandle
from ..lease.base import Claim
from ..pool import KVPool, retired_during
from ..segments import SharedSegment, check_segment_name, close_fds, peer_cred
from .base import Fallback, Spans, Transport, unverified
from .deadline import WATCHDOG
from .shm_server import _path_of
from .shmcopy import copy_into
from .shmtable import ONE_SIDED, SenderMap
from .sockets import MAX_PEERS, SocketClient
from .wire import (Kind, decode_error, encode_request, map_os_error, pack, recv_exact,
                   recv_header_fds, unpack_header)

__all__ = ["OneSidedReads", "LIVENESS_EVERY"]

_disarm = WATCHDOG.disarm

# An OPEN reply (shmtable.open_info: a layout and one offset per buffer) held to this before its
# body is read: the reader builds a plane per layer and part from it (a 7.6 MiB one naming
# 4 million layers took 3.3 GB and 8 s)
MAX_OPEN_REPLY = 256 << 10


def _blockwise(m: SenderMap, pool: KVPool, dst_ids: Sequence[int], n: int) -> bool:
    """``n`` of the sender's blocks go whole into as many whole blocks ``dst_ids`` of ``pool``, of
    the same geometry on both sides: block-by-block copies (one C pass) are then exact. (A
    sender announcing another layout would have each copy spill into the next destination
    block: not here; m.part is derived from m.layout, so an equal compat hash means an equal
    part.)"""
    return len(dst_ids) == n and m.layout.compat_hash == pool.layout.compat_hash


# what the one-call read takes of a destination pool: (pool, its buffers, its planes -- b"" where
# whole blocks cannot be read into it in one call --, its generations list, bytes per block)
Lane = tuple[Any, Any, bytes, list[int], int]
LIVENESS_EVERY = 0.001   # seconds between two checks that a one-sided reader's sender is alive

def _released(m: SenderMap) -> bool:
    """Whether this reader released the mapping (it is closing it) -- what a ValueError from the
    one-call read means then, rather than a read outside the mapped pools."""
    try:
        len(m.view), len(m.gens), len(m.tview)
    except ValueError:
        return True
    return False


def _changed(code: int, handle: KVHandle) -> KVBridgeError:
    """The one-call read's codes 2 (the source changed under the copy) and 3 (a destination
    block was freed or retired meanwhile) as errors."""
    if code == 2:
        return StaleHandle("blocks were freed during the copy; bytes discarded")
    return retired_during(handle.request_id)


class Peer(NamedTuple):
    """The connection a MAPPED reply came on, for :meth:`OneSidedReads._peer_segment`."""
    pid: int                 # the peer's process and user (SO_PEERCRED)
    uid: int
    sock: socket.socket
    client: SocketClient
    what: str


MAX_SEGFD_REPLY = 4096   # an ERROR's body; an OK has none


class OneSidedReads(Transport):
    """OPEN once per sender, then reads with no message. The state below is set up by
    :meth:`ShmTransport.__init__ <kvbridge.transports.shm.ShmTransport>`."""

    _lock: threading.Lock
    _opening: dict[str, list[Any]]
    _senders: dict[str, Optional[SenderMap]]
    _by_path: dict[str, Optional[SenderMap]]
    after_copy: Optional[Callable[[KVHandle], None]]

    if TYPE_CHECKING:      # the transport's, used to OPEN
        def _client(self, url: str) -> SocketClient: ...

    def _sender(self, url: str, handle: KVHandle, claim: Optional[Claim]) -> Optional[SenderMap]:
        """The sender at ``url`` mapped for one-sided reads: OPEN once (a refusal of the
        handle is raised, as MAP would); None where the sender does not offer them."""
        try:
            return self._senders[url]
        except KeyError:
            pass
        path = _path_of(url, self.scheme)
        # One OPEN per sender, even when reads race; a sender slow to answer holds up only reads
        # from itself. Its lock lives while OPENs of it are under way (nothing kept per URL).
        with self._lock:
            entry = self._opening.setdefault(path, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                with self._lock:
                    if path in self._by_path:          # mapped meanwhile, or another URL of it
                        return self._keep(url, path, self._by_path[path])
                return self._open_sender(url, path, handle, claim)
        finally:
            with self._lock:
                entry[1] -= 1
                if not entry[1]:
                    del self._opening[path]

    def _keep(self, url: str, path: str, m: Optional[SenderMap]) -> Optional[SenderMap]:
        """``m`` is the sender at ``url`` (its socket ``path``), this transport's lock held. At most
        ``MAX_PEERS`` URLs and senders are kept (handles naming ever new URLs -- unsigned ones
        from a hostile source, one socket under many spellings -- neither grow them nor map a
        sender twice): the oldest are forgotten."""
        self._senders[url] = self._by_path[path] = m
        while len(self._senders) > MAX_PEERS:
            del self._senders[next(iter(self._senders))]
        while len(self._by_path) > MAX_PEERS:
            old = self._by_path[next(iter(self._by_path))]
            if old is None:
                del self._by_path[next(iter(self._by_path))]
            else:
                self._forget_locked(old)   # a read under way finds it gone at its next liveness check
        return m

    def _forget_locked(self, m: SenderMap) -> None:
        """No URL or socket names ``m`` any more and its watch is closed (this transport's lock
        held): every spelling of a sender forgotten goes with it, none keeps reading through a
        closed watch. The mapping is left to the garbage collector: another thread may still be
        copying out of it."""
        for u in [u for u, v in self._senders.items() if v is m]:
            del self._senders[u]
        for path in [p for p, v in self._by_path.items() if v is m]:
            del self._by_path[path]
        m.watch.close()

    def _open_sender(self, url: str, path: str, handle: KVHandle, claim: Optional[Claim]) -> Optional[SenderMap]:
        client = self._client(url)
        what = f"open {url}"
        start = time.monotonic()     # the OPEN and its whole reply: Timeout.transfer plus its bytes at the minimum rate
        sock, k, _, length = client.call(Kind.OPEN, encode_request(handle.to_bytes(), None, claim), what, 0)
        try:
            if k is Kind.MAPPED and length > MAX_OPEN_REPLY:     # a real one is a few KB
                raise ProtocolError(f"{what}: an OPEN reply of {length} bytes (at most {MAX_OPEN_REPLY})")
            if length:
                client.arm(sock, length, start)
            body = recv_exact(sock, length) if length else b""
        except BaseException as exc:
            raise client.fail(sock, exc, what) from None
        if k is Kind.ERROR:
            client.put_back(sock)
            raise decode_error(body)
        m: Optional[SenderMap] = None
        if k is Kind.MAPPED:
            cut = _disarm(sock)
            if cut:                            # kept as the liveness watch, never pooled: disarmed here
                sock.close()
                raise client.cut_error(what, cut)
            try:
                info = json.loads(body)
                peer = Peer(*peer_cred(sock), sock, client, what)
                seg = self._peer_segment(peer, info["segment"], False)
                try:
                    table = self._peer_segment(peer, info["table"], False)
                except BaseException:
                    seg.close()
                    raise
            except KVBridgeError:
                sock.close()
                raise
            except (ValueError, KeyError, TypeError):
                sock.close()
                raise ProtocolError("OPEN reply is malformed") from None
            try:
                m = SenderMap(body, seg, table)
            except BaseException:
                seg.close()
                table.close()
                sock.close()
                raise
            sock.setblocking(False)
            m.watch = sock                     # kept: its EOF says the sender is gone
            m.poll = select.poll()
            m.poll.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
        else:
            client.put_back(sock)
        with self._lock:
            return self._keep(url, path, m)

    @staticmethod
    def _peer_segment(peer: Peer, name: Any, writable: bool) -> SharedSegment:
        """A segment a reply on ``peer.sock`` named, mapped from the descriptor the peer passes for
        it there (SEGFD, held to ``Timeout.transfer``): only a kvbridge name, a descriptor of
        shared memory sealed against shrinking that the peer's user owns
        (:meth:`SharedSegment.adopt`). ProtocolError, StaleHandle (the segment is gone) or the
        connection's error otherwise; any descriptor that came and is not kept is closed."""
        name = check_segment_name(name)
        sock, client = peer.sock, peer.client
        rid = client.next_id()
        fds: list[int] = []
        try:
            client.arm(sock, 0)
            sock.sendall(pack(Kind.SEGFD, rid, (b"\x01" if writable else b"\x00") + name.encode()))
            head, fds = recv_header_fds(sock)
            k, got, length = unpack_header(head, data_ok=False)
            if length > MAX_SEGFD_REPLY:
                raise ProtocolError(f"{peer.what}: a SEGFD reply of {length} bytes")
            body = recv_exact(sock, length) if length else b""
        except BaseException as exc:
            close_fds(fds)
            if _disarm(sock):
                raise client.cut_error(peer.what) from None
            raise map_os_error(exc, peer.what) if isinstance(exc, OSError) else exc
        if _disarm(sock):
            close_fds(fds)
            raise client.cut_error(peer.what)
        if k is Kind.ERROR:
            close_fds(fds)
            raise decode_error(body)
        if k is not Kind.OK or got != rid or len(fds) != 1:
            close_fds(fds)
            raise ProtocolError(f"{peer.what}: the peer answered SEGFD with {k.name} and {len(fds)} "
                                "descriptors, not one")
        try:
            return SharedSegment.adopt(fds[0], name, writable, peer.uid)
        except ConfigError as exc:
            raise StaleHandle(f"the peer's shared memory is gone: {exc}") from None

    def _forget(self, m: SenderMap) -> None:
        """Stop reading one-sided from a sender that went away (under every URL naming it)."""
        with self._lock:
            self._forget_locked(m)

    def _read_one_sided(self, url: str, m: SenderMap, handle: KVHandle, dst: Spans,
                        indices: Optional[list[int]]) -> Optional[int]:
        """Check, copy, re-check; None when the fast path cannot vouch for the read (the
        MAP/DONE exchange then answers, with the sender's own refusal if there is one)."""
        if (_shm_read is not None and indices is None and dst.block_ids is not None
                and _blockwise(m, dst.pool, dst.block_ids, handle.num_blocks)):
            return self._read_native(url, m, handle, dst)
        hit = m.lookup(handle.to_bytes())
        if hit is None:
            return None
        ids, want, gens, nb = handle.block_ids, handle.generations, m.gens, m.num_blocks
        for b, g in zip(ids, want):
            if not 0 <= b < nb or gens[b] != g:
                return None
        sel: Sequence[int]
        if indices is None:
            sel = ids
        else:
            n = len(ids)
            if any(not 0 <= i < n for i in indices) or len(set(indices)) != len(indices):
                return None
            sel = [ids[i] for i in indices]
        if dst.block_ids is not None and _blockwise(m, dst.pool, dst.block_ids, len(sel)):
            # one C pass copies them and, when asked, hashes each as it lands
            if dst.cancel is not None and dst.cancel.is_set():
                raise TransferCancelled("transfer cancelled")
            # Both memories stay mapped across the C call: the destination's buffers are held
            # here, and a slice of the sender's mapping makes closing it fail (BufferError).
            bufs, pin = dst.pool.buffers, None
            try:
                try:
                    pin = m.view[0:0]
                except ValueError:            # released: this reader is closing the mapping
                    raise ProtocolError("the sender's mapping was closed by this reader") from None
                dst.digests = copy_blocks(planes(dst.pool), dst.block_ids, m.packed, sel, m.part,
                                          dst.want_digests or dst.verifier is not None)
            except ValueError as exc:
                raise ProtocolError(f"one-sided read outside the mapped pools: {exc}") from None
            finally:
                if pin is not None:
                    pin.release()
                del bufs
            nbytes = dst.nbytes
        else:
            nbytes = copy_into(dst.views(), m.source_views(list(sel)), dst.on_landed)
        if self.after_copy is not None:
            self.after_copy(handle)
        stale = not m.still(*hit)
        for b, g in zip(ids, want):
            stale = stale or gens[b] != g
        if stale:
            dst.digests = None
            raise StaleHandle("blocks were freed during the copy; bytes discarded")
        return nbytes if self._alive(url, m) else None

    def fetch_whole(self, url: str, handle: KVHandle, pool: KVPool, dst: Any,
                    verify: bool) -> Optional[Union[Literal[True], Fallback]]:
        """The usual fetch from a sender already mapped, whatever its size, in one C call
        (``blockcopy.shm_fetch``): the destination ids checked, their generations taken, the
        blocks marked as landing, then :meth:`_shm_read`'s checks and copy held to them. None
        where nothing was done (not mapped, another geometry, no extension, the sender found
        gone, ids or marks the long way explains); True, or a ``Fallback`` as tcp's."""
        m = self._senders.get(url)
        if m is None or not ONE_SIDED or _shm_fetch is None or not pool.is_host:
            return None
        lane = m.lane
        if lane is None or lane[0] is not pool or lane[1] is not pool.buffers:
            try:
                lane = self._lane(m, pool)
            except KVBridgeError:          # a closed pool: the long way says so
                return None
        if not lane[2] or (time.monotonic() >= m.poll_after and not self._alive(url, m)):
            return None
        after = self.after_copy
        try:
            out = _shm_fetch(m.native, handle.to_bytes(), handle.block_ids, handle.generations, lane[2], dst,
                             handle.checksums if verify else None, lane[3], pool._landing,
                             None if after is None else (lambda: after(handle)))
        except ValueError:                # blocks outside the mapped pools, a mapping closed: nothing marked
            return None                   # (the C call undid its marks); the long way says what is wrong
        if out is None or out is True:
            return out
        code, gens, sums = out
        if code == 0:                     # a checksum differs: the pipeline refetches
            return gens, None, (len(gens) * lane[4], unverified(sums, handle, True))
        if code == 1:                     # not vouched for, nothing written: MAP/DONE
            return gens, None, None
        return gens, _changed(code, handle), None

    def _read_native(self, url: str, m: SenderMap, handle: KVHandle, dst: Spans) -> Optional[int]:
        """:meth:`_read_one_sided` of a whole handle into whole blocks of the same geometry in one
        C call (:meth:`_shm_read`). The same outcomes: None, the bytes, or StaleHandle."""
        if dst.cancel is not None and dst.cancel.is_set():
            raise TransferCancelled("transfer cancelled")
        assert dst.block_ids is not None
        lane = self._lane(m, dst.pool)   # the caller saw whole blocks of the same geometry: lane[2] is set
        read, dst.digests = self._shm_read(url, m, handle, lane, dst.block_ids,
                                           dst.want_digests or dst.verifier is not None)
        return dst.nbytes if read else None

    @staticmethod
    def _lane(m: SenderMap, pool: KVPool) -> Lane:
        """What the one-call read takes of the destination ``pool`` (``SenderMap.lane``), made once
        per pool and again where its buffers were replaced; its planes are b"" where it cannot
        take whole blocks into it (no extension, a device pool, another geometry than the sender's)."""
        lane = m.lane
        if lane is None or lane[0] is not pool or lane[1] is not pool.buffers:
            fits = _shm_read is not None and pool.is_host and m.layout.compat_hash == pool.layout.compat_hash
            lane = m.lane = (pool, pool.buffers, planes(pool) if fits else b"", pool.live_generations,
                             pool.layout.block_nbytes)
        return lane

    def _shm_read(self, url: str, m: SenderMap, handle: KVHandle, lane: Lane,
                  block_ids: Sequence[int], want: bool) -> tuple[bool, Optional[list[int]]]:
        """``blockcopy.shm_read``: the handle live in the table and its generations as issued,
        the copy into ``block_ids`` of the lane's pool (hashed as it lands when ``want``), both
        again -- one C call. (True, the digests, or None unhashed) once read; (False, None)
        where it cannot vouch for the read (nothing written, or the sender is gone: MAP/DONE
        then answers); StaleHandle where the blocks changed meanwhile."""
        after = self.after_copy
        # the lane holds the pool's buffers across the C call, as the mapping's view is pinned there
        assert _shm_read is not None
        try:
            code, sums = _shm_read(m.native, handle.to_bytes(), handle.block_ids, handle.generations,
                                   lane[2], block_ids, want, None, None if after is None else (lambda: after(handle)))
        except ValueError as exc:
            if _released(m):
                raise ProtocolError("the sender's mapping was closed by this reader") from None
            raise ProtocolError(f"one-sided read outside the mapped pools: {exc}") from None
        if code >= 2:
            raise _changed(code, handle)
        if code == 1 or (time.monotonic() >= m.poll_after and not self._alive(url, m)):
            return False, None
        return True, sums

    def _alive(self, url: str, m: SenderMap) -> bool:
        """Is the sender still there? Asked at most once per LIVENESS_EVERY: a poll releases the
        GIL, and bytes copied from a sender that died an instant ago were still checked valid.
        False: the sender closed or died; forgotten, so MAP/DONE says which."""
        alive = True
        now = time.monotonic()
        if now < m.poll_after:
            return True
        m.poll_after = now + LIVENESS_EVERY
        if m.watch.fileno() < 0:              # forgotten (closed): its descriptor may be another's now
            return False
        try:
            quiet = not m.poll.poll(0)        # nothing arrived on the control socket: no EOF
        except RuntimeError:                  # another thread is polling it: ask the socket
            quiet = False
        if not quiet:
            try:
                alive = m.watch.recv(1, socket.MSG_PEEK) != b""
            except BlockingIOError:
                alive = True
            except OSError:
                alive = False
        if not alive:
            self._forget(m)
        return alive
