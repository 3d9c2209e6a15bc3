"""Every ```python block of README.md and docs/*.md runs.

Conventions, written in the Markdown itself as an HTML comment (invisible once rendered, visible
in the source) on the line right before a block's opening fence:

* no comment: the block is a program of its own. It runs in a fresh namespace, with a fresh
  temporary directory as the current directory (so ``ckptstore.open("runs/gpt")`` creates a store
  there), and must finish within ``TIMEOUT_S`` seconds without raising.
* ``<!-- continue -->``: the block continues the previous block of the same file: the two (or
  more) run as one program, in one namespace and one directory, in the order of the page (a
  setup block, then the examples that use it).
* ``<!-- norun: REASON -->``: not run; REASON says what the block needs that a test on one CPU
  machine does not have (several ranks, a GPU, an S3 server, a framework's trainer with a model and
  a data set, another process) and, where there is one, which test runs the real thing. A norun
  block without a reason is an error, as is a ``continue`` with nothing before it.

Blocks in other languages (```bash, output) are not run. The programs run in this process (torch
is imported once: the whole module takes well under 30 s on 2 cores); the timeout is SIGALRM's.
"""

from __future__ import annotations

import contextlib
import pathlib
import re
import signal
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 20

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!--\s*(norun|continue)\s*(?::\s*(.*?))?\s*-->\s*$")


def _blocks(path: pathlib.Path) -> list[tuple[int, str, str, str]]:
    """(line, marker, reason, code) of every ```python block of ``path``; marker is "",
    "norun" or "continue"."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        if lang == "python":
            before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            mark = _MARK.match(before.strip())
            marker, reason = (mark.group(1), mark.group(2) or "") if mark else ("", "")
            found.append((start + 1, marker, reason, "\n".join(lines[start + 1:i])))
        i += 1
    return found


def _programs() -> list:
    params = []
    for path in DOCS:
        rel = path.relative_to(ROOT).as_posix()
        program: list[tuple[int, str]] = []
        for line, marker, reason, code in _blocks(path):
            if marker == "norun":
                params.append(pytest.param(rel, [(line, code)], reason,
                                           id=f"{rel}:{line}-norun"))
                continue
            if marker == "continue":
                assert program, f"{rel}:{line}: <!-- continue --> with no block before it"
                program.append((line, code))
                continue
            program = [(line, code)]
            params.append(pytest.param(rel, program, None, id=f"{rel}:{line}"))
    return params


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: int):
    def expired(signum, frame):
        raise _Timeout(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_docs_have_python_blocks():
    """The extraction finds the blocks (a changed fence style would otherwise pass vacuously)."""
    programs = _programs()
    assert sum(p.values[2] is None for p in programs) >= 6
    assert any(p.values[0] == "README.md" and p.values[2] is None for p in programs)


@pytest.mark.parametrize("doc,program,norun", _programs())
def test_doc_block_runs(doc, program, norun, tmp_path, monkeypatch):
    if norun is not None:
        assert norun.strip(), f"{doc}:{program[0][0]}: <!-- norun: --> needs a reason"
        pytest.skip(f"norun: {norun}")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for line, code in program:
        compiled = compile(code, f"{doc}:{line}", "exec")
        with warnings.catch_warnings(), _deadline(TIMEOUT_S):
            warnings.simplefilter("ignore")  # e.g. DCP's "no process group" notice
            exec(compiled, namespace)
    for value in list(namespace.values()):  # stores a block left open: close them here
        close = getattr(value, "close", None)
        if type(value).__module__.startswith("ckptstore") and callable(close):
            close()
