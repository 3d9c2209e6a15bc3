"""Checkpoints of a model that lives on an accelerator: the paths a GPU takes (a snapshot's
device-to-host copy on a side stream, gradients copied off the device for a delta, restores into
device tensors, the replay of a chain trained there), each test run on the CPU too, where the
same assertions hold bit for bit. CI has no GPU: the "cuda" cases run where one is present
(``tools/device_check.sh``, the prepared script for a session lent a GPU machine).

What differs on CUDA is said where it differs: a delta chain trained on CUDA is replayed on the
CPU (:mod:`ckptstore.replay`), so its replayed iterations are flagged approximate
(``ApproximateReplayWarning``, "trained on cuda, replayed on cpu") and only close to the
training state; bases and restores of bases stay bit for bit on every device.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import ckptstore
from ckptstore.replay import ApproximateReplayWarning
from ckptstore.replay.fingerprints import fingerprint_digest
from ckptstore.torch import Checkpointer

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (tools/device_check.sh on a GPU machine)"))]

#: one torch thread on the CPU: bit-exact comparisons with a reference computed in the same run
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(device: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4)).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _backward(model, it: int, device: str) -> None:
    g = torch.Generator().manual_seed(it)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()


def _host_state(model, opt) -> dict:
    """The live state, copied to the host (what a store's load returns)."""
    return {"model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "optimizer": {i: {k: v.detach().cpu().clone() for k, v in s.items()}
                          for i, s in opt.state_dict()["state"].items()}}


def _train(path, model, opt, device: str, n: int, **options) -> dict:
    """Train iterations 1..n through a Checkpointer with ``options`` on a new store at ``path``;
    returns the host copy of the live state at 0 (the first base) and after each step."""
    refs = {}
    with ckptstore.open(path) as store:
        ck = Checkpointer(store, model, opt, **options)
        assert ck.restore() == 0
        refs[0] = _host_state(model, opt)
        for it in range(1, n + 1):
            _backward(model, it, device)
            ck.step(it)
            opt.zero_grad()
            refs[it] = _host_state(model, opt)
        ck.close()
    return refs


def _compare(ref: dict, got: dict, where: str, exact: bool = True) -> None:
    def same(a, b, what):
        a, b = a.detach().cpu(), b.detach().cpu()
        if exact or not a.is_floating_point():
            assert torch.equal(a, b), f"{where}: {what}"
        else:
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), f"{where}: {what}"

    for k, v in ref["model"].items():
        same(v, got["model"][k], f"model {k}")
    for i, per in ref["optimizer"].items():
        for k, v in per.items():
            same(v, got["optimizer"]["state"][i][k], f"optimizer {i}.{k}")


@pytest.mark.parametrize("device", DEVICES)
def test_snapshots_of_a_device_model_are_its_state_bit_for_bit(tmp_path, device):
    """Asynchronous snapshots every 2 iterations (on a GPU: the copy to host memory runs on a side
    stream while the next step is queued) hold the state of their iteration bit for bit, and a
    restore into a fresh model on the device puts it back there."""
    model, opt = _model(device)
    refs = _train(tmp_path / "s", model, opt, device, 7, policy="snapshots", snapshot_every=2)
    with ckptstore.open(tmp_path / "s", "r") as r:
        assert r.iterations() == [0, 2, 4, 6]
        for it in (0, 2, 4, 6):
            _compare(refs[it], r.load(it), f"snapshot {it}")
    fresh, fresh_opt = _model(device)
    with ckptstore.open(tmp_path / "s") as store:
        ck = Checkpointer(store, fresh, fresh_opt, policy="snapshots", snapshot_every=2)
        assert ck.restore() == 6
        assert all(p.device.type == device for p in fresh.parameters())
        assert all(v.device.type == device for s in fresh_opt.state.values() for k, v in s.items()
                   if k != "step")
        _compare(refs[6], {"model": fresh.state_dict(), "optimizer": fresh_opt.state_dict()},
                 "restored 6")
        ck.close()


@pytest.mark.parametrize("device", DEVICES)
def test_deltas_of_a_device_model(tmp_path, device):
    """An exact delta every iteration from a model on the device: each record holds the step's
    gradients bit for bit (copied off the device) and every 3rd the parameters' fingerprint (on
    a GPU also their norm, what a replay off the device compares); bases load bit for bit; a
    restore of a delta iteration replays the chain: bit for bit on the CPU; on CUDA, replayed on
    the CPU, the state is flagged approximate with the reason and stays close."""
    model, opt = _model(device)
    refs, grads, params = {}, {}, {}
    with ckptstore.open(tmp_path / "s") as store:
        ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=4, codec="exact",
                          fingerprint_every=3)
        ck.restore()
        refs[0] = _host_state(model, opt)
        for it in range(1, 10):
            _backward(model, it, device)
            grads[it] = [p.grad.detach().cpu().clone() for p in model.parameters()]
            ck.step(it)
            opt.zero_grad()
            refs[it] = _host_state(model, opt)
            params[it] = [p.detach().cpu().clone() for p in model.parameters()]
        ck.close()
    with ckptstore.open(tmp_path / "s", "r") as r:
        assert [r.kind(it) for it in (0, 3, 4, 5, 8, 9)] == \
            ["snapshot", "delta", "snapshot", "delta", "snapshot", "delta"]
        for it in (3, 6, 9):  # fingerprints of the parameters after the step (host bytes)
            fp = r.load_record(it)["fp"]
            assert fp["xxh3"] == fingerprint_digest(params[it]), f"delta {it}'s fingerprint"
            assert ("norm" in fp) == (device != "cpu")  # (compared by replays off the device)
        for it in (3, 5, 9):
            logged = [g["g"] for g in r.load_record(it)["grads"]]
            assert len(logged) == len(grads[it])
            for a, b in zip(logged, grads[it]):
                assert a.device.type == "cpu" and torch.equal(a, b), f"delta {it}'s gradient"
        for it in (0, 4, 8):
            _compare(refs[it], r.load(it), f"base {it}")
        for it in (3, 5, 9):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                state = r.load(it)
            flagged = [w for w in caught if issubclass(w.category, ApproximateReplayWarning)]
            if device == "cpu":
                assert not flagged
                _compare(refs[it], state, f"delta {it}")
            else:
                assert flagged and f"trained on {device}, replayed on cpu" in str(flagged[0].message)
                _compare(refs[it], state, f"delta {it}", exact=False)
    fresh, fresh_opt = _model(device)
    with ckptstore.open(tmp_path / "s") as store:
        ck = Checkpointer(store, fresh, fresh_opt, policy="every-iteration", base_every=4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ApproximateReplayWarning)
            assert ck.restore() == 9
        assert all(p.device.type == device for p in fresh.parameters())
        _compare(refs[9], {"model": fresh.state_dict(), "optimizer": fresh_opt.state_dict()},
                 "restored 9", exact=device == "cpu")
        ck.close()


@pytest.mark.parametrize("device", DEVICES)
def test_load_into_device_tensors(tmp_path, device):
    """``store.load(into=...)`` of a snapshot fills tensors on the device in place (the same
    memory, bit for bit), and a plain load of device tensors returns them on the host."""
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(300, 70, generator=g).to(device),
             "h": torch.randn(5, generator=g).half().to(device)}
    with ckptstore.open(tmp_path / "s") as store:
        store.save(1, state)
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    ptrs = {k: v.data_ptr() for k, v in targets.items()}
    with ckptstore.open(tmp_path / "s", "r") as r:
        got = r.load(1, into=targets)
        plain = r.load(1)
    for k, v in state.items():
        assert got[k].data_ptr() == ptrs[k] and got[k].device.type == device
        assert torch.equal(got[k], v)
        assert plain[k].device.type == "cpu" and torch.equal(plain[k], v.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_topk_deltas_applied_on_the_device(tmp_path, device):
    """``codec="topk:0.1", apply_decoded=True``: the optimizer steps on the decoded gradients
    (decoded on the gradients' device), so the chain replays what training did: bit for bit on
    the CPU; on CUDA replayed on the CPU, flagged approximate and close."""
    model, opt = _model(device)
    refs = _train(tmp_path / "s", model, opt, device, 4, policy="every-iteration", base_every=100,
                  codec="topk:0.1", apply_decoded=True)
    with ckptstore.open(tmp_path / "s", "r") as r, warnings.catch_warnings():
        warnings.simplefilter("ignore", ApproximateReplayWarning)
        for it in (2, 4):
            _compare(refs[it], r.load(it), f"delta {it}", exact=device == "cpu")
