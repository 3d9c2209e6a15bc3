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

Which checkpoints are kept is decided by a retention policy (:mod:`ckptstore.ops.retention`: keep
the last N, every K-th, the best N by a meta metric, everything newer than an age or since an
iteration, and unions of these), then closed under the delta chain rule. A dry run
(``dry_run=True``) plans the same and estimates the bytes gc would leave by adding up the records
it would copy (sizes from the index, trees read), writing nothing.

**Rebasing on follower bases** (opt-in: a :class:`RebaseSource`, ``gc --follower-bases``;
format-spec/follower.md section 6). The closure may stop at a kept delta *t* for which a shadow
follower holds a base that passed every check (:meth:`RebaseSource.usable`); in step 1 that
iteration is then copied as a *snapshot*: the follower base's chunks and trees (verified while
copied, from the follower store), a new manifest (the follower base's tensors and state, the
primary delta's meta and ``created_ns``, a ``rebased`` field naming what it replaced) and a
snapshot COMMIT. The deltas below it that nothing else keeps are dropped like any unkept
iteration. The copied store needs nothing of the follower store: it is complete on its own. A
crash between copies and marker (the middle row of the crash table) leaves that iteration
committed twice, as the old delta and, later in log order, as the snapshot: the snapshot wins,
and holds the same state.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Protocol, Sequence

import xxhash

from ..errors import DamagedCheckpointError, FormatError
from ..format import records as rec
from ..format.chunk import decode_chunk
from ..format.commit import COMMIT_SIZE, KIND_NAMES, KIND_SNAPSHOT, Commit
from ..format.manifest import Manifest, decode_committed_manifest, encode_manifest
from ..format.state import unflatten
from ..format.tree import decode_tree, snapshot_root
from ..storage.index import Index
from ..storage.segments import SEGMENT_HEADER_RECORD_SIZE, Loc, SegmentWriter
from ..engine.engine import Engine
from ..engine.transaction import append_commit_record
from ..engine.writer_engine import WriterEngine
from .retention import (Checkpoint, KeepEvery, KeepLast, Policy, RetentionPlan, chain_closure,
                        plan_retention)


class RebaseSource(Protocol):
    """Snapshots gc may put in place of kept deltas (:class:`ckptstore.replay.follower.
    FollowerRebaser`: a shadow follower's verified bases). Call order: :meth:`usable` during
    planning (for the deltas the closure reaches), then, for each delta the plan rebases,
    :meth:`manifest_extra`, :meth:`base_manifest` and reads of :attr:`engine` while copying."""

    #: bases looked at and refused (iteration, or -1 for the whole source) -> why
    skipped: dict[int, str]

    @property
    def engine(self) -> Engine:
        """The store holding the bases (read only: gc copies their records from it)."""
        ...

    def usable(self, iteration: int) -> bool:
        """Whether the base at ``iteration`` holds exactly the state of the primary's delta
        ``iteration`` (every check passed); may be costly, the answer is cached."""
        ...

    def manifest_extra(self, iteration: int) -> dict:
        """The extra manifest fields of the snapshot gc makes of the base at ``iteration``."""
        ...

    def base_manifest(self, iteration: int) -> Manifest:
        """The manifest of what gc copies for the base at ``iteration``, read from
        :attr:`engine` (the whole base, or one rank's part of a job's base)."""
        ...


def rebased_manifest(primary: Manifest, base: Manifest, extra: dict) -> Manifest:
    """The manifest of the snapshot that replaces the primary's delta manifest ``primary`` with
    the state of ``base`` (a verified follower base of the same iteration): its tensors, state and
    chunk size; the delta's iteration, ``created_ns`` and meta (retention and ``store.meta`` see
    what they saw); ``extra`` (its provenance)."""
    return Manifest(primary.iteration, primary.created_ns, base.chunk_size, base.state, primary.meta,
                    base.tensors, "snapshot", dict(extra))


@dataclass(frozen=True)
class GcReport:
    """What a gc did (or, with ``dry_run``, would do).

    ``bytes_before`` / ``bytes_after``: the live segments' sizes before and after; for a dry run
    ``bytes_after`` is an estimate (``estimated``): the sizes of the records gc would copy,
    from the index, laid out as gc lays them out. ``compacted``: False when nothing was written
    (a dry run, or an automatic retention run that had nothing to remove). ``added``: kept
    iterations the policy did not select (the latest one and the chains of kept deltas)."""

    kept: list[int]
    removed: list[int]
    bytes_before: int
    bytes_after: int
    seconds: float
    dry_run: bool = False
    estimated: bool = False
    compacted: bool = True
    added: tuple[int, ...] = ()
    policy: str = ""
    #: kept deltas replaced by snapshots made from follower bases (``follower_bases=True``)
    rebased: tuple[int, ...] = ()
    #: follower bases looked at and not used, with why ((-1, why): the follower store itself)
    rebase_skipped: tuple[tuple[int, str], ...] = ()

    @property
    def bytes_freed(self) -> int:
        return self.bytes_before - self.bytes_after


def retained(iterations: list[int], keep_last: int, keep_every: int | None) -> list[int]:
    """The iterations a policy keeps: the newest ``keep_last`` plus every multiple of ``keep_every``
    (:class:`~ckptstore.ops.retention.KeepLast` | :class:`~ckptstore.ops.retention.KeepEvery`),
    before the chain closure.

    ``keep_last`` must be >= 1 so the latest iteration always survives (iterations keep increasing).
    """
    if type(keep_last) is not int or keep_last < 1:
        raise ValueError("keep_last must be an int >= 1 (the latest checkpoint is always kept)")
    if keep_every is not None and (type(keep_every) is not int or keep_every < 1):
        raise ValueError("keep_every must be a positive int")
    policy: Policy = KeepLast(keep_last) if keep_every is None else KeepLast(keep_last) | KeepEvery(keep_every)
    cps = [Checkpoint(i, "snapshot", 0) for i in sorted(iterations)]
    return sorted(policy.select(cps, 0))


def layout_of(index: Index) -> list[tuple[int, str]]:
    """(iteration, "snapshot" | "delta") of every committed iteration, ascending."""
    return [(it, KIND_NAMES.get(kind, "unknown")) for it, kind in index.kinds()]


def with_chains(index: Index, keep: list[int]) -> list[int]:
    """Add to ``keep`` every iteration a kept delta needs: its predecessors back to its base
    snapshot (format-spec/deltas.md, "Garbage collection"; :func:`~ckptstore.ops.retention.
    chain_closure`). A base is never removed while a retained delta depends on it."""
    return sorted(chain_closure(layout_of(index), keep))


def gc_policy(keep_last: int | None, keep_every: int | None, policy: Policy | None) -> Policy:
    """The policy of :meth:`ckptstore.Store.gc`'s arguments: the union of ``KeepLast(keep_last)``,
    ``KeepEvery(keep_every)`` and ``policy`` (those given). Keeps the old messages for bad
    ``keep_last`` / ``keep_every``."""
    if isinstance(keep_last, Policy) or isinstance(keep_every, Policy):
        raise TypeError("a retention policy is passed as policy=: store.gc(policy=KeepLast(5)); "
                        "the first two positional arguments are keep_last and keep_every (ints)")
    if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
        raise ValueError("keep_last must be an int >= 1 (the latest checkpoint is always kept)")
    if keep_every is not None and (type(keep_every) is not int or keep_every < 1):
        raise ValueError("keep_every must be a positive int")
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(f"policy must be a retention policy (ckptstore.ops.retention), not {policy!r}")
    parts: list[Policy] = []
    if keep_last is not None:
        parts.append(KeepLast(keep_last))
    if keep_every is not None:
        parts.append(KeepEvery(keep_every))
    if policy is not None:
        parts.append(policy)
    if not parts:
        raise TypeError("gc needs a retention policy: keep_last (with keep_every) or policy=")
    out = parts[0]
    for p in parts[1:]:
        out = out | p
    return out


def checkpoints_of(engine: Engine, with_meta: bool,
                   meta_cache: dict[int, Any] | None = None) -> list[Checkpoint]:
    """Every committed iteration of ``engine`` as a :class:`~ckptstore.ops.retention.Checkpoint`,
    ascending; the meta is read (one manifest per iteration, verified) only when ``with_meta``.
    ``meta_cache``: iteration -> meta of earlier calls (committed iterations never change);
    entries of iterations no longer committed are dropped."""
    out = []
    for it in engine.index.iterations():
        e = engine.index.get_commit(it)
        if e is None:
            continue
        c = e.commit
        meta = None
        if with_meta:
            if meta_cache is not None and it in meta_cache:
                meta = meta_cache[it]
            else:
                meta = unflatten(engine.manifest(it).meta, lambda i, p: None)
                if meta_cache is not None:
                    meta_cache[it] = meta
        out.append(Checkpoint(it, KIND_NAMES.get(c.kind, "unknown"), c.created_ns, meta))
    if meta_cache is not None:
        live = {c.iteration for c in out}
        for it in [i for i in meta_cache if i not in live]:
            del meta_cache[it]
    return out


def plan(engine: Engine, policy: Policy, now_ns: int | None = None,
         meta_cache: dict[int, Any] | None = None,
         rebase: RebaseSource | None = None) -> RetentionPlan:
    """The retention plan of ``policy`` over the committed iterations of ``engine``
    (RetentionError when it selects none); with ``rebase``, kept deltas may become snapshots
    (:func:`~ckptstore.ops.retention.rebasing_closure`)."""
    return plan_retention(checkpoints_of(engine, policy.uses_meta, meta_cache), policy, now_ns,
                          None if rebase is None else rebase.usable)


def skipped_bases(rebase: RebaseSource | None) -> tuple[tuple[int, str], ...]:
    """What a report says of the follower bases ``rebase`` looked at and refused."""
    return () if rebase is None else tuple(sorted(rebase.skipped.items()))


def live_bytes(engine: Engine) -> int:
    """Bytes of the live segments (what gc compacts), from the directory."""
    layout = engine.layout
    return sum(os.path.getsize(layout.segment_path(s)) for s in engine.log.refresh_segments())


def estimate_bytes_after(engine: Engine, keep: Sequence[int], rebase: RebaseSource | None = None,
                         rebased: Sequence[int] = ()) -> int:
    """The live bytes a gc keeping ``keep`` would leave, computed without writing: the records
    :class:`_Compactor` would copy (each chunk and tree once, every manifest and a COMMIT per
    kept iteration; record sizes from the index and the commits, trees read to list their chunks),
    laid out into segments as it lays them out, plus the final marker segment. Iterations in
    ``rebased`` count the follower base's records (from ``rebase.engine``) and the manifest gc
    would write. Exact unless the store changes in between or the index points a chunk at a copy
    of another size."""
    index = engine.index
    seg_size = engine.segment_size
    done: list[int] = []
    offset = 0  # of the open output segment (0: none open yet)
    chunks: set[bytes] = set()
    trees: set[bytes] = set()

    def add(payload: int) -> None:
        nonlocal offset
        if offset == 0:
            offset = SEGMENT_HEADER_RECORD_SIZE
        elif offset > SEGMENT_HEADER_RECORD_SIZE and offset + rec.OVERHEAD + payload > seg_size:
            done.append(offset)
            offset = SEGMENT_HEADER_RECORD_SIZE
        offset += rec.OVERHEAD + payload

    for it in keep:
        entry = index.get_commit(it)
        if entry is None:
            raise DamagedCheckpointError(f"iteration {it} is not committed (the store changed?)")
        c = entry.commit
        src, manifest_length = engine, c.manifest_length
        try:
            manifest = engine.manifest(it)
            if it in rebased and rebase is not None:
                src = rebase.engine
                base = src.read(functools.partial(rebase.base_manifest, it))
                manifest = rebased_manifest(manifest, base, rebase.manifest_extra(it))
                manifest_length = len(encode_manifest(manifest))
            for t in manifest.tensors:
                if t.inline is not None or t.nbytes == 0 or t.root in trees:
                    continue
                tloc = src.index.get_tree(t.root)
                if tloc is None:
                    raise FormatError(f"tree of tensor {t.path} is missing")
                for addr in src.tree_of(t).addresses:
                    if addr in chunks:
                        continue
                    ref = src.index.get_chunk(addr)
                    if ref is None:
                        raise FormatError(f"chunk {addr.hex()} of tensor {t.path} is missing")
                    add(ref.loc.length)
                    chunks.add(addr)
                add(tloc.length)
                trees.add(t.root)
        except FormatError as e:
            raise DamagedCheckpointError(
                f"iteration {it} cannot be read: {e}; run `ckptstore fsck` to locate the "
                "damage") from e
        add(manifest_length)
        add(COMMIT_SIZE)
    return sum(done) + offset + SEGMENT_HEADER_RECORD_SIZE  # + the record-less marker segment


def dry_run(engine: Engine, policy: Policy, now_ns: int | None = None,
            meta_cache: dict[int, Any] | None = None,
            rebase: RebaseSource | None = None) -> GcReport:
    """What :func:`collect` would keep and remove with ``policy`` (and ``rebase``: the follower
    bases are verified as gc verifies them), and the bytes it would leave (an estimate,
    :func:`estimate_bytes_after`). Writes nothing: works on a reader too."""
    t0 = time.perf_counter()
    p = plan(engine, policy, now_ns, meta_cache, rebase)
    before = live_bytes(engine)
    after = estimate_bytes_after(engine, p.kept, rebase, p.rebased) if p.kept else before
    return GcReport(list(p.kept), list(p.removed), before, after, time.perf_counter() - t0,
                    dry_run=True, estimated=True, compacted=False, added=p.added, policy=str(policy),
                    rebased=p.rebased, rebase_skipped=skipped_bases(rebase))


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
                                           supersedes, self.engine.evict_written,
                                           framing_checks=self.engine.header.framing_checks)
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

    def copy_tensors(self, src: Engine, manifest: Manifest,
                     progress: Callable[[int], None] | None) -> None:
        """Copy every chunk and tree of ``manifest``'s tensors not copied yet, read from ``src``
        (the store gc compacts, or the follower store of a rebased iteration), each chunk checked
        against its address. FormatError on damage."""
        for t in manifest.tensors:
            if t.inline is not None or t.nbytes == 0 or t.root in self.trees:
                continue
            tloc = src.index.get_tree(t.root)
            if tloc is None:
                raise FormatError(f"tree of tensor {t.path} is missing")
            tree_payload = src.log.read_payload(tloc)
            tree = decode_tree(tree_payload)
            if tree.root != t.root:
                raise FormatError(f"index points tree {t.root.hex()} at another tree")
            for addr in tree.addresses:
                if addr in self.chunks:
                    continue
                ref = src.index.get_chunk(addr)
                if ref is None:
                    raise FormatError(f"chunk {addr.hex()} of tensor {t.path} is missing")
                chunk_payload = src.log.read_payload(ref.loc)  # record checks
                header, _ = decode_chunk(chunk_payload)           # address check
                if header.address != addr:
                    raise FormatError(f"index points chunk {addr.hex()} at another chunk")
                self.append(rec.RecordType.CHUNK, [chunk_payload])
                self.chunks.add(addr)
                if progress is not None:
                    progress(len(chunk_payload))
            self.append(rec.RecordType.TREE, [tree_payload])
            self.trees.add(t.root)

    def copy_checkpoint(self, iteration: int, progress: Callable[[int], None] | None,
                        src: Engine | None = None) -> None:
        """Copy committed ``iteration`` of ``src`` (default: the store gc compacts; another
        store for :func:`copy_checkpoints`)."""
        engine = self.engine if src is None else src
        entry = engine.index.get_commit(iteration)
        if entry is None:
            raise DamagedCheckpointError(f"gc aborted, nothing changed: iteration {iteration} "
                                         f"is not committed in {engine.layout.root}")
        c = entry.commit
        mloc = Loc(c.manifest_seq, c.manifest_offset, c.manifest_length)
        try:
            payload = engine.log.read_payload(mloc)
            manifest = decode_committed_manifest(payload, c.manifest_digest, c.iteration)
            self.copy_tensors(engine, manifest, progress)
        except FormatError as e:  # I/O errors propagate as StoreIOError (typed, nothing changed)
            raise DamagedCheckpointError(
                f"gc aborted, nothing changed: iteration {iteration} cannot be copied: {e}; "
                "run `ckptstore fsck` to locate the damage") from e
        new_mloc = self.append(rec.RecordType.MANIFEST, [payload])
        moved = Commit(c.iteration, new_mloc.seq, new_mloc.offset, new_mloc.length, c.manifest_digest,
                       c.snapshot_root, c.created_ns, c.logical_bytes, c.written_bytes, c.kind)
        append_commit_record(self, moved)

    def copy_kept(self, iteration: int, progress: Callable[[int], None] | None,
                  rebase: RebaseSource | None, rebased: Collection[int],
                  source: Engine | None = None) -> None:
        """Copy kept ``iteration`` of ``source`` (default: the store gc compacts): as a snapshot
        made from ``rebase``'s base (:meth:`copy_rebased`) when the plan rebases it, else as it
        is (:meth:`copy_checkpoint`)."""
        if iteration in rebased and rebase is not None:
            self.copy_rebased(iteration, rebase, progress, source)
        else:
            self.copy_checkpoint(iteration, progress, source)

    def copy_rebased(self, iteration: int, rebase: RebaseSource,
                     progress: Callable[[int], None] | None, source: Engine | None = None) -> None:
        """Copy delta ``iteration`` of ``source`` (default: the store gc compacts) as a snapshot
        made from the base ``rebase`` holds for it: the base's chunks and trees, then a new
        manifest (:func:`rebased_manifest`) and a snapshot COMMIT (format-spec/follower.md
        section 6)."""
        engine, src = self.engine if source is None else source, rebase.engine
        entry = engine.index.get_commit(iteration)
        if entry is None:
            raise DamagedCheckpointError(f"gc aborted, nothing changed: iteration {iteration} "
                                         f"is not committed in {engine.layout.root}")
        c = entry.commit
        try:
            primary = decode_committed_manifest(
                engine.log.read_payload(Loc(c.manifest_seq, c.manifest_offset, c.manifest_length)),
                c.manifest_digest, c.iteration)

            def copy() -> Manifest:
                base = rebase.base_manifest(iteration)
                self.copy_tensors(src, base, progress)
                return base

            # a reader's read retries after a gc of the follower store: what was copied stays
            # copied (the sets), so a retry appends only what is still missing
            base = src.read(copy)
        except FormatError as e:
            raise DamagedCheckpointError(
                f"gc aborted, nothing changed: follower base {iteration} cannot be copied: {e}; "
                f"run `ckptstore fsck` on the follower store") from e
        manifest = rebased_manifest(primary, base, rebase.manifest_extra(iteration))
        payload = encode_manifest(manifest)
        mloc = self.append(rec.RecordType.MANIFEST, [payload])
        root = snapshot_root((t.path, t.root) for t in manifest.tensors)
        append_commit_record(self, Commit(iteration, mloc.seq, mloc.offset, mloc.length,
                                          xxhash.xxh3_128_digest(payload), root, c.created_ns,
                                          manifest.logical_bytes, 0, KIND_SNAPSHOT))

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


def collect(engine: WriterEngine, *, keep_last: int | None = None, keep_every: int | None = None,
            policy: Policy | None = None, progress: Callable[[int], None] | None = None,
            now_ns: int | None = None, only_if_removing: bool = False,
            meta_cache: dict[int, Any] | None = None,
            rebase: RebaseSource | None = None) -> GcReport:
    """Drop the checkpoints the policy does not keep and compact the log. The policy is the
    union of ``keep_last``, ``keep_every`` and ``policy`` (:func:`gc_policy`); the plan adds the
    latest iteration and the chains of kept deltas, and a policy that selects nothing raises
    RetentionError before anything is written. ``rebase``: kept deltas may be replaced by the
    verified bases it holds (module docstring). ``only_if_removing``: write nothing when the plan
    removes nothing (automatic retention). The caller holds the engine's lock with no
    transaction open (pending deltas committed first)."""
    t0 = time.perf_counter()
    layout = engine.layout
    pol = gc_policy(keep_last, keep_every, policy)
    p = plan(engine, pol, now_ns, meta_cache, rebase)
    rebased = set(p.rebased)
    keep, removed = list(p.kept), list(p.removed)
    live = engine.log.refresh_segments()
    bytes_before = sum(os.path.getsize(layout.segment_path(s)) for s in live)
    if not live or (only_if_removing and not removed):
        return GcReport(keep, removed, bytes_before, bytes_before, time.perf_counter() - t0,
                        compacted=False, added=p.added, policy=str(pol),
                        rebase_skipped=skipped_bases(rebase))
    def copy(compactor: _Compactor) -> None:
        for it in keep:
            compactor.copy_kept(it, progress, rebase, rebased)

    _compact(engine, live[-1], copy)
    bytes_after = sum(os.path.getsize(layout.segment_path(s)) for s in engine.log.refresh_segments())
    return GcReport(keep, removed, bytes_before, bytes_after, time.perf_counter() - t0,
                    added=p.added, policy=str(pol), rebased=p.rebased,
                    rebase_skipped=skipped_bases(rebase))


def copy_checkpoints(dest: WriterEngine, sources: Sequence[tuple[Engine, Sequence[int]]],
                     progress: Callable[[int], None] | None = None,
                     rebase: RebaseSource | None = None, rebased: Collection[int] = ()) -> None:
    """Compact the committed checkpoints of other stores into ``dest`` with :func:`collect`'s own
    steps (temp segments above ``dest``'s live ones, each chunk verified while copied, the
    marker, :meth:`WriterEngine.install_compaction`): afterwards ``dest`` holds exactly
    ``sources``' iterations (each ``(engine, iterations)``, copied in this order; iterations must
    strictly increase over all of them) and nothing it held before. The gc of multi-rank job
    stores (ckptstore/multirank/job_gc.py) rewrites each rank's kept iterations of several
    streams into a new one with it. Iterations in ``rebased`` (deltas) are copied as snapshots
    made from the bases ``rebase`` holds (:meth:`_Compactor.copy_rebased`: a job's rebasing gc,
    each rank its part). A damaged source checkpoint raises DamagedCheckpointError before
    anything is installed. The caller holds ``dest``'s lock with no transaction open."""
    order = [it for _, its in sources for it in its]
    if any(b <= a for a, b in zip(order, order[1:])):
        raise ValueError(f"copy_checkpoints: iterations do not increase: {order}")
    live = dest.log.refresh_segments()

    def copy(compactor: _Compactor) -> None:
        for src, its in sources:
            for it in its:
                compactor.copy_kept(it, progress, rebase, rebased, src)

    _compact(dest, live[-1] if live else 0, copy)


def _compact(engine: WriterEngine, watermark: int, copy: Callable[["_Compactor"], None]) -> None:
    """The compaction both gc paths share: ``copy`` writes the kept checkpoints into temp
    segments above ``watermark`` (the newest live segment), then the record-less marker segment
    that supersedes every live one, synced, then :meth:`WriterEngine.install_compaction` (its
    commit point). Any failure before the install deletes the temps (the live log is untouched)."""
    # Temp files of an earlier gc that failed in this process (its abort could not delete them)
    # would collide with this gc's names; they are never replayed, so delete them first.
    for tmp in engine.layout.list_gc_temps():
        engine.file_ops.unlink(tmp)
    compactor = _Compactor(engine, watermark + 1)
    try:
        copy(compactor)
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
