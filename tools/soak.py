"""Soak test: SIGKILL a real training loop thousands of times and verify the store after each kill.

Each trial forks a trainer (from a zygote process that imported torch once, so a trial costs a
fork, not an interpreter start) that resumes from the store with ``Checkpointer.restore()`` and
trains on: a small MLP with AdamW, the async pipeline writing an exact delta every iteration
(group commit 4), a base every 16 iterations, and gc every 24 iterations (keeping the last 4 and the
chains they need). After each step it appends the iteration the store reports durable to a journal.
The soak kills it with SIGKILL after a random delay (during restore, a step, a group commit, a
base save or gc), then checks the store:

* fsck finds no damaged or lost iteration (an uncommitted tail or an interrupted gc are notes);
* the newest iteration the trainer was told is durable is present (gc never drops the newest);
* every iteration in the store is bit-exact against an uninterrupted reference run (read through
  ``Store.replay``, the newest acknowledged one through ``Store.load`` too), which also checks
  exact resumption: the state at iteration i is the same however many times the run was killed
  before it.

``--kills`` counts SIGKILLs: a trainer that reached its target before its kill moment is not one.
Usage: ``python tools/soak.py --kills 10000 --dir /tmp/soak`` (about 0.5 s per kill on 2 cores
with ``--max-delay 0.8``). Prints a summary line every 100 kills and exits non-zero at the first
failure, keeping the store.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sys
import time
from collections import Counter

HIDDEN = 256
BASE_EVERY = 16
GROUP_COMMIT = 4
GC_EVERY = 24
KEEP_LAST = 4
#: reference states kept (gc keeps the store within the last ~40 iterations)
WINDOW = 512


def _trainer():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(HIDDEN, 64))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _backward(model, it: int) -> None:
    import torch

    g = torch.Generator().manual_seed(it)
    x, y = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
    model.zero_grad()
    ((model(x) - y) ** 2).mean().backward()


def train(store_path: str, journal: str, until: int) -> None:
    """The victim: resume and train to ``until``, journaling what the store reports durable."""
    import ckptstore
    from ckptstore.torch import Checkpointer

    with open(journal, "a", buffering=1) as log, ckptstore.open(store_path, "a") as store:
        model, opt = _trainer()
        ckpt = Checkpointer(store, model, opt, policy="every-iteration", base_every=BASE_EVERY,
                            group_commit=GROUP_COMMIT,
                            fingerprint_every=0)
        first = ckpt.restore() + 1
        log.write(f"resumed {first - 1}\n")
        for it in range(first, until + 1):
            _backward(model, it)
            ckpt.step(it)
            if it % GC_EVERY == 0:
                ckpt.flush()
                store.gc(keep_last=KEEP_LAST)
            durable = store.durable_iteration()
            if durable is not None:
                log.write(f"durable {durable}\n")
        ckpt.close()
        log.write("done\n")


class Reference:
    """Model parameters of the uninterrupted run, computed on demand; the last WINDOW kept."""

    def __init__(self) -> None:
        self.model, self.opt = _trainer()
        self.states = {0: self._copy()}
        self.at = 0

    def _copy(self) -> dict:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def __getitem__(self, it: int) -> dict:
        while self.at < it:
            self.at += 1
            _backward(self.model, self.at)
            self.opt.step()
            self.states[self.at] = self._copy()
            self.states.pop(self.at - WINDOW, None)
        if it not in self.states:
            raise KeyError(f"iteration {it} is older than the reference window ({WINDOW})")
        return self.states[it]


def _zygote(conn_r: int, conn_w: int) -> None:
    """Imports torch once, then forks one trainer per request (pid back over the pipe)."""
    import torch

    import ckptstore  # noqa: F401 - imported once here, inherited by every trainer
    import ckptstore.torch  # noqa: F401

    torch.set_num_threads(1)
    # one warm-up step imports what the optimizer imports lazily (torch._dynamo, ~1.5 s): every
    # forked trainer inherits it instead of paying it before its first step
    model, opt = _trainer()
    _backward(model, 1)
    opt.step()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # trainers are reaped automatically
    with os.fdopen(conn_r, "r") as requests, os.fdopen(conn_w, "w", buffering=1) as replies:
        for line in requests:
            store_path, journal, until = line.rstrip("\n").split("\t")
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    train(store_path, journal, int(until))
                except BaseException as e:  # noqa: BLE001 - reported through the journal
                    with open(journal, "a") as log:
                        log.write(f"error {type(e).__name__}: {e}\n")
                    code = 3
                os._exit(code)
            replies.write(f"{pid}\n")
    os._exit(0)


def verify(store_path: str, present: list[int], acked: int, ref: Reference,
           stats: Counter) -> str | None:
    """Every iteration in the store against the uninterrupted run: each run of consecutive
    iterations through ``Store.replay`` (one chain walk, bases restarting it), and the newest
    acknowledged one, the one a restore starts from, through ``Store.load`` as well. Returns what
    differs, or None."""
    import torch

    import ckptstore

    def differs(it: int, got: dict) -> str | None:
        want = ref[it]
        bad = [k for k in want if not torch.equal(got[k], want[k])]
        return f"iteration {it} differs from the uninterrupted run in {bad}" if bad else None

    runs: list[list[int]] = []
    for it in present:
        if runs and runs[-1][1] == it - 1:
            runs[-1][1] = it
        else:
            runs.append([it, it])
    with ckptstore.open(store_path, "r") as r:
        for first, last in runs:
            for it, state in r.replay(first, last):
                bad = differs(it, state["model"])
                if bad:
                    return bad + " (replay)"
                stats["verified replays"] += 1
        if acked in present:
            bad = differs(acked, r.load(acked)["model"])
            if bad:
                return bad + " (load)"
            stats["verified loads"] += 1
    return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone (ESRCH: it went while being read)
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=1000)
    ap.add_argument("--dir", default="/tmp/ckptstore-soak")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-delay", type=float, default=1.5, help="seconds before the kill")
    args = ap.parse_args()

    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    if os.fork() == 0:
        os.close(req_w)
        os.close(rep_r)
        _zygote(req_r, rep_w)
    os.close(req_r)
    os.close(rep_w)
    requests, replies = os.fdopen(req_w, "w", buffering=1), os.fdopen(rep_r, "r")

    import torch

    import ckptstore
    from ckptstore.ops.fsck import check

    torch.set_num_threads(1)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    store_path = os.path.join(args.dir, "store")
    rng = random.Random(args.seed)
    ref = Reference()
    stats: Counter = Counter()
    acked = -1
    t0 = time.monotonic()
    verify_s = 0.0
    kill = 0
    while kill < args.kills:
        journal = os.path.join(args.dir, "journal")
        if os.path.exists(journal):
            os.unlink(journal)
        requests.write(f"{store_path}\t{journal}\t{acked + 1000}\n")
        pid = int(replies.readline())
        time.sleep(rng.uniform(0, args.max_delay))
        finished = not _alive(pid)
        if not finished:
            os.kill(pid, signal.SIGKILL)
            kill += 1
        while _alive(pid):
            time.sleep(0.001)
        lines = []
        if os.path.exists(journal):
            with open(journal) as f:
                lines = f.read().splitlines()
        errors = [ln for ln in lines if ln.startswith("error")]
        if errors:
            print(f"kill {kill}: the trainer failed: {errors[0]}", file=sys.stderr)
            return 1
        stats["finished before the kill" if finished else "killed"] += 1
        if not finished and not any(ln.startswith("resumed") for ln in lines):
            stats["killed before resuming"] += 1
        durable = [int(ln.split()[1]) for ln in lines if ln.startswith("durable")]
        acked = max([acked] + durable)
        where = f"kill {kill} (seed {args.seed}, store {store_path})"
        if not os.path.exists(os.path.join(store_path, "STORE")):
            if acked >= 0:
                print(f"{where}: the store is gone after iteration {acked} was durable",
                      file=sys.stderr)
                return 1
            continue
        t_check = time.monotonic()
        report = check(store_path)
        if report.damage or report.damaged_iterations or report.lost_iterations:
            print(f"{where}: fsck:\n" + "\n".join(report.lines()), file=sys.stderr)
            return 1
        present = report.iterations
        if acked >= 0 and acked not in present:
            print(f"{where}: iteration {acked} was reported durable but is not in the store "
                  f"({present[-5:]})", file=sys.stderr)
            return 1
        failure = verify(store_path, present, acked, ref, stats)
        if failure:
            print(f"{where}: {failure}", file=sys.stderr)
            return 1
        stats["acknowledged"] = acked
        verify_s += time.monotonic() - t_check
        if not finished and (kill % 100 == 0 or kill == args.kills):
            rate = kill / (time.monotonic() - t0)
            print(f"{kill} kills ({rate:.1f}/s, {verify_s / kill * 1000:.0f} ms/kill verifying): "
                  f"newest durable iteration {acked}, {len(present)} in the store, "
                  f"{dict(stats)}", flush=True)
    requests.close()
    print(f"soak: {args.kills} SIGKILLs, zero failures; {dict(stats)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
