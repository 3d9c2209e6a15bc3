#!/usr/bin/env python3
"""profile_snapshot: where the CPU of one asynchronous snapshot goes, phase by phase (issue 30).

bench_snapshot.py's model (a 4.5M-parameter GPT + AdamW, 62.1 MB of Checkpointer state: the tied
embedding is stored twice and deduplicated) trains ``--warm`` steps, then takes ``--snaps``
snapshots with ``Checkpointer(policy="snapshots")`` (overlapped copy, the default), each awaited
before the next step. Every phase is timed in CPU time (``time.thread_time``) on the thread that
runs it, exclusive of the phases it calls: the persister's (the engine's ``save_snapshot`` and
what it calls, wrapped at module level), the copier thread's overlapped copy and, where the code
has one, the O_DIRECT writer thread's writes. Printed: ms per snapshot per phase, and the total
per MB.

    python tools/profile_snapshot.py
    python tools/profile_snapshot.py --json /tmp/phases.json

The wrappers cost a few microseconds per call (a ``thread_time`` system call each), charged to
the calling phase ("other Python"): totals run a little above an unwrapped persister's.
Comparing two versions: run a copy of this file in each checkout's tools/ (a tool imports the
ckptstore of its own checkout, as bench_delta.py puts it first on the path); the model, its
training and the snapshots are the same.
"""

from __future__ import annotations

import collections
import functools
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from bench_delta import build, fwd_bwd  # noqa: E402
from bench_snapshot import model_parser  # noqa: E402
from harness import header, machine, table, write_json  # noqa: E402

_PERSIST = "ckptstore-persist"
_DIRECT = "ckptstore-direct"


class PhaseTimer:
    """Exclusive CPU time per phase label, per thread: a wrapped call's time less that of the
    wrapped calls it makes. Only the persister's calls are charged (a phase runs on other
    threads too: the training thread's own saves are not this profile's), except O_DIRECT writes
    on the log's writer thread, charged to a label of their own."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = collections.defaultdict(float)
        self._tls = threading.local()

    def wrap(self, owner: Any, name: str, label: str) -> None:
        fn: Callable = getattr(owner, name)
        acc, tls = self.ms, self._tls

        @functools.wraps(fn)
        def timed(*args: Any, **kw: Any) -> Any:
            thread = threading.current_thread().name
            if thread.startswith(_DIRECT) and label == "O_DIRECT writes":
                t0 = time.thread_time()
                try:
                    return fn(*args, **kw)
                finally:
                    acc["O_DIRECT writes (writer thread)"] += time.thread_time() - t0
            if not thread.startswith(_PERSIST):
                return fn(*args, **kw)
            stack = tls.__dict__.setdefault("stack", [])
            stack.append(0.0)
            t0 = time.thread_time()
            try:
                return fn(*args, **kw)
            finally:
                spent = time.thread_time() - t0
                acc[label] += spent - stack.pop()
                if stack:
                    stack[-1] += spent

        setattr(owner, name, timed)


def instrument() -> PhaseTimer:
    """Wrap the persister's phases (module-level names, so callers see the wrappers)."""
    from ckptstore.engine import transaction, write_path, writer_engine
    from ckptstore.ops import deferred_copy
    from ckptstore.storage import direct, fileops

    t = PhaseTimer()
    t.wrap(writer_engine.WriterEngine, "save_snapshot", "other Python (per tensor, per record)")
    t.wrap(write_path, "address_of", "xxh3-128 chunk addresses")
    t.wrap(write_path, "choose_encoding", "lz4 (trials and compressions)")
    t.wrap(direct.DirectAppender, "put", "copy into the O_DIRECT staging buffer")
    t.wrap(fileops.FileOps, "write_direct", "O_DIRECT writes")
    t.wrap(write_path, "stored_chunk", "dedup look-ups (index)")
    t.wrap(write_path, "stored_tree", "dedup look-ups (index)")
    t.wrap(write_path, "encode_manifest", "manifest")
    t.wrap(transaction.Transaction, "commit", "commit: COMMIT record, fsyncs, index")
    run = deferred_copy.DeferredCopy.run

    @functools.wraps(run)
    def copy_run(self: Any) -> None:
        t0 = time.thread_time()
        try:
            run(self)
        finally:
            t.ms["overlapped copy (copier thread)"] += time.thread_time() - t0

    deferred_copy.DeferredCopy.run = copy_run  # type: ignore[method-assign]
    return t


def main(argv: list[str] | None = None) -> int:
    ap = model_parser(__doc__)
    ap.add_argument("--snaps", type=int, default=12, help="snapshots profiled (default 12)")
    ap.add_argument("--warm", type=int, default=60, help="training steps before (default 60)")
    ap.add_argument("--json", default=None, help="write the phases here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    import ckptstore
    from ckptstore.torch import Checkpointer

    timer = instrument()
    model, opt = build(a)
    for it in range(a.warm):
        fwd_bwd(model, a, 100_000 + it)
        opt.step()
        opt.zero_grad()
    work = tempfile.mkdtemp(prefix="profile-snapshot-")
    mach = machine(ckptstore_from=os.path.dirname(ckptstore.__file__))
    try:
        with ckptstore.open(os.path.join(work, "store")) as store:
            ck = Checkpointer(store, model, opt, policy="snapshots", snapshot_every=1,
                              mtbf_s=3600.0)
            ck.restore()
            stats = None
            for it in range(1, a.snaps + 3):  # the first two: warm-up, not counted
                fwd_bwd(model, a, it)
                fut = ck.step(it)
                opt.zero_grad()
                fut.copied()
                stats = fut.result()
                if it == 2:
                    timer.ms.clear()
            ck.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert stats is not None
    mb = stats.logical_bytes / 1e6
    phases = {k: 1e3 * v / a.snaps for k, v in sorted(timer.ms.items(), key=lambda kv: -kv[1])}
    total = sum(phases.values())
    print(header(f"profile_snapshot: {a.snaps} snapshots of {mb:.1f} MB after {a.warm} steps",
                 mach))
    print(table(["phase", "CPU ms per snapshot"], [[k, f"{v:.1f}"] for k, v in phases.items()] +
                [["total", f"{total:.1f}"], ["total per MB", f"{total / mb:.3f}"]]))
    write_json(a.json, "profile_snapshot", a, mach, {"phases_ms": phases}, {"total_ms": total},
               mb=mb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
