"""DCP's ``StorageReader`` over a store, and the whole-checkpoint views that need no process group
and no DCP planner (:func:`layout`, :func:`load_full_state_dict`, :func:`check_state_dict`,
:func:`is_dcp`)."""

from __future__ import annotations

import io
import math
import os
import uuid
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ...engine.read_path import RangeRead, box_span, read_ranges
from ...errors import (DamagedCheckpointError, DCPError, FormatError, NotFoundError,
                       ShardCoverageError, ShardDamagedError, ShardMismatchError, StoreIOError)
from ...format.state import Path, format_path, top_level_items, unflatten
from ...multirank.job_store import JobStore
from ...store import Store
from ...tensors import TORCH_DTYPES, empty_torch
from .metadata import (FORMAT, FORMAT_VERSION, BadMetadata, decode_metadata, iteration_of, need,
                       valid_id)
from .sharding import Layout, chunks_of, coverage_problems, decode_storage, layout_of

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
    from torch.futures import Future


#: bytes of scratch buffers one read batch may hold (boxes read into scratch, then copied)
SCRATCH_BATCH = 64 << 20

_registered = False


def _register() -> None:
    """Import DCP (first use only) and register :class:`StorageReader` as a virtual subclass of its
    ``StorageReader`` interface."""
    global _registered
    if not _registered:
        from torch.distributed.checkpoint import storage

        storage.StorageReader.register(StorageReader)
        _registered = True


def _set_element(root: Any, path: Sequence[Any], value: Any) -> None:
    """Put ``value`` into the nested state ``root`` at the default load planner's object path
    (str keys: dict entries, int keys: list positions; missing containers made on the way),
    as DCP's ``load_bytes`` does."""
    node = root
    for key, nxt in zip(path, path[1:]):
        fresh: Any = {} if type(nxt) is str else []
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = fresh
            node = node[key]
        else:
            node = node.setdefault(key, fresh)
    last = path[-1]
    if isinstance(node, list):
        node.extend([None] * (last + 1 - len(node)))
    node[last] = value


class _Part:
    """One rank's state of a DCP iteration (the only one for a single-process save): the rank,
    the store (a rank stream of a job store) that holds it, its manifest and its items by store
    key."""

    def __init__(self, rank: int, source: Store, manifest: Any, items: dict[str, Any]) -> None:
        self.rank, self.source, self.manifest, self.items = rank, source, manifest, items


class StorageReader:
    """DCP's ``StorageReader`` over a ckptstore store (see the package docstring): loads the DCP
    checkpoint of ``iteration``, or of the ``checkpoint_id`` given to DCP, else of the latest
    iteration. Raises NotFoundError / DCPError at once when the iteration is missing or holds no
    DCP checkpoint. A multi-rank checkpoint in a job store is read from the rank streams that
    hold each requested item, at any world size (a reader needs no process group)."""

    def __init__(self, store: Store | JobStore, iteration: int | str | None = None) -> None:
        _register()
        if not isinstance(store, (Store, JobStore)):
            raise TypeError(f"ckptstore.dcp needs a ckptstore Store or JobStore, not {type(store)!r}")
        self.store = store
        self.iteration: int | None = None
        self.load_id = str(uuid.uuid4())
        #: bytes of tensor data the last read_data read from the store (whole chunks)
        self.last_read_bytes = 0
        #: the ranks whose states the last read_data read from (a multi-rank checkpoint)
        self.last_read_ranks: set[int] = set()
        #: bytes of tensor data the last read_data read, per rank stream read from
        self.last_read_bytes_by_rank: dict[int, int] = {}
        self._manifest: Any = None
        #: the stored chunk of each tensor item: MetadataIndex -> (offsets, sizes)
        self._chunks: dict[Any, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        #: the kind of each key: "bytes" or "tensor"
        self._kinds: dict[str, str] = {}
        #: tensors whose stored shards do not tile them (format-spec/dcp.md §3), by fqn
        self._coverage: dict[str, ShardCoverageError] = {}
        self._doc: Any = None
        self._head_rank = 0
        self._world = 1
        self._parts: dict[int, _Part] = {}
        self._storage: dict[Any, tuple[int, str]] = {}
        if iteration is not None:
            self._open(iteration_of(iteration))

    @property
    def checkpoint_id(self) -> str | None:
        return None if self.iteration is None else str(self.iteration)

    def _read_part(self, source: Store, iteration: int) -> tuple[Any, dict[str, Any], Any]:
        """The ``dcp`` head (decoded), the items by key, and the manifest of one state."""
        store = self.store
        manifest = source.manifest(iteration)
        top = dict(top_level_items(manifest.state) or [])
        head, items = top.get("dcp"), top.get("items")
        try:
            need(head is not None and items is not None, "")
            doc = unflatten(head, _no_leaf)
            need(type(doc) is dict and doc.get("format") == FORMAT, "")
        except (BadMetadata, DCPError, FormatError):
            raise DCPError(f"{store.path}: iteration {iteration} holds no DCP checkpoint (it "
                           "was not saved through ckptstore.dcp)") from None
        try:
            need(doc.get("version") == FORMAT_VERSION,
                 f"layout version {doc.get('version')!r} is not {FORMAT_VERSION}")
            entries = top_level_items(items)
            need(entries is not None, "items is not a dict")
        except BadMetadata as e:
            raise DCPError(f"{store.path}: iteration {iteration}: the DCP metadata does not "
                           f"decode: {e}") from None
        assert entries is not None
        return doc, {k: v for k, v in entries if type(k) is str}, manifest

    def _open(self, iteration: int) -> None:
        """Read and check the iteration's DCP metadata (no tensor data): from the state of the
        rank that holds it (rank 0's state names it in a multi-rank checkpoint)."""
        store = self.store
        if isinstance(store, JobStore):
            world = store.global_commit(iteration).world_size
            kind = store.kind(iteration)
        else:
            world, kind = 1, store.kind(iteration)
        if kind != "snapshot":
            raise DCPError(f"{store.path}: iteration {iteration} is a delta record, not a DCP "
                           "checkpoint")
        head_rank = 0
        source = store.stream(iteration, 0) if isinstance(store, JobStore) else store
        doc, by_key, manifest = self._read_part(source, iteration)
        where = doc.get("metadata_rank")
        if "metadata" not in doc and isinstance(store, JobStore) and type(where) is int \
                and 0 < where < world:
            head_rank = where
            source = store.stream(iteration, where)
            doc, by_key, manifest = self._read_part(source, iteration)
        try:
            md, storage = decode_storage(doc.get("metadata"), world, head_rank)
            missing = [k for r, k in storage.values() if r == head_rank and k not in by_key]
            need(not missing, f"the metadata names items the checkpoint lacks: {missing[:5]}")
        except BadMetadata as e:
            raise DCPError(f"{store.path}: iteration {iteration}: the DCP metadata does not "
                           f"decode: {e}") from None
        self.iteration, self._manifest, self._doc = iteration, manifest, doc["metadata"]
        self._head_rank, self._world, self._storage = head_rank, world, storage
        self._chunks, self._kinds = chunks_of(md)
        self._coverage = coverage_problems(md, storage, f"{store.path}: iteration {iteration}")
        self._parts = {head_rank: _Part(head_rank, source, manifest, by_key)}

    def _part(self, rank: int) -> _Part:
        """The state of ``rank`` (opened on first use: a load reads only the ranks it needs)."""
        part = self._parts.get(rank)
        if part is None:
            store, it = self.store, self.iteration
            assert isinstance(store, JobStore) and it is not None
            source = store.stream(it, rank)
            _, by_key, manifest = self._read_part(source, it)
            missing = [k for r, k in self._storage.values() if r == rank and k not in by_key]
            if missing:
                raise DCPError(f"{store.path}: iteration {it}: rank {rank}'s state lacks items "
                               f"the DCP metadata names: {missing[:5]}")
            part = self._parts[rank] = _Part(rank, source, manifest, by_key)
        return part

    def reset(self, checkpoint_id: str | os.PathLike | int | None = None) -> None:
        if checkpoint_id is not None:
            self._open(iteration_of(checkpoint_id))
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's Metadata of the iteration, rebuilt from the store (a fresh object per call)."""
        if self._manifest is None:
            latest = self.store.latest()
            if latest is None:
                raise NotFoundError(f"{self.store.path} holds no committed iteration")
            self._open(latest)
        md, _ = decode_metadata(self._doc)
        if md.storage_meta is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        if self._manifest is None:
            raise DCPError("set_up_storage_reader() before read_metadata()")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Checks every request of this rank's plan against the stored metadata before anything
        is read: ShardMismatchError for an item the checkpoint does not hold or a box outside
        the stored shard, ShardCoverageError for a tensor whose shards do not tile it."""
        if self._manifest is None:
            raise DCPError("prepare_local_plan() before read_metadata()")
        for req in plan.items:
            self._check_request(req)
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike | int) -> bool:
        """Whether ``checkpoint_id`` names an iteration (an int >= 0 or a string of digits)."""
        return valid_id(checkpoint_id)

    def _check_request(self, req: ReadItem) -> tuple[int, str]:
        """The (rank, store key) holding a read request's item, after checking that the stored
        metadata can serve the request."""
        from torch.distributed.checkpoint.planner import LoadItemType

        index = req.storage_index
        fqn, it = index.fqn, self.iteration
        where = self._storage.get(index)
        if where is None:
            kind = self._kinds.get(fqn)
            if kind is None:
                raise ShardMismatchError(f"{self.store.path}: iteration {it}: the checkpoint holds "
                                         f"no item {fqn!r}: no such key", fqn=fqn)
            held = sorted(list(o) for i, (o, _) in self._chunks.items() if i.fqn == fqn)
            raise ShardMismatchError(
                f"{self.store.path}: iteration {it}: the checkpoint holds no item {fqn!r} at "
                f"offsets {None if index.offset is None else list(index.offset)}"
                + (f" (its shards start at {held[:8]})" if held else ""), fqn=fqn)
        problem = self._coverage.get(fqn)
        if problem is not None:
            raise problem
        kind = self._kinds.get(fqn)
        if req.type == LoadItemType.BYTE_IO:
            if kind == "tensor":
                raise ShardMismatchError(f"{self.store.path}: iteration {it}: {fqn!r} is a stored "
                                         "tensor, and the load asks for a non-tensor value",
                                         fqn=fqn)
            return where
        chunk = self._chunks.get(index)
        if chunk is None:
            raise ShardMismatchError(f"{self.store.path}: iteration {it}: {fqn!r} is a stored "
                                     "non-tensor value, and the load asks for a tensor", fqn=fqn)
        offsets, lengths, sizes = list(req.storage_offsets), list(req.lengths), chunk[1]
        if not (len(offsets) == len(lengths) == len(sizes) and all(
                0 <= o and 0 <= n and o + n <= d for o, n, d in zip(offsets, lengths, sizes))):
            raise ShardMismatchError(
                f"{self.store.path}: iteration {it}: tensor {fqn!r}: the box at {offsets} of sizes "
                f"{lengths} lies outside the stored tensor (the shard at {list(chunk[0])}, of "
                f"sizes {list(sizes)}, rank {where[0]})", fqn=fqn)
        return where

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of the plan into the planner's destinations (tensors: only the chunks
        holding the requested boxes; non-tensor values: decoded from the manifest)."""
        from torch.distributed.checkpoint.planner import LoadItemType
        from torch.futures import Future

        if self._manifest is None:
            raise DCPError("read_data() before read_metadata()")
        self.last_read_bytes = 0
        self.last_read_ranks = set()
        self.last_read_bytes_by_rank = {}
        for req in plan.items:  # all of them before reading anything (prepare_local_plan did,
            self._check_request(req)  # unless the caller skipped it)
        batch: list[_Box] = []
        scratch = 0
        for req in plan.items:
            rank, key = self._storage[req.storage_index]
            part = self._part(rank)
            node = part.items[key]
            if req.type == LoadItemType.BYTE_IO:
                _deliver_object(planner, req, unflatten(node, _no_leaf))
                continue
            box = self._box(req, node, part, planner)
            if box is None:
                continue
            self.last_read_ranks.add(rank)
            batch.append(box)
            scratch += box.scratch_bytes
            if scratch >= SCRATCH_BATCH:
                self._read(batch, planner)
                batch, scratch = [], 0
        self._read(batch, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _box(self, req: ReadItem, node: Any, part: _Part, planner: LoadPlanner) -> _Box | None:
        """Plan the read of one tensor request: the byte range of the stored tensor that holds
        the requested box, and where it goes."""
        it = self.iteration
        if not (type(node) is dict and set(node) == {"T"} and type(node["T"]) is int
                and 0 <= node["T"] < len(part.manifest.tensors)):
            raise DCPError(f"iteration {it}: item {req.storage_index.fqn!r} is not a tensor")
        index = node["T"]
        entry = part.manifest.tensors[index]
        dtype = TORCH_DTYPES.get(entry.dtype) if entry.lib == "torch" else None
        if dtype is None:
            raise DCPError(f"iteration {it}: item {req.storage_index.fqn!r} is a {entry.lib} "
                           f"{entry.dtype} array, not a torch tensor")
        shape, offsets, lengths = list(entry.shape), list(req.storage_offsets), list(req.lengths)
        fqn = req.storage_index.fqn
        if not (len(offsets) == len(lengths) == len(shape) and
                all(0 <= o and 0 <= n and o + n <= d for o, n, d in zip(offsets, lengths, shape))):
            raise ShardMismatchError(f"iteration {it}: item {fqn!r}: the box at {offsets} of sizes "
                                     f"{lengths} lies outside the stored tensor {shape} (rank "
                                     f"{part.rank})", fqn=fqn)
        dest = planner.resolve_tensor(req).detach()
        if list(dest.shape) != lengths:
            raise ShardMismatchError(f"iteration {it}: item {fqn!r}: the destination's shape "
                                     f"{list(dest.shape)} is not the box's {lengths}", fqn=fqn)
        numel = math.prod(lengths)
        if numel == 0:
            planner.commit_tensor(req, dest)
            return None
        first, stop, strides = box_span(shape, offsets, lengths)
        item = dtype.itemsize
        start, end = first * item, stop * item
        direct = (end - start == numel * item and dest.device.type == "cpu"
                  and dest.dtype == dtype and dest.is_contiguous()
                  and not dest.is_conj() and not dest.is_neg())
        return _Box(req, part, index, start, end, dest, dtype, lengths, strides, direct)

    def _read(self, batch: list[_Box], planner: LoadPlanner) -> None:
        by_part: dict[int, list[_Box]] = {}
        for b in batch:
            by_part.setdefault(id(b.part), []).append(b)
        for boxes in by_part.values():
            part = boxes[0].part
            source, manifest = part.source, part.manifest
            ranges = [RangeRead(b.index, b.start, b.end, b.target()) for b in boxes]
            source.check()
            try:
                n = _read_ranges(source, manifest, ranges)
            except (DamagedCheckpointError, FormatError, StoreIOError) as e:
                raise self._damaged(boxes, e) from e
            self.last_read_bytes += n
            self.last_read_bytes_by_rank[part.rank] = \
                self.last_read_bytes_by_rank.get(part.rank, 0) + n
        with torch.no_grad():
            for b in batch:
                b.place()
                planner.commit_tensor(b.req, b.dest)


    def _damaged(self, boxes: list[_Box], error: BaseException) -> ShardDamagedError:
        """The error for a failed read of one rank's shards: the first shard of ``boxes`` whose
        bytes do not read back on their own is named (each re-read into scratch)."""
        part = boxes[0].part
        culprit, cause = boxes[0], error
        for b in boxes:
            try:
                _read_ranges(part.source, part.manifest,
                             [RangeRead(b.index, b.start, b.end, memoryview(bytearray(b.end - b.start)))])
            except (DamagedCheckpointError, FormatError, StoreIOError) as e:
                culprit, cause = b, e
                break
        index = culprit.req.storage_index
        offsets = tuple(int(n) for n in index.offset) if index.offset is not None else ()
        return ShardDamagedError(
            f"{self.store.path}: iteration {self.iteration}: the shard of tensor {index.fqn!r} at "
            f"offsets {list(offsets)} stored by rank {part.rank} (in {part.source.path}) is "
            f"damaged: {cause}", rank=part.rank, stream=part.source.path, fqn=index.fqn,
            offsets=offsets)

    # ---- whole-checkpoint views (no process group, no DCP planner) ----------------------------
    def layout(self) -> Layout:
        """Where every tensor's shards and every value of the checkpoint are stored (read from
        the metadata only; nothing else is read)."""
        if self._manifest is None:
            self.read_metadata()
        assert self.iteration is not None
        return layout_of(self._doc, self._world, metadata_rank=self._head_rank,
                         path=self.store.path, iteration=self.iteration)

    def read_full(self, keys: Sequence[str] | None = None, *, flat: bool = False) -> dict[str, Any]:
        """The checkpoint as one process's state dict of full tensors (see
        :func:`load_full_state_dict`)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
        from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

        if self._manifest is None:
            self.read_metadata()
        md, _ = decode_metadata(self._doc)
        chosen = _select(list(md.state_dict_metadata), keys, f"{self.store.path}: iteration "
                         f"{self.iteration}")
        values: dict[str, Any] = {}
        full: dict[str, torch.Tensor] = {}
        items = []
        for fqn in chosen:
            v = md.state_dict_metadata[fqn]
            if not isinstance(v, TensorStorageMetadata):
                index = MetadataIndex(fqn)
                if index not in self._storage:
                    raise ShardMismatchError(f"{self.store.path}: iteration {self.iteration}: the "
                                             f"metadata stores value {fqn!r} in no rank", fqn=fqn)
                rank, key = self._storage[index]
                values[fqn] = unflatten(self._part(rank).items[key], _no_leaf)
                continue
            problem = self._coverage.get(fqn)
            if problem is not None:
                raise problem
            dtype = v.properties.dtype
            full[fqn] = t = empty_torch(tuple(v.size), dtype)
            values[fqn] = t
            for c in v.chunks:
                if math.prod(c.sizes) == 0:
                    continue
                index = MetadataIndex(fqn, c.offsets)
                items.append(ReadItem(type=LoadItemType.TENSOR, dest_index=index,
                                      dest_offsets=c.offsets, storage_index=index,
                                      storage_offsets=torch.Size([0] * len(c.sizes)),
                                      lengths=c.sizes))
        self.read_data(LoadPlan(items), _FullPlanner(full))  # type: ignore[arg-type]
        # in the order of the state dict given to dcp.save (DCP's flattening map's), which the
        # metadata's order need not be
        mapping = md.planner_data if isinstance(md.planner_data, dict) else {}
        order = [f for f in mapping if f in values] + [f for f in values if f not in mapping]
        values = {f: values[f] for f in order}
        if flat:
            return values
        out: dict[str, Any] = {}
        for fqn, value in values.items():
            path = mapping.get(fqn)
            if type(path) in (list, tuple) and path and all(type(k) in (str, int) for k in path):
                _set_element(out, list(path), value)
            else:
                out[fqn] = value
        return out


class _FullPlanner:
    """The destinations of a full load: each request's box of a full tensor (a view)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        t = self.tensors[req.dest_index.fqn]
        for d, (o, n) in enumerate(zip(req.dest_offsets, req.lengths)):
            t = t.narrow(d, int(o), int(n))
        return t

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        pass


def _select(fqns: list[str], keys: Sequence[str] | None, where: str) -> list[str]:
    """The fqns ``keys`` select: a key selects the fqn it equals and every fqn under it (a dotted
    prefix: ``model`` selects ``model.fc.weight``). NotFoundError for a key that selects none."""
    if keys is None:
        return fqns
    if isinstance(keys, str):
        keys = [keys]
    chosen: dict[str, None] = {}
    for k in keys:
        hit = [f for f in fqns if f == k or f.startswith(k + ".")]
        if not hit:
            raise NotFoundError(f"{where}: the DCP checkpoint holds no key {k!r}")
        chosen.update(dict.fromkeys(hit))
    return [f for f in fqns if f in chosen]


def _read_ranges(source: Store, manifest: Any, ranges: list[RangeRead]) -> int:
    engine = source.engine
    return engine.read(lambda: read_ranges(engine.state_reader(), manifest, ranges))


class _Box:
    """One tensor request: bytes ``start:end`` of stored tensor ``index`` hold the box; read
    straight into ``dest`` (``direct``) or into scratch, then copied."""

    def __init__(self, req: Any, part: _Part, index: int, start: int, end: int,
                 dest: torch.Tensor, dtype: torch.dtype, lengths: list[int], strides: list[int],
                 direct: bool) -> None:
        self.req, self.part, self.index, self.start, self.end = req, part, index, start, end
        self.dest, self.dtype, self.lengths, self.strides = dest, dtype, lengths, strides
        self.direct = direct
        self.scratch: torch.Tensor | None = None
        self.scratch_bytes = 0 if direct else end - start

    def target(self) -> memoryview:
        if self.direct:
            flat = self.dest.reshape(-1).view(torch.uint8)
        else:
            self.scratch = flat = torch.empty(self.end - self.start, dtype=torch.uint8)
        return memoryview(flat.numpy())  # type: ignore[arg-type]

    def place(self) -> None:
        if self.scratch is not None:
            src = self.scratch.view(self.dtype).as_strided(self.lengths, self.strides)
            self.dest.copy_(src)
            self.scratch = None


def _no_leaf(index: int, path: Path) -> Any:
    raise DCPError(f"a tensor at {format_path(path)} where a non-tensor value is stored")


def _deliver_object(planner: LoadPlanner, req: ReadItem, value: Any) -> None:
    """Put a decoded non-tensor value where DCP's load_bytes would, without unpickling."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    if isinstance(planner, DefaultLoadPlanner) and \
            type(planner).load_bytes is DefaultLoadPlanner.load_bytes:
        fqn = req.dest_index.fqn
        if planner.flatten_state_dict:
            _set_element(planner.original_state_dict, planner.mappings[fqn], value)
        else:
            planner.state_dict[fqn] = value
        return
    # a planner with its own load_bytes: the bytes the default SavePlanner would have produced,
    # made here from the decoded value (nothing read from the store is unpickled)
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    planner.load_bytes(req, buf)


# ---- whole checkpoints in one process (no process group, no DCP planner) -------------------------

def _reader(store: Store | JobStore, iteration: int | str | None) -> StorageReader:
    reader = StorageReader(store, iteration)
    if iteration is None:
        reader.read_metadata()  # the latest iteration
    return reader


def is_dcp(store: Store | JobStore, iteration: int) -> bool:
    """Whether committed ``iteration`` of ``store`` was saved through ckptstore.dcp (its state,
    rank 0's in a job store, carries the DCP marker). Reads one manifest; never raises for an
    iteration that is not one (NotFoundError for an iteration that is not committed)."""
    if store.kind(iteration) != "snapshot":
        return False
    source = store.stream(iteration, 0) if isinstance(store, JobStore) else store
    top = dict(top_level_items(source.manifest(iteration).state) or [])
    head = top.get("dcp")
    if head is None or "items" not in top:
        return False
    try:
        doc = unflatten(head, _no_leaf)
    except (DCPError, FormatError):
        return False
    return type(doc) is dict and doc.get("format") == FORMAT


def layout(store: Store | JobStore, iteration: int | str | None = None) -> Layout:
    """The sharded layout of a DCP checkpoint (``iteration``, default the latest): per tensor
    its global shape, dtype and shards (box, the rank stream holding it, bytes), per value the
    rank holding it, and any tensor whose shards do not tile it. Reads metadata only."""
    return _reader(store, iteration).layout()


def check_state_dict(store: Store | JobStore, iteration: int | str | None, state_dict: Any, *,
                     strict: bool = True) -> None:
    """Check, before ``dcp.load(state_dict, ...)``, that the DCP checkpoint ``iteration`` (default
    the latest) can serve ``state_dict``: every key is stored (unless ``strict=False``), a
    tensor (plain, DTensor, ShardedTensor) where a tensor is stored, with its global shape, a
    non-tensor where a value is stored, and the stored shards tile the tensor. Any placement of
    the right global shape can be served: the reader reads each rank's boxes from whichever
    shards hold them. Raises ShardMismatchError (or ShardCoverageError) naming the first key
    that cannot be served; reads metadata only and needs no process group (DCP's own planner
    reports these cases later, inside its collectives, as its own ValueError/RuntimeError)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = _reader(store, iteration)
    md = reader.read_metadata()
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state_dict, md, True)  # flattens as dcp.load does
    where = f"{reader.store.path}: iteration {reader.iteration}"
    for fqn, obj in planner.state_dict.items():
        stored = md.state_dict_metadata.get(fqn)
        if stored is None:
            if strict:
                raise ShardMismatchError(f"{where}: the checkpoint holds no key {fqn!r}", fqn=fqn)
            continue
        size = getattr(obj, "size", None)
        if isinstance(stored, TensorStorageMetadata):
            if not isinstance(obj, torch.Tensor) or not callable(size):
                raise ShardMismatchError(f"{where}: {fqn!r} is a stored tensor of shape "
                                         f"{list(stored.size)}, and the state dict has a "
                                         f"{type(obj).__qualname__} there", fqn=fqn)
            if tuple(size()) != tuple(stored.size):
                raise ShardMismatchError(f"{where}: tensor {fqn!r} is stored with global shape "
                                         f"{list(stored.size)}, and the state dict asks for "
                                         f"{list(size())}", fqn=fqn)
            problem = reader._coverage.get(fqn)
            if problem is not None:
                raise problem
        elif isinstance(obj, torch.Tensor):
            raise ShardMismatchError(f"{where}: {fqn!r} is a stored non-tensor value, and the "
                                     "state dict has a tensor there", fqn=fqn)


def load_full_state_dict(store: Store | JobStore, iteration: int | str | None = None, *,
                         keys: Sequence[str] | None = None, flat: bool = False) -> dict[str, Any]:
    """A DCP checkpoint (``iteration``, default the latest) as one process's state dict of full
    tensors: every tensor assembled from its shards, each shard's bytes read from the rank stream
    that holds it (only the chunks that hold it, straight into the full tensor where the shard
    is contiguous in it). Needs no process group and no DCP planner; works on single-process
    stores and on job stores saved at any world size. Tensors come back as contiguous CPU
    tensors of the stored dtype, non-tensor values decoded (never unpickled).

    The result is nested as the state dict given to ``dcp.save`` was (DCP's flattening map:
    ``{"model": {"fc.weight": ...}, "optim": {...}}``); ``flat=True`` returns ``{fqn: value}``
    (``"model.fc.weight"``). ``keys``: only these fqns, a key also selecting every fqn under it
    (``"model"`` selects ``"model.fc.weight"``); NotFoundError for a key that selects nothing.

    Raises ShardCoverageError for a selected tensor whose stored shards overlap or leave a gap,
    ShardDamagedError (naming the rank, its stream and the shard) when a shard's bytes fail
    verification, DCPError / NotFoundError as :class:`StorageReader` does."""
    return _reader(store, iteration).read_full(keys, flat=flat)
