"""bench_sharded's state: an FSDP2 model + AdamW whose every value is a known function of its
name and index (so any rank can check what a load gave it), zeroing and checking it, the bytes
it ideally takes, and what this process has read (``rchar``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

def build_state(world: int, args: argparse.Namespace) -> tuple[Any, Any, dict]:
    """The FSDP2 model + AdamW over a mesh of ``world`` ranks, every value set to its expected
    one; returns (model, optimizer, DCP state dict)."""
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.GELU(),
                            nn.Linear(4 * args.dim, args.dim)) for _ in range(args.layers)]
    model = nn.Sequential(nn.Embedding(args.vocab, args.dim), *blocks)
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # one step makes AdamW's state; no forward pass needed
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    fill(state, world)
    return model, opt, state


def _leaves(x: Any, prefix: str = ""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _leaves(v, f"{prefix}.{i}")
    else:
        yield prefix, x


def _expected_local(name: str, t: Any, world: int, rank: int) -> Any:
    """The expected values of this rank's part of tensor ``name`` (global values: a cheap pure
    function of the name and the flat index; a DTensor Shard(0)'s local part as torch.chunk)."""
    import torch
    from torch.distributed.tensor import DTensor

    seed = sum(name.encode()) % 9973 + 1
    shape = tuple(t.shape)
    n = 1
    for d in shape:
        n *= d
    glob = ((torch.arange(n, dtype=torch.int64) * seed) % 65521).to(t.dtype).reshape(shape) / 65521
    if isinstance(t, DTensor):
        local = t.to_local()
        if local.numel() == 0:
            return local.clone()
        return torch.chunk(glob, world, dim=0)[rank]
    return glob


def fill(state: dict, world: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank()
    with torch.no_grad():
        for name, t in _leaves(state):
            if isinstance(t, DTensor):
                t.to_local().copy_(_expected_local(name, t, world, rank))
            elif isinstance(t, torch.Tensor):
                t.copy_(_expected_local(name, t, world, rank))


def zero(state: dict) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for _, t in _leaves(state):
            if isinstance(t, DTensor):
                t.to_local().zero_()
            elif isinstance(t, torch.Tensor):
                t.zero_()


def check(state: dict, world: int) -> list[str]:
    """The names of tensors whose part on this rank is not the expected one, bit for bit."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    rank, bad = dist.get_rank(), []
    for name, t in _leaves(state):
        if isinstance(t, torch.Tensor):
            got = t.to_local() if isinstance(t, DTensor) else t
            want = _expected_local(name, t, world, rank)
            if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(
                    got.reshape(-1).view(torch.uint8),
                    want.contiguous().reshape(-1).view(torch.uint8)):
                bad.append(name)
    return bad


def ideal_bytes(state: dict) -> int:
    """The bytes of the shards this rank's destination holds."""
    import torch
    from torch.distributed.tensor import DTensor

    total = 0
    for _, t in _leaves(state):
        if isinstance(t, DTensor):
            loc = t.to_local()
            total += loc.numel() * loc.element_size()
        elif isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0
