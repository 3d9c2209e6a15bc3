"""Importing: a source read by :mod:`.sources`, saved as one iteration of a store, one atomic
commit per checkpoint (:func:`import_checkpoint`, :func:`import_dir`)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from ...errors import ImportSourceError, IterationOrderError, UnsupportedTypeError
from ...store import SaveStats, Store
from .sources import LoadedSource, iteration_from_name, load_source, scan_dir, some_of


@dataclass(frozen=True)
class ImportResult:
    """One committed import: the source, its kind and what the save did (``stats``)."""

    iteration: int
    source: str
    kind: str
    stats: SaveStats
    skipped: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class DirImportReport:
    """What :func:`import_dir` did: the imports in iteration order and the directory entries it
    left out (entry, why). ``logical_bytes`` is the state the imports hold, ``written_bytes``
    what they wrote: the difference is what dedup (and compression) saved."""

    directory: str
    imported: tuple[ImportResult, ...]
    skipped: tuple[tuple[str, str], ...]
    seconds: float

    @property
    def logical_bytes(self) -> int:
        return sum(r.stats.logical_bytes for r in self.imported)

    @property
    def written_bytes(self) -> int:
        return sum(r.stats.written_bytes for r in self.imported)

    @property
    def dedup_bytes(self) -> int:
        """Tensor bytes found already stored (earlier iterations, or twice in one) and not
        written again."""
        return sum(r.stats.dedup_bytes for r in self.imported)

    @property
    def saved_bytes(self) -> int:
        """``logical_bytes - written_bytes`` (never below 0)."""
        return max(0, self.logical_bytes - self.written_bytes)


def _writer(store: Any) -> Store:
    if not isinstance(store, Store):
        raise TypeError(f"import needs a ckptstore.Store opened with mode \"a\", not {store!r}")
    return store


def _check_order(store: Store, iteration: int, source: str) -> None:
    if type(iteration) is not int or not 0 <= iteration < 1 << 63:
        raise ValueError(f"iteration must be a non-negative int, not {iteration!r}")
    tail = store.tail()
    if tail is not None and iteration <= tail:
        raise IterationOrderError(f"cannot import {source} as iteration {iteration}: not after "
                                  f"the latest iteration {tail} of {store.path} (nothing written)")


def import_checkpoint(store: Store, iteration: int | None, source: str | os.PathLike | LoadedSource,
                      *, meta: dict | None = None, kind: str | None = None,
                      progress: Callable[[int], None] | None = None) -> ImportResult:
    """Import one checkpoint as ``iteration`` of ``store`` (a writer), committed atomically.

    ``source``: a path (read with :func:`load_source`, ``kind`` detected when None) or a
    :class:`LoadedSource` already read. ``iteration`` None: the one its name implies
    (``checkpoint-500`` -> 500; ImportSourceError when the name holds no number). ``meta``: a
    dict of JSON-like values stored with it, plus ``meta["import"]`` (package docstring).
    Raises ImportSourceError, IterationOrderError (before reading the source) or what
    :meth:`Store.save` raises; the store is unchanged on any failure."""
    st = _writer(store)
    path = source.path if isinstance(source, LoadedSource) else os.fspath(source)
    if iteration is None:
        iteration = iteration_from_name(path)
        if iteration is None:
            raise ImportSourceError(f"{path}: no iteration given and none in its name")
    _check_order(st, iteration, path)
    if meta is not None and type(meta) is not dict:
        raise UnsupportedTypeError(f"meta must be a dict, not {type(meta).__name__}")
    loaded = source if isinstance(source, LoadedSource) else load_source(path, kind)
    stats = st.save(iteration, loaded.state, meta={**(meta or {}), "import": loaded.info},
                    progress=progress)
    return ImportResult(iteration, loaded.path, loaded.kind, stats, loaded.skipped)


def import_dir(store: Store, directory: str | os.PathLike, *, meta: dict | None = None,
               on_import: Callable[[ImportResult], None] | None = None,
               progress: Callable[[int], None] | None = None) -> DirImportReport:
    """Import every checkpoint :func:`scan_dir` finds in ``directory``, in increasing iteration
    order, one commit each; tensors unchanged from an earlier iteration (or already in the store)
    are stored once. Everything is checked first (kinds, names, duplicate iterations, order
    against the store, DCP and model files): a problem there raises before anything is written.
    ``on_import`` is called after each commit. ImportSourceError when nothing is found."""
    st = _writer(store)
    d = os.fspath(directory)
    t0 = time.perf_counter()
    found, skipped = scan_dir(d)
    if not found:
        raise ImportSourceError(f"{d}: no recognised checkpoint (checkpoint-N directories, DCP "
                                "directories, torch.save or safetensors files with a number in "
                                "the name)" + (f"; left out: {some_of([s[0] for s in skipped])}"
                                               if skipped else ""))
    _check_order(st, found[0][0], found[0][1])
    done: list[ImportResult] = []
    for it, p, kind in found:
        r = import_checkpoint(st, it, p, meta=meta, kind=kind, progress=progress)
        done.append(r)
        if on_import is not None:
            on_import(r)
    return DirImportReport(d, tuple(done), tuple(skipped), time.perf_counter() - t0)
