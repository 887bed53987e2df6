"""Wire frames shared by the socket transports (tcp, and shm's control channel).

Every frame starts with a 16-byte header ``!2sBBIQ``: magic ``b"KB"``, version,
type, request id, payload length. Control payloads are capped
(:data:`MAX_CONTROL`); a DATA payload's length must equal what the request asked
for. Anything else is a :class:`ProtocolError`. Socket errors are mapped to the
kvbridge tree here, at the boundary.

A read's reply (version 4 and 5)::

    DATA   header | FENCE (!QQ: the claim it was served under; 0, 0: none) | bytes | TRAILER
    LDATA  header | FENCE | LAYERS (!HHI) + checksums | bytes | TRAILER

The declared length covers all of it, so a reply is exactly ``FENCE + LAYERS prefix +
the bytes asked for + TRAILER``: a peer that declares anything else is refused before a
byte is read into the destination. ``TRAILER`` (``!BBH``: status, two zero bytes) is the
owner's validate-after-read, taken *after* the last byte was handed to the kernel (later
changes to pool memory cannot alter bytes already sent). Its status (:class:`Vouch`):

* ``OK`` -- the blocks still had the handle's generations, the handle was live (not
  revoked, expired, closed or released), and, for a leased handle, its lease was certainly
  within its TTL by the owner's clock (:func:`~kvbridge.lease.holds_until`);
* ``UNSURE`` -- the bytes were the handle's, but the owner cannot vouch for its lease (it
  ended the handle, or the lease is within the owner's clock margin of its TTL): the
  reader raises :class:`~kvbridge.errors.Unvouched` and asks the lease store;
* ``STALE`` -- the blocks were freed or reused: the bytes are not the handle's
  (:class:`~kvbridge.errors.StaleHandle`).

Every DATA and LDATA reply carries it (``read``, pipelined ``read_many`` and layer reads
alike); a trailer that refuses a reply leaves the connection in step (the frame was read
whole), so a pipeline goes on with the next reply.

Releases without a reply (version 4) travel in batches: one RELEASES frame holds up to
:data:`MAX_RELEASES` handles, each ``u32 length | handle bytes``, and gets no answer; a
malformed one is dropped whole (no handle of it ends) and the connection goes on. A
CRELEASES frame is the same for leased handles whose lease the owner claimed inside the read
(``CLAIM_ME``): each entry is a request -- the handle and the claim (claimer, fence) the read
reported back -- and the owner, which made that very claim, releases the lease in the store
for its claimer; an entry naming any other claim is dropped.
"""

from __future__ import annotations

import array
import enum
import mmap
import socket
import struct
import threading
import time
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

from ..blockcopy import NATIVE_WIRE_VERSION
from ..segments import close_fds
from ..errors import (ConnectionLost, FrameTooLarge, KVBridgeError, ProtocolError, StaleHandle,
                      TransferTimeout, Unvouched, error_from_code)
from ..lease.base import Claim

__all__ = ["Kind", "Claim", "Request", "FrameReader", "set_os_timeouts", "HEADER", "MAX_CONTROL", "pack",
           "unpack_header", "encode_request", "decode_request", "encode_layers", "decode_layers", "LAYERS", "FENCE",
           "CLAIM_ME", "encode_claim", "TRAILER", "Vouch", "encode_trailer", "check_trailer", "vouch_of",
           "settle_vouch", "encode_error", "decode_error", "recv_exact", "recv_scatter", "send_all", "map_os_error",
           "Budget", "RateGuard", "PacedSender", "MAX_RELEASES", "encode_releases", "decode_releases"]

MAGIC = b"KB"
VERSION = 7     # 5: CRELEASES (a version 4 peer would drop the connection on it); 6: per-part checksums;
                # 7: shm segments by descriptor (SEGFD), one-head layouts' hash without the token order
if NATIVE_WIRE_VERSION is not None and NATIVE_WIRE_VERSION != VERSION:   # a stale build would talk past its peers
    raise ImportError(f"kvbridge._kvcopy speaks frame version {NATIVE_WIRE_VERSION}, this kvbridge {VERSION}: "
                      "rebuild the extension (pip install -e . or python setup.py build_ext --inplace)")
HEADER = struct.Struct("!2sBBIQ")
MAX_CONTROL = 16 << 20
IOV_MAX = 1024


class Kind(enum.IntEnum):
    READ = 1       # handle + indices -> DATA | ERROR
    DATA = 2
    ERROR = 3
    RELEASE = 4    # handle -> OK | ERROR
    OK = 5
    PING = 6
    PONG = 7
    MAP = 8        # shm: handle + indices -> MAPPED (segment runs) | ERROR
    MAPPED = 9
    DONE = 10      # shm: the copy finished -> OK (still valid) | ERROR (stale)
    RELEASES = 11  # handles, each u32 length + bytes -> nothing (best effort: the sender frees at expiry anyway)
    LDATA = 12     # reply to a layer READ: layers + checksums prefix, then the bytes
    WRITE = 13     # push: reservation + layers + checksums, then the bytes -> OK | ERROR
    WMAP = 14      # shm push: reservation + layers -> MAPPED (the receiver's segment runs) | ERROR
    WDONE = 15     # shm push: the copy finished (checksums) -> OK | ERROR
    WABORT = 16    # push: the writer gives up -> OK | ERROR
    OPEN = 17      # shm: handle -> MAPPED (where to read one-sided, once per peer) | OK (not offered) | ERROR
    CRELEASES = 18  # claimed releases: each u32 length + a request (handle, claim) -> nothing; the owner
                    # releases each lease in the store for the claimer whose claim it made in the read
    SEGFD = 19     # shm: a writable flag + the name of a segment a MAPPED reply on this connection named ->
                   # OK carrying its descriptor (SCM_RIGHTS; opened read-only unless a WMAP named it;
                   # the same user's processes only) | ERROR


MAX_RELEASES = 256   # handles in one RELEASES frame (a server ends them in one pass)


def encode_releases(raws: Sequence[bytes], kind: "Kind" = Kind.RELEASES) -> bytes:
    """RELEASES (or CRELEASES: each entry a request, handle and claim) frames, ``MAX_RELEASES``
    entries per frame."""
    out = []
    for i in range(0, len(raws), MAX_RELEASES):
        body = b"".join(_U32.pack(len(r)) + r for r in raws[i:i + MAX_RELEASES])
        out.append(pack(kind, 0, body))
    return b"".join(out)


def decode_releases(payload: bytes) -> list[bytes]:
    """The handles' bytes of a RELEASES frame; ProtocolError for a malformed or overfull one."""
    out: list[bytes] = []
    pos, end = 0, len(payload)
    while pos < end:
        if len(out) == MAX_RELEASES:
            raise ProtocolError(f"releases frame: more than {MAX_RELEASES} handles")
        if end - pos < 4:
            raise ProtocolError("releases frame: truncated length")
        n = _U32.unpack_from(payload, pos)[0]
        pos += 4
        if n > end - pos:
            raise ProtocolError("releases frame: a handle longer than the frame")
        out.append(payload[pos:pos + n])
        pos += n
    return out


def pack(kind: Kind, req_id: int, payload: bytes = b"", length: Optional[int] = None) -> bytes:
    n = len(payload) if length is None else length
    return HEADER.pack(MAGIC, VERSION, kind, req_id & 0xFFFFFFFF, n) + payload


_KINDS = {k.value: k for k in Kind}


def unpack_header(buf: bytes | bytearray, offset: int = 0, data_ok: bool = True) -> tuple[Kind, int, int]:
    """(kind, request id, length) of a frame header. ``data_ok=False`` where the request
    asked for no data (a control reply): a DATA/LDATA reply is refused before its body, and
    every length is held to ``MAX_CONTROL``."""
    magic, version, kind, req_id, length = HEADER.unpack_from(buf, offset)
    if magic != MAGIC:
        raise ProtocolError("bad frame magic: not a kvbridge peer")
    if version != VERSION:
        raise ProtocolError(f"frame version {version} unsupported (this side speaks {VERSION})")
    k = _KINDS.get(kind)
    if k is None:
        raise ProtocolError(f"unknown frame type {kind}")
    if k in (Kind.DATA, Kind.LDATA):
        if not data_ok:
            raise ProtocolError(f"unexpected {k.name} reply to a request for no data")
    elif length > MAX_CONTROL:   # data replies are sized by the request
        raise FrameTooLarge(f"{k.name} frame of {length} bytes exceeds {MAX_CONTROL}")
    return k, req_id, length


_CLAIM = struct.Struct("!QQH")
_U32 = struct.Struct("!I")
LAYERS = struct.Struct("!HHI")    # first layer, end layer, number of checksums (reply prefix)
FENCE = struct.Struct("!QQ")      # every read reply starts with the fence it was served under (0, 0: none)
F_INDICES, F_CLAIM, F_LAYERS, F_LAST, F_DATA = 1, 2, 4, 8, 16


TRAILER = struct.Struct("!BBH")  # every read reply ends with it: status, two zero bytes


class Vouch(enum.IntEnum):
    """What the owner says of a read once its last byte has left (the reply's trailer)."""

    OK = 0       # the bytes were the handle's; the handle live and its lease within its TTL
    UNSURE = 1   # the bytes were the handle's; the owner cannot vouch for the lease: ask the store
    STALE = 2    # the blocks were freed or reused: the bytes are not the handle's


def vouch_of(grant: object) -> Vouch:
    """The owner's verdict on a read grant after the last byte left: its ``vouch()``, or for a
    grant that has none, ``still_valid()`` (which knows nothing of the lease's TTL)."""
    vouch = getattr(grant, "vouch", None)
    if vouch is not None:
        v = vouch()
        return v if type(v) is Vouch else Vouch(v)
    return Vouch.OK if grant.still_valid() else Vouch.STALE  # type: ignore[attr-defined]


def encode_trailer(status: Vouch) -> bytes:
    return _TRAILERS[status]


_TRAILERS = {v: TRAILER.pack(v, 0, 0) for v in Vouch}


def settle_vouch(status: int, claim: Optional[Claim], what: str) -> None:
    """Raise unless the owner vouched for the read (``claim``: what it was served under)."""
    if status == Vouch.OK:
        return
    if status == Vouch.STALE:
        raise StaleHandle(f"{what}: the blocks were freed or reused while they were sent; bytes discarded")
    if status == Vouch.UNSURE:
        raise Unvouched(f"{what}: the sender ended the handle, or its lease neared its TTL, while serving it; "
                        "bytes not used", claim)
    raise ProtocolError(f"{what}: unknown trailer status {status}")


def check_trailer(raw: bytes, claim: Optional[Claim], what: str) -> None:
    """Parse a read reply's trailer and :func:`settle_vouch` it."""
    status, z1, z2 = TRAILER.unpack(raw)
    if z1 or z2:
        raise ProtocolError(f"{what}: malformed trailer")
    settle_vouch(status, claim, what)


def CLAIM_ME(claimer: str, ttl: float) -> Claim:
    """A read's request that the sender claim the lease for ``claimer`` itself, for ``ttl``
    seconds (one lease round trip instead of the receiver's claim plus the sender's check);
    the reply carries the fence. Epoch 0 marks it: no real fence has epoch 0."""
    return Claim(claimer, 0, max(1, int(ttl * 1000)))


class Request(NamedTuple):
    """A decoded READ / MAP / WRITE / WMAP / WDONE payload."""

    ticket: bytes                        # the handle or reservation, as issued
    indices: Optional[list[int]]
    claim: Optional[Claim]
    layers: Optional[tuple[int, int]]
    last: bool = False
    nbytes: int = 0                      # WRITE: bytes that follow the frame
    sums: bytes = b""                    # WRITE / WDONE: packed per-(layer, block) checksums


def encode_claim(claim: Claim) -> bytes:
    """A request's claim field: ``u64 epoch | u64 counter | u16 len | claimer``."""
    c = claim.claimer.encode("utf-8")
    return _CLAIM.pack(claim.epoch, claim.counter, len(c)) + c


def encode_request(ticket: bytes, indices: Optional[Sequence[int]] = None, claim: Optional[Claim] = None,
                   layers: Optional[tuple[int, int]] = None, *, last: bool = False,
                   nbytes: Optional[int] = None, sums: bytes = b"") -> bytes:
    """``u32 len | ticket | u8 flags | [indices] | [layers] | [claim] | [u64 nbytes | u32 n | sums]``."""
    if indices is None and claim is None and layers is None and nbytes is None and not last:
        return _U32.pack(len(ticket)) + ticket + b"\x00"       # a whole read, unleased: the usual one
    flags = ((F_INDICES if indices is not None else 0) | (F_CLAIM if claim is not None else 0)
             | (F_LAYERS if layers is not None else 0) | (F_LAST if last else 0)
             | (F_DATA if nbytes is not None else 0))
    parts = [struct.pack("!I", len(ticket)), ticket, bytes([flags])]
    if indices is not None:
        parts.append(struct.pack(f"!I{len(indices)}I", len(indices), *indices))
    if layers is not None:
        parts.append(struct.pack("!HH", *layers))
    if claim is not None:
        parts.append(encode_claim(claim))
    if nbytes is not None:
        parts += [struct.pack("!QI", nbytes, len(sums) // 8), sums]
    return b"".join(parts)


def decode_request(payload: bytes) -> Request:
    """Parse a request payload defensively: every length is checked against the frame."""
    if payload[-1:] == b"\x00" and len(payload) > 5 and _U32.unpack_from(payload)[0] == len(payload) - 5:
        return Request(payload[4:-1], None, None, None)    # a whole read, unleased: the usual one
    try:
        (hn,) = struct.unpack_from("!I", payload, 0)
        ticket = payload[4:4 + hn]
        if len(ticket) != hn:
            raise ProtocolError("request frame: truncated handle")
        flags = payload[4 + hn]
        if flags & ~(F_INDICES | F_CLAIM | F_LAYERS | F_LAST | F_DATA):
            raise ProtocolError(f"request frame: unknown flags {flags:#x}")
        pos = 5 + hn
        indices: Optional[list[int]] = None
        if flags & F_INDICES:
            (n,) = struct.unpack_from("!I", payload, pos)
            if n > (len(payload) - pos - 4) // 4:
                raise ProtocolError("request frame: index list longer than the frame")
            indices = list(struct.unpack_from(f"!{n}I", payload, pos + 4))
            pos += 4 + 4 * n
        layers = None
        if flags & F_LAYERS:
            first, end = struct.unpack_from("!HH", payload, pos)
            if not first < end:
                raise ProtocolError(f"request frame: empty layer range [{first}, {end})")
            layers = (first, end)
            pos += 4
        claim = None
        if flags & F_CLAIM:
            epoch, counter, cn = _CLAIM.unpack_from(payload, pos)
            pos += _CLAIM.size
            name = payload[pos:pos + cn]
            if len(name) != cn:
                raise ProtocolError("request frame: truncated claimer")
            claim = Claim(name.decode("utf-8"), epoch, counter)
            pos += cn
        nbytes, sums = 0, b""
        if flags & F_DATA:
            nbytes, ns = struct.unpack_from("!QI", payload, pos)
            pos += 12
            sums = payload[pos:pos + 8 * ns]
            if len(sums) != 8 * ns:
                raise ProtocolError("request frame: truncated checksums")
            pos += 8 * ns
        if pos != len(payload):
            raise ProtocolError("request frame has trailing bytes")
        return Request(ticket, indices, claim, layers, bool(flags & F_LAST), nbytes, sums)
    except (struct.error, IndexError, UnicodeDecodeError):
        raise ProtocolError("request frame is malformed") from None


def encode_layers(first: int, end: int, sums: bytes) -> bytes:
    return LAYERS.pack(first, end, len(sums) // 8) + sums


def decode_layers(payload: bytes, num_blocks: int, asked: tuple[int, int]) -> tuple[int, int, bytes, int]:
    """Parse a layers prefix; returns (first, end, sums, bytes consumed). Checks that the
    range is what was asked for (starts at its first layer, inside it; empty means "not
    ready yet, ask again") and that there is either no checksum or one per (layer, block)."""
    try:
        first, end, ns = LAYERS.unpack_from(payload, 0)
    except struct.error:
        raise ProtocolError("layers prefix is truncated") from None
    if first != asked[0] or not first <= end <= asked[1]:
        raise ProtocolError(f"peer served layers [{first}, {end}) for a request of [{asked[0]}, {asked[1]})")
    if ns not in (0, (end - first) * num_blocks):
        raise ProtocolError(f"peer sent {ns} checksums for {end - first} layers of {num_blocks} blocks")
    sums = payload[LAYERS.size:LAYERS.size + 8 * ns]
    if len(sums) != 8 * ns:
        raise ProtocolError("layers prefix: truncated checksums")
    return first, end, sums, LAYERS.size + 8 * ns


def encode_error(exc: KVBridgeError) -> bytes:
    return struct.pack("!H", exc.code) + exc.message.encode("utf-8", "replace")[:4096]


def decode_error(payload: bytes) -> KVBridgeError:
    if len(payload) < 2:
        return ProtocolError("malformed ERROR frame")
    (code,) = struct.unpack_from("!H", payload, 0)
    return error_from_code(code, payload[2:].decode("utf-8", "replace"))


def map_os_error(exc: BaseException, what: str) -> KVBridgeError:
    """Map a socket-level failure (``OSError``) into the error tree; a kvbridge error passes
    through. Anything else -- a programming error, cancellation, an interrupt -- is not a
    failure of the peer and is re-raised as it is."""
    if isinstance(exc, KVBridgeError):
        return exc
    if not isinstance(exc, OSError):
        raise exc
    if isinstance(exc, (socket.timeout, TimeoutError, BlockingIOError)):
        return TransferTimeout(f"{what}: timed out")
    return ConnectionLost(f"{what}: {exc.__class__.__name__}: {exc}")


def set_os_timeouts(sock: socket.socket, seconds: float) -> None:
    """Make a blocking socket give up after ``seconds`` without progress, in the kernel
    (SO_RCVTIMEO/SO_SNDTIMEO): one syscall per recv/send instead of poll + call. This bounds
    each receive alone (a byte now and then never trips it): a client's whole exchange is held
    to its deadline by :mod:`.deadline`."""
    sock.settimeout(None)
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


_NO_BUFFER = bytearray()   # a reader's buffer before its first byte, and while parked empty


class Budget:
    """Bytes a server lets all its connections buffer for control frames at once."""

    def __init__(self, nbytes: int) -> None:
        self.left = nbytes
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if n > self.left:
                return False
            self.left -= n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.left += n


class FrameReader:
    """Reads whole frames from a socket through one reused buffer: usually one recv per frame.

    Hostile peers are bounded: nothing is allocated before the first byte comes (the buffer is
    made at the first receive, and let go while the connection is parked with nothing in it);
    the buffer grows only as bytes actually arrive (a header that declares 16 MiB allocates
    nothing until they come: past ``size`` the frame gets one anonymous mapping whose pages are
    touched as bytes land, and handed back whole); a frame larger than ``size`` must fit the
    server's :class:`Budget` (held until the frame is whole or :meth:`release`), and a frame
    must be complete within ``frame_timeout`` seconds of its first byte, however slowly it
    trickles. With ``nowait``, the bytes of a frame begun are taken only as far as they have
    come (:class:`BlockingIOError` then, at once): a server parks such a connection rather than
    hold a thread for a peer that sends a byte now and then (:meth:`overdue` says when to drop it)."""

    def __init__(self, sock: socket.socket, size: int = 64 << 10, frame_timeout: float = 0.0,
                 budget: Optional[Budget] = None, nowait: bool = False) -> None:
        self.sock = sock
        self.base = size
        self.buf: Any = _NO_BUFFER      # a bytearray of `size` once bytes come (the C frame loop's)
        self.start = 0
        self.end = 0
        self.frame_timeout = frame_timeout
        self.budget = budget
        self._held = 0                  # budget taken for the frame being received
        self._flags = socket.MSG_DONTWAIT if nowait else 0
        self._since = 0.0          # when the first byte of the current frame arrived

    @property
    def empty(self) -> bool:
        return self.start == self.end

    def ready(self) -> bytearray:
        """The buffer, made if it was let go: the C frame loop receives into it when empty."""
        if len(self.buf) != self.base or type(self.buf) is not bytearray:
            self._rebase()
        return self.buf  # type: ignore[no-any-return]

    def _rebase(self) -> None:
        keep = self.buf[self.start:self.end]
        self.buf = bytearray(max(self.base, len(keep)))
        self.buf[:len(keep)] = keep
        self.start, self.end = 0, len(keep)

    def park(self) -> None:
        """The connection leaves its thread: an empty reader lets its buffer go; one holding
        part of a frame keeps those bytes only (not the buffer around them)."""
        if self.start == self.end:
            self.buf, self.start, self.end = _NO_BUFFER, 0, 0
        elif type(self.buf) is bytearray and self.end - self.start < len(self.buf) // 2:
            # (a big frame's mapping stays: only its pages touched so far take memory; copied out of
            # it, the freed copies would stay with the allocator)
            self.buf, self.end, self.start = bytearray(self.buf[self.start:self.end]), self.end - self.start, 0

    def overdue(self, now: float) -> bool:
        """A frame begun and not whole within ``frame_timeout``."""
        return bool(self.frame_timeout and self._since and now - self._since > self.frame_timeout)

    def release(self) -> None:
        """The connection is gone: the budget it held back, its buffer let go."""
        if self._held and self.budget is not None:
            self.budget.give(self._held)
        self._held = 0
        self.buf, self.start, self.end = _NO_BUFFER, 0, 0

    def _fill(self, need: int) -> None:
        """Make ``need`` bytes available from ``start``; raises ConnectionLost on EOF."""
        if self.start + need > len(self.buf):
            have = self.end - self.start
            if need > len(self.buf):                  # grow, never past what is needed
                if need > self.base:                  # pages touched only as bytes land; unmapped whole
                    newbuf: Any = mmap.mmap(-1, need)
                else:
                    newbuf = bytearray(min(self.base, max(need, 2 * len(self.buf))))
                newbuf[:have] = self.buf[self.start:self.end]
                self.buf = newbuf
            else:
                self.buf[:have] = self.buf[self.start:self.end]
            self.start, self.end = 0, have
        while self.end - self.start < need:
            k = self.sock.recv_into(memoryview(self.buf)[self.end:], 0, self._flags)
            if k == 0:
                raise ConnectionLost("peer closed the connection")
            if self.start == self.end and not self._since:
                self._since = time.monotonic()
            self.end += k
            if self.frame_timeout and self._since and time.monotonic() - self._since > self.frame_timeout:
                raise TransferTimeout(f"a frame took over {self.frame_timeout} s to arrive")

    def read_frame(self, max_len: int = MAX_CONTROL) -> tuple[Kind, int, bytes]:
        start, end, buf = self.start, self.end, self.buf
        if start == end:                  # nothing buffered: one receive, usually the whole frame
            if len(buf) != self.base:
                buf = self.ready()
            k = self.sock.recv_into(buf)
            if k == 0:
                raise ConnectionLost("peer closed the connection")
            start, end = 0, k
            self.start, self.end = 0, k
        if end - start >= HEADER.size:    # a frame already whole in the buffer: taken at once
            magic, version, kind, req_id, length = HEADER.unpack_from(buf, start)
            s = start + HEADER.size
            k_ = _KINDS.get(kind)
            if (magic == MAGIC and version == VERSION and k_ is not None and length <= max_len
                    and length <= MAX_CONTROL and s + length <= end):
                payload = bytes(buf[s:s + length])
                if s + length == end:
                    self.start = self.end = 0
                else:
                    self.start = s + length
                self._since = 0.0
                return k_, req_id, payload
        return self._read_frame(max_len)

    def _read_frame(self, max_len: int) -> tuple[Kind, int, bytes]:
        """A frame that is not whole in the buffer yet (or is refused): bounded, as described above."""
        if self.start != self.end and not self._since:
            self._since = time.monotonic()            # bytes of this frame came with the last one
        self._fill(HEADER.size)
        kind, req_id, length = unpack_header(self.buf, self.start)
        if length > max_len:
            raise FrameTooLarge(f"{kind.name} frame of {length} bytes exceeds {max_len}")
        if HEADER.size + length > self.base and self.budget is not None and not self._held:
            if not self.budget.take(length):
                raise FrameTooLarge(f"{kind.name} frame of {length} bytes: the server's control budget is spent; "
                                    "retry later")
            self._held = length                       # until the frame is whole (a parked one keeps it)
        self._fill(HEADER.size + length)
        s = self.start + HEADER.size
        payload = bytes(self.buf[s:s + length])
        if self._held:
            assert self.budget is not None
            self.budget.give(self._held)
            self._held = 0
        self.start = s + length
        self._since = 0.0
        if len(self.buf) != self.base or type(self.buf) is not bytearray:
            self._rebase()                            # a big frame's mapping, or a parked frame's bytes: let go
        elif self.start == self.end:
            self.start = self.end = 0
        return kind, req_id, payload

    def read_into(self, views: Sequence[memoryview], landed: Optional[Callable[[int], None]] = None,
                  stall: Optional[float] = None) -> int:
        """Fill ``views`` with the bytes that follow the last frame: those already buffered
        first, then straight from the socket (scatter-gather; ``stall`` as for
        :func:`recv_scatter`)."""
        views = [v for v in views if len(v)]
        got = 0
        i = 0
        while i < len(views) and self.start < self.end:
            v = views[i]
            k = min(len(v), self.end - self.start)
            v[:k] = self.buf[self.start:self.start + k]
            self.start += k
            got += k
            views[i] = v[k:]
            if not len(views[i]):
                i += 1
        if self.start == self.end:
            self.start = self.end = 0
        if got and landed is not None:
            landed(got)
        rest = views[i:]
        if rest:
            base = got
            got += recv_scatter(self.sock, rest, None if landed is None else (lambda k: landed(base + k)), stall)
        return got

    def skip(self, n: int, guard: Callable[[int], None]) -> None:
        """Discard ``n`` bytes that follow the last frame (a refused write's data). ``guard`` is
        told the bytes discarded so far after every receive: a :class:`RateGuard` there drops a
        peer that trickles them (the socket's timeout alone only bounds each receive)."""
        scratch = memoryview(bytearray(min(n, 64 << 10) or 1))
        gone = 0
        while n:
            k = min(n, self.end - self.start)
            if k:
                self.start += k
                n -= k
                gone += k
                continue
            self.start = self.end = 0
            got = self.sock.recv_into(scratch, min(n, len(scratch)))
            if got == 0:
                raise ConnectionLost("peer closed the connection")
            n -= got
            gone += got
            guard(gone)


def send_with_fd(sock: socket.socket, frame: bytes, fd: int) -> None:
    """Send ``frame`` with descriptor ``fd`` attached to its first byte (``SCM_RIGHTS``)."""
    sent = sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())])
    if sent < len(frame):
        sock.sendall(frame[sent:])


MAX_FDS = 4   # descriptors taken from one reply: any beyond its one are closed and the reply refused


def recv_header_fds(sock: socket.socket) -> tuple[bytes, list[int]]:
    """A reply's header and the descriptors that came with it (``SCM_RIGHTS``). The caller owns
    the descriptors (close each it does not keep); a reply whose descriptors were cut short
    (``MSG_CTRUNC``) is refused, the ones that came closed."""
    msg, anc, flags, _ = sock.recvmsg(HEADER.size, socket.CMSG_SPACE(MAX_FDS * 4), socket.MSG_WAITALL)
    fds: list[int] = []
    for level, typ, data in anc:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            fds += array.array("i", data[:len(data) - len(data) % 4])
    if flags & socket.MSG_CTRUNC:
        close_fds(fds)
        raise ProtocolError("the peer attached more descriptors to a reply than it may")
    if not msg:
        close_fds(fds)
        raise ConnectionLost("peer closed the connection")
    if len(msg) < HEADER.size:
        try:
            msg += recv_exact(sock, HEADER.size - len(msg))
        except BaseException:
            close_fds(fds)
            raise
    return msg, fds


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Receive exactly ``n`` bytes (control frames only)."""
    first = sock.recv(n, socket.MSG_WAITALL)      # almost always the whole of it, in one call
    if len(first) == n:
        return first
    if not first:
        raise ConnectionLost("peer closed the connection")
    buf = bytearray(n)
    buf[:len(first)] = first
    view = memoryview(buf)
    got = len(first)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionLost("peer closed the connection")
        got += k
    return bytes(buf)


def _advance(views: list[memoryview], i: int, n: int) -> int:
    """Consume ``n`` bytes from ``views[i:]`` in place; returns the new index."""
    while n:
        v = views[i]
        if n >= len(v):
            n -= len(v)
            i += 1
        else:
            views[i] = v[n:]
            n = 0
    return i


RECV_WINDOW = 1 << 20    # bytes of iovecs offered per recvmsg_into (about what one call returns)
SEND_WINDOW = 4 << 20


def _window(vs: Sequence[memoryview], i: int, max_bytes: int) -> int:
    """End index of the iovec window starting at ``i``: at most IOV_MAX buffers and about
    ``max_bytes``. Offering every remaining buffer to each call would make the kernel
    interface acquire thousands of buffers per call to fill a few."""
    j, total, end = i, 0, min(len(vs), i + IOV_MAX)
    while j < end and total < max_bytes:
        total += len(vs[j])
        j += 1
    return j


def recv_scatter(sock: socket.socket, views: Sequence[memoryview],
                 landed: Optional[Callable[[int], None]] = None, stall: Optional[float] = None) -> int:
    """Fill every view completely from the socket, scatter-gather (recvmsg_into).

    ``landed(total)`` is called as bytes arrive, so a verifier can hash them while they
    are still in cache. ``stall``: on a socket whose receive timeout is short (a server's
    tick), a pause is waited out -- ``landed`` is told at every timeout, so a rate guard there
    still drops a peer that is too slow -- until no byte has come for ``stall`` seconds
    (TransferTimeout); without it the timeout is raised at once."""
    if len(views) == 1 and landed is None and stall is None:   # one run: the plain loop
        v = views[0]
        n = len(v)
        got = 0
        while got < n:
            k = sock.recv_into(v[got:] if got else v, n - got)
            if k == 0:
                raise ConnectionLost("peer closed the connection mid-transfer")
            got += k
        return got
    vs = [v for v in views if len(v)]
    i = 0
    got = 0
    quiet_since = time.monotonic() if stall is not None else 0.0
    while i < len(vs):
        j = _window(vs, i, RECV_WINDOW)
        try:
            if j - i == 1:
                k = sock.recv_into(vs[i], len(vs[i]))
            else:
                k = sock.recvmsg_into(vs[i:j])[0]
        except BlockingIOError:
            if stall is None:
                raise
            if time.monotonic() - quiet_since > stall:
                raise TransferTimeout(f"no byte for {stall} s mid-transfer") from None
            if landed is not None:
                landed(got)
            continue
        if stall is not None:
            quiet_since = time.monotonic()
        if k == 0:
            raise ConnectionLost("peer closed the connection mid-transfer")
        got += k
        i = _advance(vs, i, k)
        if landed is not None:
            landed(got)
    return got


def _fill_window(window: list[memoryview], have: int, it: Iterator[memoryview], budget: int) -> int:
    """Top ``window`` up from ``it`` to at most IOV_MAX buffers and about ``budget`` bytes."""
    while len(window) < IOV_MAX and have < budget:
        v = next(it, None)
        if v is None:
            break
        if len(v):
            window.append(v)
            have += len(v)
    return have


def recv_iter(sock: socket.socket, views: Iterator[memoryview],
              landed: Optional[Callable[[int], None]] = None) -> int:
    """:func:`recv_scatter` over buffers produced as they are needed: a window of them at a
    time, so a transfer of many thousand pieces never holds a memoryview for each."""
    window: list[memoryview] = []
    have = got = 0
    while True:
        have = _fill_window(window, have, views, RECV_WINDOW)
        if not window:
            return got
        k = sock.recv_into(window[0]) if len(window) == 1 else sock.recvmsg_into(window)[0]
        if k == 0:
            raise ConnectionLost("peer closed the connection mid-transfer")
        got += k
        have -= k
        del window[:_advance(window, 0, k)]
        if landed is not None:
            landed(got)


def send_iter(sock: socket.socket, head: bytes, views: Iterator[memoryview],
              guard: Optional["RateGuard"] = None, flags: int = 0) -> int:
    """:func:`send_all` of ``head`` then buffers produced as they are needed (``flags``: for
    ``sendmsg``, e.g. ``MSG_MORE`` when a trailer follows at once)."""
    window: list[memoryview] = [memoryview(head)] if head else []
    have = len(head)
    sent = 0
    while True:
        have = _fill_window(window, have, views, SEND_WINDOW)
        if not window:
            return sent
        k = sock.sendmsg(window, (), flags) if flags else sock.sendmsg(window)
        sent += k
        have -= k
        del window[:_advance(window, 0, k)]
        if guard is not None:
            guard(sent)


class RateGuard:
    """Drops a peer that moves a transfer slower than ``min_rate`` bytes/s once ``grace``
    seconds have passed: a slow reader cannot hold a read (and its blocks) in flight."""

    def __init__(self, min_rate: float, grace: float) -> None:
        self.min_rate, self.grace = min_rate, grace
        self.t0 = time.monotonic()

    def __call__(self, moved: int) -> None:
        dt = time.monotonic() - self.t0
        if dt > self.grace and moved < self.min_rate * dt:
            raise TransferTimeout(f"peer moved {moved} bytes in {dt:.1f} s, under the minimum "
                                  f"{self.min_rate:.0f} B/s")


class PacedSender:
    """A server's socket as the senders of a reply see it (``sendmsg`` only): a reader that pauses
    is waited out -- the socket's own send timeout is a short tick -- and ``guard`` (a
    :class:`RateGuard`) is told the reply's bytes sent so far after every send and every timeout,
    so a reader too slow is dropped, as is one that takes nothing for ``stall`` seconds."""

    def __init__(self, sock: socket.socket, guard: RateGuard, stall: float) -> None:
        self.sock, self.guard, self.stall = sock, guard, stall
        self.sent = 0

    def sendmsg(self, buffers: Sequence[memoryview], ancdata: Sequence[object] = (), flags: int = 0) -> int:
        quiet_since = time.monotonic()
        while True:
            try:
                k = self.sock.sendmsg(buffers, (), flags)
            except BlockingIOError:
                if time.monotonic() - quiet_since > self.stall:
                    raise TransferTimeout(f"the reader took no byte for {self.stall} s") from None
                self.guard(self.sent)
                continue
            self.sent += k
            self.guard(self.sent)
            return k


def send_all(sock: socket.socket, views: Sequence[memoryview | bytes], guard: Optional[RateGuard] = None) -> int:
    """Send every buffer, scatter-gather (sendmsg), handling partial sends."""
    vs = [memoryview(v) if not isinstance(v, memoryview) else v for v in views if len(v)]
    i = 0
    sent = 0
    while i < len(vs):
        k = sock.sendmsg(vs[i:_window(vs, i, SEND_WINDOW)])
        sent += k
        i = _advance(vs, i, k)
        if guard is not None:
            guard(sent)
    return sent
