"""The one exception hierarchy of ckptstore.

Every error the package raises on purpose derives from :class:`CkptStoreError`. Where a builtin
exception has the same meaning, the subclass inherits it too (``NotFoundError`` is a ``KeyError``,
``UnsupportedTypeError`` a ``TypeError``), so callers can catch either. Third-party and OS errors are
wrapped with ``raise ... from`` so the original stays in ``__cause__``.

Messages say *what* went wrong and *where*: file, offset, iteration, tensor path.
"""

from __future__ import annotations


class CkptStoreError(Exception):
    """Root of every error ckptstore raises deliberately."""

    @classmethod
    def from_message(cls, message: str) -> "CkptStoreError":
        """An instance whose text is ``message``: another rank's error of this class, rebuilt
        from its report (:func:`rebuild`). TypeError when this class needs
        more than a message."""
        return cls(message)


class FormatError(CkptStoreError):
    """Bytes read from a store do not decode: bad magic, length, field value or checksum.

    ``path`` and ``offset`` locate the bad bytes when they are known (pure codecs do not know them;
    the storage layer fills them in).
    """

    def __init__(self, message: str, *, path: str | None = None, offset: int | None = None) -> None:
        self.reason = message
        self.path = path
        self.offset = offset
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.path is not None:
            where.append(str(self.path))
        if self.offset is not None:
            where.append(f"offset {self.offset}")
        return f"{self.reason} ({', '.join(where)})" if where else self.reason

    def located(self, path: str, offset: int) -> "FormatError":
        """Return a copy of this error that names the file and the offset of the record."""
        err = type(self).__new__(type(self))
        err.__dict__.update(self.__dict__)
        err.path = path
        err.offset = offset
        Exception.__init__(err, err._render())
        return err


class CorruptRecordError(FormatError):
    """A record is torn, truncated or fails its checksum."""


class ChecksumMismatch(CorruptRecordError):
    """A checksum or content address does not match the bytes it covers."""

    def __init__(self, what: str, expected: str, got: str, *, path: str | None = None,
                 offset: int | None = None) -> None:
        self.what = what
        self.expected = expected
        self.got = got
        super().__init__(f"{what}: checksum mismatch, expected {expected}, got {got}",
                         path=path, offset=offset)


class UnsupportedVersionError(FormatError):
    """The store or a record was written by a format version this code does not implement."""


class StoreNotFoundError(CkptStoreError, FileNotFoundError):
    """Opening a path that holds no store in read-only mode."""


class StoreLockedError(CkptStoreError):
    """Another process holds the store's single-writer lock."""


class ReadOnlyStoreError(CkptStoreError, PermissionError):
    """A write was attempted through a store opened with mode "r"."""


class JobStreamError(ReadOnlyStoreError):
    """A part of a multi-rank job store (a rank's stream under ``streams/``, or anything under
    it or ``global/``) was asked to change on its own: opened for writing, gc'd, repaired,
    pushed, pulled into, followed. A stream's commits are named by the job's global commits,
    so changing one stream alone would damage every iteration of the job; the job store
    (``ckptstore.open(job, ...)``, ``ckptstore fsck --repair job``) does it for every rank
    together. Reading a stream for inspection (mode "r") stays allowed. ``job`` is the job
    store's path."""

    def __init__(self, message: str, job: str) -> None:
        super().__init__(message)
        self.job = job


class StoreClosedError(CkptStoreError, ValueError):
    """The store was used after close()."""


class NotFoundError(CkptStoreError, KeyError):
    """An iteration, key or object the caller asked for is not in the store."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class IterationOrderError(CkptStoreError, ValueError):
    """An iteration is not greater than the latest committed one (iterations must increase)."""


class TargetMismatchError(CkptStoreError, ValueError):
    """A tensor given to load into (``load(..., into=...)``) cannot hold the stored tensor at the
    same path: another dtype, shape or device. Raised before any target is written."""


class UnsupportedTypeError(CkptStoreError, TypeError):
    """A state structure holds an object the format cannot represent; the message names its path."""


class ShardedStateError(UnsupportedTypeError):
    """A state holding DTensors (an FSDP2 / tensor-parallel ``state_dict()``) was saved where its
    shards cannot be written: into a store without a process group (a single store; a job store
    is written only with one). Raised before anything is written; ``path`` is the key of the first such DTensor (a tuple of dict keys and
    positions)."""

    def __init__(self, message: str, *, path: tuple = ()) -> None:
        self.path = path
        super().__init__(message)


class StoreIOError(CkptStoreError, OSError):
    """An operating-system I/O call failed (ENOSPC, EIO, EDQUOT, EROFS, ...).

    ``errno`` is the OS error number; the message names the operation and the file. The store stays
    consistent: everything committed before the failure is intact.
    """

    def __init__(self, operation: str, path: str, cause: OSError) -> None:
        self.operation = operation
        self.filename = path
        OSError.__init__(self, cause.errno, f"{operation} failed on {path}: {cause.strerror or cause}")

    def __str__(self) -> str:
        return self.args[1] if len(self.args) > 1 else super().__str__()

    @classmethod
    def from_message(cls, message: str) -> "StoreIOError":
        """Another rank's I/O error, rebuilt from its report: ``message`` names the operation and
        the file; the errno stays on the rank that had it (None here)."""
        error = cls.__new__(cls)
        OSError.__init__(error, None, message)
        error.operation = ""
        return error


class DiskFullError(StoreIOError):
    """ENOSPC or EDQUOT while writing."""


class DamagedCheckpointError(CkptStoreError):
    """A committed checkpoint cannot be read back intact (a chunk, tree or manifest is damaged)."""


class IndexUnusable(CkptStoreError):
    """The writer's LMDB index (a cache of the log, format-spec/format.md §16) cannot be opened or
    read, or holds a value that does not decode or does not match the log. The store handles it by
    rebuilding the index from the log; it reaches callers only from direct index use.

    ``log_damage``, when set, says that the index is sound but the log record it names is damaged
    (the message a reader reports if the rebuilt view then lacks that checkpoint)."""

    log_damage: str | None = None


class DeltaChainError(CkptStoreError, ValueError):
    """A gradient delta cannot be written or replayed because its chain is broken: no preceding
    base snapshot, a gap (the delta for iteration t must follow iteration t-1), or a delta whose
    predecessor is missing or unrecoverable."""


class ReplayDivergenceError(CkptStoreError):
    """Replaying deltas produced a state whose fingerprint differs from the one the trainer
    recorded. ``iteration`` names the first iteration that diverged."""

    def __init__(self, message: str, iteration: int) -> None:
        self.iteration = iteration
        super().__init__(message)


class BisectError(CkptStoreError, ValueError):
    """``bisect`` was asked something it cannot answer: a range that holds no committed
    iteration (or starts after it ends), a malformed condition, a ``module:function`` condition
    that cannot be imported or is not callable, a meta key that no iteration holds
    (ckptstore/ops/bisect.py)."""


class BisectPredicateError(CkptStoreError):
    """A bisect condition failed at ``iteration``: its function raised (the error is the
    ``__cause__``), or the meta value it compares is not a number there."""

    def __init__(self, message: str, iteration: int) -> None:
        self.iteration = iteration
        super().__init__(message)


class CheckpointAbortedError(CkptStoreError):
    """An asynchronous checkpoint was not committed because another one failed first: it was
    queued behind the failure, or appended and waiting for its group's commit when the failure
    rolled the group back. ``__cause__`` is the original failure."""



class LoanWithdrawnError(CheckpointAbortedError):
    """An asynchronous save was dropped unwritten because the tensors lent to it (instead of
    copied: the Checkpointer's gradients, ckptstore/ops/loan.py) changed before the persister
    read them; the lender records that state another way (the Checkpointer writes a base
    snapshot of it). Nothing committed is affected."""

class LiveStateChangedError(CkptStoreError):
    """A tensor handed to an overlapped snapshot (``save_async(..., deferred=...)``, the
    Checkpointer's snapshots) changed in place before its background copy had finished: the
    checkpoint would not be the state of its iteration, so it is not written (``path``: the
    tensor's path in the state). Change such tensors only after ``future.copied()`` returned (the
    Checkpointer waits before its next ``optimizer.step()``), or copy at once (``overlap=False``)."""

    def __init__(self, message: str, path: str) -> None:
        self.path = path
        super().__init__(message)


class DamagedIndexWarning(UserWarning):
    """A read through the index (a cache of the log) failed a check and succeeded once the writer
    rebuilt the index, or the reader read from the log instead. No data is lost and the load is
    exact; ``ckptstore fsck --repair`` rebuilds the index for later readers. Issued once per open
    store."""


class StoreFeaturesError(CkptStoreError, ValueError):
    """The store was asked for without features it has (``features="compatible"`` on a store
    created with format features, format-spec/format.md §4): features are chosen when a store
    is created and never removed, and releases that do not know them refuse to read it."""


class StaleWriterError(CkptStoreError):
    """This writer belongs to an older job: a newer job claimed a higher writer epoch of the
    multi-rank store (format-spec/format.md §22, "Epochs and fencing"). Nothing this writer
    appended after that is visible, and it may not commit again."""


class RankMismatchError(CkptStoreError, ValueError):
    """The ranks of a multi-rank store disagree: on the iteration being committed, its kind, the
    world size, or the store itself. Nothing was committed."""


class RankFailureError(CkptStoreError):
    """Another rank of a multi-rank store failed or did not answer within the commit timeout
    (a dead rank, a broken process group) before the iteration's outcome was decided: it was not
    committed. The store must be closed; a new job reopens it."""


class CommitOutcomeUnknownError(RankFailureError):
    """Contact with the other ranks was lost after this rank's records were durable and it had
    voted to commit: the coordinator may or may not have written the global commit. This rank
    keeps its records; reopening the store (a new job) tells from the global log whether the
    iteration is committed."""


class GlobalCommitAbortedError(CheckpointAbortedError):
    """A multi-rank store's commit round aborted this checkpoint on every rank: another rank
    failed before its records were durable (its error is named), or the global log could not be
    written. What this rank prepared was cut back; earlier commits are intact.

    ``failures``: ``(rank, "TypeName: message")`` of every rank whose operation failed in the
    round (empty when the global log failed); the first other rank's error, rebuilt as its
    ckptstore type (a DiskFullError naming the file), is this error's ``__cause__``."""

    def __init__(self, message: str, failures: tuple[tuple[int, str], ...] = ()) -> None:
        super().__init__(message)
        self.failures = failures


class DCPError(CkptStoreError):
    """``ckptstore.dcp`` (the storage layer of ``torch.distributed.checkpoint``) cannot do what
    DCP asked: a multi-rank save without a multi-rank job store (or with ``no_dist``, or a
    process group that does not match the store's ranks), a ``checkpoint_id`` that names no iteration, an
    iteration that holds no DCP checkpoint or whose DCP metadata does not decode, a plan that
    names what the checkpoint does not hold. Nothing was committed."""


class ShardCoverageError(DCPError, DamagedCheckpointError):
    """The shards a checkpoint records for a tensor do not tile it exactly: two shards overlap,
    or part of the tensor is in no shard (a gap). ``fqn`` names the tensor, ``offsets`` and
    ``sizes`` the box that is covered twice or not at all, ``ranks`` the rank streams of the
    shards involved. For a DCP checkpoint (its metadata's shards), loads of that tensor raise
    it before reading anything; the checkpoint's other tensors stay loadable
    (format-spec/dcp.md §3). For sharded Checkpointer parts (the BOXes of their ``shards``
    sections, format-spec/deltas.md "Sharded states"), assembling the iteration's whole state
    raises it before any tensor is assembled; each rank's own part stays loadable. Also a
    DamagedCheckpointError: such a committed checkpoint cannot be read back whole."""

    def __init__(self, message: str, *, fqn: str, offsets: tuple[int, ...],
                 sizes: tuple[int, ...], ranks: tuple[int, ...] = ()) -> None:
        self.fqn, self.offsets, self.sizes, self.ranks = fqn, offsets, sizes, ranks
        super().__init__(message)


class ShardMismatchError(DCPError, ValueError):
    """A load asks for what a DCP checkpoint's metadata cannot serve: a key it does not hold, a
    tensor where it stores a non-tensor value (or the reverse), another global shape, or a box
    outside the stored shard it names (a plan made against other metadata). ``fqn`` names the
    tensor or value. Raised before anything is read."""

    def __init__(self, message: str, *, fqn: str) -> None:
        self.fqn = fqn
        super().__init__(message)


class ShardDamagedError(DamagedCheckpointError):
    """The bytes of one shard of a DCP checkpoint fail verification (a chunk whose content does
    not match its address, an unreadable record) in the rank stream that holds it. ``rank`` and
    ``stream`` name where it is stored (rank 0 and the store itself for a single-process save),
    ``fqn`` and ``offsets`` the shard; ``__cause__`` is the store's error. The other ranks'
    shards are unaffected."""

    def __init__(self, message: str, *, rank: int, stream: str, fqn: str,
                 offsets: tuple[int, ...]) -> None:
        self.rank, self.stream, self.fqn, self.offsets = rank, stream, fqn, offsets
        super().__init__(message)


class ShardLayoutError(CkptStoreError, ValueError):
    """A sharded (FSDP2 / DTensor) Checkpointer state cannot be restored into the live model as
    asked: it was written at another world size, or a tensor's global shape, placements or mesh
    differ from the live parameter's (format-spec/deltas.md, "Sharded states").
    ``saved_world`` and ``world`` name the two world sizes; ``name`` the tensor, when one differs."""

    def __init__(self, message: str, *, saved_world: int, world: int,
                 name: str | None = None) -> None:
        self.saved_world, self.world, self.name = saved_world, world, name
        super().__init__(message)


class CheckpointPolicyError(CkptStoreError):
    """A Checkpointer running with ``on_failure="retry"`` gave up: too many checkpoints failed in
    a row, or the last durable checkpoint is too old (ckptstore/torch/failure_policy.py).
    ``__cause__`` is the last failure."""


class CheckpointPlanError(CkptStoreError, ValueError):
    """A Checkpointer's checkpoint plan cannot be what was asked (ckptstore/torch/plan.py): an
    unknown ``policy``, an ``mtbf_s``, ``disk_budget`` or ``snapshot_every`` out of range. The
    message names the argument; it is raised before anything is written."""


class UnreplayableOptimizerError(CheckpointPlanError, TypeError):
    """``policy="every-iteration"`` with an optimizer whose step replay does not know (Lion,
    8-bit Adam, a custom one): deltas of it could not be replayed. Other policies checkpoint
    such an optimizer with snapshots. (A TypeError too, as the Checkpointer raised before.)"""


class RetentionError(CkptStoreError, ValueError):
    """A retention policy cannot be applied: it selects none of the committed iterations (it
    would delete every iteration: a meta key no checkpoint holds, an age or iteration bound past
    the newest one), or retention was asked of a store gc does not support (a multi-rank job
    store). Nothing was removed (ckptstore/ops/retention.py)."""


class ImportSourceError(CkptStoreError, ValueError):
    """A checkpoint written by another tool cannot be imported (ckptstore.interop): an
    unknown source kind, a torch.save file that ``torch.load(weights_only=True)`` refuses (the
    message names the file and what torch refused; nothing is ever unpickled beyond that), a DCP
    directory with missing or truncated files, a Hugging Face checkpoint without a model file, a
    value the store cannot hold. Raised before anything is written: the store is unchanged."""


class ExportError(CkptStoreError, ValueError):
    """An iteration cannot be written in the requested format (ckptstore.interop): an unknown
    format, a target that already exists where it may not, a state the format cannot hold.
    Nothing is left at the target."""


class ImportSkippedWarning(UserWarning):
    """An optional file of an imported checkpoint was left out (an RNG state that
    ``torch.load(weights_only=True)`` refuses); the warning names it and why."""


class RemoteError(StoreIOError):
    """The object store behind a remote tier (``remote="s3://..."``, ``ckptstore push/pull``)
    failed or refused a request: unreachable endpoint, wrong credentials, missing bucket,
    throttling, a timeout (ckptstore/remote/, format-spec/remote.md). ``operation`` says what was
    attempted, ``url`` (also ``filename``) which object or prefix, ``code`` the service's error
    code ("NoSuchBucket", "InvalidAccessKeyId", "Unreachable", ...). Nothing local is ever lost
    or changed by it: the local log stays the durable copy, and the uploader retries with
    backoff."""

    def __init__(self, operation: str, url: str, message: str, *, code: str = "",
                 errno_: int = 5) -> None:
        self.operation = operation
        self.filename = url
        self.url = url
        self.code = code
        OSError.__init__(self, errno_, f"{operation} failed on {url}: {message}"
                         + (f" [{code}]" if code and code not in message else ""))

    @classmethod
    def from_message(cls, message: str) -> "StoreIOError":
        """Another rank's remote error, rebuilt from its report (the message names the operation,
        the URL and the code; the attributes are empty here)."""
        error = super().from_message(message)
        error.filename = ""
        setattr(error, "url", "")
        setattr(error, "code", "")
        return error


class RemoteIntegrityError(RemoteError):
    """A remote object does not hold what the remote HEAD says (its length or xxh3-128 digest
    differs: changed or truncated behind our back), or a HEAD object fails its own check. The
    message names the object; nothing wrong is ever written locally."""


class RemoteStreamMissingError(RemoteIntegrityError):
    """A remote job store's HEAD names a rank's stream whose objects are missing (its HEAD or an
    extent: deleted behind our back, or a lifecycle rule). ``rank`` and ``epoch`` say whose
    stream, ``url`` which object (format-spec/remote.md §8); nothing local was changed."""

    def __init__(self, operation: str, url: str, message: str, *, rank: int, epoch: int,
                 code: str = "") -> None:
        self.rank = rank
        self.epoch = epoch
        super().__init__(operation, url, message, code=code)


class RemoteConflictError(RemoteError):
    """The remote prefix holds another store (another store_id), or a history this store cannot
    continue: the remote copy is newer than the local one or diverged from it, or another writer
    wrote the same HEAD generation. Nothing was overwritten, remotely or locally."""


class RemoteUnsupportedError(CkptStoreError, ValueError):
    """A remote tier was asked of something it does not support: a URL scheme other than
    ``s3://``, a remote store opened for writing (``mode="a"`` on a URL), or a missing client
    library (``pip install 'ckptstore[remote]'``)."""


class FollowerError(CkptStoreError):
    """A shadow follower (``ckptstore follow``, :mod:`ckptstore.follow`,
    format-spec/follower.md) cannot follow this primary store: it holds no base snapshot yet, its
    chain does not start from a Checkpointer base (no replay section), it is a multi-rank job
    store, or a committed delta cannot be replayed. The message names the store and the
    iteration; nothing in the primary is ever changed."""


class FollowerMismatchError(FollowerError):
    """The follower store (``<primary>/follower/``) holds bases of another primary store (another
    store id, or iterations whose recorded manifest digests differ from the primary's commits):
    ``ckptstore follow`` refuses to write into it; readers ignore it (FollowerWarning)."""


class FollowerWarning(UserWarning):
    """A follower base was not used for a load: it reproduces another primary or another
    history, it failed to read, or replay from it failed. The load went on from the primary's own
    base (or an older follower base) and is exact: a follower store is a cache, it may cost time,
    never a load. Issued once per follower base and reason."""


# ---- errors that cross ranks -----------------------------------------------------------------
# Errors that cross ranks: what a FAILED vote says, and how the other ranks rebuild it.
#
# A rank whose commit operation fails votes FAILED with one line, ``"TypeName: message"``, of the
# root ckptstore error of its failure (:func:`describe`: the innermost CkptStoreError on the
# ``__cause__`` chain, e.g. the DiskFullError naming the file rather than the CheckpointAbortedError
# that wraps it). The other ranks rebuild it (:func:`rebuild`) as an instance of that class when
# :mod:`ckptstore.errors` defines it, looked up by name among CkptStoreError subclasses only (nothing
# is imported or unpickled on a peer's word); otherwise, or when the class takes other arguments, as
# RankFailureError. Either way its message starts with the rank that raised it, and its ``rank``
# attribute holds it. The committer makes it the ``__cause__`` of each rank's own error.


def describe(error: BaseException) -> str:
    """One line for a FAILED vote: ``"TypeName: message"`` of ``error``'s root ckptstore error
    (``error`` itself when no CkptStoreError caused it)."""
    root: BaseException = error
    cause = error.__cause__
    while cause is not None:
        if isinstance(cause, CkptStoreError):
            root = cause
        cause = cause.__cause__
    return f"{type(root).__name__}: {root}"


def rebuild(rank: int, text: str) -> CkptStoreError:
    """The error rank ``rank`` described as ``text`` (:func:`describe`), as a typed error."""
    name, sep, message = text.partition(": ")
    cls = globals().get(name) if sep else None
    error: CkptStoreError | None = None
    if isinstance(cls, type) and issubclass(cls, CkptStoreError):
        try:
            error = cls.from_message(f"rank {rank}: {message}")
        except TypeError:  # a class whose constructor takes more than a message
            error = None
    if error is None:
        error = RankFailureError(f"rank {rank}: {text}")
    setattr(error, "rank", rank)
    return error
