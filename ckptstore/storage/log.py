"""The log: every segment of a store, read by location, appended to by one writer, and scanned
into an index on open (format-spec/format.md, "Recovery").

Scan rules (normative in the spec):

* Segments are read in sequence order; segments at or below the highest ``supersedes`` watermark
  found in any segment header are obsolete (an interrupted gc) and skipped.
* CHUNK and TREE records become *pending*; a valid COMMIT whose manifest is valid, has the named
  digest and the same iteration makes everything pending visible at once (one index batch).
* Records after the last valid commit are the *tail*: uncommitted, never indexed. The writer
  truncates it on open (quarantining it first when it is *suspicious*: it holds a damaged commit);
  readers ignore it.
* A torn tail (a crash mid-append) and damage to a complete commit are told apart only by verified
  evidence: a COMMIT-typed record with a valid header that fails its payload check or names no
  valid manifest, or, where a record header is invalid, a complete COMMIT-shaped record whose
  96-byte payload passes its own trailer check (``_probe_commit``).
* A checkpoint whose commit is damaged or gone is named only from verified bytes: a valid MANIFEST
  record that no valid commit names, whose iteration is not committed, with damage between it and
  the next commit of a later save (``LostCommit``). Unverified payloads are never decoded.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from typing import Callable

import xxhash

from ..errors import CorruptRecordError, FormatError
from ..format import records as rec
from ..format.chunk import CHUNK_HEADER_SIZE, decode_chunk_header
from ..format.commit import COMMIT_SIZE, Commit, decode_commit
from ..format.header import FORMAT_VERSION, SegmentHeader
from ..format.image import BLOCK, RECORD_OVERHEAD
from ..format.manifest import decode_committed_manifest, decode_manifest
from ..format.tree import decode_tree
from .fileops import FileOps
from .index import ChunkRef, CommitEntry, Index, IndexBatch, Position
from .layout import Layout, is_segment_seq
from .direct import StagingBuffer, supported as direct_supported
from .segments import (CorruptRegion, Loc, ScannedRecord, SegmentFile, SegmentWriter,
                       misnamed_segment_error, read_segment_header_record, scan_segment)

#: Commits per index transaction while scanning a long log.
_REPLAY_BATCH = 4096
#: Directory listings refresh_segments takes when segments vanish under it (a concurrent gc).
_LISTING_RETRIES = 5


@dataclass
class Damage:
    """A corrupt stretch of a segment, as fsck and open report it."""

    path: str
    offset: int
    end: int
    record_type: int | None
    reason: str
    #: for a damaged CHUNK record whose chunk header still decodes: the chunk's address
    address: bytes | None = None

    def __str__(self) -> str:
        if self.record_type is None and self.offset == self.end == 0:
            return f"{self.path}: {self.reason}"  # a whole file (a missing segment)
        kind = rec.RecordType(self.record_type).name if self.record_type in rec.KNOWN_TYPES else "bytes"
        return f"{self.path} offset {self.offset}: {kind} ({self.end - self.offset} bytes): {self.reason}"


#: Bytes of a whole COMMIT record (header, 96-byte payload, trailer).
COMMIT_RECORD_SIZE = rec.OVERHEAD + COMMIT_SIZE


@dataclass(frozen=True)
class LostCommit:
    """A checkpoint that was written but has no valid commit, known from verified evidence: the
    valid MANIFEST record at ``path``/``offset`` (its iteration read from its checked payload)
    that no valid commit names, while ``evidence`` (damage, or a missing segment) lies between it
    and the next valid commit of a later save."""

    iteration: int
    path: str
    offset: int
    evidence: str

    def __str__(self) -> str:
        return (f"iteration {self.iteration} (manifest at {self.path}:{self.offset}) has no valid "
                f"commit: {self.evidence}")


@dataclass(frozen=True)
class _Event:
    """Damage at a place in log order; ``suspicious`` when it may be a damaged commit (or a
    missing segment), which a crash cannot produce."""

    pos: tuple[int, int]
    what: str
    suspicious: bool


@dataclass
class ScanReport:
    """What a scan of the log saw. ``tail_*`` describe bytes after the last valid commit."""

    position: Position | None
    commits: int = 0
    damage: list[Damage] = field(default_factory=list)
    #: segments holding bytes after ``position`` (the tail), with the offset where the tail starts
    tail: list[tuple[int, int]] = field(default_factory=list)
    tail_bytes: int = 0
    #: a COMMIT-typed record in the tail failed to verify: the tail may hold a damaged commit
    tail_suspicious: bool = False
    #: chunk addresses whose records were verified (only with verify=True)
    verified_chunks: set[bytes] = field(default_factory=set)
    #: live sequence numbers missing from the consecutive run watermark+1 .. highest present
    missing: list[int] = field(default_factory=list)
    #: the subset of ``missing`` that a gc marker with a damaged header may have made obsolete
    missing_uncertain: set[int] = field(default_factory=set)
    #: checkpoints whose commit is damaged or gone (only those whose manifest this scan walked)
    lost: list[LostCommit] = field(default_factory=list)


class Log:
    """Segment files of one store. Read methods are thread-safe; append methods are not."""

    def __init__(self, layout: Layout, store_id: bytes, ops: FileOps | None = None,
                 evict_written: bool = False, direct_io: bool = False, *,
                 framing_checks: bool) -> None:
        self.layout = layout
        self.store_id = store_id
        self.ops = ops
        #: the STORE header's FEATURE_FRAMING_CHECKS: the writer frames CHUNK records with
        #: FRAMING_CHECK trailers, and a verifying scan reports one in a store without it
        self.framing_checks = framing_checks
        #: the writer (and quarantine copies) advise the kernel to drop written pages (SegmentWriter)
        self.evict_written = evict_written
        #: the writer appends through O_DIRECT from this reused staging buffer (storage/direct.py)
        self.stage: StagingBuffer | None = StagingBuffer() if direct_io and direct_supported() \
            else None
        #: whether appends go through the stage now (:meth:`use_direct`)
        self.direct_on = True
        self._files: dict[int, SegmentFile] = {}
        self.headers: dict[int, SegmentHeader] = {}
        self.header_damage: dict[int, FormatError] = {}
        self.foreign: set[int] = set()
        #: segments whose verified header names another seq (renamed files) -> its ``supersedes``
        self.misnamed_supersedes: dict[int, int] = {}
        #: segments with a damaged header that hold a valid record after it: no gc marker (a
        #: marker is a header record alone, never appended to, §17)
        self.not_markers: set[int] = set()
        self.watermark = 0
        #: every segment file listed by the last refresh (obsolete and foreign ones included)
        self.present: list[int] = []
        self.writer: SegmentWriter | None = None

    # ---- segments -------------------------------------------------------------------------
    def file(self, seq: int) -> SegmentFile:
        f = self._files.get(seq)
        if f is None:
            if not is_segment_seq(seq):  # a location read from a record or the index
                raise CorruptRecordError(f"a location names segment {seq}, which is out of range "
                                         f"in {self.layout.segment_dir}")
            f = self._files.setdefault(seq, SegmentFile(self.layout.segment_path(seq), seq))
        return f

    def refresh_segments(self) -> list[int]:
        """Re-list the directory, read new segment headers; return the live (non-obsolete) seqs.

        A segment that vanishes between the listing and the read of its header was deleted by a
        concurrent gc (readers only; the writer holds the lock). gc creates its new segments before
        it deletes the old ones, so the directory is listed again: the result never names a
        segment known to be gone, and never misses the segments that replaced it."""
        for _ in range(_LISTING_RETRIES):
            present = self.layout.list_segments()
            vanished = self._read_headers(present)
            if not vanished:
                break
        present = [s for s in present if s not in vanished]
        self.present = present
        gone = set(self._files) - set(present)
        for seq in gone:
            if self.writer is not None and self.writer.seq == seq:
                continue
            self._forget(seq)
        # A segment of another store is reported (header_damage) but never scanned.
        return [s for s in present if s > self.watermark and s not in self.foreign]

    def _read_headers(self, present: list[int]) -> set[int]:
        """Read the headers of newly listed segments; return the seqs found missing."""
        vanished: set[int] = set()
        for seq in present:
            f = self._files.get(seq)
            if f is not None and not f.same_file():
                # the number was reused (a cut tail's segment deleted, a new one rolled) or the
                # file was deleted: forget the old file so this reader opens the current one
                if self.writer is None or self.writer.seq != seq:
                    self._forget(seq)
            if seq in self.headers or seq in self.header_damage:
                continue
            try:
                h = read_segment_header_record(self.file(seq))
            except FormatError as e:
                self.header_damage[seq] = e
                continue
            except OSError as e:  # StoreIOError from pread included
                if e.errno != errno.ENOENT:
                    raise
                self._forget(seq)
                vanished.add(seq)
                continue
            if h.store_id != self.store_id:
                self.header_damage[seq] = CorruptRecordError(
                    "segment belongs to another store").located(self.file(seq).path, 0)
                self.foreign.add(seq)
                continue
            if h.seq != seq:
                # a renamed file: damage, but its verified header still bounds what it obsoletes
                self.header_damage[seq] = misnamed_segment_error(self.file(seq), h)
                self.misnamed_supersedes[seq] = h.supersedes
                continue
            self.headers[seq] = h
            self.watermark = max(self.watermark, h.supersedes)
        return vanished

    def _forget(self, seq: int) -> None:
        f = self._files.pop(seq, None)
        if f is not None:
            f.close()
        self.headers.pop(seq, None)
        self.header_damage.pop(seq, None)
        self.misnamed_supersedes.pop(seq, None)
        self.not_markers.discard(seq)
        self.foreign.discard(seq)

    def obsolete_segments(self) -> list[int]:
        return [s for s in self.layout.list_segments() if s <= self.watermark]

    def missing_segments(self) -> tuple[list[int], set[int]]:
        """Segment files missing as of the last refresh, and the subset that may be obsolete.

        Writers number live segments consecutively from watermark + 1 (a roll takes the highest
        seq + 1, gc output follows the watermark, tail cuts delete from the highest down), so every
        seq in ``watermark+1 .. highest present`` must exist. A segment whose header is damaged
        may be a gc marker whose ``supersedes`` is unknown: a missing seq below it may have been
        collected, so it is returned in the second (uncertain) set as well. A renamed segment
        (verified header, another seq) is not counted in the watermark either, but its
        ``supersedes`` is known: only missing seqs up to that value are uncertain because of it.
        A damaged-header segment that a scan found holding a valid record after its header is
        no gc marker (a marker is a header record alone) and makes nothing uncertain.
        """
        if not self.present:
            return [], set()
        have = set(self.present)
        missing = [s for s in range(self.watermark + 1, self.present[-1] + 1) if s not in have]
        bound = 0  # every missing seq <= bound may have been collected by a gc
        for s in self.header_damage:
            if s in self.foreign or s in self.not_markers:
                continue
            known = self.misnamed_supersedes.get(s)
            bound = max(bound, s - 1 if known is None else known)
        return missing, {s for s in missing if s <= bound}

    def read_payload(self, loc: Loc, verify: bool = True) -> memoryview:
        return self.file(loc.seq).read_payload(loc, verify)

    def close(self) -> None:
        try:
            if self.writer is not None:
                w, self.writer = self.writer, None
                w.close()
        finally:
            for f in self._files.values():
                f.close()
            self._files.clear()

    # ---- scan -----------------------------------------------------------------------------
    def scan(self, index: Index, start: Position | None, *, verify: bool = False,
               progress: Callable[[int], None] | None = None,
               live: list[int] | None = None) -> ScanReport:
        """Scan the log from ``start`` (None: from the beginning) and apply every valid commit to
        ``index``. Never modifies the log. ``live``: the result of the :meth:`refresh_segments`
        call the caller based its choice of ``start`` on (default: list the segments now)."""
        if live is None:
            live = self.refresh_segments()
        report = ScanReport(position=start)
        events: list[_Event] = []  # damage in log order, for naming checkpoints that lost a commit

        def damaged(d: Damage, seq: int, suspicious: bool = False) -> None:
            report.damage.append(d)
            events.append(_Event((seq, d.offset), str(d), suspicious))
            if suspicious:
                report.tail_suspicious = True

        for seq, err in sorted(self.header_damage.items()):
            if seq > self.watermark and (start is None or seq >= start.seq):
                damaged(Damage(err.path or "", 0, 0, rec.RecordType.SEGMENT_HEADER, err.reason), seq)
        pending_chunks: dict[bytes, ChunkRef] = {}
        pending_trees: dict[bytes, Loc] = {}
        manifests: dict[tuple[int, int], tuple[bytes, int]] = {}
        named: set[tuple[int, int]] = set()  # manifest locations named by a valid commit
        commit_points: list[tuple[tuple[int, int], tuple[int, int]]] = []  # (commit, its manifest)
        batch = IndexBatch()
        seen_segments: list[int] = []
        tail_start: list[tuple[int, int]] = []  # candidate tail: records since the last commit
        for seq in live:
            if start is not None and seq < start.seq:
                seen_segments.append(seq)
                continue
            seen_segments.append(seq)
            f = self.file(seq)
            offset = start.offset if start is not None and seq == start.seq else 0
            tail_start.append((seq, offset))
            for item in scan_segment(f, offset, verify=verify,
                                     framing_allowed=self.framing_checks):
                if progress is not None:
                    progress(item.loc.end - item.loc.offset if isinstance(item, ScannedRecord)
                             else item.end - item.start)
                if isinstance(item, CorruptRegion):
                    c = _probe_commit(f, item)
                    if c is None:
                        damaged(Damage(f.path, item.start, item.end, None, item.error.reason), seq)
                    else:
                        damaged(Damage(f.path, item.start, item.end, rec.RecordType.COMMIT,
                                       f"{item.error.reason}: a complete COMMIT record with a "
                                       "damaged header (its payload passes its own check and "
                                       f"names iteration {c.iteration})"), seq, suspicious=True)
                    continue
                if item.error is not None:
                    damaged(_describe_damaged_record(f, item), seq,
                            suspicious=item.type == rec.RecordType.COMMIT)
                    continue
                t = item.type
                if item.loc.offset > 0 and seq in self.header_damage:
                    self.not_markers.add(seq)
                if t == rec.RecordType.SEGMENT_HEADER:
                    if item.loc.offset != 0:
                        damaged(Damage(f.path, item.loc.offset, item.loc.end, t,
                                       "segment header record inside a segment"), seq)
                elif t == rec.RecordType.CHUNK:
                    try:
                        ch = decode_chunk_header(f.pread(item.loc.payload_offset, CHUNK_HEADER_SIZE))
                    except FormatError as e:
                        damaged(Damage(f.path, item.loc.offset, item.loc.end, t, e.reason), seq)
                        continue
                    older = pending_chunks.get(ch.address)
                    if older is not None:
                        batch.superseded.append((ch.address, older))
                    pending_chunks[ch.address] = ChunkRef(item.loc, int(ch.codec))
                    if verify:
                        report.verified_chunks.add(ch.address)
                elif t == rec.RecordType.TREE:
                    assert item.payload is not None  # always read, and no error: segments._ALWAYS_READ
                    try:
                        tree = decode_tree(item.payload)
                    except FormatError as e:
                        damaged(Damage(f.path, item.loc.offset, item.loc.end, t, e.reason), seq)
                        continue
                    pending_trees[tree.root] = item.loc
                elif t == rec.RecordType.MANIFEST:
                    assert item.payload is not None  # always read, and no error: segments._ALWAYS_READ
                    try:
                        m = decode_manifest(item.payload)
                    except FormatError as e:
                        damaged(Damage(f.path, item.loc.offset, item.loc.end, t, e.reason), seq)
                        continue
                    manifests[(seq, item.loc.offset)] = (xxhash.xxh3_128_digest(item.payload),
                                                         m.iteration)
                elif t == rec.RecordType.COMMIT:
                    assert item.payload is not None  # always read, and no error: segments._ALWAYS_READ
                    try:
                        c = decode_commit(item.payload)
                    except FormatError as e:
                        damaged(Damage(f.path, item.loc.offset, item.loc.end, t, e.reason), seq,
                                suspicious=True)
                        continue
                    mloc = (c.manifest_seq, c.manifest_offset)
                    walked = manifests.get(mloc)
                    walked_ok = walked is not None and walked == (c.manifest_digest, c.iteration)
                    # a manifest written before where this scan started (group commit) is
                    # read and checked at its location instead
                    if not walked_ok and (walked is not None or not self._manifest_valid(c)):
                        damaged(Damage(f.path, item.loc.offset, item.loc.end, t,
                                       f"commit of iteration {c.iteration} names a manifest that "
                                       "is missing, damaged or different"), seq, suspicious=True)
                        continue
                    named.add(mloc)
                    commit_points.append(((seq, item.loc.offset), mloc))
                    for addr in batch.chunks.keys() & pending_chunks.keys():
                        batch.superseded.append((addr, batch.chunks[addr]))
                    batch.chunks.update(pending_chunks)
                    batch.trees.update(pending_trees)
                    pending_chunks.clear()
                    pending_trees.clear()
                    batch.commits.append(CommitEntry(c, item.loc))
                    report.position = batch.position = Position(seq, item.loc.end)
                    batch.segments = tuple(seen_segments)
                    report.commits += 1
                    report.tail_suspicious = False
                    tail_start = [(seq, item.loc.end)]
                    if len(batch.commits) >= _REPLAY_BATCH:
                        index.apply(batch)
                        batch = IndexBatch()
                # reserved types (tombstone, deltas, rank streams) are skipped in v1
        if batch.commits:
            index.apply(batch)
        # after the walk, which found which damaged-header segments hold records (no gc marker)
        report.missing, report.missing_uncertain = self.missing_segments()
        for seq in report.missing:
            if seq not in report.missing_uncertain:
                events.append(_Event((seq, 0), f"segment file {self.layout.segment_path(seq)} "
                                                   "is missing", True))
        for seq, off in tail_start:
            size = self.file(seq).size()
            header_only = off == 0 and size == _header_len() and seq in self.headers
            torn_header = off == 0 and seq not in self.headers  # crash while rolling, even 0 bytes
            if (size > off and not header_only) or torn_header:
                report.tail.append((seq, off))
                report.tail_bytes += max(size - off, 0)
        orphans = [(loc, it) for loc, (_, it) in manifests.items()
                   if loc not in named and index.get_commit(it) is None]
        if orphans:
            report.lost = self._lost_commits(orphans, commit_points, events)
        return report

    def _lost_commits(self, orphans: list[tuple[tuple[int, int], int]],
                      commit_points: list[tuple[tuple[int, int], tuple[int, int]]],
                      events: list[_Event]) -> list[LostCommit]:
        """Name the checkpoints among ``orphans`` (valid manifests that no valid commit names and
        whose iteration is not committed) whose commit was damaged or lost.

        The commit of a manifest M lies after M and before the first valid commit of a save that
        began after M (a commit naming a manifest after M; in a group commit, the commits of
        earlier members of M's group come before M's own). M's checkpoint lost its commit if damage
        lies in that window. Where no such commit follows, the window reaches into the tail, and
        only damage a crash cannot leave (a damaged commit, a missing segment) counts: a manifest
        followed by a torn record is a save that crashed before its commit point.
        """
        events = sorted(events, key=lambda e: e.pos)
        lost = []
        for pos, iteration in sorted(orphans):
            end = next((c for c, m in commit_points if c > pos and m > pos), None)
            ev = next((e for e in events if pos < e.pos and (
                e.pos < end if end is not None else e.suspicious)), None)
            if ev is not None:
                lost.append(LostCommit(iteration, self.layout.segment_path(pos[0]), pos[1],
                                       ev.what))
        return lost

    def _manifest_valid(self, c: "Commit") -> bool:
        """Whether the record at the commit's manifest location is the manifest it names."""
        try:
            payload = self.read_payload(Loc(c.manifest_seq, c.manifest_offset, c.manifest_length))
            decode_committed_manifest(payload, c.manifest_digest, c.iteration)
            return True
        except (FormatError, OSError):
            return False

    # ---- appending (writer only) ------------------------------------------------------------
    def open_writer(self, position: Position | None, segment_size: int) -> None:
        """Position the writer at ``position`` (the end of the last commit), or start segment 1.

        Called after a scan, which read the log from the files: a writer still open holds nothing
        staged before ``position`` and is replaced without writing."""
        assert self.ops is not None
        if self.writer is not None:
            w, self.writer = self.writer, None
            w.close_fds()
        if position is None:
            live = self.refresh_segments()
            if live:
                seq = live[-1]
                self.writer = SegmentWriter.reopen(self.layout.segment_path(seq), seq,
                                                   _header_len(), self.ops, self.evict_written,
                                                   self.stage, self.direct_on,
                                                   framing_checks=self.framing_checks)
            else:
                self.roll(segment_size)
            return
        self.writer = SegmentWriter.reopen(self.layout.segment_path(position.seq), position.seq,
                                           position.offset, self.ops, self.evict_written,
                                           self.stage, self.direct_on,
                                           framing_checks=self.framing_checks)

    def use_direct(self, on: bool) -> None:
        """Append through O_DIRECT (when the log has a stage) or buffered, from now on."""
        self.direct_on = on
        if self.writer is not None:
            self.writer.use_direct(on)

    def close_writer(self) -> None:
        """Close the appending writer (gc, before its marker supersedes the writer's segment);
        :meth:`open_writer` reopens one."""
        if self.writer is not None:
            w, self.writer = self.writer, None
            w.close()

    def roll(self, segment_size: int, supersedes: int = 0) -> SegmentWriter:
        """Start a new segment after every existing one (fsyncing the old one first)."""
        assert self.ops is not None
        existing = self.layout.list_segments()
        seq = (existing[-1] if existing else 0) + 1
        if self.writer is not None:
            self.writer.sync()
            self.writer.close()
            self.writer = None  # never leave a closed writer behind if create() fails
        self.writer = SegmentWriter.create(self.layout.segment_path(seq), seq, self.store_id,
                                           self.ops, supersedes, self.evict_written, self.stage,
                                           self.direct_on, framing_checks=self.framing_checks)
        self.ops.fsync_dir(self.layout.segment_dir)
        self.headers[seq] = SegmentHeader(FORMAT_VERSION, seq, self.store_id, supersedes)
        return self.writer

    def append(self, record_type: int, parts: list, segment_size: int) -> Loc:
        assert self.writer is not None
        size = rec.OVERHEAD + sum(len(p) for p in parts)
        if self.writer.offset > _header_len() and self.writer.offset + size > segment_size:
            self.roll(segment_size)  # fsyncs the full segment before leaving it
        return self.writer.append(record_type, parts)

    def append_image(self, buffers: list, segment_size: int) -> tuple[int, int]:
        """Append whole records laid out in ``buffers`` (format/image.py) without copying them;
        returns (segment seq, offset of their first byte). They go into one segment: a new one
        when they would take the current one past ``segment_size``."""
        assert self.writer is not None
        size = BLOCK + RECORD_OVERHEAD + sum(len(b) for b in buffers)  # (+ the largest pad)
        if self.writer.offset > _header_len() and self.writer.offset + size > segment_size:
            self.roll(segment_size)
        return self.writer.seq, self.writer.append_image(buffers)

    def discard_after(self, position: Position | None, quarantine: bool) -> None:
        """Cut the log back to ``position``: truncate its segment there and empty later segments.

        Later segments are deleted, highest first, down to the highest one whose header carries a
        gc watermark (``supersedes > 0``, a gc marker): that one and every one between it and the
        position are truncated to their header record instead. Deleting the marker would drop
        the watermark back, and every segment the gc collected would then count as missing.
        With ``quarantine`` the cut bytes are first copied to quarantine/ (fsynced), so a tail that
        may hold a damaged commit is kept for inspection instead of destroyed.
        """
        assert self.ops is not None
        if self.writer is not None:
            self.writer.quiesce()  # the files are read and cut below: no write may be in flight
        live = self.refresh_segments()
        cut_seq = position.seq if position is not None else 0
        cut_off = position.offset if position is not None else 0
        if quarantine:
            self._quarantine(live, cut_seq, cut_off)
        later = sorted((s for s in live if s > cut_seq), reverse=True)
        marker = next((s for s in later if s in self.headers and self.headers[s].supersedes > 0),
                      None)
        # Highest first, each unlink made durable before the next: a crash part-way leaves a
        # consecutive run of segments, never a gap that fsck would report as a missing file.
        for seq in later:
            if marker is not None and seq <= marker:
                self._truncate_segment(seq, _header_len())
                continue
            if self.writer is not None and self.writer.seq == seq:
                self.writer.close_fds()  # its staged bytes are cut with the file
                self.writer = None
            self.file(seq).close()
            self._files.pop(seq, None)
            self.headers.pop(seq, None)
            self.ops.unlink(self.layout.segment_path(seq))
            self.ops.fsync_dir(self.layout.segment_dir)
        if position is not None:
            self._truncate_segment(cut_seq, cut_off)

    def _truncate_segment(self, seq: int, offset: int) -> None:
        """Cut segment ``seq`` at ``offset`` (fsynced), through the appending writer when it is
        that segment's (its staged bytes after ``offset`` go too)."""
        assert self.ops is not None
        path = self.layout.segment_path(seq)
        live_writer = self.writer if self.writer is not None and self.writer.seq == seq else None
        if live_writer is not None:
            live_writer.quiesce()  # a background write in flight would change the size below
        if os.path.getsize(path) > offset:
            w = live_writer or SegmentWriter.reopen(path, seq, offset, self.ops,
                                                    framing_checks=self.framing_checks)
            w.truncate(offset)
            if w is not self.writer:
                w.close()
        elif live_writer is not None and live_writer.offset > offset:
            live_writer.rewind(offset)  # bytes staged for O_DIRECT only: none in the file

    def _quarantine(self, live: list[int], cut_seq: int, cut_off: int) -> None:
        assert self.ops is not None
        self.ops.makedirs(self.layout.quarantine_dir)
        for seq in live:
            if seq < cut_seq:
                continue
            start = cut_off if seq == cut_seq else 0
            f = self.file(seq)
            size = f.size()
            if size <= start or (seq > cut_seq and size <= _header_len()):
                continue  # nothing cut, or a header record alone (a gc marker is kept)
            dest = self.layout.quarantine_path(seq, start)
            fd = self.ops.open_truncate(dest)
            try:
                pos = start
                while pos < size:
                    block = f.pread(pos, min(8 << 20, size - pos))
                    self.ops.writev(fd, dest, [block], pos - start)
                    pos += len(block)
                self.ops.fsync(fd, dest)
                if self.evict_written:
                    self.ops.advise_written(fd, dest, 0, size - start)
            finally:
                os.close(fd)
        self.ops.fsync_dir(self.layout.quarantine_dir)


def _describe_damaged_record(f: SegmentFile, item: ScannedRecord) -> Damage:
    """A Damage for a record whose payload failed its check. For a CHUNK record the address in its
    (unverified) chunk header is kept, only to point fsck's per-tensor lines at this record when
    that address is one a verified tree names; nothing else is read from a failed payload, so no
    iteration is ever named from unverified bytes."""
    assert item.error is not None
    d = Damage(f.path, item.loc.offset, item.loc.end, item.type, item.error.reason)
    if item.type == rec.RecordType.CHUNK:
        try:
            d.address = decode_chunk_header(f.pread(item.loc.payload_offset, CHUNK_HEADER_SIZE)).address
        except (FormatError, OSError):
            pass
    return d


def _probe_commit(f: SegmentFile, region: CorruptRegion) -> Commit | None:
    """The commit held by a complete COMMIT record at ``region.start`` whose header is damaged.

    Where the record header is invalid, its type and length cannot be trusted, but a COMMIT
    payload has a fixed size: if the 96 bytes after the 24 header bytes pass the check stored
    in the 8 bytes after them and decode as a commit, a whole COMMIT record lies there and only
    its header changed (a random or torn byte range passes a 64-bit check with probability
    2^-64). A torn append never looks like this: its bytes end at the end of the file before the
    record's end, or hold zeros or garbage that fail the check.
    """
    if region.end - region.start < COMMIT_RECORD_SIZE:
        return None
    buf = f.pread(region.start, COMMIT_RECORD_SIZE)
    payload = buf[rec.HEADER_SIZE:rec.HEADER_SIZE + COMMIT_SIZE]
    try:
        rec.check_trailer(payload, buf[rec.HEADER_SIZE + COMMIT_SIZE:])
        return decode_commit(payload)
    except FormatError:
        return None


def _header_len() -> int:
    from .segments import SEGMENT_HEADER_RECORD_SIZE

    return SEGMENT_HEADER_RECORD_SIZE
