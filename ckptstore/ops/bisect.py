"""bisect: the first iteration of a range at which a condition holds (issue 17, section 2).

    store.bisect("nan")                       # the first state with a NaN in any tensor
    store.bisect("inf", start=1000)           # ... with a non-finite value (+-inf or NaN)
    store.bisect("loss > 10")                 # a numeric meta key against a number: no tensor read
    store.bisect("mychecks:diverged")         # a function of the state, imported, returning bool
    store.bisect(lambda state: ..., end=5000) # the same, as a callable

Conditions (:func:`parse_condition`):

* ``"nan"``: some floating-point or complex tensor of the state holds a NaN;
* ``"inf"``: some tensor holds a non-finite value, +-inf *or NaN*: an infinity becomes a NaN
  within a step or two of training (``inf - inf``, ``0 * inf``), so "holds an infinity" alone
  would not stay true;
* ``"KEY OP NUMBER"``: the numeric meta value ``KEY`` (``store.meta(it)[KEY]``; a dotted key
  also reaches into nested dicts) compared with ``>``, ``>=``, ``<``, ``<=``, ``==`` or ``!=``.
  Parsed here, never evaluated as Python. A NaN meta value satisfies only ``!=``;
* ``"module:function"``: ``function(state) -> bool`` of the importable ``module`` (dotted
  attribute paths allowed), or a callable given directly to the API.

Invariants:

* **The condition is monotone.** Bisect assumes that once the condition holds at an iteration it
  holds at every later one (a NaN in a weight stays: every later step reads it). It then
  returns the first iteration of the range where it holds. For a condition that holds and stops
  holding again, it returns *an* iteration where it holds whose predecessor among those it
  looked at does not, not necessarily the first one; it never reports an iteration where the
  condition was not seen to hold.
* **States: bases only, then one replay.** For a condition on the state, the binary search
  loads only base snapshots of the range (``store.kind(it) == "snapshot"``): at most
  ``ceil(log2(bases + 1))`` of them, to find the one base interval where the condition flips
  (the last base where it does not hold, the first where it does). Only that interval's deltas
  are then reconstructed, by one sequential :meth:`ckptstore.Store.replay` that stops at the
  first hit (replay is sequential anyway: the state at t needs t - 1). A linear scan would
  reconstruct one state per iteration of the range (a multi-rank :class:`ckptstore.JobStore`
  replays each rank's part in step and combines them as its ``load`` does).
* **Meta conditions read manifests only** (``store.meta``): a binary search over every
  iteration of the range, with no tensor loaded. An iteration whose meta lacks the key is
  skipped (the base a Checkpointer writes at its first ``restore()`` has no meta); a key that no
  iteration looked at holds is an error (a typo), not "never".
* Nothing is written: the store may be a reader or the writer, and it is not changed.
* Bad input raises :class:`ckptstore.errors.BisectError` (a ``ValueError``): a range holding no
  committed iteration, a malformed condition, a ``module:function`` that cannot be imported. A
  condition that fails at an iteration (the function raises, a meta value is not a number)
  raises :class:`ckptstore.errors.BisectPredicateError` naming that iteration, with the original
  error as ``__cause__``. Errors of the store itself (a delta that cannot be replayed:
  DeltaChainError, ...) pass through unchanged.
"""

from __future__ import annotations

import importlib
import itertools
import math
import operator
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Union

from ..errors import BisectError, BisectPredicateError

__all__ = ["BisectResult", "BisectSource", "Condition", "TensorFinding", "bisect",
           "parse_condition", "FIRST_ELEMENTS"]

#: flat element indices reported per tensor for "nan" / "inf"
FIRST_ELEMENTS = 5

_OPERATORS: dict[str, Callable[[Any, Any], bool]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le,
    "==": operator.eq, "!=": operator.ne}
_META = re.compile(r"\s*(?P<key>[^\s<>=!]+)\s*(?P<op>>=|<=|==|!=|>|<)\s*(?P<value>\S+)\s*")
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_FUNCTION = re.compile(rf"\s*(?P<module>{_IDENT}(?:\.{_IDENT})*):(?P<name>{_IDENT}(?:\.{_IDENT})*)\s*")
_FORMS = ('"nan", "inf", "KEY OP NUMBER" (OP one of > >= < <= == !=, e.g. "loss > 10") '
          'or "module:function"')


@dataclass(frozen=True)
class Condition:
    """A parsed bisect condition. ``kind``: "nan" | "inf" | "meta" | "function"."""

    text: str
    kind: str
    key: str | None = None
    op: str | None = None
    threshold: int | float | None = None
    function: Callable[[Any], Any] | None = None

    @property
    def needs_state(self) -> bool:
        return self.kind != "meta"

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class TensorFinding:
    """A tensor of the state at the found iteration holding NaN or infinite values."""

    path: str             # e.g. "model.fc.weight", "optimizer.state.0.exp_avg"
    nan: int              # NaN elements
    inf: int              # +-inf elements
    numel: int
    indices: tuple[int, ...]  # the first few flat indices of the affected elements


@dataclass(frozen=True)
class BisectResult:
    """What :func:`bisect` found."""

    #: the first iteration of the range where the condition holds; None when it never does
    iteration: int | None
    condition: str
    #: the range searched (inclusive)
    start: int
    end: int
    #: "nan" / "inf": the affected tensors at ``iteration``, in state order
    tensors: tuple[TensorFinding, ...] = ()
    #: meta conditions: the key's value at ``iteration``
    value: int | float | None = None
    #: states read through ``load`` (base snapshots of the search, the base the replay starts
    #: from, and on stores without replay each state of the interval)
    loaded: int = 0
    #: states rebuilt by the interval's replay
    replayed: int = 0
    #: manifests read for their meta
    meta_reads: int = 0
    #: the iterations walked after the binary search (first, last), if any
    interval: tuple[int, int] | None = None
    seconds: float = 0.0

    @property
    def found(self) -> bool:
        return self.iteration is not None


class BisectSource(Protocol):
    """What bisect reads: a :class:`ckptstore.Store` or :class:`ckptstore.JobStore`
    (``replay(lo, hi)`` is used when the store has it)."""

    def iterations(self) -> list[int]: ...

    def kind(self, iteration: int) -> str: ...

    def meta(self, iteration: int) -> Any: ...

    def load(self, iteration: int) -> Any: ...


Predicate = Union[str, Condition, Callable[[Any], Any]]


# ---- conditions --------------------------------------------------------------------------------
def parse_condition(spec: Predicate) -> Condition:
    """A :class:`Condition` from a string (see the module docstring) or a callable taking the
    state. BisectError for a malformed string or a ``module:function`` that cannot be imported
    or is not callable. Imports the module named by ``module:function``, nothing else."""
    if isinstance(spec, Condition):
        return spec
    if not isinstance(spec, str):
        if callable(spec):
            name = getattr(spec, "__qualname__", None) or type(spec).__name__
            return Condition(f"{getattr(spec, '__module__', '?')}:{name}", "function",
                             function=spec)
        raise BisectError(f"a bisect condition is a string ({_FORMS}) or a callable taking the "
                          f"state, not {type(spec).__name__}")
    text = spec.strip()
    if text.lower() in ("nan", "inf"):
        return Condition(text.lower(), text.lower())
    if any(c in text for c in "<>=!"):
        m = _META.fullmatch(spec)
        if m is None:
            raise BisectError(f"malformed bisect condition {spec!r}: a meta condition is KEY OP "
                              "NUMBER with OP one of > >= < <= == != (e.g. \"loss > 10\")")
        threshold = _number(m["value"], spec)
        return Condition(f"{m['key']} {m['op']} {m['value']}", "meta", key=m["key"],
                         op=m["op"], threshold=threshold)
    m = _FUNCTION.fullmatch(spec)
    if m is None:
        raise BisectError(f"malformed bisect condition {spec!r}: expected {_FORMS}")
    return Condition(text, "function", function=_import_function(m["module"], m["name"], text))


def _number(token: str, spec: str) -> int | float:
    try:
        return int(token)
    except ValueError:
        pass
    try:
        value = float(token)
    except ValueError:
        raise BisectError(f"malformed bisect condition {spec!r}: {token!r} is not a number") from None
    if math.isnan(value):
        raise BisectError(f"malformed bisect condition {spec!r}: nothing compares with NaN "
                          "(use the condition \"nan\" for NaN tensors)")
    return value


def _import_function(module: str, name: str, text: str) -> Callable[[Any], Any]:
    try:
        obj: Any = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - whatever the import raised, named in the message
        raise BisectError(f"bisect condition {text!r}: cannot import module {module!r} "
                          f"({type(e).__name__}: {e})") from e
    for part in name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise BisectError(f"bisect condition {text!r}: module {module!r} has no "
                              f"attribute {name!r}") from None
    if not callable(obj):
        raise BisectError(f"bisect condition {text!r}: {module}.{name} is a "
                          f"{type(obj).__name__}, not a function")
    return obj


# ---- the search --------------------------------------------------------------------------------
def bisect(source: BisectSource, predicate: Predicate, start: int | None = None,
           end: int | None = None, *, meta: Callable[[int], Any] | None = None,
           load: Callable[[int], Any] | None = None,
           replay: Callable[[int, int], Iterator[tuple[int, Any]]] | None = None
           ) -> BisectResult:
    """The first iteration in ``start..end`` (inclusive; defaults: the first and the last
    committed iteration) where ``predicate`` holds, assuming that once it holds it holds at every
    later iteration (see the module docstring for the conditions, the invariants and the
    errors). ``meta`` / ``load`` / ``replay``: how to read an iteration's meta / state / a range
    of states (default ``source.meta`` / ``source.load`` / ``source.replay`` when it has one; a
    job store passes its rank)."""
    t0 = time.perf_counter()
    cond = parse_condition(predicate)
    its = _range(source, start, end)
    if cond.kind == "meta":
        out = _bisect_meta(cond, its, meta or source.meta)
    else:
        out = _bisect_states(source, cond, its, load or source.load,
                             replay or getattr(source, "replay", None))
    return BisectResult(condition=cond.text, start=its[0] if start is None else start,
                        end=its[-1] if end is None else end,
                        seconds=time.perf_counter() - t0, **out)


def _range(source: BisectSource, start: int | None, end: int | None) -> list[int]:
    for name, v in (("start", start), ("end", end)):
        if v is not None and (type(v) is not int):
            raise BisectError(f"bisect: {name} must be an int iteration, not {v!r}")
    where = getattr(source, "path", "the store")
    every = source.iterations()
    if not every:
        raise BisectError(f"bisect: {where} holds no committed iteration")
    if start is not None and end is not None and start > end:
        raise BisectError(f"bisect: start {start} is after end {end}")
    its = [it for it in every if (start is None or it >= start) and (end is None or it <= end)]
    if not its:
        span = f"in {start}..{end}" if start is not None and end is not None else \
            f"at or after {start}" if start is not None else f"at or before {end}"
        raise BisectError(f"bisect: {where} holds no committed iteration {span} (its "
                          f"iterations run {every[0]}..{every[-1]})")
    return its


def _bisect_states(source: BisectSource, cond: Condition, its: list[int],
                   load: Callable[[int], Any],
                   replay: Callable[[int, int], Iterator[tuple[int, Any]]] | None
                   ) -> dict[str, Any]:
    loaded = replayed = 0
    findings: dict[int, tuple[TensorFinding, ...]] = {}

    def holds(it: int, state: Any) -> bool:
        if cond.kind == "function":
            assert cond.function is not None
            try:
                return bool(cond.function(state))
            except Exception as e:  # noqa: BLE001 - wrapped, naming the iteration
                raise BisectPredicateError(
                    f"bisect condition {cond.text!r} raised at iteration {it}: "
                    f"{type(e).__name__}: {e}", it) from e
        found = tuple(_nonfinite(state, nan_only=cond.kind == "nan"))
        if found:
            findings[it] = found
        return bool(found)

    # binary search over the range's bases: the first base where the condition holds
    bases = [it for it in its if source.kind(it) == "snapshot"]
    lo, hi = 0, len(bases)
    while lo < hi:
        mid = (lo + hi) // 2
        state = load(bases[mid])
        loaded += 1
        if holds(bases[mid], state):
            hi = mid
        else:
            lo = mid + 1
        del state
    after = bases[lo - 1] if lo > 0 else None      # the last base where it does not hold
    first = bases[lo] if lo < len(bases) else None  # the first base where it does
    # the one interval where it flips: deltas only (every snapshot of the range is a base)
    walk = [it for it in its if (after is None or it > after) and (first is None or it < first)]
    hit = None
    if walk:
        if replay is not None:
            loaded += 1  # the base the replay starts from
            states: Iterator[tuple[int, Any]] = replay(walk[0], walk[-1])
        else:
            states = ((it, load(it)) for it in walk)
        try:
            for it, state in states:
                if replay is not None:
                    replayed += 1
                else:
                    loaded += 1
                if holds(it, state):
                    hit = it
                    break
        finally:
            close = getattr(states, "close", None)
            if close is not None:
                close()  # a replay stops its read-ahead thread
    if hit is None:
        hit = first
    return {"iteration": hit, "tensors": findings.get(hit, ()) if hit is not None else (),
            "loaded": loaded, "replayed": replayed,
            "interval": (walk[0], walk[-1]) if walk else None}


_MISSING = object()


def _bisect_meta(cond: Condition, its: list[int], read: Callable[[int], Any]) -> dict[str, Any]:
    assert cond.key is not None and cond.op is not None and cond.threshold is not None
    key, compare, threshold = cond.key, _OPERATORS[cond.op], cond.threshold
    values: dict[int, Any] = {}   # index in its -> the key's value, or _MISSING
    last_meta: list[Any] = [None]

    def value_at(i: int) -> Any:
        if i not in values:
            m = read(its[i])
            last_meta[0] = (its[i], m)
            v = _lookup(m, key)
            if v is not _MISSING and (type(v) not in (int, float, bool)):
                raise BisectPredicateError(
                    f"bisect condition {cond.text!r}: meta {key!r} at iteration {its[i]} is "
                    f"{v!r} ({type(v).__name__}), not a number", its[i])
            values[i] = v
        return values[i]

    def probe(mid: int, lo: int, hi: int) -> int | None:
        """The index nearest ``mid`` in lo..hi-1 whose meta holds the key (right first)."""
        for i in itertools.chain(range(mid, hi), range(mid - 1, lo - 1, -1)):
            if value_at(i) is not _MISSING:
                return i
        return None

    lo, hi = 0, len(its)
    while lo < hi:
        j = probe((lo + hi) // 2, lo, hi)
        if j is None:
            break  # no iteration in lo..hi-1 has the key: the answer is its[hi] (or none)
        if compare(values[j], threshold):
            hi = j
        else:
            lo = j + 1
    if not any(v is not _MISSING for v in values.values()):
        it, m = last_meta[0] if last_meta[0] is not None else (its[-1], None)
        has = sorted(map(str, m)) if isinstance(m, dict) else []
        raise BisectError(f"bisect condition {cond.text!r}: no iteration looked at in "
                          f"{its[0]}..{its[-1]} has the meta key {key!r} (iteration {it} has "
                          f"{', '.join(has) or 'no meta'})")
    found = its[hi] if hi < len(its) else None
    return {"iteration": found, "value": values[hi] if found is not None else None,
            "meta_reads": len(values)}


def _lookup(meta: Any, key: str) -> Any:
    """``meta[key]``, else through nested dicts along a dotted key; _MISSING when absent."""
    if isinstance(meta, dict) and key in meta:
        return meta[key]
    node = meta
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


# ---- tensors -----------------------------------------------------------------------------------
def _nonfinite(state: Any, nan_only: bool, limit: int = FIRST_ELEMENTS) -> Iterator[TensorFinding]:
    """Every floating-point or complex tensor (torch or numpy) of ``state`` holding NaN (and,
    unless ``nan_only``, +-inf), in state order, named by its dotted path."""
    import numpy as np
    import torch

    def finding(path: str, nan: Any, inf: Any, numel: int) -> Iterator[TensorFinding]:
        n_nan, n_inf = int(nan.sum()), int(inf.sum())
        if n_nan or (n_inf and not nan_only):
            bad = nan if nan_only else nan | inf
            idx = bad.nonzero()[0][:limit] if isinstance(bad, np.ndarray) \
                else torch.nonzero(bad).reshape(-1)[:limit]
            yield TensorFinding(path, n_nan, n_inf, numel, tuple(int(i) for i in idx.tolist()))

    def visit(x: Any, path: str) -> Iterator[TensorFinding]:
        if isinstance(x, torch.Tensor):
            if x.is_floating_point() or x.is_complex():
                flat = x.detach().reshape(-1)
                try:
                    nan, inf = torch.isnan(flat), torch.isinf(flat)
                except (RuntimeError, TypeError):  # a dtype without isnan here (float8, ...)
                    wide = flat.to(torch.complex128 if x.is_complex() else torch.float64)
                    nan, inf = torch.isnan(wide), torch.isinf(wide)
                yield from finding(path, nan, inf, flat.numel())
        elif isinstance(x, np.ndarray):
            if np.issubdtype(x.dtype, np.inexact):
                arr = x.reshape(-1)
                yield from finding(path, np.isnan(arr), np.isinf(arr), arr.size)
        elif isinstance(x, dict):
            for k, v in x.items():
                yield from visit(v, f"{path}.{k}" if path else str(k))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                yield from visit(v, f"{path}.{i}" if path else str(i))

    return visit(state, "")
