"""The group-commit timer: a time bound on how long appended deltas stay uncommitted.

Deltas appended with ``durable=False`` (synchronously, or by the async pipeline for a delta that
does not end its group) are *pending*: lost on a crash until a group commit (format-spec/deltas.md).
Without a timer they are committed only by the next save, flush or close, so a pause in training
(an eval loop, a data stall) would leave them pending indefinitely. :class:`GroupTimer` is one
background thread per writer store that commits them once the oldest is ``seconds`` old, without
waiting for another call.

Invariants:
  * Commits stay in iteration order and are serialised with every other write: without an async
    pipeline the timer commits under the store mutex (``Store._flush_locked``, which commits exactly
    the pending group in order); with a pipeline it queues a flush job behind the jobs already
    submitted, run by the persister thread (FIFO), never committing by itself.
  * A failed timer commit is reported like any background failure: through the pipeline (the
    rolled-back deltas' futures, then once by the next call, flush or close), or without one by
    :meth:`Store._check_open` (once, on the next call) and by flush/close.
  * Lock order: the timer never holds its own condition while it takes the store mutex, so the
    store may :meth:`poke` it while holding the mutex.
  * :meth:`stop` joins the thread: after it returns the timer commits nothing.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..store import Store


class GroupTimer:
    """Commits a writer store's pending deltas once the oldest is ``seconds`` old."""

    def __init__(self, store: "Store", seconds: float) -> None:
        self.store = store
        self.seconds = seconds
        self._cond = threading.Condition()
        self._stopped = False
        self._requested = 0.0  # ``_pending_since`` of the group a pipeline flush was queued for
        self.error: BaseException | None = None  # a failed commit (no pipeline), not yet reported
        self._thread = threading.Thread(target=self._run, name=f"ckptstore-group:{store.path}",
                                        daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """A new pending group started, or the limit changed: recompute the deadline."""
        with self._cond:
            self._cond.notify_all()

    def set_seconds(self, seconds: float) -> None:
        with self._cond:
            self.seconds = seconds
            self._cond.notify_all()

    def stop(self) -> None:
        """Stop and join the thread (idempotent); it commits nothing afterwards."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def take_error(self) -> BaseException | None:
        """The failure of a timer commit not reported yet (then forgotten)."""
        with self._cond:
            err, self.error = self.error, None
        return err

    def _deadline(self) -> float | None:
        """When the current pending group is due (None: nothing pending, or already requested).
        Reads the store's fields without its mutex: a stale view only wakes the thread early or
        late by one poke, and every commit decision is re-checked under the mutex."""
        st = self.store
        since = st._pending_since
        if not st._pending or since == self._requested:
            return None
        return since + self.seconds

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped:
                    due = self._deadline()
                    now = time.monotonic()
                    if due is not None and now >= due:
                        break
                    self._cond.wait(None if due is None else due - now)
                if self._stopped:
                    return
            self._commit()

    def _commit(self) -> None:
        st = self.store
        pipe = st._pipeline
        if pipe is not None:
            # the persister commits, in order behind the jobs already queued; a failure goes
            # through the pipeline's own reporting
            with self._cond:
                if self._stopped:
                    return
                self._requested = st._pending_since
            pipe.request_flush()
            return
        with st._mutex:
            with self._cond:
                if self._stopped:
                    return
            if st._closed or not st._pending or \
                    time.monotonic() - st._pending_since < self.seconds:
                return
            if st._pipeline is not None:  # started meanwhile: let the next round queue a flush
                return
            try:
                st._flush_locked()  # rolls the group back on failure
            except BaseException as e:  # noqa: BLE001 - reported by the store's next call
                with self._cond:
                    if self.error is None:
                        self.error = e
