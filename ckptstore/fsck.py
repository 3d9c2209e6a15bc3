"""fsck: verify every byte of a store and, with ``repair``, restore it to a clean state.

Verification replays the whole log with every payload checked (chunks included), then walks every
committed checkpoint: manifest -> trees -> chunk addresses. It reports

* damage: corrupt or torn records, each with file, offset and length;
* damaged iterations: committed checkpoints that cannot be read back intact, with the tensor and
  the missing or corrupt chunk (and where that chunk's damaged record is, when it can be found);
* notes: an uncommitted tail (left by a crash; the next writer open cuts it), a stale index,
  quarantined tails, obsolete segments of an interrupted gc.

Repair = open as writer (the automatic recovery: finish gc, cut or quarantine the tail), then
rebuild the index from a fully verified replay, so every chunk and tree it names is intact.
Repair never deletes a committed checkpoint, intact or not: damaged ones are reported, kept, and
still load partially with ``keys=``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from .errors import DamagedCheckpointError, FormatError
from .storage.index import Index, MemoryIndex
from .storage.log import Damage, Log, ReplayReport
from .reader import read_manifest, read_tree
from .store import Store


@dataclass
class FsckReport:
    path: str
    segments: int = 0
    bytes_scanned: int = 0
    iterations: list[int] = field(default_factory=list)
    damage: list[Damage] = field(default_factory=list)
    damaged_iterations: dict[int, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    repairs: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """True when no committed data is damaged and no corrupt record remains in the log."""
        return not self.damage and not self.damaged_iterations

    def lines(self) -> list[str]:
        out = [f"store {self.path}: {len(self.iterations)} committed iterations, {self.segments} "
               f"segments, {self.bytes_scanned} bytes verified"]
        out += [f"DAMAGE {d}" for d in self.damage]
        for it, problems in sorted(self.damaged_iterations.items()):
            out += [f"DAMAGED iteration {it}: {p}" for p in problems]
        out += [f"note: {n}" for n in self.notes]
        out += [f"repaired: {r}" for r in self.repairs]
        out.append("clean" if self.clean else
                   f"NOT CLEAN: {len(self.damage)} damaged records, "
                   f"{len(self.damaged_iterations)} damaged iterations")
        return out


def check(path: str | os.PathLike, *, repair: bool = False,
          progress: Callable[[int], None] | None = None) -> FsckReport:
    """Verify the store at ``path``; with ``repair`` also recover it (needs the writer lock)."""
    path = os.fspath(path)
    report = FsckReport(path)
    if repair:
        with Store(path, "a") as store:
            _note_recovery(store.last_replay, report)
            _verify(store.log, report, progress, rebuild=store.index)
            report.repairs.append("index rebuilt from a fully verified replay of the log")
        return report
    with Store(path, "r") as store:
        _verify(store.log, report, progress, rebuild=None)
        _check_index(path, store, report)
    return report


def _note_recovery(replay: ReplayReport | None, report: FsckReport) -> None:
    if replay is not None and replay.tail_bytes:
        report.repairs.append(f"cut an uncommitted tail of {replay.tail_bytes} bytes"
                              + (" (copied to quarantine/ first)" if replay.tail_suspicious else ""))


def _verify(log: Log, report: FsckReport, progress: Callable[[int], None] | None,
            rebuild: Index | None) -> None:
    index: Index = rebuild if rebuild is not None else MemoryIndex()
    index.clear()

    def count(n: int) -> None:
        report.bytes_scanned += n
        if progress is not None:
            progress(n)

    replay = log.replay(index, None, verify=True, progress=count)
    live = log.refresh_segments()
    report.segments = len(live)
    # Writers number segments consecutively (roll = highest + 1; gc output follows the watermark),
    # so a gap in the live sequence is a segment file that went missing.
    for seq in sorted(set(range(live[0], live[-1] + 1)) - set(live)) if live else ():
        report.damage.append(Damage(log.layout.segment_path(seq), 0, 0, None,
                                    "segment file is missing: checkpoints committed in it are lost"))
    report.iterations = index.iterations()
    tail_starts = dict(replay.tail)
    for d in replay.damage:
        seq = _seq_of(log, d.path)
        if seq in tail_starts and d.offset >= tail_starts[seq] and not replay.tail_suspicious:
            continue  # part of the uncommitted tail: reported below as a note
        report.damage.append(d)
    if replay.tail_bytes:
        report.notes.append(
            f"{replay.tail_bytes} bytes after the last commit are an uncommitted tail (a crash "
            "during a save); the next writer open or fsck --repair cuts it")
    if log.obsolete_segments():
        report.notes.append(f"segments {log.obsolete_segments()} are obsolete (interrupted gc); "
                            "the next writer open deletes them")
    if os.path.isdir(log.layout.quarantine_dir) and os.listdir(log.layout.quarantine_dir):
        report.notes.append(f"quarantine/ holds {len(os.listdir(log.layout.quarantine_dir))} cut "
                            "tails that may contain a damaged commit; inspect, then delete them")
    damaged_chunks = {d.address: d for d in replay.damage if d.address is not None}
    for it in report.iterations:
        problems = _check_iteration(log, index, it, damaged_chunks)
        if problems:
            report.damaged_iterations[it] = problems
    _check_chains(index, report)


def _check_chains(index: Index, report: FsckReport) -> None:
    """Deltas (format-spec/deltas.md) are recoverable only through their whole chain: name every
    delta whose predecessor is damaged, missing or itself unrecoverable."""
    from .format.commit import KIND_DELTA

    bad: set[int] = set(report.damaged_iterations)
    for it in report.iterations:
        e = index.get_commit(it)
        if e is None or e.commit.kind != KIND_DELTA:
            continue
        prev = it - 1
        if prev in bad or index.get_commit(prev) is None:
            why = "damaged" if prev in report.damaged_iterations else \
                "missing" if index.get_commit(prev) is None else "unrecoverable"
            report.damaged_iterations.setdefault(it, []).append(
                f"unrecoverable: delta chain broken at iteration {prev} ({why})")
            bad.add(it)


def _check_iteration(log: Log, index: Index, it: int, damaged_chunks: dict[bytes, Damage]) -> list[str]:
    entry = index.get_commit(it)
    assert entry is not None
    try:
        manifest = read_manifest(log, entry)
    except DamagedCheckpointError as e:
        return [str(e)]
    problems: list[str] = []
    for t in manifest.tensors:
        if t.inline is not None or t.nbytes == 0:
            continue
        try:
            tree = read_tree(log, index, t)
        except (FormatError, OSError) as e:
            problems.append(f"tensor {t.path}: tree {t.root.hex()}: {e}")
            continue
        for start, end, addr in tree.chunk_spans():
            if index.get_chunk(addr) is None:
                where = damaged_chunks.get(addr)
                at = f" (damaged record at {where.path} offset {where.offset})" if where else " (missing)"
                problems.append(f"tensor {t.path}: bytes {start}-{end}: chunk {addr.hex()}{at}")
    return problems


def _seq_of(log: Log, path: str) -> int | None:
    name = os.path.basename(path)
    try:
        return int(name.split(".")[0])
    except ValueError:
        return None


def _check_index(path: str, store: Store, report: FsckReport) -> None:
    """Compare the writer's LMDB index with the verified replay (read-only; skipped while a writer
    holds the lock, since the index is then being written)."""
    import fcntl

    if not os.path.isdir(store.layout.index_dir):
        report.notes.append("no index: the next writer open rebuilds it from the log")
        return
    try:
        fd = os.open(store.layout.lock_file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            report.notes.append("a writer holds the store; index comparison skipped")
            return
        listed = _index_iterations(store.layout.index_dir)
        if listed is None:
            report.notes.append("index is unreadable: the next writer open rebuilds it")
        elif listed != report.iterations:
            report.notes.append("index is stale or differs from the log: the next writer open "
                                "catches it up or rebuilds it")
    finally:
        os.close(fd)


def _index_iterations(index_dir: str) -> list[int] | None:
    import struct

    import lmdb

    try:
        env = lmdb.open(index_dir, readonly=True, lock=False, max_dbs=8, subdir=True)
        try:
            db = env.open_db(b"commits", create=False)
            with env.begin() as txn:
                return [struct.unpack(">Q", k)[0] for k in txn.cursor(db=db).iternext(values=False)]
        finally:
            env.close()
    except lmdb.Error:
        return None
