"""Compiles the package's C kernels into shared libraries, once per machine, and loads them.

No Python extension module and no build step at install time: a kernel is a plain C file next
to this module, compiled on first use with the system C compiler (``$CC``, else ``cc``, ``gcc``
or ``clang``) into a per-user cache and loaded with :mod:`ctypes` (whose calls release the GIL).
Everything here is optional: with no compiler, a failed build or ``CKPTSTORE_NATIVE=0`` in the
environment, :func:`load` returns None and callers keep their pure-torch path.

Invariants:
* a cached library is named by a digest of its source, the compiler's identity, the flags and
  this CPU's feature flags (``-march=native`` code must never run on a CPU without them, e.g.
  a home directory shared by a cluster's nodes);
* a library appears in the cache only whole: it is compiled to a temporary name in the cache
  directory, then renamed over the final name (concurrent builders race harmlessly);
* the cache directory is created private to the user (mode 0700), and neither it nor the library
  is used unless this user owns it and no one else may write it, because whatever library is
  there gets loaded into the process.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger("ckptstore.replay.native")

#: -ffp-contract=off: only explicit fmaf() calls fuse, so the kernels round exactly as written.
#: -fno-math-errno lets sqrtf vectorize. Never -ffast-math.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")
#: Seconds a compile may take before it counts as failed.
COMPILE_TIMEOUT_S = 120

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def enabled() -> bool:
    """False when ``CKPTSTORE_NATIVE`` is set to 0 / false / no / off."""
    return os.environ.get("CKPTSTORE_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """``$CKPTSTORE_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/ckptstore/kernels``, else
    ``~/.cache/ckptstore/kernels``."""
    explicit = os.environ.get("CKPTSTORE_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ckptstore" / "kernels"


def load(name: str) -> ctypes.CDLL | None:
    """The compiled kernel ``name`` (``<name>.c`` beside this module), built on first use;
    None when native kernels are off or cannot be built here. Cached per process."""
    if not enabled():
        return None
    with _lock:
        if name not in _loaded:
            _loaded[name] = _build_and_load(name)
        return _loaded[name]


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    for c in ("cc", "gcc", "clang"):
        found = shutil.which(c)
        if found:
            return found
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _private(path: Path) -> bool:
    """Owned by this user and writable by no one else (whatever is there gets loaded)."""
    st = os.stat(path)
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _build_and_load(name: str) -> ctypes.CDLL | None:
    src = Path(__file__).with_name(f"{name}.c")
    cc = _compiler()
    if cc is None:
        log.info("no C compiler: native kernel %s not built", name)
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=COMPILE_TIMEOUT_S).stdout
        key = hashlib.sha256("\0".join([src.read_text(), version, " ".join(CFLAGS), _cpu_flags(),
                                        platform.machine()]).encode()).hexdigest()[:20]
        out_dir = cache_dir()
        out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not _private(out_dir):
            log.info("native kernel %s not built: %s is not a directory only this user can write",
                     name, out_dir)
            return None
        target = out_dir / f"{name}-{key}.so"
        if not target.exists():
            fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=out_dir)
            os.close(fd)
            try:
                done = subprocess.run([cc, *CFLAGS, str(src), "-o", tmp, "-lm"], capture_output=True,
                                      text=True, timeout=COMPILE_TIMEOUT_S)
                if done.returncode != 0:
                    log.info("native kernel %s did not compile: %s", name, done.stderr[-2000:])
                    return None
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        if not _private(target):
            log.info("native kernel %s not loaded: %s is writable by another user", name, target)
            return None
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        log.info("native kernel %s unavailable: %s", name, e)
        return None
