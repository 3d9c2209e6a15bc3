"""The remote tier of multi-rank job stores (ckptstore/remote/job_*.py, format-spec/remote.md §8)
against moto's S3 server on 127.0.0.1 (the fixtures of tests/test_remote.py) and real gloo groups.

Covered: a job trained with DDP at 2 ranks, pushed, deleted locally, pulled from the server alone
and loaded bit-exact at world size 1 (no group) and resumed at 1 and 4 ranks (elastic restore);
``ckptstore.open("s3://...", "r")`` of a job and the CLI's push/pull; an incremental re-push (only
the new streams' bytes, no new job HEAD for an unchanged job); no regress (an older local copy
never moves the remote back); a pull into a copy that a job wrote to since is refused; a job HEAD
that names a stream whose objects are missing (RemoteStreamMissingError naming rank and object);
fsck of the copy compared with the local job (behind, matching, missing, damaged, differing
bytes); the push SIGKILLed between two streams' HEADs, before and after the job HEAD: the remote
still restores the previous cut bit-exact, and a re-push completes; damaged job objects and the
job HEAD codec; the background tier (``remote=`` beside ``process_group=``) over two jobs, and a
rank SIGKILLed while it uploads; lazy reads of one rank's part; fsck of the remote copy (rank and
object of what is missing or damaged); the remote gc after a job gc (an old epoch's streams go
once no kept job HEAD names them; SIGKILLed in the middle, the kept job HEAD still restores) and
the race of a rank's stream gc with rank 0's job HEAD (§8.3's re-check). remote_status and
remote_flush of every store kind: tests/test_store_kinds.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import ckptstore
from ckptstore import RemoteConflictError, RemoteStreamMissingError
from ckptstore.cli import main as cli
from ckptstore.remote import pull, push, verify_remote
from ckptstore.remote.client import ObjectStore
from ckptstore.remote.job_head import newest_job_head
from ckptstore.storage.job_log import JobLayout

from _ranks import needs_gloo, run_ranks
from test_multirank import _ddp_check, _pg, ok, rank_state, same
from test_remote import MotoServer, server, url  # noqa: F401 - the moto fixtures

pytestmark = needs_gloo

MOD = __name__


# ---- scenarios (run on every rank) ------------------------------------------------------------
def _save(s, it: int, rank: int) -> None:
    """Iteration ``it`` of rank ``rank``: a delta every third iteration, else a snapshot."""
    if it % 3 == 2:
        s.save_delta(it, {"g": torch.full((7,), float(it + 10 * rank))})
    else:
        s.save(it, rank_state(it, rank))


def save_job(rank, world, path, start, stop, push_at=None, url=None, opts=None):
    """Save snapshots ``start..stop-1`` (deltas in between every other one); rank 0 pushes the
    live job after iteration ``push_at`` (the others wait in the next round)."""
    pushed = None
    with ckptstore.open(path, "a", process_group=_pg(), commit_timeout=60.0) as s:
        for it in range(start, stop):
            _save(s, it, rank)
            if it == push_at and rank == 0:
                pushed = push(path, url, opts).head.latest
        return {"iterations": s.iterations(), "pushed": pushed}


def train_with_remote(rank, world, path, url, opts, start, stop):
    """Save ``start..stop-1`` as :func:`save_job` does, with the background remote tier on."""
    with ckptstore.open(path, "a", process_group=_pg(), commit_timeout=60.0, remote=url,
                        remote_options=opts) as s:
        for it in range(start, stop):
            _save(s, it, rank)
        return s.iterations()


def _names_an_iteration(url, opts) -> bool:
    """Whether the remote copy at ``url`` has a job HEAD naming an iteration yet."""
    try:
        head = newest_job_head(ObjectStore(url, opts))
    except ckptstore.StoreNotFoundError:  # (none yet)
        return False
    return head is not None and head.latest is not None


def train_killed(rank, world, path, url, opts, victim, nth):
    """Snapshots with the remote tier on until rank ``victim`` is SIGKILLed at its ``nth`` file
    operation counted from when the remote copy first names an iteration (a job HEAD with one:
    the kill is then "while uploading" whatever the machine's speed; counted from the start, a
    slow uploader had named none yet in ~1 of 10 runs); returns the iterations committed locally
    (the survivors)."""
    from _crashkit import KillOps

    ops = KillOps("any", nth, armed=False) if rank == victim else None
    s = ckptstore.open(path, "a", process_group=_pg(), commit_timeout=10.0, remote=url,
                       remote_options=opts, file_ops=ops)
    try:
        for it in range(100):
            _save(s, it, rank)
            if ops is not None and not ops.armed:
                ops.armed = _names_an_iteration(url, opts)
    except ckptstore.CkptStoreError:
        pass
    return s.iterations()


def _expected(it: int, rank: int):
    return {"g": torch.full((7,), float(it + 10 * rank))} if it % 3 == 2 else rank_state(it, rank)


def _check_job(path: str, iterations: list[int], world: int = 2) -> None:
    """Every iteration of every rank loads bit-exact from the job store at ``path``."""
    with ckptstore.open(path, "r") as job:
        assert job.iterations() == iterations
        for it in iterations:
            for r in range(world):
                got = job.load_record(it, rank=r) if it % 3 == 2 else job.load(it, rank=r)
                assert same(_expected(it, r), got), (it, r)


def _job(tmp_path, stop: int = 4, **kw) -> str:
    path = str(tmp_path / "job")
    _job_pushed(tmp_path, path, stop, **kw)
    return path


def _job_pushed(tmp_path, path: str, stop: int = 4, **kw):
    """Run the job; the iteration rank 0's push made remote (None: no push)."""
    return ok(run_ranks(2, MOD, "save_job", path, str(tmp_path / "w"), start=0, stop=stop,
                        **kw))[0]["pushed"]


# ---- restore from the remote alone at another world size ---------------------------------------
@pytest.mark.slow  # ~100 s on 2 cores: three DDP jobs (2, 1 and 4 ranks)
def test_pushed_ddp_job_restores_from_the_remote_alone_at_1_and_4_ranks(server, url, tmp_path):
    """A DDP job at 2 ranks (partitioned Checkpointer: bases and deltas) pushed, then deleted;
    the pull loads every iteration bit-exact without a group, and jobs of 1 and 4 ranks resume
    from it with the live state of the last iteration."""
    path, live = str(tmp_path / "job"), str(tmp_path / "live")
    os.makedirs(live)
    opts = server.options()
    ok(run_ranks(2, "test_multirank", "ddp_train", path, str(tmp_path / "w1"), deadline=240,
                 iterations=6, live_dir=live))
    r = push(path, url, opts)
    assert r.head.latest == 6 and r.head.count == 7 and len(r.head.streams) == 2
    shutil.rmtree(path)  # from here on, the remote alone
    restored = str(tmp_path / "restored")
    p = pull(url, restored, opts)
    assert p.head.generation == r.head.generation and p.downloaded_bytes > 0
    _ddp_check(restored, live, range(1, 7))
    for world in (1, 4):
        copy = str(tmp_path / f"at{world}")
        shutil.copytree(restored, copy)
        res = ok(run_ranks(world, "test_multirank", "ddp_train", copy, str(tmp_path / f"w{world}"),
                           deadline=240, iterations=2, live_dir=live))
        assert [x["start"] for x in res] == [6] * world
        for rank in range(world):
            got = torch.load(os.path.join(live, f"restored-6-rank{rank}.pt"))
            want = torch.load(os.path.join(live, "live-6.pt"))
            from conftest import _same
            _same(dict(want["model"]), got["model"], f"model restored at {world} ranks")
            _same(want["optimizer"], got["optimizer"], f"optimizer restored at {world} ranks")


def test_open_url_of_a_job_and_the_cli(server, url, tmp_path, capsys, monkeypatch):
    path = _job(tmp_path)
    opts = server.options()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    args = ["--endpoint-url", server.endpoint, "--region", "us-east-1"]
    assert cli(["push", path, url, *args]) == 0
    assert "iteration 3 (4 iterations)" in capsys.readouterr().out
    with ckptstore.open(url, "r", storage_options=opts) as job:
        assert isinstance(job, ckptstore.JobStore) and job.iterations() == [0, 1, 2, 3]
        assert same(rank_state(3, 1), job.load(3, rank=1))
    cache = str(tmp_path / "cache")
    with ckptstore.open(url, "r", storage_options=opts, cache_dir=cache) as job:
        assert job.iterations() == [0, 1, 2, 3]
        st = job.remote_read_stats()  # pulled whole: the pull's bytes
        assert (st.mode, st.index) == ("whole", "skipped") and job.remote_bytes_read > 0
    assert cli(["pull", url, str(tmp_path / "pulled"), *args]) == 0
    assert cli(["fsck", url, *args]) == 0  # every object the job HEAD names, streams' included
    out = capsys.readouterr().out
    assert "remote job" in out and "2 rank streams" in out and "clean" in out
    assert cli(["fsck", path, "--remote", url, *args]) == 0  # the local job, then its copy
    out = capsys.readouterr().out
    assert "remote job" in out and out.count("clean") >= 2
    assert "the remote copy holds what" in out  # compared with the local job: the same cut
    _check_job(str(tmp_path / "pulled"), [0, 1, 2, 3])


# ---- incremental, no regress, conflicts ---------------------------------------------------------
def test_incremental_repush_sends_only_new_streams_and_never_regresses(server, url, tmp_path):
    opts = server.options()
    path = _job(tmp_path)
    old = str(tmp_path / "old")
    shutil.copytree(path, old)
    first = push(path, url, opts)
    again = push(path, url, opts)  # nothing new: the same job HEAD, nothing sent but no objects
    assert again.head.generation == first.head.generation and again.stats.uploaded_bytes == 0
    ok(run_ranks(2, MOD, "save_job", path, str(tmp_path / "w2"), start=4, stop=6))
    second = push(path, url, opts)
    assert second.head.generation == first.head.generation + 1 and second.head.latest == 5
    new_streams = sum(os.path.getsize(os.path.join(d, f))
                      for e, r in [(s.epoch, s.rank) for s in second.head.streams if s.epoch == 2]
                      for d in [os.path.join(JobLayout(path).stream_dir(e, r), "segments")]
                      for f in os.listdir(d))
    # the old streams are reused (listed, digest-checked), not sent again
    assert second.stats.uploaded_bytes < new_streams + (64 << 10), (second.stats, new_streams)
    assert second.stats.reused_objects > 0
    with pytest.raises(RemoteConflictError, match="newer than"):
        push(old, url, opts)  # an older copy of the job never moves the remote back
    assert newest_job_head(ObjectStore(url, opts)).generation == second.head.generation
    restored = str(tmp_path / "restored")
    pull(url, restored, opts)
    _check_job(restored, list(range(6)))
    # a pull into a copy the job wrote to since is refused, nothing changed
    ok(run_ranks(1, MOD, "save_job", restored, str(tmp_path / "w3"), start=6, stop=7))
    with pytest.raises(RemoteConflictError, match="written to after it was pulled"):
        pull(url, restored, opts)
    with ckptstore.open(restored, "r") as job:
        assert job.iterations() == list(range(7))


def test_a_job_head_naming_a_missing_stream_object_names_rank_and_object(server, url, tmp_path):
    opts = server.options()
    path = _job(tmp_path)
    head = push(path, url, opts).head
    report = verify_remote(url, opts)
    assert report.clean and report.head == head and report.streams == 2, report.lines()
    bucket, prefix = url.split("/")[2], url.split("/", 3)[3]
    s3 = server.s3()
    ref = head.stream(1, 1)
    assert ref is not None
    key = f"{prefix}/{ref.prefix}/heads/{ref.generation:020d}"
    s3.delete_object(Bucket=bucket, Key=key)
    with pytest.raises(RemoteStreamMissingError) as e:
        pull(url, tmp_path / "a", opts)
    report = verify_remote(url, opts)  # fsck names the rank and the object
    assert not report.clean and report.ranks == [1], report.lines()
    assert [(p.kind, p.rank, p.epoch) for p in report.problems] == [("missing", 1, 1)]
    assert key in report.problems[0].url and any(key in m and "rank 1" in m
                                                 for m in report.missing)
    assert e.value.rank == 1 and e.value.epoch == 1 and key in e.value.url
    assert "rank 1" in str(e.value)
    # an extent of rank 0's stream
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/streams/"
                                                 "0000000001-00000/segments/")["Contents"]]
    s3.delete_object(Bucket=bucket, Key=keys[-1])
    with pytest.raises(RemoteStreamMissingError) as e:
        pull(url, tmp_path / "b", opts)
    assert e.value.rank == 0 and keys[-1] in e.value.url
    report = verify_remote(url, opts)
    assert report.ranks == [0, 1] and any(keys[-1] in p.url and p.rank == 0
                                          for p in report.problems), report.lines()


def test_verify_remote_compares_the_copy_with_the_local_job(server, url, tmp_path):
    """verify_remote(URL, local=JOB): a copy older than the job is clean and behind; once pushed
    again it matches; a missing or damaged remote object is named with its rank (the local job
    holds it: no mismatch); a local byte the copy does not hold is a "differs" problem naming
    the rank, the object and the local file; a path without a store is StoreNotFoundError."""
    from ckptstore import StoreNotFoundError

    opts = server.options()
    path = str(tmp_path / "job")
    pushed = _job_pushed(tmp_path, path, push_at=1, url=url, opts=opts)
    assert pushed in (0, 1)  # (0: rank 1 had not indexed its commit of 1 yet)
    report = verify_remote(url, opts, local=path)  # the job went on to iteration 3
    assert report.clean and report.behind and report.local_iteration == 3, report.lines()
    assert (f"BEHIND: the remote copy holds iteration {pushed}, the local job store 3"
            in report.lines())
    head = push(path, url, opts).head
    report = verify_remote(url, opts, local=path)
    assert report.clean and not report.behind and not report.problems, report.lines()
    assert any("holds what" in n for n in report.notes)

    bucket, prefix = url.split("/")[2], url.split("/", 3)[3]
    s3 = server.s3()

    def extents(rank):
        return sorted(o["Key"] for o in s3.list_objects_v2(
            Bucket=bucket, Prefix=f"{prefix}/streams/0000000001-{rank:05d}/segments/")["Contents"])

    gone, bad = extents(1)[-1], extents(0)[0]
    kept = {k: s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in (gone, bad)}
    s3.delete_object(Bucket=bucket, Key=gone)
    s3.put_object(Bucket=bucket, Key=bad, Body=kept[bad][:-1] + bytes([kept[bad][-1] ^ 1]))
    report = verify_remote(url, opts, local=path)
    assert not report.clean and not report.differs, report.lines()
    got = sorted((p.kind, p.rank, p.epoch, p.url.split("/", 3)[3]) for p in report.problems)
    assert got == [("damaged", 0, 1, bad), ("missing", 1, 1, gone)], report.lines()
    for k, body in kept.items():
        s3.put_object(Bucket=bucket, Key=k, Body=body)
    assert verify_remote(url, opts, local=path).clean

    seg = os.path.join(JobLayout(path).stream_dir(1, 1), "segments")
    seg = os.path.join(seg, sorted(os.listdir(seg))[0])
    with open(seg, "r+b") as f:  # a local byte the copy does not hold: the pair differs
        at = os.path.getsize(seg) // 2
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 1]))
    report = verify_remote(url, opts, local=path)
    assert not report.clean and report.ranks == [1], report.lines()
    [p] = report.problems
    assert (p.kind, p.rank, p.epoch, p.local) == ("differs", 1, 1, seg), report.lines()
    assert f"{prefix}/streams/0000000001-00001/segments/" in p.url and "rank 1" in report.differs[0]
    with open(seg, "r+b") as f:
        f.seek(at)
        f.write(byte)
    assert verify_remote(url, opts, local=path).clean and head.latest == 3

    single = str(tmp_path / "single")
    with ckptstore.open(single, "a") as s:
        s.save(0, {"w": torch.zeros(2)})
    report = verify_remote(url, opts, local=single)  # another kind of store
    assert [(p.kind, p.rank) for p in report.problems] == [("differs", None)], report.lines()
    with pytest.raises(StoreNotFoundError):
        verify_remote(url, opts, local=tmp_path / "nothing")


# ---- a push SIGKILLed at chosen points ----------------------------------------------------------
_KILLER = """
import json, os, re, signal, sys
from ckptstore.remote import push
from ckptstore.remote.client import ObjectStore
path, url, opts, pattern, when = sys.argv[1:6]
opts = json.loads(opts)
cls = type(ObjectStore(url, opts))
orig = cls.put
def put(self, name, data, **kw):
    hit = re.search(pattern, self.where.key(name)) is not None
    if hit and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    out = orig(self, name, data, **kw)
    if hit and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)
    return out
cls.put = put
push(path, url, opts)
print("push finished")
"""


@pytest.mark.parametrize("pattern,when", [
    (r"/streams/0000000001-00001/heads/", "before"),  # rank 0's new stream HEAD is written
    (r"/jobheads/", "before"),
    (r"/jobheads/", "after"),
], ids=["between-stream-heads", "before-job-head", "after-job-head"])
def test_push_killed_at_chosen_points_keeps_the_previous_cut(server, url, tmp_path, pattern,
                                                             when):
    """The job's streams grow (rank 0 pushed the live job after iteration 1); the next push is
    SIGKILLed at ``pattern``. keep_heads=1: a stream HEAD survives its stream's gc only because
    the kept job HEAD pins it."""
    opts = server.options(keep_heads=1)
    path = str(tmp_path / "job")
    pushed = _job_pushed(tmp_path, path, push_at=1, url=url, opts=opts)
    assert pushed in (0, 1)  # 0: rank 1 had not indexed its commit of 1 yet (the cut ends before)
    code = subprocess.run([sys.executable, "-c", _KILLER, path, url, json.dumps(opts), pattern,
                           when],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert code.returncode == -signal.SIGKILL, code.stdout + code.stderr
    restored = str(tmp_path / "after-kill")
    pull(url, restored, opts)
    _check_job(restored, [0, 1, 2, 3] if when == "after" else list(range(pushed + 1)))
    r = push(path, url, opts)  # the re-push completes
    assert r.head.latest == 3
    pull(url, restored, opts)  # incremental into the earlier pull
    _check_job(restored, [0, 1, 2, 3])
    fresh = str(tmp_path / "fresh")
    pull(url, fresh, opts)
    _check_job(fresh, [0, 1, 2, 3])


# ---- remote gc after a job gc, and the gc race of a live job ----------------------------------------
@pytest.fixture(scope="module")
def job_template(tmp_path_factory):
    """A closed 2-rank job (iterations 0..3, epoch 1), built once; tests copy it."""
    tmp = tmp_path_factory.mktemp("job-template")
    return _job(tmp)


def _copy(template: str, tmp_path) -> str:
    path = str(tmp_path / "job")
    shutil.copytree(template, path)
    return path


def _keys(server, url: str, under: str) -> list[str]:
    bucket, prefix = url.split("/")[2], url.split("/", 3)[3]
    pages = server.s3().get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"{prefix}/{under}")
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


_GC_KILLER = """
import json, os, signal, sys
from ckptstore.remote import push
from ckptstore.remote.client import ObjectStore
path, url, opts = sys.argv[1:4]
opts = json.loads(opts)
cls = type(ObjectStore(url, opts))
orig = cls.delete
def delete(self, names):
    orig(self, names)
    if any("/streams/0000000001-" in self.where.key(n) for n in names):
        os.kill(os.getpid(), signal.SIGKILL)  # the first batch of an old stream went
cls.delete = delete
push(path, url, opts)
print("push finished")
"""


def test_remote_gc_after_a_job_gc_deletes_unnamed_streams_and_survives_sigkill(
        server, url, tmp_path, job_template):
    """After an offline job gc (keep_last=1: a new epoch 2 holding iteration 3), a push keeps
    the old epoch's streams while a kept job HEAD (keep_heads=2) names them; with keep_heads=1
    the push's remote gc deletes them, and SIGKILLed in the middle of that it leaves the kept job
    HEAD restorable bit-exact and fsck clean; the next push finishes the gc."""
    path = _copy(job_template, tmp_path)
    two = server.options(keep_heads=2)
    first = push(path, url, two).head
    old = _keys(server, url, "streams/0000000001-")
    assert old and first.epoch == 1
    with ckptstore.open(path, "r") as job:
        job.gc(keep_last=1)
        assert job.iterations() == [3]
    # compared with the gc'd job, the copy is older: what the gc removed is a note, not differs
    report = verify_remote(url, two, local=path)
    assert report.clean and report.behind and not report.problems, report.lines()
    assert any("collected by a job gc" in n for n in report.notes), report.notes
    second = push(path, url, two).head
    assert second.epoch > 1 and second.generation == first.generation + 1
    assert _keys(server, url, "streams/0000000001-") == old  # the older kept job HEAD names them
    one = server.options(keep_heads=1)
    code = subprocess.run([sys.executable, "-c", _GC_KILLER, path, url, json.dumps(one)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert code.returncode == -signal.SIGKILL, code.stdout + code.stderr
    left = _keys(server, url, "streams/0000000001-")
    assert 0 < len(left) < len(old)  # killed in the middle of the streams' deletion
    report = verify_remote(url, one)
    assert report.clean and report.head.generation == second.generation, report.lines()
    restored = str(tmp_path / "restored")
    pull(url, restored, one)
    _check_job(restored, [3])
    again = push(path, url, one)  # nothing new: no job HEAD, the gc finishes
    assert again.head.generation == second.generation and again.stats.deleted_objects >= 1
    assert _keys(server, url, "streams/0000000001-") == []
    assert all(_keys(server, url, f"{s.prefix}/heads/") for s in second.streams)
    shutil.rmtree(restored)
    pull(url, restored, one)
    _check_job(restored, [3])


def test_a_rank_gc_racing_the_job_head_is_caught_by_the_recheck(server, url, tmp_path,
                                                                 job_template, monkeypatch):
    """format-spec/remote.md §8.3: rank 0's job HEAD thread pins the newest stream HEAD a rank's
    uploader wrote; that rank's gc, having read the pins before, deletes it (a newer one exists)
    just before the job HEAD is written. The re-check finds the pinned HEAD gone and writes a
    second job HEAD naming the newer one: the newest job HEAD restores bit-exact."""
    from dataclasses import replace

    from ckptstore.remote.head import encode_head, head_name
    from ckptstore.remote.job_head import stream_store
    from ckptstore.remote.job_uploader import JobHeadUploader
    from ckptstore.remote.replicate import read_head

    path = _copy(job_template, tmp_path)
    opts = server.options(keep_heads=1, head_interval=3600)
    base = push(path, url, opts).head
    sub = stream_store(ObjectStore(url, opts), 1, 0, opts)

    def new_stream_head(after: int) -> int:
        """What rank 0's uploader does: a newer stream HEAD (here naming the same objects)."""
        h = read_head(sub, after)
        sub.put(head_name(after + 1), encode_head(replace(h, generation=after + 1,
                                                          created_ns=h.created_ns + 1)))
        return after + 1

    ref = base.stream(1, 0)
    assert ref is not None
    observed = new_stream_head(ref.generation)
    cls = type(sub)
    put = cls.put
    raced = []

    def racing_put(self, name, data, **kw):
        if "/jobheads/" in self.where.url(name) and not raced:
            raced.append(new_stream_head(observed))  # the rank's next HEAD, then its gc
            sub.delete([head_name(observed)])
        return put(self, name, data, **kw)

    monkeypatch.setattr(cls, "put", racing_put)
    job = JobHeadUploader(path, url, opts, epoch=1)
    try:
        head = job.sync()
    finally:
        job.stop()
    monkeypatch.setattr(cls, "put", put)
    pinned = head.stream(1, 0)
    assert raced and pinned is not None and pinned.generation == raced[0], (raced, head)
    assert head.generation == base.generation + 2  # the first one pinned the deleted HEAD
    assert verify_remote(url, opts).clean
    restored = str(tmp_path / "restored")
    pull(url, restored, opts)
    _check_job(restored, [0, 1, 2, 3])


# ---- corruption ---------------------------------------------------------------------------------
def test_damaged_job_objects_are_named_and_never_written_locally(server, url, tmp_path):
    """A damaged newer job HEAD is skipped (the older one restores); a changed global log extent
    and a stream HEAD that is not the one the job HEAD pins raise RemoteIntegrityError naming the
    object; nothing of them becomes a job store locally."""
    from dataclasses import replace

    from ckptstore import RemoteIntegrityError
    from ckptstore.remote.head import encode_head
    from ckptstore.remote.job_head import job_head_name, log_extent_name
    from ckptstore.remote.replicate import read_head

    opts = server.options()
    path = _job(tmp_path)
    head = push(path, url, opts).head
    bucket, prefix = url.split("/")[2], url.split("/", 3)[3]
    s3 = server.s3()
    s3.put_object(Bucket=bucket, Key=f"{prefix}/{job_head_name(head.generation + 1)}",
                  Body=b'{"format":"ckptstore-remote-job-head"}\nxxh3-128 ' + b"0" * 32 + b"\n")
    pulled = str(tmp_path / "ok")
    assert pull(url, pulled, opts).head.generation == head.generation  # the valid older one
    _check_job(pulled, [0, 1, 2, 3])
    lg = head.log(1)
    assert lg is not None
    key = f"{prefix}/{log_extent_name(lg.extents[-1])}"
    good = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    s3.put_object(Bucket=bucket, Key=key, Body=good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(RemoteIntegrityError, match="changed behind our back") as e:
        pull(url, tmp_path / "a", opts)
    assert key in str(e.value) and not os.path.exists(tmp_path / "a" / "STORE")
    report = verify_remote(url, opts)  # the job's own objects: no rank
    assert [(p.kind, p.rank) for p in report.problems] == [("damaged", None)] * 2, report.lines()
    assert "jobheads/" in report.problems[0].url and key in report.problems[1].url
    assert "digest mismatch" in report.damage[1] and report.head.generation == head.generation
    s3.put_object(Bucket=bucket, Key=key, Body=good)
    ref = head.stream(1, 1)
    assert ref is not None
    sub = ObjectStore(f"{url}/{ref.prefix}", opts)
    h = read_head(sub, ref.generation)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/{ref.prefix}/{h.name}",
                  Body=encode_head(replace(h, created_ns=h.created_ns + 1)))
    with pytest.raises(RemoteIntegrityError, match="rank 1's stream HEAD") as e:
        pull(url, tmp_path / "b", opts)
    assert not os.path.exists(tmp_path / "b" / "STORE")


# ---- background upload while the job trains ------------------------------------------------------
def test_ranks_upload_their_streams_while_the_job_trains(server, url, tmp_path):
    """remote= on a job store: each rank's uploader sends its own stream, rank 0 writes job HEADs
    for what the stream HEADs cover and, at close, the final one. A second job (a new epoch)
    continues the remote copy; the pull holds both jobs' iterations bit-exact."""
    opts = server.options(head_interval=0.2)
    path = str(tmp_path / "job")
    ok(run_ranks(2, MOD, "train_with_remote", path, str(tmp_path / "w1"), url=url, opts=opts,
                 start=0, stop=5))
    head = newest_job_head(ObjectStore(url, opts))
    assert head.latest == 4 and head.epoch == 1
    ok(run_ranks(2, MOD, "train_with_remote", path, str(tmp_path / "w2"), url=url, opts=opts,
                 start=6, stop=9))  # (a new stream starts with a snapshot)
    head2 = newest_job_head(ObjectStore(url, opts))
    assert head2.latest == 8 and head2.epoch == 2 and head2.generation > head.generation
    restored = str(tmp_path / "restored")
    pull(url, restored, opts)
    _check_job(restored, [0, 1, 2, 3, 4, 6, 7, 8])
    assert push(path, url, opts).head.generation == head2.generation  # nothing left to send


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_while_uploading_leaves_a_restorable_remote_copy(server, url, tmp_path,
                                                                      victim):
    """SIGKILL one rank (rank 0 writes the job HEADs) while the job trains with the remote tier:
    the newest job HEAD restores bit-exact, and names no iteration the job did not commit."""
    opts = server.options(head_interval=0.1)
    path = str(tmp_path / "job")
    res = run_ranks(2, MOD, "train_killed", path, str(tmp_path / "w"), url=url, opts=opts,
                    victim=victim, nth=400, deadline=150)
    assert "died" in res[victim], res
    with ckptstore.open(path, "r") as job:
        committed = job.iterations()
    assert len(committed) >= 2, committed  # killed mid-run, not before it began
    head = newest_job_head(ObjectStore(url, opts))
    assert head.latest is not None and head.latest <= committed[-1]
    restored = str(tmp_path / "restored")
    pull(url, restored, opts)
    _check_job(restored, list(range(head.latest + 1)))


# ---- lazy reads of one rank's part ---------------------------------------------------------------
def test_lazy_open_of_a_job_reads_only_the_part_it_loads(server, url, tmp_path):
    """open("s3://job", "r") reads a rank's stream only when a load needs it: with every object
    of rank 0's stream deleted, rank 1's part still loads bit-exact (range GETs, a few objects),
    and rank 0's raises RemoteStreamMissingError naming rank 0."""
    opts = server.options()
    path = _job(tmp_path)
    push(path, url, opts)
    bucket, prefix = url.split("/")[2], url.split("/", 3)[3]
    s3 = server.s3()
    gone = [o["Key"] for o in s3.list_objects_v2(
        Bucket=bucket, Prefix=f"{prefix}/streams/0000000001-00000/")["Contents"]]
    s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in gone]})
    with ckptstore.open(url, "r", storage_options=opts) as job:
        assert job.iterations() == [0, 1, 2, 3]
        for it in (3, 0):
            assert same(rank_state(it, 1), job.load(it, rank=1))
        assert same(_expected(2, 1), job.load_record(2, rank=1))
        stats = job.stream(3, rank=1).remote_read_stats()
        assert stats.mode == "ranges" and stats.index == "used"  # range GETs, not a pull
        with pytest.raises(RemoteStreamMissingError) as e:
            job.load(3, rank=0)
        assert e.value.rank == 0 and "0000000001-00000" in e.value.url


def test_job_head_codec_round_trips_and_refuses_malformed_heads():
    """The job HEAD codec (format-spec/remote.md §8.1): bytes out and back, and each shape the
    spec refuses raises FormatError (ChecksumMismatch for a failed check line)."""
    import json

    from ckptstore import ChecksumMismatch, FormatError, UnsupportedVersionError
    from ckptstore.remote.head import Extent, seal_json
    from ckptstore.remote.job_head import (JobHead, LogEntry, StreamRef, decode_job_head,
                                           encode_job_head)

    d = bytes(range(16))
    head = JobHead(generation=3, store_id=d, store_digest=d, epoch=2, end=300, latest=9, count=4,
                   streams=(StreamRef(1, 0, 5, d), StreamRef(2, 1, 1, d)),
                   logs=(LogEntry(1, 200, (Extent(1, 0, 200, d),)),
                         LogEntry(2, 300, (Extent(2, 0, 100, d), Extent(2, 100, 200, d)))),
                   created_ns=7)
    data = encode_job_head(head)
    assert decode_job_head(data, 3) == head
    with pytest.raises(FormatError, match="differs from its name"):
        decode_job_head(data, 4)
    with pytest.raises(ChecksumMismatch):
        decode_job_head(data.replace(b'"latest":9', b'"latest":8'), 3)
    body = json.loads(data.split(b"\n")[0])

    def bad(**change):
        return seal_json({**body, **change})
    with pytest.raises(UnsupportedVersionError):
        decode_job_head(bad(v=2), 3)
    for change, match in [
            ({"streams": [[2, 1, 1, d.hex()], [1, 0, 5, d.hex()]]}, "out of order"),
            ({"streams": [[1, 0, 0, d.hex()]]}, "generation"),
            ({"logs": [[1, 200, [[0, 100, d.hex()], [150, 50, d.hex()]]],
                       body["logs"][1]]}, "not consecutive"),
            ({"logs": [[1, 200, [[0, 100, d.hex()]]], body["logs"][1]]}, "cover"),
            ({"end": 299}, "current epoch"),
            ({"epoch": 1, "end": 200}, "current epoch"),
            ({"store": "XY"}, "hex"),
            ({"logs": "no"}, "must be a list")]:
        with pytest.raises(FormatError, match=match):
            decode_job_head(bad(**change), 3)
