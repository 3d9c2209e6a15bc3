"""The structured-state encoding: nested Python structures <-> a JSON-safe tree.

A state is a tree of dicts (str or int keys, order kept), lists, tuples, JSON-like scalars and
array leaves (tensors). :func:`flatten` turns it into a JSON-safe *skeleton* in which every array
leaf is replaced by its index in a separate leaf list; :func:`unflatten` reverses that. Each node is
encoded as (format-spec/format.md, "State encoding")::

    None, True/False, str        ->  the JSON value itself
    int in [-2**63, 2**63)       ->  the JSON number
    other int                    ->  {"i": "0x..." | "-0x..."}  (no decimal digit limit)
    float (not NaN)              ->  {"f": float.hex(x)}      exact, incl. inf/-0.0
    NaN                          ->  {"n": 16 hex digits}     its IEEE-754 bits (sign, payload)
    bytes                        ->  {"b": base64}
    list                         ->  JSON array
    tuple                        ->  {"t": [...]}
    dict                         ->  {"d": [[key, value], ...]}   key: str, int, or {"i": hex}
    OrderedDict                  ->  {"o": [[key, value], ...]} or, when it carries the
                                     ``_metadata`` attribute of ``Module.state_dict()``,
                                     {"o": [...], "m": <node of _metadata>}  (two keys)
    array leaf                   ->  {"T": index into the manifest's tensor list}

Only these exact types are accepted (a ``tuple`` subclass or a ``float`` subclass is not a tuple or
float); anything else raises UnsupportedTypeError naming the path. No object is ever constructed
from anything but these tags: decoding cannot execute code.
"""

from __future__ import annotations

import base64
import binascii
import re
import reprlib
import struct
from collections import OrderedDict

from typing import Any, Callable

from ..errors import FormatError, UnsupportedTypeError

_INT_JSON = 1 << 63
_HEX_INT = re.compile(r"-?0x[0-9a-f]+")
_NAN_BITS = re.compile(r"[0-9a-f]{16}")

#: Deepest nesting accepted, both ways (bounds recursion on hostile input).
MAX_DEPTH = 256

PathKey = str | int
Path = tuple[PathKey, ...]
#: Returns a leaf object for an array-like value at a path, or None when the value is not one.
LeafHook = Callable[[Any, Path], Any | None]


def format_path(path: Path) -> str:
    """Render a path as it would be written in Python: ``state["optim"]["state"][0]``."""
    return "state" + "".join(f"[{k!r}]" if isinstance(k, str) else f"[{k}]" for k in path)


def path_name(path: Path) -> str:
    """Render a path for tables and reports: ``optim/state/0/exp_avg``."""
    return "/".join(str(k) for k in path)


def flatten(obj: Any, leaf_hook: LeafHook) -> tuple[Any, list[Any]]:
    """Encode ``obj`` into (skeleton, leaves). ``leaf_hook`` recognises array leaves."""
    leaves: list[Any] = []

    def enc(x: Any, path: Path) -> Any:
        if len(path) > MAX_DEPTH:
            raise UnsupportedTypeError(f"structure nested deeper than {MAX_DEPTH} at {format_path(path)}")
        t = type(x)
        if x is None or t is bool or t is str:
            return x
        if t is int:
            return x if -_INT_JSON <= x < _INT_JSON else {"i": hex(x)}
        if t is float:
            if x != x:
                return {"n": struct.pack(">d", x).hex()}
            return {"f": x.hex()}
        if t is bytes:
            return {"b": base64.b64encode(x).decode("ascii")}
        if t is list:
            return [enc(v, path + (i,)) for i, v in enumerate(x)]
        if t is tuple:
            return {"t": [enc(v, path + (i,)) for i, v in enumerate(x)]}
        if t is dict or t is OrderedDict:
            items = []
            for k, v in x.items():
                if type(k) is not str and type(k) is not int:
                    raise UnsupportedTypeError(
                        f"dict key {k!r} of type {type(k).__name__} at {format_path(path)}: "
                        "keys must be str or int")
                # k is exactly str or int here, so isinstance() is the same test as type() is
                key = k if isinstance(k, str) or -_INT_JSON <= k < _INT_JSON else {"i": hex(k)}
                items.append([key, enc(v, path + (k,))])
            if t is dict:
                return {"d": items}
            node = {"o": items}
            if hasattr(x, "_metadata"):
                node["m"] = enc(x._metadata, path + ("_metadata",))
            return node
        leaf = leaf_hook(x, path)
        if leaf is not None:
            leaves.append(leaf)
            return {"T": len(leaves) - 1}
        raise UnsupportedTypeError(
            f"unsupported object of type {t.__module__}.{t.__qualname__} at {format_path(path)}: "
            "states hold dicts, lists, tuples, tensors, numpy arrays, int, float, bool, None, str, bytes")

    return enc(obj, ()), leaves


#: Renders a hostile node for an error message without recursing into it (a plain repr of a deeply
#: nested node raised RecursionError from inside the decoder).
_PREVIEW = reprlib.Repr()
_PREVIEW.maxlevel = 2
_PREVIEW.maxstring = 40
_PREVIEW.maxother = 40


def _bad(msg: str, path: Path) -> FormatError:
    return FormatError(f"manifest state: {msg} at {format_path(path)}")


def unflatten(node: Any, leaf: Callable[[int, Path], Any]) -> Any:
    """Decode a skeleton; ``leaf(index, path)`` supplies the value of each array leaf."""

    def dec(n: Any, path: Path) -> Any:
        if len(path) > MAX_DEPTH:
            raise _bad("nesting too deep", path)
        t = type(n)
        if n is None or t is bool or t is int or t is str:
            return n
        if t is list:
            return [dec(v, path + (i,)) for i, v in enumerate(n)]
        if t is dict and set(n) == {"o", "m"}:
            od = dec({"o": n["o"]}, path)
            od._metadata = dec(n["m"], path + ("_metadata",))
            return od
        if t is not dict or len(n) != 1:
            raise _bad(f"invalid node {_PREVIEW.repr(n)[:60]!r}", path)
        (tag, body), = n.items()
        if tag == "f":
            if type(body) is not str:
                raise _bad("float body is not a string", path)
            try:
                return float.fromhex(body)
            except (ValueError, OverflowError):
                raise _bad(f"invalid float {body[:40]!r}", path) from None
        if tag == "i":
            if type(body) is not str or not _HEX_INT.fullmatch(body):
                raise _bad("invalid big int", path)
            return int(body, 16)
        if tag == "n":
            if type(body) is not str or not _NAN_BITS.fullmatch(body):
                raise _bad("invalid NaN bits", path)
            return struct.unpack(">d", bytes.fromhex(body))[0]
        if tag == "b":
            if type(body) is not str:
                raise _bad("bytes body is not a string", path)
            try:
                return base64.b64decode(body.encode("ascii"), validate=True)
            except (binascii.Error, UnicodeEncodeError, ValueError):
                raise _bad("invalid base64", path) from None
        if tag == "t":
            if type(body) is not list:
                raise _bad("tuple body is not a list", path)
            return tuple(dec(v, path + (i,)) for i, v in enumerate(body))
        if tag == "d" or tag == "o":
            if type(body) is not list:
                raise _bad("dict body is not a list", path)
            out: dict = {} if tag == "d" else OrderedDict()
            for item in body:
                if type(item) is not list or len(item) != 2:
                    raise _bad("invalid dict item", path)
                key = item[0]
                if type(key) is dict and set(key) == {"i"}:
                    key = dec(key, path)  # a big int key
                elif type(key) not in (str, int):
                    raise _bad("invalid dict key", path)
                out[key] = dec(item[1], path + (key,))
            return out
        if tag == "T":
            if type(body) is not int or body < 0:
                raise _bad("invalid tensor index", path)
            return leaf(body, path)
        raise _bad(f"unknown tag {tag!r}", path)

    return dec(node, ())


def top_level_items(node: Any) -> list[tuple[PathKey, Any]] | None:
    """The (key, node) pairs of a dict skeleton's top level, or None when the root is not a dict."""
    if type(node) is dict and set(node) in ({"d"}, {"o"}, {"o", "m"}):
        body = node.get("d", node.get("o"))
        if type(body) is list:
            return [(item[0], item[1]) for item in body if type(item) is list and len(item) == 2]
    return None


def _children(n: Any) -> list[Any]:
    if type(n) is list:
        return n
    if type(n) is not dict:
        return []
    out: list[Any] = []
    for tag, body in n.items():
        if tag == "t" and type(body) is list:
            out.extend(body)
        elif tag in ("d", "o") and type(body) is list:
            out.extend(item[1] for item in body if type(item) is list and len(item) == 2)
        elif tag == "m":
            out.append(body)
    return out


def leaf_paths(node: Any) -> dict[int, Path]:
    """The structured path of every array leaf under ``node``: leaf index -> tuple of typed keys
    (str or int dict keys, int list/tuple positions), so ``{"a/b": x}`` and ``{"a": {"b": y}}``,
    or the keys ``1`` and ``"1"``, give distinct paths. An OrderedDict's ``_metadata`` node is
    reached through the key ``"_metadata"``, as in :func:`flatten`. Malformed nodes are skipped;
    a leaf index that appears twice keeps its first path."""
    out: dict[int, Path] = {}
    stack: list[tuple[Any, Path]] = [(node, ())]
    while stack:
        n, path = stack.pop()
        if len(path) > MAX_DEPTH:
            continue
        if type(n) is list:
            stack.extend((v, path + (i,)) for i, v in enumerate(n))
        elif type(n) is dict:
            if len(n) == 1 and type(n.get("T")) is int:
                out.setdefault(n["T"], path)
                continue
            for tag, body in n.items():
                if tag == "t" and type(body) is list:
                    stack.extend((v, path + (i,)) for i, v in enumerate(body))
                elif tag in ("d", "o") and type(body) is list:
                    for item in body:
                        if type(item) is list and len(item) == 2:
                            key = item[0]
                            if type(key) is dict and type(key.get("i")) is str and \
                                    _HEX_INT.fullmatch(key["i"]):
                                key = int(key["i"], 16)
                            if type(key) in (str, int):
                                stack.append((item[1], path + (key,)))
                elif tag == "m":
                    stack.append((body, path + ("_metadata",)))
    return out


def leaf_indices(node: Any) -> list[int]:
    """Indices of every array leaf under ``node`` (used to plan a partial load)."""
    out: list[int] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if type(n) is dict and len(n) == 1 and type(n.get("T")) is int:
            out.append(n["T"])
        else:
            stack.extend(_children(n))
    return out


def renumber_leaves(node: Any, mapping: dict[int, int]) -> Any:
    """A copy of skeleton ``node`` with every array leaf ``{"T": i}`` replaced by
    ``{"T": mapping[i]}`` (the rest unchanged). FormatError for a leaf ``mapping`` lacks."""

    def walk(n: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise FormatError("manifest state: nesting too deep")
        if type(n) is list:
            return [walk(v, depth + 1) for v in n]
        if type(n) is not dict:
            return n
        if len(n) == 1 and type(n.get("T")) is int:
            if n["T"] not in mapping:
                raise FormatError(f"manifest state: tensor index {n['T']} is not in the part")
            return {"T": mapping[n["T"]]}
        return {tag: walk(body, depth + 1) for tag, body in n.items()}

    return walk(node, 0)
