"""DTensor state dicts on job stores (format-spec/format.md §22.8), on real gloo groups.

One 2-rank run (the module fixture) trains an FSDP2 MLP with AdamW one step and saves
``{"model": model.state_dict(), "optim": opt.state_dict(), "big": a Shard(0) DTensor}`` with a
plain ``store.save`` at iteration 2 (iteration 1: a plain state), and a model replicated on a
(2, 1) mesh at iteration 3; rank 0 keeps every DTensor gathered whole (``full_tensor``) in a
single store. In the same run, fresh ranks' live DTensors are loaded with ``store.load(2,
into=state)`` and compared with the gathered boxes bit for bit, and what each rank read is
counted. The tests then check, in this process (no group): whole tensors, a load into plain
tensors (2 -> 1), the bytes each load read, the typed errors; the 4-rank reshard is slow.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from _ranks import needs_gloo, run_ranks
from test_sharded_checkpointer import assert_bits, bits, ok

import ckptstore
from ckptstore.errors import (DamagedCheckpointError, RankMismatchError, ShardCoverageError,
                              ShardedStateError, TargetMismatchError)
from ckptstore.multirank import dtensor_state
from ckptstore.multirank.dtensor_state import SECTION_KEY, assemble, load_into, path_key

MOD = __name__
CHUNK = 4096
BIG = (256, 16)  # float32: 16 KiB, 4 chunks; 8 KiB (2 chunks) per rank at 2 ranks

pytestmark = [
    needs_gloo,
    pytest.mark.timeout(300),
]


# ---- scenario (every rank) ----------------------------------------------------------------------
def _mlp(mesh_shape, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    names = ("replicate", "shard")[-len(mesh_shape):]
    mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=names)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 5))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 6, generator=g)).square().sum().backward()
    opt.step()
    opt.zero_grad()
    return mesh, model, opt


def _state(mesh_shape, seed: int) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh, model, opt = _mlp(mesh_shape, seed)
    big = torch.arange(BIG[0] * BIG[1], dtype=torch.float32).reshape(BIG) * (seed + 1)
    out = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": seed}
    if len(mesh_shape) == 1:
        out["big"] = distribute_tensor(big, mesh, [Shard(0)])
    _LIVE[seed] = (model, opt)
    return out


_LIVE: dict = {}  # seed -> (model, optimizer) of _state, in a rank


def _full(state):
    """The state with every DTensor gathered whole (collective), containers copied."""
    from ckptstore.replay.shards import is_dtensor

    if is_dtensor(state):
        return state.full_tensor()
    if isinstance(state, dict):
        return {k: _full(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_full(v) for v in state]
    return state


def _check_live(state, expect) -> list[str]:
    """Every DTensor's local shard of ``state`` against the box of the gathered ``expect``."""
    from ckptstore.multirank.dtensor_state import dtensors
    from ckptstore.replay.shards import box_of, local, region
    from ckptstore.tensors.inplace import lookup

    bad = []
    for path, t in dtensors(state):
        b = box_of(t)
        want = region(lookup(expect, path), b["offsets"], b["local"])
        if bits(local(t)) != bits(want.contiguous()):
            bad.append(str(path))
    return bad


def save_and_reload(rank, world, path, expect_dir):
    import torch.distributed as dist

    from ckptstore.replay.shards import local

    out = {}
    store = ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=60.0,
                           chunk_size=CHUNK)
    store.save(1, {"plain": torch.full((3,), float(rank))})
    state = _state((world,), seed=1)
    store.save(2, state)
    full = _full(state)
    repl = _state((world, 1), seed=2)
    store.save(3, repl)
    full3 = _full(repl)
    if rank == 0:
        with ckptstore.open(expect_dir, "a") as single:
            single.save(2, full)
            single.save(3, full3)
            try:  # a DTensor state on a store without a group: refused before anything is written
                single.save(4, state)
            except ShardedStateError as e:
                out["no_group"] = [type(e).__name__, str(e), list(e.path)]
            out["single_iterations"] = single.iterations()
    # a fresh model (other weights, other moments), loaded in place at the same world size
    live = _state((world,), seed=7)
    keep = {id(v) for _, v in dtensor_state.dtensors(live)}
    got, counts = load_into(store, 2, live)
    out["same_objects"] = all(id(v) in keep for _, v in dtensor_state.dtensors(got))
    out["bad"] = _check_live(live, full)
    out["counts"] = {str(r): n for r, n in counts.items()}
    out["own_shard_bytes"] = sum(local(v).nbytes for _, v in dtensor_state.dtensors(live))
    out["step_ok"] = bits(got["optim"]["state"][0]["step"]) == bits(full["optim"]["state"][0]["step"])
    out["epoch"] = got["epoch"]
    # store.load(into=) is the same load; as docs/multi-rank.md shows it: the live model's
    # parameters are filled in place, the optimizer takes the loaded state
    live2 = _state((world,), seed=8)
    model, opt = _LIVE[8]
    loaded = store.load(2, into=live2)
    opt.load_state_dict(loaded["optim"])
    out["bad_load"] = _check_live(live2, full) + _check_live(
        {"model": dict(model.named_parameters()), "optim": opt.state_dict()}, full)
    out["mismatch"] = _mesh_mismatch(store, rank, world)
    out["iterations"] = store.iterations()
    # the async pipeline takes the same parts; a rank that cannot make its part votes FAILED
    store.save_async(4, state).result()
    out["async_mismatch"] = _mesh_mismatch(store, rank, world, asynchronous=True)
    out["iterations_async"] = store.iterations()
    try:  # an async failure stays pending: close() raises it again (the pipeline's rule)
        store.close()
        out["close"] = None
    except ckptstore.CkptStoreError as e:
        out["close"] = type(e).__name__
    return out


def reshard(rank, world, path, expect_dir):
    """Load the 2-rank iteration 2 into live DTensors at this world size."""
    import torch.distributed as dist

    with ckptstore.open(expect_dir, "r") as single:
        full = single.load(2)
    store = ckptstore.open(path, "r", process_group=dist.group.WORLD)
    live = _state((world,), seed=9)
    _, counts = load_into(store, 2, live)
    return {"bad": _check_live(live, full), "counts": {str(r): n for r, n in counts.items()}}


def _mesh_mismatch(store, rank, world, asynchronous=False):
    """Rank 0 saves a DTensor over a mesh of itself alone into the job store of both ranks: it
    votes FAILED (RankMismatchError), every rank raises, nothing is committed."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    if rank == 0:
        t = DTensor.from_local(torch.ones(4, 4), DeviceMesh("cpu", [0], _init_backend=False),
                               [Shard(0)], run_check=False)
    else:
        t = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)], run_check=False)
    try:
        if asynchronous:
            store.save_async(5, {"w": t}).result()
        else:
            store.save(5, {"w": t})
        return "saved"
    except Exception as e:  # noqa: BLE001 - reported
        return [type(e).__name__, str(e)[:400]]


def killed_mid_save(rank, world, path, expect_dir, nth):
    """Iteration 1 is saved; rank 1 is SIGKILLed at its ``nth`` file operation of the save of
    iteration 2 (its shards' records): rank 0's save must fail, and readers see iteration 1."""
    import torch.distributed as dist
    from _crashkit import KillOps

    ops = KillOps("any", nth, armed=False) if rank == 1 else None
    store = ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=30.0,
                           chunk_size=CHUNK, file_ops=ops)
    state = _state((world,), seed=1)
    store.save(1, state)
    full = _full(state)
    if rank == 0:
        with ckptstore.open(expect_dir, "a") as single:
            single.save(1, full)
    nxt = _state((world,), seed=3)
    if ops is not None:
        ops.armed = True
    try:
        store.save(2, nxt)
        return "saved"
    except Exception as e:  # noqa: BLE001 - reported
        return [type(e).__name__, str(e)[:400]]


# ---- the run, once per module -------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("dtensor")
    path, expect = str(base / "job"), str(base / "expect")
    results = ok(run_ranks(2, MOD, "save_and_reload", path, str(base / "work"),
                           expect_dir=expect))
    return path, expect, results


def _expect(expect: str, it: int) -> dict:
    with ckptstore.open(expect, "r") as s:
        return s.load(it)


def test_save_reload_in_place_same_world(run):
    """Each rank's live DTensors get their boxes bit for bit, the same objects, reading only
    their own part's shards (the chunks of the rank's own boxes and plain tensors)."""
    _, _, results = run
    for r, res in enumerate(results):
        assert res["bad"] == [] and res["bad_load"] == [], res
        assert res["same_objects"] and res["step_ok"] and res["epoch"] == 1
        assert set(res["counts"]) == {str(r)}, f"rank {r} read other ranks' parts: {res['counts']}"
        # the log bytes of the rank's own half of ``big`` (two chunks); the model's and the
        # optimizer's shards and ``step`` scalars are small enough to be stored inline in the
        # manifest (read with it: no chunk)
        assert res["counts"][str(r)] == BIG[0] * BIG[1] * 4 // 2 == 2 * CHUNK, res
        assert res["own_shard_bytes"] > 2 * CHUNK


def test_reader_without_group_gets_whole_tensors(run):
    path, expect, _ = run
    with ckptstore.open(path, "r") as store:
        whole = store.load(2)
        assert SECTION_KEY not in whole
        assert_bits(whole, _expect(expect, 2), "iteration 2")
        assert_bits(store.load(3), _expect(expect, 3), "iteration 3 (replicated)")
        assert store.load(1, rank=1)["plain"].tolist() == [1.0, 1.0, 1.0]
        assert list(store.load(2, keys=["big"])) == ["big"]


def test_replicated_boxes_written_once(run):
    """On a (2, 1) mesh every box is held by both ranks: each is written by its owner only (the
    other part holds None there), balanced between the ranks."""
    path, _, _ = run
    with ckptstore.open(path, "r") as store:
        parts = [store.load(3, rank=r) for r in range(2)]
        secs = [p[SECTION_KEY] for p in parts]
        assert secs[0]["replicas"] == secs[1]["replicas"] and secs[0]["replicas"]
        owners = secs[0]["replicas"]
        assert set(owners.values()) == {0, 1}
        for key, owner in owners.items():
            path_ = dtensor_state.key_path(key)
            from ckptstore.tensors.inplace import lookup
            assert isinstance(lookup(parts[owner], path_), torch.Tensor)
            assert lookup(parts[1 - owner], path_) is None


def test_load_into_plain_tensors_at_one_rank(run):
    """2 -> 1: a process without a group loads into plain tensors of the global shapes: every
    shard read once, bit for bit."""
    path, expect, _ = run
    full = _expect(expect, 2)
    target = {"model": {k: torch.zeros_like(v) for k, v in full["model"].items()},
              "big": torch.zeros(BIG)}
    with ckptstore.open(path, "r") as store:
        got, counts = load_into(store, 2, target)
        assert got["model"]["0.weight"] is target["model"]["0.weight"]
        assert_bits(target["model"], full["model"], "model")
        assert bits(target["big"]) == bits(full["big"])
        # each half of ``big`` from its rank (the small shards are inline in the manifests)
        assert counts == {0: 2 * CHUNK, 1: 2 * CHUNK}, counts
        store.load(2, into={"big": target["big"]})
        assert bits(target["big"]) == bits(full["big"])


def test_typed_errors(run, tmp_path):
    path, _, results = run
    name, message, key = results[0]["no_group"]
    assert name == "ShardedStateError" and "state['model']" in message and key[0] == "model"
    assert results[0]["single_iterations"] == [2, 3]  # nothing of the refused save
    with ckptstore.open(path, "r") as store:
        with pytest.raises(TargetMismatchError, match="global shape"):
            store.load(2, into={"big": torch.zeros(BIG[0] + 1, BIG[1])})
        with pytest.raises(TargetMismatchError, match="float64|dtype|is float32"):
            store.load(2, into={"big": torch.zeros(BIG, dtype=torch.float64)})


def test_mesh_other_than_the_store_ranks_is_refused(run):
    _, _, results = run
    mine, other = results[0]["mismatch"], results[1]["mismatch"]
    assert mine[0] == "RankMismatchError" and "ranks [0]" in mine[1], mine
    assert other[0] == "GlobalCommitAbortedError" and "rank 0" in other[1], other
    assert results[0]["iterations"] == results[1]["iterations"] == [1, 2, 3]
    mine, other = results[0]["async_mismatch"], results[1]["async_mismatch"]
    assert mine[0] == "RankMismatchError" and other[0] == "GlobalCommitAbortedError", (mine, other)
    assert "rank 0" in other[1], other
    assert results[0]["iterations_async"] == results[1]["iterations_async"] == [1, 2, 3, 4]
    assert [r["close"] for r in results] == ["GlobalCommitAbortedError"] * 2, results
    with ckptstore.open(run[0], "r") as store:
        assert_bits(store.load(4), _expect(run[1], 2), "iteration 4 (async)")


def test_flipped_byte_in_a_shard_fails_only_the_loads_that_read_it(run, tmp_path):
    """A bit flipped in rank 1's stored half of ``big``: a whole load and a load into ``big``
    raise DamagedCheckpointError; a load into the model alone (other chunks) is bit-exact."""
    path, expect, _ = run
    copy = str(tmp_path / "job")
    shutil.copytree(path, copy)
    row = (torch.arange(BIG[1], dtype=torch.float32) + 200 * BIG[1]) * 2  # seed 1: big * 2
    needle = bits(row)
    hits = []
    for root, _, files in os.walk(os.path.join(copy, "streams")):
        for f in files:
            if f.endswith(".seg"):
                with open(os.path.join(root, f), "rb") as fh:
                    data = fh.read()
                if needle in data:
                    hits.append((os.path.join(root, f), data.index(needle)))
    assert len(hits) == 1 and f"{os.sep}0000000001-00001{os.sep}" in hits[0][0], hits
    seg, at = hits[0]
    with open(seg, "r+b") as fh:
        fh.seek(at + 5)
        b = fh.read(1)
        fh.seek(at + 5)
        fh.write(bytes([b[0] ^ 0x10]))
    full = _expect(expect, 2)
    with ckptstore.open(copy, "r") as store:
        with pytest.raises(DamagedCheckpointError):
            store.load(2)
        with pytest.raises(DamagedCheckpointError):
            store.load(2, into={"big": torch.zeros(BIG)})
        model = {k: torch.zeros_like(v) for k, v in full["model"].items()}
        store.load(2, into={"model": model})
        assert_bits(model, full["model"], "model")


# ---- damaged sections (pure: no store) ------------------------------------------------------------
def _part(rank, world, boxes, value, replicas=None):
    return {"w": value, SECTION_KEY: {"v": 1, "rank": rank, "world": world,
                                      "tensors": {path_key(("w",)): boxes},
                                      "replicas": replicas or {}}}


def _box(off, n, shape=(4,)):
    return {"shape": list(shape), "offsets": [off], "local": [n], "placements": ["S0"],
            "mesh": [2]}


def test_damaged_sections_raise_typed_errors():
    a, b = torch.arange(2.0), torch.arange(2.0, 4.0)
    whole = assemble([_part(0, 2, _box(0, 2), a), _part(1, 2, _box(2, 2), b)], 0, 5)
    assert whole["w"].tolist() == [0.0, 1.0, 2.0, 3.0] and SECTION_KEY not in whole
    with pytest.raises(ShardCoverageError, match="overlap"):
        assemble([_part(0, 2, _box(0, 3), torch.zeros(3)), _part(1, 2, _box(2, 2), b)], 0, 5)
    with pytest.raises(ShardCoverageError, match="no shard holds"):
        assemble([_part(0, 2, _box(0, 1), torch.zeros(1)), _part(1, 2, _box(2, 2), b)], 0, 5)
    with pytest.raises(DamagedCheckpointError, match="not a part 1 of 2"):
        assemble([_part(0, 2, _box(0, 2), a), _part(0, 2, _box(2, 2), b)], 0, 5)
    # both ranks hold the whole tensor and each leaves it to the other: nobody wrote it
    w = path_key(("w",))
    with pytest.raises(DamagedCheckpointError, match="no rank wrote"):
        assemble([_part(0, 2, _box(0, 4), None, {w: 1}), _part(1, 2, _box(0, 4), None, {w: 0})],
                 0, 5)
    with pytest.raises(DamagedCheckpointError, match="does not fit"):
        assemble([_part(0, 2, _box(0, 2), torch.zeros(3)), _part(1, 2, _box(2, 2), b)], 0, 5)
    with pytest.raises(DamagedCheckpointError, match="malformed path"):
        dtensor_state.key_path("w")


@pytest.mark.slow
def test_reshard_2_to_4(run, tmp_path):
    """4 ranks load the 2-rank iteration: each box bit for bit, each rank reading only the
    chunks overlapping its boxes (``big``: 4 KiB of its 8 KiB stored shard)."""
    path, expect, _ = run
    copy = str(tmp_path / "job")
    shutil.copytree(path, copy)
    results = ok(run_ranks(4, MOD, "reshard", copy, str(tmp_path / "work"), expect_dir=expect))
    for r, res in enumerate(results):
        assert res["bad"] == [], (r, res)
        # every rank's quarter of ``big`` lies in one stored half: one rank's part read for it
        assert sum(res["counts"].values()) < CHUNK + 2048, (r, res)


@pytest.mark.slow
@pytest.mark.parametrize("nth", [1, 3])
def test_rank_killed_during_a_dtensor_save_leaves_the_previous_iteration(tmp_path, nth):
    """SIGKILL of rank 1 at its first (or third) file operation of a DTensor save: rank 0's save
    fails (a typed error), nothing of iteration 2 is visible, iteration 1 loads whole bit for
    bit."""
    path, expect = str(tmp_path / "job"), str(tmp_path / "expect")
    res = run_ranks(2, MOD, "killed_mid_save", path, str(tmp_path / "work"), expect_dir=expect,
                    nth=nth)
    assert res[1] == {"died": -9}, res
    name, message = res[0]["ok"]
    # the coordinator lost contact during the vote: CommitOutcomeUnknownError (a
    # RankFailureError; the gloo error does not say which rank died) with its records kept
    assert name in ("RankFailureError", "CommitOutcomeUnknownError",
                    "GlobalCommitAbortedError"), res
    assert "rank 0 of 2" in message, res
    with ckptstore.open(path, "r") as store:
        assert store.iterations() == [1]
        assert_bits(store.load(1), _expect(expect, 1), "iteration 1")
