"""Errors that cross ranks: what a FAILED vote says, and how the other ranks rebuild it.

A rank whose commit operation fails votes FAILED with one line, ``"TypeName: message"``, of the
root ckptstore error of its failure (:func:`describe`: the innermost CkptStoreError on the
``__cause__`` chain, e.g. the DiskFullError naming the file rather than the CheckpointAbortedError
that wraps it). The other ranks rebuild it (:func:`rebuild`) as an instance of that class when
:mod:`ckptstore.errors` defines it, looked up by name among CkptStoreError subclasses only (nothing
is imported or unpickled on a peer's word); otherwise, or when the class takes other arguments, as
RankFailureError. Either way its message starts with the rank that raised it, and its ``rank``
attribute holds it. The committer makes it the ``__cause__`` of each rank's own error.
"""

from __future__ import annotations

from .. import errors
from ..errors import CkptStoreError, RankFailureError


def describe(error: BaseException) -> str:
    """One line for a FAILED vote: ``"TypeName: message"`` of ``error``'s root ckptstore error
    (``error`` itself when no CkptStoreError caused it)."""
    root: BaseException = error
    cause = error.__cause__
    while cause is not None:
        if isinstance(cause, CkptStoreError):
            root = cause
        cause = cause.__cause__
    return f"{type(root).__name__}: {root}"


def rebuild(rank: int, text: str) -> CkptStoreError:
    """The error rank ``rank`` described as ``text`` (:func:`describe`), as a typed error."""
    name, sep, message = text.partition(": ")
    cls = vars(errors).get(name) if sep else None
    error: CkptStoreError | None = None
    if isinstance(cls, type) and issubclass(cls, CkptStoreError):
        try:
            error = cls.from_message(f"rank {rank}: {message}")
        except TypeError:  # a class whose constructor takes more than a message
            error = None
    if error is None:
        error = RankFailureError(f"rank {rank}: {text}")
    setattr(error, "rank", rank)
    return error
