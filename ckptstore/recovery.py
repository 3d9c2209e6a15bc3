"""Pipelined, parallel recovery for :mod:`ckptstore.replay` (format-spec/deltas.md, "Replay").

Two pieces, both pure speed: neither changes what replay computes.

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

    def __init__(self, first: int, last: int, read: Callable[[int, Any], dict],
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
            self._n_sets += 1
            return [torch.empty(shape, dtype=dtype) for shape, dtype in self._shapes]
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
