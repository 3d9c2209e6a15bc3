"""A remote job store's names and its commit point, the job HEAD (format-spec/remote.md §8).

The codec, like :mod:`ckptstore.remote.head`: names from numbers and digests, job HEAD bytes in
and a checked :class:`JobHead` out; and reading the job HEADs of a prefix (shared by the push,
:mod:`~ckptstore.remote.job_push`, and the pull, :mod:`~ckptstore.remote.job_pull`). A remote
job store is::

    PREFIX/
      STORE                                    the job's STORE file (format_version 2)
      streams/EEEEEEEEEE-RRRRR/                the remote copy of one rank's stream: the
                                               single-store layout (§2), its own STORE and heads/
      global/EEEEEEEEEE/OOOOOOOOOOOOOOO-LLLLLLLLLLLLLLL-DDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDD
                                               bytes [O, O+L) of the global log of epoch E
      jobheads/GGGGGGGGGGGGGGGGGGGG            a job HEAD: a consistent cut of the job

A job HEAD names, for one consistent cut, each needed stream's HEAD (generation and the xxh3-128
of the HEAD object's bytes) and each global log's uploaded prefix (its extents); every object it
names was written before it (H1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


from ..errors import FormatError, RemoteIntegrityError, StoreNotFoundError
from .client import ObjectStore, RemoteURL, parse_url
from .head import (Extent, checked_hex16, checked_int, checked_opt_int, seal_json,
                   unseal_json)
from .generations import first_valid
from .replicate import fetch_sealed


JOB_HEADS_DIR = "jobheads/"
GLOBAL_DIR = "global/"
STREAMS_DIR = "streams/"
JOB_HEAD_FORMAT = "ckptstore-remote-job-head"
JOB_HEAD_VERSION = 1
_JOB_HEAD_RE = re.compile(r"^jobheads/(\d{20})$")
_LOG_EXTENT_RE = re.compile(r"^global/(\d{10})/(\d{15})-(\d{15})-([0-9a-f]{32})$")
_STREAM_RE = re.compile(r"^streams/(\d{10})-(\d{5})/")


def job_head_name(generation: int) -> str:
    if not 0 < generation < 10**20:
        raise ValueError(f"job HEAD generation {generation} out of range")
    return f"{JOB_HEADS_DIR}{generation:020d}"


def job_head_generation(name: str) -> int | None:
    """The generation a job HEAD's name carries, or None if ``name`` names none."""
    m = _JOB_HEAD_RE.match(name)
    return int(m.group(1)) if m and int(m.group(1)) > 0 else None


def log_extent_name(e: Extent) -> str:
    """The object of bytes [offset, end) of the global log of epoch ``e.seq``."""
    return f"{GLOBAL_DIR}{e.seq:010d}/{e.offset:015d}-{e.length:015d}-{e.digest.hex()}"


def is_log_extent_name(name: str) -> bool:
    return _LOG_EXTENT_RE.match(name) is not None


def stream_prefix(epoch: int, rank: int) -> str:
    """The prefix (below the job's) of the remote copy of rank ``rank``'s stream of ``epoch``."""
    if not 0 < epoch < 10**10 or not 0 <= rank < 10**5:
        raise ValueError(f"stream of epoch {epoch}, rank {rank} out of range")
    return f"{STREAMS_DIR}{epoch:010d}-{rank:05d}"


def stream_of(name: str) -> tuple[int, int] | None:
    """The (epoch, rank) of the stream whose prefix holds the object ``name`` (None: no
    stream's)."""
    m = _STREAM_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def stream_url(url: str, epoch: int, rank: int) -> str:
    """The URL of rank ``rank``'s stream copy of ``epoch`` under the job's ``url``."""
    where = parse_url(url)
    return str(RemoteURL(where.bucket, where.key(stream_prefix(epoch, rank))))


def stream_store(root: ObjectStore, epoch: int, rank: int, options: dict) -> ObjectStore:
    """The object store of one stream's remote copy (under the job's prefix)."""
    where = root.where
    return ObjectStore(RemoteURL(where.bucket, where.key(stream_prefix(epoch, rank))), options)


def is_remote_job(store: ObjectStore) -> bool:
    """Whether the prefix holds a remote job store (any job HEAD object)."""
    return any(job_head_generation(n) is not None for n in store.list_objects(JOB_HEADS_DIR))


@dataclass(frozen=True)
class StreamRef:
    """A rank's stream in a job HEAD: the stream's HEAD of ``generation`` whose object bytes
    hash to ``digest`` (xxh3-128)."""

    epoch: int
    rank: int
    generation: int
    digest: bytes

    @property
    def prefix(self) -> str:
        return stream_prefix(self.epoch, self.rank)


@dataclass(frozen=True)
class LogEntry:
    """The first ``length`` bytes of the global log of ``epoch``, as consecutive extents."""

    epoch: int
    length: int
    extents: tuple[Extent, ...]


@dataclass(frozen=True)
class JobHead:
    """A remote job commit point: a consistent cut of the job store."""

    generation: int
    store_id: bytes
    #: xxh3-128 of the job's STORE object
    store_digest: bytes
    #: the current epoch of the cut (0: none) and its global log's uploaded length: the cut's
    #: position (only grows over a job store's life: epochs grow, a global log is append-only)
    epoch: int
    end: int
    #: the newest visible iteration of the cut, and how many are visible
    latest: int | None
    count: int
    streams: tuple[StreamRef, ...]
    logs: tuple[LogEntry, ...]
    created_ns: int = 0
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def name(self) -> str:
        return job_head_name(self.generation)

    @property
    def recoverable(self) -> int | None:
        """The newest iteration a restore loads (as :attr:`Head.recoverable`)."""
        return self.latest

    @property
    def position(self) -> tuple[int, int]:
        return (self.epoch, self.end)

    def objects(self) -> set[str]:
        """What this job HEAD names under the job's prefix: its objects (STORE, the log
        extents) and, as ``streams/EEEEEEEEEE-RRRRR/``, the prefix of each stream it pins (the
        streams' objects are named by the stream HEADs it pins)."""
        return ({"STORE"} | {log_extent_name(e) for lg in self.logs for e in lg.extents}
                | {f"{s.prefix}/" for s in self.streams})

    def stream(self, epoch: int, rank: int) -> StreamRef | None:
        return next((s for s in self.streams if (s.epoch, s.rank) == (epoch, rank)), None)

    def log(self, epoch: int) -> LogEntry | None:
        return next((lg for lg in self.logs if lg.epoch == epoch), None)


def encode_job_head(h: JobHead) -> bytes:
    body = {
        "format": JOB_HEAD_FORMAT, "v": JOB_HEAD_VERSION, "generation": h.generation,
        "store_id": h.store_id.hex(), "store": h.store_digest.hex(), "epoch": h.epoch,
        "end": h.end, "latest": h.latest, "iterations": h.count, "created_ns": h.created_ns,
        "streams": [[s.epoch, s.rank, s.generation, s.digest.hex()] for s in h.streams],
        "logs": [[lg.epoch, lg.length, [[e.offset, e.length, e.digest.hex()]
                                        for e in lg.extents]] for lg in h.logs],
        **h.extra,
    }
    return seal_json(body)


def decode_job_head(data: bytes, generation: int) -> JobHead:
    """Check and decode a job HEAD named with ``generation``; FormatError says why not."""
    body = unseal_json(data, JOB_HEAD_FORMAT, JOB_HEAD_VERSION, "job HEAD")
    if checked_int(body.get("generation"), "generation", 1) != generation:
        raise FormatError(f"job HEAD: generation {body.get('generation')} differs from its "
                          f"name's {generation}")
    streams: list[StreamRef] = []
    for item in _list(body.get("streams"), "streams"):
        if not (isinstance(item, list) and len(item) == 4):
            raise FormatError(f"job HEAD: malformed stream entry {item!r:.80}")
        s = StreamRef(checked_int(item[0], "stream epoch", 1, 10**10 - 1),
                      checked_int(item[1], "stream rank", 0, 10**5 - 1),
                      checked_int(item[2], "stream HEAD generation", 1, 10**20 - 1),
                      checked_hex16(item[3], "stream HEAD digest"))
        if streams and (s.epoch, s.rank) <= (streams[-1].epoch, streams[-1].rank):
            raise FormatError(f"job HEAD: stream {s.prefix} out of order")
        streams.append(s)
    logs: list[LogEntry] = []
    for item in _list(body.get("logs"), "logs"):
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[2], list)):
            raise FormatError(f"job HEAD: malformed log entry {item!r:.80}")
        epoch = checked_int(item[0], "log epoch", 1, 10**10 - 1)
        length = checked_int(item[1], f"length of the global log of epoch {epoch}", 1)
        if logs and epoch <= logs[-1].epoch:
            raise FormatError(f"job HEAD: global log of epoch {epoch} out of order")
        extents: list[Extent] = []
        at = 0
        for x in item[2]:
            if not (isinstance(x, list) and len(x) == 3):
                raise FormatError(f"job HEAD: malformed extent {x!r:.80} of epoch {epoch}")
            off = checked_int(x[0], "extent offset", 0, 10**15 - 1)
            n = checked_int(x[1], "extent length", 1, 10**15 - 1)
            if off != at:
                raise FormatError(f"job HEAD: extents of epoch {epoch} are not consecutive "
                                  f"at {at}")
            extents.append(Extent(epoch, off, n, checked_hex16(x[2], "extent digest")))
            at = off + n
        if at != length:
            raise FormatError(f"job HEAD: extents of epoch {epoch} cover {at} bytes, not {length}")
        logs.append(LogEntry(epoch, length, tuple(extents)))
    epoch = checked_int(body.get("epoch"), "epoch", 0, 10**10 - 1)
    end = checked_int(body.get("end"), "end")
    current = next((lg for lg in logs if lg.epoch == epoch), None)
    if epoch and (current is None or current.length != end or logs[-1].epoch != epoch):
        raise FormatError(f"job HEAD: the current epoch {epoch} (end {end}) is not its newest "
                          "global log")
    known = {"format", "v", "generation", "store_id", "store", "epoch", "end", "latest",
             "iterations", "created_ns", "streams", "logs"}
    return JobHead(generation=generation, store_id=checked_hex16(body.get("store_id"), "store_id"),
                   store_digest=checked_hex16(body.get("store"), "store digest"), epoch=epoch,
                   end=end, latest=checked_opt_int(body.get("latest"), "latest"),
                   count=checked_int(body.get("iterations", 0), "iterations"),
                   streams=tuple(streams), logs=tuple(logs),
                   created_ns=checked_int(body.get("created_ns", 0), "created_ns"),
                   extra={k: v for k, v in body.items() if k not in known})


def _list(v: object, what: str) -> list:
    if not isinstance(v, list):
        raise FormatError(f"job HEAD: {what} must be a list")
    return v


# ---- reading ----------------------------------------------------------------------------------
def list_job_heads(listed: dict[str, int]) -> list[int]:
    """Job HEAD generations among listed object names, newest first."""
    return sorted((g for n in listed if (g := job_head_generation(n)) is not None), reverse=True)


def read_job_head(store: ObjectStore, generation: int) -> JobHead:
    """The job HEAD of ``generation``, checked; RemoteIntegrityError naming it when it fails."""
    name = job_head_name(generation)
    data = fetch_sealed(store, name)
    try:
        return decode_job_head(data, generation)
    except FormatError as e:
        raise RemoteIntegrityError("read job HEAD", store.where.url(name), str(e)) from e


def newest_job_head(store: ObjectStore) -> JobHead:
    """The newest job HEAD that passes its checks (a damaged newer one is skipped, with a
    warning); StoreNotFoundError when there is none, RemoteIntegrityError when none is valid."""
    gens = list_job_heads(store.list_objects(JOB_HEADS_DIR))
    if not gens:
        raise StoreNotFoundError(f"no ckptstore job store at {store.where} (no job HEAD under "
                                 f"{store.where.url(JOB_HEADS_DIR)})")
    return first_valid(gens, lambda g: read_job_head(store, g), "job HEAD")
