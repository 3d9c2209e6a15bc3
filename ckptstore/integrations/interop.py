"""Import checkpoints written by other tools into a store, and export iterations to their formats.

    import ckptstore
    from ckptstore.interop import export_checkpoint, import_checkpoint, import_dir

    with ckptstore.open("runs/gpt", mode="a") as store:
        import_checkpoint(store, 100, "old/step_100.pt")            # a torch.save file
        import_checkpoint(store, None, "hf-run/checkpoint-500")      # iteration 500, from the name
        report = import_dir(store, "old-run/")                       # every checkpoint in it
        report.logical_bytes, report.written_bytes                   # what dedup saved
        export_checkpoint(store, 500, "out/dcp-500", "dcp")           # also "torch", "safetensors"

**Sources** (the kind is detected from the files, or given as ``kind=``):

* ``"torch"``: a file written by ``torch.save``, read with ``torch.load(path, weights_only=True)``
  and nothing else. A file that needs more (a pickled class, a numpy array, ``TrainingArguments``)
  raises :class:`~ckptstore.errors.ImportSourceError` naming the file and what torch refused;
  there is no fallback to full unpickling.
* ``"safetensors"``: a ``.safetensors`` file (``safetensors.torch.load_file``); the state is its
  flat ``{name: tensor}`` dict and its string metadata is kept in the meta.
* ``"dcp"``: a ``torch.distributed.checkpoint`` directory (``FileSystemWriter`` layout:
  ``.metadata`` and ``*.distcp`` files), read in this one process by DCP's own reader into plain
  CPU tensors and nested like DCP's own ``dcp_to_torch_save`` does (DCP's flattening map; dict
  keys come back as DCP saved them, as strings). Every file the metadata names is checked to be
  there and long enough before anything is read. **Trust:** DCP's ``.metadata`` is a pickle,
  loaded by DCP itself (``FileSystemReader.read_metadata``): importing a DCP directory trusts that
  file exactly as ``dcp.load`` does, so import only directories you would ``dcp.load``. Its
  tensors are read by DCP with ``torch.load(weights_only=True)``, and its non-tensor items
  (``BYTE_IO``: learning rates, step counters, param lists), which DCP's default planner unpickles
  fully, are read here with ``torch.load(weights_only=True)`` too (refused: ImportSourceError).
  Once imported, nothing ckptstore reads from its own store is pickled.
* ``"hf"``: a Hugging Face ``Trainer`` ``checkpoint-N/`` directory: the model
  (``model.safetensors``; or ``model-0000x-of-0000y.safetensors`` shards with
  ``model.safetensors.index.json``; or ``pytorch_model.bin``, or its shards with
  ``pytorch_model.bin.index.json``, weights_only), ``optimizer.pt`` and ``scheduler.pt``
  (weights_only), ``rng_state.pth`` / ``rng_state_K.pth`` (weights_only; a file that does not
  load that way, e.g. one holding numpy's RNG state, is skipped with an
  :class:`~ckptstore.errors.ImportSkippedWarning` naming it), ``trainer_state.json`` and
  ``config.json`` (stored as JSON-like state). The state is ``{"model": {...}, "optimizer": ...,
  "scheduler": ..., "rng_state": ..., "trainer_state": {...}, "config": {...}}`` (what the
  directory has); the iteration defaults to N. ``training_args.bin`` (a pickle of
  ``TrainingArguments``) is never read; it and other files (tokenizer, ...) are listed as skipped.

The meta of an imported iteration is the caller's ``meta`` plus ``meta["import"]``: the source's
kind and absolute path, the string metadata of the safetensors files read (``"metadata"``; for
``"hf"`` keyed by file name), the files skipped (``"skipped"``: file and why);
for ``"hf"`` also ``global_step``, ``epoch`` and ``log``, the numbers ``trainer_state.json``
logged at the checkpoint's step (so ``gc --keep-best N --metric import.log.loss`` works on an
imported run).

**Nothing is lost.** An import is one :meth:`~ckptstore.Store.save`: the source is read and
checked completely first (a value the store cannot hold raises ImportSourceError naming the file
and the path in the state), then written and committed atomically; any failure leaves the store
as it was. Iterations must increase (:class:`~ckptstore.errors.IterationOrderError`, checked before
the source is read). :func:`import_dir` checks every entry it will import (kind, name, order,
required files) before the first save; each import is then its own commit, so a failure while
reading a later source (a file torch refuses) leaves the earlier ones committed and intact.

**Export** (:func:`write_state`, :func:`export_checkpoint`, ``ckptstore restore --format``):
``"torch"`` (``torch.save`` of the state as loaded), ``"safetensors"`` (tensors flattened to
``a/b/c`` names, other values as JSON in the metadata key ``ckptstore.values``), ``"dcp"`` (a DCP
directory written by ``dcp.save(..., no_dist=True)``; numpy arrays become torch tensors, DCP turns
int dict keys into strings). Every format is written under a temporary name beside the target
and renamed into place, so the target is either complete or absent; a DCP target must not exist
or be an empty directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..errors import (ExportError, ImportSkippedWarning, ImportSourceError, IterationOrderError,
                     UnsupportedTypeError)
from ..format.state import flatten
from ..store import SaveStats, Store
from ..tensors import leaf_hook

__all__ = ["KINDS", "EXPORT_FORMATS", "LoadedSource", "ImportResult", "DirImportReport",
           "detect_kind", "iteration_from_name", "load_source", "import_checkpoint", "scan_dir",
           "import_dir", "flat_tensors", "write_state", "export_checkpoint"]

#: Source kinds :func:`load_source` reads.
KINDS = ("torch", "safetensors", "dcp", "hf")
#: Formats :func:`write_state` writes.
EXPORT_FORMATS = ("torch", "safetensors", "dcp")

_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")
_HF_NAME = re.compile(r"checkpoint-(\d+)")
_HF_MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json")
_HF_MARKERS = _HF_MODEL_FILES + ("trainer_state.json", "optimizer.pt", "scheduler.pt")
_HF_RNG = re.compile(r"rng_state(_\d+)?\.pth")
_HF_JSON = {"trainer_state.json": "trainer_state", "config.json": "config"}
_HF_TORCH = {"optimizer.pt": "optimizer", "scheduler.pt": "scheduler"}
_SHARD = re.compile(r".*-\d+-of-\d+\.(safetensors|bin)")
_LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: Lines of torch's weights_only refusal that advise rather than say what was refused.
_TORCH_ADVICE = ("Weights only load failed", "(1) In PyTorch", "(2) Alternatively",
                 "Check the documentation")
#: The largest safetensors header accepted when sniffing a file's kind (the format's own limit).
_SAFETENSORS_MAX_HEADER = 100_000_000


# ---- results -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoadedSource:
    """A source read into memory and checked, ready to save: ``state`` holds only what the store
    can hold; ``info`` becomes ``meta["import"]``; ``skipped`` lists (file, why) left out."""

    path: str
    kind: str
    state: Any
    info: dict
    skipped: tuple[tuple[str, str], ...] = ()

    @property
    def iteration_hint(self) -> int | None:
        """The iteration its name implies (``checkpoint-500`` -> 500), or None."""
        return iteration_from_name(self.path)


@dataclass(frozen=True)
class ImportResult:
    """One committed import: the source, its kind and what the save did (``stats``)."""

    iteration: int
    source: str
    kind: str
    stats: SaveStats
    skipped: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class DirImportReport:
    """What :func:`import_dir` did: the imports in iteration order and the directory entries it
    left out (entry, why). ``logical_bytes`` is the state the imports hold, ``written_bytes``
    what they wrote: the difference is what dedup (and compression) saved."""

    directory: str
    imported: tuple[ImportResult, ...]
    skipped: tuple[tuple[str, str], ...]
    seconds: float

    @property
    def logical_bytes(self) -> int:
        return sum(r.stats.logical_bytes for r in self.imported)

    @property
    def written_bytes(self) -> int:
        return sum(r.stats.written_bytes for r in self.imported)

    @property
    def dedup_bytes(self) -> int:
        """Tensor bytes found already stored (earlier iterations, or twice in one) and not
        written again."""
        return sum(r.stats.dedup_bytes for r in self.imported)

    @property
    def saved_bytes(self) -> int:
        """``logical_bytes - written_bytes`` (never below 0)."""
        return max(0, self.logical_bytes - self.written_bytes)


# ---- what a path is ------------------------------------------------------------------------------

def iteration_from_name(path: str | os.PathLike) -> int | None:
    """The iteration a checkpoint's name implies: N of ``checkpoint-N``, else the last number
    in the name (``step_300.pt`` -> 300, ``iter_0400`` -> 400), else None."""
    name = os.path.basename(os.path.normpath(os.fspath(path)))
    m = _HF_NAME.fullmatch(name)
    if m:
        return int(m.group(1))
    stem, ext = os.path.splitext(name)
    if ext in _TORCH_SUFFIXES or ext == ".safetensors":
        name = stem
    m = _LAST_NUMBER.search(name)
    return int(m.group(1)) if m else None


def _sniff_file(path: str) -> str | None:
    """"torch" (a zip archive or a pickle, torch.save's two layouts), "safetensors" (a plausible
    header length, then a JSON object) or None."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError as e:
        raise ImportSourceError(f"{path}: cannot be read: {e.strerror or e}") from e
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        return "torch"
    if len(head) == 9 and head[8:9] == b"{":
        n = struct.unpack("<Q", head[:8])[0]
        if n <= min(size - 8, _SAFETENSORS_MAX_HEADER):
            return "safetensors"
    return None


def _dir_kind(path: str) -> str | None:
    names = set(os.listdir(path))
    if ".metadata" in names or any(n.endswith(".distcp") for n in names):
        return "dcp"
    if names & set(_HF_MARKERS) or _HF_NAME.fullmatch(os.path.basename(os.path.normpath(path))):
        return "hf"
    return None


def detect_kind(path: str | os.PathLike) -> str:
    """The kind of checkpoint at ``path`` (one of :data:`KINDS`); ImportSourceError when it is
    none of them or does not exist."""
    p = os.fspath(path)
    if os.path.isdir(p):
        kind = _dir_kind(p)
        if kind is None:
            raise ImportSourceError(
                f"{p}: unknown source kind: a directory that is neither a DCP checkpoint "
                "(.metadata, *.distcp) nor a Hugging Face Trainer checkpoint (model.safetensors, "
                "pytorch_model.bin, trainer_state.json, ...)")
        return kind
    if os.path.isfile(p):
        kind = _sniff_file(p)
        if kind is None:
            raise ImportSourceError(
                f"{p}: unknown source kind: neither a torch.save file (zip archive or pickle) nor "
                "a safetensors file")
        return kind
    raise ImportSourceError(f"{p}: no such file or directory")


# ---- reading sources -----------------------------------------------------------------------------

def _refusal(e: BaseException) -> str:
    """What torch (or another reader) refused, in one line."""
    lines = [line.strip() for line in _ANSI.sub("", str(e)).splitlines() if line.strip()]
    reasons = [line.split(":", 1)[1].split(" Please use", 1)[0].strip() for line in lines
               if line.startswith("WeightsUnpickler error:")]
    if not reasons:  # torch's advice around the reason is dropped; the reason stays
        reasons = [line for line in lines if not line.startswith(_TORCH_ADVICE)] or lines
    reason = reasons[0] if reasons else ""
    return f"{type(e).__name__}: {reason}" if reason else type(e).__name__


def _torch_load(path: str) -> Any:
    """``torch.load(weights_only=True)``, and nothing beyond it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        raise ImportSourceError(f"{path}: cannot be read: {e.strerror or e}") from e
    except Exception as e:  # noqa: BLE001 - whatever torch refuses becomes one typed error
        raise ImportSourceError(
            f"{path}: torch.load(weights_only=True) refused it ({_refusal(e)}); ckptstore loads "
            "torch.save files only that way, never with full unpickling: re-save it with plain "
            "tensors and containers") from e


def _safetensors_load(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
        tensors = load_file(path, device="cpu")
    except OSError as e:
        raise ImportSourceError(f"{path}: cannot be read: {e.strerror or e}") from e
    except Exception as e:  # noqa: BLE001 - SafetensorError and friends
        raise ImportSourceError(f"{path}: not a readable safetensors file ({_refusal(e)})") from e
    return tensors, dict(metadata)


def _json_load(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise ImportSourceError(f"{path}: cannot be read: {e.strerror or e}") from e
    except ValueError as e:
        raise ImportSourceError(f"{path}: not valid JSON ({e})") from e


def _read_torch(path: str) -> tuple[Any, dict, list[tuple[str, str]]]:
    return _torch_load(path), {}, []


def _read_safetensors(path: str) -> tuple[Any, dict, list[tuple[str, str]]]:
    tensors, metadata = _safetensors_load(path)
    return tensors, {"metadata": metadata}, []


# -- DCP

def _dcp_metadata(path: str) -> Any:
    """DCP's metadata of the directory, after checking that every file it names is there and
    holds the bytes it names. Reading ``.metadata`` unpickles it, as DCP does (module docstring)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise ImportSourceError(f"{path}: a DCP directory without its .metadata file")
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - DCP's reader raises what its unpickler raises
        raise ImportSourceError(f"{path}/.metadata: DCP cannot read it ({_refusal(e)})") from e
    storage = getattr(metadata, "storage_data", None)
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(storage, dict) or not isinstance(entries, dict):
        raise ImportSourceError(f"{path}/.metadata: not the metadata of a DCP FileSystemWriter "
                                "checkpoint (no storage map)")
    unstored = []
    for fqn, md in entries.items():
        wanted = ([MetadataIndex(fqn, c.offsets) for c in md.chunks]
                  if isinstance(md, TensorStorageMetadata) else [MetadataIndex(fqn)])
        if any(w not in storage for w in wanted):
            unstored.append(fqn)
    if unstored:
        raise ImportSourceError(f"{path}: DCP metadata names items stored in no file: "
                                f"{_some(unstored)}")
    root = os.path.realpath(path)
    missing: set[str] = set()
    short: set[str] = set()
    sizes: dict[str, int] = {}
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if type(rel) is not str or type(offset) is not int or type(length) is not int:
            raise ImportSourceError(f"{path}/.metadata: a storage entry without file, offset and "
                                    "length")
        full = os.path.realpath(os.path.join(root, rel))
        if not full.startswith(root + os.sep):
            raise ImportSourceError(f"{path}/.metadata: names a file outside the directory: "
                                    f"{rel!r}")
        if rel not in sizes:
            sizes[rel] = os.path.getsize(full) if os.path.isfile(full) else -1
        if sizes[rel] < 0:
            missing.add(rel)
        elif sizes[rel] < offset + length:
            short.add(rel)
    if missing:
        raise ImportSourceError(f"{path}: DCP checkpoint files missing: {_some(sorted(missing))}")
    if short:
        raise ImportSourceError(f"{path}: DCP checkpoint files shorter than the metadata says "
                                f"(truncated): {_some(sorted(short))}")
    return metadata


def _some(names: list[str], n: int = 8) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _set_path(root: dict, path: tuple, value: Any, where: str) -> None:
    """Put ``value`` at ``path`` the way DCP's ``set_element`` does (a str key makes a dict, an
    int key a list, padded with None); ImportSourceError on a path that contradicts another."""
    cur: Any = root
    for i in range(1, len(path) + 1):
        key = path[i - 1]
        if i == len(path):
            nxt = value
        else:
            nxt = {} if type(path[i]) is str else []
        if isinstance(cur, dict):
            if i == len(path):
                cur[key] = nxt
            else:
                cur = cur.setdefault(key, nxt)
        elif isinstance(cur, list) and type(key) is int and key >= 0:
            while len(cur) <= key:
                cur.append(None)
            if i == len(path):
                cur[key] = nxt
            else:
                if cur[key] is None:
                    cur[key] = nxt
                cur = cur[key]
        else:
            raise ImportSourceError(f"{where}: DCP's flattening map puts {path!r} inside a "
                                    f"{type(cur).__name__}")


def _read_dcp(path: str) -> tuple[Any, dict, list[tuple[str, str]]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException, FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _dcp_metadata(path)

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        """DCP's default load planner, except that non-tensor items are read with
        ``torch.load(weights_only=True)`` instead of full unpickling."""

        refused: ImportSourceError | None = None

        def load_bytes(self, read_item: Any, value: Any) -> None:
            fqn = read_item.dest_index.fqn
            try:
                self.state_dict[fqn] = torch.load(value, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - reported as the import's error
                self.refused = ImportSourceError(
                    f"{path}: DCP item {fqn!r}: torch.load(weights_only=True) refused it "
                    f"({_refusal(e)}); ckptstore never unpickles more than that")
                raise self.refused from e

    flat: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        flat[fqn] = (torch.empty(md.size, dtype=md.properties.dtype)
                     if isinstance(md, TensorStorageMetadata) else None)
    planner = WeightsOnlyPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's notice that it runs in a single process
            dcp.load(flat, storage_reader=FileSystemReader(path), planner=planner, no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps its readers'
        # failures in CheckpointException (a BaseException)
        if planner.refused is not None:
            raise planner.refused from e
        raise ImportSourceError(f"{path}: DCP cannot read the checkpoint ({_refusal(e)})") from e
    mapping = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    state: dict = {}
    for fqn, value in flat.items():
        p = mapping.get(fqn, (fqn,))
        if not isinstance(p, tuple) or not p or type(p[0]) is not str or \
                any(type(k) not in (str, int) for k in p):
            raise ImportSourceError(f"{path}/.metadata: a flattening path that is not a tuple "
                                    f"of str and int keys for {fqn!r}")
        _set_path(state, p, value, path)
    return state, {}, []


# -- Hugging Face Trainer

def _hf_sharded(path: str, index_name: str, load: Callable[[str], dict]) -> dict:
    index_path = os.path.join(path, index_name)
    index = _json_load(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
            type(k) is str and type(v) is str for k, v in weight_map.items()):
        raise ImportSourceError(f"{index_path}: no weight_map of tensor names to file names")
    files = list(dict.fromkeys(weight_map.values()))
    bad = [f for f in files if os.path.basename(f) != f or f in ("", ".", "..")]
    if bad:
        raise ImportSourceError(f"{index_path}: names shard files outside the directory: "
                                f"{_some(bad)}")
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise ImportSourceError(f"{path}: model shards missing: {_some(missing)}")
    loaded = {f: load(os.path.join(path, f)) for f in files}
    for f, tensors in loaded.items():
        if not isinstance(tensors, dict):
            raise ImportSourceError(f"{os.path.join(path, f)}: holds a {type(tensors).__name__}, "
                                    "not a dict of tensors")
    model: dict = {}
    for name, f in weight_map.items():
        if name not in loaded[f]:
            raise ImportSourceError(f"{os.path.join(path, f)}: does not hold {name!r}, which "
                                    f"{index_name} puts there")
        model[name] = loaded[f][name]
    for f, tensors in loaded.items():  # tensors a shard holds beyond the map: kept, not dropped
        for name, t in tensors.items():
            if name not in model:
                model[name] = t
    return model


def _hf_log(trainer_state: Any) -> dict:
    """The numbers trainer_state.json logged at its global step (later entries win)."""
    if not isinstance(trainer_state, dict):
        return {}
    step = trainer_state.get("global_step")
    out: dict = {}
    for entry in trainer_state.get("log_history") or []:
        if isinstance(entry, dict) and entry.get("step") == step:
            out.update({k: v for k, v in entry.items() if type(k) is str and
                        type(v) in (int, float) and k != "step"})
    return out


def _no_hf_model(path: str) -> ImportSourceError:
    return ImportSourceError(
        f"{path}: a Hugging Face checkpoint without a model file (model.safetensors, "
        "model.safetensors.index.json and its shards, pytorch_model.bin or "
        "pytorch_model.bin.index.json and its shards)")


def _read_hf(path: str) -> tuple[Any, dict, list[tuple[str, str]]]:
    names = sorted(os.listdir(path))
    skipped: list[tuple[str, str]] = []
    metadata: dict[str, dict[str, str]] = {}
    used: set[str] = set()

    def st_load(p: str) -> dict:
        tensors, md = _safetensors_load(p)
        metadata[os.path.basename(p)] = md
        return tensors

    if "model.safetensors" in names:
        model: Any = st_load(os.path.join(path, "model.safetensors"))
        used.add("model.safetensors")
    elif "model.safetensors.index.json" in names:
        model = _hf_sharded(path, "model.safetensors.index.json", st_load)
        used.add("model.safetensors.index.json")
    elif "pytorch_model.bin" in names:
        model = _torch_load(os.path.join(path, "pytorch_model.bin"))
        used.add("pytorch_model.bin")
    elif "pytorch_model.bin.index.json" in names:
        model = _hf_sharded(path, "pytorch_model.bin.index.json", _torch_load)
        used.add("pytorch_model.bin.index.json")
    else:
        raise _no_hf_model(path)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if index_name in used:
            weight_map = _json_load(os.path.join(path, index_name)).get("weight_map", {})
            used.update(weight_map.values())
    state: dict = {"model": model}
    for name, key in _HF_TORCH.items():
        if name in names:
            state[key] = _torch_load(os.path.join(path, name))
            used.add(name)
    for name in names:
        if _HF_RNG.fullmatch(name):
            used.add(name)
            why = _rng_problem(os.path.join(path, name), state, name[:-len(".pth")])
            if why is not None:
                warnings.warn(f"{os.path.join(path, name)}: skipped: {why}", ImportSkippedWarning,
                              stacklevel=4)
                skipped.append((name, why))
    trainer_state = None
    for name, key in _HF_JSON.items():
        if name in names:
            state[key] = _json_load(os.path.join(path, name))
            used.add(name)
            if key == "trainer_state":
                trainer_state = state[key]
    for name in names:
        if name in used:
            continue
        why = ("a pickle of TrainingArguments: never unpickled" if name == "training_args.bin"
               else "a directory" if os.path.isdir(os.path.join(path, name))
               else "not part of the training state ckptstore imports")
        skipped.append((name, why))
    info: dict = {"metadata": metadata}
    if isinstance(trainer_state, dict):
        for k in ("global_step", "epoch"):
            if type(trainer_state.get(k)) in (int, float):
                info[k] = trainer_state[k]
        info["log"] = _hf_log(trainer_state)
    return state, info, skipped


def _rng_problem(file: str, state: dict, key: str) -> str | None:
    """Load an RNG state file into ``state[key]``; why it was left out, or None."""
    try:
        value = _torch_load(file)
    except ImportSourceError as e:
        cause = e.__cause__
        return (f"torch.load(weights_only=True) refused it ({_refusal(cause)})"
                if cause is not None else str(e))
    try:
        flatten(value, leaf_hook)
    except UnsupportedTypeError as e:
        return f"holds a value the store cannot hold: {e}"
    state[key] = value
    return None


_READERS: dict[str, Callable[[str], tuple[Any, dict, list[tuple[str, str]]]]] = {
    "torch": _read_torch, "safetensors": _read_safetensors, "dcp": _read_dcp, "hf": _read_hf,
}


def _check_kind(p: str, kind: str | None) -> str:
    if kind is None:
        return detect_kind(p)
    if kind not in KINDS:
        raise ImportSourceError(f"{p}: unknown source kind {kind!r} (one of {', '.join(KINDS)})")
    if not os.path.exists(p):
        raise ImportSourceError(f"{p}: no such file or directory")
    if os.path.isdir(p) != (kind in ("dcp", "hf")):
        raise ImportSourceError(f"{p}: a {kind} checkpoint is a "
                                f"{'directory' if kind in ('dcp', 'hf') else 'file'}")
    return kind


def load_source(source: str | os.PathLike, kind: str | None = None) -> LoadedSource:
    """Read the checkpoint at ``source`` (of ``kind``, detected when None) into memory and check
    that the store can hold all of it. Touches no store. ImportSourceError for anything it
    cannot read or hold (module docstring)."""
    p = os.fspath(source)
    kind = _check_kind(p, kind)
    state, info, skipped = _READERS[kind](p)
    try:
        flatten(state, leaf_hook)
    except UnsupportedTypeError as e:
        raise ImportSourceError(f"{p}: holds a value the store cannot hold: {e}") from e
    info = {"kind": kind, "path": os.path.abspath(p), **info}
    if skipped:
        info["skipped"] = [list(s) for s in skipped]
    return LoadedSource(p, kind, state, info, tuple(skipped))


# ---- importing -----------------------------------------------------------------------------------

def _writer(store: Any) -> Store:
    if not isinstance(store, Store):
        raise TypeError(f"import needs a ckptstore.Store opened with mode \"a\", not {store!r}")
    return store


def _check_order(store: Store, iteration: int, source: str) -> None:
    if type(iteration) is not int or not 0 <= iteration < 1 << 63:
        raise ValueError(f"iteration must be a non-negative int, not {iteration!r}")
    tail = store.tail()
    if tail is not None and iteration <= tail:
        raise IterationOrderError(f"cannot import {source} as iteration {iteration}: not after "
                                  f"the latest iteration {tail} of {store.path} (nothing written)")


def import_checkpoint(store: Store, iteration: int | None, source: str | os.PathLike | LoadedSource,
                      *, meta: dict | None = None, kind: str | None = None,
                      progress: Callable[[int], None] | None = None) -> ImportResult:
    """Import one checkpoint as ``iteration`` of ``store`` (a writer), committed atomically.

    ``source``: a path (read with :func:`load_source`, ``kind`` detected when None) or a
    :class:`LoadedSource` already read. ``iteration`` None: the one its name implies
    (``checkpoint-500`` -> 500; ImportSourceError when the name holds no number). ``meta``: a
    dict of JSON-like values stored with it, plus ``meta["import"]`` (module docstring).
    Raises ImportSourceError, IterationOrderError (before reading the source) or what
    :meth:`Store.save` raises; the store is unchanged on any failure."""
    st = _writer(store)
    path = source.path if isinstance(source, LoadedSource) else os.fspath(source)
    if iteration is None:
        iteration = iteration_from_name(path)
        if iteration is None:
            raise ImportSourceError(f"{path}: no iteration given and none in its name")
    _check_order(st, iteration, path)
    if meta is not None and type(meta) is not dict:
        raise UnsupportedTypeError(f"meta must be a dict, not {type(meta).__name__}")
    loaded = source if isinstance(source, LoadedSource) else load_source(path, kind)
    stats = st.save(iteration, loaded.state, meta={**(meta or {}), "import": loaded.info},
                    progress=progress)
    return ImportResult(iteration, loaded.path, loaded.kind, stats, loaded.skipped)


def _cheap_check(path: str, kind: str) -> None:
    """What can be checked without reading tensors: headers, DCP files, HF model files."""
    if kind == "safetensors":
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt", device="cpu"):
                pass
        except Exception as e:  # noqa: BLE001
            raise ImportSourceError(f"{path}: not a readable safetensors file "
                                    f"({_refusal(e)})") from e
    elif kind == "dcp":
        _dcp_metadata(path)
    elif kind == "hf":
        names = set(os.listdir(path))
        model = next((n for n in _HF_MODEL_FILES if n in names), None)
        if model is None:
            raise _no_hf_model(path)
        if model.endswith(".index.json"):  # the shards the index names must be there
            index = _json_load(os.path.join(path, model))
            wm = index.get("weight_map") if isinstance(index, dict) else None
            if isinstance(wm, dict):
                missing = sorted({str(f) for f in wm.values()
                                  if type(f) is not str or f not in names})
                if missing:
                    raise ImportSourceError(f"{path}: model shards missing: {_some(missing)}")


def scan_dir(directory: str | os.PathLike
             ) -> tuple[list[tuple[int, str, str]], list[tuple[str, str]]]:
    """The checkpoints in ``directory``: ``[(iteration, path, kind)]`` in increasing iteration
    order (checkpoint-N directories, DCP directories, torch and safetensors files whose names hold
    a number; not the shards of a sharded model, ``model-00001-of-00002.safetensors``), and
    ``[(entry, why)]`` for the entries left out. Each is checked as far as it can be without
    reading tensors. ImportSourceError when ``directory`` is itself a checkpoint, two entries name
    the same iteration, or one that looks like a checkpoint fails a check."""
    d = os.fspath(directory)
    if not os.path.isdir(d):
        raise ImportSourceError(f"{d}: not a directory")
    itself = _dir_kind(d)
    if itself == "dcp" or _HF_NAME.fullmatch(os.path.basename(os.path.normpath(d))):
        raise ImportSourceError(f"{d}: is itself a checkpoint ({itself}), not a directory of "
                                "checkpoints: import it on its own (ckptstore import STORE "
                                "[ITER] SOURCE)")
    found: list[tuple[int, str, str]] = []
    skipped: list[tuple[str, str]] = []
    for name in sorted(os.listdir(d)):
        if name.startswith("."):
            continue
        p = os.path.join(d, name)
        if _SHARD.fullmatch(name):  # e.g. the final model a Trainer saved beside its checkpoints
            skipped.append((name, "a shard of a sharded model, not a checkpoint of its own"))
            continue
        it = iteration_from_name(name)
        try:
            kind = (_dir_kind(p) if os.path.isdir(p) else
                    _sniff_file(p) if os.path.isfile(p) else None)
        except OSError as e:
            skipped.append((name, f"cannot be read: {e}"))
            continue
        if kind is None:
            skipped.append((name, "not a recognised checkpoint"))
            continue
        if it is None:
            skipped.append((name, f"a {kind} checkpoint without an iteration number in its name"))
            continue
        found.append((it, p, kind))
    found.sort(key=lambda f: f[0])
    for a, b in zip(found, found[1:]):
        if a[0] == b[0]:
            raise ImportSourceError(f"{d}: {os.path.basename(a[1])} and {os.path.basename(b[1])} "
                                    f"both name iteration {a[0]}; nothing imported")
    for _, p, kind in found:
        _cheap_check(p, kind)
    return found, skipped


def import_dir(store: Store, directory: str | os.PathLike, *, meta: dict | None = None,
               on_import: Callable[[ImportResult], None] | None = None,
               progress: Callable[[int], None] | None = None) -> DirImportReport:
    """Import every checkpoint :func:`scan_dir` finds in ``directory``, in increasing iteration
    order, one commit each; tensors unchanged from an earlier iteration (or already in the store)
    are stored once. Everything is checked first (kinds, names, duplicate iterations, order
    against the store, DCP and model files): a problem there raises before anything is written.
    ``on_import`` is called after each commit. ImportSourceError when nothing is found."""
    st = _writer(store)
    d = os.fspath(directory)
    t0 = time.perf_counter()
    found, skipped = scan_dir(d)
    if not found:
        raise ImportSourceError(f"{d}: no recognised checkpoint (checkpoint-N directories, DCP "
                                "directories, torch.save or safetensors files with a number in "
                                "the name)" + (f"; left out: {_some([s[0] for s in skipped])}"
                                               if skipped else ""))
    _check_order(st, found[0][0], found[0][1])
    done: list[ImportResult] = []
    for it, p, kind in found:
        r = import_checkpoint(st, it, p, meta=meta, kind=kind, progress=progress)
        done.append(r)
        if on_import is not None:
            on_import(r)
    return DirImportReport(d, tuple(done), tuple(skipped), time.perf_counter() - t0)


# ---- exporting -----------------------------------------------------------------------------------

def flat_tensors(state: Any, prefix: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a nested state into ``{path: tensor}`` and ``{path: JSON-able value}`` (paths
    ``a/b/0``), for safetensors."""
    tensors: dict[str, Any] = {}
    other: dict[str, Any] = {}
    items = state.items() if isinstance(state, dict) else enumerate(state) \
        if isinstance(state, (list, tuple)) else None
    if items is None:
        if isinstance(state, torch.Tensor):
            tensors[prefix] = state.detach().contiguous()
        elif isinstance(state, np.ndarray):
            tensors[prefix] = torch.from_numpy(np.ascontiguousarray(state))
        else:
            other[prefix] = state if not isinstance(state, bytes) else state.hex()
        return tensors, other
    for k, v in items:
        t, o = flat_tensors(v, f"{prefix}/{k}" if prefix else str(k))
        tensors.update(t)
        other.update(o)
    return tensors, other


def _numpy_to_torch(state: Any) -> Any:
    """The state with every numpy array as a torch tensor (DCP pickles anything else)."""
    if isinstance(state, np.ndarray):
        a = state if state.dtype.isnative else state.astype(state.dtype.newbyteorder("="))
        return torch.from_numpy(np.ascontiguousarray(a))
    if isinstance(state, dict):
        out = type(state)((k, _numpy_to_torch(v)) for k, v in state.items())
        if hasattr(state, "_metadata"):
            out._metadata = state._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(state, list):
        return [_numpy_to_torch(v) for v in state]
    if isinstance(state, tuple):
        return tuple(_numpy_to_torch(v) for v in state)
    return state


def _write_dcp(state: Any, target: str) -> None:
    import torch.distributed.checkpoint as dcp

    if not isinstance(state, dict):
        raise ExportError(f"DCP needs a dict at the top of the state, not {type(state).__name__}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's notice that it runs in a single process
        dcp.save(_numpy_to_torch(state), checkpoint_id=target, no_dist=True)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def write_state(state: Any, out: str | os.PathLike, fmt: str, *,
                iteration: int | None = None) -> None:
    """Write a loaded state to ``out`` as ``fmt`` (one of :data:`EXPORT_FORMATS`), under a
    temporary name renamed into place (module docstring). ExportError for an unknown format, a
    DCP target that exists and is not an empty directory, or a state the format cannot hold."""
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"unknown export format {fmt!r} (one of {', '.join(EXPORT_FORMATS)})")
    target = os.fspath(out)
    if fmt == "dcp" and os.path.lexists(target) and not (
            os.path.isdir(target) and not os.path.islink(target) and not os.listdir(target)):
        raise ExportError(f"{target}: exists; a DCP export needs a new or empty directory")
    tmp = os.path.join(os.path.dirname(os.path.abspath(target)),
                       f".{os.path.basename(os.path.abspath(target))}.tmp-{os.getpid()}")
    _remove(tmp)
    try:
        if fmt == "torch":
            torch.save(state, tmp)
        elif fmt == "safetensors":
            from safetensors.torch import save_file

            tensors, other = flat_tensors(state)
            metadata = {"ckptstore.values": json.dumps(other, default=repr)}
            if iteration is not None:
                metadata["ckptstore.iteration"] = str(iteration)
            try:
                save_file(tensors, tmp, metadata=metadata)
            except (ValueError, RuntimeError) as e:
                raise ExportError(f"{target}: safetensors cannot hold this state ({e})") from e
        else:
            from torch.distributed.checkpoint import CheckpointException

            try:
                _write_dcp(state, tmp)
            except (ExportError, OSError):
                raise
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps its
                # writers' failures in CheckpointException (a BaseException)
                raise ExportError(f"{target}: DCP cannot write this state ({_refusal(e)})") from e
            if os.path.isdir(target):
                os.rmdir(target)  # empty (checked above): the rename puts the export there
        os.replace(tmp, target)
    except BaseException:
        _remove(tmp)
        raise


def export_checkpoint(store: Any, iteration: int, out: str | os.PathLike, fmt: str, *,
                      keys: list | None = None,
                      progress: Callable[[int], None] | None = None) -> None:
    """Write committed ``iteration`` of ``store`` (a delta iteration is reconstructed by
    :meth:`Store.load`) to ``out`` as ``fmt``; ``keys``: only these top-level keys."""
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"unknown export format {fmt!r} (one of {', '.join(EXPORT_FORMATS)})")
    state = store.load(iteration, keys=keys, progress=progress)
    write_state(state, out, fmt, iteration=iteration)
