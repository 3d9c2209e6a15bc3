"""ckptstore.interop and ``ckptstore import`` / ``ckptstore restore --format``: checkpoints of other
tools (torch.save files, safetensors files, DCP directories of the pinned torch, Hugging Face
Trainer checkpoint-N directories built by hand) import bit-exact; a directory of them imports in
iteration order with dedup; every export format re-imports bit-exact; every bad input raises a
typed error and leaves the store as it was (same iterations, same segment bytes, fsck clean)."""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import ckptstore
from ckptstore.cli import main as cli
from ckptstore.errors import (ExportError, ImportSkippedWarning, ImportSourceError,
                              IterationOrderError)
from ckptstore.interop import (export_checkpoint, flat_tensors, import_checkpoint, import_dir,
                               load_source, write_state)
from ckptstore.ops.fsck import check as fsck

sys.path.insert(0, str(Path(__file__).parent))
from _hostile import _Boom, boom_torch_file  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore:torch.distributed is unavailable:UserWarning")

KIB = 1 << 10


# ---- helpers --------------------------------------------------------------------------------------

def _quiet_dcp_save(state, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def _dcp_reference(path, tmp_path):
    """What DCP itself makes of a DCP directory (its own dcp_to_torch_save)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "dcp_reference.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=True)


def _trained():
    """A small model, an AdamW that took a step and a scheduler: real state dicts."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    model(torch.randn(5, 8)).pow(2).sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def _rich_state():
    """Every kind of value a torch.save file of a training state holds."""
    model, opt, sched = _trained()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
            "param": torch.nn.Parameter(torch.arange(6, dtype=torch.float32)),
            "bf16": torch.randn(3, 5).to(torch.bfloat16), "i64": torch.arange(7),
            "flags": torch.tensor([True, False]), "c64": torch.randn(2, dtype=torch.complex64),
            "scalar": torch.tensor(3.5), 7: ("int key", 1, 2.5, None), "nan": float("nan"),
            "blob": b"\x00\x01", "nested": [[1, 2], {"x": -0.0}]}


def _flat_equal(expected, got, values: bool = True) -> None:
    """Same tensors (names a/b/c, dtype, shape, bits) and (``values``) same other values, once
    both are flattened as the safetensors export flattens them."""
    te, oe = flat_tensors(expected)
    tg, og = flat_tensors(got)
    assert sorted(te) == sorted(tg), (sorted(te), sorted(tg))
    for k in te:
        a, b = te[k], tg[k]
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert a.contiguous().reshape(-1).view(torch.uint8).equal(
            b.contiguous().reshape(-1).view(torch.uint8)), k
    if values:
        assert json.dumps(oe, sort_keys=True) == json.dumps(og, sort_keys=True)


def _hf_checkpoint(root: Path, step: int, model_sd: dict, *, layout: str = "safetensors",
                   rng: str = "torch", optimizer=None, scheduler=None, marker: Path | None = None,
                   loss: float = 2.5) -> Path:
    """A Hugging Face Trainer checkpoint-N directory, by hand: model file(s), optimizer.pt,
    scheduler.pt, rng_state.pth, trainer_state.json, config.json, training_args.bin (a pickle
    that must never be loaded) and a tokenizer file."""
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    if layout == "safetensors":
        save_file(model_sd, d / "model.safetensors", metadata={"format": "pt"})
    elif layout == "sharded":
        names = list(model_sd)
        half = len(names) // 2
        shards = {"model-00001-of-00002.safetensors": names[:half],
                  "model-00002-of-00002.safetensors": names[half:]}
        for f, ns in shards.items():
            save_file({n: model_sd[n] for n in ns}, d / f, metadata={"format": "pt"})
        index = {"metadata": {"total_size": sum(t.nbytes for t in model_sd.values())},
                 "weight_map": {n: f for f, ns in shards.items() for n in ns}}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    elif layout == "bin":
        torch.save(model_sd, d / "pytorch_model.bin")
    elif layout != "none":
        raise AssertionError(layout)
    if optimizer is not None:
        torch.save(optimizer, d / "optimizer.pt")
    if scheduler is not None:
        torch.save(scheduler, d / "scheduler.pt")
    if rng == "torch":
        torch.save({"python": random.getstate(), "cpu": torch.get_rng_state()}, d / "rng_state.pth")
    elif rng == "numpy":  # what the Trainer writes: numpy's state needs more than weights_only
        torch.save({"python": random.getstate(), "numpy": np.random.get_state(),
                    "cpu": torch.get_rng_state()}, d / "rng_state.pth")
    (d / "trainer_state.json").write_text(json.dumps({
        "global_step": step, "epoch": step / 100, "best_metric": None,
        "log_history": [{"loss": loss + 1, "learning_rate": 1e-3, "step": step - 1},
                        {"loss": loss, "learning_rate": 5e-4, "step": step}]}))
    (d / "config.json").write_text(json.dumps({"model_type": "toy", "hidden": [8, 16, 4],
                                               "tie_word_embeddings": False}))
    (d / "training_args.bin").write_bytes(boom_torch_file(str(marker or root / "PWNED")))
    (d / "tokenizer.json").write_text("{}")
    return d


def _store_with_two(path: Path) -> None:
    with ckptstore.open(path, "a") as s:
        s.save(1, {"w": torch.arange(4096, dtype=torch.float32)}, meta={"loss": 1.0})
        s.save(2, {"w": torch.arange(4096, dtype=torch.float32) * 2}, meta={"loss": 0.5})


def _fingerprint(path: Path):
    """Iterations and every segment's size: what must not change when an import fails."""
    with ckptstore.open(path, "r") as r:
        its = r.iterations()
    segs = {p.name: p.stat().st_size for p in sorted((path / "segments").iterdir())}
    return its, segs


# ---- each source kind imports bit-exact ----------------------------------------------------------

def test_torch_file_imports_bit_exact(tmp_path, assert_same):
    state = _rich_state()
    src = tmp_path / "step_40.pt"
    torch.save(state, src)
    with ckptstore.open(tmp_path / "store", "a") as s:
        r = import_checkpoint(s, None, src)  # the iteration from the name
        assert (r.iteration, r.kind) == (40, "torch")
        assert_same(torch.load(src, weights_only=True), s.load(40))
        assert s.meta(40) == {"import": {"kind": "torch", "path": str(src)}}
        assert r.stats.logical_bytes == s.info(40).logical_bytes > 0
    with ckptstore.open(tmp_path / "store", "r") as rd:  # and through a fresh reader
        loaded = rd.load(40)
        assert_same(torch.load(src, weights_only=True), loaded)
        assert type(loaded["param"]) is torch.nn.Parameter and hasattr(loaded["model"], "_metadata")


def test_safetensors_file_imports_bit_exact_with_its_metadata(tmp_path, assert_same):
    tensors = {"emb.weight": torch.randn(50, 8), "h.0.attn": torch.randn(8, 8).to(torch.bfloat16),
               "h.0.ids": torch.arange(10, dtype=torch.int32), "h.0.f16": torch.randn(3).half(),
               "mask": torch.tensor([True, False, True])}
    src = tmp_path / "model.safetensors"
    save_file(tensors, src, metadata={"format": "pt", "note": "from elsewhere"})
    with ckptstore.open(tmp_path / "store", "a") as s:
        r = import_checkpoint(s, 3, src, meta={"loss": 1.25})
        assert r.kind == "safetensors"
        assert_same(load_file(src), s.load(3))
        assert s.meta(3) == {"loss": 1.25, "import": {
            "kind": "safetensors", "path": str(src),
            "metadata": {"format": "pt", "note": "from elsewhere"}}}


def test_dcp_directory_imports_as_dcp_reads_it(tmp_path, assert_same):
    model, opt, sched = _trained()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
             "list": [torch.ones(3), torch.zeros(2, 2)], "step": 17, "blob": b"xy", 5: "five"}
    src = tmp_path / "dcp_17"
    _quiet_dcp_save(state, src)
    with ckptstore.open(tmp_path / "store", "a") as s:
        r = import_checkpoint(s, None, src)
        assert (r.iteration, r.kind) == (17, "dcp")
        got = s.load(17)
    # exactly what DCP's own single-process reader makes of it (keys as DCP saved them)
    assert_same(_dcp_reference(src, tmp_path), got)
    # and every tensor and value is the one saved
    _flat_equal(state, got)
    assert got["optim"]["state"]["0"]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])


@pytest.mark.parametrize("layout", ["safetensors", "sharded", "bin"])
def test_hf_trainer_checkpoint_imports_bit_exact(tmp_path, assert_same, layout):
    model, opt, sched = _trained()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    marker = tmp_path / "PWNED"
    d = _hf_checkpoint(tmp_path / "run", 500, sd, layout=layout, optimizer=opt.state_dict(),
                       scheduler=sched.state_dict(), marker=marker)
    with ckptstore.open(tmp_path / "store", "a") as s:
        r = import_checkpoint(s, None, d)
        assert (r.iteration, r.kind) == (500, "hf")  # ITER defaults to N
        got = s.load(500)
        meta = s.meta(500)
    assert list(got) == ["model", "optimizer", "scheduler", "rng_state", "trainer_state", "config"]
    assert_same(dict(sorted(sd.items())), dict(sorted(got["model"].items())))
    assert_same(torch.load(d / "optimizer.pt", weights_only=True), got["optimizer"])
    assert_same(torch.load(d / "scheduler.pt", weights_only=True), got["scheduler"])
    assert_same(torch.load(d / "rng_state.pth", weights_only=True), got["rng_state"])
    assert got["trainer_state"] == json.loads((d / "trainer_state.json").read_text())
    assert got["config"] == json.loads((d / "config.json").read_text())
    imp = meta["import"]
    assert imp["kind"] == "hf" and imp["global_step"] == 500 and imp["epoch"] == 5.0
    assert imp["log"] == {"loss": 2.5, "learning_rate": 5e-4}
    if layout == "safetensors":
        assert imp["metadata"] == {"model.safetensors": {"format": "pt"}}
    elif layout == "sharded":
        assert sorted(imp["metadata"]) == ["model-00001-of-00002.safetensors",
                                           "model-00002-of-00002.safetensors"]
    skipped = dict(r.skipped)
    assert "never unpickled" in skipped["training_args.bin"] and "tokenizer.json" in skipped
    assert not marker.exists()  # training_args.bin was never loaded


def test_hf_rng_state_that_needs_pickle_is_skipped_with_a_warning(tmp_path):
    model, opt, _ = _trained()
    d = _hf_checkpoint(tmp_path, 30, dict(model.state_dict()), rng="numpy",
                       optimizer=opt.state_dict())
    with ckptstore.open(tmp_path / "store", "a") as s:
        with pytest.warns(ImportSkippedWarning, match=r"rng_state\.pth.*weights_only") as w:
            r = import_checkpoint(s, None, d)
        assert str(d / "rng_state.pth") in str(w[0].message)
        assert "rng_state" not in s.load(30)
        assert "numpy" in dict(r.skipped)["rng_state.pth"]
        assert ["rng_state.pth", dict(r.skipped)["rng_state.pth"]] in s.meta(30)["import"]["skipped"]


# ---- a directory of checkpoints: iteration order and dedup ----------------------------------------

def _model_versions(n: int):
    """n versions of a 1 MiB model (four 256 KiB tensors) in which only "a" changes."""
    g = torch.Generator().manual_seed(1)
    base = {k: torch.randn(64 * KIB, generator=g) for k in "abcd"}
    out = []
    for i in range(n):
        v = dict(base)
        v["a"] = torch.randn(64 * KIB, generator=g)
        out.append(v)
    return out


def test_import_dir_in_iteration_order_with_dedup(tmp_path):
    v = _model_versions(5)
    src = tmp_path / "run"
    src.mkdir()
    _hf_checkpoint(src, 9, v[0], rng="none")                         # checkpoint-9/   (hf)
    torch.save({"model": v[1]}, src / "step_10.pt")                   # torch
    save_file(v[2], src / "iter_100.safetensors")                     # safetensors
    _quiet_dcp_save({"model": v[3]}, src / "dcp_1000")                # DCP directory
    torch.save({"model": v[4]}, src / "step_2000.pt")
    (src / "notes-3.txt").write_text("not a checkpoint")
    torch.save({"model": v[0]}, src / "final.pt")                     # no number: left out
    (src / ".hidden_5.pt").write_bytes(b"")                           # hidden: ignored
    seen = []
    with ckptstore.open(tmp_path / "store", "a") as s:
        rep = import_dir(s, src, meta={"run": "old"}, on_import=lambda r: seen.append(r.iteration))
        assert s.iterations() == [9, 10, 100, 1000, 2000] == seen  # numbers, not names, order
        assert [r.kind for r in rep.imported] == ["hf", "torch", "safetensors", "dcp", "torch"]
        assert s.meta(100)["run"] == "old"
        for it, want in zip([10, 100, 2000], [v[1], v[2], v[4]]):
            got = s.load(it)
            got = got.get("model", got)
            assert all(got[k].equal(want[k]) for k in "abcd")
        assert s.load(1000)["model"]["a"].equal(v[3]["a"])
        infos = [s.info(it) for it in s.iterations()]
    assert dict(rep.skipped) == {"notes-3.txt": "not a recognised checkpoint",
                                 "final.pt": "a torch checkpoint without an iteration number in "
                                             "its name"}
    full, tensor = 4 * 256 * KIB, 256 * KIB
    # the first import writes the whole model, each later one only the tensor that changed
    assert rep.logical_bytes == sum(i.logical_bytes for i in infos) >= 5 * full
    assert abs(rep.written_bytes - sum(i.written_bytes for i in infos)) < 8 * KIB
    assert full + 4 * tensor <= rep.written_bytes < full + 4 * tensor + 64 * KIB
    assert rep.dedup_bytes >= 4 * 3 * tensor
    assert rep.saved_bytes == rep.logical_bytes - rep.written_bytes > 4 * 3 * tensor - 64 * KIB
    assert fsck(tmp_path / "store").clean


# ---- export: every format re-imports bit-exact ---------------------------------------------------

@pytest.fixture
def delta_store(tmp_path):
    """A store whose latest iteration is a delta (reconstructed by store.load on export)."""
    from ckptstore.torch import Checkpointer

    model, opt, _ = _trained()
    path = tmp_path / "trained"
    with ckptstore.open(path, "a") as s:
        ck = Checkpointer(s, model, opt, policy="every-iteration", base_every=50,
                          asynchronous=False)
        ck.restore()
        for it in range(1, 4):
            model(torch.randn(4, 8)).sum().backward()
            ck.step(it)
            opt.zero_grad()
        s.flush()
        assert s.kind(3) == "delta"
    return path


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "dcp"])
def test_export_then_reimport_round_trips(tmp_path, delta_store, assert_same, fmt):
    out = tmp_path / f"export.{fmt}"
    with ckptstore.open(delta_store, "r") as s:
        state = s.load(3)
        # torch: the model and optimizer exactly (the Checkpointer's numpy RNG state would need
        # more than weights_only to re-import: see test_reimport_of_a_torch_export_with_numpy)
        keys = ["model", "optimizer"] if fmt == "torch" else None
        export_checkpoint(s, 3, out, fmt, keys=keys)
    assert out.is_dir() == (fmt == "dcp")
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    with ckptstore.open(tmp_path / "again", "a") as s2:
        r = import_checkpoint(s2, 3, out)
        assert r.kind == fmt
        got = s2.load(3)
    if fmt == "torch":
        assert_same({k: state[k] for k in keys}, got)
    else:  # safetensors keeps the other values in its metadata (checked below)
        _flat_equal(state, got, values=fmt == "dcp")
    if fmt == "safetensors":
        with ckptstore.open(tmp_path / "again", "r") as rd:
            md = rd.meta(3)["import"]["metadata"]
        assert md["ckptstore.iteration"] == "3"
        assert json.loads(md["ckptstore.values"]) == json.loads(json.dumps(flat_tensors(state)[1]))


def test_export_rich_snapshot_to_torch_is_exact(tmp_path, assert_same):
    state = _rich_state()
    with ckptstore.open(tmp_path / "store", "a") as s:
        s.save(5, state)
        export_checkpoint(s, 5, tmp_path / "out.pt", "torch")
        r = import_checkpoint(s, 6, tmp_path / "out.pt")
        assert_same(s.load(5), s.load(6))
        assert r.stats.dedup_bytes == r.stats.logical_bytes - sum(  # every big tensor deduped
            e.nbytes for e in s.manifest(6).tensors if e.inline is not None)


def test_reimport_of_a_torch_export_with_numpy_is_refused_cleanly(tmp_path, delta_store):
    with ckptstore.open(delta_store, "r") as s:
        export_checkpoint(s, 3, tmp_path / "full.pt", "torch")  # holds rng.numpy, an ndarray
    with ckptstore.open(tmp_path / "again", "a") as s2:
        with pytest.raises(ImportSourceError, match=r"full\.pt.*weights_only=True.*numpy"):
            import_checkpoint(s2, 3, tmp_path / "full.pt")
        assert s2.iterations() == []


def test_export_refuses_a_used_dcp_target_and_unknown_formats(tmp_path):
    with ckptstore.open(tmp_path / "store", "a") as s:
        s.save(1, {"w": torch.ones(3)})
        target = tmp_path / "used"
        target.mkdir()
        (target / "keep.txt").write_text("mine")
        with pytest.raises(ExportError, match="exists"):
            export_checkpoint(s, 1, target, "dcp")
        assert os.listdir(target) == ["keep.txt"]
        with pytest.raises(ExportError, match="unknown export format"):
            export_checkpoint(s, 1, tmp_path / "x", "onnx")
        (tmp_path / "empty").mkdir()  # an empty directory is fine
        export_checkpoint(s, 1, tmp_path / "empty", "dcp")
        assert (tmp_path / "empty" / ".metadata").is_file()
        with pytest.raises(ExportError, match="dict at the top"):
            write_state([torch.ones(2)], tmp_path / "list_dcp", "dcp")
        assert not (tmp_path / "list_dcp").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


# ---- bad input: a typed error, and the store unchanged -------------------------------------------

def _bad_pickle_torch(tmp: Path):
    src = tmp / "evil.pt"
    src.write_bytes(boom_torch_file(str(tmp / "PWNED")))
    return 10, src, ImportSourceError, r"evil\.pt: torch\.load\(weights_only=True\) refused it.*mkdir"


def _dcp_missing_shard(tmp: Path):
    src = tmp / "dcp_10"
    _quiet_dcp_save({"w": torch.ones(8), "lr": 0.1}, src)
    for f in src.glob("*.distcp"):
        f.unlink()
    return 10, src, ImportSourceError, r"DCP checkpoint files missing: __0_0\.distcp"


def _dcp_truncated_shard(tmp: Path):
    src = tmp / "dcp_10"
    _quiet_dcp_save({"w": torch.ones(8), "lr": 0.1}, src)
    f = next(src.glob("*.distcp"))
    f.write_bytes(f.read_bytes()[:-100])
    return 10, src, ImportSourceError, r"shorter than the metadata says"


def _dcp_without_metadata(tmp: Path):
    src = tmp / "dcp_10"
    _quiet_dcp_save({"w": torch.ones(8)}, src)
    (src / ".metadata").unlink()
    return 10, src, ImportSourceError, r"without its \.metadata"


def _dcp_pickled_object(tmp: Path):
    src = tmp / "dcp_10"  # DCP pickles non-tensor objects; the import reads them weights_only
    _quiet_dcp_save({"w": torch.ones(8), "evil": _Boom(str(tmp / "PWNED"))}, src)
    return 10, src, ImportSourceError, r"DCP item 'evil': torch\.load\(weights_only=True\) refused"


def _hf_without_model(tmp: Path):
    model, opt, _ = _trained()
    src = _hf_checkpoint(tmp, 10, {}, layout="none", optimizer=opt.state_dict())
    return None, src, ImportSourceError, r"checkpoint-10: a Hugging Face checkpoint without a model"


def _hf_missing_shard(tmp: Path):
    model, _, _ = _trained()
    src = _hf_checkpoint(tmp, 10, dict(model.state_dict()), layout="sharded")
    (src / "model-00002-of-00002.safetensors").unlink()
    return None, src, ImportSourceError, r"model shards missing: model-00002-of-00002"


def _unknown_file(tmp: Path):
    src = tmp / "notes_10.txt"
    src.write_text("hello")
    return 10, src, ImportSourceError, r"unknown source kind"


def _unknown_dir(tmp: Path):
    src = tmp / "stuff_10"
    src.mkdir()
    (src / "a.txt").write_text("x")
    return 10, src, ImportSourceError, r"unknown source kind"


def _missing_path(tmp: Path):
    return 10, tmp / "nothing_10.pt", ImportSourceError, r"no such file or directory"


def _unholdable_value(tmp: Path):
    src = tmp / "size_10.pt"  # torch.Size loads weights_only, but the store holds no tuple subclass
    torch.save({"w": torch.ones(2), "shape": torch.Size([2])}, src)
    return 10, src, ImportSourceError, r"size_10\.pt: holds a value the store cannot hold.*shape"


def _not_after_latest(tmp: Path):
    src = tmp / "ok.pt"
    torch.save({"w": torch.ones(2)}, src)
    return 2, src, IterationOrderError, r"not after the latest iteration 2"


def _no_iteration_in_name(tmp: Path):
    src = tmp / "final.pt"
    torch.save({"w": torch.ones(2)}, src)
    return None, src, ImportSourceError, r"no iteration given and none in its name"


BAD = [_bad_pickle_torch, _dcp_missing_shard, _dcp_truncated_shard, _dcp_without_metadata,
       _dcp_pickled_object, _hf_without_model, _hf_missing_shard, _unknown_file, _unknown_dir,
       _missing_path, _unholdable_value, _not_after_latest, _no_iteration_in_name]


@pytest.mark.parametrize("case", BAD, ids=[c.__name__.lstrip("_") for c in BAD])
def test_bad_input_raises_typed_error_and_changes_nothing(tmp_path, case):
    store = tmp_path / "store"
    _store_with_two(store)
    before = _fingerprint(store)
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    iteration, src, exc, match = case(src_dir)
    with ckptstore.open(store, "a") as s:
        with pytest.raises(exc, match=match) as info:
            import_checkpoint(s, iteration, src)
        assert isinstance(info.value, ckptstore.CkptStoreError)
        assert s.iterations() == [1, 2]
    assert _fingerprint(store) == before
    assert fsck(store).clean
    assert not (src_dir / "PWNED").exists()  # nothing was unpickled
    # the CLI says the same, exit 1, and also leaves the store as it was
    args = ["import", str(store)] + ([str(iteration)] if iteration is not None else []) + [str(src)]
    assert cli(args) == 1
    assert _fingerprint(store) == before


def test_import_dir_checks_everything_before_the_first_save(tmp_path):
    store = tmp_path / "store"
    _store_with_two(store)
    before = _fingerprint(store)
    v = _model_versions(2)
    d = tmp_path / "run"
    d.mkdir()
    torch.save({"model": v[0]}, d / "step_10.pt")
    _quiet_dcp_save({"model": v[1]}, d / "dcp_20")
    (d / "dcp_20" / "__0_0.distcp").unlink()
    with ckptstore.open(store, "a") as s:
        with pytest.raises(ImportSourceError, match="dcp_20: DCP checkpoint files missing"):
            import_dir(s, d)
    assert _fingerprint(store) == before
    shutil.rmtree(d / "dcp_20")
    torch.save({"model": v[1]}, d / "ckpt-10.pt")  # two entries name iteration 10
    with ckptstore.open(store, "a") as s:
        with pytest.raises(ImportSourceError, match="both name iteration 10"):
            import_dir(s, d)
    (d / "ckpt-10.pt").unlink()
    torch.save({"model": v[1]}, d / "step_2.pt")  # not after the store's latest
    with ckptstore.open(store, "a") as s:
        with pytest.raises(IterationOrderError, match="not after the latest iteration 2"):
            import_dir(s, d)
    (d / "step_2.pt").unlink()
    (d / "step_10.pt").unlink()
    with ckptstore.open(store, "a") as s:
        with pytest.raises(ImportSourceError, match="no recognised checkpoint"):
            import_dir(s, d)
    assert _fingerprint(store) == before
    assert fsck(store).clean


def test_import_dir_of_a_trainer_output_dir(tmp_path):
    """A Trainer's output_dir: checkpoint-N/ directories beside the final model (sharded) and its
    JSON files; the shards' numbers are not iterations. A checkpoint-N itself is refused."""
    v = _model_versions(2)
    out = tmp_path / "output"
    _hf_checkpoint(out, 10, v[0], rng="none")
    _hf_checkpoint(out, 20, v[1], rng="none")
    save_file({"a": v[1]["a"]}, out / "model-00001-of-00002.safetensors")
    save_file({"b": v[1]["b"]}, out / "model-00002-of-00002.safetensors")
    (out / "config.json").write_text("{}")
    with ckptstore.open(tmp_path / "store", "a") as s:
        rep = import_dir(s, out)
        assert s.iterations() == [10, 20]
        assert s.load(20)["model"]["a"].equal(v[1]["a"])
        with pytest.raises(ImportSourceError, match="is itself a checkpoint"):
            import_dir(s, out / "checkpoint-10")
    assert "shard" in dict(rep.skipped)["model-00001-of-00002.safetensors"]
    assert dict(rep.skipped)["config.json"] == "not a recognised checkpoint"


def test_import_dir_failing_at_a_later_source_keeps_the_earlier_commits(tmp_path):
    """A file torch refuses is found only when it is read: the imports before it stay committed
    (each is its own atomic save), nothing of it is written, nothing is unpickled."""
    v = _model_versions(2)
    d = tmp_path / "run"
    d.mkdir()
    torch.save({"model": v[0]}, d / "step_10.pt")
    (d / "step_20.pt").write_bytes(boom_torch_file(str(tmp_path / "PWNED")))
    with ckptstore.open(tmp_path / "store", "a") as s:
        with pytest.raises(ImportSourceError, match=r"step_20\.pt: torch\.load"):
            import_dir(s, d)
        assert s.iterations() == [10]
        assert s.load(10)["model"]["a"].equal(v[0]["a"])
    assert fsck(tmp_path / "store").clean
    assert not (tmp_path / "PWNED").exists()


def test_load_source_touches_no_store_and_reports_kind(tmp_path):
    src = tmp_path / "x_1.safetensors"
    save_file({"w": torch.ones(2)}, src)
    loaded = load_source(src)
    assert (loaded.kind, loaded.iteration_hint) == ("safetensors", 1)
    with pytest.raises(ImportSourceError, match="unknown source kind 'onnx'"):
        load_source(src, kind="onnx")
    with pytest.raises(ImportSourceError, match="a dcp checkpoint is a directory"):
        load_source(src, kind="dcp")


# ---- the command line ----------------------------------------------------------------------------

def test_cli_end_to_end(tmp_path, capsys, assert_same):
    store = str(tmp_path / "store")
    state = _rich_state()
    torch.save(state, tmp_path / "a.pt")
    assert cli(["import", store, "5", str(tmp_path / "a.pt")]) == 0
    out = capsys.readouterr().out
    assert "(torch) as iteration 5" in out and "written" in out

    model, opt, sched = _trained()
    hf = _hf_checkpoint(tmp_path / "hf", 500, dict(model.state_dict()), layout="sharded",
                        optimizer=opt.state_dict(), scheduler=sched.state_dict())
    assert cli(["import", store, str(hf), "--meta", '{"run": "hf"}']) == 0  # ITER from the name
    out = capsys.readouterr().out
    assert "(hf) as iteration 500" in out and "left out training_args.bin" in out

    # export the HF iteration as DCP, re-import it through the CLI: the same tensors
    assert cli(["restore", store, "500", "--out", str(tmp_path / "dcp500"), "--format", "dcp"]) == 0
    assert "(dcp)" in capsys.readouterr().out
    assert cli(["import", store, "600", str(tmp_path / "dcp500")]) == 0
    capsys.readouterr()
    with ckptstore.open(store, "r") as r:
        assert r.iterations() == [5, 500, 600]
        assert r.meta(500)["run"] == "hf" and r.meta(500)["import"]["global_step"] == 500
        _flat_equal(r.load(500), r.load(600))
        assert r.info(600).written_bytes < r.info(500).written_bytes  # the tensors were stored
        assert_same(torch.load(tmp_path / "a.pt", weights_only=True), r.load(5))

    # the existing formats keep working
    for fmt in ("torch", "safetensors"):
        assert cli(["restore", store, "5", "--out", str(tmp_path / f"r.{fmt}"), "--format", fmt]) == 0
    assert_same(torch.load(tmp_path / "a.pt", weights_only=True),
                torch.load(tmp_path / "r.torch", weights_only=True))
    assert load_file(tmp_path / "r.safetensors")["model/0.weight"].equal(state["model"]["0.weight"])
    capsys.readouterr()

    # bulk import into a new store: the table, what was left out, the bytes dedup saved
    run = tmp_path / "run"
    run.mkdir()
    v = _model_versions(3)
    for i, m in enumerate(v):
        torch.save({"model": m}, run / f"step_{(i + 1) * 100}.pt")
    (run / "README").write_text("x")
    assert cli(["import", str(tmp_path / "bulk"), "--from-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "imported 3 checkpoints" in out and "dedup saved" in out and "left out README" in out
    assert cli(["ls", str(tmp_path / "bulk")]) == 0
    assert capsys.readouterr().out.count("snapshot") == 3

    # errors: exit 1 with the message; a bad source never creates a store
    assert cli(["import", str(tmp_path / "new"), "7", str(run / "README")]) == 1
    assert "unknown source kind" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    # usage: exit 2
    assert cli(["import", store]) == 2
    assert cli(["import", store, "7", str(tmp_path / "a.pt"), "--meta", "[1]"]) == 2
    assert cli(["import", store, "7", str(tmp_path / "a.pt"), "--meta", "{x"]) == 2
    assert cli(["import", store, "x", str(tmp_path / "a.pt")]) == 2
    assert cli(["import", store, str(tmp_path / "a.pt"), "--from-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "--meta must be a JSON object" in err and "usage: ckptstore import" in err
    with ckptstore.open(store, "r") as r:
        assert r.iterations() == [5, 500, 600]
