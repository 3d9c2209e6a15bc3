"""The package's structure, checked from its source (ast): each rule here can fail.

Layers, lowest first (README "Layout"); a module may import only from its own layer or below, and
two packages of one layer (ops/ and replay/) do not import each other:

    errors <- format/ <- tensors/ <- storage/ <- engine/ <- ops/, replay/, remote/ <- store <- multirank/
    <- torch/ <- ckptstore/__init__, follow (the public API) <- integrations/ <- cli/

(the integrations and the CLI, with its demo, are clients of the public API, ``ckptstore.open``
and ``ckptstore.torch``; ``ckptstore.dcp``, ``.hf``, ``.lightning`` and ``.interop``, their
documented import paths, re-export ``integrations/`` and sit at its layer).

An upward reference is allowed only for type hints, under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "ckptstore"
README = PACKAGE.parent / "README.md"

#: (module-name prefix, layer rank, group): longest prefix wins
LAYERS = [
    ("ckptstore.errors", 0, "errors"),
    ("ckptstore.format", 1, "format"),
    ("ckptstore.tensors", 2, "tensors"),
    ("ckptstore.storage", 3, "storage"),
    ("ckptstore.engine", 4, "engine"),
    ("ckptstore.ops", 5, "ops"),
    ("ckptstore.replay", 5, "replay"),
    ("ckptstore.remote", 5, "remote"),
    ("ckptstore.store", 6, "store"),
    ("ckptstore.multirank", 7, "multirank"),
    ("ckptstore.torch", 8, "torch"),
    ("ckptstore", 9, "api"),
    # framework integrations and interchange: clients of the public API; nothing in the package
    # but the CLI imports them (importing ckptstore must not import transformers or lightning).
    # ckptstore.dcp, .hf, .lightning and .interop are their documented import paths, re-exporting
    ("ckptstore.integrations", 10, "integrations"),
    ("ckptstore.dcp", 10, "integrations"),
    ("ckptstore.hf", 10, "integrations"),
    ("ckptstore.lightning", 10, "integrations"),
    ("ckptstore.interop", 10, "integrations"),
    ("ckptstore.cli", 11, "cli"),
]

#: Private names of other libraries the package uses on purpose, with why.
FOREIGN_PRIVATE = {
    "_foreach_copy_": "torch's batched copy (one call per snapshot instead of one per tensor)",
    "_version": "torch's tensor version counter (the Checkpointer's capture hooks)",
    "_base": "torch's view base (a gradient is lent only when it is no view: grad_capture.py)",
    "_metadata": "the attribute torch's state_dict() sets on its OrderedDict (kept exactly)",
}


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(name: str) -> tuple[int, str]:
    best = max((p for p in LAYERS if name == p[0] or name.startswith(p[0] + ".")),
               key=lambda p: len(p[0]))
    return best[1], best[2]


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
                (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING") or
                (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")):
            for child in node.body:
                skip.update(id(n) for n in ast.walk(child))
    return skip


def imports(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]
            ) -> list[tuple[int, str]]:
    """(line, imported ckptstore module) for every import outside ``if TYPE_CHECKING:``, function-
    level imports included; ``from pkg import mod`` counts as an import of ``pkg.mod``."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "ckptstore"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "ckptstore":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((node.lineno, sub if sub in known else target))
    return out


def test_every_module_has_a_layer():
    for name in modules():
        assert layer(name) is not None, name


def test_imports_point_down():
    known = modules()
    bad = []
    for name, path in known.items():
        rank, group = layer(name)
        for line, target in imports(name, path, known):
            t_rank, t_group = layer(target)
            if t_rank > rank or (t_rank == rank and t_group != group):
                bad.append(f"{path.relative_to(PACKAGE)}:{line}: {name} ({group}) imports "
                           f"{target} ({t_group})")
    assert not bad, "imports that point up or sideways:\n" + "\n".join(bad)


def test_no_import_cycles():
    known = modules()
    graph = {name: sorted({t for _, t in imports(name, path, known) if t != name and t in known})
             for name, path in known.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in graph[n]:
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in graph:
        if n not in state:
            visit(n)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _defined_private_names(tree: ast.AST) -> set[str]:
    """Underscore names a module defines itself: functions, classes, attributes it assigns."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if n.startswith("_")}


def test_no_module_touches_another_modules_private_names():
    bad = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        own = _defined_private_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                bad += [f"{path.relative_to(PACKAGE)}:{node.lineno}: imports {a.name}"
                        for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if not isinstance(node, ast.Attribute):
                continue
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__") or attr in own:
                continue
            v = node.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                continue
            if attr in FOREIGN_PRIVATE:
                continue
            bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: .{attr}")
    assert not bad, "another module's private names used:\n" + "\n".join(bad)


def _call_of(node: ast.AST, name: str) -> bool:
    """``node`` calls ``name`` (a plain name or an attribute)."""
    return isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id == name) or
        (isinstance(node.func, ast.Attribute) and node.func.attr == name))


def _calls(tree: ast.AST, func: str) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if _call_of(node, func)]


def _enclosing_functions(tree: ast.AST) -> dict[int, str]:
    """id(node) -> name of the innermost function (or class.method) around it."""
    where: dict[int, str] = {}

    def walk(node: ast.AST, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{name}.{child.name}" if name else child.name
                walk(child, inner)
            else:
                where[id(child)] = name
                walk(child, name)

    walk(tree, "")
    return where


def _sites(match) -> set[tuple[str, str]]:
    """(module path, enclosing function) of every ast node for which ``match(node)`` holds."""
    out = set()
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        where = _enclosing_functions(tree)
        rel = str(path.relative_to(PACKAGE))
        out |= {(rel, where.get(id(node), "")) for node in ast.walk(tree) if match(node)}
    return out


def _member(node: ast.AST, owner: str, attr: str) -> bool:
    """``node`` is ``owner.attr`` or ``<...>.owner.attr``."""
    return isinstance(node, ast.Attribute) and node.attr == attr and (
        (isinstance(node.value, ast.Attribute) and node.value.attr == owner) or
        (isinstance(node.value, ast.Name) and node.value.id == owner))


def test_exactly_one_function_writes_commit_records():
    """A COMMIT record is appended in one place (engine/transaction.py append_commit_record),
    and ``encode_commit`` is called only there and where the index packs its values."""
    writers = _sites(lambda n: _member(n, "RecordType", "COMMIT"))
    encoders = _sites(lambda n: _call_of(n, "encode_commit"))
    appenders = {w for w in writers if w[0] not in ("storage/log.py", "storage/segments.py",
                                                    "ops/fsck.py")}
    # the log scan, the segment scanner and fsck compare record types; they never write
    assert appenders == {("engine/transaction.py", "append_commit_record")}, appenders
    # the global commit and the commit vote of a multi-rank store carry COMMIT payloads inside
    # their own structures; they are not COMMIT records
    assert encoders == {("engine/transaction.py", "append_commit_record"),
                        ("storage/index.py", "pack_commit"),
                        ("format/job.py", "encode_global_commit"),
                        ("multirank/messages.py", "encode_vote")}, encoders


def test_exactly_one_function_writes_global_commit_records():
    """A multi-rank store's GLOBAL_COMMIT records are appended by one method
    (storage/job_log.py EpochLog.append_commits), which only the coordinator's committer calls,
    and a job-store gc writing its new epoch's log before renaming it into place (format §22.7)."""
    writers = _sites(lambda n: _member(n, "JobRecordType", "GLOBAL_COMMIT"))
    callers = _sites(lambda n: isinstance(n, ast.Attribute) and n.attr == "append_commits")
    appenders = {w for w in writers if w != ("storage/job_log.py", "scan_epoch_log")}
    assert appenders == {("storage/job_log.py", "EpochLog.append_commits")}, appenders
    assert callers == {("multirank/committer.py", "GlobalCommitter._decide"),
                       ("multirank/job_gc.py", "write_generation_log")}, callers


def test_one_object_owns_the_writer_lock():
    flockers, owners = set(), set()
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        rel = str(path.relative_to(PACKAGE))
        if _calls(tree, "flock"):
            flockers.add(rel)
        if _calls(tree, "WriterLock"):
            owners.add(rel)
    assert flockers == {"storage/lock.py"}
    assert owners == {"engine/writer_engine.py"}


@pytest.mark.parametrize("op", ["ops/fsck.py", "ops/gc.py"])
def test_maintenance_reaches_files_through_the_storage_layer(op):
    """fsck and gc use the storage layer's classes: no LMDB, no locks, no raw file writes."""
    text = (PACKAGE / op).read_text()
    tree = ast.parse(text)
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
             for a in n.names}
    names |= {(n.module or "").split(".")[0] for n in ast.walk(tree)
              if isinstance(n, ast.ImportFrom) and not n.level}
    assert not names & {"lmdb", "fcntl", "shutil"}, names
    assert not _calls(tree, "open") and not re.search(r"\bos\.(open|write|unlink|rename|remove)\(", text)


def test_readme_layout_lists_every_package():
    """The README's layout section names every package of ckptstore (one line each)."""
    text = README.read_text()
    section = text[text.index("## Layout"):]
    packages = sorted({p.parent for p in PACKAGE.rglob("__init__.py")} - {PACKAGE})
    missing = [str(p.relative_to(PACKAGE.parent)) for p in packages
               if f"`{p.relative_to(PACKAGE.parent)}/`" not in section]
    assert not missing, f"README's layout section does not list {missing}"
