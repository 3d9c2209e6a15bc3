"""Framework integrations: the Checkpointer's two-phase step (before_step/after_step, for loops
that apply the optimizer step themselves), Hugging Face's Trainer (ckptstore/hf.py) and
Lightning's CheckpointIO (ckptstore/lightning.py). The framework tests skip when the library is
not installed (extras ``hf`` and ``lightning``); nothing downloads anything (HF_HUB_OFFLINE)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

import ckptstore
from ckptstore.torch import Checkpointer

from conftest import FullDisk, _same

os.environ["HF_HUB_OFFLINE"] = "1"  # never reach the hub (set before transformers is imported)
os.environ["TRANSFORMERS_OFFLINE"] = "1"


@pytest.fixture(autouse=True)
def global_torch_modes():
    """Lightning's ``Trainer(deterministic=True)`` switches torch's deterministic algorithms on
    for the whole process (and with them the filling of every ``torch.empty``, which some dtypes
    do not support): put them back as they were for the tests that follow."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@pytest.fixture
def one_thread():
    """The tiny models here train fastest, and deterministically, on one thread."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- the Checkpointer's two-phase step ------------------------------------------------------

def _small(buffers=True):
    torch.manual_seed(0)
    # BatchNorm (buffers changed by forward) and Dropout (RNG) unless ``buffers`` is False
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(8, 2)) if buffers else \
        torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.5)
    return model, opt, sched


def _snapshot(model, opt, sched):
    return copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                          "scheduler": sched.state_dict()})


def _train_small(ck, model, opt, sched, its, two_phase, disk=None, full=()):
    live = {}
    for it in its:
        if disk is not None:
            disk.full = it in full
        g = torch.Generator().manual_seed(it)
        model(torch.randn(5, 6, generator=g)).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # in place, after capture
        if two_phase:
            ck.before_step(it)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=False)  # zeroed in place before after_step: taken already
            fut = ck.after_step({"it": it})
        else:
            fut = ck.step(it, {"it": it})
            opt.zero_grad(set_to_none=False)
        if ck.asynchronous and fut is not None and disk is not None:
            try:
                fut.result()
            except ckptstore.CkptStoreError:
                pass
        live[it] = _snapshot(model, opt, sched)
    if disk is not None:
        disk.full = False
    return live


@pytest.mark.parametrize("asynchronous,capture", [(True, "hooks"), (True, "step"), (False, "hooks")],
                         ids=["async-hooks", "async-step", "sync"])
def test_two_phase_step_records_what_step_records(tmp_path, asynchronous, capture):
    """before_step / the caller's optimizer and scheduler steps / after_step write the same store as
    step(): every iteration loads bit-exact as the live state, identical in both stores."""
    stores, lives = [], []
    for two_phase in (False, True):
        store = ckptstore.open(tmp_path / f"s{int(two_phase)}")
        model, opt, sched = _small()
        ck = Checkpointer(store, model, opt, sched, policy="every-iteration", base_every=4,
                          group_commit=3, asynchronous=asynchronous, capture=capture,
                          fingerprint_every=2)
        assert ck.restore() == 0
        lives.append(_train_small(ck, model, opt, sched, range(1, 12), two_phase))
        ck.flush()
        ck.close()
        stores.append(store)
    for it in range(1, 12):
        a, b = stores[0].load(it), stores[1].load(it)
        for key in ("model", "optimizer", "scheduler"):
            _same(lives[1][it][key], b[key], f"two-phase iteration {it} {key}")
            _same(a[key], b[key], f"iteration {it} {key}")
        assert stores[0].kind(it) == stores[1].kind(it)
        assert stores[1].meta(it) == {"it": it}
    for s in stores:
        s.close()


def test_two_phase_step_misuse_raises_and_changes_nothing(tmp_path):
    store = ckptstore.open(tmp_path / "s")
    model, opt, sched = _small()
    ck = Checkpointer(store, model, opt, sched, asynchronous=False, policy="every-iteration")
    ck.restore()
    with pytest.raises(ckptstore.DeltaChainError, match="without before_step"):
        ck.after_step()
    with pytest.raises(ckptstore.DeltaChainError, match="must follow"):
        ck.before_step(3)  # the live state is that of iteration 0
    model(torch.randn(5, 6)).sum().backward()
    ck.before_step(1)
    with pytest.raises(ckptstore.DeltaChainError, match="not ended"):
        ck.before_step(2)
    with pytest.raises(ckptstore.DeltaChainError, match="not ended"):
        ck.step(1)
    opt.step()
    ck.after_step()
    assert store.iterations() == [0, 1]
    _same(model.state_dict(), store.load(1)["model"], "iteration 1")
    store.close()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_two_phase_retry_policy_trains_through_a_full_disk(tmp_path, asynchronous):
    disk = FullDisk()
    store = ckptstore.open(tmp_path / "s", file_ops=disk)
    # no buffers: the base that restarts the chain after a failure is written at the next step,
    # after its forward pass (the same with step())
    model, opt, sched = _small(buffers=False)
    ck = Checkpointer(store, model, opt, sched, policy="every-iteration", base_every=5,
                      asynchronous=asynchronous, on_failure="retry", max_failures=5)
    ck.restore()
    live = _train_small(ck, model, opt, sched, range(1, 13), True, disk, full={4, 5, 6})
    ck.flush()
    assert ck.health().failures_total >= 2
    its = store.iterations()
    assert its[-1] == 12
    for it in its[1:]:
        state = store.load(it)
        _same(live[it]["model"], state["model"], f"iteration {it}")
        _same(live[it]["optimizer"], state["optimizer"], f"iteration {it}")
    store.close()


def test_restore_from_a_state_already_read(tmp_path):
    store = ckptstore.open(tmp_path / "s")
    model, opt, sched = _small()
    ck = Checkpointer(store, model, opt, sched, policy="every-iteration", base_every=4,
                      asynchronous=False)
    ck.restore()
    live = _train_small(ck, model, opt, sched, range(1, 7), False)
    ck.close()
    model2, opt2, sched2 = _small()
    ck2 = Checkpointer(store, model2, opt2, sched2, policy="every-iteration", base_every=4,
                       asynchronous=False)
    with pytest.raises(ValueError):
        ck2.restore(state=store.load(6))
    assert ck2.restore(6, state=store.load(6)) == 6
    _same(live[6], _snapshot(model2, opt2, sched2), "restored 6")
    live2 = _train_small(ck2, model2, opt2, sched2, [7], False)  # the chain goes on
    _same(live2[7]["model"], store.load(7)["model"], "iteration 7")
    store.close()


def test_importing_ckptstore_imports_no_framework():
    code = ("import sys, ckptstore, ckptstore.torch; "
            "bad = [m for m in ('transformers', 'lightning', 'pytorch_lightning') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---- Hugging Face Trainer -------------------------------------------------------------------

HF_SAMPLES, HF_BATCH = 40, 4  # 10 batches per epoch


def _hf():
    pytest.importorskip("accelerate")  # the Trainer needs it (extra hf: transformers[torch])
    return pytest.importorskip("transformers")


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n=HF_SAMPLES):
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randint(0, 128, (n, 16), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _gpt2(seed):
    transformers = _hf()
    torch.manual_seed(seed)
    # dropout left on (0.1): the resumed run matches only if the RNG states are restored exactly
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _hf_args(out, max_steps, accumulate=1):
    transformers = _hf()
    return transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=HF_BATCH,
        gradient_accumulation_steps=accumulate, learning_rate=3e-3, warmup_steps=3,
        lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=4, save_strategy="no",
        report_to=[], disable_tqdm=True, use_cpu=True, seed=7, dataloader_num_workers=0)


def _hf_callbacks(stop_at=None, live=None):
    transformers = _hf()

    class Watch(transformers.TrainerCallback):
        """Snapshots the live state after every step; stops training after ``stop_at``."""

        def on_step_end(self, args, state, control, model=None, optimizer=None,
                        lr_scheduler=None, **kwargs):
            if live is not None:
                live[state.global_step] = copy.deepcopy({
                    "model": model.state_dict(), "optimizer": optimizer.optimizer.state_dict(),
                    "scheduler": lr_scheduler.state_dict()})
            if state.global_step == stop_at:
                control.should_training_stop = True

    return [Watch()]


def _hf_train(out, model, max_steps, accumulate=1, callbacks=(), resume=None):
    transformers = _hf()
    transformers.logging.set_verbosity_error()
    trainer = transformers.Trainer(model=model, args=_hf_args(out, max_steps, accumulate),
                                   train_dataset=_Tokens(), callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _without_loss(history):
    """A log entry's ``loss`` averages the steps since the previous log within one ``train()``
    call (a resumed run starts a new average, with the Trainer's own checkpoints too); the
    summary entry holds timings."""
    return [{k: v for k, v in e.items() if k != "loss"} for e in history if "train_runtime" not in e]


@pytest.mark.parametrize("stop_at,accumulate,steps,options", [
    (13, 1, 24, {}), (10, 1, 24, {}), (7, 2, 12, {"asynchronous": False, "group_commit": 1})],
    ids=["mid-epoch", "epoch-end", "accumulate-2-sync"])
def test_hf_trainer_per_iteration_checkpoints_and_resume(tmp_path, one_thread, stop_at, accumulate,
                                                         steps, options):
    """A Trainer with StoreCallback, stopped after ``stop_at`` steps, then a new Trainer (another
    model init) resumed from the store: the final weights equal an uninterrupted run's bit for
    bit, and store.load(t) equals the live model, optimizer and scheduler after every step t
    (10 batches per epoch: step 10 ends epoch 0; with 2 accumulated batches a step per 2)."""
    _hf()
    from ckptstore.hf import StoreCallback

    plain = _hf_train(tmp_path / "a", _gpt2(0), steps, accumulate)

    path = tmp_path / "store"
    live: dict = {}
    options = {"policy": "every-iteration", "base_every": 5, "group_commit": 3, **options}
    cb = StoreCallback(path, **options)
    first = _hf_train(tmp_path / "b", _gpt2(0), steps, accumulate,
                      [cb] + _hf_callbacks(stop_at, live))
    assert first.state.global_step == stop_at and cb.store is None  # closed at train end
    with ckptstore.open(path, mode="r") as store:
        assert store.iterations() == list(range(stop_at + 1))

    cb2 = StoreCallback(path, **options)
    model = _gpt2(99)
    transformers = _hf()
    trainer = transformers.Trainer(model=model, args=_hf_args(tmp_path / "c", steps, accumulate),
                                   train_dataset=_Tokens(), callbacks=[cb2] + _hf_callbacks(None, live))
    resume_dir = cb2.resume_from()
    assert sorted(os.listdir(resume_dir)) == ["model.safetensors", "trainer_state.json"]
    trainer.train(resume_from_checkpoint=resume_dir)
    assert not os.path.exists(resume_dir)

    _same(plain.model.state_dict(), trainer.model.state_dict(), "resumed final weights")
    _same(plain.optimizer.optimizer.state_dict(), trainer.optimizer.optimizer.state_dict(),
          "resumed final optimizer")
    assert trainer.state.global_step == steps
    assert trainer.state.epoch == plain.state.epoch
    assert _without_loss(trainer.state.log_history) == _without_loss(plain.state.log_history)

    with ckptstore.open(path, mode="r") as store:
        assert store.iterations() == list(range(steps + 1))
        kinds = {store.kind(t) for t in range(1, steps + 1)}
        assert kinds == {"snapshot", "delta"}
        for t in range(1, steps + 1):
            state = store.load(t)
            for key in ("model", "optimizer", "scheduler"):
                _same(live[t][key], state[key], f"iteration {t} {key}")
            hf_meta = store.meta(t)["hf"]
            assert hf_meta["trainer_state"]["global_step"] == t
        first_logs = [e for e in first.state.log_history if "train_runtime" not in e]
        assert cb2._log_history(store, stop_at) == json.loads(json.dumps(first_logs))


def test_hf_refuses_a_used_store_without_resume(tmp_path, one_thread):
    _hf()
    from ckptstore.hf import StoreCallback

    path = tmp_path / "store"
    every = {"policy": "every-iteration"}  # (iteration 1 is in the store to branch off)
    _hf_train(tmp_path / "a", _gpt2(0), 3, callbacks=[StoreCallback(path, **every)])
    cb = StoreCallback(path, **every)
    with pytest.raises(ValueError, match="resume"):
        _hf_train(tmp_path / "b", _gpt2(0), 3, callbacks=[cb])
    cb.close()
    cb = StoreCallback(path, **every)
    with pytest.raises(ValueError, match="another store"):  # branching off iteration 1
        _hf_train(tmp_path / "c", _gpt2(0), 3, callbacks=[cb], resume=cb.resume_from(1))
    cb.close()
    with ckptstore.open(path, mode="r") as store:
        assert store.iterations() == [0, 1, 2, 3]


# ---- Lightning CheckpointIO -----------------------------------------------------------------

LIT_SAMPLES, LIT_BATCH = 48, 8  # 6 steps per epoch


def _lightning():
    return pytest.importorskip("lightning")


def _lit_module(hparams=None):
    L = _lightning()

    class Tiny(L.LightningModule):
        def __init__(self, lr=0.05, width=16, extra=None):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.BatchNorm1d(width),
                                           torch.nn.Tanh(), torch.nn.Linear(width, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss, on_step=False, on_epoch=True)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 5, 0.7)}

    L.seed_everything(0, verbose=False)
    return Tiny(**(hparams or {}))


def _lit_data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(LIT_SAMPLES, 4, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    return torch.utils.data.DataLoader(ds, batch_size=LIT_BATCH, shuffle=False)


def _lit_fit(root, model, max_epochs, plugins=(), ckpt_path=None, saved=None):
    L = _lightning()
    from lightning.pytorch.callbacks import ModelCheckpoint

    callbacks = [ModelCheckpoint(dirpath=str(root / "ckpts"), monitor="train_loss", mode="min",
                                 save_top_k=2, every_n_epochs=1, save_on_train_epoch_end=True,
                                 save_last=True)]
    plugins = list(plugins)
    if saved is not None:  # record every (name, dict) Lightning hands the plugin
        io = plugins[0]
        save = io.save_checkpoint

        def recording(checkpoint, path, storage_options=None):
            saved.append((os.path.abspath(str(path)), copy.deepcopy(checkpoint)))
            save(checkpoint, path, storage_options)
        io.save_checkpoint = recording
    trainer = L.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(root), callbacks=callbacks, plugins=plugins,
                        deterministic=True)
    trainer.fit(model, _lit_data(), ckpt_path=ckpt_path)
    return trainer


def test_lightning_checkpoints_in_the_store_save_resume_bit_exact(tmp_path, one_thread):
    """Trainer(plugins=[StoreCheckpointIO]): ModelCheckpoint's saves land in the store (iteration
    = global_step, the path a name in the meta, nothing written at the path), load back as the
    very dicts Lightning saved, a resumed fit ends bit for bit where an uninterrupted one does,
    and top-k removals are dropped by the plugin's gc."""
    _lightning()
    from ckptstore.lightning import StoreCheckpointIO

    plain = _lit_fit(tmp_path / "a", _lit_module(), 4)

    path = tmp_path / "store"
    io = StoreCheckpointIO(path)
    saved: list = []
    _lit_fit(tmp_path / "b", _lit_module(), 2, [io], saved=saved)
    assert not (tmp_path / "b" / "ckpts").exists() or not os.listdir(tmp_path / "b" / "ckpts")
    with ckptstore.open(path, mode="r") as store:
        assert store.iterations() == [6, 12]
        assert store.meta(12)["lightning"]["global_step"] == 12
    first = {}  # global step -> the first dict saved at it: what the store holds
    for name, checkpoint in saved:
        first.setdefault(checkpoint["global_step"], checkpoint)
    assert sorted(first) == [6, 12] and len(saved) == 4  # top-k and last.ckpt at each
    names = io.names()
    for name, checkpoint in saved:
        if names.get(name) != checkpoint["global_step"]:
            continue  # last.ckpt of step 6, superseded by step 12's
        loaded = io.load_checkpoint(name)
        _same(first[checkpoint["global_step"]], loaded, name)
        # a second name of a step (last.ckpt) holds the first save's dict: the same but for
        # what the callbacks changed in between (ModelCheckpoint.last_model_path)
        _same({k: v for k, v in checkpoint.items() if k != "callbacks"},
              {k: v for k, v in loaded.items() if k != "callbacks"}, name)
    resume = io.latest_path()
    assert os.path.basename(resume) == "last.ckpt" and io.names()[resume] == 12

    io2 = StoreCheckpointIO(path)
    model = _lit_module()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the resume must overwrite every weight
    resumed = _lit_fit(tmp_path / "b", model, 4, [io2], ckpt_path=resume)
    _same(plain.lightning_module.state_dict(), resumed.lightning_module.state_dict(), "final weights")
    _same(plain.optimizers[0].state_dict(), resumed.optimizers[0].state_dict(), "final optimizer")
    assert resumed.global_step == plain.global_step == 24

    names = io2.names()
    best = resumed.checkpoint_callback.best_model_path  # a name ckpt_path="best" would load
    assert io2.load_checkpoint(best)["global_step"] == names[best]
    kept = set(names.values())
    with ckptstore.open(path, mode="r") as store:
        assert store.iterations() == [6, 12, 18, 24]  # removals wait for a gc
    assert len([n for n in names if "last" not in os.path.basename(n)]) == 2  # top 2
    report = io2.gc()
    assert set(report.removed) == {6, 12, 18, 24} - kept - {24}
    with ckptstore.open(path, mode="r") as store:
        assert set(store.iterations()) == kept | {24}
    removed_name = next(n for n, c in saved if c["global_step"] in report.removed)
    with pytest.raises(ckptstore.NotFoundError):
        io2.load_checkpoint(removed_name)
    io2.teardown()


def test_lightning_names_survive_a_lost_names_file_and_retention_runs_by_itself(tmp_path, one_thread):
    _lightning()
    from ckptstore.lightning import NAMES_FILE, StoreCheckpointIO

    path = tmp_path / "store"
    io = StoreCheckpointIO(path, retention_every=1)
    _lit_fit(tmp_path, _lit_module(), 4, [io])
    with ckptstore.open(path, mode="r") as store:
        its = store.iterations()
    # automatic retention after each save (before Lightning removes the checkpoint it
    # supersedes): the top-k loser of step 18's save (6) is gone after step 24's save, the one
    # removed right after step 24's save (12) waits for the next gc
    named = set(io.names().values())
    assert its == [12, 18, 24] and named == {18, 24}
    assert set(io.gc().removed) == {12}
    with ckptstore.open(path, mode="r") as store:
        its = store.iterations()
    assert its == [18, 24]
    io.teardown()
    os.remove(path / NAMES_FILE)  # lost (or never written): rebuilt from the metas, nothing removed
    io2 = StoreCheckpointIO(path)
    names = io2.names()
    assert set(names.values()) == set(its)
    assert io2.latest_path() is not None and io2.names()[io2.latest_path()] == 24
    io2.teardown()


def test_lightning_refuses_what_the_store_cannot_hold(tmp_path, one_thread):
    _lightning()
    from ckptstore.lightning import StoreCheckpointIO

    path = tmp_path / "store"
    io = StoreCheckpointIO(path)
    with pytest.raises(ckptstore.UnsupportedTypeError, match=r"hyper_parameters.*extra"):
        _lit_fit(tmp_path, _lit_module({"extra": {1, 2}}), 1, [io])  # a set: not JSON-like
    io.teardown()
    with ckptstore.open(path, mode="r") as store:
        assert store.iterations() == []
    io = StoreCheckpointIO(path)
    io.save_checkpoint({"global_step": 5, "w": torch.ones(2)}, tmp_path / "a.ckpt")
    io.save_checkpoint({"global_step": 5, "w": torch.ones(2)}, tmp_path / "b.ckpt")  # an alias
    assert io.names() == {str(tmp_path / "a.ckpt"): 5, str(tmp_path / "b.ckpt"): 5}
    with pytest.raises(ckptstore.IterationOrderError):
        io.save_checkpoint({"global_step": 4, "w": torch.ones(2)}, tmp_path / "c.ckpt")
    io.remove_checkpoint(tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "never.ckpt")
    _same({"global_step": 5, "w": torch.ones(2)}, io.load_checkpoint(tmp_path / "b.ckpt"), "alias")
    with pytest.raises(ckptstore.NotFoundError):
        io.load_checkpoint(tmp_path / "a.ckpt")
    io.teardown()
    # StoreDDPStrategy saves on every rank through a StoreCheckpointIO only
    from lightning.fabric.plugins import TorchCheckpointIO

    from ckptstore.lightning import StoreDDPStrategy

    strategy = StoreDDPStrategy(checkpoint_io=TorchCheckpointIO())
    with pytest.raises(TypeError, match="StoreCheckpointIO only.*TorchCheckpointIO"):
        strategy.save_checkpoint({"global_step": 6}, tmp_path / "d.ckpt")
    with pytest.raises(TypeError, match="StoreCheckpointIO only"):
        strategy.remove_checkpoint(tmp_path / "d.ckpt")
    assert not (tmp_path / "d.ckpt").exists()
