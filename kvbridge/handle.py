"""KVHandle: the versioned, compact, authenticated ticket naming one request's KV blocks.

Binary form (big-endian)::

    magic "KVH" | version u8 | flags u8 | body ... | mac[16]

The body holds ids, URLs, the layout hash, block ids, generations and per-block
checksums as packed arrays whose width (1/2/4 bytes) is chosen per handle, so a
1,000-block handle is ~12 KiB. The MAC is HMAC-SHA256 (truncated to 128 bits)
over everything before it, keyed by the sender's secret: a shared secret when
configured (then receivers can verify too), otherwise a random per-sender key.

Checksums are 64 bits per block: the xxh3-64 of the xxh3-64 digests of the block's parts in
canonical order (:func:`kvbridge.integrity.combine`), so a large block's parts can be copied
and hashed on two threads; 64 bits make an undetected random corruption ~2^-64 likely;
tampering is the MAC's job, not the checksum's. Version 2: version 1 handles hashed each block
as one xxh3-64 stream, so they are refused plainly rather than failing verification.
"""

from __future__ import annotations

import array
import base64
import hashlib
import hmac
import struct
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Protocol, Sequence, TypeVar

from .errors import AccessDenied, BadHandle, ConfigError, HandleNotFound
from .policy import _seconds

__all__ = ["KVHandle", "HANDLE_VERSION", "MAX_HANDLE_BYTES", "MAX_TTL", "check_secret", "check_ttl", "compute_mac",
           "lookup_ticket"]

HANDLE_VERSION = 2     # 2: checksums combine per-part digests (integrity.combine)
MAGIC = b"KVH"
MAC_LEN = 16
MAX_HANDLE_BYTES = 8 << 20
MAX_BLOCKS = 1 << 20
_HEAD = struct.Struct("!3sBB")
_FIXED = struct.Struct("!16s16s8sIIQQQ")  # handle id, token, layout hash, num_tokens, nblocks, epoch, fence, expiry
_LEASE_FIXED = struct.calcsize("!QQQ")      # its last three fields (epoch, fence, expiry) are the lease's
_NO_LEASE_FIXED = bytes(_LEASE_FIXED)
_NO_LEASE_TEXT = b"\x00\x00\x00\x00"         # lease id and lease URL, both empty
_WIDTH_CODE = {1: "B", 2: "H", 4: "I"}
FLAG_LAYERWISE = 1
FLAG_RESERVATION = 2
_FLAGS = FLAG_LAYERWISE | FLAG_RESERVATION
MAX_TTL = 1e9   # seconds (~31 years): a ticket's expiry and a lease's TTL, in ms, stay well inside 64 bits


def check_ttl(owner: str, ttl: object) -> float:
    """``ttl`` of a handle or reservation, checked: finite seconds above 0 and at most
    :data:`MAX_TTL` (a larger one broke the ticket's encoding as a raw OverflowError, or came back
    from Redis as a script error); :class:`ConfigError` otherwise."""
    _seconds(owner, "ttl", ttl)
    assert isinstance(ttl, (int, float))
    if ttl > MAX_TTL:
        raise ConfigError(f"{owner}.ttl must be at most {MAX_TTL:.0f} seconds, got {ttl!r}",
                          hint="renew() a handle that must live longer")
    return ttl


def check_secret(owner: str, secret: object) -> None:
    """A sender's or receiver's ``secret=``: None, or non-empty bytes (a str failed every MAC in
    hmac, an empty key signed nothing worth checking); :class:`ConfigError` otherwise."""
    if secret is not None and (not isinstance(secret, (bytes, bytearray)) or not secret):
        raise ConfigError(f"{owner} secret must be non-empty bytes, got {type(secret).__name__} of length "
                          f"{len(secret) if hasattr(secret, '__len__') else '-'}",
                          hint="e.g. bytes.fromhex(SECRET_HEX); the same bytes on every sender and receiver")


def compute_mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()[:MAC_LEN]


def _width(values: Sequence[int]) -> int:
    m = max(values, default=0)
    return 1 if m < 256 else 2 if m < 65536 else 4


def _pack_ints(values: Sequence[int], width: int) -> bytes:
    a = array.array(_WIDTH_CODE[width], values)
    if sys.byteorder == "little" and width > 1:
        a.byteswap()
    return a.tobytes()


def _unpack_ints(data: bytes, width: int) -> list[int]:
    a = array.array(_WIDTH_CODE[width])
    a.frombytes(data)
    if sys.byteorder == "little" and width > 1:
        a.byteswap()
    return a.tolist()


class _Reader:
    def __init__(self, data: bytes, pos: int, end: int) -> None:
        self.data, self.pos, self.end = data, pos, end

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.end:
            raise BadHandle("handle is truncated")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int.from_bytes(self.take(2), "big")

    def text(self) -> str:
        try:
            return self.take(self.u16()).decode("utf-8")
        except UnicodeDecodeError:
            raise BadHandle("handle text field is not UTF-8") from None


def _text(s: str) -> bytes:
    if not isinstance(s, str):      # an engine's int request id (SGLang's bootstrap room), None
        raise ConfigError(f"handle text fields (request id, codec, URLs) must be str, got {type(s).__name__} "
                          f"{s!r:.40}", hint="pass str(request_id)")
    b = s.encode("utf-8")
    if len(b) > 0xFFFF:
        raise BadHandle("handle text field over 65535 bytes")
    return len(b).to_bytes(2, "big") + b


@dataclass(frozen=True)
class KVHandle:
    """Names the blocks of one request in one sender's pool. Immutable; build via ``KVSender.publish``."""

    handle_id: bytes                 # 16 random bytes, the sender's key for this handle
    request_id: str
    layout_hash: str                 # KVLayout.compat_hash (16 hex digits)
    urls: tuple[str, ...]            # where the sender serves it, preferred first
    block_ids: tuple[int, ...]
    generations: tuple[int, ...]
    checksums: tuple[int, ...]       # one per block (integrity.combine), or () when not computed
    num_tokens: int
    codec: str = "raw"
    token: bytes = b"\0" * 16        # read capability the sender checks
    lease_id: str = ""
    lease_url: str = ""              # lease server the receiver claims in ("" = no lease)
    fence_epoch: int = 0
    fence: int = 0
    expires_at_ms: int = 0           # unix ms when the sender frees the blocks if unreleased
    mac: bytes = b""
    layerwise: bool = False          # layers become ready after publish; checksums travel per layer
    reservation: bool = False        # push mode: names destination blocks the holder may write
    _raw: Optional[bytes] = field(default=None, init=False, repr=False, compare=False)
    _digest: Optional[str] = field(default=None, init=False, repr=False, compare=False)
    _lease_span: Optional[tuple[int, int]] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # refused where the handle is made -- inside KVSender.publish's undo of a refused publish --
        # not where it is first encoded (an engine's int request id failed there as AttributeError)
        if not isinstance(self.request_id, str) or not isinstance(self.codec, str):
            bad = self.request_id if not isinstance(self.request_id, str) else self.codec
            raise ConfigError(f"a handle's request id and codec must be str, got {type(bad).__name__} {bad!r:.40}",
                              hint="pass str(request_id)")

    # -- identity ------------------------------------------------------------------------
    @property
    def id(self) -> str:
        return self.handle_id.hex()

    @property
    def flags(self) -> int:
        return (FLAG_LAYERWISE if self.layerwise else 0) | (FLAG_RESERVATION if self.reservation else 0)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    # -- binary form ---------------------------------------------------------------------
    def body(self) -> bytes:
        return self._body(self.lease_id, self.lease_url, self.fence_epoch, self.fence, self.expires_at_ms)

    def _body(self, lease_id: str, lease_url: str, fence_epoch: int, fence: int, expires_at_ms: int) -> bytes:
        """The binary form without its MAC, with these lease fields in place of the handle's own."""
        n = len(self.block_ids)
        if not (len(self.generations) == n and len(self.checksums) in (0, n)):
            raise BadHandle("block_ids, generations and checksums must have equal lengths")
        try:
            lh = bytes.fromhex(self.layout_hash)
        except ValueError:
            raise BadHandle("layout_hash must be 16 hex digits") from None
        if len(lh) != 8 or len(self.handle_id) != 16 or len(self.token) != 16:
            raise BadHandle("handle_id/token must be 16 bytes and layout_hash 8 bytes")
        wb, wg = _width(self.block_ids), _width(self.generations)
        flags_arrays = bytes([wb, wg, 1 if self.checksums else 0])
        parts = [
            _HEAD.pack(MAGIC, HANDLE_VERSION, self.flags),
            _FIXED.pack(self.handle_id, self.token, lh, self.num_tokens, n, fence_epoch, fence, expires_at_ms),
            _text(self.request_id), _text(self.codec), _text(lease_id), _text(lease_url),
            bytes([len(self.urls)]), *(_text(u) for u in self.urls),
            flags_arrays,
            _pack_ints(self.block_ids, wb), _pack_ints(self.generations, wg),
        ]
        if self.checksums:
            parts.append(struct.pack(f"!{n}Q", *self.checksums))
        return b"".join(parts)

    def to_bytes(self) -> bytes:
        if self._raw is not None:
            return self._raw
        if len(self.mac) != MAC_LEN:
            raise BadHandle("handle is not signed; sign it with .signed(key)")
        raw = self.body() + self.mac
        object.__setattr__(self, "_raw", raw)
        return raw

    def lease_digest(self) -> str:
        """The lease id a handle must carry: SHA-256 of everything but its lease fields and MAC.

        It includes the secret read token, so only a holder of the genuine handle can name
        (claim, abort) its lease, and any alteration of the handle -- even one that recomputes
        this digest -- names a lease that does not exist. Receivers check it before claiming.
        """
        digest = self._digest
        if digest is None:          # the handle is immutable: computed once (a receiver checks it per fetch)
            digest = hashlib.sha256(b"kvbridge-lease\0" + self._bare()).hexdigest()[:32]
            object.__setattr__(self, "_digest", digest)
        return digest

    def _bare(self) -> bytes:
        """The body with its lease fields blank (lease id and URL empty, fence, epoch and expiry
        0). From the handle's bytes where it has them -- slices around those fields, a fraction
        of encoding it again -- or encoded. Both are the same bytes for any handle kvbridge
        encoded; bytes encoded otherwise (wider integer arrays) give another digest, which
        names no lease, as any other alteration does."""
        raw = self._raw
        if raw is None:
            return self._body("", "", 0, 0, 0)
        fixed_end = _HEAD.size + _FIXED.size
        span = self._lease_span                              # where from_bytes found the lease's text fields
        if span is None:
            r = _Reader(raw, fixed_end, len(raw) - MAC_LEN)
            r.take(r.u16()), r.take(r.u16())                 # request id, codec
            p = r.pos
            r.take(r.u16()), r.take(r.u16())                 # lease id, lease URL
            span = (p, r.pos)
        return b"".join((raw[:fixed_end - _LEASE_FIXED], _NO_LEASE_FIXED, raw[fixed_end:span[0]], _NO_LEASE_TEXT,
                         raw[span[1]:len(raw) - MAC_LEN]))

    def signed(self, key: bytes) -> "KVHandle":
        body = self.body()
        mac = compute_mac(key, body)
        h = replace(self, mac=mac)
        object.__setattr__(h, "_raw", body + mac)
        return h

    def verify(self, key: bytes) -> None:
        """Raise :class:`BadHandle` unless the MAC matches ``key``."""
        raw = self.to_bytes()
        if not hmac.compare_digest(compute_mac(key, raw[:-MAC_LEN]), self.mac):
            raise BadHandle("handle MAC does not verify: altered, forged, or a different secret")

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, key: Optional[bytes] = None) -> "KVHandle":
        """Parse a handle; with ``key``, also verify its MAC. Garbage raises :class:`BadHandle`."""
        if not isinstance(data, (bytes, bytearray, memoryview)):   # bytes(n) of an int would build n bytes
            raise BadHandle(f"a handle is bytes (KVHandle.to_bytes()), got {type(data).__name__}")
        data = bytes(data)
        if len(data) > MAX_HANDLE_BYTES:
            raise BadHandle(f"handle of {len(data)} bytes exceeds {MAX_HANDLE_BYTES}")
        if len(data) < _HEAD.size + _FIXED.size + MAC_LEN:
            raise BadHandle("handle is truncated")
        magic, version, flags = _HEAD.unpack_from(data, 0)
        if magic != MAGIC:
            raise BadHandle("not a kvbridge handle (bad magic)")
        if version != HANDLE_VERSION:
            raise BadHandle(f"handle version {version} unsupported (this kvbridge reads {HANDLE_VERSION})")
        if flags & ~_FLAGS:
            raise BadHandle(f"handle flags {flags:#x} unknown to this kvbridge")
        hid, token, lh, ntok, n, epoch, fence, expiry = _FIXED.unpack_from(data, _HEAD.size)
        if n > MAX_BLOCKS:
            raise BadHandle(f"handle names {n} blocks, over the {MAX_BLOCKS} limit")
        r = _Reader(data, _HEAD.size + _FIXED.size, len(data) - MAC_LEN)
        request_id, codec = r.text(), r.text()
        lease_at = r.pos
        lease_id, lease_url = r.text(), r.text()
        lease_span = (lease_at, r.pos)
        urls = tuple(r.text() for _ in range(r.u8()))
        wb, wg, has_sum = r.take(3)
        if wb not in _WIDTH_CODE or wg not in _WIDTH_CODE or has_sum not in (0, 1):
            raise BadHandle("handle array widths are invalid")
        blocks = _unpack_ints(r.take(n * wb), wb)
        gens = _unpack_ints(r.take(n * wg), wg)
        sums = struct.unpack(f"!{n}Q", r.take(8 * n)) if has_sum else ()
        if r.pos != r.end:
            raise BadHandle("handle has trailing bytes")
        h = cls(hid, request_id, lh.hex(), urls, tuple(blocks), tuple(gens), tuple(sums), ntok,
                codec, token, lease_id, lease_url, epoch, fence, expiry, data[-MAC_LEN:],
                layerwise=bool(flags & FLAG_LAYERWISE), reservation=bool(flags & FLAG_RESERVATION))
        object.__setattr__(h, "_raw", data)
        object.__setattr__(h, "_lease_span", lease_span)
        if key is not None:
            h.verify(key)
        return h

    # -- JSON-safe form ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (for an engine's ``kv_transfer_params``); round-trips exactly."""
        return {"kvbridge_handle": HANDLE_VERSION,
                "request_id": self.request_id, "num_tokens": self.num_tokens,
                "num_blocks": self.num_blocks, "urls": list(self.urls),
                **({"reservation": True} if self.reservation else {}),
                "data": base64.b64encode(self.to_bytes()).decode("ascii")}

    @classmethod
    def from_dict(cls, d: dict[str, Any], key: Optional[bytes] = None) -> "KVHandle":
        version = d.get("kvbridge_handle") if isinstance(d, dict) else None
        if type(version) is not int or version != HANDLE_VERSION or "data" not in d:   # not True, not 1.0
            raise BadHandle(f"not a kvbridge handle dict (one has 'kvbridge_handle': {HANDLE_VERSION}, an int, "
                            "and 'data')")
        try:
            raw = base64.b64decode(d["data"], validate=True)
        except (ValueError, TypeError):
            raise BadHandle("handle dict 'data' is not base64") from None
        h = cls.from_bytes(raw, key)
        if d.get("reservation", False) != h.reservation:
            raise BadHandle("handle dict field 'reservation' differs from the signed handle: altered")
        # The visible fields are for routers and logs; they must say what the signed data says.
        signed = {"request_id": h.request_id, "num_tokens": h.num_tokens, "num_blocks": h.num_blocks,
                  "urls": list(h.urls)}
        for name, value in signed.items():
            if name in d and d[name] != value:
                raise BadHandle(f"handle dict field {name!r} ({d[name]!r}) differs from the signed handle "
                                f"({value!r}): altered")
        unknown = set(d) - set(signed) - {"kvbridge_handle", "data", "reservation"}
        if unknown:
            raise BadHandle(f"handle dict has unknown fields {sorted(unknown)}")
        return h


class _Issued(Protocol):
    raw: bytes


_R = TypeVar("_R", bound=_Issued)
_ID = slice(_HEAD.size, _HEAD.size + 16)   # the handle id inside a handle's bytes
ID_OFFSET = _ID.start    # where the handle id starts in a handle's bytes (kvbridge._kvcopy.serve_small)


def find_issued(table: Mapping[bytes, _R], raw: bytes) -> Optional[_R]:
    """The record ``raw`` names in ``table`` if they are exactly the bytes issued, else None
    (:func:`lookup_ticket` says why)."""
    rec = table.get(raw[_ID])
    return rec if rec is not None and hmac.compare_digest(raw, rec.raw) else None


def lookup_ticket(table: Mapping[bytes, _R], raw: bytes, key: bytes, what: str = "handle") -> _R:
    """The record a peer's handle (or reservation) bytes name in ``table`` (keyed by handle
    id), if they are exactly the bytes issued; otherwise the precise refusal: garbage or a
    forgery (:class:`BadHandle`), a genuine ticket no longer live (:class:`HandleNotFound`),
    or a genuine id with other contents (:class:`AccessDenied`)."""
    if len(raw) < _ID.stop:
        raise BadHandle(f"{what} is truncated")
    found = find_issued(table, bytes(raw))
    if found is not None:
        return found
    rec = table.get(bytes(raw[_ID]))
    h = KVHandle.from_bytes(raw)                     # BadHandle on garbage
    try:
        h.verify(key)
    except BadHandle:
        # the text travels to the peer (a hint does not): say what an engine meets most, a restart
        raise BadHandle(f"{what} MAC does not verify: it was altered or forged, or not issued here -- e.g. issued "
                        "before this peer restarted, its KV gone: re-prefill (a persistent secret= makes such "
                        "tickets HandleNotFound, REPREFILL)") from None
    if rec is None:
        raise HandleNotFound(f"{what} {h.id} of request {h.request_id!r} is not live here "
                             "(released, expired or never issued)")
    raise AccessDenied(f"{what} does not match the one issued under this id")
