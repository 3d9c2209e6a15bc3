"""Lightning checkpoints in a ckptstore store: a ``CheckpointIO`` plugin (and, for a job of
several processes writing a multi-rank job store, a DDP strategy that saves on every rank).

    from ckptstore.lightning import StoreCheckpointIO

    io = StoreCheckpointIO("runs/lit", retention_every=4)
    trainer = Trainer(plugins=[io], callbacks=[ModelCheckpoint(dirpath="ckpts", save_top_k=2, ...)])
    trainer.fit(model, ckpt_path=io.latest_path())     # None on an empty store: from scratch

**A Lightning checkpoint is one iteration of the store: its ``global_step``.** The path Lightning
passes (``ckpts/epoch=0-step=100.ckpt``) is only a name: it is recorded in the iteration's meta,
``{"lightning": {"name": ..., "epoch": ..., "global_step": ...}}``, and nothing is written at that
path. The checkpoint dict is saved as it is (``state_dict``, ``optimizer_states``,
``lr_schedulers``, ``loops``, ``callbacks``, ``hyper_parameters``, ...) with
:meth:`ckptstore.Store.save`: durable when ``save_checkpoint`` returns, deduplicated against the
checkpoints before it, loaded bit-exact. Values other than tensors must be JSON-like (None, bool,
int, float, str, bytes, and lists, tuples and str/int-keyed dicts of them): anything else raises
:class:`~ckptstore.errors.UnsupportedTypeError` naming its key (``state['hyper_parameters']['act']``)
before anything is written. Nothing is pickled, nothing is unpickled.

A second save at the step the store's newest iteration already holds (``save_last=True`` right
after the top-k save, a second ``ModelCheckpoint``) makes its name another name of that iteration:
its content is the first save's (the two differ only where the callbacks' states changed in
between, e.g. ``ModelCheckpoint.last_model_path`` on the very first save). A save at a step below
the newest iteration (training resumed from an older checkpoint) raises
:class:`~ckptstore.errors.IterationOrderError`: iterations only increase.

**Removals become retention.** ``remove_checkpoint`` (``ModelCheckpoint``'s top-k, a superseded
``last.ckpt``) forgets the name; an iteration no name points to any more is dropped by the next
gc run with :meth:`StoreCheckpointIO.retention_policy`: :meth:`StoreCheckpointIO.gc`, or
automatically after every ``retention_every``-th save (the store's automatic retention,
:meth:`ckptstore.Store.set_retention`, compacting only when something is removable). The names
live in ``lightning.json`` in the store's directory (rewritten atomically: temporary file, fsync,
rename, directory fsync); its ``seen`` is the newest iteration it accounts for, and every
iteration after ``seen`` is kept and named from its meta, so a crash between a save's commit and
the file's update never loses a checkpoint. The store's newest iteration is always kept, as by
any gc. ``ckptstore gc`` from the command line does not read ``lightning.json``.

**Several processes** (``strategy="ddp"``): Lightning calls ``save_checkpoint`` and
``remove_checkpoint`` on global rank 0 only (``Strategy.save_checkpoint``; DDP's checkpoint dict
is the same on every rank), so rank 0 alone opens the store for writing, a single-writer store,
and every rank reads it to resume (``latest_path()``, ``load_checkpoint``: readers, beside rank
0's writer). A multi-rank job store is refused there (ValueError): no other rank would ever join
its collective commits. A save that fails raises on rank 0; the other ranks, waiting in
Lightning's barrier after the save, fail with torch.distributed's error once rank 0's process
ends.

**Every rank writes a job store** with ``strategy=StoreDDPStrategy()`` (DDP whose
``save_checkpoint`` and ``remove_checkpoint`` call this plugin on every rank:
:class:`EveryRankCheckpoints`). The plugin then opens the store on every rank, collectively, as
a multi-rank job store over torch.distributed's default group (format-spec/format.md §22), and
each checkpoint is one global commit: visible once every rank's part is durable. DDP's state is
the same on every rank, so **rank 0's part carries the checkpoint** (the dict Lightning made on
rank 0, as with one writer) and every other rank's part is ``{"lightning": {"held_by": 0}}``;
``load_checkpoint`` on any rank (and ``store.load(t, rank=0)`` of a reader) returns rank 0's.
Only rank 0 writes ``lightning.json``; every rank keeps the same names in memory (the same calls
in the same order). Call sequence on every rank:

1. ``io = StoreCheckpointIO(path)``; ``Trainer(strategy=StoreDDPStrategy(), plugins=[io], ...)``;
2. ``trainer.fit(model, ckpt_path=io.latest_path())``: every rank reads the store (a reader) to
   resume; the first save opens the job store for writing (collective, a new epoch), each
   later save and removal is collective too;
3. the strategy's teardown closes it (collective).

A rank whose save fails (a value the store cannot hold, on rank 0) makes that save fail on
every rank: the others raise GlobalCommitAbortedError naming the rank and its error. A rank that
dies makes the others raise RankFailureError (or torch's own error from DDP's all-reduce).

``lightning`` is imported by this module, never by ``import ckptstore``.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from ..errors import IterationOrderError, NotFoundError, StoreNotFoundError, UnsupportedTypeError
from ..multirank.job_store import JobStore
from ..ops.retention import Checkpoint, Policy
from ..storage.job_log import is_job_store
from ..store import Store
from .store_ref import StoreRef

try:
    from lightning.fabric.plugins import CheckpointIO
    from lightning.pytorch.strategies import DDPStrategy
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("ckptstore.lightning needs lightning: pip install 'ckptstore[lightning]'") from e

__all__ = ["StoreCheckpointIO", "NamedCheckpoints", "EveryRankCheckpoints", "StoreDDPStrategy",
           "META_KEY", "NAMES_FILE"]

#: the key of this plugin's entry in each iteration's meta
META_KEY = "lightning"
#: the names file in the store's directory
NAMES_FILE = "lightning.json"
_FORMAT = "ckptstore.lightning"


class NamedCheckpoints(Policy):
    """The retention policy of a :class:`StoreCheckpointIO`: keep every iteration a checkpoint
    name points to, and every iteration after the newest one the names account for. Reads the
    plugin's names when a gc asks (after later saves and removals too)."""

    def __init__(self, io: StoreCheckpointIO) -> None:
        self._io = io

    def select(self, checkpoints: Sequence[Checkpoint], now_ns: int) -> frozenset[int]:
        named, seen = self._io.named_iterations(), self._io.seen
        keep = frozenset(c[0] for c in checkpoints if c[0] in named or c[0] > seen)
        if not keep and checkpoints:
            keep = frozenset({max(c[0] for c in checkpoints)})  # (gc keeps the newest anyway)
        return keep

    def __str__(self) -> str:
        return "the checkpoints Lightning has not removed"


class StoreCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` over a ckptstore store (see the module's documentation).

    ``store``: a path (opened with ``ckptstore.open(path, "a")`` when first needed, closed at
    ``teardown``) or an open writable :class:`~ckptstore.Store` or :class:`~ckptstore.JobStore`
    (left open). ``retention_every``: run the store's automatic retention with
    :meth:`retention_policy` after every that many saves (None: only when :meth:`gc` is called).
    ``commit_timeout``: how long a rank waits for the others in a job store's commit (default
    the job store's).

    With Lightning's own strategies one process writes (Lightning saves on global rank 0 only);
    other ranks never open the store unless they load, and then read it; a job store (a path
    holding one, or a JobStore) is refused with ValueError at the first save. Driven by
    :class:`StoreDDPStrategy` (:attr:`every_rank`), every rank calls it and a job of several
    ranks writes a multi-rank job store (the module's documentation)."""

    def __init__(self, store: str | os.PathLike | Store | JobStore, *,
                 retention_every: int | None = None,
                 commit_timeout: float | None = None) -> None:
        self._ref = StoreRef(store, "StoreCheckpointIO")
        self._path = self._ref.path
        if retention_every is not None and (type(retention_every) is not int or retention_every < 1):
            raise ValueError(f"retention_every must be an int >= 1 or None, not {retention_every!r}")
        self.retention_every = retention_every
        self._open_options = {} if commit_timeout is None else {"commit_timeout": commit_timeout}
        #: set by :class:`EveryRankCheckpoints`: every rank calls ``save_checkpoint`` and
        #: ``remove_checkpoint`` (False: global rank 0 alone, Lightning's own strategies)
        self.every_rank = False
        self._names: dict[str, int] | None = None  # name -> iteration (None: not read yet)
        #: the newest iteration the names account for (-1: none)
        self.seen = -1
        self._policy = NamedCheckpoints(self)

    # ---- the store and the names --------------------------------------------------------------
    def _writer(self) -> Store | JobStore:
        """The store, opened for writing if needed (on every rank at once, collectively, as a
        job store when :attr:`every_rank` and torch.distributed runs several ranks), with the
        names read. ValueError, nothing opened, for a job store without :attr:`every_rank`."""
        if self._ref.store is None:
            self._names = None  # (re)opened: read the names again
        if not self.every_rank and (isinstance(self._ref.store, JobStore) or (
                self._ref.store is None and is_job_store(self._path))):
            raise ValueError(
                f"{self._path} is a multi-rank job store: StoreCheckpointIO writes one from every "
                "rank, with a strategy that saves on every rank (strategy=ckptstore.lightning."
                "StoreDDPStrategy()); Lightning's own strategies save from global rank 0 only")
        store = self._ref.writer(distributed=self.every_rank, **self._open_options)
        if self._names is None:
            self._names, self.seen = _scan_names(store, self.names_path)
        if self.retention_every is not None and store.retention is not self._policy:
            store.set_retention(self._policy, every=self.retention_every)
        return store

    @property
    def store(self) -> Store | JobStore | None:
        """The store while it is open (None before the first use of a path, and after teardown)."""
        return self._ref.store

    @contextmanager
    def _view(self) -> Iterator[tuple[Any, dict[str, int]]]:
        """(store, names) for a read: the plugin's writer when it holds one, else a reader opened
        for the call (None and no names when there is no store yet)."""
        store = self.store
        if store is not None:  # (a JobStore handed in reads before the strategy's first save)
            if self._names is None:
                self._names, self.seen = _scan_names(store, self.names_path)
            yield store, self._names
            return
        import ckptstore
        try:
            reader = ckptstore.open(self._path, mode="r")
        except StoreNotFoundError:
            yield None, {}
            return
        try:
            yield reader, _scan_names(reader, self.names_path)[0]
        finally:
            reader.close()

    @property
    def names_path(self) -> str:
        return os.path.join(self._path, NAMES_FILE)

    def _write_names(self, store: Store | JobStore) -> None:
        """Rewrite ``lightning.json`` (a job store's rank 0 only: the other ranks keep the same
        names in memory)."""
        assert self._names is not None
        if isinstance(store, JobStore) and store.rank != 0:
            return
        doc = {"format": _FORMAT, "v": 1, "seen": self.seen, "names": self._names}
        tmp = self.names_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(doc, indent=1, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.names_path)
        fd = os.open(self._path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def named_iterations(self) -> frozenset[int]:
        """The iterations some checkpoint name points to (as this plugin's writer knows them)."""
        return frozenset((self._names or {}).values())

    def names(self) -> dict[str, int]:
        """Checkpoint name -> iteration, for every checkpoint not removed."""
        with self._view() as (_, names):
            return dict(names)

    def latest_path(self) -> str | None:
        """A name of the newest checkpoint not removed (to resume: ``fit(ckpt_path=...)``;
        ``last.ckpt``'s name when it points there), or None when there is none."""
        names = self.names()
        if not names:
            return None
        newest = max(names.values())
        at = sorted(n for n, it in names.items() if it == newest)
        return next((n for n in at if os.path.basename(n).startswith("last")), at[0])

    # ---- CheckpointIO -------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("StoreCheckpointIO.save_checkpoint takes no storage_options "
                            f"(got {storage_options!r})")
        name = _name(path)
        step = checkpoint.get("global_step")
        if type(step) is not int or step < 0:
            raise TypeError(f"Lightning checkpoint {name}: global_step must be an int >= 0, "
                            f"not {step!r}")
        store = self._writer()
        names = self._names
        assert names is not None
        latest = store.latest()
        if latest is not None and step <= latest:
            if step < latest:
                raise IterationOrderError(
                    f"Lightning checkpoint {name} is of global step {step}, below the newest "
                    f"iteration of {store.path} ({latest}): iterations only increase (training "
                    "resumed from an older checkpoint needs another store)")
            names[name] = step  # another name of the newest iteration
            self._write_names(store)
            return
        meta = {META_KEY: {"name": name, "global_step": step,
                           "epoch": checkpoint.get("epoch") if type(checkpoint.get("epoch")) is int
                           else None}}
        part = checkpoint if _holds_checkpoint(store) else {META_KEY: {"held_by": 0}}
        try:
            store.save(step, part, meta=meta)
        except UnsupportedTypeError as e:
            raise UnsupportedTypeError(
                f"Lightning checkpoint {name}: {e} (values other than tensors, e.g. "
                "hyper_parameters, must be JSON-like: None, bool, int, float, str, bytes, lists, "
                "tuples and dicts of them)") from e
        names[name] = step
        self.seen = step
        self._write_names(store)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        """The checkpoint saved as ``path`` (``weights_only`` changes nothing: nothing is
        unpickled). ``map_location``: None (CPU tensors), a device or device string, or a dict
        mapping "cpu" to one. NotFoundError for a name never saved or removed."""
        name = _name(path)
        with self._view() as (store, names):
            if name not in names:
                raise NotFoundError(f"no Lightning checkpoint named {name} in {self._path} "
                                    f"(it has {sorted(names)})")
            state = store.load(names[name], **_carrier(store))
        device = _device(map_location)
        if device is not None:
            state = _to(state, device)
        return state

    def remove_checkpoint(self, path: Any) -> None:
        """Forget the name; its iteration is dropped by the next gc unless another name points
        to it (see :meth:`retention_policy`). A name not saved is ignored."""
        name = _name(path)
        store = self._writer()
        assert self._names is not None
        if self._names.pop(name, None) is not None:
            self._write_names(store)

    def teardown(self) -> None:
        """Close the store if this plugin opened it (it is opened again when needed)."""
        if self._ref.owned and self._ref.store is not None:
            self._names = None
        self._ref.close()

    # ---- retention ----------------------------------------------------------------------------
    def retention_policy(self) -> Policy:
        """The policy keeping what Lightning has not removed (also for ``store.gc(policy=...)``,
        alone or combined with ``|``)."""
        return self._policy

    def gc(self) -> Any:
        """Drop the iterations no checkpoint name points to now (a gc of the store with
        :meth:`retention_policy`; compacts, so it costs about the bytes kept): a
        :class:`~ckptstore.ops.gc.GcReport`, a job store's JobGcReport (a job store's gc is
        collective: every rank calls it)."""
        return self._writer().gc(policy=self._policy)


class EveryRankCheckpoints:
    """A Lightning ``Strategy`` mix-in: ``save_checkpoint`` and ``remove_checkpoint`` call the
    strategy's :class:`StoreCheckpointIO` on every rank (Lightning's own call it on global rank
    0 only), marking it :attr:`~StoreCheckpointIO.every_rank`, so that every rank writes its
    part of a multi-rank job store (the module's documentation). Put it before the strategy
    class: ``class MyStrategy(EveryRankCheckpoints, DDPStrategy)``. Any other CheckpointIO is
    refused (TypeError): it would write the same file from every rank."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        _every_rank_io(self).save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        _every_rank_io(self).remove_checkpoint(filepath)


class StoreDDPStrategy(EveryRankCheckpoints, DDPStrategy):
    """``DDPStrategy`` (the same arguments and training) whose checkpoints every rank saves into
    the :class:`StoreCheckpointIO` given as ``plugins=[io]`` or ``checkpoint_io=io``: a job of
    several processes writes a multi-rank job store."""


def _every_rank_io(strategy: Any) -> StoreCheckpointIO:
    io = strategy.checkpoint_io
    if not isinstance(io, StoreCheckpointIO):
        raise TypeError(f"{type(strategy).__name__} saves checkpoints on every rank through a "
                        f"ckptstore.lightning.StoreCheckpointIO only (plugins=[StoreCheckpointIO("
                        f"path)]), not {type(io).__name__}, which would write the same file "
                        "from every rank")
    io.every_rank = True
    return io


def _holds_checkpoint(store: Store | JobStore) -> bool:
    """Whether this process's part of a save holds the checkpoint: a single store's writer, a
    job store's rank 0 (DDP's state is the same on every rank)."""
    return not isinstance(store, JobStore) or store.rank == 0


def _carrier(store: Any) -> dict[str, int]:
    """The keyword that reads the part holding the checkpoint: rank 0's of a job store."""
    return {"rank": 0} if isinstance(store, JobStore) else {}


def _name(path: Any) -> str:
    s = os.fspath(path)
    if not isinstance(s, str):
        s = os.fsdecode(s)
    return s if "://" in s else os.path.abspath(s)


def _scan_names(store: Any, names_path: str) -> tuple[dict[str, int], int]:
    """(name -> iteration, seen): ``lightning.json``'s names of iterations still in the store,
    then the meta names of every iteration after its ``seen`` (a later save of a name wins);
    ``seen`` becomes the newest iteration. A missing or unreadable file counts as empty (every
    iteration then keeps its meta name: removals are forgotten, nothing is lost)."""
    names: dict[str, int] = {}
    seen = -1
    try:
        with open(names_path, encoding="utf-8") as f:
            doc = json.load(f)
        if isinstance(doc, dict) and doc.get("format") == _FORMAT and doc.get("v") == 1:
            names = {str(k): v for k, v in doc["names"].items() if type(v) is int}
            seen = int(doc["seen"])
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        names, seen = {}, -1
    its = store.iterations()
    present = set(its)
    names = {k: v for k, v in names.items() if v in present}
    for it in its:
        if it > seen:
            name = _meta_name(store.meta(it, **_carrier(store)))
            if name is not None:
                names[name] = it
    return names, (its[-1] if its else seen)


def _meta_name(meta: Any) -> str | None:
    entry = meta.get(META_KEY) if isinstance(meta, dict) else None
    name = entry.get("name") if isinstance(entry, dict) else None
    return name if isinstance(name, str) else None


def _device(map_location: Any) -> torch.device | None:
    if map_location is None:
        return None
    if isinstance(map_location, dict):
        target = map_location.get("cpu")
        return None if target is None else torch.device(target)
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    raise TypeError(f"StoreCheckpointIO.load_checkpoint: map_location {map_location!r} is not "
                    "supported (None, a device, a device string, or a dict mapping 'cpu')")


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        out = type(value)()
        out.update((k, _to(v, device)) for k, v in value.items())
        if hasattr(value, "_metadata"):  # a state_dict's module versions
            out._metadata = value._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value
