"""The Checkpointer's failure policy (ckptstore/torch/failure_policy.py): with on_failure="retry"
a full disk is logged and counted while training goes on, the chain restarts with a base once the
disk has room again (every checkpoint then loads bit-exact), and the job stops only after
max_failures in a row or max_lag_s without a durable checkpoint."""

from __future__ import annotations

import copy
import logging
import time
from collections import namedtuple

import pytest
import torch

import ckptstore
from ckptstore.torch import Checkpointer

from conftest import FullDisk, _same


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _checkpointer(tmp_path, **options):
    """A store on a FullDisk, a small model and its restored Checkpointer (base 0 written)."""
    disk = FullDisk()
    store = ckptstore.open(tmp_path / "s", file_ops=disk)
    model, opt = _model()
    ck = Checkpointer(store, model, opt, **{"policy": "every-iteration", **options})
    ck.restore()
    return disk, store, model, opt, ck


def _train(ck, model, opt, its, live, disk=None, full=()):
    for it in its:
        if disk is not None:
            disk.full = it in full
        g = torch.Generator().manual_seed(it)
        model(torch.randn(4, 6, generator=g)).square().mean().backward()
        fut = ck.step(it)
        if ck.asynchronous and fut is not None:
            try:
                fut.result()  # (a failure is reported to the next step as well)
            except ckptstore.CkptStoreError:
                pass
        opt.zero_grad()
        live[it] = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    if disk is not None:
        disk.full = False


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_retry_keeps_training_through_a_full_disk_and_loses_nothing_committed(
        tmp_path, caplog, asynchronous):
    disk, store, model, opt, ck = _checkpointer(tmp_path, base_every=5, asynchronous=asynchronous,
                                                on_failure="retry", max_failures=5)
    live: dict = {}
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        _train(ck, model, opt, range(1, 13), live, disk, full={4, 5, 6})
    ck.flush()
    h = ck.health()
    assert h.failures_total >= 2 and h.failures_in_a_row == 0, h
    # stats(): the same counters beside what the store says (one call, no second copy of them)
    st = ck.stats()
    assert (st.health.failures_total, st.health.failures_in_a_row, st.health.last_error) == \
        (h.failures_total, 0, h.last_error) and "No space left" in st.health.last_error
    assert st.health.seconds_since_durable < 60 and st.durable_iteration == 12
    if asynchronous:  # the store's per-checkpoint statistics: durable checkpoints only, in order
        its_stats = [c.iteration for c in st.checkpoints]
        assert its_stats == sorted(its_stats) and its_stats[-1] == 12
        assert set(its_stats) <= set(store.iterations()) and st.checkpoints == store.stats()
    else:
        assert st.checkpoints == []
    assert any("failed" in r.getMessage() and "training continues" in r.getMessage()
               for r in caplog.records)
    its = store.iterations()
    assert its[-1] == 12 and 1 in its
    for it in its:
        if it == 0:
            continue
        state = store.load(it)
        _same(live[it]["model"], state["model"], f"iteration {it}")
        _same(live[it]["optimizer"], state["optimizer"], f"iteration {it}")
    assert not set(range(4, 6)) & set(its) or asynchronous  # sync: nothing of the full disk
    store.close()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_retry_gives_up_after_max_failures_in_a_row(tmp_path, asynchronous):
    disk, store, model, opt, ck = _checkpointer(tmp_path, base_every=50, asynchronous=asynchronous,
                                                on_failure="retry", max_failures=2)
    with pytest.raises(ckptstore.CheckpointPolicyError, match="2 times in a row") as info:
        _train(ck, model, opt, range(1, 10), {}, disk, full=set(range(3, 10)))
    assert isinstance(info.value.__cause__, (ckptstore.StoreIOError, ckptstore.CheckpointAbortedError))
    st = ck.stats()  # what a monitor polling stats() saw when the job stopped
    assert st.health.failures_in_a_row == 2 and st.health.failures_total == 2, st
    assert st.health.last_error.startswith(type(info.value.__cause__).__name__)
    assert st.durable_iteration is not None and st.durable_iteration < 3
    store.close()


def test_retry_gives_up_when_the_last_durable_checkpoint_is_too_old(tmp_path):
    disk, store, model, opt, ck = _checkpointer(tmp_path, asynchronous=False, on_failure="retry",
                                                max_failures=100, max_lag_s=0.05)
    time.sleep(0.1)
    with pytest.raises(ckptstore.CheckpointPolicyError, match="s old"):
        _train(ck, model, opt, [1], {}, disk, full={1})
    store.close()


def test_the_default_policy_raises_at_the_failing_step(tmp_path):
    disk, store, model, opt, ck = _checkpointer(tmp_path, asynchronous=False)
    with pytest.raises(ckptstore.DiskFullError):
        _train(ck, model, opt, [1], {}, disk, full={1})
    assert ck.health().policy == "raise"
    st = ck.stats()  # "raise" counts the failure it raised to the caller
    assert (st.health.policy, st.health.failures_total, st.health.failures_in_a_row,
            st.durable_iteration) == ("raise", 1, 1, 0)
    assert "DiskFullError" in st.health.last_error and "No space left" in st.health.last_error
    store.close()


def test_misuse_is_never_retried(tmp_path):
    _, store, model, opt, ck = _checkpointer(tmp_path, asynchronous=False, on_failure="retry")
    with pytest.raises(ckptstore.DeltaChainError):
        ck.step(5)  # does not follow iteration 0
    store.close()


def test_a_base_that_will_not_fit_is_announced(tmp_path, caplog):
    store = ckptstore.open(tmp_path / "s")
    model, opt = _model()
    ck = Checkpointer(store, model, opt, asynchronous=False, on_failure="retry")
    ck.policy.disk_usage = lambda path: namedtuple("usage", "total used free")(10, 9, 1)
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        ck.restore()  # writes base 0
    assert ck.health().low_space_warnings == 1
    assert any("will probably fail" in r.getMessage() for r in caplog.records)
    store.close()
