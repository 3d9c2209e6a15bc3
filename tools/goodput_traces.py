"""Failures for the goodput simulator (tools/goodput.py): the public preemption traces' parsers
(Bamboo, PCcheck's GPU trace), traces compressed in time (bench_goodput's scenarios), Poisson
failures at a rate (LLaMA 3's per GPU, scaled) and :class:`Scenario`, which yields a run's
failure times from either. tools/goodput.py's docstring says what each trace's failures are.
"""

from __future__ import annotations

import itertools
import math
import os
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

#: LLaMA 3 report: 419 unexpected interruptions in 54 days of pre-training on 16,384 H100 GPUs
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16384


class TraceFormatError(ValueError):
    """A trace file does not parse: ``path`` and ``line`` (1-based) locate the bad row."""

    def __init__(self, path: str | os.PathLike, line: int, reason: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        super().__init__(f"{self.path}, line {line}: {reason}")


# ---- failure scenarios ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Trace:
    """Failure times of a trace, as offsets in ``(0, period_s]`` from its first row, and the
    trace's time resolution (the smallest gap between two of its row times)."""

    name: str
    failures: tuple[float, ...]
    period_s: float
    resolution_s: float = 0.0

    @property
    def mtbf_s(self) -> float:
        return self.period_s / len(self.failures) if self.failures else math.inf


def llama3_rate_per_hour(gpus: int) -> float:
    """A job's failure rate (per hour) at LLaMA 3's per-GPU rate: 419 in 54 days on 16,384 GPUs."""
    if not gpus > 0:
        raise ValueError(f"GPU count must be positive, got {gpus}")
    return gpus * LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)


def check_rate(rate_per_hour: float) -> float:
    """``rate_per_hour`` if it is a positive finite number, else ValueError."""
    if not (rate_per_hour > 0 and math.isfinite(rate_per_hour)):
        raise ValueError(f"failure rate must be a positive number per hour, got {rate_per_hour}")
    return rate_per_hour


def poisson_failure_times(rate_per_hour: float, seed: int) -> Iterator[float]:
    """Failure times (s) of a Poisson process at ``rate_per_hour``: unit-rate exponential draws of
    ``random.Random(seed)`` scaled by the mean time between failures."""
    mean = 3600.0 / check_rate(rate_per_hour)
    rng = random.Random(seed)
    t = 0.0
    while True:
        t += rng.expovariate(1.0) * mean
        yield t


def trace_failure_times(trace: Trace, start_s: float = 0.0,
                        rng: random.Random | None = None) -> Iterator[float]:
    """Failure times (s) of a job that starts ``start_s`` into ``trace``, the trace repeated. With
    ``rng``, each failure is placed uniformly within the resolution before its recorded time (a row
    only says the failure happened since the row before)."""
    offsets = sorted(((f - start_s) % trace.period_s) or trace.period_s for f in trace.failures)
    if not offsets:
        return
    cycle, last = 0, -math.inf
    while True:
        for f in offsets:
            t = cycle * trace.period_s + f
            if rng is not None:
                t -= rng.random() * trace.resolution_s
            if t <= 0:
                # (placed before the job's start: a failure of the trace, not of this job; until
                # 2026-11-30 it was yielded, bench_goodput killed the job as it started, and the
                # simulator, which counts failures after 0 only, did not: 5 failures against 4)
                continue
            last = max(last, t)
            yield last
        cycle += 1


def _trace(path: Path, times: list[float], failures: list[float], line: int) -> Trace:
    if len(times) < 2 or times[-1] <= times[0]:
        raise TraceFormatError(path, line, "a trace needs rows spanning a positive duration")
    period = times[-1] - times[0]
    offs = sorted({(f - times[0]) or period for f in failures})
    resolution = min(b - a for a, b in itertools.pairwise(times) if b > a)
    return Trace(path.stem.removesuffix("-trace"), tuple(offs), period, resolution)


def parse_bamboo_trace(path: str | os.PathLike, lines: Iterable[tuple[int, list[str]]]) -> Trace:
    """Rows ``t_ms,add|remove,nodeN`` (no header), times non-decreasing. Each distinct time with a
    removal is one failure."""
    path = Path(path)
    times: list[float] = []
    failures: list[float] = []
    line = 0
    for line, row in lines:
        if len(row) != 3:
            raise TraceFormatError(path, line, f"expected 't_ms,add|remove,node', got {len(row)} fields")
        t_ms, action, node = (c.strip() for c in row)
        try:
            t = float(t_ms) / 1000.0
        except ValueError:
            raise TraceFormatError(path, line, f"time {t_ms!r} is not a number of milliseconds") from None
        if not (math.isfinite(t) and t >= 0):
            raise TraceFormatError(path, line, f"time {t_ms!r} is not a non-negative number")
        if times and t < times[-1]:
            raise TraceFormatError(path, line, f"time {t_ms} ms goes back (previous row: "
                                               f"{times[-1] * 1e3:g})")
        if action not in ("add", "remove"):
            raise TraceFormatError(path, line, f"action {action!r} is neither 'add' nor 'remove'")
        if not node:
            raise TraceFormatError(path, line, "empty node name")
        times.append(t)
        if action == "remove":
            failures.append(t)
    return _trace(path, times, failures, line)


def parse_pccheck_trace(path: str | os.PathLike, lines: Iterable[tuple[int, list[str]]]) -> Trace:
    """Rows ``index,unix_seconds,gpus`` after the header ``,Time,GPUs``, times increasing. Each row
    with fewer GPUs than the row before is one failure."""
    path = Path(path)
    times: list[float] = []
    failures: list[float] = []
    gpus_before = None
    line = 0
    for line, row in lines:
        if len(row) != 3:
            raise TraceFormatError(path, line, f"expected 'index,Time,GPUs', got {len(row)} fields")
        try:
            t, gpus = float(row[1]), int(row[2])
        except ValueError:
            raise TraceFormatError(path, line,
                                   f"Time {row[1]!r} or GPUs {row[2]!r} is not a number") from None
        if not math.isfinite(t) or gpus < 0:
            raise TraceFormatError(path, line, f"bad Time {row[1]!r} or GPU count {row[2]!r}")
        if times and t <= times[-1]:
            raise TraceFormatError(path, line, f"Time {row[1]} does not increase")
        if gpus_before is not None and gpus < gpus_before:
            failures.append(t)
        times.append(t)
        gpus_before = gpus
    return _trace(path, times, failures, line)


def load_trace(path: str | os.PathLike) -> Trace:
    """Parse a Bamboo or PCcheck trace, told apart by the first row (PCcheck's has a header).
    Raises :class:`TraceFormatError` naming the file and line of the first bad row."""
    path = Path(path)
    rows = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                text = raw.decode()
            except UnicodeDecodeError:
                raise TraceFormatError(path, n, "not UTF-8 text") from None
            if text.strip():
                rows.append((n, text.rstrip("\r\n").split(",")))
    if not rows:
        raise TraceFormatError(path, 1, "empty trace")
    line, head = rows[0]
    if [c.strip() for c in head] == ["", "Time", "GPUs"]:
        return parse_pccheck_trace(path, rows[1:])
    if len(head) == 3 and head[1].strip() in ("add", "remove"):
        return parse_bamboo_trace(path, rows)
    raise TraceFormatError(path, line, "neither a Bamboo trace (t_ms,add|remove,node) nor a "
                                       "PCcheck one (header ',Time,GPUs')")


def load_traces(directory: str | os.PathLike) -> list[Trace]:
    """Every ``*.csv`` trace in ``directory``, by file name."""
    return [load_trace(p) for p in sorted(Path(directory).glob("*.csv"))]


@dataclass(frozen=True)
class Scenario:
    """Where failures come from: a Poisson rate (per hour) or a trace."""

    name: str
    rate_per_hour: float | None = None
    trace: Trace | None = None

    def __post_init__(self) -> None:
        if (self.rate_per_hour is None) == (self.trace is None):
            raise ValueError("a scenario has either a rate or a trace")
        if self.rate_per_hour is not None:
            check_rate(self.rate_per_hour)

    @property
    def mtbf_s(self) -> float:
        if self.trace is not None:
            return self.trace.mtbf_s
        assert self.rate_per_hour is not None
        return 3600.0 / self.rate_per_hour

    def failure_times(self, seed: int, run: int) -> Iterator[float]:
        """Failure times of run ``run``: deterministic given ``seed``."""
        rng_seed = seed * 100003 + run
        if self.trace is not None:
            rng = random.Random(rng_seed)
            return trace_failure_times(self.trace, rng.uniform(0, self.trace.period_s), rng)
        assert self.rate_per_hour is not None
        return poisson_failure_times(self.rate_per_hour, rng_seed)


# ---- traces compressed in time (bench_goodput's scenarios) ------------------------------------
def compress_trace(trace: Trace, mtbf_s: float) -> Trace:
    """``trace`` with every time divided by one factor so that its MTBF is ``mtbf_s`` (the order
    and relative spacing of failures, the burstiness, unchanged): bench_goodput's scenarios."""
    if not (mtbf_s > 0 and trace.failures):
        raise ValueError(f"need a trace with failures and a positive MTBF, got {mtbf_s}")
    k = trace.mtbf_s / mtbf_s
    return Trace(trace.name, tuple(f / k for f in trace.failures), trace.period_s / k,
                 trace.resolution_s / k)
