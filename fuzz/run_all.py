"""Run every fuzz target for a bounded time; exit non-zero on any finding.

    python fuzz/run_all.py [--seconds S] [--jobs J] [TARGET ...]

Each target runs in its own subprocess (fuzz/run_target.py) for ``S`` seconds (default: env
CKPTSTORE_FUZZ_SECONDS, else 30) with libFuzzer's limits: -rss_limit_mb=2048 (a length field must
never make a decoder allocate gigabytes), -timeout=10 per input (no hangs), -max_len=16384. Inputs
that crash, time out or exceed the memory limit are written to fuzz/regressions/<target>/ (replayed
by tests/test_fuzz_regressions.py). The committed seeds in fuzz/corpus/<target>/ are read, never
written: new coverage goes to a temporary directory. Prints executions and coverage per target.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

RSS_LIMIT_MB = 2048
TIMEOUT_S = 10
MAX_LEN = 16384


@dataclass
class Result:
    name: str
    rc: int
    execs: int | None
    cov: int | None
    seconds: float
    findings: list[str]
    tail: str

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.findings


def target_names() -> list[str]:
    from fuzz.targets import TARGETS

    return list(TARGETS)


def run_one(name: str, seconds: int) -> Result:
    corpus = os.path.join(HERE, "corpus", name)
    regress = os.path.join(HERE, "regressions", name)
    os.makedirs(regress, exist_ok=True)
    before = set(os.listdir(regress))
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"ckptstore-fuzz-{name}-") as work:
        cmd = [sys.executable, os.path.join(HERE, "run_target.py"), name,
               f"-max_total_time={seconds}", f"-rss_limit_mb={RSS_LIMIT_MB}",
               f"-timeout={TIMEOUT_S}", f"-max_len={MAX_LEN}", "-print_final_stats=1",
               f"-artifact_prefix={regress}{os.sep}", work]
        if os.path.isdir(corpus):
            cmd.append(corpus)
        env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE) + os.pathsep +
                   os.environ.get("PYTHONPATH", ""))
        # A hard wall-clock stop well past libFuzzer's own (startup and seed replay included).
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace", env=env, timeout=seconds + 300)
            out, rc = p.stdout, p.returncode
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode("utf-8", "replace") if isinstance(e.stdout, bytes) \
                else (e.stdout or "")
            out += "\nrun_all: target did not stop in time"
            rc = 124
    execs = _stat(out, "number_of_executed_units")
    cov = _last_int(out, r"\bcov: (\d+)")
    findings = sorted(set(os.listdir(regress)) - before)
    return Result(name, rc, execs, cov, time.monotonic() - t0, findings, out[-6000:])


def _stat(out: str, key: str) -> int | None:
    m = re.search(rf"stat::{key}:\s*(\d+)", out)
    return int(m.group(1)) if m else None


def _last_int(out: str, pattern: str) -> int | None:
    found = re.findall(pattern, out)
    return int(found[-1]) if found else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("targets", nargs="*", help="targets to run (default: all)")
    ap.add_argument("--seconds", type=int,
                    default=int(os.environ.get("CKPTSTORE_FUZZ_SECONDS", "30")))
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("CKPTSTORE_FUZZ_JOBS", "2")))
    args = ap.parse_args(argv)
    names = args.targets or target_names()
    unknown = set(names) - set(target_names())
    if unknown:
        ap.error(f"unknown targets {sorted(unknown)}")
    print(f"fuzzing {len(names)} targets, {args.seconds} s each, {args.jobs} at a time", flush=True)
    failed = []
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for r in pool.map(lambda n: run_one(n, args.seconds), names):
            status = "ok" if r.ok else "FINDING" if r.findings else f"FAILED (exit {r.rc})"
            print(f"{r.name:16s} {status:10s} execs {r.execs if r.execs is not None else '?':>9} "
                  f"cov {r.cov if r.cov is not None else '?':>5}  {r.seconds:5.0f} s", flush=True)
            if not r.ok:
                failed.append(r)
    for r in failed:
        print(f"\n==== {r.name}: exit {r.rc}; inputs written to fuzz/regressions/{r.name}/: "
              f"{r.findings}\n{r.tail}", flush=True)
    print("fuzz: " + ("no findings" if not failed else f"{len(failed)} targets FAILED: "
                                                        f"{[r.name for r in failed]}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
