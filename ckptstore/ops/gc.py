"""gc: a retention policy, then compaction of the survivors into fresh segments.

Protocol (format-spec/format.md, "Garbage collection"), with W = the highest live segment seq:

1. For each kept checkpoint, oldest first, copy its records into temp files ``<seq>.seg.gc-tmp``
   (seq > W): every chunk and tree it needs that was not copied yet (each verified while copied),
   its manifest (same bytes), then a COMMIT naming the manifest's new location.
2. A final, record-less segment whose header says ``supersedes = W``.
3. fsync every temp file; rename the copies into place in seq order, fsyncing the directory
   after each rename (so a power loss keeps a prefix of them: never a later copy without an
   earlier one, a gap fsck would report as a missing segment); rename the final segment; fsync
   the directory: **the gc commit point** — from here every segment <= W is obsolete, whether or
   not it still exists.
4. Delete the segments <= W; fsync the directory; rebuild the index from the new segments.

A crash before 3 completes leaves temp files (deleted on the next writer open) and possibly renamed
copies that duplicate live checkpoints (harmless: replay lets a later copy of the same commit win).
A crash after it leaves obsolete segments, which the next writer open deletes. Either way every
kept checkpoint stays readable, and a damaged chunk aborts gc before anything is renamed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import DamagedCheckpointError, FormatError
from ..format import records as rec
from ..format.chunk import decode_chunk
from ..format.commit import KIND_DELTA, Commit
from ..format.manifest import decode_committed_manifest
from ..format.tree import decode_tree
from ..storage.index import Index
from ..storage.segments import SEGMENT_HEADER_RECORD_SIZE, Loc, SegmentWriter
from ..engine.transaction import append_commit_record
from ..engine.writer_engine import WriterEngine


@dataclass(frozen=True)
class GcReport:
    kept: list[int]
    removed: list[int]
    bytes_before: int
    bytes_after: int
    seconds: float


def retained(iterations: list[int], keep_last: int, keep_every: int | None) -> list[int]:
    """The iterations a policy keeps: the newest ``keep_last`` plus every multiple of ``keep_every``.

    ``keep_last`` must be >= 1 so the latest iteration always survives (iterations keep increasing).
    """
    if type(keep_last) is not int or keep_last < 1:
        raise ValueError("keep_last must be an int >= 1 (the latest checkpoint is always kept)")
    if keep_every is not None and (type(keep_every) is not int or keep_every < 1):
        raise ValueError("keep_every must be a positive int")
    keep = set(iterations[-keep_last:])
    if keep_every:
        keep.update(i for i in iterations if i % keep_every == 0)
    return sorted(keep)


def with_chains(index: Index, keep: list[int]) -> list[int]:
    """Add to ``keep`` every iteration a kept delta needs: its predecessors back to its base
    snapshot (format-spec/deltas.md, "Garbage collection"). A base is never removed while a
    retained delta depends on it."""
    out = set(keep)
    for it in keep:
        p = it
        while True:
            e = index.get_commit(p)
            if e is None or e.commit.kind != KIND_DELTA:
                break
            p -= 1
            if p in out:
                break
            if index.get_commit(p) is not None:
                out.add(p)
    return sorted(out)


class _Compactor:
    """Writes the copies into temp segments, rolling at the store's segment size."""

    def __init__(self, engine: WriterEngine, first_seq: int) -> None:
        self.engine = engine
        self.ops = engine.file_ops
        self.seq = first_seq
        self.temps: list[tuple[int, str]] = []
        self.writer: SegmentWriter | None = None
        self.chunks: set[bytes] = set()
        self.trees: set[bytes] = set()

    def new_segment(self, supersedes: int = 0) -> SegmentWriter:
        """Start the next temp segment (fsyncing and closing the current one)."""
        if self.writer is not None:
            self.writer.sync()
            self.writer.close()
        path = self.engine.layout.gc_temp_path(self.seq)
        self.writer = SegmentWriter.create(path, self.seq, self.engine.header.store_id, self.ops,
                                           supersedes, self.engine.evict_written)
        self.temps.append((self.seq, path))
        self.seq += 1
        return self.writer

    def append(self, rtype: int, parts: Sequence[bytes | memoryview]) -> Loc:
        """Append one record to the current temp segment, rolling at the store's segment size
        (a :class:`~ckptstore.engine.transaction.RecordAppender`)."""
        w = self.writer or self.new_segment()
        if w.offset > SEGMENT_HEADER_RECORD_SIZE and \
                w.offset + rec.OVERHEAD + sum(len(p) for p in parts) > self.engine.segment_size:
            w = self.new_segment()
        return w.append(rtype, parts)

    def copy_checkpoint(self, iteration: int, progress: Callable[[int], None] | None) -> None:
        engine = self.engine
        entry = engine.index.get_commit(iteration)
        assert entry is not None
        c = entry.commit
        mloc = Loc(c.manifest_seq, c.manifest_offset, c.manifest_length)
        try:
            payload = engine.log.read_payload(mloc)
            manifest = decode_committed_manifest(payload, c.manifest_digest, c.iteration)
            for t in manifest.tensors:
                if t.inline is not None or t.nbytes == 0 or t.root in self.trees:
                    continue
                tloc = engine.index.get_tree(t.root)
                if tloc is None:
                    raise FormatError(f"tree of tensor {t.path} is missing")
                tree_payload = engine.log.read_payload(tloc)
                tree = decode_tree(tree_payload)
                for addr in tree.addresses:
                    if addr in self.chunks:
                        continue
                    ref = engine.index.get_chunk(addr)
                    if ref is None:
                        raise FormatError(f"chunk {addr.hex()} of tensor {t.path} is missing")
                    chunk_payload = engine.log.read_payload(ref.loc)  # record checks
                    header, _ = decode_chunk(chunk_payload)           # address check
                    if header.address != addr:
                        raise FormatError(f"index points chunk {addr.hex()} at another chunk")
                    self.append(rec.RecordType.CHUNK, [chunk_payload])
                    self.chunks.add(addr)
                    if progress is not None:
                        progress(len(chunk_payload))
                self.append(rec.RecordType.TREE, [tree_payload])
                self.trees.add(t.root)
        except FormatError as e:  # I/O errors propagate as StoreIOError (typed, nothing changed)
            raise DamagedCheckpointError(
                f"gc aborted, nothing changed: iteration {iteration} cannot be copied: {e}; "
                "run `ckptstore fsck` to locate the damage") from e
        new_mloc = self.append(rec.RecordType.MANIFEST, [payload])
        moved = Commit(c.iteration, new_mloc.seq, new_mloc.offset, new_mloc.length, c.manifest_digest,
                       c.snapshot_root, c.created_ns, c.logical_bytes, c.written_bytes, c.kind)
        append_commit_record(self, moved)

    def abort(self) -> None:
        """Best effort: delete the temp files (any left over are deleted by the next gc or the
        next writer open; they are never replayed)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        for _, path in self.temps:
            try:
                self.ops.unlink(path)
            except OSError:
                pass


def collect(engine: WriterEngine, *, keep_last: int, keep_every: int | None = None,
            progress: Callable[[int], None] | None = None) -> GcReport:
    """Drop the checkpoints the policy does not keep and compact the log. The caller holds the
    engine's lock with no transaction open (pending deltas committed first)."""
    t0 = time.perf_counter()
    layout = engine.layout
    iterations = engine.index.iterations()
    keep = with_chains(engine.index, retained(iterations, keep_last, keep_every))
    removed = [i for i in iterations if i not in set(keep)]
    live = engine.log.refresh_segments()
    bytes_before = sum(os.path.getsize(layout.segment_path(s)) for s in live)
    if not live:
        return GcReport(keep, removed, 0, 0, time.perf_counter() - t0)
    watermark = live[-1]
    # Temp files of an earlier gc that failed in this process (its abort could not delete them)
    # would collide with this gc's names; they are never replayed, so delete them first.
    for tmp in layout.list_gc_temps():
        engine.file_ops.unlink(tmp)
    compactor = _Compactor(engine, watermark + 1)
    try:
        for it in keep:
            compactor.copy_checkpoint(it, progress)
        compactor.new_segment(supersedes=watermark)  # the record-less marker segment
        assert compactor.writer is not None
        compactor.writer.sync()
        compactor.writer.close()
        compactor.writer = None
    except BaseException:
        compactor.abort()
        raise
    *copies, marker = compactor.temps
    try:
        engine.install_compaction(copies, marker)
    except BaseException:
        compactor.abort()
        raise
    bytes_after = sum(os.path.getsize(layout.segment_path(s)) for s in engine.log.refresh_segments())
    return GcReport(keep, removed, bytes_before, bytes_after, time.perf_counter() - t0)
