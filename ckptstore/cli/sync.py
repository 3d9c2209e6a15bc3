"""The remote tier from the shell: ``push`` a store to an object store, ``pull`` it back."""

from __future__ import annotations

import argparse

from .common import remote_options
from .console import human_bytes, progress


def cmd_push(args: argparse.Namespace) -> int:
    """Upload a store's committed state to an object store (only what the remote lacks)."""
    from ..remote import push

    with progress("push", None) as tick:
        r = push(args.path, args.url, remote_options(args), progress=tick)
    h = r.head
    print(f"pushed {args.path} to {r.url}: HEAD generation {h.generation}, iteration "
          f"{h.recoverable} ({h.count} iterations); sent {human_bytes(r.stats.uploaded_bytes)} in "
          f"{r.stats.uploaded_objects} objects, {r.stats.reused_objects} already there, "
          f"{r.seconds:.2f} s")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    """Restore the newest remote HEAD into a local directory (incremental into a copy)."""
    from ..remote import pull

    with progress("pull", None) as tick:
        r = pull(args.url, args.path, remote_options(args), progress=tick)
    h = r.head
    print(f"pulled {r.url} (HEAD generation {h.generation}, iteration {h.recoverable}, "
          f"{h.count} iterations) into {r.path}: {human_bytes(r.downloaded_bytes)} downloaded in "
          f"{r.downloaded_objects} objects, {human_bytes(r.kept_bytes)} already there, "
          f"{r.seconds:.2f} s")
    return 0
