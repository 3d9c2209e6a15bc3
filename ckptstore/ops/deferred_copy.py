"""Overlapped snapshot copies (CheckFreq's rule): the copy into host staging of tensors the caller
promises not to change yet runs on a background thread while the caller goes on.

A snapshot requested after training step t may be copied while step t+1 runs forward and
backward, which read the parameters and the optimizer state but do not change them; the copy
must be complete before ``optimizer.step()`` of t+1 changes them. The Checkpointer hands those
tensors over as *deferred* (``Store.save_async(..., deferred=...)``) and waits for the copy with
:meth:`SaveFuture.copied` before its next optimizer step; every other leaf (model buffers, which a
forward in training mode updates; RNG states; anything else) is copied at once.

Call sequence of one deferred copy:
  1. ``Pipeline.submit``: :func:`ckptstore.ops.host_staging.snapshot_leaves` copies the other
     leaves and returns the deferred (destination view, live tensor) pairs; a
     :class:`DeferredCopy` records each live tensor's version counter and is queued on the
     pipeline's :class:`Copier`; ``submit`` returns.
  2. The copier thread copies the pairs (one ``torch._foreach_copy_``; a chunk image's strided
     pieces are made here, not in the caller's ``submit``), then compares the version
     counters: a tensor changed in place meanwhile makes the copy fail with
     :class:`~ckptstore.errors.LiveStateChangedError` (the checkpoint is not written).
  3. The caller calls :meth:`SaveFuture.copied` before it changes the tensors.
  4. The persister waits for the copy before it reads the arena (its failure is the job's), and
     no arena is released while a copy into it may still run.

Invariants: a deferred copy is complete (or failed) before its job's bytes are read or its arena
is released. The version check sees in-place changes made through the tensors themselves or
their views (``p.add_()``, the optimizer's ``_foreach`` kernels); writes through ``.data``, numpy
or DLPack aliases do not bump the counter and are not seen (the caller's promise covers them).
Only CPU tensors are deferred: CUDA leaves are copied on a side stream already (host_staging).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch

from ..errors import LiveStateChangedError
from ..tensors import ImageTensor
from .loan import Loan


class DeferredCopy:
    """The copy of ``pairs`` ((destination, live tensor, path name) triples; a destination is a
    tensor or an :class:`~ckptstore.tensors.ImageTensor`) into an arena, run by a
    :class:`Copier`. ``seconds``: how long the copy took; ``error``: why it failed (None: it
    did not)."""

    def __init__(self, iteration: int, pairs: list[tuple[Any, torch.Tensor, str]]) -> None:
        self.iteration = iteration
        self.pairs = pairs
        self.versions = [src._version for _, src, _ in pairs]
        self.nbytes = sum(dst.nbytes if isinstance(dst, ImageTensor) else
                          dst.numel() * dst.element_size() for dst, _, _ in pairs)
        self.seconds = 0.0
        self.error: BaseException | None = None
        self._done = threading.Event()

    def run(self) -> None:
        """Copy, then check that no live tensor changed meanwhile (step 2)."""
        t0 = time.perf_counter()
        try:
            dsts: list[torch.Tensor] = []
            srcs: list[torch.Tensor] = []
            for dst, src, _ in self.pairs:
                if isinstance(dst, ImageTensor):  # (its pieces: made here, off the caller's time)
                    for d, s in dst.copy_pairs(src):
                        dsts.append(d)
                        srcs.append(s)
                else:
                    dsts.append(dst)
                    srcs.append(src)
            with torch.no_grad():
                torch._foreach_copy_(dsts, srcs)
            for (_, src, name), v in zip(self.pairs, self.versions):
                if src._version != v:
                    raise LiveStateChangedError(
                        f"iteration {self.iteration}: {name} changed in place while its overlapped "
                        "snapshot copy was running; the checkpoint was not written (change it "
                        "only after the snapshot's future.copied(), or copy at once: "
                        "Checkpointer(overlap=False))", name)
        except BaseException as e:  # noqa: BLE001 - kept for the persister and the waiter
            self.error = e
        finally:
            self.seconds = time.perf_counter() - t0
            self.pairs = []  # the live tensors are not held past the copy
            self._done.set()

    def wait(self) -> float:
        """Block until the copy is over; returns the seconds waited."""
        if self._done.is_set():
            return 0.0
        t0 = time.perf_counter()
        self._done.wait()
        return time.perf_counter() - t0

    def done(self) -> bool:
        return self._done.is_set()


class SaveFuture(Future):
    """The future of an asynchronous save (:meth:`ckptstore.Store.save_async`): resolved when the
    checkpoint is durable. :meth:`copied` waits only for its copy into host memory."""

    deferred: DeferredCopy | None = None
    #: the gate of tensors lent to the save (ckptstore/ops/loan.py); None: nothing was lent
    loan: Loan | None = None

    def result(self, timeout: float | None = None) -> Any:
        """``Future.result``; on the lender's thread it first decides the save's loan (the
        persister waits for that decision, which only the lender can make)."""
        if self.loan is not None:
            self.loan.settle()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """``Future.exception``, deciding the loan first like :meth:`result`."""
        if self.loan is not None:
            self.loan.settle()
        return super().exception(timeout)

    def done(self) -> bool:
        """``Future.done``, deciding the loan first like :meth:`result` (a loop polling it on
        the lender's thread would otherwise never see it done while it holds the tensors)."""
        if self.loan is not None:
            self.loan.settle()
        return super().done()

    def copied(self) -> float:
        """Block until every tensor of the save is copied out of the caller's memory (at once
        unless some were ``deferred``); returns the seconds waited. The caller may change the
        deferred tensors after this returns, whatever the save's outcome."""
        d = self.deferred
        return d.wait() if d is not None else 0.0


class Copier:
    """One background thread running deferred copies in submission order (started on first use,
    stopped by :meth:`stop`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[DeferredCopy | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, copy: DeferredCopy) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._queue.put(copy)

    def stop(self) -> None:
        """Run what is queued, then end the thread (a later :meth:`put` starts a new one)."""
        with self._lock:
            t, self._thread = self._thread, None
            if t is None:
                return
            self._queue.put(None)
        t.join()

    def _run(self) -> None:
        while True:
            copy = self._queue.get()
            if copy is None:
                return
            copy.run()

