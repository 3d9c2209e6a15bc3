"""How a job's state at one iteration is made from its ranks' states (:meth:`JobStore.load`
without ``rank``, :meth:`JobStore.replay`): pure functions of the parts, no I/O of their own.

1. ``first`` = the part of this process's rank (rank 0's for a reader, or a rank beyond the
   iteration's world size) is looked at;
2. data-parallel parts (:mod:`ckptstore.replay.partition`): every part, merged;
3. a DTensor state saved with ``save`` (:mod:`.dtensor_state`): every part, each DTensor's tensor
   assembled whole;
4. sharded Checkpointer parts (:mod:`ckptstore.replay.shards`): every part, assembled;
5. anything else: ``first`` itself (one rank's own state; a reader of several ranks' states must
   say which: ValueError, :meth:`JobStore.load`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..replay.partition import merge_parts, partition_of
from ..replay.shards import assemble_parts, shards_of
from ..store import select_keys
from .dtensor_state import assemble, section_of


def combine(part: Callable[[int], Any], world: int, mine: int | None, iteration: int,
            keys: Sequence[Any] | None, which: Callable[[], object]) -> Any:
    """The job's state at ``iteration`` from its ``world`` ranks' states (``part(r)``: rank r's,
    asked for only when needed, at most once each); ``mine``: this process's rank when it took
    part in the iteration, else None. ``keys``: only these top-level keys (NotFoundError for one
    the state lacks). ``which()`` raises the error for step 5 without a rank."""
    first = part(mine if mine is not None else 0)
    local = mine or 0

    def every() -> list[Any]:
        return [first if r == local else part(r) for r in range(world)]

    if partition_of(first) is not None:
        return select_keys(merge_parts(every(), local), keys, iteration)
    if section_of(first) is not None:
        return select_keys(assemble(every(), local, iteration), keys, iteration)
    if shards_of(first) is not None:
        return select_keys(assemble_parts(every(), local), keys, iteration)
    if mine is None and world > 1:
        which()
    return select_keys(first, keys, iteration)
