"""Crash consistency: SIGKILL a saving (or collecting) process at random moments and prove that

* fsck of the crashed store shows nothing but an uncommitted tail,
* the next writer open recovers automatically (fsck clean, no notes left),
* nothing whose save() returned is lost, and nothing uncommitted appears,
* every committed iteration loads bit-exact against the reference function,
* saving continues after the crash,

and that readers running beside a writer never see a partial or missing committed iteration.

The victims are forked from a fork server (tests/_crashkit.py) that imported ckptstore once, so a
trial costs a fork, not an interpreter start. Trial count: CKPTSTORE_TRIALS (default 60; at least
5/6 of them, and never fewer than 50 at the default, are save-loop kills, the rest kill gc).
Seed: CKPTSTORE_SEED.
"""

from __future__ import annotations

import errno
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from typing import Callable
from collections import Counter
from pathlib import Path

import pytest

import ckptstore
from ckptstore.ops.fsck import check
from ckptstore.storage.fileops import FileOps
from ckptstore.storage.layout import Layout

from _crashkit import CHUNK_SIZE, SEGMENT_SIZE, read_journal, state_bytes, state_for

HERE = Path(__file__).resolve().parent
TRIALS = int(os.environ.get("CKPTSTORE_TRIALS", "60"))
GC_TRIALS = TRIALS // 6
SAVE_TRIALS = TRIALS - GC_TRIALS
SEED = int(os.environ.get("CKPTSTORE_SEED", "1337"))
#: Save-loop trials share a store for this many trials, then start a fresh one (bounds the cost of
#: verifying every iteration after every crash; the first trial of each store crashes its creation).
TRIALS_PER_STORE = 10
TAIL_NOTE = "uncommitted tail"


class ForkServer:
    """Client of ``python tests/_crashkit.py``: one forked victim per :meth:`run`."""

    def __init__(self, workdir: Path) -> None:
        self.stderr_path = workdir / "forkserver.stderr"
        self._stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen([sys.executable, str(HERE / "_crashkit.py")], cwd=str(HERE),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, bufsize=0)
        self._buf = b""

    def stderr_tail(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_bytes()[-3000:].decode(errors="replace")

    def _read(self, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                data = os.read(self.proc.stdout.fileno(), 4096)
                if not data:
                    raise RuntimeError(f"fork server died:\n{self.stderr_tail()}")
                self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def start(self, cmd: dict) -> int:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        msg = self._read(60)
        assert msg is not None, f"fork server did not fork:\n{self.stderr_tail()}"
        return msg["pid"]

    def wait(self, pid: int, timeout: float = 60) -> dict:
        """The victim's end: {"signal": 9, ...} when killed. A victim still alive after
        ``timeout`` is killed (and reported with timed_out)."""
        msg = self._read(timeout)
        if msg is None:
            os.kill(pid, signal.SIGKILL)
            msg = self._read(30)
            assert msg is not None, "victim survived SIGKILL"
            msg["timed_out"] = True
        assert msg["pid"] == pid
        return msg

    def kill_after(self, pid: int, delay: float) -> dict:
        """SIGKILL the victim after ``delay`` seconds (it never exits by itself before that:
        delay-mode victims idle until killed, so the pid cannot have been reaped)."""
        msg = self._read(delay)
        if msg is None:
            os.kill(pid, signal.SIGKILL)
            msg = self._read(60)
        assert msg is not None and msg["pid"] == pid
        return msg

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._stderr.close()


@pytest.fixture(scope="module")
def forkserver(tmp_path_factory):
    server = ForkServer(tmp_path_factory.mktemp("forkserver"))
    yield server
    server.close()


# ---- what a journal says ---------------------------------------------------------------------

class Journal:
    """What the victim reported, in order (each line written only after the fact it states)."""

    def __init__(self, path: Path) -> None:
        self.events = read_journal(str(path))
        self.saved: list[int] = []
        self.in_flight: int | None = None
        self.gc_done_removed: set[int] = set()
        self.gc_in_flight: dict | None = None
        self.opened = False
        self.last = self.events[-1][1] if self.events else None
        for _, event, arg in self.events:
            if event == "open":
                self.opened = True
            elif event == "begin":
                self.in_flight = int(arg)
            elif event == "saved":
                assert self.in_flight == int(arg)
                self.saved.append(int(arg))
                self.in_flight = None
            elif event == "gc-begin":
                self.gc_in_flight = json.loads(arg)
            elif event == "gc-done":
                assert self.gc_in_flight is not None
                self.gc_done_removed |= set(self.gc_in_flight["remove"])
                self.gc_in_flight = None

    def timing(self) -> tuple[float | None, list[float]]:
        """(seconds from child start to open, seconds per completed save)."""
        t = {e: ts for ts, e, _ in reversed(self.events)}
        open_s = t["open"] - t["start"] if "open" in t and "start" in t else None
        saves, begun = [], None
        for ts, event, _ in self.events:
            if event == "begin":
                begun = ts
            elif event == "saved" and begun is not None:
                saves.append(ts - begun)
        return open_s, saves


def verify_after_crash(path: Path, before: set[int], journal: Journal, assert_same, where: str,
                       stats: Counter) -> set[int]:
    """All post-crash checks. ``before``: iterations present when the victim started. Returns the
    iterations present afterwards (including one new save made here)."""
    saved = set(journal.saved)
    in_flight_remove = set(journal.gc_in_flight["remove"]) if journal.gc_in_flight else set()
    must = (before | saved) - journal.gc_done_removed - in_flight_remove
    may = must | in_flight_remove | ({journal.in_flight} if journal.in_flight is not None else set())
    layout = Layout(str(path))

    if not os.path.exists(layout.store_file):  # killed while creating the store
        assert not before and not saved, f"{where}: STORE file vanished after saves returned"
        stats["killed before the store existed"] += 1
    else:
        report = check(path)
        assert not report.damage, f"{where}: fsck of the crashed store found damage: {report.lines()}"
        assert not report.damaged_iterations, \
            f"{where}: fsck of the crashed store found damaged iterations: {report.lines()}"
        assert not report.lost_iterations, \
            f"{where}: fsck of the crashed store names lost iterations: {report.lines()}"
        present = set(report.iterations)
        assert must <= present, (f"{where}: committed iterations lost by the crash: "
                                 f"{sorted(must - present)} (fsck lists {sorted(present)})")
        assert present <= may, (f"{where}: iterations present that were never saved or were "
                                f"already collected: {sorted(present - may)}")
        if any(TAIL_NOTE in n for n in report.notes):
            stats["crash left an uncommitted tail"] += 1
        if journal.in_flight is not None and journal.in_flight in present:
            stats["commit durable but save() had not returned"] += 1
        if journal.gc_in_flight is not None:
            stats["kill inside gc"] += 1
            if in_flight_remove and in_flight_remove <= present:
                stats["gc killed before its commit point"] += 1
            elif in_flight_remove and not in_flight_remove & present:
                stats["gc killed after its commit point"] += 1
        if report.notes and any("obsolete" in n for n in report.notes):
            stats["crash left obsolete segments"] += 1

    # Automatic recovery by the next writer open, then one more save.
    with ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=SEGMENT_SIZE) as w:
        present = set(w.iterations())
        assert must <= present <= may, (f"{where}: after recovery {sorted(present)}; must hold "
                                        f"{sorted(must)}, may hold {sorted(may)}")
        assert layout.list_gc_temps() == [], f"{where}: gc temp files survive recovery"
        assert w.log.obsolete_segments() == [], f"{where}: obsolete segments survive recovery"
        nxt = (w.latest() or 0) + 1
        w.save(nxt, state_for(nxt))
        present.add(nxt)
    report = check(path)
    assert report.clean and not report.notes, f"{where}: fsck after recovery: {report.lines()}"
    assert set(report.iterations) == present, f"{where}: fsck after recovery lists {report.iterations}"

    with ckptstore.open(path, "r") as r:
        assert r.iterations() == sorted(present)
        for it in sorted(present):
            assert_same(state_for(it), r.load(it), f"{where}: iteration {it}")
    return present


# ---- save loop ---------------------------------------------------------------------------------

def _save_trial_plan(rng: random.Random, trial: int, est_open: float, est_save: float,
                     per_save_bytes: int) -> tuple[dict, float | None, str]:
    """(command extras, delay for an external kill or None, mode name). Every other triple of
    trials appends through O_DIRECT (fewer, larger writes: a save's records reach the file at its
    syncs, so the write to kill is picked among fewer)."""
    mode = ("delay", "progress", "fileops")[trial % 3]
    direct_io = (trial // 3) % 2 == 1
    extra, delay, name = _save_trial_kill(rng, mode, direct_io, est_open, est_save, per_save_bytes)
    return {**extra, "direct_io": direct_io}, delay, f"{name}{'/direct' if direct_io else ''}"


def _save_trial_kill(rng: random.Random, mode: str, direct_io: bool, est_open: float,
                     est_save: float, per_save_bytes: int) -> tuple[dict, float | None, str]:
    if mode == "delay":
        saves = rng.randint(1, 6)
        return ({"max_saves": saves, "idle": True},
                rng.uniform(0, est_open + saves * est_save), "delay")
    if mode == "progress":
        return {"kill_at_bytes": rng.randint(1, 5 * per_save_bytes)}, None, "progress"
    target = rng.choices(["write", "fsync", "any"], weights=[55, 25, 20])[0]
    nth = rng.randint(1, ({"write": 8, "fsync": 12, "any": 20} if direct_io else
                          {"write": 45, "fsync": 12, "any": 60})[target])
    kill = {"target": target, "nth": nth, "tear": rng.random(), "after": rng.random() < 0.5}
    return {"kill": kill}, None, f"fileops:{target}"


@pytest.mark.slow
def test_sigkill_during_save_loop(tmp_path, forkserver, assert_same):
    rng = random.Random(SEED)
    per_save = state_bytes(state_for(1))
    est_open, est_save = 0.05, 0.01
    stats: Counter = Counter()
    killed = 0
    present: set[int] = set()
    path = tmp_path / "store-0"
    t0 = time.monotonic()
    for trial in range(SAVE_TRIALS):
        if trial % TRIALS_PER_STORE == 0:
            path = tmp_path / f"store-{trial // TRIALS_PER_STORE}"
            present = set()
        journal_path = tmp_path / f"journal-{trial}"
        extra, delay, mode = _save_trial_plan(rng, trial, est_open, est_save, per_save)
        cmd = {"mode": "save", "path": str(path), "journal": str(journal_path), **extra}
        where = f"save trial {trial} (seed {SEED}, {mode}, {extra})"
        pid = forkserver.start(cmd)
        end = forkserver.kill_after(pid, delay) if delay is not None else forkserver.wait(pid)
        assert end.get("exit") != 3, f"{where}: victim failed:\n{forkserver.stderr_tail()}"
        assert end["signal"] == signal.SIGKILL, f"{where}: victim was not killed: {end}"
        killed += 1
        journal = Journal(journal_path)
        stats[f"mode {mode.split(':')[0]}{'/direct' if mode.endswith('/direct') else ''}"] += 1
        if not journal.opened:
            stats["kill during open/recovery"] += 1
        elif journal.in_flight is not None:
            stats["kill inside save()"] += 1
        elif journal.last == "closed":
            stats["kill after the loop (idle)"] += 1
        open_s, saves = journal.timing()
        if open_s is not None:
            est_open = 0.7 * est_open + 0.3 * open_s
        if saves:
            est_save = 0.7 * est_save + 0.3 * (sum(saves) / len(saves))
        present = verify_after_crash(path, present, journal, assert_same, where, stats)
    summary = f"{killed} SIGKILLs in {time.monotonic() - t0:.1f} s: {dict(stats)}"
    print(summary)
    assert killed == SAVE_TRIALS, summary
    # The kills must really land inside saves, and mid-record: not just between checkpoints.
    assert stats["kill inside save()"] >= SAVE_TRIALS // 2, summary
    assert stats["crash left an uncommitted tail"] >= SAVE_TRIALS // 4, summary


# ---- gc loop -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_sigkill_during_gc(tmp_path, forkserver, assert_same):
    if GC_TRIALS == 0:
        pytest.skip("CKPTSTORE_TRIALS too small for gc trials")
    rng = random.Random(SEED + 1)
    stats: Counter = Counter()
    path = tmp_path / "store"
    present: set[int] = set()
    killed = 0
    t0 = time.monotonic()
    for trial in range(GC_TRIALS):
        journal_path = tmp_path / f"journal-{trial}"
        cmd = {"mode": "gc", "path": str(path), "journal": str(journal_path), "gc_every": 3,
               "keep_last": 2, "keep_every": 4}
        if trial % 4 == 3:  # a timed kill anywhere in the save/gc loop
            cmd.update(max_saves=rng.randint(3, 12), idle=True)
            delay = rng.uniform(0, 0.05 + cmd["max_saves"] * 0.012)
            mode = "delay"
        else:
            target = ("rename", "unlink", "fsync", "write", "any")[trial % 5]
            nth = rng.randint(1, {"rename": 4, "unlink": 5, "fsync": 10, "write": 60, "any": 80}[target])
            cmd["kill"] = {"target": target, "nth": nth, "tear": rng.random(),
                           "after": rng.random() < 0.5, "armed": False}
            delay, mode = None, f"fileops:{target}"
        where = f"gc trial {trial} (seed {SEED}, {mode}, {cmd.get('kill') or cmd.get('max_saves')})"
        pid = forkserver.start(cmd)
        end = forkserver.kill_after(pid, delay) if delay is not None else forkserver.wait(pid)
        assert end.get("exit") != 3, f"{where}: victim failed:\n{forkserver.stderr_tail()}"
        assert end["signal"] == signal.SIGKILL, f"{where}: victim was not killed: {end}"
        killed += 1
        journal = Journal(journal_path)
        stats[f"mode {mode.split(':')[0]}{'/direct' if mode.endswith('/direct') else ''}"] += 1
        present = verify_after_crash(path, present, journal, assert_same, where, stats)
    summary = f"{killed} SIGKILLs in {time.monotonic() - t0:.1f} s: {dict(stats)}"
    print(summary)
    assert killed == GC_TRIALS, summary
    # Injected kills are armed only inside gc(): every one of those trials must have died there.
    assert stats["kill inside gc"] >= stats["mode fileops"], summary


class _PowerCutOps(FileOps):
    """Power loss during gc's publish step (format.md §17 G5, §2 A4): once ``armed``, the
    ``cut``-th rename or directory fsync fails and every later write-side call fails too (the
    machine is off). Records the renames into segments/ that no fsync of segments/ has made
    durable yet: after a power loss the file system may keep any subset of them."""

    def __init__(self, segment_dir: str, cut: int) -> None:
        self.segment_dir, self.cut = segment_dir, cut
        self.armed = self.dead = False
        self.calls = 0
        self.unsynced: list[tuple[str, str]] = []
        self._dir: str | None = None

    def _step(self) -> None:
        if self.dead:
            raise OSError(errno.EIO, "power is off")
        if self.armed:
            self.calls += 1
            if self.calls == self.cut:
                self.dead = True
                raise OSError(errno.EIO, "power cut (simulated)")

    def _rename(self, src, dst):
        self._step()
        super()._rename(src, dst)
        if os.path.dirname(dst) == self.segment_dir:
            self.unsynced.append((src, dst))

    def fsync_dir(self, path):
        self._dir = path
        super().fsync_dir(path)

    def _fsync_dir(self, fd):
        self._step()
        super()._fsync_dir(fd)
        if self._dir == self.segment_dir:
            self.unsynced.clear()

    def _pwritev(self, fd, buffers, offset):
        if self.dead:
            raise OSError(errno.EIO, "power is off")
        return super()._pwritev(fd, buffers, offset)

    def _fsync(self, fd):
        if self.dead:
            raise OSError(errno.EIO, "power is off")
        return super()._fsync(fd)

    def _unlink(self, path):
        if self.dead:
            raise OSError(errno.EIO, "power is off")
        return super()._unlink(path)

    def _ftruncate(self, fd, length):
        if self.dead:
            raise OSError(errno.EIO, "power is off")
        return super()._ftruncate(fd, length)


def test_power_loss_during_gc_publish_keeps_a_prefix_of_copies(tmp_path, assert_same):
    """gc publishes 4 copy segments and a marker. A power cut at every rename and directory fsync
    of gc, with every subset of the renames not yet made durable lost: the live segments never
    have a gap (G5), fsck is clean, every iteration loads bit-exact (all of them before the gc
    commit point, the kept ones after it), and the next writer open recovers."""
    import itertools
    import shutil

    import numpy as np

    states = {i: {"x": np.random.default_rng(i).standard_normal(4000)} for i in range(1, 7)}
    base = tmp_path / "base"
    with ckptstore.open(base, "a", chunk_size=CHUNK_SIZE, segment_size=40_000) as w:
        for i, st in states.items():
            w.save(i, st)
    assert Layout(str(base)).list_segments() == [1, 2, 3, 4, 5, 6]
    kept = [3, 4, 5, 6]

    def run_gc(path: Path, cut: int) -> _PowerCutOps:
        ops = _PowerCutOps(Layout(str(path)).segment_dir, cut)
        w = ckptstore.open(path, "a", segment_size=40_000, file_ops=ops)
        ops.armed = True
        try:
            w.gc(keep_last=len(kept))
        except ckptstore.StoreIOError:
            assert ops.dead
        finally:
            ops.dead = False  # close() only releases the lock; the lost renames are undone below
            ops.armed = False
            w.close()
        return ops

    full = tmp_path / "full"
    shutil.copytree(base, full)
    calls = run_gc(full, cut=0).calls
    assert calls >= 6  # 4 copy renames, 1 marker rename, their directory fsyncs
    trials = 0
    for cut in range(1, calls + 1):
        run = tmp_path / f"cut{cut}"
        shutil.copytree(base, run)
        lost_candidates = run_gc(run, cut).unsynced
        for n in range(len(lost_candidates) + 1):
            for lost in itertools.combinations(lost_candidates, n):
                store = tmp_path / f"cut{cut}-{trials}"
                shutil.copytree(run, store)
                for src, dst in lost:
                    os.rename(dst.replace(str(run), str(store)), src.replace(str(run), str(store)))
                where = f"power cut at gc call {cut}, renames lost: {lost}"
                layout = Layout(str(store))
                segs = layout.list_segments()
                assert segs == list(range(segs[0], segs[-1] + 1)), f"{where}: gap in {segs}"
                report = check(store)
                committed = report.iterations
                assert report.clean, f"{where}: {report.lines()}"
                assert committed in (sorted(states), kept), f"{where}: {committed}"
                with ckptstore.open(store, "r") as r:
                    for i in committed:
                        assert_same(states[i], r.load(i))
                with ckptstore.open(store, "a") as w:
                    assert w.iterations() == committed
                after = check(store)
                assert after.clean and not after.notes, f"{where}: {after.lines()}"
                trials += 1
                shutil.rmtree(store)
        shutil.rmtree(run)
    assert trials >= calls


# ---- readers beside a writer ---------------------------------------------------------------------

def _read_while_writing(tmp_path, forkserver, assert_same, seconds: float, **writer) -> Counter:
    path = tmp_path / "store"
    with ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=SEGMENT_SIZE) as w:
        w.save(1, state_for(1))
    stop = tmp_path / "stop"
    cmd = {"mode": "writer", "path": str(path), "journal": str(tmp_path / "journal"),
           "stop": str(stop), "max_saves": 100_000, **writer}
    pid = forkserver.start(cmd)
    seen: Counter = Counter()
    latest_seen: set[int] = set()
    long_lived = ckptstore.open(path, "r")
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            # a reader racing the writer (and its gc) must never fail: no error is tolerated
            with ckptstore.open(path, "r") as r:  # a fresh reader
                it = r.latest()
                assert it is not None
                assert_same(state_for(it), r.load(it), f"fresh reader, iteration {it}")
                its = r.iterations()
                assert its[-1] >= it
                seen["fresh reader loads"] += 1
                latest_seen.add(it)
            it = long_lived.latest()  # a reader that follows the writer (refresh)
            assert_same(state_for(it), long_lived.load(it), f"long-lived reader, iteration {it}")
            seen["long-lived reader loads"] += 1
            latest_seen.add(it)
            if not writer.get("gc_every"):
                its = long_lived.iterations()
                assert its == list(range(1, its[-1] + 1)), \
                    f"a committed iteration is missing: {its}"
    finally:
        long_lived.close()
        stop.touch()
        end = forkserver.wait(pid)
    assert end.get("exit") == 0, f"writer failed: {end}\n{forkserver.stderr_tail()}"
    seen["distinct latest iterations seen"] = len(latest_seen)
    assert len(latest_seen) >= 5, f"the writer did not make progress while reading: {dict(seen)}"
    report = check(path)
    assert report.clean, report.lines()
    return seen


def test_readers_during_writer(tmp_path, forkserver, assert_same):
    seen = _read_while_writing(tmp_path, forkserver, assert_same, 3.0)
    print(dict(seen))


def test_readers_during_writer_with_gc(tmp_path, forkserver, assert_same):
    seen = _read_while_writing(tmp_path, forkserver, assert_same, 3.0, gc_every=4, keep_last=3)
    print(dict(seen))


# ---- a crash inside Log.roll ---------------------------------------------------------------------

class _DieWhileCreatingSegment(FileOps):
    """Crash (nothing more reaches the disk) while the header of a new segment is being written,
    after ``torn_bytes`` of its 80 bytes: what SIGKILL between SegmentWriter.create's
    open(O_CREAT) and its pwritev leaves behind."""

    def __init__(self, torn_bytes: int) -> None:
        self.torn_bytes, self.armed, self.dead = torn_bytes, False, False

    def _check(self) -> None:
        if self.dead:
            raise OSError(errno.EIO, "the process is dead (simulated crash)")

    def _pwritev(self, fd, buffers, offset):
        self._check()
        data = b"".join(bytes(b) for b in buffers)
        if self.armed and offset == 0 and data[4] == 1:  # a SEGMENT_HEADER record
            if self.torn_bytes:
                os.pwrite(fd, data[:self.torn_bytes], 0)
            self.dead = True
            self._check()
        return super()._pwritev(fd, buffers, offset)

    def _fsync(self, fd):
        self._check()
        super()._fsync(fd)

    def _ftruncate(self, fd, length):
        self._check()
        super()._ftruncate(fd, length)

    def _rename(self, src, dst):
        self._check()
        super()._rename(src, dst)

    def _unlink(self, path):
        self._check()
        super()._unlink(path)


@pytest.mark.parametrize("torn_bytes", [0, 14, 40])
@pytest.mark.parametrize("segment", ["after a commit", "after a tail", "first of the store"])
def test_crash_while_creating_a_segment(tmp_path, torn_bytes, segment, assert_same):
    """A stub segment (0..79 bytes: its header torn or never written) is an uncommitted tail, not
    damage; recovery removes it (it once stayed in the middle of the log forever, or, as the
    store's first segment, received records after a header that was never written)."""
    path = tmp_path / "store"
    ops = _DieWhileCreatingSegment(torn_bytes)
    if segment == "first of the store":
        ops.armed = True
        with pytest.raises(ckptstore.StoreIOError):
            ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=SEGMENT_SIZE, file_ops=ops)
        before, stub = [], 1
    else:
        with ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=SEGMENT_SIZE) as w:
            w.save(1, state_for(1))
            w.save(2, state_for(2))
        end = os.path.getsize(Layout(str(path)).segment_path(1))
        # Iteration 3's first record does not fit (a roll right after a commit), or its second.
        limit = end + 10 if segment == "after a commit" else end + 20_000
        w = ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=limit, file_ops=ops)
        ops.armed = True
        with pytest.raises(ckptstore.StoreIOError):
            w.save(3, state_for(3))
        w.close()
        before, stub = [1, 2], 2
    assert Layout(str(path)).list_segments()[-1] == stub
    assert os.path.getsize(Layout(str(path)).segment_path(stub)) == torn_bytes

    report = check(path)
    assert report.iterations == before
    assert not report.damage and not report.damaged_iterations, \
        f"an ordinary crash is reported as damage: {report.lines()}"
    with ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=SEGMENT_SIZE) as w:
        assert w.iterations() == before
        for it in range(len(before) + 1, 12):  # several rolls
            w.save(it, state_for(it))
    report = check(path)
    assert report.clean and not report.notes, f"recovery left damage behind: {report.lines()}"
    with ckptstore.open(path, "r") as r:
        assert r.iterations() == list(range(1, 12))
        for it in r.iterations():
            assert_same(state_for(it), r.load(it))


# ---- a crash tearing a commit, a crash while recovery cuts a tail --------------------------------

def _dies_by_sigkill(fn) -> None:
    """Run ``fn`` in a forked child, which must end by SIGKILL (the crash), not by returning."""
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        except BaseException:  # noqa: BLE001 - report, then exit with a code the parent rejects
            import traceback

            traceback.print_exc()
        os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, \
        f"the victim was not killed: status {status}"


def _small(i: int) -> dict:
    import numpy as np

    return {"x": np.random.default_rng(i).standard_normal(4000)}  # 32000 B: 2 chunks


def _commit_record_at(data: bytes, skip: int = 0) -> int | None:
    """Offset in ``data`` of the first COMMIT record's (valid) header at or after ``skip``."""
    from ckptstore.format import records as rec

    i = data.find(rec.MAGIC + bytes([rec.RecordType.COMMIT]), skip)
    while i != -1:
        try:
            rec.decode_header(data[i:i + rec.HEADER_SIZE])
            return i
        except ckptstore.FormatError:
            i = data.find(rec.MAGIC + bytes([rec.RecordType.COMMIT]), i + 1)
    return None


@pytest.mark.parametrize("direct_io", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("torn", [0, 1, 23, 24, 60, 120, 127])
def test_sigkill_tearing_a_commit_record(tmp_path, torn, direct_io, assert_same):
    """SIGKILL while the COMMIT record is being written, after ``torn`` of its 128 bytes: a torn
    commit is an uncommitted tail -- never damage, never a lost iteration, never quarantined
    (only a complete commit with a damaged header is, test_corruption). With O_DIRECT appends the
    commit is written with the records staged before it, and a tear inside an O_DIRECT write
    falls on a block boundary (_crashkit.torn_write)."""
    from _crashkit import die, torn_write

    class KillInCommit(FileOps):
        def _pwritev(self, fd, buffers, offset):
            data = b"".join(bytes(b) for b in buffers)
            # an O_DIRECT write rewrites its first block whole: skip the bytes already in the file
            at = _commit_record_at(data, max(0, os.fstat(fd).st_size - offset))
            if at is not None:
                torn_write(fd, data, at + torn, offset)
                die()
            return super()._pwritev(fd, buffers, offset)

    path = tmp_path / "store"
    with ckptstore.open(path, "a", chunk_size=CHUNK_SIZE) as w:
        w.save(1, _small(1))
        w.save(2, _small(2))

    def victim():
        s = ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, file_ops=KillInCommit(),
                           direct_io=direct_io)
        s.save(3, _small(3))

    _dies_by_sigkill(victim)
    report = check(path)
    assert report.iterations == [1, 2], report.lines()
    assert not report.damage and not report.damaged_iterations and not report.lost_iterations, \
        f"a torn commit is reported as damage: {report.lines()}"
    assert report.clean and any(TAIL_NOTE in n for n in report.notes), report.lines()
    layout = Layout(str(path))
    with ckptstore.open(path, "a", chunk_size=CHUNK_SIZE) as w:
        assert w.iterations() == [1, 2]
        w.save(3, _small(3))
    assert not os.path.exists(layout.quarantine_dir), "a torn commit was quarantined"
    report = check(path)
    assert report.clean and not report.notes, report.lines()
    with ckptstore.open(path, "r") as r:
        for i in (1, 2, 3):
            assert_same(_small(i), r.load(i))


@pytest.mark.parametrize("nth,after", [(1, False), (1, True), (2, True)])
def test_sigkill_while_cutting_a_tail_of_several_segments(tmp_path, nth, after, assert_same):
    """SIGKILL during the writer open that deletes a tail spanning several segments: segments go
    highest first, so what is left is still consecutive -- an uncommitted tail, never a missing
    segment (which fsck reports as damage)."""
    from _crashkit import FreezeOps, KillOps

    path = tmp_path / "store"
    with ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=40_000) as w:
        w.save(1, _small(1))
    w = ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=40_000, file_ops=FreezeOps(10))
    with pytest.raises(ckptstore.StoreIOError):
        w.save(2, {"a": _small(2)["x"], "b": _small(3)["x"], "c": _small(4)["x"]})
    try:
        w.close()
    except ckptstore.StoreIOError:
        pass
    layout = Layout(str(path))
    assert layout.list_segments() == [1, 2, 3, 4], "the crashed save did not span 3 segments"

    def victim():
        ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=40_000,
                       file_ops=KillOps("unlink", nth, after=after))

    _dies_by_sigkill(victim)
    left = layout.list_segments()
    assert left == list(range(1, 4 - (nth - 1) - after + 1)), left  # 4, 3, 2 down first
    report = check(path)
    assert report.iterations == [1], report.lines()
    assert not report.damage and not report.lost_iterations, \
        f"an interrupted tail cut is reported as damage: {report.lines()}"
    with ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=40_000) as w:
        w.save(2, _small(2))
    report = check(path)
    assert report.clean and not report.notes, report.lines()
    with ckptstore.open(path, "r") as r:
        assert r.iterations() == [1, 2]
        assert_same(_small(2), r.load(2))


# ---- a reader's refresh racing a gc ------------------------------------------------------------

class _RacyLayout(Layout):
    """A Layout that runs ``plan = (n, fn, before)`` at its n-th segment listing: ``fn`` (a gc in
    the writer) runs just before that listing is taken, or just after it is taken and before the
    caller uses it. Deterministic versions of a reader racing a writer's gc."""

    plan: tuple | None = None
    calls = 0

    def list_segments(self) -> list[int]:
        cls = type(self)
        cls.calls += 1
        due = cls.plan is not None and cls.calls == cls.plan[0]
        if due and cls.plan[2]:
            cls.plan[1]()
        listing = super().list_segments()
        if due and not cls.plan[2]:
            cls.plan[1]()
        return listing


def _listing_race(n: int, before: bool):
    """Stage a gc at the reader's n-th directory listing (see _RacyLayout)."""
    def stage(r, gc) -> Callable[[], bool]:
        r.log.layout = _RacyLayout(r.path)
        _RacyLayout.calls, _RacyLayout.plan = 0, (n, gc, before)
        return lambda: _RacyLayout.calls >= n
    return stage


def _gc_after_deciding(r, gc) -> Callable[[], bool]:
    """Stage a gc right after the reader's first refresh_segments returns: the reader has listed
    the segments and decides from that listing whether its index is still valid, then scans."""
    real, calls = r.log.refresh_segments, []

    def refresh_segments() -> list[int]:
        live = real()
        calls.append(len(live))
        if len(calls) == 1:
            gc()
        return live

    r.log.refresh_segments = refresh_segments
    return lambda: len(calls) >= 1


def _reader_behind_a_gc(path: Path, assert_same, stage) -> None:
    w = ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=SEGMENT_SIZE)
    try:
        for it in range(1, 7):
            w.save(it, state_for(it))
        r = ckptstore.open(path, "r")
        try:
            assert r.iterations() == list(range(1, 7))
            segs = Layout(str(path)).list_segments()
            while Layout(str(path)).list_segments() == segs:  # a segment the reader has not seen
                it += 1
                w.save(it, state_for(it))
            staged = stage(r, lambda: w.gc(keep_last=2))
            latest = r.latest()  # the gc runs inside this call
            assert staged(), "the race was not staged"
            assert latest == it
            assert r.iterations() == [it - 1, it], "the reader lists removed iterations"
            for i in r.iterations():
                assert_same(state_for(i), r.load(i))
        finally:
            r.close()
    finally:
        w.close()


def test_reader_listing_races_gc(tmp_path, assert_same):
    """A listing names segments a gc deletes before their headers are read (was: StoreIOError
    ENOENT escaping Log.refresh_segments, outside the reader's retry)."""
    _reader_behind_a_gc(tmp_path / "store", assert_same, _listing_race(1, before=False))


def test_reader_refresh_straddles_gc(tmp_path, assert_same):
    """A gc completes between the listing a reader's refresh decides on and its scan (was: the
    scan listed again and replayed the gc's segments into the uncleared index, so removed
    iterations stayed listed)."""
    _reader_behind_a_gc(tmp_path / "store", assert_same, _gc_after_deciding)


@pytest.mark.slow
def test_soak_tool_runs_a_few_kills(tmp_path):
    """tools/soak.py (the long SIGKILL soak of a training loop, run outside CI) stays working: a
    few kills, each verified (fsck, the newest durable iteration present, every iteration in the
    store bit-exact against an uninterrupted run)."""
    tool = Path(__file__).resolve().parent.parent / "tools" / "soak.py"
    out = subprocess.run([sys.executable, str(tool), "--kills", "4", "--dir", str(tmp_path / "soak"),
                          "--max-delay", "1.0"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "soak: 4 SIGKILLs, zero failures" in out.stdout
