"""ckptstore.dcp: the store as the storage layer of torch.distributed.checkpoint (the real DCP of
the pinned torch): round trips, dedup across iterations, atomic commit, partial and byte-range
reads, non-tensor values stored natively (never pickled), typed errors, async_save, fsck/gc,
one- and two-rank process groups, and ports of DCP's own no-dist CPU tests."""

from __future__ import annotations

import copy
import errno
import io
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem, WriteItemType
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ckptstore
import ckptstore.dcp as cdcp
from ckptstore.errors import (DCPError, DiskFullError, IterationOrderError, NotFoundError,
                              ReadOnlyStoreError, UnsupportedTypeError)
from ckptstore.ops.fsck import check as fsck
from ckptstore.storage.fileops import FileOps

from _ranks import run_ranks

MOD = __name__

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore:torch.distributed is unavailable:UserWarning")


# ---- helpers --------------------------------------------------------------------------------------

def make_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    return model, opt


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def dcp_state(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def save(store, iteration, state, **kw):
    return dcp.save(state, storage_writer=cdcp.StorageWriter(store, iteration), no_dist=True, **kw)


def load(store, iteration, state, **kw):
    reader = cdcp.StorageReader(store, iteration)
    dcp.load(state, storage_reader=reader, no_dist=True, **kw)
    return reader


def restore(store, iteration, seed=99):
    """A freshly initialised model + AdamW loaded from ``iteration`` through DCP."""
    model, opt = make_model(seed)
    train(model, opt, 1, seed)  # so the optimizer has state tensors to load into
    state = dcp_state(model, opt)
    load(store, iteration, state)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt


def snapshot(model, opt) -> dict:
    return copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})


def cause(exc_info) -> BaseException:
    """The ckptstore error inside DCP's CheckpointException (rank 0's)."""
    e = exc_info.value
    assert isinstance(e, CheckpointException), e
    return e.failures[0][0]


def log_bytes(store) -> int:
    seg = os.path.join(store.path, "segments")
    return sum(os.path.getsize(os.path.join(seg, f)) for f in os.listdir(seg))


@pytest.fixture
def store(tmp_path):
    with ckptstore.open(tmp_path / "s", mode="a") as s:
        yield s


# ---- round trips -----------------------------------------------------------------------------------

def test_model_and_adamw_round_trip_bit_exact(store, assert_same):
    model, opt = make_model(0)
    train(model, opt, 3, seed=1)
    expected = snapshot(model, opt)
    md = save(store, 1, dcp_state(model, opt))
    assert store.iterations() == [1]
    assert isinstance(md.storage_data[MetadataIndex("model.0.weight", [0, 0])], str)

    model2, opt2 = make_model(7)
    train(model2, opt2, 1, seed=5)
    ptrs = [p.data_ptr() for p in model2.parameters()]
    state = dcp_state(model2, opt2)
    load(store, 1, state)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert [p.data_ptr() for p in model2.parameters()] == ptrs  # loaded in place
    assert_same(expected, snapshot(model2, opt2))
    # training on from both gives the same bits
    train(model, opt, 2, seed=3)
    train(model2, opt2, 2, seed=3)
    assert_same(snapshot(model, opt), snapshot(model2, opt2))


def test_storage_interfaces_and_checkpoint_ids(store):
    from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

    w = cdcp.StorageWriter(store)
    assert isinstance(w, StorageWriter)
    assert cdcp.StorageWriter.validate_checkpoint_id(5)
    assert cdcp.StorageWriter.validate_checkpoint_id("0012")
    for bad in ("12a", "", "-1", -1, 1.0, True, "１２", b"12", "/tmp/x", None):
        assert not cdcp.StorageWriter.validate_checkpoint_id(bad), bad
        assert not cdcp.StorageReader.validate_checkpoint_id(bad), bad
    with pytest.raises(DCPError, match="not an iteration"):
        w.reset("abc")
    t = {"x": torch.arange(10.0)}
    dcp.save(t, checkpoint_id="3", storage_writer=w, no_dist=True)
    dcp.save(t, checkpoint_id=4, storage_writer=w, no_dist=True)
    assert store.iterations() == [3, 4]
    assert w.checkpoint_id == "4" and w.storage_meta().checkpoint_id == "4"
    with pytest.raises(IterationOrderError):
        w.reset(4)
    with pytest.raises(IterationOrderError):
        cdcp.StorageWriter(store, 2)
    r = cdcp.StorageReader(store)
    assert isinstance(r, StorageReader)
    out = {"x": torch.zeros(10)}
    dcp.load(out, checkpoint_id="0003", storage_reader=r, no_dist=True)
    assert torch.equal(out["x"], t["x"]) and r.iteration == 3
    out["x"].zero_()
    dcp.load(out, storage_reader=cdcp.StorageReader(store), no_dist=True)  # the latest
    assert torch.equal(out["x"], t["x"])
    # DCP's experimental rank-local mode, in one process
    dcp.save({"x": torch.ones(3)}, checkpoint_id=5, storage_writer=w, no_dist=True,
             use_collectives=False)
    assert store.iterations() == [3, 4, 5]


def test_metadata_rebuilt_exactly(store):
    model, opt = make_model(0)
    train(model, opt, 1, seed=1)
    state = dcp_state(model, opt)
    state["extra"] = {"bf": torch.ones(3, 5, dtype=torch.bfloat16), "name": "run-1", "k": (1, 2.5)}
    saved = save(store, 1, state)
    read = cdcp.StorageReader(store, 1).read_metadata()
    assert read.storage_meta.load_id is not None
    read.storage_meta.load_id = None
    assert read == saved
    assert read.planner_data == saved.planner_data and read.planner_data["extra.k"] == ("extra", "k")


def test_several_iterations_dedup_and_point_in_time(store, assert_same):
    model, opt = make_model(0)
    expected = {}
    for it in (10, 20, 30):
        train(model, opt, 1, seed=it)
        save(store, it, dcp_state(model, opt))
        expected[it] = snapshot(model, opt)
    save(store, 40, dcp_state(model, opt))          # unchanged since 30
    expected[40] = snapshot(model, opt)
    with torch.no_grad():
        model[2].bias.add_(1.0)                      # one small tensor changes
    save(store, 50, dcp_state(model, opt))
    expected[50] = snapshot(model, opt)

    full = store.info(10)
    tensor_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    assert full.logical_bytes >= tensor_bytes and full.written_bytes >= tensor_bytes
    assert store.info(20).written_bytes >= tensor_bytes       # everything changed
    same = store.info(40)
    assert same.logical_bytes == full.logical_bytes
    overhead = full.written_bytes - full.logical_bytes          # manifest (with DCP's metadata)
    assert same.written_bytes < overhead + 1024, (same, full)   # no tensor byte written again
    one = store.info(50).written_bytes                          # only the changed bias (inline)
    assert one < overhead + 2048, (one, full)
    for it in (10, 20, 30, 40, 50):
        model2, opt2 = restore(store, it)
        assert_same(expected[it], snapshot(model2, opt2), f"iteration {it}")


def test_tied_tensors_stored_once(store):
    w = torch.randn(256, 256)
    save(store, 1, {"a": w, "b": w.clone(), "c": torch.randn(256, 256)})
    info = store.info(1)
    assert info.logical_bytes == 3 * w.nbytes
    assert 2 * w.nbytes <= info.written_bytes < 2 * w.nbytes + 16384


def test_partial_load_reads_only_the_requested_tensors(store):
    model, opt = make_model(0)
    train(model, opt, 1, seed=1)
    save(store, 1, dcp_state(model, opt))
    out = {"model": {"0.weight": torch.zeros(128, 64)}}
    reader = load(store, 1, out)
    assert torch.equal(out["model"]["0.weight"], model[0].weight.detach())
    assert reader.last_read_bytes == 128 * 64 * 4
    # optimizer hyper-parameters only: no tensor data read at all
    out = {"optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}}
    reader = load(store, 1, out)
    assert out == {"optim": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999)}]}}
    assert reader.last_read_bytes == 0
    # a key the checkpoint lacks: DCP's own strict check, or skipped with allow_partial_load
    with pytest.raises(CheckpointException, match="Missing key"):
        load(store, 1, {"nope": torch.zeros(1)})
    out = {"nope": torch.zeros(1), "model": {"2.bias": torch.zeros(32)}}
    load(store, 1, out, planner=DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(out["model"]["2.bias"], model[2].bias.detach())


class BoxPlanner:
    """A minimal LoadPlanner for hand-made read items: destinations by fqn."""

    def __init__(self, dests):
        self.dests = dests
        self.committed = []

    def resolve_tensor(self, req):
        return self.dests[req.dest_index.fqn]

    def commit_tensor(self, req, tensor):
        self.committed.append(req.dest_index.fqn)


def box(fqn, offsets, lengths, dest_fqn=None):
    return ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(dest_fqn or fqn),
                    dest_offsets=torch.Size([0] * len(offsets)),
                    storage_index=MetadataIndex(fqn, [0] * len(offsets)),
                    storage_offsets=torch.Size(offsets), lengths=torch.Size(lengths))


def test_byte_range_reads(tmp_path):
    """Only the store chunks overlapping a requested box are read; contiguous boxes land
    straight in a contiguous destination."""
    chunk = 64 << 10
    big = torch.randn(1024, 256)                     # 1 MiB: 16 chunks of 64 KiB
    with ckptstore.open(tmp_path / "s", mode="a", chunk_size=chunk) as s:
        save(s, 1, {"big": big, "i8": torch.arange(100, dtype=torch.int8).reshape(10, 10)})
        reader = cdcp.StorageReader(s, 1)
        reader.read_metadata()
        rows = torch.empty(10, 256)
        ptr = rows.data_ptr()
        cols = torch.empty(1024, 3).t()              # not contiguous: read via scratch
        one = torch.empty(1, 1, dtype=torch.float64)  # another dtype: converted, as DCP does
        mid = torch.empty(3, 4, dtype=torch.int8)
        planner = BoxPlanner({"rows": rows, "cols": cols, "one": one, "mid": mid})
        plan = LoadPlan([box("big", [100, 0], [10, 256], "rows")])
        reader.read_data(plan, planner).wait()
        assert rows.data_ptr() == ptr and torch.equal(rows, big[100:110])
        assert reader.last_read_bytes == chunk      # 10 KiB inside one chunk
        plan = LoadPlan([box("big", [1000, 255], [1, 1], "one")])
        reader.read_data(plan, planner).wait()
        assert one.item() == big[1000, 255].item() and reader.last_read_bytes == chunk
        plan = LoadPlan([box("big", [63, 246], [2, 10], "x")])  # crosses a chunk boundary
        planner.dests["x"] = torch.empty(2, 10)
        reader.read_data(plan, planner).wait()
        assert torch.equal(planner.dests["x"], big[63:65, 246:256]) and reader.last_read_bytes == 2 * chunk
        cols_t = torch.empty(3, 1024)
        planner.dests["cols"] = cols_t.t()
        plan = LoadPlan([box("big", [0, 5], [1024, 3], "cols"), box("i8", [2, 3], [3, 4], "mid")])
        reader.read_data(plan, planner).wait()
        assert torch.equal(cols_t.t(), big[:, 5:8]) and torch.equal(mid, torch.arange(100, dtype=torch.int8).reshape(10, 10)[2:5, 3:7])
        assert planner.committed[-2:] == ["cols", "mid"]
        with pytest.raises(DCPError, match="outside the stored tensor"):
            reader.read_data(LoadPlan([box("big", [1020, 0], [10, 256], "rows")]), planner)
        with pytest.raises(DCPError, match="holds no item"):
            reader.read_data(LoadPlan([box("nope", [0], [1], "rows")]), planner)


# ---- non-tensor values: stored natively, never pickled ---------------------------------------------

def test_non_tensor_values_never_unpickled(store, monkeypatch, assert_same):
    values = {"lr": 0.5, "betas": (0.9, 0.999), "names": ["a", "b"], "none": None, "flag": True,
              "big": 2 ** 70, "nan": float("nan"), "neg0": -0.0, "raw": b"\x80\x04K\x01.",
              "text": "é\n", "nested": {"deep": [1, (2, "3")], "empty_list": []}}
    save(store, 1, {"t": torch.ones(2), "v": copy.deepcopy(values)})
    items = store.load(1)["items"]
    assert items["v.lr"] == 0.5 and items["v.betas"] == (0.9, 0.999)  # native, not bytes
    out = {"t": torch.zeros(2), "v": {k: None for k in values}}
    out["v"]["nested"] = {"deep": None, "empty_list": None}

    def refuse(*a, **k):
        raise AssertionError("unpickling attempted")

    import pickle
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    load(store, 1, out)
    monkeypatch.undo()
    assert_same({"t": torch.ones(2), "v": values}, out)


def test_custom_load_planner_gets_bytes_made_from_the_value(store):
    save(store, 1, {"step": 7, "lr": 0.25})

    class Mine(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            self.original_state_dict[read_item.dest_index.fqn] = (
                "mine", torch.load(value, weights_only=True))

    out = {"step": 0, "lr": 0.0}
    dcp.load(out, storage_reader=cdcp.StorageReader(store, 1), planner=Mine(), no_dist=True)
    assert out == {"step": ("mine", 7), "lr": ("mine", 0.25)}


class Opaque:
    pass


@pytest.mark.parametrize("value,what", [
    (Opaque(), "Opaque"), (torch.device("cpu"), "device"), ({1, 2}, "set"),
    ((torch.ones(2), 1), "Tensor"), (torch.float32, "dtype"), (torch.Size([2]), "Size")])
def test_unpicklable_values_refused_at_save(store, value, what):
    save(store, 1, {"ok": torch.ones(3)})
    size = log_bytes(store)
    with pytest.raises(CheckpointException) as ei:
        save(store, 2, {"ok": torch.ones(3), "sub": {"bad": value}})
    err = cause(ei)
    assert isinstance(err, UnsupportedTypeError) and "'sub.bad'" in str(err), err
    assert what in str(err)
    assert store.iterations() == [1]
    assert log_bytes(store) == size  # nothing was written
    save(store, 2, {"ok": torch.ones(3)})  # the next save works
    assert store.iterations() == [1, 2]


def test_custom_save_planner_serializing_objects_refused(store):
    class Own(DefaultSavePlanner):
        def transform_object(self, write_item, object):
            if write_item.type == WriteItemType.BYTE_IO:
                return io.BytesIO(b"my own bytes")
            return object

    with pytest.raises(CheckpointException) as ei:
        dcp.save({"x": torch.ones(2), "n": 3}, storage_writer=cdcp.StorageWriter(store, 1),
                 planner=Own(), no_dist=True)
    assert isinstance(cause(ei), UnsupportedTypeError) and "'n'" in str(cause(ei))
    # tensors only: the planner's own serialization is never asked for
    dcp.save({"x": torch.ones(2)}, storage_writer=cdcp.StorageWriter(store, 1), planner=Own(),
             no_dist=True)
    assert store.iterations() == [1]


# ---- typed errors ----------------------------------------------------------------------------------

def test_missing_iteration_and_non_dcp_iteration(store, tmp_path):
    out = {"x": torch.zeros(3)}
    with pytest.raises(NotFoundError):
        cdcp.StorageReader(store, 99)
    store.save(5, {"x": torch.ones(3)})                # a plain ckptstore checkpoint
    with pytest.raises(DCPError, match="holds no DCP checkpoint"):
        cdcp.StorageReader(store, 5)
    with pytest.raises(DCPError, match="holds no DCP checkpoint"):
        dcp.load(out, checkpoint_id=5, storage_reader=cdcp.StorageReader(store), no_dist=True)
    with pytest.raises(NotFoundError):
        dcp.load(out, checkpoint_id="77", storage_reader=cdcp.StorageReader(store), no_dist=True)
    with pytest.raises(DCPError):
        dcp.load(out, checkpoint_id="x7", storage_reader=cdcp.StorageReader(store), no_dist=True)
    # a read-only store cannot be written; it can be read
    save(store, 6, {"x": torch.full((3,), 2.0)})
    with ckptstore.open(store.path, mode="r") as r:
        with pytest.raises(ReadOnlyStoreError):
            cdcp.StorageWriter(r, 7)
        dcp.load(out, storage_reader=cdcp.StorageReader(r, 6), no_dist=True)
        assert torch.equal(out["x"], torch.full((3,), 2.0))
    # no iteration given anywhere
    with pytest.raises(CheckpointException) as ei:
        dcp.save(out, storage_writer=cdcp.StorageWriter(store), no_dist=True)
    assert isinstance(cause(ei), DCPError)


def hostile(store, it, metadata, items=None):
    store.save(it, {"dcp": {"format": "ckptstore.dcp", "version": 1, "metadata": metadata},
                    "items": items or {}})


@pytest.mark.parametrize("metadata", [
    None, [], {"state_dict_metadata": "x"},
    {"state_dict_metadata": [["a", {"type": "pickle"}]], "storage": []},
    {"state_dict_metadata": [["a", {"type": "tensor", "dtype": "object", "size": [1],
                                    "layout": "strided", "requires_grad": False,
                                    "memory_format": "contiguous_format", "pin_memory": False,
                                    "chunks": []}]], "storage": []},
    {"state_dict_metadata": [["a", {"type": "tensor", "dtype": "float32", "size": [2],
                                    "layout": "strided", "requires_grad": False,
                                    "memory_format": "contiguous_format", "pin_memory": False,
                                    "chunks": [[[1], [2]]]}]], "storage": []},
    {"state_dict_metadata": [], "storage": [["a", None, "missing"]]},
    {"state_dict_metadata": [], "storage": [], "storage_meta": {"modules": [1]}},
])
def test_malformed_metadata_is_a_typed_error(store, metadata):
    hostile(store, 1, metadata)
    with pytest.raises(DCPError, match="does not decode"):
        cdcp.StorageReader(store, 1)


def test_wrong_format_marker(store):
    store.save(1, {"dcp": {"format": "other", "version": 1, "metadata": {}}, "items": {}})
    store.save(2, {"dcp": {"format": "ckptstore.dcp", "version": 9, "metadata": {}}, "items": {}})
    store.save(3, {"dcp": torch.ones(2), "items": {}})
    with pytest.raises(DCPError, match="no DCP checkpoint"):
        cdcp.StorageReader(store, 1)
    with pytest.raises(DCPError, match="layout version"):
        cdcp.StorageReader(store, 2)
    with pytest.raises(DCPError, match="no DCP checkpoint"):
        cdcp.StorageReader(store, 3)


# ---- atomic commit, failures, async ---------------------------------------------------------------

class FullDisk(FileOps):
    armed = False

    def _pwritev(self, fd, buffers, offset):
        if self.armed:
            self.armed = False
            raise OSError(errno.ENOSPC, "injected")
        return super()._pwritev(fd, buffers, offset)


def test_disk_full_during_commit_leaves_nothing_visible(tmp_path, assert_same):
    ops = FullDisk()
    with ckptstore.open(tmp_path / "s", mode="a", file_ops=ops) as s:
        model, opt = make_model(0)
        save(s, 1, dcp_state(model, opt))
        first = snapshot(model, opt)
        train(model, opt, 1, seed=2)
        writer = cdcp.StorageWriter(s, 2)
        ops.armed = True
        with pytest.raises(CheckpointException) as ei:
            dcp.save(dcp_state(model, opt), storage_writer=writer, no_dist=True)
        assert isinstance(cause(ei), DiskFullError)
        assert s.iterations() == [1]
        with pytest.raises(NotFoundError):
            cdcp.StorageReader(s, 2)
        dcp.save(dcp_state(model, opt), storage_writer=writer, no_dist=True)  # retried cleanly
        assert s.iterations() == [1, 2]
        second = snapshot(model, opt)
        assert_same(first, snapshot(*restore(s, 1)))
        assert_same(second, snapshot(*restore(s, 2)))
    assert fsck(tmp_path / "s").clean


@pytest.mark.parametrize("stage", ["set_up_storage_writer", "prepare_local_plan",
                                   "prepare_global_plan", "write_data", "finish"])
def test_failure_at_every_stage_leaves_nothing_visible(store, stage):
    """Port of DCP's test_checkpoint.py FaultyStorageWriter: a failure at any step of the save
    raises CheckpointException; here also: nothing becomes visible and the next save works."""

    class Faulty(cdcp.StorageWriter):
        pass

    def boom(self, *a, **k):
        raise ValueError(f"injected in {stage}")

    setattr(Faulty, stage, boom)
    save(store, 1, {"x": torch.ones(4)})
    with pytest.raises(CheckpointException, match=f"injected in {stage}"):
        dcp.save({"x": torch.zeros(4)}, storage_writer=Faulty(store, 2), no_dist=True)
    assert store.iterations() == [1]
    save(store, 2, {"x": torch.zeros(4)})
    assert store.iterations() == [1, 2]


@pytest.mark.parametrize("stage", ["read_metadata", "set_up_storage_reader",
                                   "prepare_local_plan", "prepare_global_plan", "read_data"])
def test_reader_failure_at_every_stage(store, stage):
    save(store, 1, {"x": torch.ones(4)})

    class Faulty(cdcp.StorageReader):
        pass

    def boom(self, *a, **k):
        raise ValueError(f"injected in {stage}")

    setattr(Faulty, stage, boom)
    with pytest.raises((CheckpointException, AssertionError), match=f"injected in {stage}"):
        dcp.load({"x": torch.zeros(4)}, storage_reader=Faulty(store, 1), no_dist=True)


def test_async_save(store, assert_same):
    model, opt = make_model(0)
    train(model, opt, 2, seed=1)
    expected = snapshot(model, opt)
    fut = dcp.async_save(dcp_state(model, opt), storage_writer=cdcp.StorageWriter(store, 1),
                         no_dist=True)
    train(model, opt, 1, seed=9)  # the live tensors change while the save runs: not stored
    fut.result()
    assert store.iterations() == [1]
    assert_same(expected, snapshot(*restore(store, 1)))
    second = snapshot(model, opt)
    fut = dcp.async_save(dcp_state(model, opt), checkpoint_id=2,
                         storage_writer=cdcp.StorageWriter(store), no_dist=True)
    fut.result()
    assert_same(second, snapshot(*restore(store, 2)))


def test_async_save_failure_leaves_nothing_visible(store):
    fut = dcp.async_save({"x": torch.ones(2), "bad": Opaque()},
                         storage_writer=cdcp.StorageWriter(store, 1), no_dist=True)
    with pytest.raises(CheckpointException):
        fut.result()
    assert store.iterations() == []


def test_fsck_gc_and_point_in_time_restore(tmp_path, assert_same):
    path = tmp_path / "s"
    expected = {}
    with ckptstore.open(path, mode="a") as s:
        model, opt = make_model(0)
        for it in range(1, 6):
            train(model, opt, 1, seed=it)
            save(s, it, dcp_state(model, opt))
            expected[it] = snapshot(model, opt)
    assert fsck(path).clean
    with ckptstore.open(path, mode="a") as s:
        s.gc(keep_last=2)
        assert s.iterations() == [4, 5]
        with pytest.raises(NotFoundError):
            cdcp.StorageReader(s, 2)
        for it in (4, 5):
            assert_same(expected[it], snapshot(*restore(s, it)))
        train(model, opt, 1, seed=6)
        save(s, 6, dcp_state(model, opt))
        expected[6] = snapshot(model, opt)
    assert fsck(path).clean
    with ckptstore.open(path, mode="r") as r:
        for it in (4, 5, 6):
            assert_same(expected[it], snapshot(*restore(r, it)))


# ---- ports of DCP's no-dist CPU tests (test_file_system_checkpoint_cpu.py, test_checkpoint.py) ----

def test_read_write_only_tensor(store):
    """test_read_write_only_tensor: a tensor and a non-tensor value round trip."""
    sd = {"replicated": torch.rand(10, 10), "bytes": [1, 2, 3, 4]}
    save(store, 1, sd)
    out = {"replicated": torch.zeros(10, 10), "bytes": [5, 6, 7]}
    load(store, 1, out)
    assert torch.equal(sd["replicated"], out["replicated"]) and out["bytes"] == [1, 2, 3, 4]


def test_nested_lists_dtypes_scalars_empty_noncontiguous(store, assert_same):
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    sd = {
        "nested": {"a": {"b": torch.randn(3, 4), "c": [torch.ones(2), torch.zeros(3, 1)]}},
        "list": [torch.arange(5), {"in_list": torch.tensor(3.5)}],
        "scalar": torch.tensor(7, dtype=torch.int64),
        "dtypes": {str(dt): (torch.rand(4, 3) * 100).to(dt) for dt in
                   (torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
                    torch.int32, torch.bool, torch.complex64)},
        "empty": torch.empty(0), "empty2": torch.empty(3, 0, 2, dtype=torch.bfloat16),
        "transposed": base.t(), "strided": base[::2, 1::3], "expanded": torch.ones(3, 1).expand(3, 4),
        "neg": torch.randn(4, dtype=torch.complex64).conj(),
        "big": torch.randn(300, 300),
        "values": {"i": 3, "f": 0.1, "s": "x", "n": None, "t": (1, "a")},
    }
    expected = copy.deepcopy(sd)
    save(store, 1, sd)

    def blank(x):
        if isinstance(x, torch.Tensor):
            return torch.full_like(x.contiguous().resolve_conj(), 0)
        if isinstance(x, dict):
            return {k: blank(v) for k, v in x.items()}
        if isinstance(x, list):
            return [blank(v) for v in x]
        return None

    out = blank(sd)
    load(store, 1, out)

    def norm(x):  # layout aside (DCP loads into the caller's tensors), the values must be exact
        if isinstance(x, torch.Tensor):
            return x.resolve_conj().contiguous()
        if isinstance(x, dict):
            return {k: norm(v) for k, v in x.items()}
        if isinstance(x, list):
            return [norm(v) for v in x]
        return x

    assert_same(norm(expected), norm(out))
    # also into non-contiguous destinations of the original layouts
    out2 = {"transposed": torch.zeros(6, 8).t(), "strided": torch.zeros(3, 6)[:, ::2]}
    load(store, 1, out2)
    assert torch.equal(out2["transposed"], base.t()) and torch.equal(out2["strided"], base[::2, 1::3])


def test_load_into_a_different_layout_raises(store):
    sd = {"w": torch.randn(4, 5), "b": torch.randn(5)}
    save(store, 1, sd)
    out = {"w": torch.zeros(5, 4), "b": torch.zeros(5)}
    with pytest.raises(CheckpointException, match="Size mismatch"):
        load(store, 1, out)
    assert torch.equal(out["w"], torch.zeros(5, 4)) and torch.equal(out["b"], torch.zeros(5))
    with pytest.raises(CheckpointException, match="expected BytesStorageMetadata"):
        load(store, 1, {"w": 3, "b": torch.zeros(5)})  # a value where a tensor was stored


def test_load_state_dict_from_keys(store, assert_same):
    """DCP's _load_state_dict_from_keys (the empty-state planner): the whole state rebuilt from
    the metadata, and a subset of it."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    sd = {"model": {"w": torch.randn(4, 4), "b": torch.ones(4, dtype=torch.bfloat16)},
          "step": 12, "hp": {"betas": (0.9, 0.95)}}
    save(store, 1, sd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _load_state_dict_from_keys(storage_reader=cdcp.StorageReader(store, 1))
        assert_same(sd, got)
        got = _load_state_dict_from_keys({"model.w"}, storage_reader=cdcp.StorageReader(store, 1))
    assert list(got) == ["model"] and list(got["model"]) == ["w"]
    assert torch.equal(got["model"]["w"], sd["model"]["w"])


def test_store_views_of_a_dcp_iteration(store):
    save(store, 1, {"model": {"w": torch.ones(2, 2)}, "lr": 0.5})
    state = store.load(1)
    assert state["dcp"]["format"] == "ckptstore.dcp"
    assert torch.equal(state["items"]["model.w"], torch.ones(2, 2)) and state["items"]["lr"] == 0.5
    assert [d.path for d in store.manifest(1).tensors] == ["items/model.w"]


# ---- process groups (spawned gloo ranks) ------------------------------------------------------------

def one_rank(rank: int, world: int, path: str) -> list:
    """A one-rank process group: DCP runs its collectives; a Store and a one-rank JobStore."""
    import torch.distributed as dist

    out = []
    sd = {"w": torch.arange(12.0).reshape(3, 4), "n": 5}
    with ckptstore.open(os.path.join(path, "plain"), mode="a") as s:
        dcp.save(sd, storage_writer=cdcp.StorageWriter(s, 1))
        got = {"w": torch.zeros(3, 4), "n": 0}
        dcp.load(got, storage_reader=cdcp.StorageReader(s, 1))
        out.append(torch.equal(got["w"], sd["w"]) and got["n"] == 5)
    with ckptstore.open(os.path.join(path, "job"), mode="a", process_group=dist.group.WORLD) as js:
        dcp.save(sd, storage_writer=cdcp.StorageWriter(js, 3))
        got = {"w": torch.zeros(3, 4), "n": 0}
        dcp.load(got, storage_reader=cdcp.StorageReader(js, 3))
        out.append(torch.equal(got["w"], sd["w"]) and got["n"] == 5 and js.iterations() == [3])
    with ckptstore.open(os.path.join(path, "job"), mode="r") as r:
        got = {"w": torch.zeros(3, 4), "n": 0}
        dcp.load(got, storage_reader=cdcp.StorageReader(r, 3), no_dist=True)
        out.append(torch.equal(got["w"], sd["w"]))
    return out


def two_ranks(rank: int, world: int, path: str) -> dict:
    """Two ranks: a save is refused with DCPError on every rank (nothing committed); every rank
    loads an iteration saved by one process."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import CheckpointException

    res: dict = {}
    with ckptstore.open(os.path.join(path, "job2"), mode="a", process_group=dist.group.WORLD) as js:
        try:
            cdcp.StorageWriter(js, 1)
        except DCPError as e:
            res["job"] = type(e).__name__
        res["job_its"] = js.iterations()
    mine = os.path.join(path, f"own{rank}")
    with ckptstore.open(mine, mode="a") as s:
        try:
            dcp.save({"x": torch.ones(2)}, storage_writer=cdcp.StorageWriter(s, 1))
        except CheckpointException as e:
            res["save"] = sorted({type(f[0]).__name__ for f in e.failures.values()})
        try:  # no collectives: refused on every rank (none waits at DCP's closing barrier)
            dcp.save({"x": torch.ones(2)}, storage_writer=cdcp.StorageWriter(s, 1),
                     use_collectives=False)
        except DCPError as e:
            res["nocoll"] = type(e).__name__
        res["own_its"] = s.iterations()
    with ckptstore.open(os.path.join(path, "shared"), mode="r") as r:
        got = {"w": torch.zeros(64, 64), "lr": 0.0}
        dcp.load(got, storage_reader=cdcp.StorageReader(r, 7))
        res["load"] = bool(torch.equal(got["w"], torch.arange(4096.0).reshape(64, 64))) and got["lr"] == 0.5
    return res


def test_process_groups(tmp_path):
    shared = tmp_path / "shared"
    with ckptstore.open(shared, mode="a") as s:
        save(s, 7, {"w": torch.arange(4096.0).reshape(64, 64), "lr": 0.5})
    results = run_ranks(1, MOD, "one_rank", str(tmp_path), str(tmp_path / "w1"))
    assert results == [{"ok": [True, True, True]}], results
    results = run_ranks(2, MOD, "two_ranks", str(tmp_path), str(tmp_path / "w2"))
    assert all("ok" in r for r in results), results
    for r in results:
        assert r["ok"] == {"job": "DCPError", "job_its": [], "save": ["DCPError"],
                           "nocoll": "DCPError", "own_its": [], "load": True}, r
