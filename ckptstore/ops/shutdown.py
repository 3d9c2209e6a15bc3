"""What ckptstore stops before the interpreter finalises (issue 29: "no crash at exit").

On Python 3.11 a thread that needs the GIL once finalisation has begun is ended with
``pthread_exit``; inside torch's C++ (a gloo worker freeing the last reference to a Python tensor,
the async persister returning from a collective's ``wait``) that unwinding becomes
``std::terminate``: the process dies of SIGABRT after the script returned normally. So no thread
of ckptstore may still run torch code when finalisation begins.

``close()`` gives that already (a store's close joins its persister and destroys its rank
group). For a store left open, :func:`track` registers its persister (:class:`~.pipeline.Pipeline`)
and its rank group (:class:`~ckptstore.multirank.group.RankGroup`); one :mod:`atexit` hook, installed
the first time anything is tracked, stops them. A Python atexit hook runs after the non-daemon
threads were joined and before daemon threads (the persister is one) are killed, on the main
thread, with the interpreter whole.

Invariants:
  * Everything still tracked at exit is stopped before the hook returns: first every persister
    (``stop_at_exit``: the job it is running, a commit round included, finishes; queued ones are
    abandoned, as in a crash), then every rank group (``stop_at_exit``: destroyed, its gloo
    threads joined). Persisters first: a group destroyed under a collective in flight would wait
    for that collective's timeout.
  * A stopped store keeps everything committed before or by the job that was running; what was
    only queued or appended without a commit is abandoned exactly as a crash would abandon it (the
    next open recovers the store as after a crash). Each store stopped this way is named in a
    ResourceWarning and a warning on the ``ckptstore`` logger.
  * Objects are held weakly: tracking keeps nothing alive; ``forget`` (a ``close``) unregisters.
"""

from __future__ import annotations

import atexit
import logging
import threading
import warnings
import weakref
from typing import Protocol

#: the order objects are stopped in at exit
PERSISTERS, GROUPS = 0, 1


class Stoppable(Protocol):
    def stop_at_exit(self) -> str | None:
        """Stop (the interpreter is exiting with it still open); return what to warn about, or
        None when nothing was lost or left open."""


_lock = threading.Lock()
_tracked: tuple[weakref.WeakSet, weakref.WeakSet] = (weakref.WeakSet(), weakref.WeakSet())
_installed = False


def track(obj: Stoppable, phase: int) -> None:
    """Stop ``obj`` at exit unless it is forgotten first (``phase``: PERSISTERS or GROUPS)."""
    global _installed
    with _lock:
        _tracked[phase].add(obj)
        if not _installed:
            # registered after torch's own hooks (torch is imported before any store runs), so
            # it runs before them (atexit is last in, first out)
            atexit.register(_at_exit)
            _installed = True


def forget(obj: Stoppable) -> None:
    """``obj`` was closed: nothing to do at exit."""
    with _lock:
        for s in _tracked:
            s.discard(obj)


def stop_all() -> list[str]:
    """Stop everything tracked (persisters, then groups); returns the warnings' texts."""
    said = []
    for phase in (PERSISTERS, GROUPS):
        with _lock:
            objs = list(_tracked[phase])
            _tracked[phase].clear()
        for obj in objs:
            try:
                message = obj.stop_at_exit()
            except Exception as e:  # noqa: BLE001 - the other objects are stopped still
                message = f"ckptstore: stopping {obj!r} at exit failed: {type(e).__name__}: {e}"
            if message:
                said.append(message)
    return said


def _at_exit() -> None:
    for message in stop_all():
        warnings.warn(message, ResourceWarning, stacklevel=1)
        logging.getLogger("ckptstore").warning("%s", message)
