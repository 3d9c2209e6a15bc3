"""diff: which tensors changed between two checkpoints, by Merkle roots, then chunk addresses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import FormatError
from ..format.manifest import Manifest, TensorEntry
from ..format.state import format_path, leaf_paths, path_name
from ..format.tree import Tree


@dataclass(frozen=True)
class TensorDiff:
    """One tensor path compared between two checkpoints (Merkle comparison)."""

    path: str
    status: str  # "added" | "removed" | "changed" | "unchanged"
    nbytes_a: int
    nbytes_b: int
    bytes_changed: int


def diff_manifests(ma: Manifest, mb: Manifest, tree_of: Callable[[TensorEntry], Tree],
                   tree_of_b: Callable[[TensorEntry], Tree] | None = None) -> list[TensorDiff]:
    """Compare the tensors of two checkpoints by Merkle roots, then chunk addresses
    (``tree_of`` reads a tensor's verified tree; ``tree_of_b`` those of ``mb`` when they are
    in another store, e.g. another stream of a job store).

    Tensors are matched by their structured path (typed keys: ``{"a/b": x}`` is not
    ``{"a": {"b": x}}``, the key ``1`` is not ``"1"``). ``TensorDiff.path`` is the usual
    ``a/b`` display, or ``state['a/b']`` where two paths of the diff would display alike."""
    ta, tb = _tensors_by_path(ma), _tensors_by_path(mb)
    keys = list(ta) + [k for k in tb if k not in ta]
    names: dict[str, int] = {}
    for k in keys:
        names[_display(k, False)] = names.get(_display(k, False), 0) + 1
    out: list[TensorDiff] = []
    for key in keys:
        ea, eb = ta.get(key), tb.get(key)
        path = _display(key, names[_display(key, False)] > 1)
        if eb is None:
            assert ea is not None
            out.append(TensorDiff(path, "removed", ea.nbytes, 0, 0))
        elif ea is None:
            out.append(TensorDiff(path, "added", 0, eb.nbytes, eb.nbytes))
        elif ea.root == eb.root and ea.dtype == eb.dtype and ea.shape == eb.shape:
            out.append(TensorDiff(path, "unchanged", ea.nbytes, eb.nbytes, 0))
        else:
            out.append(TensorDiff(path, "changed", ea.nbytes, eb.nbytes,
                                  _changed_bytes(ea, eb, tree_of, tree_of_b or tree_of)))
    return out


def _changed_bytes(ea: TensorEntry, eb: TensorEntry, tree_of: Callable[[TensorEntry], Tree],
                   tree_of_b: Callable[[TensorEntry], Tree]) -> int:
    if ea.inline is not None or eb.inline is not None or ea.nbytes != eb.nbytes:
        return eb.nbytes
    try:
        tree_a, tree_b = tree_of(ea), tree_of_b(eb)
    except (FormatError, OSError):
        return eb.nbytes
    if tree_a.chunk_size != tree_b.chunk_size:
        return eb.nbytes
    return sum(e - s for (s, e, addr), a in zip(tree_b.chunk_spans(), tree_a.addresses) if addr != a)


#: A diff key: a tensor's structured path and its occurrence number among equal paths of one
#: manifest (0 unless the manifest is odd); tensors no state node names are keyed by display path.
_DiffKey = tuple[Any, ...]


def _tensors_by_path(m: Manifest) -> dict[_DiffKey, TensorEntry]:
    paths = leaf_paths(m.state)
    out: dict[_DiffKey, TensorEntry] = {}
    for i, t in enumerate(m.tensors):
        p = paths.get(i)
        key: _DiffKey = ("path", p, 0) if p is not None else ("unreferenced", t.path, 0)
        while key in out:
            key = (key[0], key[1], key[2] + 1)
        out[key] = t
    return out


def _display(key: _DiffKey, unambiguous: bool) -> str:
    kind, p, n = key
    if kind != "path":
        name = p
    else:
        name = format_path(p) if unambiguous else path_name(p)
    return f"{name} #{n + 1}" if n else name
