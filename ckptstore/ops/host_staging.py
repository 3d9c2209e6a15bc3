"""Host staging memory of the asynchronous pipeline (:mod:`ckptstore.ops.pipeline`): reusable
host arenas (pinned when CUDA is available) within a byte budget (:class:`HostPool`), and the
foreground copy of a flattened state's leaves into one arena (:func:`snapshot_leaves`: CPU
tensors by one batched ``_foreach_copy_``, CUDA tensors on a side stream the training stream then
waits for on the GPU; CPU tensors the caller defers are left to :mod:`ckptstore.ops.deferred_copy`).

With an image stride (the pipeline's snapshots), each CPU torch tensor above the manifest's inline
size gets a *chunk image* in the arena (format/image.py): its chunks are copied where their CHUNK
records' data will lie, so the write path frames the records in place and writes them with
O_DIRECT straight from the arena, instead of copying every byte once more into the log's aligned
staging buffer (the gradient captures of deltas do the same, ckptstore/torch/grad_capture.py).

Invariants: the bytes of reserved plus cached arenas stay within the pool's budget (one
reservation larger than the whole budget proceeds alone); an arena is reserved by one holder
from :meth:`HostPool.acquire` until :meth:`HostPool.release`; a leaf copied by
:func:`snapshot_leaves` views the arena from then on (a tensor, or an ImageTensor), never the
caller's tensor; every chunk image starts page-aligned in memory.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ..format.image import BLOCK, ChunkImage
from ..format.manifest import INLINE_MAX
from ..tensors import TORCH_DTYPES, ArrayLeaf, ImageTensor, LentTensor

ALIGN = 64  # leaf offsets inside an arena: any dtype can view its slice
_ROUND = 1 << 20  # arena capacities are rounded up to 1 MiB so similar sizes reuse the same arena
#: a cached arena is reused for requests down to 1/_REUSE_SLACK of its capacity, no smaller
_REUSE_SLACK = 2


def default_host_budget() -> int:
    """A quarter of physical memory, at most 4 GiB (at least 256 MiB)."""
    try:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        phys = 8 << 30
    return max(256 << 20, min(4 << 30, phys // 4))


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Arena:
    """One reusable host staging buffer (pinned when CUDA is available).

    It caches the typed destination views of the last few :class:`ArenaLayout` s copied into it, so a
    state whose structure repeats (every save of a training run) builds no views."""

    _MAX_VIEWS = 4

    def __init__(self, capacity: int, pin: bool) -> None:
        self.capacity = capacity
        with torch.inference_mode(False):  # a normal tensor: copies into it work in any mode
            self.buf = torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)
        self._ptr = self.buf.untyped_storage().data_ptr()
        self._views: dict[ArenaLayout, list] = {}

    def slice(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buf[offset:offset + nbytes]

    def holds(self, t: Any) -> bool:
        if isinstance(t, ImageTensor):
            t = t.buffer
        return isinstance(t, torch.Tensor) and t.device.type == "cpu" and \
            t.untyped_storage().data_ptr() == self._ptr

    def views(self, layout: "ArenaLayout") -> list:
        """The destination of every leaf of ``layout``: a torch tensor (torch leaves), an
        :class:`ImageTensor` (leaves the layout puts in a chunk image) or a numpy array (numpy
        leaves) of the leaf's dtype and shape, viewing its slice of this arena. With images the
        layout's offsets count from the arena's first page boundary."""
        v = self._views.get(layout)
        if v is None:
            if len(self._views) >= self._MAX_VIEWS:
                self._views.clear()
            shift = -self._ptr % BLOCK if layout.stride else 0
            with torch.inference_mode(False):  # cached views are used in and out of that mode
                v = self._views[layout] = [self._view(shift + off, leaf, layout.stride)
                                           for off, leaf in zip(layout.offsets, layout.key)]
        return v

    def _view(self, offset: int, leaf: tuple, stride: int) -> Any:
        lib, dtype, shape, nbytes, image = leaf
        if image:
            return ImageTensor(self.buf, offset, TORCH_DTYPES[dtype], shape, stride)
        dst = self.slice(offset, nbytes)
        if lib == "torch":
            return dst.view(TORCH_DTYPES[dtype]).view(shape)
        return dst.numpy().view(np.dtype(dtype)).reshape(shape)


@dataclass(frozen=True, eq=False)
class ArenaLayout:
    """Where the copied leaves of a state of one structure lie in an arena: ``key`` is each leaf's
    (lib, dtype, shape, nbytes, image) in order, ``offsets`` its offset, ``total`` the bytes
    needed, ``stride`` the chunk images' stride (0: no leaf is in an image). Leaves in images
    come first, each image a whole number of pages from the arena's first page boundary (an
    arena need not start on one: ``total`` has a page of room); the rest follow, ALIGN-aligned.
    Layouts are compared by identity (a cached layout is found by its key and stride)."""

    key: tuple
    offsets: tuple[int, ...]
    total: int
    stride: int = 0

    @classmethod
    def of(cls, key: tuple, stride: int = 0) -> "ArenaLayout":
        offsets = [0] * len(key)
        off = 0
        images = False
        for i, leaf in enumerate(key):
            if leaf[4]:
                offsets[i] = off
                off += ChunkImage(leaf[3], stride).size
                images = True
        for i, leaf in enumerate(key):
            if not leaf[4]:
                offsets[i] = off
                off += align(leaf[3])
        return cls(key, tuple(offsets), off + BLOCK if images else off, stride if images else 0)


class HostPool:
    """Host staging memory: arenas are reused (best fit; while the budget has room for a new
    arena, only among those at most :data:`_REUSE_SLACK` times the request, so a small request
    does not take the arena a large one will want) and the bytes held by reserved plus cached
    arenas stay within ``budget``; a reservation that does not fit waits until others are
    released. One reservation larger than the whole budget proceeds when it is alone. A holder
    that will not ask for an arena's size again :meth:`retire` s it: it is freed instead of
    cached."""

    def __init__(self, budget: int, pin: bool) -> None:
        self.budget = budget
        self.pin = pin
        self._cond = threading.Condition()
        self._free: list[Arena] = []
        self._retired: weakref.WeakSet[Arena] = weakref.WeakSet()  # freed at release, not cached
        self.reserved = 0
        self.cached = 0
        self.allocations = 0

    def acquire(self, nbytes: int, own: int = 0) -> tuple[Arena, float]:
        """An arena of at least ``nbytes``, and the seconds spent waiting for it. ``own``: bytes the
        caller already holds (they do not block its own reservation)."""
        need = max(_ROUND, (nbytes + _ROUND - 1) // _ROUND * _ROUND)
        t0 = time.perf_counter()
        with self._cond:
            while self.reserved + need > self.budget and self.reserved - own > 0:
                self._cond.wait()
            waited = time.perf_counter() - t0
            fits = [a for a in self._free if a.capacity >= need]
            if self.reserved + self.cached + need <= self.budget:  # room for a new one
                fits = [a for a in fits if a.capacity <= need * _REUSE_SLACK]
            if fits:
                arena = min(fits, key=lambda a: a.capacity)
                self._free.remove(arena)
                self.cached -= arena.capacity
            else:
                while self._free and self.reserved + self.cached + need > self.budget:
                    self.cached -= self._free.pop(0).capacity  # dropped: freed by refcount
                arena = Arena(need, self.pin)
                self.allocations += 1
            self.reserved += arena.capacity
        return arena, waited

    def release(self, arena: Arena) -> None:
        with self._cond:
            self.reserved -= arena.capacity
            if arena in self._retired:
                self._retired.discard(arena)
            else:
                self._free.append(arena)
                self.cached += arena.capacity
            while self._free and self.reserved + self.cached > self.budget:
                self.cached -= self._free.pop(0).capacity
            self._cond.notify_all()

    def retire(self, arena: Arena) -> None:
        """Free ``arena`` now if it is cached, else when it is released (its holder will not ask
        for its size again: e.g. gradient copies that lending replaced)."""
        with self._cond:
            if arena in self._free:
                self._free.remove(arena)
                self.cached -= arena.capacity
            else:
                self._retired.add(arena)

    def set_budget(self, budget: int) -> None:
        with self._cond:
            self.budget = budget
            self._cond.notify_all()


@dataclass
class Staged:
    """What :func:`snapshot_leaves` did: ``arena`` (None when nothing needed one), CUDA ``events``
    to wait for, ``copied`` bytes reserved for the copies, ``waited`` seconds for memory, and the
    ``deferred`` (destination view, live tensor, path name) triples it left to copy later."""

    arena: Arena | None = None
    events: list = field(default_factory=list)
    copied: int = 0
    waited: float = 0.0
    deferred: list = field(default_factory=list)


def _imaged(lf: ArrayLeaf, stride: int) -> bool:
    """Whether leaf ``lf`` gets a chunk image of ``stride`` (0: none does): a CPU torch tensor
    above the inline size whose dtype an image can hold."""
    v = lf.value
    return bool(stride) and lf.nbytes > INLINE_MAX and isinstance(v, torch.Tensor) and v.is_cpu \
        and ImageTensor.fits(v.dtype, lf.nbytes, stride)


def snapshot_leaves(leaves: list[ArrayLeaf], owned: list[Arena], pool: HostPool, own_bytes: int,
                     streams: dict, layouts: dict,
                     deferred: Callable[[torch.Tensor], bool] | None = None,
                     image_stride: int = 0) -> Staged:
    """Copy every leaf not already in an owned arena into one arena from ``pool``; each such
    leaf's ``value`` then views the arena (``leaves`` is the caller's fresh flatten output).
    ``layouts``: the caller's cache of :class:`ArenaLayout` by key, reused while the state's
    structure (dtypes, shapes) repeats. ``deferred``: CPU tensors for which it returns True get
    their place in the arena but are not copied: :attr:`Staged.deferred` lists them for the
    caller's overlapped copy (:mod:`ckptstore.ops.deferred_copy`). ``image_stride``: CPU torch
    tensors above the inline size are copied into chunk images of that stride (their ``value``
    becomes an :class:`ImageTensor`; 0: none are). A :class:`LentTensor` leaf is not copied at
    all: the write path reads its owner's memory (the job's loan keeps it unchanged).

    CPU tensors are copied by one ``torch._foreach_copy_`` into views of their own dtype and shape
    (no Python call per tensor but a chunk image's split into its one or two strided pieces; a
    same-dtype copy moves bits, NaN payloads included, and resolves strided, conjugate and
    negative views)."""
    if owned:
        todo = [lf for lf in leaves if lf.nbytes and not isinstance(lf.value, LentTensor)
                and not any(a.holds(lf.value) for a in owned)]
    else:
        todo = [lf for lf in leaves if lf.nbytes and not isinstance(lf.value, LentTensor)]
    if not todo:
        return Staged()
    key = tuple([(lf.lib, lf.dtype, lf.shape, lf.nbytes, _imaged(lf, image_stride))
                 for lf in todo])
    layout = layouts.get((key, image_stride))
    if layout is None:
        if len(layouts) >= 16:
            layouts.clear()
        layout = layouts[(key, image_stride)] = ArenaLayout.of(key, image_stride)
    arena, waited = pool.acquire(layout.total, own=own_bytes)
    events: list = []
    later: list = []
    try:
        cpu_dst: list[torch.Tensor] = []
        cpu_src: list[torch.Tensor] = []
        cuda_copies: dict[Any, list] = {}
        for lf, dst in zip(todo, arena.views(layout)):
            src = lf.value
            if isinstance(src, ImageTensor):  # (an image of an arena not handed over)
                src = src.to_tensor()
            if lf.lib != "torch":
                dst.reshape(-1).view(np.uint8)[:] = \
                    np.ascontiguousarray(src).reshape(-1).view(np.uint8)  # a byte copy
            elif src.is_cpu and deferred is not None and deferred(src):
                later.append((dst, src, lf.name))  # (into its image too: DeferredCopy splits it)
            elif isinstance(dst, ImageTensor):  # (a CPU tensor: _imaged)
                for d, s in dst.copy_pairs(src):
                    cpu_dst.append(d)
                    cpu_src.append(s)
            elif src.is_cpu:
                cpu_dst.append(dst)
                cpu_src.append(src)
            elif src.is_cuda:
                cuda_copies.setdefault(src.device, []).append((dst, src.detach()))
            else:
                with torch.no_grad():
                    dst.copy_(src)
            lf.value = dst
        if cpu_dst:
            with torch.no_grad():
                torch._foreach_copy_(cpu_dst, cpu_src)
        for dev, pairs in cuda_copies.items():
            events.append(_cuda_copy(dev, pairs, streams))
    except BaseException:
        for ev in events:  # (the copies issued to other devices write into this arena)
            ev.synchronize()
        pool.release(arena)
        raise
    return Staged(arena, events, layout.total, waited, later)


def _cuda_copy(device: Any, pairs: list, streams: dict) -> Any:
    """Device -> pinned host copies on a side stream. The training stream is made to wait for them
    on the GPU (so later kernels cannot overwrite a tensor before it is copied), the CPU does not
    wait; the returned event is synchronised by the persister before it reads the arena."""
    side = streams.get(device)
    if side is None:
        side = streams[device] = torch.cuda.Stream(device=device)
    current = torch.cuda.current_stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
            src.record_stream(side)  # the allocator must not reuse src's memory before the copy
    event = torch.cuda.Event()
    event.record(side)
    current.wait_stream(side)
    return event
