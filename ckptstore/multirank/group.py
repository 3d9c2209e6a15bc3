"""The ranks of one job, as the store talks to them: byte messages over torch.distributed.

The store never uses the caller's process group for its own traffic: a commit round may run while
the training loop's collectives (DDP's all-reduce) are in flight, and collectives of one group must
be issued in the same order on every rank. :class:`RankGroup` creates a dedicated gloo group over
the same ranks (CPU tensors, whatever backend training uses) whose timeout bounds every wait: a
rank that dies or stops answering makes the others fail within ``timeout`` seconds with
RankFailureError, never hang. (A killed peer usually fails them at once: its sockets close.)

Messages are bytes (:mod:`ckptstore.multirank.messages`) sent as uint8 tensors: nothing is
pickled.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist

from ..errors import RankFailureError

#: gloo groups of closed RankGroups, kept for the next RankGroup over the same ranks of the same
#: default group with the same timeout (see RankGroup.close)
_IDLE: dict[tuple[Any, tuple[int, ...], float], list[Any]] = {}
_IDLE_LOCK = threading.Lock()


class RankGroup:
    """A dedicated gloo group over the ranks of ``process_group`` (every rank of it must create
    one, in the same order relative to other group creations)."""

    def __init__(self, process_group: Any, timeout: float) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("a process group needs torch.distributed initialised "
                             "(torch.distributed.init_process_group)")
        if not timeout > 0:
            raise ValueError(f"commit_timeout must be positive, not {timeout!r}")
        self.timeout = float(timeout)
        ranks = dist.get_process_group_ranks(process_group)
        self._key = (dist.group.WORLD, tuple(ranks), self.timeout)
        #: whether a collective of this group failed (the group is not reused)
        self._failed = False
        with _IDLE_LOCK:
            idle = _IDLE.get(self._key)
            group = idle.pop() if idle else None
        if group is None:
            group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=self.timeout),
                                   backend="gloo", use_local_synchronization=True)
        self.group = group
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

    def all_gather(self, payload: bytes, what: str) -> list[bytes]:
        """Every rank's ``payload``, in rank order."""
        try:
            size = torch.tensor([len(payload)], dtype=torch.int64)
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
            dist.all_gather(sizes, size, group=self.group)
            longest = max(int(s.item()) for s in sizes)
            mine = torch.zeros(longest, dtype=torch.uint8)
            if payload:
                mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            outs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
            dist.all_gather(outs, mine, group=self.group)
        except RuntimeError as e:  # gloo: a peer closed its connection, or the timeout passed
            raise self.failure(what, e) from e
        return [bytes(o[:int(s.item())].numpy()) for o, s in zip(outs, sizes)]

    def broadcast(self, payload: bytes | None, what: str, src: int = 0) -> bytes:
        """``payload`` of rank ``src`` (the others pass None)."""
        try:
            size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
            dist.broadcast(size, src=dist.get_global_rank(self.group, src), group=self.group)
            buf = torch.zeros(int(size.item()), dtype=torch.uint8)
            if payload is not None and payload:
                buf[:] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if buf.numel():
                dist.broadcast(buf, src=dist.get_global_rank(self.group, src), group=self.group)
        except RuntimeError as e:
            raise self.failure(what, e) from e
        return bytes(buf.numpy())

    def broadcast_bytes_of(self, tensors: list[torch.Tensor], src: int, what: str) -> None:
        """Broadcast the bytes of ``tensors`` from rank ``src`` into the same-sized tensors of the
        other ranks, in place (any dtype: the bytes travel, so the bits are exact). They travel
        packed in one buffer: one collective, whatever the number of tensors."""
        views = [t.reshape(-1).view(torch.uint8) for t in tensors if t.numel()]
        total = sum(v.numel() for v in views)
        if not total:
            return
        packed = torch.empty(total, dtype=torch.uint8)
        mine = self.rank == src
        if mine:
            torch.cat(views, out=packed)
        try:
            dist.broadcast(packed, src=dist.get_global_rank(self.group, src), group=self.group)
        except RuntimeError as e:
            raise self.failure(what, e) from e
        if not mine:
            at = 0
            for v in views:
                v.copy_(packed[at:at + v.numel()])
                at += v.numel()

    def failure(self, what: str, cause: BaseException) -> RankFailureError:
        self._failed = True
        return RankFailureError(
            f"rank {self.rank} of {self.world_size}: {what} failed: another rank died, or did not "
            f"answer within the commit timeout of {self.timeout:g} s ({cause})")

    def close(self) -> None:
        """Give the group back. A sound one is kept for the next RankGroup over the same ranks
        (every rank opens and closes its stores in the same order, so every rank reuses it):
        torch names a group made with ``use_local_synchronization`` after its ranks and the
        number of groups alive, so a group made again after one was destroyed gets the same name,
        and its rendezvous reads the destroyed group's addresses, still in the default store: the
        ranks connect to stale endpoints and hang until the timeout (a job store closed and
        opened again in the same processes). One whose collective failed is destroyed (a job
        that lost a rank reopens its stores in new processes)."""
        group, self.group = self.group, None
        if group is None:
            return
        if not self._failed:
            with _IDLE_LOCK:
                _IDLE.setdefault(self._key, []).append(group)
            return
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError):  # already gone with the default group
            pass
