"""A store handed to a framework integration, or the path of one it opens itself on first use.

Invariant: :meth:`StoreRef.close` closes only a store this object opened; a store the caller
passed in (a :class:`Store`, or a :class:`JobStore` opened on every rank) stays open (it is the
caller's).
"""

from __future__ import annotations

import os
from typing import Any

from ..multirank.job_store import JobStore
from ..storage.job_log import is_job_store
from ..store import Store


def default_group(path: str) -> Any:
    """The process group a training job writes the store at ``path`` with: torch.distributed's
    default group when it is initialized with more than one rank (each rank writes its part of
    a job store), or with one rank and ``path`` holds a job store already; else None (one
    process, a single-writer store)."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    if dist.get_world_size() < 2 and not is_job_store(path):
        return None
    return dist.group.WORLD


class StoreRef:
    """Either an open writable :class:`Store` or :class:`JobStore`, or a path, opened for writing
    on first use. ``user`` names the integration in errors."""

    def __init__(self, store: str | os.PathLike | Store | JobStore, user: str) -> None:
        self.user = user
        self.store: Store | JobStore | None
        if isinstance(store, (Store, JobStore)):
            self.owned, self.store, self.path = False, store, store.path
        else:
            self.owned, self.store, self.path = True, None, os.fspath(store)

    def writer(self, distributed: bool = False, **options: Any) -> Store | JobStore:
        """The store, opened for writing if it is not open. ``distributed``: a training job's
        process may be one of several: with :func:`default_group` (every rank calls this at
        once) it opens a multi-rank job store with ``options`` (``commit_timeout``, ...);
        otherwise, and without ``distributed``, a single-writer store. ValueError when the store
        at the path is of the other kind (nothing is opened)."""
        if self.store is None:
            import ckptstore

            job = is_job_store(self.path)
            process_group = default_group(self.path) if distributed else None
            if process_group is None and job:
                raise ValueError(f"{self.path} is a multi-rank job store: {self.user} cannot "
                                 "write it from one process: it writes one from every rank of a "
                                 "training job (torch.distributed initialized with several "
                                 "ranks, or an open JobStore passed in)")
            if process_group is not None and not job and \
                    os.path.exists(os.path.join(self.path, "STORE")):
                raise ValueError(f"{self.path} is a single-writer store: a training job of "
                                 f"several ranks writes a multi-rank job store ({self.user} on "
                                 "every rank): use another path")
            if process_group is None:
                self.store = ckptstore.open(self.path, mode="a")
            else:
                self.store = ckptstore.open(self.path, mode="a", process_group=process_group,
                                            **options)
        return self.store

    def close(self) -> None:
        """Close the store if this object opened it (a later :meth:`writer` reopens it)."""
        if self.owned and self.store is not None:
            store, self.store = self.store, None
            store.close()
