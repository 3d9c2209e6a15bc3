"""What a checkpoint of another tool is, and reading it: detecting a path's kind (``torch``,
``safetensors``, ``dcp``, ``hf``), reading a source into a state the store can hold and checking it
(:func:`load_source`), and scanning a directory of them (:func:`scan_dir`). Reads files only;
nothing is written."""

from __future__ import annotations

import json
import os
import re
import struct
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...errors import ImportSkippedWarning, ImportSourceError, UnsupportedTypeError
from ...format.state import flatten
from ...tensors import leaf_hook

#: Source kinds :func:`load_source` reads.
KINDS = ("torch", "safetensors", "dcp", "hf")

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

def refusal(e: BaseException) -> str:
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
            f"{path}: torch.load(weights_only=True) refused it ({refusal(e)}); ckptstore loads "
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
        raise ImportSourceError(f"{path}: not a readable safetensors file ({refusal(e)})") from e
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
    holds the bytes it names. Reading ``.metadata`` unpickles it, as DCP does (package
    docstring)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise ImportSourceError(f"{path}: a DCP directory without its .metadata file")
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - DCP's reader raises what its unpickler raises
        raise ImportSourceError(f"{path}/.metadata: DCP cannot read it ({refusal(e)})") from e
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
                                f"{some_of(unstored)}")
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
        raise ImportSourceError(f"{path}: DCP checkpoint files missing: {some_of(sorted(missing))}")
    if short:
        raise ImportSourceError(f"{path}: DCP checkpoint files shorter than the metadata says "
                                f"(truncated): {some_of(sorted(short))}")
    return metadata


def some_of(names: list[str], n: int = 8) -> str:
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
                    f"({refusal(e)}); ckptstore never unpickles more than that")
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
        raise ImportSourceError(f"{path}: DCP cannot read the checkpoint ({refusal(e)})") from e
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
                                f"{some_of(bad)}")
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise ImportSourceError(f"{path}: model shards missing: {some_of(missing)}")
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
        return (f"torch.load(weights_only=True) refused it ({refusal(cause)})"
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
    cannot read or hold (package docstring)."""
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


# ---- a directory of checkpoints -----------------------------------------------------------------

def _cheap_check(path: str, kind: str) -> None:
    """What can be checked without reading tensors: headers, DCP files, HF model files."""
    if kind == "safetensors":
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt", device="cpu"):
                pass
        except Exception as e:  # noqa: BLE001
            raise ImportSourceError(f"{path}: not a readable safetensors file "
                                    f"({refusal(e)})") from e
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
                    raise ImportSourceError(f"{path}: model shards missing: {some_of(missing)}")


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
