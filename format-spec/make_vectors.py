#!/usr/bin/env python3
"""Generate format-spec/vectors/vectors.json: hex test vectors of the ckptstore v1 format.

Every vector is built from FIXED inputs (store id, timestamps, tensor bytes), so running this script
again with the same ckptstore and lz4 produces the same file. The committed JSON is the reference:
``tests/test_format_vectors.py`` decodes the committed hex and never calls this script, so an
unintended change of the on-disk format shows up as a failing test instead of a silently
regenerated vector. Regenerate only for an intended, spec-approved format change:

    python format-spec/make_vectors.py          # rewrites format-spec/vectors/vectors.json
    python format-spec/make_vectors.py --check  # exit 1 if the committed file differs

Vector schema (one JSON object per vector):

    name      unique identifier
    kind      store_header | record | segment_header | chunk | tree | snapshot_root | commit |
              manifest | state | segment | job_store_header | epoch | global_commit | job_record
    hex       the bytes the decoder of ``kind`` takes (lowercase hex)
    expected  decoded fields (positive vectors), or
    error     the exact class name of the ckptstore.errors exception the decoder raises
    note      what the vector shows or how it was damaged

Kinds and their decoder: store_header -> decode_store_header (64-byte STORE file); record ->
decode_record (a whole record: header, payload, trailer); segment_header -> decode_segment_header
(the 48-byte payload); chunk -> decode_chunk (a CHUNK payload); tree -> decode_tree (a TREE
payload); snapshot_root -> snapshot_root(input) (hex is the 16-byte root); commit -> decode_commit
(the 96-byte payload); manifest -> decode_manifest (the JSON payload); state -> json + unflatten (a
state skeleton, serialised as in a manifest; ``sharded_part_base``: a sharded Checkpointer part,
deltas.md "Sharded states", whose ``expected`` also gives its ``shards`` section, what it omits and
``whole``, the skeleton it was cut from; ``dtensor_part``: a part of a DTensor state, format.md
§22.8, whose ``expected`` gives its section, the paths its keys name and where it holds None);
segment -> a whole segment file 0000000001.seg of the
store whose STORE file is the vector "store_header_v1". Job stores (§22): job_store_header ->
decode_store_header accepting version 2 only; epoch -> decode_epoch (the 64-byte payload);
global_commit -> decode_global_commit; job_record -> decode_record with the global log's types.

``vectors/dcp.json`` (format-spec/dcp.md, DCP checkpoints): kind dcp_head, the ``dcp`` head of
a coordinator's state as its state skeleton is serialised in a manifest, with ``world_size``
(the iteration's); decoded with json + unflatten + ``ckptstore.dcp.layout_of``. ``expected``:
per tensor its dtype, global shape and shards (offsets, sizes, rank, store key), per value its
rank and key; or ``error`` (DCPError: does not decode; ShardCoverageError: shards that do not
tile a tensor, ``fqn`` and ``box`` [offsets, sizes] the ones the error names).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from collections import OrderedDict
from typing import Any

import lz4.block
import xxhash

from ckptstore.format import records as rec
from ckptstore.format.chunk import Codec, address_of, choose_encoding, encode_chunk_header
from ckptstore.format.commit import Commit, encode_commit
from ckptstore.format.header import (FEATURE_FRAMING_CHECKS, SegmentHeader, StoreHeader,
                                     encode_segment_header, encode_store_header)
from ckptstore.format.manifest import Manifest, TensorEntry, encode_manifest
from ckptstore.format.state import flatten
from ckptstore.format.tree import encode_tree, make_tree, snapshot_root, tree_root
from state_repr import state_repr  # (beside this script: the vectors' repr text)

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vectors", "vectors.json")

# ---- fixed inputs -------------------------------------------------------------------------------
STORE_ID = bytes.fromhex("00112233445566778899aabbccddeeff")
CREATED_NS = 1_700_000_000_000_000_000          # 2023-11-14T22:13:20Z
CHUNK_SIZE = 4 << 20
SEGMENT_SIZE = 1 << 30
RAW64 = bytes(range(64))                          # 00 01 02 ... 3f
TEXT = b"ckptstore " * 64                         # 640 compressible bytes
TEN = bytes(range(10))                            # a 10-byte "tensor" in 4-byte chunks


def u64(x: int) -> bytes:
    return struct.pack("<Q", x)


def raw_header(rtype: int, length: int, *, magic: bytes = rec.MAGIC, flags: int = 0,
               reserved: int = 0) -> bytes:
    """A record header with arbitrary fields and a *correct* header check."""
    head = struct.pack("<4sBBHQ", magic, rtype, flags, reserved, length)
    return head + u64(xxhash.xxh3_64_intdigest(head))


def flip(buf: bytes, index: int, mask: int = 0x01) -> bytes:
    b = bytearray(buf)
    b[index] ^= mask
    return bytes(b)


def recheck_store(body56: bytes) -> bytes:
    return body56 + u64(xxhash.xxh3_64_intdigest(body56))


class _Leaf:
    """Placeholder for an array leaf in state vectors (flatten's leaf hook recognises it)."""


def _leaf_hook(x, path):
    return x if isinstance(x, _Leaf) else None


def _json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


# ---- builders -----------------------------------------------------------------------------------
def store_header_vectors() -> list[dict]:
    h = StoreHeader(1, STORE_ID, CHUNK_SIZE, SEGMENT_SIZE, CREATED_NS)
    good = encode_store_header(h)
    fields = {"format_version": 1, "store_id": STORE_ID.hex(), "chunk_size": CHUNK_SIZE,
              "segment_size": SEGMENT_SIZE, "created_ns": CREATED_NS, "flags": 0}
    framed = encode_store_header(StoreHeader(1, STORE_ID, CHUNK_SIZE, SEGMENT_SIZE, CREATED_NS,
                                             FEATURE_FRAMING_CHECKS))
    body = good[:56]
    v2 = recheck_store(body[:8] + struct.pack("<I", 2) + body[12:])
    flags = recheck_store(body[:12] + struct.pack("<I", 2) + body[16:])
    zero_chunk = recheck_store(body[:32] + u64(0) + body[40:])
    return [
        dict(name="store_header_v1", kind="store_header", hex=good.hex(), expected=fields,
             note="STORE file of a v1 store (4 MiB chunks, 1 GiB segments)"),
        dict(name="store_header_framing_checks", kind="store_header", hex=framed.hex(),
             expected={**fields, "flags": FEATURE_FRAMING_CHECKS},
             note="STORE flag 1 (FRAMING_CHECKS): CHUNK records may carry record flag 1; what "
                  "a store created since 2026-11-26 has"),
        dict(name="store_header_bad_magic", kind="store_header", hex=flip(good, 0, 0x20).hex(),
             error="FormatError", note="magic 'cKPTSTOR'"),
        dict(name="store_header_bad_check", kind="store_header", hex=flip(good, 40).hex(),
             error="ChecksumMismatch", note="one bit of segment_size flipped, check not updated"),
        dict(name="store_header_unknown_version", kind="store_header", hex=v2.hex(),
             error="UnsupportedVersionError", note="format_version 2 with a valid check"),
        dict(name="store_header_unknown_flags", kind="store_header", hex=flags.hex(),
             error="FormatError", note="flags 2 (unknown) with a valid check"),
        dict(name="store_header_zero_chunk_size", kind="store_header", hex=zero_chunk.hex(),
             error="FormatError", note="chunk_size 0 with a valid check"),
        dict(name="store_header_truncated", kind="store_header", hex=good[:63].hex(),
             error="FormatError", note="63 of 64 bytes"),
    ]


def record_vectors() -> list[dict]:
    seg_payload = encode_segment_header(SegmentHeader(1, 1, STORE_ID, 0))
    seg_rec = rec.encode_record(rec.RecordType.SEGMENT_HEADER, seg_payload)
    commit_rec = rec.encode_record(rec.RecordType.COMMIT, encode_commit(_commit()))
    tomb = rec.encode_record(rec.RecordType.TOMBSTONE, b"")
    delta = rec.encode_record(rec.RecordType.GRAD_DELTA, b"reserved")
    small = rec.encode_record(rec.RecordType.MANIFEST, b"{}")

    def ok(name, r, rtype, payload, note, flags=0):
        return dict(name=name, kind="record", hex=r.hex(), note=note,
                    expected={"type": int(rtype), "type_name": rec.RecordType(rtype).name,
                              "length": len(payload), "payload": payload.hex(), "flags": flags})

    def bad(name, buf, error, note):
        return dict(name=name, kind="record", hex=buf.hex(), error=error, note=note)

    unknown_type = raw_header(7, 2) + b"{}" + rec.encode_trailer(b"{}")
    flags = raw_header(rec.RecordType.MANIFEST, 2, flags=1) + b"{}" + rec.encode_trailer(b"{}")
    reserved = raw_header(rec.RecordType.MANIFEST, 2, reserved=1) + b"{}" + rec.encode_trailer(b"{}")
    too_long = raw_header(rec.RecordType.CHUNK, rec.MAX_PAYLOAD + 1)
    chunk_raw = bytes(range(48))
    chunk_payload = encode_chunk_header(address_of(chunk_raw), Codec.RAW, 48) + chunk_raw
    framed = rec.encode_record(rec.RecordType.CHUNK, chunk_payload, rec.FRAMING_CHECK)
    framed_short = raw_header(rec.RecordType.CHUNK, 16, flags=1) + bytes(16) + \
        rec.encode_trailer(bytes(16))
    flag2 = raw_header(rec.RecordType.CHUNK, len(chunk_payload), flags=2) + chunk_payload + \
        rec.encode_trailer(chunk_payload)
    return [
        ok("record_chunk_framing_check", framed, rec.RecordType.CHUNK, chunk_payload,
           "a CHUNK record with flag 1 (FRAMING_CHECK): payload_check = xxh3_64 of the 32-byte "
           "chunk header only; the 48 data bytes are covered by the address", flags=1),
        ok("record_chunk_framing_check_data_flipped", flip(framed, 24 + 32), rec.RecordType.CHUNK,
           flip(chunk_payload, 32),
           "record_chunk_framing_check with its first data byte flipped: the record is valid "
           "(its trailer does not cover data) and its chunk payload fails the address check "
           "(ChecksumMismatch): a reader MUST verify the address (C1)", flags=1),
        bad("record_chunk_framing_check_header_flipped", flip(framed, 24 + 20),
            "ChecksumMismatch", "record_chunk_framing_check with a chunk-header reserved byte "
            "flipped: the trailer covers the chunk header"),
        bad("record_framing_check_short_chunk", framed_short, "CorruptRecordError",
            "flag 1 on a 16-byte CHUNK payload (shorter than a chunk header) with valid checks"),
        bad("record_chunk_unknown_flag", flag2, "CorruptRecordError",
            "flag 2 (unassigned) on a CHUNK record with valid checks"),
        ok("record_segment_header", seg_rec, rec.RecordType.SEGMENT_HEADER, seg_payload,
           "the 80-byte first record of segment 1 (see segment_header_seq1)"),
        ok("record_commit", commit_rec, rec.RecordType.COMMIT, encode_commit(_commit()),
           "a COMMIT record (payload: commit_basic)"),
        ok("record_tombstone_reserved", tomb, rec.RecordType.TOMBSTONE, b"",
           "reserved type 6 with an empty payload: valid, skipped by v1 readers"),
        ok("record_grad_delta_reserved", delta, rec.RecordType.GRAD_DELTA, b"reserved",
           "reserved type 16: valid, skipped by v1 readers"),
        ok("record_manifest_small", small, rec.RecordType.MANIFEST, b"{}",
           "framing only: the payload '{}' is not a valid manifest"),
        bad("record_bad_magic", flip(small, 3, 0x02), "CorruptRecordError", "magic 'CSR3'"),
        bad("record_bad_header_check", flip(small, 16), "ChecksumMismatch",
            "first byte of header_check flipped"),
        bad("record_length_changed", flip(small, 8, 0x04), "ChecksumMismatch",
            "length 2 -> 6 without updating header_check"),
        bad("record_bad_payload_check", flip(small, len(small) - 1, 0x80), "ChecksumMismatch",
            "last byte of payload_check flipped"),
        bad("record_payload_bit_flip", flip(small, 24), "ChecksumMismatch",
            "payload '{}' -> 'z}'; payload_check no longer matches"),
        bad("record_truncated_header", small[:23], "CorruptRecordError", "23 of 24 header bytes"),
        bad("record_truncated_payload", small[:25], "CorruptRecordError",
            "header claims 2 payload bytes; 1 present, no trailer"),
        bad("record_truncated_trailer", small[:-1], "CorruptRecordError", "7 of 8 trailer bytes"),
        bad("record_unknown_type", unknown_type, "CorruptRecordError",
            "type 7 (unassigned) with valid checks: the header is invalid in v1"),
        bad("record_unknown_flags", flags, "CorruptRecordError",
            "flag 1 (FRAMING_CHECK) on a MANIFEST record with valid checks: only CHUNK records "
            "carry it"),
        bad("record_nonzero_reserved", reserved, "CorruptRecordError",
            "reserved u16 = 1 with valid checks"),
        bad("record_length_over_max", too_long, "CorruptRecordError",
            "length MAX_PAYLOAD+1 with a valid header check (never allocated)"),
    ]


def segment_header_vectors() -> list[dict]:
    def ok(name, h, note):
        return dict(name=name, kind="segment_header", hex=encode_segment_header(h).hex(), note=note,
                    expected={"format_version": h.format_version, "seq": h.seq,
                              "store_id": h.store_id.hex(), "supersedes": h.supersedes})

    good = encode_segment_header(SegmentHeader(1, 1, STORE_ID, 0))
    return [
        ok("segment_header_seq1", SegmentHeader(1, 1, STORE_ID, 0), "segment 1, no gc watermark"),
        ok("segment_header_gc_marker", SegmentHeader(1, 9, STORE_ID, 7),
           "segment 9 written by gc: segments 1..7 are obsolete"),
        dict(name="segment_header_unknown_version", kind="segment_header",
             hex=(struct.pack("<I", 2) + good[4:]).hex(), error="UnsupportedVersionError",
             note="format_version 2"),
        dict(name="segment_header_nonzero_reserved", kind="segment_header",
             hex=(good[:40] + u64(1)).hex(), error="FormatError", note="last reserved u64 = 1"),
        dict(name="segment_header_supersedes_not_older", kind="segment_header",
             hex=encode_segment_header(SegmentHeader(1, 3, STORE_ID, 3)).hex(), error="FormatError",
             note="seq 3 claims to supersede segment 3"),
        dict(name="segment_header_truncated", kind="segment_header", hex=good[:47].hex(),
             error="FormatError", note="47 of 48 bytes"),
    ]


def chunk_vectors() -> list[dict]:
    raw_addr = address_of(RAW64)
    raw_payload = encode_chunk_header(raw_addr, Codec.RAW, len(RAW64)) + RAW64
    packed = lz4.block.compress(TEXT, store_size=False)
    lz_addr = address_of(TEXT)
    lz_payload = encode_chunk_header(lz_addr, Codec.LZ4, len(TEXT)) + packed

    def ok(name, payload, addr, codec, raw, note):
        return dict(name=name, kind="chunk", hex=payload.hex(), note=note,
                    expected={"address": addr.hex(), "codec": int(codec), "raw_length": len(raw),
                              "data": payload[32:].hex(), "raw": raw.hex()})

    def bad(name, payload, error, note):
        return dict(name=name, kind="chunk", hex=payload.hex(), error=error, note=note)

    # lz4 ratio bound: a 4-byte block cannot decode to more than 255*4+64 = 1084 bytes.
    tiny_block = lz4.block.compress(b"a", store_size=False)
    ratio = encode_chunk_header(address_of(b"a" * 1085), Codec.LZ4, 1085) + tiny_block[:1] + b"\0" * 3
    wrong_size = encode_chunk_header(lz_addr, Codec.LZ4, len(TEXT) + 1) + packed
    return [
        ok("chunk_raw", raw_payload, raw_addr, Codec.RAW, RAW64, "64 raw bytes 00..3f"),
        ok("chunk_lz4", lz_payload, lz_addr, Codec.LZ4, TEXT,
           "640 bytes 'ckptstore ' x 64 as one lz4 block (no size prefix)"),
        bad("chunk_bad_address", flip(raw_payload, 0), "ChecksumMismatch",
            "first address byte flipped: the data no longer hashes to it"),
        bad("chunk_raw_data_flip", flip(raw_payload, 40), "ChecksumMismatch",
            "one data byte flipped (the record check is a separate layer)"),
        bad("chunk_raw_length_mismatch", encode_chunk_header(raw_addr, Codec.RAW, 65) + RAW64,
            "CorruptRecordError", "raw chunk declares 65 bytes, holds 64"),
        bad("chunk_lz4_ratio_bound", ratio, "CorruptRecordError",
            "4 bytes of lz4 data declaring 1085 raw bytes (> 255*4+64): refused before decoding"),
        bad("chunk_lz4_wrong_raw_length", wrong_size, "CorruptRecordError",
            "valid lz4 block of 640 bytes declared as 641"),
        bad("chunk_lz4_garbage", encode_chunk_header(lz_addr, Codec.LZ4, len(TEXT)) + b"\xff" * 16,
            "CorruptRecordError", "16 bytes that are not an lz4 block"),
        bad("chunk_unknown_codec", encode_chunk_header(raw_addr, 2, 64) + RAW64, "FormatError",
            "codec 2"),
        bad("chunk_nonzero_reserved", raw_payload[:17] + b"\x01" + raw_payload[18:], "FormatError",
            "first reserved byte = 1"),
        bad("chunk_raw_length_over_max",
            encode_chunk_header(raw_addr, Codec.RAW, (256 << 20) + 1) + RAW64, "FormatError",
            "raw_length MAX_CHUNK_SIZE+1"),
        bad("chunk_truncated_header", raw_payload[:31], "CorruptRecordError", "31 of 32 header bytes"),
    ]


def _ten_tree():
    addrs = [address_of(TEN[i:i + 4]) for i in range(0, len(TEN), 4)]
    return make_tree(len(TEN), 4, addrs)


def tree_vectors() -> list[dict]:
    t = _ten_tree()
    good = encode_tree(t)
    empty = make_tree(0, CHUNK_SIZE, [])

    def ok(name, tree, note, chunks=None):
        exp = {"root": tree.root.hex(), "nbytes": tree.nbytes, "chunk_size": tree.chunk_size,
               "addresses": [a.hex() for a in tree.addresses]}
        if chunks is not None:
            exp["chunks"] = [c.hex() for c in chunks]
        return dict(name=name, kind="tree", hex=encode_tree(tree).hex(), expected=exp, note=note)

    n_wrong = good[:32] + u64(2) + good[40:]
    return [
        ok("tree_three_chunks", t, "10 bytes 00..09 in 4-byte chunks: 00010203 | 04050607 | 0809",
           chunks=[TEN[0:4], TEN[4:8], TEN[8:10]]),
        ok("tree_empty", empty, "an empty tensor: no chunks"),
        dict(name="tree_bad_root", kind="tree", hex=flip(good, 0).hex(), error="ChecksumMismatch",
             note="first root byte flipped"),
        dict(name="tree_address_flip", kind="tree", hex=flip(good, 40).hex(),
             error="ChecksumMismatch", note="first address byte flipped: root no longer matches"),
        dict(name="tree_wrong_chunk_count", kind="tree", hex=n_wrong.hex(), error="FormatError",
             note="n_chunks 2 for 10 bytes in 4-byte chunks"),
        dict(name="tree_zero_chunk_size", kind="tree",
             hex=(good[:24] + u64(0) + good[32:]).hex(), error="FormatError", note="chunk_size 0"),
        dict(name="tree_nbytes_over_max", kind="tree",
             hex=(good[:16] + u64((1 << 48) + 1) + good[24:]).hex(), error="FormatError",
             note="nbytes 2**48+1"),
        dict(name="tree_truncated", kind="tree", hex=good[:-1].hex(), error="FormatError",
             note="last address byte missing"),
        dict(name="tree_short_header", kind="tree", hex=good[:39].hex(), error="FormatError",
             note="39 of 40 header bytes"),
    ]


def snapshot_vectors() -> list[dict]:
    pairs = [("model/w", _ten_tree().root), ("model/b", tree_root(0, CHUNK_SIZE, [])),
             ("opt/é", address_of(b"x"))]
    return [dict(name="snapshot_root_three", kind="snapshot_root",
                 hex=snapshot_root(pairs).hex(),
                 expected={"input": [[p, r.hex()] for p, r in pairs]},
                 note="CKS1 || (u32 len || utf-8 path || root)* over three tensors")]


def _commit() -> Commit:
    return Commit(iteration=100, manifest_seq=1, manifest_offset=4096, manifest_length=512,
                  manifest_digest=bytes.fromhex("000102030405060708090a0b0c0d0e0f"),
                  snapshot_root=bytes.fromhex("f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff"),
                  created_ns=CREATED_NS, logical_bytes=1 << 20, written_bytes=4608, kind=0)


def _commit_fields(c: Commit) -> dict:
    return {"iteration": c.iteration, "manifest_seq": c.manifest_seq,
            "manifest_offset": c.manifest_offset, "manifest_length": c.manifest_length,
            "manifest_digest": c.manifest_digest.hex(), "snapshot_root": c.snapshot_root.hex(),
            "created_ns": c.created_ns, "logical_bytes": c.logical_bytes,
            "written_bytes": c.written_bytes, "kind": c.kind}


def commit_vectors() -> list[dict]:
    c = _commit()
    good = encode_commit(c)
    delta = Commit(101, 1, 8192, 300, c.manifest_digest, c.snapshot_root, CREATED_NS + 1, 4096,
                   460, 1)
    return [
        dict(name="commit_basic", kind="commit", hex=good.hex(), expected=_commit_fields(c),
             note="iteration 100; manifest at segment 1 offset 4096, 512 bytes"),
        dict(name="commit_delta", kind="commit", hex=encode_commit(delta).hex(),
             expected=_commit_fields(delta), note="kind 1: the commit of a delta manifest"),
        dict(name="commit_unknown_kind", kind="commit", hex=(good[:88] + b"\x02" + good[89:]).hex(),
             error="FormatError", note="kind 2 (unassigned)"),
        dict(name="commit_nonzero_reserved", kind="commit", hex=(good[:95] + b"\x01").hex(),
             error="FormatError", note="last reserved byte = 1"),
        dict(name="commit_iteration_out_of_range", kind="commit",
             hex=(u64(1 << 63) + good[8:]).hex(), error="FormatError", note="iteration 2**63"),
        dict(name="commit_truncated", kind="commit", hex=good[:95].hex(), error="FormatError",
             note="95 of 96 bytes"),
    ]


def _entry_fields(t: TensorEntry) -> dict:
    return {"path": t.path, "lib": t.lib, "dtype": t.dtype, "shape": list(t.shape),
            "nbytes": t.nbytes, "root": t.root.hex(),
            "inline": None if t.inline is None else t.inline.hex(), "param": t.param,
            "requires_grad": t.requires_grad}


def job_vectors() -> list[dict]:
    """A multi-rank job store (§22): its STORE (version 2), an EPOCH and a GLOBAL_COMMIT record
    of two ranks, whole records as they lie in a global log, and their negative cases."""
    from ckptstore.format.job import (Epoch, GlobalCommit, JobRecordType, RankCommit,
                                      encode_epoch, encode_global_commit)

    h = StoreHeader(2, STORE_ID, CHUNK_SIZE, SEGMENT_SIZE, CREATED_NS)
    header_fields = {"format_version": 2, "store_id": STORE_ID.hex(), "chunk_size": CHUNK_SIZE,
                     "segment_size": SEGMENT_SIZE, "created_ns": CREATED_NS}
    e2 = Epoch(2, 2, STORE_ID, adopted_epoch=1, adopted_end=424, created_ns=CREATED_NS)
    epoch_fields = {"epoch": 2, "world_size": 2, "store_id": STORE_ID.hex(), "adopted_epoch": 1,
                    "adopted_end": 424, "created_ns": CREATED_NS}
    c0 = _commit()
    c1 = Commit(100, 3, 65536, 640, bytes(range(16, 32)), bytes(range(32, 48)), CREATED_NS,
                1 << 20, 9216, 0)
    g = GlobalCommit(100, 2, 0, (RankCommit(1, 4640, c0), RankCommit(3, 66208, c1)), CREATED_NS)
    gpay = encode_global_commit(g)
    global_fields = {"iteration": 100, "epoch": 2, "kind": 0, "created_ns": CREATED_NS, "ranks": [
        {"commit_seq": 1, "commit_offset": 4640, "commit": _commit_fields(c0)},
        {"commit_seq": 3, "commit_offset": 66208, "commit": _commit_fields(c1)}]}
    epay = encode_epoch(e2)
    other_it = encode_global_commit(GlobalCommit(100, 2, 0, (RankCommit(1, 4640, c0), RankCommit(
        3, 66208, Commit(101, 3, 65536, 640, c1.manifest_digest, c1.snapshot_root, CREATED_NS,
                         1 << 20, 9216, 0))), CREATED_NS))
    return [
        dict(name="job_store_header_v2", kind="job_store_header", expected=header_fields,
             hex=encode_store_header(h).hex(), note="STORE file of a multi-rank job store"),
        dict(name="job_store_header_v1_refused", kind="job_store_header",
             hex=encode_store_header(StoreHeader(1, STORE_ID, CHUNK_SIZE, SEGMENT_SIZE,
                                                 CREATED_NS)).hex(),
             error="UnsupportedVersionError", note="a v1 STORE is not a job store"),
        dict(name="job_store_header_flags_refused", kind="job_store_header",
             hex=encode_store_header(StoreHeader(2, STORE_ID, CHUNK_SIZE, SEGMENT_SIZE,
                                                 CREATED_NS, FEATURE_FRAMING_CHECKS)).hex(),
             error="FormatError", note="flags 1 on a job store's STORE: a job store has no "
                                       "feature flags (its rank streams, v1 stores, do)"),
        dict(name="epoch_2_adopts_1", kind="epoch", hex=epay.hex(), expected=epoch_fields,
             note="epoch 2 of a 2-rank job, continuing epoch 1's global log up to offset 424"),
        dict(name="epoch_adopts_itself", kind="epoch",
             hex=encode_epoch(Epoch(2, 2, STORE_ID, 2, 424, CREATED_NS)).hex(),
             error="FormatError", note="adopted_epoch must be older"),
        dict(name="epoch_zero_world", kind="epoch", hex=(epay[:8] + bytes(4) + epay[12:]).hex(),
             error="FormatError", note="world_size 0"),
        dict(name="epoch_nonzero_reserved", kind="epoch", hex=(epay[:56] + u64(1)).hex(),
             error="FormatError", note="last reserved u64 = 1"),
        dict(name="epoch_truncated", kind="epoch", hex=epay[:63].hex(), error="FormatError",
             note="63 of 64 bytes"),
        dict(name="global_commit_two_ranks", kind="global_commit", hex=gpay.hex(),
             expected=global_fields, note="iteration 100 of epoch 2 on ranks 0 and 1: each "
             "rank's local COMMIT location and payload"),
        dict(name="global_commit_rank_names_other_iteration", kind="global_commit",
             hex=other_it.hex(), error="FormatError",
             note="rank 1's commit is of iteration 101"),
        dict(name="global_commit_world_size_mismatch", kind="global_commit",
             hex=(gpay[:16] + struct.pack("<I", 3) + gpay[20:]).hex(), error="FormatError",
             note="world_size 3 with two rank entries"),
        dict(name="global_commit_unknown_kind", kind="global_commit",
             hex=(gpay[:20] + b"\x02" + gpay[21:]).hex(), error="FormatError", note="kind 2"),
        dict(name="global_commit_truncated", kind="global_commit", hex=gpay[:-1].hex(),
             error="FormatError", note="one byte short"),
        dict(name="record_epoch", kind="job_record",
             hex=rec.encode_record(JobRecordType.EPOCH, epay).hex(),
             expected={"type": 18, "length": len(epay), "payload": epay.hex()},
             note="the first record of global/0000000002.log"),
        dict(name="record_global_commit", kind="job_record",
             hex=rec.encode_record(JobRecordType.GLOBAL_COMMIT, gpay).hex(),
             expected={"type": 19, "length": len(gpay), "payload": gpay.hex()},
             note="a GLOBAL_COMMIT record as it lies in a global log"),
        dict(name="job_record_commit_type_refused", kind="job_record",
             hex=rec.encode_record(rec.RecordType.COMMIT, encode_commit(c0)).hex(),
             error="CorruptRecordError", note="type 5 (COMMIT) is not assigned in a global log"),
    ]


def manifest_vectors() -> list[dict]:
    state, _ = flatten({"model": {"w": _Leaf(), "b": _Leaf()}, "step": 100, "lr": 0.001},
                       _leaf_hook)
    meta, _ = flatten({"loss": 2.5}, _leaf_hook)
    w = TensorEntry("model/w", "torch", "float32", (4, 100), 1600, _ten_tree().root)
    b_bytes = bytes(range(16))
    b_root = tree_root(16, 1024, [address_of(b_bytes)])
    b = TensorEntry("model/b", "numpy", "<f4", (4,), 16, b_root, b_bytes, False, False)
    m = Manifest(100, CREATED_NS, 1024, state, meta, (w, b))
    good = encode_manifest(m)
    fields = {"iteration": 100, "kind": "snapshot", "created_ns": CREATED_NS, "chunk_size": 1024,
              "state": state, "meta": meta, "tensors": [_entry_fields(w), _entry_fields(b)],
              "extra": {}}
    doc = json.loads(good)

    def variant(**changes) -> bytes:
        d = json.loads(good)
        for k, v in changes.items():
            d[k] = v
        return _json(d)

    def entry_variant(i: int, **changes) -> bytes:
        d = json.loads(good)
        d["tensors"][i].update(changes)
        return _json(d)

    param = TensorEntry("w", "torch", "bfloat16", (), 2, tree_root(2, 64, [address_of(b"\x80\x3f")]),
                        b"\x80\x3f", True, True)
    m2 = Manifest(0, 0, 64, {"T": 0}, None, (param,))
    extra = dict(doc)
    extra["future_field"] = {"x": 1}
    dm = Manifest(101, CREATED_NS + 1, 1024, {"d": [["lr", {"f": (0.001).hex()}]]}, None, (), "delta",
                  {"prev": 100, "base": 100})
    return [
        dict(name="manifest_two_tensors", kind="manifest", hex=good.hex(), expected=fields,
             note="a chunked torch tensor (root of tree_three_chunks, as a stand-in) and an "
                  "inline numpy tensor"),
        dict(name="manifest_parameter_inline", kind="manifest", hex=encode_manifest(m2).hex(),
             expected={"iteration": 0, "kind": "snapshot", "created_ns": 0, "chunk_size": 64,
                       "state": {"T": 0}, "meta": None, "tensors": [_entry_fields(param)],
                       "extra": {}},
             note="a 0-d bfloat16 nn.Parameter with requires_grad, stored inline"),
        dict(name="manifest_unknown_key_kept", kind="manifest", hex=_json(extra).hex(),
             expected=dict(fields, extra={"future_field": {"x": 1}}),
             note="unknown top-level keys are ignored by readers (kept in Manifest.extra and "
                  "written back after the known keys)"),
        dict(name="manifest_delta", kind="manifest", hex=encode_manifest(dm).hex(),
             expected={"iteration": 101, "kind": "delta", "created_ns": CREATED_NS + 1,
                       "chunk_size": 1024, "state": dm.state, "meta": None, "tensors": [],
                       "extra": {"prev": 100, "base": 100}},
             note="kind delta: prev = iteration - 1, base = the snapshot the chain starts from"),
        dict(name="manifest_delta_broken_chain", kind="manifest",
             hex=encode_manifest(Manifest(101, CREATED_NS, 1024, None, None, (), "delta",
                                          {"prev": 99, "base": 99})).hex(),
             error="FormatError", note="delta with prev 99 for iteration 101"),
        dict(name="manifest_delta_without_base", kind="manifest",
             hex=encode_manifest(Manifest(101, CREATED_NS, 1024, None, None, (), "delta",
                                          {"prev": 100})).hex(),
             error="FormatError", note="delta without base"),
        dict(name="manifest_unknown_version", kind="manifest", hex=variant(v=2).hex(),
             error="UnsupportedVersionError", note='"v": 2'),
        dict(name="manifest_version_not_int", kind="manifest", hex=variant(v=1.0).hex(),
             error="UnsupportedVersionError", note='"v": 1.0'),
        dict(name="manifest_not_json", kind="manifest", hex=good[:-1].hex(), error="FormatError",
             note="last byte '}' missing"),
        dict(name="manifest_not_object", kind="manifest", hex=b"[1]".hex(), error="FormatError",
             note="a JSON array"),
        dict(name="manifest_non_ascii", kind="manifest",
             hex=good.replace(b'"model/w"', '"modèl/w"'.encode("utf-8")).hex(),
             error="FormatError", note="raw UTF-8 byte in a string: payloads are ASCII JSON"),
        dict(name="manifest_unknown_kind", kind="manifest", hex=variant(kind="full").hex(),
             error="FormatError", note='"kind": "full" (unassigned)'),
        dict(name="manifest_negative_iteration", kind="manifest", hex=variant(iteration=-1).hex(),
             error="FormatError", note='"iteration": -1'),
        dict(name="manifest_bool_iteration", kind="manifest", hex=variant(iteration=True).hex(),
             error="FormatError", note='"iteration": true (exact int required)'),
        dict(name="manifest_zero_chunk_size", kind="manifest", hex=variant(chunk_size=0).hex(),
             error="FormatError", note='"chunk_size": 0'),
        dict(name="manifest_missing_state", kind="manifest",
             hex=_json({k: v for k, v in doc.items() if k != "state"}).hex(), error="FormatError",
             note='no "state" key'),
        dict(name="manifest_bad_root", kind="manifest", hex=entry_variant(0, root="00" * 15).hex(),
             error="FormatError", note="root of 15 bytes"),
        dict(name="manifest_unknown_lib", kind="manifest", hex=entry_variant(0, lib="jax").hex(),
             error="FormatError", note='"lib": "jax"'),
        dict(name="manifest_bad_shape", kind="manifest", hex=entry_variant(0, shape=[4, -1]).hex(),
             error="FormatError", note="negative dimension"),
        dict(name="manifest_inline_length_mismatch", kind="manifest",
             hex=entry_variant(1, nbytes=15).hex(), error="FormatError",
             note="inline holds 16 bytes, nbytes says 15"),
        dict(name="manifest_inline_bad_base64", kind="manifest",
             hex=entry_variant(1, inline="AAECAwQFBgcICQoLDA0ODw=").hex(), error="FormatError",
             note="base64 with wrong padding"),
        dict(name="manifest_param_not_bool", kind="manifest", hex=entry_variant(0, param=1).hex(),
             error="FormatError", note='"param": 1'),
    ]


def state_vectors() -> list[dict]:
    model = OrderedDict([("fc.weight", _Leaf()), ("fc.bias", _Leaf())])
    model._metadata = OrderedDict([("", {"version": 1}), ("fc", {"version": 1})])
    value = {
        "model": model,
        "optim": {"state": {0: {"step": _Leaf(), "exp_avg": _Leaf()}},
                  "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0],
                                    "foreach": None, "amsgrad": False}]},
        "floats": [-0.0, float("inf"), float("-inf"), float("nan"), 1e-310, 1.5],
        "misc": (b"\x00\xffbytes", "str", -7, 2 ** 70),
    }
    skeleton, leaves = flatten(value, _leaf_hook)
    enc = _json(skeleton)

    def bad(name, node, note):
        return dict(name=name, kind="state", hex=_json(node).hex(), error="FormatError", note=note)

    deep = 0
    for _ in range(257):
        deep = [deep]
    return [
        dict(name="state_optimizer_like", kind="state", hex=enc.hex(), note=(
            "every tag: d (str and int keys), o+m (Module.state_dict with _metadata), t, f "
            "(-0.0, inf, -inf, nan, subnormal), b, T; leaves shown as <leaf i>"),
             expected={"repr": _state_repr(value, leaves),
                       "metadata": {"model": state_repr(model._metadata)}, "leaves": len(leaves)}),
        dict(name="state_scalar_root", kind="state", hex=_json({"f": (0.1).hex()}).hex(),
             expected={"repr": "0.1", "metadata": {}, "leaves": 0}, note="the root may be a scalar"),
        bad("state_unknown_tag", {"x": 1}, "tag 'x'"),
        bad("state_two_tags", {"t": [], "d": []}, "two keys other than o+m"),
        bad("state_m_without_o", {"d": [], "m": None}, "'m' is only valid next to 'o'"),
        bad("state_float_not_string", {"f": 1.5}, "float body must be a hex string"),
        bad("state_float_garbage", {"f": "0x1.zp0"}, "not a float.hex() string"),
        bad("state_bad_base64", {"b": "AAE"}, "base64 without padding"),
        bad("state_dict_item_not_pair", {"d": [["a", 1, 2]]}, "dict item of three elements"),
        bad("state_dict_key_float", {"d": [[1.5, 1]]}, "dict key 1.5 (str or int only)"),
        bad("state_dict_key_bool", {"d": [[True, 1]]}, "dict key true (exact int only)"),
        bad("state_tuple_not_list", {"t": {"d": []}}, "tuple body must be an array"),
        bad("state_negative_leaf", {"T": -1}, "negative tensor index"),
        bad("state_raw_json_object", {"a": 1, "b": 2}, "plain JSON objects are not a node"),
        bad("state_too_deep", deep, "257 nested lists (MAX_DEPTH 256)"),
    ]


def _sharded_whole() -> dict:
    """A Checkpointer state (deltas.md, "Sharded states") of 2 ranks' job, before the part is cut:
    ``embed.weight`` Shard(0) (rows 0-1 of 4 on rank 0), ``norm.weight`` Replicate (owned by
    rank 1), ``head.weight`` tied to ``embed.weight``; AdamW state for both parameters."""
    model = OrderedDict([("embed.weight", _Leaf()), ("norm.weight", _Leaf()),
                         ("head.weight", _Leaf())])
    model._metadata = OrderedDict([("", {"version": 1})])
    adam = {0: {"step": _Leaf(), "exp_avg": _Leaf(), "exp_avg_sq": _Leaf()},
            1: {"step": _Leaf(), "exp_avg": _Leaf(), "exp_avg_sq": _Leaf()}}
    return {"model": model,
            "optimizer": {"state": adam, "param_groups": [{"lr": 0.01, "weight_decay": 0.01,
                                                           "params": [0, 1]}]},
            "iteration": 4,
            "ckptstore.replay": {"v": 1, "optimizer": "AdamW", "defaults": {"lr": 0.01},
                                 "groups": [["embed.weight", "norm.weight"]],
                                 "aliases": {"head.weight": "embed.weight"}, "codec": "exact",
                                 "device": "cpu", "torch": "2.13.0", "scheduler": False}}


def _sharded_part(whole: dict) -> dict:
    """Rank 0's part of :func:`_sharded_whole` as the spec cuts it (norm.weight left to rank 1)."""
    box = {"shape": [4, 2], "offsets": [0, 0], "local": [2, 2], "placements": ["S0"], "mesh": [2]}
    rep = {"shape": [3], "offsets": [0], "local": [3], "placements": ["R"], "mesh": [2]}
    info = whole["ckptstore.replay"]
    model = OrderedDict((k, v) for k, v in whole["model"].items() if k != "norm.weight")
    model._metadata = whole["model"]._metadata
    return {"model": model,
            "optimizer": {"state": {0: whole["optimizer"]["state"][0]},
                          "param_groups": [{"lr": 0.01, "weight_decay": 0.01, "params": [0]}]},
            "iteration": 4,
            "ckptstore.replay": dict(info, groups=[["embed.weight"]], aliases=dict(info["aliases"]),
                                     shards={
                "v": 1, "rank": 0, "world": 2,
                "tensors": {"embed.weight": box, "norm.weight": rep, "head.weight": box},
                "replicas": {"norm.weight": 1}, "groups": info["groups"],
                "keys": list(whole["model"]), "aliases": dict(info["aliases"]),
                "state_order": [0, 1], "param_names": [None]})}


def sharded_part_vectors() -> list[dict]:
    """A sharded part (deltas.md, "Sharded states") as its state skeleton is serialised in a
    manifest; ``expected.whole`` the skeleton of the state it was cut from (hex)."""
    whole = _sharded_whole()
    part = _sharded_part(whole)
    skeleton, leaves = flatten(part, _leaf_hook)
    whole_skeleton, _ = flatten(whole, _leaf_hook)
    return [dict(name="sharded_part_base", kind="state", hex=_json(skeleton).hex(), note=(
        "rank 0's part of 2: embed.weight Shard(0) (written), norm.weight Replicate owned by "
        "rank 1 (cut: model, optimizer state renumbered, groups), head.weight tied to "
        "embed.weight (written next to it)"),
        expected={"repr": _state_repr(part, leaves),
                  "metadata": {"model": state_repr(part["model"]._metadata)}, "leaves": len(leaves),
                  "shards": part["ckptstore.replay"]["shards"],
                  "replay_groups": [["embed.weight"]],
                  "replay_aliases": {"head.weight": "embed.weight"},
                  "omitted": {"norm.weight": 1}, "donors": [1],
                  "whole": _json(whole_skeleton).hex()})]


def dtensor_part_vectors() -> list[dict]:
    """Rank 1's part of 2 of a DTensor state saved with ``JobStore.save`` (format.md §22.8): a
    Shard(0) model entry (rows 2-3 of 4), a Replicate() entry owned by rank 0 (None here), the
    AdamW moment of the sharded entry (integer key 0 in its path) and a plain ``step``."""
    box = {"shape": [4, 2], "offsets": [2, 0], "local": [2, 2], "placements": ["S0"], "mesh": [2]}
    rep = {"shape": [3], "offsets": [0], "local": [3], "placements": ["R"], "mesh": [2]}
    model = OrderedDict([("w", _Leaf()), ("b", None)])
    model._metadata = OrderedDict([("", {"version": 1})])
    part = {"model": model,
            "optim": {"state": {0: {"step": _Leaf(), "exp_avg": _Leaf()}},
                      "param_groups": [{"lr": 0.01, "params": [0, 1]}]},
            "ckptstore.shards": {"v": 1, "rank": 1, "world": 2,
                                 "tensors": {'["model","w"]': box, '["model","b"]': rep,
                                             '["optim","state",0,"exp_avg"]': box},
                                 "replicas": {'["model","b"]': 0}}}
    skeleton, leaves = flatten(part, _leaf_hook)
    return [dict(name="dtensor_part", kind="state", hex=_json(skeleton).hex(), note=(
        "rank 1's part of 2 of a DTensor state: model.w Shard(0) (written), model.b Replicate "
        "owned by rank 0 (None), optim.state[0].exp_avg sharded as model.w, a plain step"),
        expected={"repr": _state_repr(part, leaves),
                  "metadata": {"model": state_repr(model._metadata)}, "leaves": len(leaves),
                  "section": part["ckptstore.shards"],
                  "paths": [["model", "w"], ["model", "b"], ["optim", "state", 0, "exp_avg"]],
                  "omitted": [["model", "b"]]})]


def _state_repr(value, leaves) -> str:
    """repr of the decoded state with each leaf shown as <leaf i> (how the test decodes it)."""
    index = {id(x): i for i, x in enumerate(leaves)}

    def sub(x):
        if isinstance(x, _Leaf):
            return _Shown(index[id(x)])
        if type(x) is OrderedDict:
            return OrderedDict((k, sub(v)) for k, v in x.items())
        if type(x) is dict:
            return {k: sub(v) for k, v in x.items()}
        if type(x) is list:
            return [sub(v) for v in x]
        if type(x) is tuple:
            return tuple(sub(v) for v in x)
        return x

    return state_repr(sub(value))


class _Shown:
    def __init__(self, i: int) -> None:
        self.i = i

    def __repr__(self) -> str:
        return f"<leaf {self.i}>"


class _Segment:
    """Segment 1 of store_header_v1's store, built record by record as the writer lays it out:
    ``out`` the bytes, ``records`` each record's offset/type/length, ``written`` the bytes
    appended after the segment header (a COMMIT's written_bytes counts them)."""

    def __init__(self) -> None:
        self.out = bytearray(rec.encode_record(rec.RecordType.SEGMENT_HEADER,
                                               encode_segment_header(SegmentHeader(1, 1, STORE_ID, 0))))
        self.records = [{"offset": 0, "type": "SEGMENT_HEADER", "length": 48}]
        self.written = 0

    def append(self, rtype, payload: bytes) -> tuple[int, int]:
        off = len(self.out)
        self.out.extend(rec.encode_record(rtype, payload))
        self.records.append({"offset": off, "type": rec.RecordType(rtype).name,
                             "length": len(payload)})
        self.written += rec.OVERHEAD + len(payload)
        return off, len(payload)


def segment_vectors() -> list[dict]:
    """A whole segment file holding one checkpoint, as ckptstore's writer lays it out, plus the
    same file with an uncommitted tail and with a damaged second commit."""
    import numpy as np

    chunk_size = 512
    w = np.arange(256, dtype="<f4")                 # 1024 bytes: two raw chunks
    z = np.zeros(300, dtype="<f4")                  # 1200 bytes: chunks of zeros, deduplicated
    small = np.array([1, 2, 3], dtype="<i8")        # 24 bytes: inline
    seg = _Segment()
    out, records, append = seg.out, seg.records, seg.append

    seen: set[bytes] = set()
    codecs: list[str] = []
    entries, roots = [], []
    for name, arr in (("w", w), ("z", z)):
        raw = arr.tobytes()
        addrs = []
        for s in range(0, len(raw), chunk_size):
            piece = raw[s:s + chunk_size]
            a = address_of(piece)
            addrs.append(a)
            if a in seen:
                continue
            seen.add(a)
            codec, data = choose_encoding(memoryview(piece))   # the writer's policy
            codecs.append(f"{name}[{s}:{s + len(piece)}] {codec.name.lower()}")
            append(rec.RecordType.CHUNK, encode_chunk_header(a, codec, len(piece)) + bytes(data))
        tree = make_tree(len(raw), chunk_size, addrs)
        append(rec.RecordType.TREE, encode_tree(tree))
        entries.append(TensorEntry(name, "numpy", "<f4", arr.shape, len(raw), tree.root))
        roots.append((name, tree.root))
    sb = small.tobytes()
    sroot = tree_root(len(sb), chunk_size, [address_of(sb)])
    entries.append(TensorEntry("small", "numpy", "<i8", small.shape, len(sb), sroot, sb))
    roots.append(("small", sroot))
    skeleton, _ = flatten({"w": _Leaf(), "z": _Leaf(), "small": _Leaf(), "step": 7}, _leaf_hook)
    meta, _ = flatten({"note": "vector"}, _leaf_hook)
    manifest = encode_manifest(Manifest(7, CREATED_NS, chunk_size, skeleton, meta, tuple(entries)))
    moff, mlen = append(rec.RecordType.MANIFEST, manifest)
    logical = sum(e.nbytes for e in entries)
    commit = Commit(7, 1, moff, mlen, xxhash.xxh3_128_digest(manifest), snapshot_root(roots),
                    CREATED_NS, logical, seg.written + rec.OVERHEAD + 96, 0)
    append(rec.RecordType.COMMIT, encode_commit(commit))
    committed = bytes(out)
    records_committed = list(records)

    # A torn tail: the next save's first chunk, cut in the middle of its payload.
    nxt = np.full(128, 9, dtype="<f4").tobytes()
    torn = rec.encode_record(rec.RecordType.CHUNK,
                             encode_chunk_header(address_of(nxt), Codec.RAW, len(nxt)) + nxt)
    with_tail = committed + torn[:300]

    # A second checkpoint whose commit record is damaged (one payload bit flipped).
    out2 = bytearray(committed)
    man2 = encode_manifest(Manifest(8, CREATED_NS + 1, chunk_size, {"T": 0}, None, (entries[2],)))
    m2off = len(out2)
    out2 += rec.encode_record(rec.RecordType.MANIFEST, man2)
    c2 = Commit(8, 1, m2off, len(man2), xxhash.xxh3_128_digest(man2),
                snapshot_root([("small", sroot)]), CREATED_NS + 1, len(sb),
                2 * rec.OVERHEAD + len(man2) + 96, 0)
    c2off = len(out2)
    out2 += rec.encode_record(rec.RecordType.COMMIT, encode_commit(c2))
    damaged = flip(bytes(out2), c2off + rec.HEADER_SIZE)          # iteration 8 -> 9

    load = {"w": {"dtype": "<f4", "shape": [256], "bytes": w.tobytes().hex()},
            "z": {"dtype": "<f4", "shape": [300], "bytes": z.tobytes().hex()},
            "small": {"dtype": "<i8", "shape": [3], "bytes": sb.hex()}, "step": 7}
    return [
        dict(name="segment_one_checkpoint", kind="segment", hex=committed.hex(), note=(
            "segment 1 of store_header_v1's store, laid out as the writer does with 512-byte "
            "chunks: CHUNK records " + ", ".join(codecs) + " (z's second chunk equals its first "
            "and is not written again), the TREEs of w and z, the MANIFEST (small is inline), "
            "the COMMIT of iteration 7"),
             expected={"records": records_committed, "iterations": [7], "tail_bytes": 0,
                       "commit": _commit_fields(commit), "load": load}),
        dict(name="segment_torn_tail", kind="segment", hex=with_tail.hex(),
             note="segment_one_checkpoint + 300 bytes of a torn CHUNK record: an uncommitted "
                  "tail that readers ignore and a writer truncates",
             expected={"records": records_committed, "iterations": [7], "tail_bytes": 300,
                       "tail_suspicious": False, "commit": _commit_fields(commit), "load": load}),
        dict(name="segment_damaged_commit", kind="segment", hex=damaged.hex(),
             note="segment_one_checkpoint + a manifest and a COMMIT for iteration 8 with one "
                  "payload bit flipped: iteration 8 is not committed; the tail is suspicious "
                  "(a writer quarantines it before truncating)",
             expected={"records": records_committed + [
                 {"offset": m2off, "type": "MANIFEST", "length": len(man2)},
                 {"offset": c2off, "type": "COMMIT", "length": 96}],
                 "iterations": [7], "tail_bytes": len(damaged) - len(committed),
                 "tail_suspicious": True, "commit": _commit_fields(commit), "load": load}),
    ]


def _commit_tensor_g(seg: "_Segment", g: Any, chunk_size: int, addrs: list[bytes],
                     iteration: int) -> Commit:
    """Append the TREE of ``g`` (its chunks' ``addrs`` at ``chunk_size``, already in ``seg``),
    the MANIFEST of ``{"g": g, "i": iteration}`` and its COMMIT; returns the commit."""
    raw = g.tobytes()
    tree = make_tree(len(raw), chunk_size, addrs)
    seg.append(rec.RecordType.TREE, encode_tree(tree))
    entries = (TensorEntry("g", "numpy", "<f4", g.shape, len(raw), tree.root),)
    skeleton, _ = flatten({"g": _Leaf(), "i": iteration}, _leaf_hook)
    manifest = encode_manifest(Manifest(iteration, CREATED_NS, chunk_size, skeleton, None, entries))
    moff, mlen = seg.append(rec.RecordType.MANIFEST, manifest)
    commit = Commit(iteration, 1, moff, mlen, xxhash.xxh3_128_digest(manifest),
                    snapshot_root([("g", tree.root)]), CREATED_NS, len(raw),
                    seg.written + rec.OVERHEAD + 96, 0)
    seg.append(rec.RecordType.COMMIT, encode_commit(commit))
    return commit


def chunk_image_vectors() -> list[dict]:
    """A segment whose checkpoint was written from a chunk image (format.md section 8, "Chunk
    images" and "Alignment padding"): pad records, block-aligned CHUNK records of a stride."""
    import numpy as np

    from ckptstore.format.image import BLOCK, ChunkImage, pad_payload, pad_size, seal_chunk, seal_pad

    g = (np.arange(2500, dtype="<f4") * 0.5 - 7).astype("<f4")  # 10000 bytes: two records
    geo = ChunkImage(g.nbytes, ChunkImage.stride_for(8000))       # stride 8192, chunk_size 8128
    seg = _Segment()
    out, records, append = seg.out, seg.records, seg.append
    append(rec.RecordType.CHUNK, pad_payload(pad_size(len(out))))
    image = bytearray(geo.size)
    buf = memoryview(image)
    raw = g.tobytes()
    addrs = []
    base = len(out)
    assert base % BLOCK == 0
    for j in range(geo.n_chunks):
        n = geo.data_length(j)
        start = geo.data_offset(j)
        buf[start:start + n] = raw[j * geo.chunk_size:j * geo.chunk_size + n]
        addrs.append(address_of(raw[j * geo.chunk_size:j * geo.chunk_size + n]))
        seal_chunk(buf, j * geo.stride, addrs[-1], n, False)  # beside store_header_v1: flags 0
        records.append({"offset": base + j * geo.stride, "type": "CHUNK", "length": 32 + n})
    seal_pad(buf, geo.records_end, geo.pad, False)
    records.append({"offset": base + geo.records_end, "type": "CHUNK",
                    "length": geo.pad - rec.OVERHEAD})
    out += image
    seg.written += geo.size

    commit = _commit_tensor_g(seg, g, geo.chunk_size, addrs, 3)
    return [dict(name="segment_chunk_image", kind="segment", hex=bytes(out).hex(), note=(
        "segment 1 of store_header_v1's store written from a chunk image (stride 8192, manifest "
        "chunk_size 8128): a pad record moves the log's end from 80 to 4096, the CHUNK records "
        "of g start at 4096 and 12288 (data at +56), a pad record ends the image at 16384, then "
        "the TREE, MANIFEST and COMMIT of iteration 3"),
        expected={"records": records, "iterations": [3], "tail_bytes": 0,
                  "commit": _commit_fields(commit),
                  "load": {"g": {"dtype": "<f4", "shape": [2500], "bytes": raw.hex()}, "i": 3}})]


def lent_record_vectors() -> list[dict]:
    """A segment whose checkpoint was written from a lent tensor's memory (format.md section 8,
    "Lent records"): each record placed by a pad record so that its data's first block boundary
    in memory (here at memory address 4096 * 9 + 100, so 3996 bytes in) falls on a block
    boundary in the log; a chunk too small for a block of its own lies whole in a gap."""
    import numpy as np

    from ckptstore.format.image import BLOCK, LentFramer, pad_payload, pad_size

    g = (np.arange(2500, dtype="<f4") * 0.25 + 3).astype("<f4")  # 10000 bytes: chunks of 9000
    raw = g.tobytes()
    chunk = 9000
    seg = _Segment()
    out, records, append = seg.out, seg.records, seg.append
    append(rec.RecordType.CHUNK, pad_payload(pad_size(len(out))))
    base = len(out)
    assert base % BLOCK == 0
    framer = LentFramer(False)  # beside store_header_v1: flags 0
    addrs, at = [], []
    for start in range(0, len(raw), chunk):
        piece = memoryview(raw)[start:start + chunk]
        addrs.append(address_of(piece))
        at.append(framer.add(piece, 4096 * 9 + 100 + start, addrs[-1]))
    written = b"".join(bytes(b) for b in framer.buffers())
    off = 0
    while off < len(written):  # every record of the written bytes, pads included
        header, _ = rec.decode_record(written[off:])
        records.append({"offset": base + off, "type": "CHUNK", "length": header.length})
        off += header.total_size
    out += written
    seg.written += len(written)
    assert [r["offset"] - base for r in records if r["length"] in (32 + 9000, 32 + 1000)] == at

    commit = _commit_tensor_g(seg, g, chunk, addrs, 4)
    return [dict(name="segment_lent_records", kind="segment", hex=bytes(out).hex(), note=(
        "segment 1 of store_header_v1's store written from a lent tensor's memory (chunk_size "
        "9000, the data at memory address 36964): a pad record moves the log's end from 80 to "
        "4096; a pad record of 4140 bytes (44 would be shorter than a record: 44 + 4096) "
        "places the first CHUNK record at 8236 so that its data's byte 3996 (memory address "
        "40960) lies at 12288; the second chunk (1000 bytes) "
        "follows whole, then a pad record to a block boundary; then the TREE, MANIFEST and "
        "COMMIT of iteration 4"),
        expected={"records": records, "iterations": [4], "tail_bytes": 0,
                  "commit": _commit_fields(commit),
                  "load": {"g": {"dtype": "<f4", "shape": [2500], "bytes": raw.hex()}, "i": 4}})]


def build() -> dict:
    vectors = (store_header_vectors() + record_vectors() + segment_header_vectors()
               + chunk_vectors() + tree_vectors() + snapshot_vectors() + commit_vectors()
               + manifest_vectors() + state_vectors() + segment_vectors() + chunk_image_vectors()
               + lent_record_vectors()
               + job_vectors() + sharded_part_vectors() + dtensor_part_vectors())
    names = [v["name"] for v in vectors]
    assert len(names) == len(set(names)), "duplicate vector names"
    return {
        "format_version": 1,
        "generator": "format-spec/make_vectors.py",
        "fixed_inputs": {"store_id": STORE_ID.hex(), "created_ns": CREATED_NS},
        "vectors": vectors,
    }


# ---- DCP checkpoints (format-spec/dcp.md): vectors/dcp.json -------------------------------------
def _dcp_entry(size, chunks, dtype="float32") -> dict:
    return {"type": "tensor", "dtype": dtype, "size": list(size), "layout": "strided",
            "requires_grad": False, "pin_memory": False, "memory_format": "contiguous_format",
            "chunks": [[list(o), list(n)] for o, n in chunks]}


def _dcp_head(entries, storage) -> dict:
    return {"format": "ckptstore.dcp", "version": 1, "metadata": {
        "version": "1.0.0", "state_dict_metadata": entries, "planner_data": None,
        "storage_meta": None, "storage": storage}}


def dcp_vectors() -> list[dict]:
    """The ``dcp`` head of a coordinator's state (dcp.md §1-§3), as its state skeleton is
    serialised in a manifest; ``world_size``: the iteration's. ``expected``: per tensor its
    dtype, global shape and shards in offset order (offsets, sizes, rank, store key), per value
    its rank and key; ``error`` and ``box``: the error a reader raises for the tensor ``fqn``
    and the box it names (offsets, sizes)."""
    def vec(name, world, head, note, expected=None, error=None, fqn=None, box=None):
        skeleton, leaves = flatten(head, _leaf_hook)
        assert not leaves
        v = dict(name=name, kind="dcp_head", world_size=world, hex=_json(skeleton).hex(), note=note)
        if error is None:
            v["expected"] = expected
        else:
            v.update(error=error, fqn=fqn, box=box)
        return v

    # two ranks: w Shard(0), c Shard(1), r replicated (stored once, by rank 1), a value
    w = [((0, 0), (3, 8)), ((3, 0), (3, 8))]
    c = [((0, 0), (4, 5)), ((0, 5), (4, 5))]
    two = [["w", _dcp_entry((6, 8), w)], ["c", _dcp_entry((4, 10), c, "bfloat16")],
           ["r", _dcp_entry((5, 3), [((0, 0), (5, 3))])], ["step", {"type": "bytes"}]]
    two_rows = [["w", [0, 0], "w", 0], ["w", [3, 0], "w@3,0", 1], ["c", [0, 0], "c", 0],
                ["c", [0, 5], "c@0,5", 1], ["r", [0, 0], "r", 1], ["step", None, "step", 0]]
    # four ranks, a (2, 2) mesh with placements (Shard(0), Shard(1)): one quadrant each
    quads = [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3))]
    four = [["g", _dcp_entry((4, 6), quads)]]
    four_rows = [["g", list(o), "g" if o == (0, 0) else f"g@{o[0]},{o[1]}", r]
                 for r, (o, _) in enumerate(quads)]
    return [
        vec("dcp_sharded_two_ranks", 2, _dcp_head(two, two_rows),
            "Shard(0), Shard(1) (bfloat16), a replicated tensor stored once and a value",
            expected={"tensors": [
                ["w", "float32", [6, 8], [[[0, 0], [3, 8], 0, "w"], [[3, 0], [3, 8], 1, "w@3,0"]]],
                ["c", "bfloat16", [4, 10], [[[0, 0], [4, 5], 0, "c"], [[0, 5], [4, 5], 1, "c@0,5"]]],
                ["r", "float32", [5, 3], [[[0, 0], [5, 3], 1, "r"]]]],
                "values": [["step", 0, "step"]]}),
        vec("dcp_sharded_2d_four_ranks", 4, _dcp_head(four, four_rows),
            "a 2-D placement over a (2, 2) mesh: one quadrant per rank",
            expected={"tensors": [["g", "float32", [4, 6], [
                [[0, 0], [2, 3], 0, "g"], [[0, 3], [2, 3], 1, "g@0,3"],
                [[2, 0], [2, 3], 2, "g@2,0"], [[2, 3], [2, 3], 3, "g@2,3"]]]], "values": []}),
        vec("dcp_gap_missing_rank_shard", 2, _dcp_head(two, [r for r in two_rows if r[2] != "w@3,0"]),
            "rank 1's shard of w is in no storage row: the gap is rows 3-5",
            error="ShardCoverageError", fqn="w", box=[[3, 0], [3, 8]]),
        vec("dcp_gap_2d_quadrant", 4, _dcp_head([["g", _dcp_entry((4, 6), quads[:3])]],
                                                four_rows[:3]),
            "the bottom-right quadrant is missing from the metadata",
            error="ShardCoverageError", fqn="g", box=[[2, 3], [2, 3]]),
        vec("dcp_overlap", 2, _dcp_head([["w", _dcp_entry((6, 8), [((0, 0), (4, 8)), ((3, 0), (3, 8))])]],
                                        two_rows[:2]),
            "rank 0's shard claims rows 0-3, rank 1's rows 3-5: row 3 twice",
            error="ShardCoverageError", fqn="w", box=[[3, 0], [1, 8]]),
        vec("dcp_rank_beyond_world", 2, _dcp_head(two, two_rows[:-1] + [["step", None, "step", 2]]),
            "a storage row names rank 2 of a 2-rank iteration", error="DCPError"),
        vec("dcp_chunk_outside_tensor", 2,
            _dcp_head([["w", _dcp_entry((6, 8), [((0, 0), (3, 8)), ((4, 0), (3, 8))])]], two_rows[:2]),
            "a shard reaches row 7 of a 6-row tensor", error="DCPError"),
    ]


def build_dcp() -> dict:
    vectors = dcp_vectors()
    names = [v["name"] for v in vectors]
    assert len(names) == len(set(names)), "duplicate vector names"
    return {"layout_version": 1, "generator": "format-spec/make_vectors.py",
            "spec": "format-spec/dcp.md", "vectors": vectors}


OUT_DCP = os.path.join(os.path.dirname(OUT), "dcp.json")


def render(doc: dict) -> str:
    return json.dumps(doc, indent=1, ensure_ascii=True) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed file only")
    args = ap.parse_args()
    outputs = [(OUT, build()), (OUT_DCP, build_dcp())]
    if args.check:
        rc = 0
        for out, doc in outputs:
            name = os.path.basename(out)
            try:
                with open(out, encoding="ascii") as f:
                    same = f.read() == render(doc)
            except FileNotFoundError:
                same = False
            print(f"{name} is up to date" if same else f"{name} differs from the generator")
            rc |= 0 if same else 1
        return rc
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    for out, doc in outputs:
        with open(out, "w", encoding="ascii") as f:
            f.write(render(doc))
        print(f"wrote {len(doc['vectors'])} vectors to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
