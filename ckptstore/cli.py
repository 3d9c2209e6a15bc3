"""The ``ckptstore`` command line: ls, show, diff, restore, import, fsck, gc, stats, bisect, demo,
push, pull, follow, doctor.

Exit codes: 0 success (fsck: clean; bisect: found); 1 the store is damaged or an operation failed
(the message says what and where; bisect: the condition never holds); 2 bad usage.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Any, Sequence

from .console import human_bytes, printable, progress, table
from .errors import CkptStoreError, JobStreamError, NotFoundError
from .multirank.fsck import check_job
from .multirank.job_store import JobStore
from .storage.job_log import is_job_store


def _when(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9).isoformat(timespec="seconds")


def _open(path: str, mode: str = "r", **options: Any):
    from . import open as open_store

    return open_store(path, mode, **options)


def _ls_job(store: Any, path: str) -> int:
    """ls of a multi-rank job store: one row per iteration, sizes summed over its ranks."""
    rows = []
    for it in store.iterations():
        g = store.global_commit(it)
        infos = [store.info(it, rank=r) for r in range(g.world_size)]
        rows.append([it, infos[0].kind, g.epoch, g.world_size, _when(infos[0].created_ns),
                     human_bytes(sum(i.logical_bytes for i in infos)),
                     human_bytes(sum(i.written_bytes for i in infos))])
    print(f"{path}: multi-rank job store, {store.world_size} ranks, epochs {store.view.chain}")
    if rows:
        print(table(rows, ["iteration", "kind", "epoch", "ranks", "created", "size", "written"]))
    else:
        print("no committed checkpoints")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    with _open(args.path) as store:
        if isinstance(store, JobStore):
            return _ls_job(store, args.path)
        rows = []
        for it in store.iterations():
            info = store.info(it)
            rows.append([it, info.kind, _when(info.created_ns), human_bytes(info.logical_bytes),
                         human_bytes(info.written_bytes), info.snapshot_root[:12]])
        if not rows:
            print(f"{args.path}: no committed checkpoints")
            return 0
        print(table(rows, ["iteration", "kind", "created", "size", "written", "root"]))
    return 0


def _latest(store: Any, path: str) -> int:
    latest = store.latest()
    if latest is None:
        raise NotFoundError(f"{path} holds no committed checkpoint")
    return latest


def _show_dcp(store: Any, iteration: int, path: str) -> int:
    """show of a DCP checkpoint: its sharded layout (ckptstore.dcp.layout). Exit 1 when a
    tensor's shards do not tile it."""
    from .integrations.dcp import layout

    lay = layout(store, iteration)
    rank = lay.metadata_rank
    if isinstance(store, JobStore):
        g = store.global_commit(iteration)
        who = f"saved by {lay.world_size} ranks in epoch {g.epoch}, metadata in rank {rank}'s state"
        info, meta = store.info(iteration, rank=rank), store.meta(iteration, rank=rank)
    else:
        who = "saved by one process"
        info, meta = store.info(iteration), store.meta(iteration)
    print(f"iteration {iteration} ({info.kind}): a DCP checkpoint {who}; created "
          f"{_when(info.created_ns)}")
    per_rank: dict[Any, int] = {}
    rows = []
    for t in lay.tensors:
        for sh in t.shards:
            per_rank[sh.rank] = per_rank.get(sh.rank, 0) + sh.nbytes
            rows.append([t.fqn, t.dtype, "x".join(map(str, t.shape)) or "scalar",
                         ",".join(map(str, sh.offsets)) or "-", "x".join(map(str, sh.sizes)) or "-",
                         "none" if sh.rank is None else sh.rank, human_bytes(sh.nbytes)])
    total = sum(t.nbytes for t in lay.tensors)
    print(f"{len(lay.tensors)} tensors ({human_bytes(total)}) in {len(rows)} shards, "
          f"{len(lay.values)} values; shard bytes per rank: "
          + ", ".join(f"{r}: {human_bytes(n)}" for r, n in sorted(per_rank.items(),
                                                                  key=lambda x: (x[0] is None, x[0] or 0))))
    print(f"meta: {json.dumps(meta, default=repr)}")
    if rows:
        print(table(rows, ["tensor", "dtype", "shape", "shard offsets", "shard sizes", "rank",
                           "bytes"], right=(6,)))
    if lay.values:
        print(table([[v.fqn, "none" if v.rank is None else v.rank] for v in lay.values],
                    ["value", "rank"]))
    for problem in lay.problems:
        print(f"ckptstore show: error: {printable(str(problem))}", file=sys.stderr)
    return 1 if lay.problems else 0


def _show_sharded(store: JobStore, iteration: int, sections: list[dict]) -> int:
    """show of sharded Checkpointer parts: every DTensor entry's box on every rank (global shape,
    offsets, local shape, placements, mesh) and the rank whose part stores its bytes (another
    one for a replica it owns). Exit 1 when a tensor's boxes do not tile it."""
    from .replay.shards import layout_problems

    g = store.global_commit(iteration)
    info, base = store.info(iteration, rank=0), store.base_of(iteration, rank=0)
    print(f"iteration {iteration} ({info.kind}): sharded Checkpointer parts (FSDP2 / DTensor) "
          f"of {g.world_size} ranks in epoch {g.epoch}; created {_when(info.created_ns)}"
          + ("" if base == iteration else f"; boxes as recorded by its base {base}"))

    def dims(v: Any, sep: str) -> str:
        return sep.join(map(str, v)) if isinstance(v, list) else str(v)

    def table_of(sec: dict, key: str) -> dict:
        t = sec.get(key)
        return t if isinstance(t, dict) else {}

    names: dict[str, None] = {}
    for sec in sections:
        names.update(dict.fromkeys(table_of(sec, "tensors")))
    rows = []
    for name in names:
        for r, sec in enumerate(sections):
            box = table_of(sec, "tensors").get(name)
            if not isinstance(box, dict):
                rows.append([name, "-", "-", "-", "-", "-", r, "(no box)"])
                continue
            owner = table_of(sec, "replicas").get(name, r)
            rows.append([name, dims(box.get("shape"), "x") or "scalar",
                         dims(box.get("offsets"), ",") or "-", dims(box.get("local"), "x") or "-",
                         dims(box.get("placements"), ","), dims(box.get("mesh"), "x"), r, owner])
    print(f"{len(names)} sharded tensors in {len(rows)} boxes (stored by: the rank whose part "
          "holds the bytes; --rank N: rank N's part as stored)")
    print(f"meta: {json.dumps(store.meta(iteration, rank=0), default=repr)}")
    if rows:
        print(table(rows, ["tensor", "global shape", "offsets", "local", "placements", "mesh",
                           "rank", "stored by"], right=(6, 7)))
    problems = layout_problems(sections, f"iteration {iteration}: ")
    for problem in problems:
        print(f"ckptstore show: error: {printable(str(problem))}", file=sys.stderr)
    return 1 if problems else 0


def cmd_show(args: argparse.Namespace) -> int:
    from .integrations.dcp import is_dcp

    with _open(args.path) as opened:
        it = args.iteration if args.iteration is not None else _latest(opened, args.path)
        if not args.raw and args.rank is None and is_dcp(opened, it):
            return _show_dcp(opened, it, args.path)
        if not args.raw and args.rank is None and isinstance(opened, JobStore):
            sections = opened.shard_sections(it)
            if sections is not None:
                return _show_sharded(opened, it, sections)
        store = opened
        if isinstance(opened, JobStore):
            g = opened.global_commit(it)
            rank = args.rank or 0
            print(f"iteration {it}: committed by {g.world_size} ranks in epoch "
                  f"{g.epoch}; showing rank {rank} (--rank to choose)")
            store = opened.stream(it, rank=rank)
        info = store.info(it)
        m = store.manifest(it)
        print(f"iteration {info.iteration} ({info.kind}), created {_when(info.created_ns)}")
        print(f"size {human_bytes(info.logical_bytes)} in {len(m.tensors)} tensors, written "
              f"{human_bytes(info.written_bytes)}, chunk size {human_bytes(m.chunk_size)}, root {info.snapshot_root}")
        print(f"meta: {json.dumps(store.meta(it), default=repr)}")
        rows = [[t.path, t.lib, t.dtype, "x".join(map(str, t.shape)) or "scalar", human_bytes(t.nbytes),
                 t.root.hex()[:12]] for t in m.tensors]
        if rows:
            print(table(rows, ["tensor", "lib", "dtype", "shape", "bytes", "root"]))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    with _open(args.path) as store:
        diffs = store.diff(args.a, args.b)
        shown = [d for d in diffs if args.all or d.status != "unchanged"]
        rows = [[d.path, d.status, human_bytes(d.nbytes_a), human_bytes(d.nbytes_b), human_bytes(d.bytes_changed)]
                for d in shown]
        if rows:
            print(table(rows, ["tensor", "status", f"bytes@{args.a}", f"bytes@{args.b}", "changed"]))
        changed = sum(d.bytes_changed for d in diffs)
        total = sum(d.nbytes_b for d in diffs)
        n = sum(d.status != "unchanged" for d in diffs)
        print(f"{n} of {len(diffs)} tensors differ; {human_bytes(changed)} of {human_bytes(total)} changed")
    return 0


def _restore_args(args: argparse.Namespace) -> tuple[int, str] | None:
    """(iteration, out) from ``restore STORE ITER --out OUT``, ``restore STORE ITER OUT`` or
    ``restore STORE --iteration ITER OUT``; None (a usage message printed) for anything else."""
    given = list(args.positional)
    iteration = args.iteration_opt
    if iteration is None and given:
        try:
            iteration = _iteration(given.pop(0))
        except argparse.ArgumentTypeError as e:
            print(f"ckptstore restore: ITER {e}", file=sys.stderr)
            return None
    outs = given + ([args.out] if args.out is not None else [])
    if iteration is None or len(outs) != 1:
        print("ckptstore restore: usage: ckptstore restore STORE ITER --out OUT, or ckptstore "
              "restore STORE --iteration ITER OUT", file=sys.stderr)
        return None
    return iteration, outs[0]


def cmd_restore(args: argparse.Namespace) -> int:
    from .integrations.dcp import is_dcp, load_full_state_dict

    parsed = _restore_args(args)
    if parsed is None:
        return 2
    args.iteration, args.out = parsed
    with _open(args.path) as store:
        if args.rank is None and is_dcp(store, args.iteration):
            # a DCP checkpoint (any world size): every tensor assembled whole from its shards,
            # nested as the state dict given to dcp.save
            state = load_full_state_dict(store, args.iteration, keys=args.keys or None)
        elif isinstance(store, JobStore):
            # a job store: the merged state of a data-parallel job, or one rank's (--rank)
            state = store.load(args.iteration, keys=args.keys or None, rank=args.rank)
        else:
            total = store.info(args.iteration).logical_bytes
            with progress("restore", total) as tick:
                state = store.load(args.iteration, keys=args.keys or None, progress=tick)
    from .integrations.interop import write_state

    # torch, safetensors or a DCP directory, written under a temporary name and renamed into place
    write_state(state, args.out, args.format, iteration=args.iteration)
    print(f"restored iteration {args.iteration} to {args.out} ({args.format})")
    return 0


def _import_usage(msg: str) -> int:
    print(f"ckptstore import: {msg} (usage: ckptstore import STORE [ITER] SOURCE [--kind K] "
          "[--meta JSON] | ckptstore import STORE --from-dir DIR [--meta JSON])", file=sys.stderr)
    return 2


def cmd_import(args: argparse.Namespace) -> int:
    """Import a checkpoint of another tool (ckptstore.interop): the source is read and checked
    before the store is opened, so a bad source leaves no trace (not even a new empty store)."""
    from .integrations.interop import import_checkpoint, import_dir, load_source, scan_dir

    if is_job_store(args.path):  # its iterations are committed by every rank of a job together
        return _import_usage(f"{args.path} is a multi-rank job store; import into a "
                             "single-writer store")
    meta = None
    if args.meta is not None:
        try:
            meta = json.loads(args.meta)
        except ValueError as e:
            return _import_usage(f"--meta is not valid JSON ({e})")
        if type(meta) is not dict:
            return _import_usage("--meta must be a JSON object")
    if args.from_dir is not None:
        if args.source or args.kind:
            return _import_usage("--from-dir takes no ITER, SOURCE or --kind")
        scan_dir(args.from_dir)  # everything checked before the store is opened
        rows: list[list[Any]] = []

        def imported(r: Any) -> None:
            print(f"imported {printable(r.source)} ({r.kind}) as iteration {r.iteration}: "
                  f"{human_bytes(r.stats.logical_bytes)}, {human_bytes(r.stats.written_bytes)} "
                  "written", flush=True)
            rows.append([r.iteration, r.kind, printable(os.path.basename(r.source)),
                         human_bytes(r.stats.logical_bytes), human_bytes(r.stats.written_bytes),
                         human_bytes(r.stats.dedup_bytes)])

        with _open(args.path, "a", features=args.features) as store:
            rep = import_dir(store, args.from_dir, meta=meta, on_import=imported)
        print(table(rows, ["iteration", "kind", "source", "size", "written", "dedup"]))
        for name, why in rep.skipped:
            print(f"left out {printable(name)}: {printable(why)}")
        pct = 100.0 * rep.saved_bytes / rep.logical_bytes if rep.logical_bytes else 0.0
        print(f"imported {len(rep.imported)} checkpoints: {human_bytes(rep.logical_bytes)} of "
              f"state, {human_bytes(rep.written_bytes)} written; dedup saved "
              f"{human_bytes(rep.saved_bytes)} ({pct:.0f}%) in {rep.seconds:.2f} s")
        return 0
    if len(args.source) not in (1, 2):
        return _import_usage("give [ITER] SOURCE, or --from-dir DIR")
    iteration = None
    if len(args.source) == 2:
        try:
            iteration = _iteration(args.source[0])
        except argparse.ArgumentTypeError as e:
            return _import_usage(f"ITER {e}")
    loaded = load_source(args.source[-1], args.kind)  # read and checked before the store opens
    with _open(args.path, "a", features=args.features) as store:
        with progress("import", None) as tick:
            r = import_checkpoint(store, iteration, loaded, meta=meta, progress=tick)
    print(f"imported {printable(r.source)} ({r.kind}) as iteration {r.iteration}: "
          f"{human_bytes(r.stats.logical_bytes)} in {r.stats.tensors} tensors, "
          f"{human_bytes(r.stats.written_bytes)} written, {human_bytes(r.stats.dedup_bytes)} "
          "already stored")
    for name, why in r.skipped:
        print(f"left out {printable(name)}: {printable(why)}")
    return 0


def _remote_options(args: argparse.Namespace) -> dict:
    """storage/remote options from --endpoint-url, --region, --bandwidth and --option K=V
    (credentials: boto3's usual chain, e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)."""
    opts: dict[str, Any] = {}
    for item in getattr(args, "option", None) or []:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"ckptstore {args.command}: --option wants KEY=VALUE, not {item!r}",
                  file=sys.stderr)
            raise SystemExit(2)
        try:
            opts[key] = int(value)
        except ValueError:
            try:
                opts[key] = float(value)
            except ValueError:
                opts[key] = {"true": True, "false": False}.get(value.lower(), value)
    if getattr(args, "endpoint_url", None):
        opts["endpoint_url"] = args.endpoint_url
    if getattr(args, "region", None):
        opts["region_name"] = args.region
    if getattr(args, "bandwidth", None) is not None:
        opts["bandwidth"] = args.bandwidth
    from .remote import split_options

    try:
        split_options(opts)
    except (TypeError, ValueError) as e:
        print(f"ckptstore {args.command}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return opts


def _rate(text: str) -> float:
    """argparse type: bytes/s, with an optional K, M or G suffix (powers of 1024)."""
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1:].lower(), 1)
    try:
        n = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r} (e.g. 50M)") from None
    if not n > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text!r}")
    return n


def cmd_push(args: argparse.Namespace) -> int:
    """Upload a store's committed state to an object store (only what the remote lacks)."""
    from .remote import push

    with progress("push", None) as tick:
        r = push(args.path, args.url, _remote_options(args), progress=tick)
    h = r.head
    print(f"pushed {args.path} to {r.url}: HEAD generation {h.generation}, iteration "
          f"{h.recoverable} ({h.count} iterations); sent {human_bytes(r.stats.uploaded_bytes)} in "
          f"{r.stats.uploaded_objects} objects, {r.stats.reused_objects} already there, "
          f"{r.seconds:.2f} s")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    """Restore the newest remote HEAD into a local directory (incremental into a copy)."""
    from .remote import pull

    with progress("pull", None) as tick:
        r = pull(args.url, args.path, _remote_options(args), progress=tick)
    h = r.head
    print(f"pulled {r.url} (HEAD generation {h.generation}, iteration {h.recoverable}, "
          f"{h.count} iterations) into {r.path}: {human_bytes(r.downloaded_bytes)} downloaded in "
          f"{r.downloaded_objects} objects, {human_bytes(r.kept_bytes)} already there, "
          f"{r.seconds:.2f} s")
    return 0


def cmd_fsck(args: argparse.Namespace) -> int:
    from .ops.fsck import check
    from .remote import is_remote_url, verify_remote

    if is_remote_url(args.path) or args.remote:
        if args.repair:
            print("ckptstore fsck: --repair applies to local stores only", file=sys.stderr)
            return 2
        url = args.path if is_remote_url(args.path) else args.remote
        local = None if is_remote_url(args.path) else args.path
        clean = True
        if local is not None:
            with progress("fsck", None) as tick:
                local_report = check(local, progress=tick)
            for line in local_report.lines():
                print(printable(line))
            clean = local_report.clean
        with progress("fsck remote", None) as tick:
            remote_report = verify_remote(url, _remote_options(args), local=local, progress=tick)
        for line in remote_report.lines():
            print(printable(line))
        return 0 if clean and remote_report.clean else 1
    with progress("fsck", None) as tick:
        if is_job_store(args.path):
            report: Any = check_job(args.path, repair=args.repair, progress=tick)
        else:
            report = check(args.path, repair=args.repair, progress=tick)
    for line in report.lines():
        print(printable(line))
    return 0 if report.clean else 1


def cmd_gc(args: argparse.Namespace) -> int:
    from .ops.retention import policy_from_options

    usage = None
    if (args.keep_best is None) != (args.metric is None):
        usage = "--keep-best N and --metric KEY go together"
    elif args.mode is not None and args.keep_best is None:
        usage = "--mode goes with --keep-best N --metric KEY"
    elif all(v is None for v in (args.keep_last, args.keep_every, args.keep_best,
                                 args.keep_newer_than, args.keep_since_iteration)):
        usage = ("no retention policy given: use --keep-last, --keep-every, --keep-best with "
                 "--metric, --keep-newer-than and/or --keep-since-iteration")
    try:
        policy = None if usage else policy_from_options(
            keep_last=args.keep_last, keep_every=args.keep_every, keep_best=args.keep_best,
            metric=args.metric, mode=args.mode or "min", keep_newer_than=args.keep_newer_than,
            keep_since_iteration=args.keep_since_iteration)
    except ValueError as e:
        usage = str(e)
    if usage is not None or policy is None:
        print(f"ckptstore gc: {usage} (see ckptstore gc --help)", file=sys.stderr)
        return 2
    if is_job_store(args.path):
        return _gc_job(args, policy)
    if args.dry_run:
        # a reader that scans the log instead of using the writer's LMDB index: no byte under
        # the directory changes (not even LMDB's reader table in index/lock.mdb), no lock is
        # taken, nothing is recovered or compacted
        from . import open as open_store

        with open_store(args.path, "r", use_index=False) as store:
            r = store.gc(policy=policy, dry_run=True, follower_bases=args.follower_bases)
        print(f"dry run, nothing changed: gc would remove {len(r.removed)} of "
              f"{len(r.kept) + len(r.removed)} checkpoints"
              + (f": {_ranges(r.removed)}" if r.removed else ""))
        print(f"would keep {len(r.kept)}: {_ranges(r.kept)}" if r.kept else "would keep none")
        if r.added:
            print(f"  (kept beyond the policy, as the latest iteration or for delta chains: "
                  f"{_ranges(list(r.added))})")
        _print_rebase(r, args.follower_bases, "would ")
        print(f"would free about {human_bytes(max(0, r.bytes_freed))}: log "
              f"{human_bytes(r.bytes_before)} -> about {human_bytes(r.bytes_after)} (an estimate "
              "from the index: the records gc would copy)")
        return 0
    with _open(args.path, "a") as store:
        with progress("gc", None) as tick:
            r = store.gc(policy=policy, progress=tick, follower_bases=args.follower_bases)
    print(f"kept {len(r.kept)} checkpoints, removed {len(r.removed)}"
          + (f" ({', '.join(map(str, r.removed[:20]))}{' ...' if len(r.removed) > 20 else ''})"
             if r.removed else ""))
    _print_rebase(r, args.follower_bases, "")
    print(f"log {human_bytes(r.bytes_before)} -> {human_bytes(r.bytes_after)} in {r.seconds:.2f} s")
    return 0


def _gc_job(args: argparse.Namespace, policy: Any) -> int:
    """gc of a multi-rank job store (offline: no job may write it; format-spec/format.md
    §22.7): the same policy options; every rank keeps or drops an iteration together."""
    from . import open as open_store

    if args.follower_bases:
        print(f"ckptstore gc: {args.path} is a multi-rank job store: --follower-bases is not "
              "supported for job stores", file=sys.stderr)
        return 2
    with open_store(args.path, "r") as store:
        if args.dry_run:
            r = store.gc(policy=policy, dry_run=True)
            print(f"dry run, nothing changed: gc would remove {len(r.removed)} of "
                  f"{len(r.kept) + len(r.removed)} iterations of the job (on every rank)"
                  + (f": {_ranges(r.removed)}" if r.removed else ""))
            print(f"would keep {len(r.kept)}: {_ranges(r.kept)}" if r.kept else "would keep none")
            for it in r.added:
                print(f"  {it}: {r.why.get(it, 'kept')}")
            print(f"would free about {human_bytes(max(0, r.bytes_freed))}: job store "
                  f"{human_bytes(r.bytes_before)} -> about {human_bytes(r.bytes_after)}")
            return 0
        with progress("gc", None) as tick:
            r = store.gc(policy=policy, progress=tick)
    print(f"kept {len(r.kept)} iterations, removed {len(r.removed)}"
          + (f" ({', '.join(map(str, r.removed[:20]))}{' ...' if len(r.removed) > 20 else ''})"
             if r.removed else "") + (f"; now epoch {r.epoch}" if r.epoch else ""))
    if r.unchanged:
        print(f"  kept as they are (an earlier world size): {_ranges(list(r.unchanged))}")
    print(f"job store {human_bytes(r.bytes_before)} -> {human_bytes(r.bytes_after)} in "
          f"{r.seconds:.2f} s")
    return 0


def _print_rebase(r: Any, asked: bool, would: str) -> None:
    """gc's lines about follower bases (``--follower-bases``)."""
    if not asked:
        return
    if r.rebased:
        many = len(r.rebased) > 1
        print(f"{would}replace delta{'s' if many else ''} {_ranges(list(r.rebased))} by "
              f"{'snapshots' if many else 'a snapshot'} made from "
              f"{'verified follower bases' if many else 'a verified follower base'} (the deltas "
              f"before {'them' if many else 'it'} that the policy does not keep "
              f"{'would be' if would else 'are'} dropped)")
    else:
        print(f"{would}use no follower base")
    for it, why in r.rebase_skipped:
        print(printable(f"  follower store: {why}" if it < 0 else f"  follower base {it} not used: {why}"))


def _ranges(its: Sequence[int]) -> str:
    """Ascending iterations as runs: "0, 5-9, 20"."""
    runs: list[list[int]] = []
    for i in its:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _count(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {n}")
    return n


def _iteration(text: str) -> int:
    """argparse type: an iteration (int >= 0)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {n}")
    return n


def _duration(text: str) -> float:
    """argparse type: a duration such as 90s, 15m, 2h, 3d (seconds)."""
    from .ops.retention import parse_duration

    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _num(d: Any, key: str, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    """A number from a manifest's "pipeline" field, or "?" when it is missing or not a number."""
    v = d.get(key) if isinstance(d, dict) else None
    if type(v) is not int and type(v) is not float:  # (not isinstance: a bool is no number here)
        return "?"
    return fmt.format(v * scale)


def cmd_stats(args: argparse.Namespace) -> int:
    """Per-checkpoint pipeline statistics, read from each manifest's "pipeline" field
    (format-spec/format.md section 10); checkpoints written synchronously show "-"."""
    import statistics

    with _open(args.path) as store:
        its = store.iterations()
        if args.last:
            its = its[-args.last:]
        rows, stalls, persists = [], [], []
        for it in its:
            info = store.info(it)
            p = store.manifest(it).extra.get("pipeline")
            if p is None:
                rows.append([it, info.kind, "-", "-", "-", "-", "-", human_bytes(info.written_bytes), "-"])
                continue
            rows.append([it, info.kind, _num(p, "stall_s", 1e3), _num(p, "wait_s", 1e3),
                         _num(p, "snapshot_s", 1e3), _num(p, "write_s", 1e3),
                         _num(p, "queue_depth", fmt="{:.0f}"), human_bytes(info.written_bytes),
                         human_bytes(p["dedup_bytes"]) if isinstance(p, dict) and
                         type(p.get("dedup_bytes")) is int else "?"])
            if isinstance(p, dict) and type(p.get("stall_s")) in (int, float):
                stalls.append(p["stall_s"])
            if isinstance(p, dict) and type(p.get("write_s")) in (int, float):
                persists.append(p["write_s"])
        if not rows:
            print(f"{args.path}: no committed checkpoints")
            return 0
        print(table(rows, ["iteration", "kind", "stall ms", "wait ms", "snapshot ms", "write ms",
                            "queue", "written", "dedup"]))
        if stalls:
            print(f"{len(stalls)} async checkpoints: median stall {statistics.median(stalls) * 1e3:.1f} ms, "
                  f"max {max(stalls) * 1e3:.1f} ms; median background write "
                  f"{statistics.median(persists) * 1e3:.1f} ms" if persists else "")
    return 0


def cmd_bisect(args: argparse.Namespace) -> int:
    """The first iteration where a condition holds (ckptstore/ops/bisect.py): exit 0 found,
    1 never holds in the range (or an error), 2 a malformed condition or range."""
    from .errors import BisectError
    from .ops.bisect import parse_condition

    if args.start is not None and args.end is not None and args.start > args.end:
        print(f"ckptstore bisect: --start {args.start} is after --end {args.end}", file=sys.stderr)
        return 2
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:  # a module:function condition may name a module of the working directory
        sys.path.insert(0, cwd)
    try:
        cond = parse_condition(args.until)
    except BisectError as e:
        print(f"ckptstore bisect: error: {printable(str(e))}", file=sys.stderr)
        return 2
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
    with _open(args.path) as store:
        if isinstance(store, JobStore):
            r = store.bisect(cond, args.start, args.end, rank=args.rank)
        else:
            r = store.bisect(cond, args.start, args.end)
    cost = (f"{r.meta_reads} meta reads" if cond.kind == "meta" else
            f"{r.loaded} states loaded, {r.replayed} replayed") + f", {r.seconds:.2f} s"
    if r.iteration is None:
        print(f"{printable(r.condition)}: never holds in {r.start}..{r.end} ({cost})")
        return 1
    print(f"{printable(r.condition)}: first holds at iteration {r.iteration} "
          f"(searched {r.start}..{r.end}; {cost})")
    if r.value is not None:
        print(f"{printable(str(cond.key))} = {r.value!r} at iteration {r.iteration}")
    if r.tensors:
        rows = [[t.path, t.nan, t.inf, t.numel, ", ".join(map(str, t.indices)) + (
                 " ..." if (t.nan if cond.kind == "nan" else t.nan + t.inf) > len(t.indices)
                 else "")] for t in r.tensors]
        print(table(rows, ["tensor", "nan", "inf", "elements", "first indices"]))
    return 0


def cmd_follow(args: argparse.Namespace) -> int:
    import signal

    from .follow import Follower

    if not args.poll > 0:
        print("ckptstore follow: error: --poll must be more than 0", file=sys.stderr)
        return 2
    with Follower(args.path, every=args.every, keep=args.keep, poll_s=args.poll,
                  wait=args.wait, threads=args.threads or 1) as f:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        old = {s: signal.signal(s, lambda *_: f.stop()) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            print(f"following {args.path} into {f.path}: a base every {args.every} iterations",
                  flush=True)
            it = f.run(until=args.until_iteration, timeout=args.timeout)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        st = f.stats
        print(f"followed to iteration {it} (primary at {st.primary_latest}): {st.applied} deltas "
              f"replayed, {len(st.bases)} bases written"
              + (f", the newest {st.bases[-1]}" if st.bases else ""), flush=True)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args.dir, iterations=args.iterations, crash_at=args.crash_at)


#: the native kernels (``ckptstore/replay/native/<name>.c``) doctor builds and loads
_KERNELS = ("adam_steps", "topk_select")
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _doctor_o_direct(directory: str) -> str:
    """Whether the file system of ``directory`` takes an O_DIRECT write: a probe file is created
    there, written through the storage layer's O_DIRECT calls (as a writer would) and removed."""
    import mmap
    import tempfile

    from .storage import direct
    from .storage.fileops import FileOps

    if not direct.supported():
        return "no: this platform has no O_DIRECT (appends are buffered)"
    try:
        fd, probe = tempfile.mkstemp(prefix=".ckptstore-doctor-", dir=directory)
    except OSError as e:
        return f"unknown: cannot create a probe file in {directory} ({e.strerror})"
    ops = FileOps()
    direct_fd = None
    try:
        direct_fd = ops.open_direct(probe)
        if direct_fd is None:
            return "no: the file system refuses O_DIRECT opens (appends fall back to buffered)"
        block = mmap.mmap(-1, direct.ALIGN)  # page-aligned, as O_DIRECT needs
        try:
            written = ops.write_direct(direct_fd, probe, memoryview(block), 0)
        finally:
            block.close()
        if written is None:
            return "no: the file system refuses O_DIRECT writes (appends fall back to buffered)"
        return "yes (delta records are written with O_DIRECT)"
    except CkptStoreError as e:
        return f"unknown: the probe failed ({e})"
    finally:
        if direct_fd is not None:
            os.close(direct_fd)
        os.close(fd)
        os.unlink(probe)


def _doctor_fs_type(path: str) -> str:
    """The type of the file system holding ``path`` (the longest mount point of /proc/mounts)."""
    real, best, kind = os.path.realpath(path), "", "unknown"
    try:
        with open("/proc/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, fields[2]
    except OSError:
        return kind
    return f"{kind} (mounted at {best})" if best else kind


def _doctor_kernels() -> list[tuple[str, str]]:
    import shutil

    from .replay.native import build

    rows = []
    if not build.enabled():
        return [("native kernels", "off (CKPTSTORE_NATIVE="
                 f"{os.environ.get('CKPTSTORE_NATIVE', '')}): replay uses torch's ops, same bits")]
    cc = os.environ.get("CC")
    compiler = shutil.which(cc) if cc else next(
        (found for c in ("cc", "gcc", "clang") if (found := shutil.which(c))), None)
    rows.append(("C compiler", compiler or f"none found ({'$CC=' + cc if cc else 'cc, gcc, clang'}):"
                 " replay uses torch's ops, same bits, slower"))
    rows.append(("kernel cache", str(build.cache_dir())))
    for name in _KERNELS:
        lib = build.load(name)
        rows.append((f"kernel {name}", "built and loaded" if lib is not None else
                     "unavailable (no compiler, a failed build or an unsafe cache directory; "
                     "logger ckptstore.replay.native at INFO says which)"))
    return rows


def _doctor_store(path: str) -> tuple[list[tuple[str, str]], bool]:
    """Rows describing the store at ``path`` and whether it is one (read from STORE files only)."""
    from .format.header import feature_names
    from .storage.job_log import JobLayout, job_store_holding, read_job_header
    from .storage.layout import Layout
    from .storage.store_file import read_store_header

    def described(h: Any) -> list[tuple[str, str]]:
        return [("format version", str(h.format_version)),
                ("features", ", ".join(feature_names(h.flags)) or "none (readable by releases "
                 "before format features)"),
                ("chunk size", human_bytes(h.chunk_size)),
                ("segment size", human_bytes(h.segment_size)),
                ("created", _when(h.created_ns))]

    if "://" in path:
        return [("store", f"{path}: a remote URL (doctor reads local stores; "
                 "`ckptstore fsck URL` checks a remote copy)")], False
    if not os.path.isdir(path):
        return [("store", f"{path}: not a directory")], False
    if is_job_store(path):
        layout = JobLayout(path)
        rows = [("store kind", "multi-rank job store")] + described(read_job_header(layout))[:1]
        epochs = layout.list_epochs()
        streams = sorted(os.listdir(layout.streams_dir)) if os.path.isdir(layout.streams_dir) else []
        rows.append(("writer epochs", f"{len(epochs)}" + (f" (newest {epochs[-1]})" if epochs else "")))
        rows.append(("rank streams", str(len(streams))))
        if streams:
            newest = os.path.join(layout.streams_dir, streams[-1])
            h = read_store_header(Layout(newest))
            rows += [(f"{k} (stream {streams[-1]})", v) for k, v in described(h)]
        return rows, True
    if not os.path.exists(Layout(path).store_file):
        return [("store", f"{path}: no STORE file (not a ckptstore store)")], False
    h = read_store_header(Layout(path))
    job = job_store_holding(path)
    kind = "single-writer store" + (f" (one rank's stream of the job store {job})" if job else "")
    return [("store kind", kind)] + described(h), True


def cmd_doctor(args: argparse.Namespace) -> int:
    import platform
    import shutil

    import numpy
    import torch

    from . import __version__

    where = args.path if args.path and "://" not in args.path else os.getcwd()
    probe_dir = where if os.path.isdir(where) else os.path.dirname(os.path.abspath(where))
    if args.path and os.path.isdir(args.path):
        # beside the store, never inside it (same file system unless the store is a mount point)
        parent = os.path.dirname(os.path.abspath(args.path))
        if os.stat(parent).st_dev == os.stat(args.path).st_dev and os.access(parent, os.W_OK):
            probe_dir = parent
    rows: list[tuple[str, str]] = [
        ("ckptstore", __version__),
        ("torch", torch.__version__),
        ("numpy", numpy.__version__),
        ("python", f"{platform.python_version()} ({platform.python_implementation()})"),
        ("platform", platform.platform()),
        ("cpus", str(os.cpu_count())),
    ]
    rows += _doctor_kernels()
    rows.append(("O_DIRECT", _doctor_o_direct(probe_dir)))
    rows.append(("file system", _doctor_fs_type(probe_dir)))
    try:
        with open(_THP, encoding="ascii") as f:
            thp = f.read().strip()
    except OSError:
        thp = "unknown (no " + _THP + ")"
    hp = os.environ.get("CKPTSTORE_HUGEPAGES")
    rows.append(("transparent huge pages", thp + (f"; CKPTSTORE_HUGEPAGES={hp}" if hp else "")))
    usage = shutil.disk_usage(probe_dir)
    rows.append(("free space", f"{human_bytes(usage.free)} of {human_bytes(usage.total)} "
                 f"({probe_dir})"))
    env = sorted(k for k in os.environ if k.startswith("CKPTSTORE_"))
    rows.append(("environment", " ".join(f"{k}={os.environ[k]}" for k in env) or "no CKPTSTORE_* set"))
    ok = True
    if args.path:
        try:
            store_rows, ok = _doctor_store(args.path)
        except CkptStoreError as e:  # a damaged or unreadable STORE file: still print the rest
            store_rows, ok = [("store", f"unreadable: {e}")], False
        rows += [("path", os.path.abspath(args.path))] + store_rows
    print(table(rows, ("item", "value")))
    return 0 if ok else 1


def _remote_arguments(s: argparse.ArgumentParser, bandwidth: bool) -> None:
    s.add_argument("--endpoint-url", help="the S3 endpoint (MinIO, R2, a test server, ...); "
                   "credentials come from the environment (AWS_ACCESS_KEY_ID, ...)")
    s.add_argument("--region", help="the bucket's region")
    if bandwidth:
        s.add_argument("--bandwidth", type=_rate, metavar="BYTES_PER_S",
                       help="bound the average upload rate, e.g. 50M")
    s.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="another remote option (ckptstore/remote/client.py, replicate.py)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptstore", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("ls", help="list committed checkpoints")
    s.add_argument("path")
    s.set_defaults(func=cmd_ls)

    s = sub.add_parser("show", help="show one checkpoint's tensors and meta (a DCP checkpoint: "
                       "its sharded layout)")
    s.add_argument("path")
    s.add_argument("iteration", type=_iteration, nargs="?",
                   help="the iteration (default: the latest)")
    s.add_argument("--rank", type=int, help="multi-rank stores: whose state (default 0)")
    s.add_argument("--raw", action="store_true", help="a DCP checkpoint or sharded (FSDP2 / "
                   "DTensor) Checkpointer parts: the stored state as is (rank 0's, or --rank's) "
                   "instead of the sharded layout")
    s.set_defaults(func=cmd_show)

    s = sub.add_parser("diff", help="which tensors changed between two checkpoints (Merkle diff)")
    s.add_argument("path")
    s.add_argument("a", type=int)
    s.add_argument("b", type=int)
    s.add_argument("--all", action="store_true", help="also list unchanged tensors")
    s.set_defaults(func=cmd_diff)

    s = sub.add_parser("restore", help="write one checkpoint as a torch or safetensors file or "
                                       "a DCP directory")
    s.add_argument("path")
    s.add_argument("positional", nargs="*", metavar="[ITER] [OUT]",
                   help="the iteration and the output (or --iteration / --out)")
    s.add_argument("--iteration", dest="iteration_opt", type=_iteration, metavar="ITER")
    s.add_argument("--out")
    s.add_argument("--format", choices=("torch", "safetensors", "dcp"), default="torch",
                   help="dcp: a torch.distributed.checkpoint directory (--out must not exist or "
                        "be empty)")
    s.add_argument("--keys", nargs="*", help="only these top-level keys (a DCP checkpoint: "
                   "these keys and every key under them, e.g. model)")
    s.add_argument("--rank", type=int, help="multi-rank stores: this rank's state (default: the "
                   "job's, merged from every rank's part; a DCP checkpoint: every tensor "
                   "assembled whole from its shards)")
    s.set_defaults(func=cmd_restore)

    s = sub.add_parser("import", help="import a torch.save or safetensors file, a DCP directory "
                                      "or a Hugging Face checkpoint-N directory (or --from-dir: "
                                      "every checkpoint in a directory, deduplicated)",
                       usage="ckptstore import STORE [ITER] SOURCE [--kind K] [--meta JSON]\n"
                             "       ckptstore import STORE --from-dir DIR [--meta JSON]",
                       description="Import checkpoints written by other tools as iterations of "
                       "STORE (created if needed). torch.save files are read with "
                       "torch.load(weights_only=True) only. ITER defaults to the number in "
                       "SOURCE's name (checkpoint-500 -> 500). Each import is one atomic commit; "
                       "a source that cannot be read leaves the store unchanged.")
    s.add_argument("path", metavar="STORE")
    s.add_argument("source", nargs="*", metavar="[ITER] SOURCE")
    s.add_argument("--kind", choices=("torch", "safetensors", "dcp", "hf"),
                   help="the source's kind (default: detected from its files)")
    s.add_argument("--meta", metavar="JSON", help="a JSON object stored as the meta of each "
                   "imported iteration (beside meta[\"import\"]: source kind, path, metadata)")
    s.add_argument("--from-dir", metavar="DIR", help="import every checkpoint in DIR "
                   "(checkpoint-N and DCP directories, torch and safetensors files with a number "
                   "in the name) in increasing iteration order")
    s.add_argument("--features", choices=("current", "compatible"), default="current",
                   help="a STORE created by this import: with every format feature this release "
                   "writes (current, the default), or with none, so that older ckptstore releases "
                   "read it too (compatible; refused for a store that has features)")
    s.set_defaults(func=cmd_import)

    s = sub.add_parser("fsck", help="verify every record and checkpoint; --repair recovers")
    s.add_argument("path", help="a store directory, or s3://BUCKET/PREFIX: verify a remote "
                   "copy (every object against its HEAD's digests)")
    s.add_argument("--repair", action="store_true",
                   help="cut an uncommitted tail, finish an interrupted gc, rebuild the index "
                        "(never deletes committed checkpoints)")
    s.add_argument("--remote", metavar="URL", help="also verify this remote copy of the store "
                   "and say whether it is older than the local one")
    _remote_arguments(s, bandwidth=False)
    s.set_defaults(func=cmd_fsck)

    s = sub.add_parser("push", help="upload a store to an object store (s3://): only what the "
                       "remote copy lacks; an interrupted push resumes")
    s.add_argument("path")
    s.add_argument("url", help="s3://BUCKET/PREFIX")
    _remote_arguments(s, bandwidth=True)
    s.set_defaults(func=cmd_push)

    s = sub.add_parser("pull", help="restore a store from an object store (s3://) into a "
                       "local directory, verified; then open or restore from it")
    s.add_argument("url", help="s3://BUCKET/PREFIX")
    s.add_argument("path", help="an empty directory, or an earlier pull of the same store")
    _remote_arguments(s, bandwidth=False)
    s.set_defaults(func=cmd_pull)

    s = sub.add_parser("gc", help="drop checkpoints by retention policy and compact the log",
                       description="Keep the union of what the given policies keep, plus the "
                       "latest iteration and every base and delta a kept delta needs; drop the "
                       "rest and compact the log. A policy set that keeps no iteration is an "
                       "error and nothing is removed.")
    s.add_argument("path")
    s.add_argument("--keep-last", type=_count, metavar="N", help="the N newest iterations")
    s.add_argument("--keep-every", type=_count, metavar="K",
                   help="every iteration that is a multiple of K")
    s.add_argument("--keep-best", type=_count, metavar="N",
                   help="the N iterations with the best --metric")
    s.add_argument("--metric", metavar="KEY", help="numeric meta key of --keep-best (dotted "
                   "keys reach into nested dicts)")
    s.add_argument("--mode", choices=("min", "max"), help="--keep-best: lowest (min, default) "
                   "or highest (max) value is best")
    s.add_argument("--keep-newer-than", type=_duration, metavar="DURATION",
                   help="iterations committed within DURATION of now (90s, 15m, 2h, 3d, 1w)")
    s.add_argument("--keep-since-iteration", type=_iteration, metavar="I",
                   help="iterations >= I")
    s.add_argument("--dry-run", action="store_true", help="show what would be removed and the "
                   "bytes freed (estimated) without changing anything")
    s.add_argument("--follower-bases", action="store_true",
                   help="let kept deltas' chains start at verified bases of the shadow follower "
                   "(PATH/follower/, `ckptstore follow`): each such base is copied in as a "
                   "snapshot and the deltas before it that no policy keeps are dropped "
                   "(format-spec/follower.md §6)")
    s.set_defaults(func=cmd_gc)

    s = sub.add_parser("stats", help="per-checkpoint async pipeline statistics (stall, snapshot, "
                                     "write times, queue depth, bytes)")
    s.add_argument("path")
    s.add_argument("--last", type=int, help="only the last N checkpoints")
    s.set_defaults(func=cmd_stats)

    s = sub.add_parser("bisect", help="the first iteration where a condition holds (NaN, inf, "
                                      "a meta comparison, a function of the state)")
    s.add_argument("path")
    s.add_argument("--until", required=True, metavar="CONDITION",
                   help='"nan", "inf" (any non-finite value), a meta comparison such as '
                        '"loss > 10" (> >= < <= == !=), or module:function taking the state '
                        "and returning a bool; assumed to keep holding once it holds")
    s.add_argument("--start", type=int, help="first iteration searched (default: the first)")
    s.add_argument("--end", type=int, help="last iteration searched (default: the latest)")
    s.add_argument("--rank", type=int, help="multi-rank stores: this rank's state and meta")
    s.set_defaults(func=cmd_bisect)

    s = sub.add_parser("follow", help="shadow follower: replay every committed delta into a live "
                       "replica and write a base every K iterations into STORE/follower/",
                       description="Tail STORE (read-only; a Checkpointer store, e.g. written "
                       "with base_every=None) and keep a replica of its training state; every K "
                       "iterations write it as a base into the follower store STORE/follower/, "
                       "from which loads and restores start (format-spec/follower.md). Stops on "
                       "SIGINT/SIGTERM, --until-iteration or --timeout; a killed follower resumes.")
    s.add_argument("path", metavar="STORE")
    s.add_argument("--every", type=_count, default=100, metavar="K",
                   help="a follower base at every iteration that is a multiple of K (default 100)")
    s.add_argument("--keep", type=_count, metavar="N", help="keep only the newest N follower "
                   "bases (default: all)")
    s.add_argument("--poll", type=_duration, default=0.1, metavar="DURATION",
                   help="how often to look for new commits when caught up (default 0.1 s)")
    s.add_argument("--until-iteration", type=_iteration, metavar="I",
                   help="stop once the replica reaches iteration I")
    s.add_argument("--timeout", type=_duration, metavar="DURATION",
                   help="stop after DURATION (90s, 15m, 2h; a plain number is seconds)")
    s.add_argument("--wait", action="store_true",
                   help="wait for an empty STORE's first base instead of failing")
    s.add_argument("--threads", type=_count, metavar="N", help="torch intra-op threads, and "
                   "threads of the replay kernels when catching up (default: torch's, and 1)")
    s.set_defaults(func=cmd_follow)

    s = sub.add_parser("demo", help="train a small GPT with a delta checkpoint every iteration, "
                                    "SIGKILL it, resume bit-exactly, restore a past iteration, "
                                    "bisect a NaN, fsck")
    s.add_argument("--dir", default="demo-run")
    s.add_argument("--iterations", type=int, default=240)
    s.add_argument("--crash-at", type=int, default=137, help="SIGKILL the trainer after this iteration")
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("doctor", help="what a bug report needs: versions, platform, native "
                       "kernels, O_DIRECT, huge pages, free space, and a store's kind and format",
                       description="Print what a bug report needs: ckptstore, torch, numpy and "
                       "Python versions and the platform; whether the native replay kernels "
                       "build and load; whether the file system beside PATH (or the current "
                       "directory) takes O_DIRECT writes (a probe file, removed); the transparent "
                       "huge pages setting; free space; CKPTSTORE_* variables; and for PATH the "
                       "store's kind (single-writer or multi-rank job store), format version and "
                       "features (STORE header flags). Reads STORE files only, takes no lock.")
    s.add_argument("path", nargs="?", help="a store directory (optional)")
    s.set_defaults(func=cmd_doctor)

    _add_examples(p, sub)
    return p


#: each command's example, shown under its --help (and the main --help's)
_EXAMPLES = {
    "ls": "ckptstore ls runs/gpt",
    "show": "ckptstore show runs/gpt 1200\nckptstore show runs/gpt 1200 --rank 1      # a multi-rank "
            "job store: rank 1's part",
    "diff": "ckptstore diff runs/gpt 1000 1200",
    "restore": "ckptstore restore runs/gpt 1200 --out ckpt-1200.pt\n"
               "ckptstore restore runs/gpt 1200 --out full.safetensors --format safetensors",
    "import": "ckptstore import runs/gpt out/checkpoint-500     # iteration 500\n"
              "ckptstore import runs/gpt --from-dir out/         # every checkpoint in out/",
    "fsck": "ckptstore fsck runs/gpt\nckptstore fsck runs/gpt --repair\n"
            "ckptstore fsck s3://bucket/runs/gpt --endpoint-url http://127.0.0.1:9000",
    "push": "ckptstore push runs/gpt s3://bucket/runs/gpt --bandwidth 50M",
    "pull": "ckptstore pull s3://bucket/runs/gpt restored/gpt",
    "gc": "ckptstore gc runs/gpt --keep-last 5 --keep-every 1000 --dry-run\n"
          "ckptstore gc runs/gpt --keep-best 3 --metric val.loss --mode min",
    "stats": "ckptstore stats runs/gpt --last 20",
    "bisect": "ckptstore bisect runs/gpt --until nan\n"
              "ckptstore bisect runs/gpt --until \"loss > 10\" --start 1000",
    "follow": "ckptstore follow runs/gpt --every 100 --keep 3",
    "demo": "ckptstore demo --dir demo-run",
    "doctor": "ckptstore doctor\nckptstore doctor runs/gpt",
}


def _add_examples(parser: argparse.ArgumentParser, sub: Any) -> None:
    """An "example:" epilog under every command's --help, and the main --help's (raw text, so
    the lines stay as written; the descriptions are wrapped here instead)."""
    import textwrap

    def indent(text: str) -> str:
        return textwrap.indent(text, "  ")

    for name, s in sub.choices.items():
        s.formatter_class = argparse.RawDescriptionHelpFormatter
        if s.description:
            s.description = textwrap.fill(s.description, 78)
        example = _EXAMPLES.get(name)
        if example:
            s.epilog = "example:\n" + indent(example)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = ("examples:\n" + indent("\n".join(_EXAMPLES[c].splitlines()[0] for c in (
        "ls", "show", "restore", "fsck", "gc", "bisect", "doctor"))) +
        "\n\n`ckptstore COMMAND --help` shows a command's options and examples. Exit status: 0 "
        "success,\n1 damage found or an operation failed, 2 bad usage.")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse takes a command's positionals in one run: the OUT of "restore STORE
        # --iteration N OUT" comes after the options, and is the restore's
        if args.command == "restore" and not any(e.startswith("-") for e in extra):
            args.positional += extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except JobStreamError as e:  # a misuse, not a failure: one rank's stream on its own
        print(f"ckptstore {args.command}: {printable(str(e))}", file=sys.stderr)
        return 2
    except (CkptStoreError, FileNotFoundError, PermissionError, IsADirectoryError) as e:
        print(f"ckptstore {args.command}: error: {printable(str(e))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
