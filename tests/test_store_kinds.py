"""One test class of the store operations, run against every kind of store (issue 31, part 6).

A single store, a 1-rank job store and a 2-rank job store are written the same way -- a
Checkpointer with an exact delta every iteration and a base every 4, over real gloo processes for
the job stores (tests/_ranks.py), DistributedDataParallel at 2 ranks -- and each run saves its
live model + optimizer after every step. :class:`StoreKindTests` then checks every read-side
operation and gc against those live states, once per kind (zarr-python's ``StoreTests``,
dulwich's ``ObjectStoreTests``): an operation that lands for one kind only fails here for the
others. ``part`` is the only difference the class knows of: the per-part operations of a job
store (``meta``, ``manifest``, ``load_record``, ``diff``) take the rank whose part is meant.
The remote tier's operations (push, pull, ``open("s3://...")`` and its ``remote_read_stats``,
fsck of the copy alone and compared with the local store, a writer's
``remote_flush``/``remote_status``) run against one moto S3 server per module (tests/test_remote.py).
"""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

import ckptstore
from ckptstore.cli import main
from ckptstore.errors import NotFoundError

from _ranks import run_ranks
from conftest import _same
from test_multirank import _ddp_model, ok
from test_remote import MotoServer, server, url  # noqa: F401 - one moto server per module

ITERATIONS = 10
KINDS = ["single", "job-1", "job-2"]


def train(rank, world, path, live_dir, kind):
    """The same training on every kind: restore, 10 steps, live state saved after each."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ckptstore.torch import Checkpointer

    model, opt, sched = _ddp_model()
    net = DDP(model) if world > 1 else model
    if kind == "single":
        store = ckptstore.open(path, "a")
    else:
        store = ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=60.0)
    ck = Checkpointer(store, model, opt, sched, policy="every-iteration", base_every=4,
                      group_commit=2)
    ck.restore()
    for it in range(1, ITERATIONS + 1):
        g = torch.Generator().manual_seed(1000 * rank + it)
        x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        ck.step(it, meta={"loss": float(it)})
        opt.zero_grad()
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                       os.path.join(live_dir, f"live-{it}.pt"))
    store.close()
    return True


def save_remote(rank, world, path, kind, url, opts):
    """The remote tier on a writer of each kind: one more iteration (11) with ``remote=``, then
    remote_status, remote_flush (collective on a job store) and remote_status again."""
    import torch.distributed as dist

    pg = {} if kind == "single" else {"process_group": dist.group.WORLD, "commit_timeout": 60.0}
    failed = None
    with ckptstore.open(path, "a", remote=url, remote_options=opts, **pg) as s:
        s.save(ITERATIONS + 1, {"w": torch.full((3,), float(rank))})
        if world > 1:  # rank 1's flush times out at once: every rank raises it, naming rank 1
            try:
                s.remote_flush(0.0 if rank == 1 else 60.0)
            except ckptstore.RemoteError as e:
                failed = [type(e).__name__, getattr(e, "rank", None), "rank 1" in str(e)
                          or rank == 1, "did not catch up" in str(e)]
        flushed = s.remote_flush(60.0)
        st = s.remote_status()
        return [flushed, st.iteration, st.local_iteration, st.behind, st.error is None,
                st.generation is not None, failed]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """kind -> (store path, live-state directory), each written once per module."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    root = tmp_path_factory.mktemp("kinds")
    out = {}
    for kind in KINDS:
        path, live = str(root / kind), str(root / f"live-{kind}")
        os.makedirs(live)
        world = 2 if kind == "job-2" else 1
        ok(run_ranks(world, __name__, "train", path, str(root / f"w-{kind}"), deadline=240,
                     live_dir=live, kind=kind))
        out[kind] = (path, live)
    return out


class StoreKindTests:
    """Every store operation, written once; ``kind`` says which store it runs against."""

    kind: str

    @pytest.fixture
    def store(self, built):
        path, _ = built[self.kind]
        with ckptstore.open(path, "r") as s:
            yield s

    @pytest.fixture
    def live(self, built):
        _, live_dir = built[self.kind]
        return lambda it: torch.load(os.path.join(live_dir, f"live-{it}.pt"))

    @property
    def part(self) -> dict:
        """The keyword that names a part: the rank (job stores), nothing (a single store)."""
        return {} if self.kind == "single" else {"rank": 0}

    def test_is_the_kind_open_returns(self, store):
        want = ckptstore.Store if self.kind == "single" else ckptstore.JobStore
        assert type(store) is want

    def test_iterations_latest_kind_base_of(self, store):
        assert store.iterations() == list(range(ITERATIONS + 1))
        assert store.latest() == ITERATIONS
        assert store.kind(0) == "snapshot" and store.kind(3) == "delta"
        assert store.kind(4) == "snapshot" and store.base_of(7) == 4
        with pytest.raises(NotFoundError):
            store.load(ITERATIONS + 5)

    def test_load_every_iteration_bit_exact(self, store, live):
        for it in range(1, ITERATIONS + 1):
            state, want = store.load(it), live(it)
            _same(want["model"], state["model"], f"{self.kind} iteration {it} model")
            _same(want["optimizer"], state["optimizer"], f"{self.kind} iteration {it} optimizer")

    def test_load_keys(self, store, live):
        assert set(store.load(6, keys=["model"])) == {"model"}
        _same(live(6)["model"], store.load(6, keys=["model"])["model"], "keys")

    def test_meta_manifest_record(self, store):
        assert store.meta(6, **self.part)["loss"] == 6.0
        assert store.manifest(6, **self.part).iteration == 6
        record = store.load_record(6, **self.part)
        assert isinstance(record, dict) and record

    def test_replay_yields_what_load_returns(self, store):
        seen = []
        for it, state in store.replay(3, 9):
            seen.append(it)
            _same(store.load(it)["model"], state["model"], f"{self.kind} replay {it}")
            _same(store.load(it)["optimizer"], state["optimizer"], f"{self.kind} replay {it}")
        assert seen == list(range(3, 10))

    def test_diff(self, store):
        same = store.diff(4, 4, **self.part)
        assert same and all(d.status == "unchanged" for d in same)
        changed = store.diff(0, 8, **self.part)
        assert any(d.status == "changed" for d in changed)

    def test_bisect_a_meta_condition(self, store):
        assert store.bisect("loss > 6.5").iteration == 7

    def test_fsck_is_clean(self, built, capsys):
        assert main(["fsck", built[self.kind][0]]) == 0
        capsys.readouterr()

    def test_gc_keeps_and_removes_what_it_says(self, built, tmp_path, live):
        path = str(tmp_path / "copy")
        shutil.copytree(built[self.kind][0], path)
        mode = "a" if self.kind == "single" else "r"  # a job store's gc runs on a reader
        with ckptstore.open(path, mode) as s:
            report = s.gc(keep_last=2)
        assert report.kept == [8, 9, 10] and report.removed == list(range(8))
        with ckptstore.open(path, "r") as s:
            assert s.iterations() == [8, 9, 10]
            for it in (9, 10):
                _same(live(it)["model"], s.load(it)["model"], f"{self.kind} after gc {it}")
            with pytest.raises(NotFoundError):
                s.load(5)
        assert main(["fsck", path]) == 0

    # ---- the remote tier (format-spec/remote.md; moto's S3 server on 127.0.0.1) ------------------
    def test_push_pull_open_url_and_fsck_of_the_remote_copy(self, built, server, url, tmp_path,
                                                            live):
        from ckptstore.remote import pull, push, verify_remote

        opts = server.options()
        assert push(built[self.kind][0], url, opts).head.latest == ITERATIONS
        assert verify_remote(url, opts).clean
        report = verify_remote(url, opts, local=built[self.kind][0])  # and the local store
        assert report.clean and not report.behind, report.lines()
        assert report.local_iteration == ITERATIONS
        pulled = str(tmp_path / "pulled")
        pull(url, pulled, opts)
        with ckptstore.open(pulled, "r") as s, \
                ckptstore.open(url, "r", storage_options=opts) as lazy:
            want = ckptstore.Store if self.kind == "single" else ckptstore.JobStore
            assert type(s) is want and type(lazy) is want
            opened = lazy.remote_read_stats()
            for store in (s, lazy):
                assert store.iterations() == list(range(ITERATIONS + 1))
                for it in (ITERATIONS, 7):
                    state = store.load(it)
                    _same(live(it)["model"], state["model"], f"{self.kind} remote {it}")
                    _same(live(it)["optimizer"], state["optimizer"], f"{self.kind} remote {it}")
            with pytest.raises(ckptstore.RemoteUnsupportedError):
                s.remote_read_stats()  # a local store (pulled): nothing read remotely
            read = lazy.remote_read_stats()  # range GETs through the index, counted
            assert type(read) is type(opened) and read.generation == report.head.generation
            assert (read.mode, read.index) == ("ranges", "used"), read
            assert read.bytes_read == lazy.remote_bytes_read > opened.bytes_read > 0
            assert read.requests > opened.requests > 0 and read.cache_size > 0

    def test_remote_flush_and_status_of_a_writer(self, built, server, url, tmp_path, store):
        """remote_flush (collective on a job store: every rank gets the iteration) and
        remote_status (the job HEAD's, on every rank) after one more save with remote=; a store
        opened without remote= raises RemoteUnsupportedError."""
        with pytest.raises(ckptstore.RemoteUnsupportedError):
            store.remote_status()
        path = str(tmp_path / "copy")
        shutil.copytree(built[self.kind][0], path)
        opts = server.options(head_interval=3600)
        want = [ITERATIONS + 1, ITERATIONS + 1, ITERATIONS + 1, False, True, True, None]
        if self.kind == "single":
            assert save_remote(0, 1, path, self.kind, url, opts) == want
        elif self.kind == "job-1":
            assert ok(run_ranks(1, __name__, "save_remote", path, str(tmp_path / "w"),
                                kind=self.kind, url=url, opts=opts)) == [want]
        else:  # and first a flush that fails on rank 1 (raised on both, naming rank 1)
            got = ok(run_ranks(2, __name__, "save_remote", path, str(tmp_path / "w"),
                               kind=self.kind, url=url, opts=opts))
            assert got == [want[:-1] + [["RemoteError", 1, True, True]],
                           want[:-1] + [["RemoteError", None, True, True]]], got
        from ckptstore.remote import verify_remote

        report = verify_remote(url, opts)
        assert report.clean and report.head.recoverable == ITERATIONS + 1

    def test_sizes_and_where_a_load_starts(self, store):
        assert store.chunk_size > 0 and store.segment_size >= store.chunk_size
        assert store.load_base(6, **self.part) == ("primary", 4)
        assert store.load_base(4, **self.part) == ("primary", 4)
        with pytest.raises(ckptstore.ReadOnlyStoreError):
            store.set_async_limits(host_budget=1 << 20)
        with pytest.raises(ckptstore.RemoteUnsupportedError):
            store.remote_iteration()

    def test_world_size_and_stream(self, store):
        """``world_size``: the ranks that wrote (a single store: 1); ``stream(t, rank)``: the
        store holding that rank's records of ``t`` (a single store: itself), checked: an
        uncommitted iteration raises NotFoundError, a rank not among ``t``'s RankMismatchError,
        no rank on a reader of several ranks ValueError."""
        world = 2 if self.kind == "job-2" else 1
        assert store.world_size == world
        for r in range(world):
            part = store.stream(6, rank=r)
            assert isinstance(part, ckptstore.Store) and part.world_size == 1
            assert part.info(6) == store.info(6, **({} if self.kind == "single" else {"rank": r}))
        if world == 1:
            assert store.stream(6).info(6) == store.stream(6, rank=0).info(6)
        else:
            with pytest.raises(ValueError, match="pass rank="):
                store.stream(6)
        with pytest.raises(NotFoundError):
            store.stream(ITERATIONS + 5, rank=0)
        for bad in (world, -1, "0"):
            with pytest.raises(ckptstore.RankMismatchError):
                store.stream(6, rank=bad)

    def test_info(self, store):
        info = store.info(6, **self.part)
        assert info.iteration == 6 and info.kind == "delta" and info.written_bytes > 0
        assert not math.isnan(info.written_bytes)


class TestSingleStore(StoreKindTests):
    kind = "single"


class TestOneRankJobStore(StoreKindTests):
    kind = "job-1"


class TestTwoRankJobStore(StoreKindTests):
    kind = "job-2"


def test_world_size_and_stream_of_an_empty_store(tmp_path):
    """As a job store's: a writer's world size is its own (1), a reader of an empty store's
    None; stream() of an iteration not committed raises NotFoundError."""
    with ckptstore.open(tmp_path / "s", "a") as s:
        assert s.world_size == 1
        with pytest.raises(NotFoundError):
            s.stream(0)
    with ckptstore.open(tmp_path / "s", "r") as r:
        assert r.world_size is None
        with pytest.raises(NotFoundError):
            r.stream(0, rank=0)
