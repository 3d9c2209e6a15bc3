"""Every name the documentation tells users to import still imports from its documented path.

The names are collected, not listed by hand, so a module moved without a re-export at its old path
fails here:

* every ``import``/``from ... import`` of ckptstore in the ```python blocks of README.md and
  docs/*.md, and every dotted ``ckptstore.a.b`` those blocks use (``ckptstore.dcp.StorageWriter``);
* every ``ckptstore.a.b`` written in backticks in README.md, docs/*.md and format-spec/*.md
  (``ckptstore.follow.Follower``), except the few that name a format marker or a meta key, not a
  Python object (``NOT_PYTHON``);
* the import lines of the examples in the package's docstrings (``from ckptstore.interop import
  export_checkpoint``);
* every name of every ``__all__`` in the package;
* and the modules that re-export a moved one (``ckptstore.dcp`` for ``ckptstore.integrations.dcp``)
  export the same objects under the same names.

Importing ``ckptstore.hf`` or ``ckptstore.lightning`` imports transformers or lightning: those are
skipped where the framework is not installed (extras ``hf``, ``lightning``).
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ckptstore"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SPECS = sorted((ROOT / "format-spec").glob("*.md"))

#: dotted names in backticks that are not Python objects, with what they are
NOT_PYTHON = {
    "ckptstore.follower": "the follower's meta key and format marker (format-spec/follower.md)",
    "ckptstore.plan": "a Checkpointer base's persisted-plan key (format-spec/deltas.md)",
    "ckptstore.shards": "a DTensor state part's section key (format-spec/format.md §22.8)",
}
#: documented modules that re-export a module moved into a package, and that module
REEXPORTS = {
    "ckptstore.dcp": "ckptstore.integrations.dcp",
    "ckptstore.hf": "ckptstore.integrations.hf",
    "ckptstore.lightning": "ckptstore.integrations.lightning",
    "ckptstore.interop": "ckptstore.integrations.interop",
}
#: modules that import a framework that may not be installed, and that framework
FRAMEWORKS = {"ckptstore.hf": "transformers", "ckptstore.integrations.hf": "transformers",
              "ckptstore.lightning": "lightning", "ckptstore.integrations.lightning": "lightning"}

_FENCE = re.compile(r"^```(\w*)\s*$")
_TICKED = re.compile(r"`([^`\n]*)`")
_DOTTED = re.compile(r"(?<![\w.])ckptstore(?:\.[A-Za-z_]\w*)+")
_DOC_IMPORT = re.compile(r"^\s*((?:from ckptstore[\w.]* import .+)|(?:import ckptstore[\w., ]*))$")


def _python_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        if m.group(1) == "python":
            out.append((start + 1, "\n".join(lines[start + 1:i])))
        i += 1
    return out


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "ckptstore":
        return ".".join(["ckptstore", *reversed(parts)])
    return None


def _references_in_code(code: str) -> set[tuple[str, str | None]]:
    """(module, name) imported by ``code``'s import statements (name None: the module itself),
    and ("ckptstore.a.b", None) for its longest dotted uses of ``ckptstore``. A block that is not
    valid Python (an elided ``...`` argument in a norun sketch) is read line by line."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        refs: set[tuple[str, str | None]] = {(name, None) for name in _DOTTED.findall(code)}
        for text in code.splitlines():
            m = _DOC_IMPORT.match(text)
            if m:
                refs |= _references_in_code(m.group(1).strip())
        return refs
    refs = set()
    inner: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            refs |= {(a.name, None) for a in node.names if a.name.split(".")[0] == "ckptstore"}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and \
                node.module.split(".")[0] == "ckptstore":
            refs |= {(node.module, a.name) for a in node.names}
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            name = _dotted(node)
            if name is not None:
                refs.add((name, None))
                v = node.value
                while isinstance(v, ast.Attribute):  # the shorter prefixes are checked with it
                    inner.add(id(v))
                    v = v.value
    return refs


def _documented() -> dict[tuple[str, str | None], str]:
    """Every documented reference, with where it is written (the first place)."""
    found: dict[tuple[str, str | None], str] = {}
    for path in DOCS:
        rel = path.relative_to(ROOT).as_posix()
        for line, code in _python_blocks(path):
            for ref in _references_in_code(code):
                found.setdefault(ref, f"{rel}:{line}")
    for path in DOCS + SPECS:
        rel = path.relative_to(ROOT).as_posix()
        for n, text in enumerate(path.read_text().splitlines(), 1):
            for span in _TICKED.findall(text):
                for name in _DOTTED.findall(span):
                    if name not in NOT_PYTHON:
                        found.setdefault((name, None), f"{rel}:{n}")
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                continue
            doc = ast.get_docstring(node, clean=False) or ""
            for text in doc.splitlines():
                m = _DOC_IMPORT.match(text)
                if m:
                    for ref in _references_in_code(m.group(1).strip()):
                        where = getattr(node, "name", "the module")
                        found.setdefault(ref, f"{rel} (docstring of {where})")
    return found


def _need_framework(module: str) -> None:
    for prefix, framework in FRAMEWORKS.items():
        if module == prefix or module.startswith(prefix + "."):
            pytest.importorskip(framework)


def _import(module: str) -> object:
    """``importlib.import_module``, refusing a module served from outside this package's
    directory (an editable install of another checkout answers for modules this one lacks)."""
    import ckptstore

    mod = importlib.import_module(module)
    file = getattr(mod, "__file__", None)
    here = pathlib.Path(ckptstore.__file__).resolve().parent
    if file is not None and not pathlib.Path(file).resolve().is_relative_to(here):
        raise ImportError(f"{module} is not in {here} (loaded from {file})", name=module)
    return mod


def _resolve(dotted: str, name: str | None) -> object:
    """What ``from dotted import name`` (name None: ``import dotted`` or, for a dotted name that
    is not a module, the attribute it names) gives."""
    if name is not None:
        _need_framework(dotted)
        module = _import(dotted)
        if hasattr(module, name):
            return getattr(module, name)
        return _import(f"{dotted}.{name}")  # a submodule
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        mod_name = ".".join(parts[:cut])
        _need_framework(mod_name)
        try:
            obj: object = _import(mod_name)
        except ModuleNotFoundError as e:
            if e.name is not None and not mod_name.startswith(e.name):
                raise  # a dependency of the module is missing, not the module
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def _all_lists() -> list[tuple[str, str]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts[-1] == "__main__":
            continue
        module = ".".join(parts)
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AugAssign) else []
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                out += [(module, e.value) for e in ast.walk(node.value)
                        if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return out


DOCUMENTED = _documented()


def test_the_collection_finds_the_documented_names():
    """A changed fence or backtick style would otherwise pass vacuously."""
    names = {m if n is None else f"{m}.{n}" for m, n in DOCUMENTED}
    for expected in ("ckptstore.open", "ckptstore.torch.Checkpointer",
                     "ckptstore.dcp.StorageWriter", "ckptstore.hf.StoreCallback",
                     "ckptstore.lightning.StoreCheckpointIO", "ckptstore.follow.Follower",
                     "ckptstore.interop.import_checkpoint"):
        assert expected in names, expected
    assert len(_all_lists()) > 100


@pytest.mark.parametrize("ref", sorted(DOCUMENTED, key=lambda r: (r[0], r[1] or "")),
                         ids=lambda r: r[0] if r[1] is None else f"{r[0]}:{r[1]}")
def test_documented_name_imports(ref):
    module, name = ref
    try:
        _resolve(module, name)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{DOCUMENTED[ref]} documents {module}{'' if name is None else ' ' + name}, "
                    f"which no longer imports: {e!r}")


@pytest.mark.parametrize("module,name", _all_lists(), ids=lambda x: x)
def test_every_name_in_all_imports(module, name):
    _need_framework(module)
    assert hasattr(_import(module), name), f"{module}.__all__ names {name!r}"


def test_every_module_imports_from_this_package():
    """Every module of the package imports, and every ckptstore module loaded (by these imports
    and by any test run before) comes from this package's directory: a stale import of a moved
    module must fail, not be served by another copy of the package (an editable install of
    another checkout answers for modules this one lacks)."""
    import ckptstore

    here = pathlib.Path(ckptstore.__file__).resolve().parent
    for path in sorted(here.rglob("*.py")):
        parts = list(path.relative_to(here.parent).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        module = ".".join(parts)
        if any(module == m or module.startswith(m + ".") for m in FRAMEWORKS):
            _need_framework(module)
        importlib.import_module(module)
    import sys

    strays = sorted(f"{name}: {mod.__file__}" for name, mod in list(sys.modules.items())
                    if name.split(".")[0] == "ckptstore" and getattr(mod, "__file__", None)
                    and not pathlib.Path(mod.__file__).resolve().is_relative_to(here))
    assert not strays, "ckptstore modules loaded from outside the package:\n" + "\n".join(strays)


@pytest.mark.parametrize("old,new", sorted(REEXPORTS.items()))
def test_documented_paths_reexport_the_moved_modules(old, new):
    _need_framework(old)
    a, b = _import(old), _import(new)
    assert sorted(a.__all__) == sorted(b.__all__)
    for name in b.__all__:
        assert getattr(a, name) is getattr(b, name), name
