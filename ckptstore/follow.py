"""The shadow follower: a separate process that keeps a live replica of a training run and writes
its bases, so the trainer writes only deltas and a restore replays at most ``every`` of them.

    ckptstore follow runs/gpt --every 100          # or, in Python:

    from ckptstore.follow import Follower
    with Follower("runs/gpt", every=100) as f:
        f.run()                                     # until f.stop() (another thread, a signal)

and in the trainer ``Checkpointer(store, model, opt, policy="every-iteration", base_every=None)``:
base 0 (and a base after a chain restart) only, then deltas (the default policy, "auto", plans
its own bases or snapshots).

The follower opens the primary store read-only and tails it: every committed delta is replayed
onto an in-memory replica of model + optimizer state (:class:`ckptstore.replay.IncrementalReplayer`,
the same engine and bits as ``store.load``), and at every iteration that is a multiple of
``every`` the replica is written as a base snapshot into the follower store, ``<primary>/follower/``
(a single-writer store of its own; the primary is never written). Each follower base carries in
its meta the identity of the primary commit it reproduces (the primary's store id, the iteration,
the commit's manifest digest, and its chain's base and that base's digest), so it is never used
for another history. ``Store.load(t)`` then starts from the newest follower base ``b`` with
``base_of(t) < b <= t`` that matches (:mod:`ckptstore.replay.follower`). Normative:
format-spec/follower.md.

A follower killed at any point resumes: it starts again from its own newest base of the current
chain (or the primary's base) and replays from there. Follower bases of a lossy replica (lossy
codec not applied, training on another device) are never written.

The primary may be a multi-rank job store (``ckptstore.open(job, "a", process_group=pg)``): the
follower then opens it as a reader without a group, its replica holds every rank's part of the
state, each advanced in that rank's records (:class:`~ckptstore.multirank.job_follower.JobReplica`),
and a follower base holds the parts under ``"rank<r>"`` keys, named by the job's store id and job
digests (format-spec/follower.md §7). ``JobStore.load`` then starts each rank's part from it, at
any world size, with or without a group.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from .errors import (CkptStoreError, DeltaChainError, FollowerError, FollowerMismatchError,
                     FollowerWarning, NotFoundError)
from .multirank.job_follower import JobPrimary, JobReplica
from .multirank.job_store import JobStore
from .ops.retention import KeepLast
from .replay.follower import FOLLOWER_KEY, Identity, follower_path, identity_of, mismatch
from .replay.replayer import IncrementalReplayer
from .replay.report import ReplayReport
from .storage.fileops import FileOps
from .storage.job_log import is_job_store, refuse_job_part
from .store import Store

__all__ = ["Follower", "FollowerStats", "follower_path"]

log = logging.getLogger("ckptstore")


@dataclass
class FollowerStats:
    """What a follower has done since it started."""

    #: deltas replayed onto the replica
    applied: int = 0
    #: follower bases written (iterations)
    bases: list[int] = field(default_factory=list)
    #: times the replica was (re)built: from a follower base or a primary base (chain restarts,
    #: resumes, deltas removed by the primary's gc)
    starts: int = 0
    #: where the replica was last built from: ("follower" | "primary", iteration)
    started_from: tuple[str, int] | None = None
    #: the primary's newest committed iteration at the last poll
    primary_latest: int | None = None


class Replica(Protocol):
    """What the follower advances: :class:`~ckptstore.replay.IncrementalReplayer` (a single
    store) or :class:`~ckptstore.multirank.job_follower.JobReplica` (a job: one per rank)."""

    @property
    def iteration(self) -> int: ...

    @property
    def exact(self) -> bool: ...

    @property
    def report(self) -> ReplayReport: ...

    def apply_next(self, iteration: int) -> None: ...

    def advance(self, last: int, threads: int = 1) -> None: ...

    def state(self, clone: bool = True) -> dict: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Followed:
    """The primary a follower follows, open read-only (``reader``: a :class:`ckptstore.Store`,
    or a job store as :class:`~ckptstore.multirank.job_follower.JobPrimary`), and how replicas
    of it are made: ``at_base(b)`` from its base snapshot ``b``, ``from_state(state, b)`` from a
    follower base's state of iteration ``b``."""

    reader: Any
    at_base: Callable[[int], Replica]
    from_state: Callable[[Any, int], Replica]

    @classmethod
    def open(cls, path: str) -> "Followed":
        """The store or job store at ``path`` (StoreNotFoundError: none)."""
        if is_job_store(path):
            job = JobStore(path, "r")
            return cls(JobPrimary(job), lambda b: JobReplica.start(job, b),
                       lambda state, b: JobReplica.from_state(job, state, b))
        store = Store(path, "r")
        return cls(store, lambda b: IncrementalReplayer(store, b),
                   lambda state, b: IncrementalReplayer.from_state(state, b, store))


class Follower:
    """Follow the primary store at ``primary``: replay every committed delta onto a replica and
    write a base into ``<primary>/follower/`` at every multiple of ``every``. The primary is a
    single-writer store or a multi-rank job store (whose replica holds every rank's part, each
    replayed in its rank's records: format-spec/follower.md §7).

    ``keep``: keep only the newest ``keep`` follower bases (a gc of the follower store every
    ``keep`` bases; None keeps them all, as the primary keeps its own bases). ``poll_s``: how
    long :meth:`run` sleeps when nothing new is committed. ``wait``: an empty primary (the trainer
    has not committed base 0 yet) is waited for instead of raising FollowerError. ``threads``:
    threads of the replay kernels when several deltas are replayed at once (catching up).

    ``file_ops``: the follower store's file operations (tests inject faults and crashes).

    Raises StoreNotFoundError (no primary), JobStreamError (a part of a job store),
    FollowerMismatchError (the follower store holds bases of another primary or history; remove
    it to start over), StoreLockedError (another follower runs)."""

    def __init__(self, primary: str | os.PathLike, every: int = 100, *, keep: int | None = None,
                 poll_s: float = 0.1, wait: bool = False, threads: int = 1,
                 file_ops: FileOps | None = None) -> None:
        if type(every) is not int or every < 1:
            raise ValueError(f"every must be a positive int (iterations between follower bases), "
                             f"not {every!r}")
        if keep is not None and (type(keep) is not int or keep < 1):
            raise ValueError(f"keep must be a positive int or None, not {keep!r}")
        if isinstance(poll_s, bool) or not isinstance(poll_s, (int, float)) or not poll_s > 0:
            raise ValueError(f"poll_s must be a positive number, not {poll_s!r}")
        if type(threads) is not int or threads < 1:
            raise ValueError(f"threads must be a positive int, not {threads!r}")
        #: threads of a replay window's kernels (catching up several deltas at once)
        self.threads = threads
        self.primary_path = os.fspath(primary)
        self.every = every
        self.poll_s = float(poll_s)
        self.wait = wait
        self.path = follower_path(self.primary_path)
        self.stats = FollowerStats()
        self._stop = threading.Event()
        self._replica: Replica | None = None
        self._chain_base: int | None = None
        self._inexact_warned = False
        self._futures: list[Future] = []
        # its follower store would be written inside the job store, beside the ranks' streams
        refuse_job_part(self.primary_path, "following")
        self._followed = Followed.open(self.primary_path)
        #: the primary, read-only (a Store; a job store as a JobPrimary)
        self.primary = self._followed.reader
        self.store: Store | None = None
        try:
            self.store = Store(self.path, "a", max_inflight=1, file_ops=file_ops,
                               retention=KeepLast(keep) if keep is not None else None,
                               retention_every=keep if keep is not None else 1)
            self._check_owner()
            #: the newest follower base written (or found at start)
            self._newest: int | None = self.store.latest()
        except BaseException:
            self.close()
            raise

    # ---- state ----------------------------------------------------------------------------
    @property
    def iteration(self) -> int | None:
        """The primary iteration the replica holds (None before the first step)."""
        return None if self._replica is None else self._replica.iteration

    def _writable(self) -> Store:
        if self.store is None or self.store.closed:
            raise FollowerError(f"the follower of {self.primary_path} is closed")
        return self.store

    def _check_owner(self) -> None:
        """Refuse a follower store that holds anything but bases of this primary's history."""
        store = self._writable()
        sid = self.primary.header.store_id.hex()
        for b in store.iterations():
            ident = Identity.from_meta(store.meta(b)) if store.kind(b) == "snapshot" else None
            why = None
            if ident is None:
                why = f"iteration {b} is not a follower base (no {FOLLOWER_KEY!r} identity)"
            elif ident.primary != sid:
                why = f"its base {b} reproduces another primary store (store id {ident.primary})"
            elif b > (self.primary.latest() or -1):
                why = f"its base {b} is newer than anything the primary holds (another history)"
            elif self._committed(b):
                why = mismatch(self.primary, ident, b)
            # (else removed by the primary's gc: ignored by readers, harmless)
            if why is not None:
                raise FollowerMismatchError(
                    f"follower store {self.path} does not belong to {self.primary_path}: {why}; "
                    "remove it to start a follower over")

    def _committed(self, iteration: int) -> bool:
        try:
            self.primary.info(iteration)
        except NotFoundError:
            return False
        return True

    def close(self) -> None:
        """Wait for the bases being written, then release both stores. Idempotent."""
        err: BaseException | None = None
        if self._replica is not None:
            self._replica.close()
            self._replica = None
        if self.store is not None:
            try:
                self.store.close()
            except BaseException as e:  # noqa: BLE001 - re-raised once the primary is released
                err = e
        self.primary.close()
        if err is not None:
            raise err

    def __enter__(self) -> "Follower":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stop(self) -> None:
        """Make :meth:`run` (and a :meth:`step_once` in progress) return soon; thread- and
        signal-safe."""
        self._stop.set()

    # ---- following --------------------------------------------------------------------------
    def run(self, until: int | None = None, timeout: float | None = None) -> int | None:
        """Follow until :meth:`stop`, until the replica reaches iteration ``until``, or for
        ``timeout`` seconds; then wait for the bases being written. Returns :attr:`iteration`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._stop.is_set():
            n = self.step_once()
            if until is not None and self.iteration is not None and self.iteration >= until:
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
            if n == 0:
                self._stop.wait(self.poll_s)
        self.flush()
        return self.iteration

    def flush(self) -> None:
        """Wait until every follower base written so far is durable."""
        self._writable().flush()
        self._reap()

    def step_once(self, max_deltas: int | None = None) -> int:
        """Catch up once: replay every delta the primary has committed since the last call, or
        at most ``max_deltas`` of them (writing bases as due). Returns how many iterations the
        replica advanced (0: nothing new). Raises FollowerError when there is nothing to follow
        or a delta cannot be replayed (the message names the store and the iteration)."""
        self._writable()
        self._reap()
        latest = self.primary.latest()
        self.stats.primary_latest = latest
        if latest is None:
            if self.wait:
                return 0
            raise FollowerError(f"{self.primary_path} holds no committed iteration (no base "
                                "snapshot): nothing to follow yet; start the trainer first "
                                "(its Checkpointer writes base 0), or wait for it")
        before = self.iteration
        if self._replica is None or self._replica.iteration > latest:
            self._start(latest)
        n = 0
        while not self._stop.is_set() and (max_deltas is None or n < max_deltas):
            replica = self._replica
            assert replica is not None
            r = replica.iteration
            if r >= latest:
                break
            # the next run of deltas of this chain, up to the next base (or max_deltas)
            target = min(latest, (r // self.every + 1) * self.every,
                         latest if max_deltas is None else r + max_deltas - n)
            end, stop = target, None
            for it in range(r + 1, target + 1):
                try:
                    kind = self.primary.kind(it)
                    base = self.primary.base_of(it)
                except NotFoundError:
                    kind, base = "missing", None
                if kind != "delta" or base != self._chain_base:
                    end, stop = it - 1, (it, kind)
                    break
            if end > r:
                try:
                    if end == r + 1:
                        replica.apply_next(end)
                    else:  # records read ahead, steady deltas in tiled windows
                        replica.advance(end, self.threads)
                except CkptStoreError as e:
                    failed = replica.iteration + 1
                    self._drop_replica()
                    raise FollowerError(f"{self.primary_path}: delta {failed} cannot be replayed: "
                                        f"{e}") from e
                self.stats.applied += end - r
                n += end - r
                if end % self.every == 0:
                    self._write_base(end)
            if stop is not None:
                it, kind = stop
                if kind == "snapshot":  # a chain restart: the primary's own base
                    self._start_primary(it)
                    n += 1
                else:  # removed by the primary's gc, or another chain: the newest chain
                    self._start(latest)
        if before is None and self.iteration is not None:
            n = max(n, 1)  # the first start counts as progress
        return n

    def _drop_replica(self) -> None:
        if self._replica is not None:
            self._replica.close()
            self._replica = None

    def _start(self, latest: int) -> None:
        """(Re)build the replica for the chain of ``latest``: from this follower's newest base of
        that chain when one matches and reads, else from the chain's primary base."""
        self._drop_replica()
        pb = self.primary.base_of(latest)
        store = self._writable()
        for b in reversed([b for b in store.iterations() if pb < b <= latest]):
            try:
                ident = Identity.from_meta(store.meta(b))
                why = "no follower identity" if ident is None else mismatch(self.primary, ident, b)
                if why is not None:
                    raise FollowerError(why)
                replica = self._followed.from_state(store.load(b), b)
            except CkptStoreError as e:
                warnings.warn(f"ckptstore follow: follower base {b} in {self.path} is not used "
                              f"({e}); starting from an older base", FollowerWarning, stacklevel=2)
                continue
            self._replica, self._chain_base = replica, pb
            self.stats.starts += 1
            self.stats.started_from = ("follower", b)
            return
        self._start_primary(pb)

    def _start_primary(self, base: int) -> None:
        """Build the replica from the primary's base snapshot ``base``."""
        self._drop_replica()
        try:
            replica = self._followed.at_base(base)
        except DeltaChainError as e:
            raise FollowerError(f"{self.primary_path}: base snapshot {base} cannot start a replica "
                                f"(not a Checkpointer store?): {e}") from e
        except CkptStoreError as e:
            raise FollowerError(f"{self.primary_path}: base snapshot {base} cannot be read: {e}") from e
        self._replica, self._chain_base = replica, base
        self.stats.starts += 1
        self.stats.started_from = ("primary", base)
        if not replica.exact:
            self._warn_inexact()

    def _warn_inexact(self) -> None:
        if not self._inexact_warned:
            self._inexact_warned = True
            log.warning("ckptstore follow: the chain of %s is not exactly replayable (%s): no "
                        "follower bases are written for it", self.primary_path,
                        "; ".join(self._replica.report.reasons) if self._replica else "")

    def _write_base(self, it: int) -> None:
        """Write the replica (the state of primary iteration ``it``) as a follower base."""
        replica = self._replica
        assert replica is not None
        if not replica.exact:
            self._warn_inexact()
            return
        store = self._writable()
        if self._newest is not None and self._newest >= it:
            return  # written before a restart (it reproduces the same commit: checked at start)
        ident = identity_of(self.primary, it)
        fut = store.save_async(it, replica.state(clone=False), meta={FOLLOWER_KEY: ident.to_meta()})
        self._newest = it
        self._futures.append(fut)
        self.stats.bases.append(it)
        log.debug("ckptstore follow: base %d of %s written", it, self.primary_path)

    def _reap(self) -> None:
        """Raise a failed base write (a full disk...) once."""
        done = [f for f in self._futures if f.done()]
        self._futures = [f for f in self._futures if not f.done()]
        for f in done:
            f.result()
