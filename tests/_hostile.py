"""Hostile-store helpers for tests/test_security.py (not a test module).

* :func:`boom_pickle` -- a pickle that creates a marker directory when unpickled.
* :func:`append_checkpoint` -- what a malicious writer can do: append a checkpoint whose records
  all carry valid checksums and addresses but whose manifest JSON is any document it likes.
* ``python tests/_hostile.py SPEC.json`` -- runs every read operation (API and CLI) named in the
  spec twice: once to warm up imports, then under a ``sys.addaudithook`` that records every event
  that would mean code execution from data (unpickling, marshal, exec/eval/compile, processes)
  and every file-system change outside the allowed directories. Prints one JSON report.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
from typing import Any

#: Audit events that must never fire while ckptstore reads a store.
FORBIDDEN = ("pickle.find_class", "marshal.loads", "marshal.load", "exec", "compile",
             "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "subprocess.Popen",
             "ctypes.dlopen", "import")
#: Audit events that change the file system; their first argument is a path.
FS_CHANGES = ("os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.symlink", "os.link",
              "os.truncate", "os.chmod", "os.chown", "os.utime", "shutil.rmtree")


class _Boom:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def boom_pickle(marker: str, protocol: int = 2) -> bytes:
    return pickle.dumps({"weights": _Boom(marker)}, protocol=protocol)


def boom_torch_file(marker: str) -> bytes:
    """A torch.save archive whose data.pkl would create ``marker`` under torch.load(weights_only=False)."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save({"w": torch.zeros(2), "evil": _Boom(marker)}, buf)
    return buf.getvalue()


def boom_npy(marker: str) -> bytes:
    """A .npy file with an object array: numpy.load(allow_pickle=True) would create ``marker``."""
    import io

    import numpy as np

    buf = io.BytesIO()
    arr = np.empty(1, dtype=object)
    arr[0] = _Boom(marker)
    np.save(buf, arr, allow_pickle=True)
    return buf.getvalue()


def append_checkpoint(path: str, iteration: int, doc: dict, chunks: list[bytes] = (),
                      chunk_size: int = 1 << 20,
                      trees: list[tuple[int, int, list[bytes]]] = ()) -> None:
    """Append a committed checkpoint: RAW chunk records for ``chunks`` (each with its TREE, as a
    one-chunk tensor), a TREE record for each ``(nbytes, chunk_size, addresses)`` of ``trees``,
    then ``doc`` as the manifest, then a COMMIT naming it -- every checksum and digest valid, as
    only a malicious (or buggy) writer would produce."""
    import xxhash

    import ckptstore
    from ckptstore.format import records as rec
    from ckptstore.format.chunk import Codec, address_of, encode_chunk_header
    from ckptstore.format.commit import Commit, encode_commit
    from ckptstore.format.tree import encode_tree, make_tree

    with ckptstore.open(path, "a") as s:
        size = s.segment_size
        for raw in chunks:
            addr = address_of(raw)
            s.log.append(rec.RecordType.CHUNK, [encode_chunk_header(addr, Codec.RAW, len(raw)), raw], size)
            s.log.append(rec.RecordType.TREE, [encode_tree(make_tree(len(raw), chunk_size, [addr]))], size)
        for nbytes, tree_chunk_size, addresses in trees:
            s.log.append(rec.RecordType.TREE, [encode_tree(make_tree(nbytes, tree_chunk_size, addresses))],
                         size)
        payload = json.dumps(doc).encode()
        mloc = s.log.append(rec.RecordType.MANIFEST, [payload], size)
        s.log.writer.sync()
        c = Commit(iteration, mloc.seq, mloc.offset, mloc.length, xxhash.xxh3_128_digest(payload),
                   bytes(16), time.time_ns(), 0, 0)
        s.log.append(rec.RecordType.COMMIT, [encode_commit(c)], size)
        s.log.writer.sync()
        s.index.clear()  # the next open rebuilds the index from the log
        s.engine.mark_unclean()


# ---- the audited run (a separate process: audit hooks cannot be removed) ----------------------

def _operations(spec: dict) -> list[tuple[str, Any]]:
    import ckptstore
    from ckptstore.cli import main as cli
    from ckptstore.ops.fsck import check

    path, out = spec["path"], spec["out"]
    ops: list[tuple[str, Any]] = []

    def with_reader(fn):
        def run():
            with ckptstore.open(path, "r") as r:
                return fn(r)
        return run

    ops.append(("open+iterations", with_reader(lambda r: r.iterations())))
    for it in spec["iterations"]:
        ops.append((f"info {it}", with_reader(lambda r, it=it: r.info(it))))
        ops.append((f"manifest {it}", with_reader(lambda r, it=it: r.manifest(it))))
        ops.append((f"meta {it}", with_reader(lambda r, it=it: r.meta(it))))
        ops.append((f"load {it}", with_reader(lambda r, it=it: r.load(it))))
        ops.append((f"load_record {it}", with_reader(lambda r, it=it: r.load_record(it))))
        for name, cmd in (("show", ["show", path, str(it)]),
                          ("restore torch", ["restore", path, str(it), "--out",
                                             os.path.join(out, f"{it}.pt")]),
                          ("restore safetensors", ["restore", path, str(it), "--out",
                                                   os.path.join(out, f"{it}.safetensors"),
                                                   "--format", "safetensors"])):
            ops.append((f"cli {name} {it}", lambda cmd=cmd: cli(cmd)))
    its = spec["iterations"]
    for a, b in zip(its, its[1:]):
        ops.append((f"diff {a} {b}", with_reader(lambda r, a=a, b=b: r.diff(a, b))))
        ops.append((f"cli diff {a} {b}", lambda a=a, b=b: cli(["diff", path, str(a), str(b), "--all"])))
    ops.append(("cli ls", lambda: cli(["ls", path])))
    ops.append(("fsck", lambda: check(path).lines()))
    ops.append(("cli fsck", lambda: cli(["fsck", path])))
    if spec.get("writer"):
        ops.append(("fsck --repair", lambda: check(path, repair=True).lines()))
        ops.append(("writer open+iterations", lambda: _writer(path, lambda s: s.iterations())))
        ops.append(("gc", lambda: _writer(path, lambda s: s.gc(keep_last=len(its) + 5))))
    return ops


def _writer(path: str, fn):
    import ckptstore

    with ckptstore.open(path, "a") as s:
        return fn(s)


def _run_all(spec: dict) -> dict[str, str]:
    from ckptstore.errors import CkptStoreError

    results: dict[str, str] = {}
    for name, fn in _operations(spec):
        try:
            v = fn()
            results[name] = "ok" if not isinstance(v, int) or v == 0 else f"exit {v}"
        except CkptStoreError as e:
            results[name] = f"{type(e).__name__}: {str(e)[:200]}"
        except Exception as e:  # noqa: BLE001 - reported as a failure by the test
            import traceback

            results[name] = f"UNTYPED {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
    return results


def main(spec_file: str) -> None:
    with open(spec_file) as f:
        spec = json.load(f)
    # warm up on a copy (the writer operations repair the store): every lazy import happens
    # now, before the audit hook is installed
    import shutil

    warm = spec["path"] + ".warm-up"
    shutil.copytree(spec["path"], warm)
    _run_all(dict(spec, path=warm))
    shutil.rmtree(warm)
    for name in os.listdir(spec["out"]):
        os.unlink(os.path.join(spec["out"], name))
    allowed = [os.path.realpath(p) for p in spec["allowed_dirs"]]
    events: list[str] = []
    writes: list[str] = []

    def inside(p: Any) -> bool:
        try:
            real = os.path.realpath(os.fsdecode(p))
        except (TypeError, ValueError):
            return False
        return any(real == a or real.startswith(a + os.sep) for a in allowed)

    def hook(event: str, args: tuple) -> None:
        if event in FORBIDDEN or event.startswith(("os.exec", "os.spawn", "os.posix_spawn")):
            events.append(f"{event} {str(args)[:120]}")
        elif event == "open" and args and isinstance(args[0], (str, bytes)):
            mode, flags = args[1], args[2]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                (isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            if writing and not inside(args[0]):
                writes.append(f"open {args[0]!r} mode={mode!r} flags={flags}")
        elif event in FS_CHANGES and args and isinstance(args[0], (str, bytes, os.PathLike)):
            if not inside(args[0]) or (event == "os.rename" and not inside(args[1])):
                writes.append(f"{event} {args[:2]!r}")

    sys.addaudithook(hook)
    results = _run_all(spec)
    print(json.dumps({"results": results, "events": events, "writes_outside": writes,
                      "marker": os.path.exists(spec["marker"])}))


if __name__ == "__main__":
    main(sys.argv[1])
