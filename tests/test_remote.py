"""The remote tier (ckptstore/remote/, format-spec/remote.md) against a real S3 server process.

Every test talks HTTP to moto's standalone server (``python -m moto.server``) started as a
subprocess on a free port of 127.0.0.1; nothing of the client is mocked. Covered: push and pull
round trips, bit-exact (snapshots, a Checkpointer delta chain, multipart objects); uploading
while training (the writer's background uploader, rate-limited HEADs); a push SIGKILLed
mid-upload and resumed; the server stopped mid-run and restarted (moto keeps no state across a
restart: the uploader reports a typed error, backs off, local saves go on, and it re-uploads
everything once the server is back); restore into an empty directory from the server alone; an
object changed behind our back; wrong credentials and a missing bucket; a remote copy older
(reported) or newer (refused) than the local store; gc under a remote; misuse refused; lazy
remote reads (``ckptstore.open("s3://...", "r")``): bytes fetched per load, bit-exact snapshots
and delta chains, a changed extent named, an absent, missing, damaged, stale or foreign index
object, objects collected under a reader, the service going away under one.

Both S3 clients (ckptstore/remote/client.py: obstore, the default, and boto3) are tested: every
request of the client interface against the server for each installed client
(``test_client_contract``), and the push/pull/lazy round trip for each; the rest of the module
runs with the default client, or with the one ``CKPTSTORE_REMOTE_CLIENT`` names
(``CKPTSTORE_REMOTE_CLIENT=boto3 python -m pytest tests/test_remote.py``).

Needs the ``remote-test`` extra (``pip install -e '.[remote-test]'``: obstore, moto[server], which
brings boto3: the tests change objects behind the client's back with it).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
from _ports import server_port

pytest.importorskip("boto3", reason="the remote tier needs boto3 (pip install -e '.[remote]')")
pytest.importorskip("moto.server", reason="these tests run moto's S3 server: pip install -e "
                    "'.[remote-test]' (moto[server])")

import boto3  # noqa: E402

import ckptstore  # noqa: E402
from ckptstore import (RemoteConflictError, RemoteError, RemoteIntegrityError,  # noqa: E402
                       RemoteUnsupportedError, StoreNotFoundError)
from ckptstore.cli import main as cli  # noqa: E402
from ckptstore.ops.fsck import check  # noqa: E402
from ckptstore.remote import newest_head, pull, push, verify_remote  # noqa: E402
from ckptstore.remote.client import CLIENTS, Cancelled, ObjectStore, Pacer  # noqa: E402
from ckptstore.torch import Checkpointer  # noqa: E402

MiB = 1 << 20
#: the clients installed here (each test parametrized with ``client`` runs once per client)
INSTALLED = [c for c in CLIENTS if importlib.util.find_spec(c) is not None]


class MotoServer:
    """moto's S3 server as a child process on 127.0.0.1 (restartable on the same port)."""

    def __init__(self, log_dir, env: dict | None = None) -> None:
        self.port = server_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **(env or {})}
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None
        self._starts = itertools.count()

    def start(self) -> None:
        log = open(os.path.join(self.log_dir, f"moto-{self.port}-{next(self._starts)}.log"), "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}")
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
                return
            except urllib.error.HTTPError:
                return  # it answers (an auth-checking server refuses the unsigned request)
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("moto server did not answer within 60 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def options(self, **extra) -> dict:
        return {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing",
                "region_name": "us-east-1", **extra}

    def s3(self):
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = MotoServer(str(tmp_path_factory.mktemp("moto")))
    srv.start()
    yield srv
    srv.stop()


_buckets = itertools.count()


@pytest.fixture
def url(server):
    """A fresh bucket on the module's server; the store's prefix in it."""
    name = f"ckpt-{os.getpid()}-{next(_buckets)}"
    server.s3().create_bucket(Bucket=name)
    return f"s3://{name}/runs/a"


def _state(i: int, big: int = 0) -> dict:
    g = torch.Generator().manual_seed(i)
    st = {"model": {"w": torch.randn(64, 32, generator=g),
                    "b": torch.arange(7, dtype=torch.bfloat16) + i,
                    "mask": torch.rand(33, generator=g) > 0.5},
          "step": i, "lr": 0.1 / (i + 1), "name": f"it{i}", "tup": (i, None, b"\x00\xff")}
    if big:
        st["big"] = torch.randn(big // 4, generator=g)  # random: neither dedup nor lz4 shrink it
    return st


def _all_states(path) -> dict:
    with ckptstore.open(path, "r") as s:
        return {it: s.load(it) for it in s.iterations()}


def _checkpointer_run(path, n, remote=None, remote_options=None, **ck):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    store = ckptstore.open(path, "a", remote=remote, remote_options=remote_options)
    c = Checkpointer(store, model, opt, **{"policy": "every-iteration", **ck})
    start = c.restore()
    for it in range(start + 1, n + 1):
        g = torch.Generator().manual_seed(it)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        c.step(it, meta={"it": it})
        opt.zero_grad()
    return store, c


# ---- the client interface, per client -----------------------------------------------------------
def test_client_contract(server, url, client, monkeypatch):
    """Every request of ckptstore/remote/client.py's interface, against the server, for each
    installed client: the same answers and the same typed errors from both."""
    import errno
    import threading

    from ckptstore.errors import StoreIOError

    opts = server.options(client=client)
    store = ObjectStore(url, opts)
    assert store.kind == client
    s3, bucket, prefix = server.s3(), url.split("/")[2], url.split("/", 3)[3]
    store.check_bucket()
    # conditional create (If-None-Match: *): the second one writes nothing
    assert store.put("heads/1", b"one", if_absent=True)
    assert not store.put("heads/1", b"two", if_absent=True)
    assert store.get("heads/1") == b"one" and store.conditional_writes
    assert store.put("heads/1", b"two") and store.get("heads/1") == b"two"  # plain: overwrites
    store.put("meta", b"m", metadata={"xxh3-128": "ab" * 16})
    meta = s3.head_object(Bucket=bucket, Key=f"{prefix}/meta")["Metadata"]
    assert meta == {"xxh3-128": "ab" * 16}
    assert store.size("heads/1") == 3 and store.size("nope") is None
    # a multipart upload: each part read once, in order, counted as sent
    data = os.urandom(12 * MiB)
    reads, sent = [], []

    def read(off: int, n: int) -> bytes:
        reads.append((off, n))
        return data[off:off + n]

    store.put_range("segments/big", read, len(data), 5 * MiB, Pacer(None),
                    metadata={"xxh3-128": "cd" * 16}, sent=sent.append)
    assert reads == [(0, 5 * MiB), (5 * MiB, 5 * MiB), (10 * MiB, 2 * MiB)]
    assert sum(sent) == len(data)
    h = s3.head_object(Bucket=bucket, Key=f"{prefix}/segments/big")
    assert h["ETag"].endswith('-3"') and h["Metadata"] == {"xxh3-128": "cd" * 16}
    store.put_range("segments/small", read, 100, 5 * MiB, Pacer(None))  # fits a part: one PUT
    assert store.get("segments/small") == data[:100]
    # range GETs and streams
    assert store.get("segments/big", 5 * MiB - 3, 10) == data[5 * MiB - 3:5 * MiB + 7]
    assert store.get("segments/big", len(data) - 4, 100) == data[-4:]  # fewer: the object ends
    with pytest.raises(RemoteError) as e:
        store.get("segments/big", len(data) + 10, 5)
    assert e.value.code == "InvalidRange"
    blocks = list(store.stream("segments/big", MiB, 100, 3 * MiB))
    assert all(len(b) <= MiB for b in blocks) and b"".join(blocks) == data[100:100 + 3 * MiB]
    assert b"".join(store.stream("segments/big", 4 * MiB)) == data
    assert b"".join(store.stream("segments/big", 4 * MiB, 7 * MiB)) == data[7 * MiB:]
    with pytest.raises(RemoteError) as e:
        store.get("nope")
    assert e.value.code in ("NoSuchKey", "404") and e.value.errno == errno.ENOENT
    assert f"{url}/nope" in str(e.value)
    assert store.list_objects() == {"heads/1": 3, "meta": 1, "segments/big": len(data),
                                    "segments/small": 100}
    assert store.list_objects("segments/") == {"segments/big": len(data), "segments/small": 100}
    # an upload stopped by its owner (Cancelled) or by a local read error is aborted, and the
    # exception comes out unchanged
    stop = threading.Event()
    stop.set()
    with pytest.raises(Cancelled):
        store.put_range("segments/cancelled", read, len(data), 5 * MiB, Pacer(1.0, stop))

    def failing(off: int, n: int) -> bytes:
        if off:
            raise StoreIOError("read", "/local/segment", OSError(errno.EIO, "bad sector"))
        return data[:n]

    with pytest.raises(StoreIOError, match="bad sector"):
        store.put_range("segments/failed", failing, len(data), 5 * MiB, Pacer(None))
    assert not s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads")
    assert store.size("segments/cancelled") is None and store.size("segments/failed") is None
    # the multipart upload of a process that died: abort_uploads finds and aborts it
    s3.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/segments/dead")
    assert store.abort_uploads() == 1
    assert not s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads")
    if client == "obstore":  # without boto3 it cannot list them (s3_obstore.py's docstring)
        monkeypatch.setitem(sys.modules, "boto3", None)
        assert store.abort_uploads() == 0
        monkeypatch.undo()
    store.delete(["heads/1", "segments/absent"])
    assert set(store.list_objects()) == {"meta", "segments/big", "segments/small"}
    # a missing bucket, an endpoint that does not answer: typed
    gone = ObjectStore("s3://no-such-bucket-here/x", opts)
    for request in (gone.check_bucket, gone.list_objects, lambda: gone.put("a", b"1"),
                    lambda: gone.get("a")):
        with pytest.raises(RemoteError) as e:
            request()
        assert e.value.code == "NoSuchBucket" and e.value.errno == errno.ENOENT, e.value
    down = ObjectStore(url, server.options(client=client, endpoint_url=f"http://127.0.0.1:"
                                           f"{server_port()}", max_attempts=1, connect_timeout=1))
    for request in (down.check_bucket, down.list_objects, lambda: down.get("meta", 0, 10),
                    lambda: down.put("a", b"1", if_absent=True), lambda: down.size("meta")):
        with pytest.raises(RemoteError) as e:
            request()
        assert e.value.code == "Unreachable" and e.value.errno == errno.ECONNREFUSED, e.value
    with pytest.raises(ValueError, match="client"):
        ObjectStore(url, server.options(client="s3fs"))


@pytest.mark.skipif(INSTALLED != ["obstore", "boto3"], reason="needs both clients")
def test_a_child_forked_after_obstore_ran_gets_boto3(server, url, tmp_path):
    """obstore's Rust runtime does not survive fork (a child's requests hang, and can stall the
    parent's): in a child forked after obstore ran, the default client is boto3, and obstore is
    refused with a typed error instead of hanging; the parent's client goes on working."""
    opts = server.options()
    script = f"""
import os, signal, sys
from ckptstore.errors import RemoteUnsupportedError
from ckptstore.remote.client import ObjectStore
st = ObjectStore({url!r}, {opts!r})
assert st.kind == "obstore"
st.put("a", b"1")
pid = os.fork()
if pid == 0:
    signal.alarm(20)
    code = 0
    try:
        child = ObjectStore({url!r}, {opts!r})
        assert child.kind == "boto3" and child.get("a") == b"1", child.kind
        for request in (lambda: ObjectStore({url!r}, dict({opts!r}, client="obstore")),
                        lambda: st.get("a")):
            try:
                request()
                code = 3
            except RemoteUnsupportedError as e:
                assert "fork" in str(e), e
    except BaseException as e:
        print("child:", repr(e), flush=True)
        code = 2
    os._exit(code)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
assert st.get("a") == b"1" and st.kind == "obstore"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "CKPTSTORE_REMOTE_CLIENT": ""})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


# ---- push / pull -------------------------------------------------------------------------------
@pytest.fixture(params=INSTALLED)
def client(request) -> str:
    return request.param


def test_push_pull_round_trip_bit_exact_and_restore_from_the_server_alone(server, url, tmp_path,
                                                                           assert_same, client):
    src = tmp_path / "src"
    # a Checkpointer delta chain (bases every 4, deltas in between), then plain snapshots
    store, _ = _checkpointer_run(src, 12, base_every=4, group_commit=2)
    store.close()
    with ckptstore.open(src, "a") as s:
        for i in range(13, 16):
            s.save(i, _state(i, big=6 * MiB if i == 14 else 0), meta={"loss": 1.0 / (i + 1)})
    expected = _all_states(src)
    assert list(expected) == list(range(0, 16))
    # the 6 MiB tensor's extent goes as a multipart
    opts = server.options(part_size=5 * MiB, client=client)

    r = push(src, url, opts)
    assert r.head.recoverable == 15 and r.head.count == len(expected)
    assert r.stats.uploaded_objects >= 2 and r.stats.heads_written == 1
    again = push(src, url, opts)  # nothing new: nothing sent, no new HEAD
    assert again.stats.uploaded_bytes == 0 and again.stats.heads_written == 0
    assert again.head.generation == r.head.generation

    shutil.rmtree(src)  # the machine is gone: only the server has the store
    dest = tmp_path / "restored"
    p = pull(url, dest, opts)
    assert p.head.generation == r.head.generation and p.downloaded_bytes == r.head.nbytes
    got = _all_states(dest)
    assert list(got) == list(expected)
    for it in expected:
        assert_same(expected[it], got[it], f"iteration {it}")
    assert check(dest).clean
    with ckptstore.open(url, "r", storage_options=opts) as remote:  # the API's remote reader
        assert remote.iterations() == list(expected)
        assert_same(expected[7], remote.load(7))  # a delta: base 4 + replayed steps
    assert pull(url, dest, opts).downloaded_bytes == 0  # an up-to-date copy: nothing fetched


def test_the_store_continues_on_a_new_machine(server, url, tmp_path, assert_same):
    """Pull, reopen the copy as a writer with the same remote: it continues the remote copy
    (its extents are reused, not sent again) and a second pull is incremental."""
    a = tmp_path / "a"
    with ckptstore.open(a, "a") as s:
        for i in range(3):
            s.save(i, _state(i, big=MiB))
    push(a, url, server.options())
    b = tmp_path / "b"
    pull(url, b, server.options())
    with ckptstore.open(b, "a", remote=url, remote_options=server.options()) as s:
        s.save(3, _state(3, big=MiB))
        assert s.remote_flush(30) == 3
        st = s.remote_status()
        assert st.uploaded_bytes < 2 * MiB and not st.behind  # only the new commit went
    r = pull(url, a, server.options())  # the old machine's copy catches up incrementally
    assert r.kept_bytes > 3 * MiB and r.downloaded_bytes < 2 * MiB
    assert_same(_all_states(b), _all_states(a))


# ---- the writer's uploader -------------------------------------------------------------------
def test_upload_while_training(server, url, tmp_path, assert_same):
    """A Checkpointer trains (async deltas, group commits, bases) on a writer with remote=...:
    the remote iteration advances during the run, at most one HEAD per head_interval."""
    path = tmp_path / "train"
    interval = 0.3
    t0 = time.monotonic()
    store, c = _checkpointer_run(path, 0, remote=url,
                                 remote_options=server.options(head_interval=interval),
                                 base_every=10, group_commit=2)
    model, opt = c.model, c.optimizer
    seen = []
    for it in range(1, 41):
        g = torch.Generator().manual_seed(it)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        c.step(it)
        opt.zero_grad()
        seen.append(store.remote_iteration())
        time.sleep(0.03)
    store.flush()
    durable = store.durable_iteration()
    assert store.remote_flush(30) == durable == 40
    st = store.remote_status()
    elapsed = time.monotonic() - t0
    assert st.error is None and not st.behind and st.iteration == 40 and st.local_iteration == 40
    assert st.heads_written <= elapsed / interval + 3, (st.heads_written, elapsed)  # rate-limited
    assert len({s for s in seen if s is not None}) >= 2  # the remote advanced during the run
    store.close()
    assert_same(_all_states(path), _all_states_pulled(url, tmp_path / "pulled", server))


def _all_states_pulled(url, dest, server) -> dict:
    pull(url, dest, server.options())
    return _all_states(dest)


def test_checkpointer_with_remote_deltas_and_close_uploads_the_end(server, url, tmp_path,
                                                                    assert_same):
    path = tmp_path / "ck"
    store, c = _checkpointer_run(path, 30, remote=url,
                                 remote_options=server.options(head_interval=0.2),
                                 base_every=8, group_commit=3)
    store.close()  # commits pending deltas, then the final upload
    assert newest_head(ObjectStore(url, server.options())).recoverable == 30
    assert_same(_all_states(path), _all_states_pulled(url, tmp_path / "pulled", server))


# ---- interruption: SIGKILL mid-upload, resume ----------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("uploader", ["push", "writer"])
def test_upload_killed_mid_way_resumes(server, url, tmp_path, assert_same, uploader):
    """SIGKILL the uploading process (``push``, or a writer's background uploader) while an
    object is on its way; the next upload reuses what arrived and aborts the dead multipart."""
    src = tmp_path / "src"
    with ckptstore.open(src, "a") as s:
        for i in range(3):
            s.save(i, _state(i, big=8 * MiB))
    opts = server.options(part_size=5 * MiB, max_object=8 * MiB)  # 8 MiB objects: multipart
    slow = dict(opts, bandwidth=4 * MiB)
    code = (f"from ckptstore.remote import push\npush({str(src)!r}, {url!r}, {slow!r})\n"
            if uploader == "push" else
            f"import ckptstore, time\ns = ckptstore.open({str(src)!r}, 'a', remote={url!r}, "
            f"remote_options={slow!r})\ntime.sleep(120)\n")
    child = subprocess.Popen([sys.executable, "-c", code])
    s3, bucket = server.s3(), url.split("/")[2]
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", ())]
            if sum("/segments/" in k for k in keys) >= 1:
                break
            assert child.poll() is None, "the push finished before it could be killed"
            time.sleep(0.05)
        else:
            pytest.fail("no object arrived within 60 s")
        time.sleep(0.8)  # the next object's multipart upload is under way
        assert child.poll() is None, "the push finished before it could be killed"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    with pytest.raises(StoreNotFoundError, match="no HEAD"):  # no partial iteration is visible
        pull(url, tmp_path / "early", opts)
    total = sum(os.path.getsize(p) for p in (src / "segments").iterdir())
    if uploader == "push":
        stats = push(src, url, opts).stats
    else:
        with ckptstore.open(src, "a", remote=url, remote_options=opts) as s:
            assert s.remote_flush(60) == 2
            stats = s.remote_status()
    index = newest_head(ObjectStore(url, opts)).index  # the index object goes with the HEAD
    assert index is not None
    # what arrived was not sent again
    assert stats.uploaded_bytes <= total - 8 * MiB + 64 + index.length
    assert not s3.list_multipart_uploads(Bucket=bucket).get("Uploads")  # the dead one aborted
    assert_same(_all_states(src), _all_states_pulled(url, tmp_path / "pulled", server))
    assert verify_remote(url, opts).clean


def test_bandwidth_bound(server, url, tmp_path):
    src = tmp_path / "src"
    with ckptstore.open(src, "a") as s:
        s.save(0, _state(0, big=6 * MiB))
    rate = 4 * MiB
    t0 = time.monotonic()
    r = push(src, url, server.options(bandwidth=rate, part_size=5 * MiB))
    took = time.monotonic() - t0
    # leaky bucket: everything after the first request waits for its share of the rate
    assert took >= (r.stats.uploaded_bytes - 5 * MiB) / rate * 0.9, took


# ---- network faults ------------------------------------------------------------------------------
def test_server_down_mid_run_then_back(tmp_path, assert_same):
    srv = MotoServer(str(tmp_path))
    srv.start()
    try:
        srv.s3().create_bucket(Bucket="faults")
        url = "s3://faults/run"
        opts = srv.options(head_interval=0.1, max_backoff=0.4, connect_timeout=1,
                           read_timeout=5, max_attempts=1)
        path = tmp_path / "s"
        store = ckptstore.open(path, "a", remote=url, remote_options=opts)
        for i in range(2):
            store.save(i, _state(i, big=MiB))
        assert store.remote_flush(30) == 1
        srv.stop()
        for i in range(2, 5):  # local saves go on while the remote is unreachable
            store.save(i, _state(i, big=MiB))
        deadline = time.monotonic() + 30
        while store.remote_status().error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        st = store.remote_status()
        assert isinstance(st.error, RemoteError) and st.error.code == "Unreachable", st.error
        assert st.behind and st.iteration == 1 and st.local_iteration == 4
        assert store.remote_iteration() == 1
        with pytest.raises(RemoteError):
            store.remote_flush(timeout=0.5)
        failures = store.remote_status().failures
        time.sleep(1.0)  # backing off: a few retries, not a busy loop
        assert store.remote_status().failures - failures <= 6
        srv.start()  # same port; moto keeps no state across restarts: an empty server
        srv.s3().create_bucket(Bucket="faults")
        store.save(5, _state(5, big=MiB))
        assert store.remote_flush(60) == 5  # everything uploaded again
        assert store.remote_status().error is None
        store.close()
        assert_same(_all_states(path), _all_states_pulled(url, tmp_path / "pulled", srv))
    finally:
        srv.stop()


# ---- integrity --------------------------------------------------------------------------------
def test_object_changed_behind_our_back(server, url, tmp_path, capsys):
    src = tmp_path / "src"
    opts = server.options()
    with ckptstore.open(src, "a") as s:
        s.save(0, _state(0, big=MiB))
    push(src, url, opts)
    with ckptstore.open(src, "a") as s:
        s.save(1, _state(1, big=MiB))
    head = push(src, url, opts).head
    s3, bucket = server.s3(), url.split("/")[2]
    prefix = url.split("/", 3)[3]
    victim = head.extents()[-1]
    key = f"{prefix}/{victim.name}"
    data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))

    dest = tmp_path / "dest"
    with pytest.raises(RemoteIntegrityError, match=victim.name) as e:
        pull(url, dest, opts)
    assert "digest mismatch" in str(e.value)
    seg = dest / "segments" / f"{victim.seq:010d}.seg"
    assert not seg.exists() or seg.stat().st_size == victim.offset  # nothing wrong kept
    report = verify_remote(url, opts)
    assert not report.clean and any(victim.name in d for d in report.damage)
    assert cli(["fsck", url, "--endpoint-url", server.endpoint, "--option", "key=testing",
                "--option", "secret=testing"]) == 1
    assert victim.name in capsys.readouterr().out

    # a damaged newest HEAD: readers fall back to the older valid one, fsck reports it
    data[len(data) // 2] ^= 0x01
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))  # the extent repaired
    hkey = f"{prefix}/{head.name}"
    raw = s3.get_object(Bucket=bucket, Key=hkey)["Body"].read()
    s3.put_object(Bucket=bucket, Key=hkey, Body=raw.replace(b'"iterations":2', b'"iterations":9'))
    assert newest_head(ObjectStore(url, opts)).generation == head.generation - 1
    report = verify_remote(url, opts)
    assert any("checksum mismatch" in d for d in report.damage) and report.head is not None
    with ckptstore.open(url, "r", storage_options=opts) as r:
        assert r.iterations() == [0]


# ---- credentials, buckets ------------------------------------------------------------------------
def test_missing_bucket_is_typed_and_loses_nothing(server, tmp_path):
    path = tmp_path / "s"
    with ckptstore.open(path, "a") as s:
        s.save(0, _state(0))
    gone = "s3://no-such-bucket-here/run"
    with pytest.raises(RemoteError) as e:
        ckptstore.open(path, "a", remote=gone, remote_options=server.options())
    assert e.value.code == "NoSuchBucket"
    with pytest.raises(RemoteError, match="NoSuchBucket"):
        push(path, gone, server.options())
    # the open failed cleanly: the lock is free and the store intact
    with ckptstore.open(path, "a", remote=gone,
                        remote_options=server.options(check_on_open=False,
                                                      max_backoff=0.2)) as s:
        s.save(1, _state(1))  # saves work; the uploader reports the error
        with pytest.raises(RemoteError) as e:
            s.remote_flush(timeout=2)
        assert e.value.code == "NoSuchBucket" and isinstance(s.remote_status().error, RemoteError)
    with ckptstore.open(path, "r") as s:
        assert s.iterations() == [0, 1]
    with pytest.raises(RemoteError, match="NoSuchBucket"):
        pull(gone, tmp_path / "dest", server.options())


def test_wrong_credentials_are_typed(tmp_path, client):
    srv = MotoServer(str(tmp_path), env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})  # checks keys
    srv.start()
    try:
        path = tmp_path / "s"
        with ckptstore.open(path, "a") as s:
            s.save(0, _state(0))
        url = "s3://secured/run"
        bad = srv.options(key="AKIAWRONGWRONGWRONG0", secret="nope", client=client)
        with pytest.raises(RemoteError) as e:
            push(path, url, bad)
        assert e.value.code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied")
        assert isinstance(e.value, OSError) and "s3://secured/run" in str(e.value)
        with pytest.raises(RemoteError):
            ckptstore.open(path, "a", remote=url, remote_options=bad)
        with pytest.raises(RemoteError):
            pull(url, tmp_path / "dest", bad)
        assert not (tmp_path / "dest" / "STORE").exists()
        with ckptstore.open(path, "a") as s:  # nothing local lost, the lock released
            assert s.iterations() == [0]
    finally:
        srv.stop()


# ---- older / newer / other stores -----------------------------------------------------------------
def test_remote_older_than_local_is_reported(server, url, tmp_path, capsys):
    path = tmp_path / "s"
    with ckptstore.open(path, "a") as s:
        for i in range(2):
            s.save(i, _state(i))
    push(path, url, server.options())
    with ckptstore.open(path, "a") as s:
        s.save(2, _state(2))
    report = verify_remote(url, server.options(), local=path)
    assert report.clean and report.behind and report.local_iteration == 2
    assert any("older" in n for n in report.notes)
    assert cli(["fsck", str(path), "--remote", url, "--endpoint-url", server.endpoint,
                "--option", "key=testing", "--option", "secret=testing"]) == 0
    out = capsys.readouterr().out
    assert "BEHIND: the remote copy holds iteration 1, the local store 2" in out
    with ckptstore.open(path, "a", remote=url,
                        remote_options=server.options(head_interval=3600)) as s:
        st = s.remote_status()
        assert st.iteration in (1, 2)
        assert s.remote_flush(30) == 2 and not s.remote_status().behind


def _flip_local(path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_fsck_with_the_local_store_compares_bytes(server, url, tmp_path, capsys):
    """verify_remote(URL, local=DIR) of a single store compares bytes, as for a job store
    (remote/job_compare.py): a local segment byte the copy does not hold is DIFFERS, naming the
    object and the local file; a remote object changed behind our back is damage (the local
    bytes still match); both put back, the pair is clean."""
    path, opts = tmp_path / "s", server.options()
    with ckptstore.open(path, "a") as s:
        for i in range(2):
            s.save(i, _state(i))
    head = push(path, url, opts).head
    assert verify_remote(url, opts, local=path).clean
    victim = head.extents()[0]
    seg = path / "segments" / f"{victim.seq:010d}.seg"
    _flip_local(seg, victim.offset + victim.length // 2)
    report = verify_remote(url, opts, local=path)
    assert not report.clean and not report.damage and len(report.differs) == 1, report.lines()
    assert victim.name in report.differs[0] and str(seg) in report.differs[0], report.differs
    assert cli(["fsck", str(path), "--remote", url, "--endpoint-url", server.endpoint,
                "--option", "key=testing", "--option", "secret=testing"]) == 1
    assert "1 differ from the local store" in capsys.readouterr().out
    _flip_local(seg, victim.offset + victim.length // 2)
    _flip(server, url, victim.name, victim.length // 2)
    report = verify_remote(url, opts, local=path)
    assert not report.clean and not report.differs, report.lines()
    assert any(victim.name in d and "digest mismatch" in d for d in report.damage), report.lines()
    _flip(server, url, victim.name, victim.length // 2)
    assert verify_remote(url, opts, local=path).clean


def test_remote_newer_or_foreign_is_never_overwritten(server, url, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    with ckptstore.open(a, "a") as s:
        s.save(0, _state(0))
    push(a, url, server.options())
    pull(url, b, server.options())
    with ckptstore.open(b, "a", remote=url, remote_options=server.options()) as s:
        s.save(1, _state(1))  # the copy on the "new machine" goes further
    with pytest.raises(RemoteConflictError, match="newer"):
        ckptstore.open(a, "a", remote=url, remote_options=server.options())
    with pytest.raises(RemoteConflictError):
        push(a, url, server.options())
    other = tmp_path / "other"
    with ckptstore.open(other, "a") as s:
        s.save(5, _state(5))
    with pytest.raises(RemoteConflictError, match="another store"):
        push(other, url, server.options())
    with pytest.raises(RemoteConflictError):  # pulling into a directory of another store
        pull(url, other, server.options())
    with ckptstore.open(a, "a") as s:  # b's state is not a's: pulling over a is refused too
        s.save(1, _state(11))
    with pytest.raises(RemoteConflictError):
        pull(url, a, server.options())
    with ckptstore.open(a, "a") as s:  # a's own history now goes further than b's
        s.save(2, _state(2))
    with pytest.raises(RemoteConflictError, match="another history"):
        push(a, url, server.options())
    with ckptstore.open(a, "r") as s:
        assert s.iterations() == [0, 1, 2]
    with ckptstore.open(url, "r", storage_options=server.options()) as r:
        assert r.iterations() == [0, 1]
        assert torch.equal(r.load(1)["model"]["w"], _state(1)["model"]["w"])


# ---- gc ------------------------------------------------------------------------------------------
def test_gc_under_a_remote_removes_objects_only_after_a_newer_head(server, url, tmp_path,
                                                                    assert_same):
    path = tmp_path / "s"
    opts = server.options(head_interval=0, keep_heads=1)
    store = ckptstore.open(path, "a", segment_size=2 * MiB, remote=url, remote_options=opts)
    for i in range(6):
        store.save(i, _state(i, big=MiB))
    store.remote_flush(30)
    before = newest_head(ObjectStore(url, opts))
    old_objects = {e.name for e in before.extents()}
    store.gc(keep_last=2)
    assert store.remote_flush(30) == 5
    after = newest_head(ObjectStore(url, opts))
    assert after.generation > before.generation
    live = sorted(int(p.name[:10]) for p in (path / "segments").iterdir()
                  if p.name.endswith(".seg"))
    assert [s.seq for s in after.segments] == live  # the gc marker travels too
    names = set(ObjectStore(url, opts).list_objects("segments/"))
    assert names == {e.name for e in after.extents()} and not (old_objects & names - {
        e.name for e in after.extents()})
    assert after.index is not None  # the index objects of dropped HEADs went with them
    assert set(ObjectStore(url, opts).list_objects("index/")) == {after.index.name}
    store.close()
    dest = tmp_path / "pulled"
    pull(url, dest, opts)
    assert check(dest).clean  # no segment reads as missing: the watermark came along
    assert_same(_all_states(path), _all_states(dest))
    assert list(_all_states(dest)) == [4, 5]


# ---- what is refused -----------------------------------------------------------------------------
def test_misuse_is_refused(server, url, tmp_path):
    with pytest.raises(RemoteUnsupportedError):
        ckptstore.open(url, "a", storage_options=server.options())
    with pytest.raises(RemoteUnsupportedError):
        ckptstore.open("gs://bucket/x", "r")
    with ckptstore.open(tmp_path / "s", "a") as s:
        s.save(0, _state(0))
    with pytest.raises(RemoteUnsupportedError):
        ckptstore.open(tmp_path / "s", "r", remote=url)
    with ckptstore.open(tmp_path / "s", "a") as s:
        with pytest.raises(RemoteUnsupportedError):
            s.remote_iteration()
    with pytest.raises(ValueError, match="unknown remote options"):
        push(tmp_path / "s", url, {"bandwith": 5})
    with pytest.raises(StoreNotFoundError):
        ckptstore.open(url, "r", storage_options=server.options())  # nothing pushed yet


# ---- lazy remote reads (ckptstore/remote/reader.py) ----------------------------------------------
def _rewrite_head(server, url, head) -> None:
    """Overwrite a HEAD object in place with ``head`` (a valid check line): what another writer
    (an older version, a damaged upload) could have left."""
    from ckptstore.remote.head import encode_head

    bucket, prefix = url.split("/")[2], url.split("/", 3)[3]
    server.s3().put_object(Bucket=bucket, Key=f"{prefix}/{head.name}", Body=encode_head(head))


def _flip(server, url, name: str, at: int) -> None:
    bucket, prefix = url.split("/")[2], url.split("/", 3)[3]
    s3 = server.s3()
    data = bytearray(s3.get_object(Bucket=bucket, Key=f"{prefix}/{name}")["Body"].read())
    data[at] ^= 0x01
    s3.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=bytes(data))


def _many_iterations(path, n: int, each: int) -> dict:
    """``n`` snapshots, each with ``each`` bytes of its own (random: no dedup, no compression)
    and a few small tensors; returns what was saved."""
    saved = {}
    with ckptstore.open(path, "a") as s:
        for i in range(n):
            g = torch.Generator().manual_seed(1000 + i)
            st = {"w": torch.randn(each // 4, generator=g), "b": torch.arange(5) + i, "step": i}
            s.save(i, st)
            saved[i] = st
    return saved


def test_lazy_open_fetches_about_one_iterations_bytes(server, url, tmp_path, assert_same):
    """open("s3://...", "r") fetches STORE, the HEAD and the index object, then per load about
    that iteration's own bytes -- not the store."""
    src = tmp_path / "src"
    each = 1 * MiB
    saved = _many_iterations(src, 24, each)
    head = push(src, url, server.options()).head
    assert head.index is not None and head.index.length < head.index.raw_length
    shutil.rmtree(src)  # a fresh machine: the server alone
    with ckptstore.open(url, "r", storage_options=server.options()) as r:
        st = r.remote_read_stats()
        assert (st.mode, st.index, st.generation) == ("ranges", "used", head.generation)
        opened = st.bytes_read
        assert opened < 64 << 10, st  # metadata only: HEAD, STORE, index, segment headers
        assert r.iterations() == list(range(24))
        per_load = []
        for it in (3, 17, 23, 0):
            before = r.remote_bytes_read
            assert_same(saved[it], r.load(it), f"iteration {it}")
            per_load.append(r.remote_bytes_read - before)
        # its own bytes (less what an earlier read left in the block cache), plus at most a
        # block or two of records around them
        block = r.remote_read_stats().block_size
        assert all(each - block <= n <= each + 2 * block for n in per_load), per_load
        again = r.remote_bytes_read
        part = r.load(17, keys=["b", "step"])  # no big tensor: cached records
        assert_same({"b": saved[17]["b"], "step": 17}, part)
        assert r.remote_bytes_read - again < 256 << 10
        total = r.remote_read_stats()
        assert total.bytes_read < head.nbytes / 4 and total.mode == "ranges", (total, head.nbytes)
        private = r.path  # STORE and the index: removed at close
        assert sorted(os.listdir(private)) == ["STORE", "index"]
    assert not os.path.exists(private)
    print(f"\nlazy remote reads: store {head.nbytes} bytes, open {opened} bytes, per load of "
          f"{each} bytes: {per_load}, index object {head.index.length} bytes "
          f"({head.index.raw_length} raw)")


def test_lazy_open_of_a_checkpointer_run_bit_exact(server, url, tmp_path, assert_same):
    """The writer's uploader names its own LMDB index in each HEAD: a lazy reader replays the
    delta chain from range reads, bit-exact."""
    path = tmp_path / "ck"
    store, _ = _checkpointer_run(path, 14, remote=url,
                                 remote_options=server.options(head_interval=0.2),
                                 base_every=5, group_commit=2)
    store.close()
    expected = _all_states(path)
    with ckptstore.open(url, "r", storage_options=server.options()) as r:
        assert r.iterations() == list(expected)
        assert r.kind(7) == "delta"
        for it in expected:
            assert_same(expected[it], r.load(it), f"iteration {it}")
        st = r.remote_read_stats()
        assert (st.mode, st.index) == ("ranges", "used"), st


@pytest.mark.parametrize("max_object", [64 * MiB, 128 << 10], ids=["one-extent", "small-extents"])
def test_lazy_read_of_a_changed_extent_names_it(server, url, tmp_path, assert_same, max_object):
    """An extent changed behind our back: the load that reads it raises RemoteIntegrityError
    naming the object (small extents are checked whole as they arrive; in a large one the read
    path's checksum failure makes the reader hash the extents under the failing record); a load
    that does not touch it is unaffected."""
    src = tmp_path / "src"
    saved = _many_iterations(src, 6, 512 << 10)
    opts = server.options(max_object=max_object)
    head = push(src, url, opts).head
    seg = (src / "segments" / f"{head.segments[0].seq:010d}.seg").read_bytes()
    at = seg.find(saved[2]["w"].numpy().tobytes()[:4096]) + 1000  # inside iteration 2's tensor
    assert at > 1000
    victim = next(e for e in head.extents() if e.seq == head.segments[0].seq
                  and e.offset <= at < e.end)
    _flip(server, url, victim.name, at - victim.offset)
    with ckptstore.open(url, "r", storage_options=opts) as r:
        assert r.remote_read_stats().index == "used"
        assert_same(saved[4], r.load(4))
        with pytest.raises(RemoteIntegrityError, match=victim.name) as e:
            r.load(2)
        assert "digest mismatch" in str(e.value) and "changed behind our back" in str(e.value)
        assert r.remote_read_stats().mode == "ranges"  # found without fetching the store whole
        assert_same(saved[5], r.load(5))


def test_lazy_open_without_index_falls_back_to_whole_segments(server, url, tmp_path,
                                                                 assert_same):
    """A HEAD that names no index (an older writer) or an index object that fails its digest:
    the reader fetches the segments whole (verified) and scans them; loads are bit-exact."""
    from dataclasses import replace

    src = tmp_path / "src"
    saved = _many_iterations(src, 5, 256 << 10)
    head = push(src, url, server.options()).head
    assert head.index is not None
    _flip(server, url, head.index.name, head.index.length // 2)  # damaged: a cache, not data
    with ckptstore.open(url, "r", storage_options=server.options()) as r:
        st = r.remote_read_stats()
        assert (st.mode, st.index) == ("whole", "damaged")
        assert st.bytes_read >= head.nbytes
        for it in saved:
            assert_same(saved[it], r.load(it))
    report = verify_remote(url, server.options())
    assert any(head.index.name in d and "a cache" in d for d in report.damage), report.damage

    _rewrite_head(server, url, replace(head, index=None))  # as an older writer wrote it
    server.s3().delete_object(Bucket=url.split("/")[2],
                              Key=f"{url.split('/', 3)[3]}/{head.index.name}")
    with ckptstore.open(url, "r", storage_options=server.options()) as r:
        st = r.remote_read_stats()
        assert (st.mode, st.index) == ("whole", "absent")
        assert r.iterations() == list(saved)
        assert_same(saved[3], r.load(3))
    assert verify_remote(url, server.options()).clean
    with ckptstore.open(url, "r", storage_options=server.options(), lazy=False) as r:
        assert r.remote_read_stats().mode == "whole"
        assert_same(saved[1], r.load(1))
    # a push of the same state adds an index to that HEAD (a new generation, nothing else sent)
    again = push(tmp_path / "src", url, server.options())
    assert again.head.index is not None and again.head.generation == head.generation + 1
    assert again.stats.uploaded_objects == 1


def test_lazy_open_with_a_stale_or_foreign_index(server, url, tmp_path, assert_same):
    """The index is a cache validated against the log: an older one (of an earlier HEAD) still
    serves, the log after its position is scanned with range reads; one of another store fails
    validation and the reader fetches the segments whole. Both load bit-exact."""
    from dataclasses import replace

    src = tmp_path / "src"
    saved = _many_iterations(src, 4, 256 << 10)
    first = push(src, url, server.options()).head
    with ckptstore.open(src, "a") as s:
        for i in range(4, 8):
            g = torch.Generator().manual_seed(1000 + i)
            saved[i] = {"w": torch.randn(64 << 10, generator=g), "b": torch.arange(5) + i,
                        "step": i}
            s.save(i, saved[i])
    second = push(src, url, server.options()).head
    assert first.index is not None and second.index != first.index
    _rewrite_head(server, url, replace(second, index=first.index))  # stale: iterations 0..3
    with ckptstore.open(url, "r", storage_options=server.options()) as r:
        st = r.remote_read_stats()
        assert (st.mode, st.index) == ("ranges", "used"), st
        assert r.iterations() == list(range(8))
        before = r.remote_bytes_read
        assert_same(saved[6], r.load(6))
        assert r.remote_bytes_read - before < 1 * MiB
        assert_same(saved[1], r.load(1))

    other = tmp_path / "other"  # an index object of another store, under this HEAD's name
    _many_iterations(other, 2, 4096)
    other_url = url.rsplit("/", 1)[0] + "/other"
    foreign = push(other, other_url, server.options()).head.index
    assert foreign is not None
    bucket, prefix = url.split("/")[2], url.split("/", 3)[3]
    server.s3().copy_object(Bucket=bucket, Key=f"{prefix}/{foreign.name}",
                            CopySource={"Bucket": bucket,
                                        "Key": f"{other_url.split('/', 3)[3]}/{foreign.name}"})
    _rewrite_head(server, url, replace(second, index=foreign))
    with ckptstore.open(url, "r", storage_options=server.options()) as r:
        st = r.remote_read_stats()
        assert (st.mode, st.index) == ("whole", "unusable"), st
        assert r.iterations() == list(range(8))
        assert_same(saved[7], r.load(7))


def test_lazy_reader_of_a_head_collected_under_it(server, url, tmp_path, assert_same):
    """A lazy reader reads the HEAD newest at its open; a writer's gc and the remote gc after a
    newer HEAD delete objects it names: a read of one raises RemoteIntegrityError naming it
    (never wrong bytes), and a reopen reads the newest HEAD."""
    src = tmp_path / "src"
    opts = server.options(keep_heads=1)
    with ckptstore.open(src, "a", segment_size=1 * MiB) as s:
        for i in range(4):
            g = torch.Generator().manual_seed(i)
            s.save(i, {"w": torch.randn((300 << 10) // 4, generator=g)})
    push(src, url, opts)
    r = ckptstore.open(url, "r", storage_options=opts)
    try:
        with ckptstore.open(src, "a") as s:
            s.gc(keep_last=1)
        push(src, url, opts)  # the old HEAD and the objects only it named are deleted
        with pytest.raises(RemoteIntegrityError, match="segments/0000000001/.*missing"):
            r.load(0)
    finally:
        r.close()
    with ckptstore.open(url, "r", storage_options=opts) as r2:
        assert r2.iterations() == [3]


def test_lazy_reader_service_failure_is_a_remote_error(tmp_path):
    """The server goes away under a lazy reader: a load raises the typed RemoteError of the
    service (never DamagedCheckpointError: nothing in the store is damaged)."""
    srv = MotoServer(str(tmp_path))
    srv.start()
    try:
        srv.s3().create_bucket(Bucket="gone")
        src = tmp_path / "src"
        saved = _many_iterations(src, 3, 256 << 10)
        opts = srv.options(connect_timeout=1, read_timeout=2, max_attempts=1)
        push(src, "s3://gone/run", opts)
        r = ckptstore.open("s3://gone/run", "r", storage_options=opts)
        try:
            assert torch.equal(r.load(2)["w"], saved[2]["w"])
            srv.stop()
            with pytest.raises(RemoteError) as e:
                r.load(0)
            assert e.value.code == "Unreachable" and not isinstance(e.value,
                                                                   RemoteIntegrityError)
        finally:
            r.close()
    finally:
        srv.stop()


def test_head_index_entry_codec():
    from ckptstore.remote.head import Head, IndexRef, decode_head, encode_head
    from ckptstore.errors import FormatError

    h = Head(generation=3, store_id=b"\x01" * 16, store_digest=b"\x02" * 16, position=None,
             latest=None, recoverable=None, count=0, watermark=0, segments=(),
             index=IndexRef(100, 4096, b"\x03" * 16))
    got = decode_head(encode_head(h), 3)
    assert got.index == h.index and h.index.name in got.objects()
    assert decode_head(encode_head(Head(**{**h.__dict__, "index": None})), 3).index is None
    bad = encode_head(h).split(b"\n")[0].replace(b'"index":[100,4096,', b'"index":[0,4096,')
    import xxhash

    with pytest.raises(FormatError, match="index length"):
        decode_head(bad + b"\nxxh3-128 " + xxhash.xxh3_128_hexdigest(bad).encode() + b"\n", 3)


def test_cli_push_pull(server, url, tmp_path, monkeypatch, capsys, assert_same):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    src = tmp_path / "src"
    with ckptstore.open(src, "a") as s:
        for i in range(2):
            s.save(i, _state(i))
    assert cli(["push", str(src), url, "--endpoint-url", server.endpoint, "--bandwidth",
                "100M"]) == 0
    assert "HEAD generation 1, iteration 1" in capsys.readouterr().out
    assert cli(["pull", url, str(tmp_path / "dest"), "--endpoint-url", server.endpoint]) == 0
    assert cli(["fsck", url, "--endpoint-url", server.endpoint]) == 0
    assert_same(_all_states(src), _all_states(tmp_path / "dest"))
    with pytest.raises(SystemExit) as e:
        cli(["push", str(src), url, "--option", "nope=1"])
    assert e.value.code == 2
