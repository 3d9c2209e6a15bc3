"""The asynchronous delta path of a Checkpointer's steps (``asynchronous=True``): every record
goes through the store's pipeline (:mod:`ckptstore.ops.pipeline`), the step only snapshots into
host buffers (captured gradients: :mod:`ckptstore.torch.grad_capture`) and returns a future
resolved when the record is durable; deltas are group-committed (``group_commit`` deltas, or the
oldest ``group_seconds`` old).

Call sequence: :func:`begin_async` before ``optimizer.step()`` (an earlier background failure is
raised here, before any change; a chain that lost records restarts with a base of the live
state), :func:`end_async` after it. Both keep :class:`StepWriter`'s invariants.
"""

from __future__ import annotations

import time
from typing import Any

from .live_state import capture_rng, hyperparameters
from .step_writer import Step, StepWriter


def begin_async(w: StepWriter, iteration: int, own_grads: bool) -> Step:
    """:meth:`StepWriter.begin_sync` on the asynchronous path."""
    try:
        pipe = w.store.pipeline  # raises an earlier background failure before any change
        pipe.check()
    except BaseException as e:
        w.resync = True
        w.policy_failed(e, iteration)  # raises unless the policy keeps training
        pipe = w.store.running_pipeline  # reported: the store takes records again
    tail = pipe.tail()
    if w.resync or w.last is None or tail is None or tail < w.last:
        # (a tail behind the last step: a failure reported through another call lost records)
        w.check_resumes(iteration)
        try:
            latest = w.store.latest()
            if latest is None or latest != iteration - 1:
                # empty store, or records lost to a background failure: the live state (that
                # of iteration - 1) starts a new chain
                w.save_base(iteration - 1, measured=False)
            else:
                w.continue_chain(latest)
        except BaseException as e:
            w.policy_failed(e, iteration)
            w.capture.release(pipe)
            return Step(iteration, recorded=False)
        w.resync = False
    w.check_follows(iteration, pipe.tail())
    t0 = time.perf_counter()
    rng = capture_rng()
    hyper = hyperparameters(w.records.optimizer)
    arena = None
    if w.capture_grads:
        grads, arena = w.capture.take(own_grads)
        err: dict[str, Any] = {"max_abs": [], "l2": 0.0, "grad_l2": 0.0}
    else:
        grads, err = w.records.encode_grads()
        if own_grads:
            grads = w.records.own_payloads(grads)
    return Step(iteration, True, t0, rng, hyper, grads, err, arena, pipe)


def end_async(w: StepWriter, st: Step, meta: dict | None) -> Any:
    """:meth:`StepWriter.end_sync` on the asynchronous path: a base when due, else the delta
    submitted to the pipeline (committing the group when it is full or old enough)."""
    iteration, pipe = st.iteration, st.pipe
    try:
        if w.base_due(iteration):
            st.release()
            w.capture.forget()  # (gradients lent for a delta not written)
            w.last = iteration
            fut = w.save_base(iteration, meta)
        else:
            record = w.records.delta_record(iteration, st.grads, st.hyper, st.rng, st.err)
            now = time.monotonic()
            if w.group_n and not pipe.pending_deltas():
                w.group_n = 0  # the group timer (or a flush) committed the group
            if w.group_n == 0:
                w.group_t0 = now
            w.group_n += 1
            commit = w.group_n >= w.group_commit or (
                w.group_seconds is not None and now - w.group_t0 >= w.group_seconds)
            if commit:
                w.group_n = 0
            owned, st.arena = st.arena, None
            w.last = iteration
            fut = pipe.submit("delta", iteration, record, meta, commit=commit,
                              owned=[owned] if owned is not None else None,
                              loan=w.capture.lend_to(iteration))
            fut.add_done_callback(w.cost_callback("delta_cost", time.perf_counter() - st.t0))
            fut.add_done_callback(w.durable_callback)
            fut.add_done_callback(w.auto.observe_delta)
            w.wrote = "delta"
    except BaseException as e:
        return w.failed(st, e)
    w.last_stats = fut
    return fut
