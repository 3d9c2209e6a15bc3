"""Shared fixtures for the ckptstore tests: deep structural equality, a save/load round trip, and
tables that test modules print in the run's terminal summary (:func:`add_terminal_table`)."""

from __future__ import annotations

import errno
import struct
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np
import pytest
import torch

import ckptstore
from ckptstore.storage.fileops import FileOps


def _torch_bytes(t: torch.Tensor) -> bytes:
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _key(k) -> str:
    if type(k) is int and k.bit_length() > 4000:  # repr() of huge ints hits the digit limit
        return f"<int of {k.bit_length()} bits>"
    return repr(k)


def _same(a, b, path: str) -> None:
    assert type(a) is type(b), f"{path}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert tuple(a.shape) == tuple(b.shape), f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert a.requires_grad == b.requires_grad, f"{path}: requires_grad differs"
        assert b.device.type == "cpu", f"{path}: loaded on {b.device}"
        assert _torch_bytes(a) == _torch_bytes(b), f"{path}: tensor bytes differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype.str == b.dtype.str, f"{path}: dtype {a.dtype.str} != {b.dtype.str}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), \
            f"{path}: array bytes differ"
    elif type(a) is float:  # bit equality: -0.0 is not 0.0, NaN sign and payload count
        assert struct.pack("<d", a) == struct.pack("<d", b), \
            f"{path}: {a!r} != {b!r} ({struct.pack('>d', a).hex()} vs {struct.pack('>d', b).hex()})"
    elif type(a) in (dict, OrderedDict):
        ka, kb = list(a), list(b)
        assert ka == kb and [type(k) for k in ka] == [type(k) for k in kb], \
            f"{path}: keys {[_key(k) for k in ka]} != {[_key(k) for k in kb]}"
        assert hasattr(a, "_metadata") == hasattr(b, "_metadata"), f"{path}: _metadata presence differs"
        if hasattr(a, "_metadata"):
            _same(a._metadata, b._metadata, f"{path}._metadata")
        for k in ka:
            _same(a[k], b[k], f"{path}[{_key(k)}]")
    elif type(a) in (list, tuple):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {_key(a)} != {_key(b)}"


@pytest.fixture(scope="session")
def assert_same():
    """``assert_same(expected, actual)``: exact types, key order, tensor/array bits, float bits
    (NaN sign and payload included)."""

    def check(a, b, path: str = "state") -> None:
        _same(a, b, path)

    return check


@pytest.fixture
def roundtrip(tmp_path):
    """``roundtrip(state, **open_options)``: save as iteration 1, load it back through the writer
    and through a fresh read-only open; both loads must agree exactly. Returns the reader's load."""
    counter = iter(range(1_000_000))

    def run(state, meta=None, **options):
        path = tmp_path / f"store{next(counter)}"
        with ckptstore.open(path, mode="a", **options) as w:
            w.save(1, state, meta=meta)
            first = w.load(1)
        with ckptstore.open(path, mode="r") as r:
            second = r.load(1)
        _same(first, second, "state")
        return second

    return run


class FullDisk(FileOps):
    """Every segment write fails with ENOSPC while ``full`` is set."""

    full = False

    def _pwritev(self, fd, buffers, offset):
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return super()._pwritev(fd, buffers, offset)


def create_store_without_features(path, chunk_size: int = 4 << 20,
                                  segment_size: int = 1 << 30) -> None:
    """Create at ``path`` a store with STORE flags 0, as releases before FRAMING_CHECKS made
    them (format-spec/format.md §4), through the user-facing ``features="compatible"``: writers
    opening it frame every record with a full payload check, and stay readable by those
    releases."""
    import ckptstore

    ckptstore.open(path, features="compatible", chunk_size=chunk_size,
                   segment_size=segment_size).close()


def chunk_records(path) -> list[tuple[str, int, Any, bytes, bytes]]:
    """(segment path, offset, record header, payload, trailer) of every CHUNK record in the
    segments of the store at ``path``, in log order."""
    from ckptstore.format import records as rec
    from ckptstore.storage.layout import Layout
    from ckptstore.storage.segments import ScannedRecord, SegmentFile, scan_segment

    layout = Layout(str(path))
    out = []
    for seq in layout.list_segments():
        f = SegmentFile(layout.segment_path(seq), seq)
        try:
            for r in scan_segment(f):
                if isinstance(r, ScannedRecord) and r.type == rec.RecordType.CHUNK:
                    buf = f.pread(r.loc.offset, r.loc.end - r.loc.offset)
                    header = rec.decode_header(buf)
                    end = rec.HEADER_SIZE + header.length
                    out.append((f.path, r.loc.offset, header, bytes(buf[rec.HEADER_SIZE:end]),
                                bytes(buf[end:])))
        finally:
            f.close()
    return out


def chunk_record_flags(path) -> list[int]:
    """The record flags of every CHUNK record in the store at ``path``."""
    return [header.flags for _, _, header, _, _ in chunk_records(path)]


# ---- tables in the terminal summary ---------------------------------------------------------------

#: {title: (header, rows)}: what test modules handed to :func:`add_terminal_table` in this run
_TABLES: dict[str, tuple[list[str], list[list[str]]]] = {}


def add_terminal_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print a table (first column left-aligned, the others right-aligned) in this run's terminal
    summary, where ``pytest -q`` shows it (what a test prints is captured unless ``-s``). Only
    tests that ran add one; a second table with the same title replaces the first."""
    _TABLES[title] = (list(header), [[str(c) for c in r] for r in rows])


def pytest_terminal_summary(terminalreporter) -> None:
    for title, (header, rows) in _TABLES.items():
        cells = [header, *rows]
        widths = [max(len(r[k]) for r in cells) for k in range(len(header))]
        terminalreporter.write_sep("-", title)
        for r in cells:
            terminalreporter.write_line("  ".join(
                c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(r, widths))))


@pytest.fixture
def one_torch_thread():
    """torch on one intra-op thread for the test (restored after): bit-exact comparisons with a
    reference computed on one thread, and forked children that must not use an OpenMP pool."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
