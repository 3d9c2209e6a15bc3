"""Loans: tensors a caller lends to an asynchronous save instead of copying them, and the gate
that keeps the persister off them until the lender says they are safe to read.

The Checkpointer lends a step's large gradients (:class:`~ckptstore.tensors.LentTensor` leaves of
the delta record): nothing copies them on the training thread, and the persister hashes and
writes them straight from their memory. That is safe only while nobody changes them, and the
lender cannot know at submission: ``optimizer.zero_grad()`` drops them (the default,
``set_to_none=True``: safe) or zeroes them in place (``set_to_none=False``: not). So a loan is
*decided* later, by the lender, on its own thread, at a point where it knows whether they
changed (the next step's start, a flush, a wait on the save's future, close):

1. ``Pipeline.submit(..., loan=loan)``: the job is queued with the loan; the persister reaches it
   and waits (:meth:`Loan.wait`), confirming it itself as soon as the lender's
   :attr:`Loan.unreachable` test says nobody can change the tensors any more;
2. else the lender decides (:meth:`Loan.settle`, through the ``settle`` callback it gave): either
   :meth:`Loan.confirm` (unchanged, and nothing will change them before the job has read them)
   or :meth:`Loan.withdraw` (changed: the job is dropped unwritten, the lender records the state
   another way);
3. a confirmed job is written; :meth:`Loan.returned` is set once the persister no longer reads
   the lent memory (written, failed or dropped), so a lender that must change the tensors soon
   can wait for it (:meth:`Loan.wait_returned`).

Invariant: the persister reads lent memory only after :meth:`Loan.confirm`, and never after
:meth:`Loan.returned` is set. Anyone blocking on the pipeline from the lender's thread settles
its loans first (a persister waiting for a decision only the blocked thread can make would
never go on).
"""

from __future__ import annotations

import threading
from collections.abc import Callable


def _holds(test: Callable[[], bool]) -> bool:
    """``test()``, False when it raises (the lender then decides, as without a test)."""
    try:
        return bool(test())
    except Exception:  # noqa: BLE001 - a test that cannot tell says nothing
        return False


def _decided(loan: "Loan", early: bool) -> None:
    """The settle callback of a decided loan (nothing to decide)."""


class Loan:
    """The gate of one job's lent tensors (see the module docstring). ``settle(loan, early)``:
    the lender's decision, run on the lender's thread only (:meth:`settle`); it calls
    :meth:`confirm` or :meth:`withdraw`, or with ``early`` may leave the loan undecided."""

    def __init__(self, iteration: int, settle: Callable[["Loan", bool], None]) -> None:
        self.iteration = iteration
        self._settle = settle
        self.lender = threading.get_ident()
        self._cond = threading.Condition()
        self._decision: bool | None = None  # None: undecided; True: confirmed; False: withdrawn
        self.why = ""  # why it was withdrawn
        self._returned = False
        #: called (no arguments) when the loan is withdrawn: its pipeline takes its tail back
        self.on_withdraw: Callable[[], None] | None = None
        #: the lender's test, safe from any thread, that nobody can change the lent tensors any
        #: more (the training loop dropped them, unchanged): the waiting persister then confirms
        #: the loan itself (:meth:`wait`); None: only the lender decides
        self.unreachable: Callable[[], bool] | None = None

    @property
    def decided(self) -> bool:
        return self._decision is not None

    @property
    def confirmed(self) -> bool:
        return self._decision is True

    def confirm(self) -> None:
        self._decide(True, "")

    def withdraw(self, why: str) -> None:
        self._decide(False, why)

    def _decide(self, ok: bool, why: str) -> None:
        with self._cond:
            if self._decision is not None:
                return
            self._decision, self.why = ok, why
            # the lender's callbacks hold the lent tensors: a future kept by the caller (which
            # keeps its loan) must not keep every step's gradients alive
            self._settle, self.unreachable = _decided, None
            self._cond.notify_all()
        if not ok and self.on_withdraw is not None:
            self.on_withdraw()

    def settle(self, early: bool = False) -> bool:
        """Decide now if the calling thread is the lender's and the loan is undecided (step 2;
        ``early``: only if that needs no wait, as the lender's callback judges); returns
        whether it is decided afterwards. Any other thread leaves it to the lender."""
        if self._decision is None and threading.get_ident() == self.lender:
            self._settle(self, early)
        return self._decision is not None

    def wait(self, cancelled: Callable[[], bool] | None = None, poll_s: float = 0.02) -> bool:
        """Block until the loan is decided (the persister, step 1); returns whether it was
        confirmed. Every ``poll_s`` it asks :attr:`unreachable` and confirms the loan itself
        when the lent tensors can no longer change (the common case: the loop dropped them
        right after its step, so the delta is written then, not at the lender's next
        decision point, and a lender blocked in a wait the loan cannot see still gets its
        save); ``cancelled``: True ends the wait as a withdrawal (the pipeline was stopped at
        interpreter exit)."""
        while True:
            with self._cond:
                if self._decision is not None:
                    return self._decision
                if cancelled is not None and cancelled():
                    self._decision, self.why = False, "the store's async saves were stopped"
                    self._settle, self.unreachable = _decided, None
                    return False
                test = self.unreachable
            if test is not None and _holds(test):  # (outside the lock: reads the lender's objects)
                self.confirm()
                continue
            with self._cond:
                if self._decision is None:
                    self._cond.wait(poll_s)

    def give_back(self) -> None:
        """The persister no longer reads the lent memory (step 3)."""
        with self._cond:
            self._returned = True
            self._cond.notify_all()

    @property
    def returned(self) -> bool:
        return self._returned

    def wait_returned(self) -> None:
        """Block until the persister no longer reads the lent memory (a confirmed loan's lender
        about to let the tensors change)."""
        with self._cond:
            while not self._returned:
                self._cond.wait()
