"""atheris harness for one target of fuzz/targets.py.

    python fuzz/run_target.py NAME [libFuzzer options] [corpus dirs]

Only ckptstore and the targets are instrumented for coverage (torch, numpy, lz4 and xxhash are
imported first, uninstrumented). Any exception other than a CkptStoreError escaping a check is a
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

with atheris.instrument_imports(include=["ckptstore", "fuzz"]):
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
