"""The ranks of one job, as the store talks to them: byte messages over torch.distributed.

The store never uses the caller's process group for its own traffic: a commit round may run while
the training loop's collectives (DDP's all-reduce) are in flight, and collectives of one group must
be issued in the same order on every rank. :class:`RankGroup` creates a dedicated gloo group over
the same ranks (CPU tensors, whatever backend training uses) whose timeout bounds every wait: a
rank that dies or stops answering makes the others fail within ``timeout`` seconds with
RankFailureError, never hang. (A killed peer usually fails them at once: its sockets close.)

Messages are bytes (:mod:`ckptstore.multirank.messages`) sent as uint8 tensors: nothing is
pickled.

Lifetime (issue 29, "no crash at exit"): every tensor a collective of the group touches is one of
the group's own buffers, held until the group is destroyed. A gloo worker thread drops its
references to a collective's tensors only after the caller was woken; were it the last holder,
it would free a Python tensor and take the GIL, and a worker doing so while the interpreter
finalises dies in ``std::terminate`` (SIGABRT). ``close`` destroys the group (torch joins its
threads) before it lets the buffers go, and a group left open is closed by the exit hook
(:mod:`ckptstore.ops.shutdown`), so no gloo thread of ckptstore's outlives the interpreter.

Naming: torch names a group created with ``use_local_synchronization`` after its ranks and the
number of groups alive, so a group created again after one over the same ranks was destroyed
(a job store closed and opened again in the same processes) gets the destroyed group's name, and
gloo's rendezvous would read the destroyed group's addresses, still in the default store: the
ranks connect to stale endpoints and fail or hang. The group is therefore created through the
``ckptstore_gloo`` backend (:func:`_create_backend`, registered with torch once): a gloo backend
whose rendezvous keys lie under a fresh generation of that name, counted in the default store.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import RankFailureError
from ..ops import shutdown

#: the torch.distributed backend RankGroups are created with (gloo, fresh rendezvous keys)
BACKEND = "ckptstore_gloo"
_GENERATION_KEY = "ckptstore-generation"
_register_lock = threading.Lock()
#: smallest buffer: messages round up to a power of two at least this (few distinct buffers)
_MIN_BUFFER = 64
#: largest staging buffer of broadcast_bytes_of (bigger payloads travel in several collectives)
STAGING_MAX = 16 << 20


def _create_backend(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """torch's constructor of a ``ckptstore_gloo`` backend: a gloo backend whose rendezvous keys
    lie under ``ckptstore-<generation>/`` of ``store`` (the default store under the group's
    name). Every rank of the group adds 1 to the name's counter once per creation, and a rank
    leaves its rendezvous only after every rank wrote its address (so after every rank added):
    the counts of one creation are ``k*size+1 .. k*size+size``, all ranks compute generation
    ``k``, and no key of an earlier group with the same name is read."""
    generation = (int(store.add(_GENERATION_KEY, 1)) - 1) // size
    prefixed = dist.PrefixStore(f"ckptstore-{generation}/", store)
    return dist.ProcessGroupGloo(prefixed, rank, size, timeout)


def _register_backend() -> None:
    with _register_lock:
        if not hasattr(dist.Backend, BACKEND.upper()):  # register_backend sets the attribute
            dist.Backend.register_backend(BACKEND, _create_backend, devices=["cpu"])


def _capacity(n: int) -> int:
    """The buffer size for an ``n``-byte message: a power of two, at least _MIN_BUFFER."""
    return max(_MIN_BUFFER, 1 << (max(n, 1) - 1).bit_length())


class RankGroup:
    """A dedicated gloo group over the ranks of ``process_group`` (every rank of it must create
    one, in the same order relative to other RankGroups over the same ranks).

    Invariants: collectives run on one thread at a time (the commit rounds' thread); every tensor
    passed to a collective is in ``_held`` (sizes, and per capacity one send buffer and one
    receive buffer per rank), kept until ``close`` destroyed the group; messages travel in whole
    buffers (a capacity every rank derives from the same sizes)."""

    def __init__(self, process_group: Any, timeout: float, label: str = "") -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("a process group needs torch.distributed initialised "
                             "(torch.distributed.init_process_group)")
        if not timeout > 0:
            raise ValueError(f"commit_timeout must be positive, not {timeout!r}")
        self.timeout = float(timeout)
        #: what the group serves (a job store's path), for the exit hook's warning
        self.label = label
        ranks = dist.get_process_group_ranks(process_group)
        _register_backend()
        group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=self.timeout),
                               backend=BACKEND, use_local_synchronization=True)
        self.group: Any = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._size = torch.zeros(1, dtype=torch.int64)
        self._sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        #: per capacity: (send buffer, one receive buffer per rank)
        self._gather: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        #: per capacity: the buffer broadcasts travel in
        self._bcast: dict[int, torch.Tensor] = {}
        shutdown.track(self, shutdown.GROUPS)

    def _live(self, what: str) -> Any:
        if self.group is None:
            raise RankFailureError(f"{what}: the store's rank group is closed")
        return self.group

    def all_gather(self, payload: bytes, what: str) -> list[bytes]:
        """Every rank's ``payload``, in rank order."""
        group = self._live(what)
        try:
            self._size[0] = len(payload)
            dist.all_gather(self._sizes, self._size, group=group)
            sizes = [int(s.item()) for s in self._sizes]
            cap = _capacity(max(sizes))
            bufs = self._gather.get(cap)
            if bufs is None:
                bufs = self._gather[cap] = (torch.zeros(cap, dtype=torch.uint8),
                                            [torch.zeros(cap, dtype=torch.uint8)
                                             for _ in range(self.world_size)])
            mine, outs = bufs
            if payload:
                mine.numpy()[:len(payload)] = np.frombuffer(payload, dtype=np.uint8)
            dist.all_gather(outs, mine, group=group)
        except RuntimeError as e:  # gloo: a peer closed its connection, or the timeout passed
            raise self.failure(what, e) from e
        return [o.numpy()[:n].tobytes() for o, n in zip(outs, sizes)]

    def broadcast(self, payload: bytes | None, what: str, src: int = 0) -> bytes:
        """``payload`` of rank ``src`` (the others pass None)."""
        group = self._live(what)
        try:
            self._size[0] = len(payload) if payload is not None else 0
            dist.broadcast(self._size, group_src=src, group=group)
            n = int(self._size.item())
            if not n:
                return b""
            buf = self._buffer(_capacity(n))
            if payload is not None:
                buf.numpy()[:n] = np.frombuffer(payload, dtype=np.uint8)
            dist.broadcast(buf, group_src=src, group=group)
        except RuntimeError as e:
            raise self.failure(what, e) from e
        return buf.numpy()[:n].tobytes()

    def _buffer(self, cap: int) -> torch.Tensor:
        buf = self._bcast.get(cap)
        if buf is None:
            buf = self._bcast[cap] = torch.zeros(cap, dtype=torch.uint8)
        return buf

    def broadcast_bytes_of(self, tensors: list[torch.Tensor], src: int, what: str) -> None:
        """Broadcast the bytes of ``tensors`` from rank ``src`` into the same-sized tensors of the
        other ranks, in place (any dtype: the bytes travel, so the bits are exact). They travel
        packed in the group's staging buffer: one collective per STAGING_MAX bytes, whatever the
        number of tensors (``tensors`` themselves never reach gloo)."""
        group = self._live(what)
        views = [t.reshape(-1).view(torch.uint8) for t in tensors if t.numel()]
        total = sum(v.numel() for v in views)
        if not total:
            return
        staging = self._buffer(min(_capacity(total), STAGING_MAX))
        mine = self.rank == src
        done = 0
        while done < total:
            n = min(total - done, staging.numel())
            if mine:
                _copy_span(views, done, n, staging, out=True)
            try:
                dist.broadcast(staging, group_src=src, group=group)
            except RuntimeError as e:
                raise self.failure(what, e) from e
            if not mine:
                _copy_span(views, done, n, staging, out=False)
            done += n

    def failure(self, what: str, cause: BaseException) -> RankFailureError:
        return RankFailureError(
            f"rank {self.rank} of {self.world_size}: {what} failed: another rank died, or did not "
            f"answer within the commit timeout of {self.timeout:g} s ({cause})")

    def close(self) -> None:
        """Destroy the group (torch joins its gloo threads), then let its buffers go. Idempotent;
        after it every collective raises RankFailureError. Local: the other ranks need not
        close at the same time (a group is never reused: the next RankGroup over the same ranks
        rendezvous under a fresh generation, see the module docstring)."""
        group, self.group = self.group, None
        if group is None:
            return
        shutdown.forget(self)
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError):  # already gone with the default group
            pass
        del group  # the last reference: the backend's threads are joined here
        self._gather.clear()
        self._bcast.clear()
        self._sizes = []

    def stop_at_exit(self) -> str | None:
        """The exit hook's close (:mod:`ckptstore.ops.shutdown`): the store was left open."""
        if self.group is None:
            return None
        self.close()
        return (f"ckptstore: job store {self.label or '?'} was left open at interpreter exit: "
                "its rank group was destroyed (work not committed is abandoned, as in a crash; "
                "close() the store to commit it)")

    def __repr__(self) -> str:
        return f"<RankGroup {self.label!r} rank={self.rank} of {self.world_size}>"


def _copy_span(views: list[torch.Tensor], start: int, n: int, staging: torch.Tensor,
               out: bool) -> None:
    """Copy bytes ``start .. start+n`` of the concatenated ``views`` into ``staging[:n]``
    (``out``) or back from it."""
    at = 0
    pos = 0
    for v in views:
        size = v.numel()
        lo, hi = max(start, at), min(start + n, at + size)
        if lo < hi:
            part, dst = v[lo - at:hi - at], staging[pos:pos + hi - lo]
            if out:
                dst.copy_(part)
            else:
                part.copy_(dst)
            pos += hi - lo
        at += size
        if at >= start + n:
            break
