"""Reading follower bases: a shadow follower's replica of a primary store, used as a base.

A follower (:mod:`ckptstore.follow`, ``ckptstore follow``) replays every committed delta of a
primary store into a live replica and, every K iterations, writes the replica as a base snapshot
into its own store at ``<primary>/follower/``, tagged with the identity of the primary commit it
reproduces. This module is the read side (format-spec/follower.md): for iteration ``t`` of the
primary it picks the newest follower base ``b`` with ``base_of(t) < b <= t`` whose identity
matches the primary's commit of ``b`` (and whose parameters match the fingerprint the primary's
delta ``b`` records, when it records one), and presents "follower base ``b``, then the primary's
deltas ``b+1..t``" to the replay engine as one :class:`~ckptstore.replay.replayer.RecordSource`.

A follower store is a cache: a base that does not match, fails to read or fails to replay is
skipped with a :class:`ckptstore.errors.FollowerWarning` and the load goes on from an older
follower base or the primary's own base. Nothing here writes.
"""

from __future__ import annotations

import os
import warnings
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from ..errors import CkptStoreError, FollowerWarning, NotFoundError, StoreNotFoundError
from ..format.delta import REPLAY_KEY
from .replayer import fingerprint_digest

#: the follower store's directory inside the primary store's directory
FOLLOWER_DIR = "follower"
#: the meta key of a follower base (its identity)
FOLLOWER_KEY = "ckptstore.follower"
FOLLOWER_VERSION = 1


def follower_path(primary_path: str | os.PathLike) -> str:
    """Where the follower store of the primary store at ``primary_path`` lives."""
    return os.path.join(os.fspath(primary_path), FOLLOWER_DIR)


@dataclass(frozen=True)
class Identity:
    """What a follower base reproduces: iteration ``iteration`` of the primary store whose STORE
    ``store_id`` is ``primary`` (hex), whose commit names a manifest of digest ``digest`` (xxh3-128,
    hex), in the chain of primary base ``base`` (manifest digest ``base_digest``)."""

    primary: str
    iteration: int
    digest: str
    base: int
    base_digest: str

    def to_meta(self) -> dict:
        return {"v": FOLLOWER_VERSION, "primary": self.primary, "iteration": self.iteration,
                "digest": self.digest, "base": self.base, "base_digest": self.base_digest}

    @classmethod
    def from_meta(cls, meta: Any) -> "Identity | None":
        """The identity in a follower base's meta, or None when it has none or a malformed one."""
        sec = meta.get(FOLLOWER_KEY) if isinstance(meta, dict) else None
        if not isinstance(sec, dict) or sec.get("v") != FOLLOWER_VERSION:
            return None
        try:
            ident = cls(sec["primary"], sec["iteration"], sec["digest"], sec["base"],
                        sec["base_digest"])
        except KeyError:
            return None
        if not (_hex(ident.primary, 32) and _hex(ident.digest, 32) and _hex(ident.base_digest, 32)
                and type(ident.iteration) is int and type(ident.base) is int
                and 0 <= ident.base < ident.iteration):
            return None
        return ident


def _hex(s: Any, n: int) -> bool:
    return type(s) is str and len(s) == n and all(c in "0123456789abcdef" for c in s)


class Primary(Protocol):
    """What the read side needs of the primary store (:class:`ckptstore.Store` is one)."""

    path: str
    mode: str

    @property
    def header(self) -> Any: ...

    def base_of(self, iteration: int) -> int: ...

    def kind(self, iteration: int) -> str: ...

    def info(self, iteration: int) -> Any: ...

    def load(self, iteration: int) -> Any: ...

    def load_record(self, iteration: int, keys: Sequence[Any] | None = None, *,
                    into: Callable[[Any], Any] | None = None) -> Any: ...

    def consistent_reads(self) -> AbstractContextManager[Any]: ...


def identity_of(primary: Primary, iteration: int) -> Identity:
    """The identity of the primary's commit of ``iteration`` (a delta) and of its chain's base."""
    base = primary.base_of(iteration)
    return Identity(primary.header.store_id.hex(), iteration, primary.info(iteration).manifest_digest,
                    base, primary.info(base).manifest_digest)


def mismatch(primary: Primary, ident: Identity, iteration: int) -> str | None:
    """Why a follower base of ``iteration`` with identity ``ident`` does not reproduce the
    primary's commit of ``iteration``; None when it does (format-spec/follower.md, "Reader")."""
    if ident.primary != primary.header.store_id.hex():
        return f"it reproduces another primary store (store id {ident.primary})"
    if ident.iteration != iteration:
        return f"its identity names iteration {ident.iteration}"
    try:
        if primary.kind(iteration) != "delta":
            return f"iteration {iteration} of the primary is not a delta"
        if primary.info(iteration).manifest_digest != ident.digest:
            return f"the primary's commit of iteration {iteration} has another manifest digest"
        base = primary.base_of(iteration)
        if base != ident.base or primary.info(base).manifest_digest != ident.base_digest:
            return f"iteration {iteration} of the primary is in another chain (base {base})"
    except NotFoundError:
        return f"iteration {iteration} is not a recoverable iteration of the primary"
    return None


def parameters_of(state: dict) -> list[Any]:
    """A base state's parameters in optimizer order (the order a delta's ``fp`` hashes)."""
    model = state["model"]
    return [model[n] for names in state[REPLAY_KEY]["groups"] for n in names]


class FollowerSource:
    """A :class:`~ckptstore.replay.replayer.RecordSource`: follower base ``base`` (its state
    ``state`` already read, handed out once; a retried replay reads it again), then the primary's
    deltas."""

    def __init__(self, primary: Primary, follower: Any, base: int, state: dict) -> None:
        self.primary = primary
        self.follower = follower
        self.base = base
        self.mode = primary.mode
        self._state: dict | None = state

    def base_of(self, iteration: int) -> int:
        if iteration < self.base:
            raise NotFoundError(f"iteration {iteration} is before follower base {self.base}")
        return self.base

    def kind(self, iteration: int) -> str:
        return "snapshot" if iteration == self.base else self.primary.kind(iteration)

    def load(self, iteration: int) -> Any:
        if iteration != self.base:
            return self.primary.load(iteration)
        state, self._state = self._state, None
        return state if state is not None else self.follower.load(iteration)

    def load_record(self, iteration: int, keys: Sequence[Any] | None = None, *,
                    into: Callable[[Any], Any] | None = None) -> Any:
        return self.primary.load_record(iteration, keys, into=into)

    def consistent_reads(self) -> AbstractContextManager[Any]:
        return self.primary.consistent_reads()


class FollowerBases:
    """The read side of a primary's follower store (``<primary>/follower/``), opened lazily with
    ``open_reader(path)`` (a read-only store), refreshed before each use, never written."""

    def __init__(self, primary: Primary, open_reader: Callable[[str], Any]) -> None:
        self.primary = primary
        self.path = follower_path(primary.path)
        self._open_reader = open_reader
        self._reader: Any = None
        #: (follower store id, iteration) -> identity (None: no valid identity); immutable
        self._idents: dict[tuple[bytes, int], Identity | None] = {}
        self._warned: set[tuple[Any, ...]] = set()
        #: the follower base the last :meth:`replay` started from (None: the primary's base)
        self.last_base: int | None = None

    def close(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()

    def _warn(self, key: tuple[Any, ...], message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"ckptstore: follower store {self.path}: {message}; loading from the "
                          "primary's own bases instead (nothing is lost)", FollowerWarning,
                          stacklevel=4)

    def reader(self) -> Any:
        """The follower store, read-only and caught up; None when there is none (or it cannot be
        opened: warned)."""
        if self._reader is None:
            if not os.path.isfile(os.path.join(self.path, "STORE")):
                return None
            try:
                self._reader = self._open_reader(self.path)
            except StoreNotFoundError:
                return None
            except (CkptStoreError, OSError) as e:
                self._warn(("open", type(e).__name__), f"cannot be opened ({e})")
                return None
        else:
            try:
                self._reader.refresh()
            except (CkptStoreError, OSError) as e:
                self._warn(("refresh", type(e).__name__), f"cannot be read ({e})")
                self.close()
                return None
        return self._reader

    def _identity(self, reader: Any, b: int) -> Identity | None:
        key = (reader.header.store_id, b)
        if key not in self._idents:
            ident = None
            try:
                if reader.kind(b) == "snapshot":
                    ident = Identity.from_meta(reader.meta(b))
            except (CkptStoreError, OSError) as e:
                self._warn(("meta", key), f"base {b} cannot be read ({e})")
                return None
            self._idents[key] = ident
        return self._idents[key]

    def candidates(self, iteration: int) -> list[int]:
        """Follower bases usable for ``iteration`` of the primary, newest first: every ``b`` with
        ``base_of(iteration) < b <= iteration`` whose identity matches the primary (those that do
        not are warned about once)."""
        reader = self.reader()
        if reader is None:
            return []
        pb = self.primary.base_of(iteration)
        try:
            its = [b for b in reader.iterations() if pb < b <= iteration]
        except (CkptStoreError, OSError) as e:
            self._warn(("list", type(e).__name__), f"cannot be listed ({e})")
            return []
        out = []
        for b in reversed(its):
            ident = self._identity(reader, b)
            why = "it carries no follower identity" if ident is None else mismatch(self.primary, ident, b)
            if why is not None:
                foreign = ident is not None and ident.primary != self.primary.header.store_id.hex()
                # a foreign store is warned about once, not once per base
                self._warn(("foreign", reader.header.store_id) if foreign
                           else ("identity", reader.header.store_id, b),
                           f"base {b} is not used: {why}")
                continue
            out.append(b)
        return out

    def base_state(self, b: int) -> dict | None:
        """Follower base ``b`` read and checked against the fingerprint the primary's delta ``b``
        records (when it records one); None (warned) when it fails."""
        reader = self._reader
        if reader is None:
            return None
        try:
            state = reader.load(b)
            if not isinstance(state, dict) or "replay_report" in state:
                raise CkptStoreError("it is not an exact Checkpointer base")
            try:
                fp = self.primary.load_record(b, ["fp"])["fp"]
            except NotFoundError:
                fp = None  # delta b records no fingerprint
            if isinstance(fp, dict) and fingerprint_digest(parameters_of(state)) != fp.get("xxh3"):
                raise CkptStoreError(f"its parameters differ from the fingerprint the primary's "
                                     f"delta {b} records")
        except (CkptStoreError, OSError, KeyError, TypeError, IndexError, AttributeError,
                ValueError) as e:  # (a malformed state: the follower store is not trusted more)
            self._warn(("read", reader.header.store_id, b), f"base {b} is not used: {e}")
            return None
        return state

    def replay(self, iteration: int, run: Callable[[FollowerSource], Any]) -> Any:
        """``run(source)`` (a replay of ``iteration``) from the newest usable follower base; None
        when no follower base could be used (the caller replays from the primary's base)."""
        self.last_base = None
        for b in self.candidates(iteration):
            state = self.base_state(b)
            if state is None:
                continue
            reader = self._reader
            try:
                out = run(FollowerSource(self.primary, reader, b, state))
            except CkptStoreError as e:
                # a damaged follower base (or a damaged primary delta: the replay from the
                # primary's base meets it again and raises it)
                self._warn(("replay", reader.header.store_id if reader is not None else None, b),
                           f"replay from base {b} failed ({e})")
                return None
            self.last_base = b
            return out
        return None
