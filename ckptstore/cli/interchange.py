"""Checkpoints in and out of other formats: ``restore`` (torch, safetensors, DCP) and ``import``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..multirank.job_store import JobStore
from ..storage.job_log import is_job_store
from .common import iteration_arg, open_path
from .console import human_bytes, printable, progress, table


def _restore_args(args: argparse.Namespace) -> tuple[int, str] | None:
    """(iteration, out) from ``restore STORE ITER --out OUT``, ``restore STORE ITER OUT`` or
    ``restore STORE --iteration ITER OUT``; None (a usage message printed) for anything else."""
    given = list(args.positional)
    iteration = args.iteration_opt
    if iteration is None and given:
        try:
            iteration = iteration_arg(given.pop(0))
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
    from ..integrations.dcp import is_dcp, load_full_state_dict

    parsed = _restore_args(args)
    if parsed is None:
        return 2
    args.iteration, args.out = parsed
    with open_path(args.path) as store:
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
    from ..integrations.interop import write_state

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
    from ..integrations.interop import import_checkpoint, import_dir, load_source, scan_dir

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

        with open_path(args.path, "a", features=args.features) as store:
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
            iteration = iteration_arg(args.source[0])
        except argparse.ArgumentTypeError as e:
            return _import_usage(f"ITER {e}")
    loaded = load_source(args.source[-1], args.kind)  # read and checked before the store opens
    with open_path(args.path, "a", features=args.features) as store:
        with progress("import", None) as tick:
            r = import_checkpoint(store, iteration, loaded, meta=meta, progress=tick)
    print(f"imported {printable(r.source)} ({r.kind}) as iteration {r.iteration}: "
          f"{human_bytes(r.stats.logical_bytes)} in {r.stats.tensors} tensors, "
          f"{human_bytes(r.stats.written_bytes)} written, {human_bytes(r.stats.dedup_bytes)} "
          "already stored")
    for name, why in r.skipped:
        print(f"left out {printable(name)}: {printable(why)}")
    return 0
