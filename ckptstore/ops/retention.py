"""Retention policies: which committed iterations a gc keeps. Pure: no file I/O, no clock read
unless the caller passes none.

A policy looks at the committed checkpoints, each a :class:`Checkpoint` ``(iteration, kind,
created_ns, meta)``, and selects the iterations it wants kept::

    KeepLast(3)                      the 3 newest iterations
    KeepEvery(1000)                  every iteration that is a multiple of 1000
    KeepBest(2, "val.loss", "min")   the 2 iterations with the lowest meta["val"]["loss"]
    KeepNewerThan(6 * 3600)          every iteration committed at most 6 h before ``now``
    KeepSinceIteration(5000)         every iteration >= 5000

Policies compose with ``|`` (:class:`AnyOf`): a policy set keeps the **union** of what each of
its policies keeps. :func:`plan_retention` turns a selection into a gc plan:

1. the policy's selection, which must not be empty (else :class:`~ckptstore.errors.
   RetentionError`: nothing is removed);
2. plus the latest committed iteration (always kept);
3. closed under the delta chain rule by :func:`chain_closure`: a kept delta keeps its base
   snapshot and every delta between (format-spec/deltas.md, "Chain rule" and "Garbage
   collection"), so every kept iteration stays recoverable after the gc. Opt-in
   (``gc --follower-bases``): a walk down a kept delta's chain may stop at a delta gc can replace
   by a verified follower base (:func:`rebasing_closure`, format-spec/follower.md section 6).

What ``ckptstore gc`` and :meth:`ckptstore.Store.gc` do with the plan (copy the kept
checkpoints, delete the rest) is :mod:`ckptstore.ops.gc`.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple, Sequence

from ..errors import RetentionError

__all__ = ["Checkpoint", "Policy", "KeepLast", "KeepEvery", "KeepBest", "KeepNewerThan",
           "KeepSinceIteration", "AnyOf", "RetentionPlan", "chain_closure", "rebasing_closure", "plan_retention",
           "policy_from_options", "parse_duration", "metric_value"]

SNAPSHOT = "snapshot"
DELTA = "delta"


class Checkpoint(NamedTuple):
    """One committed iteration as a policy sees it (a plain 4-tuple works as well).

    ``kind``: "snapshot" (a base) or "delta"; ``created_ns``: the commit's wall-clock creation
    time (ns since the epoch); ``meta``: the user's meta dict, or None when the caller did not
    read it (only :class:`KeepBest` looks at it)."""

    iteration: int
    kind: str
    created_ns: int
    meta: Any = None


def _positive_int(value: Any, what: str) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"{what} must be an int >= 1, not {value!r}")


class Policy:
    """A retention policy: :meth:`select` returns the iterations it keeps. Subclasses are frozen
    dataclasses; ``a | b`` is the policy set keeping the union of both selections."""

    def select(self, checkpoints: Sequence[Checkpoint], now_ns: int) -> frozenset[int]:
        """The iterations of ``checkpoints`` (ascending, distinct iterations) this policy keeps:
        always a subset of theirs. ``now_ns``: the current wall-clock time (ns since the epoch)."""
        raise NotImplementedError

    @property
    def uses_meta(self) -> bool:
        """Whether :meth:`select` reads ``meta`` (callers may skip reading manifests otherwise)."""
        return False

    def __or__(self, other: "Policy") -> "AnyOf":
        if not isinstance(other, Policy):
            return NotImplemented
        return AnyOf((self, other))


@dataclass(frozen=True)
class KeepLast(Policy):
    """The ``n`` newest iterations (``n >= 1``)."""

    n: int

    def __post_init__(self) -> None:
        _positive_int(self.n, "keep_last")

    def select(self, checkpoints: Sequence[Checkpoint], now_ns: int) -> frozenset[int]:
        return frozenset(c[0] for c in checkpoints[-self.n:])

    def __str__(self) -> str:
        return f"the last {self.n}"


@dataclass(frozen=True)
class KeepEvery(Policy):
    """Every iteration that is a multiple of ``k`` (``k >= 1``; iteration 0 included)."""

    k: int

    def __post_init__(self) -> None:
        _positive_int(self.k, "keep_every")

    def select(self, checkpoints: Sequence[Checkpoint], now_ns: int) -> frozenset[int]:
        return frozenset(c[0] for c in checkpoints if c[0] % self.k == 0)

    def __str__(self) -> str:
        return f"every {self.k}th"


_MISSING = object()


def metric_value(meta: Any, key: str) -> float | None:
    """The number at ``key`` in ``meta`` (``meta[key]``, else along a dotted key through nested
    dicts, as ``bisect`` reads meta), or None when it is absent, not an int or float (a bool is
    no number), or NaN."""
    node: Any = _MISSING
    if isinstance(meta, dict) and key in meta:
        node = meta[key]
    elif isinstance(meta, dict):
        node = meta
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
    if type(node) not in (int, float) or (type(node) is float and math.isnan(node)):
        return None
    return float(node)


@dataclass(frozen=True)
class KeepBest(Policy):
    """The ``n`` iterations with the best value of the numeric meta key ``metric`` (a dotted key
    reaches into nested dicts): the lowest for ``mode="min"``, the highest for ``"max"``. Ties
    go to the newer iteration. Iterations whose meta lacks a number there (or holds NaN) are
    never selected by this policy."""

    n: int
    metric: str
    mode: str = "min"

    def __post_init__(self) -> None:
        _positive_int(self.n, "keep_best")
        if type(self.metric) is not str or not self.metric:
            raise ValueError(f"metric must be a non-empty str, not {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f'mode must be "min" or "max", not {self.mode!r}')

    @property
    def uses_meta(self) -> bool:
        return True

    def select(self, checkpoints: Sequence[Checkpoint], now_ns: int) -> frozenset[int]:
        sign = 1.0 if self.mode == "min" else -1.0
        scored = []
        for c in checkpoints:
            v = metric_value(c[3], self.metric)
            if v is not None:
                scored.append((sign * v, -c[0]))
        scored.sort()
        return frozenset(-it for _, it in scored[:self.n])

    def __str__(self) -> str:
        return f"the best {self.n} by {self.metric} ({self.mode})"


@dataclass(frozen=True)
class KeepNewerThan(Policy):
    """Every iteration committed at most ``seconds`` before ``now`` (by its commit's
    ``created_ns``, a wall-clock time: a clock set back or forward moves the bound with it)."""

    seconds: float

    def __post_init__(self) -> None:
        s = self.seconds
        if type(s) not in (int, float) or not math.isfinite(s) or s < 0:
            raise ValueError(f"keep_newer_than must be a finite number of seconds >= 0, not {s!r}")

    def select(self, checkpoints: Sequence[Checkpoint], now_ns: int) -> frozenset[int]:
        bound = now_ns - round(self.seconds * 1e9)
        return frozenset(c[0] for c in checkpoints if c[2] >= bound)

    def __str__(self) -> str:
        return f"newer than {format_duration(self.seconds)}"


@dataclass(frozen=True)
class KeepSinceIteration(Policy):
    """Every iteration ``>= iteration``."""

    iteration: int

    def __post_init__(self) -> None:
        if type(self.iteration) is not int or self.iteration < 0:
            raise ValueError(f"keep_since_iteration must be an int >= 0, not {self.iteration!r}")

    def select(self, checkpoints: Sequence[Checkpoint], now_ns: int) -> frozenset[int]:
        return frozenset(c[0] for c in checkpoints if c[0] >= self.iteration)

    def __str__(self) -> str:
        return f"since iteration {self.iteration}"


@dataclass(frozen=True)
class AnyOf(Policy):
    """A policy set: keeps the union of what each of ``policies`` keeps (at least one; nested
    sets are flattened, so ``a | b | c`` is one AnyOf of three)."""

    policies: tuple[Policy, ...]

    def __post_init__(self) -> None:
        flat: list[Policy] = []
        for p in tuple(self.policies):
            if isinstance(p, AnyOf):
                flat.extend(p.policies)
            elif isinstance(p, Policy):
                flat.append(p)
            else:
                raise TypeError(f"AnyOf takes retention policies, not {p!r}")
        if not flat:
            raise ValueError("a policy set needs at least one policy")
        object.__setattr__(self, "policies", tuple(flat))

    @property
    def uses_meta(self) -> bool:
        return any(p.uses_meta for p in self.policies)

    def select(self, checkpoints: Sequence[Checkpoint], now_ns: int) -> frozenset[int]:
        out: frozenset[int] = frozenset()
        for p in self.policies:
            out = out | p.select(checkpoints, now_ns)
        return out

    def __str__(self) -> str:
        return ", ".join(str(p) for p in self.policies)


def chain_closure(layout: Iterable[tuple[int, str]], keep: Iterable[int]) -> frozenset[int]:
    """``keep`` plus every iteration a kept delta needs: its base snapshot and every delta
    between. ``layout`` lists the committed iterations as ``(iteration, kind)``, kind "delta" or
    anything else (a snapshot); ``keep`` must be a subset of its iterations (else ValueError).

    Invariant (the chain rule of format-spec/deltas.md: delta *t* is recoverable iff *t-1* is
    committed and recoverable): the result R is the smallest superset of ``keep`` such that for
    every delta *t* in R whose predecessor *t-1* is committed, *t-1* is in R. Hence an iteration
    recoverable in ``layout`` and kept stays recoverable in the layout restricted to R: a gc
    keeping R never breaks a chain a kept iteration needs. A delta whose predecessor is not
    committed (a chain already broken) pulls in nothing below the gap.
    """
    return rebasing_closure(layout, keep, None)[0]


def rebasing_closure(layout: Iterable[tuple[int, str]], keep: Iterable[int],
                     can_rebase: Callable[[int], bool] | None
                     ) -> tuple[frozenset[int], frozenset[int]]:
    """:func:`chain_closure` where a delta may become a snapshot: ``can_rebase(t)`` says whether
    gc can replace delta *t* by a snapshot of the same state (a verified follower base,
    format-spec/follower.md section 6). Returns (R, rebased).

    Walking down from each kept iteration, newest first, the walk stops at the first delta *t*
    with ``can_rebase(t)`` instead of going on to the chain's base. ``rebased`` = the deltas
    where some walk stopped so and whose predecessor is not in R for another reason (a delta
    whose predecessor is kept anyway stays a delta: rebasing it would add a base and free
    nothing). Invariant: with every member of ``rebased`` a snapshot, R satisfies the invariant
    of :func:`chain_closure`, so every kept recoverable iteration stays recoverable; and R is a
    subset of :func:`chain_closure`'s result. ``can_rebase`` is asked only about deltas a walk
    reaches (it may be costly), each at most once per walk."""
    kinds = dict(layout)
    out: set[int] = set()
    stops: set[int] = set()
    for it in sorted(keep, reverse=True):
        if it not in kinds:
            raise ValueError(f"iteration {it} is not in the layout")
        p = it
        # every member of ``out`` already has its whole chain in ``out``: stop at the first one
        while p not in out:
            out.add(p)
            if kinds[p] != DELTA or p - 1 not in kinds:
                break
            if can_rebase is not None and p - 1 not in out and can_rebase(p):
                stops.add(p)
                break
            p -= 1
    rebased = frozenset(p for p in stops if p - 1 not in out)
    return frozenset(out), rebased


@dataclass(frozen=True)
class RetentionPlan:
    """What a gc with a policy keeps and removes.

    Invariants: ``kept`` and ``removed`` are ascending, disjoint and together every committed
    iteration; ``selected`` (the policy's own choice) is a subset of ``kept``; the latest
    committed iteration is in ``kept``; ``kept`` is closed under the chain rule
    (:func:`chain_closure`) once every iteration of ``rebased`` (kept deltas gc replaces by a
    snapshot of the same state, :func:`rebasing_closure`; empty unless the plan was asked to
    rebase) is a snapshot; ``added`` = ``kept`` minus ``selected`` (the latest iteration and
    what kept deltas need)."""

    kept: tuple[int, ...]
    removed: tuple[int, ...]
    selected: tuple[int, ...]
    added: tuple[int, ...]
    rebased: tuple[int, ...] = ()


def plan_retention(checkpoints: Iterable[Checkpoint | tuple[int, str, int, Any]], policy: Policy,
                   now_ns: int | None = None,
                   can_rebase: Callable[[int], bool] | None = None) -> RetentionPlan:
    """Apply ``policy`` to the committed ``checkpoints`` (any order, distinct iterations) and
    return the plan (see :class:`RetentionPlan` for its invariants). ``now_ns`` defaults to the
    current wall-clock time. ``can_rebase``: which deltas gc may turn into snapshots
    (:func:`rebasing_closure`; None: none, the plain chain closure).

    Raises RetentionError, and nothing is to be removed, when the policy selects none of the
    iterations of a non-empty store (it would delete every iteration but the latest: a metric no
    meta holds, a bound past the newest iteration). An empty store gives an empty plan."""
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a retention policy (ckptstore.ops.retention), not {policy!r}")
    cps = sorted((Checkpoint(*c) for c in checkpoints), key=lambda c: c.iteration)
    its = [c.iteration for c in cps]
    if len(set(its)) != len(its):
        raise ValueError("checkpoints list an iteration twice")
    if not cps:
        return RetentionPlan((), (), (), ())
    now = time.time_ns() if now_ns is None else now_ns
    selected = policy.select(cps, now)
    if not selected:
        raise RetentionError(
            f"retention policy ({policy}) keeps none of the {len(cps)} committed iterations "
            f"({its[0]}..{its[-1]}): it would delete every iteration; nothing was removed")
    kept, rebased = rebasing_closure(((c.iteration, c.kind) for c in cps), selected | {its[-1]},
                                     can_rebase)
    return RetentionPlan(tuple(sorted(kept)), tuple(i for i in its if i not in kept),
                         tuple(sorted(selected)), tuple(sorted(kept - selected)),
                         tuple(sorted(rebased)))


def policy_from_options(*, keep_last: int | None = None, keep_every: int | None = None,
                        keep_best: int | None = None, metric: str | None = None,
                        mode: str = "min", keep_newer_than: float | None = None,
                        keep_since_iteration: int | None = None,
                        policy: Policy | None = None) -> Policy:
    """The policy set of the options given (their union), as ``ckptstore gc`` flags and
    :meth:`ckptstore.Store.gc` keywords spell them; ``policy``, when given, joins the union.
    ValueError when none is given, or ``keep_best`` and ``metric`` do not come together."""
    parts: list[Policy] = []
    if keep_last is not None:
        parts.append(KeepLast(keep_last))
    if keep_every is not None:
        parts.append(KeepEvery(keep_every))
    if (keep_best is None) != (metric is None):
        raise ValueError("keep_best and metric go together (the best N by which meta key)")
    if keep_best is not None and metric is not None:
        parts.append(KeepBest(keep_best, metric, mode))
    if keep_newer_than is not None:
        parts.append(KeepNewerThan(keep_newer_than))
    if keep_since_iteration is not None:
        parts.append(KeepSinceIteration(keep_since_iteration))
    if policy is not None:
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a retention policy, not {policy!r}")
        parts.append(policy)
    if not parts:
        raise ValueError("no retention policy given (keep_last, keep_every, keep_best + metric, "
                         "keep_newer_than, keep_since_iteration or policy)")
    return parts[0] if len(parts) == 1 else AnyOf(tuple(parts))


_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")


def parse_duration(text: str) -> float:
    """Seconds in a duration such as "90", "90s", "15m", "2h", "3d", "1w" or "1h30m" (a bare
    number is seconds). ValueError for anything else."""
    s = text.strip().lower() if isinstance(text, str) else ""
    if re.fullmatch(r"\d+(?:\.\d+)?", s):
        return float(s)
    pos, total = 0, 0.0
    for m in _PART.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if not s or pos != len(s):
        raise ValueError(f"not a duration: {text!r} (e.g. 90s, 15m, 2h, 3d, 1w, 1h30m)")
    return total


def format_duration(seconds: float) -> str:
    """A short human form of ``seconds`` ("2h", "3d", "90s", "1.5h")."""
    for unit in ("w", "d", "h", "m"):
        n = seconds / _UNITS[unit]
        if n >= 1 and float(n).is_integer():
            return f"{int(n)}{unit}"
    return f"{seconds:g}s"
