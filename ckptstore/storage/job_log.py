"""The files of a multi-rank job store: layout, STORE, the per-epoch global logs (format §22).

::

    <store>/
      STORE                       format_version 2 (written once, atomically)
      global/EEEEEEEEEE.log       the global log of epoch E: EPOCH, then GLOBAL_COMMIT records
      streams/EEEEEEEEEE-RRRRR/   the stream of rank R in epoch E: a complete v1 store

Each epoch's files are written by that epoch's job only: its coordinator appends to its global log,
rank R to its own stream. A newer job never writes an older job's files, so a writer left over
from an older job (a zombie rank on another machine) can never damage what the newer job writes;
the newer job's EPOCH record says which of the older commits it continues (``adopted_end``), and
readers ignore whatever the older job appended after that (:func:`read_job_view`).

Invariants: a global log is written append-only; every record is durable (fsync) before its
append returns; a failed append is cut back before the next one (or the log is marked broken).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import time
from dataclasses import dataclass, field

from ..errors import CkptStoreError, FormatError, JobStreamError, StoreIOError
from ..format import records as rec
from ..format.header import STORE_HEADER_SIZE, StoreHeader, decode_store_header, encode_store_header
from ..format.job import (GLOBAL_HEAD_SIZE, JOB_FORMAT_VERSION, JOB_TYPES, RANK_ENTRY_SIZE, Epoch,
                          GlobalCommit, JobRecordType, decode_epoch, decode_global_commit,
                          encode_epoch, encode_global_commit)
from .fileops import FileOps, io_errors
from .layout import QUARANTINE_DIR, STORE_FILE

GLOBAL_DIR = "global"
STREAMS_DIR = "streams"
#: suffix of what a job-store gc builds (a global log, a stream) before it renames it into place
GC_TMP = ".gc-tmp"
#: where a job-store gc moves the old streams it deletes
GC_TRASH_DIR = "gc-trash"
_EPOCH_LOG_RE = re.compile(r"^(\d{10})\.log$")
#: a global log's file name (epoch)
EPOCH_LOG_RE = _EPOCH_LOG_RE
#: a rank stream's directory name (epoch, rank)
STREAM_RE = re.compile(r"^(\d{10})-(\d{5})$")
#: a job-store gc's temp files and directories in global/ and streams/ (the epoch it claimed)
GC_TMP_RE = re.compile(r"^(\d{10})(?:\.log|-\d{5})\.gc-tmp$")


@dataclass(frozen=True)
class JobLayout:
    root: str

    @property
    def store_file(self) -> str:
        return os.path.join(self.root, STORE_FILE)

    @property
    def global_dir(self) -> str:
        return os.path.join(self.root, GLOBAL_DIR)

    @property
    def streams_dir(self) -> str:
        return os.path.join(self.root, STREAMS_DIR)

    def epoch_log_path(self, epoch: int) -> str:
        if not 0 < epoch < 10**10:
            raise ValueError(f"epoch {epoch} out of range")
        return os.path.join(self.global_dir, f"{epoch:010d}.log")

    def stream_dir(self, epoch: int, rank: int) -> str:
        """The v1 store holding rank ``rank``'s records of epoch ``epoch``."""
        if not 0 < epoch < 10**10 or not 0 <= rank < 10**5:
            raise ValueError(f"stream of epoch {epoch}, rank {rank} out of range")
        return os.path.join(self.streams_dir, f"{epoch:010d}-{rank:05d}")

    def gc_log_path(self, epoch: int) -> str:
        """Where a job-store gc builds epoch ``epoch``'s global log before renaming it over the
        claimed (empty) log: the gc commit point (format §22.7). Not a global log's name."""
        return self.epoch_log_path(epoch) + GC_TMP

    def gc_stream_dir(self, epoch: int, rank: int) -> str:
        """Where a job-store gc builds rank ``rank``'s stream of epoch ``epoch`` before renaming
        it into place. Not a stream's name: readers, fsck and later jobs ignore it."""
        return self.stream_dir(epoch, rank) + GC_TMP

    @property
    def gc_trash_dir(self) -> str:
        """Where a job-store gc moves the streams it deletes (one rename each), then deletes
        them: nothing reads it, so a crash never leaves half a stream under ``streams/``."""
        return os.path.join(self.root, GC_TRASH_DIR)

    @property
    def quarantine_dir(self) -> str:
        return os.path.join(self.root, QUARANTINE_DIR)

    def quarantine_path(self, epoch: int, offset: int) -> str:
        """Where the suspicious tail of epoch ``epoch``'s global log, from ``offset``, is kept."""
        return os.path.join(self.quarantine_dir, f"global-{epoch:010d}-{offset}.tail")

    def list_epochs(self) -> list[int]:
        """Epoch numbers of the global logs present (claimed epochs), ascending. A name that is
        not a valid epoch (0) is not a global log."""
        try:
            with io_errors("list", self.global_dir):
                names = os.listdir(self.global_dir)
        except StoreIOError as e:
            if isinstance(e.__cause__, FileNotFoundError):
                return []
            raise
        numbers = [int(m.group(1)) for name in names if (m := _EPOCH_LOG_RE.match(name))]
        return sorted(n for n in numbers if n > 0)


def is_job_store(path: str) -> bool:
    """Whether ``path`` holds a job store: a STORE file of version 2 and a ``global/`` folder
    (created before STORE). Anything else reads as False: the caller's own open then reports
    what it is."""
    layout = JobLayout(path)
    if not os.path.isdir(layout.global_dir):
        return False
    try:
        read_job_header(layout)
        return True
    except (OSError, CkptStoreError):
        return False


def job_store_holding(path: str) -> str | None:
    """The job store whose own parts hold ``path`` (its ``streams/`` or ``global/`` folder, at
    any depth: a rank's stream, a store made inside one), or None. Symlinks are resolved first,
    so a link to a stream is a stream; ``path`` need not exist (a store about to be created)."""
    child = os.path.realpath(path)
    parent = os.path.dirname(child)
    while parent != child:
        if os.path.basename(child) in (STREAMS_DIR, GLOBAL_DIR) and is_job_store(parent):
            return parent
        child, parent = parent, os.path.dirname(parent)
    return None


def refuse_job_part(path: str, action: str) -> None:
    """Raise JobStreamError when ``path`` is a part of a job store (:func:`job_store_holding`):
    ``action`` (e.g. "gc") on it alone would change one rank's records under the job's global
    commits. Called before anything is created or written."""
    job = job_store_holding(path)
    if job is not None:
        raise JobStreamError(
            f"{path} is a part of the multi-rank job store {job} (one rank's stream): {action} "
            "of it alone would change records that the job's global commits name and damage "
            f"every iteration of the job; use the job store {job} instead (ckptstore.open(job, "
            "'a', process_group=pg) writes it, ckptstore fsck --repair repairs it); reading the "
            "stream with mode \"r\" is allowed", job)


def create_job_store(layout: JobLayout, ops: FileOps, chunk_size: int, segment_size: int) -> None:
    """Create ``global/`` and ``streams/``, then STORE (version 2) atomically: the job store exists
    once the rename is durable. Two coordinators creating one store at once is not supported (a
    job store is created by the first job's coordinator)."""
    ops.makedirs(layout.global_dir)
    ops.makedirs(layout.streams_dir)
    ops.fsync_dir(layout.root)
    header = StoreHeader(JOB_FORMAT_VERSION, secrets.token_bytes(16), chunk_size, segment_size,
                         time.time_ns())
    ops.write_file_atomic(layout.store_file, encode_store_header(header))
    ops.fsync_dir(os.path.dirname(os.path.abspath(layout.root)))


def read_job_header(layout: JobLayout) -> StoreHeader:
    with io_errors("read", layout.store_file):
        with open(layout.store_file, "rb") as f:
            buf = f.read(STORE_HEADER_SIZE + 1)
    try:
        return decode_store_header(buf, (JOB_FORMAT_VERSION,))
    except FormatError as e:
        raise e.located(layout.store_file, 0) from None


# ---- reading ------------------------------------------------------------------------------------
@dataclass
class EpochScan:
    """What one global log holds: its EPOCH record (None: not a valid epoch) and the valid prefix
    of its GLOBAL_COMMIT records, each with the offset where its record ends."""

    number: int
    path: str
    epoch: Epoch | None = None
    commits: list[tuple[GlobalCommit, int]] = field(default_factory=list)
    #: end of the valid prefix (where the next record goes)
    valid_end: int = 0
    size: int = 0
    #: what ended the valid prefix before the end of the file, if anything
    damage: str | None = None


def scan_epoch_log(path: str, number: int, store_id: bytes) -> EpochScan:
    """Decode the global log of epoch ``number``: the valid prefix and where it ends. A record that
    fails a check, names another epoch or store, or does not increase the iteration ends it."""
    out = EpochScan(number, path)
    with io_errors("read", path):
        with open(path, "rb") as f:
            data = f.read()
    out.size = len(data)
    view = memoryview(data)
    at = 0
    while at < len(data):
        try:
            header, payload = rec.decode_record(view[at:], JOB_TYPES)
            if out.epoch is None:
                if header.type != JobRecordType.EPOCH:
                    raise FormatError("the first record is not an EPOCH record")
                e = decode_epoch(payload)
                if e.epoch != number or e.store_id != store_id:
                    raise FormatError(f"EPOCH record names epoch {e.epoch} of store "
                                      f"{e.store_id.hex()}, not epoch {number} of this store")
                out.epoch = e
            else:
                if header.type != JobRecordType.GLOBAL_COMMIT:
                    raise FormatError("a second EPOCH record")
                g = decode_global_commit(payload)
                if g.epoch != number or g.world_size != out.epoch.world_size:
                    raise FormatError(f"global commit of epoch {g.epoch} with {g.world_size} "
                                      f"ranks in the log of epoch {number} "
                                      f"({out.epoch.world_size} ranks)")
                if out.commits and g.iteration <= out.commits[-1][0].iteration:
                    raise FormatError(f"global commit of iteration {g.iteration} follows "
                                      f"{out.commits[-1][0].iteration}")
                out.commits.append((g, at + header.total_size))
        except FormatError as e:
            out.damage = f"{path}, offset {at}: {e.reason if hasattr(e, 'reason') else e}"
            break
        at += header.total_size
        out.valid_end = at
    return out


def tail_is_suspicious(scan: EpochScan) -> bool:
    """Whether the bytes after a global log's valid prefix are at least one GLOBAL_COMMIT record
    long: a complete record that fails a check (a damaged commit, or one a power loss garbled
    during its own fsync) rather than an append a crash cut short (format §22.2)."""
    if scan.epoch is None:
        return False
    full = rec.OVERHEAD + GLOBAL_HEAD_SIZE + RANK_ENTRY_SIZE * scan.epoch.world_size
    return scan.size - scan.valid_end >= full


def quarantine_tail(layout: JobLayout, ops: FileOps, scan: EpochScan) -> str:
    """Copy the bytes after ``scan``'s valid prefix to quarantine/ (fsynced, with the directory):
    a newer job never writes an older job's log, so a suspicious tail it adopts past is kept
    here for inspection instead. Returns the copy's path."""
    with io_errors("read", scan.path):
        with open(scan.path, "rb") as f:
            f.seek(scan.valid_end)
            data = f.read()
    ops.makedirs(layout.quarantine_dir)
    dest = layout.quarantine_path(scan.number, scan.valid_end)
    ops.write_file(dest, data)
    ops.fsync_dir(layout.quarantine_dir)
    ops.fsync_dir(layout.root)
    return dest


@dataclass
class JobView:
    """The committed state of a job store, from its global logs."""

    #: the newest valid epoch (None: no job has claimed the store yet)
    epoch: Epoch | None
    #: visible global commits by iteration, ascending
    commits: dict[int, GlobalCommit]
    #: every global log read, by epoch number
    logs: dict[int, EpochScan]
    #: epochs on the adoption chain, oldest first
    chain: list[int]
    #: the highest epoch number claimed (a file exists), valid or not
    highest_claimed: int
    #: notes on damage and on commits ignored (an older job's commits after a newer job began)
    notes: list[str]

    @property
    def latest(self) -> int | None:
        return next(reversed(self.commits)) if self.commits else None


def read_job_view(layout: JobLayout, store_id: bytes) -> JobView:
    """Read every global log and resolve which global commits are visible:

    1. the newest epoch whose log starts with a valid EPOCH record is the current one;
    2. the chain is that epoch, the epoch it adopted, the one that one adopted, ...;
    3. an epoch's commits are visible up to its valid prefix's end, and for every epoch but the
       current one only those ending at or before its successor's ``adopted_end``;
    4. iterations strictly increase along the chain (a commit that does not is ignored, noted).
    Epochs off the chain (a job that crashed before writing its EPOCH record) hold nothing."""
    numbers = layout.list_epochs()
    logs = {n: scan_epoch_log(layout.epoch_log_path(n), n, store_id) for n in numbers}
    notes = [f"global log of epoch {s.number}: {s.damage}" for s in logs.values() if s.damage]
    valid = [n for n in numbers if logs[n].epoch is not None]
    chain: list[int] = []
    cutoffs: dict[int, int | None] = {}
    if valid:
        n, cutoff = valid[-1], None
        while True:
            chain.append(n)
            cutoffs[n] = cutoff
            e = logs[n].epoch
            assert e is not None
            if e.adopted_epoch == 0:
                break
            prev = logs.get(e.adopted_epoch)
            if prev is None or prev.epoch is None:
                notes.append(f"epoch {n} adopts epoch {e.adopted_epoch}, whose global log is "
                             "missing or invalid: its commits are not visible")
                break
            n, cutoff = e.adopted_epoch, e.adopted_end
        chain.reverse()
    commits: dict[int, GlobalCommit] = {}
    last = -1
    for n in chain:
        cutoff = cutoffs[n]
        for g, end in logs[n].commits:
            if cutoff is not None and end > cutoff:
                notes.append(f"epoch {n}: global commit of iteration {g.iteration} was written "
                             f"after epoch {next(c for c in chain if c > n)} began: ignored")
                continue
            if g.iteration <= last:
                notes.append(f"epoch {n}: global commit of iteration {g.iteration} does not "
                             f"follow iteration {last}: ignored")
                continue
            commits[g.iteration] = g
            last = g.iteration
    current = logs[chain[-1]].epoch if chain else None
    return JobView(current, commits, logs, chain, numbers[-1] if numbers else 0, notes)


# ---- writing ------------------------------------------------------------------------------------
def claim_next_epoch(layout: JobLayout, ops: FileOps, after: int) -> "EpochLog":
    """Claim the lowest free epoch above ``after`` (the highest claimed one a view read):
    :meth:`EpochLog.claim`, moving up past numbers another job claimed first."""
    number = after
    for _ in range(64):
        number += 1
        try:
            return EpochLog.claim(layout, ops, number)
        except FileExistsError:
            continue
    raise CkptStoreError(f"{layout.root}: could not claim a writer epoch after {number}")


class EpochLog:
    """The global log of the epoch this job claimed (written by the job's coordinator only)."""

    def __init__(self, layout: JobLayout, ops: FileOps, number: int, fd: int) -> None:
        self.layout = layout
        self.number = number
        self.path = layout.epoch_log_path(number)
        self.epoch: Epoch | None = None
        self._ops = ops
        self._fd: int | None = fd
        #: where the next record goes (everything before is durable)
        self.end = 0
        #: an append failed and cutting it back failed too: nothing more may be appended
        self.broken = False

    @classmethod
    def claim(cls, layout: JobLayout, ops: FileOps, number: int) -> "EpochLog":
        """Create the global log of epoch ``number`` exclusively (durable, empty): from now on an
        older job's coordinator sees it and commits no more (:meth:`superseded`). The caller then
        reads what it adopts and writes the EPOCH record (:meth:`write_epoch`). Raises
        FileExistsError when another job claimed that number first."""
        path = layout.epoch_log_path(number)
        try:
            fd = ops.open_append(path, create=True)
        except StoreIOError as e:
            if e.errno == errno.EEXIST:
                raise FileExistsError(errno.EEXIST, f"epoch {number} is already claimed",
                                      path) from None
            raise
        log = cls(layout, ops, number, fd)
        try:
            ops.fsync_dir(layout.global_dir)
        except BaseException:
            log.close()
            raise
        return log

    @classmethod
    def staged(cls, layout: JobLayout, ops: FileOps, number: int) -> "EpochLog":
        """A new, empty log of epoch ``number`` at its gc name (:meth:`JobLayout.gc_log_path`):
        a job-store gc writes its EPOCH and GLOBAL_COMMIT records there, then renames it over the
        claimed log (format §22.7). An older file of that name is replaced."""
        path = layout.gc_log_path(number)
        if os.path.exists(path):
            ops.unlink(path)
        log = cls(layout, ops, number, ops.open_append(path, create=True))
        log.path = path
        return log

    def write_epoch(self, epoch: Epoch) -> None:
        """Write this log's EPOCH record and make it durable (once, first)."""
        assert self._fd is not None and self.end == 0 and epoch.epoch == self.number
        record = rec.encode_record(JobRecordType.EPOCH, encode_epoch(epoch))
        self._ops.writev(self._fd, self.path, [record], 0)
        self._ops.fsync(self._fd, self.path)
        self.epoch = epoch
        self.end = len(record)

    def superseded(self) -> int | None:
        """The number of a newer epoch claimed after this one (a newer job owns the store), or
        None."""
        newer = [n for n in self.layout.list_epochs() if n > self.number]
        return newer[-1] if newer else None

    def append_commits(self, commits: list[GlobalCommit]) -> int:
        """Append one GLOBAL_COMMIT record per commit (in iteration order) and fsync: the global
        commit point of their iterations. Returns the log's new end. On failure the records are
        cut back (if that fails too, the log is broken; the append's error is raised)."""
        if self._fd is None or self.broken or self.epoch is None:
            raise StoreIOError("append", self.path, OSError(errno.EIO, "the global log is closed "
                               "or broken by an earlier failure; reopen the store"))
        records = [rec.encode_record(JobRecordType.GLOBAL_COMMIT, encode_global_commit(g))
                   for g in commits]
        try:
            self._ops.writev(self._fd, self.path, records, self.end)
            self._ops.fsync(self._fd, self.path)
        except BaseException:
            try:
                self._ops.truncate(self._fd, self.path, self.end)
                self._ops.fsync(self._fd, self.path)
            except BaseException:  # noqa: BLE001 - the append's error is the one to report
                self.broken = True
            raise
        self.end += sum(len(r) for r in records)
        return self.end

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
