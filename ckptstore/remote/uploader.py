"""The writer's background uploader: the remote tier below the local log.

A :class:`Uploader` belongs to one writer Store (``ckptstore.open(path, "a", remote="s3://...",
remote_options={...})``). It registers a listener in the writer engine's ``durable_listeners``
(ckptstore/engine/writer_engine.py: called after each commit is indexed and after a gc is
installed, under the engine's lock; the listener only sets a flag and wakes this thread), and
its one thread runs :meth:`~ckptstore.remote.replicate.Replicator.sync` -- the same code path as
``ckptstore push`` -- at most once per ``head_interval`` seconds while commits keep coming, or at
once when :meth:`Uploader.flush` asks. The local commit protocol is unchanged: a save returns
when the local log holds it; the remote copy follows.

Failures never reach training: the error is kept (:meth:`Uploader.status`, typed
:class:`~ckptstore.errors.RemoteError`), logged once per streak, and the round is retried with
exponential backoff (0.5 s doubling up to ``max_backoff``), after re-reading the remote's state
(the service may have lost objects). A :class:`~ckptstore.errors.RemoteConflictError` (another
store, or a newer copy, under the URL) stops the uploader until the store is reopened.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

from ..engine.writer_engine import WriterEngine
from ..errors import RemoteConflictError, RemoteError, RemoteUnsupportedError
from .client import Cancelled, ObjectStore, parse_url
from .head import Head
from .replicate import Replicator, capture, pos_key, split_options

log = logging.getLogger("ckptstore")

#: Service error codes that a retry does not fix by itself (credentials, a missing bucket): a
#: flush that saw its own round fail with one raises at once instead of waiting out its timeout.
#: The uploader still retries them in the background (a bucket may be created meanwhile).
PERMANENT_CODES = frozenset({"NoSuchBucket", "AccessDenied", "InvalidAccessKeyId",
                             "SignatureDoesNotMatch", "NoCredentials", "ExpiredToken",
                             "InvalidToken", "403"})


@dataclass(frozen=True)
class RemoteStatus:
    """Where the remote copy stands (:meth:`ckptstore.Store.remote_status`)."""

    url: str
    #: the newest recoverable iteration of the remote HEAD: what survives losing this machine
    iteration: int | None
    #: the HEAD's generation (None: the remote holds no HEAD yet)
    generation: int | None
    #: the newest recoverable iteration of the local store
    local_iteration: int | None
    #: the local store holds commits the remote copy does not (yet)
    behind: bool
    #: bytes and objects sent, HEADs written by this uploader
    uploaded_bytes: int
    uploaded_objects: int
    heads_written: int
    #: the last failure of the current streak (None after a successful round)
    error: BaseException | None
    #: failed rounds in a row
    failures: int
    #: seconds since the last successful round (None: none yet)
    seconds_since_sync: float | None
    #: the uploader stopped (closed, or a conflict it cannot retry)
    stopped: bool


class Uploader:
    """Keeps a remote copy of a writer's store up to date (see the module docstring)."""

    def __init__(self, engine: WriterEngine, url: str, options: dict | None = None) -> None:
        client_opts, self.opts = split_options(options)
        self.engine = engine
        self.url = str(parse_url(url))
        self._cancel = threading.Event()
        self.rep = Replicator(ObjectStore(url, client_opts), self.opts, cancel=self._cancel)
        self._cond = threading.Condition()
        self._pending = True  # catch up with what the store already holds
        self._requested = 0  # flush requests made ...
        self._served = 0  # ... and the count when the last round began
        self._failed_for = 0  # the request count the last failed round served
        self._waiters = 0
        self._stop = False
        self._fatal = False
        self._error: BaseException | None = None
        self._failures = 0
        self._retry_at = 0.0
        self._last_sync = -math.inf
        self._head: Head | None = None
        if self.opts.check_on_open:
            self.rep.load()  # wrong credentials, a missing bucket: fail the open
            snap = capture(engine)
            if snap is not None:
                try:
                    self.rep.check_compatible(snap)
                    h = self.rep.head
                    if h is not None and pos_key(h.position) < pos_key(snap.position):
                        log.info("ckptstore: remote copy %s is at iteration %s, %s is at %s: "
                                 "uploading the difference", self.url, h.recoverable,
                                 engine.path, snap.recoverable)
                finally:
                    snap.close()
            self._head = self.rep.head
        engine.durable_listeners.append(self._poke)
        self._thread = threading.Thread(target=self._run, name=f"ckptstore-remote {self.url}",
                                        daemon=True)
        self._thread.start()

    # ---- the listener (under the engine's lock: only a flag and a wake-up) ---------------------
    def _poke(self) -> None:
        with self._cond:
            self._pending = True
            self._cond.notify_all()

    # ---- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stop or self._fatal:
                        return
                    now = time.monotonic()
                    if self._requested > self._served:
                        break  # a flush asked since the last round began: go now
                    if self._error is not None:
                        if now < self._retry_at:
                            self._cond.wait(self._retry_at - now)
                            continue
                        if self._pending or self._waiters:
                            break  # retry once the backoff elapsed
                    if self._pending:
                        wait = self._last_sync + self.opts.head_interval - now
                        if wait <= 0:
                            break
                        self._cond.wait(wait)
                        continue
                    self._cond.wait()
                self._served = self._requested
                self._pending = False
                served = self._served
            self._round(served)

    def _round(self, served: int = 0) -> None:
        snap = None
        try:
            snap = capture(self.engine)
            if snap is None:  # closed, or awaiting recovery (the next write recovers): retry
                with self._cond:
                    self._pending = not self.engine.closed
                self._cancel.wait(0.2)
                return
            head = self.rep.sync(snap)
        except Cancelled:
            return
        except Exception as e:  # noqa: BLE001 - kept and reported; training never sees it
            self.rep.reset()
            with self._cond:
                self._failures += 1
                first = self._error is None
                self._error = e
                self._failed_for = served
                self._pending = True
                backoff = min(self.opts.max_backoff, 0.5 * 2 ** (self._failures - 1))
                self._retry_at = time.monotonic() + backoff
                if isinstance(e, (RemoteConflictError, RemoteUnsupportedError)):
                    self._fatal = True
                self._cond.notify_all()
            if first or self._fatal:
                log.warning("ckptstore: upload to %s failed (%s)%s; the local store is "
                            "unaffected", self.url, e,
                            "; the uploader stops" if self._fatal else
                            f"; retrying with backoff (up to {self.opts.max_backoff:g} s)")
            return
        finally:
            if snap is not None:
                snap.close()
        with self._cond:
            if self._error is not None:
                log.info("ckptstore: upload to %s works again (HEAD generation %d)", self.url,
                         head.generation)
            self._error = None
            self._failures = 0
            self._head = head
            self._last_sync = time.monotonic()
            self._cond.notify_all()

    # ---- the writer's side -----------------------------------------------------------------
    def _local_position(self) -> tuple[int, int] | None:
        with self.engine.locked():
            if self.engine.closed:
                return None
            p = self.engine.indexed(lambda: self.engine.index.position())
        return None if p is None else (p.seq, p.offset)

    def flush(self, timeout: float | None = None) -> Head:
        """Wait until the remote HEAD holds everything durable locally now (skipping the
        ``head_interval`` wait). Raises the uploader's last RemoteError (or a RemoteError
        "Timeout") when that does not happen within ``timeout`` seconds, and a conflict at once."""
        target = self._local_position()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._requested += 1
            mine = self._requested
            self._waiters += 1
            self._cond.notify_all()
            try:
                while True:
                    h = self._head
                    # a HEAD at or after the position durable when flush was called holds it
                    if h is not None and pos_key(h.position) >= pos_key(target):
                        return h
                    err = self._error
                    if isinstance(err, RemoteError) and err.code in PERMANENT_CODES and \
                            self._failed_for >= mine:
                        raise err  # the round for this flush failed in a way waiting won't fix
                    if self._fatal or (self._stop and not self._thread.is_alive()):
                        err = self._error
                        if isinstance(err, RemoteError):
                            raise err
                        raise RemoteError("flush", self.url, "the uploader has stopped"
                                          + (f": {err}" if err else ""), code="Stopped") from err
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        err = self._error
                        if isinstance(err, RemoteError):
                            raise err
                        raise RemoteError("flush", self.url, f"the remote copy did not catch up "
                                          f"within {timeout} s" + (f": {err}" if err else ""),
                                          code="Timeout") from err
                    self._cond.wait(remaining if remaining is None else min(remaining, 1.0))
            finally:
                self._waiters -= 1

    def status(self) -> RemoteStatus:
        h = self._head
        local: int | None = None
        behind = False
        with self.engine.locked():
            if not self.engine.closed:
                local = self.engine.recoverable_latest()
                p = self.engine.indexed(lambda: self.engine.index.position())
                behind = pos_key(None if h is None else h.position) < pos_key(
                    None if p is None else (p.seq, p.offset))
        with self._cond:
            st = self.rep.stats
            return RemoteStatus(
                self.url, None if h is None else h.recoverable,
                None if h is None else h.generation, local, behind, st.uploaded_bytes,
                st.uploaded_objects, st.heads_written, self._error, self._failures,
                None if self._last_sync == -math.inf else time.monotonic() - self._last_sync,
                self._stop or self._fatal)

    @property
    def head(self) -> Head | None:
        """The newest HEAD this uploader wrote or found."""
        return self._head

    def close(self, timeout: float | None = None) -> None:
        """Upload what is durable now (bounded by ``timeout``, default ``close_timeout``), then
        stop the thread. Never raises: a remote failure is logged and kept in :meth:`status`."""
        if self._stop:
            return
        timeout = self.opts.close_timeout if timeout is None else timeout
        if not self._fatal:
            try:
                self.flush(timeout)
            except Exception as e:  # noqa: BLE001 - the local store is intact; say so and go
                log.warning("ckptstore: the remote copy %s may lag the local store at close: %s",
                            self.url, e)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._cancel.set()
        try:
            self.engine.durable_listeners.remove(self._poke)
        except ValueError:
            pass
        self._thread.join(timeout=max(1.0, min(timeout, 10.0)))
