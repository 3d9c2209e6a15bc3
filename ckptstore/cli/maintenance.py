"""Keeping a store healthy and small: ``fsck``, ``gc``, and ``follow`` (the shadow follower that
writes bases for fast restores)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from ..multirank.fsck import check_job
from ..storage.job_log import is_job_store
from .common import open_path, remote_options
from .console import human_bytes, printable, progress


def cmd_fsck(args: argparse.Namespace) -> int:
    from ..ops.fsck import check
    from ..remote import is_remote_url, verify_remote

    if is_remote_url(args.path) or args.remote:
        if args.repair:
            print("ckptstore fsck: --repair applies to local stores only", file=sys.stderr)
            return 2
        url = args.path if is_remote_url(args.path) else args.remote
        local = None if is_remote_url(args.path) else args.path
        clean = True
        if local is not None:
            with progress("fsck", None) as tick:
                local_report: Any = (check_job(local, progress=tick) if is_job_store(local)
                                     else check(local, progress=tick))
            for line in local_report.lines():
                print(printable(line))
            clean = local_report.clean
        with progress("fsck remote", None) as tick:
            remote_report = verify_remote(url, remote_options(args), progress=tick, local=local)
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
    from ..ops.retention import policy_from_options

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
        from .. import open as open_store

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
    with open_path(args.path, "a") as store:
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
    §22.7): the same policy options and ``--follower-bases`` (format-spec/follower.md §7);
    every rank keeps or drops an iteration together."""
    from .. import open as open_store

    with open_store(args.path, "r") as store:
        if args.dry_run:
            r = store.gc(policy=policy, dry_run=True, follower_bases=args.follower_bases)
            print(f"dry run, nothing changed: gc would remove {len(r.removed)} of "
                  f"{len(r.kept) + len(r.removed)} iterations of the job (on every rank)"
                  + (f": {_ranges(r.removed)}" if r.removed else ""))
            print(f"would keep {len(r.kept)}: {_ranges(r.kept)}" if r.kept else "would keep none")
            for it in r.added:
                print(f"  {it}: {r.why.get(it, 'kept')}")
            _print_rebase(r, args.follower_bases, "would ")
            print(f"would free about {human_bytes(max(0, r.bytes_freed))}: job store "
                  f"{human_bytes(r.bytes_before)} -> about {human_bytes(r.bytes_after)}")
            return 0
        with progress("gc", None) as tick:
            r = store.gc(policy=policy, progress=tick, follower_bases=args.follower_bases)
    print(f"kept {len(r.kept)} iterations, removed {len(r.removed)}"
          + (f" ({', '.join(map(str, r.removed[:20]))}{' ...' if len(r.removed) > 20 else ''})"
             if r.removed else "") + (f"; now epoch {r.epoch}" if r.epoch else ""))
    _print_rebase(r, args.follower_bases, "")
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


def cmd_follow(args: argparse.Namespace) -> int:
    import signal

    from ..follow import Follower

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
