"""FRAMING_CHECK records (format-spec/format.md §4, §5, §8): in a store created with the
FRAMING_CHECKS feature, a CHUNK record's trailer covers its chunk header only, its data being
covered by the chunk's xxh3-128 address.

What must hold: a store created now has the feature and frames every CHUNK record (plain saves,
lz4 chunks, chunk images and their pad records, gc copies) that way, while a store created
without it keeps full payload checks on every record; the bytes on disk are what the spec says;
damage to a flagged record's data or chunk header is found by loads and by fsck, located at the
record, and costs no other iteration; a store whose STORE header has a flag this reader does not
know is refused at open, not misread.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import xxhash

import ckptstore
from ckptstore.errors import DamagedCheckpointError, FormatError
from ckptstore.format import records as rec
from ckptstore.format.chunk import CHUNK_HEADER_SIZE, Codec, decode_chunk_header
from ckptstore.format.header import (FEATURE_FRAMING_CHECKS, StoreHeader, decode_store_header,
                                     encode_store_header)
from ckptstore.ops.fsck import check
from ckptstore.storage.layout import Layout
from conftest import _same, chunk_record_flags, chunk_records, create_store_without_features
from test_chunk_image import CHUNK, _grads, _imaged

KINDS = ["framing_checks", "full_checks"]


def _states(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"w": torch.randn(3 * CHUNK // 4 + 5, generator=g),      # raw chunks
            "z": torch.zeros(CHUNK // 2) + i,                        # compresses: lz4 chunks
            "i": i}


def _fill(path: Path, kind: str) -> None:
    if kind == "full_checks":
        create_store_without_features(path, CHUNK, 1 << 20)
    with ckptstore.open(path, chunk_size=CHUNK, segment_size=1 << 20) as s:
        s.save(0, {"w": torch.zeros(10)})
        for i in range(1, 5):
            s.save_delta(i, _imaged(i), durable=i % 2 == 0)    # chunk images (and pad records)
        for i in range(5, 9):
            s.save(i, _states(i))


@pytest.mark.parametrize("kind", KINDS)
def test_every_chunk_record_is_framed_as_its_store_says(tmp_path: Path, kind: str) -> None:
    """On disk: with the feature, every CHUNK record (raw, lz4, imaged, pad) has record flag 1 and
    a trailer of xxh3_64(chunk header); without it, flag 0 and xxh3_64(payload). Every other
    record has flag 0 either way. Everything loads; fsck (which verifies every record) is clean."""
    path = tmp_path / "s"
    _fill(path, kind)
    with open(Layout(str(path)).store_file, "rb") as f:
        header = decode_store_header(f.read())
    assert header.framing_checks == (kind == "framing_checks")
    records = chunk_records(path)
    codecs = {decode_chunk_header(payload).codec for _, _, _, payload, _ in records}
    assert codecs == {Codec.RAW, Codec.LZ4}
    pads = [p for _, _, _, p, _ in records if p[CHUNK_HEADER_SIZE:] == bytes(len(p) - CHUNK_HEADER_SIZE)]
    assert pads, "the imaged deltas wrote pad records"
    for where, off, h, payload, trailer in records:
        covered = payload[:CHUNK_HEADER_SIZE] if kind == "framing_checks" else payload
        assert h.flags == (rec.FRAMING_CHECK if kind == "framing_checks" else 0), (where, off)
        assert int.from_bytes(trailer, "little") == xxhash.xxh3_64_intdigest(covered), (where, off)
    assert check(str(path)).clean
    _check_loads_all(path)


def _check_loads_all(path: Path) -> None:
    with ckptstore.open(path, mode="r") as r:
        for i in range(1, 5):
            got, want = r.load_record(i), _grads(i)
            assert torch.equal(got["g"]["w"], want["w"]) and torch.equal(got["b"], want["b"])
        for i in range(5, 9):
            _same(_states(i), r.load(i), f"iteration {i}")


@pytest.mark.parametrize("kind", KINDS)
def test_gc_copies_keep_their_stores_framing(tmp_path: Path, kind: str) -> None:
    """gc re-appends the records it keeps: they are framed as their store says, verified on the
    way (the address of every copied chunk), and load."""
    path = tmp_path / "s"
    _fill(path, kind)
    with ckptstore.open(path, chunk_size=CHUNK, segment_size=1 << 20) as s:
        s.gc(keep_last=3)
        kept = s.iterations()
    assert kept[-3:] == [6, 7, 8]
    flags = set(chunk_record_flags(path))
    assert flags == ({rec.FRAMING_CHECK} if kind == "framing_checks" else {0})
    assert check(str(path)).clean
    with ckptstore.open(path, mode="r") as r:
        for i in (6, 7, 8):
            _same(_states(i), r.load(i), f"iteration {i} after gc")


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("where", ["data", "chunk header", "trailer", "lz4 data"])
def test_damage_to_a_framed_record_is_found_and_contained(tmp_path: Path, where: str) -> None:
    """One byte changed in a FRAMING_CHECK record: its data (caught by the address on load and by
    fsck's decode), its chunk header (the trailer), its trailer (fsck; a load may still succeed
    bit-exact: the read path checks the address), lz4 data (decode or address). fsck names the
    record's file and offset and the iteration that needs it; every other iteration loads."""
    path = tmp_path / "s"
    _fill(path, "framing_checks")
    records = chunk_records(path)
    with ckptstore.open(path, mode="r") as r:
        idx = r.engine.index
        want_codec = Codec.LZ4 if where == "lz4 data" else Codec.RAW
        # a chunk only iteration 7 uses: 7's "w" (random, not shared) or 7's "z" (lz4, distinct)
        tensor = "z" if want_codec is Codec.LZ4 else "w"
        target = None
        for seg, off, h, payload, trailer in records:
            ch = decode_chunk_header(payload)
            if ch.codec is not want_codec:
                continue
            ref = idx.get_chunk(ch.address)
            if ref is not None and ref.loc.offset == off and _only_in(r, ch.address, 7, tensor):
                target = (seg, off, h)
                break
    assert target is not None
    seg, off, h = target
    at = {"data": off + rec.HEADER_SIZE + CHUNK_HEADER_SIZE + 100,
          "lz4 data": off + rec.HEADER_SIZE + CHUNK_HEADER_SIZE + (h.length - CHUNK_HEADER_SIZE) // 2,
          "chunk header": off + rec.HEADER_SIZE + 5,
          "trailer": off + rec.HEADER_SIZE + h.length + 3}[where]
    _flip(seg, at)
    report = check(str(path))
    text = "\n".join(report.lines())
    assert not report.clean, text
    assert f"{os.path.basename(seg)} offset {off}" in text, text
    assert 7 in report.damaged_iterations, text
    assert set(report.damaged_iterations) == {7}, text
    with ckptstore.open(path, mode="r") as r:
        if where == "trailer":
            _same(_states(7), r.load(7), "a damaged trailer leaves verified data readable")
        else:
            with pytest.raises(DamagedCheckpointError):
                r.load(7)
        for i in (5, 6, 8):
            _same(_states(i), r.load(i), f"iteration {i}")


def _only_in(r, address: bytes, it: int, tensor: str) -> bool:
    """Whether chunk ``address`` belongs to tensor ``tensor`` of iteration ``it`` and to no other
    iteration's tensors."""
    from ckptstore.format.tree import decode_tree

    users = set()
    for i in r.iterations():
        for t in r.manifest(i).tensors:
            if t.inline is not None:
                continue
            loc = r.engine.index.get_tree(t.root)
            if loc is None:
                continue
            if address in decode_tree(r.engine.log.read_payload(loc)).addresses:
                users.add((i, t.path.rsplit("/", 1)[-1]))
    return users == {(it, tensor)}


def test_a_store_with_an_unknown_feature_flag_is_refused_at_open(tmp_path: Path) -> None:
    """A STORE flag this reader does not know (a newer release's feature) refuses the store in
    every mode, naming the file, and changes nothing on disk."""
    path = tmp_path / "s"
    _fill(path, "framing_checks")
    store_file = Layout(str(path)).store_file
    with open(store_file, "rb") as f:
        h = decode_store_header(f.read())
    with open(store_file, "wb") as f:
        f.write(encode_store_header(StoreHeader(h.format_version, h.store_id, h.chunk_size,
                                                h.segment_size, h.created_ns,
                                                FEATURE_FRAMING_CHECKS | 0x4)))
    before = {p: p.read_bytes() for p in sorted(path.rglob("*.seg"))}
    for mode in ("r", "a"):
        with pytest.raises(FormatError, match="unknown flags 0x4") as ei:
            ckptstore.open(path, mode=mode)
        assert "STORE" in str(ei.value)
    assert {p: p.read_bytes() for p in sorted(path.rglob("*.seg"))} == before


def test_a_featureless_store_stays_featureless_across_reopens(tmp_path: Path) -> None:
    """Reopening a store created without the feature (an older release's store) never turns it
    on: appends after a reopen, an index rebuild and a tail cut keep full payload checks."""
    path = tmp_path / "s"
    _fill(path, "full_checks")
    shutil.rmtree(path / "index")
    with ckptstore.open(path, chunk_size=CHUNK, segment_size=1 << 20) as s:
        s.save_delta(9, _imaged(9), durable=True)
        s.save(10, _states(10))
    assert set(chunk_record_flags(path)) == {0}
    assert check(str(path)).clean
    with ckptstore.open(path, mode="r") as r:
        got = r.load_record(9)
        assert torch.equal(got["g"]["w"], _grads(9)["w"])
        _same(_states(10), r.load(10), "iteration 10")


def _flags(path: Path) -> int:
    with open(Layout(str(path)).store_file, "rb") as f:
        return decode_store_header(f.read()).flags


def test_features_compatible_creates_a_store_older_releases_read(tmp_path: Path) -> None:
    """``features="compatible"`` (the user-facing switch for older readers) creates a store with
    STORE flags 0 whose records keep full payload checks; it opens again with either setting and
    stays so. ``ckptstore import --features compatible`` does the same."""
    path = tmp_path / "s"
    with ckptstore.open(path, features="compatible", chunk_size=CHUNK) as s:
        s.save(0, _states(0))
    assert _flags(path) == 0
    with ckptstore.open(path, features="compatible") as s:
        s.save(1, _states(1))
    with ckptstore.open(path) as s:  # the default never adds a feature to an existing store
        s.save(2, _states(2))
    assert _flags(path) == 0
    assert set(chunk_record_flags(path)) == {0}
    assert check(str(path)).clean
    with ckptstore.open(path, mode="r") as r:
        _same(_states(2), r.load(2), "iteration 2")

    from ckptstore.cli import main

    src = tmp_path / "w.safetensors"
    from safetensors.torch import save_file
    save_file({"w": torch.arange(100.0)}, str(src))
    for features, want in (("compatible", 0), ("current", FEATURE_FRAMING_CHECKS)):
        dst = tmp_path / f"imported-{features}"
        assert main(["import", str(dst), "7", str(src), "--features", features]) == 0
        assert _flags(dst) == want


def test_features_compatible_refuses_a_store_with_features(tmp_path: Path) -> None:
    """Asking for a compatible store where one with features exists raises StoreFeaturesError
    naming the file and the feature, changes nothing, and leaves the store openable (the writer
    lock is released). A bad value is a ValueError and creates nothing."""
    path = tmp_path / "s"
    with ckptstore.open(path) as s:
        s.save(0, _states(0))
    before = {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file() and
              "index" not in p.parts}
    with pytest.raises(ckptstore.StoreFeaturesError, match="FRAMING_CHECKS") as ei:
        ckptstore.open(path, features="compatible")
    assert isinstance(ei.value, ValueError) and "STORE" in str(ei.value)
    assert {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file() and
            "index" not in p.parts} == before
    with ckptstore.open(path) as s:  # not left locked
        s.save(1, _states(1))
    with pytest.raises(ValueError, match="features must be"):
        ckptstore.open(tmp_path / "new", features="old")
    assert not (tmp_path / "new" / "STORE").exists()


def test_fsck_reports_a_framed_record_in_a_store_without_the_feature(tmp_path: Path) -> None:
    """A FRAMING_CHECK record that no writer of its store may write (the store lacks the
    feature; an older reader would take it for damage): fsck reports it, at its file and offset,
    as damage to the iteration that uses it. Loads still verify its data by address and succeed."""
    path = tmp_path / "s"
    _fill(path, "full_checks")
    seg, off, h, payload, _ = next(r for r in chunk_records(path)
                                   if decode_chunk_header(r[3]).codec is Codec.RAW
                                   and len(r[3]) > 4096)
    framed = rec.encode_record(rec.RecordType.CHUNK, payload, rec.FRAMING_CHECK)
    with open(seg, "r+b") as f:  # the same record, re-framed: valid, but not allowed here
        f.seek(off)
        f.write(framed)
    report = check(str(path))
    text = "\n".join(report.lines())
    assert not report.clean and f"{os.path.basename(seg)} offset {off}" in text, text
    assert "without the FRAMING_CHECKS feature" in text, text
    assert report.damaged_iterations, text
    with ckptstore.open(path, mode="r") as r:
        for i in range(1, 5):
            assert torch.equal(r.load_record(i)["g"]["w"], _grads(i)["w"])
        for i in range(5, 9):
            _same(_states(i), r.load(i), f"iteration {i}")


def test_a_save_does_not_deduplicate_against_a_chunk_whose_header_is_damaged(tmp_path: Path) -> None:
    """The dedup check reads a stored chunk's record and chunk headers, and for a FRAMING_CHECK
    record its trailer: with a byte of the chunk header changed (its raw length, which neither the
    address nor the record header covers), a later save of the same bytes writes the chunk again
    instead of naming the damaged record, and both checkpoints load from the new copy."""
    path = tmp_path / "s"
    _fill(path, "framing_checks")
    with ckptstore.open(path, mode="r") as r:
        idx = r.engine.index
        target = next((seg, off) for seg, off, h, payload, _ in chunk_records(path)
                      if decode_chunk_header(payload).codec is Codec.RAW and len(payload) > 4096
                      and _only_in(r, decode_chunk_header(payload).address, 8, "w")
                      and idx.get_chunk(decode_chunk_header(payload).address).loc.offset == off)
    seg, off = target
    _flip(seg, off + rec.HEADER_SIZE + 24)  # raw_length's low byte: still decodes, now wrong
    with ckptstore.open(path, mode="r") as r:
        with pytest.raises(DamagedCheckpointError):
            r.load(8)
    with ckptstore.open(path, chunk_size=CHUNK, segment_size=1 << 20) as s:
        stats = s.save(9, _states(8))
        assert stats.chunks_written == 1, stats  # the damaged one; the rest deduplicated
    with ckptstore.open(path, mode="r") as r:
        _same(_states(8), r.load(9), "iteration 9: the chunk written again")
        _same(_states(8), r.load(8), "iteration 8: its chunk's new copy serves it too")
