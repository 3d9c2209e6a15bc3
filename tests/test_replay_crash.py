"""Crash-and-resume with the Checkpointer: a training process is SIGKILLed at a random point of
its record stream (mid delta, mid group commit, between groups, mid base); a new process reopens
the store, ``ckpt.restore()``s and finishes. The final parameters must be bit-identical to an
uninterrupted run, every recoverable iteration must load, and nothing reported durable before the
crash may be lost (format-spec/deltas.md, "Group commit" and "Recovery")."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import traceback

import pytest

N = 40
HERE = os.path.abspath(__file__)


def child(path: str, kill_at_append: int | str, durable_log: str, out: str) -> None:
    import torch

    kill_at_append = int(kill_at_append)
    import ckptstore
    from ckptstore.storage.log import Log
    from ckptstore.torch import Checkpointer

    torch.set_num_threads(1)
    if kill_at_append > 0:
        calls = [0]

        def killing(orig):
            def append(self, *a, **kw):
                calls[0] += 1
                if calls[0] == kill_at_append:
                    os.kill(os.getpid(), signal.SIGKILL)
                return orig(self, *a, **kw)
            return append

        # records, and the lent gradients' records (written from the gradients' own memory)
        Log.append, Log.append_image = killing(Log.append), killing(Log.append_image)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.1), torch.nn.GELU(),
                                torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.8)
    store = ckptstore.open(path)
    ck = Checkpointer(store, model, opt, sched, policy="every-iteration", base_every=9,
                      group_commit=3, fingerprint_every=4)
    start = ck.restore()
    for it in range(start + 1, N + 1):
        g = torch.Generator().manual_seed(it)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)  # dropout consumes the global RNG
        loss.backward()
        ck.step(it, meta={"loss": loss.item()})
        opt.zero_grad()
        with open(durable_log, "a") as f:
            f.write(f"{store.durable_iteration()}\n")
    store.close()
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, out)


def _run(args, check=True):
    env = dict(os.environ, PYTHONHASHSEED="0")
    p = subprocess.run([sys.executable, HERE, *map(str, args)], env=env, capture_output=True,
                       text=True, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"child failed rc={p.returncode}:\n{p.stderr[-3000:]}")
    return p


def serve() -> None:
    """Fork server: one JSON list of child() arguments per stdin line; answers the child's exit
    code (negative: killed by that signal) as one JSON number per line."""
    import torch

    import ckptstore.torch  # noqa: F401  (preloaded once, as every child needs it)

    torch.set_num_threads(1)
    torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())  # imports torch._dynamo once, here
    for line in sys.stdin:
        args = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                child(*args)
            except BaseException:  # noqa: BLE001 - reported through the exit code and stderr
                traceback.print_exc()
                code = 3
            finally:
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)


class ForkServer:
    def __init__(self, workdir) -> None:
        self.stderr_path = workdir / "forkserver.stderr"
        self._err = open(self.stderr_path, "w")
        self.proc = subprocess.Popen([sys.executable, HERE, "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, text=True,
                                     env=dict(os.environ, PYTHONHASHSEED="0"))

    def run(self, args, check=True) -> int:
        self.proc.stdin.write(json.dumps([str(a) for a in args]) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"fork server died:\n{self.stderr_tail()}")
        code = json.loads(line)
        if check and code != 0:
            raise AssertionError(f"child failed rc={code}:\n{self.stderr_tail()}")
        return code

    def stderr_tail(self) -> str:
        self._err.flush()
        return open(self.stderr_path).read()[-3000:]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self._err.close()


@pytest.fixture(scope="module")
def forkserver(tmp_path_factory):
    server = ForkServer(tmp_path_factory.mktemp("replay-forkserver"))
    yield server
    server.close()


def _same_params(a, b):
    import torch

    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k].view(torch.uint8) if a[k].dtype == torch.bool else a[k], b[k]) and \
            a[k].contiguous().view(-1).view(torch.uint8).tolist() == \
            b[k].contiguous().view(-1).view(torch.uint8).tolist(), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    import torch

    d = tmp_path_factory.mktemp("ref")
    _run([d / "s", 0, d / "durable", d / "final.pt"])
    return torch.load(d / "final.pt"), d


@pytest.mark.slow
def test_sigkill_anywhere_then_resume_is_bit_identical(tmp_path, reference, forkserver, assert_same):
    import torch

    import ckptstore

    ref_final, ref_dir = reference
    trials = max(20, int(os.environ.get("CKPTSTORE_TRIALS", "20")) // 2)
    rnd = random.Random(1234)
    with ckptstore.open(ref_dir / "s", "r") as r:
        n_records = sum(1 for _ in r.iterations()) * 3  # rough upper bound of appends per iteration
    for trial in range(trials):
        d = tmp_path / f"t{trial}"
        d.mkdir()
        kill = rnd.randint(1, max(2, n_records))
        code = forkserver.run([d / "s", kill, d / "durable", d / "final.pt"], check=False)
        if code == 0:
            assert torch.load(d / "final.pt").keys() == ref_final.keys()
            continue  # the kill point was past the end of this run
        assert code == -signal.SIGKILL, forkserver.stderr_tail()
        reported = [int(x) for x in open(d / "durable").read().split() if x != "None"] \
            if os.path.exists(d / "durable") else []
        with ckptstore.open(d / "s", "r") as r:
            its = r.iterations()
            assert its == list(range(len(its))), f"trial {trial}: recoverable iterations {its}"
            if reported:
                assert its[-1] >= max(reported), "an iteration reported durable was lost"
            ref = ckptstore.open(ref_dir / "s", "r")
            try:
                for t in ({its[-1], its[len(its) // 2]} if its else ()):
                    a, b = ref.load(t), r.load(t)
                    assert_same(a["model"], b["model"], f"trial {trial} iteration {t}")
                    assert_same(a["optimizer"], b["optimizer"], f"trial {trial} iteration {t}")
            finally:
                ref.close()
        forkserver.run([d / "s", 0, d / "durable2", d / "final.pt"])
        _same_params(ref_final, torch.load(d / "final.pt"))
        from ckptstore.ops.fsck import check

        assert check(d / "s").clean


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        child(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
