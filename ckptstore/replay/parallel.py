"""Pipelined, parallel replay for :mod:`ckptstore.replay` (format-spec/deltas.md, "Replay").

Pure speed: nothing here changes what replay computes.

* :class:`RecordFeed` reads delta records in a background thread, a few iterations ahead of the
  optimizer steps (reads and xxh3 verification release the GIL, so they overlap the steps). For the
  ``exact`` codec the gradients are read straight into recycled, preallocated gradient tensors
  (verified in place), instead of a fresh allocation per record.
* :class:`ShardedStep` splits an optimizer step across a thread pool: the parameters are dealt into
  shards of about equal size, whole parameters only, one optimizer instance per shard of the same
  class with every group's settings (so the same foreach / fused / for-loop path), sharing the
  main optimizer's per-parameter state dicts. Only optimizers in :data:`SEPARABLE_OPTIMIZERS`
  are sharded: their step updates each parameter from that parameter's gradient and state alone,
  so a shard computes, op for op, what the whole step computes for its parameters. Anything
  else (a global gradient norm, LBFGS's closure, an optimizer not listed) steps sequentially.
* :class:`TiledSteps` runs a window of steady-state steps tile by tile; Adam and AdamW windows
  go through the native kernel (:mod:`ckptstore.replay.native.adam`) where it is verified bit-exact.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

#: torch.optim classes whose step is elementwise per parameter (no cross-parameter reduction)
#: and that never keep a reference to ``p.grad`` in their state (so gradient buffers may be
#: recycled after the step). Checked against torch's implementations (single-tensor, foreach and
#: fused paths); tests/test_checkpointer.py replays each one bit-exactly through the shards.
SEPARABLE_OPTIMIZERS = frozenset({"SGD", "Adam", "AdamW", "RMSprop", "Adagrad"})
#: Below this many parameter entries a sharded step costs more in thread handoffs than it saves.
PARALLEL_MIN_NUMEL = 1 << 20
#: At most this many shards (threads) by default.
MAX_SHARDS = 8


def default_shards() -> int:
    """One shard per CPU this process may run on, at most :data:`MAX_SHARDS`."""
    import os

    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(n, MAX_SHARDS))

_DONE = object()


class RecordFeed:
    """Yields ``(iteration, record)`` for ``first..last`` from a reader thread, at most
    ``buffers - 1`` records ahead. ``read(it, into)`` loads one record; ``into`` is the reader's
    destination hook (None: allocate). With ``grad_shapes`` (one ``(shape, dtype)`` per optimizer
    parameter, exact codec only) each record's gradients land in one of ``buffers`` recycled sets
    of tensors; the consumer hands a set back with :meth:`release` once no one holds its tensors.
    """

    def __init__(self, first: int, last: int, read: Callable[[int, Any], object],
                 grad_shapes: list[tuple[tuple[int, ...], "torch.dtype"]] | None = None,
                 buffers: int = 3) -> None:
        self._read = read
        self._first, self._last = first, last
        self._queue: queue.Queue = queue.Queue()
        self._free: queue.Queue = queue.Queue()
        self._shapes = grad_shapes
        self._n_sets = 0
        self._max_sets = max(2, buffers)
        self._stop = threading.Event()
        self._window = threading.Semaphore(max(1, buffers - 1))
        self._thread = threading.Thread(target=self._run, name="ckptstore-replay-feed", daemon=True)
        self._thread.start()

    def _buffer_set(self) -> list["torch.Tensor"] | None:
        import torch

        if self._shapes is None:
            return None
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        if self._n_sets < self._max_sets:
            from ..storage.memory import advise_huge_tensor

            self._n_sets += 1
            out = [torch.empty(shape, dtype=dtype) for shape, dtype in self._shapes]
            for t in out:  # fresh memory the first read fills: huge pages, fewer faults
                advise_huge_tensor(t)
            return out
        return self._free.get()  # None when closing

    def _run(self) -> None:
        try:
            for it in range(self._first, self._last + 1):
                self._window.acquire()
                if self._stop.is_set():
                    return
                bufs = self._buffer_set()
                if self._stop.is_set():
                    return
                rec = self._read(it, None if bufs is None else _into(bufs))
                self._queue.put((it, rec, bufs))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            self._queue.put((None, e, None))
        finally:
            self._queue.put(_DONE)

    def __iter__(self):
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            it, rec, bufs = item
            if it is None:
                raise rec
            yield it, rec, bufs
            self._window.release()

    def release(self, bufs: list | None) -> None:
        """The consumer no longer uses this set of gradient tensors: recycle it."""
        if bufs is not None:
            self._free.put(bufs)

    def close(self) -> None:
        """Stop the reader thread (also after an error in the consumer) and wait for it."""
        self._stop.set()
        self._window.release()
        self._free.put(None)
        self._thread.join()


def _into(bufs: list["torch.Tensor"]) -> Callable[[Any], Any]:
    """The reader hook that puts exact gradient ``i`` (``grads/i/g``) into ``bufs[i]`` when its
    shape and dtype match (else the reader allocates, and the codec's check reports it)."""
    by_path = {f"grads/{i}/g": b for i, b in enumerate(bufs)}

    def into(entry: Any) -> Any:
        b = by_path.pop(entry.path, None)  # each buffer serves one tensor of one record
        if b is None or entry.lib != "torch" or tuple(entry.shape) != tuple(b.shape) \
                or entry.dtype != str(b.dtype).removeprefix("torch."):
            return None
        return b

    return into


def _deal(sizes: list[int], n: int) -> list[list[int]]:
    """Indices of ``sizes`` dealt into ``n`` bins of about equal total (largest first)."""
    bins: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        b = min(range(n), key=load.__getitem__)
        bins[b].append(i)
        load[b] += sizes[i]
    return [sorted(b) for b in bins if b]


class ShardedStep:
    """Runs ``optimizer.step()`` as ``n`` shard steps in parallel (see the module docstring).

    Invariants: every parameter is in exactly one shard; a shard's groups carry all of the
    corresponding main group's settings, refreshed by :meth:`sync_groups` before each step;
    ``shard.state[p] is optimizer.state[p]`` for every parameter, so the main optimizer's
    ``state_dict()`` sees every update.
    """

    def __init__(self, optimizer: "torch.optim.Optimizer", n: int, make: Callable[[list], Any]) -> None:
        params = [(gi, p) for gi, g in enumerate(optimizer.param_groups) for p in g["params"]]
        bins = _deal([p.numel() for _, p in params], n)
        self.optimizer = optimizer
        self.shards: list[tuple[Any, list[int]]] = []
        for b in bins:
            gis = sorted({params[i][0] for i in b})
            groups = [dict({k: v for k, v in optimizer.param_groups[gi].items() if k != "params"},
                           params=[params[i][1] for i in b if params[i][0] == gi]) for gi in gis]
            opt = make(groups)
            for g in opt.param_groups:
                for p in g["params"]:
                    if p in optimizer.state:  # (state is a defaultdict: never create entries)
                        opt.state[p] = optimizer.state[p]
            self.shards.append((opt, gis))
        self._order = [p for _, p in params]
        self._pool = ThreadPoolExecutor(len(self.shards), thread_name_prefix="ckptstore-replay-step")

    def sync_groups(self) -> None:
        """Copy each main group's settings (lr, betas, ... as set for this step) to the shards."""
        for opt, gis in self.shards:
            for g, gi in zip(opt.param_groups, gis):
                g.update({k: v for k, v in self.optimizer.param_groups[gi].items() if k != "params"})

    def step(self) -> None:
        self.sync_groups()
        for f in [self._pool.submit(opt.step) for opt, _ in self.shards]:
            f.result()
        # State a shard created (a parameter's first step) joins the main optimizer, in parameter
        # order as a whole step would have inserted it (state_dict() keeps insertion order).
        new = {}
        for opt, _ in self.shards:
            for p, st in opt.state.items():
                if self.optimizer.state.get(p) is not st:
                    new[p] = st
        for p in self._order:
            if p in new:
                self.optimizer.state[p] = new[p]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


#: Elements per tile of :class:`TiledSteps`: one fp32 tensor slice is 1 MiB, so a tile's
#: parameter, optimizer state and a window's gradients stay in this class of CPU's L2/L3 while all
#: of a window's steps run on it (measured: 256 Ki elements beat 64 Ki, 1 Mi and 4 Mi per tile
#: for AdamW on a 2-core EPYC, 7x faster per step than whole-tensor steps).
TILE_NUMEL = 1 << 18


#: Gradient bytes a tiled window may hold (its records' gradients plus two read ahead).
WINDOW_BYTES = 1 << 30
#: At most this many deltas per tiled window (past ~8, a tile's data is already read rarely).
MAX_WINDOW = 16


def window_size(params: list) -> int:
    """Deltas per tiled window for these parameters: as many as :data:`WINDOW_BYTES` of gradients
    allow (counting two sets read ahead), between 1 and :data:`MAX_WINDOW`."""
    per = sum(p.numel() * p.element_size() for p in params)
    return max(1, min(MAX_WINDOW, WINDOW_BYTES // max(per, 1) - 2))


#: Tile cuts inside a parameter fall on multiples of this many elements from its start. Kernels
#: run a vector loop then a scalar tail, and the two may round differently (torch's fused CPU
#: optimizers do: measured with fused SGD); aligned cuts give every element the same path as in
#: the whole-tensor step (64 = two AVX-512 vectors of bf16, the widest unrolled vector step).
TILE_ALIGN = 64


class TiledSteps:
    """Runs a window of consecutive optimizer steps tile by tile instead of step by step.

    The flat parameters are cut into tiles of about :data:`TILE_NUMEL` elements (a large parameter
    spans several tiles, small ones share a tile). Each tile has its own optimizer of the same
    class and group settings over 1-d slice views of the parameters, whose state holds slice views
    of the main optimizer's per-parameter state tensors. A window of ``k`` steps then runs as: for
    each tile, ``k`` steps of that tile's optimizer, so a tile's data is read from memory once per
    window instead of once per step.

    Why it computes the same bits: only optimizers in :data:`SEPARABLE_OPTIMIZERS` whose state is
    steady (:meth:`ready`) are tiled. Their step is elementwise within a parameter: every state
    tensor entry, parameter entry and gradient entry at index i is updated from entries at index i
    and per-parameter scalars (step count, hyperparameters) alone. Running entry i's steps in the
    same order with the same scalars and the same torch kernels gives the same result whatever
    other entries share its tensor; tests/test_checkpointer.py checks it bit for bit for every
    optimizer and implementation path (for-loop, foreach, fused), and tests/test_recovery.py on
    sizes and cuts that do not fall on vector-width boundaries.

    Invariants: every parameter entry belongs to exactly one tile slice, and slices start at
    multiples of :data:`TILE_ALIGN` from their parameter's start; full-size state tensors are
    updated in place through the views; per-parameter scalar state (``step``) is copied into each
    slice's state at the start of a window and written back from the parameter's first slice at
    its end (all slices of a parameter take the same steps, so they agree).
    """

    def __init__(self, optimizer: "torch.optim.Optimizer", params: list, make: Callable[[list], Any],
                 tile_numel: int | None = None, threads: int = 1) -> None:
        from .native.adam import AdamWindow

        tile_numel = TILE_NUMEL if tile_numel is None else tile_numel
        cut = max(TILE_ALIGN, tile_numel // TILE_ALIGN * TILE_ALIGN)
        self.optimizer = optimizer
        self.params = params
        gi_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        pieces: list[tuple[int, int, int]] = []  # (param index, start, stop)
        for i, p in enumerate(params):
            n = p.numel()
            pieces.extend((i, a, min(n, a + cut)) for a in range(0, n, cut))
        tiles: list[list[tuple[int, int, int]]] = [[]]
        load = 0
        for piece in pieces:
            size = piece[2] - piece[1]
            if tiles[-1] and load + size > tile_numel:
                tiles.append([])
                load = 0
            tiles[-1].append(piece)
            load += size
        #: per tile: (optimizer, [(param index, start, stop, slice view)], main group index per group)
        self.tiles: list[tuple[Any, list[tuple[int, int, int, Any]], list[int]]] = []
        for tile in tiles:
            if not tile:
                continue
            views = [(i, a, b, params[i].detach().view(-1)[a:b]) for i, a, b in tile]
            gis = sorted({gi_of[id(params[i])] for i, _, _ in tile})
            groups = [dict({k: v for k, v in optimizer.param_groups[gi].items() if k != "params"},
                           params=[v for i, _, _, v in views if gi_of[id(params[i])] == gi]) for gi in gis]
            self.tiles.append((make(groups), views, gis))
        #: the native kernel for Adam/AdamW windows (None: torch's ops only)
        self._native = AdamWindow(optimizer, make, threads) if AdamWindow.supports(optimizer) else None
        self._slices = [[(i, a, b) for i, a, b, _ in views] for _, views, _ in self.tiles]
        self._group_of = [gi_of[id(p)] for p in params]

    @staticmethod
    def ready(optimizer: "torch.optim.Optimizer", params: list) -> bool:
        """Whether a tiled window computes what step-by-step does: a separable optimizer, every
        parameter a contiguous CPU tensor whose state is complete (a step will not create state:
        no missing entry, no ``None``, tensors either the parameter's shape or 0-d), or SGD
        without momentum (no state at all)."""
        import torch

        name = type(optimizer).__name__
        if name not in SEPARABLE_OPTIMIZERS or type(optimizer) is not getattr(torch.optim, name):
            return False
        if not all(p.device.type == "cpu" and p.is_contiguous() and p.numel() for p in params):
            return False
        if name == "SGD" and all(float(g.get("momentum", 0.0)) == 0.0 for g in optimizer.param_groups):
            return True
        for p in params:
            st = optimizer.state.get(p)
            if not st:
                return False
            for v in st.values():
                if v is None:
                    return False
                if isinstance(v, torch.Tensor) and not (
                        (v.dim() == 0 or v.shape == p.shape) and _steady_tensor(v, p)):
                    return False
        return True

    def run(self, steps: list[tuple[list[dict], list[Any]]]) -> None:
        """Apply ``steps`` in order; each is (per main group: the settings in effect for that step,
        per parameter: its gradient: a tensor, None, or a :class:`ckptstore.replay.gradcodecs.GradSlices`
        decoded tile by tile into a reused buffer). The caller applies each step's post-step group
        settings to the main optimizer afterwards, as for a plain step."""
        import torch

        if self._native is not None and self._native.run(self._slices, self.params, self._group_of, steps):
            return
        if not TiledSteps.ready(self.optimizer, self.params):  # a window the native kernel started
            self._run_whole(steps)                             # (AdamWindow.can_start) but declined
            return
        state = self.optimizer.state
        # every tile's slice state is made before any tile runs: a tile's write-back replaces a
        # parameter's scalar state, which later tiles of that parameter must not start from
        placed: list[dict] = []
        for opt, views, _ in self.tiles:
            opt.state.clear()
            for i, a, b, v in views:
                p = self.params[i]
                opt.state[v] = {k: (x.view(-1)[a:b] if x.shape == p.shape else x.clone())
                                if isinstance(x, torch.Tensor) else x
                                for k, x in state.get(p, {}).items()}
                placed.append(dict(opt.state[v]))
        n = 0
        scratch: dict[Any, Any] = {}  # dtype -> one tile's worth of buffer for sliced decodes
        for opt, views, gis in self.tiles:
            into = self._scratch_views(views, scratch, steps)
            for hyper, grads in steps:
                for g, gi in zip(opt.param_groups, gis):
                    g.update(hyper[gi])
                for (i, a, b, v), buf in zip(views, into):
                    g = grads[i]
                    v.grad = None if g is None else g.reshape(-1)[a:b] if isinstance(g, torch.Tensor) \
                        else g.into(a, b, buf)
                opt.step()
            for i, a, b, v in views:
                v.grad = None
                self._write_back(self.params[i], a, b, opt.state.get(v, {}), placed[n])
                n += 1

    def _run_whole(self, steps: list[tuple[list[dict], list[Any]]]) -> None:
        """``steps`` one after another on whole tensors with the main optimizer (state not steady:
        a step may create it, which slices cannot)."""
        import torch

        for hyper, grads in steps:
            for g, h in zip(self.optimizer.param_groups, hyper):
                g.update(h)
            for p, g in zip(self.params, grads):
                if g is not None and not isinstance(g, torch.Tensor):
                    g = g.into(0, p.numel(), torch.empty(p.numel(), dtype=p.dtype))
                p.grad = None if g is None else g.view(p.shape)
            self.optimizer.step()
        for p in self.params:
            p.grad = None

    @staticmethod
    def _scratch_views(views: list, scratch: dict, steps: list) -> list:
        """Per view, a 1-d buffer for a sliced (lossy) gradient decode: slices of one growing
        buffer per dtype, reused by every step and tile (no optimizer keeps ``p.grad``, see
        SEPARABLE_OPTIMIZERS). None for views whose gradients are all plain tensors."""
        import torch

        need = [any(g[i] is not None and not isinstance(g[i], torch.Tensor) for _, g in steps)
                for i, _, _, _ in views]
        if not any(need):
            return [None] * len(views)
        total: dict[Any, int] = {}
        for (_, a, b, v), nd in zip(views, need):
            if nd:
                total[v.dtype] = total.get(v.dtype, 0) + b - a
        for dt, n in total.items():
            if dt not in scratch or scratch[dt].numel() < n:
                scratch[dt] = torch.empty(n, dtype=dt)
        out, off = [], dict.fromkeys(total, 0)
        for (_, a, b, v), nd in zip(views, need):
            if nd:
                out.append(scratch[v.dtype][off[v.dtype]:off[v.dtype] + b - a])
                off[v.dtype] += b - a
            else:
                out.append(None)
        return out

    def _write_back(self, p: Any, a: int, b: int, st: dict, placed: dict) -> None:
        """Scalar state from a parameter's first slice to the main state; a full-size state tensor
        the optimizer replaced instead of updating in place is copied into its slice."""
        import torch

        if not st:
            return  # (the main state is a defaultdict: never create an entry)
        main = self.optimizer.state[p]
        for k, x in st.items():
            if isinstance(x, torch.Tensor) and isinstance(main.get(k), torch.Tensor) \
                    and main[k].shape == p.shape:
                if x is not placed.get(k):
                    main[k].view(-1)[a:b].copy_(x.reshape(-1))
            elif a == 0:
                main[k] = x

    def close(self) -> None:
        for opt, views, _ in self.tiles:
            opt.state.clear()
        if self._native is not None:
            self._native.close()


def _steady_tensor(v: Any, p: Any) -> bool:
    """A state tensor a tiled window can slice (the parameter's shape: contiguous, CPU, same
    layout) or copy per slice (0-d)."""
    if v.dim() == 0 and v.shape != p.shape:
        return True
    return v.device.type == "cpu" and v.is_contiguous()
