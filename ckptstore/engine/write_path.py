"""The write path: a flattened state -> chunk, tree, manifest and commit records.

Order of writes for one checkpoint (format-spec/format.md, "Commit protocol"):

1. new CHUNK records (chunks whose address the index or this save already holds are skipped),
2. a TREE record per tensor whose root is new,
3. the MANIFEST record,
4. fsync every segment written (rolled segments are fsynced when they are left),
5. the COMMIT record, then fsync: **the commit point**,
6. one index transaction naming everything above.

A crash before 5 completes leaves only an uncommitted tail, which recovery discards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import xxhash

from ..errors import FormatError, IndexUnusable
from ..format import records as rec
from ..format.chunk import (CHUNK_HEADER_SIZE, address_of, choose_encoding, decode_chunk_header,
                           encode_chunk_header)
from ..format.commit import COMMIT_SIZE, KIND_DELTA, KIND_SNAPSHOT, Commit, encode_commit
from ..format.manifest import INLINE_MAX, Manifest, TensorEntry, encode_manifest
from ..format.tree import decode_tree, encode_tree, make_tree, snapshot_root, tree_root
from ..storage.index import ChunkRef, CommitEntry, Index, IndexBatch, Position
from ..storage.log import Log
from ..storage.segments import Loc
from ..tensors import ArrayLeaf


@dataclass(frozen=True)
class SaveStats:
    """What one save did. ``dedup_bytes`` were found already stored and not written again."""

    iteration: int
    logical_bytes: int
    written_bytes: int
    dedup_bytes: int
    chunks_written: int
    chunks_deduped: int
    tensors: int
    seconds: float
    snapshot_root: str


def stored_chunk(log: Log, index: Index, address: bytes) -> bool:
    """Whether the log holds chunk ``address`` where the index says (its record header and chunk
    header are read and checked, not its data). A malformed or wrong index entry reads as absent:
    the chunk is written again and its new location replaces the entry, so no commit ever depends
    on an index value the log does not confirm."""
    try:
        ref = index.get_chunk(address)
        if ref is None:
            return False
        head = log.file(ref.loc.seq).pread(ref.loc.offset, rec.HEADER_SIZE + CHUNK_HEADER_SIZE)
        header = rec.decode_header(head[:rec.HEADER_SIZE])
        chunk = decode_chunk_header(head[rec.HEADER_SIZE:])
    except (IndexUnusable, FormatError, OSError):
        return False
    return header.type == rec.RecordType.CHUNK and header.length == ref.loc.length and \
        chunk.address == address


def stored_tree(log: Log, index: Index, root: bytes) -> bool:
    """Whether the log holds the TREE record of ``root`` where the index says (read and decoded);
    like :func:`stored_chunk`, a wrong index entry reads as absent."""
    try:
        loc = index.get_tree(root)
        return loc is not None and decode_tree(log.read_payload(loc)).root == root
    except (IndexUnusable, FormatError, OSError):
        return False


def write_snapshot(log: Log, index: Index, iteration: int, skeleton: Any, meta: Any,
                   leaves: list[ArrayLeaf], *, chunk_size: int, segment_size: int,
                   progress: Callable[[int], None] | None = None, kind: str = "snapshot",
                   extra: dict | None = None, defer_commit: bool = False,
                   stats_field: str | None = None,
                   pending: Sequence[IndexBatch] = ()) -> tuple[IndexBatch, SaveStats]:
    """Append one checkpoint and make it durable. Returns the index batch to apply and stats.

    ``kind``/``extra``: manifest kind ("delta" for gradient deltas, format-spec/deltas.md) and its
    extra manifest fields. With ``defer_commit`` (group commit of deltas) nothing is fsynced and no
    COMMIT record is appended: the returned batch holds the commit with ``loc=None`` and no
    position; the caller fsyncs, appends the commit and fsyncs again (Store.flush).
    ``stats_field``: name of a dict in ``extra`` (the async pipeline's "pipeline" field,
    format-spec/format.md section 10) that receives ``dedup_bytes`` and ``write_s`` (seconds spent
    hashing, compressing and appending before the manifest) just before the manifest is encoded.
    ``pending``: the batches of the earlier, not yet committed deltas of this group commit; their
    new chunks and trees deduplicate like indexed ones. Safe by this invariant: their records lie
    in the log before this save's, are made durable by the same fsync before any COMMIT of the
    group, and are only ever cut together with this save (a group rollback cuts from the group's
    start; a failed save cuts from its own start, after them), so a commit never names a record
    the log does not keep before it.

    The caller owns rollback: on any exception nothing has been committed, and the log must be cut
    back to where this save began.
    """
    t0 = time.perf_counter()
    created_ns = time.time_ns()
    assert log.writer is not None
    new_chunks: dict[bytes, ChunkRef] = {}
    new_trees: dict[bytes, Loc] = {}
    entries: list[TensorEntry] = []
    roots: list[tuple[str, bytes]] = []
    written = dedup = n_written = n_dedup = 0
    in_group_chunks = [b.chunks for b in pending]
    in_group_trees = [b.trees for b in pending]

    def append(rtype: int, parts: list) -> Loc:
        nonlocal written
        loc = log.append(rtype, parts, segment_size)
        written += loc.end - loc.offset
        return loc

    for leaf in leaves:
        view = leaf.byte_view()
        nbytes = len(view)
        inline = None
        if nbytes <= INLINE_MAX:
            addresses = [address_of(view)] if nbytes else []
            root = tree_root(nbytes, chunk_size, addresses)
            inline = bytes(view)
        else:
            addresses = []
            for start in range(0, nbytes, chunk_size):
                piece = view[start:start + chunk_size]
                addr = address_of(piece)
                addresses.append(addr)
                if addr in new_chunks or any(addr in c for c in in_group_chunks) or \
                        stored_chunk(log, index, addr):
                    dedup += len(piece)
                    n_dedup += 1
                else:
                    codec, data = choose_encoding(piece)
                    loc = append(rec.RecordType.CHUNK, [encode_chunk_header(addr, codec, len(piece)), data])
                    new_chunks[addr] = ChunkRef(loc, int(codec))
                    n_written += 1
                if progress is not None:
                    progress(len(piece))
            tree = make_tree(nbytes, chunk_size, addresses)
            root = tree.root
            if root not in new_trees and not any(root in t for t in in_group_trees) and \
                    not stored_tree(log, index, root):
                new_trees[root] = append(rec.RecordType.TREE, [encode_tree(tree)])
        entries.append(TensorEntry(leaf.name, leaf.lib, leaf.dtype, leaf.shape, nbytes, root, inline,
                                   leaf.param, leaf.requires_grad))
        roots.append((leaf.name, root))

    extra = dict(extra or {})
    if stats_field is not None:
        extra[stats_field] = dict(extra.get(stats_field) or {}, dedup_bytes=dedup,
                                  write_s=round(time.perf_counter() - t0, 6))
    manifest = Manifest(iteration, created_ns, chunk_size, skeleton, meta, tuple(entries), kind, extra)
    payload = encode_manifest(manifest)
    mloc = append(rec.RecordType.MANIFEST, [payload])
    if not defer_commit:
        log.writer.sync()
    sroot = snapshot_root(roots)
    logical = manifest.logical_bytes
    commit = Commit(iteration, mloc.seq, mloc.offset, mloc.length, xxhash.xxh3_128_digest(payload),
                    sroot, created_ns, logical, written + rec.OVERHEAD + COMMIT_SIZE,
                    KIND_DELTA if kind == "delta" else KIND_SNAPSHOT)
    if defer_commit:
        stats = SaveStats(iteration, logical, written, dedup, n_written, n_dedup, len(leaves),
                          time.perf_counter() - t0, sroot.hex())
        return IndexBatch(new_chunks, new_trees, [CommitEntry(commit, None)], None), stats  # type: ignore[arg-type]
    cloc = append(rec.RecordType.COMMIT, [encode_commit(commit)])
    log.writer.sync()  # the commit point
    batch = IndexBatch(new_chunks, new_trees, [CommitEntry(commit, cloc)], Position(cloc.seq, cloc.end))
    stats = SaveStats(iteration, logical, written, dedup, n_written, n_dedup, len(leaves),
                      time.perf_counter() - t0, sroot.hex())
    return batch, stats
