"""The background remote tier of a job store's writer ranks (format-spec/remote.md §8.3).

``ckptstore.open(path, "a", process_group=pg, remote="s3://...", remote_options={...})``:

1. every rank opens its own stream with the single store's :class:`~.uploader.Uploader` on the
   stream's prefix (:func:`stream_url`): each rank uploads its own stream, after its own commits,
   at most once per ``head_interval``; its remote gc keeps the stream HEADs that kept job HEADs
   pin (:func:`stream_pins`, asked at each gc);
2. rank 0 runs a :class:`JobHeadUploader`: every ``head_interval`` it reads the job's global logs
   and the newest HEAD each rank's uploader wrote (older epochs' streams, closed, it uploads
   itself), and writes a job HEAD for the cut those stream HEADs cover
   (:class:`~.job_push.JobReplicator`, the code path of a push): the global log's commits are
   uploaded after the streams they name;
3. at close every rank flushes its stream's uploader, the ranks meet, and rank 0 writes the final
   job HEAD (:meth:`JobHeadUploader.finish`).

Failures never reach training: they are logged and kept (:attr:`JobHeadUploader.error`), and the
next round re-reads the remote.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from typing import Any

from ..errors import CkptStoreError, RemoteError, RemoteUnsupportedError, StoreNotFoundError
from .client import ObjectStore, parse_url
from .job_head import JobHead, list_job_heads, newest_job_head, read_job_head, stream_url
from .job_push import JobReplicator
from .head import head_name
from .replicate import SyncStats, split_options
from .uploader import RemoteStatus

log = logging.getLogger("ckptstore")


def stream_pins(root: ObjectStore, keep_heads: int, epoch: int, rank: int) -> frozenset[int]:
    """The generations of stream (epoch, rank)'s HEADs that the newest ``keep_heads`` valid job
    HEADs pin (J4: the stream's remote gc keeps them)."""
    out: set[int] = set()
    valid = 0
    for g in list_job_heads(root.list_objects("jobheads/")):
        try:
            h = read_job_head(root, g)
        except RemoteError:
            continue  # damaged, or collected since the listing
        ref = h.stream(epoch, rank)
        if ref is not None:
            out.add(ref.generation)
        valid += 1
        if valid >= keep_heads:
            break
    return frozenset(out)


class JobHeadUploader:
    """Rank 0's thread writing job HEADs while the job trains (module docstring, 2)."""

    def __init__(self, path: str, url: str, options: dict | None, epoch: int) -> None:
        client_opts, self.opts = split_options(options)
        self.path = path
        self.rep = JobReplicator(ObjectStore(url, client_opts), client_opts, self.opts)
        self.rep.live_epoch = epoch
        #: the newest job HEAD written or found, the last round's failure (None: it succeeded)
        self.head: JobHead | None = None
        self.error: BaseException | None = None
        #: failed rounds in a row, and when the last round succeeded (time.monotonic())
        self.failures = 0
        self.last_sync = -math.inf
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one sync at a time
        self._thread = threading.Thread(target=self._run, name=f"ckptstore-remote-job {url}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.opts.head_interval):
            self.sync_once()

    def sync_once(self) -> JobHead | None:
        """One round (:meth:`sync`); a failure is logged and kept, never raised: the newest job
        HEAD written or found."""
        try:
            return self.sync()
        except Exception:  # noqa: BLE001 - never raised into training (kept in .error)
            return self.head

    def sync(self) -> JobHead:
        """One round: a job HEAD for the newest cut the remote stream HEADs cover; then check
        that the live streams' HEADs it pins are still there (a rank's gc could have collected
        one between this round's reading and its job HEAD: then a second round names newer
        ones). A failure is logged, kept (:attr:`error`, :attr:`failures`) and raised."""
        with self._lock:
            try:
                for _ in range(2):
                    head = self.head = self.rep.sync(self.path)
                    if all(self.rep.streams[(s.epoch, s.rank)].store.size(head_name(s.generation))
                           is not None for s in head.streams
                           if (s.epoch, s.rank) in self.rep.streams):
                        break
                if self.error is not None:
                    log.info("ckptstore: the job's remote copy %s is written again",
                             self.rep.root.where)
                self.error = None
                self.failures = 0
                self.last_sync = time.monotonic()
                return head
            except Exception as e:
                if self.error is None:
                    log.warning("ckptstore: the job's remote copy %s: %s (retried)",
                                self.rep.root.where, e)
                self.error = e
                self.failures += 1
                self.rep.loaded = False  # re-read the remote next time
                raise

    def finish(self, timeout: float | None = None) -> JobHead | None:
        """Stop the thread, then write the final job HEAD (the ranks flushed their streams)."""
        self._stop.set()
        self._thread.join(self.opts.close_timeout if timeout is None else timeout)
        t0 = time.monotonic()
        head = self.sync_once()
        log.debug("ckptstore: final job HEAD in %.3f s", time.monotonic() - t0)
        return head

    def stop(self) -> None:
        self._stop.set()


class JobRemote:
    """What a job store's writer rank holds of the remote tier (module docstring): the options
    its stream opens with, rank 0's :class:`JobHeadUploader`, the close protocol."""

    def __init__(self, url: str, options: dict | None) -> None:
        client_opts, self.opts = split_options(options)  # (a bad option fails the open)
        self.url = str(parse_url(url))
        self.options = dict(options or {})
        self.root = ObjectStore(url, client_opts)
        self.job: JobHeadUploader | None = None

    def stream_options(self, epoch: int, rank: int) -> dict:
        """The keywords of rank ``rank``'s stream Store for ``epoch``: its own uploader."""
        return {"remote": stream_url(self.url, epoch, rank), "remote_options": self.options}

    def started(self, path: str, epoch: int, rank: int, stream: Any) -> None:
        """After the epoch's streams opened: the stream's gc learns the pins; rank 0 starts (or,
        after a job gc's new epoch, retargets) the job HEAD thread."""
        uploader = stream.uploader
        if uploader is not None:
            keep = self.opts.keep_heads
            uploader.rep.pins = lambda: stream_pins(self.root, keep, epoch, rank)
        if rank != 0:
            return
        if self.job is None:
            self.job = JobHeadUploader(path, self.url, self.options, epoch)
        else:
            self.job.rep.live_epoch = epoch

    def finish(self, stream: Any, group: Any, rank: int) -> None:
        """At close (collective): flush this rank's stream copy, meet, then rank 0 writes the
        final job HEAD. Remote failures are logged, never raised (the local store is intact)."""
        if stream is not None and not stream.closed and stream.uploader is not None:
            try:
                stream.remote_flush(self.opts.close_timeout)
            except RemoteError as e:
                log.warning("ckptstore: rank %d's stream copy may lag at close: %s", rank, e)
        group.all_gather(b"", "the remote copy's close")
        if self.job is not None:
            self.job.finish()

    def stop(self) -> None:
        if self.job is not None:
            self.job.stop()

    @staticmethod
    def of(remote: "JobRemote | None", path: str) -> "JobRemote":
        """``remote``; RemoteUnsupportedError when the job store was opened without remote=."""
        if remote is None:
            raise RemoteUnsupportedError(f"{path} was opened without remote=")
        return remote

    def status(self, stream: Any, local: int | None) -> RemoteStatus:
        """Where the job's remote copy stands, as a single store's :class:`RemoteStatus` (local to
        this rank, no collective): ``iteration`` and ``generation`` are the newest job HEAD's
        (rank 0: the one its thread wrote or found; another rank reads the newest valid one, one
        LIST and one GET, a failure kept in ``error``); ``local_iteration`` is ``local``, the
        job's newest visible iteration, and ``behind`` says the job HEAD holds less; the counters,
        the error and ``stopped`` are this rank's stream uploader's, with rank 0's job HEAD
        thread's added (its error first)."""
        up = getattr(stream, "uploader", None)
        own = up.status() if up is not None and not stream.closed else None
        job, error, head = self.job, None, None
        if job is not None:  # (before its first round: the newest one it read)
            head, error = job.head if job.head is not None else job.rep.head, job.error
        else:
            try:
                head = newest_job_head(self.root)
            except StoreNotFoundError:
                pass
            except RemoteError as e:
                error = e
        st = job.rep.all_stats() if job is not None else SyncStats()
        since = (None if job.last_sync == -math.inf else time.monotonic() - job.last_sync) \
            if job is not None else (own.seconds_since_sync if own is not None else None)
        latest = None if head is None else head.latest
        return RemoteStatus(
            self.url, latest, None if head is None else head.generation, local,
            local is not None and (latest is None or latest < local),
            st.uploaded_bytes + (own.uploaded_bytes if own else 0),
            st.uploaded_objects + (own.uploaded_objects if own else 0),
            st.heads_written + (own.heads_written if own else 0),
            error or (own.error if own else None),
            (job.failures if job else 0) + (own.failures if own else 0), since,
            own is None or own.stopped)

    def flush(self, stream: Any, group: Any, local: int | None,
              timeout: float | None = None) -> int | None:
        """Collective (every rank, between saves): wait until the job's remote copy holds every
        iteration visible now (``local``: rank 0's counts) and return the iteration of its job
        HEAD on every rank. In order:

        1. every rank flushes its stream's uploader (``timeout`` bounds it, as a single store's
           :meth:`~.uploader.Uploader.flush`);
        2. the ranks exchange the outcome (all_gather): when a rank failed, every rank raises its
           error, typed and naming that rank (ckptstore/errors.py: describe, rebuild);
        3. rank 0 writes a job HEAD for the cut the flushed stream HEADs cover (one round of its
           thread's :meth:`JobHeadUploader.sync`: every commit visible at the call is covered,
           each rank's COMMIT being durable before its GLOBAL_COMMIT) and broadcasts its
           iteration or its error (a RemoteError "Behind" when the cut still lacks ``local``).

        Nothing local changes; a remote failure leaves the job writing on. Keep ``timeout``
        under the group's ``commit_timeout``: the other ranks wait that long in step 2 before
        they count a rank as dead (RankFailureError)."""
        from ..errors import describe, rebuild

        failure: BaseException | None = None
        try:
            if stream is None:  # (a job gc that failed to start the new epoch: the job is broken)
                raise RemoteError("flush", self.url, "this rank's stream is not open",
                                  code="Stopped")
            stream.remote_flush(self.opts.close_timeout if timeout is None else timeout)
        except CkptStoreError as e:
            failure = e
        said = group.all_gather(b"" if failure is None else describe(failure).encode(),
                                "the remote copy's flush")
        bad = next((r for r, m in enumerate(said) if m), None)
        if bad is not None:
            if failure is not None:
                raise failure
            raise rebuild(bad, said[bad].decode(errors="replace"))
        if self.job is None:  # another rank: rank 0 says
            msg = group.broadcast(None, "the remote copy's job HEAD")
            if msg[:1] != b"\x01":
                raise rebuild(0, msg[1:].decode(errors="replace"))
            return json.loads(msg[1:])
        try:
            head = self.job.sync()
            if local is not None and (head.latest is None or head.latest < local):
                raise RemoteError("flush", self.url, f"the job HEAD (generation "
                                  f"{head.generation}) holds iteration {head.latest}, the job "
                                  f"{local}", code="Behind")
        except Exception as e:
            group.broadcast(b"\x00" + describe(e).encode(), "the remote copy's job HEAD")
            raise
        group.broadcast(b"\x01" + json.dumps(head.latest).encode(), "the remote copy's job HEAD")
        return head.latest
