"""Manifest records: what one checkpoint contains.

The manifest payload is one UTF-8 JSON object (strict JSON: no NaN literals; floats inside the state
use the state encoding's exact hex form)::

    {"v": 1,                      format version of the manifest
     "iteration": int >= 0,
     "kind": "snapshot" | "delta",
     "prev": int,                 delta only: the iteration this delta applies to (iteration - 1)
     "base": int,                 delta only: the base snapshot its chain starts from
                                  (format-spec/deltas.md)
     "created_ns": int,
     "chunk_size": int,           chunk size used for this checkpoint's trees
     "state": <skeleton>,         see format/state.py
     "meta": <skeleton>,          the user's meta, same encoding, no tensors
     "tensors": [<entry>, ...]}

A tensor entry::

    {"path": "model/fc.weight",   display path (data, never a file path)
     "lib": "torch" | "numpy",
     "dtype": "float32" (torch name) | "<f4" (numpy dtype.str),
     "shape": [int, ...],
     "nbytes": int,               == product(shape) * itemsize
     "root": hex32,               the tensor's Merkle root (format/tree.py)
     "inline": base64,            optional: the bytes themselves, for tensors <= INLINE_MAX bytes;
                                  otherwise a TREE record with this root holds the chunk list
     "param": true,               optional (torch): restore as torch.nn.Parameter
     "requires_grad": true}       optional (torch)
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ..errors import ChecksumMismatch, FormatError, UnsupportedVersionError
from .state import leaf_indices, renumber_leaves, top_level_items
from .tree import MAX_TENSOR_BYTES

MANIFEST_VERSION = 1
#: Tensors of at most this many bytes are stored inside the manifest instead of as chunks.
INLINE_MAX = 256
MAX_DIMS = 64
KINDS = ("snapshot", "delta")


@dataclass(frozen=True)
class TensorEntry:
    path: str
    lib: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    root: bytes
    inline: bytes | None = None
    param: bool = False
    requires_grad: bool = False

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "lib": self.lib, "dtype": self.dtype,
                             "shape": list(self.shape), "nbytes": self.nbytes, "root": self.root.hex()}
        if self.inline is not None:
            d["inline"] = base64.b64encode(self.inline).decode("ascii")
        if self.param:
            d["param"] = True
        if self.requires_grad:
            d["requires_grad"] = True
        return d


@dataclass(frozen=True)
class Manifest:
    iteration: int
    created_ns: int
    chunk_size: int
    state: Any
    meta: Any
    tensors: tuple[TensorEntry, ...]
    kind: str = "snapshot"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def logical_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def encode_manifest(m: Manifest) -> bytes:
    doc = {"v": MANIFEST_VERSION, "iteration": m.iteration, "kind": m.kind, "created_ns": m.created_ns,
           "chunk_size": m.chunk_size, "state": m.state, "meta": m.meta,
           "tensors": [t.to_json() for t in m.tensors]}
    for k, v in m.extra.items():
        if k not in doc:
            doc[k] = v
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def _req(d: dict, key: str, typ: type, where: str) -> Any:
    v = d.get(key)
    if type(v) is not typ:
        raise FormatError(f"{where}: field {key!r} missing or not {typ.__name__}")
    return v


def _decode_entry(e: Any, i: int) -> TensorEntry:
    where = f"manifest tensor {i}"
    if type(e) is not dict:
        raise FormatError(f"{where}: not an object")
    path = _req(e, "path", str, where)
    lib = _req(e, "lib", str, where)
    if lib not in ("torch", "numpy"):
        raise FormatError(f"{where} ({path}): unknown lib {lib!r}")
    dtype = _req(e, "dtype", str, where)
    shape = _req(e, "shape", list, where)
    if len(shape) > MAX_DIMS or any(type(s) is not int or s < 0 for s in shape):
        raise FormatError(f"{where} ({path}): invalid shape")
    nbytes = _req(e, "nbytes", int, where)
    if not 0 <= nbytes <= MAX_TENSOR_BYTES:
        raise FormatError(f"{where} ({path}): invalid nbytes {nbytes}")
    root_hex = _req(e, "root", str, where)
    try:
        root = bytes.fromhex(root_hex)
    except ValueError:
        root = b""
    if len(root) != 16:
        raise FormatError(f"{where} ({path}): invalid root")
    inline = None
    if "inline" in e:
        raw = _req(e, "inline", str, where)
        try:
            inline = base64.b64decode(raw.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError, ValueError):
            raise FormatError(f"{where} ({path}): invalid inline base64") from None
        if len(inline) != nbytes:
            raise FormatError(f"{where} ({path}): inline data is {len(inline)} bytes, nbytes {nbytes}")
    flags = {}
    for flag in ("param", "requires_grad"):
        v = e.get(flag, False)
        if type(v) is not bool:
            raise FormatError(f"{where} ({path}): {flag} is not a bool")
        flags[flag] = v
    return TensorEntry(path, lib, dtype, tuple(shape), nbytes, root, inline, **flags)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _finite_float(text: str) -> float:
    v = float(text)
    if v in (float("inf"), float("-inf")):
        raise ValueError(f"JSON number {text[:40]} overflows a float")
    return v


def decode_manifest(buf: bytes | memoryview) -> Manifest:
    """Decode and validate a manifest payload. Raises FormatError / UnsupportedVersionError."""
    try:
        doc = json.loads(bytes(buf).decode("ascii"), parse_constant=_reject_constant,
                         parse_float=_finite_float)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"manifest is not valid JSON: {str(e)[:80]}") from None
    if type(doc) is not dict:
        raise FormatError("manifest is not a JSON object")
    v = doc.get("v")
    if v != MANIFEST_VERSION or type(v) is not int:
        raise UnsupportedVersionError(f"manifest version {v!r} is not supported")
    iteration = _req(doc, "iteration", int, "manifest")
    if iteration < 0 or iteration >= 1 << 63:
        raise FormatError(f"manifest iteration {iteration} out of range")
    kind = _req(doc, "kind", str, "manifest")
    if kind not in KINDS:
        raise FormatError(f"manifest kind {kind!r} is not known")
    created = _req(doc, "created_ns", int, "manifest")
    chunk_size = _req(doc, "chunk_size", int, "manifest")
    if chunk_size <= 0:
        raise FormatError("manifest chunk_size must be positive")
    tensors = _req(doc, "tensors", list, "manifest")
    if "state" not in doc or "meta" not in doc:
        raise FormatError("manifest lacks state or meta")
    entries = tuple(_decode_entry(e, i) for i, e in enumerate(tensors))
    extra = {k: v for k, v in doc.items()
             if k not in ("v", "iteration", "kind", "created_ns", "chunk_size", "state", "meta",
                          "tensors")}
    if kind == "delta":
        prev = _req(doc, "prev", int, "delta manifest")
        base = _req(doc, "base", int, "delta manifest")
        if prev != iteration - 1 or not 0 <= base <= prev:
            raise FormatError(f"delta manifest of iteration {iteration}: prev {prev} / base {base} "
                              "do not form a chain (prev must be iteration - 1, base <= prev)")
    return Manifest(iteration, created, chunk_size, doc["state"], doc["meta"], entries, kind, extra)


def decode_committed_manifest(buf: bytes | memoryview, digest: bytes, iteration: int) -> Manifest:
    """Decode the manifest a commit names, checking the commit's digest and iteration (the
    "committed" rule of format-spec/format.md section 13)."""
    actual = xxhash.xxh3_128_digest(buf)
    if actual != digest:
        raise ChecksumMismatch("manifest digest", digest.hex(), actual.hex())
    m = decode_manifest(buf)
    if m.iteration != iteration:
        raise FormatError(f"manifest is for iteration {m.iteration}, its commit for {iteration}")
    return m


def part_manifest(m: Manifest, key: str) -> Manifest:
    """The manifest of the part of ``m``'s state under its top-level dict key ``key`` (one rank's
    part of a job store's follower base, format-spec/follower.md §7) as a snapshot of that part
    alone would hold it: the part's skeleton with its tensors renumbered in their order in ``m``
    (the order :func:`~.state.flatten` of the part gives), their entries with the display-path
    prefix ``key/`` removed (roots, chunks and trees unchanged); ``m``'s other fields. FormatError
    when the state is not a dict holding ``key``."""
    top = top_level_items(m.state)
    have = dict(top) if top is not None else {}
    if key not in have:
        raise FormatError(f"manifest of iteration {m.iteration}: the state has no part {key!r}")
    node = have[key]
    old = sorted(set(leaf_indices(node)))
    if old and old[-1] >= len(m.tensors):
        raise FormatError(f"manifest of iteration {m.iteration} names tensor {old[-1]} but lists "
                          f"{len(m.tensors)}")
    prefix = f"{key}/"
    tensors = tuple(dataclasses.replace(t, path=t.path[len(prefix):])
                    if t.path.startswith(prefix) else t for t in (m.tensors[i] for i in old))
    return Manifest(m.iteration, m.created_ns, m.chunk_size,
                    renumber_leaves(node, {i: n for n, i in enumerate(old)}), m.meta, tensors,
                    m.kind, dict(m.extra))
