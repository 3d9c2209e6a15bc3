"""The replay engine: base snapshot + delta records -> the training state at any iteration.

Normative description: format-spec/deltas.md. In short, a base snapshot written by
:class:`ckptstore.torch.Checkpointer` holds ``{"model", "optimizer", "scheduler"?, "rng",
"iteration", "ckptstore.replay"}``; the ``ckptstore.replay`` section names the optimizer class
(resolved only through :data:`OPTIMIZERS`, an allowlist of ``torch.optim`` classes: nothing named
by a store is ever imported), its defaults, the parameter names per param group in optimizer
order, tied-parameter aliases, the gradient codec and the training device.

Replay rebuilds the optimizer around the base's parameter tensors (no model class is needed), loads
the base optimizer state, and for every delta t: sets each group's hyperparameters to those in
effect at step t, sets ``p.grad`` to the decoded gradient, calls ``optimizer.step()``, then sets
the groups to their recorded post-step values (the LR scheduler's effect), takes the recorded
scheduler state, RNG states and non-parameter model state, and checks the recorded fingerprint.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator, Protocol, Sequence

from ..errors import CkptStoreError, DamagedCheckpointError, DeltaChainError, ReplayDivergenceError
from ..format.delta import OPTIMIZER_NAMES, REPLAY_KEY, REPLAY_VERSION
from .fingerprints import fingerprint_digest, parameter_norm
from .report import ReplayReport, warn_if_approximate

if TYPE_CHECKING:
    from .parallel import ShardedStep



def optimizer_class(name: str):
    import torch

    if name not in OPTIMIZER_NAMES:
        raise CkptStoreError(f"optimizer {name!r} named by the store is not replayable (allowed: "
                             f"{', '.join(OPTIMIZER_NAMES)})")
    return getattr(torch.optim, name)


#: What the engine (and torch under it) raises on a record that has the wrong structure.
_MALFORMED = (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError,
              OverflowError, ZeroDivisionError)


def _untrusted(what: str, it_arg: int):
    """Decorator for engine methods that consume a state read from a store: a record without the
    structure this module expects (a hostile or buggy writer: checksums only prove the bytes are
    the ones written) raises DamagedCheckpointError naming the iteration, never a bare KeyError or
    TypeError from the engine or torch. ``it_arg``: position of the iteration argument."""

    def wrap(fn):
        @functools.wraps(fn)
        def checked(self, *args):
            try:
                return fn(self, *args)
            except CkptStoreError:
                raise
            except _MALFORMED as e:
                raise DamagedCheckpointError(
                    f"{what} {args[it_arg]}: malformed replay record ({type(e).__name__}: "
                    f"{str(e)[:200]})") from e
        return checked
    return wrap


def on_cpu(settings: dict) -> dict:
    """A parameter group's (or an optimizer's default) settings for a replay on the CPU:
    ``capturable`` off (a chain trained with it, on a GPU, keeps its step counts on the device;
    torch refuses it on the CPU, and it changes where the count lives, not the arithmetic).
    ``settings`` itself when there is nothing to change."""
    if settings.get("capturable"):
        return dict(settings, capturable=False)
    return settings


class _StateReplayer:
    @_untrusted("base snapshot", it_arg=1)
    def __init__(self, base_state: dict, base: int) -> None:
        import torch

        from .gradcodecs import parse_codec

        info = base_state.get(REPLAY_KEY) if isinstance(base_state, dict) else None
        if not isinstance(info, dict) or info.get("v") != REPLAY_VERSION:
            raise DeltaChainError(f"base snapshot {base} has no {REPLAY_KEY!r} section of version "
                                  f"{REPLAY_VERSION}: it was not written by a Checkpointer")
        self.info = info
        self.state = dict(base_state)
        self.model = base_state["model"]
        self.iteration = base
        cls = optimizer_class(info["optimizer"])
        try:
            groups_params = [[self.model[n] for n in names] for names in info["groups"]]
        except KeyError as e:
            raise DeltaChainError(f"base snapshot {base}: parameter {e} is not in its model state") from None
        saved_groups = base_state["optimizer"]["param_groups"]
        groups = [dict({k: v for k, v in g.items() if k not in ("params", "param_names")}, params=ps)
                  for ps, g in zip(groups_params, saved_groups)]
        self._cls = cls
        self._defaults = on_cpu(dict(info.get("defaults") or {}))
        self.opt = self._make_optimizer(groups)
        self.opt.load_state_dict(base_state["optimizer"])
        for group in self.opt.param_groups:  # (the base's settings, as load_state_dict set them)
            group.update(on_cpu(group))
        self._sharded: ShardedStep | None = None
        self.params = [p for ps in groups_params for p in ps]
        self.codec = parse_codec(info["codec"])
        self.aliases = dict(info.get("aliases") or {})
        self.device_ok = info.get("device", "cpu") == "cpu"
        self.report = ReplayReport(base, base)
        if not self.device_ok:
            self.report.exact = False
            self.report.param_error_bound = None
            self.report.reasons.append(f"trained on {info.get('device')}, replayed on cpu")
        self._sgd = info["optimizer"] == "SGD"
        from .parallel import SEPARABLE_OPTIMIZERS

        #: per window slot, per parameter: reused lossy-decode buffers (separable optimizers only:
        #: they keep no reference to ``p.grad``)
        self._decode_sets: list[list[Any]] | None = [] if info["optimizer"] in SEPARABLE_OPTIMIZERS else None
        self._tiled: Any = None
        #: deltas per tiled window (1: step by step); set by :meth:`parallel`
        self._window = 1
        #: threads for a tiled window's native kernel calls; set by :meth:`parallel`
        self._threads = 1
        self._E = [0.0] * len(groups)   # per group: bound on |param error|
        self._B = [0.0] * len(groups)   # per group: bound on |momentum buffer error|
        self._torch = torch

    def _make_optimizer(self, groups: list[dict]):
        try:
            return self._cls(groups, **self._defaults)
        except TypeError:
            return self._cls(groups)

    @_untrusted("delta", it_arg=0)
    def apply(self, it: int, rec: dict) -> None:
        """Replay delta ``it`` (its record ``rec``) onto the state of iteration ``it - 1``."""
        self.begin(it, rec)
        self.step()
        self.end(it, rec)

    @_untrusted("delta", it_arg=0)
    def begin(self, it: int, rec: dict) -> None:
        """Check ``rec`` against the chain, set the hyperparameters in effect at step ``it`` and
        each parameter's gradient (lossy payloads decoded into reused buffers when the optimizer
        keeps no reference to ``p.grad``)."""
        settings = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        hypers, grads = self.prepare(it, rec, 0, settings)
        for group, hyper in zip(self.opt.param_groups, hypers):
            group.update(hyper)
        for p, g in zip(self.params, grads):
            p.grad = g

    @_untrusted("delta", it_arg=0)
    def prepare(self, it: int, rec: dict, slot: int, settings: list[dict],
                sliced: bool = False) -> tuple[list[dict], list[Any]]:
        """Check ``rec`` (the ``slot``-th delta after the engine's iteration) against the chain and
        decode its gradients (lossy payloads into slot ``slot``'s reused buffers; with ``sliced``,
        lossy payloads whose codec decodes ranges on their own stay encoded, as checked
        :class:`ckptstore.replay.gradcodecs.GradSlices` for a tiled window). ``settings``: each group's
        settings before the step, updated in place with the record's hyperparameters. Returns
        (per group: the record's hyperparameters, per parameter: its gradient or None)."""
        torch = self._torch
        if it != self.iteration + 1 + slot:
            raise DeltaChainError(f"delta {it} does not follow iteration {self.iteration + slot}")
        grads = rec["grads"]
        if len(grads) != len(self.params) or len(rec["hyper"]) != len(self.opt.param_groups):
            raise DeltaChainError(f"delta {it} does not match the optimizer of its base")
        codec = self.codec if rec.get("codec") == self.codec.name else None
        if codec is None:
            from .gradcodecs import parse_codec

            codec = parse_codec(rec["codec"])
        lossy = bool(rec.get("lossy")) and not bool(rec.get("applied"))
        errs = rec.get("err") or {}
        per_param_err = errs.get("max_abs") if lossy else None
        group_err: list[float] = []
        out: list[Any] = []
        i = 0
        bufs = None
        if self._decode_sets is not None and codec.name != "exact":
            while len(self._decode_sets) <= slot:
                self._decode_sets.append([None] * len(self.params))
            bufs = self._decode_sets[slot]
        hypers = [on_cpu(dict(h)) for h in rec["hyper"]]
        for group, hyper, cur in zip(self.opt.param_groups, hypers, settings):
            cur.update(hyper)
            d = 0.0
            for p in group["params"]:
                payload = grads[i]
                lazy = codec.slicer(payload, p) if sliced and payload is not None and codec.lossy else None
                if payload is None:
                    out.append(None)
                elif lazy is not None:
                    out.append(lazy)
                elif bufs is not None:
                    if bufs[i] is None:
                        bufs[i] = torch.empty_like(p, memory_format=torch.contiguous_format)
                    out.append(codec.decode_into(payload, bufs[i]))
                else:
                    out.append(codec.decode(payload, tuple(p.shape), p.dtype))
                if per_param_err is not None and payload is not None:
                    d = max(d, float(per_param_err[i]))
                i += 1
            group_err.append(d)
        if lossy:
            self._track_bound(group_err, settings)
            self.report.exact = False
            self.report.lossy_steps += 1
            self.report.grad_max_abs_error = max(self.report.grad_max_abs_error, max(group_err or [0.0]))
            if f"lossy codec {rec['codec']}" not in self.report.reasons:
                self.report.reasons.append(f"lossy codec {rec['codec']}")
        return hypers, out

    def tiled_ready(self) -> bool:
        """Whether the next deltas may run as a tiled window (:class:`ckptstore.replay.parallel.TiledSteps`)."""
        from .native.adam import AdamWindow
        from .parallel import TiledSteps

        return self._window > 1 and (TiledSteps.ready(self.opt, self.params)
                                     or AdamWindow.can_start(self.opt, self.params))

    def apply_window(self, items: list[tuple[int, dict]]) -> None:
        """Replay consecutive deltas ``items`` ((iteration, record), in order) as one tiled window:
        the same result as :meth:`apply` on each in turn (see TiledSteps for why), with each
        tile's data read once per window. The caller checks :meth:`tiled_ready` first, and ends a
        window at a record with a fingerprint (only the window's last state is ever whole)."""
        from .parallel import TiledSteps

        settings = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        steps, hypers = [], []
        for slot, (it, rec) in enumerate(items):
            h, grads = self.prepare(it, rec, slot, settings, True)
            steps.append(([dict(c) for c in settings], grads))
            hypers.append(h)
            self._after(it, rec, settings)
        if self._tiled is None:
            self._tiled = TiledSteps(self.opt, self.params, self._make_optimizer, threads=self._threads)
        try:
            self._tiled.run(steps)
        except _MALFORMED as e:
            raise DamagedCheckpointError(
                f"deltas {items[0][0]}..{items[-1][0]}: malformed replay record ({type(e).__name__}: "
                f"{str(e)[:200]})") from e
        for (it, rec), h in zip(items, hypers):
            for group, hyper in zip(self.opt.param_groups, h):
                group.update(hyper)
            self.end(it, rec)

    @_untrusted("delta", it_arg=0)
    def _after(self, it: int, rec: dict, settings: list[dict]) -> None:
        """``settings`` take delta ``it``'s post-step group values (as :meth:`end` does)."""
        for cur, after in zip(settings, rec["groups"]):
            cur.update(on_cpu(after))

    def step(self) -> None:
        """``optimizer.step()``, sharded across threads when :meth:`parallel` set that up."""
        if self._sharded is not None:
            self._sharded.step()
        else:
            self.opt.step()
        for p in self.params:
            p.grad = None

    @_untrusted("delta", it_arg=0)
    def end(self, it: int, rec: dict) -> None:
        """Take the post-step group settings, scheduler, RNG and buffer states of ``it`` and check
        its fingerprint."""
        for group, after in zip(self.opt.param_groups, rec["groups"]):
            group.update(on_cpu(after))
        for k in ("scheduler", "rng"):
            if k in rec:
                self.state[k] = rec[k]
        for name, t in (rec.get("buffers") or {}).items():
            self.model[name] = t
        self.iteration = it
        self.report.iteration = it
        self.report.deltas += 1
        fp = rec.get("fp")
        if fp:
            self.report.fingerprints_checked += 1
            if self.report.exact:
                digest = fingerprint_digest(self.params)
                if digest != fp["xxh3"]:
                    raise ReplayDivergenceError(
                        f"replay diverged at iteration {it}: parameter fingerprint {digest} differs "
                        f"from the recorded {fp['xxh3']} (different torch build, optimizer "
                        "implementation path or damaged record)", it)
            elif "norm" in fp:  # recorded for lossy codecs and non-CPU training (deltas.md)
                norm = parameter_norm(self.params)
                rel = abs(norm - fp["norm"]) / max(fp["norm"], 1e-30)
                self.report.measured_norm_rel_error = max(self.report.measured_norm_rel_error or 0.0, rel)

    def parallel(self, threads: int) -> None:
        """Choose how steps run. Steady-state deltas of a separable optimizer
        (:data:`ckptstore.replay.parallel.SEPARABLE_OPTIMIZERS`) run as tiled windows when a window
        holds more than one delta (:func:`ckptstore.replay.parallel.window_size`); else, with ``threads``
        > 1 and parameters large enough to gain (``PARALLEL_MIN_NUMEL``), each step is sharded
        over ``threads`` threads; else steps run sequentially. The two are exclusive: the
        sharding pool's threads each start their own OpenMP team for torch's intra-op work, and
        with those teams alive the tiled windows' ops ran 2x slower here (2 cores)."""
        from .parallel import PARALLEL_MIN_NUMEL, SEPARABLE_OPTIMIZERS, ShardedStep, window_size

        self._window = window_size(self.params)
        self._threads = max(1, threads)
        if self._window == 1 and threads > 1 and len(self.params) > 1 \
                and self.info["optimizer"] in SEPARABLE_OPTIMIZERS \
                and sum(p.numel() for p in self.params) >= PARALLEL_MIN_NUMEL:
            self._sharded = ShardedStep(self.opt, threads, self._make_optimizer)

    @property
    def window(self) -> int:
        """Deltas per tiled window (1: step by step)."""
        return self._window

    def grad_shapes(self) -> list[tuple[tuple[int, ...], Any]] | None:
        """(shape, dtype) per parameter when gradient buffers may be recycled across deltas
        (exact codec, separable optimizer: nothing keeps a reference to ``p.grad``)."""
        from .parallel import SEPARABLE_OPTIMIZERS

        if self.codec.name != "exact" or self.info["optimizer"] not in SEPARABLE_OPTIMIZERS:
            return None
        return [(tuple(p.shape), p.dtype) for p in self.params]

    def close(self) -> None:
        if self._sharded is not None:
            self._sharded.close()
            self._sharded = None
        if self._tiled is not None:
            self._tiled.close()
            self._tiled = None

    def _track_bound(self, group_err: list[float], settings: list[dict]) -> None:
        """Per-entry error bound for SGD: the step is affine in (grad, param, buffer), so errors
        propagate linearly: E' = |1 - lr*wd| E + lr * s, s = step error (see deltas.md).
        ``settings``: each group's settings in effect for the step."""
        if not self._sgd or self.report.param_error_bound is None:
            self.report.param_error_bound = None
            return
        for gi, (main, group, d) in enumerate(zip(self.opt.param_groups, settings, group_err)):
            lr, wd = float(group["lr"]), float(group.get("weight_decay", 0.0))
            mu, damp = float(group.get("momentum", 0.0)), float(group.get("dampening", 0.0))
            E, B = self._E[gi], self._B[gi]
            d_eff = d + abs(wd) * E
            if mu != 0.0:
                first = any("momentum_buffer" not in self.opt.state.get(p, {}) or
                            self.opt.state[p].get("momentum_buffer") is None for p in main["params"])
                B = d_eff if first else mu * B + abs(1 - damp) * d_eff
                s = d_eff + mu * B if group.get("nesterov") else B
            else:
                s = d_eff
            self._E[gi], self._B[gi] = E + lr * s, B
        self.report.param_error_bound = max(self._E) if self._E else 0.0

    def current(self, clone: bool) -> dict:
        for alias, canon in self.aliases.items():
            self.model[alias] = self.model[canon]
        out = dict(self.state)
        out["model"] = self.model
        out["optimizer"] = self.opt.state_dict()
        out["iteration"] = self.iteration
        if clone:
            out = _clone(out)
        if not self.report.exact:
            out["replay_report"] = self.report.to_dict()
        return out


def _clone(x: Any) -> Any:
    import copy

    return copy.deepcopy(x)


class RecordSource(Protocol):
    """What replay reads: the committed checkpoints of a store (:class:`ckptstore.Store` is one).
    Replay depends on this interface only, never on a store's internals."""

    mode: str

    def base_of(self, iteration: int) -> int: ...

    def kind(self, iteration: int) -> str: ...

    def load(self, iteration: int) -> Any: ...

    def load_record(self, iteration: int, keys: Sequence[Any] | None = None, *,
                    into: Callable[[Any], Any] | None = None) -> Any: ...

    def consistent_reads(self) -> AbstractContextManager[Any]:
        """Held by a read-ahead thread around each read (see :meth:`ckptstore.Store.consistent_reads`)."""
        ...


#: ``read_record(iteration, into)``: a delta record, read into existing tensors where ``into``
#: says so (:meth:`ckptstore.engine.read_path.StateReader.load`).
ReadRecord = Callable[[int, Any], Any]


class IncrementalReplayer:
    """A replica of the training state kept in memory and advanced one delta at a time, for a
    process that follows a live store (:mod:`ckptstore.follow`): the base is loaded once, then
    each :meth:`apply_next` is one recorded optimizer step (format-spec/deltas.md, "Replay"),
    with the same checks and the same bits as :func:`replay_to`.

    ``IncrementalReplayer(source, base)`` loads base snapshot ``base`` of ``source`` (a
    :class:`RecordSource`); ``IncrementalReplayer.from_state(state, base)`` starts from a base
    state already in memory (which it then owns: the steps update its tensors in place). A state
    that is not a Checkpointer base raises DeltaChainError naming ``base``."""

    def __init__(self, source: RecordSource | None, base: int, *,
                 state: dict | None = None) -> None:
        if state is None:
            if source is None:
                raise ValueError("IncrementalReplayer needs a source or a base state")
            if source.kind(base) != "snapshot":
                raise DeltaChainError(f"iteration {base} is a {source.kind(base)}, not a base snapshot")
            state = source.load(base)
        self._source = source
        self._eng = _StateReplayer(state, base)
        self._configured = False
        #: the iteration the replica started from
        self.base = base

    @classmethod
    def from_state(cls, state: dict, base: int,
                   source: RecordSource | None = None) -> "IncrementalReplayer":
        return cls(source, base, state=state)

    @property
    def iteration(self) -> int:
        """The iteration whose state the replica holds."""
        return self._eng.iteration

    @property
    def report(self) -> ReplayReport:
        """How the replica relates to the training state (``exact``, lossy steps, ...)."""
        return self._eng.report

    @property
    def exact(self) -> bool:
        return self._eng.report.exact

    def apply_next(self, iteration: int, record: dict | None = None) -> None:
        """Replay delta ``iteration`` (must be :attr:`iteration` + 1) onto the replica. ``record``:
        its delta record, else read from the source (checked to be a delta). Raises
        DeltaChainError, DamagedCheckpointError (a malformed record), ReplayDivergenceError (a
        recorded fingerprint differs); after an error the replica is unusable."""
        if record is None:
            if self._source is None:
                raise ValueError("apply_next without a record needs a source")
            record = _record(self._source, iteration)
        self._eng.apply(iteration, record)

    def advance(self, last: int, threads: int = 1) -> None:
        """Replay every delta after :attr:`iteration` up to ``last``, read from the source: the
        records read ahead in a background thread and steady deltas run as tiled windows (with
        ``threads`` threads for a window's kernels), as :func:`replay_to` does; the same bits as
        :meth:`apply_next` on each. The first call fixes ``threads``. Raises as
        :meth:`apply_next` (DeltaChainError also for a snapshot or a missing iteration in the
        range); after an error the replica is unusable."""
        if self._source is None:
            raise ValueError("advance needs a source")
        if not self._configured:
            self._eng.parallel(threads)
            self._configured = True
        _replay_deltas(self._source, self._eng, last, threads, None, configure=False)

    def fingerprint(self) -> str:
        """xxh3-64 of the replica's parameters in optimizer order (what a delta's ``fp`` records)."""
        return fingerprint_digest(self._eng.params)

    def state(self, clone: bool = True) -> dict:
        """The replica as a state: a Checkpointer base snapshot (``model``, ``optimizer``,
        ``scheduler``, ``rng``, ``iteration``, the replay section), plus ``replay_report`` when
        not exact. ``clone=False`` shares the replica's tensors (the next step changes them)."""
        return self._eng.current(clone)

    def close(self) -> None:
        self._eng.close()

    def __enter__(self) -> "IncrementalReplayer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _replayer_at(store: RecordSource, start: int) -> _StateReplayer:
    base = store.base_of(start)
    if store.kind(base) != "snapshot":
        raise DeltaChainError(f"iteration {start}: chain does not start from a snapshot")
    return _StateReplayer(store.load(base), base)


def replay_to(store: RecordSource, iteration: int, *, threads: int | None = None,
              read_record: ReadRecord | None = None) -> dict:
    """The state at ``iteration``: its chain's base, then every delta up to it replayed.

    ``read_record`` reads the delta records in the read-ahead thread (default:
    ``store.load_record``); :meth:`ckptstore.Store.load` passes one that takes no lock and does
    not retry, because it holds the writer's lock and retries the whole replay itself.

    Records are read ahead in a background thread (:class:`ckptstore.replay.parallel.RecordFeed`) and
    the optimizer steps are sharded over ``threads`` threads (default: one per CPU, see
    :func:`ckptstore.replay.parallel.default_shards`) when the optimizer allows it; the result is the
    same as stepping one delta at a time."""
    _preimport_dynamo()
    eng = _replayer_at(store, iteration)
    try:
        _replay_deltas(store, eng, iteration, threads, read_record)
    finally:
        eng.close()
    warn_if_approximate(eng.report)
    return eng.current(clone=False)


def _replay_deltas(store: RecordSource, eng: _StateReplayer, last: int, threads: int | None,
                   read_record: ReadRecord | None, configure: bool = True) -> None:
    from .parallel import RecordFeed, default_shards

    if eng.iteration >= last:
        return
    if configure:  # (else the caller set it up once: IncrementalReplayer)
        eng.parallel(default_shards() if threads is None else threads)
    # replay_to runs inside Store.load (which holds the writer's mutex and retries on failure):
    # the read-ahead thread reads without taking the mutex again. A tiled window holds up to
    # ``eng.window`` records' gradient buffers at once, plus two being read ahead.
    feed = RecordFeed(eng.iteration + 1, last,
                      lambda it, into: _record(store, it, into, read_record),
                      eng.grad_shapes(), buffers=eng.window + 2)
    window: list[tuple[int, dict, Any]] = []

    def run_window() -> None:
        if len(window) == 1:
            eng.apply(window[0][0], window[0][1])
        else:
            eng.apply_window([(it, rec) for it, rec, _ in window])
        for _, _, bufs in window:
            feed.release(bufs)
        window.clear()

    try:
        for it, rec, bufs in feed:
            if not window and not eng.tiled_ready():
                eng.apply(it, rec)
                del rec
                feed.release(bufs)
                continue
            window.append((it, rec, bufs))
            del rec
            # a fingerprinted delta ends its window: it is checked against the whole state
            if len(window) >= eng.window or it == last or \
                    (isinstance(window[-1][1], dict) and window[-1][1].get("fp")):
                run_window()
        if window:
            run_window()
    finally:
        window.clear()
        feed.close()


def _preimport_dynamo() -> None:
    """torch.optim's first optimizer in a process imports torch._dynamo (seconds, once). Start
    that import in the background so it overlaps the base snapshot's read."""
    import sys
    import threading

    if "torch._dynamo" in sys.modules:
        return

    def imp() -> None:
        try:
            import torch._dynamo  # noqa: F401
        except Exception:  # noqa: BLE001 - the optimizer's own import will report it
            pass

    threading.Thread(target=imp, name="ckptstore-import", daemon=True).start()


def _record(store: RecordSource, it: int, into: Any = None,
            load: Callable[[int, Any], Any] | None = None) -> dict:
    """Delta record ``it``, checked to be a delta; ``load(it, into)`` reads it (default
    :meth:`Store.load_record`)."""
    try:
        kind = store.kind(it)
    except KeyError:
        raise DeltaChainError(f"delta chain broken: iteration {it} is missing") from None
    if kind != "delta":
        raise DeltaChainError(f"iteration {it} is a {kind}, expected a delta")
    return store.load_record(it, into=into) if load is None else load(it, into)


def replay_range(store: RecordSource, start: int, stop: int
                 ) -> Generator[tuple[int, dict], None, None]:
    """Yield (iteration, state) for start..stop inclusive. Each state is an independent copy.
    A base snapshot met on the way restarts the engine from it (no replay needed past it).

    The records after the base (delta records, and any base snapshot met on the way) are read
    ahead by a background thread (:class:`ckptstore.replay.parallel.RecordFeed`, two records ahead),
    overlapping the optimizer steps, the copies and the caller's own work between items; what is
    yielded is what stepping one record at a time yields, and a failing read is raised at its
    iteration, after every state before it. The records are read into fresh tensors (no recycled
    gradient buffers), so nothing a yielded state holds is ever reused. Closing the generator
    early (``break``, ``close()``, an exception in the loop body) stops and joins that thread."""
    from .parallel import RecordFeed

    if stop < start:
        return
    base = store.base_of(start)
    if store.kind(base) != "snapshot":
        raise DeltaChainError(f"iteration {start}: chain does not start from a snapshot")
    feed = RecordFeed(base + 1, stop, lambda it, _into: _read_ahead(store, it))
    eng: _StateReplayer | None = None
    try:
        eng = _StateReplayer(store.load(base), base)  # the feed reads the first records meanwhile
        if base == start:
            yield base, eng.current(clone=True)
        for it, (kind, data), _ in feed:
            if kind == "snapshot":
                eng.close()
                eng = _StateReplayer(data, it)
            else:
                eng.apply(it, data)
            del data
            if it >= start:
                warn_if_approximate(eng.report)
                yield it, eng.current(clone=True)
    finally:
        feed.close()
        if eng is not None:
            eng.close()


def _read_ahead(store: RecordSource, it: int) -> tuple[str, Any]:
    """What :func:`replay_range` needs of iteration ``it``, read in the feed's thread:
    ``("snapshot", state)`` for a base snapshot, else ``("delta", record)``. A missing iteration
    raises NotFoundError, a non-delta, non-snapshot one DeltaChainError (as stepping did).

    Each read is made under ``store.consistent_reads()``: for a reader, so the loop body's calls
    on the same store cannot swap its index view mid-read."""
    with store.consistent_reads():
        if store.kind(it) == "snapshot":
            return "snapshot", store.load(it)
        return "delta", _record(store, it)
