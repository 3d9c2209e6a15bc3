"""Shared helpers for the crash and corruption tests (not a test module).

* :func:`state_for` -- the deterministic reference: the state saved as iteration ``i`` is a pure
  function of ``i``. Some tensors never change (dedup across iterations), some change every third
  iteration, some change one chunk of several, one is LZ4-compressible, one is inline-sized, and
  several are larger than :data:`CHUNK_SIZE`.
* :class:`KillOps` -- a FileOps that SIGKILLs its own process on the N-th chosen system call
  (optionally leaving a torn prefix of a write, or killing just after the call completed).
* :class:`FreezeOps` -- in-process crash simulation: after the N-th write every later write-side
  call fails, so nothing more reaches the disk (the store's own rollback cannot clean up).
* A fork server (``python tests/_crashkit.py``): imports ckptstore (and torch) once, then forks one
  crash victim per trial on request, so a trial costs a fork instead of a 2-3 s interpreter start.
  Protocol: one JSON command per stdin line; the server answers ``{"pid": N}`` when the child runs
  and ``{"pid": N, "signal": S, "exit": E}`` when it is gone.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

import numpy as np

CHUNK_SIZE = 16 << 10
SEGMENT_SIZE = 256 << 10

_CONST = np.random.default_rng(7).standard_normal(10_000).astype(np.float32)  # 40000 B, 3 chunks
_OPT_BASE = np.random.default_rng(8).standard_normal(12_288).astype(np.float32)  # 48 KiB, 3 chunks


def state_for(i: int) -> dict:
    """The checkpoint of iteration ``i`` (a pure function of ``i``)."""
    import torch

    r = np.random.default_rng(1_000_003 * i + 11)
    slow = np.random.default_rng(500_000 + i // 3).standard_normal(6_000).astype(np.float32)
    m = _OPT_BASE.copy()
    m[-4096:] = r.standard_normal(4096)  # only the last of three chunks changes
    mask = np.zeros(40_000, dtype=np.uint8)  # compressible: LZ4 chunks, two of three shared
    mask[(i * 7919) % 40_000] = 1 + i % 255
    var = r.integers(-128, 128, size=int(r.integers(300, 30_000)), dtype=np.int8)
    return {
        "model": {
            "embed": torch.from_numpy(_CONST.copy()),            # never changes
            "w": torch.from_numpy(slow).reshape(60, 100),        # changes every 3rd iteration
            "bias": torch.arange(8, dtype=torch.float32) + i,    # inline (32 bytes)
        },
        "opt": {"m": m, "mask": mask, "step": i},
        "var": torch.from_numpy(var),
        "lr": 0.1 / (1 + i),
        "tag": f"it-{i}",
    }


def state_bytes(state: dict) -> int:
    """Bytes the progress callback reports for one save of ``state`` (chunked tensors only)."""
    import torch

    total = 0

    def walk(x):
        nonlocal total
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, torch.Tensor):
            n = x.numel() * x.element_size()
            total += n if n > 256 else 0
        elif isinstance(x, np.ndarray):
            total += x.nbytes if x.nbytes > 256 else 0

    walk(state)
    return total


def die() -> None:
    """Crash like a killed training job: no cleanup, no flush, no finally blocks."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
    os._exit(99)  # unreachable


def _fileops_base():
    from ckptstore.storage.fileops import FileOps

    return FileOps


class CountOps(_fileops_base()):
    """Counts the writes and fsyncs of a run (``counts``), so a sweep can kill at each of them."""

    def __init__(self) -> None:
        self.counts = {"write": 0, "fsync": 0}

    def _pwritev(self, fd, buffers, offset):
        self.counts["write"] += 1
        return super()._pwritev(fd, buffers, offset)

    def _fsync(self, fd):
        self.counts["fsync"] += 1
        return super()._fsync(fd)


def run_forked(fn, *args) -> int:
    """Run ``fn(*args)`` in a forked child and wait for it: the child's exit status (0 when
    ``fn`` returned, 3 when it raised, its traceback on stderr), or ``-signal`` when a signal
    (a KillOps SIGKILL) ended it."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn(*args)
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def torn_write(fd: int, data: bytes, cut: int, offset: int) -> None:
    """Write the leading ``cut`` bytes of ``data`` at ``offset``: what a write interrupted by a
    crash leaves. An O_DIRECT write moves whole blocks, so on an O_DIRECT descriptor the tear falls
    on a block boundary (and the bytes come from an aligned buffer, as O_DIRECT requires)."""
    import fcntl
    import mmap

    direct = getattr(os, "O_DIRECT", 0)
    if direct and fcntl.fcntl(fd, fcntl.F_GETFL) & direct:
        cut -= cut % 4096
        if cut > 0:
            buf = mmap.mmap(-1, cut)
            buf[:] = data[:cut]
            os.pwrite(fd, buf, offset)
    elif cut > 0:
        os.pwrite(fd, data[:cut], offset)


class KillOps(_fileops_base()):
    """SIGKILL the process on the ``nth`` call of ``target`` ("write", "fsync", "truncate",
    "rename", "unlink" or "any"), counted only while ``armed``.

    A killed write first writes the leading ``tear`` fraction of its bytes (a torn record); with
    ``after`` a killed fsync/truncate/rename/unlink completes before the kill.
    """

    def __init__(self, target: str | None = None, nth: int = 0, tear: float = 0.0,
                 after: bool = False, armed: bool = True) -> None:
        self.target, self.left, self.tear, self.after, self.armed = target, nth, tear, after, armed

    def _due(self, op: str) -> bool:
        if not self.armed or self.target is None or self.target not in (op, "any"):
            return False
        self.left -= 1
        return self.left == 0

    def _pwritev(self, fd, buffers, offset):
        if self._due("write"):
            data = b"".join(bytes(b) for b in buffers)
            torn_write(fd, data, min(len(data) - 1, int(len(data) * self.tear)), offset)
            die()
        return super()._pwritev(fd, buffers, offset)

    def _call(self, op: str, fn, *args):
        if self._due(op):
            if self.after:
                fn(*args)
            die()
        return fn(*args)

    def _fsync(self, fd):
        return self._call("fsync", os.fsync, fd)

    def _ftruncate(self, fd, length):
        return self._call("truncate", os.ftruncate, fd, length)

    def _rename(self, src, dst):
        return self._call("rename", os.rename, src, dst)

    def _unlink(self, path):
        return self._call("unlink", os.unlink, path)


class FreezeOps(_fileops_base()):
    """In-process crash: the ``nth`` write writes only its leading ``tear`` fraction, and from then
    on every write-side call fails with EIO (the 'dead' process can change nothing more on disk)."""

    def __init__(self, nth: int, tear: float = 0.5) -> None:
        self.left, self.tear, self.frozen = nth, tear, False

    def _dead(self):
        import errno

        raise OSError(errno.EIO, "process is dead (simulated crash)")

    def _pwritev(self, fd, buffers, offset):
        if self.frozen:
            self._dead()
        self.left -= 1
        if self.left == 0:
            data = b"".join(bytes(b) for b in buffers)
            torn_write(fd, data, min(len(data) - 1, int(len(data) * self.tear)), offset)
            self.frozen = True
            self._dead()
        return super()._pwritev(fd, buffers, offset)

    def _fsync(self, fd):
        if self.frozen:
            self._dead()
        return super()._fsync(fd)

    def _ftruncate(self, fd, length):
        if self.frozen:
            self._dead()
        return super()._ftruncate(fd, length)

    def _rename(self, src, dst):
        if self.frozen:
            self._dead()
        return super()._rename(src, dst)

    def _unlink(self, path):
        if self.frozen:
            self._dead()
        return super()._unlink(path)


# ---- the crash victim (runs in a forked child) ----------------------------------------------

class _Journal:
    """Append-only side file: a line is written only after what it reports has happened."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def __call__(self, event: str) -> None:
        os.write(self.fd, f"{time.monotonic():.6f} {event}\n".encode())


def read_journal(path: str) -> list[tuple[float, str, str]]:
    """(time, event, argument) per line of a journal; a torn last line is dropped."""
    out = []
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return out
    for line in text.split("\n")[:-1]:
        t, _, rest = line.partition(" ")
        event, _, arg = rest.partition(" ")
        out.append((float(t), event, arg))
    return out


def _child(cmd: dict) -> None:
    import ckptstore
    from ckptstore.ops.gc import retained

    journal = _Journal(cmd["journal"])
    journal("start")
    kill = cmd.get("kill") or {}
    ops = KillOps(kill.get("target"), kill.get("nth", 0), kill.get("tear", 0.0),
                  kill.get("after", False), armed=kill.get("armed", True))
    kill_at = cmd.get("kill_at_bytes")
    seen = 0

    def progress(n: int) -> None:
        nonlocal seen
        seen += n
        if kill_at is not None and seen >= kill_at:
            die()

    store = ckptstore.open(cmd["path"], "a", chunk_size=CHUNK_SIZE, segment_size=SEGMENT_SIZE,
                           file_ops=ops, direct_io=cmd.get("direct_io", True))
    journal("open")
    it = (store.latest() or 0) + 1
    mode = cmd["mode"]
    for n in range(cmd.get("max_saves", 400)):
        if mode == "writer" and os.path.exists(cmd["stop"]):
            break
        journal(f"begin {it}")
        store.save(it, state_for(it), progress=progress)
        journal(f"saved {it}")
        it += 1
        gc_every = cmd.get("gc_every")
        if gc_every and (n + 1) % gc_every == 0:
            keep_last, keep_every = cmd["keep_last"], cmd.get("keep_every")
            iters = store.iterations()
            keep = retained(iters, keep_last, keep_every)
            journal("gc-begin " + json.dumps({"keep": keep,
                                              "remove": [i for i in iters if i not in keep]}))
            if mode == "gc":
                ops.armed = True
            store.gc(keep_last=keep_last, keep_every=keep_every)
            if mode == "gc":
                ops.armed = False
            journal("gc-done")
    store.close()
    journal("closed")
    if cmd.get("idle"):  # wait for the kill (a delay kill must never find the pid reaped)
        time.sleep(120)


def serve() -> None:
    import ckptstore  # noqa: F401  (preloaded once; each trial forks from here)
    import ckptstore.ops.gc  # noqa: F401

    for line in sys.stdin:
        cmd = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                _child(cmd)
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
                code = 3
            os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid,
                          "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                          "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}),
              flush=True)


if __name__ == "__main__":
    serve()


def kill_sweep(template, work_dir, run):
    """SIGKILL ``run(path, ops, journal)`` (a writer that journals "durable N" after each save)
    at each of its writes (torn at 60%: an O_DIRECT write breaks on a block boundary) and each
    fsync (before and after the call), each time on a fresh copy of the store at ``template``.
    Yields ``(path, where, durable)`` per kill: the store the killed writer left (fsck already
    found it clean), a label, and the newest iteration it had reported durable. The caller checks
    what survived and deletes ``path``."""
    import shutil

    from ckptstore.ops.fsck import check
    from test_crash import _dies_by_sigkill

    counter = CountOps()
    shutil.copytree(template, work_dir / "count")
    run(work_dir / "count", counter, None)
    kills = [("write", n, 0.6, False) for n in range(1, counter.counts["write"] + 1)] + \
            [("fsync", n, 0.0, after) for n in range(1, counter.counts["fsync"] + 1)
             for after in (False, True)]
    for target, nth, tear, after in kills:
        path = work_dir / f"{target}-{nth}-{int(after)}"
        shutil.copytree(template, path)
        jpath = str(path) + ".journal"
        _dies_by_sigkill(lambda: run(path, KillOps(target, nth, tear, after), _Journal(jpath)))
        where = f"kill at {target} #{nth}{' (after)' if after else ''}"
        assert check(str(path)).clean, where
        yield path, where, max([int(a) for _, e, a in read_journal(jpath) if e == "durable"],
                               default=0)
