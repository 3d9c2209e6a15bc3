"""bench_core's states and measurement helpers: the deterministic state of a run (tensor specs,
tensors, the changed subset, verification of what a load returned), the process's memory
(``/proc/self/status``, the peak-RSS mark, prefaulting), cold page caches, and
:func:`measure` (wall time, peak memory and the threads an operation started).
"""

from __future__ import annotations

import gc
import math
import mmap
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from bench_core_report import SEED
from harness import MiB, evict_files

def tensor_specs(size_mib: float, tensors: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of ``tensors`` float32 tensors of about ``size_mib`` MiB in total."""
    numel = max(1, int(size_mib * MiB) // tensors // 4)
    shape = (numel // 1024, 1024) if numel >= 1024 else (numel,)
    return [(f"layers.{i}.weight", shape) for i in range(tensors)]


def make_tensor(i: int, shape: tuple[int, ...]) -> Any:
    import torch

    return torch.randn(shape, generator=torch.Generator().manual_seed(SEED + i))


def make_state(specs: list[tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
    return {name: make_tensor(i, shape) for i, (name, shape) in enumerate(specs)}


def state_bytes(specs: list[tuple[str, tuple[int, ...]]]) -> int:
    return 4 * sum(math.prod(shape) for _, shape in specs)


def changed_indices(tensors: int, fraction: float = 0.10) -> list[int]:
    """Evenly spaced indices of ``fraction`` of the tensors (10 of 100: 0, 10, ..., 90)."""
    k = max(1, round(tensors * fraction))
    return sorted({int(j * tensors / k) for j in range(k)})


def verify_loaded(specs: list[tuple[str, tuple[int, ...]]], loaded: dict[str, Any]) -> None:
    """Outside the clock: the loaded state has every tensor and the first/last are bit-exact."""
    import torch

    if set(loaded) != {name for name, _ in specs}:
        raise AssertionError("loaded state has different keys")
    for i in {0, len(specs) - 1}:
        name, shape = specs[i]
        if not torch.equal(loaded[name], make_tensor(i, shape)):
            raise AssertionError(f"loaded tensor {name} differs from what was saved")


# ================================================================================================
# Child side: process memory, durability helpers, the measured operations
# ================================================================================================
def proc_status() -> dict[str, int]:
    """VmRSS / VmHWM / RssFile of this process, in bytes."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def write_proc(path: str, value: str) -> bool:
    """Write ``value`` to the kernel control file ``path``; False where the kernel refuses."""
    try:
        with open(path, "w") as f:
            f.write(value)
        return True
    except OSError:
        return False


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    return write_proc("/proc/self/clear_refs", "5")


def drop_caches() -> bool:
    os.sync()
    return write_proc("/proc/sys/vm/drop_caches", "3")


def make_cold(*paths: str) -> str:
    """Empty the page cache for a cold read: drop_caches where the kernel allows it, else evict
    the files that will be read (both sides' the same way). Returns the method used."""
    if drop_caches():
        return "drop_caches"
    evict_files(*paths)
    return "fadvise"


class ThreadWatch:
    """Counts threads alive while an engine calls back (its worker threads)."""

    def __init__(self) -> None:
        self.base = threading.active_count()
        self.peak = self.base

    def __call__(self, _n: int) -> None:
        self.peak = max(self.peak, threading.active_count())

    @property
    def workers(self) -> int:
        return max(1, self.peak - self.base)


@dataclass
class Measured:
    seconds: float
    peak_extra: int
    rss_before: int
    rss_file_after: int
    result: Any


def prefault(nbytes: int) -> None:
    """Touch ``nbytes`` of anonymous memory and unmap it at once, so the guest kernel holds that
    many free pages the host has just backed: anonymous allocations right after (tensors, clone)
    skip this VM's first-touch cost (shared/MEASUREMENTS.md). Measured: it does not make new page
    cache fast. Off unless --prefault. No heap buffer is used, so the RSS baseline is unchanged."""
    if nbytes <= 0:
        return
    import numpy as np

    m = mmap.mmap(-1, nbytes)
    try:
        view = np.frombuffer(m, dtype=np.uint8)
        view.fill(1)
        del view
    finally:
        m.close()


def measure(fn: Callable[[], Any], prefault_bytes: int = 0) -> Measured:
    """Run ``fn`` once with the clock and the peak-RSS mark reset just before it."""
    os.sync()
    gc.collect()
    prefault(prefault_bytes)
    exact = reset_peak_rss()
    before = proc_status()
    t0 = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t0
    after = proc_status()
    base = before["VmRSS"] if exact else before["VmHWM"]
    return Measured(seconds, after["VmHWM"] - base, before["VmRSS"], after.get("RssFile", 0), result)
