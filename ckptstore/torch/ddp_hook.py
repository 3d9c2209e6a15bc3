"""The DistributedDataParallel communication hook that hands each all-reduced gradient bucket
to a Checkpointer (:func:`ddp_comm_hook`), so the gradient the job exchanges anyway becomes the
checkpoint's delta."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .checkpointer import Checkpointer


def ddp_comm_hook(checkpointer: Checkpointer | None = None) -> Any:
    """A DistributedDataParallel communication hook: all-reduce (average) each gradient bucket,
    like DDP's default hook, and hand the reduced bucket to ``checkpointer`` as it completes, so
    the gradient the job exchanges anyway becomes the checkpoint's delta (no second pass over the
    parameters). Ranks without a Checkpointer pass None (a single-writer store written by rank
    0); on a multi-rank store every rank passes its own and captures only the parameters it
    owns. The hook's state is the process group (None: the default group)::

        ddp.register_comm_hook(None, ddp_comm_hook(ckpt if rank == 0 else None))

    At ``ckpt.step`` each captured slot is compared bit for bit with ``p.grad`` (a read; a copy is
    made only if the gradient was changed after the all-reduce, e.g. by clipping)."""
    import torch.distributed as dist

    def hook(state, bucket):  # unannotated: DDP checks annotations against dist.GradBucket
        group = state if state is not None else dist.group.WORLD
        buf = bucket.buffer()
        buf.div_(dist.get_world_size(group))
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
        if checkpointer is None:
            return fut.then(lambda f: f.value()[0])
        params = list(bucket.parameters())

        def done(f):
            try:
                out = f.value()[0]
            except Exception as e:  # noqa: BLE001 - re-raised as ckptstore's typed error
                raise checkpointer.peer_failure(e)  # (its __cause__ is the root cause)
            checkpointer.capture_bucket(params, out)
            return out
        return fut.then(done)
    return hook
