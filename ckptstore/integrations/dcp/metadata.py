"""The head of a DCP iteration: the format marker, the checkpoint ids DCP passes (iterations), and
DCP's ``Metadata`` encoded in the store's own state encoding (nothing pickled; format-spec/dcp.md
§1). Pure functions, no I/O."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from ...errors import DCPError, UnsupportedTypeError
from ...format.state import Path, flatten, format_path
from ...tensors import TORCH_DTYPES

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


#: the marker of a DCP iteration (``state["dcp"]["format"]``) and its layout version
FORMAT = "ckptstore.dcp"
FORMAT_VERSION = 1

DTYPE_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in TORCH_DTYPES.items()}
_MEMORY_FORMATS: dict[str, torch.memory_format] = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve_format": torch.preserve_format,
}
_MEMORY_FORMAT_NAMES = {v: k for k, v in _MEMORY_FORMATS.items()}


def iteration_of(checkpoint_id: Any) -> int:
    """The iteration a DCP ``checkpoint_id`` names: a non-negative int, or a string of ASCII
    decimal digits. Raises DCPError for anything else."""
    if type(checkpoint_id) is int and 0 <= checkpoint_id < 1 << 63:
        return checkpoint_id
    if type(checkpoint_id) is str and checkpoint_id.isascii() and checkpoint_id.isdigit() \
            and len(checkpoint_id) <= 19 and int(checkpoint_id) < 1 << 63:
        return int(checkpoint_id)
    raise DCPError(f"checkpoint_id {checkpoint_id!r} is not an iteration: ckptstore.dcp takes an "
                   "int >= 0 or a string of decimal digits")


def valid_id(checkpoint_id: Any) -> bool:
    try:
        iteration_of(checkpoint_id)
    except DCPError:
        return False
    return True


# ---- the metadata, encoded in the store's state encoding ------------------------------------------

def plain_only(x: Any, path: Path) -> None:
    """flatten() hook for values that must hold no array: refuses tensors and arrays."""
    if isinstance(x, torch.Tensor) or type(x).__module__.split(".")[0] == "numpy":
        raise UnsupportedTypeError(f"a {type(x).__module__}.{type(x).__qualname__} at "
                                   f"{format_path(path)}")
    return None


def _dtype_name(dtype: Any, fqn: str) -> str:
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        raise UnsupportedTypeError(f"DCP key {fqn!r}: tensor dtype {dtype} is not supported")
    return name


def encode_metadata(md: Metadata) -> dict[str, Any]:
    """DCP's Metadata as a JSON-like structure of the state encoding (its storage_data must map
    MetadataIndex -> store key, or -> (rank, store key) for an item another rank's state holds).
    Raises UnsupportedTypeError for what the encoding cannot hold."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    entries: list[Any] = []
    for fqn, v in md.state_dict_metadata.items():
        if type(fqn) is not str:
            raise UnsupportedTypeError(f"DCP key {fqn!r} is not a str")
        if isinstance(v, BytesStorageMetadata):
            entries.append([fqn, {"type": "bytes"}])
        elif isinstance(v, TensorStorageMetadata):
            p = v.properties
            if p.layout != torch.strided:
                raise UnsupportedTypeError(f"DCP key {fqn!r}: layout {p.layout} is not supported")
            mf = _MEMORY_FORMAT_NAMES.get(p.memory_format)
            if mf is None:
                raise UnsupportedTypeError(f"DCP key {fqn!r}: memory format {p.memory_format} "
                                           "is not supported")
            entries.append([fqn, {
                "type": "tensor", "dtype": _dtype_name(p.dtype, fqn), "size": [int(n) for n in v.size],
                "layout": "strided", "requires_grad": bool(p.requires_grad), "memory_format": mf,
                "pin_memory": bool(p.pin_memory),
                "chunks": [[[int(n) for n in c.offsets], [int(n) for n in c.sizes]]
                           for c in v.chunks]}])
        else:
            raise UnsupportedTypeError(f"DCP key {fqn!r}: storage metadata of type "
                                       f"{type(v).__qualname__} is not supported")
    try:
        flatten(md.planner_data, plain_only)
    except UnsupportedTypeError as e:
        raise UnsupportedTypeError(f"DCP planner_data cannot be stored without pickling: {e}; "
                                   "ckptstore.dcp stores JSON-like planner data only") from e
    sm = md.storage_meta
    storage = []
    for index, where in (md.storage_data or {}).items():
        row: list[Any] = [index.fqn, None if index.offset is None else
                          [int(n) for n in index.offset]]
        if type(where) is str:      # the item is in this state's "items"
            row.append(where)
        else:                       # (rank, key): in that rank's state of the iteration
            rank, key = where
            row += [key, int(rank)]
        storage.append(row)
    return {
        "version": md.version,
        "state_dict_metadata": entries,
        "planner_data": md.planner_data,
        "storage_meta": None if sm is None else {
            "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
            "save_id": sm.save_id, "load_id": sm.load_id, "modules": list(sm.modules)},
        "storage": storage,
    }


class BadMetadata(Exception):
    """Stored DCP metadata that does not decode (the callers raise DCPError saying why)."""


def need(ok: bool, why: str) -> None:
    """Raise :class:`BadMetadata` (``why``) unless ``ok``."""
    if not ok:
        raise BadMetadata(why)


def _ints(x: Any, what: str, low: int = 0) -> list[int]:
    need(type(x) is list and all(type(n) is int and n >= low for n in x),
         f"{what} is not a list of ints >= {low}")
    return x


def _opt_str(x: Any, what: str) -> str | None:
    need(x is None or type(x) is str, f"{what} is not a string")
    return x


def decode_metadata(doc: Any) -> tuple[Metadata, dict[Any, tuple[int | None, str]]]:
    """Rebuild torch's Metadata from :func:`encode_metadata`'s structure. Returns it and its
    storage map (MetadataIndex -> (rank, store key); rank None: the state holding the metadata).
    Raises BadMetadata for anything malformed."""
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                       Metadata, MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)

    need(type(doc) is dict, "metadata is not a dict")
    entries = doc.get("state_dict_metadata")
    need(type(entries) is list, "state_dict_metadata is not a list")
    sdm: dict[str, Any] = {}
    for item in entries:
        need(type(item) is list and len(item) == 2 and type(item[0]) is str
             and type(item[1]) is dict, "a state_dict_metadata entry is malformed")
        fqn, v = item
        need(fqn not in sdm, f"key {fqn!r} appears twice")
        kind = v.get("type")
        if kind == "bytes":
            sdm[fqn] = BytesStorageMetadata()
            continue
        need(kind == "tensor", f"key {fqn!r}: unknown entry type {kind!r}")
        dtype = TORCH_DTYPES.get(v.get("dtype")) if type(v.get("dtype")) is str else None
        if dtype is None:
            raise BadMetadata(f"key {fqn!r}: unknown dtype {v.get('dtype')!r}")
        need(v.get("layout") == "strided", f"key {fqn!r}: unknown layout {v.get('layout')!r}")
        mf = _MEMORY_FORMATS.get(v.get("memory_format")) if type(v.get("memory_format")) is str \
            else None
        if mf is None:
            raise BadMetadata(f"key {fqn!r}: unknown memory format {v.get('memory_format')!r}")
        need(type(v.get("requires_grad")) is bool and type(v.get("pin_memory")) is bool,
             f"key {fqn!r}: requires_grad/pin_memory are not booleans")
        size = _ints(v.get("size"), f"key {fqn!r}: size")
        chunks = v.get("chunks")
        need(type(chunks) is list, f"key {fqn!r}: chunks is not a list")
        cs = []
        for c in chunks:
            need(type(c) is list and len(c) == 2, f"key {fqn!r}: a chunk is malformed")
            offsets = _ints(c[0], f"key {fqn!r}: chunk offsets")
            sizes = _ints(c[1], f"key {fqn!r}: chunk sizes")
            need(len(offsets) == len(sizes) == len(size) and
                 all(o + n <= d for o, n, d in zip(offsets, sizes, size)),
                 f"key {fqn!r}: a chunk lies outside the tensor")
            cs.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        props = TensorProperties(dtype=dtype, layout=torch.strided,
                                 requires_grad=v["requires_grad"], memory_format=mf,
                                 pin_memory=v["pin_memory"])
        sdm[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=cs)
    sm_doc = doc.get("storage_meta")
    sm: StorageMeta | None = None
    if sm_doc is not None:
        need(type(sm_doc) is dict, "storage_meta is not a dict")
        modules = sm_doc.get("modules", [])
        need(type(modules) is list and all(type(m) is str for m in modules),
             "storage_meta.modules is not a list of strings")
        sm = StorageMeta(checkpoint_id=_opt_str(sm_doc.get("checkpoint_id"), "checkpoint_id"),
                         save_id=_opt_str(sm_doc.get("save_id"), "save_id"),
                         load_id=_opt_str(sm_doc.get("load_id"), "load_id"), modules=modules)
    storage: dict[Any, tuple[int | None, str]] = {}
    plain: dict[Any, Any] = {}
    rows = doc.get("storage")
    need(type(rows) is list, "storage is not a list")
    for row in rows:
        need(type(row) is list and len(row) in (3, 4) and type(row[0]) is str
             and type(row[2]) is str and (len(row) == 3 or (type(row[3]) is int and row[3] >= 0)),
             "a storage entry is malformed")
        offset = None if row[1] is None else torch.Size(_ints(row[1], "a storage offset"))
        index = MetadataIndex(row[0], offset)
        need(index not in storage, f"key {row[0]!r} at offset {row[1]} is stored twice")
        rank = row[3] if len(row) == 4 else None
        storage[index] = (rank, row[2])
        plain[index] = row[2] if rank is None else (rank, row[2])
    md = Metadata(state_dict_metadata=sdm, planner_data=doc.get("planner_data"),
                  storage_data=plain, storage_meta=sm,
                  version=_opt_str(doc.get("version"), "version"))
    return md, storage
