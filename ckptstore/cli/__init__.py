"""The ``ckptstore`` command line: ls, show, diff, restore, import, fsck, gc, stats, bisect, demo,
push, pull, follow, doctor.

Exit codes: 0 success (fsck: clean; bisect: found); 1 the store is damaged or an operation failed
(the message says what and where; bisect: the condition never holds); 2 bad usage.

This module declares the command line (every command, its arguments, help and example) and runs
it (:func:`main`); the commands are in one module per group: ``views`` (ls, show, diff, stats,
bisect), ``interchange`` (restore, import), ``maintenance`` (fsck, gc, follow), ``sync`` (push,
pull), ``system`` (doctor, demo); ``common`` holds what they share, ``console`` the terminal
output (rich), ``demo`` the demo behind ``ckptstore demo``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from ..errors import CkptStoreError, JobStreamError
from .common import count_arg, duration_arg, iteration_arg, rate_arg
from .console import printable
from .interchange import cmd_import, cmd_restore
from .maintenance import cmd_follow, cmd_fsck, cmd_gc
from .sync import cmd_pull, cmd_push
from .system import cmd_demo, cmd_doctor
from .views import cmd_bisect, cmd_diff, cmd_ls, cmd_show, cmd_stats


def _remote_arguments(s: argparse.ArgumentParser, bandwidth: bool) -> None:
    s.add_argument("--endpoint-url", help="the S3 endpoint (MinIO, R2, a test server, ...); "
                   "credentials come from the environment (AWS_ACCESS_KEY_ID, ...)")
    s.add_argument("--region", help="the bucket's region")
    if bandwidth:
        s.add_argument("--bandwidth", type=rate_arg, metavar="BYTES_PER_S",
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
    s.add_argument("iteration", type=iteration_arg, nargs="?",
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
    s.add_argument("--iteration", dest="iteration_opt", type=iteration_arg, metavar="ITER")
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
    s.add_argument("--keep-last", type=count_arg, metavar="N", help="the N newest iterations")
    s.add_argument("--keep-every", type=count_arg, metavar="K",
                   help="every iteration that is a multiple of K")
    s.add_argument("--keep-best", type=count_arg, metavar="N",
                   help="the N iterations with the best --metric")
    s.add_argument("--metric", metavar="KEY", help="numeric meta key of --keep-best (dotted "
                   "keys reach into nested dicts)")
    s.add_argument("--mode", choices=("min", "max"), help="--keep-best: lowest (min, default) "
                   "or highest (max) value is best")
    s.add_argument("--keep-newer-than", type=duration_arg, metavar="DURATION",
                   help="iterations committed within DURATION of now (90s, 15m, 2h, 3d, 1w)")
    s.add_argument("--keep-since-iteration", type=iteration_arg, metavar="I",
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
    s.add_argument("--every", type=count_arg, default=100, metavar="K",
                   help="a follower base at every iteration that is a multiple of K (default 100)")
    s.add_argument("--keep", type=count_arg, metavar="N", help="keep only the newest N follower "
                   "bases (default: all)")
    s.add_argument("--poll", type=duration_arg, default=0.1, metavar="DURATION",
                   help="how often to look for new commits when caught up (default 0.1 s)")
    s.add_argument("--until-iteration", type=iteration_arg, metavar="I",
                   help="stop once the replica reaches iteration I")
    s.add_argument("--timeout", type=duration_arg, metavar="DURATION",
                   help="stop after DURATION (90s, 15m, 2h; a plain number is seconds)")
    s.add_argument("--wait", action="store_true",
                   help="wait for an empty STORE's first base instead of failing")
    s.add_argument("--threads", type=count_arg, metavar="N", help="torch intra-op threads, and "
                   "threads of the replay kernels when catching up (default: torch's, and 1)")
    s.set_defaults(func=cmd_follow)

    s = sub.add_parser("demo", help="train a small GPT with a delta checkpoint every iteration, "
                                    "SIGKILL it, resume bit-exactly, restore a past iteration, "
                                    "bisect a NaN, fsck")
    s.add_argument("--dir", default="demo-run")
    s.add_argument("--iterations", type=int, default=160)
    s.add_argument("--crash-at", type=int, default=97, help="SIGKILL the trainer after this iteration")
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
