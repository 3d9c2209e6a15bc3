"""What a training job does when a checkpoint fails: raise, or keep training and retry.

A checkpoint can fail in the background during a multi-day run (a full disk, EIO, a lost mount).
:class:`FailurePolicy` decides, for the Checkpointer, what happens next:

* ``"raise"`` (the default): the next ``step`` raises the failure (the live objects are never
  left behind the store: see :meth:`ckptstore.torch.Checkpointer.step`);
* ``"retry"``: log the failure (logger ``"ckptstore"``, level WARNING, so a person sees it even
  with logging unconfigured), count it, and keep training; the next step restarts the chain with
  a base of the live state. The job raises :class:`~ckptstore.errors.CheckpointPolicyError`
  (its ``__cause__`` is the last failure) only once ``max_failures`` checkpoints in a row have
  failed, or once the last durable checkpoint is more than ``max_lag_s`` seconds old.

Only storage failures are subject to the policy (:class:`~ckptstore.errors.StoreIOError`, with
DiskFullError, and :class:`~ckptstore.errors.CheckpointAbortedError`); a misuse (an iteration out of
order, an unsupported state) always raises.

Before every base snapshot the free space under the store is compared with the base's size; a
base that will not fit is announced in the log before it is written.

:meth:`ckptstore.torch.Checkpointer.stats` reports the policy's counters (a
:class:`CheckpointHealth`) together with the store's per-checkpoint statistics, as
:class:`CheckpointerStats`: the counters live here only, the store knows nothing of the policy.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import CheckpointAbortedError, CheckpointPolicyError, StoreIOError
from ..ops.pipeline import AsyncStats

log = logging.getLogger("ckptstore")

#: failures the "retry" policy absorbs (storage trouble, not misuse)
RETRYABLE = (StoreIOError, CheckpointAbortedError)


@dataclass
class CheckpointHealth:
    """How checkpointing is going, as the policy sees it. Invariants: ``failures_in_a_row <=
    failures_total``; a checkpoint that becomes durable resets ``failures_in_a_row`` (and
    ``seconds_since_durable``) to 0; every failure the Checkpointer sees is counted, whatever
    the policy (under "raise" it is also raised; a misuse is counted and raised under both)."""

    policy: str
    failures_total: int = 0
    failures_in_a_row: int = 0
    last_error: str | None = None
    #: seconds since the last checkpoint that became durable (or since training started)
    seconds_since_durable: float = 0.0
    #: base snapshots announced as not fitting in the free space
    low_space_warnings: int = 0
    history: list[str] = field(default_factory=list)


@dataclass
class CheckpointerStats:
    """What :meth:`ckptstore.torch.Checkpointer.stats` returns: one snapshot, taken at the call.

    ``health``: the failure policy's counters (a copy: later failures do not change it);
    ``durable_iteration``: what survives a crash now (``store.durable_iteration()``);
    ``checkpoints``: the store's per-checkpoint statistics of its async saves, oldest first
    (``store.stats()``; empty on the synchronous path). Failed checkpoints appear only in
    ``health``: ``checkpoints`` lists the ones that became durable."""

    health: CheckpointHealth
    durable_iteration: int | None
    checkpoints: list[AsyncStats] = field(default_factory=list, repr=False)


class FailurePolicy:
    """The failure policy of one Checkpointer (see the module docstring)."""

    def __init__(self, mode: str = "raise", *, max_failures: int = 3,
                 max_lag_s: float | None = 3600.0) -> None:
        if mode not in ("raise", "retry"):
            raise ValueError('on_failure must be "raise" or "retry"')
        if type(max_failures) is not int or max_failures < 1:
            raise ValueError("max_failures must be a positive int")
        if max_lag_s is not None and not max_lag_s > 0:
            raise ValueError("max_lag_s must be positive or None")
        self.mode = mode
        self.max_failures = max_failures
        self.max_lag_s = max_lag_s
        self._lock = threading.Lock()  # futures' callbacks run on the persister thread
        self._health = CheckpointHealth(mode)
        self._last_durable = time.monotonic()
        #: the free-space probe (shutil.disk_usage; replaceable for tests)
        self.disk_usage: Callable[[str], Any] = shutil.disk_usage

    def health(self) -> CheckpointHealth:
        with self._lock:
            h = self._health
            return CheckpointHealth(h.policy, h.failures_total, h.failures_in_a_row, h.last_error,
                                    time.monotonic() - self._last_durable, h.low_space_warnings,
                                    list(h.history))

    def succeeded(self) -> None:
        """A checkpoint became durable."""
        with self._lock:
            self._last_durable = time.monotonic()
            self._health.failures_in_a_row = 0

    def count(self, error: BaseException, iteration: int) -> int:
        """Count a failure in :meth:`health` (no verdict: a failure training cannot go on
        from, such as a peer's, is counted here alone); returns the failures in a row."""
        with self._lock:
            h = self._health
            h.failures_total += 1
            h.failures_in_a_row += 1
            h.last_error = f"{type(error).__name__}: {error}"
            h.history = (h.history + [f"iteration {iteration}: {h.last_error}"])[-20:]
            return h.failures_in_a_row

    def failed(self, error: BaseException, iteration: int) -> None:
        """A checkpoint failed; returns to keep training, raises to stop (the error itself under
        "raise" or for a failure the policy does not cover, else CheckpointPolicyError)."""
        row = self.count(error, iteration)
        with self._lock:
            lag = time.monotonic() - self._last_durable
        if self.mode == "raise" or not isinstance(error, RETRYABLE):
            raise error
        if row >= self.max_failures or (self.max_lag_s is not None and lag > self.max_lag_s):
            raise CheckpointPolicyError(
                f"checkpointing failed {row} times in a row (limit {self.max_failures}); the last "
                f"durable checkpoint is {lag:.0f} s old (limit {self.max_lag_s}); last failure at "
                f"iteration {iteration}: {type(error).__name__}: {error}") from error
        log.warning("ckptstore: checkpoint at iteration %d failed (%s: %s); training continues "
                    "and the next step retries with a base snapshot (%d failed in a row, limit "
                    "%d; last durable checkpoint %.0f s ago)", iteration, type(error).__name__,
                    error, row, self.max_failures, lag)

    def check_space(self, path: str, nbytes: int, iteration: int) -> None:
        """Before a base of about ``nbytes``: announce in the log when it will not fit."""
        try:
            free = self.disk_usage(path).free
        except OSError:
            return
        if free < nbytes:
            with self._lock:
                self._health.low_space_warnings += 1
            log.warning("ckptstore: the base snapshot of iteration %d needs about %.1f MiB but "
                        "only %.1f MiB are free under %s: it will probably fail (free space, or "
                        "gc the store)", iteration, nbytes / 2**20, free / 2**20, path)
