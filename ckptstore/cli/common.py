"""What the commands share: opening a store by path, timestamps, argparse types, the remote
options of ``push``, ``pull`` and ``fsck``."""

from __future__ import annotations

import argparse
import datetime
import sys
from typing import Any

from ..errors import NotFoundError


def when(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9).isoformat(timespec="seconds")


def open_path(path: str, mode: str = "r", **options: Any):
    from .. import open as open_store

    return open_store(path, mode, **options)


def latest_iteration(store: Any, path: str) -> int:
    latest = store.latest()
    if latest is None:
        raise NotFoundError(f"{path} holds no committed checkpoint")
    return latest


def count_arg(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {n}")
    return n


def iteration_arg(text: str) -> int:
    """argparse type: an iteration (int >= 0)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {n}")
    return n


def duration_arg(text: str) -> float:
    """argparse type: a duration such as 90s, 15m, 2h, 3d (seconds)."""
    from ..ops.retention import parse_duration

    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def rate_arg(text: str) -> float:
    """argparse type: bytes/s, with an optional K, M or G suffix (powers of 1024)."""
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1:].lower(), 1)
    try:
        n = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r} (e.g. 50M)") from None
    if not n > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text!r}")
    return n


def remote_options(args: argparse.Namespace) -> dict:
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
    from ..remote import split_options

    try:
        split_options(opts)
    except (TypeError, ValueError) as e:
        print(f"ckptstore {args.command}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return opts
