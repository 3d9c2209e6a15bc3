"""bisect (ckptstore/ops/bisect.py): the first iteration where a condition holds, found by a
binary search over base snapshots and one replay of the base interval where it flips; meta
conditions by manifests alone; the CLI; every bad input as a typed error."""

from __future__ import annotations

import random
import textwrap

import pytest
import torch

import ckptstore
from ckptstore import BisectError, BisectPredicateError, CkptStoreError, DeltaChainError
from ckptstore.cli import main
from ckptstore.ops.bisect import parse_condition
from ckptstore.torch import Checkpointer

from _ranks import needs_gloo

N = 40
BASE_EVERY = 5
BASES = list(range(0, N + 1, BASE_EVERY))
#: what bisect may load for a state condition over N iterations with a base every BASE_EVERY:
#: a binary search over the bases, then the base one replay starts from
MAX_LOADED = (len(BASES) + 1).bit_length() + 1
MOD = __name__


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add handoffs on a busy machine
    yield
    torch.set_num_threads(threads)


def build(opt_name: str = "Adam"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2) if opt_name == "Adam" \
        else torch.optim.SGD(model.parameters(), lr=0.05)
    return model, opt


def batch(it: int):
    g = torch.Generator().manual_seed(1000 + it)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def train(path, *, inject=None, opt_name: str = "Adam", n: int = N, loss_jump: int | None = None):
    """Train ``n`` iterations through an asynchronous exact Checkpointer (a base every
    BASE_EVERY). ``inject``: (iteration, parameter name, flat index, value) written into that
    parameter's gradient after backward. Meta: the loss (plus 100 from ``loss_jump`` on), the
    step, and a nested dict."""
    model, opt = build(opt_name)
    with ckptstore.open(path, "a") as store:
        ck = Checkpointer(store, model, opt, base_every=BASE_EVERY, codec="exact",
                          policy="every-iteration")
        ck.restore()
        params = dict(model.named_parameters())
        for it in range(1, n + 1):
            x, y = batch(it)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if inject is not None and it == inject[0]:
                with torch.no_grad():
                    params[inject[1]].grad.view(-1)[inject[2]] = inject[3]
            value = loss.item() + (100.0 if loss_jump is not None and it >= loss_jump else 0.0)
            ck.step(it, meta={"loss": value, "step": it, "train": {"loss": value}})
            opt.zero_grad()
        ck.close()


def pick(seed: int, where: str):
    """A seeded injection: (iteration, parameter, flat index); ``where``: on a base iteration, or
    on a delta (then somewhere inside a base interval)."""
    rng = random.Random(seed)
    if where == "base":
        it = BASE_EVERY * rng.randint(1, N // BASE_EVERY)
    else:
        it = BASE_EVERY * rng.randint(0, N // BASE_EVERY - 1) + rng.randint(1, BASE_EVERY - 1)
    model, _ = build()
    name, p = rng.choice(list(model.named_parameters()))
    return it, name, rng.randrange(p.numel())


# ---- nan / inf -----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed,where", [(1, "delta"), (2, "delta"), (3, "base")])
def test_nan_is_found_at_the_iteration_it_entered_naming_the_tensor(tmp_path, seed, where):
    it, name, idx = pick(seed, where)
    path = tmp_path / "run"
    train(path, inject=(it, name, idx, float("nan")))
    with ckptstore.open(path, "r") as store:
        assert store.iterations() == list(range(N + 1))
        assert [i for i in store.iterations() if store.kind(i) == "snapshot"] == BASES
        r = store.bisect("nan")
    assert r.iteration == it and r.found and r.condition == "nan" and (r.start, r.end) == (0, N)
    by_path = {t.path: t for t in r.tensors}
    # the parameter and Adam's two moments of it, at exactly the injected element; nothing else
    pindex = [n for n, _ in build()[0].named_parameters()].index(name)
    assert set(by_path) == {f"model.{name}", f"optimizer.state.{pindex}.exp_avg",
                            f"optimizer.state.{pindex}.exp_avg_sq"}, by_path
    for t in by_path.values():
        assert (t.nan, t.inf, t.indices) == (1, 0, (idx,)), t
    # far fewer states than a linear scan (N + 1): a handful of bases and one interval's deltas
    assert r.loaded <= MAX_LOADED and r.replayed <= BASE_EVERY - 1, r
    assert r.loaded + r.replayed <= 10 and r.meta_reads == 0
    if where == "base":
        assert r.replayed < BASE_EVERY and (r.interval is None or r.interval[1] == it - 1)
    else:
        assert r.interval is not None and r.interval[0] <= it <= r.interval[1]
        assert r.interval[1] - r.interval[0] == BASE_EVERY - 2  # strictly between two bases
    assert r.seconds > 0


def test_inf_is_found_and_reported_with_its_elements(tmp_path):
    it, name, idx = pick(7, "delta")
    path = tmp_path / "run"
    train(path, inject=(it, name, idx, float("inf")), opt_name="SGD")
    with ckptstore.open(path, "r") as store:
        r = store.bisect("inf")
        # "nan" does not hold where the infinity entered (SGD: w - lr * inf = -inf)
        assert store.bisect("nan", start=it, end=it).iteration is None
        # ranges: a start after the injection finds the start; an end before it finds nothing
        assert store.bisect("inf", start=it + 2).iteration == it + 2
        before = store.bisect("inf", end=it - 1)
    assert r.iteration == it
    assert [(t.path, t.nan, t.inf, t.indices) for t in r.tensors] == [(f"model.{name}", 0, 1, (idx,))]
    assert r.loaded <= MAX_LOADED and r.replayed <= BASE_EVERY - 1
    assert before.iteration is None and before.tensors == () and before.end == it - 1


def test_snapshot_only_stores_need_no_replay(tmp_path):
    """A store of plain saves (every iteration a base): the search loads only the bases it probes."""
    with ckptstore.open(tmp_path / "s", "a") as store:
        for i in range(16):
            w = torch.arange(12, dtype=torch.float32).reshape(3, 4) + i
            if i >= 11:
                w[1, 2] = float("nan")
            store.save(i, {"net": {"w": w, "steps": torch.tensor([i])}, "opt": [torch.zeros(3, dtype=torch.float64)]})
        r = store.bisect("nan")
    assert r.iteration == 11 and r.replayed == 0 and r.loaded <= 5 and r.interval is None
    assert [(t.path, t.indices) for t in r.tensors] == [("net.w", (6,))]


def test_every_floating_dtype_and_numpy_arrays_are_scanned(tmp_path):
    bad = torch.tensor([0.0, float("nan"), float("inf"), 1.0])
    with ckptstore.open(tmp_path / "s", "a") as store:
        store.save(0, {"x": torch.zeros(4), "ints": torch.arange(4)})
        store.save(1, {"bf16": bad.bfloat16(), "f8": bad.to(torch.float8_e5m2),
                       "c64": torch.complex(torch.zeros(4), bad), "np": [bad.numpy().astype(">f8")],
                       "ints": torch.arange(4), "fine": torch.ones(3, dtype=torch.float16)})
        r_inf, r_nan = store.bisect("inf"), store.bisect("nan")
    assert [(t.path, t.nan, t.inf, t.indices) for t in r_inf.tensors] == [
        (p, 1, 1, (1, 2)) for p in ("bf16", "f8", "c64", "np.0")]
    assert r_inf.iteration == r_nan.iteration == 1
    assert [t.indices for t in r_nan.tensors] == [(1,)] * 4


# ---- meta conditions -------------------------------------------------------------------------------
def test_meta_condition_reads_manifests_only(tmp_path, monkeypatch):
    path = tmp_path / "run"
    train(path, loss_jump=23)
    with ckptstore.open(path, "a") as store:  # the writer can bisect too
        def no_tensors(*a, **k):
            raise AssertionError("a meta condition loaded a state")

        monkeypatch.setattr(store, "load", no_tensors)
        monkeypatch.setattr(store, "replay", no_tensors)
        r = store.bisect("loss > 10")
        assert (r.iteration, r.loaded, r.replayed) == (23, 0, 0) and r.value > 100
        assert r.meta_reads <= 8, r  # a binary search over 41 iterations, not a scan
        assert store.bisect("train.loss>=100").iteration == 23  # a dotted key reaches nested meta
        assert store.bisect(" loss  <  -1 ").iteration is None
        assert store.bisect("step >= 17").iteration == 17
        # == is monotone only for a flag: over a counter it finds a hit only on the search's path
        assert store.bisect("step == 20").iteration == 20  # (the first probe)
        assert store.bisect("step != 0").iteration == 1
        assert store.bisect("step >= 1e1", start=3, end=30).iteration == 10
        assert store.bisect("step > 35", end=30).iteration is None
        # iteration 0 (the base restore() wrote) has no meta: skipped, never reported
        r0 = store.bisect("step >= 0")
        assert r0.iteration == 1 and r0.value == 1


def test_meta_key_missing_everywhere_or_not_a_number(tmp_path):
    with ckptstore.open(tmp_path / "s", "a") as store:
        for i in range(6):
            store.save(i, {"w": torch.zeros(2)}, meta={"tag": f"t{i}", "loss": float(i), "ok": i > 2})
        with pytest.raises(BisectError, match=r"meta key 'lss'.*iteration \d+ has loss, ok, tag"):
            store.bisect("lss > 1")
        with pytest.raises(BisectPredicateError, match=r"'tag' at iteration \d+ is 't\d' \(str\)") as e:
            store.bisect("tag > 1")
        assert e.value.iteration in range(6)
        assert store.bisect("ok == 1").iteration == 3  # a bool compares as 0 / 1
        assert store.bisect("loss >= 4").value == 4.0


# ---- functions of the state ------------------------------------------------------------------------
def first_layer_has_nan(state) -> bool:
    return bool(torch.isnan(state["model"]["0.weight"]).any())


def broken_check(state) -> bool:
    raise RuntimeError("kaboom")


def test_function_conditions_by_import_path_and_callable(tmp_path, monkeypatch):
    it = pick(11, "delta")[0]
    path = tmp_path / "run"
    train(path, inject=(it, "0.weight", 3, float("nan")))
    mod_dir = tmp_path / "mods"
    mod_dir.mkdir()
    (mod_dir / "bisect_checks_tmp.py").write_text(textwrap.dedent("""
        import torch

        class Checks:
            @staticmethod
            def big_step(state):
                return state["iteration"] >= 29
    """))
    monkeypatch.syspath_prepend(str(mod_dir))
    with ckptstore.open(path, "r") as store:
        r = store.bisect(f"{MOD}:first_layer_has_nan")
        assert r.iteration == it and r.tensors == () and r.condition == f"{MOD}:first_layer_has_nan"
        assert r.loaded <= MAX_LOADED and r.replayed <= BASE_EVERY - 1
        assert store.bisect("bisect_checks_tmp:Checks.big_step").iteration == 29
        lam = store.bisect(lambda s: s["iteration"] > 12, start=3)
        assert lam.iteration == 13 and "lambda" in lam.condition
        # a function that raises: wrapped, naming the iteration (the middle base is probed first)
        with pytest.raises(BisectPredicateError, match=r"raised at iteration 20: RuntimeError: kaboom") as e:
            store.bisect(f"{MOD}:broken_check")
        assert e.value.iteration == 20 and isinstance(e.value.__cause__, RuntimeError)
        assert isinstance(e.value, CkptStoreError)


# ---- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,match", [
    ("loss >> 10", "malformed"), ("loss > ten", "'ten' is not a number"), ("loss >", "malformed"),
    ("> 3", "malformed"), ("loss == nan", "nothing compares with NaN"), ("nan nan", "malformed"),
    ("divergence", "malformed"), ("__import__('os').system('true')", "malformed"),
    ("1 + 1 == 2", "malformed"), ("", "malformed"), ("os:", "malformed"),
    ("no_such_module_for_bisect:f", "cannot import module 'no_such_module_for_bisect'"),
    ("ckptstore:no_such_function", "has no attribute 'no_such_function'"),
    ("ckptstore:__version__", "is a str, not a function"),
])
def test_malformed_conditions_are_refused_before_anything_is_read(tmp_path, spec, match):
    with ckptstore.open(tmp_path / "s", "a") as store:
        store.save(0, {"w": torch.zeros(2)}, meta={"loss": 1.0})
        with pytest.raises(BisectError, match=match) as e:
            store.bisect(spec)
        assert isinstance(e.value, ValueError) and isinstance(e.value, CkptStoreError)
    with pytest.raises(BisectError, match="a string .* or a callable"):
        parse_condition(42)  # type: ignore[arg-type]


def test_bad_ranges(tmp_path):
    with ckptstore.open(tmp_path / "s", "a") as store:
        with pytest.raises(BisectError, match="holds no committed iteration$"):
            store.bisect("nan")
        for i in (3, 4, 9):
            store.save(i, {"w": torch.zeros(2)})
        with pytest.raises(BisectError, match=r"no committed iteration in 5\.\.8 \(its iterations run 3\.\.9\)"):
            store.bisect("nan", start=5, end=8)
        with pytest.raises(BisectError, match="start 9 is after end 4"):
            store.bisect("nan", start=9, end=4)
        with pytest.raises(BisectError, match="start must be an int"):
            store.bisect("nan", start="3")  # type: ignore[arg-type]
        assert store.bisect("nan", start=5).iteration is None  # 9 alone


def test_deltas_that_cannot_be_replayed_where_a_state_is_needed(tmp_path):
    """Deltas not written by a Checkpointer: a state condition needs them replayed and gets the
    store's own DeltaChainError naming the base; a meta condition needs no state and works."""
    with ckptstore.open(tmp_path / "s", "a") as store:
        store.save(0, {"w": torch.zeros(2)}, meta={"step": 0})
        for i in range(1, 4):
            store.save_delta(i, {"g": torch.ones(2)}, meta={"step": i})
        with pytest.raises(DeltaChainError, match="base snapshot 0 .*not written by a Checkpointer"):
            store.bisect("nan")
        assert store.bisect("step >= 2").iteration == 2


# ---- command line --------------------------------------------------------------------------------------
def test_cli_end_to_end(tmp_path, capsys, monkeypatch):
    it, name, idx = pick(5, "delta")
    path = str(tmp_path / "run")
    train(path, inject=(it, name, idx, float("nan")))

    assert main(["bisect", path, "--until", "nan"]) == 0
    out = capsys.readouterr().out
    assert f"nan: first holds at iteration {it} (searched 0..{N};" in out
    assert "states loaded" in out and "replayed" in out
    header, rule, *rows = out.splitlines()[1:]
    assert set(rule) == {"─"}
    assert header.split() == ["tensor", "nan", "inf", "elements", "first", "indices"]
    assert rows[0].split()[:3] == [f"model.{name}", "1", "0"] and rows[0].split()[-1] == str(idx)

    # (the loss is NaN from the injection on: a NaN compares false, only "nan" finds it)
    assert main(["bisect", path, "--until", "step>30", "--start", "5"]) == 0
    out = capsys.readouterr().out
    assert "step > 30: first holds at iteration 31 (searched 5..40;" in out and "meta reads" in out
    assert "step = 31 at iteration 31" in out

    assert main(["bisect", path, "--until", "inf", "--end", str(it - 1)]) == 1
    assert f"inf: never holds in 0..{it - 1}" in capsys.readouterr().out

    # a module of the working directory
    (tmp_path / "cwd_checks_for_bisect.py").write_text(
        "def late(state):\n    return state['iteration'] >= 33\n")
    monkeypatch.chdir(tmp_path)
    assert main(["bisect", path, "--until", "cwd_checks_for_bisect:late"]) == 0
    assert "first holds at iteration 33" in capsys.readouterr().out

    # bad usage: 2; errors: 1, the message on stderr
    for argv, code, err in [
        (["--until", "loss >> 3"], 2, "malformed bisect condition"),
        (["--until", "not_a_module_xyz:f"], 2, "cannot import module 'not_a_module_xyz'"),
        (["--until", "nan", "--start", "9", "--end", "3"], 2, "--start 9 is after --end 3"),
        (["--until", "nan", "--start", "100"], 1, "no committed iteration at or after 100 "),
        (["--until", f"{MOD}:broken_check"], 1, "raised at iteration 20"),
    ]:
        assert main(["bisect", path, *argv]) == code, argv
        cap = capsys.readouterr()
        assert err in cap.err and cap.out == "", (argv, cap)
    with pytest.raises(SystemExit) as e:
        main(["bisect", path])  # --until is required
    assert e.value.code == 2
    assert main(["bisect", str(tmp_path / "nowhere"), "--until", "nan"]) == 1
    assert "error" in capsys.readouterr().err


def test_cli_escapes_what_the_store_names(tmp_path, capsys):
    with ckptstore.open(tmp_path / "s", "a") as store:
        for i in range(3):
            store.save(i, {"evil\x1b]0;pwned\x07": torch.tensor([float("nan") if i == 2 else 0.0])})
    assert main(["bisect", str(tmp_path / "s"), "--until", "nan"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\x1b]0;pwned\\x07" in out


# ---- job (multi-rank) stores ---------------------------------------------------------------------------
def job_train(rank, world, path, inject, n):
    """A data-parallel job without DDP (every rank sees the same data, so every rank's model is
    the same): a partitioned Checkpointer on the job store, a NaN injected on every rank."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model, opt = build()
    params = dict(model.named_parameters())
    store = ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=60.0)
    ck = Checkpointer(store, model, opt, base_every=BASE_EVERY, codec="exact", group_commit=4,
                      policy="every-iteration")
    ck.restore()
    for it in range(1, n + 1):
        x, y = batch(it)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if it == inject[0]:
            with torch.no_grad():
                params[inject[1]].grad.view(-1)[inject[2]] = float("nan")
        ck.step(it, meta={"step": it, "rank": rank})
        opt.zero_grad()
    ck.close()
    store.close()
    return rank


@needs_gloo
def test_job_store(tmp_path, capsys):
    from _ranks import run_ranks

    n, it = 20, 13
    path = str(tmp_path / "job")
    res = run_ranks(2, MOD, "job_train", path, str(tmp_path / "w"), deadline=180,
                    inject=[it, "2.weight", 4], n=n)
    assert [r.get("ok") for r in res] == [0, 1], res
    with ckptstore.open(path, "r") as job:
        assert isinstance(job, ckptstore.JobStore) and job.world_size == 2
        r = job.bisect("nan")  # merged states of both ranks' parts
        assert r.iteration == it and "model.2.weight" in {t.path for t in r.tensors}
        # bases by binary search, then one replay of both ranks' parts in step over the interval
        assert r.loaded <= 5 and 0 < r.replayed <= 4 and r.interval == (11, 14), r
        assert job.bisect("step >= 17").iteration == 17  # rank 0's meta
        assert job.bisect("rank == 1", rank=1).iteration == 1  # rank 1's (0: no meta)
        assert job.bisect("rank == 1").iteration is None
    assert main(["bisect", path, "--until", "nan"]) == 0
    assert f"first holds at iteration {it}" in capsys.readouterr().out
