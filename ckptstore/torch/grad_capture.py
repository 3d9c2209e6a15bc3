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

Lending (zero-copy capture). When the training loop drops its gradients after each step
(``optimizer.zero_grad()``'s default ``set_to_none=True``: every step's gradients are new
tensors, seen by :meth:`take` two steps running), the large gradients that own their storage
are not copied at all: :meth:`take` lends them to the record
(:class:`~ckptstore.tensors.LentTensor`), under a :class:`~ckptstore.ops.loan.Loan` that the
persister waits for before it reads them. It is decided:

1. by the persister itself, as soon as no lent gradient changed (``_version``) and none is its
   parameter's ``p.grad`` any more (the loop dropped them: nothing it does can change them),
   usually right after the step's ``zero_grad()``;
2. else on the training thread (:meth:`settle`), early at the next backward's first gradient
   when that needs no wait, at the latest at the next step's start, a flush, a wait on the
   future or close: confirmed when unchanged (while a gradient is still ``p.grad``, the
   decision waits until the persister has read it), withdrawn when one changed in place. A
   withdrawn record is dropped unwritten, lending stops for good, and the step writer writes
   a base snapshot of the live state, that iteration's, instead (the next delta step's
   restart, or :meth:`StepWriter.rebase_withdrawn` at a flush, close or switch to
   snapshots): nothing committed is lost, and the iteration is recorded all the same.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..format.image import BLOCK as IMAGE_BLOCK, ChunkImage
from ..format.manifest import INLINE_MAX
from ..ops.host_staging import align
from ..ops.loan import Loan
from ..replay.shards import local
from ..tensors import ImageTensor, LentTensor
from .param_layout import ParamLayout

log = logging.getLogger("ckptstore")


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
                 active: Callable[[], bool], lend: bool = False) -> None:
        """``lend``: large gradients may be lent instead of copied (see the module docstring)
        once the training loop is seen to drop them after each step."""
        self.store = store
        #: lending is allowed (the caller's choice; False for good after a withdrawal)
        self.lend_allowed = lend
        #: the steps lend now (the hooks leave the large gradients alone)
        self.lending = False
        #: why lending stopped ("" while it did not)
        self.lend_stopped = ""
        #: the iteration whose loan this capture withdrew (its delta was not written: the step
        #: writer owes a base of it, :meth:`StepWriter.rebase_withdrawn`); None: none owed
        self.withdrawn: int | None = None
        #: the loan of the last record submitted, until :meth:`settle` decides it
        self.pending_loan: Loan | None = None
        self._open_loan: Loan | None = None  # lent by take(), not yet submitted
        self._last_taken: list[Any] = [None] * len(layout.params)  # weakrefs of take()'s grads
        self.layout = layout
        self.active = active
        self.lock = threading.Lock()
        self._arena: Any = None  # host arena of this iteration's gradient slots (pipeline pool)
        self._captured: list[Any] = [None] * len(layout.params)
        self._hooks: list[Any] = []
        #: DDP buckets were seen: the hooks stand aside (the comm hook captures)
        self.ddp = False
        #: gradients captured during backward ("hook"), from DDP buckets ("ddp"), at step
        #: ("step"), or lent without a copy ("lent")
        self.counts = {"hook": 0, "ddp": 0, "step": 0, "lent": 0}
        self.wait_s = 0.0  # backpressure met while capturing gradients
        self._layout_slots(chunk_size)

    def install_hooks(self) -> None:
        """Capture each parameter's gradient as soon as backward has accumulated it (and, when
        lending, decide a pending loan early at the next backward's first gradient; not at the
        next forward: a module hook would be traced into a compiled model's graph)."""
        for i, p in enumerate(self.layout.params):
            self._hooks.append(p.register_post_accumulate_grad_hook(self.hook(i)))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _ensure_arena(self, full: bool = True) -> Any:
        """This iteration's arena: one with every gradient slot (``full``), or one with only the
        small gradients' slots, the layout's prefix (while lending: the large gradients need
        none). A small arena asked for ``full`` is replaced by a full one, its slots copied over
        (so a caller takes slot views only of the arena it will hand on)."""
        with self.lock:
            arena = self._arena
            if arena is None or (full and arena.capacity < self._slot_bytes):
                # the running pipeline (started with the Checkpointer), not the property, which
                # would raise a background failure inside backward (the next step raises it instead)
                pipe = self.store.running_pipeline
                assert pipe is not None
                # (own: the small arena held here must not keep the pool waiting for itself)
                bigger, waited = pipe.pool.acquire(self._slot_bytes if full else self._small_bytes,
                                                   own=arena.capacity if arena is not None else 0)
                self.wait_s += waited
                if full and not self.lending:
                    self._full_arenas.add(bigger)
                if arena is not None:  # the small gradients captured so far move over
                    n = self._small_bytes - IMAGE_BLOCK
                    src = -arena.buf.data_ptr() % IMAGE_BLOCK
                    dst = -bigger.buf.data_ptr() % IMAGE_BLOCK
                    bigger.slice(dst, n).copy_(arena.slice(src, n))
                    pipe.pool.release(arena)
                self._arena = arena = bigger
            return arena

    def _retire_full_arenas(self) -> None:
        """Once lending starts, the full arenas of the steps before it are not needed again: the
        pool frees them (now, or when their jobs release them) instead of keeping them cached.
        (A full arena a lending step needs, for a large gradient it cannot lend, is cached as
        usual: such a gradient tends to come back every step.)"""
        pipe = self.store.running_pipeline
        for arena in list(self._full_arenas):
            if pipe is not None:
                pipe.pool.retire(arena)
        self._full_arenas.clear()

    def _layout_slots(self, chunk_size: int) -> None:
        """Where each parameter's captured gradient lies in an arena, counted from the arena's
        first page boundary: the small gradients first, in plain ``ALIGN``-aligned slots
        (:mod:`ckptstore.ops.host_staging`), then from the next page boundary the large CPU
        gradients, a chunk image each (ckptstore/format/image.py: the store writes their records
        straight from the arena, no staging copy). So an arena of the small slots alone
        (``_small_bytes``) serves the steps that lend the large gradients. ``_slots[i]``:
        (offset, bytes, whether it is an image)."""
        params = self.layout.params
        self._stride = ChunkImage.stride_for(chunk_size)
        self._slots: list[tuple[int, int, bool]] = [(0, 0, False)] * len(params)
        images = []
        off = 0
        for i, (p, owned) in enumerate(zip(params, self.layout.owned)):
            p = local(p)  # a DTensor's gradient is captured as its local shard
            n = p.numel() * p.element_size() if owned else 0  # (others' gradients: never captured)
            if n > INLINE_MAX and p.device.type == "cpu" and ImageTensor.fits(p.dtype, n, self._stride):
                images.append((i, n))
            else:
                self._slots[i] = (off, n, False)
                off += align(n)
        self._small_bytes = off + IMAGE_BLOCK  # + room to start at a page boundary in any arena
        off = -(-off // IMAGE_BLOCK) * IMAGE_BLOCK
        for i, n in images:
            self._slots[i] = (off, n, True)
            off += ChunkImage(n, self._stride).size
        self._slot_bytes = off + IMAGE_BLOCK
        #: each arena's slot views, dropped with the arena (they view its buffer, not the
        #: Arena: the pool alone decides how long an arena lives)
        self._slot_views: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
        self._full_arenas: weakref.WeakSet[Any] = weakref.WeakSet()

    def _slot(self, i: int, arena: Any) -> Any:
        """Parameter ``i``'s gradient slot in ``arena``: a tensor view, or an ImageTensor (None
        for a large gradient's slot in a small arena: never asked for)."""
        views = self._slot_views.get(arena)
        if views is None:
            shift = -arena.buf.data_ptr() % IMAGE_BLOCK
            full = arena.capacity >= self._slot_bytes
            views = []
            for p, (off, n, image) in zip(self.layout.params, self._slots):
                p = local(p)
                if n == 0 and p.numel() > 0:
                    views.append(None)  # another rank's gradient: never captured here
                elif image:
                    views.append(ImageTensor(arena.buf, shift + off, p.dtype, tuple(p.shape),
                                             self._stride) if full else None)
                else:
                    views.append(arena.slice(shift + off, n).view(p.dtype).view(p.shape))
            self._slot_views[arena] = views
        return views[i]

    def capturable(self, i: int, g: torch.Tensor | None) -> bool:
        """Whether gradient ``g`` of parameter ``i`` fits its slot (a dense CPU tensor of the
        parameter's dtype and shape)."""
        p = local(self.layout.params[i])
        return g is not None and g.layout == torch.strided and g.device.type == "cpu" and \
            g.dtype == p.dtype and g.shape == p.shape

    def hook(self, i: int) -> Callable[[torch.Tensor], None]:
        """The post-accumulate-grad hook of parameter ``i``."""
        def on_grad(p: torch.Tensor) -> None:
            if self.pending_loan is not None:
                self.settle(early=True)
                if self.pending_loan is not None:
                    # (undecided: its job may hold the arena this capture would wait for;
                    # take() copies this gradient once the step's start has decided the loan)
                    return
            g = local(p.grad)
            if self.ddp or g is None or not self.layout.owned[i] or not self.active() or \
                    not self.capturable(i, g) or (self.lending and self._slots[i][2]):
                return  # (a large gradient while lending: take() lends it)
            self._slot(i, self._ensure_arena(full=not self.lending)).copy_(g)
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
        the caller, who hands it to the pipeline), or lent. ``own`` (the two-part step, whose
        caller may zero or free its gradients before the record is submitted): copy the
        gradients that cannot go to a slot too (else the payload is the live gradient, copied
        when the record is submitted); a lent gradient needs no copy (its loan holds the tensor,
        and one zeroed in place is seen and withdrawn)."""
        grads: list[Any] = []
        arena = None
        lent_before = self.lending
        lend = self.lending and not self.ddp
        live = [local(p.grad) if owned else None
                for p, owned in zip(self.layout.params, self.layout.owned)]
        # an arena with the large gradients' slots only when one of them is copied
        full = not lend or any(g is not None and self._slots[i][2] and self.capturable(i, g) and
                               not self.lendable(g) for i, g in enumerate(live))
        lent: list[tuple[int, torch.Tensor, int]] = []
        fresh = True  # every large gradient is a new tensor since the last take()
        for i, g in enumerate(live):
            if g is None:  # (not owned: dropped from the record)
                grads.append(None)
                continue
            if not self.capturable(i, g):
                grads.append({"g": g.detach().clone() if own else g.detach()})  # (else copied
                continue                                 # by the pipeline's snapshot)
            if self._slots[i][2]:
                prev = self._last_taken[i]
                fresh = fresh and prev is not None and prev() is not g
                self._last_taken[i] = weakref.ref(g)
                if lend and self.lendable(g):
                    grads.append({"g": LentTensor(g)})
                    lent.append((i, g, g._version))
                    self.counts["lent"] += 1
                    continue
            arena = arena or self._ensure_arena(full)
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
        self._open_loan = None
        if lent:
            self._open_loan = Loan(-1, functools.partial(self._decide, lent))
            self._open_loan.unreachable = functools.partial(self._unreachable, lent)
        # (from the next backward on)
        self.lending = fresh and self.lend_allowed and not self.ddp
        if self.lending and not lent_before:
            self._retire_full_arenas()
        return grads, arena

    def lend_to(self, iteration: int) -> Loan | None:
        """The loan of the gradients :meth:`take` lent, for the record of ``iteration`` being
        submitted now (it becomes :attr:`pending_loan`); None when nothing was lent."""
        loan, self._open_loan = self._open_loan, None
        if loan is not None:
            loan.iteration = iteration
            self.pending_loan = loan
        return loan

    def settle(self, early: bool = False) -> None:
        """Decide the pending loan now (on the training thread: the start of a step, close).
        ``early`` (the next backward's first gradient): decide only
        what can be decided without waiting; a lent gradient still held as ``p.grad`` is left
        for later (the loop may drop it before its next backward)."""
        loan = self.pending_loan
        if loan is not None and loan.settle(early):
            self.pending_loan = None

    @staticmethod
    def lendable(g: torch.Tensor) -> bool:
        """Whether gradient ``g`` may be lent: contiguous and owning its whole storage (not a
        view: a gradient laid in a persistent flat buffer would be written again there)."""
        return g.is_contiguous() and g._base is None and g.storage_offset() == 0 and \
            g.untyped_storage().nbytes() == g.numel() * g.element_size()

    def _unreachable(self, lent: list[tuple[int, torch.Tensor, int]]) -> bool:
        """Whether no lent gradient changed and none is its parameter's ``p.grad`` any more:
        the training loop dropped them (``zero_grad()``), so nothing it does can change them
        (the persister asks this from its own thread, :class:`~ckptstore.ops.loan.Loan`)."""
        return all(g._version == v and local(self.layout.params[i].grad) is not g
                   for i, g, v in lent)

    def _decide(self, lent: list[tuple[int, torch.Tensor, int]], loan: Loan, early: bool) -> None:
        """The lender's decision on ``loan`` (:mod:`ckptstore.ops.loan`, run on the training
        thread): withdrawn when a lent gradient changed in place, else confirmed; while the
        training loop still holds one as ``p.grad`` it could change it next, so the decision
        then waits until the persister has read it (``early``: is left for later instead)."""
        changed = [self.layout.names[i] for i, g, v in lent if g._version != v]
        if changed:
            self.lending = self.lend_allowed = False
            self.lend_stopped = (f"the gradient of {changed[0]} changed in place after step "
                                 f"{loan.iteration} (optimizer.zero_grad(set_to_none=False)?): "
                                 "gradients are copied during backward from now on")
            log.info("ckptstore: %s; iteration %d is written as a base snapshot instead of its "
                     "delta", self.lend_stopped, loan.iteration)
            self.withdrawn = loan.iteration
            loan.withdraw(self.lend_stopped)
            return
        held = any(local(self.layout.params[i].grad) is g for i, g, _ in lent)
        if held and early:
            return
        loan.confirm()
        if held:
            loan.wait_returned()

    def forget(self) -> None:
        """Nothing captured so far counts (the next step copies every gradient again; a loan
        not yet submitted is dropped: nothing will read it)."""
        self._captured = [None] * len(self.layout.params)
        self._open_loan = None

    def release(self, pipe: Any) -> None:
        """Give back the gradients captured for a step that records nothing (to ``pipe``'s pool;
        none: no pipeline runs, nothing to give back)."""
        with self.lock:
            arena, self._arena = self._arena, None
        if arena is not None and pipe is not None:
            pipe.pool.release(arena)
