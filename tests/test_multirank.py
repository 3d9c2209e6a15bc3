"""Multi-rank job stores (format-spec/format.md §22) on real multi-process gloo groups.

Every scenario runs on spawned ranks (tests/_ranks.py) with a deadline, so a rank that hangs fails
the test instead of CI. States are pure functions of (iteration, rank), so any process can check
what any rank saved, bit for bit.
"""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch

import ckptstore
from ckptstore.storage.job_log import JobLayout, read_job_view

from _crashkit import KillOps, state_for
from _ranks import needs_gloo, run_ranks
from conftest import _same

pytestmark = needs_gloo

MOD = __name__


def rank_state(it: int, rank: int) -> dict:
    s = state_for(it)
    s["rank"] = {"id": rank, "rng": torch.arange(16, dtype=torch.float64) * (rank + 1) + it}
    return s


def same(a, b) -> bool:
    try:
        _same(a, b, "state")
        return True
    except AssertionError:
        return False


def _pg():
    import torch.distributed as dist

    return dist.group.WORLD


def errors_of(results) -> list:
    return [r.get("error") for r in results]


def ok(results) -> list:
    assert all("ok" in r for r in results), [
        (r.get("error"), r.get("message"), r.get("trace", "")[-1500:], r.get("died")) for r in results]
    return [r["ok"] for r in results]


# ---- scenarios (run on every rank) ------------------------------------------------------------
def save_and_load(rank, world, path, iterations, timeout=30.0):
    with ckptstore.open(path, "a", process_group=_pg(), commit_timeout=timeout) as s:
        assert isinstance(s, ckptstore.JobStore) and s.rank == rank and s.world_size == world
        start = (s.latest() or 0) + 1
        for it in range(start, start + iterations):
            s.save(it, rank_state(it, rank), meta={"loss": 1.0 / it})
        assert s.iterations()[-iterations:] == list(range(start, start + iterations))
        checks = [same(rank_state(it, rank), s.load(it)) for it in s.iterations()]
        other = (rank + 1) % world
        checks.append(same(rank_state(start, other), s.load(start, rank=other)))
        return {"epoch": s.epoch, "iterations": s.iterations(), "exact": all(checks)}


def fail_on_one_rank(rank, world, path, how):
    """Iteration 1 commits; iteration 2 fails on rank 1 (how); then 2 is retried and commits."""
    ops = None
    if how == "fsync" and rank == 1:
        from test_faults import FaultyOps
        ops = FaultyOps()
    with ckptstore.open(path, "a", process_group=_pg(), commit_timeout=30.0, file_ops=ops) as s:
        s.save(1, rank_state(1, rank))
        err = None
        try:
            if how == "unsupported" and rank == 1:
                s.save(2, {"bad": object()})
            elif how == "mismatch":
                s.save(2 + rank, rank_state(2, rank))
            else:
                if ops is not None:
                    import errno
                    ops.arm("fsync", 2, errno.ENOSPC)  # the local COMMIT's fsync
                s.save(2, rank_state(2, rank))
        except ckptstore.CkptStoreError as e:
            err = type(e).__name__
        except TypeError as e:
            err = type(e).__name__
        after_failure = s.iterations()
        s.save(2, rank_state(2, rank))  # the same iteration again: nothing of the failure is left
        return {"error": err, "after_failure": after_failure, "final": s.iterations(),
                "exact": same(rank_state(2, rank), s.load(2))}


def deltas_and_flush(rank, world, path):
    """Snapshot, then deltas appended without committing and committed by one flush; the records
    load back per rank (load_record: a delta is stored as written)."""
    with ckptstore.open(path, "a", process_group=_pg(), commit_timeout=30.0) as s:
        s.save(0, rank_state(0, rank))
        for it in (1, 2, 3):
            s.save_delta(it, {"g": torch.full((5,), float(it + 10 * rank))}, durable=False)
        assert s.iterations() == [0]
        durable = s.flush()
        rec = s.load_record(2)
        return {"durable": durable, "iterations": s.iterations(), "kind": s.kind(3),
                "g": rec["g"].tolist()}


def save_with_features(rank, world, path, iteration, features):
    """Open with ``features``, save ``iteration``; the STORE flags of this rank's new stream, or
    the error's type and message."""
    from ckptstore.storage.layout import Layout
    from ckptstore.storage.store_file import read_store_header

    try:
        s = ckptstore.open(path, "a", process_group=_pg(), commit_timeout=30.0, features=features)
    except ckptstore.CkptStoreError as e:
        return {"error_type": type(e).__name__, "message": str(e)}
    with s:
        s.save(iteration, rank_state(iteration, rank))
        own = JobLayout(path).stream_dir(s.epoch, rank)
        return {"flags": read_store_header(Layout(own)).flags, "iterations": s.iterations()}


def zombie(rank, world, path, ready, go):
    """Job A (world 1): commits 1, waits while job B takes the store over, then tries again."""
    import time

    s = ckptstore.open(path, "a", process_group=_pg(), commit_timeout=30.0)
    s.save(1, rank_state(1, 0))
    open(ready, "w").close()
    while not os.path.exists(go):
        time.sleep(0.05)
    try:
        s.save(3, rank_state(3, 0))
        outcome = "committed"
    except ckptstore.StaleWriterError as e:
        outcome = f"StaleWriterError: {e}"
    try:
        s.close()
    except ckptstore.CkptStoreError:
        pass
    return outcome


def kill_loop(rank, world, path, victim, nth, acks):
    """Save iterations until rank ``victim`` is SIGKILLed at its ``nth`` file operation;
    acknowledge each save that returned (one line per iteration, fsynced)."""
    ops = KillOps("any", nth) if rank == victim else None
    with open(f"{acks}-{rank}", "a") as ack:
        s = ckptstore.open(path, "a", process_group=_pg(), commit_timeout=20.0, file_ops=ops)
        start = (s.latest() or 0) + 1
        for it in range(start, start + 40):
            s.save(it, rank_state(it, rank))
            ack.write(f"{it}\n")
            ack.flush()
            os.fsync(ack.fileno())
        s.close()
    return "no kill"


# ---- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_saves_and_loads_its_own_state(tmp_path, world):
    path = str(tmp_path / "job")
    res = ok(run_ranks(world, MOD, "save_and_load", path, str(tmp_path / "w1"), iterations=3))
    assert all(r["exact"] for r in res) and {r["epoch"] for r in res} == {1}
    assert all(r["iterations"] == [1, 2, 3] for r in res)
    # a second job continues the store in a new epoch; the first job's iterations stay readable
    res = ok(run_ranks(world, MOD, "save_and_load", path, str(tmp_path / "w2"), iterations=2))
    assert {r["epoch"] for r in res} == {2} and all(r["exact"] for r in res)
    with ckptstore.open(path, "r") as reader:
        assert isinstance(reader, ckptstore.JobStore) and reader.world_size == world
        assert reader.iterations() == [1, 2, 3, 4, 5]
        for it in reader.iterations():
            for r in range(world):
                assert same(rank_state(it, r), reader.load(it, rank=r)), (it, r)
        assert reader.meta(4, rank=1) == {"loss": 0.25}
        with pytest.raises(ValueError, match="rank="):
            reader.load(1)
        with pytest.raises(ckptstore.RankMismatchError):
            reader.load(1, rank=world)
        with pytest.raises(ckptstore.NotFoundError):
            reader.load(6, rank=0)
    streams = sorted(os.listdir(os.path.join(path, "streams")))
    assert streams == [f"{e:010d}-{r:05d}" for e in (1, 2) for r in range(world)]
    # a single-writer open of a job store is refused with a clear error
    with pytest.raises(ckptstore.UnsupportedVersionError, match="multi-rank"):
        ckptstore.Store(path, "a")


@pytest.mark.parametrize("how", ["unsupported", "fsync", "mismatch"])
def test_a_failure_on_one_rank_aborts_the_iteration_on_every_rank(tmp_path, how):
    path = str(tmp_path / "job")
    res = ok(run_ranks(2, MOD, "fail_on_one_rank", path, str(tmp_path / "w"), how=how))
    expected = {"unsupported": ["GlobalCommitAbortedError", "UnsupportedTypeError"],
                "fsync": ["GlobalCommitAbortedError", "DiskFullError"],
                "mismatch": ["RankMismatchError", "RankMismatchError"]}[how]
    assert [r["error"] for r in res] == expected
    assert all(r["after_failure"] == [1] and r["final"] == [1, 2] and r["exact"] for r in res)
    with ckptstore.open(path, "r") as reader:
        assert reader.iterations() == [1, 2]
        for r in range(2):
            assert same(rank_state(2, r), reader.load(2, rank=r))
            # rank 0's local commit of the failed attempt was cut: its stream holds 1 and 2 once
            stream = ckptstore.open(JobLayout(path).stream_dir(1, r), "r")
            assert stream.iterations() == [1, 2]
            stream.close()


def test_deltas_are_committed_globally_by_one_flush(tmp_path):
    path = str(tmp_path / "job")
    res = ok(run_ranks(2, MOD, "deltas_and_flush", path, str(tmp_path / "w")))
    assert [r["durable"] for r in res] == [3, 3]
    assert all(r["iterations"] == [0, 1, 2, 3] and r["kind"] == "delta" for r in res)
    assert [r["g"] for r in res] == [[2.0] * 5, [12.0] * 5]


def test_a_job_store_keeps_the_features_its_first_streams_were_created_with(tmp_path):
    """Every job that reopens a multi-rank store creates new streams (one per rank per epoch):
    they get the features of the job's first streams whatever the reopening job asks, so a store
    begun "compatible" stays readable by older releases; asking "compatible" of a store begun
    with features raises StoreFeaturesError on every rank, and a bad value is refused before
    anything is created."""
    from ckptstore.format.header import NEW_STORE_FEATURES

    compat, current = str(tmp_path / "compat"), str(tmp_path / "current")
    # (one rank where the check is each rank's own: a job of 2 ranks per store, then of 1)
    for path, world, features, it, flags in ((compat, 2, "compatible", 0, 0),
                                             (compat, 1, "current", 1, 0),
                                             (current, 1, "current", 0, NEW_STORE_FEATURES)):
        res = ok(run_ranks(world, MOD, "save_with_features", path, str(tmp_path / "w"),
                           iteration=it, features=features))
        assert [r["flags"] for r in res] == [flags] * world
        assert res[0]["iterations"] == list(range(it + 1))
    res = run_ranks(2, MOD, "save_with_features", current, str(tmp_path / "w"), iteration=1,
                    features="compatible")
    assert [r["ok"]["error_type"] for r in res] == ["StoreFeaturesError"] * 2, res
    assert all("FRAMING_CHECKS" in r["ok"]["message"] for r in res)
    with pytest.raises(ValueError, match="features must be"):
        ckptstore.JobStore(str(tmp_path / "none"), "r", features="old")
    assert not os.path.exists(tmp_path / "none")


def test_a_writer_of_an_older_epoch_is_fenced(tmp_path):
    """Two jobs on one store (no flock between them: each epoch writes its own files): the newer
    job's epoch wins, the older job's next commit raises StaleWriterError, and readers see the
    older job's commits only up to where the newer job began."""
    import threading

    path = str(tmp_path / "job")
    ready, go = str(tmp_path / "ready"), str(tmp_path / "go")
    out: dict = {}
    a = threading.Thread(target=lambda: out.setdefault("a", run_ranks(
        1, MOD, "zombie", path, str(tmp_path / "wa"), ready=ready, go=go)))
    a.start()
    try:
        for _ in range(1200):
            if os.path.exists(ready):
                break
            a.join(0.1)
        assert os.path.exists(ready), "job A did not get going"
        res = ok(run_ranks(1, MOD, "save_and_load", path, str(tmp_path / "wb"), iterations=1))
        assert res[0]["epoch"] == 2 and res[0]["iterations"] == [1, 2]
    finally:
        open(go, "w").close()
        a.join(120)
    assert ok(out["a"])[0].startswith("StaleWriterError")
    with ckptstore.open(path, "r") as reader:
        assert reader.iterations() == [1, 2]
        assert same(rank_state(2, 0), reader.load(2))


def _acked(path: str) -> set[int]:
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        return {int(line) for line in f if line.strip()}


@pytest.mark.slow
def test_sigkill_of_any_rank_during_commits_loses_nothing(tmp_path):
    """A rank is SIGKILLed at a random file operation (a stream write or fsync, or on rank 0 the
    global log's); the other rank gets a typed error (RankFailureError or
    CommitOutcomeUnknownError) instead of hanging; every iteration any rank acknowledged is
    committed and loads bit-exact for every rank; no partial iteration is visible; a new job
    resumes. ``CKPTSTORE_MULTIRANK_KILLS`` kills (default 4; the README's figure used 200)."""
    kills = int(os.environ.get("CKPTSTORE_MULTIRANK_KILLS", "4"))
    rng = random.Random(int(os.environ.get("CKPTSTORE_SEED", "1234")))
    path = str(tmp_path / "job")
    acked: set[int] = set()
    errors: dict[str, int] = {}
    for trial in range(kills):
        victim, nth = rng.randrange(2), rng.randrange(1, 60)
        acks = str(tmp_path / f"acks-{trial}")
        res = run_ranks(2, MOD, "kill_loop", path, str(tmp_path / f"w{trial}"), deadline=90,
                        victim=victim, nth=nth, acks=acks)
        survivor = res[1 - victim]
        assert "died" in res[victim] or res[victim].get("ok") == "no kill", res[victim]
        if "died" in res[victim]:
            assert "error" in survivor and "RankFailureError" in survivor["mro"], survivor
            errors[survivor["error"]] = errors.get(survivor["error"], 0) + 1
        for r in range(2):
            acked |= _acked(f"{acks}-{r}")
        check_job_store(path, acked)
    print(f"{kills} kills; survivors' errors: {errors}; {len(acked)} acknowledged iterations")


def check_job_store(path: str, acked: set[int]) -> None:
    with ckptstore.open(path, "r") as reader:
        its = reader.iterations()
        assert acked <= set(its), sorted(acked - set(its))
        for it in its:  # nothing partial: every visible iteration loads for every rank
            for r in range(reader.world_size or 0):
                assert same(rank_state(it, r), reader.load(it, rank=r)), (it, r)


def test_global_log_records_decode_and_name_every_rank(tmp_path):
    path = str(tmp_path / "job")
    ok(run_ranks(2, MOD, "save_and_load", path, str(tmp_path / "w"), iterations=2))
    layout = JobLayout(path)
    header = ckptstore.open(path, "r").header
    view = read_job_view(layout, header.store_id)
    assert view.chain == [1] and view.epoch.world_size == 2 and not view.notes
    g = view.commits[2]
    assert g.world_size == 2 and [rc.commit.iteration for rc in g.ranks] == [2, 2]
    # torn tail: the last record cut in half is not committed, the rest is
    log = layout.epoch_log_path(1)
    size = os.path.getsize(log)
    with open(log, "r+b") as f:
        f.truncate(size - 40)
    view = read_job_view(layout, header.store_id)
    assert list(view.commits) == [1] and view.notes


def test_a_damaged_rank_stream_is_reported_naming_the_rank(tmp_path):
    """Damage confined to one rank's stream costs that rank's loads only, with an error naming
    the rank and the stream; a missing stream is reported the same way."""
    import shutil

    path = str(tmp_path / "job")
    ok(run_ranks(2, MOD, "save_and_load", path, str(tmp_path / "w"), iterations=2))
    stream1 = JobLayout(path).stream_dir(1, 1)
    seg = os.path.join(stream1, "segments", "0000000001.seg")
    data = bytearray(open(seg, "rb").read())
    # the last record of the segment is iteration 2's COMMIT: flip a byte of its payload
    data[-20] ^= 0xFF
    open(seg, "wb").write(bytes(data))
    shutil.rmtree(os.path.join(stream1, "index"), ignore_errors=True)
    with ckptstore.open(path, "r") as reader:
        assert reader.iterations() == [1, 2]  # the global log is intact
        assert same(rank_state(2, 0), reader.load(2, rank=0))
        assert same(rank_state(1, 1), reader.load(1, rank=1))
        with pytest.raises(ckptstore.DamagedCheckpointError, match="rank 1") as info:
            reader.load(2, rank=1)
        assert stream1 in str(info.value)
    shutil.rmtree(stream1)
    with ckptstore.open(path, "r") as reader:
        assert same(rank_state(1, 0), reader.load(1, rank=0))
        with pytest.raises(ckptstore.DamagedCheckpointError, match="rank 1.*missing"):
            reader.load(1, rank=1)


def test_cli_ls_show_and_fsck_of_a_job_store(tmp_path, capsys):
    from ckptstore.cli import main

    path = str(tmp_path / "job")
    ok(run_ranks(2, MOD, "save_and_load", path, str(tmp_path / "w"), iterations=2))
    assert main(["ls", path]) == 0
    out = capsys.readouterr().out
    assert "2 ranks" in out and out.splitlines()[1].split()[:4] == ["iteration", "kind", "epoch", "ranks"]
    assert main(["show", path, "2", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "showing rank 1" in out and "rank/rng" in out
    assert main(["fsck", path]) == 0
    out = capsys.readouterr().out
    assert "2 committed iterations, 2 ranks" in out and out.strip().endswith("clean")
    assert main(["gc", path, "--keep-last", "1", "--dry-run"]) == 0  # job-store gc: test_job_gc
    capsys.readouterr()
    assert main(["gc", JobLayout(path).stream_dir(1, 0), "--keep-last", "1"]) == 2
    assert "part of the multi-rank job store" in capsys.readouterr().err
    out_file = str(tmp_path / "r1.pt")
    assert main(["restore", path, "2", "--rank", "1", "--out", out_file]) == 0
    capsys.readouterr()
    assert same(rank_state(2, 1), torch.load(out_file, weights_only=False))
    seg = os.path.join(JobLayout(path).stream_dir(1, 1), "segments", "0000000001.seg")
    data = bytearray(open(seg, "rb").read())
    data[-20] ^= 0xFF  # iteration 2's COMMIT record on rank 1
    open(seg, "wb").write(bytes(data))
    assert main(["fsck", path]) == 1
    out = capsys.readouterr().out
    assert "NOT CLEAN" in out and "DAMAGED iteration 2" in out and "rank 1" in out, out


# ---- data-parallel training through the Checkpointer ------------------------------------------
def _ddp_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model[6].weight = model[4].weight  # tied: "6.weight" is an alias in the state dict
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def ddp_train(rank, world, path, iterations, live_dir, base_every=4, group_commit=2,
              partition=None, asynchronous=True, comm_hook=False, retention=None,
              **checkpointer_kw):
    """DDP training with a Checkpointer on the job store: restore (or start), train, and save the
    live model and optimizer state after every step for the test to compare. ``checkpointer_kw``:
    more of the Checkpointer's arguments (its policy's)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ckptstore.torch import Checkpointer, ddp_comm_hook

    model, opt, sched = _ddp_model()
    ddp = DDP(model)
    store = ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=60.0)
    checkpointer_kw.setdefault("policy", "every-iteration")  # (the delta path's tests)
    ck = Checkpointer(store, model, opt, sched, base_every=base_every, group_commit=group_commit,
                      partition=partition, asynchronous=asynchronous, retention=retention,
                      **checkpointer_kw)
    if comm_hook:
        ddp.register_comm_hook(None, ddp_comm_hook(ck))
    start = ck.restore()
    from ckptstore.torch.dp_restore import can_load_in_parallel
    parallel = start > 0 and can_load_in_parallel(store, start)
    restored = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                "optimizer": copy.deepcopy(opt.state_dict()), "rng": torch.get_rng_state()}
    for it in range(start + 1, start + iterations + 1):
        g = torch.Generator().manual_seed(1000 * rank + it)
        x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        ck.step(it, meta={"rank": rank})
        opt.zero_grad()
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                       os.path.join(live_dir, f"live-{it}.pt"))
    torch.save(restored, os.path.join(live_dir, f"restored-{start}-rank{rank}.pt"))
    written = sum(store.info(i, rank=rank).written_bytes for i in store.iterations()
                  if store.global_commit(i).epoch == store.epoch)
    plan = ck.plan()
    auto = {"retention": repr(store.retention), "plan_retention": plan and plan.retention,
            "mode": ck.mode}
    store.close()
    del ddp
    return {"start": start, "written": written, "parallel": parallel,
            "captured": dict(ck.capture_counts), **auto}


def _ddp_check(path, live_dir, its):
    with ckptstore.open(path, "r") as reader:
        for it in its:
            live = torch.load(os.path.join(live_dir, f"live-{it}.pt"))
            state = reader.load(it)
            _same(live["model"], state["model"], f"iteration {it} model")
            _same(live["optimizer"], state["optimizer"], f"iteration {it} optimizer")


@pytest.mark.parametrize("world,asynchronous,comm_hook",
                         [(2, True, False), (4, True, False), (2, False, False), (2, True, True)],
                         ids=["2-async", "4-async", "2-sync", "2-async-ddp-comm-hook"])
def test_ddp_checkpointer_partitions_and_restores_every_rank(tmp_path, world, asynchronous,
                                                             comm_hook):
    """Each rank writes only its share of the parameters (their state and gradients); the merged
    load of any iteration, base or replayed delta, equals the live DDP state bit for bit; a new
    job resumes every rank from the store (model, optimizer, scheduler; RNG per rank)."""
    path, live = str(tmp_path / "job"), str(tmp_path / "live")
    os.makedirs(live)
    res = ok(run_ranks(world, MOD, "ddp_train", path, str(tmp_path / "w1"), deadline=240,
                       iterations=9, live_dir=live, asynchronous=asynchronous,
                       comm_hook=comm_hook))
    assert [r["start"] for r in res] == [0] * world
    if comm_hook:  # every rank captured its own parameters from the all-reduced buckets
        assert all(r["captured"]["ddp"] > 0 and r["captured"]["step"] == 0 for r in res), res
    _ddp_check(path, live, range(1, 10))
    with ckptstore.open(path, "r") as reader:
        assert reader.iterations() == list(range(0, 10)) and reader.kind(5) == "delta"
        parts = [reader.load(6, rank=r) for r in range(world)]
        names = {n for n, _ in _ddp_model()[0].named_parameters()}
        owned = [set(p["model"]) & names for p in parts]
        assert sum(len(o) for o in owned) == len(names) == 9 and all(owned)
        holders = [r for r, p in enumerate(parts) if "6.weight" in p["model"]]
        assert len(holders) == 1 and "4.weight" in parts[holders[0]]["model"]  # with its parameter
    # a second job resumes at 9 on every rank and continues; its first step is a base
    res2 = ok(run_ranks(world, MOD, "ddp_train", path, str(tmp_path / "w2"), deadline=240,
                        iterations=3, live_dir=live, asynchronous=asynchronous))
    assert [r["start"] for r in res2] == [9] * world
    assert all(r["parallel"] for r in res2)  # each rank replayed its own part, then exchanged
    for r in range(world):
        restored = torch.load(os.path.join(live, f"restored-9-rank{r}.pt"))
        live9 = torch.load(os.path.join(live, "live-9.pt"))
        _same(dict(live9["model"]), restored["model"], "restored model")
        _same(live9["optimizer"], restored["optimizer"], "restored optimizer")
    _ddp_check(path, live, range(8, 13))
    with ckptstore.open(path, "r") as reader:
        assert reader.kind(10) == "snapshot" and reader.iterations()[-1] == 12


@pytest.mark.parametrize("saved,resumed", [(2, 1), (2, 4), (4, 2)])
def test_ddp_checkpoints_resume_at_another_world_size(tmp_path, saved, resumed):
    path, live = str(tmp_path / "job"), str(tmp_path / "live")
    os.makedirs(live)
    ok(run_ranks(saved, MOD, "ddp_train", path, str(tmp_path / "w1"), deadline=240,
                 iterations=6, live_dir=live))
    res = ok(run_ranks(resumed, MOD, "ddp_train", path, str(tmp_path / "w2"), deadline=240,
                       iterations=3, live_dir=live))
    assert [r["start"] for r in res] == [6] * resumed
    assert not any(r["parallel"] for r in res)  # another world size: every part merged here
    for r in range(resumed):
        restored = torch.load(os.path.join(live, f"restored-6-rank{r}.pt"))
        _same(dict(torch.load(os.path.join(live, "live-6.pt"))["model"]), restored["model"],
              "restored")
    _ddp_check(path, live, range(1, 10))
    with ckptstore.open(path, "r") as reader:
        assert reader.world_size == resumed
        assert [reader.global_commit(i).world_size for i in (6, 7)] == [saved, resumed]


def async_saves(rank, world, path, fail):
    """Async snapshots and deltas: the global rounds run in each rank's persister thread. With
    ``fail``, rank 1's second fsync of iteration 3's job fails (the local commit of delta 2's
    group, committed first): the futures of iteration 3 raise on both ranks, the next call
    reports it once, and saving resumes."""
    ops = None
    if fail and rank == 1:
        from test_faults import FaultyOps
        ops = FaultyOps()
    with ckptstore.open(path, "a", process_group=_pg(), commit_timeout=30.0, file_ops=ops) as s:
        s.save_async(1, rank_state(1, rank)).result()
        s.save_delta_async(2, {"g": torch.full((3,), 2.0 + rank)}, durable=False)
        if ops is not None:
            import errno
            ops.arm("fsync", 2, errno.ENOSPC)
        fut = s.save_async(3, rank_state(3, rank))  # commits delta 2's group first (one round)
        err = None
        try:
            fut.result()
        except ckptstore.CkptStoreError as e:
            err = type(e).__name__
        reported = None
        try:
            s.check()
        except ckptstore.CkptStoreError as e:
            reported = type(e).__name__
        s.save_async(4, rank_state(4, rank)).result()
        s.flush()
        return {"error": err, "reported": reported, "iterations": s.iterations(),
                "exact": same(rank_state(4, rank), s.load(4, rank=rank))}


@pytest.mark.parametrize("fail", [False, True], ids=["ok", "fsync-fails-on-rank-1"])
def test_async_saves_commit_globally_in_the_background(tmp_path, fail):
    path = str(tmp_path / "job")
    res = ok(run_ranks(2, MOD, "async_saves", path, str(tmp_path / "w"), fail=fail))
    if fail:
        assert [r["error"] for r in res] == ["GlobalCommitAbortedError", "DiskFullError"]
        assert [r["reported"] for r in res] == ["GlobalCommitAbortedError", "DiskFullError"]
        # delta 2 was committed in iteration 3's job (its group first): the failure rolled both
        # back on both ranks, as a failed async save does on a single store
        assert all(r["iterations"] == [1, 4] for r in res)
    else:
        assert [r["error"] for r in res] == [None, None]
        assert all(r["iterations"] == [1, 2, 3, 4] for r in res)
    assert all(r["exact"] for r in res)


# ---- regressions from review: outcomes a rank must not misread, rounds a rank must not skip -----
def global_log_fails(rank, world, path):
    """Rank 0's global log: the fsync of iteration 2's GLOBAL_COMMIT fails and cutting it back
    fails too. The record may be durable: every rank must keep its records (unknown outcome),
    never cut them."""
    import errno

    from ckptstore.storage.fileops import FileOps, io_errors

    class Faulty(FileOps):
        armed = False

        def fsync(self, fd, p):
            if self.armed and p.endswith(".log"):
                with io_errors("fsync", p):
                    raise OSError(errno.EIO, "injected")
            return super().fsync(fd, p)

        def truncate(self, fd, p, length):
            if self.armed and p.endswith(".log"):
                with io_errors("truncate", p):
                    raise OSError(errno.EIO, "injected")
            return super().truncate(fd, p, length)

    s, error = _second_save_with_rank_0_faulty(rank, path, Faulty() if rank == 0 else None)
    try:
        s.close()
    except ckptstore.CkptStoreError:
        pass
    return None if error is None else type(error).__name__


def _second_save_with_rank_0_faulty(rank, path, ops):
    """Open the job (rank 0 with ``ops``), save iteration 1, arm ``ops``, save iteration 2:
    (the open store, the error the second save raised or None)."""
    s = ckptstore.open(path, "a", process_group=_pg(), commit_timeout=30.0, file_ops=ops)
    s.save(1, rank_state(1, rank))
    if ops is not None:
        ops.armed = True
    try:
        s.save(2, rank_state(2, rank))
    except ckptstore.CkptStoreError as e:
        return s, e
    return s, None


def test_a_global_log_that_cannot_be_cut_back_keeps_every_ranks_records(tmp_path):
    path = str(tmp_path / "job")
    res = ok(run_ranks(2, MOD, "global_log_fails", path, str(tmp_path / "w")))
    assert res == ["CommitOutcomeUnknownError", "CommitOutcomeUnknownError"]
    with ckptstore.open(path, "r") as reader:  # the record did reach the file: it is committed
        assert reader.iterations() == [1, 2]
        for r in range(2):
            assert same(rank_state(2, r), reader.load(2, rank=r))


def global_log_full(rank, world, path):
    """Rank 0's global log: the append of iteration 2's GLOBAL_COMMIT fails (ENOSPC) and is cut
    back. Every rank's error carries the coordinator's typed failure as its cause."""
    import errno

    from ckptstore.storage.fileops import FileOps

    class Faulty(FileOps):
        armed = False

        def writev(self, fd, p, buffers, offset):
            if self.armed and p.endswith(".log"):
                self.armed = False
                from ckptstore.storage.fileops import io_errors
                with io_errors("write", p):
                    raise OSError(errno.ENOSPC, "injected")
            return super().writev(fd, p, buffers, offset)

    s, e = _second_save_with_rank_0_faulty(rank, path, Faulty() if rank == 0 else None)
    out = None
    if e is not None:
        cause = e.__cause__
        out = [type(e).__name__, type(cause).__name__, getattr(cause, "rank", None),
               ".log" in str(cause)]
    s.save(3, rank_state(3, rank))  # the job goes on
    its = s.iterations()
    s.close()
    return {"error": out, "iterations": its}


def test_a_global_log_that_fails_and_is_cut_back_names_its_typed_error_on_every_rank(tmp_path):
    res = ok(run_ranks(2, MOD, "global_log_full", str(tmp_path / "job"), str(tmp_path / "w")))
    assert [r["error"] for r in res] == [
        ["GlobalCommitAbortedError", "DiskFullError", None, True],
        ["GlobalCommitAbortedError", "DiskFullError", 0, True]], res
    assert all(r["iterations"] == [1, 3] for r in res), res


def local_failure_then_flush(rank, world, path):
    """Rank 1's async delta (durable=False: no round) fails on its own; then every rank
    flushes. The flush round must run on both (rank 1 votes FAILED), not leave rank 0 waiting
    for the commit timeout."""
    import errno
    import time

    from test_faults import FaultyOps

    ops = FaultyOps() if rank == 1 else None
    s = ckptstore.open(path, "a", process_group=_pg(), commit_timeout=20.0, file_ops=ops)
    s.save_async(0, rank_state(0, rank)).result()
    if ops is not None:
        ops.arm("write", 1, errno.ENOSPC)
    fut = s.save_delta_async(1, {"g": torch.ones(3)}, durable=False)
    time.sleep(1.0)
    t0 = time.monotonic()
    try:
        s.flush()
        flushed = "ok"
    except ckptstore.CkptStoreError as e:
        flushed = type(e).__name__
    waited = time.monotonic() - t0
    del fut
    s.save_async(2, rank_state(2, rank)).result()  # the store works again on every rank
    its = s.iterations()
    s.close()
    return {"flush": flushed, "waited": waited, "iterations": its}


def test_a_rank_local_async_failure_does_not_leave_the_others_waiting(tmp_path):
    res = ok(run_ranks(2, MOD, "local_failure_then_flush", str(tmp_path / "job"),
                       str(tmp_path / "w")))
    assert [r["flush"] for r in res] == ["GlobalCommitAbortedError", "DiskFullError"], res
    assert all(r["waited"] < 10 for r in res), res
    assert all(r["iterations"] == [0, 2] for r in res), res


def test_a_stray_epoch_zero_file_is_not_a_global_log(tmp_path):
    path = str(tmp_path / "job")
    ok(run_ranks(1, MOD, "save_and_load", path, str(tmp_path / "w"), iterations=1))
    open(os.path.join(path, "global", "0000000000.log"), "wb").close()
    with ckptstore.open(path, "r") as reader:
        assert reader.iterations() == [1]


def reopen_in_process(rank, world, path, times):
    """Open, save into and close a job store ``times`` times in the same processes (a fresh
    store each time, and the first again at the end)."""
    out = []
    for i in list(range(times)) + [0]:
        with ckptstore.open(f"{path}{i}", "a", process_group=_pg(), commit_timeout=20.0) as s:
            it = (s.latest() or 0) + 1
            s.save(it, rank_state(it, rank))
            out.append(s.iterations())
    return out


def test_a_job_store_reopened_in_the_same_processes(tmp_path):
    """A job store closed and opened again in the same 4 processes: each open makes a new gloo
    group and each close destroys it; torch would give the new group the destroyed one's name,
    whose rendezvous keys are still in the default store (4 ranks hung at the second open), so
    RankGroup's backend reads its keys under a fresh generation (multirank/group.py)."""
    res = ok(run_ranks(4, MOD, "reopen_in_process", str(tmp_path / "job"), str(tmp_path / "w"),
                       deadline=120, times=3))
    assert res == [[[1], [1], [1], [1, 2]]] * 4, res
