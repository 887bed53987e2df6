"""Counters kept by senders and receivers (plain dataclasses; export with ``asdict``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["SenderStats", "ReceiverStats"]


@dataclass
class SenderStats:
    published: int = 0
    blocks_published: int = 0
    # handles ended, by reason ("expired" = reclaimed at the TTL without a release)
    released: int = 0
    aborted: int = 0
    expired: int = 0
    revoked: int = 0
    closed: int = 0
    blocks_freed: int = 0
    blocks_released: int = 0
    blocks_aborted: int = 0
    blocks_expired: int = 0
    blocks_revoked: int = 0
    blocks_closed: int = 0
    reads: int = 0
    bytes_served: int = 0
    refused: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class ReceiverStats:
    fetches: int = 0
    claimed: int = 0             # leases claimed
    released: int = 0            # leases released after a verified fetch
    aborted: int = 0             # claims given up after a failed fetch
    stale_refused: int = 0       # fetches whose bytes a lease check refused (never used)
    ok: int = 0
    failed: int = 0
    retries: int = 0
    refetches: int = 0
    integrity_failures: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)
