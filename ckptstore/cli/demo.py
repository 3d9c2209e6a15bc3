"""The demo behind ``ckptstore demo``: what per-iteration checkpoints buy, on the real path.

1. A child process trains a small GPT (AdamW, a warm-up + cosine LR schedule, deterministic CPU,
   batches keyed by iteration) through :class:`ckptstore.torch.Checkpointer`: an exact gradient
   delta every iteration (``policy="every-iteration"``, not the default "auto", which may plan
   snapshots), written in the background (async pipeline, group commit), with base snapshots
   chosen automatically (``base_every="auto"``).
2. At ``crash_at`` it SIGKILLs itself with deltas still in flight. The parent shows what survived
   (``durable`` = the last group commit) and runs fsck on the store the crash left.
3. A second child reopens the store, ``Checkpointer.restore()`` brings model, optimizer,
   scheduler and RNG back to the newest durable iteration, and training goes on to the end.
4. The final state (model and optimizer, replayed from the last base) is compared bit for bit with
   an uninterrupted run done here without checkpoints, and so is a point-in-time restore of a
   past iteration in the middle of a delta chain.
5. ``bisect`` finds the iteration where a NaN was injected into a gradient, in a second store.
6. fsck, then a table (bytes on disk per iteration vs torch.save every iteration, step time with
   and without checkpoints, restore times) and a PNG (loss curve with the crash and the resume;
   bytes written per iteration), when matplotlib is installed.

Invariants: the trainer's argv holds the demo directory and ints only; everything shown is
measured in this run.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from .console import human_bytes, table

VOCAB, DIM, LAYERS, HEADS, CONTEXT, BATCH = 256, 128, 2, 4, 64, 16
GROUP_COMMIT = 10


# ---- the model and its data -------------------------------------------------------------------
class TinyGPT(torch.nn.Module):
    """A decoder-only transformer: token + position embeddings, pre-norm causal blocks, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(VOCAB, DIM)
        self.positions = torch.nn.Embedding(CONTEXT, DIM)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(DIM, HEADS, 4 * DIM, dropout=0.0, batch_first=True,
                                             norm_first=True) for _ in range(LAYERS))
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(CONTEXT),
                             persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions.weight[: idx.shape[1]]
        for block in self.blocks:
            x = block(x, src_mask=self.mask, is_causal=True)
        return self.head(self.norm(x))


def build(seed: int = 0) -> tuple[TinyGPT, torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    torch.manual_seed(seed)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor)
    return model, opt, sched


def _lr_factor(step: int) -> float:
    """Linear warm-up over 20 steps, then a cosine decay to 10% over 1000 steps."""
    if step < 20:
        return (step + 1) / 20
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - 20) / 1000)))


_CORPUS: torch.Tensor | None = None


def corpus() -> torch.Tensor:
    """A token stream from a fixed random Markov chain in which each token has 4 likely
    successors: learnable (the loss falls from ln 256 = 5.5 towards ~1.5), no download."""
    global _CORPUS
    if _CORPUS is None:
        g = torch.Generator().manual_seed(7)
        successors = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)
        picks = torch.randint(0, 4, (1 << 16,), generator=g)
        out = torch.empty(1 << 16, dtype=torch.long)
        tok = 0
        for i, p in enumerate(picks.tolist()):
            tok = int(successors[tok, p])
            out[i] = tok
        _CORPUS = out
    return _CORPUS


def batch(it: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = corpus()
    g = torch.Generator().manual_seed(1000 + it)
    starts = torch.randint(0, len(data) - CONTEXT - 1, (BATCH,), generator=g)
    rows = torch.stack([data[s: s + CONTEXT + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def forward_backward(model: TinyGPT, it: int) -> float:
    x, y = batch(it)
    loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    loss.backward()
    return loss.item()


# ---- the trainer (a child process) -------------------------------------------------------------
def train_child(path: str, iterations: int, crash_at: int, log_path: str) -> None:
    """Train to ``iterations`` through a Checkpointer, resuming from the store; SIGKILL ourselves
    right after iteration ``crash_at`` (0: never), with its delta still in flight."""
    import ckptstore
    from ckptstore.torch import Checkpointer

    from .console import steps

    torch.set_num_threads(1)  # the persister gets the other core
    model, opt, sched = build()
    corpus()
    t0 = time.perf_counter()
    with ckptstore.open(path, "a") as store, open(log_path, "a") as log:
        ckpt = Checkpointer(store, model, opt, sched, policy="every-iteration", base_every="auto",
                            target_recovery_s=0.3, codec="exact", group_commit=GROUP_COMMIT)
        start = ckpt.restore()
        restore_s = time.perf_counter() - t0  # open (recovery included) + restore
        log.write(json.dumps({"restored": start, "seconds": restore_s}) + "\n")
        label = "training" if start == 0 else f"resumed at {start}"
        with steps(label, iterations, completed=start) as advance:
            for it in range(start + 1, iterations + 1):
                t = time.perf_counter()
                loss = forward_backward(model, it)
                ckpt.step(it, meta={"loss": loss})
                opt.zero_grad()
                step_s = time.perf_counter() - t
                log.write(json.dumps({"it": it, "loss": loss, "step_s": step_s,
                                      "interval": ckpt.interval()}) + "\n")
                log.flush()
                advance(1, f"loss {loss:.3f}")
                if it == crash_at:
                    os.kill(os.getpid(), signal.SIGKILL)


# ---- the reference and the measurements (the parent) ------------------------------------------
@dataclass
class Reference:
    """An uninterrupted run without checkpoints: its step times and two of its states."""

    step_s: list[float]
    at: dict[int, dict[str, Any]]


def reference_run(iterations: int, keep: set[int]) -> Reference:
    torch.set_num_threads(1)
    model, opt, sched = build()
    times, at = [], {}
    for it in range(1, iterations + 1):
        t = time.perf_counter()
        forward_backward(model, it)
        opt.step()
        sched.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
        if it in keep:
            at[it] = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                      "optimizer": _opt_tensors(opt.state_dict())}
    return Reference(times, at)


def _opt_tensors(state: dict) -> dict:
    return {(i, k): v.clone() for i, s in state["state"].items() for k, v in s.items()}


def same_state(loaded: dict, ref: dict[str, Any]) -> bool:
    model = loaded["model"]
    opt = _opt_tensors(loaded["optimizer"])
    return (model.keys() == ref["model"].keys() and opt.keys() == ref["optimizer"].keys()
            and all(torch.equal(model[k], v) for k, v in ref["model"].items())
            and all(torch.equal(opt[k], v) for k, v in ref["optimizer"].items()))


def _timed(fn: Any) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _read_log(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def bisect_nan(path: str, iterations: int = 40, seed: int = 0) -> tuple[int, Any, float]:
    """Train a second store with a NaN injected into one gradient at a random iteration; return
    that iteration, what bisect found and the seconds it took."""
    import ckptstore
    from ckptstore.torch import Checkpointer

    bad = int(torch.randint(2, iterations, (1,), generator=torch.Generator().manual_seed(seed)))
    model, opt, sched = build()
    with ckptstore.open(path, "a") as store:
        ckpt = Checkpointer(store, model, opt, sched, policy="every-iteration", base_every=10,
                            codec="exact", asynchronous=False)
        ckpt.restore()
        for it in range(1, iterations + 1):
            forward_backward(model, it)
            grad = model.head.weight.grad
            if it == bad and grad is not None:
                grad[3, 5] = float("nan")
            ckpt.step(it)
            opt.zero_grad()
    with ckptstore.open(path, "r") as store:
        found, seconds = _timed(lambda: store.bisect("nan"))
    return bad, found, seconds


def plot(png: str, runs: list[list[dict]], crash_at: int, resumed: int,
         written: dict[int, int], torch_save_bytes: int) -> str | None:
    """The loss curve (crash and resume marked) and the bytes written per iteration; None when
    matplotlib is missing (the reason otherwise)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib, or the [plots] extra)"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for run, style, name in zip(runs, ("-", "-"), ("first run", "after the crash")):
        pts = [(r["it"], r["loss"]) for r in run if "it" in r]
        if pts:
            ax1.plot(*zip(*pts), style, lw=1, label=name)
    ax1.axvline(crash_at, color="red", ls="--", lw=1, label=f"SIGKILL after iteration {crash_at}")
    ax1.axvline(resumed, color="green", ls=":", lw=1.5, label=f"resumed from iteration {resumed}")
    ax1.set(xlabel="iteration", ylabel="training loss", title="Crash and bit-exact resume")
    ax1.legend(loc="upper right")
    its = sorted(written)
    ax2.bar(its, [written[i] / 2**20 for i in its], width=1.0, color="tab:blue",
            label="ckptstore: written per iteration")
    ax2.axhline(torch_save_bytes / 2**20, color="tab:orange", lw=1.5,
                label="torch.save of the full state")
    ax2.set(xlabel="iteration", ylabel="MiB written", ylim=(0, torch_save_bytes / 2**20 * 1.25),
            title="Bytes written per iteration (the spikes are bases)")
    ax2.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return None


def run_demo(path: str, iterations: int = 160, crash_at: int = 97) -> int:
    import ckptstore
    from ckptstore.ops.fsck import check

    if not 0 < crash_at < iterations:
        raise ValueError("crash_at must be within 1..iterations - 1")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    store_path, log_path = os.path.join(path, "store"), os.path.join(path, "train.jsonl")
    def trainer(crash: int) -> list[str]:
        return [sys.executable, "-m", "ckptstore.cli.demo", store_path, str(iterations), str(crash),
                log_path]

    t_start = time.perf_counter()
    params = sum(p.numel() for p in build()[0].parameters())
    print(f"1. training a {params / 1e6:.2f}M-parameter GPT for {iterations} iterations with an "
          f"exact delta checkpoint every iteration into {store_path}/")
    rc = subprocess.run(trainer(crash_at)).returncode
    if rc != -signal.SIGKILL:
        print(f"   the trainer exited with {rc}, not SIGKILL")
        return 1
    first = _read_log(log_path)
    with ckptstore.open(store_path, "r") as store:
        its = store.iterations()
        latest = store.latest()
    assert latest is not None
    print(f"   SIGKILL after iteration {crash_at}; the store holds {len(its)} committed iterations "
          f"({its[0]}..{latest}): iterations {latest + 1}..{crash_at} were not durable yet "
          f"(group commit every {GROUP_COMMIT})")
    report = check(store_path)
    print("2. fsck of the crashed store: " + ("clean" if report.clean else "NOT CLEAN")
          + "".join(f"\n     note: {n}" for n in report.notes))
    print("3. restarting the trainer: it reopens the store, restores the latest iteration and "
          "goes on")
    mark = len(first)
    rc = subprocess.run(trainer(0)).returncode
    if rc != 0:
        print(f"   the trainer failed with {rc}")
        return 1
    rows = _read_log(log_path)
    second = rows[mark:]
    resumed, resume_s = second[0]["restored"], second[0]["seconds"]

    middle = next(i for i in range(iterations // 2, iterations) if i % 2)  # a past iteration
    print(f"4. checking against an uninterrupted run without checkpoints")
    ref = reference_run(iterations, {middle, iterations})
    with ckptstore.open(store_path, "r") as store:
        final = store.load(iterations)
        past, past_s = _timed(lambda: store.load(middle))
        kinds = [store.kind(i) for i in store.iterations()]
        written = {i: store.info(i).written_bytes for i in store.iterations()}
        base_of_middle = store.base_of(middle)
    exact = same_state(final, ref.at[iterations])
    past_exact = same_state(past, ref.at[middle])
    print(f"   final model + optimizer state: {'bit-identical' if exact else 'DIFFERENT'}")
    print(f"   point-in-time restore of iteration {middle} (base {base_of_middle} + "
          f"{middle - base_of_middle} deltas replayed): "
          f"{'bit-identical' if past_exact else 'DIFFERENT'}")

    print("5. bisect: a second run with a NaN injected into one gradient")
    bad, found, bisect_s = bisect_nan(os.path.join(path, "nan-store"))
    where = ", ".join(t.path for t in found.tensors[:3])
    print(f"   NaN injected at iteration {bad}; `bisect nan` found iteration {found.iteration} "
          f"({where}) in {bisect_s:.2f} s, loading {found.loaded} states and replaying "
          f"{found.replayed}")

    report = check(store_path)
    print("6. fsck: " + ("clean" if report.clean else "NOT CLEAN"))

    full = {"model": final["model"], "optimizer": final["optimizer"]}
    buf = io.BytesIO()
    torch.save(full, buf)
    torch_save_bytes = buf.tell()
    tmp = os.path.join(path, "full.pt")
    with open(tmp, "wb") as f:
        f.write(buf.getbuffer())
    _, torch_load_s = _timed(lambda: torch.load(tmp, weights_only=True))
    os.unlink(tmp)
    steps_ckpt = [r["step_s"] for r in rows if "step_s" in r]
    plain, with_ckpt = statistics.median(ref.step_s), statistics.median(steps_ckpt)
    on_disk = _dir_bytes(store_path)
    bases = kinds.count("snapshot")
    print()
    print(table([
        ["bytes on disk per iteration", f"{human_bytes(on_disk / iterations)}",
         f"{human_bytes(torch_save_bytes)} (torch.save every iteration)",
         f"{on_disk / iterations / torch_save_bytes:.2f}x"],
        ["step time (median)", f"{with_ckpt * 1e3:.1f} ms",
         f"{plain * 1e3:.1f} ms (no checkpoints)", f"{with_ckpt / plain:.2f}x"],
        [f"resume: restore iteration {resumed}", f"{resume_s:.2f} s",
         f"{torch_load_s:.2f} s (torch.load of a full checkpoint)", f"{resume_s / torch_load_s:.1f}x"],
        [f"restore iteration {middle} (point in time)", f"{past_s:.2f} s",
         "only if saved at that iteration", ""],
        ["work lost to the SIGKILL", f"{crash_at - resumed} iterations",
         f"up to the save interval", ""],
    ], ["", "ckptstore", "without it", "ratio"], right=(3,)))
    print(f"({len(kinds)} iterations: {bases} bases chosen automatically, "
          f"{len(kinds) - bases} exact deltas; store {human_bytes(on_disk)})")
    png = os.path.join(path, "demo.png")
    why = plot(png, [first, second[1:]], crash_at, resumed, written, torch_save_bytes)
    print(f"plot: {png}" if why is None else f"no plot: {why}")
    print(f"done in {time.perf_counter() - t_start:.0f} s; try: ckptstore ls {store_path}")
    ok = exact and past_exact and report.clean and found.iteration == bad
    return 0 if ok else 1


if __name__ == "__main__":
    train_child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
