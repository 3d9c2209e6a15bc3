"""Replay the fuzz seeds and every input the fuzzers ever flagged through the same checks atheris
runs (fuzz/targets.py), without atheris; plus unit tests for the decoder bugs fuzzing found.

Every file under fuzz/corpus/<target>/ and fuzz/regressions/<target>/ must pass its target's
check: decode, or raise a CkptStoreError, and keep the properties the check asserts.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fuzz import targets  # noqa: E402

from ckptstore.errors import CkptStoreError, FormatError  # noqa: E402


def _inputs() -> list:
    out = []
    for kind in ("corpus", "regressions"):
        base = ROOT / "fuzz" / kind
        if not base.is_dir():
            continue
        for tdir in sorted(base.iterdir()):
            if tdir.is_dir():
                out += [pytest.param(tdir.name, f, id=f"{kind}/{tdir.name}/{f.name}")
                        for f in sorted(tdir.iterdir()) if f.is_file() and f.name != ".gitkeep"]
    return out


INPUTS = _inputs()


def test_every_target_has_seeds():
    seeded = {name for name, _ in (p.values for p in INPUTS)}
    assert seeded >= set(targets.TARGETS), sorted(set(targets.TARGETS) - seeded)


def test_input_folders_name_targets():
    unknown = {name for name, _ in (p.values for p in INPUTS)} - set(targets.TARGETS)
    assert not unknown, f"fuzz inputs for unknown targets: {sorted(unknown)}"


@pytest.mark.parametrize("name,path", INPUTS)
def test_replay(name, path):
    targets.TARGETS[name](path.read_bytes())


# ---- the fixture the delta targets fuzz around is a real, replayable chain --------------------------

def test_delta_fixture_replays_bit_exact():
    from conftest import _same

    fx = targets.delta_fixture()
    eng = targets._replay_engine(copy.deepcopy(fx["base"]), 0)
    for it in (1, 2):
        eng.apply(it, copy.deepcopy(fx["records"][it]))
        got = eng.current(clone=True)
        _same(fx["expected"][it]["model"], got["model"], f"model at {it}")
        _same(fx["expected"][it]["optimizer"], got["optimizer"], f"optimizer at {it}")


# ---- decoder bugs found by fuzzing -----------------------------------------------------------------

@pytest.mark.parametrize("lib,dtype", [("torch", "float32"), ("numpy", "<f4")])
@pytest.mark.parametrize("shape", [(0, 2 ** 70), (0, 2 ** 62, 2 ** 62), (0,) * 64])
def test_allocate_refuses_unrepresentable_shapes(lib, dtype, shape):
    """A zero dimension makes any other extent pass the nbytes check; torch raised TypeError
    (a dimension past int64) and numpy ValueError (too many dimensions / too big)."""
    from ckptstore.format.manifest import TensorEntry
    from ckptstore.tensors import allocate

    entry = TensorEntry("x", lib, dtype, shape, 0, bytes(16))
    try:
        value, view = allocate(entry)
    except CkptStoreError as e:  # FormatError (unrepresentable) or CkptStoreError (cannot allocate)
        assert "tensor x" in str(e)
    else:
        assert len(view) == 0 and tuple(value.shape) == shape


def test_malformed_delta_record_is_a_damaged_checkpoint():
    """Before: KeyError / TypeError / AttributeError from the replay engine for a delta record
    whose checksums are fine but whose structure is not a delta record."""
    fx = targets.delta_fixture()
    good = fx["records"][1]
    bad_records = [
        {}, {"grads": 3}, dict(good, grads=good["grads"][:-1]), dict(good, hyper=[5]),
        dict(good, grads=[{"x": 1}] * len(good["grads"])), dict(good, err=[0.5], lossy=True),
        dict(good, hyper=[dict(good["hyper"][0], lr="fast")]), dict(good, fp={"norm": 1.0}),
        dict(good, codec="topk:2"), dict(good, buffers=[1]),
    ]
    for i, record in enumerate(bad_records):
        eng = targets._replay_engine(copy.deepcopy(fx["base"]), 0)
        with pytest.raises(CkptStoreError) as info:
            eng.apply(1, record)
        assert "delta 1" in str(info.value) or isinstance(info.value, ValueError), (i, info.value)


def test_malformed_base_snapshot_is_a_damaged_checkpoint():
    fx = targets.delta_fixture()
    base = fx["base"]
    info = base["ckptstore.replay"]
    for bad in ({**base, "model": {}}, {**base, "optimizer": None},
                {**base, "ckptstore.replay": {**info, "groups": 5}},
                {**base, "ckptstore.replay": {**info, "defaults": {"lr": -1.0}},
                 "optimizer": {"state": {}, "param_groups": "x"}},
                {**base, "ckptstore.replay": {**info, "codec": 1}}):
        with pytest.raises(CkptStoreError, match="base snapshot 0"):
            targets._replay_engine(copy.deepcopy(bad), 0)


def test_checks_flag_a_bad_decoder(monkeypatch):
    """The checks are not vacuous: a decoder that lets a foreign exception out, or returns a value
    breaking a property, is reported."""
    import ckptstore.format.commit as commit

    monkeypatch.setattr(targets, "decode_commit", lambda b: (_ for _ in ()).throw(IndexError("x")))
    with pytest.raises(IndexError):
        targets.check_commit(b"\0" + bytes(96))
    good = commit.decode_commit(bytes(96))
    monkeypatch.setattr(targets, "decode_commit", lambda b: good)
    with pytest.raises(targets.FuzzFinding):
        targets.check_commit(b"\0" + b"\1" * 96)


def test_invalid_deep_state_node_is_a_format_error():
    """The error message for an invalid node rendered the node with a plain repr, which raised
    RecursionError for a deeply nested one (JSON nesting that json.loads still accepts)."""
    import json

    from ckptstore.format.state import unflatten

    # json.loads needs one frame per level, the decoder two per list level above the bad node,
    # so the repr of the bad node overflowed the stack where json.loads did not
    node = json.loads("[" * 250 + '{"a":1,"b":' + "[" * 620 + "]" * 620 + "}" + "]" * 250)
    with pytest.raises(FormatError, match="invalid node"):
        unflatten(node, lambda i, p: None)


def test_manifest_refuses_a_float_that_overflows():
    """``1e400`` decoded to inf, a value strict JSON cannot re-encode (encode_manifest raised
    ValueError); format.md now refuses it like the NaN/Infinity constants."""
    from ckptstore.format.manifest import decode_manifest

    doc = ('{"v":1,"iteration":3,"kind":"snapshot","created_ns":0,"chunk_size":1024,'
           '"state":null,"meta":%s,"tensors":[]}')
    with pytest.raises(FormatError, match="not valid JSON"):
        decode_manifest((doc % "-1e400").encode())
    assert decode_manifest((doc % "1.5e300").encode()).meta == 1.5e300
