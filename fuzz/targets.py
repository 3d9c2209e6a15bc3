"""Fuzz targets: one pure ``check_<name>(data: bytes) -> None`` per decoder that reads store bytes.

Each check feeds ``data`` to a decoder and enforces the contract of format-spec/format.md for
untrusted input: the decoder either returns a value or raises a :class:`ckptstore.errors.
CkptStoreError`; any other exception is a finding (it propagates). Where a value comes back the
check also asserts properties (re-encoding gives the same bytes, decoded sizes are bounded by the
input's length, a canonical form is a fixpoint) and raises :class:`FuzzFinding` when one fails.

The checks are shared by the atheris harness (fuzz/run_target.py) and by pytest
(tests/test_fuzz_regressions.py, which replays fuzz/corpus/ and fuzz/regressions/ without atheris).

Input layout: the first byte is a control byte, the rest the body the decoder sees. Control bit 0
asks the check to *repair checksums* in the body before decoding (record header and payload
checks, STORE check, tree root, chunk address): random bytes practically never pass an xxh3 check,
so without this the fuzzer could not reach the field validation behind it.
"""

from __future__ import annotations

import copy
import json
import os
import re
import struct
import tempfile
from collections import OrderedDict
from typing import Any, Callable

import xxhash

from ckptstore.errors import CkptStoreError, DamagedCheckpointError, FormatError
from ckptstore.format import records as rec
from ckptstore.format.chunk import (CHUNK_HEADER_SIZE, MAX_CHUNK_SIZE, Codec, decode_chunk,
                                    encode_chunk_header)
from ckptstore.format.commit import decode_commit, encode_commit
from ckptstore.format.header import (STORE_HEADER_SIZE, decode_segment_header,
                                     decode_store_header, encode_segment_header,
                                     encode_store_header)
from ckptstore.format.manifest import decode_committed_manifest, decode_manifest, encode_manifest
from ckptstore.format.state import flatten, leaf_indices, top_level_items, unflatten
from ckptstore.format.tree import TREE_HEADER_SIZE, decode_tree, encode_tree, tree_root

#: Largest tensor the manifest check allocates (bounds memory; larger entries are checked unallocated).
_ALLOC_CAP = 1 << 20


class FuzzFinding(AssertionError):
    """A decoder returned a value that breaks a property of the format."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise FuzzFinding(msg)


def _split(data: bytes) -> tuple[bool, bytes]:
    if not data:
        return False, b""
    return bool(data[0] & 1), bytes(data[1:])


def _decodes(fn: Callable[[], Any]) -> tuple[bool, Any]:
    """Run a decoder: (True, value), or (False, None) when it raised a package error."""
    try:
        return True, fn()
    except CkptStoreError:
        return False, None


# ---- checksum repair (control bit 0) -------------------------------------------------------------

def _fix_record_at(buf: bytearray, pos: int) -> int | None:
    """Recompute the header check (and the payload check when the record fits) of the record that
    starts at ``pos``; return its end, or None when no header fits."""
    if pos + rec.HEADER_SIZE > len(buf):
        return None
    buf[pos + 16:pos + 24] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(buf[pos:pos + 16])))
    (length,) = struct.unpack_from("<Q", buf, pos + 8)
    end = pos + rec.HEADER_SIZE + length
    if end + rec.TRAILER_SIZE > len(buf):
        return None
    covered = end
    if buf[pos + 5] & rec.FRAMING_CHECK and length >= rec.FRAMED_BYTES:  # the chunk header only
        covered = pos + rec.HEADER_SIZE + rec.FRAMED_BYTES
    buf[end:end + 8] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(buf[pos + 24:covered])))
    return end + rec.TRAILER_SIZE


def _fix_records(body: bytes) -> bytes:
    """Repair the checks of a chain of records laid end to end from offset 0."""
    buf = bytearray(body)
    pos: int | None = 0
    while pos is not None and pos < len(buf):
        pos = _fix_record_at(buf, pos)
    return bytes(buf)


# ---- record framing -------------------------------------------------------------------------------

def check_records(data: bytes) -> None:
    """format/records.py: decode_header and decode_record."""
    fix, body = _split(data)
    if fix:
        body = _fix_records(body)
    ok, h = _decodes(lambda: rec.decode_header(body))
    if ok:
        _require(0 <= h.length <= rec.MAX_PAYLOAD and h.type in rec.KNOWN_TYPES, f"bad header {h}")
        _require(h.flags in (0, rec.FRAMING_CHECK) and
                 (h.flags == 0 or (h.type == rec.RecordType.CHUNK and h.length >= rec.FRAMED_BYTES)),
                 f"a record flag on {h}")
        _require(rec.encode_header(h.type, h.length, h.flags) == body[:rec.HEADER_SIZE],
                 "a decoded header does not re-encode to its bytes")
    ok2, got = _decodes(lambda: rec.decode_record(body))
    if ok2:
        h2, payload = got
        _require(ok and h2 == h, "decode_record accepted a header decode_header refused")
        _require(len(payload) == h2.length and h2.total_size <= len(body),
                 "record payload is not bounded by the input")
        _require(rec.encode_record(h2.type, bytes(payload), h2.flags) == body[:h2.total_size],
                 "a decoded record does not re-encode to its bytes")


# ---- segments -------------------------------------------------------------------------------------

_TMP: dict[str, str] = {}


def _tmpdir(name: str) -> str:
    if name not in _TMP:
        _TMP[name] = tempfile.mkdtemp(prefix=f"ckptstore-fuzz-{name}-")
    return _TMP[name]


def check_segment(data: bytes) -> None:
    """storage/segments.py: scan_segment (with verify) and read_segment_header on a file holding
    the body. The scan must tile the file exactly: every byte belongs to one record or one corrupt
    region, in order, and it terminates."""
    from ckptstore.storage.segments import (CorruptRegion, ScannedRecord, SegmentFile,
                                            read_segment_header, scan_segment)

    fix, body = _split(data)
    if fix:
        body = _fix_records(body)
    path = os.path.join(_tmpdir("segment"), "0000000001.seg")
    with open(path, "wb") as fh:
        fh.write(body)
    f = SegmentFile(path, 1)
    try:
        ok, h = _decodes(lambda: read_segment_header(f))
        if ok:
            _require(h.seq == 1 and h.supersedes < h.seq, f"bad segment header {h}")
        pos = 0
        items = 0
        for item in scan_segment(f, 0, verify=True):
            items += 1
            _require(items <= len(body) + 1, "scan does not terminate")
            if isinstance(item, ScannedRecord):
                _require(item.loc.offset == pos and pos < item.loc.end <= len(body),
                         f"record at {item.loc} does not follow offset {pos}")
                if item.payload is not None:
                    _require(len(item.payload) == item.loc.length, "payload length differs")
                    _require(item.error is None, "a read payload carries an error")
                    got = rec.decode_record(body[item.loc.offset:item.loc.end])[1]
                    _require(bytes(got) == item.payload, "scanned payload differs from the bytes")
                _require(item.error is None or isinstance(item.error, FormatError), "bad error")
                pos = item.loc.end
            else:
                _require(isinstance(item, CorruptRegion) and item.start == pos < item.end <= len(body),
                         f"corrupt region {item} does not follow offset {pos}")
                _require(isinstance(item.error, FormatError) and item.error.path == path,
                         "corrupt region error is not located")
                pos = item.end
        _require(pos == len(body), f"scan stopped at {pos} of {len(body)} bytes")
    finally:
        f.close()


# ---- STORE header and segment header ------------------------------------------------------------

def check_header(data: bytes) -> None:
    """format/header.py: decode_store_header and decode_segment_header on the same body."""
    fix, body = _split(data)
    if fix and len(body) == STORE_HEADER_SIZE:
        body = body[:56] + struct.pack("<Q", xxhash.xxh3_64_intdigest(body[:56]))
    ok, h = _decodes(lambda: decode_store_header(body))
    if ok:
        _require(encode_store_header(h) == body, "STORE header does not re-encode to its bytes")
    ok, s = _decodes(lambda: decode_segment_header(body))
    if ok:
        _require(encode_segment_header(s) == body, "segment header does not re-encode to its bytes")


# ---- commit, tree, chunk ----------------------------------------------------------------------------

def check_commit(data: bytes) -> None:
    """format/commit.py: decode_commit; a decoded commit re-encodes to the same 96 bytes."""
    _, body = _split(data)
    ok, c = _decodes(lambda: decode_commit(body))
    if ok:
        _require(encode_commit(c) == body, "commit does not re-encode to its bytes")


def check_tree(data: bytes) -> None:
    """format/tree.py: decode_tree; a decoded tree re-encodes to its bytes and its chunk list
    covers exactly nbytes."""
    fix, body = _split(data)
    if fix and len(body) >= TREE_HEADER_SIZE:
        nbytes, chunk_size = struct.unpack_from("<QQ", body, 16)
        addrs = [body[i:i + 16] for i in range(TREE_HEADER_SIZE, len(body) - 15, 16)]
        body = tree_root(nbytes, chunk_size, addrs) + body[16:]
    ok, t = _decodes(lambda: decode_tree(body))
    if ok:
        _require(encode_tree(t) == body, "tree does not re-encode to its bytes")
        spans = list(t.chunk_spans())
        _require(sum(e - s for s, e, _ in spans) == t.nbytes, "tree spans do not cover nbytes")


def check_chunk(data: bytes) -> None:
    """format/chunk.py: decode_chunk. The decoded size equals raw_length and is bounded by the
    input (raw: exactly the data; lz4: at most 255x + 64), so a length field cannot make the
    decoder allocate more than a bounded multiple of what it was given."""
    import lz4.block

    fix, body = _split(data)
    if fix and len(body) >= CHUNK_HEADER_SIZE:
        codec, raw_length = body[16], struct.unpack_from("<Q", body, 24)[0]
        raw: bytes | None = None
        if codec == Codec.RAW:
            raw = body[CHUNK_HEADER_SIZE:]
        elif codec == Codec.LZ4 and raw_length <= 255 * (len(body) - CHUNK_HEADER_SIZE) + 64:
            try:
                raw = lz4.block.decompress(body[CHUNK_HEADER_SIZE:], uncompressed_size=raw_length)
            except (lz4.block.LZ4BlockError, ValueError, MemoryError):
                raw = None
        if raw is not None:
            body = xxhash.xxh3_128_digest(raw) + body[16:]
    ok, got = _decodes(lambda: decode_chunk(body))
    if ok:
        h, raw = got
        n = len(body) - CHUNK_HEADER_SIZE
        _require(len(raw) == h.raw_length <= MAX_CHUNK_SIZE, "decoded size differs from raw_length")
        _require(len(raw) <= (n if h.codec is Codec.RAW else 255 * n + 64),
                 f"{n} bytes of chunk data decoded to {len(raw)} bytes")
        _require(xxhash.xxh3_128_digest(raw) == h.address, "chunk bytes do not match the address")
        if h.codec is Codec.RAW:
            _require(encode_chunk_header(h.address, h.codec, h.raw_length) == body[:CHUNK_HEADER_SIZE],
                     "chunk header does not re-encode to its bytes")


# ---- manifest ----------------------------------------------------------------------------------------

class _Leaf:
    """Stands in for an array leaf while checking the state encoding."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __eq__(self, other: object) -> bool:
        return type(other) is _Leaf and other.index == self.index

    def __hash__(self) -> int:
        return hash(self.index)


def _leaf_hook(x: Any, path: Any) -> Any:
    return x if type(x) is _Leaf else None


def check_manifest(data: bytes) -> None:
    """format/manifest.py: decode_manifest and decode_committed_manifest, then what a reader does
    with a decoded manifest before touching chunks: decode its state and meta skeletons, plan a
    partial load, and allocate its (small) tensors."""
    from ckptstore.tensors import allocate

    _, body = _split(data)
    ok, m = _decodes(lambda: decode_manifest(body))
    if not ok:
        return
    again = decode_manifest(encode_manifest(m))
    _require(again == m, "a decoded manifest does not survive encode + decode")
    digest = xxhash.xxh3_128_digest(body)
    _require(decode_committed_manifest(body, digest, m.iteration) == m, "committed decode differs")
    for it, dg in ((m.iteration + 1, digest), (m.iteration, bytes(16) if any(digest) else b"\1" * 16)):
        ok2, _ = _decodes(lambda: decode_committed_manifest(body, dg, it))
        _require(not ok2, "decode_committed_manifest accepted a wrong iteration or digest")
    for e in m.tensors:
        _require(e.inline is None or len(e.inline) == e.nbytes, "inline size differs from nbytes")
        if e.nbytes <= _ALLOC_CAP:
            ok3, got = _decodes(lambda: allocate(e))
            if ok3:
                _require(len(got[1]) == e.nbytes, "allocated view size differs from nbytes")
    _check_skeleton(m.state)
    _check_skeleton(m.meta)


# ---- state encoding ----------------------------------------------------------------------------------

def _same_value(a: Any, b: Any, where: str = "state") -> None:
    """Exact equality: same types, same float bits (NaN payloads included), same order."""
    _require(type(a) is type(b), f"{where}: {type(a).__name__} became {type(b).__name__}")
    if type(a) is float:
        _require(struct.pack("<d", a) == struct.pack("<d", b), f"{where}: float {a!r} became {b!r}")
    elif type(a) in (list, tuple):
        _require(len(a) == len(b), f"{where}: length {len(a)} became {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            _same_value(x, y, f"{where}[{i}]")
    elif type(a) in (dict, OrderedDict):
        _require(list(a) == list(b) and all(type(k) is type(j) for k, j in zip(a, b)),
                 f"{where}: keys {list(a)[:5]} became {list(b)[:5]}")
        for k in a:
            _same_value(a[k], b[k], f"{where}[{k!r}]")
        _require(hasattr(a, "_metadata") == hasattr(b, "_metadata"), f"{where}: _metadata lost")
        if hasattr(a, "_metadata"):
            _same_value(a._metadata, b._metadata, f"{where}._metadata")
    else:
        _require(a == b, f"{where}: {a!r} became {b!r}")


def _check_skeleton(node: Any) -> None:
    """Decode a skeleton (leaves as placeholders); a decoded value must re-encode, and the
    re-encoded skeleton must be a fixpoint that decodes to the same value."""
    leaf_indices(node)
    top_level_items(node)
    ok, value = _decodes(lambda: unflatten(node, lambda i, p: _Leaf(i)))
    if not ok:
        return
    skel, leaves = flatten(value, _leaf_hook)
    value2 = unflatten(skel, lambda i, p: leaves[i])
    _same_value(value, value2)
    skel2, _ = flatten(value2, _leaf_hook)
    _require(skel2 == skel, "the state encoding's canonical form is not a fixpoint")
    _require(json.loads(json.dumps(skel, allow_nan=False)) == skel, "skeleton is not JSON-safe")


def _reject_constant(name: str) -> Any:
    raise ValueError(name)


def _json(body: bytes) -> tuple[bool, Any]:
    try:
        return True, json.loads(body.decode("ascii"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False, None  # not JSON: the manifest decoder refuses it before the state decoder


def check_state(data: bytes) -> None:
    """format/state.py: unflatten (and the partial-load planners) on any JSON document."""
    _, body = _split(data)
    ok, node = _json(body)
    if ok:
        _check_skeleton(node)


class _Bytes:
    """Deterministic consumer of fuzz bytes (a minimal FuzzedDataProvider that needs no atheris)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out.ljust(n, b"\0")

    def byte(self) -> int:
        return self.take(1)[0]

    def left(self) -> bool:
        return self.pos < len(self.data)


def _gen_int(src: _Bytes) -> int:
    n = src.byte() % 20
    v = int.from_bytes(src.take(n), "little")
    return -v if src.byte() & 1 else v


def _gen_str(src: _Bytes) -> str:
    return src.take(src.byte() % 12).decode("utf-8", "surrogateescape")


def _gen_value(src: _Bytes, depth: int, leaves: list[_Leaf]) -> Any:
    kind = src.byte() % 14 if depth < 6 and src.left() else src.byte() % 8
    if kind == 0:
        return None
    if kind == 1:
        return bool(src.byte() & 1)
    if kind == 2:
        return _gen_int(src)
    if kind == 3:
        return struct.unpack("<d", src.take(8))[0]  # any bits: NaN payloads, -0.0, inf
    if kind == 4:
        return _gen_str(src)
    if kind == 5:
        return src.take(src.byte() % 10)
    if kind in (6, 7):
        leaves.append(_Leaf(len(leaves)))
        return leaves[-1]
    n = src.byte() % 5
    items = [_gen_value(src, depth + 1, leaves) for _ in range(n)]
    if kind in (8, 9):
        return items
    if kind == 10:
        return tuple(items)
    keys = [_gen_int(src) if src.byte() & 1 else _gen_str(src) for _ in items]
    if kind in (11, 12):
        return dict(zip(keys, items))
    od = OrderedDict(zip(keys, items))
    if src.byte() & 1:
        od._metadata = _gen_value(src, depth + 1, leaves)  # type: ignore[attr-defined]
    return od


def check_state_roundtrip(data: bytes) -> None:
    """Round trip of the state encoding for structured values built from the fuzz bytes: flatten,
    strict JSON (as in a manifest), unflatten gives back exactly the same value."""
    leaves: list[_Leaf] = []
    value = _gen_value(_Bytes(data), 0, leaves)
    skel, got_leaves = flatten(value, _leaf_hook)
    # (duplicate dict keys drop values, so not every generated leaf is in the value)
    _require(len({id(x) for x in got_leaves}) == len(got_leaves) and
             all(any(x is y for y in leaves) for x in got_leaves), "leaves not collected once each")
    text = json.dumps(skel, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    back = unflatten(json.loads(text, parse_constant=_reject_constant), lambda i, p: got_leaves[i])
    _same_value(value, back)


# ---- delta records and replay -------------------------------------------------------------------------

_DELTA: dict[str, Any] = {}


def delta_fixture() -> dict[str, Any]:
    """A tiny real Checkpointer chain (built once per process): the base state, the delta records
    of iterations 1 and 2, and the tensor pools that fuzzed skeletons index into."""
    if _DELTA:
        return _DELTA
    import numpy as np
    import torch

    import ckptstore
    from ckptstore.torch import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    path = os.path.join(_tmpdir("delta"), "store")
    with ckptstore.open(path, "a") as store:
        ck = Checkpointer(store, model, opt, sched, policy="every-iteration", base_every=100,
                          fingerprint_every=1)
        ck.save_base(0)
        for it in (1, 2):
            model(torch.randn(5, 4)).square().sum().backward()
            ck.step(it)
            opt.zero_grad()
        ck.flush()
        _DELTA["base"] = store.load(0)
        _DELTA["records"] = {it: store.load_record(it) for it in (1, 2)}
        _DELTA["expected"] = {it: store.load(it) for it in (1, 2)}
    odd = [torch.zeros(0), torch.ones(5, dtype=torch.int8), torch.ones(3, dtype=torch.float16),
           torch.tensor([7, -1], dtype=torch.int64), torch.ones(3, 4), torch.tensor(2.0)]
    for name in ("base", "delta"):
        src = _DELTA["base"] if name == "base" else _DELTA["records"][1]
        skel, leaves = flatten(src, lambda x, p: x if isinstance(x, (torch.Tensor, np.ndarray)) else None)
        _DELTA[f"{name}_skeleton"] = skel
        _DELTA[f"{name}_pool"] = leaves + odd
    return _DELTA


def _pool_leaf(pool: list[Any]) -> Callable[[int, Any], Any]:
    def leaf(i: int, path: Any) -> Any:
        if i >= len(pool):  # what the reader does for an index past the manifest's tensor list
            raise DamagedCheckpointError(f"tensor index {i} unknown")
        return copy.deepcopy(pool[i])
    return leaf


def _replay_engine(base: Any, iteration: int) -> Any:
    from ckptstore.replay.replayer import _StateReplayer

    return _StateReplayer(base, iteration)


def _fuzzed_state(data: bytes, pool: list[Any]) -> tuple[bool, Any]:
    """(True, state) for a fuzzed JSON skeleton over ``pool``'s tensors that decodes, else
    (False, None)."""
    _, body = _split(data)
    ok, node = _json(body)
    if not ok:
        return False, None
    return _decodes(lambda: unflatten(node, _pool_leaf(pool)))


def _real_base_engine(fx: dict[str, Any]) -> Any:
    """A replay engine on a copy of the fixture's real base (it must accept it)."""
    ok, eng = _decodes(lambda: _replay_engine(copy.deepcopy(fx["base"]), 0))
    _require(ok, "the engine refused the real base")
    return eng


def check_delta(data: bytes) -> None:
    """replay.py + gradcodecs.py + recovery.py: a delta record (any skeleton over the real
    record's tensors plus odd ones) applied by the replay engine to the real base, step by step
    and as the two steps of a tiled window after the real delta 1, either replays or raises a
    package error (DamagedCheckpointError, DeltaChainError, ReplayDivergenceError)."""
    fx = delta_fixture()
    ok, record = _fuzzed_state(data, fx["delta_pool"])
    if not ok:
        return
    eng = _real_base_engine(fx)
    if _decodes(lambda: eng.apply(1, record))[0]:
        _decodes(lambda: eng.current(clone=False))
    eng = _real_base_engine(fx)
    ok, _ = _decodes(lambda: eng.apply(1, copy.deepcopy(fx["records"][1])))
    _require(ok, "the engine refused the real delta 1")
    window = [(2, record), (3, copy.deepcopy(record))]
    if _decodes(lambda: eng.apply_window(window))[0]:
        _decodes(lambda: eng.current(clone=False))


def check_replay_base(data: bytes) -> None:
    """replay.py: a base snapshot state (any skeleton over the real base's tensors plus odd ones)
    given to the replay engine, then the real delta 1 applied: either replays or raises a package
    error."""
    fx = delta_fixture()
    ok, base = _fuzzed_state(data, fx["base_pool"])
    if not ok:
        return
    ok, eng = _decodes(lambda: _replay_engine(base, 0))
    if ok and _decodes(lambda: eng.apply(1, copy.deepcopy(fx["records"][1])))[0]:
        _decodes(lambda: eng.current(clone=False))


# ---- a whole (one-segment) store ------------------------------------------------------------------

def check_store_open(data: bytes) -> None:
    """log.py replay, reader, fsck: a store whose only segment holds the body (its STORE header
    takes the store id the body's segment header names, so the segment is not foreign). Opening,
    listing, loading every listed iteration and fsck either work or raise package errors."""
    import shutil

    import ckptstore
    from ckptstore.format.header import FORMAT_VERSION, StoreHeader
    from ckptstore.ops.fsck import check

    fix, body = _split(data)
    if fix:
        body = _fix_records(body)
    root = os.path.join(_tmpdir("store"), "s")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(os.path.join(root, "segments"))
    store_id = body[40:56].ljust(16, b"\0")
    with open(os.path.join(root, "STORE"), "wb") as fh:
        fh.write(encode_store_header(StoreHeader(FORMAT_VERSION, store_id, 1 << 16, 1 << 20, 0)))
    with open(os.path.join(root, "segments", "0000000001.seg"), "wb") as fh:
        fh.write(body)

    def read_all() -> None:
        with ckptstore.open(root, "r") as r:
            for it in r.iterations():
                _decodes(lambda: r.manifest(it))
                _decodes(lambda: r.load(it))

    _decodes(read_all)
    ok, report = _decodes(lambda: check(root))
    if ok:
        report.lines()
    _require(os.listdir(root) == ["STORE", "segments"] or sorted(os.listdir(root)) ==
             ["STORE", "segments"], f"a reader wrote into the store: {os.listdir(root)}")


#: name -> check; the names are the corpus and regression folder names.
# ---- a multi-rank job store's global log (format §22) -----------------------------------------

def check_global_log(data: bytes) -> None:
    """storage/job_log.py scan_epoch_log on a file holding the input (record checks repaired when
    the control byte's low bit is set, so mutations reach the payload decoders), and
    format/job.py decode_epoch / decode_global_commit on the raw body: decoded values re-encode
    to their bytes, and the scan's valid prefix lies inside the file and holds increasing
    iterations of one world size."""
    from ckptstore.format.job import (decode_epoch, decode_global_commit, encode_epoch,
                                      encode_global_commit)
    from ckptstore.storage.job_log import scan_epoch_log

    fix, body = _split(data)
    ok, e = _decodes(lambda: decode_epoch(body))
    if ok:
        _require(encode_epoch(e) == body, "epoch does not re-encode to its bytes")
    ok, g = _decodes(lambda: decode_global_commit(body))
    if ok:
        _require(encode_global_commit(g) == body, "global commit does not re-encode")
    if fix:
        body = _fix_records(body)
    path = os.path.join(_tmpdir("global_log"), "0000000002.log")
    with open(path, "wb") as f:
        f.write(body)
    scan = scan_epoch_log(path, 2, bytes.fromhex("00112233445566778899aabbccddeeff"))
    _require(0 <= scan.valid_end <= len(body), "valid prefix past the end of the file")
    its = [c.iteration for c, _ in scan.commits]
    _require(its == sorted(set(its)), "global commits out of order")
    _require(all(end <= scan.valid_end for _, end in scan.commits), "commit past the prefix")
    if scan.epoch is not None:
        _require(all(c.world_size == scan.epoch.world_size for c, _ in scan.commits),
                 "global commit of another world size")


# ---- a remote job store's job HEAD (format-spec/remote.md §8.1) -----------------------------------

def _reseal(body: bytes) -> bytes:
    """``body`` with its check line recomputed (the first line's xxh3-128), so a mutated job HEAD
    reaches the field checks behind the seal."""
    line = body.partition(b"\n")[0]
    return line + b"\nxxh3-128 " + xxhash.xxh3_128_digest(line).hex().encode() + b"\n"


def check_job_head(data: bytes) -> None:
    """remote/job_head.py decode_job_head on the input (its check line recomputed when the control
    byte's low bit is set), named with the generation its own JSON claims (1 when it claims none,
    so a mismatch is also fuzzed by bits 1-7 of the control byte): a decoded job HEAD re-encodes
    to bytes that decode to the same value, its cut is consistent (streams ascending, each log's
    extents consecutive from 0 and adding up to its length, the current epoch its newest log) and
    every object name derived from it is well formed."""
    from ckptstore.remote.job_head import (decode_job_head, encode_job_head, is_log_extent_name,
                                           job_head_generation, stream_of)

    fix, body = _split(data)
    if fix:
        body = _reseal(body)
    claimed = 1
    try:
        v = json.loads(body.partition(b"\n")[0])
        if isinstance(v, dict) and type(v.get("generation")) is int:
            claimed = v["generation"]
    except (ValueError, RecursionError):
        pass
    generation = claimed + (data[0] >> 1 if data else 0)
    ok, h = _decodes(lambda: decode_job_head(body, generation))
    if not ok:
        return
    _require(h.generation == generation and job_head_generation(h.name) == generation,
             "job HEAD name does not carry its generation")
    again = decode_job_head(encode_job_head(h), generation)
    _require(again == h and again.extra == h.extra, "job HEAD does not round-trip")
    keys = [(s.epoch, s.rank) for s in h.streams]
    _require(keys == sorted(set(keys)), "job HEAD streams out of order")
    _require([lg.epoch for lg in h.logs] == sorted({lg.epoch for lg in h.logs}),
             "job HEAD logs out of order")
    for lg in h.logs:
        at = 0
        for e in lg.extents:
            _require(e.seq == lg.epoch and e.offset == at and e.length > 0,
                     "job HEAD extents not consecutive")
            at = e.end
        _require(at == lg.length, "job HEAD extents do not add up to the log's length")
    _require(h.epoch == 0 or (h.logs[-1].epoch == h.epoch and h.logs[-1].length == h.end),
             "job HEAD's current epoch is not its newest log")
    _require(all(is_log_extent_name(n) or stream_of(n) is not None for n in h.objects()
                 if n != "STORE"), "job HEAD names a malformed object")
    for s in h.streams:
        _require(re.fullmatch(r"streams/\d{10}-\d{5}", s.prefix) is not None,
                 "job HEAD names a malformed stream prefix")


TARGETS: dict[str, Callable[[bytes], None]] = {
    "records": check_records,
    "segment": check_segment,
    "header": check_header,
    "commit": check_commit,
    "tree": check_tree,
    "chunk": check_chunk,
    "manifest": check_manifest,
    "state": check_state,
    "state_roundtrip": check_state_roundtrip,
    "delta": check_delta,
    "replay_base": check_replay_base,
    "store_open": check_store_open,
    "global_log": check_global_log,
    "job_head": check_job_head,
}
