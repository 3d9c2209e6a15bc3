"""Power-loss simulation through the FileOps seam (the idea of SQLite's crash-test VFS, ALICE and
CrashMonkey), under exactly the assumptions format-spec/format.md §2 states.

A SIGKILL keeps the page cache (A6); a power cut does not. :class:`RecordingOps` performs every
write-side call of an operation for real and records it: file creations, writes (buffered and
O_DIRECT alike), truncates, fsyncs, renames, unlinks, directory creations and directory fsyncs,
plus a copy of the LMDB index after each index commit (LMDB writes its own files, outside the
seam; it syncs on commit). The caller adds ``mark`` entries for what it was told (a save returned).

:class:`Disk` replays the trace and keeps, for every file, its durable content (as of its last
fsync) and the writes and truncates issued since, and for every directory its durable entries
(as of its last directory fsync) and the creations, renames and unlinks issued since. A crash at
any point between two syncs can leave, under the assumptions:

* A2: each unsynced write of a file kept, lost, or kept only in part (the file longer than its
  durable size with zeros where the write did not land), independently of the others;
* A3: a write torn at a sector boundary (512 B) or inside the sector in flight: what landed is
  new, the rest of its range old, zeros or garbage -- never a byte outside the range (A5);
* A4: each unsynced namespace operation of a directory kept or lost, in any order (a subset,
  applied in issue order: a rename never lands before the creation it renames);
* the index as of its last commit, or lost (it is a cache; losing it must never cost a load).

Crash points are the moments just before each fsync, directory fsync and index commit, and the end
of the trace: a crash anywhere between two of them leaves a subset of the states of the later one
(everything pending at the earlier moment is still pending at the later one), so nothing is missed.
:meth:`Disk.crash_states` enumerates a bounded set at each point: nothing pending kept, everything
kept (what a SIGKILL leaves), all but one operation kept, one write torn, one namespace operation
lost, and seeded random subsets; identical disk images are explored once.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from ckptstore.storage.fileops import FileOps

SECTOR = 512
#: the kinds of trace entries after which a crash point is taken (just before them)
SYNC_KINDS = ("fsync", "fsync_dir", "index")


class RecordingOps(FileOps):
    """Performs every call and appends it to ``trace`` (thread-safe: the async pipeline writes from
    its own thread). fsyncs are recorded but not performed: durability is what :class:`Disk`
    models, and real fsyncs would only slow the exploration down."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.trace: list[tuple] = []
        self.index_dirs: set[str] = set()
        self._lock = threading.RLock()
        self.initial_files, self.initial_dirs, self.initial_index = snapshot_tree(self.root)

    def mark(self, *what: Any) -> None:
        with self._lock:
            self.trace.append(("mark",) + what)

    def _open(self, path: str, flags: int, mode: int) -> int:
        path = os.path.abspath(path)
        with self._lock:
            existed = os.path.exists(path)
            fd = super()._open(path, flags, mode)
            ino = os.fstat(fd).st_ino
            if not existed:
                self.trace.append(("create", path, ino))
            elif flags & os.O_TRUNC:
                self.trace.append(("truncate", ino, 0))
            return fd

    def _mkdir(self, path: str) -> None:
        path = os.path.abspath(path)
        with self._lock:
            missing, p = [], path
            while not os.path.isdir(p):
                missing.append(p)
                p = os.path.dirname(p)
            super()._mkdir(path)
            for d in reversed(missing):
                self.trace.append(("mkdir", d))

    def _pwritev(self, fd: int, buffers: Sequence[bytes | memoryview], offset: int) -> int:
        with self._lock:
            n = super()._pwritev(fd, buffers, offset)
            data = b"".join(bytes(b) for b in buffers)[:n]
            self.trace.append(("write", os.fstat(fd).st_ino, offset, data))
            return n

    def _fsync(self, fd: int) -> None:
        with self._lock:
            self.trace.append(("fsync", os.fstat(fd).st_ino))

    def _fsync_dir(self, fd: int) -> None:
        with self._lock:
            self.trace.append(("fsync_dir", os.readlink(f"/proc/self/fd/{fd}")))

    def _ftruncate(self, fd: int, length: int) -> None:
        with self._lock:
            super()._ftruncate(fd, length)
            self.trace.append(("truncate", os.fstat(fd).st_ino, length))

    def _rename(self, src: str, dst: str) -> None:
        with self._lock:
            super()._rename(src, dst)
            self.trace.append(("rename", os.path.abspath(src), os.path.abspath(dst)))

    def _unlink(self, path: str) -> None:
        with self._lock:
            super()._unlink(path)
            self.trace.append(("unlink", os.path.abspath(path)))

    def _index_open(self, path: str, options: dict) -> Any:
        with self._lock:
            self.index_dirs.add(os.path.abspath(path))
            return super()._index_open(path, options)

    def _index_commit(self, txn: Any) -> None:
        with self._lock:
            super()._index_commit(txn)
            self.trace.append(("index", {d: _read_dir(d) for d in sorted(self.index_dirs)}))

    def _advise(self, fd: int, offset: int, length: int) -> None:
        pass  # advice changes no byte; skipping it keeps the recorded run deterministic


def _read_dir(d: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        with open(os.path.join(d, name), "rb") as f:
            out[name] = f.read()
    return out


def snapshot_tree(root: str) -> tuple[dict[str, tuple[int, bytes]], set[str], dict[str, dict]]:
    """(files -> (inode, content), directories, index directories -> files) under ``root``, all
    taken as durable (the state an operation starts from, after a clean close)."""
    files: dict[str, tuple[int, bytes]] = {}
    dirs: set[str] = set()
    index: dict[str, dict] = {}
    if not os.path.isdir(root):
        return files, dirs, index
    for d, subdirs, names in os.walk(root):
        dirs.add(os.path.abspath(d))
        if os.path.basename(d) == "index":
            index[os.path.abspath(d)] = _read_dir(d)
            subdirs.clear()
            continue
        for n in names:
            p = os.path.abspath(os.path.join(d, n))
            with open(p, "rb") as f:
                files[p] = (os.stat(p).st_ino, f.read())
    return files, dirs, index


@dataclass
class CrashState:
    """One disk image a crash may leave: ``files`` path -> content, ``dirs``; ``index``: the index
    directories' files (None: the index is lost). ``point``: the trace position of the crash
    (entries before it were issued); ``how`` says which choice made it."""

    point: int
    how: str
    files: dict[str, bytes]
    dirs: set[str]
    index: dict[str, dict] | None
    #: the caller's marks issued before the crash (what it had been told)
    marks: list[tuple] = field(default_factory=list)

    def digest(self) -> str:
        h = hashlib.sha256()
        for p in sorted(self.files):
            h.update(p.encode() + b"\0" + hashlib.sha256(self.files[p]).digest())
        for d in sorted(self.dirs):
            h.update(b"D" + d.encode())
        h.update(repr(sorted((d, sorted(f)) for d, f in (self.index or {}).items())).encode()
                 if self.index is not None else b"no index")
        return h.hexdigest()

    def materialize(self, root: str, dest: str) -> None:
        """Write the image under ``dest`` (``root``'s paths rebased there)."""
        if os.path.exists(dest):
            shutil.rmtree(dest)

        def there(p: str) -> str:
            rel = os.path.relpath(p, root)
            return dest if rel == "." else os.path.join(dest, rel)

        if root not in self.dirs:
            return
        for d in sorted(self.dirs):
            os.makedirs(there(d), exist_ok=True)
        for p, data in self.files.items():
            with open(there(p), "wb") as f:
                f.write(data)
        for d, files in (self.index or {}).items():
            if d in self.dirs:
                for name, data in files.items():
                    with open(os.path.join(there(d), name), "wb") as f:
                        f.write(data)


@dataclass
class _File:
    content: bytearray
    durable: bytes
    pending: list[tuple] = field(default_factory=list)  # ("write", off, data) | ("truncate", n)


class Disk:
    """The trace replayed: durable and pending state of every file and directory (module doc)."""

    def __init__(self, ops: RecordingOps) -> None:
        self.root = ops.root
        self.trace = ops.trace
        self.files: dict[int, _File] = {}
        self.by_ino: dict[int, int] = {}
        self.names: dict[str, int] = {}
        self.dirs: set[str] = set(ops.initial_dirs)
        self.durable_names: dict[str, int] = {}
        self.durable_dirs: set[str] = set(ops.initial_dirs)
        self.pending_ns: dict[str, list[tuple]] = {}
        self.index: dict[str, dict] = dict(ops.initial_index)
        self.marks: list[tuple] = []
        for path, (ino, data) in ops.initial_files.items():
            fid = self._new_file(ino, data)
            self.names[path] = self.durable_names[path] = fid
        self.position = 0

    def _new_file(self, ino: int, data: bytes = b"") -> int:
        fid = len(self.files)
        self.files[fid] = _File(bytearray(data), bytes(data))
        self.by_ino[ino] = fid
        return fid

    # ---- replay ----------------------------------------------------------------------------------
    def advance(self, to: int) -> None:
        """Apply trace entries up to (not including) ``to``."""
        while self.position < to:
            self._apply(self.trace[self.position])
            self.position += 1

    def _apply(self, e: tuple) -> None:
        kind = e[0]
        if kind == "mark":
            self.marks.append(e[1:])
        elif kind == "create":
            _, path, ino = e
            fid = self._new_file(ino)
            self.names[path] = fid
            self.pending_ns.setdefault(os.path.dirname(path), []).append(("link", path, fid))
        elif kind == "mkdir":
            self.dirs.add(e[1])
            self.pending_ns.setdefault(os.path.dirname(e[1]), []).append(("mkdir", e[1]))
        elif kind == "write":
            _, ino, off, data = e
            f = self.files[self.by_ino[ino]]
            _write(f.content, off, data)
            f.pending.append(("write", off, data))
        elif kind == "truncate":
            _, ino, n = e
            f = self.files[self.by_ino[ino]]
            _truncate(f.content, n)
            f.pending.append(("truncate", n))
        elif kind == "fsync":
            f = self.files[self.by_ino[e[1]]]
            f.durable = bytes(f.content)
            f.pending.clear()
        elif kind == "fsync_dir":
            for op in self.pending_ns.pop(e[1], []):
                _apply_ns(op, self.durable_names, self.durable_dirs)
        elif kind == "rename":
            _, src, dst = e
            assert os.path.dirname(src) == os.path.dirname(dst), f"rename across directories: {e}"
            self.names[dst] = self.names.pop(src)
            self.pending_ns.setdefault(os.path.dirname(src), []).append(("rename", src, dst))
        elif kind == "unlink":
            self.names.pop(e[1])
            self.pending_ns.setdefault(os.path.dirname(e[1]), []).append(("unlink", e[1]))
        elif kind == "index":
            self.index = e[1]
        else:
            raise AssertionError(f"unknown trace entry {kind}")

    def crash_points(self) -> list[int]:
        """Trace positions just before each sync, and the end of the trace."""
        return [i for i, e in enumerate(self.trace) if e[0] in SYNC_KINDS] + [len(self.trace)]

    # ---- crash images ----------------------------------------------------------------------------
    def _pending_data(self) -> list[tuple[int, int]]:
        """(file id, index in its pending list) of every unsynced data operation."""
        return [(fid, k) for fid, f in self.files.items() for k in range(len(f.pending))]

    def _pending_ns(self) -> list[tuple[str, int]]:
        return [(d, k) for d, ops in self.pending_ns.items() for k in range(len(ops))]

    def image(self, how: str, keep_data: set[tuple[int, int]], keep_ns: set[tuple[str, int]],
              torn: dict[tuple[int, int], tuple[int, str]] | None = None,
              index: bool = True) -> CrashState:
        """The disk after a crash now that kept exactly ``keep_data`` / ``keep_ns`` of the pending
        operations; ``torn`` maps a kept write to (bytes of it that landed; what the rest of its
        range holds: "old" content, "zeros" or "garbage")."""
        torn = torn or {}
        names, dirs = dict(self.durable_names), set(self.durable_dirs)
        for d, ops in self.pending_ns.items():
            for k, op in enumerate(ops):
                if (d, k) in keep_ns:
                    _apply_ns(op, names, dirs)
        files = {}
        for path, fid in names.items():
            if not _reachable(path, dirs, self.root):
                continue
            f = self.files[fid]
            data = bytearray(f.durable)
            for k, op in enumerate(f.pending):
                if (fid, k) not in keep_data:
                    continue
                if op[0] == "truncate":
                    _truncate(data, op[1])
                    continue
                _, off, payload = op
                if (fid, k) in torn:
                    landed, rest = torn[(fid, k)]
                    n = len(payload) - landed
                    fill = {"old": b"", "zeros": bytes(n),
                            "garbage": random.Random(off ^ n).randbytes(n)}[rest]
                    _write(data, off, payload[:landed] + fill)
                else:
                    _write(data, off, payload)
            files[path] = bytes(data)
        under = {d for d in dirs if d == self.root or d.startswith(self.root + os.sep)}
        return CrashState(self.position, how, files, {d for d in under if _reachable(d, dirs, self.root)},
                          self.index if index else None, list(self.marks))

    def _tears(self, item: tuple[int, int], rng: random.Random) -> list[tuple[int, str]]:
        """Ways a pending write may be torn (A2, A3): cut at up to 3 of the sector boundaries inside
        its range and at one arbitrary byte (a sector in flight holds anything), the rest of its
        range old, zeros or garbage."""
        _, off, payload = self.files[item[0]].pending[item[1]]
        bounds = [b - off for b in range((off // SECTOR + 1) * SECTOR, off + len(payload), SECTOR)]
        cuts = sorted(set(rng.sample(bounds, min(3, len(bounds))) + [0]
                          + ([rng.randrange(1, len(payload))] if len(payload) > 1 else [])))
        return [(c, rng.choice(("old", "zeros", "garbage"))) for c in cuts]

    def crash_states(self, rng: random.Random, randoms: int = 12) -> Iterator[CrashState]:
        """The bounded set of images of a crash at the current position (module doc)."""
        data, ns = self._pending_data(), self._pending_ns()
        all_data, all_ns = set(data), set(ns)
        writes = [x for x in data if self.files[x[0]].pending[x[1]][0] == "write"]
        yield self.image("nothing pending kept", set(), set())
        yield self.image("everything kept (a SIGKILL)", all_data, all_ns)
        yield self.image("everything kept, index lost", all_data, all_ns, index=False)
        yield self.image("data kept, namespace operations lost", all_data, set())
        for item in data:
            yield self.image(f"all but data op {item}", all_data - {item}, all_ns)
            yield self.image(f"data ops before {item}", {x for x in data if x < item}, all_ns)
        for item in writes:
            for landed, rest in self._tears(item, rng):
                before = {x for x in data if x < item}
                yield self.image(f"write {item} torn at {landed}, then {rest}", before | {item},
                                 all_ns, {item: (landed, rest)})
        for k, item in enumerate(ns):
            yield self.image(f"all but namespace op {item}", all_data, all_ns - {item})
            yield self.image(f"namespace ops before {item}", all_data, set(ns[:k]))
        for r in range(randoms):
            kd = {x for x in data if rng.random() < 0.5}
            kn = {x for x in ns if rng.random() < 0.5}
            tear = {}
            kept_writes = sorted(x for x in writes if x in kd)
            if kept_writes and rng.random() < 0.5:
                x = rng.choice(kept_writes)
                tear[x] = rng.choice(self._tears(x, rng))
            yield self.image(f"random subset {r}", kd, kn, tear, index=rng.random() < 0.8)


def explore(ops: RecordingOps, seed: int, budget: int | None) -> Iterator[CrashState]:
    """Distinct crash images over every crash point of the recorded trace. With ``budget``, at
    most that many, spread evenly over the crash points (each point's images shuffled by the
    seed, the first ones of every point taken before the second ones of any)."""
    disk = Disk(ops)
    rng = random.Random(seed)
    per_point: list[list[CrashState]] = []
    for point in disk.crash_points():
        disk.advance(point)
        seen: set[str] = set()
        states = []
        for s in disk.crash_states(rng):
            d = s.digest()
            if d not in seen:
                seen.add(d)
                states.append(s)
        rng.shuffle(states)
        per_point.append(states)
    seen_all: set[str] = set()
    out = 0
    for rank in range(max((len(s) for s in per_point), default=0)):
        for states in per_point:
            if rank < len(states):
                s = states[rank]
                d = f"{s.digest()} {s.marks}"  # the same image later, with more acknowledged
                if d in seen_all:
                    continue
                seen_all.add(d)
                yield s
                out += 1
                if budget is not None and out >= budget:
                    return


# ---- small helpers -------------------------------------------------------------------------------

def _write(buf: bytearray, off: int, data: bytes) -> None:
    if len(buf) < off:
        buf.extend(bytes(off - len(buf)))
    buf[off:off + len(data)] = data


def _truncate(buf: bytearray, n: int) -> None:
    if len(buf) > n:
        del buf[n:]
    else:
        buf.extend(bytes(n - len(buf)))


def _apply_ns(op: tuple, names: dict[str, int], dirs: set[str]) -> None:
    kind = op[0]
    if kind == "link":
        names[op[1]] = op[2]
    elif kind == "mkdir":
        dirs.add(op[1])
    elif kind == "rename":
        if op[1] in names:  # the creation it renames may itself be lost
            names[op[2]] = names.pop(op[1])
    elif kind == "unlink":
        names.pop(op[1], None)


def _reachable(path: str, dirs: set[str], root: str) -> bool:
    """Whether every directory from the top of ``root`` down to ``path``'s parent exists."""
    d = os.path.dirname(path)
    top = os.path.dirname(root)
    while d != top and len(d) >= len(top):
        if d not in dirs:
            return False
        d = os.path.dirname(d)
    return True
