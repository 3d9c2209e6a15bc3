"""gc of a multi-rank job store (format-spec/format.md §22.7): offline, on a store no job writes.

An iteration is kept or dropped on every rank together. The retention policy
(:mod:`ckptstore.ops.retention`) selects from the job's visible iterations (KeepBest reads rank
0's meta); kept = selected, the latest iteration, and every iteration a kept one needs on any
rank's delta chain (each rank stream's own layout, :func:`~ckptstore.ops.retention.
chain_closure`), to a fixpoint. The iterations since the job's last change of world size (the
*suffix*) are rewritten; earlier ones (another world size) stay as they are, adopted.

With ``follower_bases`` (format-spec/follower.md §7) a kept suffix delta's chain may stop at a
delta *b* whose shadow-follower base verifies on every rank (:func:`~.job_follower.job_rebaser`):
step 3 then copies each rank's part of that base into the rank's new stream as a snapshot of *b*
and step 4 names it with a snapshot GLOBAL_COMMIT; the deltas before it that nothing keeps go.
Steps, commit point and crash behaviour are the same (the new streams are built aside).

Protocol (one new epoch G; every step before 5 is invisible to readers):

1. Refuse when a stream's LOCK is held (a writer on this machine: StoreLockedError), then claim G
   as a job open does (exclusive ``global/G.log``, empty): any older writer is fenced from now on.
2. Read the view after the claim (what a job open would adopt) and plan.
3. For each rank r: build ``streams/G-r.gc-tmp/``, a new v1 store holding r's kept iterations
   (and what their chains need), copied from the old streams with the single-store compaction
   (:func:`~ckptstore.ops.gc.copy_checkpoints`: every chunk verified); close it, rename it to
   ``streams/G-r``; then fsync ``streams/``.
4. Write ``global/G.log.gc-tmp``: the EPOCH record (adopting the unchanged prefix's last epoch, or
   none) and one GLOBAL_COMMIT per kept suffix iteration naming the new streams' commits; fsync.
5. If no newer epoch was claimed: rename it over ``global/G.log``, fsync ``global/``: **the commit
   point** (the log turns valid, complete, in one step: readers follow it from now on).
6. If still no newer epoch is claimed: move every stream of an epoch below G that the new chain
   does not hold to ``gc-trash/`` (one rename each), fsync ``streams/``, unlink those epochs'
   logs, fsync ``global/``, delete ``gc-trash/``.

A crash before 5 leaves the old state visible (G's log empty or absent: an invalid epoch) plus
leftovers the next gc deletes; after 5 the new state, plus old files the next gc deletes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..engine.writer_engine import WriterEngine
from ..errors import (CkptStoreError, DamagedCheckpointError, FormatError, StaleWriterError,
                      StoreLockedError)
from ..format import records as rec
from ..format.commit import KIND_NAMES, KIND_SNAPSHOT
from ..format.job import Epoch, GlobalCommit, RankCommit
from ..ops.gc import copy_checkpoints, estimate_bytes_after, layout_of, skipped_bases
from ..ops.retention import Checkpoint, Policy, chain_closure, plan_retention
from ..replay.follower import FollowerRebaser, PartRebase
from ..storage.fileops import FileOps
from ..storage.job_log import (EPOCH_LOG_RE, GC_TMP_RE, STREAM_RE, EpochLog, JobLayout,
                               claim_next_epoch, quarantine_tail,
                               read_job_header, read_job_view, tail_is_suspicious)
from ..storage.layout import Layout
from ..storage.lock import no_writer
from ..storage.store_file import read_store_header
from .job_follower import job_rebaser, part_key

if TYPE_CHECKING:
    from .job_store import JobStore


@dataclass(frozen=True)
class JobGcReport:
    """What a job-store gc did (or, with ``dry_run``, would do). ``kept``/``removed``: visible
    iterations (on every rank); ``added``: kept beyond the policy, with ``why`` each is kept
    ("the latest iteration", "needed by rank r's chain of iteration t", ...); ``unchanged``:
    iterations of an earlier world size, kept as they are (gc rewrites only the iterations since
    the job's last change of world size). Bytes: every file of the job store (``bytes_after``
    estimated for a dry run). ``epoch``: the epoch holding the result (None: nothing written)."""

    kept: list[int]
    removed: list[int]
    bytes_before: int
    bytes_after: int
    seconds: float
    dry_run: bool = False
    estimated: bool = False
    policy: str = ""
    added: tuple[int, ...] = ()
    why: dict[int, str] = field(default_factory=dict)
    unchanged: tuple[int, ...] = ()
    epoch: int | None = None
    world_size: int | None = None
    streams_deleted: int = 0
    #: kept deltas made snapshots (on every rank) from verified follower bases
    #: (``follower_bases=True``, format-spec/follower.md §7)
    rebased: tuple[int, ...] = ()
    #: follower bases looked at and not used, with why ((-1, why): the follower store itself)
    rebase_skipped: tuple[tuple[int, str], ...] = ()

    @property
    def bytes_freed(self) -> int:
        return self.bytes_before - self.bytes_after

    @property
    def compacted(self) -> bool:
        return self.epoch is not None


def report_to_json(report: JobGcReport) -> bytes:
    """``report`` as JSON (how rank 0 tells the other ranks what the job's gc did: no pickle)."""
    d = dataclasses.asdict(report)
    d["why"] = [[it, text] for it, text in report.why.items()]
    return json.dumps(d).encode()


def report_from_json(data: bytes) -> JobGcReport:
    """The :class:`JobGcReport` :func:`report_to_json` wrote; FormatError when it is not one."""
    try:
        d = json.loads(data)
        d["why"] = {int(it): str(text) for it, text in d["why"]}
        d["added"] = tuple(d["added"])
        d["unchanged"] = tuple(d["unchanged"])
        d["rebased"] = tuple(int(it) for it in d.get("rebased", ()))
        d["rebase_skipped"] = tuple((int(it), str(why)) for it, why in d.get("rebase_skipped", ()))
        return JobGcReport(**d)
    except (ValueError, TypeError, KeyError) as e:
        raise FormatError(f"a job gc report that does not decode: {e}") from None


@dataclass
class JobGcPlan:
    world_size: int
    kept: list[int]
    removed: list[int]
    added: tuple[int, ...]
    why: dict[int, str]
    unchanged: list[int]
    #: (epoch, end) the new epoch adopts: the unchanged iterations' last epoch; (0, 0): none
    adopt: tuple[int, int]
    #: epochs whose files the new chain keeps as they are (the unchanged iterations')
    keep_epochs: set[int]
    #: rank -> [(source epoch, stream iterations to copy, ascending)], epochs ascending
    copies: dict[int, list[tuple[int, list[int]]]]
    #: suffix iterations to name in the new epoch's log
    named: list[int]
    #: kept suffix deltas copied as snapshots made from verified follower bases (every rank)
    rebased: frozenset[int] = frozenset()


def plan_job_gc(reader: JobStore, policy: Policy, now_ns: int | None = None,
                rebase: FollowerRebaser | None = None) -> JobGcPlan | None:
    """The plan of ``policy`` over ``reader``'s view (None: nothing committed). RetentionError
    when the policy selects nothing; DamagedCheckpointError when a stream does not hold what the
    global commits name. ``rebase`` (:func:`~.job_follower.job_rebaser` of ``reader``): a kept
    suffix delta's chain may stop at a delta whose follower base verifies on every rank
    (:func:`~ckptstore.ops.retention.rebasing_closure` over the global kinds; format-spec/
    follower.md §7); every rank's stream then holds it as a snapshot."""
    view = reader.view
    commits = view.commits
    its = list(commits)
    if not its:
        return None
    latest = its[-1]
    w = commits[latest].world_size
    split = len(its)
    while split > 0 and commits[its[split - 1]].world_size == w:
        split -= 1
    unchanged, suffix = its[:split], its[split:]
    cps = [Checkpoint(it, KIND_NAMES.get(g.kind, "unknown"), g.ranks[0].commit.created_ns,
                      reader.meta(it, rank=0) if policy.uses_meta else None)
           for it, g in commits.items()]
    in_suffix = set(suffix)
    can_rebase = None if rebase is None else (lambda t: t in in_suffix and rebase.usable(t))
    p = plan_retention(cps, policy, now_ns, can_rebase)  # RetentionError: nothing selected
    rebased = set(p.rebased)  # decided once for the job: the same iterations on every rank
    why: dict[int, str] = {}
    kept = set(p.selected) | {latest} | set(unchanged)
    if latest not in p.selected:
        why[latest] = "the latest iteration (always kept)"
    for it in unchanged:
        if it not in p.selected:
            why[it] = (f"written at world size {commits[it].world_size}, before the job's last "
                       f"change of world size (gc rewrites only the iterations since then)")
    by_epoch: dict[int, list[int]] = {}
    for it in suffix:
        by_epoch.setdefault(commits[it].epoch, []).append(it)
    layouts: dict[tuple[int, int], list[tuple[int, str]]] = {}
    for e, e_its in by_epoch.items():
        for r in range(w):
            # the newest iteration: a stream read before it was committed is refreshed
            engine = reader.stream(e_its[-1], rank=r).engine
            layouts[(e, r)] = engine.read(functools.partial(_layout, engine))

    def closure(key: tuple[int, int], keep: list[int]) -> frozenset[int]:
        layout = [(i, "snapshot" if i in rebased else k) for i, k in layouts[key]]
        try:
            return chain_closure(layout, keep)
        except ValueError as e:
            raise DamagedCheckpointError(
                f"{reader.path}: rank {key[1]}'s stream of epoch {key[0]} does not hold an "
                f"iteration its global commits name ({e}); run `ckptstore fsck`") from None

    visible = set(suffix)
    changed = True
    while changed:  # a rank's chain may keep an iteration whose chain on another rank is longer
        changed = False
        for (e, r) in sorted(layouts):
            for t in sorted((i for i in by_epoch[e] if i in kept), reverse=True):
                for a in sorted(closure((e, r), [t])):
                    if a in visible and a not in kept:
                        kept.add(a)
                        why[a] = f"needed by rank {r}'s chain of iteration {t}"
                        changed = True
    for a in p.kept:  # the plan's own closure (global kinds) keeps nothing less
        if a not in kept:
            kept.add(a)
            why[a] = "needed by a delta chain (the retention plan's chain rule)"
    # a rebase whose predecessor some rank keeps anyway frees nothing: not made (the kept set
    # stays closed: that predecessor's chains are in it on every rank)
    rebased -= {b for b in rebased if b - 1 in kept}
    copies: dict[int, list[tuple[int, list[int]]]] = {r: [] for r in range(w)}
    for e in sorted(by_epoch):
        mine = [t for t in by_epoch[e] if t in kept]
        if not mine:
            continue
        for r in range(w):
            copies[r].append((e, sorted(closure((e, r), mine))))
    adopt, keep_epochs = (0, 0), set()
    if unchanged:
        last = unchanged[-1]
        x = commits[last].epoch
        end = next(end for g, end in view.logs[x].commits if g.iteration == last)
        adopt = (x, end)
        keep_epochs = set(view.chain[:view.chain.index(x) + 1])
    kept_list = sorted(kept)
    return JobGcPlan(w, kept_list, [i for i in its if i not in kept],
                     tuple(i for i in kept_list if i not in p.selected), why, unchanged, adopt,
                     keep_epochs, copies, [i for i in suffix if i in kept], frozenset(rebased))


def _layout(engine: Any) -> list[tuple[int, str]]:
    return layout_of(engine.index)


def job_bytes(layout: JobLayout) -> int:
    """Bytes of every file of the job store (streams, their indexes, global logs, leftovers)."""
    total = 0
    for d, _, names in os.walk(layout.root):
        for n in names:
            try:
                total += os.lstat(os.path.join(d, n)).st_size
            except OSError:
                pass
    return total


def _epoch_bytes(layout: JobLayout, epochs: set[int]) -> int:
    total = 0
    for e in epochs:
        p = layout.epoch_log_path(e)
        total += os.path.getsize(p) if os.path.exists(p) else 0
        for name in _stream_names(layout):
            m = STREAM_RE.match(name)
            if m and int(m.group(1)) == e:
                total += job_bytes(JobLayout(os.path.join(layout.streams_dir, name)))
    return total


def _stream_names(layout: JobLayout) -> list[str]:
    try:
        return sorted(os.listdir(layout.streams_dir))
    except FileNotFoundError:
        return []


def dry_run_job(reader: JobStore, policy: Policy, now_ns: int | None = None,
                follower_bases: bool = False) -> JobGcReport:
    """What :func:`collect_job` would keep and remove, and about how many bytes it would leave
    (the records it would copy, from each stream's index; with ``follower_bases`` the follower
    bases are verified as the gc verifies them). Writes nothing."""
    with rebasing(reader, follower_bases) as rebase:
        return _dry_run(reader, policy, now_ns, rebase)


def rebasing(reader: JobStore, follower_bases: bool) -> Any:
    """A context holding :func:`~.job_follower.job_rebaser` of ``reader`` (None without
    ``follower_bases``), closed on exit (what :func:`plan_job_gc` takes as ``rebase``)."""
    return contextlib.closing(job_rebaser(reader)) if follower_bases else \
        contextlib.nullcontext(None)


def _part_rebase(rebase: FollowerRebaser | None, rank: int) -> PartRebase | None:
    return None if rebase is None else rebase.part(part_key(rank))


def _dry_run(reader: JobStore, policy: Policy, now_ns: int | None,
             rebase: FollowerRebaser | None) -> JobGcReport:
    t0 = time.perf_counter()
    layout = reader.layout
    before = job_bytes(layout)
    plan = plan_job_gc(reader, policy, now_ns, rebase)
    if plan is None:
        return JobGcReport([], [], before, before, time.perf_counter() - t0, dry_run=True,
                           estimated=True, policy=str(policy))
    after = os.path.getsize(layout.store_file)
    after += _epoch_bytes(layout, plan.keep_epochs)
    head = rec.OVERHEAD + 64
    after += head + len(plan.named) * (rec.OVERHEAD + 40 + 112 * plan.world_size)
    for r, sources in plan.copies.items():
        for e, its in sources:
            newest = max(i for i in reader.view.commits if reader.view.commits[i].epoch == e)
            engine = reader.stream(newest, rank=r).engine
            after += engine.read(functools.partial(
                estimate_bytes_after, engine, its, _part_rebase(rebase, r),
                [i for i in its if i in plan.rebased]))
    return JobGcReport(plan.kept, plan.removed, before, after, time.perf_counter() - t0,
                       dry_run=True, estimated=True, policy=str(policy), added=plan.added,
                       why=dict(plan.why), unchanged=tuple(plan.unchanged),
                       world_size=plan.world_size, rebased=tuple(sorted(plan.rebased)),
                       rebase_skipped=skipped_bases(rebase))


def refuse_writers(layout: JobLayout) -> None:
    """StoreLockedError when a rank stream's LOCK is held: a job (on this machine) has the store
    open for writing. A writer elsewhere is not seen here; the epoch gc claims fences it."""
    for name in _stream_names(layout):
        if not STREAM_RE.match(name):
            continue
        with no_writer(Layout(os.path.join(layout.streams_dir, name))) as state:
            if state == "locked":
                raise StoreLockedError(
                    f"{layout.root} is open for writing by a job (rank stream {name} is locked): "
                    "gc of a job store runs offline; close the job (every rank) first. Nothing "
                    "was changed")


def _superseded(layout: JobLayout, epoch: int) -> int | None:
    newer = [n for n in layout.list_epochs() if n > epoch]
    return newer[-1] if newer else None


def _features(layout: JobLayout, epoch: int, rank: int) -> str:
    flags = read_store_header(Layout(layout.stream_dir(epoch, rank))).flags
    return "current" if flags else "compatible"


def _build_streams(layout: JobLayout, ops: FileOps, reader: JobStore, plan: JobGcPlan, new: int,
                   progress: Callable[[int], None] | None,
                   rebase: FollowerRebaser | None) -> dict[int, list[RankCommit]]:
    """Step 3: every rank's new stream, renamed into place and durable (a rebased iteration:
    that rank's part of the verified follower base, as a snapshot). Returns, per named
    iteration, each rank's new local commit."""
    header = reader.header
    view = reader.view
    first_of: dict[int, int] = {}
    for it in plan.named:
        first_of.setdefault(view.commits[it].epoch, it)
    out: dict[int, list[RankCommit]] = {it: [] for it in plan.named}
    for r in range(plan.world_size):
        for it in plan.named:
            reader.stream(it, rank=r)  # the stream commits it as the global commit says
        staging = layout.gc_stream_dir(new, r)
        if os.path.exists(staging):
            shutil.rmtree(staging)
        sources = [(reader.stream(first_of[e], rank=r).engine, its) for e, its in plan.copies[r]]
        dest = WriterEngine(staging, chunk_size=header.chunk_size,
                            segment_size=header.segment_size, file_ops=ops,
                            features=_features(layout, plan.copies[r][0][0], r), job_stream=True,
                            direct_io=False)  # (no O_DIRECT staging buffer to allocate: one copy)
        try:
            with dest.locked():
                try:
                    copy_checkpoints(dest, sources, progress, _part_rebase(rebase, r),
                                     plan.rebased)
                except ValueError as e:
                    raise CkptStoreError(f"{layout.root}: rank {r}'s kept iterations cannot be "
                                         f"merged into one stream ({e}); nothing was changed")
                for it in plan.named:
                    entry = dest.index.get_commit(it)
                    if entry is None:
                        raise CkptStoreError(f"gc: iteration {it} missing from the new stream")
                    out[it].append(RankCommit(entry.loc.seq, entry.loc.offset, entry.commit))
        finally:
            dest.close()
        ops.rename(staging, layout.stream_dir(new, r))
    ops.fsync_dir(layout.streams_dir)
    return out


def _undo(layout: JobLayout, ops: FileOps, new: int, world_size: int) -> None:
    """Best effort, before the commit point: remove what this gc wrote (the next gc deletes
    what is left)."""
    try:
        for r in range(world_size):
            for d in (layout.gc_stream_dir(new, r), layout.stream_dir(new, r)):
                if os.path.isdir(d):
                    shutil.rmtree(d)
        for p in (layout.gc_log_path(new), layout.epoch_log_path(new)):
            if os.path.exists(p):
                ops.unlink(p)
    except (OSError, CkptStoreError):
        pass


def delete_old(layout: JobLayout, ops: FileOps, new: int, keep_epochs: set[int],
               remove_trash: bool = True) -> int:
    """Step 6: every stream and global log of an epoch below ``new`` that its chain does not hold,
    and every gc leftover below it. Returns the number of streams deleted. ``remove_trash``
    False: the last part, deleting ``gc-trash/``, is left to the caller (what it holds is off
    every chain, readers ignore it, and the next gc deletes it in any case)."""
    trash = layout.gc_trash_dir
    moved = 0
    for name in _stream_names(layout):
        m = STREAM_RE.match(name) or GC_TMP_RE.match(name)
        if m is None or int(m.group(1)) >= new:
            continue
        if STREAM_RE.match(name) and int(m.group(1)) in keep_epochs:
            continue
        ops.makedirs(trash)
        dest = os.path.join(trash, name)
        if os.path.exists(dest):
            shutil.rmtree(dest)
        ops.rename(os.path.join(layout.streams_dir, name), dest)
        moved += 1
    if moved:
        ops.fsync_dir(layout.streams_dir)
    unlinked = False
    try:
        names = sorted(os.listdir(layout.global_dir))
    except FileNotFoundError:
        names = []
    for name in names:
        log, tmp = EPOCH_LOG_RE.match(name), GC_TMP_RE.match(name)
        m = log or tmp
        if m is None or int(m.group(1)) >= new or (log and int(m.group(1)) in keep_epochs):
            continue
        ops.unlink(os.path.join(layout.global_dir, name))
        unlinked = True
    if unlinked:
        ops.fsync_dir(layout.global_dir)
    if remove_trash and os.path.isdir(trash):
        shutil.rmtree(trash)
    return moved


def write_generation_log(layout: JobLayout, ops: FileOps, epoch: Epoch,
                         commits: list[GlobalCommit]) -> None:
    """Step 4: the new epoch's complete log at its gc name, durable (the records written by
    :class:`EpochLog`'s own methods, the one writer of global log records)."""
    log = EpochLog.staged(layout, ops, epoch.epoch)
    try:
        log.write_epoch(epoch)
        if commits:
            log.append_commits(commits)
    finally:
        log.close()


def collect_job(path: str | os.PathLike, policy: Policy,
                open_reader: Callable[[str], "JobStore"], *, file_ops: FileOps | None = None,
                now_ns: int | None = None, progress: Callable[[int], None] | None = None,
                remove_trash: bool = True, follower_bases: bool = False) -> JobGcReport:
    """Apply ``policy`` to the job store at ``path`` and compact it (module docstring). Raises
    RetentionError (the policy selects nothing), StoreLockedError (a job writes it),
    StaleWriterError (a job opened it while gc ran: before the commit point nothing changed;
    after it nothing old was deleted) or DamagedCheckpointError (a kept iteration cannot be
    copied: nothing changed). ``open_reader(path)``: a JobStore reader of ``path`` (mode "r").
    ``remove_trash``: see :func:`delete_old` (a job's own gc deletes ``gc-trash/`` in the
    background, so that training waits only for steps 1-6's renames). ``follower_bases``: step
    2 plans with the job's verified follower bases (:func:`plan_job_gc`) and step 3 copies each
    rank's part of those it uses (format-spec/follower.md §7); the protocol is unchanged."""
    t0 = time.perf_counter()
    path = os.fspath(path)
    ops = file_ops or FileOps()
    layout = JobLayout(path)
    header = read_job_header(layout)
    refuse_writers(layout)
    with open_reader(path) as reader:  # a bad policy fails before anything is written
        if plan_job_gc(reader, policy, now_ns) is None:
            return JobGcReport([], [], job_bytes(layout), job_bytes(layout),
                               time.perf_counter() - t0, policy=str(policy))
    before = job_bytes(layout)
    log = claim_next_epoch(layout, ops, read_job_view(layout, header.store_id).highest_claimed)
    new = log.number
    log.close()  # the commit renames a complete log over the claimed one
    world = 0
    attempted = False
    try:
        # the view after the claim: what a job open adopts
        with open_reader(path) as reader, rebasing(reader, follower_bases) as rebase:
            plan = plan_job_gc(reader, policy, now_ns, rebase)
            assert plan is not None
            world = plan.world_size
            ranks = _build_streams(layout, ops, reader, plan, new, progress, rebase)
            view = reader.view
            skipped = skipped_bases(rebase)
        old_current = view.chain[-1]
        if old_current not in plan.keep_epochs and tail_is_suspicious(view.logs[old_current]):
            quarantine_tail(layout, ops, view.logs[old_current])  # kept, never adopted
        write_generation_log(layout, ops, Epoch(new, world, header.store_id, plan.adopt[0],
                                                plan.adopt[1], time.time_ns()),
                             [GlobalCommit(it, new, KIND_SNAPSHOT if it in plan.rebased
                                           else view.commits[it].kind, tuple(ranks[it]),
                                           view.commits[it].created_ns) for it in plan.named])
        newer = _superseded(layout, new)
        if newer is not None:
            raise StaleWriterError(f"{path}: a job claimed epoch {newer} while gc ran (epoch "
                                   f"{new}): gc stopped before its commit point, nothing changed")
        attempted = True
        ops.rename(layout.gc_log_path(new), layout.epoch_log_path(new))
        ops.fsync_dir(layout.global_dir)  # the commit point of the job store's gc
    except BaseException:
        if not attempted:
            _undo(layout, ops, new, world)
        raise
    newer = _superseded(layout, new)
    if newer is not None:
        raise StaleWriterError(f"{path}: gc committed epoch {new}, but a job claimed epoch "
                               f"{newer} meanwhile (it adopted either the old state or this "
                               "one): nothing old was deleted; run gc again once no job writes")
    deleted = delete_old(layout, ops, new, plan.keep_epochs, remove_trash)
    return JobGcReport(plan.kept, plan.removed, before, job_bytes(layout),
                       time.perf_counter() - t0, policy=str(policy), added=plan.added,
                       why=dict(plan.why), unchanged=tuple(plan.unchanged), epoch=new,
                       world_size=world, streams_deleted=deleted,
                       rebased=tuple(sorted(plan.rebased)), rebase_skipped=skipped)
