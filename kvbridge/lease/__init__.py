"""Leases: the lifecycle authority for published KV handles (see ``docs/LEASES.md``)."""

from .base import (EVENT_KINDS, Claim, Fence, Lease, LeaseEvent, LeaseState, LeaseStats, LeaseStore,
                   holds_until, owner_deadline)
from .embedded import (EmbeddedRedis, default_lease_url, find_server_binary, open_lease_store,
                       resolve_lease_url)
from .redis import DEFAULT_RETRY, LeaseBatch, RedisLeaseStore

__all__ = [
    "EVENT_KINDS", "Claim", "Fence", "Lease", "LeaseEvent", "LeaseState", "LeaseStats", "LeaseStore",
    "owner_deadline", "holds_until", "EmbeddedRedis", "default_lease_url", "find_server_binary",
    "open_lease_store", "resolve_lease_url", "DEFAULT_RETRY", "LeaseBatch", "RedisLeaseStore",
]
