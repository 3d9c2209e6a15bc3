"""The generations of HEAD-like objects (a store's HEADs, a job's HEADs; format-spec/remote.md
§3, §5 step 4, §8): the conditional write of the next generation, and the remote gc that keeps
the newest ones and deletes what none of them names. One implementation for both kinds."""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol, TypeVar

from ..errors import RemoteConflictError, RemoteIntegrityError
from .client import ObjectStore

log = logging.getLogger("ckptstore")

H = TypeVar("H")


class _Named(Protocol):
    def objects(self) -> set[str]: ...


def first_valid(gens: list[int], read: Callable[[int], H], what: str) -> H:
    """The newest of generations ``gens`` (newest first, at least one) that ``read`` returns
    without a RemoteIntegrityError (each damaged newer one is logged and skipped); the newest
    one's error when none is valid. ``what`` names the kind in the log."""
    first: RemoteIntegrityError | None = None
    for g in gens:
        try:
            return read(g)
        except RemoteIntegrityError as e:
            log.warning("ckptstore: %s; using an older %s", e, what)
            first = first or e
    assert first is not None, "first_valid of no generation"
    raise first


def read_newest(gens: list[int], read: Callable[[int], H], keep: int,
                what: str) -> tuple[dict[int, H | None], H | None]:
    """Read generations ``gens`` (newest first) with ``read`` until ``keep`` valid ones are
    read: every generation maps to its object (None where unread, or invalid: a
    RemoteIntegrityError is logged and the next older one is tried), with the newest valid
    one (None: none). ``what`` names the kind in the log ("HEAD", "job HEAD")."""
    heads: dict[int, H | None] = dict.fromkeys(gens)
    newest: H | None = None
    valid = 0
    for g in gens:
        try:
            h = read(g)
        except RemoteIntegrityError as e:
            log.warning("ckptstore: %s; it is ignored (an older %s is used)", e, what)
            continue
        heads[g] = h
        newest = h if newest is None else newest
        valid += 1
        if valid >= keep:
            break
    return heads, newest


def put_next_generation(store: ObjectStore, name: Callable[[int], str],
                        body: Callable[[int], bytes], generation: int,
                        reread: Callable[[], int]) -> int:
    """Write a HEAD-like object under the next generation after ``generation`` with a
    conditional create (H2), and return the generation written. Losing the race to another
    writer calls ``reread`` (it re-reads the remote, raises RemoteConflictError when the other
    writer's HEAD conflicts, and returns the highest generation now listed), then tries above it.
    Shared by a store's HEADs and a job's (format-spec/remote.md §3, §8)."""
    for _ in range(5):
        gen = generation + 1
        if store.put(name(gen), body(gen), if_absent=True):
            return gen
        generation = max(gen, reread())
    raise RemoteConflictError("write HEAD", store.where.url(name(generation + 1)),
                              "another writer keeps taking the next HEAD generation")


def collect(store: ObjectStore, heads: dict[int, Any], keep_heads: int,
            pins: Callable[[], frozenset[int]], name: Callable[[int], str],
            objects: dict[str, int], spare: Callable[[str], bool] | None = None,
            remove: Callable[[list[str]], None] | None = None) -> int:
    """Remote gc of HEAD-like objects (``heads``: generation -> decoded, None when invalid or not
    read; updated): delete all but the newest ``keep_heads`` valid ones and the valid ones
    ``pins()`` names (asked only when something would go), then every entry of ``objects``
    (listed names; updated) that no remaining one names and ``spare`` does not keep, with
    ``remove`` (default: the objects themselves; a job's removes a whole stream prefix).
    Returns how many entries went."""
    gens = sorted(heads, reverse=True)
    keep = [g for g in gens if heads[g] is not None][:keep_heads]
    pinned = pins() if len(gens) > len(keep) else frozenset()
    keep += [g for g in gens if g in pinned and g not in keep and heads[g] is not None]
    drop = [g for g in gens if g not in keep]
    if drop:
        store.delete([name(g) for g in drop])
        for g in drop:
            del heads[g]
    named: set[str] = set()
    for g in keep:
        h: _Named = heads[g]
        named |= h.objects()
    stale = sorted(n for n in objects if n not in named and not (spare and spare(n)))
    if stale:
        (remove or store.delete)(stale)
        for n in stale:
            del objects[n]
    return len(stale)
