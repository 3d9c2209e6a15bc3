"""I/O faults injected through the FileOps seam: typed errors, nothing committed lost, writing
resumes once the fault clears (no manual repair)."""

from __future__ import annotations

import errno

import numpy as np
import pytest

import ckptstore
from ckptstore.fsck import check
from ckptstore.storage.fileops import FileOps


class FaultyOps(FileOps):
    """Fails the N-th call of one kind of operation with an OSError of a chosen errno."""

    def __init__(self) -> None:
        self.arm(None)

    def arm(self, op: str | None, nth: int = 1, err: int = errno.EIO, short: bool = False,
            then: tuple | None = None) -> None:
        """Fail the ``nth`` next ``op``; ``then`` = arguments of the fault armed right after."""
        self.op, self.left, self.err, self.short, self.then = op, nth, err, short, then

    def _hit(self, op: str) -> int | None:
        """The errno to fail this call with, or None."""
        if self.op != op:
            return None
        self.left -= 1
        if self.left:
            return None
        err, short = self.err, self.short
        self.arm(*self.then) if self.then is not None else self.arm(None)
        if short:  # a short write now, then the disk fills up
            self.arm("write", 1, err)
            return -1
        return err

    def _pwritev(self, fd, buffers, offset):
        err = self._hit("write")
        if err == -1:
            first = bytes(buffers[0])[: max(1, len(buffers[0]) // 2)]
            return super()._pwritev(fd, [first], offset)
        if err:
            raise OSError(err, "injected")
        return super()._pwritev(fd, buffers, offset)

    def _fsync(self, fd):
        if err := self._hit("fsync"):
            raise OSError(err, "injected")
        super()._fsync(fd)

    def _ftruncate(self, fd, length):
        if err := self._hit("truncate"):
            raise OSError(err, "injected")
        super()._ftruncate(fd, length)

    def _rename(self, src, dst):
        if err := self._hit("rename"):
            raise OSError(err, "injected")
        super()._rename(src, dst)

    def _unlink(self, path):
        if err := self._hit("unlink"):
            raise OSError(err, "injected")
        super()._unlink(path)


def state(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {"w": rng.standard_normal(20_000).astype(np.float32), "fixed": np.arange(5000.0), "i": i}


def assert_intact(path, iterations) -> None:
    with ckptstore.open(path, "r") as s:
        assert s.iterations() == iterations
        for i in iterations:
            got = s.load(i)
            np.testing.assert_array_equal(got["w"], state(i)["w"])
            assert got["i"] == i


CASES = [("write", 1, errno.ENOSPC, False), ("write", 3, errno.EIO, False),
         ("write", 2, errno.EDQUOT, True), ("fsync", 1, errno.EIO, False),
         ("fsync", 2, errno.EIO, False)]


@pytest.mark.parametrize("op,nth,err,short", CASES)
def test_fault_during_save_keeps_committed_and_resumes(tmp_path, op, nth, err, short):
    ops = FaultyOps()
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=16 << 10, segment_size=64 << 10, file_ops=ops) as s:
        for i in range(3):
            s.save(i, state(i))
        ops.arm(op, nth, err, short)
        with pytest.raises(ckptstore.StoreIOError) as info:
            s.save(3, state(3))
        assert info.value.errno == err
        assert op in str(info.value) and str(path) in str(info.value)
        if err in (errno.ENOSPC, errno.EDQUOT):
            assert isinstance(info.value, ckptstore.DiskFullError)
        assert s.iterations() == [0, 1, 2]
        s.save(3, state(3))  # the fault has cleared: writing resumes without repair
        s.save(4, state(4))
    assert_intact(path, [0, 1, 2, 3, 4])
    assert check(path).clean


def test_fault_during_rollback_recovers_on_next_save(tmp_path):
    ops = FaultyOps()
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=16 << 10, file_ops=ops) as s:
        s.save(0, state(0))
        # The save fails, and so does the rollback's truncate: the store must recover by itself.
        ops.arm("write", 2, errno.ENOSPC, then=("truncate", 1, errno.EIO))
        with pytest.raises(ckptstore.DiskFullError):
            s.save(1, state(1))
        assert s.iterations() == [0]  # recovery (cut the tail) runs here
        s.save(1, state(1))
    assert_intact(path, [0, 1])
    assert check(path).clean


def test_fault_in_segment_roll(tmp_path):
    ops = FaultyOps()
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=16 << 10, segment_size=40 << 10, file_ops=ops) as s:
        s.save(0, state(0))
        ops.arm("fsync", 1, errno.EIO)  # the first fsync of the next save is the roll's
        with pytest.raises(ckptstore.StoreIOError):
            s.save(1, state(1))
        s.save(1, state(1))
    assert_intact(path, [0, 1])
    assert check(path).clean


@pytest.mark.parametrize("op,nth", [("write", 1), ("fsync", 2), ("rename", 1), ("rename", 2),
                                    ("unlink", 1)])
def test_fault_during_gc_loses_nothing(tmp_path, op, nth):
    ops = FaultyOps()
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=16 << 10, segment_size=64 << 10, file_ops=ops) as s:
        for i in range(6):
            s.save(i, state(i))
        ops.arm(op, nth, errno.EIO)
        try:
            s.gc(keep_last=2)
            done = True
        except ckptstore.StoreIOError:
            done = False
    with ckptstore.open(path, "a") as s:  # reopen finishes or discards the interrupted gc
        its = s.iterations()
    assert its[-2:] == [4, 5]
    assert its == ([4, 5] if done or op == "unlink" else its)
    assert set(its) <= set(range(6))
    assert_intact(path, its)
    assert check(path).clean
