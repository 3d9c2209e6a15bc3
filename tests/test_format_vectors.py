"""The committed test vectors of format-spec/ against the codecs.

Every vector in ``format-spec/vectors/vectors.json`` is decoded with the ``ckptstore.format``
functions: positive vectors must decode to their expected fields and re-encode to exactly the same
bytes; negative vectors must raise exactly the named error class. The hex is read from the
committed file and never regenerated here, so a change of the on-disk format fails this test.
"""

from __future__ import annotations

import json
import os
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

import ckptstore
from ckptstore import errors
from ckptstore.format import records as rec
from ckptstore.format.chunk import CHUNK_HEADER_SIZE, Codec, address_of, decode_chunk, encode_chunk_header
from ckptstore.format.commit import Commit, decode_commit, encode_commit
from ckptstore.format.header import (SegmentHeader, StoreHeader, decode_segment_header,
                                     decode_store_header, encode_segment_header, encode_store_header)
from ckptstore.format.job import (JOB_FORMAT_VERSION, JOB_TYPES, Epoch, GlobalCommit, RankCommit,
                                  decode_epoch, decode_global_commit, encode_epoch,
                                  encode_global_commit)
from ckptstore.format.manifest import Manifest, TensorEntry, decode_manifest, encode_manifest
from ckptstore.format.state import flatten, unflatten
from ckptstore.format.tree import decode_tree, encode_tree, make_tree, snapshot_root

SPEC = Path(__file__).resolve().parent.parent / "format-spec"
sys.path.insert(0, str(SPEC))
from state_repr import state_repr  # noqa: E402  (the vectors' repr text on any Python)
DOC = json.loads((SPEC / "vectors" / "vectors.json").read_text(encoding="ascii"))
VECTORS = DOC["vectors"]
BY_NAME = {v["name"]: v for v in VECTORS}


def _bytes(v: dict) -> bytes:
    return bytes.fromhex(v["hex"])


def _json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


class _Leaf:
    """An array leaf in a state vector; shown as ``<leaf i>``."""

    def __init__(self, i: int) -> None:
        self.i = i

    def __repr__(self) -> str:
        return f"<leaf {self.i}>"


# ---- decoders: bytes -> comparable fields -------------------------------------------------------
def _decode_store_header(buf: bytes) -> dict:
    h = decode_store_header(buf)
    return {"format_version": h.format_version, "store_id": h.store_id.hex(),
            "chunk_size": h.chunk_size, "segment_size": h.segment_size, "created_ns": h.created_ns,
            "flags": h.flags}


def _decode_record(buf: bytes) -> dict:
    header, payload = rec.decode_record(buf)
    assert header.total_size == len(buf), "a record vector is exactly one record"
    return {"type": header.type, "type_name": rec.RecordType(header.type).name,
            "length": header.length, "payload": bytes(payload).hex(), "flags": header.flags}


def _decode_segment_header(buf: bytes) -> dict:
    h = decode_segment_header(buf)
    return {"format_version": h.format_version, "seq": h.seq, "store_id": h.store_id.hex(),
            "supersedes": h.supersedes}


def _decode_chunk(buf: bytes) -> dict:
    header, raw = decode_chunk(buf)
    return {"address": header.address.hex(), "codec": int(header.codec),
            "raw_length": header.raw_length, "data": buf[CHUNK_HEADER_SIZE:].hex(),
            "raw": bytes(raw).hex()}


def _decode_tree(buf: bytes) -> dict:
    t = decode_tree(buf)
    return {"root": t.root.hex(), "nbytes": t.nbytes, "chunk_size": t.chunk_size,
            "addresses": [a.hex() for a in t.addresses]}


def _commit_fields(c: Commit) -> dict:
    return {"iteration": c.iteration, "manifest_seq": c.manifest_seq,
            "manifest_offset": c.manifest_offset, "manifest_length": c.manifest_length,
            "manifest_digest": c.manifest_digest.hex(), "snapshot_root": c.snapshot_root.hex(),
            "created_ns": c.created_ns, "logical_bytes": c.logical_bytes,
            "written_bytes": c.written_bytes, "kind": c.kind}


def _decode_commit(buf: bytes) -> dict:
    return _commit_fields(decode_commit(buf))


def _entry_fields(t: TensorEntry) -> dict:
    return {"path": t.path, "lib": t.lib, "dtype": t.dtype, "shape": list(t.shape),
            "nbytes": t.nbytes, "root": t.root.hex(),
            "inline": None if t.inline is None else t.inline.hex(), "param": t.param,
            "requires_grad": t.requires_grad}


def _decode_manifest(buf: bytes) -> dict:
    m = decode_manifest(buf)
    return {"iteration": m.iteration, "kind": m.kind, "created_ns": m.created_ns,
            "chunk_size": m.chunk_size, "state": m.state, "meta": m.meta,
            "tensors": [_entry_fields(t) for t in m.tensors], "extra": m.extra}


def _decode_state(buf: bytes):
    skeleton = json.loads(buf.decode("ascii"))
    return unflatten(skeleton, lambda i, path: _Leaf(i))


def _metadata_at(value, path: str):
    node = value
    for key in path.split("/"):
        node = node[key]
    return node._metadata


def _decode_job_store_header(buf: bytes) -> dict:
    h = decode_store_header(buf, (JOB_FORMAT_VERSION,))
    return {"format_version": h.format_version, "store_id": h.store_id.hex(),
            "chunk_size": h.chunk_size, "segment_size": h.segment_size, "created_ns": h.created_ns}


def _decode_epoch(buf: bytes) -> dict:
    e = decode_epoch(buf)
    return {"epoch": e.epoch, "world_size": e.world_size, "store_id": e.store_id.hex(),
            "adopted_epoch": e.adopted_epoch, "adopted_end": e.adopted_end,
            "created_ns": e.created_ns}


def _decode_global_commit(buf: bytes) -> dict:
    g = decode_global_commit(buf)
    return {"iteration": g.iteration, "epoch": g.epoch, "kind": g.kind, "created_ns": g.created_ns,
            "ranks": [{"commit_seq": r.commit_seq, "commit_offset": r.commit_offset,
                       "commit": _commit_fields(r.commit)} for r in g.ranks]}


def _decode_job_record(buf: bytes) -> dict:
    header, payload = rec.decode_record(buf, JOB_TYPES)
    return {"type": header.type, "length": header.length, "payload": bytes(payload).hex()}


DECODERS = {
    "job_store_header": _decode_job_store_header,
    "epoch": _decode_epoch,
    "global_commit": _decode_global_commit,
    "job_record": _decode_job_record,
    "store_header": _decode_store_header,
    "record": _decode_record,
    "segment_header": _decode_segment_header,
    "chunk": _decode_chunk,
    "tree": _decode_tree,
    "commit": _decode_commit,
    "manifest": _decode_manifest,
    "state": _decode_state,
}


# ---- encoders: expected fields -> bytes ----------------------------------------------------------
def _encode(v: dict) -> bytes:
    e, kind = v["expected"], v["kind"]
    if kind == "job_store_header":
        return encode_store_header(StoreHeader(e["format_version"], bytes.fromhex(e["store_id"]),
                                               e["chunk_size"], e["segment_size"], e["created_ns"]))
    if kind == "epoch":
        return encode_epoch(Epoch(e["epoch"], e["world_size"], bytes.fromhex(e["store_id"]),
                                  e["adopted_epoch"], e["adopted_end"], e["created_ns"]))
    if kind == "global_commit":
        return encode_global_commit(GlobalCommit(
            e["iteration"], e["epoch"], e["kind"],
            tuple(RankCommit(r["commit_seq"], r["commit_offset"], _commit_from(r["commit"]))
                  for r in e["ranks"]), e["created_ns"]))
    if kind == "job_record":
        return rec.encode_record(e["type"], bytes.fromhex(e["payload"]))
    if kind == "store_header":
        return encode_store_header(StoreHeader(e["format_version"], bytes.fromhex(e["store_id"]),
                                               e["chunk_size"], e["segment_size"], e["created_ns"],
                                               e["flags"]))
    if kind == "record":
        return rec.encode_record(e["type"], bytes.fromhex(e["payload"]), e["flags"])
    if kind == "segment_header":
        return encode_segment_header(SegmentHeader(e["format_version"], e["seq"],
                                                   bytes.fromhex(e["store_id"]), e["supersedes"]))
    if kind == "chunk":
        return encode_chunk_header(bytes.fromhex(e["address"]), Codec(e["codec"]),
                                   e["raw_length"]) + bytes.fromhex(e["data"])
    if kind == "tree":
        return encode_tree(make_tree(e["nbytes"], e["chunk_size"],
                                     [bytes.fromhex(a) for a in e["addresses"]]))
    if kind == "commit":
        return encode_commit(_commit_from(e))
    if kind == "manifest":
        tensors = tuple(TensorEntry(t["path"], t["lib"], t["dtype"], tuple(t["shape"]), t["nbytes"],
                                    bytes.fromhex(t["root"]),
                                    None if t["inline"] is None else bytes.fromhex(t["inline"]),
                                    t["param"], t["requires_grad"]) for t in e["tensors"])
        return encode_manifest(Manifest(e["iteration"], e["created_ns"], e["chunk_size"], e["state"],
                                        e["meta"], tensors, e["kind"], dict(e["extra"])))
    raise AssertionError(f"no encoder for kind {kind}")


def _commit_from(e: dict) -> Commit:
    return Commit(e["iteration"], e["manifest_seq"], e["manifest_offset"], e["manifest_length"],
                  bytes.fromhex(e["manifest_digest"]), bytes.fromhex(e["snapshot_root"]),
                  e["created_ns"], e["logical_bytes"], e["written_bytes"], e["kind"])


# ---- the tests ---------------------------------------------------------------------------------
def test_vector_file_shape():
    assert DOC["format_version"] == 1
    assert len(BY_NAME) == len(VECTORS), "vector names are unique"
    for v in VECTORS:
        assert v["kind"] in (*DECODERS, "snapshot_root", "segment"), v["name"]
        assert v["hex"] == v["hex"].lower() and len(v["hex"]) % 2 == 0, v["name"]
        assert ("expected" in v) != ("error" in v), f"{v['name']}: expected xor error"
        if "error" in v:
            cls = getattr(errors, v["error"], None)
            assert isinstance(cls, type) and issubclass(cls, errors.FormatError), v["name"]


def test_required_negative_vectors_present():
    """The corruption cases every decoder must have (STYLE: a corruption case per decoder)."""
    for name in ("store_header_bad_magic", "store_header_bad_check", "store_header_unknown_version",
                 "store_header_truncated", "record_bad_magic", "record_bad_header_check",
                 "record_bad_payload_check", "record_truncated_payload", "record_unknown_type",
                 "segment_header_unknown_version", "chunk_bad_address", "chunk_lz4_ratio_bound",
                 "tree_bad_root", "commit_unknown_kind", "manifest_unknown_version",
                 "state_unknown_tag", "job_store_header_v1_refused", "epoch_truncated",
                 "global_commit_rank_names_other_iteration", "global_commit_truncated",
                 "job_record_commit_type_refused"):
        assert name in BY_NAME, name
    kinds_with_errors = {v["kind"] for v in VECTORS if "error" in v}
    assert set(DECODERS) <= kinds_with_errors


POSITIVE = [v for v in VECTORS if "expected" in v and v["kind"] in DECODERS]
NEGATIVE = [v for v in VECTORS if "error" in v]


@pytest.mark.parametrize("v", [v for v in POSITIVE if v["kind"] != "state"], ids=lambda v: v["name"])
def test_positive_vector_decodes(v):
    got = DECODERS[v["kind"]](_bytes(v))
    want = {k: x for k, x in v["expected"].items() if k != "chunks"}  # chunks: tree inputs only
    assert got == want


@pytest.mark.parametrize("v", [v for v in POSITIVE if v["kind"] != "state"], ids=lambda v: v["name"])
def test_positive_vector_reencodes(v):
    assert _encode(v).hex() == v["hex"]


@pytest.mark.parametrize("v", NEGATIVE, ids=lambda v: v["name"])
def test_negative_vector_raises(v):
    with pytest.raises(errors.CkptStoreError) as info:
        DECODERS[v["kind"]](_bytes(v))
    assert type(info.value).__name__ == v["error"], f"{v['name']}: {info.value!r}"


def test_chunk_vectors_address_is_xxh3_128_of_raw():
    for v in POSITIVE:
        if v["kind"] == "chunk":
            e = v["expected"]
            raw = bytes.fromhex(e["raw"])
            assert address_of(raw).hex() == e["address"] and len(raw) == e["raw_length"]


def test_tree_vectors_list_their_chunks():
    for v in POSITIVE:
        if v["kind"] == "tree" and "chunks" in v["expected"]:
            e = v["expected"]
            chunks = [bytes.fromhex(c) for c in e["chunks"]]
            assert [address_of(c).hex() for c in chunks] == e["addresses"]
            assert sum(map(len, chunks)) == e["nbytes"]
            assert all(len(c) == e["chunk_size"] for c in chunks[:-1])


def test_snapshot_root_vectors():
    for v in VECTORS:
        if v["kind"] == "snapshot_root":
            pairs = [(p, bytes.fromhex(r)) for p, r in v["expected"]["input"]]
            assert snapshot_root(pairs).hex() == v["hex"]


@pytest.mark.parametrize("v", [v for v in POSITIVE if v["kind"] == "state"], ids=lambda v: v["name"])
def test_state_vector(v):
    buf = _bytes(v)
    value = _decode_state(buf)
    e = v["expected"]
    assert state_repr(value) == e["repr"]
    for path, meta_repr in e["metadata"].items():
        md = _metadata_at(value, path)
        assert type(md) is OrderedDict and state_repr(md) == meta_repr
    leaves: list[_Leaf] = []

    def hook(x, path):
        if isinstance(x, _Leaf):
            leaves.append(x)
            return x
        return None

    skeleton, found = flatten(value, hook)
    assert len(found) == e["leaves"]
    assert [leaf.i for leaf in found] == list(range(len(found))), "leaves numbered in order"
    assert _json(skeleton) == buf


def test_sharded_part_vector():
    """A sharded part (format-spec/deltas.md, "Sharded states"): its ``shards`` section, the
    replay groups and aliases cut to what it writes, what a reader completes from which ranks;
    and the writer's own cut (``localize``) of the whole state gives exactly these bytes."""
    pytest.importorskip("torch")
    from ckptstore.replay.shards import donors_needed, localize, omitted, shards_of

    v = BY_NAME["sharded_part_base"]
    e = v["expected"]
    part = _decode_state(_bytes(v))
    assert shards_of(part) == e["shards"]
    info = part["ckptstore.replay"]
    assert info["groups"] == e["replay_groups"] and info["aliases"] == e["replay_aliases"]
    assert omitted(part) == {k: int(o) for k, o in e["omitted"].items()}
    assert donors_needed(part) == e["donors"]
    assert list(part["model"]) == [k for k in e["shards"]["keys"] if k not in e["omitted"]]
    assert [len(g["params"]) for g in part["optimizer"]["param_groups"]] == \
        [len([n for n in g if n not in e["omitted"]]) for g in e["shards"]["groups"]]
    whole = _decode_state(bytes.fromhex(e["whole"]))
    sec = e["shards"]
    cut = localize(whole, sec["rank"], sec["world"],
                   {k: o for k, o in sec["replicas"].items() if k not in sec["aliases"]})
    cut["ckptstore.replay"]["shards"]["tensors"] = sec["tensors"]  # (boxes: from DTensors)
    skeleton, _ = flatten(cut, lambda x, path: x if isinstance(x, _Leaf) else None)
    assert _json(skeleton) == _bytes(v)


def test_dtensor_part_vector():
    """A part of a DTensor state (format-spec/format.md §22.8): its section, the paths its keys
    name (JSON lists: the integer key 0 stays an int), None where a replica's owner wrote it."""
    pytest.importorskip("torch")
    from ckptstore.multirank.dtensor_state import key_path, section_of
    from ckptstore.tensors.inplace import lookup

    e = BY_NAME["dtensor_part"]["expected"]
    part = _decode_state(_bytes(BY_NAME["dtensor_part"]))
    sec = section_of(part)
    assert sec == e["section"]
    assert [list(key_path(k)) for k in sec["tensors"]] == e["paths"]
    for p in e["paths"]:
        held = lookup(part, tuple(p))
        assert (held is None) == (p in e["omitted"]) and (held is None or isinstance(held, _Leaf))


def _walk(buf: bytes) -> tuple[list[dict], int]:
    """Records whose header is valid and whose extent fits, in order; and where that stops."""
    out, pos = [], 0
    while pos < len(buf):
        try:
            h = rec.decode_header(buf[pos:pos + rec.HEADER_SIZE])
        except errors.FormatError:
            break
        if pos + h.total_size > len(buf):
            break
        out.append({"offset": pos, "type": rec.RecordType(h.type).name, "length": h.length})
        pos += h.total_size
    return out, pos


@pytest.mark.parametrize("v", [v for v in VECTORS if v["kind"] == "segment"], ids=lambda v: v["name"])
def test_segment_vector(v, tmp_path):
    buf, e = _bytes(v), v["expected"]
    records, end = _walk(buf)
    assert records == e["records"]
    # bytes after the last whole record: the torn tail (a damaged commit is a whole record)
    assert len(buf) - end == (0 if e.get("tail_suspicious") else e["tail_bytes"])
    store = tmp_path / "store"
    (store / "segments").mkdir(parents=True)
    (store / "STORE").write_bytes(_bytes(BY_NAME["store_header_v1"]))
    (store / "segments" / "0000000001.seg").write_bytes(buf)
    with ckptstore.open(store, mode="r") as r:
        report = r.last_scan
        assert r.iterations() == e["iterations"]
        assert report.tail_bytes == e["tail_bytes"]
        assert report.tail_suspicious == e.get("tail_suspicious", False)
        entry = r.index.get_commit(e["iterations"][-1])
        assert _commit_fields(entry.commit) == e["commit"]
        state = r.load(e["iterations"][-1])
    assert list(state) == list(e["load"])
    for key, want in e["load"].items():
        got = state[key]
        if isinstance(want, dict):
            assert type(got) is np.ndarray and got.dtype.str == want["dtype"]
            assert list(got.shape) == want["shape"] and got.tobytes().hex() == want["bytes"]
        else:
            assert got == want
    assert sorted(os.listdir(store)) == ["STORE", "segments"], "a reader writes nothing"
    assert (store / "segments" / "0000000001.seg").read_bytes() == buf


@pytest.mark.parametrize("name", ["segment_torn_tail", "segment_damaged_commit"])
def test_segment_vector_writer_cuts_tail(name, tmp_path):
    """A writer truncates the tail; a suspicious one (a damaged COMMIT) is quarantined first."""
    v = BY_NAME[name]
    buf, e = _bytes(v), v["expected"]
    store = tmp_path / "store"
    (store / "segments").mkdir(parents=True)
    (store / "STORE").write_bytes(_bytes(BY_NAME["store_header_v1"]))
    (store / "segments" / "0000000001.seg").write_bytes(buf)
    with ckptstore.open(store, mode="a") as w:
        assert w.iterations() == e["iterations"]
    cut = len(buf) - e["tail_bytes"]
    assert (store / "segments" / "0000000001.seg").read_bytes() == buf[:cut]
    quarantined = sorted(os.listdir(store / "quarantine")) if (store / "quarantine").exists() else []
    if e["tail_suspicious"]:
        assert quarantined == [f"0000000001-{cut}.tail"]
        assert (store / "quarantine" / quarantined[0]).read_bytes() == buf[cut:]
    else:
        assert quarantined == []
