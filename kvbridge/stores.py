"""Which lease store a ticket is claimed in: one cache of open stores per sender or receiver."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional, Union

from .errors import BadHandle, ConfigError
from .handle import KVHandle
from .lease import LeaseStore, open_lease_store

__all__ = ["LeasesArg", "StoreCache"]

# A Redis URL, a store, None (the lease server each ticket names; this process's embedded
# one where it names none) or False (no leases).
LeasesArg = Union[str, LeaseStore, None, bool]
# Stores kept for the lease servers tickets name: a peer chooses those URLs, so past this many
# the least recently used is closed (it reconnects if a ticket names it again).
MAX_TICKET_STORES = 16


class StoreCache:
    """Resolves ``leases=`` for tickets and keeps the stores it opened (closed with it)."""

    def __init__(self, arg: LeasesArg, namespace: str = "kvb") -> None:
        self.arg = arg
        self.namespace = namespace
        self._stores: OrderedDict[str, LeaseStore] = OrderedDict()
        self._lock = threading.Lock()

    def _open(self, url: str) -> LeaseStore:
        evicted: list[LeaseStore] = []
        with self._lock:
            store = self._stores.get(url)
            if store is None:
                store = self._stores[url] = open_lease_store(url or None, namespace=self.namespace)
                mine = self.arg if isinstance(self.arg, str) else ""   # this side's own: never evicted
                others = [u for u in self._stores if u not in (mine, url)]   # least recently used first
                for old in others[:max(0, len(others) + 1 - MAX_TICKET_STORES)]:
                    evicted.append(self._stores.pop(old))
            self._stores.move_to_end(url)
        for s in evicted:
            s.close()
        return store

    def own(self) -> Optional[LeaseStore]:
        """The store this side publishes its own leases in (None with ``leases=False``)."""
        arg = self.arg
        if arg is False:
            return None
        if isinstance(arg, LeaseStore):
            return arg
        return self._open(arg if isinstance(arg, str) else "")

    def for_ticket(self, ticket: KVHandle) -> Optional[LeaseStore]:
        """The store to claim ``ticket`` in, or None for an unleased ticket. A lease server URL
        the ticket names (``leases=None``; it is outside the ticket's lease digest: whoever made
        the ticket chose it) that no store can use is the ticket's fault: BadHandle. This side's
        own ``leases=`` URL stays a ConfigError."""
        arg = self.arg
        if not ticket.lease_id or arg is False:
            return None
        if isinstance(arg, LeaseStore):
            return arg
        if isinstance(arg, str):
            return self._open(arg)
        try:
            return self._open(ticket.lease_url)
        except ConfigError as exc:
            if not ticket.lease_url:
                raise
            raise BadHandle(f"the {'reservation' if ticket.reservation else 'handle'} names a lease server "
                            f"no store can use: {exc}") from None

    def close(self) -> None:
        with self._lock:
            stores = list(self._stores.values())
            self._stores.clear()
        for s in stores:
            s.close()
