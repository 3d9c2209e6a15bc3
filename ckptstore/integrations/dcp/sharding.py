"""Where each shard of a DCP checkpoint is stored, and whether the shards tile their tensors
(format-spec/dcp.md §3-§5): :func:`layout_of` and the coverage checks, pure functions of the
stored metadata."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import TYPE_CHECKING, Any, Sequence

from ...errors import DCPError, ShardCoverageError
from .metadata import DTYPE_NAMES, BadMetadata, decode_metadata, need

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """One stored shard (DCP chunk) of a tensor: its box in the global tensor, the rank stream
    whose state holds it (0 in a single-process store; None: the metadata names no storage for
    it) and its store key there, and its bytes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int | None
    key: str | None
    nbytes: int


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """A tensor of a DCP checkpoint: global shape, dtype (format.md's name), its shards in
    offset order, and why they do not tile it (None when they do)."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    shards: tuple[ShardLayout, ...]
    problem: ShardCoverageError | None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)


@dataclasses.dataclass(frozen=True)
class ValueLayout:
    """A non-tensor value of a DCP checkpoint and the rank whose state holds it."""

    fqn: str
    rank: int | None
    key: str | None


@dataclasses.dataclass(frozen=True)
class Layout:
    """The sharded layout of one DCP checkpoint (:func:`layout`)."""

    path: str
    iteration: int
    world_size: int
    metadata_rank: int
    tensors: tuple[TensorLayout, ...]
    values: tuple[ValueLayout, ...]

    @property
    def problems(self) -> list[ShardCoverageError]:
        return [t.problem for t in self.tensors if t.problem is not None]


def chunks_of(md: Metadata) -> tuple[dict[Any, tuple[tuple[int, ...], tuple[int, ...]]],
                                      dict[str, str]]:
    """The stored chunk (offsets, sizes) of every tensor item, and every key's kind."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    chunks: dict[Any, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    kinds: dict[str, str] = {}
    for fqn, v in md.state_dict_metadata.items():
        if isinstance(v, TensorStorageMetadata):
            kinds[fqn] = "tensor"
            for c in v.chunks:
                chunks[MetadataIndex(fqn, c.offsets)] = (tuple(int(n) for n in c.offsets),
                                                         tuple(int(n) for n in c.sizes))
        else:
            kinds[fqn] = "bytes"
    return chunks, kinds


_ShardBox = tuple[tuple[int, ...], tuple[int, ...], int]   # offsets, sizes, rank


def _intersection(a: _ShardBox, b: _ShardBox) -> tuple[list[int], list[int]] | None:
    lo = [max(x, y) for x, y in zip(a[0], b[0])]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1])]
    if all(lh < hh for lh, hh in zip(lo, hi)):
        return lo, [hh - lh for lh, hh in zip(lo, hi)]
    return None


def _gap(size: tuple[int, ...], boxes: list[_ShardBox]) -> tuple[list[int], list[int]]:
    """A box of the tensor that no shard covers (the caller knows one exists): the first
    uncovered cell of the grid the shards' edges make, grown along each dimension while the
    grown box stays uncovered."""
    nd = len(size)
    edges = [sorted({0, size[d]} | {b[0][d] for b in boxes} | {b[0][d] + b[1][d] for b in boxes})
             for d in range(nd)]

    def covered(cell: Sequence[int]) -> bool:      # cell: one grid index per dimension
        point = [edges[d][cell[d]] for d in range(nd)]
        return any(all(o <= p < o + n for p, o, n in zip(point, b[0], b[1])) for b in boxes)

    def free(lo: list[int], hi: list[int]) -> bool:  # grid cells lo..hi (exclusive) all uncovered
        return not any(covered(c) for c in itertools.product(*[range(a, z) for a, z in zip(lo, hi)]))

    first = next(c for c in itertools.product(*[range(len(e) - 1) for e in edges])
                 if not covered(c))
    lo, hi = list(first), [c + 1 for c in first]
    for d in range(nd):
        while hi[d] < len(edges[d]) - 1 and free(lo[:d] + [hi[d]] + lo[d + 1:],
                                                  hi[:d] + [hi[d] + 1] + hi[d + 1:]):
            hi[d] += 1
    offsets = [edges[d][lo[d]] for d in range(nd)]
    return offsets, [edges[d][hi[d]] - offsets[d] for d in range(nd)]


def coverage_problems(md: Metadata, storage: dict[Any, tuple[int, str]],
                      where: str) -> dict[str, ShardCoverageError]:
    """For each tensor whose stored shards (its chunks that some rank's state holds) do not
    tile it exactly: the error naming the first overlap (both shards and their ranks) or a
    box no shard covers. Empty shards are ignored."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    out: dict[str, ShardCoverageError] = {}
    for fqn, v in md.state_dict_metadata.items():
        if not isinstance(v, TensorStorageMetadata):
            continue
        size = tuple(int(n) for n in v.size)
        boxes: list[_ShardBox] = []
        for c in v.chunks:
            held = storage.get(MetadataIndex(fqn, c.offsets))
            if held is not None and math.prod(c.sizes) > 0:
                boxes.append((tuple(int(n) for n in c.offsets), tuple(int(n) for n in c.sizes),
                              held[0]))
        total = math.prod(size)
        nd = len(size)
        # overlaps: a sweep along the dimension with the most distinct shard offsets
        d = max(range(nd), key=lambda k: len({b[0][k] for b in boxes})) if nd else None
        active: list[_ShardBox] = []
        overlap = None
        for b in sorted(boxes, key=lambda b: b[0][d] if d is not None else 0):
            if d is not None:
                active = [a for a in active if a[0][d] + a[1][d] > b[0][d]]
            for a in active:
                box = _intersection(a, b)
                if box is not None:
                    overlap = (a, b, box)
                    break
            if overlap is not None:
                break
            active.append(b)
        name = f"{where}: tensor {fqn!r} of shape {list(size)}"
        if overlap is not None:
            a, b, (o, n) = overlap
            out[fqn] = ShardCoverageError(
                f"{name}: its shards at offsets {list(a[0])} (sizes {list(a[1])}, rank {a[2]}) "
                f"and at offsets {list(b[0])} (sizes {list(b[1])}, rank {b[2]}) overlap in the "
                f"box at offsets {o} of sizes {n}", fqn=fqn, offsets=tuple(o), sizes=tuple(n),
                ranks=(a[2], b[2]))
            continue
        have = sum(math.prod(b[1]) for b in boxes)
        if have < total:
            o, n = _gap(size, boxes)
            out[fqn] = ShardCoverageError(
                f"{name}: no shard holds the box at offsets {o} of sizes {n} (its "
                f"{len(boxes)} stored shards hold {have} of its {total} elements)",
                fqn=fqn, offsets=tuple(o), sizes=tuple(n))
    return out


def decode_storage(metadata: Any, world_size: int, metadata_rank: int
                   ) -> tuple[Metadata, dict[Any, tuple[int, str]]]:
    """DCP's Metadata and the storage map (MetadataIndex -> (rank, store key)) of encoded
    metadata held by rank ``metadata_rank`` of an iteration of ``world_size`` ranks. Raises
    BadMetadata."""
    md, rows = decode_metadata(metadata)
    storage = {index: (metadata_rank if r is None else r, key) for index, (r, key) in rows.items()}
    bad = sorted({r for r, _ in storage.values() if r >= world_size})
    need(not bad, f"the metadata names ranks {bad}, the iteration has {world_size}")
    return md, storage


def layout_of(metadata: Any, world_size: int, *, metadata_rank: int = 0, path: str = "",
              iteration: int = 0) -> Layout:
    """The :class:`Layout` of a DCP checkpoint from its encoded metadata (format-spec/dcp.md
    §1's METADATA, as stored in rank ``metadata_rank``'s state of an iteration of
    ``world_size`` ranks): a pure function, no I/O. Raises DCPError when the metadata does not
    decode; shards that do not tile a tensor are reported in the layout (``problems``), not
    raised."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    where = f"{path}: iteration {iteration}" if path else f"iteration {iteration}"
    try:
        md, storage = decode_storage(metadata, world_size, metadata_rank)
    except BadMetadata as e:
        raise DCPError(f"{where}: the DCP metadata does not decode: {e}") from None
    coverage = coverage_problems(md, storage, where)
    tensors, values = [], []
    for fqn, v in md.state_dict_metadata.items():
        if not isinstance(v, TensorStorageMetadata):
            rank, key = storage.get(MetadataIndex(fqn), (None, None))
            values.append(ValueLayout(fqn, rank, key))
            continue
        itemsize = v.properties.dtype.itemsize
        shards = []
        for c in sorted(v.chunks, key=lambda c: tuple(c.offsets)):
            rank, key = storage.get(MetadataIndex(fqn, c.offsets), (None, None))
            shards.append(ShardLayout(tuple(int(n) for n in c.offsets),
                                      tuple(int(n) for n in c.sizes), rank, key,
                                      math.prod(c.sizes) * itemsize))
        tensors.append(TensorLayout(fqn, DTYPE_NAMES[v.properties.dtype],
                                    tuple(int(n) for n in v.size), tuple(shards),
                                    coverage.get(fqn)))
    return Layout(path, iteration, world_size, metadata_rank, tuple(tensors), tuple(values))
