"""DCP's ``StorageWriter`` over a store: one save, one iteration (the package docstring says how a
save runs, on one process and on many ranks)."""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from typing import TYPE_CHECKING, Any

import torch

from ...errors import DCPError, IterationOrderError, ReadOnlyStoreError, UnsupportedTypeError
from ...format.state import flatten
from ...multirank.job_store import JobStore
from ...store import Store
from .metadata import FORMAT, FORMAT_VERSION, encode_metadata, iteration_of, plain_only, valid_id
from .planning import assign_keys, global_metadata, keys_of, plan_keys

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future


_registered = False


def _register() -> None:
    """Import DCP (first use only) and register :class:`StorageWriter` as a virtual subclass of its
    ``StorageWriter`` interface."""
    global _registered
    if not _registered:
        from torch.distributed.checkpoint import storage

        storage.StorageWriter.register(StorageWriter)
        _registered = True


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


class StorageWriter:
    """DCP's ``StorageWriter`` over a ckptstore store (see the package docstring): each
    ``dcp.save``/``dcp.async_save`` commits one iteration, ``iteration`` here or the
    ``checkpoint_id`` given to DCP. ``meta``: the iteration's user meta (JSON-like). Over a
    :class:`~ckptstore.JobStore` of several ranks, every rank makes its own writer and the save
    commits through the job store's global commit (package docstring, "Many ranks")."""

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
        out = plan_keys(plans, store.rank)
        self._plans = out
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """One process: resolve and check every item of the plan; nothing is written until
        :meth:`finish`. Many ranks (no collective of ckptstore's own): resolve this rank's items
        and *prepare* them (the coordinator's with DCP's metadata) as this rank's part of the
        iteration: durable in its stream, not visible; the results end with this rank's vote,
        which DCP gathers for the coordinator's :meth:`finish` (the global commit)."""
        if not self._multi:
            self._staged, results = self._stage(plan, planner, assign_keys(plan.items))
            return _resolved(results)
        store = self.store
        assert isinstance(store, JobStore) and self.iteration is not None
        try:
            staged, results = self._stage(plan, planner, keys_of(plan, store.rank))
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
                size = len(json.dumps(flatten(value, plain_only)[0]))
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

    def _metadata_head(self, planner: SavePlanner) -> dict[str, Any]:
        """The coordinator's ``dcp`` head: DCP's metadata of the whole save, with the storage
        map naming the rank and key of every item."""
        store = self.store
        assert isinstance(store, JobStore)
        md, storage = global_metadata(self._plans, planner, store.world_size)
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
        return valid_id(checkpoint_id)


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
        flatten(value, plain_only)
    except UnsupportedTypeError as e:
        raise UnsupportedTypeError(
            f"DCP key {fqn!r} holds a value ckptstore.dcp cannot store without pickling ({e}); "
            "non-tensor values must be None, bool, int, float, str, bytes or lists, tuples and "
            "dicts of them") from e
    return value
