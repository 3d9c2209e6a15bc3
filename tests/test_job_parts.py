"""A job store's parts cannot be changed on their own (issue 29.1).

A rank's stream under ``<job>/streams/`` is a complete v1 store on disk, but its commits are named
by the job's global commits: a gc, repair, push, pull or follower of one stream alone would damage
or misrepresent every iteration of the job. Every API and CLI path that writes into a store
directory refuses a job store's part with JobStreamError (CLI: exit 2) before anything is
created, locked or written; read-only inspection stays allowed. After every refusal the job
store loads bit-exact and fsck is clean.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import ckptstore
from ckptstore.cli import main
from ckptstore.errors import JobStreamError
from ckptstore.storage.job_log import JobLayout, job_store_holding

from _ranks import run_ranks
from conftest import _same


def same(a, b) -> bool:
    _same(a, b, "state")
    return True

MOD = __name__
ITERATIONS = 6


def rank_state(it: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(1000 * it + rank)
    return {"w": torch.randn(64, 8, generator=g), "step": it, "rank": rank}


def build_and_misuse_own_stream(rank, world, path):
    """Save ITERATIONS iterations, then try to change this rank's own stream through the writer's
    handle on it (JobStore.stream): every attempt is refused; the job is closed normally."""
    import torch.distributed as dist

    refused = []
    with ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=60) as js:
        for it in range(1, ITERATIONS + 1):
            js.save(it, rank_state(it, rank))
        own = js.stream(ITERATIONS)
        for name, call in [("gc", lambda: own.gc(keep_last=1)),
                           ("gc dry run", lambda: own.gc(keep_last=1, dry_run=True)),
                           ("follower gc", lambda: own.gc(keep_last=1, follower_bases=True))]:
            try:
                call()
            except JobStreamError as e:
                refused.append((name, e.job == os.path.realpath(path)))
    return refused


@pytest.fixture(scope="module")
def built_job(tmp_path_factory):
    base = tmp_path_factory.mktemp("jobparts")
    path = str(base / "job")
    res = run_ranks(2, MOD, "build_and_misuse_own_stream", path, str(base / "w"), deadline=120)
    assert all("ok" in r for r in res), res
    assert [r["ok"] for r in res] == [[["gc", True], ["gc dry run", True],
                                       ["follower gc", True]]] * 2
    return path


@pytest.fixture
def job(built_job, tmp_path):
    path = str(tmp_path / "job")
    shutil.copytree(built_job, path)
    return path


def stream_of(job: str, rank: int = 0) -> str:
    return JobLayout(job).stream_dir(1, rank)


def assert_whole(job: str) -> None:
    """Every iteration of the job loads bit-exact for every rank and fsck is clean."""
    with ckptstore.open(job, "r") as js:
        assert js.iterations() == list(range(1, ITERATIONS + 1))
        for it in js.iterations():
            for rank in (0, 1):
                assert same(js.load(it, rank=rank), rank_state(it, rank))
    assert main(["fsck", job]) == 0


def snapshot_tree(path: str) -> dict[str, tuple[int, int]]:
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            st = os.stat(os.path.join(d, f))
            out[os.path.relpath(os.path.join(d, f), path)] = (st.st_size, st.st_mtime_ns)
    return out


def test_the_writers_own_stream_is_refused(job):
    assert_whole(job)  # (the fixture's scenario checked the refusals themselves)


@pytest.mark.parametrize("how", ["Store", "open", "link", "new store in streams/",
                                 "store inside a stream"])
def test_a_stream_cannot_be_opened_for_writing(job, tmp_path, how):
    target = stream_of(job)
    if how == "link":
        os.symlink(target, tmp_path / "link")
        target = str(tmp_path / "link")
    elif how == "new store in streams/":
        target = os.path.join(JobLayout(job).streams_dir, "0000000009-00000")
    elif how == "store inside a stream":
        target = os.path.join(stream_of(job), "follower")
    before = snapshot_tree(job)
    with pytest.raises(JobStreamError) as info:
        if how == "open":
            ckptstore.open(target, "a")
        else:
            ckptstore.Store(target, "a")
    assert info.value.job == os.path.realpath(job) and "use the job store" in str(info.value)
    assert snapshot_tree(job) == before  # nothing created, locked or written
    assert_whole(job)


def test_gc_of_a_stream_is_refused_in_every_form(job):
    with ckptstore.Store(stream_of(job), "r") as reader:  # inspection stays allowed
        assert reader.iterations() == list(range(1, ITERATIONS + 1))
        assert same(reader.load(3), rank_state(3, 0))
        for kwargs in [{"keep_last": 1}, {"keep_last": 1, "dry_run": True},
                       {"policy": ckptstore.KeepLast(2)}]:
            with pytest.raises(JobStreamError):
                reader.gc(**kwargs)
    with pytest.raises(JobStreamError):
        ckptstore.open(stream_of(job), "a", retention=ckptstore.KeepLast(2))
    assert_whole(job)


def test_cli_refuses_every_change_of_a_stream(job, tmp_path, capsys):
    stream = stream_of(job, 1)
    src = str(tmp_path / "src.pt")
    torch.save({"w": torch.zeros(3)}, src)
    for argv in (["gc", stream, "--keep-last", "1"],
                 ["fsck", "--repair", stream],
                 ["import", stream, "99", src],
                 ["push", stream, "s3://bucket/run"],
                 ["pull", "s3://bucket/run", stream]):
        assert main(argv) == 2, argv
        assert "part of the multi-rank job store" in capsys.readouterr().err, argv
    assert main(["fsck", stream]) in (0, 1)  # read-only verification runs
    capsys.readouterr()
    assert main(["fsck", "--repair", job]) == 0  # the job store repairs its own streams
    assert_whole(job)


def test_remote_and_follower_paths_refuse_a_stream(job, tmp_path):
    from ckptstore.follow import Follower
    from ckptstore.ops.fsck import check
    from ckptstore.remote import pull, push

    stream = stream_of(job)
    with pytest.raises(JobStreamError):
        push(stream, "s3://bucket/run")  # refused before any client is made
    with pytest.raises(JobStreamError):
        pull("s3://bucket/run", stream)
    with pytest.raises(JobStreamError):
        pull("s3://bucket/run", os.path.join(JobLayout(job).streams_dir, "0000000009-00001"))
    with pytest.raises(JobStreamError):
        check(stream, repair=True)
    with pytest.raises(JobStreamError):
        Follower(stream)
    assert not os.path.exists(os.path.join(stream, "follower"))
    assert_whole(job)


def test_job_store_holding(job, tmp_path):
    layout = JobLayout(job)
    real = os.path.realpath(job)
    assert job_store_holding(stream_of(job)) == real
    assert job_store_holding(os.path.join(stream_of(job), "segments")) == real
    assert job_store_holding(os.path.join(layout.global_dir, "x")) == real
    assert job_store_holding(job) is None  # the job store itself: its own open refuses a v1 writer
    assert job_store_holding(str(tmp_path / "streams" / "a")) is None  # not under a job store
    plain = str(tmp_path / "plain")
    with ckptstore.open(plain, "a") as s:
        s.save(1, {"w": torch.ones(2)})
    os.makedirs(os.path.join(plain, "streams"))
    assert job_store_holding(os.path.join(plain, "streams", "x")) is None
