"""Gradient capture for the Checkpointer's asynchronous delta path (exact codec): each owned
parameter's gradient copied into a slot of a pooled host arena (the store pipeline's pool,
:mod:`ckptstore.ops.pipeline`) as soon as it is final, so a step copies only what was not
captured or changed since.

Call sequence, per step:

1. during backward: the post-accumulate-grad hook of each parameter (:meth:`GradCapture.hook`,
   installed by :meth:`GradCapture.install_hooks`) or, under DDP, :meth:`GradCapture.capture_bucket`
   (:mod:`ckptstore.torch.ddp_hook`) copies into the slots of the arena acquired for this step;
2. at the step: :meth:`GradCapture.take` checks each slot (the gradient tensor's identity and
   ``_version``, or for a DDP bucket its bits) and recopies what changed; the arena's ownership
   passes to the caller, which hands it to the pipeline with the record;
3. a step that records nothing gives the arena back (:meth:`GradCapture.release`).

Invariant: a slot handed on by :meth:`take` holds exactly the bits of the live gradient at that
time (in-place changes such as ``clip_grad_norm_`` are seen through ``_version``; writes through
``.data`` or numpy aliases are not, and the recorded fingerprints then make replay fail loudly).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..format.image import BLOCK as IMAGE_BLOCK, ChunkImage
from ..format.manifest import INLINE_MAX
from ..ops.host_staging import align
from ..replay.shards import local
from ..tensors import ImageTensor
from .param_layout import ParamLayout


def same_bits(slot: Any, g: torch.Tensor) -> bool:
    """Whether a gradient slot (tensor or ImageTensor) holds exactly ``g``'s bits."""
    if isinstance(slot, ImageTensor):
        return slot.same_bits(g)
    return torch.equal(slot.reshape(-1).view(torch.uint8), g.detach().reshape(-1).view(torch.uint8))


class GradCapture:
    """The gradient slots of ``layout``'s parameters in host arenas of ``store``'s pipeline pool
    (see the module docstring). ``active()``: whether the steps write deltas now (no capture
    while they write snapshots)."""

    def __init__(self, store: Any, layout: ParamLayout, chunk_size: int,
                 active: Callable[[], bool]) -> None:
        self.store = store
        self.layout = layout
        self.active = active
        self.lock = threading.Lock()
        self._arena: Any = None  # host arena of this iteration's gradient slots (pipeline pool)
        self._captured: list[Any] = [None] * len(layout.params)
        self._hooks: list[Any] = []
        #: DDP buckets were seen: the hooks stand aside (the comm hook captures)
        self.ddp = False
        #: gradients captured during backward ("hook"), from DDP buckets ("ddp"), at step ("step")
        self.counts = {"hook": 0, "ddp": 0, "step": 0}
        self.wait_s = 0.0  # backpressure met while capturing gradients
        self._layout_slots(chunk_size)

    def install_hooks(self) -> None:
        """Capture each parameter's gradient as soon as backward has accumulated it."""
        for i, p in enumerate(self.layout.params):
            self._hooks.append(p.register_post_accumulate_grad_hook(self.hook(i)))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _ensure_arena(self) -> Any:
        with self.lock:
            if self._arena is None:
                # the running pipeline (started with the Checkpointer), not the property, which
                # would raise a background failure inside backward (the next step raises it instead)
                pipe = self.store.running_pipeline
                assert pipe is not None
                self._arena, waited = pipe.pool.acquire(self._slot_bytes)
                self.wait_s += waited
            return self._arena

    def _layout_slots(self, chunk_size: int) -> None:
        """Where each parameter's captured gradient lies in an arena. Large CPU gradients get a
        chunk image each (ckptstore/format/image.py: the store writes their records straight
        from the arena, no staging copy), laid end to end from the arena's first page boundary;
        the rest get plain ``ALIGN``-aligned slots (:mod:`ckptstore.ops.host_staging`) after them. ``_slots[i]``: (offset from that
        boundary, bytes, whether it is an image)."""
        params = self.layout.params
        self._stride = ChunkImage.stride_for(chunk_size)
        self._slots: list[tuple[int, int, bool]] = [(0, 0, False)] * len(params)
        off = 0
        rest = []
        for i, (p, owned) in enumerate(zip(params, self.layout.owned)):
            p = local(p)  # a DTensor's gradient is captured as its local shard
            n = p.numel() * p.element_size() if owned else 0  # (others' gradients: never captured)
            if n > INLINE_MAX and p.device.type == "cpu" and ImageTensor.fits(p.dtype, n, self._stride):
                self._slots[i] = (off, n, True)
                off += ChunkImage(n, self._stride).size
            else:
                rest.append((i, n))
        for i, n in rest:
            self._slots[i] = (off, n, False)
            off += align(n)
        self._slot_bytes = off + IMAGE_BLOCK  # + room to start at a page boundary in any arena
        self._slot_views: dict[int, tuple[Any, list[Any]]] = {}

    def _slot(self, i: int, arena: Any) -> Any:
        """Parameter ``i``'s gradient slot in ``arena``: a tensor view, or an ImageTensor."""
        cached = self._slot_views.get(id(arena))
        if cached is None or cached[0] is not arena:
            if len(self._slot_views) >= 8:
                self._slot_views.clear()
            shift = -arena.buf.data_ptr() % IMAGE_BLOCK
            views: list[Any] = []
            for p, (off, n, image) in zip(self.layout.params, self._slots):
                p = local(p)
                if n == 0 and p.numel() > 0:
                    views.append(None)  # another rank's gradient: never captured here
                elif image:
                    views.append(ImageTensor(arena.buf, shift + off, p.dtype, tuple(p.shape),
                                             self._stride))
                else:
                    views.append(arena.slice(shift + off, n).view(p.dtype).view(p.shape))
            cached = self._slot_views[id(arena)] = (arena, views)
        return cached[1][i]

    def capturable(self, i: int, g: torch.Tensor | None) -> bool:
        """Whether gradient ``g`` of parameter ``i`` fits its slot (a dense CPU tensor of the
        parameter's dtype and shape)."""
        p = local(self.layout.params[i])
        return g is not None and g.layout == torch.strided and g.device.type == "cpu" and \
            g.dtype == p.dtype and g.shape == p.shape

    def hook(self, i: int) -> Callable[[torch.Tensor], None]:
        """The post-accumulate-grad hook of parameter ``i``."""
        def on_grad(p: torch.Tensor) -> None:
            g = local(p.grad)
            if self.ddp or g is None or not self.layout.owned[i] or not self.active() or \
                    not self.capturable(i, g):
                return
            self._slot(i, self._ensure_arena()).copy_(g)
            self._captured[i] = (weakref.ref(g), g._version)
            self.counts["hook"] += 1
        return on_grad

    def capture_bucket(self, params: list[torch.Tensor], flat: torch.Tensor) -> None:
        """Copy an all-reduced DDP bucket (``flat``: the bucket's gradients of ``params``, in
        order) into the gradient slots (from then on the hooks stand aside)."""
        self.ddp = True
        if not self.active():
            return
        if sum(p.numel() for p in params) != flat.numel() or flat.device.type != "cpu":
            return  # an unexpected layout: the step copies p.grad instead
        arena = self._ensure_arena()
        off = 0
        for p in params:
            n = p.numel()
            i = self.layout.index.get(id(p))
            if i is not None and self.layout.owned[i] and flat.dtype == p.dtype:
                self._slot(i, arena).copy_(flat[off:off + n].view(p.shape))
                self._captured[i] = "ddp"
                with self.lock:
                    self.counts["ddp"] += 1
            off += n

    def take(self, own: bool = False) -> tuple[list[Any], Any]:
        """Gradient payloads for the delta record, in slots of a host arena (ownership passes to
        the caller, who hands it to the pipeline). ``own``: copy the gradients that cannot go to
        a slot too (else the payload is the live gradient, copied when the record is submitted)."""
        grads: list[Any] = []
        arena = None
        for i, p in enumerate(self.layout.params):
            g = local(p.grad)
            if g is None or not self.layout.owned[i]:  # (not owned: dropped from the record)
                grads.append(None)
                continue
            if not self.capturable(i, g):
                grads.append({"g": g.detach().clone() if own else g.detach()})  # (else copied
                continue                                 # by the pipeline's snapshot)
            arena = arena or self._ensure_arena()
            slot = self._slot(i, arena)
            c = self._captured[i]
            if c == "ddp":
                ok = same_bits(slot, g) if g.is_contiguous() else False
            else:
                ok = c is not None and c[0]() is g and c[1] == g._version
            if not ok:
                slot.copy_(g)
                self.counts["step"] += 1
            grads.append({"g": slot})
        with self.lock:
            if arena is not None:
                self._arena = None
            self._captured = [None] * len(self.layout.params)
        return grads, arena

    def forget(self) -> None:
        """Nothing captured so far counts (the next step copies every gradient again)."""
        self._captured = [None] * len(self.layout.params)

    def release(self, pipe: Any) -> None:
        """Give back the gradients captured for a step that records nothing (to ``pipe``'s pool;
        none: no pipeline runs, nothing to give back)."""
        with self.lock:
            arena, self._arena = self._arena, None
        if arena is not None and pipe is not None:
            pipe.pool.release(arena)
