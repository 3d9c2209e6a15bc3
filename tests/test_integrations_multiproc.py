"""Multi-process Hugging Face Trainer and Lightning with ckptstore (issue 31, item 5).

Each job runs 2 ranks as separate ``python`` processes (this file run as a script), launched
the way torchrun launches them: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in the
environment. The Trainer (DDP through accelerate, ``ddp_backend="gloo"``, ``use_cpu=True``) and
Lightning (``strategy="ddp"``, ``accelerator="cpu"``, ``devices=2``; LOCAL_RANK set, so Lightning
launches nothing itself) start torch.distributed from it. Every job has a deadline; a rank that
does not finish in time is killed and reported as "hang", never waited for.

* Hugging Face: :class:`ckptstore.hf.StoreCallback` opens the store on every rank as a multi-rank
  job store; each rank writes its part of every step's record.
* Lightning: Lightning saves a checkpoint from global rank 0 only (``Strategy.save_checkpoint``),
  so :class:`ckptstore.lightning.StoreCheckpointIO` writes a single-writer store on rank 0 and
  every rank reads it to resume; with ``strategy=StoreDDPStrategy()`` every rank saves, into a
  multi-rank job store (rank 0's part carries the checkpoint).

Run a rank by hand: ``python tests/test_integrations_multiproc.py SCENARIO CONFIG_JSON`` with the
environment above. The tiny models are random-weight ones from configs: nothing downloads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

import pytest
from _ports import server_port

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
WORLD = 2
HF_STEPS, HF_STOP = 12, 7       # 40 samples, 4 per rank and step: 5 steps per epoch
LIT_EPOCHS, LIT_STOP = 4, 2     # 48 samples, 8 per rank and step: 3 steps per epoch


# ==== the rank programs ==========================================================================

def _write_result(work: str, rank: int, result: dict) -> None:
    tmp = os.path.join(work, f"rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(work, f"rank{rank}.json"))


def _error(e: BaseException) -> dict:
    return {"error": type(e).__name__, "message": str(e),
            "mro": [c.__name__ for c in type(e).__mro__], "trace": traceback.format_exc()}


def _differs(a: dict, b: dict) -> str | None:
    """The first key whose tensors differ in bits (None: the same keys, bit for bit)."""
    import torch

    if list(a) != list(b):
        return f"keys {sorted(set(a) ^ set(b))}"
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(
                x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return k
    return None


def _optimizer_tensors(opt: Any) -> dict:
    """An optimizer's state tensors by "index/name" (AdamW: exp_avg, exp_avg_sq, step)."""
    import torch

    return {f"{i}/{k}": v.detach().clone() for i, st in sorted(opt.state_dict()["state"].items())
            for k, v in sorted(st.items()) if isinstance(v, torch.Tensor)}


# ---- Hugging Face ----------------------------------------------------------------------------

def _hf_model(seed: int) -> Any:
    import torch
    import transformers

    torch.manual_seed(seed)
    # dropout on (0.1): a resume matches only if each rank's RNG states are restored exactly
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _hf_trainer(work: str, name: str, model: Any, callbacks: list) -> Any:
    import torch
    import transformers

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(1234)
            self.x = torch.randint(0, 128, (40, 16), generator=g)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.x[i], "labels": self.x[i]}

    args = transformers.TrainingArguments(
        output_dir=os.path.join(work, name), max_steps=HF_STEPS, per_device_train_batch_size=4,
        learning_rate=3e-3, warmup_steps=3, lr_scheduler_type="linear", max_grad_norm=1.0,
        logging_steps=4, save_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True,
        seed=7, dataloader_num_workers=0, ddp_backend="gloo", ddp_timeout=120)
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                callbacks=callbacks)


def _mark(work: str, rank: int) -> None:
    """Tell the launcher this rank reached the kill point (it SIGKILLs every rank once all
    have: :func:`launch` with ``kill_on_marks``)."""
    with open(os.path.join(work, f"mark-rank{rank}"), "w"):
        pass


def _hf_watch(rank: int, stop_at: int | None = None, kill_at: int | None = None,
              kill_ranks: tuple = (), live: dict | None = None, mark_at: int | None = None,
              work: str = "") -> Any:
    import transformers

    class Watch(transformers.TrainerCallback):
        """After each step: the live weights (``live``), stop after ``stop_at``, SIGKILL this
        process after ``kill_at`` when its rank is in ``kill_ranks``, tell the launcher after
        ``mark_at`` and wait there (its background commits go on) until it kills every rank."""

        def on_step_end(self, args, state, control, model=None, **kwargs):
            t = state.global_step
            if live is not None:
                live.update({f"{t}/{k}": v.detach().clone() for k, v in model.state_dict().items()})
            if t == mark_at:
                _mark(work, rank)
                time.sleep(120)  # (paused: the launcher kills it while its records commit)
            if t == kill_at and rank in kill_ranks:
                os.kill(os.getpid(), signal.SIGKILL)
            if t == stop_at:
                control.should_training_stop = True

    return Watch()


def _hf_plain(work: str) -> Any:
    """An uninterrupted run (no callback): the reference."""
    trainer = _hf_trainer(work, "plain", _hf_model(0), [])
    trainer.train()
    return trainer


def _hf_resume(work: str, store: str, callbacks: tuple = ()) -> tuple[Any, int | None]:
    """A new Trainer (another model init) resumed from the store to HF_STEPS."""
    from ckptstore.hf import StoreCallback

    cb = StoreCallback(store, policy="every-iteration", base_every=5, group_commit=3,
                       commit_timeout=60)
    trainer = _hf_trainer(work, "resumed", _hf_model(99), [cb, *callbacks])
    resume = cb.resume_from()  # collective: torch.distributed runs since the Trainer exists
    resumed_at = None
    if resume is not None:
        with open(os.path.join(resume, "trainer_state.json")) as f:
            resumed_at = json.load(f)["global_step"]
    trainer.train(resume_from_checkpoint=resume)
    return trainer, resumed_at


def _hf_compare(plain: Any, resumed: Any) -> dict:
    return {"model": _differs(plain.model.state_dict(), resumed.model.state_dict()),
            "optimizer": _differs(_optimizer_tensors(plain.optimizer.optimizer),
                                  _optimizer_tensors(resumed.optimizer.optimizer)),
            "steps": [plain.state.global_step, resumed.state.global_step]}


def hf_resume(rank: int, cfg: dict) -> dict:
    """A run stopped after HF_STOP steps, resumed to HF_STEPS by a new Trainer, against an
    uninterrupted run; rank 0 keeps the live weights after every step (``live.safetensors``)."""
    from safetensors.torch import save_file

    from ckptstore.hf import StoreCallback

    work, store = cfg["work"], cfg["store"]
    plain = _hf_plain(work)
    live: dict = {}
    cb = StoreCallback(store, policy="every-iteration", base_every=5, group_commit=3,
                       commit_timeout=60)
    first = _hf_trainer(work, "first", _hf_model(0), [cb, _hf_watch(rank, stop_at=HF_STOP,
                                                                    live=live)])
    first.train()
    closed = cb.store is None
    resumed, at = _hf_resume(work, store, (_hf_watch(rank, live=live),))
    out = _hf_compare(plain, resumed)
    out.update(resumed_at=at, closed=closed)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in live.items()},
                  os.path.join(work, "live.safetensors"))
    return out


def hf_kill(rank: int, cfg: dict) -> dict:
    """Train with the callback; SIGKILL the ranks in ``kill_ranks`` after step ``kill_at``
    (the others then fail in a collective: their error is the result), or mark step
    ``mark_at`` for the launcher, which kills every rank."""
    from ckptstore.hf import StoreCallback

    cb = StoreCallback(cfg["store"], policy="every-iteration", base_every=5, group_commit=3,
                       commit_timeout=30)
    trainer = _hf_trainer(cfg["work"], "killed", _hf_model(0),
                          [cb, _hf_watch(rank, kill_at=cfg.get("kill_at"),
                                         kill_ranks=tuple(cfg.get("kill_ranks", ())),
                                         mark_at=cfg.get("mark_at"), work=cfg["work"])])
    trainer.train()
    return {"finished": trainer.state.global_step}


def hf_after_kill(rank: int, cfg: dict) -> dict:
    """The relaunch: resume from the store, and an uninterrupted run to compare with."""
    resumed, at = _hf_resume(cfg["work"], cfg["store"])
    out = _hf_compare(_hf_plain(cfg["work"]), resumed)
    out["resumed_at"] = at
    return out


def hf_elastic(rank: int, cfg: dict) -> dict:
    """Resume a job store written at another world size: the weights restored (``restored.
    safetensors``, taken before the first step) and how far training went."""
    import torch.distributed as dist
    import transformers
    from safetensors.torch import save_file

    from ckptstore.hf import StoreCallback

    restored: dict = {}

    class Restored(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if not restored:
                restored.update({k: v.detach().clone().contiguous()
                                 for k, v in model.state_dict().items()})
                if rank == 0:  # (now: the job may be killed later)
                    save_file(restored, os.path.join(cfg["work"], "restored.safetensors"))

    cb = StoreCallback(cfg["store"], policy="every-iteration", base_every=5, commit_timeout=60,
                       group_commit=cfg.get("group_commit", 3),
                       asynchronous=cfg.get("asynchronous", True))
    trainer = _hf_trainer(cfg["work"], "elastic", _hf_model(99),
                          [cb, Restored(), _hf_watch(rank, kill_at=cfg.get("kill_at"),
                                                     kill_ranks=(0, 1))])
    resume = cb.resume_from()
    trainer.train(resume_from_checkpoint=resume)
    return {"world": dist.get_world_size() if dist.is_initialized() else None,
            "steps": trainer.state.global_step}


def hf_fail(rank: int, cfg: dict) -> dict:
    """Bad input, then a rank whose record fails: a single-writer store at ``single`` is refused
    on every rank; then rank 1's disk is full from step 4 on (a base is due at 4)."""
    import torch.distributed as dist

    import ckptstore
    from ckptstore.hf import StoreCallback
    from conftest import FullDisk

    out: dict = {}
    try:
        _hf_trainer(cfg["work"], "single", _hf_model(0), [StoreCallback(cfg["single"])]).train()
        out["single"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["single"] = _error(e)
    disk = FullDisk()
    js = ckptstore.open(cfg["store"], "a", process_group=dist.group.WORLD, commit_timeout=60,
                        file_ops=disk)
    import transformers

    class Fill(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            disk.full = rank == 1 and state.global_step + 1 >= 4

    cb = StoreCallback(js, policy="every-iteration", base_every=4,
                       asynchronous=cfg.get("asynchronous", False))
    try:
        _hf_trainer(cfg["work"], "full", _hf_model(0), [Fill(), cb]).train()
        out["full"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["full"] = _error(e)
    out["iterations"] = js.iterations()
    return out


# ---- Lightning ---------------------------------------------------------------------------------

def _lit_module(perturb: bool = False) -> Any:
    import lightning as L
    import torch

    class Tiny(L.LightningModule):
        def __init__(self, lr: float = 0.05, width: int = 16) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(),
                                           torch.nn.Linear(width, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 5, 0.7)}

    L.seed_everything(0, verbose=False)
    model = Tiny()
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # the resume must overwrite every weight
    return model


def _lit_fit(work: str, name: str, model: Any, max_epochs: int, io: Any = None,
             ckpt_path: str | None = None, callbacks: tuple = (), job: bool = False,
             ckpts: str | None = None) -> Any:
    """A DDP fit (``job``: with ckptstore's StoreDDPStrategy: every rank saves), checkpoint
    names under ``ckpts`` (default: ``work/ckpts``)."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    g = torch.Generator().manual_seed(5)
    x = torch.randn(48, 4, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin()),
                                       batch_size=8, shuffle=True)
    cbs = list(callbacks)
    if io is not None:
        cbs.append(ModelCheckpoint(dirpath=ckpts or os.path.join(work, "ckpts"), monitor="train_loss",
                                   mode="min", save_top_k=2, every_n_epochs=1,
                                   save_on_train_epoch_end=True, save_last=True))
    from ckptstore.lightning import StoreDDPStrategy

    trainer = L.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=WORLD,
                        strategy=StoreDDPStrategy() if job else "ddp",
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=os.path.join(work, name), callbacks=cbs,
                        plugins=[io] if io is not None else [], enable_checkpointing=io is not None,
                        deterministic=True)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer


def _lit_compare(plain: Any, resumed: Any) -> dict:
    return {"model": _differs(plain.lightning_module.state_dict(),
                              resumed.lightning_module.state_dict()),
            "optimizer": _differs(_optimizer_tensors(plain.optimizers[0]),
                                  _optimizer_tensors(resumed.optimizers[0])),
            "steps": [plain.global_step, resumed.global_step]}


def _lit_kill(rank: int, at_step: int) -> Any:
    import lightning as L

    class Kill(L.Callback):
        def on_train_batch_end(self, trainer, *args, **kwargs):
            if trainer.global_step == at_step:
                os.kill(os.getpid(), signal.SIGKILL)

    return Kill()


def _lit_io(store: str, job: bool = False, retention_every: int | None = None) -> Any:
    """The plugin (``job``: every rank waits at most 60 s for the others in a commit)."""
    from ckptstore.lightning import StoreCheckpointIO

    return StoreCheckpointIO(store, retention_every=retention_every,
                             **({"commit_timeout": 60.0} if job else {}))


def _lit_resume(work: str, store: str, job: bool = False, retention_every: int | None = None,
                ckpts: str | None = None) -> tuple[Any, str | None, Any]:
    io = _lit_io(store, job, retention_every)
    path = io.latest_path()  # every rank reads the store
    resumed = _lit_fit(work, "resumed", _lit_module(perturb=True), LIT_EPOCHS, io, path, job=job,
                       ckpts=ckpts)
    return resumed, path, io


def lit_resume(rank: int, cfg: dict) -> dict:
    """fit for LIT_STOP epochs with the plugin, then a new Trainer resumed from its newest
    checkpoint to LIT_EPOCHS, against an uninterrupted fit."""
    from ckptstore.lightning import StoreCheckpointIO

    work, store = cfg["work"], cfg["store"]
    plain = _lit_fit(work, "plain", _lit_module(), LIT_EPOCHS)
    import lightning as L

    io = StoreCheckpointIO(store)
    opened = []

    class Opened(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):  # (ModelCheckpoint saves after it)
            opened.append(io.store is not None)

    _lit_fit(work, "first", _lit_module(), LIT_STOP, io, callbacks=(Opened(),))
    io.teardown()
    resumed, path, io2 = _lit_resume(work, store)
    out = _lit_compare(plain, resumed)
    out.update(resumed_from=path, opened=any(opened), names=io2.names())
    io2.teardown()
    return out


def lit_kill(rank: int, cfg: dict) -> dict:
    """Fit until every rank SIGKILLs itself at step ``kill_at`` (``job``: StoreDDPStrategy, every
    rank saving into a job store)."""
    job = cfg.get("job", False)
    trainer = _lit_fit(cfg["work"], "killed", _lit_module(), LIT_EPOCHS, _lit_io(cfg["store"], job),
                       callbacks=(_lit_kill(rank, cfg["kill_at"]),), job=job,
                       ckpts=cfg.get("ckpts"))
    return {"finished": trainer.global_step}


def lit_after_kill(rank: int, cfg: dict) -> dict:
    """Resume the killed fit from the store, then an uninterrupted fit to compare with."""
    resumed, path, io = _lit_resume(cfg["work"], cfg["store"], cfg.get("job", False),
                                    cfg.get("retention_every"), cfg.get("ckpts"))
    out = _lit_compare(_lit_fit(cfg["work"], "plain", _lit_module(), LIT_EPOCHS), resumed)
    out["resumed_from"] = path
    io.teardown()
    out["names"] = io.names()
    return out


def lit_fail(rank: int, cfg: dict) -> dict:
    """Rank 0's save fails (a value the store cannot hold): rank 0 raises the typed error; the
    other rank, in Lightning's barrier after the save (``job``: in the job store's commit round),
    must fail too (not hang)."""
    import lightning as L

    class Poison(L.Callback):
        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            checkpoint["poison"] = {1, 2}  # a set: not JSON-like

    try:
        job = cfg.get("job", False)
        _lit_fit(cfg["work"], "fail", _lit_module(), 1, _lit_io(cfg["store"], job),
                 callbacks=(Poison(),), job=job)
        return {"fit": None}
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"fit": _error(e), "failures": [list(f) for f in getattr(e, "failures", ())]}


SCENARIOS: dict[str, Callable[[int, dict], dict]] = {
    f.__name__: f for f in (hf_resume, hf_kill, hf_after_kill, hf_elastic, hf_fail, lit_resume,
                            lit_kill,
                            lit_after_kill, lit_fail)}


def rank_main(scenario: str, cfg: dict) -> None:
    import torch

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    try:
        result = {"ok": SCENARIOS[scenario](rank, cfg)}
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result = _error(e)
    _write_result(cfg["work"], rank, result)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (gloo threads of a failed group can hang it)


# ==== launching jobs =============================================================================

def launch(scenario: str, cfg: dict, work: str, deadline: float, world: int = WORLD,
           kill_on_marks: bool = False) -> list[dict]:
    """Run ``scenario`` on ``world`` ranks (processes of this file); per rank its result
    (``{"ok": ...}`` or an error), ``{"died": exit status}`` (negative: the signal), or
    ``{"hang": True}`` when it was still running at the deadline (then killed).
    ``kill_on_marks``: SIGKILL every rank, at once, as soon as every rank has marked its
    kill point (:func:`_mark`; a scheduler killing a job)."""
    os.makedirs(work, exist_ok=True)
    cfg = dict(cfg, work=work)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server_port()),
               WORLD_SIZE=str(world), NODE_RANK="0", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for r in range(world):
        for name in (f"rank{r}.json", f"mark-rank{r}"):
            if os.path.exists(os.path.join(work, name)):
                os.unlink(os.path.join(work, name))
    procs: list[subprocess.Popen] = []
    codes: list[int | None] = []
    try:
        for r in range(world):
            with open(os.path.join(work, f"rank{r}.log"), "wb") as log:
                procs.append(subprocess.Popen([sys.executable, HERE, scenario, json.dumps(cfg)],
                                              stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r))))
        end = time.monotonic() + deadline
        marks = [os.path.join(work, f"mark-rank{r}") for r in range(world)]
        while kill_on_marks and time.monotonic() < end and any(p.poll() is None for p in procs):
            if all(os.path.exists(m) for m in marks):
                for p in procs:
                    p.send_signal(signal.SIGKILL)
                break
            time.sleep(0.01)
        for p in procs:
            try:
                codes.append(p.wait(max(0.1, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:  # (also when the test itself is interrupted: no rank outlives the call)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = []
    for r, code in enumerate(codes):
        f = os.path.join(work, f"rank{r}.json")
        if code is None:
            out.append({"hang": True})
        elif os.path.exists(f):
            with open(f) as fh:
                out.append(json.load(fh))
        else:
            out.append({"died": code})
    return out


def _logs(work: str, world: int = WORLD) -> str:
    parts = []
    for r in range(world):
        with open(os.path.join(work, f"rank{r}.log"), errors="replace") as f:
            parts.append(f"--- rank {r}:\n{f.read()[-4000:]}")
    return "\n".join(parts)


def _ok(results: list[dict], work: str) -> list[dict]:
    bad = [r for r in results if "ok" not in r]
    assert not bad, f"{results}\n{_logs(work)}"
    return [r["ok"] for r in results]


def _bit_exact(res: dict) -> None:
    assert res["model"] is None, f"final weights differ at {res['model']}"
    assert res["optimizer"] is None, f"final optimizer state differs at {res['optimizer']}"
    assert res["steps"][0] == res["steps"][1]


# ==== tests ======================================================================================

@pytest.mark.timeout(400)
def test_hf_trainer_on_two_ranks_writes_a_job_store_and_resumes_bit_exact(tmp_path):
    """2 ranks (DDP, gloo): StoreCallback writes a job store of 2 ranks (each its part of every
    step), ``store.load(t)`` is the live model after every step t, and a new Trainer resumed
    from the store after step 7 ends with the weights and optimizer state of an uninterrupted
    run, bit for bit, on every rank."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file

    import ckptstore

    store, work = str(tmp_path / "store"), str(tmp_path / "job")
    results = _ok(launch("hf_resume", {"store": store}, work, 360), work)
    for rank, res in enumerate(results):
        _bit_exact(res)
        assert res["resumed_at"] == HF_STOP and res["closed"], (rank, res)
    live = load_file(os.path.join(work, "live.safetensors"))
    with ckptstore.open(store, mode="r") as js:
        assert isinstance(js, ckptstore.JobStore) and js.world_size == WORLD
        assert js.iterations() == list(range(HF_STEPS + 1))
        assert {js.kind(t) for t in range(1, HF_STEPS + 1)} == {"snapshot", "delta"}
        for t in range(1, HF_STEPS + 1):
            model = js.load(t)["model"]
            for k, v in model.items():
                assert torch.equal(v, live[f"{t}/{k}"]), f"iteration {t}: {k} differs"
            assert js.meta(t, rank=0)["hf"]["trainer_state"]["global_step"] == t
        # each rank wrote a part of the parameters (the Checkpointer's partition)
        parts = [set(js.load(HF_STEPS, rank=r)["model"]) for r in range(WORLD)]
        assert parts[0] and parts[1] and not parts[0] & parts[1]
        its = js.iterations()
    # one process without torch.distributed (this one) cannot write the job store: refused,
    # nothing opened or changed
    from ckptstore.hf import StoreCallback

    cb = StoreCallback(store)
    with pytest.raises(ValueError, match="multi-rank job store.*every rank"):
        cb.resume_from()
    try:
        from ckptstore.lightning import StoreCheckpointIO
    except ImportError:
        StoreCheckpointIO = None
    if StoreCheckpointIO is not None:
        io = StoreCheckpointIO(store)
        with pytest.raises(ValueError, match="multi-rank job store.*rank 0 only"):
            io.save_checkpoint({"global_step": 100, "w": torch.ones(2)}, tmp_path / "x.ckpt")
        io.every_rank = True  # (as StoreDDPStrategy drives it): still one process here
        with pytest.raises(ValueError, match="multi-rank job store.*every rank"):
            io.save_checkpoint({"global_step": 100, "w": torch.ones(2)}, tmp_path / "x.ckpt")
    with ckptstore.open(store, mode="r") as js:
        assert js.iterations() == its


@pytest.mark.timeout(300)
def test_hf_bad_store_and_a_failing_rank_fail_every_rank_with_typed_errors(tmp_path):
    """A single-writer store under a 2-rank Trainer is refused on every rank before anything is
    written; a rank whose record fails (rank 1's disk full at the base of step 4) makes both
    ranks raise: rank 1 its DiskFullError, rank 0 GlobalCommitAbortedError naming rank 1; the
    iterations before it stay committed."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    import torch

    import ckptstore

    single = str(tmp_path / "single")
    with ckptstore.open(single) as s:
        s.save(0, {"w": torch.zeros(2)})
    work = str(tmp_path / "job")
    results = _ok(launch("hf_fail", {"store": str(tmp_path / "store"), "single": single},
                         work, 240), work)
    for rank, res in enumerate(results):
        assert res["single"] is not None and res["single"]["error"] == "ValueError", res
        assert "single-writer store" in res["single"]["message"]
        assert res["iterations"] == [0, 1, 2, 3], (rank, res)
    full0, full1 = results[0]["full"], results[1]["full"]
    assert full1 is not None and "DiskFullError" in full1["mro"], full1
    assert full0 is not None and full0["error"] == "GlobalCommitAbortedError", full0
    assert "rank 1" in full0["message"] and "No space left" in full0["message"], full0
    with ckptstore.open(single, mode="r") as s:
        assert s.iterations() == [0]


@pytest.mark.slow
@pytest.mark.timeout(700)
@pytest.mark.parametrize("victims", [(0, 1), (1,)], ids=["kill-all", "kill-rank-1"])
def test_hf_killed_trainer_resumes_bit_exact(tmp_path, victims):
    """SIGKILL of every rank at once (by the launcher, once both passed step 8, while their
    records commit in the background) or of rank 1 alone after step 8 (rank 0 then fails in a collective and must exit,
    not hang): a relaunched job resumes from the newest committed iteration (any: the records
    are committed in the background) and ends bit for bit where an uninterrupted run does."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    import ckptstore

    store = str(tmp_path / "store")
    every = victims == tuple(range(WORLD))
    cfg = {"store": store, "mark_at": 8} if every else \
        {"store": store, "kill_at": 8, "kill_ranks": list(victims)}
    killed = launch("hf_kill", cfg, str(tmp_path / "killed"), 240, kill_on_marks=every)
    for rank, res in enumerate(killed):
        if rank in victims:
            assert res == {"died": -signal.SIGKILL}, (rank, res)
        else:
            assert "error" in res, (rank, res)  # failed in a collective, did not hang
    with ckptstore.open(store, mode="r") as js:
        latest = js.latest()
    assert latest is not None and 0 <= latest <= 8
    work = str(tmp_path / "relaunch")
    for rank, res in enumerate(_ok(launch("hf_after_kill", {"store": store}, work, 360), work)):
        _bit_exact(res)
        assert res["resumed_at"] == latest, (rank, res)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hf_job_store_resumes_at_another_world_size(tmp_path):
    """A job store written by 2 ranks (both killed after step 8) resumed by 1 process, killed
    after step 10, then resumed by 2 ranks again (the elastic restore: every part merged; a
    rank the writing job did not have reads rank 0's meta and state): each time the weights the
    Trainer starts from are the store's newest iteration bit for bit, and the last job trains
    to the last step at world size 2."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file

    import ckptstore

    store = str(tmp_path / "store")
    killed = launch("hf_kill", {"store": store, "mark_at": 8}, str(tmp_path / "killed"), 240,
                    kill_on_marks=True)
    assert killed == [{"died": -signal.SIGKILL}] * WORLD, killed
    latest: list[int] = []
    for world, kill_at in ((1, 10), (WORLD, None)):  # (at 1: each record durable at once)
        with ckptstore.open(store, mode="r") as js:
            latest.append(js.latest())
            expected = js.load(latest[-1])["model"]
        assert latest[-1] is not None and latest[-1] < HF_STEPS
        work = str(tmp_path / f"at{world}")
        cfg = {"store": store, "kill_at": kill_at} if world > 1 else \
            {"store": store, "kill_at": kill_at, "asynchronous": False, "group_commit": 1}
        results = launch("hf_elastic", cfg, work, 300, world=world)
        if kill_at is not None:
            assert results == [{"died": -signal.SIGKILL}] * world, results
        else:
            assert _ok(results, work) == [{"world": world, "steps": HF_STEPS}] * world
        restored = load_file(os.path.join(work, "restored.safetensors"))
        for k, v in expected.items():
            assert torch.equal(v, restored[k]), (world, k)
    with ckptstore.open(store, mode="r") as js:
        assert js.iterations() == list(range(HF_STEPS + 1))
        assert js.global_commit(HF_STEPS).world_size == WORLD
        assert js.global_commit(latest[0]).world_size == WORLD
        assert js.global_commit(latest[1]).world_size == 1
        assert latest[0] <= 8 and latest[1] == 10


@pytest.mark.timeout(400)
def test_lightning_ddp_checkpoints_in_the_store_and_resumes_bit_exact(tmp_path):
    """Trainer(strategy="ddp", devices=2): rank 0 saves ModelCheckpoint's checkpoints in the
    store (the other rank never opens it for writing), every rank loads the newest one to
    resume, and the resumed fit ends bit for bit where an uninterrupted one does."""
    pytest.importorskip("lightning")
    import ckptstore

    store, work = str(tmp_path / "store"), str(tmp_path / "job")
    results = _ok(launch("lit_resume", {"store": store}, work, 360), work)
    steps = 3 * LIT_STOP
    for rank, res in enumerate(results):
        _bit_exact(res)
        assert res["opened"] == (rank == 0), (rank, res)  # a writer on rank 0 only
        assert res["resumed_from"] is not None and res["resumed_from"].endswith("last.ckpt")
    assert results[0]["names"] == results[1]["names"]
    with ckptstore.open(store, mode="r") as s:
        assert not isinstance(s, ckptstore.JobStore)
        assert s.iterations()[:LIT_STOP] == [3 * (e + 1) for e in range(LIT_STOP)]
        assert s.iterations()[-1] == 3 * LIT_EPOCHS
        assert s.meta(steps)["lightning"]["global_step"] == steps


@pytest.mark.timeout(300)
def test_lightning_ddp_failed_save_fails_every_rank(tmp_path):
    """Rank 0's save raises UnsupportedTypeError before anything is written; the other rank
    (waiting in Lightning's barrier after the save) fails too when rank 0 leaves: no hang,
    nothing in the store."""
    pytest.importorskip("lightning")
    import ckptstore

    store, work = str(tmp_path / "store"), str(tmp_path / "job")
    results = launch("lit_fail", {"store": store}, work, 240)
    assert all("ok" in r for r in results), f"{results}\n{_logs(work)}"
    fit0, fit1 = results[0]["ok"]["fit"], results[1]["ok"]["fit"]
    assert fit0 is not None and fit0["error"] == "UnsupportedTypeError", fit0
    assert "poison" in fit0["message"]
    assert fit1 is not None, fit1
    with ckptstore.open(store, mode="r") as s:
        assert s.iterations() == []


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_lightning_killed_ddp_fit_resumes_bit_exact(tmp_path):
    """SIGKILL of both ranks in epoch 3 (after the checkpoints of epochs 1 and 2): a relaunched
    fit resumes from the newest checkpoint and ends bit for bit where an uninterrupted one does."""
    pytest.importorskip("lightning")

    store = str(tmp_path / "store")
    killed = launch("lit_kill", {"store": store, "kill_at": 7}, str(tmp_path / "killed"), 240)
    assert killed == [{"died": -signal.SIGKILL}] * WORLD, killed
    work = str(tmp_path / "relaunch")
    for rank, res in enumerate(_ok(launch("lit_after_kill", {"store": store}, work, 360), work)):
        _bit_exact(res)
        assert res["resumed_from"].endswith("last.ckpt"), (rank, res)


@pytest.mark.slow  # ~28 s on 2 cores (2 Lightning processes); the single-store twin is default
@pytest.mark.timeout(300)
def test_lightning_store_ddp_strategy_failed_save_fails_every_rank_naming_rank_0(tmp_path):
    """StoreDDPStrategy: rank 0's part of the first save holds a value the store cannot hold.
    Rank 0 raises UnsupportedTypeError naming it, rank 1 GlobalCommitAbortedError naming rank 0
    and its error (the job store's commit round); nothing is committed."""
    pytest.importorskip("lightning")
    import ckptstore

    store, work = str(tmp_path / "store"), str(tmp_path / "job")
    results = _ok(launch("lit_fail", {"store": store, "job": True}, work, 240), work)
    fit0, fit1 = results[0]["fit"], results[1]["fit"]
    assert fit0 is not None and fit0["error"] == "UnsupportedTypeError", fit0
    assert "poison" in fit0["message"]
    assert fit1 is not None and fit1["error"] == "GlobalCommitAbortedError", fit1
    assert [r for r, _ in results[1]["failures"]] == [0], results[1]
    assert "UnsupportedTypeError" in results[1]["failures"][0][1]
    with ckptstore.open(store, mode="r") as js:
        assert isinstance(js, ckptstore.JobStore) and js.iterations() == []


@pytest.mark.slow  # ~49 s on 2 cores: two launches of 2 Lightning processes
@pytest.mark.timeout(700)
def test_lightning_store_ddp_strategy_writes_a_job_store_and_a_killed_fit_resumes_bit_exact(
        tmp_path):
    """strategy=StoreDDPStrategy(): every rank saves ModelCheckpoint's checkpoints into a job
    store of 2 ranks (rank 0's part carries the checkpoint). SIGKILL of both ranks in epoch 3;
    the relaunched fit resumes from the job store on both ranks and ends bit for bit where an
    uninterrupted fit does; the resumed checkpoints are global commits of both ranks."""
    pytest.importorskip("lightning")
    import ckptstore

    store = str(tmp_path / "store")
    # (one ModelCheckpoint dirpath for both fits: the resumed one goes on removing the top-k's)
    cfg = {"store": store, "kill_at": 7, "job": True, "ckpts": str(tmp_path / "ckpts")}
    killed = launch("lit_kill", cfg, str(tmp_path / "killed"), 240)
    assert killed == [{"died": -signal.SIGKILL}] * WORLD, killed
    with ckptstore.open(store, mode="r") as js:
        assert isinstance(js, ckptstore.JobStore) and js.iterations() == [3, 6]
        assert js.global_commit(6).world_size == WORLD
    work = str(tmp_path / "relaunch")  # with the plugin's retention after every save
    results = _ok(launch("lit_after_kill", dict(cfg, retention_every=1), work, 360), work)
    for rank, res in enumerate(results):
        _bit_exact(res)
        assert res["resumed_from"].endswith("last.ckpt"), (rank, res)
    names = results[0]["names"]  # top-2 and last.ckpt: the others were removed on every rank
    assert names == results[1]["names"] and len(names) == 3, results
    with ckptstore.open(store, mode="r") as js:
        last = 3 * LIT_EPOCHS
        its = js.iterations()
        assert its[-1] == last and js.global_commit(last).world_size == WORLD
        # the job's automatic gc (before the save of 12) collected the iteration the removal
        # after the save of 9 left unnamed: 3 of the 4 kept, every name among them
        assert len(its) == 3 and set(names.values()) <= set(its), (its, names)
        held = js.load(last, rank=0)
        assert held["global_step"] == last and "state_dict" in held
        assert js.load(last, rank=1) == {"lightning": {"held_by": 0}}
        assert js.meta(last, rank=1)["lightning"]["global_step"] == last


if __name__ == "__main__":
    rank_main(sys.argv[1], json.loads(sys.argv[2]))
