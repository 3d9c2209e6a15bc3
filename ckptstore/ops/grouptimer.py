"""The group-commit timer: a time bound on how long appended deltas stay uncommitted.

Deltas appended with ``durable=False`` (synchronously, or by the async pipeline for a delta that
does not end its group) are *pending*: lost on a crash until a group commit (format-spec/deltas.md).
Without a timer they are committed only by the next save, flush or close, so a pause in training
(an eval loop, a data stall) would leave them pending indefinitely. :class:`GroupTimer` is one
background thread per writer store that commits them once the oldest is ``seconds`` old, without
waiting for another call.

The timer knows nothing of stores: it is given ``group_since`` (when the open group's first delta
was staged, None when no group is open) and ``commit(since)``, which its owner implements
(:meth:`ckptstore.ops.background.BackgroundWork.set_group_seconds` gives it one).

Invariants:
  * Commits stay in iteration order and are serialised with every other write: the owner's
    ``commit`` either commits under the engine's lock (only the group begun at ``since``:
    :meth:`~ckptstore.engine.writer_engine.WriterEngine.commit_group_begun_at`) or, with an
    async pipeline, queues a flush job behind the jobs already submitted (FIFO), never
    committing by itself.
  * Each group is asked for once: a commit that raises is kept in :attr:`GroupTimer.error` and
    reported by the owner (once, on its next call, and by flush/close); a pipeline's flush job
    reports its failure through the pipeline.
  * Lock order: the timer never holds its own condition while it calls ``commit`` (which takes
    the engine's lock), so the owner may :meth:`poke` it while holding that lock.
  * :meth:`stop` joins the thread: after it returns the timer commits nothing.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class GroupTimer:
    """Commits a writer's open delta group once its oldest delta is ``seconds`` old."""

    def __init__(self, group_since: Callable[[], float | None], commit: Callable[[float], None],
                 seconds: float, *, name: str = "") -> None:
        self._group_since = group_since
        self._commit_group = commit
        self.seconds = seconds
        self._cond = threading.Condition()
        self._stopped = False
        self._requested: float | None = None  # ``group_since`` of the group last asked for
        self.error: BaseException | None = None  # a failed commit, not yet reported
        self._thread = threading.Thread(target=self._run, name=f"ckptstore-group:{name}",
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

    def _deadline(self) -> tuple[float, float] | None:
        """(since, due) of the open group, None when there is none or it was asked for already.
        Reads the owner's state without its lock: a stale view only wakes the thread early or
        late by one poke, and the owner re-checks the group under its lock."""
        since = self._group_since()
        if since is None or since == self._requested:
            return None
        return since, since + self.seconds

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped:
                    deadline = self._deadline()
                    now = time.monotonic()
                    if deadline is not None and now >= deadline[1]:
                        break
                    self._cond.wait(None if deadline is None else deadline[1] - now)
                if self._stopped:
                    return
                assert deadline is not None
                self._requested = deadline[0]
            try:
                self._commit_group(deadline[0])
            except BaseException as e:  # noqa: BLE001 - reported by the owner's next call
                with self._cond:
                    if self.error is None:
                        self.error = e
