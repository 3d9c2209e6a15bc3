"""The write path: a flattened state -> the chunk, tree and manifest records of one checkpoint.

:func:`append_checkpoint` appends, into an open :class:`~ckptstore.engine.transaction.Transaction`:

1. new CHUNK records (chunks whose address the index, this save or an earlier checkpoint of the
   same transaction already holds are skipped),
2. a TREE record per tensor whose root is new,
3. the MANIFEST record,

and returns the index batch that stages the checkpoint. The transaction then makes it durable and
writes its COMMIT record (the commit point; format-spec/format.md, "Commit protocol"). A crash
before that leaves only an uncommitted tail, which recovery discards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import xxhash

from ..errors import FormatError, IndexUnusable
from ..format import records as rec
from ..format.chunk import (CHUNK_HEADER_SIZE, Codec, address_of, choose_encoding,
                           decode_chunk_header, encode_chunk_header)
from ..format.commit import COMMIT_SIZE, KIND_DELTA, KIND_SNAPSHOT, Commit
from ..format.image import LentFramer, seal_chunk, seal_pad
from ..format.manifest import INLINE_MAX, Manifest, TensorEntry, encode_manifest
from ..format.tree import decode_tree, encode_tree, make_tree, snapshot_root, tree_root
from ..storage.index import ChunkRef, Index
from ..storage.log import Log
from ..storage.segments import Loc
from ..format.state import flatten
from ..errors import UnsupportedTypeError
from ..tensors import ArrayLeaf, ImageTensor, LentTensor, no_leaves
from .transaction import StagedCheckpoint


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
    header are read and checked, not its data; for a FRAMING_CHECK record the trailer too, which
    covers the chunk header: a damaged codec or length is not deduplicated against). A malformed
    or wrong index entry reads as absent: the chunk is written again and its new location
    replaces the entry, so no commit ever depends on an index value the log does not confirm."""
    try:
        ref = index.get_chunk(address)
        if ref is None:
            return False
        f = log.file(ref.loc.seq)
        head = f.pread(ref.loc.offset, rec.HEADER_SIZE + CHUNK_HEADER_SIZE)
        header = rec.decode_header(head[:rec.HEADER_SIZE])
        chunk = decode_chunk_header(head[rec.HEADER_SIZE:])
        if header.framing_checked:
            rec.check_trailer(head[rec.HEADER_SIZE:], f.pread(ref.loc.payload_offset + ref.loc.length,
                                                              rec.TRAILER_SIZE), header)
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


class CheckpointTarget(Protocol):
    """Where a checkpoint's records go: an open transaction on the live log (reads of earlier
    records go through ``log``)."""

    log: Log

    def append(self, record_type: int, parts: Sequence[bytes | memoryview]) -> Loc: ...

    def append_image(self, buffers: Sequence[memoryview]) -> tuple[int, int]: ...


def chunk_size_for(leaves: Sequence[ArrayLeaf], default: int) -> int:
    """The chunk size a checkpoint of ``leaves`` uses: that of the chunk images its leaves lie
    in (format/image.py; written without a copy only at their own chunk size), else
    ``default``."""
    sizes = {leaf.image.image.chunk_size for leaf in leaves if leaf.image is not None}
    return sizes.pop() if len(sizes) == 1 else default


def flatten_meta(meta: Any) -> Any:
    """The skeleton of the user's meta (a dict of JSON-like values, or None)."""
    if meta is not None and type(meta) is not dict:
        raise UnsupportedTypeError(f"meta must be a dict, not {type(meta).__name__}")
    return flatten(meta, no_leaves)[0]


def append_checkpoint(target: CheckpointTarget, index: Index, iteration: int, skeleton: Any,
                      meta: Any, leaves: list[ArrayLeaf], *, chunk_size: int,
                      progress: Callable[[int], None] | None = None, kind: str = "snapshot",
                      extra: dict | None = None, stats_field: str | None = None,
                      pending: Sequence[StagedCheckpoint] = (),
                      trials: "CompressionTrials | None" = None) -> tuple[StagedCheckpoint, SaveStats]:
    """Append one checkpoint's records to ``target``. Returns what the transaction stages (it
    writes the COMMIT) and the save's stats. ``trials``: the writer's memory of which chunks of
    imaged tensors did not compress (see :class:`CompressionTrials`).

    ``kind``/``extra``: manifest kind ("delta" for gradient deltas, format-spec/deltas.md) and its
    extra manifest fields. ``stats_field``: name of a dict in ``extra`` (the async pipeline's
    "pipeline" field, format-spec/format.md section 10) that receives ``dedup_bytes`` and
    ``write_s`` (seconds spent hashing, compressing and appending before the manifest) just before
    the manifest is encoded. ``pending``: the checkpoints staged earlier in the same
    transaction; their new chunks and trees deduplicate like indexed ones. Safe by this invariant:
    their records lie in the log before this save's, are made durable by the same fsync before any
    COMMIT of the transaction, and are only ever cut together with this save (an abort cuts from
    the transaction's start; a failed save rolls back to its own savepoint, after them), so a
    commit never names a record the log does not keep before it.

    The caller owns rollback: on any exception nothing has been committed, and the target must be
    rolled back to where this save began.
    """
    t0 = time.perf_counter()
    created_ns = time.time_ns()
    log = target.log
    new_chunks: dict[bytes, ChunkRef] = {}
    new_trees: dict[bytes, Loc] = {}
    entries: list[TensorEntry] = []
    roots: list[tuple[str, bytes]] = []
    written = dedup = n_written = n_dedup = 0
    in_group_chunks = [b.chunks for b in pending]
    in_group_trees = [b.trees for b in pending]

    def append(rtype: int, parts: list) -> Loc:
        nonlocal written
        loc = target.append(rtype, parts)
        written += loc.end - loc.offset
        return loc

    # tensors lying in chunk images: framed now, written after the loop
    images = _ImageBatch(log.framing_checks)

    def chunk_known(addr: bytes) -> bool:
        return addr in new_chunks or addr in images.addresses or \
            any(addr in c for c in in_group_chunks) or stored_chunk(log, index, addr)

    def append_tree(tree: Any) -> None:
        if tree.root not in new_trees and not any(tree.root in t for t in in_group_trees) and \
                not stored_tree(log, index, tree.root):
            new_trees[tree.root] = append(rec.RecordType.TREE, [encode_tree(tree)])

    for leaf in leaves:
        name = leaf.name  # (a path joined anew on every access)
        image = leaf.image
        lent = leaf.lent
        if lent is not None and leaf.nbytes > INLINE_MAX:
            tree = images.frame_lent(lent, chunk_size, chunk_known, progress, name, trials)
            entries.append(TensorEntry(name, leaf.lib, leaf.dtype, leaf.shape, leaf.nbytes,
                                       tree.root, None, leaf.param, leaf.requires_grad))
            roots.append((name, tree.root))
            continue
        if image is not None and image.image.chunk_size == chunk_size and leaf.nbytes > INLINE_MAX:
            tree = images.frame(image, chunk_known, progress, name, trials)
            entries.append(TensorEntry(name, leaf.lib, leaf.dtype, leaf.shape, leaf.nbytes,
                                       tree.root, None, leaf.param, leaf.requires_grad))
            roots.append((name, tree.root))
            continue
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
                if chunk_known(addr):
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
            append_tree(tree)
        entries.append(TensorEntry(name, leaf.lib, leaf.dtype, leaf.shape, nbytes, root, inline,
                                   leaf.param, leaf.requires_grad))
        roots.append((name, root))

    written += images.write(target, new_chunks)
    n_written += images.n_new
    n_dedup += images.n_known
    dedup += images.known_bytes
    for tree in images.trees:
        append_tree(tree)
    extra = dict(extra or {})
    if stats_field is not None:
        extra[stats_field] = dict(extra.get(stats_field) or {}, dedup_bytes=dedup,
                                  write_s=round(time.perf_counter() - t0, 6))
    manifest = Manifest(iteration, created_ns, chunk_size, skeleton, meta, tuple(entries), kind, extra)
    payload = encode_manifest(manifest)
    mloc = append(rec.RecordType.MANIFEST, [payload])
    sroot = snapshot_root(roots)
    logical = manifest.logical_bytes
    commit = Commit(iteration, mloc.seq, mloc.offset, mloc.length, xxhash.xxh3_128_digest(payload),
                    sroot, created_ns, logical, written + rec.OVERHEAD + COMMIT_SIZE,
                    KIND_DELTA if kind == "delta" else KIND_SNAPSHOT)
    stats = SaveStats(iteration, logical, written, dedup, n_written, n_dedup, len(leaves),
                      time.perf_counter() - t0, sroot.hex())
    return StagedCheckpoint(commit, new_chunks, new_trees), stats


class CompressionTrials:
    """Which chunks of a writer's imaged tensors (captured gradients, deltas after deltas, the
    pipeline's snapshots) are worth a compression trial. A chunk whose trial saved less than
    ``min_saving`` of its bytes (nothing, or too little to pay for compressing it every time)
    skips its next ``skip`` trials (stored raw meanwhile); one that compressed better is tried
    every time. Float weights, moments and gradients do not compress, so this saves most of the
    trials' cost; a chunk that turns compressible is stored raw at most ``skip`` times before it
    is found (writer policy: any chunk may be raw)."""

    def __init__(self, skip: int = 3, capacity: int = 1 << 16, min_saving: float = 0.25) -> None:
        self.skip = skip
        self.capacity = capacity
        #: the least fraction of a chunk lz4 must save for the chunk to be tried again next time
        #: (an AdamW second moment of an embedding, its untouched rows zero, saves ~14%: 2.5 ms
        #: of lz4 per 4 MiB chunk for 0.6 MB less to write, which costs the device far less)
        self.min_saving = min_saving
        self._wait: dict[tuple[str, int], int] = {}

    def due(self, name: str, j: int) -> bool:
        key = (name, j)
        left = self._wait.get(key, 0)
        if left > 0:
            self._wait[key] = left - 1
            return False
        return True

    def record(self, name: str, j: int, raw_length: int, stored_length: int) -> None:
        """The trial of chunk ``j`` of ``name`` stored ``raw_length`` bytes in ``stored_length``."""
        if stored_length <= raw_length * (1 - self.min_saving):
            self._wait.pop((name, j), None)
        else:
            if len(self._wait) >= self.capacity:
                self._wait.clear()
            self._wait[(name, j)] = self.skip


class _ImageBatch:
    """The CHUNK records of the tensors of one checkpoint that lie in chunk images
    (format/image.py): each tensor is framed in place by :meth:`frame`, then :meth:`write` appends
    them all at once, straight from the images' memory, adjacent images as one write. Chunks
    already stored are left out (each record owns a block-aligned span, so what remains stays
    aligned); chunks that compress are appended compressed after the images. Lent tensors
    (:meth:`frame_lent`) are written in the same write after the images, from their owner's
    memory, framed by one :class:`~ckptstore.format.image.LentFramer` (one gap buffer)."""

    def __init__(self, framing_checks: bool) -> None:
        #: records are framed with FRAMING_CHECK trailers (the store's STORE flag)
        self.framing_checks = framing_checks
        #: what to write, in order: [buffer, start, end) spans of image memory (adjacent ones
        #: merged), then the lent tensors' gaps and middles (memoryviews, LentFramer)
        self.runs: list[Any] = []
        #: (address, offset in the written bytes, payload length) of each framed record
        self.framed: list[tuple[bytes, int, int]] = []
        self.addresses: set[bytes] = set()  # of the chunks framed or packed so far
        self.packed: list[tuple[bytes, Any, int]] = []  # (address, lz4 data, raw length)
        self.trees: list[Any] = []
        self.n_known = self.known_bytes = self.out = 0
        #: the lent tensors' records, written after the images (one framer: one gap buffer)
        self.lent = LentFramer(framing_checks)
        #: (address, offset in the framer's bytes, payload length) of each lent record
        self.lent_framed: list[tuple[bytes, int, int]] = []

    @property
    def n_new(self) -> int:
        return len(self.framed) + len(self.lent_framed) + len(self.packed)

    def _raw_address(self, piece: memoryview, j: int, known: Callable[[bytes], bool],
                     progress: Callable[[int], None] | None, name: str,
                     trials: "CompressionTrials | None", addresses: list[bytes]) -> bytes | None:
        """Chunk ``j`` (``piece``) of tensor ``name``: its address, appended to ``addresses``,
        when it is to be written raw where it lies; None when it is not written there (already
        stored, counted as known; or compressible, queued compressed in :attr:`packed`)."""
        n = len(piece)
        addr = address_of(piece)
        addresses.append(addr)
        if progress is not None:
            progress(n)
        if known(addr):
            self.n_known += 1
            self.known_bytes += n
            return None
        self.addresses.add(addr)
        if trials is None or trials.due(name, j):
            codec, data = choose_encoding(piece)
            if trials is not None:
                trials.record(name, j, n, len(data))
            if codec is not Codec.RAW:
                self.packed.append((addr, data, n))
                return None
        return addr

    def frame(self, tensor: ImageTensor, known: Callable[[bytes], bool],
              progress: Callable[[int], None] | None, name: str,
              trials: "CompressionTrials | None") -> Any:
        """Hash and frame ``tensor``'s chunks; returns its tree (appended by the caller after
        the images)."""
        geo = tensor.image
        buf = tensor.memory()
        addresses: list[bytes] = []
        last = geo.n_chunks - 1
        for j in range(geo.n_chunks):
            start = geo.data_offset(j)
            n = geo.data_length(j)
            piece = buf[start:start + n]
            addr = self._raw_address(piece, j, known, progress, name, trials, addresses)
            if addr is None:
                continue
            lo, hi = geo.span(j)
            seal_chunk(buf, lo, addr, n, self.framing_checks)
            if j == last and geo.pad:
                seal_pad(buf, geo.records_end, geo.pad, self.framing_checks)
            self.framed.append((addr, self.out, CHUNK_HEADER_SIZE + n))
            self.out += hi - lo
            lo += tensor.offset
            hi += tensor.offset
            if self.runs and isinstance(self.runs[-1], list) and \
                    self.runs[-1][0] is tensor.buffer and self.runs[-1][2] == lo:
                self.runs[-1][2] = hi
            else:
                self.runs.append([tensor.buffer, lo, hi])
        tree = make_tree(geo.nbytes, geo.chunk_size, addresses)
        self.trees.append(tree)
        return tree

    def frame_lent(self, lent: LentTensor, chunk_size: int, known: Callable[[bytes], bool],
                   progress: Callable[[int], None] | None, name: str,
                   trials: "CompressionTrials | None") -> Any:
        """Hash and frame the chunks of ``lent`` (a lent tensor, format/image.py's
        :class:`~ckptstore.format.image.LentFramer`: written from its owner's memory, after the
        images) at ``chunk_size``; returns its tree (appended by the caller after the images)."""
        mem = lent.memory()
        addresses: list[bytes] = []
        for j, start in enumerate(range(0, lent.nbytes, chunk_size)):
            piece = mem[start:start + chunk_size]
            addr = self._raw_address(piece, j, known, progress, name, trials, addresses)
            if addr is not None:
                self.lent_framed.append((addr, self.lent.add(piece, lent.address + start, addr),
                                         CHUNK_HEADER_SIZE + len(piece)))
        tree = make_tree(lent.nbytes, chunk_size, addresses)
        self.trees.append(tree)
        return tree

    def write(self, target: CheckpointTarget, new_chunks: dict[bytes, ChunkRef]) -> int:
        """Append everything framed, then the compressed chunks; index them in ``new_chunks``.
        Returns the bytes appended."""
        out = 0
        lent_at = self.out  # the lent records follow the images (which end on a block boundary)
        if self.lent_framed:
            lent = self.lent.buffers()
            self.out += sum(len(b) for b in lent)
            self.runs.extend(lent)
        if self.runs:
            buffers = [r if isinstance(r, memoryview) else memoryview(r[0][r[1]:r[2]].numpy())
                       for r in self.runs]
            seq, base = target.append_image(buffers)
            for addr, off, length in self.framed:
                new_chunks[addr] = ChunkRef(Loc(seq, base + off, length), int(Codec.RAW))
            for addr, off, length in self.lent_framed:
                new_chunks[addr] = ChunkRef(Loc(seq, base + lent_at + off, length), int(Codec.RAW))
            out += self.out
        for addr, data, n in self.packed:
            loc = target.append(rec.RecordType.CHUNK, [encode_chunk_header(addr, Codec.LZ4, n), data])
            new_chunks[addr] = ChunkRef(loc, int(Codec.LZ4))
            out += loc.end - loc.offset
        return out
