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

The package, lowest first: ``metadata`` (the format marker, checkpoint ids, DCP's Metadata in the
state encoding), ``planning`` (the store keys of a save's plans and the global metadata made from
them), ``sharding`` (where each shard is stored, whether the shards tile their tensors),
``writing`` (:class:`StorageWriter`), ``reading`` (:class:`StorageReader` and the
whole-checkpoint views). The documented import path is ``ckptstore.dcp``.
"""

from .metadata import FORMAT, FORMAT_VERSION
from .reading import StorageReader, check_state_dict, is_dcp, layout, load_full_state_dict
from .sharding import Layout, ShardLayout, TensorLayout, ValueLayout, layout_of
from .writing import VOTE_KEY, StorageWriter

__all__ = ["StorageWriter", "StorageReader", "FORMAT", "FORMAT_VERSION", "Layout", "TensorLayout",
           "ShardLayout", "ValueLayout", "is_dcp", "layout", "layout_of", "load_full_state_dict",
           "check_state_dict", "VOTE_KEY"]
