"""Errors that cross ranks carry the failing rank and its cause (issue 29.4).

Real 2-rank gloo jobs: DDP with ckptstore's comm hook and a Checkpointer on a job store, one rank's
disk filling up (an injected ENOSPC) or one rank dying. Every rank learns at once which rank failed
and why; nobody waits for ``commit_timeout`` (60 s here); under "retry" training goes on on every
rank; ``health()`` counts the failure on every rank.
"""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch

import ckptstore
from ckptstore.cli import main as cli

from _ranks import run_ranks

MOD = __name__
TIMEOUT = 60.0


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _segment_write_faults():
    """A FaultyOps whose write faults hit only writes into a stream's segments: the scenario's
    disk fills up under a checkpoint's records, whichever thread writes next (the async
    persister may be appending the previous round's global commit at the moment the fault is
    armed, and a global-log failure is another scenario, whose error names that log)."""
    import threading

    from test_faults import FaultyOps

    class SegmentWriteFaults(FaultyOps):
        def __init__(self) -> None:
            self.writing = threading.local()
            super().__init__()

        def writev(self, fd, path, buffers, offset):
            self.writing.segment = f"{os.sep}segments{os.sep}" in path
            try:
                return super().writev(fd, path, buffers, offset)
            finally:
                self.writing.segment = False

        def write_direct(self, fd, path, buffer, offset):
            self.writing.segment = f"{os.sep}segments{os.sep}" in path
            try:
                return super().write_direct(fd, path, buffer, offset)
            finally:
                self.writing.segment = False

        def _hit(self, op):
            if op == "write" and not getattr(self.writing, "segment", False):
                return None
            return super()._hit(op)

    return SegmentWriteFaults()


def disk_full_on_rank_0(rank, world, path, policy, asynchronous):
    """Train 12 iterations; rank 0's disk fills up at iteration 5's first write."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ckptstore.torch import Checkpointer, ddp_comm_hook

    model, opt = _model()
    ddp = DDP(model)
    ops = _segment_write_faults() if rank == 0 else None
    store = ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=TIMEOUT,
                           file_ops=ops)
    ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=8, group_commit=4,
                      asynchronous=asynchronous, on_failure=policy)
    ddp.register_comm_hook(None, ddp_comm_hook(ck))
    ck.restore()
    error = None
    t0 = time.monotonic()
    for it in range(1, 13):
        if it == 5 and ops is not None:
            ops.arm("write", 1, errno.ENOSPC)
        g = torch.Generator().manual_seed(1000 * rank + it)
        x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
        try:
            try:
                torch.nn.functional.mse_loss(ddp(x), y).backward()
            except RuntimeError as e:
                # rank 0 left first (async: its step reported the failure before this rank's
                # step did): the all-reduce failed in the comm hook, whose typed error DDP
                # re-raises as RuntimeError; ck.peer_failure gives it back, as users are told
                raise ck.peer_failure(e)
            ck.step(it)
        except ckptstore.CkptStoreError as e:
            cause = e.__cause__
            error = {"type": type(e).__name__, "message": str(e),
                     "seconds": time.monotonic() - t0,
                     "cause": [type(cause).__name__, str(cause), getattr(cause, "rank", None)]
                     if cause is not None else None}
            break
        opt.zero_grad()
    t1 = time.monotonic()
    health = ck.health()
    ck.close()
    store.close()
    return {"error": error, "close_seconds": time.monotonic() - t1,
            "failures_total": health.failures_total, "last_error": health.last_error}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_one_ranks_full_disk_reaches_every_rank_with_its_cause(tmp_path, asynchronous):
    _full_disk_run(tmp_path, asynchronous)


@pytest.mark.slow
def test_every_async_full_disk_run_reports_each_ranks_own_failure(tmp_path):
    """The async scenario again and again: a race once told a rank a peer's or a round's failure
    instead of its own (about 1 run in 25 on a loaded machine; fixed in Checkpointer.peer_failure
    and Pipeline._record, each pinned by a deterministic test below). ``CKPTSTORE_RANK_ERROR_RUNS``
    runs (default 5, ~3.5 s each on 2 cores: CI time; 40 to hunt for a race)."""
    for i in range(int(os.environ.get("CKPTSTORE_RANK_ERROR_RUNS", "5"))):
        _full_disk_run(tmp_path / str(i), asynchronous=True)


def _full_disk_run(tmp_path, asynchronous):
    path = str(tmp_path / "job")
    res = run_ranks(2, MOD, "disk_full_on_rank_0", path, str(tmp_path / "w"), deadline=120,
                    policy="raise", asynchronous=asynchronous)
    assert all("ok" in r for r in res), res
    r0, r1 = (r["ok"] for r in res)
    assert r0["error"]["type"] == "DiskFullError", r0
    assert r1["error"]["type"] == "GlobalCommitAbortedError", r1
    seg_dir = os.path.join(path, "streams", "0000000001-00000", "segments")
    # rank 1's error names the failing rank, its error type and the file that failed
    assert "rank 0: " in r1["error"]["message"] and seg_dir in r1["error"]["message"], r1
    assert "DiskFullError" in r1["error"]["message"], r1
    # ... and its cause is rank 0's own error, rebuilt with its type
    cause_type, cause_message, cause_rank = r1["error"]["cause"]
    assert (cause_type, cause_rank) == ("DiskFullError", 0), r1
    assert cause_message.startswith("rank 0: ") and seg_dir in cause_message, r1
    for r in (r0, r1):
        assert r["error"]["seconds"] < TIMEOUT / 3, r   # at once, not after the commit timeout
        assert r["close_seconds"] < TIMEOUT / 3, r      # close runs no round the other never joins
        assert r["failures_total"] == 1, r              # counted under "raise" too
    assert cli(["fsck", path]) == 0
    with ckptstore.open(path, "r") as reader:
        assert reader.iterations() and all(it < 5 for it in reader.iterations())


def test_retry_restarts_the_chain_on_every_rank_and_training_goes_on(tmp_path):
    path = str(tmp_path / "job")
    res = run_ranks(2, MOD, "disk_full_on_rank_0", path, str(tmp_path / "w"), deadline=120,
                    policy="retry", asynchronous=False)
    assert all("ok" in r for r in res), res
    for r in (x["ok"] for x in res):
        assert r["error"] is None and r["failures_total"] == 1, r
    assert "DiskFullError" in res[0]["ok"]["last_error"]
    assert "rank 0: DiskFullError" in res[1]["ok"]["last_error"]
    with ckptstore.open(path, "r") as reader:
        its = reader.iterations()
        assert its[-1] == 12 and any(it > 5 for it in its) and 5 not in its, its
        reader.load(12)
    assert cli(["fsck", path]) == 0


def peer_dies(rank, world, path):
    """Rank 1 dies (os._exit) in the middle of training; rank 0's first error comes from the
    comm hook and is ckptstore's, and the store says why afterwards."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ckptstore.torch import Checkpointer, ddp_comm_hook

    model, opt = _model()
    ddp = DDP(model)
    store = ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=TIMEOUT)
    ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=4, group_commit=2)
    ddp.register_comm_hook(None, ddp_comm_hook(ck))
    ck.restore()
    out = {}
    for it in range(1, 9):
        if it == 6 and rank == 1:
            os._exit(3)
        g = torch.Generator().manual_seed(1000 * rank + it)
        x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
        try:
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            ck.step(it)
        except Exception as e:  # noqa: BLE001 - DDP re-raises the hook's error as RuntimeError
            out["first"] = f"{type(e).__name__}: {e}"
            break
        opt.zero_grad()
    try:
        store.check()
        out["check"] = None
    except ckptstore.CkptStoreError as e:  # RankFailureError, or its CommitOutcomeUnknownError
        out["check"] = [c.__name__ for c in type(e).__mro__]  # when the round had voted
    t1 = time.monotonic()
    try:
        store.close()
    except ckptstore.CkptStoreError:
        pass
    out["close_seconds"] = time.monotonic() - t1
    return out


def test_a_dead_peer_under_ddp_is_reported_by_ckptstore(tmp_path):
    path = str(tmp_path / "job")
    res = run_ranks(2, MOD, "peer_dies", path, str(tmp_path / "w"), deadline=120)
    assert res[1] == {"died": 3}, res
    r0 = res[0]["ok"]
    # torch's reducer keeps no Python type: the hook's typed error is in the RuntimeError's text,
    # a RankFailureError or, when the round had voted before the peer died, its subclass
    # CommitOutcomeUnknownError (which of the two is a race with the peer's exit)
    assert any(name in r0["first"] for name in ("RankFailureError", "CommitOutcomeUnknownError")) \
        and "rank 0" in r0["first"], r0
    assert "RankFailureError" in r0["check"], r0
    assert r0["close_seconds"] < TIMEOUT / 3, r0
    with ckptstore.open(path, "r") as reader:
        assert reader.iterations() and max(reader.iterations()) <= 6


def test_a_failed_vote_names_the_root_error_and_peers_rebuild_its_type():
    from ckptstore.errors import describe, rebuild

    try:
        try:
            raise ckptstore.DiskFullError("write", "/d/seg", OSError(errno.ENOSPC, "No space"))
        except OSError as e:
            raise ckptstore.CheckpointAbortedError("iteration 4 was not written") from e
    except ckptstore.CkptStoreError as e:
        text = describe(e)
    assert text == "DiskFullError: write failed on /d/seg: No space"
    err = rebuild(3, text)
    assert type(err) is ckptstore.DiskFullError and isinstance(err, OSError) and err.rank == 3
    assert str(err) == "rank 3: write failed on /d/seg: No space"
    assert type(rebuild(1, "UnsupportedTypeError: state.x: object")) is ckptstore.UnsupportedTypeError
    # not a ckptstore error class, or one that takes more than a message: RankFailureError
    for text in ("ValueError: bad", "os: x", "JobStreamError: x", "no colon"):
        err = rebuild(1, text)
        assert type(err) is ckptstore.RankFailureError and str(err) == f"rank 1: {text}", text


def test_a_ranks_own_failure_is_kept_before_its_failed_vote_goes_out(tmp_path):
    """The persister keeps its own failure before the round's FAILED vote tells the other ranks:
    they may stop at once, and this rank's training loop, seeing them gone, asks check() why
    (Checkpointer.peer_failure): it gets its own DiskFullError, never "nothing failed here"."""
    import threading

    from ckptstore.store import Store
    from test_faults import FaultyOps

    seen: list = []
    askers: list = []

    def commit_round(operation):  # stands for a job store's round, at the point it votes FAILED
        try:
            return operation()
        except BaseException:
            started = threading.Event()

            def ask():
                started.set()
                try:
                    store.pipeline.check()
                    seen.append(None)
                except BaseException as e:  # noqa: BLE001 - what check() reports
                    seen.append(e)
            asker = threading.Thread(target=ask)
            asker.start()
            askers.append(asker)
            started.wait(30)
            # (before the fix check() returned at once; now it waits for this job to end)
            asker.join(0.2)
            raise

    ops = FaultyOps()
    store = Store(str(tmp_path / "s"), "a", file_ops=ops, commit_round=commit_round)
    try:
        ops.arm("write", 1, errno.ENOSPC)
        fut = store.save_async(0, {"w": torch.ones(4)})
        assert type(fut.exception(timeout=30)) is ckptstore.DiskFullError
        askers[0].join(30)
        assert len(seen) == 1 and type(seen[0]) is ckptstore.DiskFullError, seen
        assert seen[0] is fut.exception()  # reported once, to the check that asked first
        store.check()
    finally:
        store.close()


def test_peer_failure_returns_the_error_it_returned_first(tmp_path):
    """DDP re-raises the comm hook's error as RuntimeError; the loop calls peer_failure again to
    get the type back. Meanwhile the store may have learnt of another failure (its persister's
    next round failing on the peer that left): the second call still returns the first error,
    this rank's own, counted once."""
    from ckptstore.torch import Checkpointer
    from test_faults import FaultyOps

    ops = FaultyOps()
    model, opt = _model()
    with ckptstore.open(str(tmp_path / "s"), "a", file_ops=ops) as store:
        ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=8, group_commit=1,
                          asynchronous=True)
        ck.restore()
        ops.arm("write", 1, errno.ENOSPC)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        fut = ck.step(1)
        assert type(fut.exception(timeout=30)) is ckptstore.DiskFullError
        first = ck.peer_failure(RuntimeError("Connection closed by peer"))
        assert type(first) is ckptstore.DiskFullError, first  # the store's own failure
        again = ck.peer_failure(RuntimeError("the RuntimeError DDP re-raised"))
        assert again is first
        assert ck.health().failures_total == 1
        ck.close()


def test_a_vote_behind_an_earlier_failure_names_the_root_error(tmp_path):
    """A committing job queued behind this rank's failed one votes FAILED too: its vote must
    describe the root error (DiskFullError), not "CheckpointAbortedError: ... was not written",
    so the other ranks rebuild the failing rank's own type."""
    import threading

    from ckptstore.errors import describe
    from ckptstore.store import Store
    from test_faults import FaultyOps

    go = threading.Event()
    votes: list[str] = []

    def commit_round(operation):  # stands for a job store's round: records each FAILED vote
        go.wait(30)
        try:
            return operation()
        except BaseException as e:
            votes.append(describe(e))
            raise

    ops = FaultyOps()
    store = Store(str(tmp_path / "s"), "a", file_ops=ops, commit_round=commit_round)
    try:
        ops.arm("write", 1, errno.ENOSPC)
        first = store.save_async(1, {"w": torch.ones(4)})
        second = store.save_async(2, {"w": torch.zeros(4)})  # queued before the first fails
        go.set()
        assert type(first.exception(timeout=30)) is ckptstore.DiskFullError
        assert type(second.exception(timeout=30)) is ckptstore.CheckpointAbortedError
        assert len(votes) == 2 and all(v.startswith("DiskFullError: ") for v in votes), votes
    finally:
        try:
            store.close()
        except ckptstore.DiskFullError:
            pass
