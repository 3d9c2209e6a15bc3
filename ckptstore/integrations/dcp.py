"""ckptstore as the storage layer of ``torch.distributed.checkpoint`` (DCP).

    import torch.distributed.checkpoint as dcp
    import ckptstore, ckptstore.dcp

    store = ckptstore.open("runs/gpt", mode="a")
    dcp.save(state, storage_writer=ckptstore.dcp.StorageWriter(store, 100))
    dcp.load(state, storage_reader=ckptstore.dcp.StorageReader(store, 100))   # in place
    fut = dcp.async_save(state, storage_writer=ckptstore.dcp.StorageWriter(store, 200))
    fut.result()
    # or one writer/reader for many iterations, each named by DCP's checkpoint_id:
    dcp.save(state, checkpoint_id=300, storage_writer=ckptstore.dcp.StorageWriter(store))

:class:`StorageWriter` and :class:`StorageReader` implement DCP's ``StorageWriter`` and
``StorageReader`` interfaces (``torch/distributed/checkpoint/storage.py``; they are registered as
virtual subclasses of both, so ``isinstance`` holds). ``torch.distributed.checkpoint`` is
imported by this module only, and only when the first writer or reader is made: ``import
ckptstore`` never imports it.

**A DCP checkpoint is one iteration of the store.** ``checkpoint_id`` is the iteration: an int,
or a string of decimal digits (:meth:`StorageWriter.validate_checkpoint_id` says which ids are
accepted). The iteration's state is::

    {"dcp":   {"format": "ckptstore.dcp", "version": 1, "metadata": <DCP's Metadata, encoded>},
     "items": {storage key: tensor | JSON-like value, ...}}

one entry of ``items`` per DCP write item, keyed by its fully qualified name (``fqn``, with
``@offsets`` appended for a chunk that does not start at the origin). In a job store saved by
several ranks, each rank's state of the iteration holds the items that rank wrote, and the
metadata is in the coordinator's (rank 0's unless DCP's ``coordinator_rank`` says otherwise;
"Many ranks" below). So everything the store
does applies unchanged: a tensor identical to one saved before (another iteration, or another
key of the same one, e.g. tied weights) is stored once (chunks are content-addressed); ``fsck``
verifies DCP iterations like any other; ``gc`` keeps or drops them as whole iterations; any
committed iteration can be loaded (point-in-time restore); ``ckptstore show``/``store.load(it)``
read them as ordinary states.

**Nothing is pickled, nothing is unpickled.** DCP's ``Metadata`` is stored in the store's own
state encoding (format-spec/format.md, "State encoding"): per key either a tensor's dtype,
size, chunks (offsets and sizes) and properties (layout, requires_grad, memory format,
pin_memory) or a bytes item; the planner data (the default planner's flattening map, tuples of
keys) and the storage meta; and the storage data (which store key holds which DCP index). On
read it is checked field by field and rebuilt into torch's ``Metadata`` dataclasses; anything
malformed raises :class:`~ckptstore.errors.DCPError`.

Non-tensor values (``lr``, ``betas``, ``step`` counters, parameter-name lists...) reach a
storage layer as DCP ``BYTE_IO`` items, which the default planner turns into ``torch.save``
bytes and, on load, hands to ``torch.load(weights_only=False)``: storing those bytes would mean
unpickling them on every load. Instead the writer takes the object itself from the default
planner (``DefaultSavePlanner.lookup_object``) and stores it natively when it is JSON-like (None,
bool, int, float, str, bytes, and lists, tuples and str/int-keyed dicts of them: everything a
``Module``/optimizer/LR-scheduler state dict holds besides tensors). On load the value is
decoded and set into the caller's state dict exactly where the default load planner's
``load_bytes`` would put it, with no bytes in between; a custom ``LoadPlanner`` that overrides
``load_bytes`` gets ``torch.save`` bytes made here from the decoded value (not bytes read from
the store). Refused at save time, with an :class:`~ckptstore.errors.UnsupportedTypeError` that
names the DCP key, before anything is written: any other object (a custom class, a tuple
holding tensors, a numpy scalar), and every ``BYTE_IO`` item of a ``SavePlanner`` that
serializes objects its own way (its bytes could only be read back by unpickling them).

**Atomic commit** (one process; many ranks: below). ``write_data`` resolves every item (the
planner's ``resolve_data``), checks it and returns its ``WriteResult``; it writes nothing.
``finish`` (the coordinator's last call)
saves the iteration with :meth:`ckptstore.Store.save`: chunks, trees, manifest, fsync, then the
COMMIT record and its fsync, the commit point. The iteration is visible only once ``finish``
has committed it; a failure before (in planning, ``write_data``, or inside ``finish``: a full
disk, an unsupported value) leaves nothing visible, every earlier iteration intact, and the next
save retries cleanly. DCP's ``FileSystemWriter`` writes into the checkpoint directory in place
and, in ``finish``, deletes the old ``.metadata`` before renaming the new one over it: between
the two the directory holds no metadata, and a crash there leaves the checkpoint unloadable.
Here there is no such window: an iteration never changes once committed, a new one is
invisible until its single COMMIT record is durable, and the store's previous iterations stay
loadable throughout.

**Reads.** ``read_data`` reads each requested box of a stored tensor (``storage_offsets`` and
``lengths``) from the smallest byte range that holds it, reading only the store chunks that
overlap that range (each verified against its address, as every read of the store is). When the
box is contiguous in the stored tensor and DCP's destination (``LoadPlanner.resolve_tensor``) is
a contiguous CPU tensor of the stored dtype, whole chunks are read straight into the
destination's memory; otherwise into a scratch buffer that is copied into the destination (any
device, any layout, dtype conversion as DCP's own reader does with ``copy_``).

**Many ranks.** Over a :class:`~ckptstore.JobStore` of N > 1 ranks (``ckptstore.open(path, "a",
process_group=pg)`` on every rank), ``dcp.save`` runs on every rank of ``pg`` and each save is
one iteration of the job store, committed by the DCP variant of its global two-phase commit
(format-spec/format.md §22.6): visible only once every rank's items are durable and DCP gathered
every rank's success, or not at all::

    js = ckptstore.open("runs/gpt", "a", process_group=dist.group.WORLD)   # every rank
    dcp.save(state, storage_writer=ckptstore.dcp.StorageWriter(js, 100))   # every rank

ckptstore runs no collective of its own during a DCP save: DCP's own collectives carry
everything (so a rank that fails anywhere, in a planner, a writer subclass, before or after this
writer's ``write_data``, makes every rank raise DCP's ``CheckpointException`` at once, naming
that rank's error, and the store saves again right after). How a save runs (DCP's flow,
``state_dict_saver._save_state_dict``):

1. *Planning.* DCP gathers every rank's plan on the coordinator; its planner deduplicates the
   items every rank holds alike (a replicated parameter, a non-tensor value: one rank writes
   each, chosen by DCP's ``dedup_save_plans``) and makes the global metadata. The writer's
   ``prepare_global_plan`` (coordinator) then gives each rank's plan ``storage_data``: the store
   key of each of its items (JSON-like lists; DCP ships plans with its own object collectives).
   Keys are a pure function of a rank's items (``fqn``, ``@offsets`` off the origin, ``#`` while
   taken), so the coordinator knows every rank's keys without another message. The
   coordinator's ``set_up_storage_writer`` settles what an earlier save of this job store left
   prepared (below).
2. *write_data, every rank: prepare.* Each rank resolves its items (nothing is written when one
   cannot be stored) and commits ``{"dcp": head, "items": its items}`` in its own rank stream
   (records, fsync, local COMMIT, fsync) without making it visible: the job store holds the
   stream's index update back (``JobStore.prepared``). The coordinator's ``head`` holds DCP's
   metadata of the whole save (the planner's, the Metadata DCP passes to ``finish``), its
   storage map naming the rank and key of every item; the other ranks' heads name the coordinator
   (``metadata_rank``). The WriteResults it returns end with one more, key ``VOTE_KEY``, whose
   ``storage_data`` is this rank's *vote*: where its local COMMIT is and what it says (the commit
   round's vote encoding, multirank/messages.py, as a hex string: plain data, which DCP's gather
   carries to the coordinator; nothing read from a store is pickled).
3. *finish, the coordinator: the global commit.* DCP calls it only when every rank's
   ``write_data`` succeeded. It checks the Metadata DCP passes against the prepared one and
   every rank's results, then decides on the votes exactly as a commit round's coordinator does
   (same iteration on every rank, no newer epoch, after the latest commit) and appends the
   GLOBAL_COMMIT: **the commit point**. A failure before it (a subclass raising at the start of
   ``finish``, a check failing) commits nothing. When ``dcp.save`` returns on any rank, the
   iteration is durable.
4. *Every other rank learns lazily.* Its prepared commit stays held until the job store's next
   use reads the global log (``iterations``, ``latest``, ``load``, the next save's set-up...):
   named by a GLOBAL_COMMIT, it is indexed and visible. A save that failed leaves it held; the
   rank's next ``write_data`` (which DCP runs only after the coordinator began that next save,
   and so settled the failed one for good) cuts it back unless the log names it; any other write
   first (``JobStore.save``, ``close``) keeps it in its stream, never visible. So a failed save
   costs nothing and the same iteration can be saved again.

Failures: DCP reports the failing ranks' errors in ``CheckpointException.failures`` (the other
ranks report none); the writer keeps the typed one in ``error`` (``GlobalCommitAbortedError``,
``RankMismatchError``, ``StaleWriterError``, ``CommitOutcomeUnknownError`` from the decision).
A rank that dies makes DCP's next collective over it fail on the others (gloo's error, at once
when its sockets close, else at the process group's timeout): an acknowledged save is never lost,
and a save in flight is visible iff its GLOBAL_COMMIT is durable. Refused with ``DCPError`` on
every rank before anything is written: ``use_collectives=False``, ``no_dist=True``, a DCP process
group of another size or rank numbering than the job store's (save over the group the store was
opened with), a DCP coordinator other than the job store's rank 0 (``dcp.save`` always uses rank
0; only ``coordinator_rank`` of the deprecated ``save_state_dict`` can differ), deltas pending
commit, a job store whose async pipeline runs (its persister owns the stream's commits). DCP's
plan caching (``DefaultSavePlanner(enable_plan_caching=True)``) works: unchanged plans keep the
keys made from the same items.

Loads work at any world size, and in one process without a group: the reader takes DCP's
metadata from the coordinator's state and reads each requested box from the stream of the rank
that holds it (a rank's manifest is read when a request first needs it), reading only the chunks
that hold it. A one-writer :class:`~ckptstore.Store` (or a job store of one rank) takes saves from
one process only (``no_dist=True``, or a process group of one rank); more ranks raise
``DCPError`` on every rank. The layout: format-spec/dcp.md.

**Whole checkpoints in one process** (no process group, no DCP planner; single-process stores
and job stores saved at any world size): :func:`layout` says where every tensor's shards are
stored (box, rank, bytes; ``ckptstore show``), :func:`load_full_state_dict` assembles every
tensor whole from its shards, each shard read once from the rank that holds it (``ckptstore
restore``), :func:`check_state_dict` says before ``dcp.load`` whether the checkpoint can serve a
state dict. The shards of a tensor must tile it; a load of a tensor whose stored shards overlap
or leave a gap raises :class:`~ckptstore.errors.ShardCoverageError` (naming the tensor and the
box) before anything is read, a request the metadata cannot serve
:class:`~ckptstore.errors.ShardMismatchError`, a shard whose bytes fail verification
:class:`~ckptstore.errors.ShardDamagedError` (naming the rank, its stream and the shard).
Layout and byte-range rules: format-spec/dcp.md §3-§5.

Errors DCP catches come back wrapped in its ``CheckpointException`` (``failures[rank][0]`` is the
ckptstore error). The typed errors a caller most often wants are raised before DCP runs: the
constructors and ``reset(checkpoint_id)`` raise ``NotFoundError`` (no such iteration),
``DCPError`` (an iteration that holds no DCP checkpoint, a bad checkpoint_id),
``IterationOrderError`` (a writer's iteration not after the latest) and ``ReadOnlyStoreError``.

A writer is used by one save at a time (``async_save`` runs it in DCP's thread; wait for the
future before the next save with the same writer, or with the same job store).
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import math
import os
import uuid
from collections import ChainMap
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..engine.read_path import RangeRead, read_ranges
from ..errors import (DamagedCheckpointError, DCPError, FormatError, IterationOrderError,
                     NotFoundError, ReadOnlyStoreError, ShardCoverageError, ShardDamagedError,
                     ShardMismatchError, StoreIOError, UnsupportedTypeError)
from ..format.state import Path, flatten, format_path, top_level_items, unflatten
from ..multirank.job_store import JobStore
from ..store import Store
from ..tensors import TORCH_DTYPES, empty_torch

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
    from torch.distributed.checkpoint.planner import (LoadPlan, LoadPlanner, ReadItem, SavePlan,
                                                      SavePlanner, WriteItem)
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

__all__ = ["StorageWriter", "StorageReader", "FORMAT", "FORMAT_VERSION", "Layout", "TensorLayout",
           "ShardLayout", "ValueLayout", "is_dcp", "layout", "layout_of", "load_full_state_dict",
           "check_state_dict", "VOTE_KEY"]

#: the marker of a DCP iteration (``state["dcp"]["format"]``) and its layout version
FORMAT = "ckptstore.dcp"
FORMAT_VERSION = 1
#: bytes of scratch buffers one read batch may hold (boxes read into scratch, then copied)
SCRATCH_BATCH = 64 << 20

_DTYPE_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in TORCH_DTYPES.items()}
_MEMORY_FORMATS: dict[str, torch.memory_format] = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve_format": torch.preserve_format,
}
_MEMORY_FORMAT_NAMES = {v: k for k, v in _MEMORY_FORMATS.items()}
_registered = False


def _register() -> None:
    """Import DCP (first use only) and register the two classes as virtual subclasses of its
    interfaces."""
    global _registered
    if not _registered:
        from torch.distributed.checkpoint import storage

        storage.StorageWriter.register(StorageWriter)
        storage.StorageReader.register(StorageReader)
        _registered = True


def iteration_of(checkpoint_id: Any) -> int:
    """The iteration a DCP ``checkpoint_id`` names: a non-negative int, or a string of ASCII
    decimal digits. Raises DCPError for anything else."""
    if type(checkpoint_id) is int and 0 <= checkpoint_id < 1 << 63:
        return checkpoint_id
    if type(checkpoint_id) is str and checkpoint_id.isascii() and checkpoint_id.isdigit() \
            and len(checkpoint_id) <= 19 and int(checkpoint_id) < 1 << 63:
        return int(checkpoint_id)
    raise DCPError(f"checkpoint_id {checkpoint_id!r} is not an iteration: ckptstore.dcp takes an "
                   "int >= 0 or a string of decimal digits")


def _valid_id(checkpoint_id: Any) -> bool:
    try:
        iteration_of(checkpoint_id)
    except DCPError:
        return False
    return True


# ---- the metadata, encoded in the store's state encoding ------------------------------------------

def _plain(x: Any, path: Path) -> None:
    """flatten() hook for values that must hold no array: refuses tensors and arrays."""
    if isinstance(x, torch.Tensor) or type(x).__module__.split(".")[0] == "numpy":
        raise UnsupportedTypeError(f"a {type(x).__module__}.{type(x).__qualname__} at "
                                   f"{format_path(path)}")
    return None


def _dtype_name(dtype: Any, fqn: str) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise UnsupportedTypeError(f"DCP key {fqn!r}: tensor dtype {dtype} is not supported")
    return name


def encode_metadata(md: Metadata) -> dict[str, Any]:
    """DCP's Metadata as a JSON-like structure of the state encoding (its storage_data must map
    MetadataIndex -> store key, or -> (rank, store key) for an item another rank's state holds).
    Raises UnsupportedTypeError for what the encoding cannot hold."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    entries: list[Any] = []
    for fqn, v in md.state_dict_metadata.items():
        if type(fqn) is not str:
            raise UnsupportedTypeError(f"DCP key {fqn!r} is not a str")
        if isinstance(v, BytesStorageMetadata):
            entries.append([fqn, {"type": "bytes"}])
        elif isinstance(v, TensorStorageMetadata):
            p = v.properties
            if p.layout != torch.strided:
                raise UnsupportedTypeError(f"DCP key {fqn!r}: layout {p.layout} is not supported")
            mf = _MEMORY_FORMAT_NAMES.get(p.memory_format)
            if mf is None:
                raise UnsupportedTypeError(f"DCP key {fqn!r}: memory format {p.memory_format} "
                                           "is not supported")
            entries.append([fqn, {
                "type": "tensor", "dtype": _dtype_name(p.dtype, fqn), "size": [int(n) for n in v.size],
                "layout": "strided", "requires_grad": bool(p.requires_grad), "memory_format": mf,
                "pin_memory": bool(p.pin_memory),
                "chunks": [[[int(n) for n in c.offsets], [int(n) for n in c.sizes]]
                           for c in v.chunks]}])
        else:
            raise UnsupportedTypeError(f"DCP key {fqn!r}: storage metadata of type "
                                       f"{type(v).__qualname__} is not supported")
    try:
        flatten(md.planner_data, _plain)
    except UnsupportedTypeError as e:
        raise UnsupportedTypeError(f"DCP planner_data cannot be stored without pickling: {e}; "
                                   "ckptstore.dcp stores JSON-like planner data only") from e
    sm = md.storage_meta
    storage = []
    for index, where in (md.storage_data or {}).items():
        row: list[Any] = [index.fqn, None if index.offset is None else
                          [int(n) for n in index.offset]]
        if type(where) is str:      # the item is in this state's "items"
            row.append(where)
        else:                       # (rank, key): in that rank's state of the iteration
            rank, key = where
            row += [key, int(rank)]
        storage.append(row)
    return {
        "version": md.version,
        "state_dict_metadata": entries,
        "planner_data": md.planner_data,
        "storage_meta": None if sm is None else {
            "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
            "save_id": sm.save_id, "load_id": sm.load_id, "modules": list(sm.modules)},
        "storage": storage,
    }


class _Bad(Exception):
    pass


def _need(ok: bool, why: str) -> None:
    if not ok:
        raise _Bad(why)


def _ints(x: Any, what: str, low: int = 0) -> list[int]:
    _need(type(x) is list and all(type(n) is int and n >= low for n in x),
          f"{what} is not a list of ints >= {low}")
    return x


def _opt_str(x: Any, what: str) -> str | None:
    _need(x is None or type(x) is str, f"{what} is not a string")
    return x


def decode_metadata(doc: Any) -> tuple[Metadata, dict[Any, tuple[int | None, str]]]:
    """Rebuild torch's Metadata from :func:`encode_metadata`'s structure. Returns it and its
    storage map (MetadataIndex -> (rank, store key); rank None: the state holding the metadata).
    Raises _Bad for anything malformed."""
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                       Metadata, MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)

    _need(type(doc) is dict, "metadata is not a dict")
    entries = doc.get("state_dict_metadata")
    _need(type(entries) is list, "state_dict_metadata is not a list")
    sdm: dict[str, Any] = {}
    for item in entries:
        _need(type(item) is list and len(item) == 2 and type(item[0]) is str
              and type(item[1]) is dict, "a state_dict_metadata entry is malformed")
        fqn, v = item
        _need(fqn not in sdm, f"key {fqn!r} appears twice")
        kind = v.get("type")
        if kind == "bytes":
            sdm[fqn] = BytesStorageMetadata()
            continue
        _need(kind == "tensor", f"key {fqn!r}: unknown entry type {kind!r}")
        dtype = TORCH_DTYPES.get(v.get("dtype")) if type(v.get("dtype")) is str else None
        if dtype is None:
            raise _Bad(f"key {fqn!r}: unknown dtype {v.get('dtype')!r}")
        _need(v.get("layout") == "strided", f"key {fqn!r}: unknown layout {v.get('layout')!r}")
        mf = _MEMORY_FORMATS.get(v.get("memory_format")) if type(v.get("memory_format")) is str \
            else None
        if mf is None:
            raise _Bad(f"key {fqn!r}: unknown memory format {v.get('memory_format')!r}")
        _need(type(v.get("requires_grad")) is bool and type(v.get("pin_memory")) is bool,
              f"key {fqn!r}: requires_grad/pin_memory are not booleans")
        size = _ints(v.get("size"), f"key {fqn!r}: size")
        chunks = v.get("chunks")
        _need(type(chunks) is list, f"key {fqn!r}: chunks is not a list")
        cs = []
        for c in chunks:
            _need(type(c) is list and len(c) == 2, f"key {fqn!r}: a chunk is malformed")
            offsets = _ints(c[0], f"key {fqn!r}: chunk offsets")
            sizes = _ints(c[1], f"key {fqn!r}: chunk sizes")
            _need(len(offsets) == len(sizes) == len(size) and
                  all(o + n <= d for o, n, d in zip(offsets, sizes, size)),
                  f"key {fqn!r}: a chunk lies outside the tensor")
            cs.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        props = TensorProperties(dtype=dtype, layout=torch.strided,
                                 requires_grad=v["requires_grad"], memory_format=mf,
                                 pin_memory=v["pin_memory"])
        sdm[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=cs)
    sm_doc = doc.get("storage_meta")
    sm: StorageMeta | None = None
    if sm_doc is not None:
        _need(type(sm_doc) is dict, "storage_meta is not a dict")
        modules = sm_doc.get("modules", [])
        _need(type(modules) is list and all(type(m) is str for m in modules),
              "storage_meta.modules is not a list of strings")
        sm = StorageMeta(checkpoint_id=_opt_str(sm_doc.get("checkpoint_id"), "checkpoint_id"),
                         save_id=_opt_str(sm_doc.get("save_id"), "save_id"),
                         load_id=_opt_str(sm_doc.get("load_id"), "load_id"), modules=modules)
    storage: dict[Any, tuple[int | None, str]] = {}
    plain: dict[Any, Any] = {}
    rows = doc.get("storage")
    _need(type(rows) is list, "storage is not a list")
    for row in rows:
        _need(type(row) is list and len(row) in (3, 4) and type(row[0]) is str
              and type(row[2]) is str and (len(row) == 3 or (type(row[3]) is int and row[3] >= 0)),
              "a storage entry is malformed")
        offset = None if row[1] is None else torch.Size(_ints(row[1], "a storage offset"))
        index = MetadataIndex(row[0], offset)
        _need(index not in storage, f"key {row[0]!r} at offset {row[1]} is stored twice")
        rank = row[3] if len(row) == 4 else None
        storage[index] = (rank, row[2])
        plain[index] = row[2] if rank is None else (rank, row[2])
    md = Metadata(state_dict_metadata=sdm, planner_data=doc.get("planner_data"),
                  storage_data=plain, storage_meta=sm,
                  version=_opt_str(doc.get("version"), "version"))
    return md, storage


def _storage_key(index: MetadataIndex, taken: dict[str, Any]) -> str:
    """The store key of a write item: its fqn, ``@offsets`` appended for a chunk away from the
    origin, ``#`` appended while the key is taken."""
    key = index.fqn
    if index.offset is not None and any(index.offset):
        key += "@" + ",".join(str(int(n)) for n in index.offset)
    while key in taken:
        key += "#"
    return key


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


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _multi_rank(store: Any) -> bool:
    """Whether a save into ``store`` is multi-rank: a job store written by several ranks."""
    return isinstance(store, JobStore) and (store.world_size or 1) > 1


def _writable(store: Any) -> None:
    if not isinstance(store, (Store, JobStore)):
        raise TypeError(f"ckptstore.dcp needs a ckptstore Store or JobStore, not {type(store)!r}")
    store.check()
    if store.mode != "a":
        raise ReadOnlyStoreError(f'store {store.path} is open read-only (mode="r")')


def _assign_keys(items: Sequence[WriteItem]) -> list[str]:
    """The store keys of one rank's write items, in plan order (:func:`_storage_key`): a pure
    function of the items, so the coordinator and the rank that writes them agree."""
    taken: dict[str, None] = {}
    for item in items:
        taken[_storage_key(item.index, taken)] = None
    return list(taken)


def _offset_of(index: MetadataIndex) -> list[int] | None:
    return None if index.offset is None else [int(n) for n in index.offset]


def _dcp_version(default: str | None) -> str | None:
    try:
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
        return CURRENT_DCP_VERSION
    except ImportError:  # pragma: no cover - older torch
        return default


def _resolved(value: Any) -> Future[Any]:
    from torch.futures import Future

    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


def _check_coverage(md: Metadata, storage: dict[Any, tuple[int, str]]) -> None:
    """Every item DCP's metadata names has exactly one writer in the global plan, and nothing
    else is written."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    want = set()
    for fqn, v in md.state_dict_metadata.items():
        if isinstance(v, BytesStorageMetadata):
            want.add(MetadataIndex(fqn))
        else:
            want.update(MetadataIndex(fqn, c.offsets) for c in v.chunks)
    have = set(storage)
    if want != have:
        lost, extra = sorted(i.fqn for i in want - have), sorted(i.fqn for i in have - want)
        raise DCPError(f"DCP's metadata and the global plan disagree: {len(lost)} items no rank "
                       f"writes {lost[:5]}, {len(extra)} writes the metadata lacks {extra[:5]}")


# ---- writing ----------------------------------------------------------------------------------------

class StorageWriter:
    """DCP's ``StorageWriter`` over a ckptstore store (see the module docstring): each
    ``dcp.save``/``dcp.async_save`` commits one iteration, ``iteration`` here or the
    ``checkpoint_id`` given to DCP. ``meta``: the iteration's user meta (JSON-like). Over a
    :class:`~ckptstore.JobStore` of several ranks, every rank makes its own writer and the save
    commits through the job store's global commit (module docstring, "Many ranks")."""

    def __init__(self, store: Store | JobStore, iteration: int | str | None = None, *,
                 meta: dict | None = None) -> None:
        _register()
        _writable(store)
        self.store = store
        self.meta = meta
        self.iteration: int | None = None
        if iteration is not None:
            self.iteration = self._checked(iteration_of(iteration))
        #: the SaveStats of the last committed save (written and deduplicated bytes; of this
        #: rank's part in a multi-rank save)
        self.last_stats: Any = None
        self.save_id = str(uuid.uuid4())
        self._staged: dict[str, Any] | None = None
        self.rank: int | None = None
        # a multi-rank save (a job store of several ranks), set up by set_up_storage_writer
        self._multi = False
        self._coordinator = False
        self._plans: list[SavePlan] | None = None
        #: the coordinator's committed (DCP metadata, storage map, encoded metadata)
        self._committed: tuple[Metadata, dict[Any, tuple[int, str]], dict[str, Any]] | None = None
        self._done = False
        #: why this rank's part of the last multi-rank save failed in write_data or finish (None:
        #: it did not fail there): the typed error (GlobalCommitAbortedError, RankMismatchError,
        #: CommitOutcomeUnknownError, DCPError, ...) that DCP wraps in its CheckpointException
        self.error: BaseException | None = None

    def _checked(self, iteration: int) -> int:
        latest = self.store.latest()
        if latest is not None and iteration <= latest:
            raise IterationOrderError(f"{self.store.path}: iteration {iteration} is not after the "
                                      f"latest committed iteration {latest}")
        return iteration

    @property
    def checkpoint_id(self) -> str | None:
        """The iteration the next save commits, as DCP's checkpoint_id (a string of digits)."""
        return None if self.iteration is None else str(self.iteration)

    def reset(self, checkpoint_id: str | os.PathLike | int | None = None) -> None:
        """A new save begins; ``checkpoint_id`` (when given) names its iteration."""
        if checkpoint_id is not None:
            self.iteration = self._checked(iteration_of(checkpoint_id))
        self._staged = None
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = kwargs.get("rank")
        self._staged, self._plans, self._committed, self._done = None, None, None, False
        self.error = None
        self._multi = _multi_rank(self.store)
        if self._multi:
            self._set_up_multi(bool(is_coordinator), kwargs.get("use_collectives", True))
            return
        if kwargs.get("use_collectives", True) is False and _world_size() > 1:
            # every rank would run to DCP's closing barrier on its own: refuse on all of them
            raise DCPError("ckptstore.dcp does not support use_collectives=False in a process "
                           "group of several ranks")
        if not is_coordinator:
            raise DCPError(f"rank {self.rank}: this save runs on several ranks, and a "
                           f"{type(self.store).__name__} of one writer takes saves from one "
                           "process; open a job store on every rank (ckptstore.open(path, 'a', "
                           "process_group=...)) for a multi-rank save")
        _writable(self.store)
        if self.iteration is None:
            raise DCPError("no iteration to save: pass StorageWriter(store, iteration) or "
                           "checkpoint_id= to dcp.save")
        self._checked(self.iteration)

    def _set_up_multi(self, is_coordinator: bool, use_collectives: Any) -> None:
        store = self.store
        assert isinstance(store, JobStore)
        if use_collectives is False:
            raise DCPError(f"{store.path}: a multi-rank save commits through a global round every "
                           "rank runs inside DCP's collectives: use_collectives=False is not "
                           "supported")
        _writable(store)
        if self.rank is not None and self.rank != store.rank:
            raise DCPError(f"{store.path}: DCP's rank {self.rank} is not the job store's rank "
                           f"{store.rank}: save over the process group the store was opened with")
        if store.running_pipeline is not None:
            raise DCPError(f"{store.path}: the job store's async pipeline runs its commit rounds; "
                           "ckptstore.dcp commits through DCP's own collectives and cannot share "
                           "the stream with it (use a job store without async saves, or "
                           "dcp.async_save)")
        if is_coordinator != (store.rank == 0):
            raise DCPError(f"{store.path}: rank {store.rank} of the job store is "
                           f"{'' if is_coordinator else 'not '}DCP's coordinator: the global commit "
                           "is written by the job store's rank 0 in DCP's finish, so DCP's "
                           "coordinator must be rank 0 (dcp.save's; coordinator_rank=0)")
        if store.pending():
            raise DCPError(f"{store.path}: rank {store.rank} has deltas pending commit; flush() "
                           "the job store before a DCP save")
        if self.iteration is None:
            raise DCPError("no iteration to save: pass StorageWriter(store, iteration) or "
                           "checkpoint_id= to dcp.save")
        prepared = store.prepared
        if is_coordinator:
            prepared.begin_save()  # from here no decide can commit an earlier save's prepare
        self._checked(self.iteration)
        self._coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """One process: checks that there is one plan. Many ranks (the coordinator): gives each
        rank's plan the store keys of its items (``storage_data``, JSON-like)."""
        if not self._multi:
            if len(plans) != 1:
                raise DCPError(f"this save has {len(plans)} ranks and {type(self.store).__name__} "
                               "takes saves from one process; use a job store for multi-rank saves")
            return plans
        store = self.store
        assert isinstance(store, JobStore)
        if len(plans) != store.world_size:
            raise DCPError(f"{store.path}: this save runs on {len(plans)} ranks, the job store on "
                           f"{store.world_size}: save over the process group the store was opened "
                           "with")
        out = []
        for r, plan in enumerate(plans):
            if not getattr(plan, "usable", True):
                # DCP's plan cache: that rank reuses its cached final plan, whose storage data was
                # made here from the same items
                out.append(plan)
                continue
            keys = _assign_keys(plan.items)
            data = {"format": FORMAT, "rank": r, "coordinator": store.rank,
                    "keys": [[item.index.fqn, _offset_of(item.index), key]
                             for item, key in zip(plan.items, keys)]}
            out.append(dataclasses.replace(plan, storage_data=data))
        self._plans = out
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """One process: resolve and check every item of the plan; nothing is written until
        :meth:`finish`. Many ranks (no collective of ckptstore's own): resolve this rank's items
        and *prepare* them (the coordinator's with DCP's metadata) as this rank's part of the
        iteration: durable in its stream, not visible; the results end with this rank's vote,
        which DCP gathers for the coordinator's :meth:`finish` (the global commit)."""
        if not self._multi:
            self._staged, results = self._stage(plan, planner, _assign_keys(plan.items))
            return _resolved(results)
        store = self.store
        assert isinstance(store, JobStore) and self.iteration is not None
        try:
            staged, results = self._stage(plan, planner, self._keys_of(plan))
            if self._coordinator:
                head = self._metadata_head(planner)
            else:
                head = {"format": FORMAT, "version": FORMAT_VERSION,
                        "metadata_rank": plan.storage_data["coordinator"]}
            state = {"dcp": head, "items": staged}
            self.last_stats, vote = store.prepared.prepare(self.iteration, state, self.meta)
        except BaseException as e:
            self.error = e
            raise
        results.append(_vote_result(store.rank or 0, self.iteration, vote))
        self._done = True
        return _resolved(results)

    def _stage(self, plan: SavePlan, planner: SavePlanner, keys: list[str]
               ) -> tuple[dict[str, Any], list[WriteResult]]:
        """Every item of the plan, resolved and checked, by store key; and its WriteResult."""
        from torch.distributed.checkpoint.planner import WriteItemType
        from torch.distributed.checkpoint.storage import WriteResult

        staged: dict[str, Any] = {}
        results: list[WriteResult] = []
        for item, key in zip(plan.items, keys, strict=True):
            if item.type == WriteItemType.BYTE_IO:
                value = _object_of(item, planner)
                size = len(json.dumps(flatten(value, _plain)[0]))
            else:
                value = planner.resolve_data(item)
                if not isinstance(value, torch.Tensor):
                    raise DCPError(f"DCP key {item.index.fqn!r}: the planner resolved a tensor item "
                                   f"to a {type(value).__qualname__}")
                value = value.detach()
                want = None if item.tensor_data is None else tuple(item.tensor_data.chunk.sizes)
                if want is not None and tuple(value.shape) != want:
                    raise DCPError(f"DCP key {item.index.fqn!r}: the planner resolved a chunk of "
                                   f"sizes {list(want)} to a tensor of shape {list(value.shape)}")
                size = value.numel() * value.element_size()
            staged[key] = value
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=key))
        return staged, results

    def _keys_of(self, plan: SavePlan) -> list[str]:
        """The store keys the coordinator gave this rank's items (checked against the items)."""
        rank = self.store.rank if isinstance(self.store, JobStore) else 0
        data = plan.storage_data
        rows = data.get("keys") if type(data) is dict and data.get("format") == FORMAT else None
        if type(rows) is not list or data.get("rank") != rank or \
                type(data.get("coordinator")) is not int:
            raise DCPError(f"rank {rank}: the plan DCP passed to write_data carries no "
                           "store keys for this rank from ckptstore.dcp's prepare_global_plan")
        if len(rows) != len(plan.items) or any(
                type(row) is not list or len(row) != 3 or row[0] != item.index.fqn
                or row[1] != _offset_of(item.index) or type(row[2]) is not str
                for row, item in zip(rows, plan.items)):
            raise DCPError(f"rank {rank}: the plan's items are not those the "
                           "coordinator planned (a planner's finish_plan changed them?)")
        return [row[2] for row in rows]

    def _metadata_head(self, planner: SavePlanner) -> dict[str, Any]:
        """The coordinator's ``dcp`` head: DCP's metadata of the whole save, with the storage
        map naming the rank and key of every item."""
        from torch.distributed.checkpoint.default_planner import (DefaultSavePlanner,
                                                                  create_default_global_save_plan)
        from torch.distributed.checkpoint.metadata import Metadata

        store = self.store
        assert isinstance(store, JobStore)
        plans = self._plans
        if plans is None or not all(getattr(p, "usable", True) for p in plans):
            # DCP's plan cache sent unusable plans: the default planner holds the full ones
            plans = getattr(planner, "global_plan", None) \
                if isinstance(planner, DefaultSavePlanner) else None
            if type(plans) is not list or len(plans) != store.world_size:
                raise DCPError("the coordinator has no global plan of every rank (a planner with "
                               "plan caching that is not a DefaultSavePlanner?)")
        storage: dict[Any, tuple[int, str]] = {}
        for r, p in enumerate(plans):
            for item, key in zip(p.items, _assign_keys(p.items)):
                storage[item.index] = (r, key)
        md: Any = None
        if isinstance(planner, DefaultSavePlanner) and \
                type(planner).create_global_plan is DefaultSavePlanner.create_global_plan:
            md = getattr(planner, "metadata", None)   # the Metadata DCP passes to finish()
        if not isinstance(md, Metadata):
            _, md = create_default_global_save_plan(list(plans), rewrite_index_hints=False)
            data = [p.planner_data for p in plans]
            if data and all(isinstance(d, dict) for d in data):
                md.planner_data = dict(ChainMap(*data))
        _check_coverage(md, storage)
        full = dataclasses.replace(md, storage_data=dict(storage), storage_meta=self.storage_meta(),
                                   version=_dcp_version(md.version))
        doc = encode_metadata(full)
        self._committed = (md, storage, doc)
        return {"format": FORMAT, "version": FORMAT_VERSION, "metadata": doc}

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """One process: store the metadata and every item as the iteration, and commit it
        (durable when this returns). Many ranks: nothing is left to commit (every rank committed
        in write_data); the metadata DCP returns gets the storage map."""
        if self._multi:
            self._finish_multi(metadata, results)
            return
        staged, self._staged = self._staged, None
        if staged is None:
            raise DCPError("finish() without write_data(): nothing to commit")
        assert self.iteration is not None
        metadata.version = _dcp_version(metadata.version)
        storage = {}
        for per_rank in results:
            for wr in per_rank:
                if type(wr.storage_data) is not str or wr.storage_data not in staged:
                    raise DCPError(f"DCP key {wr.index.fqn!r}: write result {wr.storage_data!r} "
                                   "names no item this writer staged")
                storage[wr.index] = wr.storage_data
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        state = {"dcp": {"format": FORMAT, "version": FORMAT_VERSION,
                         "metadata": encode_metadata(metadata)},
                 "items": staged}
        self.last_stats = self.store.save(self.iteration, state, meta=self.meta)

    def _finish_multi(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The global commit (the coordinator, after DCP gathered every rank's results): check
        the metadata and every rank's results, then decide on every rank's vote. Any failure
        before the decision commits nothing (the coordinator's prepared part is cut back; the
        others' are cut at their next save)."""
        store = self.store
        assert isinstance(store, JobStore)
        committed, self._committed = self._committed, None
        try:
            if committed is None or not self._done:
                raise DCPError("finish() without a prepared write_data()")
            md, storage, doc = committed
            it = self.iteration
            assert it is not None
            if metadata is not md:
                theirs = encode_metadata(dataclasses.replace(metadata, storage_data={}))
                if (theirs["state_dict_metadata"], theirs["planner_data"]) != \
                        (doc["state_dict_metadata"], doc["planner_data"]):
                    raise DCPError(f"iteration {it}: the metadata DCP passed to finish() differs "
                                   "from the one ckptstore.dcp computed from the global plan and "
                                   "prepared (a planner whose create_global_plan makes its own); "
                                   "nothing is committed")
            votes = _votes_of(results, it, store.world_size or 0)
            for r, per_rank in enumerate(results):
                for wr in per_rank[:-1]:
                    if storage.get(wr.index) != (r, wr.storage_data):
                        raise DCPError(f"iteration {it}: rank {r}'s write result for "
                                       f"{wr.index.fqn!r} is not the item the plan gave it")
        except BaseException as e:
            self.error = e
            store.prepared.abandon()
            raise
        try:
            store.prepared.decide(it, votes)  # the global commit point
        except BaseException as e:
            self.error = e
            raise
        metadata.version = _dcp_version(metadata.version)
        metadata.storage_data = dict(storage)
        metadata.storage_meta = self.storage_meta()

    def storage_meta(self) -> StorageMeta | None:
        from torch.distributed.checkpoint.metadata import StorageMeta

        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike | int) -> bool:
        """Whether ``checkpoint_id`` names an iteration (an int >= 0 or a string of digits)."""
        return _valid_id(checkpoint_id)


#: the DCP key of the extra WriteResult that carries a rank's vote (a NUL never starts an fqn)
VOTE_KEY = "\x00ckptstore.dcp.vote"


def _vote_result(rank: int, iteration: int, vote: bytes) -> WriteResult:
    """The WriteResult that carries this rank's PREPARED vote to the coordinator's finish through
    DCP's gather (plain data: the vote's bytes, multirank/messages.py, as hex)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    return WriteResult(index=MetadataIndex(VOTE_KEY), size_in_bytes=0,
                       storage_data={"format": FORMAT, "rank": rank, "iteration": iteration,
                                     "vote": vote.hex()})


def _votes_of(results: list[list[WriteResult]], iteration: int, world: int) -> list[bytes]:
    """Every rank's vote from DCP's gathered results (each rank's list ends with it), in rank
    order; DCPError naming the rank whose results carry none."""
    if len(results) != world:
        raise DCPError(f"iteration {iteration}: DCP gathered the results of {len(results)} ranks, "
                       f"the job store has {world}")
    votes = []
    for r, per_rank in enumerate(results):
        last = per_rank[-1] if per_rank else None
        data = getattr(last, "storage_data", None)
        if last is None or last.index.fqn != VOTE_KEY or type(data) is not dict or \
                data.get("format") != FORMAT or data.get("rank") != r or \
                data.get("iteration") != iteration or type(data.get("vote")) is not str:
            raise DCPError(f"iteration {iteration}: rank {r}'s write results carry no vote of "
                           "ckptstore.dcp's write_data for it (a writer subclass that changes "
                           "them?); nothing is committed")
        try:
            votes.append(bytes.fromhex(data["vote"]))
        except ValueError:
            raise DCPError(f"iteration {iteration}: rank {r}'s vote is not hex") from None
    return votes


def _object_of(item: WriteItem, planner: SavePlanner) -> Any:
    """The non-tensor value of a BYTE_IO item, checked to be storable natively."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    fqn = item.index.fqn
    cls = type(planner)
    if not (isinstance(planner, DefaultSavePlanner)
            and cls.resolve_data is DefaultSavePlanner.resolve_data
            and getattr(cls, "transform_object", None) is DefaultSavePlanner.transform_object):
        raise UnsupportedTypeError(
            f"DCP key {fqn!r}: the planner {cls.__qualname__} serializes non-tensor values its own "
            "way, and ckptstore.dcp stores none of them (reading them back would mean "
            "unpickling); use DefaultSavePlanner or store the value as a tensor")
    value = planner.lookup_object(item.index)
    try:
        flatten(value, _plain)
    except UnsupportedTypeError as e:
        raise UnsupportedTypeError(
            f"DCP key {fqn!r} holds a value ckptstore.dcp cannot store without pickling ({e}); "
            "non-tensor values must be None, bool, int, float, str, bytes or lists, tuples and "
            "dicts of them") from e
    return value


# ---- reading ----------------------------------------------------------------------------------------

class _Part:
    """One rank's state of a DCP iteration (the only one for a single-process save): the rank,
    the store (a rank stream of a job store) that holds it, its manifest and its items by store
    key."""

    def __init__(self, rank: int, source: Store, manifest: Any, items: dict[str, Any]) -> None:
        self.rank, self.source, self.manifest, self.items = rank, source, manifest, items


class StorageReader:
    """DCP's ``StorageReader`` over a ckptstore store (see the module docstring): loads the DCP
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
            _need(head is not None and items is not None, "")
            doc = unflatten(head, _no_leaf)
            _need(type(doc) is dict and doc.get("format") == FORMAT, "")
        except (_Bad, DCPError, FormatError):
            raise DCPError(f"{store.path}: iteration {iteration} holds no DCP checkpoint (it "
                           "was not saved through ckptstore.dcp)") from None
        try:
            _need(doc.get("version") == FORMAT_VERSION,
                  f"layout version {doc.get('version')!r} is not {FORMAT_VERSION}")
            entries = top_level_items(items)
            _need(entries is not None, "items is not a dict")
        except _Bad as e:
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
            md, storage = _decode_storage(doc.get("metadata"), world, head_rank)
            missing = [k for r, k in storage.values() if r == head_rank and k not in by_key]
            _need(not missing, f"the metadata names items the checkpoint lacks: {missing[:5]}")
        except _Bad as e:
            raise DCPError(f"{store.path}: iteration {iteration}: the DCP metadata does not "
                           f"decode: {e}") from None
        self.iteration, self._manifest, self._doc = iteration, manifest, doc["metadata"]
        self._head_rank, self._world, self._storage = head_rank, world, storage
        self._chunks, self._kinds = _chunks_of(md)
        self._coverage = _coverage_problems(md, storage, f"{store.path}: iteration {iteration}")
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
        return _valid_id(checkpoint_id)

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
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        first = sum(o * s for o, s in zip(offsets, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides))
        item = dtype.itemsize
        start, end = first * item, (last + 1) * item
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


# ---- layout: where each shard is stored, and whether the shards tile their tensors -----------------

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


def _chunks_of(md: Metadata) -> tuple[dict[Any, tuple[tuple[int, ...], tuple[int, ...]]],
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


def _coverage_problems(md: Metadata, storage: dict[Any, tuple[int, str]],
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


def _decode_storage(metadata: Any, world_size: int, metadata_rank: int
                    ) -> tuple[Metadata, dict[Any, tuple[int, str]]]:
    """DCP's Metadata and the storage map (MetadataIndex -> (rank, store key)) of encoded
    metadata held by rank ``metadata_rank`` of an iteration of ``world_size`` ranks. Raises _Bad."""
    md, rows = decode_metadata(metadata)
    storage = {index: (metadata_rank if r is None else r, key) for index, (r, key) in rows.items()}
    bad = sorted({r for r, _ in storage.values() if r >= world_size})
    _need(not bad, f"the metadata names ranks {bad}, the iteration has {world_size}")
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
        md, storage = _decode_storage(metadata, world_size, metadata_rank)
    except _Bad as e:
        raise DCPError(f"{where}: the DCP metadata does not decode: {e}") from None
    coverage = _coverage_problems(md, storage, where)
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
        tensors.append(TensorLayout(fqn, _DTYPE_NAMES[v.properties.dtype],
                                    tuple(int(n) for n in v.size), tuple(shards),
                                    coverage.get(fqn)))
    return Layout(path, iteration, world_size, metadata_rank, tuple(tensors), tuple(values))


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
