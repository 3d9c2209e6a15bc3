"""Read-only questions about a store's history: ``ls``, ``show``, ``diff``, ``stats``,
``bisect``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..multirank.job_store import JobStore
from .common import latest_iteration, open_path, when
from .console import human_bytes, printable, table


def _ls_job(store: Any, path: str) -> int:
    """ls of a multi-rank job store: one row per iteration, sizes summed over its ranks."""
    rows = []
    for it in store.iterations():
        g = store.global_commit(it)
        infos = [store.info(it, rank=r) for r in range(g.world_size)]
        rows.append([it, infos[0].kind, g.epoch, g.world_size, when(infos[0].created_ns),
                     human_bytes(sum(i.logical_bytes for i in infos)),
                     human_bytes(sum(i.written_bytes for i in infos))])
    print(f"{path}: multi-rank job store, {store.world_size} ranks, epochs {store.view.chain}")
    if rows:
        print(table(rows, ["iteration", "kind", "epoch", "ranks", "created", "size", "written"]))
    else:
        print("no committed checkpoints")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    with open_path(args.path) as store:
        if isinstance(store, JobStore):
            return _ls_job(store, args.path)
        rows = []
        for it in store.iterations():
            info = store.info(it)
            rows.append([it, info.kind, when(info.created_ns), human_bytes(info.logical_bytes),
                         human_bytes(info.written_bytes), info.snapshot_root[:12]])
        if not rows:
            print(f"{args.path}: no committed checkpoints")
            return 0
        print(table(rows, ["iteration", "kind", "created", "size", "written", "root"]))
    return 0


def _show_dcp(store: Any, iteration: int, path: str) -> int:
    """show of a DCP checkpoint: its sharded layout (ckptstore.dcp.layout). Exit 1 when a
    tensor's shards do not tile it."""
    from ..integrations.dcp import layout

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
          f"{when(info.created_ns)}")
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
    from ..replay.shards import layout_problems

    g = store.global_commit(iteration)
    info, base = store.info(iteration, rank=0), store.base_of(iteration, rank=0)
    print(f"iteration {iteration} ({info.kind}): sharded Checkpointer parts (FSDP2 / DTensor) "
          f"of {g.world_size} ranks in epoch {g.epoch}; created {when(info.created_ns)}"
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
    from ..integrations.dcp import is_dcp

    with open_path(args.path) as opened:
        it = args.iteration if args.iteration is not None else latest_iteration(opened, args.path)
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
        print(f"iteration {info.iteration} ({info.kind}), created {when(info.created_ns)}")
        print(f"size {human_bytes(info.logical_bytes)} in {len(m.tensors)} tensors, written "
              f"{human_bytes(info.written_bytes)}, chunk size {human_bytes(m.chunk_size)}, root {info.snapshot_root}")
        print(f"meta: {json.dumps(store.meta(it), default=repr)}")
        rows = [[t.path, t.lib, t.dtype, "x".join(map(str, t.shape)) or "scalar", human_bytes(t.nbytes),
                 t.root.hex()[:12]] for t in m.tensors]
        if rows:
            print(table(rows, ["tensor", "lib", "dtype", "shape", "bytes", "root"]))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    with open_path(args.path) as store:
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

    with open_path(args.path) as store:
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
    from ..errors import BisectError
    from ..ops.bisect import parse_condition

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
    with open_path(args.path) as store:
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
