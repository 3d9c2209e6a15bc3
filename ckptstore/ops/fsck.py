"""fsck: verify every byte of a store and, with ``repair``, restore it to a clean state.

Verification scans the whole log with every payload checked (chunks included), then walks every
committed checkpoint: manifest -> trees -> chunk addresses. It reports

* damage: corrupt or torn records, each with file, offset and length;
* damaged iterations: committed checkpoints that cannot be read back intact, with the tensor and
  the missing or corrupt chunk (and where that chunk's damaged record is, when it can be found);
* lost iterations: checkpoints that were written but whose COMMIT record is damaged or gone, named
  only from verified evidence -- a valid MANIFEST record that no valid commit names with damage
  between it and the next commit (storage/log.py ``LostCommit``), or an entry of the writer's
  index (a cache filled only from verified commits) whose commit the log no longer holds. An
  iteration with a valid commit is never reported lost;
* notes: an uncommitted tail (left by a crash; the next writer open cuts it), a stale index,
  quarantined tails, obsolete segments of an interrupted gc.

Repair = open as writer (the automatic recovery: finish gc, cut or quarantine the tail), then
rebuild the index from a fully verified scan, so every chunk and tree it names is intact.
Repair never deletes a committed checkpoint, intact or not: damaged ones are reported, kept, and
still load partially with ``keys=``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from ..errors import DamagedCheckpointError, FormatError
from ..format.chunk import CHUNK_HEADER_SIZE, decode_chunk_header
from ..storage.index import ChunkRef, Index, MemoryIndex
from ..storage.job_log import refuse_job_part
from ..storage.layout import Layout
from ..storage.lmdb_index import IndexContents, read_index_unlocked
from ..storage.lock import no_writer
from ..storage.log import Damage, Log, ScanReport
from ..engine.engine import Engine
from ..engine.read_path import read_manifest, read_tree
from ..engine.reader_engine import ReaderEngine
from ..engine.writer_engine import WriterEngine


@dataclass
class FsckReport:
    path: str
    segments: int = 0
    bytes_scanned: int = 0
    iterations: list[int] = field(default_factory=list)
    damage: list[Damage] = field(default_factory=list)
    damaged_iterations: dict[int, list[str]] = field(default_factory=dict)
    #: iteration -> why it is known to have been written and to have no valid commit
    lost_iterations: dict[int, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    repairs: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """True when no committed data is damaged or lost and no corrupt record remains in the
        log."""
        return not self.damage and not self.damaged_iterations and not self.lost_iterations

    def lines(self) -> list[str]:
        out = [f"store {self.path}: {len(self.iterations)} committed iterations, {self.segments} "
               f"segments, {self.bytes_scanned} bytes verified"]
        out += [f"DAMAGE {d}" for d in self.damage]
        for it, problems in sorted(self.damaged_iterations.items()):
            out += [f"DAMAGED iteration {it}: {p}" for p in problems]
        out += [f"LOST {why}" for _, why in sorted(self.lost_iterations.items())]
        out += [f"note: {n}" for n in self.notes]
        out += [f"repaired: {r}" for r in self.repairs]
        out.append("clean" if self.clean else
                   f"NOT CLEAN: {len(self.damage)} damaged records, "
                   f"{len(self.damaged_iterations)} damaged iterations, "
                   f"{len(self.lost_iterations)} lost iterations")
        return out


def check(path: str | os.PathLike, *, repair: bool = False,
          progress: Callable[[int], None] | None = None, job_stream: bool = False) -> FsckReport:
    """Verify the store at ``path``; with ``repair`` also recover it (needs the writer lock).
    A rank's stream of a job store is repaired only by the job store's fsck, which passes
    ``job_stream`` (ckptstore/multirank/fsck.py); alone it raises JobStreamError."""
    path = os.fspath(path)
    report = FsckReport(path)
    if repair:
        if not job_stream:
            refuse_job_part(path, "repair")
        # Read before the writer open, which rebuilds an index that no longer matches the log.
        indexed = _read_index(Layout(path))[1]
        writer = WriterEngine(path, job_stream=job_stream)  # recovery: finish gc, cut the tail
        try:
            _note_recovery(writer.last_scan, report)
            _verify(writer.log, report, progress, rebuild=writer.index)
            _note_lost_by_index(writer, indexed, report)
            report.repairs.append("index rebuilt from a fully verified scan of the log")
        finally:
            writer.close()
        return report
    reader = ReaderEngine(path, use_index=False)  # fsck reads the index itself, unlocked
    try:
        verified = _verify(reader.log, report, progress, rebuild=None)
        indexed = _check_index(reader, report, verified)
        _note_lost_by_index(reader, indexed, report)
    finally:
        reader.close()
    return report


def quarantine_note(quarantine_dir: str) -> str | None:
    """fsck's note on what a quarantine directory holds (None when it is empty or absent)."""
    held = len(os.listdir(quarantine_dir)) if os.path.isdir(quarantine_dir) else 0
    if not held:
        return None
    tails, them = ("cut tail", "it") if held == 1 else ("cut tails", "them")
    return (f"quarantine/ holds {held} {tails} that may contain a damaged commit; inspect, then "
            f"delete {them}")


def _note_recovery(scan: ScanReport | None, report: FsckReport) -> None:
    if scan is None:
        return
    if scan.tail_bytes:
        report.repairs.append(f"cut an uncommitted tail of {scan.tail_bytes} bytes"
                              + (" (copied to quarantine/ first)" if scan.tail_suspicious else ""))
    for lost in scan.lost:  # found before the cut: a damaged commit the cut removed
        report.lost_iterations.setdefault(lost.iteration, str(lost))


def _verify(log: Log, report: FsckReport, progress: Callable[[int], None] | None,
            rebuild: Index | None) -> Index:
    """Scan the whole log with every payload verified into ``rebuild`` (or a new MemoryIndex),
    check every committed iteration, and return that index."""
    index: Index = rebuild if rebuild is not None else MemoryIndex()
    index.clear()

    def count(n: int) -> None:
        report.bytes_scanned += n
        if progress is not None:
            progress(n)

    scan = log.scan(index, None, verify=True, progress=count)
    live = log.refresh_segments()
    report.segments = len(live)
    for first, last, uncertain in _runs(scan.missing, scan.missing_uncertain):
        if first == last:
            why = "segment file is missing"
            why += (" (unless a gc collected it: a later segment whose header is damaged may be "
                    "the gc's marker)" if uncertain else ": checkpoints committed in it are lost")
        else:
            why = f"segments {first}..{last} are missing ({last - first + 1} files)"
            why += (" (unless a gc collected them: a later segment whose header is damaged may "
                    "be the gc's marker)" if uncertain
                    else ": checkpoints committed in them are lost")
        report.damage.append(Damage(log.layout.segment_path(first), 0, 0, None, why))
    report.iterations = index.iterations()
    tail_starts = dict(scan.tail)
    for d in scan.damage:
        seq = _seq_of(log, d.path)
        if seq in tail_starts and d.offset >= tail_starts[seq] and not scan.tail_suspicious:
            continue  # part of the uncommitted tail: reported below as a note
        report.damage.append(d)
    for lost in scan.lost:
        report.lost_iterations.setdefault(lost.iteration, str(lost))
    if scan.tail_bytes and scan.tail_suspicious:
        report.notes.append(
            f"{scan.tail_bytes} bytes after the last valid commit hold a damaged commit (see "
            "above); the next writer open or fsck --repair copies them to quarantine/, then cuts "
            "them")
    elif scan.tail_bytes:
        report.notes.append(
            f"{scan.tail_bytes} bytes after the last commit are an uncommitted tail (a crash "
            "during a save); the next writer open or fsck --repair cuts it")
    if log.obsolete_segments():
        report.notes.append(f"segments {log.obsolete_segments()} are obsolete (interrupted gc); "
                            "the next writer open deletes them")
    held = quarantine_note(log.layout.quarantine_dir)
    if held:
        report.notes.append(held)
    damaged_chunks = {d.address: d for d in scan.damage if d.address is not None}
    raw_lengths: dict[bytes, int | str] = {}
    for it in report.iterations:
        problems = _check_iteration(log, index, it, damaged_chunks, raw_lengths)
        if problems:
            report.damaged_iterations[it] = problems
    _check_chains(index, report)
    return index


def _runs(seqs: list[int], uncertain: set[int]) -> list[tuple[int, int, bool]]:
    """Consecutive runs ``(first, last, uncertain)`` of the sorted ``seqs``, split where the
    uncertainty changes (a stray far-ahead segment file would otherwise yield one line per
    number in between)."""
    runs: list[tuple[int, int, bool]] = []
    for seq in seqs:
        u = seq in uncertain
        if runs and runs[-1][1] == seq - 1 and runs[-1][2] == u:
            runs[-1] = (runs[-1][0], seq, u)
        else:
            runs.append((seq, seq, u))
    return runs


def _note_lost_by_index(engine: Engine, indexed: IndexContents | None,
                        report: FsckReport) -> None:
    """Name iterations the writer's index lists as committed but the log has no valid commit of.

    The index is filled only from verified commits, in the same transaction as the position
    after them, and never ahead of the log: tail cuts remove no committed record and gc rebuilds
    it. So an entry in a live segment whose iteration the verified scan did not commit names a
    checkpoint that was committed and is now lost. Entries in obsolete segments (an interrupted
    gc) are skipped, as are those in a missing segment that a gc may have collected.
    """
    if indexed is None or indexed.store_id != engine.header.store_id:
        return
    log = engine.log
    log.refresh_segments()
    missing, uncertain = log.missing_segments()
    committed = set(report.iterations)
    for it, e in sorted(indexed.commits.items()):
        seq = e.loc.seq
        if it in committed or it in report.lost_iterations or seq <= log.watermark \
                or seq in uncertain:
            continue
        path = log.layout.segment_path(seq)
        if seq not in log.present:
            why = f"segment file {path} is missing"
        elif seq in log.foreign:
            why = f"{path} now belongs to another store"
        else:
            try:
                size = log.file(seq).size()
            except OSError:
                continue
            why = (f"{path} ends at {size}, before the end of the commit record"
                   if e.loc.end > size else "no valid COMMIT record there")
        report.lost_iterations[it] = (f"iteration {it} (commit at {path}:{e.loc.offset}, per the "
                                      f"index) has no valid commit: {why}")


def _check_chains(index: Index, report: FsckReport) -> None:
    """Deltas (format-spec/deltas.md) are recoverable only through their whole chain: name every
    delta whose predecessor is damaged, missing or itself unrecoverable."""
    from ..format.commit import KIND_DELTA

    bad: set[int] = set(report.damaged_iterations)
    for it in report.iterations:
        e = index.get_commit(it)
        if e is None or e.commit.kind != KIND_DELTA:
            continue
        prev = it - 1
        if prev in bad or index.get_commit(prev) is None:
            why = "damaged" if prev in report.damaged_iterations else \
                "lost" if prev in report.lost_iterations else \
                "missing" if index.get_commit(prev) is None else "unrecoverable"
            report.damaged_iterations.setdefault(it, []).append(
                f"unrecoverable: delta chain broken at iteration {prev} ({why})")
            bad.add(it)


def _check_iteration(log: Log, index: Index, it: int, damaged_chunks: dict[bytes, Damage],
                     raw_lengths: dict[bytes, int | str]) -> list[str]:
    """What keeps checkpoint ``it`` from loading: its manifest, each tensor's tree, and for each
    span of a tree the (verified) chunk record that must hold it and that chunk's raw length
    (``raw_lengths`` caches the latter per address: the chunk header's raw length, or why it
    cannot be read)."""
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
            ref = index.get_chunk(addr)
            if ref is None:
                where = damaged_chunks.get(addr)
                at = f" (damaged record at {where.path} offset {where.offset})" if where else " (missing)"
                problems.append(f"tensor {t.path}: bytes {start}-{end}: chunk {addr.hex()}{at}")
                continue
            raw = raw_lengths.get(addr)
            if raw is None:
                raw = raw_lengths[addr] = _chunk_raw_length(log, ref)
            if raw != end - start:
                has = raw if isinstance(raw, str) else f"holds {raw} bytes"
                problems.append(f"tensor {t.path}: bytes {start}-{end}: chunk {addr.hex()} at "
                                f"{log.layout.segment_path(ref.loc.seq)} offset {ref.loc.offset} "
                                f"{has}, not the span's {end - start}")
    return problems


def _chunk_raw_length(log: Log, ref: ChunkRef) -> int | str:
    """The raw length in the chunk header of a record the verified scan indexed."""
    try:
        buf = log.file(ref.loc.seq).pread(ref.loc.payload_offset, CHUNK_HEADER_SIZE)
        return decode_chunk_header(buf).raw_length
    except (FormatError, OSError) as e:
        return f"has an unreadable chunk header ({e})"


def _seq_of(log: Log, path: str) -> int | None:
    name = os.path.basename(path)
    try:
        return int(name.split(".")[0])
    except ValueError:
        return None


def _check_index(engine: Engine, report: FsckReport, verified: Index) -> IndexContents | None:
    """Compare every entry of the writer's LMDB index with the verified scan (read-only; skipped
    while a writer holds the store, since the index is then being written). The index is a cache:
    what differs is reported as a note (loads fall back to the log), not as damage. Returns what
    the index holds."""
    status, indexed = _read_index(engine.layout)
    if status == "absent":
        report.notes.append("no index: the next writer open rebuilds it from the log")
    elif status == "locked":
        report.notes.append("a writer holds the store; index comparison skipped")
    elif indexed is None or indexed.store_id != engine.header.store_id:
        report.notes.append("index is unreadable: the next writer open rebuilds it")
        return None
    else:
        wrong = _index_mismatches(indexed, verified)
        if indexed.damaged or wrong:
            report.notes.append(
                f"index: {indexed.damaged} entries fail their check and {wrong} differ from the "
                "log (a damaged cache: loads fall back to the log); `fsck --repair` rebuilds it")
        elif sorted(indexed.commits) != report.iterations or \
                indexed.recorded_commits != len(indexed.commits):
            report.notes.append("index is stale or differs from the log: the next writer open "
                                "catches it up or rebuilds it")
    return indexed


def _index_mismatches(indexed: IndexContents, verified: Index) -> int:
    """Entries of the index that name something else than the verified scan does for the same
    key (an entry the scan lacks is stale, not wrong: the log may have been cut after it)."""
    wrong = 0
    for it, e in indexed.commits.items():
        v = verified.get_commit(it)
        wrong += v is not None and v != e
    for addr, ref in indexed.chunks.items():
        v_ref = verified.get_chunk(addr)
        wrong += v_ref is not None and v_ref != ref and ref not in verified.chunk_alternatives(addr)
    for root, loc in indexed.trees.items():
        v_loc = verified.get_tree(root)
        wrong += v_loc is not None and v_loc != loc
    return wrong


def _read_index(layout: Layout) -> tuple[str, IndexContents | None]:
    """("absent" | "locked" | "unreadable" | "ok", the index's entries).

    The environment is read without LMDB's lock file (fsck writes nothing), which is safe only
    while no writer runs: :func:`~ckptstore.storage.lock.no_writer` makes sure of that."""
    if not os.path.isdir(layout.index_dir):
        return "absent", None
    with no_writer(layout) as status:
        if status != "free":
            return status, None
        indexed = read_index_unlocked(layout.index_dir)
        return ("ok" if indexed is not None else "unreadable"), indexed
