"""A store handed to a framework integration, or the path of one it opens itself on first use.

Invariant: :meth:`StoreRef.close` closes only a store this object opened; a :class:`Store` the
caller passed in stays open (it is the caller's).
"""

from __future__ import annotations

import os

from ..store import Store


class StoreRef:
    """Either an open writable :class:`Store` or a path, opened for writing on first use.
    ``user`` names the integration in errors."""

    def __init__(self, store: str | os.PathLike | Store, user: str) -> None:
        self.user = user
        self.store: Store | None
        if isinstance(store, Store):
            self.owned, self.store, self.path = False, store, store.path
        else:
            self.owned, self.store, self.path = True, None, os.fspath(store)

    def writer(self) -> Store:
        """The store, opened for writing (mode "a") if it is not open. Raises ValueError for a
        multi-rank job store (the integrations write single-writer stores)."""
        if self.store is None:
            import ckptstore

            store = ckptstore.open(self.path, mode="a")
            if not isinstance(store, Store):
                store.close()
                raise ValueError(f"{self.path} is a multi-rank job store; {self.user} writes "
                                 "single-writer stores only")
            self.store = store
        return self.store

    def close(self) -> None:
        """Close the store if this object opened it (a later :meth:`writer` reopens it)."""
        if self.owned and self.store is not None:
            store, self.store = self.store, None
            store.close()
