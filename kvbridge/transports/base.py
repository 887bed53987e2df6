"""The Transport interface: small on purpose.

A *server* (``Transport.serve``) exposes an endpoint at a URL: a :class:`BlockSource`
(the sender, pull mode) and/or a :class:`BlockSink` (a receiver that reserved blocks,
push mode). A *client* (an instance of a Transport subclass) moves the blocks named by
a handle or reservation, in canonical order (see :mod:`kvbridge.layout`).

Client methods: :meth:`Transport.read` (one handle), :meth:`Transport.read_layers`
(the ready layers of a layer-wise handle), :meth:`Transport.read_many` (many handles,
pipelined where the backend can), :meth:`Transport.write` / :meth:`Transport.abort_write`
(push), :meth:`Transport.release`, :meth:`Transport.close`, and :meth:`Transport.extra`
for backend-specific facts. Transports are synchronous and thread-safe: transfers run
on the caller's thread or a transfer worker (:mod:`kvbridge.transfer`), never on an
event loop.
"""

from __future__ import annotations

import abc
import ctypes
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Literal, Optional, Protocol, Sequence, TypeVar,
                    Union)

import numpy as np

from ..errors import ConfigError, KVBridgeError, ProtocolError, TransferCancelled
from ..handle import KVHandle
from ..layout import Segment
from ..policy import Timeout
from ..pool import retired_during
from ..lease.base import Claim

if TYPE_CHECKING:
    import torch

    from ..integrity import StreamVerifier
    from ..transfer import Flag
    from ..pool import KVPool

__all__ = ["Run", "Spans", "Staging", "ReadGrant", "WriteGrant", "BlockSource", "BlockSink", "Server", "Transport",
           "ReadOp", "Chunk", "SpansFor", "Claim", "copy_runs", "total"]

# (address, nbytes): a contiguous run of host memory
Run = tuple[int, int]
T = TypeVar("T")


class Spans:
    """Host memory of some blocks of a pool, in canonical order, as pool segments.

    Transports take what suits them: :meth:`views` (memoryview slices, for socket
    I/O) or :meth:`runs` (addresses, for memcpy). Both are derived lazily and cached.
    ``verifier`` hashes bytes as they land; ``cancel`` (an Event) stops a transfer
    between chunks: transports call :meth:`landed` as bytes arrive whenever
    :attr:`watched` is true.
    """

    __slots__ = ("pool", "_segments", "_layers", "nbytes", "_views", "_array", "_runs", "verifier", "cancel", "claimed",
                 "block_ids", "want_digests", "digests")

    def __init__(self, pool: "KVPool", segments: Optional[list[Segment]], block_ids: Optional[list[int]] = None,
                 layers: Optional[range] = None) -> None:
        """``segments``, or None for ``block_ids`` over ``layers`` (segments then made on first use)."""
        self.pool = pool
        self._segments = segments
        self._layers = layers
        if segments is not None:
            self.nbytes = sum(n for _, _, n in segments)
        else:
            assert block_ids is not None
            L = pool.layout
            nl = L.num_layers if layers is None else len(layers)
            self.nbytes = len(block_ids) * nl * L.num_parts * L.part_nbytes
        self._views: Optional[list[memoryview]] = None
        self._array: Optional[np.ndarray] = None
        self._runs: Optional[list[Run]] = None
        self.verifier: Optional["StreamVerifier"] = None   # hashes bytes as they land
        self.cancel: Optional["Flag"] = None     # anything with is_set(): a Transfer's cancel flag
        self.claimed: Optional[Claim] = None     # the claim a read was served under, when the sender made it
        # Whole blocks (every layer) of a pool, when made by of_blocks without a layer range: a
        # transport that copies block by block may then hash each block as it lands
        # (want_digests) and leave the checksums of what landed in `digests`.
        self.block_ids = block_ids
        self.want_digests = False
        self.digests: Optional[list[int]] = None

    @property
    def segments(self) -> list[Segment]:
        if self._segments is None:
            assert self.block_ids is not None
            self._segments = list(self.pool.layout.segments(self.block_ids, self.pool.num_blocks, self._layers))
        return self._segments

    @property
    def segment_array(self) -> np.ndarray:
        """:attr:`segments` as an ``(n, 3)`` int64 array (made without a Python loop per block
        where the spans are blocks); read-only, kept."""
        if self._array is None:
            if self._segments is None:
                assert self.block_ids is not None
                arr = self.pool.layout.segment_array(self.block_ids, self.pool.num_blocks, self._layers)
            else:
                arr = np.asarray(self._segments, dtype=np.int64).reshape(-1, 3)
            arr.flags.writeable = False
            self._array = arr
        return self._array

    @property
    def whole_blocks(self) -> bool:
        """Every layer of :attr:`block_ids`, in canonical order (what ``planes`` and the ids describe)."""
        return self.block_ids is not None and self._layers is None

    @property
    def watched(self) -> bool:
        return self.verifier is not None or self.cancel is not None

    def landed(self, upto: int) -> None:
        """Transports call this as the first ``upto`` bytes of the stream have arrived."""
        if self.cancel is not None and self.cancel.is_set():
            raise TransferCancelled("transfer cancelled")
        if self.verifier is not None:
            self.verifier.advance(upto)

    @property
    def on_landed(self) -> Optional[Callable[[int], None]]:
        return self.landed if self.watched else None

    @classmethod
    def of_blocks(cls, pool: "KVPool", block_ids: Sequence[int], layers: Optional[range] = None) -> "Spans":
        ids = list(block_ids)
        if layers is None or (layers.start == 0 and layers.stop == pool.layout.num_layers and layers.step == 1):
            nb = pool.num_blocks
            for b in ids:            # checked now, as making the segments would
                if not 0 <= b < nb:
                    raise IndexError(f"block {b} outside a pool of {nb} blocks")
            return cls(pool, None, ids)
        return cls(pool, list(pool.layout.segments(ids, pool.num_blocks, layers)))

    def iter_views(self) -> Iterator[memoryview]:
        """The views one by one, made as they are needed (a windowed socket loop's source)."""
        if self._views is not None:
            yield from self._views
            return
        hv = self.pool.host_views()
        for b, o, n in self.segments:
            yield hv[b][o:o + n]

    def views(self) -> list[memoryview]:
        if self._views is None:
            hv = self.pool.host_views()
            self._views = [hv[b][o:o + n] for b, o, n in self.segments]
        return self._views

    def runs(self) -> list[Run]:
        if self._runs is None:
            addrs = self.pool.buffer_addresses()
            self._runs = [(addrs[b] + o, n) for b, o, n in self.segments]
        return self._runs


class Staging:
    """A byte buffer that transports move like pool memory: codec frames, in canonical order.

    It answers what :class:`Spans` asks of a pool (``host_views``, ``buffer_addresses``,
    ``buffers``, ``is_host``) and, when it lives in shared memory, what ``shm://`` asks
    (``segment``, ``buffer_offsets``)."""

    def __init__(self, data: "torch.Tensor", segment: Any = None) -> None:
        self.buffers = [data]
        self.device = data.device
        self.segment = segment
        self.buffer_offsets = [0]
        self._views: Optional[list[memoryview]] = None

    @property
    def is_host(self) -> bool:
        return self.device.type == "cpu"

    def host_views(self) -> list[memoryview]:
        if self._views is None:
            t = self.buffers[0]
            n = t.numel()
            self._views = [memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B") if n
                           else memoryview(bytearray(0))]
        return self._views

    def buffer_addresses(self) -> list[int]:
        return [self.buffers[0].data_ptr()]

    def spans(self, pieces: Sequence[tuple[int, int]]) -> "Spans":
        """Spans of (offset, nbytes) pieces of the buffer, in order."""
        return Spans(self, [(0, o, n) for o, n in pieces if n])  # type: ignore[arg-type]


def total(runs: Any) -> int:
    """Bytes named by (offset, nbytes) runs: a sequence of pairs, or an ``(n, 2)`` array."""
    if hasattr(runs, "shape"):
        return int(runs[:, 1].sum()) if len(runs) else 0
    return sum(n for _, n in runs)


COPY_CHUNK = 256 << 10   # hash each chunk while it is still in L2


def copy_runs(dst: Sequence[Run], src: Sequence[Run], landed: Optional[Callable[[int], None]] = None) -> int:
    """memcpy the byte stream described by ``src`` runs into ``dst`` runs (same total).

    With ``landed``, copies go in chunks of at most COPY_CHUNK bytes and ``landed(total)``
    follows, so a verifier can hash the bytes while they are in cache."""
    if total(dst) != total(src):
        raise ProtocolError(f"size mismatch: destination {total(dst)} bytes, source {total(src)} bytes")
    memmove = ctypes.memmove
    if len(dst) == len(src) and all(d[1] == s[1] <= COPY_CHUNK for d, s in zip(dst, src)):
        # Runs pair up one to one (scattered blocks on both sides): the tightest loop.
        moved = since = 0
        for (da, n), (sa, _) in zip(dst, src):
            memmove(da, sa, n)
            moved += n
            since += n
            if landed is not None and since >= COPY_CHUNK:
                landed(moved)
                since = 0
        if landed is not None:
            landed(moved)
        return moved
    i = j = 0
    doff = soff = 0
    moved = 0
    while i < len(dst) and j < len(src):
        da, dn = dst[i]
        sa, sn = src[j]
        n = min(dn - doff, sn - soff)
        if landed is not None:
            n = min(n, COPY_CHUNK)
        if n:
            memmove(da + doff, sa + soff, n)
            moved += n
            if landed is not None:
                landed(moved)
        doff += n
        soff += n
        if doff == dn:
            i, doff = i + 1, 0
        if soff == sn:
            j, soff = j + 1, 0
    return moved


class ReadGrant(Protocol):
    """Permission to read some blocks of a live handle; holds an in-flight count until closed.

    ``layers`` is the layer range served (a layer-wise handle serves the ready layers of
    the range asked for); ``sums`` the packed per-(layer, block) checksums of those layers
    (``b""`` when the handle carries its checksums, or has none)."""

    spans: Spans               # source memory in canonical order
    layers: tuple[int, int]
    sums: bytes
    claim: Optional[Claim]     # the claim the read is served under (the sender's, for CLAIM_ME reads)

    def still_valid(self) -> bool: ...
    def close(self) -> None: ...


class WriteGrant(Protocol):
    """Permission to write some layers of a reservation's blocks (push mode); the write is in
    flight until closed, so a cancel never frees pages under it."""

    spans: Spans               # destination memory in canonical order (verifier attached)
    layers: tuple[int, int]

    def finish(self, sums: bytes, last: bool) -> None: ...   # verify what landed; raise to refuse
    def close(self) -> None: ...


class BlockSource(Protocol):
    """What a server serves reads from: the sender. It authorizes every read.

    ``layers=(first, end)`` asks a layer-wise handle for its layers from ``first``: the
    source waits (bounded) until ``first`` is ready and serves the ready ones below ``end``.

    Socket servers also use two optional methods when the source has them (the sender does):
    ``serve_small(fd, request_payload, request_id)`` -- a small whole read answered on the
    socket in one piece, or False for the long way -- ``release_many(list_of_bytes)`` --
    the releases that arrived together, ended in one pass -- and
    ``release_claimed(list of (handle_bytes, claim))`` -- leased handles whose lease the source
    claimed inside a read, released in the store for that claim."""

    def open_read(self, handle_bytes: bytes, indices: Optional[Sequence[int]],
                  claim: Optional[Claim] = None, layers: Optional[tuple[int, int]] = None) -> ReadGrant:
        """``claim`` with fence (0, 0) (:func:`~kvbridge.transports.wire.CLAIM_ME`) asks the
        source to claim the lease for that claimer; the grant's ``claim`` says under which fence."""
    def release_remote(self, handle_bytes: bytes) -> None: ...


class BlockSink(Protocol):
    """What a server accepts writes into (push mode): the receiver. It authorizes every write."""

    def open_write(self, ticket_bytes: bytes, layers: tuple[int, int], claim: Optional[Claim]) -> WriteGrant: ...
    def abort_remote(self, ticket_bytes: bytes, claim: Optional[Claim]) -> None: ...
    def authorize_ticket(self, ticket_bytes: bytes, claim: Optional[Claim]) -> None: ...


class Server(abc.ABC):
    url: str
    watches_ends = False   # whether ended() does anything (set per class: the sender skips the call otherwise)

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.watches_ends = cls.ended is not Server.ended

    def published(self, handle_id: bytes, raw: bytes) -> None:
        """The source published a whole, raw handle (``raw``: its bytes). A server that serves
        reads without the source's help (shm:// one-sided reads) indexes it here."""

    def ended(self, handle_id: bytes) -> None:
        """That handle ended; called before any of its blocks is freed."""

    @abc.abstractmethod
    def close(self) -> None: ...


@dataclass
class ReadOp:
    """One read in a batch: a handle, the destination runs, optional block indices."""

    handle: KVHandle
    dst: Spans
    indices: Optional[list[int]] = None
    claim: Optional[Claim] = None
    result: Optional[int | KVBridgeError] = None


@dataclass
class Chunk:
    """What a layer read brought: layers [first, end), their checksums, and bytes."""

    first: int
    end: int
    sums: bytes
    nbytes: int
    claim: Optional[Claim] = None


SpansFor = Callable[[int, int, int], Spans]   # destination of layers [first, end), given the bytes that come


def generations_held(pool: "KVPool", block_ids: list[int], gens: list[int], request_id: str,
                     read: Callable[[], T]) -> T:
    """``read()``, unless a block of ``block_ids`` no longer has its generation in ``gens`` when
    it ends: then TransferCancelled (:func:`~kvbridge.pool.retired_during`), whatever ``read``
    returned or the error it raised (the bytes landed are not the caller's, and a retry would
    write into a block that is not)."""
    try:
        out = read()
    except Exception:
        if not pool.same_generations(block_ids, gens):
            raise retired_during(request_id) from None
        raise
    if not pool.same_generations(block_ids, gens):
        raise retired_during(request_id)
    return out


def unverified(digests: Optional[list[int]], handle: KVHandle, verify: bool) -> Optional[list[int]]:
    """What :meth:`Transport.read_small` returns beside the bytes: with ``verify``, the blocks'
    checksums as they landed (``digests``, which a verified read must have taken, inside its
    generation check) where one differs from the handle's; else None (nothing left to check)."""
    if not verify:
        return None
    if digests is None:       # never counted as verified: the fetch fails instead
        raise ProtocolError("a verified read landed without the blocks' checksums")
    return None if tuple(digests) == handle.checksums else digests


# What a fetch_whole that did not end verified hands to the pipeline: the destination's
# generations as it began, then the error it failed with, or (bytes, checksums as landed)
# where a checksum differs (one of the two is None).
Fallback = tuple[list[int], Optional[KVBridgeError], Optional[tuple[int, Optional[list[int]]]]]


class Transport(abc.ABC):
    """A client for one URL scheme. Instances keep connections and are thread-safe."""

    scheme: ClassVar[str]
    claims_on_read: ClassVar[bool] = False   # reads may carry CLAIM_ME and report the claim back

    def __init__(self, timeout: Timeout = Timeout(), secret: Optional[bytes] = None) -> None:
        self.timeout = timeout
        self.secret = secret

    @classmethod
    @abc.abstractmethod
    def serve(cls, url: str, source: Union[BlockSource, BlockSink], timeout: Timeout = Timeout()) -> Server:
        """Start serving ``source`` at ``url`` (port 0 picks a free port): a sender (reads), a
        receiver taking pushes (writes), or an endpoint that is both; returns the server."""

    @abc.abstractmethod
    def read(self, url: str, handle: KVHandle, dst: Spans, indices: Optional[list[int]] = None,
             claim: Optional[Claim] = None) -> int:
        """Read the handle's blocks (all, or ``indices`` of them) into ``dst``; returns bytes.

        ``claim`` names the lease claimer and fence the read is made under (leased handles)."""

    def read_small(self, url: str, handle: KVHandle, pool: "KVPool", block_ids: list[int], verify: bool,
                   gens: list[int]) -> Optional[tuple[int, Optional[list[int]]]]:
        """Optional fast path for the most common read: all of an unleased handle's blocks into
        whole ``block_ids`` of a host pool (checked by the caller; shm: a one-sided read of any
        size; tcp has :meth:`fetch_whole` instead). Returns the bytes moved and None where nothing is left to
        check -- with ``verify``, every block's checksum as it landed equals the handle's --
        or, where one differs, each block's checksum as it landed (see :func:`unverified`);
        None where this transport has no such path for this read (:meth:`read` then). Raises
        as :meth:`read` does, and TransferCancelled (:func:`~kvbridge.pool.retired_during`) where a
        destination block's generation is no longer the one in ``gens`` (the caller's snapshot,
        taken before) when it ends (:func:`generations_held`)."""
        return None

    def fetch_whole(self, url: str, handle: KVHandle, pool: "KVPool", dst: Any,
                    verify: bool) -> Optional[Union[Literal[True], Fallback]]:
        """Optional fastest path for the usual fetch -- all of an unleased raw handle into whole
        blocks ``dst`` of a host pool, as the caller gave them (tcp: any size) -- doing what
        :meth:`KVReceiver.fetch` would around :meth:`read_small` too: the ids checked, their
        generations taken, the blocks marked as landing (``pool._landing``), read, checksums
        compared with the handle's (``verify``), generations compared again. None where nothing
        was done (no such path, or ids, marks or sizes it does not take: the long way says
        why); True where it all held (the marks undone); else a :data:`Fallback`, the marks
        left for the caller to undo. Raises only what no retry can help (a signal's error)."""
        return None

    def fetch_claimed(self, url: str, handle: KVHandle, pool: "KVPool", dst: Any, verify: bool,
                      claim: Claim) -> Optional[tuple[Optional[Claim], Union[Literal[True], Fallback]]]:
        """:meth:`fetch_whole` for a leased handle, the read asking its owner to claim the lease
        as it serves it (``claim``: :func:`~kvbridge.transports.wire.CLAIM_ME`): None where
        nothing was done; else the claim the reply says the read was served under (None where
        no reply said so) and the outcome as :meth:`fetch_whole`'s -- but the marks are left
        for the caller on True too (its validate-after-read and release come next)."""
        return None

    def read_layers(self, url: str, handle: KVHandle, spans_for: SpansFor, first: int, end: int,
                    indices: Optional[list[int]] = None, claim: Optional[Claim] = None) -> Chunk:
        """Read the ready layers of a layer-wise (or coded) handle from ``first`` (below
        ``end``); the sender waits, bounded, for ``first`` to be ready. ``spans_for(first,
        end, nbytes)`` gives the destination of the layers actually served (``nbytes``: what
        the sender offers; coded frames vary in size, raw layers must match exactly)."""
        raise ConfigError(f"{self.scheme}:// does not support layer-wise handles")

    def read_many(self, url: str, ops: list[ReadOp]) -> list[ReadOp]:
        """Read many handles from one sender; sets each op's result (bytes or error)."""
        for op in ops:
            try:
                op.result = self.read(url, op.handle, op.dst, op.indices, op.claim)
            except KVBridgeError as exc:
                op.result = exc
        return ops

    def write(self, url: str, ticket: KVHandle, src: Spans, layers: tuple[int, int], claim: Optional[Claim],
              sums: bytes, last: bool) -> int:
        """Push mode: write ``src`` (layers ``layers`` of the source blocks, canonical order) into
        the blocks a reservation ``ticket`` names; ``sums`` are their per-(layer, block)
        checksums; ``last`` completes the reservation. Returns bytes written."""
        raise ConfigError(f"{self.scheme}:// does not support push")

    def abort_write(self, url: str, ticket: KVHandle, claim: Optional[Claim]) -> None:
        """Push mode: tell the reservation's owner that this writer gives up (under its claim,
        for a leased reservation: only the writer that holds it may end it)."""
        raise ConfigError(f"{self.scheme}:// does not support push")

    @abc.abstractmethod
    def release(self, url: str, handle: KVHandle, wait: bool = True) -> None:
        """Tell the sender that the handle is consumed (it frees the blocks).

        ``wait=False`` may skip the reply (best effort: an unreleased handle expires)."""

    def release_claimed(self, url: str, handle: KVHandle, claim: Claim) -> bool:
        """A leased handle whose lease the sender claimed inside the read (``CLAIM_ME``), done:
        hand the release to the sender, which makes it in the lease store for ``claim`` (its own
        claim, which it checks), without a reply and riding on a later request. False where
        this transport cannot (the receiver then releases through the store itself)."""
        return False

    def extra(self, name: str, default: Any = None) -> Any:
        """Backend-specific facts (e.g. 'connections'); ``default`` when unknown."""
        return default

    def close(self) -> None:
        pass

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
