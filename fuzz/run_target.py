"""atheris harness for one target of fuzz/targets.py.

    python fuzz/run_target.py NAME [libFuzzer options] [corpus dirs]

Only the target's own part of ckptstore (COVERAGE_SCOPE) and the targets are instrumented for
coverage (torch, numpy, lz4 and xxhash are imported first, uninstrumented). Any exception other than a CkptStoreError escaping a check is a
finding: libFuzzer writes the input to -artifact_prefix and exits non-zero. fuzz/run_all.py runs
every target this way.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import atheris  # noqa: E402

# Heavy dependencies first, so they are not instrumented.
import json  # noqa: E402,F401
import lz4.block  # noqa: E402,F401
import lmdb  # noqa: E402,F401
import numpy  # noqa: E402,F401
import torch  # noqa: E402,F401
import xxhash  # noqa: E402,F401

#: The modules whose coverage guides each target (the decoders it drives and what they call). A
#: target not named here instruments all of ckptstore. Instrumenting all of it costs every target
#: ~6 s of start-up on 2 cores (the bytecode of ~150 modules rewritten at import); a decoder-only
#: target reaches none of the rest, so its coverage signal is the same without it.
COVERAGE_SCOPE: dict[str, tuple[str, ...]] = {
    "records": ("ckptstore.format",),
    "header": ("ckptstore.format",),
    "commit": ("ckptstore.format",),
    "tree": ("ckptstore.format",),
    "chunk": ("ckptstore.format",),
    "state": ("ckptstore.format",),
    "state_roundtrip": ("ckptstore.format",),
    "manifest": ("ckptstore.format", "ckptstore.tensors"),
    "segment": ("ckptstore.format", "ckptstore.storage"),
    "global_log": ("ckptstore.format", "ckptstore.storage"),
    "job_head": ("ckptstore.format", "ckptstore.remote.job_head"),
}


def modules_outside(scope: tuple[str, ...]) -> list[str]:
    """Every module of the ckptstore package (found on disk, nothing imported) outside ``scope``:
    atheris's ``include`` takes whole top-level packages, its ``exclude`` exact module names."""
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ckptstore")
    names = []
    for folder, _, files in os.walk(root):
        package = os.path.relpath(folder, os.path.dirname(root)).replace(os.sep, ".")
        for f in files:
            if f.endswith(".py"):
                names.append(package if f == "__init__.py" else f"{package}.{f[:-3]}")
    return [n for n in names if not any(n == s or n.startswith(s + ".") for s in scope)]


_scope = COVERAGE_SCOPE.get(sys.argv[1] if len(sys.argv) > 1 else "", ("ckptstore",))

with atheris.instrument_imports(include=["ckptstore", "fuzz"], exclude=modules_outside(_scope)):
    import ckptstore  # noqa: F401
    import ckptstore.ops.fsck  # noqa: F401
    import ckptstore.replay.gradcodecs  # noqa: F401
    import ckptstore.engine.read_path  # noqa: F401
    import ckptstore.replay  # noqa: F401
    import ckptstore.storage.log  # noqa: F401
    import ckptstore.storage.segments  # noqa: F401
    import ckptstore.tensors  # noqa: F401
    import ckptstore.torch  # noqa: F401
    from fuzz import targets


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in targets.TARGETS:
        sys.exit(f"usage: run_target.py NAME [libFuzzer args]; NAME is one of {sorted(targets.TARGETS)}")
    name = sys.argv[1]
    check = targets.TARGETS[name]
    if name in ("delta", "replay_base"):
        targets.delta_fixture()  # build the real chain once, outside the timed inputs
    atheris.Setup([sys.argv[0], *sys.argv[2:]], check)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
