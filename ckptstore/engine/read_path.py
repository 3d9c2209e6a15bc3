"""The read path: commit -> manifest -> trees -> chunks -> the state, verified on the way.

Every byte returned was checked: the manifest against the commit's digest, each tree against its
root, each chunk against its address (raw chunks are read straight into the destination array and
verified in place; nothing is copied twice). :func:`read_ranges` reads byte ranges of stored
tensors, touching only the chunks that overlap them (ckptstore.dcp's partial reads).
"""

from __future__ import annotations

import math

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..errors import DamagedCheckpointError, FormatError, NotFoundError, StoreIOError
from ..format import records as rec
from ..format.chunk import (CHUNK_HEADER_SIZE, Codec, address_of, decode_chunk_data,
                           decode_chunk_header, max_raw_length)
from ..format.manifest import Manifest, TensorEntry, decode_committed_manifest
from ..format.state import leaf_indices, leaf_paths, top_level_items, unflatten
from ..format.tree import Tree, decode_tree, tree_root
from ..storage.index import ChunkRef, CommitEntry, Index
from ..storage.log import Log
from ..storage.memory import MIN_BYTES as HUGE_MIN_BYTES, advise_huge_buffer
from ..storage.segments import Loc
from ..tensors.inplace import destinations
from ..tensors import allocate, finish, into_view

_HEAD = rec.HEADER_SIZE + CHUNK_HEADER_SIZE


def read_manifest(log: Log, entry: CommitEntry) -> Manifest:
    c = entry.commit
    loc = Loc(c.manifest_seq, c.manifest_offset, c.manifest_length)
    try:
        return decode_committed_manifest(log.read_payload(loc), c.manifest_digest, c.iteration)
    except (FormatError, StoreIOError, FileNotFoundError) as e:
        raise DamagedCheckpointError(
            f"iteration {c.iteration}: manifest at {log.layout.segment_path(loc.seq)} offset "
            f"{loc.offset} is unreadable: {e}") from e


def read_tree(log: Log, index: Index, entry: TensorEntry) -> Tree:
    loc = index.get_tree(entry.root)
    if loc is None:
        raise FormatError(f"tree {entry.root.hex()} is not in the store")
    tree = decode_tree(log.read_payload(loc))
    if tree.root != entry.root or tree.nbytes != entry.nbytes:
        raise FormatError(f"tree {entry.root.hex()} does not match the manifest entry")
    return tree


def chunk_spans_bounded(log: Log, index: Index, entry: TensorEntry) -> list[tuple[int, int, bytes]]:
    """The (start, end, address) spans of a tensor's verified tree, each checked against the
    indexed CHUNK record that must hold it: that record exists and its length can decode to the
    span (:func:`max_raw_length`). A manifest and tree that claim more bytes than the store's
    chunk records hold are refused here, before the tensor is allocated. Raises FormatError."""
    tree = read_tree(log, index, entry)
    spans = list(tree.chunk_spans())
    for start, end, addr in spans:
        ref = index.get_chunk(addr)
        if ref is None:
            raise FormatError(f"chunk {addr.hex()} is not in the store")
        if end - start > max(max_raw_length(r.codec, r.loc.length)
                             for r in [ref, *index.chunk_alternatives(addr)]):
            raise FormatError(
                f"bytes {start}-{end}: the record of chunk {addr.hex()} at "
                f"{log.layout.segment_path(ref.loc.seq)} offset {ref.loc.offset} "
                f"({ref.loc.length} payload bytes) cannot hold {end - start} bytes")
    return spans


def read_chunk_into(log: Log, index: Index, address: bytes, dest: memoryview) -> None:
    """Fill ``dest`` with the verified bytes of chunk ``address``. Raises FormatError (for the
    indexed record, after every earlier record of the chunk failed as well)."""
    ref = index.get_chunk(address)
    if ref is None:
        raise FormatError(f"chunk {address.hex()} is not in the store")
    try:
        _read_chunk_at(log, ref, address, dest)
    except FormatError:
        for older in index.chunk_alternatives(address):
            try:
                _read_chunk_at(log, older, address, dest)
                return
            except (FormatError, OSError):
                continue
        raise


def _read_chunk_at(log: Log, ref: ChunkRef, address: bytes, dest: memoryview) -> None:
    f = log.file(ref.loc.seq)
    try:
        if ref.codec == Codec.RAW and ref.loc.length == CHUNK_HEADER_SIZE + len(dest):
            head = bytearray(_HEAD)
            got = f.readinto(ref.loc.offset, [memoryview(head), dest])
            if got < _HEAD + len(dest):
                raise FormatError("chunk record truncated")
            header = rec.decode_header(head)
            if header.type != rec.RecordType.CHUNK or header.length != ref.loc.length:
                raise FormatError("index points at a record that is not this chunk")
            ch = decode_chunk_header(memoryview(head)[rec.HEADER_SIZE:])
            if ch.address != address:
                raise FormatError(f"record holds chunk {ch.address.hex()}")
            decode_chunk_data(ch, dest)  # verifies the address in place
        else:
            payload = f.read_payload(ref.loc, verify=False)
            ch = decode_chunk_header(payload)
            if ch.address != address or ch.raw_length != len(dest):
                raise FormatError(f"record holds chunk {ch.address.hex()} of {ch.raw_length} bytes")
            dest[:] = decode_chunk_data(ch, payload[CHUNK_HEADER_SIZE:])
    except FormatError as e:
        raise e.located(f.path, ref.loc.offset) from None


@dataclass
class _ChunkRead:
    """One chunk to read, verify and place into the bytes of the tensor it belongs to."""

    entry: TensorEntry
    dest: memoryview
    address: bytes


class StateReader:
    """Loads a manifest's tensors, in parallel across chunks (reads and hashing release the GIL)."""

    def __init__(self, log: Log, index: Index, threads: int = 2) -> None:
        self.log = log
        self.index = index
        self.threads = threads

    def load(self, entry: CommitEntry, keys: Sequence[Any] | None = None,
             progress: Callable[[int], None] | None = None,
             into: Callable[[TensorEntry], Any] | None = None, target: Any = None) -> Any:
        """The state of ``entry``'s commit. ``into(tensor_entry)`` may return an existing torch
        tensor (contiguous, CPU, of the entry's dtype and shape) to read that tensor's bytes into
        instead of a fresh allocation (verified in place like any other); None allocates.
        ``target``: a state-shaped structure whose tensors receive the stored tensors at the same
        paths (:mod:`ckptstore.tensors.inplace`; checked before anything is read)."""
        manifest = read_manifest(self.log, entry)
        skeleton = manifest.state
        if keys is not None:
            top = top_level_items(skeleton)
            if top is None:
                raise NotFoundError(f"iteration {manifest.iteration}: the state is not a dict, "
                                    "so keys= cannot select from it")
            have = dict(top)
            missing = [k for k in keys if k not in have]
            if missing:
                raise NotFoundError(f"iteration {manifest.iteration}: keys {missing} are not in the "
                                    f"state (it has {list(have)})")
            tag = "d" if "d" in skeleton else "o"  # keep a state_dict's OrderedDict type
            skeleton = {tag: [[k, have[k]] for k in keys]}
        needed = sorted(set(leaf_indices(skeleton)))
        if needed and needed[-1] >= len(manifest.tensors):
            raise DamagedCheckpointError(f"iteration {manifest.iteration}: manifest names tensor "
                                         f"{needed[-1]} but lists {len(manifest.tensors)}")
        targets: dict[int, Any] = {}
        if target is not None:
            paths = leaf_paths(skeleton)
            targets = destinations({i: paths[i] for i in needed if i in paths},
                                   list(manifest.tensors), target)
        values = self._load_tensors(manifest, needed, progress, into, targets)

        def leaf(i: int, path: Any) -> Any:
            if i not in values:
                raise DamagedCheckpointError(f"iteration {manifest.iteration}: tensor index {i} unknown")
            return values[i]

        try:
            return unflatten(skeleton, leaf)
        except FormatError as e:
            raise DamagedCheckpointError(f"iteration {manifest.iteration}: {e}") from e

    def _load_tensors(self, manifest: Manifest, needed: list[int],
                      progress: Callable[[int], None] | None,
                      into: Callable[[TensorEntry], Any] | None = None,
                      targets: dict[int, Any] | None = None) -> dict[int, Any]:
        it = manifest.iteration
        values: dict[int, Any] = {}
        given_back: dict[int, Any] = {}  # index -> the caller's tensor, returned as it is
        staged: list[tuple[Any, Any]] = []  # (fresh CPU tensor, GPU or strided target) to copy
        jobs: list[_ChunkRead] = []
        for i in needed:
            e = manifest.tensors[i]
            try:
                # The tree and its chunk records bound the size before anything is allocated.
                spans = chunk_spans_bounded(self.log, self.index, e) \
                    if e.inline is None and e.nbytes else []
                target = targets.get(i) if targets else None
                if target is None:
                    given = into(e) if into is not None else None
                elif target.device.type == "cpu" and target.is_contiguous():
                    given = target.detach()  # the reads fill it (and verify it) in place
                else:
                    given = None  # read into a fresh CPU tensor, copied into it at the end
                value, view = allocate(e) if given is None else into_view(e, given)
                if given is None and len(view) >= HUGE_MIN_BYTES:
                    # fresh memory, about to be written for the first time by the reads
                    advise_huge_buffer(view)
                if target is not None:
                    given_back[i] = target
                    if given is None:
                        staged.append((value, target))
                if e.inline is not None:
                    if e.nbytes:
                        view[:] = e.inline
                    addrs = [address_of(e.inline)] if e.nbytes else []
                    if tree_root(e.nbytes, manifest.chunk_size, addrs) != e.root:
                        raise FormatError("inline tensor bytes do not match its root")
                jobs.extend(_ChunkRead(e, view[s:t], a) for s, t, a in spans)
            except (FormatError, StoreIOError, FileNotFoundError) as err:
                raise DamagedCheckpointError(f"iteration {it}: tensor {e.path}: {err}") from err
            values[i] = (e, value)

        def run(job: _ChunkRead) -> int:
            try:
                read_chunk_into(self.log, self.index, job.address, job.dest)
            except (FormatError, StoreIOError, FileNotFoundError) as err:
                raise DamagedCheckpointError(f"iteration {it}: tensor {job.entry.path}: {err}") from err
            return len(job.dest)

        if len(jobs) > 1 and self.threads > 1:
            with ThreadPoolExecutor(self.threads, thread_name_prefix="ckptstore-load") as pool:
                for n in pool.map(run, jobs):
                    if progress is not None:
                        progress(n)
        else:
            for job in jobs:
                n = run(job)
                if progress is not None:
                    progress(n)
        if staged:
            with torch.no_grad():
                for fresh, target in staged:
                    target.copy_(fresh)
        return {i: given_back[i] if i in given_back else finish(e, v)
                for i, (e, v) in values.items()}


@dataclass
class RangeRead:
    """Bytes ``start:end`` of the raw (C-order) bytes of the manifest's tensor ``index``, to be
    placed into ``dest`` (``end - start`` bytes)."""

    index: int
    start: int
    end: int
    dest: memoryview


def box_span(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]
             ) -> tuple[int, int, list[int]]:
    """The smallest element span ``[first, end)`` of a C-order tensor of ``shape`` holding the
    box at ``offsets`` of ``lengths`` (non-empty), and the tensor's strides (in elements): the
    box is ``span.as_strided(lengths, strides)`` of the span's elements."""
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    first = sum(o * s for o, s in zip(offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides))
    return first, last + 1, strides


def read_ranges(reader: StateReader, manifest: Manifest, requests: Sequence[RangeRead]) -> int:
    """Fill each request's ``dest`` with the verified bytes ``start:end`` of a stored tensor,
    reading only the chunks that overlap the range: a chunk wholly inside it is read straight into
    ``dest`` (verified in place), a chunk the range cuts is read into a scratch buffer of its own
    size, verified whole against its address, and only the overlap copied. Chunk reads run on the
    reader's threads. Returns the bytes read from the log. Raises DamagedCheckpointError (naming
    the tensor) for damage or a request outside the tensor."""
    it = manifest.iteration
    jobs: list[tuple[TensorEntry, bytes, memoryview, int, int, int]] = []
    for rq in requests:
        if not 0 <= rq.index < len(manifest.tensors):
            raise DamagedCheckpointError(f"iteration {it}: tensor index {rq.index} unknown")
        e = manifest.tensors[rq.index]
        if not 0 <= rq.start <= rq.end <= e.nbytes or len(rq.dest) != rq.end - rq.start:
            raise DamagedCheckpointError(
                f"iteration {it}: tensor {e.path}: bytes {rq.start}-{rq.end} requested into "
                f"{len(rq.dest)} bytes, the tensor holds {e.nbytes}")
        if rq.start == rq.end:
            continue
        try:
            if e.inline is not None:
                if tree_root(e.nbytes, manifest.chunk_size, [address_of(e.inline)]) != e.root:
                    raise FormatError("inline tensor bytes do not match its root")
                rq.dest[:] = memoryview(e.inline)[rq.start:rq.end]
                continue
            for s, t, addr in chunk_spans_bounded(reader.log, reader.index, e):
                lo, hi = max(s, rq.start), min(t, rq.end)
                if lo < hi:
                    jobs.append((e, addr, rq.dest, s, t, rq.start))
        except (FormatError, StoreIOError, FileNotFoundError) as err:
            raise DamagedCheckpointError(f"iteration {it}: tensor {e.path}: {err}") from err

    def run(job: tuple[TensorEntry, bytes, memoryview, int, int, int]) -> int:
        e, addr, dest, s, t, base = job
        lo, hi = max(s, base), min(t, base + len(dest))
        try:
            if lo == s and hi == t:
                read_chunk_into(reader.log, reader.index, addr, dest[s - base:t - base])
            else:
                scratch = bytearray(t - s)
                read_chunk_into(reader.log, reader.index, addr, memoryview(scratch))
                dest[lo - base:hi - base] = memoryview(scratch)[lo - s:hi - s]
        except (FormatError, StoreIOError, FileNotFoundError) as err:
            raise DamagedCheckpointError(f"iteration {it}: tensor {e.path}: {err}") from err
        return t - s

    if len(jobs) > 1 and reader.threads > 1:
        with ThreadPoolExecutor(reader.threads, thread_name_prefix="ckptstore-load") as pool:
            return sum(pool.map(run, jobs))
    return sum(run(job) for job in jobs)
