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

The primary may be a multi-rank job store (format-spec/follower.md §7,
:mod:`ckptstore.multirank.job_follower`): its identities come from the job (any object with the
:class:`Primary` interface), and each rank's part of a follower base is read and replayed on its
own (a :class:`Part`: the part's key in the follower base and that rank's records).

gc of the primary may *rebase* on a follower base (``ckptstore gc --follower-bases``,
format-spec/follower.md section 6): :class:`FollowerRebaser` checks a follower base completely
(:meth:`FollowerRebaser.verify`) and gc copies it into the primary as a snapshot of its own whose
manifest records where it came from (:data:`REBASED_KEY`), so the deltas before it can go. Chain
identities look through such a snapshot to the chain it was cut from (:func:`chain_origin`), so
follower bases written before the gc keep matching.
"""

from __future__ import annotations

import os
import warnings
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from ..errors import CkptStoreError, FollowerWarning, NotFoundError, StoreNotFoundError
from ..format.delta import REPLAY_KEY
from ..format.manifest import part_manifest
from .fingerprints import fingerprint_digest

#: the follower store's directory inside the primary store's directory
FOLLOWER_DIR = "follower"
#: the meta key of a follower base (its identity)
FOLLOWER_KEY = "ckptstore.follower"
FOLLOWER_VERSION = 1
#: the manifest field of a primary snapshot that gc made from a follower base (format-spec/follower.md §6)
REBASED_KEY = "rebased"
REBASED_VERSION = 1


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

    def manifest(self, iteration: int) -> Any: ...

    def latest(self) -> int | None: ...

    def iterations(self) -> list[int]: ...

    def load(self, iteration: int, keys: Sequence[Any] | None = None) -> Any: ...

    def load_record(self, iteration: int, keys: Sequence[Any] | None = None, *,
                    into: Callable[[Any], Any] | None = None) -> Any: ...

    def consistent_reads(self) -> AbstractContextManager[Any]: ...


@dataclass(frozen=True)
class Rebased:
    """Where a primary snapshot that gc made from a follower base comes from (the manifest field
    :data:`REBASED_KEY`, format-spec/follower.md section 6): it stands for the primary's delta
    whose manifest digest was ``digest``, in the chain whose origin is base ``base`` (manifest
    digest ``base_digest``), and was copied from follower store ``follower`` (store id, hex)."""

    digest: str
    base: int
    base_digest: str
    follower: str

    def to_json(self) -> dict:
        return {"v": REBASED_VERSION, "digest": self.digest, "base": self.base,
                "base_digest": self.base_digest, "follower": self.follower}

    @classmethod
    def from_extra(cls, extra: Any, iteration: int) -> "Rebased | None":
        """The provenance in a snapshot manifest's extra fields; None when it has none or a
        malformed one (the snapshot is then an ordinary base: its own chain's origin)."""
        sec = extra.get(REBASED_KEY) if isinstance(extra, dict) else None
        if not isinstance(sec, dict) or sec.get("v") != REBASED_VERSION:
            return None
        digest: Any = sec.get("digest")
        base: Any = sec.get("base")
        base_digest: Any = sec.get("base_digest")
        follower: Any = sec.get("follower")
        if not (_hex(digest, 32) and _hex(base_digest, 32) and _hex(follower, 32)
                and type(base) is int and 0 <= base < iteration):
            return None
        return cls(digest, base, base_digest, follower)


def rebased_of(primary: Primary, iteration: int) -> Rebased | None:
    """The provenance of the primary's snapshot ``iteration`` when gc made it from a follower
    base, else None."""
    return Rebased.from_extra(primary.manifest(iteration).extra, iteration)


def dropped_by_rebase(primary: Primary, iteration: Any) -> NotFoundError | None:
    """The NotFoundError for ``iteration`` when a gc with ``follower_bases`` dropped it: the
    first snapshot after it was made from a follower base of a chain that held it
    (format-spec/follower.md §6); None otherwise."""
    if type(iteration) is not int:
        return None
    try:
        later = [i for i in primary.iterations()
                 if i > iteration and primary.kind(i) == "snapshot"]
        r = rebased_of(primary, later[0]) if later else None
    except CkptStoreError:
        return None
    if r is None or not r.base < iteration:
        return None
    return NotFoundError(
        f"iteration {iteration} is not in {primary.path}: a gc that rebased on follower bases "
        f"dropped it (its chain now starts at iteration {later[0]}, a snapshot made from a "
        f"follower base; iterations from {later[0]} on are restorable)")


#: (store id, snapshot, its manifest digest) -> its chain origin; committed manifests never change
_ORIGINS: dict[tuple[bytes, int, str], tuple[int, str]] = {}


def chain_origin(primary: Primary, base: int) -> tuple[int, str]:
    """(iteration, manifest digest hex) of the base snapshot the chain of the primary's snapshot
    ``base`` started from: ``base`` itself, or for a snapshot gc made from a follower base
    (:func:`rebased_of`) the origin it records. Follower identities name origins, so a follower
    base matches before and after a gc that rebased its chain."""
    digest = primary.info(base).manifest_digest
    key = (primary.header.store_id, base, digest)
    hit = _ORIGINS.get(key)
    if hit is None:
        r = rebased_of(primary, base)
        hit = (base, digest) if r is None else (r.base, r.base_digest)
        if len(_ORIGINS) > 4096:
            _ORIGINS.clear()
        _ORIGINS[key] = hit
    return hit


def identity_of(primary: Primary, iteration: int) -> Identity:
    """The identity of the primary's commit of ``iteration`` (a delta) and of its chain's origin
    (:func:`chain_origin`)."""
    base, base_digest = chain_origin(primary, primary.base_of(iteration))
    return Identity(primary.header.store_id.hex(), iteration, primary.info(iteration).manifest_digest,
                    base, base_digest)


def mismatch(primary: Primary, ident: Identity, iteration: int) -> str | None:
    """Why a follower base of ``iteration`` with identity ``ident`` does not reproduce the
    primary's commit of ``iteration``; None when it does (format-spec/follower.md, "Reader").
    A primary snapshot that gc made from this very follower base (it records the same delta
    digest and chain origin) matches too: the same history, held by the primary itself."""
    if ident.primary != primary.header.store_id.hex():
        return f"it reproduces another primary store (store id {ident.primary})"
    if ident.iteration != iteration:
        return f"its identity names iteration {ident.iteration}"
    try:
        if primary.kind(iteration) == "delta":
            if primary.info(iteration).manifest_digest != ident.digest:
                return f"the primary's commit of iteration {iteration} has another manifest digest"
            base = primary.base_of(iteration)
        else:
            r = rebased_of(primary, iteration)
            if r is None or r.digest != ident.digest:
                return f"iteration {iteration} of the primary is not a delta"
            base = iteration
        if chain_origin(primary, base) != (ident.base, ident.base_digest):
            return f"iteration {iteration} of the primary is in another chain (base {base})"
    except NotFoundError:
        return f"iteration {iteration} is not a recoverable iteration of the primary"
    return None


def parameters_of(state: dict) -> list[Any]:
    """A base state's parameters in optimizer order (the order a delta's ``fp`` hashes)."""
    model = state["model"]
    return [model[n] for names in state[REPLAY_KEY]["groups"] for n in names]


@dataclass(frozen=True)
class Part:
    """What a load replays from a follower base: the state under its top-level key ``key`` (one
    rank's part of a job store's follower base, format-spec/follower.md §7; None: the whole
    state), continued with the deltas of ``records`` (a
    :class:`~ckptstore.replay.replayer.RecordSource`: the primary, or that rank's records)."""

    key: str | None
    records: Any


class FollowerSource:
    """A :class:`~ckptstore.replay.replayer.RecordSource`: follower base ``base`` (its state
    ``state`` already read, handed out once; a retried replay reads it again: the follower base's
    top-level ``key`` only when given, a job's part), then the primary's deltas (``primary``: the
    records those deltas are read from)."""

    def __init__(self, primary: Any, follower: Any, base: int, state: dict,
                 key: str | None = None) -> None:
        self.primary = primary
        self.follower = follower
        self.base = base
        self.key = key
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
        if state is not None:
            return state
        return read_base(self.follower, iteration, self.key)

    def load_record(self, iteration: int, keys: Sequence[Any] | None = None, *,
                    into: Callable[[Any], Any] | None = None) -> Any:
        return self.primary.load_record(iteration, keys, into=into)

    def consistent_reads(self) -> AbstractContextManager[Any]:
        return self.primary.consistent_reads()


def _label(b: int, key: str | None) -> str:
    """How warnings name follower base ``b`` (and the part ``key`` of it)."""
    return f"base {b}" if key is None else f"base {b} ({key})"


def read_base(reader: Any, b: int, key: str | None) -> Any:
    """Follower base ``b`` of the follower store ``reader``: the whole state, or the part under
    top-level key ``key`` (a job's rank part; only its tensors are read)."""
    return reader.load(b) if key is None else reader.load(b, [key])[key]


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

    def base_state(self, b: int, part: Part | None = None) -> dict | None:
        """Follower base ``b`` (``part``: one rank's part of it) read and checked against the
        fingerprint the primary's delta ``b`` (that rank's) records, when it records one; None
        (warned) when it fails."""
        reader = self._reader
        if reader is None:
            return None
        part = part or Part(None, self.primary)
        key = part.key
        try:
            state = read_base(reader, b, key)
            if not isinstance(state, dict) or "replay_report" in state:
                raise CkptStoreError("it is not an exact Checkpointer base")
            try:
                fp = part.records.load_record(b, ["fp"])["fp"]
            except NotFoundError:
                fp = None  # delta b records no fingerprint
            if isinstance(fp, dict) and fingerprint_digest(parameters_of(state)) != fp.get("xxh3"):
                raise CkptStoreError(f"its parameters differ from the fingerprint the primary's "
                                     f"delta {b} records")
        except (CkptStoreError, OSError, KeyError, TypeError, IndexError, AttributeError,
                ValueError) as e:  # (a malformed state: the follower store is not trusted more)
            self._warn(("read", reader.header.store_id, b, key),
                       f"{_label(b, key)} is not used: {e}")
            return None
        return state

    def replay(self, iteration: int, run: Callable[[FollowerSource], Any],
               part: Part | None = None) -> Any:
        """``run(source)`` (a replay of ``iteration``) from the newest usable follower base; None
        when no follower base could be used (the caller replays from the primary's base).
        ``part``: replay that rank's part of a job store's follower bases, with its records."""
        self.last_base = None
        part = part or Part(None, self.primary)
        key = part.key
        for b in self.candidates(iteration):
            state = self.base_state(b, part)
            if state is None:
                continue
            reader = self._reader
            try:
                out = run(FollowerSource(part.records, reader, b, state, key))
            except CkptStoreError as e:
                # a damaged follower base (or a damaged primary delta: the replay from the
                # primary's base meets it again and raises it)
                self._warn(("replay", reader.header.store_id if reader is not None else None, b,
                            key), f"replay from {_label(b, key)} failed ({e})")
                return None
            self.last_base = b
            return out
        return None


def _same(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of two decoded state values (tensors, arrays, containers, scalars;
    floats by their bits, so NaN equals NaN)."""
    import struct

    import numpy as np

    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if hasattr(a, "untyped_storage"):  # a torch tensor

        def raw(t: Any) -> Any:
            return t.detach().contiguous().reshape(-1).view(torch.uint8)

        import torch

        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(raw(a), raw(b)))
    return bool(a == b)


class FollowerRebaser:
    """The follower bases gc of the primary may rebase on (``Store.gc(follower_bases=True)``,
    ``ckptstore gc --follower-bases``; format-spec/follower.md section 6): a
    :class:`ckptstore.ops.gc.RebaseSource`.

    :meth:`usable` says whether follower base ``b`` passed every check of :meth:`verify` (cached:
    each base is read and replayed at most once); gc then copies its records from
    :attr:`engine` (the follower store's, read-only) into the primary as a snapshot whose
    manifest carries :meth:`manifest_extra`. Nothing here writes."""

    def __init__(self, primary: Primary, open_reader: Callable[[str], Any],
                 parts: Callable[[int], Sequence[Part]] | None = None) -> None:
        self.primary = primary
        self.path = follower_path(primary.path)
        #: the parts of follower base ``b`` :meth:`verify` checks, each on its own records (a
        #: job's: one per rank of ``b``, format-spec/follower.md §7); default: the whole state
        self.parts = parts or (lambda b: [Part(None, primary)])
        self._reader: Any = None
        self._verdicts: dict[int, str | None] = {}
        self._idents: dict[int, Identity] = {}
        #: follower bases looked at and not usable: iteration -> why
        self.skipped: dict[int, str] = {}
        if os.path.isfile(os.path.join(self.path, "STORE")):
            try:
                self._reader = open_reader(self.path)
                self._scan()
            except (CkptStoreError, OSError) as e:
                self.close()
                self.skipped[-1] = f"follower store {self.path} cannot be read ({e})"

    def _scan(self) -> None:
        """Checks (a)-(e) of every follower base (identities only)."""
        reader = self._reader
        for b in reader.iterations():
            try:
                self.primary.info(b)
            except NotFoundError:
                continue  # an iteration the primary's gc removed: harmless (§3.2), not listed
            ident = Identity.from_meta(reader.meta(b)) if reader.kind(b) == "snapshot" else None
            why = "it carries no follower identity" if ident is None else mismatch(self.primary, ident, b)
            if why is None and self.primary.kind(b) != "delta":
                continue  # the primary holds it as a snapshot already (an earlier rebase)
            if why is not None or ident is None:
                self.skipped[b] = why or "it carries no follower identity"
                continue
            self._idents[b] = ident

    @property
    def engine(self) -> Any:
        """The follower store's engine (what gc copies a base's records from)."""
        return self._reader.engine

    def candidates(self) -> list[int]:
        """Follower bases whose identity matches a delta of the primary, ascending."""
        return sorted(self._idents)

    def usable(self, iteration: int) -> bool:
        """Whether gc may replace the primary's delta ``iteration`` by follower base
        ``iteration`` (:meth:`verify`, cached)."""
        if iteration not in self._idents:
            return False
        if iteration not in self._verdicts:
            why = self.verify(iteration)
            self._verdicts[iteration] = why
            if why is not None:
                self.skipped[iteration] = why
        return self._verdicts[iteration] is None

    def manifest_extra(self, iteration: int) -> dict:
        """The extra manifest field (:data:`REBASED_KEY`) of the snapshot gc makes of base
        ``iteration``."""
        ident = self._idents[iteration]
        return {REBASED_KEY: Rebased(ident.digest, ident.base, ident.base_digest,
                                     self._reader.header.store_id.hex()).to_json()}

    def base_manifest(self, iteration: int) -> Any:
        """The manifest of follower base ``iteration`` (read from :attr:`engine`)."""
        return self._reader.engine.manifest(iteration)

    def part(self, key: str) -> "PartRebase":
        """The :class:`ckptstore.ops.gc.RebaseSource` of the parts ``key`` of these bases (a
        job's gc copies each rank's part into that rank's stream)."""
        return PartRebase(self, key)

    @staticmethod
    def _fingerprint(records: Any, iteration: int) -> dict | None:
        """The ``fp`` of the delta ``iteration`` of ``records`` (None: it records none)."""
        try:
            fp = records.load_record(iteration, ["fp"])["fp"]
        except NotFoundError:
            return None
        return fp if isinstance(fp, dict) and isinstance(fp.get("xxh3"), str) else None

    def verify(self, b: int) -> str | None:
        """Why follower base ``b`` must not replace the primary's delta ``b``; None when it may.
        Besides the reader's checks (a)-(g) of format-spec/follower.md §4, with (g) required, the
        base's scheduler, RNG, buffers and param-group settings must equal what the primary's
        delta ``b`` records, and replaying the primary's deltas after ``b`` onto it up to the next
        one that records a fingerprint must be exact and match that fingerprint. Every part of
        :attr:`parts` must pass (a job's: every rank's, each against its own records; the
        reason names the part that failed)."""
        try:
            parts = list(self.parts(b))
        except (CkptStoreError, OSError) as e:
            return f"{type(e).__name__}: {e}"
        for part in parts:
            why = self._verify_part(b, part)
            if why is not None:
                return why if part.key is None else f"its part {part.key}: {why}"
        return None

    def _verify_part(self, b: int, part: Part) -> str | None:
        """:meth:`verify` of one part: its state read from the follower base (under ``part.key``),
        checked against the deltas of ``part.records``."""
        from .replayer import IncrementalReplayer

        primary, reader, records = self.primary, self._reader, part.records
        try:
            fp = self._fingerprint(records, b)
            if fp is None:
                return f"the primary's delta {b} records no fingerprint to check it against"
            chain = primary.base_of(b)
            nxt, it = None, b + 1
            latest = primary.latest()
            while latest is not None and it <= latest and primary.kind(it) == "delta" and primary.base_of(it) == chain:
                if self._fingerprint(records, it) is not None:
                    nxt = it
                    break
                it += 1
            if nxt is None:
                return (f"no delta after {b} records a fingerprint yet (the replay check needs "
                        "one)")
            state = read_base(reader, b, part.key)
            if not isinstance(state, dict) or "replay_report" in state or state.get("iteration") != b:
                return "it is not an exact Checkpointer base of this iteration"
            section = records.load_record(chain, [REPLAY_KEY])[REPLAY_KEY]
            if not _same(state.get(REPLAY_KEY), section):
                return f"its {REPLAY_KEY!r} section differs from its chain's base {chain}"
            if fingerprint_digest(parameters_of(state)) != fp["xxh3"]:
                return f"its parameters differ from the fingerprint the primary's delta {b} records"
            rec = {}
            for key in ("scheduler", "rng", "buffers", "groups"):
                try:
                    rec.update(records.load_record(b, [key]))
                except NotFoundError:
                    pass  # (no scheduler)
            for key in ("scheduler", "rng"):
                if key in rec and not _same(state.get(key), rec[key]):
                    return f"its {key} state differs from the primary's delta {b}"
            for name, t in (rec.get("buffers") or {}).items():
                if not _same(state["model"].get(name), t):
                    return f"its buffer {name!r} differs from the primary's delta {b}"
            groups = state["optimizer"]["param_groups"]
            if len(groups) != len(rec["groups"]) or any(
                    not _same(g.get(k), v) for g, after in zip(groups, rec["groups"])
                    for k, v in after.items()):
                return f"its param-group settings differ from the primary's delta {b}"
            del rec
            with IncrementalReplayer.from_state(state, b, records) as rep:
                for u in range(b + 1, nxt + 1):
                    rep.apply_next(u)  # the fingerprint of ``nxt`` is checked here
                if not rep.exact:
                    return "replay from it is not exact"
        except (CkptStoreError, OSError, KeyError, TypeError, IndexError, AttributeError,
                ValueError) as e:  # (a malformed state: the follower store is not trusted more)
            return f"{type(e).__name__}: {e}"
        return None

    def close(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()


class PartRebase:
    """One part of a :class:`FollowerRebaser`'s bases as a :class:`ckptstore.ops.gc.RebaseSource`
    (a job's rank ``key``: gc copies that part of a verified base into that rank's stream; the
    verdicts, the follower store and the provenance are the whole base's)."""

    def __init__(self, bases: FollowerRebaser, key: str) -> None:
        self.bases, self.key = bases, key
        self.skipped = bases.skipped  # (the same dict: one verdict per base)

    @property
    def engine(self) -> Any:
        return self.bases.engine

    def usable(self, iteration: int) -> bool:
        return self.bases.usable(iteration)

    def manifest_extra(self, iteration: int) -> dict:
        return self.bases.manifest_extra(iteration)

    def base_manifest(self, iteration: int) -> Any:
        """The manifest of part :attr:`key` of follower base ``iteration``
        (:func:`~ckptstore.format.manifest.part_manifest`)."""
        return part_manifest(self.bases.base_manifest(iteration), self.key)
