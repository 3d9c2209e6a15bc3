"""harness: what every benchmark in tools/ shares, so that each one holds only what it measures.

A benchmark, in order:

1. ``ap = parser(__doc__)``; its own options; ``add_standard_args(ap, rounds=N)``: ``--rounds N``
   (interleaved rounds), ``--json OUT`` (every sample and the aggregates), ``--quick`` (the
   smallest settings that still measure everything: a smoke run);
2. ``m = machine()`` and ``print(header(title, m))``: CPUs, load average, Python, torch and
   ckptstore versions, the date (UTC), whatever the tool adds;
3. ``samples = interleave(names, rounds, run)``: every round runs every named strategy (or peer)
   once, the order rotated by one each round, so that a shared machine's drift hits each alike;
   ``run(name, r)`` returns seconds, a dict of figures or a list of either;
4. ``samples.stats(name)`` / :meth:`Stats.of`: median, mean, min-max and stdev;
   ``table(headers, rows)``: a Markdown table (columns padded: readable as text too);
5. ``write_json(a.json, tool, a, m, samples, aggregates)``: every sample plus the aggregates.

Also the file-system helpers several tools need (fsync, page-cache eviction, sizes, O_DIRECT
bandwidth), the load-average sampling that flags a run other processes competed with, and the
glibc malloc settings the large-state tools re-execute themselves with (shared/MEASUREMENTS.md).
Nothing here imports ckptstore or torch at import time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import mmap
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Sequence

MiB = 1 << 20
GB = 1e9
TOOLS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TOOLS)

#: glibc settings for the large-state tools: this VM's fresh allocations are slow and bimodal
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "268435456", "MALLOC_TRIM_THRESHOLD_": "1073741824"}


# ---- command line ------------------------------------------------------------------------------
def parser(doc: str | None) -> argparse.ArgumentParser:
    """An ArgumentParser whose description is ``doc``'s first paragraph (the tool's docstring)."""
    return argparse.ArgumentParser(description=(doc or "").split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_standard_args(ap: argparse.ArgumentParser, rounds: int | None = 3,
                      rounds_help: str = "interleaved rounds over the strategies",
                      aliases: Sequence[str] = (), quick_help: str = "") -> None:
    """``--rounds N`` (omitted with ``rounds=None``: a tool without rounds; ``aliases``: the
    tool's older names for it), ``--json OUT`` and ``--quick``."""
    if rounds is not None:
        ap.add_argument("--rounds", *aliases, dest="rounds", type=int, default=rounds,
                        help=f"{rounds_help} (default {rounds})")
    ap.add_argument("--json", metavar="OUT", default=None,
                    help="also write every sample and the aggregates as JSON")
    ap.add_argument("--quick", action="store_true",
                    help=quick_help or "the smallest settings: a smoke run, not a measurement")


def quick(a: argparse.Namespace, ap: argparse.ArgumentParser, **small: Any) -> None:
    """With ``--quick``: each of ``small`` (option dest -> value) the user left at its default
    takes the small value (an option given on the command line keeps it)."""
    if not a.quick:
        return
    for key, value in small.items():
        if getattr(a, key) == ap.get_default(key):
            setattr(a, key, value)


# ---- the machine -------------------------------------------------------------------------------
def load_average() -> str:
    return "{:.2f} {:.2f} {:.2f} (1/5/15 min)".format(*os.getloadavg())


def machine(**extra: Any) -> dict[str, Any]:
    """The machine header: date (UTC), CPUs, load average, memory available, Python, torch and
    ckptstore (with its git revision) versions, then ``extra``."""
    out: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(), "load average": load_average(),
        "memory available": f"{mem_available() / 2**30:.1f} GiB",
        "python": platform.python_version()}
    try:
        import torch
        out["torch"] = f"{torch.__version__} ({torch.get_num_threads()} threads)"
    except ImportError:
        out["torch"] = "missing"
    out["ckptstore"] = ckptstore_version()
    out.update(extra)
    return out


def ckptstore_version() -> str:
    """ckptstore's version and the git revision of the checkout it is imported from."""
    if REPO not in sys.path:
        sys.path.append(REPO)  # (an installed ckptstore, earlier on the path, wins)
    import ckptstore

    repo = os.path.dirname(os.path.dirname(os.path.abspath(ckptstore.__file__)))
    try:
        rev = subprocess.run(["git", "-C", repo, "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return f"{ckptstore.__version__} ({rev or '?'})"


def header(title: str, m: dict[str, Any]) -> str:
    """``title`` and one indented line per machine entry."""
    return "\n".join([title, *(f"  {k}: {v}" for k, v in m.items())])


def load_summary(loads: Sequence[float]) -> str:
    """The 1-minute load averages sampled during a run, with a warning when other processes
    competed for the CPUs (median above the CPU count)."""
    if not loads:
        return "?"
    mid = statistics.median(loads)
    line = f"median {mid:.2f}, max {max(loads):.2f} (1 min, sampled during the run)"
    if mid > (os.cpu_count() or 1) + 0.5:
        line += "  WARNING: other processes competed for the CPUs; treat the numbers with care"
    return line


def mem_available() -> int:
    """MemAvailable of /proc/meminfo, bytes (0 where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def ensure_malloc_env(script: str, refuse: bool) -> str:
    """Re-execute ``script`` with :data:`MALLOC_ENV` set unless they are set already or
    ``refuse`` (``--no-malloc-env``); returns a line saying which settings the run has."""
    mark = "CKPTSTORE_BENCH_REEXECUTED"
    missing = {k: v for k, v in MALLOC_ENV.items() if k not in os.environ}
    if missing and not refuse and not os.environ.get(mark):
        env = dict(os.environ, **missing, **{mark: "1"})
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, os.path.abspath(script), *sys.argv[1:]], env)
    values = " ".join(f"{k}={os.environ.get(k, '(unset)')}" for k in MALLOC_ENV)
    if os.environ.get(mark):
        return f"{values} (re-executed with these set)"
    if missing:
        return f"{values} (--no-malloc-env: glibc defaults where unset)"
    return f"{values} (inherited from the environment)"


# ---- statistics --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stats:
    """Summary of a sample list: count, median, mean, min, max, stdev (0 for one sample)."""

    n: int
    median: float
    mean: float
    min: float
    max: float
    stdev: float

    @classmethod
    def of(cls, xs: Iterable[float]) -> "Stats":
        v = [float(x) for x in xs]
        if not v:
            nan = math.nan
            return cls(0, nan, nan, nan, nan, nan)
        return cls(len(v), statistics.median(v), statistics.fmean(v), min(v), max(v),
                   statistics.stdev(v) if len(v) > 1 else 0.0)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def spread(self, spec: str = ".3f") -> str:
        """``min-max``."""
        return f"{self.min:{spec}}-{self.max:{spec}}" if self.n else "-"

    def show(self, scale: float = 1.0, spec: str = ".3f", unit: str = "") -> str:
        """``median (mean, min-max, sd, n)``, each value times ``scale``."""
        if not self.n:
            return "-"
        f = lambda x: format(x * scale, spec)  # noqa: E731
        return (f"{f(self.median)}{unit} (mean {f(self.mean)}, {f(self.min)}-{f(self.max)}, "
                f"sd {f(self.stdev)}, n {self.n})")


def median(xs: Iterable[float]) -> float | None:
    """The median, None for no samples."""
    v = list(xs)
    return statistics.median(v) if v else None


# ---- interleaved rounds ------------------------------------------------------------------------
def rotated(items: Iterable[Any], r: int) -> list[Any]:
    """``items`` rotated left by ``r`` (round r's order: each item goes first in turn)."""
    items = list(items)
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


class Samples:
    """Every sample of a run: per strategy name, rows (dicts) with the round they came from and
    the figures the strategy returned (``seconds`` for a bare number; a figure may be a list:
    one call's several samples)."""

    def __init__(self) -> None:
        self.rows: dict[str, list[dict[str, Any]]] = {}

    def add(self, name: str, r: int, value: Any) -> None:
        """Record what ``run`` returned: a number, a dict, a list of either, or None (nothing)."""
        if value is None:
            return
        if isinstance(value, list):
            for v in value:
                self.add(name, r, v)
            return
        row = dict(value) if isinstance(value, dict) else {"seconds": float(value)}
        self.rows.setdefault(name, []).append({"round": r, **row})

    def values(self, name: str, key: str = "seconds") -> list[float]:
        """``key`` of every row of ``name``, in order; a row holding a list gives each item."""
        out: list[float] = []
        for row in self.rows.get(name, []):
            v = row.get(key)
            out.extend(v if isinstance(v, list) else [] if v is None else [v])
        return out

    def stats(self, name: str, key: str = "seconds") -> Stats:
        return Stats.of(self.values(name, key))

    def aggregates(self, key: str = "seconds") -> dict[str, dict[str, float]]:
        """:class:`Stats` of ``key`` per strategy, as dicts (for JSON)."""
        return {name: self.stats(name, key).as_dict() for name in self.rows}


def interleave(names: Sequence[str], rounds: int, run: Callable[[str, int], Any], *,
               samples: Samples | None = None,
               between: Callable[[], None] | None = None) -> Samples:
    """Run every strategy of ``names`` once per round for ``rounds`` rounds, round r in the
    order :func:`rotated` by r; ``run(name, r)``'s return is recorded (:meth:`Samples.add`);
    ``between()`` runs before each call (a settle: sync, sleep)."""
    samples = samples if samples is not None else Samples()
    for r in range(rounds):
        for name in rotated(names, r):
            if between is not None:
                between()
            samples.add(name, r, run(name, r))
    return samples


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of ``fn()``."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def timed_between(fn: Callable[[], Any], barrier: Callable[[], Any]) -> float:
    """Seconds of a collective ``fn()`` between two ``barrier()`` calls (every rank calls it;
    rank 0's figure is the job's)."""
    barrier()
    t0 = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - t0


# ---- output ------------------------------------------------------------------------------------
def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def ratio(x: float | None, y: float | None, spec: str = ".2f") -> str:
    return fmt(x / y if x is not None and y else None, spec)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], left: int | None = 1) -> str:
    """A Markdown table, columns padded to their widths; the first ``left`` columns are
    left-aligned, the rest right-aligned (numbers). ``left=None``: each column is right-aligned
    when every cell of it reads as a number, else left-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(3, len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    if left is None:
        right = [bool(cells) and all(_is_number(r[i]) for r in cells) for i in range(len(headers))]
    else:
        right = [i >= left for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if r else c.ljust(w)
                                 for c, w, r in zip(row, widths, right)) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" if r else "-" * (w + 2)
                          for w, r in zip(widths, right)) + "|"
    return "\n".join([line(list(headers)), rule, *map(line, cells)])


def _is_number(s: str) -> bool:
    try:
        float(s.replace(",", ""))
    except ValueError:
        return False
    return True


def write_json(path: str | None, tool: str, a: argparse.Namespace | dict, m: dict[str, Any],
               samples: Samples | dict | list, aggregates: Any, **extra: Any) -> None:
    """Write ``{"tool", "config", "machine", "samples", "aggregates", **extra}`` to ``path``
    (nothing without one); values JSON cannot hold are written as strings."""
    if not path:
        return
    config = vars(a) if isinstance(a, argparse.Namespace) else a
    doc = {"tool": tool, "config": config, "machine": m,
           "samples": samples.rows if isinstance(samples, Samples) else samples,
           "aggregates": aggregates, **extra}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(f"{tool}: wrote {path}", file=sys.stderr)


def log(msg: str) -> None:
    """Progress, on stderr (the report goes to stdout)."""
    print(msg, file=sys.stderr, flush=True)


# ---- files -------------------------------------------------------------------------------------
def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file under ``path`` (or ``path`` itself), its directories and its parent."""
    if os.path.isdir(path):
        for root, _, files in os.walk(path):
            for name in files:
                fsync_path(os.path.join(root, name))
            fsync_path(root)
    else:
        fsync_path(path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def files_under(path: str) -> list[str]:
    return [path] if os.path.isfile(path) else \
        [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]


def evict_files(*paths: str) -> None:
    """Drop the page cache of every file under ``paths`` (posix_fadvise DONTNEED after a sync:
    clean pages go; works without privileges, unlike drop_caches): the next read is cold."""
    os.sync()
    for top in paths:
        for name in files_under(top):
            fd = os.open(name, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_tree(path: str) -> None:
    """Read every file under ``path`` once (into the page cache, as far as it fits): warm."""
    buf = bytearray(16 * MiB)
    for name in files_under(path):
        with open(name, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def tree_bytes(path: str) -> tuple[int, int]:
    """(apparent bytes: the files' sizes, allocated bytes: st_blocks x 512) under ``path``."""
    apparent = allocated = 0
    for name in files_under(path):
        st = os.lstat(name)
        apparent += st.st_size
        allocated += st.st_blocks * 512
    return apparent, allocated


def dir_bytes(path: str) -> int:
    """The sizes of the files under ``path``, summed."""
    return tree_bytes(path)[0]


def filesystem_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (from /proc/self/mountinfo)."""
    real = os.path.realpath(path)
    best, fstype = "", "unknown"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mnt = left.split()[4]
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, fstype = mnt, right.split()[0]
    except OSError:
        pass
    return fstype


def direct_write_bandwidth(directory: str, total: int = 256 << 20) -> float | None:
    """Bytes/s of O_DIRECT writes of 8 MiB from a page-aligned reused buffer + fsync in
    ``directory`` (the disk's limit for the writer's path), best of 3; None where O_DIRECT is
    refused."""
    buf = mmap.mmap(-1, 8 << 20)
    buf[:] = os.urandom(8 << 20)
    path = os.path.join(directory, "direct-bandwidth.tmp")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0),
                     0o644)
    except OSError:
        return None
    try:
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            for off in range(0, total, 8 << 20):
                os.pwrite(fd, memoryview(buf), off)
            os.fsync(fd)
            best = min(best, time.perf_counter() - t0)
        return total / best
    except OSError:
        return None
    finally:
        os.close(fd)
        os.unlink(path)


if __name__ == "__main__":
    print(header("harness: this machine", machine()))
