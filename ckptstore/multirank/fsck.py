"""fsck of a multi-rank job store (format-spec/format.md §22): the global logs, every rank stream
(each verified by the v1 fsck, :func:`ckptstore.ops.fsck.check`), and every visible global commit
against the streams it names. Every finding names the rank and the file.

Repair (``repair=True``) is the v1 repair of each stream (cut its uncommitted tail, rebuild its
index); it never deletes a stream's committed data. The global logs are never rewritten: a torn
tail of a global log is what a crash of its coordinator leaves, and readers stop before it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Callable

from ..errors import CkptStoreError, DamagedCheckpointError, StoreNotFoundError
from ..ops.fsck import FsckReport, check, quarantine_note
from ..replay.shards import layout_problems
from ..storage.job_log import (GC_TMP_RE, GC_TRASH_DIR, JobLayout, read_job_header, read_job_view,
                               tail_is_suspicious)
from .job_store import JobStore

_STREAM_RE = re.compile(r"^(\d{10})-(\d{5})$")


@dataclass
class JobFsckReport:
    path: str
    world_size: int | None = None
    epochs: list[int] = field(default_factory=list)
    iterations: list[int] = field(default_factory=list)
    #: (epoch, rank) -> the v1 fsck report of that stream
    streams: dict[tuple[int, int], FsckReport] = field(default_factory=dict)
    damage: list[str] = field(default_factory=list)
    damaged_iterations: dict[int, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.damage and not self.damaged_iterations and \
            all(r.clean for r in self.streams.values())

    def lines(self) -> list[str]:
        out = [f"job store {self.path}: {len(self.iterations)} committed iterations, "
               f"{self.world_size} ranks, epochs {self.epochs}, {len(self.streams)} streams"]
        for (epoch, rank), r in sorted(self.streams.items()):
            for line in r.lines()[1:-1]:
                out.append(f"rank {rank} (epoch {epoch}, {r.path}): {line}")
        out += [f"DAMAGE {d}" for d in self.damage]
        for it, problems in sorted(self.damaged_iterations.items()):
            out += [f"DAMAGED iteration {it}: {p}" for p in problems]
        out += [f"note: {n}" for n in self.notes]
        bad = sum(not r.clean for r in self.streams.values())
        out.append("clean" if self.clean else
                   f"NOT CLEAN: {len(self.damage)} damaged global records, "
                   f"{len(self.damaged_iterations)} damaged iterations, {bad} damaged streams")
        return out


def check_job(path: str | os.PathLike, *, repair: bool = False,
              progress: Callable[[int], None] | None = None) -> JobFsckReport:
    path = os.fspath(path)
    layout = JobLayout(path)
    report = JobFsckReport(path)
    header = read_job_header(layout)
    view = read_job_view(layout, header.store_id)
    report.world_size = view.epoch.world_size if view.epoch is not None else None
    report.epochs = view.chain
    report.iterations = list(view.commits)
    adopter = {view.chain[i]: view.chain[i + 1] for i in range(len(view.chain) - 1)}
    for n, scan in sorted(view.logs.items()):
        if scan.epoch is None:
            report.notes.append(f"global log {scan.path} holds no valid EPOCH record (a job that "
                                "stopped while claiming the store): ignored")
            continue
        rest = scan.size - scan.valid_end
        if view.chain and n < view.chain[-1] and n not in view.chain:
            report.notes.append(f"global log of epoch {n} is off the chain (superseded by a "
                                "job-store gc or a newer job): nothing in it is visible; the "
                                "next gc deletes it and its streams")
        if n in adopter:  # an older job's log: only what the newer one adopted counts
            newer = view.logs[adopter[n]].epoch
            assert newer is not None
            if scan.valid_end < newer.adopted_end:
                report.damage.append(
                    f"global log of epoch {n}: the records between offset {scan.valid_end} and "
                    f"{newer.adopted_end} of {scan.path}, adopted by epoch {newer.epoch}, are "
                    f"unreadable ({scan.damage}): the commits in them are lost")
            elif rest:
                report.notes.append(
                    f"global log of epoch {n}: {rest} bytes after offset {scan.valid_end} of "
                    f"{scan.path}, past what epoch {newer.epoch} adopted, are ignored (appended "
                    "after the newer job began, or cut short by a crash)")
            continue
        if not rest:
            continue
        what = f"{rest} bytes after offset {scan.valid_end} of {scan.path} ({scan.damage})"
        if n != view.chain[-1]:
            report.notes.append(f"global log of epoch {n} (off the chain, nothing in it is "
                                f"visible): {what}")
        elif tail_is_suspicious(scan):
            report.damage.append(
                f"global log of epoch {n}: {what}: a complete record that fails its check, a "
                "damaged commit (or one a power loss garbled during its own fsync); the next "
                "job copies it to quarantine/ and continues from the valid prefix")
        else:
            report.notes.append(f"torn tail of the current global log: {what}")
    held = quarantine_note(layout.quarantine_dir)
    if held:
        report.notes.append(held)
    report.notes += [n for n in view.notes if "was written after epoch" in n]
    try:
        names = sorted(os.listdir(layout.streams_dir))
    except FileNotFoundError:
        names = []
    try:
        in_global = sorted(os.listdir(layout.global_dir))
    except FileNotFoundError:
        in_global = []
    leftovers = [n for n in names + in_global if GC_TMP_RE.match(n)]
    if os.path.isdir(layout.gc_trash_dir):
        leftovers.append(GC_TRASH_DIR)
    if leftovers:
        report.notes.append(f"leftovers of an interrupted job-store gc, never read (the next gc "
                            f"deletes them): {', '.join(leftovers)}")
    for name in names:
        m = _STREAM_RE.match(name)
        if m is None:
            continue
        epoch, rank = int(m.group(1)), int(m.group(2))
        stream_dir = os.path.join(layout.streams_dir, name)
        where = f"rank {rank}'s stream {stream_dir} (epoch {epoch})"
        try:
            report.streams[(epoch, rank)] = check(stream_dir, repair=repair, progress=progress, job_stream=True)
        except StoreNotFoundError as e:
            if any(g.epoch == epoch for g in view.commits.values()):
                report.damage.append(f"{where} cannot be checked: {e}")
            else:  # a crash while the job opened, before it committed anything
                report.notes.append(f"{where} was never completed ({e}); no visible commit "
                                    "names it: ignored")
        except CkptStoreError as e:
            report.damage.append(f"{where} cannot be checked: {e}")
    layouts: dict[tuple[int, ...], list[str]] = {}
    with JobStore(path, "r") as reader:
        for it, g in view.commits.items():
            for r in range(g.world_size):
                stream = report.streams.get((g.epoch, r))
                if stream is not None and it in stream.damaged_iterations:
                    report.damaged_iterations.setdefault(it, []).append(
                        f"rank {r}'s stream {stream.path}: "
                        + "; ".join(stream.damaged_iterations[it]))
                    continue
                try:
                    reader.stream(it, rank=r)
                except DamagedCheckpointError as e:
                    report.damaged_iterations.setdefault(it, []).append(str(e))
            if it not in report.damaged_iterations:
                for problem in _layout_problems(reader, it, layouts):
                    report.damaged_iterations.setdefault(it, []).append(problem)
    return report


def _layout_problems(reader: JobStore, iteration: int,
                     seen: dict[tuple[int, ...], list[str]]) -> list[str]:
    """Why the sharded Checkpointer parts of ``iteration`` (if it holds any) cannot be assembled
    into one state: boxes that do not tile a tensor, a rank without a box or a sharded part
    (format-spec/deltas.md, "Sharded states"). Reads each base's replay section once: iterations
    whose ranks have the same bases (a base and its deltas) share ``seen``'s answer."""
    g = reader.global_commit(iteration)
    key = (g.epoch, *(reader.base_of(iteration, rank=r) for r in range(g.world_size)))
    if key not in seen:
        try:
            sections = reader.shard_sections(iteration)
            problems = [] if sections is None else layout_problems(sections, "")
            seen[key] = [f"sharded parts: {p}" for p in problems]
        except CkptStoreError as e:
            seen[key] = [f"sharded parts: {e}"]
    return [f"iteration {iteration}: {p}" for p in seen[key]]
