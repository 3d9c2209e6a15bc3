"""The multi-rank harness (tests/_ranks.py) never hides a crash: a rank dead of SIGSEGV comes back
as ``{"died": -11}`` even when it had written its result, and its native stacks (gdb over its
core, where the system writes cores to files and gdb is installed) reach the test's stderr."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal

import pytest
from _ranks import file_core_pattern, needs_gloo, run_ranks

MOD = __name__

pytestmark = [
    needs_gloo,
    pytest.mark.timeout(400),
]


def crash(rank, world, path, when):
    """Rank 1 dies of SIGSEGV: in the scenario (``when="during"``) or as its group is torn
    down, after its result was written (``when="after"``)."""
    import torch.distributed as dist

    dist.barrier()
    if rank == 1:
        if when == "during":
            ctypes.string_at(0)
        dist.destroy_process_group = lambda *a, **k: ctypes.string_at(0)
    return rank


def _cores_land_in_files() -> bool:
    import resource

    return file_core_pattern() is not None and resource.getrlimit(resource.RLIMIT_CORE)[1] != 0


@pytest.mark.parametrize("when", ["during", "after"])
def test_a_rank_dead_of_sigsegv_is_reported_with_its_native_stacks(tmp_path, capsys, when):
    work = str(tmp_path / "w")
    res = run_ranks(2, MOD, "crash", str(tmp_path / "p"), work, deadline=300, when=when)
    assert res[0] == {"ok": 0}
    assert res[1] == {"died": -signal.SIGSEGV}, res  # "after": its result was {"ok": 1}
    err = capsys.readouterr().err
    assert "rank 1 (pid " in err and "died of SIGSEGV" in err, err
    if not _cores_land_in_files():
        assert "no core file" in err
        return
    cores = [f for f in os.listdir(work) if f.startswith("core.rank1.")]
    assert len(cores) == 1, os.listdir(work)  # moved out of the rank's working directory
    if shutil.which("gdb") is None:
        assert "no gdb to read it" in err
        return
    assert "native stacks (gdb)" in err, err[-3000:]
    # every thread's backtrace, the faulting one with the signal frame and the faulting call
    assert "thread apply all" not in err and "Thread 1 (" in err, err[-3000:]
    assert "<signal handler called>" in err, err[-3000:]
    if when == "during":
        assert "string_at" in err, err[-3000:]
