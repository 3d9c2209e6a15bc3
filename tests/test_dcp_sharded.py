"""Sharded DCP checkpoints in job stores, seen whole by one process (ckptstore.dcp.layout,
load_full_state_dict, ``ckptstore show`` and ``ckptstore restore``): FSDP2 (fully_shard on CPU
over gloo) and DTensor states saved on real gloo groups of 2 and 4 ranks, assembled bit for bit
with no process group; shards that overlap or leave a gap, loads the metadata cannot serve and a
damaged shard of one rank, each a typed error naming the tensor, the box or the rank; a rank
SIGKILLed in the middle of a sharded commit (nothing visible, fsck clean, the next job saves).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import ckptstore
import ckptstore.dcp as cdcp
from ckptstore.cli import main as cli
from ckptstore.errors import (DCPError, NotFoundError, ShardCoverageError, ShardDamagedError,
                              ShardMismatchError)
from ckptstore.storage.fileops import FileOps
from ckptstore.storage.job_log import JobLayout

from _ranks import needs_gloo, run_ranks

MOD = __name__

pytestmark = [
    needs_gloo,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning",
                               "ignore:torch.distributed is unavailable:UserWarning"),
]

#: key -> (seed, global shape, dtype, placement) of the DTensors every job saves
DTENSORS = {"s0": (1, (6, 8), torch.float32, "S0"), "s1": (2, (4, 10), torch.float32, "S1"),
            "r": (3, (5, 3), torch.float32, "R"), "bf": (4, (8, 4), torch.bfloat16, "S0"),
            "uneven": (6, (7, 1), torch.float32, "S0"), "one": (5, (1,), torch.float32, "S0"),
            # larger than a manifest's inline bytes: their shards are read from chunks
            "big": (7, (256, 64), torch.float32, "S0"), "wide": (8, (32, 256), torch.float32, "S1")}
VALUES = {"step": 3, "name": "run-1"}


def glob(key: str, shift: int = 0) -> torch.Tensor:
    seed, shape, dtype, _ = DTENSORS[key]
    g = torch.Generator().manual_seed(seed + 1000 * shift)
    return torch.randn(shape, generator=g).to(dtype)


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# ---- scenarios (run on every rank) ------------------------------------------------------------

def _fsdp_model(world: int):
    """A small MLP sharded by FSDP2 (fully_shard) over a CPU mesh, after one AdamW step: its
    parameters and both AdamW moments are DTensors Shard(0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.ReLU(), torch.nn.Linear(20, 6))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return mesh, model, opt


def _train(model, opt, seed: int) -> None:
    import torch.distributed as dist

    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(seed * 100 + dist.get_rank()))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _dtensors(mesh, shift: int = 0) -> dict:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    place = {"S0": [Shard(0)], "S1": [Shard(1)], "R": [Replicate()]}
    out: dict = {}
    for k, (_, _, _, p) in DTENSORS.items():
        if k == "uneven":  # torch's uneven-shard case: built from local shards of torch.chunk
            g = glob(k, shift)
            local = torch.chunk(g, mesh.size())[mesh.get_local_rank()]
            out[k] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=g.shape,
                                        stride=g.stride())
        else:
            out[k] = distribute_tensor(glob(k, shift), mesh, place[p])
    return out


def _full(x):
    """A state with every DTensor gathered whole (what a single-process load must give)."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        return x.full_tensor()
    if isinstance(x, dict):
        return {k: _full(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_full(v) for v in x)
    return x


def _state(world: int, shift: int):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    mesh, model, opt = _fsdp_model(world)
    for s in range(1 + shift):
        _train(model, opt, s)
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "dt": _dtensors(mesh, shift), **copy.deepcopy(VALUES)}


def sharded_saves(rank: int, world: int, path: str, expected: str, iterations: list,
                  hostile: bool = False) -> dict:
    """Save each iteration (FSDP2 model + AdamW, DTensors) through DCP into the job store at
    ``path``; rank 0 stores the full (gathered) state of each in the plain store ``expected``.
    Each iteration is loaded back here (dcp.load into a fresh sharded state) and compared whole.
    With ``hostile``: then two iterations written as rank states whose DCP metadata (rank 0's)
    lists shards that leave a gap (rank 1's shard missing) and that overlap (:func:`hostile_doc`)."""
    import torch.distributed as dist

    with ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=60.0) as js:
        before = js.iterations()
        loaded = []
        for it in iterations:
            state = _state(world, it)
            full = _full(state)
            dcp.save(state, storage_writer=cdcp.StorageWriter(js, it))
            if rank == 0:
                with ckptstore.open(expected, "a") as s:
                    s.save(it, full)
            fresh = _state(world, 0)
            dcp.load(fresh, storage_reader=cdcp.StorageReader(js, it))
            loaded.append(_same_bits(_full(fresh), full))
        if hostile:
            for it, case in ((iterations[-1] + 1, "gap"), (iterations[-1] + 2, "overlap")):
                doc, items = hostile_doc(case, rank)
                js.save(it, {"dcp": doc, "items": items})
        return {"before": before, "iterations": js.iterations(), "loaded": loaded}


def _same_bits(a, b) -> bool:
    from conftest import _same

    try:
        _same(a, b, "state")
        return True
    except AssertionError:
        return False


W = torch.arange(48.0).reshape(6, 8)


def _entry(size, chunks) -> dict:
    return {"type": "tensor", "dtype": "float32", "size": list(size), "layout": "strided",
            "requires_grad": False, "pin_memory": False, "memory_format": "contiguous_format",
            "chunks": [[list(o), list(n)] for o, n in chunks]}


def hostile_doc(case: str, rank: int) -> tuple[dict, dict]:
    """Rank ``rank``'s ``dcp`` head and items of a two-rank checkpoint of tensor ``w`` (W, rows
    0-2 on rank 0, rows 3-5 on rank 1) and an intact tensor ``ok``, where the metadata
    (rank 0's) lacks rank 1's row of ``w`` ("gap") or gives rank 0 rows 0-3 ("overlap")."""
    top = 4 if case == "overlap" else 3
    entries = [["w", _entry((6, 8), [((0, 0), (top, 8)), ((3, 0), (3, 8))])],
               ["ok", _entry((2,), [((0,), (1,)), ((1,), (1,))])]]
    storage = [["w", [0, 0], "w", 0], ["ok", [0], "ok", 0], ["ok", [1], "ok@1", 1]]
    if case != "gap":
        storage.append(["w", [3, 0], "w@3,0", 1])
    if rank == 0:
        md = {"version": "1", "state_dict_metadata": entries, "planner_data": None,
              "storage_meta": None, "storage": storage}
        return ({"format": "ckptstore.dcp", "version": 1, "metadata": md},
                {"w": W[:top].clone(), "ok": torch.tensor([1.0])})
    return ({"format": "ckptstore.dcp", "version": 1, "metadata_rank": 0},
            {"w@3,0": W[3:].clone(), "ok@1": torch.tensor([2.0])})



class KillAt(FileOps):
    """SIGKILLs its process at the ``nth`` ``op`` ("writev" or "fsync") on a file whose path
    holds ``where``, counted once ``armed`` (``after``: the fsync completes first)."""

    def __init__(self, op: str, where: str, nth: int = 1, after: bool = False) -> None:
        self.op, self.where, self.left, self.after, self.armed = op, where, nth, after, False

    def _hit(self, op: str, path: str) -> bool:
        if self.armed and op == self.op and self.where in path:
            self.left -= 1
            return self.left == 0
        return False

    def writev(self, fd, path, buffers, offset):
        if self._hit("writev", path):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().writev(fd, path, buffers, offset)

    def fsync(self, fd, path):
        hit = self._hit("fsync", path)
        if hit and not self.after:
            os.kill(os.getpid(), signal.SIGKILL)
        super().fsync(fd, path)
        if hit:
            os.kill(os.getpid(), signal.SIGKILL)


def kill_in_commit(rank: int, world: int, path: str, victim: int, kill: list,
                   timeout: float) -> dict:
    """Iteration 1 (sharded) commits; rank ``victim`` is SIGKILLed during iteration 2's commit
    at ``kill`` (KillAt's arguments)."""
    import time

    import torch.distributed as dist

    ops = KillAt(*kill) if rank == victim else None
    js = ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=timeout,
                        file_ops=ops)
    dcp.save(_state(world, 1), storage_writer=cdcp.StorageWriter(js, 1))
    state = _state(world, 2)
    if ops is not None:
        ops.armed = True
    writer = cdcp.StorageWriter(js, 2)
    t0 = time.perf_counter()
    try:
        dcp.save(state, storage_writer=writer)
        err = None
    except BaseException as e:  # noqa: BLE001 - DCP's collective over the dead rank: gloo's error
        err = type(e).__name__
    out = {"error": err, "s": time.perf_counter() - t0, "iterations": js.iterations(),
           "typed": [] if writer.error is None else [c.__name__ for c in type(writer.error).__mro__]}
    try:
        js.close()
    except ckptstore.CkptStoreError:
        pass
    return out


# ---- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Job stores saved by 2 ranks (iterations 1, 2; then 3: a gap, 4: an overlap) and by 4
    ranks (iteration 1), with the full state of each iteration in a plain store beside it; and a
    single-process DCP store (iteration 1: the full state of the 2-rank job's iteration 1)."""
    root = tmp_path_factory.mktemp("sharded")
    out = {}
    for world, its in ((2, [1, 2]), (4, [1])):
        path, expected = str(root / f"job{world}"), str(root / f"expected{world}")
        res = run_ranks(world, MOD, "sharded_saves", path, str(root / f"w{world}"),
                        deadline=240, expected=expected, iterations=its, hostile=world == 2)
        assert all("ok" in r for r in res), res
        assert all(r["ok"]["loaded"] == [True] * len(its) for r in res), res
        out[world] = (path, expected)
    single = str(root / "single")
    with ckptstore.open(out[2][1], "r") as e, ckptstore.open(single, "a") as s:
        dcp.save(e.load(1), storage_writer=cdcp.StorageWriter(s, 1), no_dist=True)
    out[1] = (single, out[2][1])
    return out


def _flat(state, prefix=""):
    """{dotted fqn: tensor} of a nested state (DCP's flattening of dicts)."""
    out = {}
    for k, v in state.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, name + "."))
        elif isinstance(v, torch.Tensor):
            out[name] = v
    return out


# ---- ckptstore show: the layout of a sharded checkpoint -----------------------------------------

@pytest.mark.parametrize("world", [1, 2, 4])
def test_show_prints_each_tensors_shards_and_the_rank_holding_them(jobs, world, capsys):
    path, _ = jobs[world]
    with ckptstore.open(path, "r") as store:
        lay = cdcp.layout(store, 1)
    assert lay.world_size == world and lay.metadata_rank == 0 and not lay.problems
    assert cli(["show", path, "1"]) == 0
    out = capsys.readouterr().out
    head = f"saved by {world} ranks" if world > 1 else "saved by one process"
    assert out.splitlines()[0].startswith("iteration 1 (snapshot): a DCP checkpoint " + head)
    rows = [line.split() for line in out.splitlines() if line.startswith(("dt.", "model.", "optim."))]
    by_tensor: dict = {}
    for r in rows:
        if len(r) == 8:  # tensor dtype shape offsets sizes rank N unit
            by_tensor.setdefault(r[0], []).append(r[1:])
    # every shard of every tensor, with its box and the rank holding it; Shard(0) of (256, 64)
    # over `world` ranks: rank r holds rows r*256/world ...
    step = 256 // world
    assert by_tensor["dt.big"] == [["float32", "256x64", f"{r * step},0", f"{step}x64", str(r),
                                    f"{step * 64 * 4 / 1024:.1f}", "KiB"] for r in range(world)]
    cols = 256 // world
    assert [(s[2], s[3], s[4]) for s in by_tensor["dt.wide"]] == [
        (f"0,{r * cols}", f"32x{cols}", str(r)) for r in range(world)]
    assert len(by_tensor["dt.r"]) == 1  # a replicated tensor is stored once
    for t in lay.tensors:
        assert len(by_tensor[t.fqn]) == len(t.shards), t.fqn
        assert [s[4] for s in by_tensor[t.fqn]] == [str(s.rank) for s in t.shards]
    values = [line.split() for line in out.splitlines() if line.startswith(("step ", "name "))]
    assert sorted(v[0] for v in values) == ["name", "step"]
    # the latest iteration by default (the 2-rank job's is the overlap case: exit 1); --raw:
    # the stored state of rank 0 as is
    assert cli(["show", path]) == (1 if world == 2 else 0)
    with ckptstore.open(path, "r") as store:
        latest = store.latest()
    assert capsys.readouterr().out.startswith(f"iteration {latest} ")
    assert cli(["show", path, "1", "--raw"]) == 0
    raw = capsys.readouterr().out
    assert "items/dt.big" in raw and "shard offsets" not in raw


# ---- whole tensors from the shards, with no process group ---------------------------------------

@pytest.mark.parametrize("world", [1, 2, 4])
def test_load_full_state_dict_is_bit_exact_and_reads_each_shard_once(jobs, world, assert_same):
    path, expected = jobs[world]
    with ckptstore.open(path, "r") as store, ckptstore.open(expected, "r") as exp:
        its = [1, 2] if world == 2 else [1]
        for it in its:
            want = exp.load(it)
            reader = cdcp.StorageReader(store, it)
            got = reader.read_full()
            assert_same(want, got)
            # every shard read once, from the rank holding it: per rank, exactly the bytes of its
            # shards (those not inline in a manifest, which cost no chunk read)
            lay = reader.layout()
            ideal: dict = {}
            for t in lay.tensors:
                for sh in t.shards:
                    if sh.nbytes > 256:
                        ideal[sh.rank] = ideal.get(sh.rank, 0) + sh.nbytes
            assert reader.last_read_bytes_by_rank == ideal
            assert_same(want, cdcp.load_full_state_dict(store, it))
        # flat fqns, and keys selecting a subtree: only what is asked is read
        flat = cdcp.load_full_state_dict(store, 1, flat=True)
        assert bits(flat["dt.big"]) == bits(glob("big", 1)) and flat["step"] == 3
        reader = cdcp.StorageReader(store, 1)
        part = reader.read_full(["dt.big", "model"])
        assert list(part) == ["model", "dt"] and list(part["dt"]) == ["big"]
        assert_same(exp.load(1)["model"], part["model"])
        assert reader.last_read_ranks == set(range(world))
        one = reader.read_full(["dt.big"], flat=True)
        assert reader.last_read_bytes_by_rank == {r: 256 * 64 * 4 // world for r in range(world)}
        assert list(one) == ["dt.big"]
        with pytest.raises(NotFoundError, match="no key 'nope'"):
            cdcp.load_full_state_dict(store, 1, keys=["nope"])
        # DCP's own single-process path through this reader agrees
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        theirs = _load_state_dict_from_keys(storage_reader=cdcp.StorageReader(store, 1))
        assert bits(theirs["dt"]["wide"]) == bits(glob("wide", 1))


@pytest.mark.parametrize("world", [2, 4])
def test_restore_writes_full_tensors_from_a_sharded_checkpoint(jobs, world, tmp_path, assert_same,
                                                               capsys):
    from safetensors.torch import load_file

    from ckptstore.interop import flat_tensors

    path, expected = jobs[world]
    with ckptstore.open(expected, "r") as exp:
        want = exp.load(1)
    out = str(tmp_path / "full.safetensors")
    assert cli(["restore", path, "--iteration", "1", "--format", "safetensors", out]) == 0
    assert f"restored iteration 1 to {out}" in capsys.readouterr().out
    got = load_file(out)
    tensors, _ = flat_tensors(want)
    assert sorted(got) == sorted(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and bits(got[name]) == bits(t), name
    assert bits(got["dt/big"]) == bits(glob("big", 1)) and bits(got["dt/wide"]) == bits(glob("wide", 1))
    # the older syntax, torch format, one subtree
    pt = str(tmp_path / "model.pt")
    assert cli(["restore", path, "1", "--out", pt, "--keys", "model"]) == 0
    assert_same({"model": want["model"]}, torch.load(pt, weights_only=True))
    # --rank: that rank's stored state as is
    assert cli(["restore", path, "1", str(tmp_path / "r1.pt"), "--rank", "1"]) == 0
    assert set(torch.load(str(tmp_path / "r1.pt"), weights_only=True)) == {"dcp", "items"}
    assert cli(["restore", path, str(tmp_path / "x.pt")]) == 2  # no iteration
    assert cli(["restore", path, "--iteration", "1", "a", "--out", "b"]) == 2


# ---- the committed vectors of format-spec/vectors/dcp.json --------------------------------------

DCP_VECTORS = json.loads((Path(__file__).resolve().parent.parent / "format-spec" / "vectors"
                          / "dcp.json").read_text(encoding="ascii"))["vectors"]


@pytest.mark.parametrize("v", DCP_VECTORS, ids=lambda v: v["name"])
def test_dcp_layout_vectors(v):
    from ckptstore.format.state import unflatten

    def no_leaf(index, path):
        raise AssertionError("a dcp head holds no tensor")

    head = unflatten(json.loads(bytes.fromhex(v["hex"])), no_leaf)
    assert head["format"] == "ckptstore.dcp" and head["version"] == 1
    if v.get("error") == "DCPError":
        with pytest.raises(DCPError, match="does not decode"):
            cdcp.layout_of(head["metadata"], v["world_size"])
        return
    lay = cdcp.layout_of(head["metadata"], v["world_size"])
    if v.get("error") == "ShardCoverageError":
        [problem] = lay.problems
        assert type(problem) is ShardCoverageError and problem.fqn == v["fqn"]
        assert [list(problem.offsets), list(problem.sizes)] == v["box"]
        return
    assert not lay.problems
    assert [[t.fqn, t.dtype, list(t.shape), [[list(s.offsets), list(s.sizes), s.rank, s.key]
                                            for s in t.shards]] for t in lay.tensors] \
        == v["expected"]["tensors"]
    assert [[x.fqn, x.rank, x.key] for x in lay.values] == v["expected"]["values"]


# ---- bad input: typed errors naming the tensor, the box, the rank -------------------------------

def _md(entries, storage) -> dict:
    return {"version": "1", "state_dict_metadata": entries, "planner_data": None,
            "storage_meta": None, "storage": storage}


def _head(md) -> dict:
    return {"format": "ckptstore.dcp", "version": 1, "metadata": md}


@pytest.mark.parametrize("case,fqn,offsets,sizes,ranks", [
    ("gap", "w", (3, 0), (3, 8), ()),            # rank 1's shard is in no storage row
    ("overlap", "w", (3, 0), (1, 8), (0, 1)),    # rank 0's shard claims rows 0-3
])
def test_shards_that_do_not_tile_their_tensor_in_a_job_store(jobs, case, fqn, offsets, sizes,
                                                             ranks, tmp_path, capsys):
    path, _ = jobs[2]
    it = 3 if case == "gap" else 4
    with ckptstore.open(path, "r") as store:
        lay = cdcp.layout(store, it)
        assert [t.fqn for t in lay.tensors if t.problem is not None] == ["w"]
        with pytest.raises(ShardCoverageError) as ei:
            cdcp.load_full_state_dict(store, it)
        e = ei.value
        assert (e.fqn, e.offsets, e.sizes, e.ranks) == (fqn, offsets, sizes, ranks), str(e)
        assert f"box at offsets {list(offsets)} of sizes {list(sizes)}" in str(e)
        if case == "overlap":
            assert "(sizes [4, 8], rank 0)" in str(e) and "(sizes [3, 8], rank 1)" in str(e)
        # the checkpoint's other tensors load; a DCP load of the bad one fails before reading
        assert torch.equal(cdcp.load_full_state_dict(store, it, keys=["ok"])["ok"],
                           torch.tensor([1.0, 2.0]))
        reader = cdcp.StorageReader(store, it)
        with pytest.raises(CheckpointException) as ei:
            dcp.load({"w": torch.zeros(6, 8)}, storage_reader=reader, no_dist=True)
        assert isinstance(ei.value.failures[0][0], ShardCoverageError)
        assert reader.last_read_bytes == 0
        with pytest.raises(ShardCoverageError):
            cdcp.check_state_dict(store, it, {"w": torch.zeros(6, 8)})
    assert cli(["show", path, str(it)]) == 1
    cap = capsys.readouterr()
    assert "tensor 'w' of shape [6, 8]" in cap.err and f"offsets {list(offsets)}" in cap.err
    assert cli(["restore", path, str(it), str(tmp_path / "x.safetensors"),
                "--format", "safetensors"]) == 1
    assert "tensor 'w' of shape [6, 8]" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x.safetensors")


@pytest.mark.parametrize("chunks,storage,offsets,sizes", [
    # a 2-D grid of four shards, the bottom-right one missing from the metadata
    ([((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3))], None, (2, 3), (2, 3)),
    # the same quadrant listed, but stored nowhere
    ([((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3))], 3, (2, 3), (2, 3)),
    # two missing rows of a column-sharded tensor: the gap is the whole lower band
    ([((0, 0), (2, 3)), ((0, 3), (2, 3))], None, (2, 0), (2, 6)),
    # an overlap in a corner of a 2-D grid
    ([((0, 0), (3, 4)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3))], None, (0, 3), (2, 1)),
])
def test_shards_that_do_not_tile_their_tensor_in_a_single_store(tmp_path, chunks, storage,
                                                               offsets, sizes):
    full = torch.arange(24.0).reshape(4, 6)
    keys = [f"g@{o[0]},{o[1]}" for o, _ in chunks]
    rows = [["g", list(o), k] for (o, _), k in zip(chunks, keys) if storage is None
            or k != keys[storage]]
    items = {k: full[o[0]:o[0] + n[0], o[1]:o[1] + n[1]].clone() for (o, n), k in zip(chunks, keys)}
    with ckptstore.open(tmp_path / "s", "a") as s:
        s.save(1, {"dcp": _head(_md([["g", _entry((4, 6), chunks)]], rows)), "items": items})
        with pytest.raises(ShardCoverageError) as ei:
            cdcp.load_full_state_dict(s, 1)
        assert (ei.value.offsets, ei.value.sizes) == (offsets, sizes), str(ei.value)
        assert cdcp.layout(s, 1).problems[0].sizes == sizes


def test_a_load_the_metadata_cannot_serve(jobs):
    """A plan the stored metadata cannot serve (a shard that is not there, a box outside the
    shard, a value asked as a tensor and the reverse, a key the checkpoint lacks) and a state
    dict it cannot serve (another global shape, a tensor for a value, a missing key): typed
    errors naming the key, before anything is read."""
    path, _ = jobs[2]

    def item(fqn, offset, soffsets, lengths, kind=LoadItemType.TENSOR):
        index = MetadataIndex(fqn, None if offset is None else torch.Size(offset))
        return ReadItem(type=kind, dest_index=index, dest_offsets=torch.Size(soffsets),
                        storage_index=index, storage_offsets=torch.Size(soffsets),
                        lengths=torch.Size(lengths))

    with ckptstore.open(path, "r") as store:
        reader = cdcp.StorageReader(store, 1)
        reader.read_metadata()
        cases = [
            (item("dt.s0", [2, 0], [0, 0], [1, 8]), r"no item 'dt.s0' at offsets \[2, 0\] "
             r"\(its shards start at \[\[0, 0\], \[3, 0\]\]\)"),
            (item("dt.s0", [3, 0], [1, 0], [3, 8]), r"box at \[1, 0\] of sizes \[3, 8\] lies "
             r"outside the stored tensor \(the shard at \[3, 0\], of sizes \[3, 8\], rank 1\)"),
            (item("dt.s0", [0, 0], [0, 0], [3, 8], LoadItemType.BYTE_IO), "stored tensor"),
            (item("step", None, [], [], LoadItemType.TENSOR), "non-tensor value"),
            (item("nope", [0], [0], [1]), "holds no item 'nope': no such key"),
        ]
        for req, match in cases:
            with pytest.raises(ShardMismatchError, match=match) as ei:
                reader.prepare_local_plan(LoadPlan([req]))
            assert ei.value.fqn == req.storage_index.fqn and isinstance(ei.value, ValueError)

        class Planner(torch.distributed.checkpoint.DefaultLoadPlanner):
            def create_local_plan(self):
                return LoadPlan([cases[1][0]])

        reader = cdcp.StorageReader(store, 1)
        with pytest.raises(CheckpointException) as ei:
            dcp.load({"dt": {"s0": torch.zeros(6, 8)}}, storage_reader=reader, planner=Planner(),
                     no_dist=True)
        assert isinstance(ei.value.failures[0][0], ShardMismatchError)
        assert reader.last_read_bytes == 0
        # a state dict, checked against the metadata (no process group, nothing read)
        good = {"dt": {"big": torch.zeros(256, 64), "wide": torch.zeros(32, 256)}, "step": 0}
        cdcp.check_state_dict(store, 1, good)
        for bad, match in [({"dt": {"big": torch.zeros(64, 256)}}, r"global shape \[256, 64\], and "
                            r"the state dict asks for \[64, 256\]"),
                           ({"step": torch.zeros(1)}, "'step' is a stored non-tensor value"),
                           ({"dt": {"big": 1.0}}, "'dt.big' is a stored tensor"),
                           ({"extra": torch.zeros(1)}, "holds no key 'extra'")]:
            with pytest.raises(ShardMismatchError, match=match):
                cdcp.check_state_dict(store, 1, bad)
        cdcp.check_state_dict(store, 1, {"extra": torch.zeros(1)}, strict=False)


def _flip_in(seg: str, needle: bytes) -> None:
    data = bytearray(open(seg, "rb").read())
    at = data.find(needle)
    assert at > 0 and data.find(needle, at + 1) < 0, "the shard's bytes are not stored raw, once"
    data[at + 17] ^= 0xFF
    with open(seg, "r+b") as f:
        f.seek(at + 17)
        f.write(bytes([data[at + 17]]))


def test_a_damaged_shard_is_reported_naming_the_rank_and_the_tensor(jobs, tmp_path, capsys):
    src, _ = jobs[2]
    path = str(tmp_path / "job")
    shutil.copytree(src, path)
    stream1 = JobLayout(path).stream_dir(1, 1)
    seg = os.path.join(stream1, "segments", "0000000001.seg")
    # rank 1 holds rows 128-255 of dt.big; flip one byte inside them (iteration 1's values)
    _flip_in(seg, bits(glob("big", 1)[128:])[:64])
    with ckptstore.open(path, "r") as store:
        with pytest.raises(ShardDamagedError) as ei:
            cdcp.load_full_state_dict(store, 1)
        e = ei.value
        assert (e.rank, e.fqn, e.offsets, e.stream) == (1, "dt.big", (128, 0), stream1), str(e)
        assert "rank 1" in str(e) and "'dt.big'" in str(e) and stream1 in str(e)
        assert isinstance(e, ckptstore.DamagedCheckpointError)
        # what does not touch the damaged shard still loads: rank 0's half, other tensors
        got = cdcp.load_full_state_dict(store, 1, keys=["dt.wide", "model"])
        assert bits(got["dt"]["wide"]) == bits(glob("wide", 1))
        half = {"dt": {"big": torch.zeros(128, 64)}}

        class Top(torch.distributed.checkpoint.DefaultLoadPlanner):
            """Loads rows 0-127 of dt.big only: rank 0's shard."""

            def create_local_plan(self):
                index = MetadataIndex("dt.big", torch.Size([0, 0]))
                return LoadPlan([ReadItem(type=LoadItemType.TENSOR, dest_index=index,
                                          dest_offsets=torch.Size([0, 0]), storage_index=index,
                                          storage_offsets=torch.Size([0, 0]),
                                          lengths=torch.Size([128, 64]))])

            def resolve_tensor(self, read_item):
                return self.state_dict["dt.big"]

        dcp.load(half, storage_reader=cdcp.StorageReader(store, 1), planner=Top(), no_dist=True)
        assert bits(half["dt"]["big"]) == bits(glob("big", 1)[:128])
        with pytest.raises(CheckpointException) as ei:
            dcp.load({"dt": {"big": torch.zeros(256, 64)}},
                     storage_reader=cdcp.StorageReader(store, 1), no_dist=True)
        assert isinstance(ei.value.failures[0][0], ShardDamagedError)
        # iteration 2's shards are other bytes: intact
        assert bits(cdcp.load_full_state_dict(store, 2, keys=["dt.big"], flat=True)["dt.big"]) \
            == bits(glob("big", 2))
    assert cli(["restore", path, "1", str(tmp_path / "out.safetensors"),
                "--format", "safetensors"]) == 1
    err = capsys.readouterr().err
    assert "rank 1" in err and "'dt.big'" in err and not os.path.exists(tmp_path / "out.safetensors")
    assert cli(["fsck", path]) == 1


# ---- a rank SIGKILLed during a sharded commit ---------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("victim,kill,after_vote", [
    (1, ["writev", "/streams/", 1], False),          # rank 1 writing its shards' records
    (1, ["fsync", "/streams/", 2, True], False),     # rank 1 with its local COMMIT durable
    (0, ["writev", "/global/", 1], True),            # the coordinator at the global commit
], ids=["rank1-writing-shards", "rank1-local-commit-durable", "coordinator-at-global-commit"])
def test_sigkill_of_a_rank_during_a_sharded_commit(tmp_path, victim, kill, after_vote,
                                                   assert_same):
    """Nothing of the iteration becomes visible, the survivor fails at once (DCP's own
    collective over the dead rank raises: ckptstore runs no round during a DCP save, format
    §22.6, so the error is torch's, not a commit round's), fsck is clean, and the next job (a new
    epoch) saves the same iteration and loads it whole at any world size."""
    timeout = 5.0
    path, expected = str(tmp_path / "job"), str(tmp_path / "expected")
    res = run_ranks(2, MOD, "kill_in_commit", path, str(tmp_path / "w"), deadline=120,
                    pg_timeout=30, victim=victim, kill=kill, timeout=timeout)
    assert "died" in res[victim], res
    survivor = res[1 - victim]["ok"]
    assert survivor["error"] is not None and survivor["iterations"] == [1], survivor
    assert survivor["s"] < timeout + 10, survivor  # (after_vote: no longer a different error)
    with ckptstore.open(path, "r") as reader:
        assert reader.iterations() == [1]
        with pytest.raises(NotFoundError):
            cdcp.StorageReader(reader, 2)
        got = cdcp.load_full_state_dict(reader, 1, keys=["dt"], flat=True)
        assert bits(got["dt.big"]) == bits(glob("big", 1))
    assert cli(["fsck", path]) == 0
    res = run_ranks(2, MOD, "sharded_saves", path, str(tmp_path / "w2"), deadline=120,
                    expected=expected, iterations=[2])
    assert all("ok" in r for r in res), res
    assert [r["ok"]["before"] for r in res] == [[1], [1]] and res[0]["ok"]["loaded"] == [True]
    with ckptstore.open(path, "r") as reader, ckptstore.open(expected, "r") as exp:
        assert reader.iterations() == [1, 2]
        assert_same(exp.load(2), cdcp.load_full_state_dict(reader, 2))
    assert cli(["fsck", path]) == 0
