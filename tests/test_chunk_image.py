"""Chunk images (ckptstore/format/image.py): deltas whose tensors lie in memory as their CHUNK
records will lie in the log, framed in place and written without a staging copy.

What must hold: the framed bytes are ordinary, valid v1 records (a reader of any version reads
them like any others); a store writes them through O_DIRECT, buffered, or on a file system that
refuses O_DIRECT, and loads every delta exactly; chunks already stored or compressible are left
out of the image; a kill at any write or fsync leaves a prefix of whole iterations; the
Checkpointer captures gradients into images."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptstore
from ckptstore.format import records as rec
from ckptstore.format.chunk import Codec, address_of, decode_chunk
from ckptstore.format.image import (BLOCK, DATA_OFFSET, RECORD_OVERHEAD, ChunkImage, pad_payload,
                                    pad_size, seal_chunk, seal_pad)
from ckptstore.ops.fsck import check
from ckptstore.storage import direct
from ckptstore.tensors import ImageTensor
from test_direct import _RefusingOpen, _RefusingWrite, dio_dir  # noqa: F401 - a fixture

CHUNK = 16 << 10
STRIDE = ChunkImage.stride_for(CHUNK)


def _walk(buf: bytes, flags: int = 0) -> list[tuple[int, int, bytes, bytes]]:
    """Every record of ``buf`` in order: (offset, type, chunk address, chunk data); each must have
    record ``flags``."""
    out, off = [], 0
    while off < len(buf):
        header, payload = rec.decode_record(buf[off:])
        assert header.type == rec.RecordType.CHUNK and header.flags == flags
        ch, data = decode_chunk(payload)
        assert ch.codec is Codec.RAW and address_of(data) == ch.address
        out.append((off, header.type, ch.address, bytes(data)))
        off += header.total_size
    assert off == len(buf)
    return out


# ---- the pure layer ------------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(nbytes=st.integers(1, 3 * 3 * BLOCK + 777), blocks=st.integers(2, 4), seed=st.integers(0, 2**32 - 1),
       framing=st.booleans())
def test_a_framed_image_is_a_run_of_valid_chunk_records(nbytes: int, blocks: int, seed: int,
                                                       framing: bool) -> None:
    geo = ChunkImage(nbytes, blocks * BLOCK)
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    image = bytearray(np.random.default_rng(seed + 1).integers(0, 256, geo.size, dtype=np.uint8))
    buf = memoryview(image)
    for j in range(geo.n_chunks):
        start, n = geo.data_offset(j), geo.data_length(j)
        buf[start:start + n] = data[j * geo.chunk_size:j * geo.chunk_size + n]
        seal_chunk(buf, j * geo.stride, address_of(buf[start:start + n]), n, framing)
        lo, hi = geo.span(j)
        assert lo % BLOCK == 0 and hi % BLOCK == 0 and lo == j * geo.stride
    if geo.pad:
        seal_pad(buf, geo.records_end, geo.pad, framing)
    assert geo.size % BLOCK == 0 and (geo.pad == 0 or geo.pad >= RECORD_OVERHEAD)
    records = _walk(bytes(image), rec.FRAMING_CHECK if framing else 0)
    assert b"".join(r[3] for r in records[:geo.n_chunks]) == data
    assert [r[0] for r in records[:geo.n_chunks]] == [j * geo.stride for j in range(geo.n_chunks)]
    if geo.pad:
        assert len(records) == geo.n_chunks + 1 and records[-1][3] == bytes(geo.pad - RECORD_OVERHEAD)
    else:
        assert len(records) == geo.n_chunks


@pytest.mark.parametrize("end", [0, 1, 4095 - 63, 4096 - 64, 4096 - 63, 4096 - 1, 4096, 12345])
def test_pad_records_reach_the_next_block_and_are_never_shorter_than_a_record(end: int) -> None:
    pad = pad_size(end)
    assert (end + pad) % BLOCK == 0 and (pad == 0 or pad >= RECORD_OVERHEAD)
    if pad:
        assert [r[3] for r in _walk(rec.encode_record(rec.RecordType.CHUNK, pad_payload(pad)))] == [bytes(pad - RECORD_OVERHEAD)]


def test_geometry_refuses_what_it_cannot_lay_out() -> None:
    with pytest.raises(ValueError):
        ChunkImage(10, 4096 + 64)  # not a block multiple
    with pytest.raises(ValueError):
        ChunkImage(0, STRIDE)
    assert ChunkImage.stride_for(4 << 20) == 4 << 20 and ChunkImage.stride_for(100) == 2 * BLOCK
    assert ChunkImage(1, 4 << 20).chunk_size == (4 << 20) - 64 == DATA_OFFSET + (4 << 20) - 120


# ---- ImageTensor ---------------------------------------------------------------------------------

def image_state(values: dict[str, torch.Tensor], stride: int = STRIDE) -> dict:
    """A state whose tensors lie in chunk images of one page-aligned host buffer."""
    sizes = [ChunkImage(v.nbytes, stride).size for v in values.values()]
    buf = torch.empty(sum(sizes) + BLOCK, dtype=torch.uint8)
    off = -buf.data_ptr() % BLOCK
    out: dict = {}
    for (k, v), size in zip(values.items(), sizes):
        out[k] = ImageTensor(buf, off, v.dtype, tuple(v.shape), stride).copy_(v)
        off += size
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool])
def test_an_image_tensor_holds_the_bits_it_was_given(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    v = (torch.randn(37, 1001, generator=g) * 100).to(dtype)
    if dtype.is_floating_point:
        v.view(-1)[5] = float("nan")
    t = image_state({"v": v})["v"]
    back = t.to_tensor()
    assert back.dtype == dtype and back.shape == v.shape
    assert torch.equal(back.view(torch.uint8), v.view(torch.uint8))
    assert t.same_bits(v) and not t.same_bits(torch.zeros_like(v))


def test_dtypes_that_cannot_lie_in_an_image_are_refused() -> None:
    assert not ImageTensor.fits(torch.complex128, 1600, STRIDE)
    assert not ImageTensor.fits(torch.float32, 0, STRIDE)
    buf = torch.empty(4 * STRIDE, dtype=torch.uint8)
    off = -buf.data_ptr() % BLOCK
    with pytest.raises(ValueError):
        ImageTensor(buf, off + 8, torch.float32, (100,), STRIDE)  # not page-aligned


# ---- a store writing images ----------------------------------------------------------------------

def _grads(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return {"w": torch.randn(3 * CHUNK // 4 + 99, generator=g), "v": torch.randn(700, 9, generator=g),
            "b": torch.randn(50, generator=g)}


def _imaged(i: int) -> dict:
    grads = _grads(i)
    imaged = image_state({k: v for k, v in grads.items() if k != "b"})
    return {"g": imaged, "b": grads["b"], "i": i}


def check_loads_of(path: Path, its: list[int], grads: Callable[[int], dict],
                   chunk_size: int | None = None) -> None:
    """The store at ``path`` holds iteration 0 and the delta records ``its``, each holding
    ``grads(i)`` ("w", "v" under "g"; "b"; "i") bit for bit, at ``chunk_size`` when given."""
    with ckptstore.open(path, mode="r") as r:
        assert r.iterations() == [0, *its]
        for i in its:
            got, want = r.load_record(i), grads(i)
            assert torch.equal(got["g"]["w"], want["w"]) and torch.equal(got["g"]["v"], want["v"])
            assert torch.equal(got["b"], want["b"]) and got["i"] == i
            assert chunk_size is None or r.manifest(i).chunk_size == chunk_size


def _check_loads(path: Path, its: list[int]) -> None:
    check_loads_of(path, its, _grads, STRIDE - RECORD_OVERHEAD)


def every_kind_of_append(tmp_path: Path, mode: str, record: Callable[[int], dict],
                         check_loads: Callable[[Path, list[int]], None], direct_bytes: int) -> None:
    """Deltas ``record(1..6)`` appended in ``mode`` (O_DIRECT, buffered, O_DIRECT refused at
    open or at the first write) load exactly, fsck is clean, and after the index is deleted the
    next writer appends ``record(7)`` to a rebuilt cache. ``direct_bytes``: the least the
    O_DIRECT mode writes so."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    fd = direct.supported() and ckptstore.storage.fileops.FileOps().open_direct(str(probe))
    if mode == "direct" and not fd:
        pytest.skip("no O_DIRECT here")
    if fd:
        import os
        os.close(fd)
    ops = {"refused-open": _RefusingOpen, "refused-write": _RefusingWrite}.get(mode)
    kw = dict(chunk_size=CHUNK, direct_io=mode != "buffered")
    if ops is not None:
        kw["file_ops"] = ops()
    path = tmp_path / "s"
    with ckptstore.open(path, **kw) as s:
        s.save(0, {"w": torch.zeros(10)})
        for i in range(1, 7):
            s.save_delta(i, record(i), durable=i % 2 == 0)
        s.flush()
        writer = s.engine.log.writer
        if mode == "direct":
            assert writer.direct is not None and writer.direct.direct_bytes > direct_bytes
        elif mode != "buffered":
            assert writer.direct is None  # fell back to buffered appends
    report = check(str(path))
    assert report.clean, report.lines()
    check_loads(path, list(range(1, 7)))
    shutil.rmtree(path / "index")  # a rebuilt cache indexes the framed records (and the pads)
    with ckptstore.open(path, chunk_size=CHUNK) as s:
        s.save_delta(7, record(7), durable=True)
    assert check(str(path)).clean
    check_loads(path, list(range(1, 8)))


@pytest.mark.parametrize("mode", ["direct", "buffered", "refused-open", "refused-write"])
def test_imaged_deltas_load_exactly_through_every_kind_of_append(tmp_path: Path, mode: str) -> None:
    every_kind_of_append(tmp_path, mode, _imaged, _check_loads, 6 * 3 * CHUNK)
    if mode == "direct":
        with ckptstore.open(tmp_path / "s", mode="r") as r:
            ref = r.engine.index.get_chunk(address_of(_grads(6)["w"].numpy().tobytes()[:STRIDE - 64]))
            assert ref is not None and ref.loc.offset % BLOCK == 0  # framed where the image lay


def test_chunks_already_stored_or_compressible_are_left_out_of_the_image(dio_dir: Path) -> None:
    """A delta whose chunks repeat earlier ones (same content) writes none of them again; a chunk
    of zeros goes compressed after the image; what remains of the image is still written from a
    block boundary and everything loads exactly."""
    path = dio_dir / "s"
    per = (STRIDE - RECORD_OVERHEAD) // 4  # floats per full chunk
    g = torch.Generator().manual_seed(5)
    first = torch.randn(4 * per + 10, generator=g)
    with ckptstore.open(path, chunk_size=CHUNK) as s:
        s.save(0, {"w": torch.zeros(10)})
        s.save_delta(1, {"g": image_state({"a": first})}, durable=True)
        again = first.clone()
        again[per:2 * per] = 0  # chunk 1: zeros (compresses)
        again[2 * per:3 * per] = torch.randn(per, generator=g)  # chunk 2: new
        # chunks 0, 3 and the tail are as in iteration 1; "b" repeats "a" whole
        stats = s.save_delta(2, {"g": image_state({"a": again, "b": again})}, durable=True)
        assert stats.chunks_written == 2  # the zeros (lz4) and the new chunk
        assert stats.dedup_bytes == again.nbytes * 2 - 2 * per * 4
        assert stats.written_bytes < 2 * per * 4 + 3 * BLOCK + 1000
    report = check(str(path))
    assert report.clean, report.lines()
    with ckptstore.open(path, mode="r") as r:
        rec2 = r.load_record(2)["g"]
        assert torch.equal(rec2["a"], again) and torch.equal(rec2["b"], again)
        assert torch.equal(r.load_record(1)["g"]["a"], first)


def _durable_prefix(path: Path, where: str, durable: int) -> list[int]:
    """The iterations a killed writer left at ``path``: 0..n with no gap, n at least the newest
    one it reported durable (AssertionError naming ``where`` otherwise)."""
    with ckptstore.open(path, chunk_size=CHUNK) as w:
        its = w.iterations()
    assert its == list(range(len(its))) and its[-1] >= durable, f"{where}: {its}"
    return its


def sigkill_sweep_of_deltas(dio_dir: Path, assert_same, kind: str, record: Callable[[int], dict],
                            grads: Callable[[int], dict],
                            check_loads: Callable[[Path, list[int]], None]) -> None:
    """Kill the writer at each of its writes (an O_DIRECT write torn on a block boundary) and
    fsyncs while it appends deltas ``record(1..4)``: a prefix of whole iterations survives
    (``grads(i)`` bit for bit), every durable one among them, fsck is clean and the next writer
    finishes the run. ``kind`` "framing_checks": a store created now (FRAMING_CHECK records,
    whose trailers do not cover the data); "full_checks": one created without the feature."""
    from _crashkit import kill_sweep
    from conftest import chunk_record_flags, create_store_without_features

    template = dio_dir / "template"
    if kind == "full_checks":
        create_store_without_features(template, CHUNK)
    with ckptstore.open(template, chunk_size=CHUNK) as s:
        s.save(0, {"w": torch.zeros(10)})

    def run(path: Path, ops, journal=None) -> None:
        s = ckptstore.open(path, chunk_size=CHUNK, file_ops=ops)
        for i in range(1, 5):
            s.save_delta(i, record(i), durable=i % 2 == 0)
            if journal is not None and s.durable_iteration() is not None:
                journal(f"durable {s.durable_iteration()}")
        s.close()

    for path, where, durable in kill_sweep(template, dio_dir, run):
        its = _durable_prefix(path, where, durable)
        with ckptstore.open(path, chunk_size=CHUNK) as w:
            for i in its[1:]:
                got = w.load_record(i)
                assert_same(grads(i), {**got["g"], "b": got["b"]}, f"{where}: iteration {i}")
            for i in range(its[-1] + 1, 5):
                w.save_delta(i, record(i), durable=True)
        assert check(str(path)).clean, where
        check_loads(path, [1, 2, 3, 4])
        assert set(chunk_record_flags(path)) == {rec.FRAMING_CHECK if kind == "framing_checks" else 0}
        shutil.rmtree(path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["framing_checks", "full_checks"])
def test_sigkill_at_every_write_and_fsync_of_imaged_deltas(dio_dir: Path, assert_same, kind: str) -> None:
    sigkill_sweep_of_deltas(dio_dir, assert_same, kind, _imaged, _grads, _check_loads)


def test_the_checkpointer_captures_gradients_into_chunk_images(tmp_path: Path) -> None:
    """Large CPU gradients are captured into images (the delta's manifest uses the image chunk
    size) and replay reproduces training bit for bit."""
    from ckptstore.torch import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 200), torch.nn.Tanh(), torch.nn.Linear(200, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with ckptstore.open(tmp_path / "s", chunk_size=CHUNK) as s:
        ck = Checkpointer(s, model, opt, policy="every-iteration", base_every=50, group_commit=2,
                          capture="hooks")  # (the default lends the large gradients instead)
        ck.restore()
        for it in range(1, 6):
            x = torch.randn(16, 64)
            model(x).square().mean().backward()
            ck.step(it)
            opt.zero_grad()
        ck.flush()
        assert ck.capture_counts["hook"] >= 5 * 4
        assert s.manifest(5).chunk_size == STRIDE - RECORD_OVERHEAD
        want = {k: v.clone() for k, v in model.state_dict().items()}
        ck.close()
    with ckptstore.open(tmp_path / "s", mode="r") as r:
        got = r.load(5)["model"]
        assert all(torch.equal(got[k], v) for k, v in want.items())
    assert check(str(tmp_path / "s")).clean


# ---- asynchronous snapshots staged in images -----------------------------------------------------

def test_compression_trials_skip_chunks_that_save_too_little() -> None:
    """A chunk whose trial saved less than ``min_saving`` (or nothing) is stored raw for its next
    ``skip`` trials, then tried again; one that saved more is tried every time."""
    from ckptstore.engine.write_path import CompressionTrials

    t = CompressionTrials(skip=3, min_saving=0.25)
    t.record("a", 0, 1000, 860)  # 14%: too little
    t.record("b", 0, 1000, 1000)  # nothing
    t.record("c", 0, 1000, 700)  # 30%: worth it
    assert [t.due("a", 0) for _ in range(4)] == [False, False, False, True]
    assert [t.due("b", 0) for _ in range(4)] == [False, False, False, True]
    assert all(t.due("c", 0) for _ in range(4)) and t.due("a", 1)


def _snapshot_state(i: int) -> dict:
    """Every kind of leaf a snapshot stages: large CPU tensors (in images: several chunks, a
    strided view, bfloat16 with a NaN payload), and leaves that are not (complex, tiny, numpy)."""
    g = torch.Generator().manual_seed(200 + i)
    big = torch.randn(2 * CHUNK // 4 + 333, generator=g)
    half = torch.randn(40, 300, generator=g).to(torch.bfloat16)
    half.view(torch.int16)[0, 0] = 0x7FC1  # a NaN payload
    return {"big": big, "same": torch.arange(5000, dtype=torch.float32),
            "strided": torch.randn(300, 20, generator=g).t(), "half": half,
            "cplx": torch.randn(100, dtype=torch.complex64, generator=g), "tiny": torch.ones(3),
            "np": np.arange(1000, dtype=np.int64) * i, "i": i}


def test_async_snapshots_stage_tensors_in_images_and_load_exactly(dio_dir: Path, assert_same) -> None:
    """save_async stages large CPU tensors in chunk images, written from the arena: they load bit
    for bit (also through an overlapped copy), the manifest records the image chunk size, a tensor
    unchanged since the last snapshot is not written again, and fsck is clean."""
    path = dio_dir / "s"
    with ckptstore.open(path, chunk_size=CHUNK) as s:
        for i in range(1, 4):
            fut = s.save_async(i, _snapshot_state(i), deferred=(lambda t: True) if i == 2 else None)
            fut.copied()
            stats = fut.result()
            assert s.manifest(i).chunk_size == STRIDE - RECORD_OVERHEAD
            if i > 1:  # "same" (20000 bytes: 2 chunks) deduplicates
                assert stats.dedup_bytes >= 20000
        writer = s.engine.log.writer
        assert writer.direct is not None and writer.direct.direct_bytes > 3 * 2 * CHUNK
        s.pipeline.snapshot_images = False  # the plain staging path writes the same tensors
        s.save_async(4, _snapshot_state(4)).result()
        assert s.manifest(4).chunk_size == CHUNK
    assert check(str(path)).clean
    with ckptstore.open(path, mode="r") as r:
        for i in range(1, 5):
            assert_same(_snapshot_state(i), r.load(i), f"iteration {i}")


@pytest.mark.slow
def test_sigkill_at_every_write_and_fsync_of_imaged_async_snapshots(dio_dir: Path, assert_same) -> None:
    """Kill the writer at each write (torn on a block boundary) and fsync of two async snapshots
    staged in images: the iterations it left are whole and exact, every durable one among them."""
    from _crashkit import kill_sweep

    template = dio_dir / "template"
    with ckptstore.open(template, chunk_size=CHUNK) as s:
        s.save(0, {"w": torch.zeros(10)})

    def run(path: Path, ops, journal=None) -> None:
        s = ckptstore.open(path, chunk_size=CHUNK, file_ops=ops)
        for i in (1, 2):
            s.save_async(i, _snapshot_state(i)).result()
            if journal is not None:
                journal(f"durable {i}")
        s.close()

    for path, where, durable in kill_sweep(template, dio_dir, run):
        its = _durable_prefix(path, where, durable)
        with ckptstore.open(path, chunk_size=CHUNK) as w:
            for i in its[1:]:
                assert_same(_snapshot_state(i), w.load(i), f"{where}: iteration {i}")
        shutil.rmtree(path)
