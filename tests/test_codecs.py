"""The pure codecs of ckptstore/format: good encodings decode, bad bytes raise typed errors only.

Every decoder must raise FormatError subclasses (never ValueError, KeyError, struct.error, a json
error or an lz4 error) and must never allocate according to a length field it has not checked.
"""

from __future__ import annotations

import base64
import math
import os
import json
import random
import struct
import tracemalloc
from collections import OrderedDict

import lz4.block
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore.errors import (ChecksumMismatch, CkptStoreError, CorruptRecordError, FormatError,
                              UnsupportedVersionError)
from ckptstore.format import chunk as fchunk
from ckptstore.format import commit as fcommit
from ckptstore.format import header as fheader
from ckptstore.format import manifest as fmanifest
from ckptstore.format import records as rec
from ckptstore.format import state as fstate
from ckptstore.format import tree as ftree

RNG_SEED = 20240601
ID = bytes(range(16))


# ---------------------------------------------------------------------------------------------
# helpers


def raises_format(fn, *args, exc=FormatError):
    """Call ``fn(*args)``; it must raise ``exc`` (a FormatError subclass) and nothing else."""
    with pytest.raises(exc) as ei:
        fn(*args)
    assert isinstance(ei.value, FormatError)
    return ei.value


def only_format_errors(fn, data) -> bool:
    """True when ``fn(data)`` succeeded; False when it raised a FormatError. Anything else fails."""
    try:
        fn(data)
    except FormatError:
        return False
    except Exception as e:  # pragma: no cover - the assertion is the point
        pytest.fail(f"{fn.__module__}.{fn.__name__} raised {type(e).__name__}: {e} on {bytes(data)[:80]!r}")
    return True


def bit_flips(data: bytes):
    for i in range(len(data) * 8):
        b = bytearray(data)
        b[i // 8] ^= 1 << (i % 8)
        yield bytes(b)


def small_alloc(fn, *args, limit=4 << 20):
    """Run ``fn`` under tracemalloc and assert it allocated less than ``limit`` bytes at peak."""
    tracemalloc.start()
    try:
        try:
            fn(*args)
        except FormatError:
            pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < limit, f"{fn.__name__} allocated {peak} bytes for a hostile input"


def raw_header(rtype=rec.RecordType.CHUNK, flags=0, reserved=0, length=0, magic=rec.MAGIC) -> bytes:
    """A record header with any field values and a *valid* header check."""
    head = struct.pack("<4sBBHQ", magic, rtype, flags, reserved, length)
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def store_body(magic=fheader.STORE_MAGIC, version=1, flags=0, store_id=ID, chunk=4096, seg=1 << 20,
               created=123) -> bytes:
    body = struct.pack("<8sII16sQQQ", magic, version, flags, store_id, chunk, seg, created)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def good_chunk(raw: bytes, codec=None) -> bytes:
    if codec is None:
        codec, data = fchunk.choose_encoding(memoryview(raw))
    else:
        data = raw if codec is fchunk.Codec.RAW else lz4.block.compress(raw, store_size=False)
    return fchunk.encode_chunk_header(fchunk.address_of(raw), codec, len(raw)) + bytes(data)


def good_tree(nbytes=10_000, chunk_size=4096) -> tuple[ftree.Tree, bytes]:
    addrs = [xxhash.xxh3_128_digest(i.to_bytes(4, "little")) for i in range(ftree.expected_chunks(nbytes, chunk_size))]
    t = ftree.make_tree(nbytes, chunk_size, addrs)
    return t, ftree.encode_tree(t)


def good_commit(**kw) -> fcommit.Commit:
    base = dict(iteration=42, manifest_seq=1, manifest_offset=72, manifest_length=500,
                manifest_digest=b"d" * 16, snapshot_root=b"r" * 16, created_ns=10**18,
                logical_bytes=12345, written_bytes=678)
    base.update(kw)
    return fcommit.Commit(**base)


def manifest_doc() -> dict:
    inline = bytes(range(12))
    return {
        "v": 1, "iteration": 7, "kind": "snapshot", "created_ns": 1, "chunk_size": 4096,
        "state": {"d": [["w", {"T": 0}], ["b", {"T": 1}], ["lr", {"f": (0.1).hex()}]]},
        "meta": {"d": [["loss", {"f": "0x1.0p+1"}]]},
        "tensors": [
            {"path": "w", "lib": "torch", "dtype": "float32", "shape": [100, 100], "nbytes": 40000,
             "root": "ab" * 16, "param": True, "requires_grad": True},
            {"path": "b", "lib": "numpy", "dtype": "<f4", "shape": [3], "nbytes": 12,
             "root": "cd" * 16, "inline": base64.b64encode(inline).decode()},
        ],
    }


def enc_doc(doc) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode("ascii")


# ---------------------------------------------------------------------------------------------
# records


def test_record_good_roundtrip():
    for rtype in rec.RecordType:
        for payload in (b"", b"x", bytes(range(256)) * 9):
            buf = rec.encode_record(rtype, payload)
            assert len(buf) == rec.OVERHEAD + len(payload)
            h, p = rec.decode_record(buf)
            assert h.type == rtype and h.length == len(payload) and bytes(p) == payload
            assert h.total_size == len(buf)
            h2, p2 = rec.decode_record(memoryview(buf + b"trailing garbage"))
            assert h2 == h and bytes(p2) == payload
            assert rec.decode_header(buf[:rec.HEADER_SIZE]) == h


def test_record_trailer_in_parts():
    parts = [b"abc", memoryview(b"defg"), b""]
    assert rec.encode_trailer(*parts) == rec.encode_trailer(b"abcdefg")
    rec.check_trailer(b"abcdefg", rec.encode_trailer(*parts))
    raises_format(rec.check_trailer, b"abcdefh", rec.encode_trailer(*parts), exc=ChecksumMismatch)
    raises_format(rec.check_trailer, b"abcdefg", b"short", exc=CorruptRecordError)


def test_record_encoder_refuses_bad_lengths():
    with pytest.raises(ValueError):
        rec.encode_header(rec.RecordType.CHUNK, rec.MAX_PAYLOAD + 1)
    with pytest.raises(ValueError):
        rec.encode_header(rec.RecordType.CHUNK, -1)


def test_record_header_corruptions():
    good = rec.encode_record(rec.RecordType.MANIFEST, b"hello")
    raises_format(rec.decode_header, good[:23], exc=CorruptRecordError)        # truncated
    raises_format(rec.decode_header, b"", exc=CorruptRecordError)
    raises_format(rec.decode_header, b"XSR1" + good[4:], exc=CorruptRecordError)  # bad magic
    bad_check = bytearray(good)
    bad_check[8] ^= 1                                                          # length byte
    raises_format(rec.decode_header, bytes(bad_check), exc=ChecksumMismatch)
    bad_check = bytearray(good)
    bad_check[20] ^= 0x80                                                      # the check itself
    raises_format(rec.decode_header, bytes(bad_check), exc=ChecksumMismatch)
    # valid header check, but field values a v1 reader must refuse
    raises_format(rec.decode_header, raw_header(magic=b"CSR2"), exc=CorruptRecordError)
    raises_format(rec.decode_header, raw_header(flags=1), exc=CorruptRecordError)
    raises_format(rec.decode_header, raw_header(reserved=0x100), exc=CorruptRecordError)
    raises_format(rec.decode_header, raw_header(length=rec.MAX_PAYLOAD + 1), exc=CorruptRecordError)
    raises_format(rec.decode_header, raw_header(length=2**64 - 1), exc=CorruptRecordError)
    for unknown in (0, 7, 15, 18, 255):
        raises_format(rec.decode_header, raw_header(rtype=unknown), exc=CorruptRecordError)
    for reserved_type in rec.RESERVED_TYPES:  # known, skippable
        assert rec.decode_header(raw_header(rtype=reserved_type)).type == reserved_type


def test_record_payload_corruptions():
    good = rec.encode_record(rec.RecordType.COMMIT, bytes(96))
    raises_format(rec.decode_record, good[:-1], exc=CorruptRecordError)       # trailer cut
    raises_format(rec.decode_record, good[:30], exc=CorruptRecordError)       # payload cut
    raises_format(rec.decode_record, good[:10], exc=CorruptRecordError)       # header cut
    flipped = bytearray(good)
    flipped[40] ^= 4
    raises_format(rec.decode_record, bytes(flipped), exc=ChecksumMismatch)
    flipped = bytearray(good)
    flipped[-1] ^= 4
    raises_format(rec.decode_record, bytes(flipped), exc=ChecksumMismatch)
    err = raises_format(rec.decode_record, good[:30], exc=CorruptRecordError)
    assert err.path is None and err.offset is None
    located = err.located("/x/0000000001.seg", 4096)
    assert type(located) is type(err) and "offset 4096" in str(located) and located.offset == 4096


def test_record_hostile_lengths_do_not_allocate():
    for length in (rec.MAX_PAYLOAD, rec.MAX_PAYLOAD - 1, 2**40, 2**64 - 1):
        buf = raw_header(length=length) + b"x" * 100
        small_alloc(rec.decode_record, buf)
        small_alloc(rec.decode_header, buf)


def test_record_every_single_bit_flip_is_detected():
    for payload in (b"", b"abc", bytes(range(200))):
        good = rec.encode_record(rec.RecordType.TREE, payload)
        for bad in bit_flips(good):
            raises_format(rec.decode_record, bad)


# ---------------------------------------------------------------------------------------------
# STORE header and segment header


def test_store_header_good():
    h = fheader.StoreHeader(1, ID, 4096, 1 << 20, 99)
    buf = fheader.encode_store_header(h)
    assert len(buf) == fheader.STORE_HEADER_SIZE
    assert fheader.decode_store_header(buf) == h
    assert buf == store_body(chunk=4096, seg=1 << 20, created=99)
    assert not h.framing_checks


def test_store_header_with_framing_checks():
    """STORE flag 1 (FRAMING_CHECKS) round-trips; a store created now carries it."""
    h = fheader.StoreHeader(1, ID, 4096, 1 << 20, 99, fheader.FEATURE_FRAMING_CHECKS)
    buf = fheader.encode_store_header(h)
    assert buf == store_body(chunk=4096, seg=1 << 20, created=99, flags=1)
    assert fheader.decode_store_header(buf) == h and h.framing_checks
    assert fheader.NEW_STORE_FEATURES == fheader.FEATURE_FRAMING_CHECKS


def test_store_header_corruptions():
    good = store_body()
    raises_format(fheader.decode_store_header, good[:-1])                   # bad length
    raises_format(fheader.decode_store_header, good + b"\0")
    raises_format(fheader.decode_store_header, b"")
    raises_format(fheader.decode_store_header, store_body(magic=b"CKPTSTOX"))  # bad magic
    raises_format(fheader.decode_store_header, b"\0" * 64)
    bad = bytearray(good)
    bad[33] ^= 1
    raises_format(fheader.decode_store_header, bytes(bad), exc=ChecksumMismatch)
    bad = bytearray(good)
    bad[63] ^= 1
    raises_format(fheader.decode_store_header, bytes(bad), exc=ChecksumMismatch)
    for version in (0, 2, 2**32 - 1):
        buf = fheader.encode_store_header(fheader.StoreHeader(version, ID, 4096, 1 << 20, 1))
        err = raises_format(fheader.decode_store_header, buf, exc=UnsupportedVersionError)
        assert str(version) in str(err)
    for flags in (2, 3, 1 << 31):                                            # unknown flags
        err = raises_format(fheader.decode_store_header, store_body(flags=flags))
        assert "unknown flags" in str(err)
    raises_format(fheader.decode_store_header, store_body(chunk=0))
    raises_format(fheader.decode_store_header, store_body(seg=0))


def test_store_header_every_single_bit_flip_is_detected():
    good = store_body()
    for bad in bit_flips(good):
        raises_format(fheader.decode_store_header, bad)


def test_segment_header_good():
    for h in (fheader.SegmentHeader(1, 1, ID), fheader.SegmentHeader(1, 10**9, ID, 10**9 - 1)):
        buf = fheader.encode_segment_header(h)
        assert len(buf) == fheader.SEGMENT_HEADER_SIZE
        assert fheader.decode_segment_header(buf) == h
        assert fheader.decode_segment_header(memoryview(buf)) == h


def test_segment_header_corruptions():
    seg = struct.Struct("<IIQ16sQQ")
    good = seg.pack(1, 0, 5, ID, 0, 0)
    assert fheader.decode_segment_header(good).seq == 5
    raises_format(fheader.decode_segment_header, good[:-1])
    raises_format(fheader.decode_segment_header, good + b"\0")
    raises_format(fheader.decode_segment_header, seg.pack(2, 0, 5, ID, 0, 0), exc=UnsupportedVersionError)
    raises_format(fheader.decode_segment_header, seg.pack(0, 0, 5, ID, 0, 0), exc=UnsupportedVersionError)
    raises_format(fheader.decode_segment_header, seg.pack(1, 1, 5, ID, 0, 0))   # reserved
    raises_format(fheader.decode_segment_header, seg.pack(1, 0, 5, ID, 0, 7))   # reserved
    raises_format(fheader.decode_segment_header, seg.pack(1, 0, 5, ID, 5, 0))   # supersedes itself
    raises_format(fheader.decode_segment_header, seg.pack(1, 0, 5, ID, 9, 0))   # supersedes newer
    raises_format(fheader.decode_segment_header, seg.pack(1, 0, 0, ID, 0, 0))   # seq 0


# ---------------------------------------------------------------------------------------------
# chunks


@pytest.mark.parametrize("codec", [fchunk.Codec.RAW, fchunk.Codec.LZ4])
def test_chunk_good(codec):
    for raw in (b"", b"a", bytes(1000), bytes(range(256)) * 40):
        payload = good_chunk(raw, codec)
        h, out = fchunk.decode_chunk(payload)
        assert h == fchunk.ChunkHeader(fchunk.address_of(raw), codec, len(raw))
        assert bytes(out) == raw
        h2, out2 = fchunk.decode_chunk(memoryview(payload))
        assert h2 == h and bytes(out2) == raw


def test_chunk_raw_decode_is_zero_copy():
    raw = bytearray(b"q" * 100)
    h = fchunk.ChunkHeader(fchunk.address_of(raw), fchunk.Codec.RAW, 100)
    view = fchunk.decode_chunk_data(h, memoryview(raw))
    assert view.obj is raw


def test_chunk_corruptions():
    raw = bytes(range(256)) * 20
    addr = fchunk.address_of(raw)
    raw_payload = good_chunk(raw, fchunk.Codec.RAW)
    lz_payload = good_chunk(raw, fchunk.Codec.LZ4)
    enc = fchunk.encode_chunk_header
    dec = fchunk.decode_chunk
    raises_format(dec, raw_payload[:31], exc=CorruptRecordError)              # truncated header
    raises_format(dec, b"", exc=CorruptRecordError)
    raises_format(dec, raw_payload[:-1], exc=CorruptRecordError)              # truncated data
    raises_format(dec, raw_payload + b"x", exc=CorruptRecordError)            # extra data
    raises_format(dec, lz_payload[:-3], exc=CorruptRecordError)               # truncated lz4
    bad = bytearray(raw_payload)
    bad[20] = 1                                                               # reserved byte
    raises_format(dec, bytes(bad))
    for codec in (2, 3, 255):                                                 # unknown codec
        raises_format(dec, struct.pack("<16sB7sQ", addr, codec, bytes(7), len(raw)) + raw)
    raises_format(dec, enc(addr, fchunk.Codec.RAW, fchunk.MAX_CHUNK_SIZE + 1) + raw)
    raises_format(dec, enc(addr, fchunk.Codec.RAW, 2**64 - 1) + raw)
    bad = bytearray(raw_payload)
    bad[100] ^= 1                                                             # data flipped
    raises_format(dec, bytes(bad), exc=ChecksumMismatch)
    bad = bytearray(raw_payload)
    bad[3] ^= 1                                                               # address flipped
    raises_format(dec, bytes(bad), exc=ChecksumMismatch)
    raises_format(dec, enc(addr, fchunk.Codec.LZ4, len(raw)) + b"\xff" * 50, exc=CorruptRecordError)
    raises_format(dec, enc(addr, fchunk.Codec.LZ4, len(raw) - 1) + lz_payload[32:], exc=CorruptRecordError)
    raises_format(dec, enc(addr, fchunk.Codec.LZ4, len(raw) + 1) + lz_payload[32:], exc=CorruptRecordError)
    raises_format(dec, enc(addr, fchunk.Codec.LZ4, 0) + lz_payload[32:], exc=CorruptRecordError)
    raises_format(dec, enc(addr, fchunk.Codec.RAW, len(raw)) + lz_payload[32:], exc=CorruptRecordError)
    # RAW data that happens to be valid lz4 input but declared RAW with the lz4 length -> checksum
    raises_format(dec, enc(addr, fchunk.Codec.RAW, len(lz_payload) - 32) + lz_payload[32:],
                  exc=ChecksumMismatch)


def test_chunk_header_decoder_alone():
    raw = b"z" * 300
    h = fchunk.decode_chunk_header(good_chunk(raw))
    assert h.raw_length == 300
    raises_format(fchunk.decode_chunk_header, b"\0" * 31, exc=CorruptRecordError)


def test_chunk_hostile_lengths_do_not_allocate():
    addr = bytes(16)
    enc = fchunk.encode_chunk_header
    small_alloc(fchunk.decode_chunk, enc(addr, fchunk.Codec.LZ4, fchunk.MAX_CHUNK_SIZE) + b"\x1f" * 10)
    small_alloc(fchunk.decode_chunk, enc(addr, fchunk.Codec.LZ4, 2**63) + b"\x1f" * 10)
    small_alloc(fchunk.decode_chunk, enc(addr, fchunk.Codec.RAW, 2**63) + b"\x1f" * 10)
    small_alloc(fchunk.decode_chunk, enc(addr, fchunk.Codec.RAW, fchunk.MAX_CHUNK_SIZE) + b"\x1f" * 10)


def test_chunk_every_single_bit_flip_is_detected():
    raw = b"incompressible?" + bytes(range(200))
    good = good_chunk(raw, fchunk.Codec.RAW)
    for bad in bit_flips(good):
        raises_format(fchunk.decode_chunk, bad)
    # lz4: several encodings decode to the same bytes, so a flip may be harmless -- but whatever
    # decodes must be exactly the original bytes (the address is verified after decoding)
    raw = bytes(600) + bytes(range(100))
    good = good_chunk(raw, fchunk.Codec.LZ4)
    harmless = 0
    for bad in bit_flips(good):
        try:
            _, out = fchunk.decode_chunk(bad)
        except FormatError:
            continue
        assert bytes(out) == raw
        harmless += 1
    assert harmless < len(good)  # nearly every flip is caught


# ---------------------------------------------------------------------------------------------
# trees


def test_tree_good():
    for nbytes, cs in ((0, 4096), (1, 4096), (4096, 4096), (4097, 4096), (10_000, 7), (10, 1)):
        t, buf = good_tree(nbytes, cs)
        assert ftree.decode_tree(buf) == t
        assert ftree.decode_tree(memoryview(buf)) == t
        spans = list(t.chunk_spans())
        assert len(spans) == ftree.expected_chunks(nbytes, cs)
        assert sum(e - s for s, e, _ in spans) == nbytes
        if spans:
            assert spans[0][0] == 0 and spans[-1][1] == nbytes


def test_tree_make_tree_checks_count():
    with pytest.raises(ValueError):
        ftree.make_tree(10, 4, [b"a" * 16])


def test_tree_corruptions():
    t, buf = good_tree(10_000, 4096)
    head = struct.Struct("<16sQQQ")
    dec = ftree.decode_tree
    raises_format(dec, buf[:39])
    raises_format(dec, b"")
    raises_format(dec, buf[:-1])
    raises_format(dec, buf + b"\0" * 16)
    body = buf[40:]
    raises_format(dec, head.pack(t.root, 10_000, 0, 3) + body)                      # chunk size 0
    raises_format(dec, head.pack(t.root, 10_000, fchunk.MAX_CHUNK_SIZE + 1, 1) + body[:16])
    raises_format(dec, head.pack(t.root, ftree.MAX_TENSOR_BYTES + 1, 2**28, 2**20 + 1) + body)
    raises_format(dec, head.pack(t.root, 10_000, 4096, 2) + body[:32])             # wrong n
    raises_format(dec, head.pack(t.root, 10_000, 4096, 4) + body + b"\0" * 16)
    raises_format(dec, head.pack(b"\0" * 16, 10_000, 4096, 3) + body, exc=ChecksumMismatch)
    swapped = body[16:32] + body[:16] + body[32:]
    raises_format(dec, head.pack(t.root, 10_000, 4096, 3) + swapped, exc=ChecksumMismatch)


def test_tree_hostile_counts_do_not_allocate():
    head = struct.Struct("<16sQQQ")
    small_alloc(ftree.decode_tree, head.pack(bytes(16), ftree.MAX_TENSOR_BYTES, 1,
                                             ftree.MAX_TENSOR_BYTES) + bytes(64))
    small_alloc(ftree.decode_tree, head.pack(bytes(16), 2**64 - 1, 1, 2**64 - 1) + bytes(64))


def test_tree_every_single_bit_flip_is_detected():
    _, buf = good_tree(5000, 1024)
    for bad in bit_flips(buf):
        raises_format(ftree.decode_tree, bad)


def test_snapshot_root_depends_on_paths_and_order():
    a, b = b"a" * 16, b"b" * 16
    r = ftree.snapshot_root([("x", a), ("y", b)])
    assert r != ftree.snapshot_root([("y", b), ("x", a)])
    assert r != ftree.snapshot_root([("x", b), ("y", a)])
    assert r != ftree.snapshot_root([("xy", a), ("", b)])  # length-prefixed paths
    assert r == ftree.snapshot_root(iter([("x", a), ("y", b)]))


# ---------------------------------------------------------------------------------------------
# manifests


def test_manifest_good_roundtrip():
    doc = manifest_doc()
    m = fmanifest.decode_manifest(enc_doc(doc))
    assert m.iteration == 7 and m.chunk_size == 4096 and m.kind == "snapshot"
    assert m.state == doc["state"] and m.meta == doc["meta"]
    w, b = m.tensors
    assert w.param and w.requires_grad and w.inline is None and w.shape == (100, 100)
    assert b.inline == bytes(range(12)) and not b.param and b.lib == "numpy"
    assert m.logical_bytes == 40012
    again = fmanifest.decode_manifest(fmanifest.encode_manifest(m))
    assert again == m
    assert fmanifest.decode_manifest(memoryview(enc_doc(doc))) == m
    doc["future_field"] = [1, 2]
    assert fmanifest.decode_manifest(enc_doc(doc)).extra == {"future_field": [1, 2]}


def test_manifest_encoder_is_strict_json():
    m = fmanifest.decode_manifest(enc_doc(manifest_doc()))
    out = fmanifest.encode_manifest(m)
    out.decode("ascii")
    json.loads(out, parse_constant=lambda c: pytest.fail(f"non-strict constant {c}"))


def _mutated(path, value):
    doc = manifest_doc()
    node = doc
    for k in path[:-1]:
        node = node[k]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return enc_doc(doc)


_DELETE = object()
MANIFEST_CORRUPTIONS = {
    "iteration_negative": (("iteration",), -1),
    "iteration_too_big": (("iteration",), 2**63),
    "iteration_float": (("iteration",), 7.0),
    "iteration_bool": (("iteration",), True),
    "iteration_missing": (("iteration",), _DELETE),
    "kind_unknown": (("kind",), "incremental"),
    "kind_empty": (("kind",), ""),
    "kind_int": (("kind",), 0),
    "created_str": (("created_ns",), "1"),
    "chunk_zero": (("chunk_size",), 0),
    "chunk_negative": (("chunk_size",), -4096),
    "tensors_dict": (("tensors",), {}),
    "tensors_missing": (("tensors",), _DELETE),
    "state_missing": (("state",), _DELETE),
    "meta_missing": (("meta",), _DELETE),
    "entry_not_object": (("tensors", 0), [1, 2]),
    "entry_null": (("tensors", 0), None),
    "path_int": (("tensors", 0, "path"), 5),
    "lib_unknown": (("tensors", 0, "lib"), "jax"),
    "lib_missing": (("tensors", 0, "lib"), _DELETE),
    "dtype_missing": (("tensors", 0, "dtype"), _DELETE),
    "dtype_list": (("tensors", 0, "dtype"), ["float32"]),
    "shape_negative": (("tensors", 0, "shape"), [-1, 100]),
    "shape_float": (("tensors", 0, "shape"), [100.0, 100]),
    "shape_bool": (("tensors", 0, "shape"), [True]),
    "shape_too_many_dims": (("tensors", 0, "shape"), [1] * 65),
    "shape_str": (("tensors", 0, "shape"), "100,100"),
    "nbytes_negative": (("tensors", 0, "nbytes"), -1),
    "nbytes_huge": (("tensors", 0, "nbytes"), 2**49),
    "nbytes_float": (("tensors", 0, "nbytes"), 4e4),
    "root_short": (("tensors", 0, "root"), "ab" * 15),
    "root_long": (("tensors", 0, "root"), "ab" * 17),
    "root_not_hex": (("tensors", 0, "root"), "zz" * 16),
    "root_bytes_like": (("tensors", 0, "root"), 123),
    "inline_bad_base64": (("tensors", 1, "inline"), "!!!!"),
    "inline_non_ascii": (("tensors", 1, "inline"), "é"),
    "inline_wrong_length": (("tensors", 1, "inline"), base64.b64encode(b"x" * 11).decode()),
    "inline_not_str": (("tensors", 1, "inline"), 12),
    "param_not_bool": (("tensors", 0, "param"), 1),
    "requires_grad_str": (("tensors", 0, "requires_grad"), "yes"),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CORRUPTIONS))
def test_manifest_field_corruptions(case):
    path, value = MANIFEST_CORRUPTIONS[case]
    raises_format(fmanifest.decode_manifest, _mutated(path, value))


@pytest.mark.skipif("delta" not in fmanifest.KINDS, reason="no delta manifests in this format")
def test_manifest_delta_chain_fields():
    def delta(**kw):
        doc = manifest_doc()
        doc.update(kind="delta", prev=6, base=2)
        doc.update(kw)
        return enc_doc({k: v for k, v in doc.items() if v is not _DELETE})

    m = fmanifest.decode_manifest(delta())
    assert m.kind == "delta" and m.extra.get("prev") == 6 and m.extra.get("base") == 2
    for bad in (dict(prev=_DELETE), dict(base=_DELETE), dict(prev=5), dict(prev=7), dict(base=7),
                dict(base=-1), dict(prev="6"), dict(base=2.0), dict(prev=True)):
        raises_format(fmanifest.decode_manifest, delta(**bad))


@pytest.mark.parametrize("v", [0, 2, "1", 1.0, True, None, _DELETE])
def test_manifest_unknown_version(v):
    raises_format(fmanifest.decode_manifest, _mutated(("v",), v), exc=UnsupportedVersionError)


@pytest.mark.parametrize("buf", [
    b"", b"{", b"[]", b"null", b"42", b'"str"', b"\xff\xfe", "{\"v\":1,\"ü\":1}".encode("utf-8"),
    b"{\"v\":1}", b"[" * 100_000 + b"]" * 100_000, b"{\"v\":1,\"x\":" + b"9" * 5000 + b"}",
    b"\x00" * 10, b"{\"v\": 1, \"iteration\": 1e999}",
], ids=lambda b: repr(b[:20]))
def test_manifest_garbage(buf):
    raises_format(fmanifest.decode_manifest, buf)


def test_manifest_hostile_sizes_decode_without_allocating():
    doc = manifest_doc()
    doc["tensors"][0].update(shape=[2**24, 2**24], nbytes=2**48)
    small_alloc(fmanifest.decode_manifest, enc_doc(doc))  # decoding never allocates tensor bytes


# ---------------------------------------------------------------------------------------------
# commits


def test_commit_good():
    for c in (good_commit(), good_commit(iteration=0), good_commit(iteration=2**63 - 1)):
        buf = fcommit.encode_commit(c)
        assert len(buf) == fcommit.COMMIT_SIZE == 96
        assert fcommit.decode_commit(buf) == c
        assert fcommit.decode_commit(memoryview(buf)) == c


def test_commit_corruptions():
    good = fcommit.encode_commit(good_commit())
    raises_format(fcommit.decode_commit, good[:-1])
    raises_format(fcommit.decode_commit, good + b"\0")
    raises_format(fcommit.decode_commit, b"")
    raises_format(fcommit.decode_commit, struct.pack("<Q", 2**63) + good[8:])          # iteration
    raises_format(fcommit.decode_commit, struct.pack("<Q", 2**64 - 1) + good[8:])
    for kind in sorted(set(range(256)) - set(fcommit.KINDS))[:5] + [255]:
        raises_format(fcommit.decode_commit, good[:88] + bytes([kind]) + good[89:])    # kind
    for kind in fcommit.KINDS:
        assert fcommit.decode_commit(good[:88] + bytes([kind]) + good[89:]).kind == kind
    for i in range(89, 96):
        raises_format(fcommit.decode_commit, good[:i] + b"\x01" + good[i + 1:])        # reserved


# ---------------------------------------------------------------------------------------------
# state skeletons


def _leaf(i, path):
    return ("LEAF", i, path)


def test_unflatten_good():
    node = {"o": [["a", {"t": [1, {"f": "-0x0.0p+0"}, {"b": "AAE="}]}], [3, [None, True, "s"]],
                  ["w", {"T": 0}]],
            "m": {"d": [["", {"d": [["version", 1]]}]]}}
    out = fstate.unflatten(node, _leaf)
    assert type(out) is OrderedDict and list(out) == ["a", 3, "w"]
    assert out["a"] == (1, -0.0, b"\x00\x01") and str(out["a"][1]) == "-0.0"
    assert out[3] == [None, True, "s"]
    assert out["w"] == ("LEAF", 0, ("w",))
    assert out._metadata == {"": {"version": 1}}
    for x in (float("inf"), float("-inf"), 1.7976931348623157e308, 5e-324, -0.0, 0.1):
        y = fstate.unflatten({"f": x.hex()}, _leaf)
        assert type(y) is float and struct.pack("<d", y) == struct.pack("<d", x)
    assert fstate.unflatten({"f": "nan"}, _leaf) != fstate.unflatten({"f": "nan"}, _leaf)  # a NaN


STATE_CORRUPTIONS = [
    1.5, {"x": 1}, {}, {"f": 1}, {"f": "zz"}, {"f": "0x1p99999999"}, {"f": None},
    {"b": "!!"}, {"b": 1}, {"b": "é"}, {"b": "AAE"}, {"t": 1}, {"t": {"d": []}}, {"d": 1},
    {"d": [1]}, {"d": [[1]]}, {"d": [[1, 2, 3]]}, {"d": [[1.5, 1]]}, {"d": [[True, 1]]},
    {"d": [[None, 1]]}, {"d": [[[], 1]]}, {"o": "x"}, {"o": [], "m": 1.5}, {"o": 1, "m": {"d": []}},
    {"d": [], "t": []}, {"o": [], "m": [], "x": 1}, {"T": -1}, {"T": "0"}, {"T": 1.0}, {"T": True},
    {"T": None}, [1, [2, {"bad": 3}]], {"d": [["k", {"t": [{"f": "x"}]}]]},
    {"i": 5}, {"i": "12"}, {"i": "0xZZ"}, {"i": None}, {"n": 1}, {"n": "xyz"}, {"n": "7ff8"},
]


@pytest.mark.parametrize("node", STATE_CORRUPTIONS, ids=lambda n: repr(n)[:40])
def test_unflatten_corruptions(node):
    err = raises_format(fstate.unflatten, node, _leaf)
    assert "state" in str(err)


def test_unflatten_depth_limit():
    deep: object = 1
    for _ in range(fstate.MAX_DEPTH + 5):
        deep = [deep]
    raises_format(fstate.unflatten, deep, _leaf)
    deep = 1
    for _ in range(fstate.MAX_DEPTH + 5):
        deep = {"d": [["k", deep]]}
    raises_format(fstate.unflatten, deep, _leaf)
    deep = {"d": []}
    for _ in range(fstate.MAX_DEPTH + 5):
        deep = {"o": [], "m": deep}
    raises_format(fstate.unflatten, deep, _leaf)


def test_unflatten_error_names_the_path():
    err = raises_format(fstate.unflatten, {"d": [["opt", {"d": [[3, [0, {"f": "zz"}]]]}]]}, _leaf)
    assert "state['opt'][3][1]" in str(err)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=5)
    | st.sampled_from(["f", "b", "t", "d", "o", "m", "T", "i", "n", "0x1p1", "AA==", "nan", "0x1f",
                       "-0x0", "7ff8000000000001"]),
    lambda kids: (st.lists(kids, max_size=4)
                  | st.dictionaries(st.sampled_from(["f", "b", "t", "d", "o", "m", "T", "i", "n", "x"]),
                                    kids,
                                    max_size=2)),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_property_unflatten_only_raises_format_errors(node):
    only_format_errors(lambda n: fstate.unflatten(n, _leaf), node)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), json_values), min_size=1, max_size=3))
def test_property_manifest_mutations_only_raise_format_errors(mutations):
    doc = manifest_doc()
    for pick, value in mutations:
        # walk to a pseudo-random container in the document and replace one of its members
        node = doc
        while True:
            children = list(node.items()) if type(node) is dict else list(enumerate(node))
            if not children:
                break
            k, child = children[pick % len(children)]
            if type(child) in (dict, list) and child and pick % 3:
                node, pick = child, pick // 3 + 1
                continue
            node[k] = value
            break
    only_format_errors(fmanifest.decode_manifest, enc_doc(doc))


# ---------------------------------------------------------------------------------------------
# random bytes and bit flips through every decoder

DECODERS = {
    "decode_header": (rec.decode_header, [rec.encode_record(rec.RecordType.CHUNK, b"x" * 50)[:24]],
                      rec.MAGIC),
    "decode_record": (rec.decode_record, [rec.encode_record(rec.RecordType.MANIFEST, b"{}" * 20),
                                          rec.encode_record(rec.RecordType.COMMIT, bytes(96))],
                      rec.MAGIC),
    "decode_store_header": (fheader.decode_store_header, [store_body()], fheader.STORE_MAGIC),
    "decode_segment_header": (fheader.decode_segment_header,
                              [fheader.encode_segment_header(fheader.SegmentHeader(1, 3, ID, 2))],
                              struct.pack("<II", 1, 0)),
    "decode_chunk": (fchunk.decode_chunk, [good_chunk(bytes(range(256)) * 3),
                                           good_chunk(bytes(2000)),
                                           good_chunk(b"", fchunk.Codec.LZ4)], b""),
    "decode_tree": (ftree.decode_tree, [good_tree(9000, 4096)[1], good_tree(0, 64)[1]], b""),
    "decode_manifest": (fmanifest.decode_manifest, [enc_doc(manifest_doc())], b'{"v":1,'),
    "decode_commit": (fcommit.decode_commit, [fcommit.encode_commit(good_commit())], b""),
    "unflatten": (lambda b: fstate.unflatten(json.loads(b) if _is_json(b) else b, _leaf),
                  [json.dumps({"d": [["a", {"t": [1, {"f": "0x1p0"}, {"b": "AA=="}]}],
                                     ["w", {"T": 3}]]}).encode()], b'{"d":'),
}


def _is_json(b):
    try:
        json.loads(b)
        return True
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_random_bytes_and_bit_flips(name):
    fn, goods, prefix = DECODERS[name]
    rnd = random.Random(f"{RNG_SEED}-{name}")
    for good in goods:
        assert only_format_errors(fn, good), f"{name} refuses its own good encoding"
    sizes = sorted({len(g) for g in goods} | {0, 1, 23, 24, 32, 48, 64, 96, 200})
    for i in range(2000):
        n = sizes[i % len(sizes)] if i % 2 else rnd.randrange(0, 400)
        data = rnd.randbytes(n)
        if i % 3 == 0:
            data = prefix + data
        only_format_errors(fn, data)
    for good in goods:
        for _ in range(700):
            b = bytearray(good)
            for _ in range(rnd.choice((1, 1, 2, 3, 8))):
                b[rnd.randrange(len(b))] ^= 1 << rnd.randrange(8)
            only_format_errors(fn, bytes(b))
            only_format_errors(fn, bytes(b[:rnd.randrange(len(b) + 1)]))     # truncated
            only_format_errors(fn, bytes(b) + rnd.randbytes(rnd.randrange(1, 40)))  # extended


def test_random_lz4_payloads_only_raise_format_errors():
    rnd = random.Random(RNG_SEED)
    seeds = [lz4.block.compress(bytes(1000), store_size=False),
             lz4.block.compress(bytes(range(256)) * 8, store_size=False)]
    for i in range(2000):
        if i % 2:
            data = rnd.randbytes(rnd.randrange(1, 300))
        else:
            data = bytearray(rnd.choice(seeds))
            data[rnd.randrange(len(data))] = rnd.randrange(256)
            data = bytes(data)
        raw_length = rnd.choice((0, 1, len(data), 1000, 2048, rnd.randrange(0, 70_000)))
        payload = fchunk.encode_chunk_header(rnd.randbytes(16), fchunk.Codec.LZ4, raw_length) + data
        only_format_errors(fchunk.decode_chunk, payload)


def test_error_hierarchy():
    assert issubclass(ChecksumMismatch, CorruptRecordError)
    assert issubclass(CorruptRecordError, FormatError)
    assert issubclass(UnsupportedVersionError, FormatError)
    assert issubclass(FormatError, CkptStoreError)
    assert not issubclass(FormatError, (ValueError, KeyError))
    e = ChecksumMismatch("tree root", "aa", "bb")
    assert e.expected == "aa" and e.got == "bb" and "tree root" in str(e)


def test_grad_slices_match_whole_decodes():
    """gradcodecs slicers (tiled replay windows) write exactly what a whole decode holds."""
    import torch

    from ckptstore.replay.gradcodecs import parse_codec

    g = torch.Generator().manual_seed(5)
    grad = torch.randn(37, 101, generator=g)
    for name in ("bf16", "fp16", "topk:0.07"):
        codec = parse_codec(name)
        payload = codec.encode(grad)
        whole = codec.decode_into(payload, torch.empty_like(grad)).reshape(-1)
        sl = codec.slicer(payload, grad)
        for a, b in ((0, 64), (64, 1000), (1000, grad.numel()), (5, 5), (0, grad.numel())):
            out = torch.full((b - a,), float("nan"))
            assert torch.equal(sl.into(a, b, out), whole[a:b]), (name, a, b)
    codec = parse_codec("topk:0.07")
    payload = codec.encode(grad)
    shuffled = {"i": payload["i"].flip(0), "v": payload["v"].flip(0)}
    assert codec.slicer(shuffled, grad) is None  # not increasing: the whole decode is used
    bad = {"i": payload["i"] + grad.numel(), "v": payload["v"]}
    with pytest.raises(ValueError):
        codec.slicer(bad, grad)
    assert parse_codec("exact").slicer({"g": grad}, grad) is None
    assert parse_codec("int8").slicer(parse_codec("int8").encode(grad), grad) is None


def test_topk_selection_on_large_tensors():
    """Above EXACT_TOPK_MAX entries topk keeps every entry at or above a sampled threshold:
    about k of them, strictly increasing, none smaller than any dropped one; deterministic; the
    global RNG is untouched; ties (mostly zeros) fall back to exactly k."""
    import torch

    from ckptstore.replay import gradcodecs
    from ckptstore.replay.gradcodecs import parse_codec

    codec = parse_codec("topk:0.01")
    g = torch.Generator().manual_seed(9)
    grad = torch.randn(1_000_003, generator=g) * torch.rand(1_000_003, generator=g)
    k = 10_001
    rng_before = torch.get_rng_state()
    payload = codec.encode(grad)
    assert torch.equal(torch.get_rng_state(), rng_before)
    idx = payload["i"].to(torch.int64)
    assert k * 0.8 <= idx.numel() <= k * 1.2
    assert bool((idx[1:] > idx[:-1]).all())
    kept = torch.zeros(grad.numel(), dtype=torch.bool)
    kept[idx] = True
    assert float(grad.abs()[kept].min()) >= float(grad.abs()[~kept].max())
    assert torch.equal(payload["v"], grad[idx])
    again = codec.encode(grad.clone())
    assert torch.equal(again["i"], payload["i"]) and torch.equal(again["v"], payload["v"])
    # 0.2% nonzero: the sampled threshold is 0 and keeps too few; exactly k instead
    sparse = torch.zeros(1_000_003)
    sparse[::500] = torch.randn(sparse[::500].numel(), generator=g)
    assert codec.encode(sparse)["i"].numel() == k
    # small tensors: exactly k, as torch.topk picks them
    small = torch.randn(gradcodecs.EXACT_TOPK_MAX, generator=g)
    p = codec.encode(small)
    assert p["i"].numel() == math.ceil(0.01 * small.numel())
    assert set(p["i"].tolist()) == set(torch.topk(small.abs(), p["i"].numel()).indices.tolist())


@pytest.mark.parametrize("n", [1000, 300_001])
def test_topk_measured_error_matches_the_generic_measurement(n):
    """TopKCodec.encode_measured skips the float64 decode-and-subtract: same payload, the same
    largest error, norms within 1e-6 (float32 partial sums, see sum_of_squares), and the decode
    only when asked for."""
    import torch

    from ckptstore.replay.gradcodecs import GradCodec, parse_codec

    codec = parse_codec("topk:0.02")
    g = torch.randn(n, generator=torch.Generator().manual_seed(n)).reshape(-1, 1)
    fast_payload, fast_dec, fast = codec.encode_measured(g)
    slow_payload, slow_dec, slow = GradCodec.encode_measured(codec, g)
    assert torch.equal(fast_payload["i"], slow_payload["i"]) and torch.equal(fast_payload["v"], slow_payload["v"])
    assert torch.equal(fast_dec, slow_dec)
    assert fast.max_abs_error == slow.max_abs_error
    assert fast.l2_error == pytest.approx(slow.l2_error, rel=1e-6)
    assert fast.l2_grad == pytest.approx(slow.l2_grad, rel=1e-6)
    assert codec.encode_measured(g, decoded=False)[1] is None


def test_topk_payload_must_be_one_dimensional():
    """A 2-d index tensor would pass an increasing check that compares rows (found in review:
    unsorted positions then reached the native kernel). Every topk decode path refuses it."""
    import torch

    from ckptstore.replay.gradcodecs import parse_codec

    codec = parse_codec("topk:0.5")
    grad = torch.zeros(1 << 12)
    bad = {"i": torch.tensor([[4095, 0]], dtype=torch.int32), "v": torch.tensor([[1.0, 2.0]])}
    for call in (lambda: codec.slicer(bad, grad), lambda: codec.decode(bad, (1 << 12,), torch.float32),
                 lambda: codec.decode_into(bad, grad.clone())):
        with pytest.raises(ValueError, match="invalid indices"):
            call()
    with pytest.raises(ValueError, match="invalid indices"):
        codec.slicer({"i": torch.tensor([1.0, 2.0]), "v": torch.tensor([1.0, 2.0])}, grad)


@pytest.mark.parametrize("scale", [1e21, 1e-22, 1.0])
def test_sum_of_squares_outside_float32_range(scale):
    """Squares that overflow or turn subnormal in float32 are summed in float64 instead."""
    import torch

    from ckptstore.replay.gradcodecs import sum_of_squares

    t = torch.randn(200_003, generator=torch.Generator().manual_seed(1)) * scale
    exact = float(t.double().square().sum())
    assert sum_of_squares(t) == pytest.approx(exact, rel=1e-6)


def test_topk_keeps_nan_entries_like_torch_topk():
    import torch

    from ckptstore.replay.gradcodecs import parse_codec

    g = torch.randn(1 << 20, generator=torch.Generator().manual_seed(2))
    g[12345] = float("nan")
    idx = parse_codec("topk:0.01").encode(g)["i"].to(torch.int64)
    assert 12345 in set(idx.tolist())


@pytest.mark.parametrize("case", ["randn", "nan", "inf", "mostly-zero", "huge", "tiny", "vanishing",
                                  "strided"])
def test_topk_native_selection_keeps_what_the_torch_path_keeps(case):
    """The C kernel (ckptstore/replay/native/topk_select.c) keeps exactly the entries of the
    torch path for the same sampled threshold, with the same values, and measures the same
    error (its sums in float64: within 1e-6); where the threshold misses, both fall back."""
    import torch

    from ckptstore.replay.gradcodecs import parse_codec
    from ckptstore.replay.native import topk as native_topk

    if not native_topk.available():
        pytest.skip("no C compiler: the native kernel is not built here")
    g = torch.randn(3_000_017, generator=torch.Generator().manual_seed(4))
    if case == "nan":
        g[[5, 77_777, 2_999_999]] = float("nan")
    elif case == "inf":
        g[1000] = float("-inf")
    elif case == "mostly-zero":
        g[:2_500_000] = 0
    elif case == "huge":
        g *= 1e21
    elif case == "tiny":
        g *= 1e-22
    elif case == "vanishing":  # every float32 square is 0: a run summed as 0 is summed again
        g *= 1e-24
    elif case == "strided":
        g = g[:3_000_000].reshape(1000, 3000).t()
    native = parse_codec("topk:0.01")
    torch_path = parse_codec("topk:0.01")
    torch_path._selected_natively = lambda flat: None  # type: ignore[method-assign]
    p1, d1, s1 = native.encode_measured(g)
    p2, d2, s2 = torch_path.encode_measured(g)
    assert torch.equal(p1["i"], p2["i"])
    assert torch.equal(p1["v"].view(torch.int32), p2["v"].view(torch.int32))
    assert torch.equal(d1.view(torch.int32), d2.view(torch.int32))
    assert s1.max_abs_error == s2.max_abs_error
    for a, b in ((s1.l2_error, s2.l2_error), (s1.l2_grad, s2.l2_grad)):
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6)
    if case in ("randn", "huge", "strided"):
        assert native._selected_natively(g.reshape(-1)) is not None  # the kernel served it


@pytest.mark.parametrize("case", ["randn", "zeros", "ties", "nan", "more-nan-than-k", "inf",
                                  "negative-zero", "all-equal", "one-entry"])
@pytest.mark.parametrize("fraction", ["0.01", "0.3", "1"])
def test_topk_exact_path_native_and_torch_keep_the_same_entries(case, fraction):
    """Small gradients (at most EXACT_TOPK_MAX entries) keep exactly k: every entry above the
    k-th largest magnitude, then ties at it in increasing index order, NaN the largest. The C
    kernel (ckpt_topk_exact) and the torch path (_exactly_k) keep the same entries, values and
    largest error, with norms within 1e-6, ties and NaN included."""
    import torch

    from ckptstore.replay.gradcodecs import parse_codec
    from ckptstore.replay.native import topk as native_topk

    if not native_topk.available():
        pytest.skip("no C compiler: the native kernel is not built here")
    g = torch.randn(4099, generator=torch.Generator().manual_seed(8))
    if case == "zeros":
        g[100:] = 0
    elif case == "ties":
        g = (g * 2).round() / 2
    elif case == "nan":
        g[[3, 999, 4000]] = float("nan")
    elif case == "more-nan-than-k":
        g[::2] = float("nan")
        g[1::4] = -g[1::4].abs() * float("nan")  # NaN of the other sign (cleared in the key)
    elif case == "inf":
        g[[7, 70]] = float("inf")
        g[700] = float("-inf")
    elif case == "negative-zero":
        g[:3000] = -0.0
    elif case == "all-equal":
        g[:] = -1.5
    elif case == "one-entry":
        g = g[:1].clone()
    native = parse_codec(f"topk:{fraction}")
    torch_path = parse_codec(f"topk:{fraction}")
    torch_path._selected_natively = lambda flat, *a, **k: None  # type: ignore[method-assign]
    p1, d1, s1 = native.encode_measured(g)
    p2, d2, s2 = torch_path.encode_measured(g)
    k = math.ceil(float(fraction) * g.numel())
    assert p1["i"].numel() == k and p1["i"].dtype == torch.int32
    assert torch.equal(p1["i"], p2["i"])
    assert torch.equal(p1["v"].view(torch.int32), p2["v"].view(torch.int32))
    assert torch.equal(d1.view(torch.int32), d2.view(torch.int32))
    assert s1.max_abs_error == s2.max_abs_error or math.isnan(s1.max_abs_error) and math.isnan(s2.max_abs_error)
    for a, b in ((s1.l2_error, s2.l2_error), (s1.l2_grad, s2.l2_grad)):
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6)
    assert native._selected_natively(g) is not None  # the kernel served it
    # the rule itself: ties at the k-th magnitude go front to back
    keys = g.abs().view(torch.int32)
    kth = torch.topk(keys, k).values[-1]
    idx = p1["i"].to(torch.int64)
    assert bool((keys[idx] >= kth).all())
    dropped = torch.ones(g.numel(), dtype=torch.bool)
    dropped[idx] = False
    assert not bool((keys[dropped] > kth).any())
    tied_kept = idx[keys[idx] == kth]
    tied_dropped = dropped.nonzero().squeeze(1)[keys[dropped] == kth]
    assert tied_kept.numel() == 0 or tied_dropped.numel() == 0 or tied_kept.max() < tied_dropped.min()


def test_topk_without_the_kernel_takes_the_torch_path():
    """With CKPTSTORE_NATIVE=0 (as with no C compiler) every topk encode runs the torch path, in
    a fresh process (the kernel is loaded once per process): found in review, the loader raised
    UnboundLocalError there and every float32 encode failed."""
    import subprocess
    import sys

    code = """
import math, torch
from ckptstore.replay.gradcodecs import parse_codec
from ckptstore.replay.native import topk
assert not topk.available()
c = parse_codec("topk:0.01")
grads = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (1000, 300001, 70001)]
for (p, _, st), g in zip(c.encode_many(grads, False), grads):
    assert p["i"].numel() >= math.ceil(0.01 * g.numel()) // 2 and st.l2_grad > 0
assert parse_codec("topk:0.5").encode(torch.randn(1000))["i"].numel() == 500
print("ok")
"""
    env = dict(os.environ, CKPTSTORE_NATIVE="0")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_topk_keeps_non_cpu_gradients_off_the_kernel():
    """The kernel reads host memory: a gradient on another device (here "meta") is never
    handed to it (found in review: small ones reached SelectionBatch and raised)."""
    import torch

    from ckptstore.replay.gradcodecs import parse_codec

    codec = parse_codec("topk:0.01")
    for n in (1000, 300_001):
        assert codec._native_mode(torch.empty(n, device="meta")) is None
        assert codec._selected_natively(torch.empty(n, device="meta")) is None


def test_selection_batch_refuses_what_it_cannot_serve():
    import numpy as np
    import torch

    from ckptstore.replay.native import topk as native_topk

    if not native_topk.available():
        pytest.skip("no C compiler: the native kernel is not built here")
    x = torch.randn(100)
    with pytest.raises(ValueError, match="not a contiguous float32"):
        native_topk.SelectionBatch([x.double()], [None], [3], [3], [torch.int32], 1)
    with pytest.raises(ValueError, match="cap 2 below"):
        native_topk.SelectionBatch([x], [None], [3], [2], [torch.int32], 1)
    batch = native_topk.SelectionBatch([x, x], [torch.tensor([0, 100]), torch.tensor([1, 2])],
                                       [1, 3], [10, 10], [torch.int64, torch.int32], 2)
    for share in range(batch.shares):
        batch.run(share)
    with pytest.raises(IndexError):
        batch.result(0)
    with pytest.raises(ValueError, match="keep 3 outside"):
        batch.result(1)
    # a mix of modes and index dtypes in one batch: each as it would be alone
    ys = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (5, 300_000, 70_001)]
    pos = [None, torch.arange(0, 300_000, 7), torch.arange(0, 70_001, 3)]
    batch = native_topk.SelectionBatch(ys, pos, [2, 400, 200], [2, 20_000, 20_000],
                                       [torch.int64, torch.int32, torch.int64], 2)
    for share in range(batch.shares):
        batch.run(share)
    want0 = sorted(range(5), key=lambda i: -abs(float(ys[0][i])))[:2]
    got0 = batch.result(0)
    assert got0 is not None and got0[0].tolist() == sorted(want0) and got0[0].dtype == torch.int64
    for j in (1, 2):
        got = batch.result(j)
        assert got is not None
        sample = ys[j][pos[j]].abs()
        threshold = float(torch.topk(sample, [400, 200][j - 1]).values[-1])
        want = (ys[j].abs() >= threshold).nonzero().squeeze(1)
        assert torch.equal(got[0].to(torch.int64), want)
        assert got[0].dtype == [torch.int32, torch.int64][j - 1]
        assert torch.equal(got[1], ys[j][want])
        assert got[2] == pytest.approx(float(np.square(ys[j].double().numpy()).sum()), rel=1e-6)


@pytest.mark.parametrize("spec", ["topk:0.01", "topk:0.6"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_encode_many_gives_each_gradient_what_it_gives_alone(threads, spec):
    """encode_many (topk: concurrent selections on a pool, small gradients on the caller's
    thread) returns, in order, exactly encode_measured of each gradient alone: same indices,
    values, decode and largest error (the norms within float64 rounding), None where a gradient
    is None, with any number of torch threads."""
    import torch

    from ckptstore.replay.gradcodecs import parse_codec
    from ckptstore.replay.native import topk as native_topk

    gen = torch.Generator().manual_seed(9)
    sizes = [3, 70_000, None, 300_001, native_topk.SPLIT_AT + 5, 1 << 20, 17, None, 250_000,
             200_000]
    grads = [None if n is None else torch.randn(n, generator=gen) for n in sizes]
    grads[1][[4, 9]] = float("nan")
    grads[5] = grads[5].reshape(1024, 1024).t()  # strided
    grads[9][:199_500] = 0  # mostly zero: the sampled threshold misses, the torch path runs
    codec = parse_codec(spec)
    if native_topk.available() and spec == "topk:0.01":
        assert codec._selected_natively(grads[9]) is None  # (the kernel gives it back)
        assert codec._selected_natively(grads[8]) is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # (the torch path's float32 sums follow the thread count)
    try:
        many = codec.encode_many(grads, True)
        alone = [None if g is None else codec.encode_measured(g, True) for g in grads]
    finally:
        torch.set_num_threads(before)
    assert len(many) == len(grads)
    for g, got, want in zip(grads, many, alone):
        if g is None:
            assert got is None and want is None
            continue
        assert want is not None
        p, d, s = want
        assert got is not None
        assert torch.equal(got[0]["i"], p["i"]) and torch.equal(got[0]["v"].view(torch.int32), p["v"].view(torch.int32))
        assert torch.equal(got[1].view(torch.int32), d.view(torch.int32))
        assert got[2].max_abs_error == s.max_abs_error
        # the pool scans a large gradient on one thread, alone it is split in two: its float64
        # partial sums add up in another order
        for a, b in ((got[2].l2_grad, s.l2_grad), (got[2].l2_error, s.l2_error)):
            assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12)


@pytest.mark.parametrize("case", ["randn", "nan", "inf", "zeros", "ties", "float64", "subnormal",
                                  "negative-zero", "all-nan"])
def test_sampled_threshold_is_the_samples_order_statistic(case):
    """The sampled threshold (the C kernel's radix select for float32, where it is built) is the
    keep-th largest sampled magnitude as torch.topk gives it, NaN counted as the largest."""
    import torch

    from ckptstore.replay import gradcodecs

    g = torch.randn(1_000_003, generator=torch.Generator().manual_seed(6))
    if case == "nan":
        g[::5000] = float("nan")
    elif case == "inf":
        g[::7000] = float("-inf")
    elif case == "zeros":
        g[:990_000] = 0
    elif case == "ties":
        g = g.round()
    elif case == "float64":
        g = g.double()
    elif case == "subnormal":
        g = g * 1e-40
    elif case == "negative-zero":
        g[:600_000] = -0.0
    elif case == "all-nan":
        g[:] = float("nan")
    for k in (1, 10_000, 400_000, g.numel()):
        positions = gradcodecs._sample_positions(g.numel(), gradcodecs.sample_size(g.numel(), k))
        keep = max(1, round(positions.numel() * k / g.numel()))
        sample = g[positions].abs()
        want = torch.topk(sample, keep, sorted=True).values[-1]
        got = gradcodecs._sampled_threshold(g, k)
        assert got.dtype == g.dtype and (bool(torch.isnan(want)) and bool(torch.isnan(got)) or
                                         got.item() == want.item())


def test_sample_size_expects_enough_entries_above_the_threshold():
    """The sample is the smallest power of two in [2^14, 2^16] expected to hold 128 entries
    above the threshold; across fractions the count kept stays near k (inside [k/2, 2k],
    where the threshold must land, by a wide margin)."""
    import torch

    from ckptstore.replay import gradcodecs
    from ckptstore.replay.gradcodecs import parse_codec, sample_size

    n = 1 << 20
    assert sample_size(n, n // 100) == 1 << 14  # topk:0.01
    assert sample_size(n, n // 1000) == 1 << 16  # topk:0.001 would want 2^17
    assert sample_size(n, n // 4) == 1 << 14
    assert sample_size(n, 0) == 1 << 16
    for m in (sample_size(n, k) for k in range(1, n, 997)):
        assert m & (m - 1) == 0 and gradcodecs.TOPK_SAMPLE_MIN <= m <= gradcodecs.TOPK_SAMPLE
    g = torch.randn(n, generator=torch.Generator().manual_seed(3))
    for fraction in (0.002, 0.01, 0.05, 0.2):
        k = math.ceil(fraction * n)
        kept = parse_codec(f"topk:{fraction}").encode(g)["i"].numel()
        assert 0.75 * k <= kept <= 1.25 * k, (fraction, kept, k)


def test_kth_magnitude_refuses_positions_out_of_range():
    import torch

    from ckptstore.replay.native import topk as native_topk

    if not native_topk.available():
        pytest.skip("no C compiler: the native kernel is not built here")
    x = torch.randn(100)
    assert native_topk.kth_magnitude(x, torch.tensor([3, 50, 99]), 2) == sorted(
        x[[3, 50, 99]].abs().tolist())[-2]
    for bad in ([0, 100], [-1, 5]):
        with pytest.raises(IndexError):
            native_topk.kth_magnitude(x, torch.tensor(bad), 1)
    assert native_topk.kth_magnitude(x, torch.tensor([1, 2]), 3) is None  # keep > m


@settings(max_examples=60, deadline=None)
@given(raw=st.binary(min_size=1, max_size=3000), compressible=st.booleans(),
       cut=st.integers(1, 700), seed=st.integers(0, 2**32 - 1))
def test_verify_chunk_blocks_agrees_with_decoding_the_whole_payload(raw: bytes, compressible: bool,
                                                                   cut: int, seed: int) -> None:
    """Streaming verification (a framed record's data read block by block) accepts exactly what
    decode_chunk accepts: intact chunks of either codec in any blocking; a flipped data byte, a
    short stream and an lz4 payload over lz4's worst case are refused with a FormatError."""
    import random

    if compressible:
        raw = raw[:8] * 400
    payload = good_chunk(raw)
    header = fchunk.decode_chunk_header(payload)
    data = payload[fchunk.CHUNK_HEADER_SIZE:]
    blocks = [data[i:i + cut] for i in range(0, len(data), cut)]
    fchunk.verify_chunk_blocks(header, len(data), blocks)
    bad = bytearray(data)
    bad[random.Random(seed).randrange(len(bad))] ^= 0x10
    with pytest.raises(FormatError):
        fchunk.decode_chunk(payload[:fchunk.CHUNK_HEADER_SIZE] + bytes(bad))
    with pytest.raises(FormatError):
        fchunk.verify_chunk_blocks(header, len(data), [bytes(bad)])
    with pytest.raises(CorruptRecordError):
        fchunk.verify_chunk_blocks(header, len(data), blocks[:-1])
    if header.codec is fchunk.Codec.LZ4:
        too_long = fchunk.lz4_bound(header.raw_length) + 1
        with pytest.raises(CorruptRecordError):
            fchunk.verify_chunk_blocks(header, too_long, [data + bytes(too_long - len(data))])
