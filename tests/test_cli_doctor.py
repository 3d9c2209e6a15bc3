"""``ckptstore doctor [PATH]``: what a bug report needs (versions, platform, native kernels,
O_DIRECT, transparent huge pages, free space, and for PATH the store's kind, format version and
features); and every command's ``--help`` shows an example."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

import ckptstore
from ckptstore.cli import _EXAMPLES, build_parser, main

ROOT = str(pathlib.Path(__file__).resolve().parent.parent)


def _doctor(capsys, *args: str) -> tuple[int, dict[str, str]]:
    rc = main(["doctor", *args])
    out = capsys.readouterr().out
    rows = {}
    for line in out.splitlines()[2:]:  # the header and its rule
        key, _, value = line.partition("  ")
        rows[key.strip()] = value.strip()
    return rc, rows


def test_doctor_without_a_path_reports_the_environment(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CKPTSTORE_HUGEPAGES", "0")
    rc, rows = _doctor(capsys)
    assert rc == 0
    assert rows["ckptstore"] == ckptstore.__version__ and rows["torch"] == torch.__version__
    assert rows["python"].startswith(".".join(map(str, sys.version_info[:3])))
    assert rows["platform"] and rows["cpus"]
    assert rows["O_DIRECT"].split(":")[0].split(" ")[0] in ("yes", "no", "unknown")
    assert "CKPTSTORE_HUGEPAGES=0" in rows["transparent huge pages"]
    assert "CKPTSTORE_HUGEPAGES=0" in rows["environment"]
    assert "free space" in rows and str(tmp_path) in rows["free space"]
    assert any(k.startswith("kernel ") or k == "native kernels" for k in rows)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".ckptstore-doctor-")]


def test_doctor_with_native_kernels_off(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CKPTSTORE_NATIVE", "0")
    rc, rows = _doctor(capsys)
    assert rc == 0 and rows["native kernels"].startswith("off")


@pytest.mark.parametrize("features", ["current", "compatible"])
def test_doctor_describes_a_single_writer_store(tmp_path, capsys, features):
    path = tmp_path / "run"
    with ckptstore.open(path, "a", features=features) as s:
        s.save(1, {"w": torch.ones(4)})
        listing = sorted(os.listdir(path))
        rc, rows = _doctor(capsys, str(path))  # beside a running writer: reads STORE only
    assert rc == 0
    assert rows["store kind"] == "single-writer store"
    assert rows["format version"] == "1"
    if features == "current":
        assert rows["features"] == "FRAMING_CHECKS"
    else:
        assert rows["features"].startswith("none")
    assert rows["chunk size"] == "4.0 MiB" and rows["path"] == str(path)
    assert sorted(os.listdir(path)) == listing  # nothing written inside the store
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".ckptstore-doctor-")]


def test_doctor_refuses_what_is_not_a_store(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    rc, rows = _doctor(capsys, str(tmp_path / "empty"))
    assert rc == 1 and "no STORE file" in rows["store"]
    rc, rows = _doctor(capsys, str(tmp_path / "missing"))
    assert rc == 1 and "not a directory" in rows["store"]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "STORE").write_bytes(b"garbage")
    rc, rows = _doctor(capsys, str(tmp_path / "bad"))
    assert rc == 1 and rows["store"].startswith("unreadable")


_JOB = r"""
import sys, torch, ckptstore
import torch.distributed as dist
path = sys.argv[1]
dist.init_process_group("gloo", init_method="file://" + path + ".rdv", rank=0, world_size=1)
with ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=30.0) as js:
    js.save(1, {"w": torch.ones(4)})
dist.destroy_process_group()
"""


def test_doctor_describes_a_job_store_and_its_streams(tmp_path, capsys):
    path = str(tmp_path / "job")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", _JOB, path], capture_output=True, text=True,
                         env=env, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    rc, rows = _doctor(capsys, path)
    assert rc == 0
    assert rows["store kind"] == "multi-rank job store"
    assert rows["format version"] == "2"
    assert rows["writer epochs"].startswith("1") and rows["rank streams"] == "1"
    stream = next(k for k in rows if k.startswith("features (stream "))
    assert rows[stream] == "FRAMING_CHECKS"
    stream_dir = os.path.join(path, "streams", os.listdir(os.path.join(path, "streams"))[0])
    rc, rows = _doctor(capsys, stream_dir)
    assert rc == 0 and "one rank's stream of the job store" in rows["store kind"]


def test_every_command_help_shows_an_example(capsys):
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(commands) == set(_EXAMPLES)
    for name in commands:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert "example:" in out and f"ckptstore {name}" in out.split("example:")[1], name
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "ckptstore doctor" in out
