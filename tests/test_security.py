"""Reading an untrusted store can never do worse than raise a clear error.

* A static check: no module of ckptstore imports pickle, marshal or shelve (or their relatives),
  calls eval/exec/compile/__import__, calls torch.load without ``weights_only=True`` or
  numpy.load with ``allow_pickle=True``, or starts processes.
* A malicious store whose bytes would run code if anything in them were unpickled or evaluated
  (pickles in manifest strings, chunk contents, dtypes, inline values, state-dict keys, meta, torch
  archives and .npy object arrays as chunks, files dropped into the store directory): every read
  operation of the API and the CLI, run under an audit hook, raises only package errors, executes
  nothing, and changes nothing outside the store.
* Names in state dicts are data, never paths: traversal, absolute, NUL, very long and unicode keys
  round-trip as data and no file appears outside the store.
"""

from __future__ import annotations

import ast
import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptstore
from ckptstore.cli import main as cli
from ckptstore.format.chunk import address_of
from ckptstore.ops.fsck import check
from ckptstore.format.tree import tree_root

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _hostile import append_checkpoint, boom_npy, boom_pickle, boom_torch_file  # noqa: E402

PACKAGE = HERE.parent / "ckptstore"

# ---- static check ----------------------------------------------------------------------------------

BANNED_MODULES = {"pickle", "_pickle", "cPickle", "pickletools", "marshal", "shelve", "dill",
                  "cloudpickle", "joblib", "copyreg", "yaml", "subprocess", "multiprocessing",
                  "code", "codeop", "runpy", "importlib", "ctypes"}
BANNED_BUILTINS = {"eval", "exec", "compile", "__import__", "breakpoint"}
BANNED_ATTRS = {("os", "system"), ("os", "popen"), ("os", "execv"), ("os", "execvp"),
                ("os", "spawnv"), ("os", "posix_spawn"), ("torch", "jit"), ("serialization", "load")}
#: Justified exceptions, (module path relative to ckptstore/, rule) -> why. Keep it empty unless
#: a use is provably safe; every entry needs a reason.
ALLOWLIST: dict[tuple[str, str], str] = {
    ("cli/demo.py", "import subprocess"):
        "the demo starts itself (sys.executable -m ckptstore.cli.demo) as the trainer it SIGKILLs; "
        "the argv holds the demo directory given on the command line and ints, nothing read from a "
        "store",
    ("ops/bisect.py", "import importlib"):
        "bisect imports the module its user names in a `module:function` condition (an argument "
        "of the CLI or the API, as `python -m` would); nothing read from a store reaches it",
    ("remote/client.py", "import importlib.util"):
        "find_spec asks whether obstore or boto3 is installed, and import_module imports one of "
        "the two client modules, both by the names of the module's own constant CLIENTS table "
        "(a client= option is checked against its keys); nothing read from a store reaches it",
    ("replay/native/build.py", "import subprocess"):
        "runs the C compiler on the package's own kernel source (fixed flags, paths inside the "
        "package and the user's private cache); nothing read from a store reaches the argv",
    ("replay/native/build.py", "import ctypes"):
        "loads the library it compiled from the package's own source, from a 0700 cache directory, "
        "named by the digest of source, compiler, flags and CPU",
    ("replay/native/adam.py", "import ctypes"):
        "calls the package's own kernel and torch's MKL; pointers come from tensors whose sizes and "
        "dtypes are checked against the parameters, sparse positions are range-checked and "
        "increasing (gradcodecs.TopKCodec.slicer), so store data cannot steer a read or write",
    ("storage/memory.py", "import ctypes"):
        "calls libc's madvise(MADV_HUGEPAGE) on the memory of tensors this process just allocated "
        "as read destinations (addresses and lengths from those tensors, never from store data)",
    ("replay/native/topk.py", "import ctypes"):
        "calls the package's own kernel on the training side only (encoding a live gradient, "
        "never data read from a store); output buffers are allocated with the capacity passed",
}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def violations(source: str, filename: str = "<src>") -> list[str]:
    """Every construct of ``source`` that could execute code from data."""
    out: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in BANNED_MODULES:
                    out.append(f"{where}: import {a.name}")
        elif isinstance(node, ast.ImportFrom):
            mod = (node.module or "").split(".")[0]
            if node.level == 0 and mod in BANNED_MODULES:
                out.append(f"{where}: from {node.module} import ...")
            if node.level == 0 and node.module == "torch" and any(a.name in ("load", "jit") for a in node.names):
                out.append(f"{where}: from torch import load/jit")
            if node.level == 0 and node.module == "numpy" and any(a.name == "load" for a in node.names):
                out.append(f"{where}: from numpy import load")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            kw = {k.arg: k.value for k in node.keywords}
            if isinstance(node.func, ast.Name) and node.func.id in BANNED_BUILTINS:
                out.append(f"{where}: {node.func.id}()")
            if name in ("getattr",) and node.args and _dotted(node.args[0]) == "builtins":
                out.append(f"{where}: getattr(builtins, ...)")
            if name.endswith("torch.load") or name == "torch.load":
                if not _is_true(kw.get("weights_only")):
                    out.append(f"{where}: torch.load without weights_only=True")
            if name in ("np.load", "numpy.load") and not (
                    isinstance(kw.get("allow_pickle"), ast.Constant) and kw["allow_pickle"].value is False) \
                    and "allow_pickle" in kw:
                out.append(f"{where}: numpy.load(allow_pickle=...)")
            if name in ("np.load", "numpy.load") and any(k.arg is None for k in node.keywords):
                out.append(f"{where}: numpy.load(**kwargs)")
            if name.endswith(("yaml.load", "yaml.unsafe_load")):
                out.append(f"{where}: {name}")
        elif isinstance(node, ast.Attribute):
            base = _dotted(node.value).split(".")[-1]
            if (base, node.attr) in BANNED_ATTRS:
                out.append(f"{where}: {base}.{node.attr}")
    return out


def test_static_no_code_execution_from_data():
    """Walk the AST of every module of the package: nothing that can execute code from bytes."""
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 20, modules
    found = []
    for m in modules:
        rel = str(m.relative_to(PACKAGE))
        for v in violations(m.read_text(), rel):
            if not any(v.startswith(f"{rel}:") and rule in v for (f, rule) in ALLOWLIST if f == rel):
                found.append(v)
    assert not found, "code execution from data is reachable:\n" + "\n".join(found)


@pytest.mark.parametrize("snippet", [
    "import pickle", "import marshal", "import shelve", "from pickle import loads",
    "import dill", "from _pickle import Unpickler", "import subprocess",
    "x = eval(s)", "exec(code)", "compile(s, 'f', 'exec')", "__import__(name)",
    "torch.load(f)", "torch.load(f, weights_only=False)", "torch.load(f, weights_only=flag)",
    "np.load(f, allow_pickle=True)", "numpy.load(f, allow_pickle=x)", "os.system('x')",
    "yaml.load(s)", "from torch import load", "torch.jit.load(f)",
])
def test_static_check_catches(snippet):
    """The checker is not vacuous: each banned construct is reported."""
    assert violations(snippet), snippet


@pytest.mark.parametrize("snippet", ["torch.load(f, weights_only=True)", "np.load(f)",
                                     "np.load(f, allow_pickle=False)", "json.loads(s)"])
def test_static_check_allows(snippet):
    assert not violations(snippet)


# ---- a malicious store ---------------------------------------------------------------------------------

def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _entry(path: str, raw: bytes, *, inline: bool, lib: str = "numpy", dtype: str = "|u1",
           chunk_size: int = 1 << 20) -> dict:
    addrs = [address_of(raw)] if raw else []
    e = {"path": path, "lib": lib, "dtype": dtype, "shape": [len(raw)], "nbytes": len(raw),
         "root": tree_root(len(raw), chunk_size, addrs).hex()}
    if inline:
        e["inline"] = _b64(raw)
    return e


def _doc(it: int, state, tensors, meta=None, **extra) -> dict:
    d = {"v": 1, "iteration": it, "kind": "snapshot", "created_ns": 1, "chunk_size": 1 << 20,
         "state": state, "meta": meta, "tensors": tensors}
    d.update(extra)
    return d


def build_hostile_store(root: Path, marker: Path) -> tuple[Path, dict[int, str], dict[str, bytes]]:
    """A store where every place that holds bytes or strings holds a payload that would create
    ``marker`` if unpickled/evaluated. Returns the path and, per iteration, what a reader must do
    with it: "loads" (the payload comes back as plain data) or "refused" (a package error)."""
    path = root / "store"
    pk = boom_pickle(str(marker))
    pk0 = boom_pickle(str(marker), protocol=0)  # ASCII pickle: fits into JSON strings as is
    pt = boom_torch_file(str(marker))
    npy = boom_npy(str(marker))
    pstr = pk0.decode("ascii")
    with ckptstore.open(path, "a", chunk_size=1 << 20) as s:  # an honest first checkpoint
        s.save(0, {"w": np.arange(100, dtype=np.float32), "note": pstr, pstr: {"b": pk}},
               meta={"pickle": pstr})
    expect = {0: "loads"}
    # 1: pickles as bytes values, keys, meta and extra manifest fields; chunks holding a pickle,
    #    a torch.save archive and a .npy object array; an inline tensor holding a pickle
    state = {"o": [[pstr, {"b": _b64(pk)}], ["pt", {"T": 0}], ["npy", {"T": 1}], ["pk", {"T": 2}],
                   ["inline", {"T": 3}], ["__reduce__", pstr], ["eval", "__import__('os').system('x')"]]}
    tensors = [_entry("pt", pt, inline=False), _entry("npy", npy, inline=False),
               _entry("pk", pk, inline=False), _entry("inline", pk[:200], inline=True)]
    append_checkpoint(str(path), 1, _doc(1, state, tensors, meta={"d": [[pstr, {"b": _b64(pk)}]]},
                                         __class__=pstr, pickle=_b64(pk)),
                      chunks=[pt, npy, pk])
    expect[1] = "loads"
    # 2: dtypes that name pickled / object types, or code
    bad_dtypes = [("numpy", "|O8"), ("numpy", "O"), ("numpy", "object"), ("numpy", pstr[:40]),
                  ("torch", "__import__('os').system('x')"), ("torch", pstr[:60]), ("numpy", "<V8")]
    for j, (lib, dt) in enumerate(bad_dtypes):
        e = _entry(f"t{j}", bytes(8), inline=True, lib=lib, dtype=dt)
        e["shape"] = [1]
        append_checkpoint(str(path), 2 + j, _doc(2 + j, {"d": [["x", {"T": 0}]]}, [e]))
        expect[2 + j] = "refused"
    n = 2 + len(bad_dtypes)
    # unknown state tags carrying pickles; a "pickle" kind; a tensor index out of range
    for j, state in enumerate([{"p": _b64(pk)}, {"__reduce__": [pstr]}, {"d": [[pstr, {"pickle": _b64(pk)}]]},
                               {"o": [["x", {"T": 7}]]}, {"f": pstr}, {"i": pstr}]):
        append_checkpoint(str(path), n + j, _doc(n + j, state, []))
        expect[n + j] = "refused"
    n += 6
    append_checkpoint(str(path), n, _doc(n, {"d": []}, [], kind="pickle"))  # not committed
    # files a careless reader might open: a "segment" that is a torch archive, a pickle in
    # quarantine/ and next to the index
    (path / "segments" / "0000009999.seg").write_bytes(pt)
    (path / "quarantine").mkdir(exist_ok=True)
    (path / "quarantine" / "0000000001-0.tail").write_bytes(pk)
    (path / "index" / "evil.pkl").write_bytes(pk)
    (path / "checkpoint.pt").write_bytes(pt)
    return path, expect, {"pk": pk, "pk0": pk0, "pt": pt, "npy": npy}


def _audited(tmp_path: Path, path: Path, marker: Path, iterations: list[int], writer: bool) -> dict:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    spec = {"path": str(path), "out": str(out), "marker": str(marker), "iterations": iterations,
            "allowed_dirs": [str(path), str(out)], "writer": writer}
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    proc = subprocess.run([sys.executable, str(HERE / "_hostile.py"), str(spec_file)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_malicious_store_never_executes_code(tmp_path):
    marker = tmp_path / "PWNED"
    path, expect, payloads = build_hostile_store(tmp_path, marker)
    # the payloads are live: unpickling any of them creates the marker
    import pickle

    pickle.loads(boom_pickle(str(marker)))
    assert marker.exists()
    marker.rmdir()

    with ckptstore.open(path, "r") as r:
        listed = r.iterations()
    assert sorted(expect) == listed, f"committed: {listed}"
    report = _audited(tmp_path, path, marker, listed, writer=True)
    assert not report["marker"], "a payload was executed"
    assert not report["events"], report["events"]
    assert not report["writes_outside"], report["writes_outside"]
    untyped = {k: v for k, v in report["results"].items() if v.startswith("UNTYPED")}
    assert not untyped, json.dumps(untyped, indent=1)
    assert not marker.exists()
    res = report["results"]
    assert res["cli fsck"] == "exit 1"  # the foreign file in segments/ is reported
    for it, what in expect.items():
        if what == "loads":
            assert res[f"load {it}"] == "ok" and res[f"cli restore torch {it}"] == "ok", res
        else:
            assert res[f"load {it}"].startswith("DamagedCheckpointError"), res[f"load {it}"]
            assert res[f"cli restore torch {it}"] == "exit 1", res[f"cli restore torch {it}"]
    # what "loads" gave back is the payload as plain data
    with ckptstore.open(path, "r") as r:
        st = r.load(1)
        assert st[payloads["pk0"].decode()] == payloads["pk"]
        for name in ("pk", "pt", "npy"):
            assert st[name].dtype == np.uint8 and st[name].tobytes() == payloads[name], name
        assert st["inline"].tobytes() == payloads["pk"][:200]
        assert r.meta(0) == {"pickle": payloads["pk0"].decode()}
    assert not marker.exists()


def test_malicious_store_header_file(tmp_path):
    """STORE itself replaced by a pickle or a torch archive: a FormatError, nothing executed."""
    marker = tmp_path / "PWNED"
    for payload in (boom_pickle(str(marker)), boom_torch_file(str(marker))):
        path = tmp_path / "s"
        with ckptstore.open(path, "a") as s:
            s.save(0, {"w": np.zeros(3)})
        (path / "STORE").write_bytes(payload)
        for mode in ("r", "a"):
            with pytest.raises(ckptstore.FormatError):
                ckptstore.open(path, mode)
        assert cli(["ls", str(path)]) == 1 and cli(["fsck", str(path)]) == 1
        assert not marker.exists()
        import shutil

        shutil.rmtree(path)


def test_lying_tensor_size_is_refused_before_allocation(tmp_path, monkeypatch):
    """A manifest entry (and a matching, valid tree) claiming 1 TiB for a tensor whose chunk
    records hold 4 KiB: every load path refuses it with DamagedCheckpointError naming the chunk
    record, before anything is allocated for it; the honest tensor next to it still loads through
    ``keys=``; fsck reports the iteration damaged."""
    import ckptstore.engine.read_path
    from ckptstore.format.chunk import MAX_CHUNK_SIZE
    from ckptstore.format.tree import expected_chunks

    path = tmp_path / "store"
    with ckptstore.open(path, "a") as s:
        s.save(0, {"w": np.arange(10)})
    raw = bytes(range(256)) * 16
    small = bytes(range(200))
    n, cs = 1 << 40, MAX_CHUNK_SIZE  # 4096 chunk spans (2**48 would need a 16 MiB tree)
    addrs = [address_of(raw)] * expected_chunks(n, cs)
    huge = {"path": "huge", "lib": "numpy", "dtype": "|u1", "shape": [n], "nbytes": n,
            "root": tree_root(n, cs, addrs).hex()}
    state = {"d": [["huge", {"T": 0}], ["small", {"T": 1}]]}
    append_checkpoint(str(path), 1, _doc(1, state, [huge, _entry("small", small, inline=False)]),
                      chunks=[raw, small], trees=[(n, cs, addrs)])

    allocated: list[int] = []
    real_allocate = ckptstore.engine.read_path.allocate

    def recording(entry):
        allocated.append(entry.nbytes)
        return real_allocate(entry)

    monkeypatch.setattr(ckptstore.engine.read_path, "allocate", recording)
    for mode in ("r", "a"):
        with ckptstore.open(path, mode) as s:
            assert s.iterations() == [0, 1]
            with pytest.raises(ckptstore.DamagedCheckpointError,
                               match=r"tensor huge: bytes 0-268435456: the record of chunk "
                                     rf"{address_of(raw).hex()} at .*0000000001\.seg offset "
                                     r"\d+ \(4128 payload bytes\) cannot hold 268435456 bytes"):
                s.load(1)
            assert n not in allocated
            assert bytes(s.load(1, keys=["small"])["small"]) == small
    assert n not in allocated and len(small) in allocated
    report = check(path)
    assert not report.clean and list(report.damaged_iterations) == [1]
    assert any("chunk " + address_of(raw).hex() in p and "holds 4096 bytes, not the span's "
               "268435456" in p for p in report.damaged_iterations[1]), report.lines()


def test_replay_section_cannot_name_code(tmp_path):
    """A base snapshot whose replay section names an optimizer that is code: loading a delta on
    it raises a package error; nothing named by a store is ever imported or evaluated."""
    from ckptstore.format.delta import REPLAY_KEY
    from ckptstore.torch import Checkpointer

    marker = tmp_path / "PWNED"
    path = tmp_path / "s"
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ckptstore.open(path, "a") as s:
        ck = Checkpointer(s, model, opt, policy="every-iteration", base_every=100)
        ck.restore()
        for it in (1, 2):
            model(torch.ones(1, 3)).sum().backward()
            ck.step(it)
            opt.zero_grad()
        ck.flush()
        base, rec = s.load_record(0), s.load_record(1)
        for j, name in enumerate([f"__import__('os').mkdir({str(marker)!r})", "Optimizer",
                                  "os.system", boom_pickle(str(marker), 0).decode()]):
            base[REPLAY_KEY] = dict(base[REPLAY_KEY], optimizer=name)
            s.save(10 + 2 * j, base)
            s.save_delta(11 + 2 * j, rec)
    with ckptstore.open(path, "r") as r:
        for j in range(4):
            with pytest.raises(ckptstore.CkptStoreError):
                r.load(11 + 2 * j)
    assert not marker.exists()


# ---- names are data ---------------------------------------------------------------------------------

HOSTILE_KEYS = ["../../etc/passwd", "../../../../tmp/ckptstore-escape", "/abs/path", "/", ".", "..",
                "a\x00b", "\x00", "a/../../b", "C:\\Windows\\system32", "~root/.ssh/authorized_keys",
                "k" * 100_000, "\u202egnp.exe", "名前/🔥", "\ud800", "segments/0000000001.seg",
                "STORE", "LOCK", "index/data.mdb", "\x1b]0;pwned\x07\x1b[31m", "line\nbreak", ""]


def _keyed_state(i: int) -> dict:
    return {k: {"t": torch.full((j + 1,), float(i + j)), "n": torch.arange(300, dtype=torch.int64) * j,
                k: k} for j, k in enumerate(HOSTILE_KEYS)}


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_keys_are_data_never_paths(tmp_path, assert_same):
    work = tmp_path / "work"
    work.mkdir()
    cwd = os.getcwd()
    os.chdir(work)  # relative traversal would land here or above
    try:
        outside_before = _tree(tmp_path)
        path = work / "store"
        with ckptstore.open(path, "a", chunk_size=1 << 12) as s:
            s.save(1, _keyed_state(1), meta={k: k for k in HOSTILE_KEYS})
            s.save(2, _keyed_state(2))
            s.save_delta(3, {k: np.full(3, 7) for k in HOSTILE_KEYS})
            s.gc(keep_last=5)
        with ckptstore.open(path, "r") as r:
            assert_same(_keyed_state(1), r.load(1))
            assert_same(_keyed_state(2), r.load(2))
            assert r.meta(1) == {k: k for k in HOSTILE_KEYS}
            assert_same({k: _keyed_state(2)[k] for k in HOSTILE_KEYS[:3]},
                        r.load(2, keys=HOSTILE_KEYS[:3]))
            assert {d.status for d in r.diff(1, 2)} <= {"changed", "unchanged"}
        out = tmp_path / "restored.pt"
        assert cli(["restore", str(path), "2", "--out", str(out)]) == 0
        restored = torch.load(out, weights_only=True)
        assert_same(_keyed_state(2), restored)
        assert cli(["show", str(path), "1"]) == 0 and cli(["diff", str(path), "1", "2"]) == 0
        assert check(path).clean
        # nothing appeared anywhere but inside the store and the one restore output
        new = _tree(tmp_path) - outside_before
        stray = {p for p in new if not p.startswith("work/store") and p != "restored.pt"}
        assert not stray, stray
        inside = {p for p in _tree(path)}
        assert all(p.split("/")[0] in ("STORE", "LOCK", "segments", "index") for p in inside), inside
        assert all(p.endswith(".seg") or p == "segments" for p in inside if p.startswith("segments")), inside
        assert not Path("/tmp/ckptstore-escape").exists()
    finally:
        os.chdir(cwd)


def test_cli_escapes_control_characters_in_names(tmp_path, capsys):
    """A name holding terminal escape sequences is printed escaped, never raw."""
    path = tmp_path / "s"
    with ckptstore.open(path, "a") as s:
        s.save(1, {"\x1b]0;pwned\x07\x1b[31mred": np.zeros(3), "ok": np.ones(400)},
               meta={"\x1b[2J": "\x1b[31m"})
        s.save(2, {"\x1b]0;pwned\x07\x1b[31mred": np.ones(3), "ok": np.ones(400)})
    for cmd in (["show", str(path), "1"], ["diff", str(path), "1", "2", "--all"], ["ls", str(path)]):
        assert cli(cmd) == 0
        printed = capsys.readouterr().out
        assert "\x1b" not in printed and "\x07" not in printed, (cmd, printed)
    assert cli(["show", str(path), "1"]) == 0
    assert "\\x1b]0;pwned" in capsys.readouterr().out
