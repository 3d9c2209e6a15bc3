"""The demo behind ``ckptstore demo``: per-iteration checkpoints, a crash, a restore, an fsck.

1. A child process trains a small model (AdamW + LR schedule, deterministic CPU, data keyed by
   iteration) and checkpoints model + optimizer + scheduler + RNG **every iteration**.
2. At ``crash_at`` it SIGKILLs itself halfway through writing that iteration's checkpoint.
3. The parent inspects the store (the torn checkpoint is invisible), runs fsck, and starts a new
   child, which reopens the store (automatic recovery), restores the latest checkpoint and finishes.
4. The final parameters are compared bit for bit with an uninterrupted run, then fsck runs again.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import torch

HIDDEN = 256


def _build(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, HIDDEN), torch.nn.GELU(),
                                torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(),
                                torch.nn.Linear(HIDDEN, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=200)
    return model, opt, sched


def _batch(it: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + it)
    x = torch.randn(32, 64, generator=g)
    return x, (x[:, :10].sum(dim=1) * 3).long().remainder(10)


def _step(model, opt, sched, it: int) -> float:
    x, y = _batch(it)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def _state(model, opt, sched, it: int) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(), "rng": torch.get_rng_state(), "iteration": it}


def train_child(path: str, iterations: int, crash_at: int) -> None:
    """Train with a checkpoint per iteration; SIGKILL ourselves mid-save at ``crash_at``."""
    import ckptstore

    torch.set_num_threads(1)
    model, opt, sched = _build()
    with ckptstore.open(path, "a", chunk_size=64 << 10) as store:
        start = store.latest()
        if start is not None:
            s = store.load(start)
            model.load_state_dict(s["model"])
            opt.load_state_dict(s["optimizer"])
            sched.load_state_dict(s["scheduler"])
            torch.set_rng_state(s["rng"])
            print(f"  [trainer] restored iteration {start}; resuming", flush=True)
        else:
            start = 0
            store.save(0, _state(model, opt, sched, 0))
        for it in range(start + 1, iterations + 1):
            loss = _step(model, opt, sched, it)
            progress = None
            if it == crash_at:
                written = [0]

                def progress(n: int) -> None:  # noqa: F811 - kill halfway through the save
                    written[0] += n
                    if written[0] > 200_000:
                        print(f"  [trainer] iteration {it}: SIGKILL in the middle of its checkpoint",
                              flush=True)
                        os.kill(os.getpid(), signal.SIGKILL)
            store.save(it, _state(model, opt, sched, it), meta={"loss": loss}, progress=progress)
            if it % 10 == 0:
                print(f"  [trainer] iteration {it}: loss {loss:.4f} (checkpointed)", flush=True)


def _reference(iterations: int) -> dict:
    torch.set_num_threads(1)
    model, opt, sched = _build()
    for it in range(1, iterations + 1):
        _step(model, opt, sched, it)
    return model.state_dict()


def run_demo(path: str, iterations: int = 60, crash_at: int = 37) -> int:
    import ckptstore
    from ckptstore.ops.fsck import check

    if not 0 < crash_at <= iterations:
        raise ValueError("crash_at must be within 1..iterations")
    shutil.rmtree(path, ignore_errors=True)
    child = [sys.executable, "-m", "ckptstore.demo", path, str(iterations), str(crash_at)]
    print(f"1. training {iterations} iterations with a checkpoint every iteration into {path}/")
    t0 = time.perf_counter()
    rc = subprocess.run(child).returncode
    print(f"   trainer exited with {rc} ({'killed by SIGKILL' if rc == -signal.SIGKILL else 'unexpected'})")
    if rc != -signal.SIGKILL:
        return 1
    with ckptstore.open(path, "r") as store:
        its = store.iterations()
        print(f"2. after the crash the store holds {len(its)} committed checkpoints "
              f"({its[0]}..{its[-1]}); iteration {crash_at} was torn and is invisible")
    report = check(path)
    print("   fsck (read-only): " + ("clean" if report.clean else "NOT CLEAN") +
          "".join(f"\n     note: {n}" for n in report.notes))
    print("3. restarting the trainer: it reopens the store (recovery cuts the torn tail), "
          "restores and resumes")
    rc = subprocess.run(child[:-1] + ["0"]).returncode
    if rc != 0:
        print(f"   trainer failed with {rc}")
        return 1
    with ckptstore.open(path, "r") as store:
        final = store.load(iterations, keys=["model"])["model"]
        d = store.diff(iterations - 10, iterations)
        info = store.info(iterations)
        sizes = [store.info(i).written_bytes for i in store.iterations()[1:]]
        print(f"   {len(store.iterations())} checkpoints; each {info.logical_bytes / 1e6:.2f} MB of "
              f"state, median {sorted(sizes)[len(sizes) // 2] / 1e6:.2f} MB written per iteration")
        print(f"   diff {iterations - 10} -> {iterations}: "
              f"{sum(x.status == 'changed' for x in d)} of {len(d)} tensors changed")
    ref = _reference(iterations)
    exact = all(torch.equal(final[k], ref[k]) for k in ref)
    print(f"4. final parameters vs an uninterrupted run: {'bit-identical' if exact else 'DIFFERENT'}")
    report = check(path)
    print("5. fsck: " + ("clean" if report.clean else "NOT CLEAN"))
    for line in report.lines()[:-1]:
        print(f"     {line}")
    print(f"done in {time.perf_counter() - t0:.1f} s; try: ckptstore ls {path}")
    return 0 if exact and report.clean else 1


if __name__ == "__main__":
    train_child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
