"""Memory advice for large, freshly allocated read destinations.

Reading a checkpoint into new tensors touches every page of them for the first time: with 4 KiB
pages the kernel takes one page fault per 4 KiB (a 313 MiB base snapshot: 80,000 faults, about
as long as the copy itself). Where transparent huge pages are enabled in ``madvise`` mode (or
``always``), :func:`advise_huge` asks for 2 MiB pages on the part of a tensor's memory that holds
whole huge pages, before it is first written: 512 times fewer faults. Pure advice: nothing
changes what is read or where, and any failure (another OS, THP off, an address the kernel does
not take) is ignored.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

HUGE_PAGE = 2 << 20
#: tensors smaller than this are not advised (at most one huge page would fit)
MIN_BYTES = 4 << 20
_MADV_HUGEPAGE = 14

_madvise: Any = None
_enabled: bool | None = None


def _thp_madvise() -> bool:
    """Whether the kernel gives huge pages to regions advised so (``madvise`` or ``always``)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[madvise]" in mode or "[always]" in mode


def advise_huge(address: int, nbytes: int) -> bool:
    """Advise huge pages for the 2 MiB-aligned interior of ``[address, address + nbytes)`` (the
    memory of a tensor not written yet). True when the kernel took the advice. Disabled by
    ``CKPTSTORE_HUGEPAGES=0``."""
    global _madvise, _enabled
    if nbytes < MIN_BYTES:
        return False
    if _enabled is None:
        _enabled = sys.platform.startswith("linux") and \
            os.environ.get("CKPTSTORE_HUGEPAGES", "1") != "0" and _thp_madvise()
        if _enabled:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                _madvise = libc.madvise
                _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                _madvise.restype = ctypes.c_int
            except (OSError, AttributeError):
                _enabled = False
    if not _enabled:
        return False
    lo = (address + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    hi = (address + nbytes) & ~(HUGE_PAGE - 1)
    return hi > lo and _madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0


def advise_huge_tensor(t: Any) -> bool:
    """:func:`advise_huge` for the memory of a contiguous CPU torch tensor."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return False
    return advise_huge(t.data_ptr(), t.numel() * t.element_size())


def advise_huge_buffer(view: memoryview) -> bool:
    """:func:`advise_huge` for a writable buffer's memory (its address taken through numpy)."""
    import numpy as np

    arr = np.frombuffer(view, dtype=np.uint8)
    return advise_huge(arr.__array_interface__["data"][0], arr.nbytes)
