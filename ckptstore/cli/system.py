"""About this installation: ``doctor`` (what a bug report needs) and ``demo``."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..errors import CkptStoreError
from ..storage.job_log import is_job_store
from .common import when
from .console import human_bytes, table


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args.dir, iterations=args.iterations, crash_at=args.crash_at)


#: the native kernels (``ckptstore/replay/native/<name>.c``) doctor builds and loads
_KERNELS = ("adam_steps", "topk_select")


_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _doctor_o_direct(directory: str) -> str:
    """Whether the file system of ``directory`` takes an O_DIRECT write: a probe file is created
    there, written through the storage layer's O_DIRECT calls (as a writer would) and removed."""
    import mmap
    import tempfile

    from ..storage import direct
    from ..storage.fileops import FileOps

    if not direct.supported():
        return "no: this platform has no O_DIRECT (appends are buffered)"
    try:
        fd, probe = tempfile.mkstemp(prefix=".ckptstore-doctor-", dir=directory)
    except OSError as e:
        return f"unknown: cannot create a probe file in {directory} ({e.strerror})"
    ops = FileOps()
    direct_fd = None
    try:
        direct_fd = ops.open_direct(probe)
        if direct_fd is None:
            return "no: the file system refuses O_DIRECT opens (appends fall back to buffered)"
        block = mmap.mmap(-1, direct.ALIGN)  # page-aligned, as O_DIRECT needs
        try:
            written = ops.write_direct(direct_fd, probe, memoryview(block), 0)
        finally:
            block.close()
        if written is None:
            return "no: the file system refuses O_DIRECT writes (appends fall back to buffered)"
        return "yes (delta records are written with O_DIRECT)"
    except CkptStoreError as e:
        return f"unknown: the probe failed ({e})"
    finally:
        if direct_fd is not None:
            os.close(direct_fd)
        os.close(fd)
        os.unlink(probe)


def _doctor_fs_type(path: str) -> str:
    """The type of the file system holding ``path`` (the longest mount point of /proc/mounts)."""
    real, best, kind = os.path.realpath(path), "", "unknown"
    try:
        with open("/proc/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, fields[2]
    except OSError:
        return kind
    return f"{kind} (mounted at {best})" if best else kind


def _doctor_kernels() -> list[tuple[str, str]]:
    import shutil

    from ..replay.native import build

    rows = []
    if not build.enabled():
        return [("native kernels", "off (CKPTSTORE_NATIVE="
                 f"{os.environ.get('CKPTSTORE_NATIVE', '')}): replay uses torch's ops, same bits")]
    cc = os.environ.get("CC")
    compiler = shutil.which(cc) if cc else next(
        (found for c in ("cc", "gcc", "clang") if (found := shutil.which(c))), None)
    rows.append(("C compiler", compiler or f"none found ({'$CC=' + cc if cc else 'cc, gcc, clang'}):"
                 " replay uses torch's ops, same bits, slower"))
    rows.append(("kernel cache", str(build.cache_dir())))
    for name in _KERNELS:
        lib = build.load(name)
        rows.append((f"kernel {name}", "built and loaded" if lib is not None else
                     "unavailable (no compiler, a failed build or an unsafe cache directory; "
                     "logger ckptstore.replay.native at INFO says which)"))
    return rows


def _doctor_store(path: str) -> tuple[list[tuple[str, str]], bool]:
    """Rows describing the store at ``path`` and whether it is one (read from STORE files only)."""
    from ..format.header import feature_names
    from ..storage.job_log import JobLayout, job_store_holding, read_job_header
    from ..storage.layout import Layout
    from ..storage.store_file import read_store_header

    def described(h: Any) -> list[tuple[str, str]]:
        return [("format version", str(h.format_version)),
                ("features", ", ".join(feature_names(h.flags)) or "none (readable by releases "
                 "before format features)"),
                ("chunk size", human_bytes(h.chunk_size)),
                ("segment size", human_bytes(h.segment_size)),
                ("created", when(h.created_ns))]

    if "://" in path:
        return [("store", f"{path}: a remote URL (doctor reads local stores; "
                 "`ckptstore fsck URL` checks a remote copy)")], False
    if not os.path.isdir(path):
        return [("store", f"{path}: not a directory")], False
    if is_job_store(path):
        layout = JobLayout(path)
        rows = [("store kind", "multi-rank job store")] + described(read_job_header(layout))[:1]
        epochs = layout.list_epochs()
        streams = sorted(os.listdir(layout.streams_dir)) if os.path.isdir(layout.streams_dir) else []
        rows.append(("writer epochs", f"{len(epochs)}" + (f" (newest {epochs[-1]})" if epochs else "")))
        rows.append(("rank streams", str(len(streams))))
        if streams:
            newest = os.path.join(layout.streams_dir, streams[-1])
            h = read_store_header(Layout(newest))
            rows += [(f"{k} (stream {streams[-1]})", v) for k, v in described(h)]
        return rows, True
    if not os.path.exists(Layout(path).store_file):
        return [("store", f"{path}: no STORE file (not a ckptstore store)")], False
    h = read_store_header(Layout(path))
    job = job_store_holding(path)
    kind = "single-writer store" + (f" (one rank's stream of the job store {job})" if job else "")
    return [("store kind", kind)] + described(h), True


def cmd_doctor(args: argparse.Namespace) -> int:
    import platform
    import shutil

    import numpy
    import torch

    from .. import __version__

    where = args.path if args.path and "://" not in args.path else os.getcwd()
    probe_dir = where if os.path.isdir(where) else os.path.dirname(os.path.abspath(where))
    if args.path and os.path.isdir(args.path):
        # beside the store, never inside it (same file system unless the store is a mount point)
        parent = os.path.dirname(os.path.abspath(args.path))
        if os.stat(parent).st_dev == os.stat(args.path).st_dev and os.access(parent, os.W_OK):
            probe_dir = parent
    rows: list[tuple[str, str]] = [
        ("ckptstore", __version__),
        ("torch", torch.__version__),
        ("numpy", numpy.__version__),
        ("python", f"{platform.python_version()} ({platform.python_implementation()})"),
        ("platform", platform.platform()),
        ("cpus", str(os.cpu_count())),
    ]
    rows += _doctor_kernels()
    rows.append(("O_DIRECT", _doctor_o_direct(probe_dir)))
    rows.append(("file system", _doctor_fs_type(probe_dir)))
    try:
        with open(_THP, encoding="ascii") as f:
            thp = f.read().strip()
    except OSError:
        thp = "unknown (no " + _THP + ")"
    hp = os.environ.get("CKPTSTORE_HUGEPAGES")
    rows.append(("transparent huge pages", thp + (f"; CKPTSTORE_HUGEPAGES={hp}" if hp else "")))
    usage = shutil.disk_usage(probe_dir)
    rows.append(("free space", f"{human_bytes(usage.free)} of {human_bytes(usage.total)} "
                 f"({probe_dir})"))
    env = sorted(k for k in os.environ if k.startswith("CKPTSTORE_"))
    rows.append(("environment", " ".join(f"{k}={os.environ[k]}" for k in env) or "no CKPTSTORE_* set"))
    ok = True
    if args.path:
        try:
            store_rows, ok = _doctor_store(args.path)
        except CkptStoreError as e:  # a damaged or unreadable STORE file: still print the rest
            store_rows, ok = [("store", f"unreadable: {e}")], False
        rows += [("path", os.path.abspath(args.path))] + store_rows
    print(table(rows, ("item", "value")))
    return 0 if ok else 1
