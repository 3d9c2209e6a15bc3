"""Build the seed corpus fuzz/corpus/<target>/ (deterministic; run from the repository root).

    python fuzz/make_corpus.py

Seeds come from (1) the hex vectors of format-spec/vectors/vectors.json, by kind, and (2) two
small real stores made here with a fixed store id and clock: snapshots of a mixed state (torch and
numpy tensors, chunked, inline and lz4-compressible, big ints, NaN, bytes, a state_dict with
_metadata) and a torch Checkpointer chain (a base and exact deltas). Every record, payload, STORE
header, segment file and state skeleton of those stores becomes a seed of the matching target.
Stores use tiny chunks and segments so every seed stays under run_all's -max_len. Each seed is one
control byte (fuzz/targets.py: 0 = decode verbatim, 1 = repair checksums first) plus the body.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import shutil
import sys
import tempfile
from collections import OrderedDict
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import ckptstore  # noqa: E402
from ckptstore.format import records as rec  # noqa: E402
from ckptstore.format.manifest import decode_manifest  # noqa: E402
from ckptstore.storage.layout import Layout  # noqa: E402
from ckptstore.storage.segments import ScannedRecord, SegmentFile, scan_segment  # noqa: E402

from fuzz.run_all import MAX_LEN  # noqa: E402
from fuzz.targets import TARGETS, delta_fixture  # noqa: E402

CORPUS = os.path.join(HERE, "corpus")
VECTOR_TARGETS = {"store_header": ["header"], "segment_header": ["header"], "record": ["records"],
                  "chunk": ["chunk"], "tree": ["tree"], "commit": ["commit"],
                  "manifest": ["manifest"], "state": ["state"], "segment": ["segment", "store_open"],
                  "epoch": ["global_log"], "global_commit": ["global_log"],
                  "job_record": ["global_log"]}
PAYLOAD_TARGET = {rec.RecordType.SEGMENT_HEADER: "header", rec.RecordType.CHUNK: "chunk",
                  rec.RecordType.TREE: "tree", rec.RecordType.MANIFEST: "manifest",
                  rec.RecordType.COMMIT: "commit"}


class Seeds:
    def __init__(self) -> None:
        self.files: dict[str, dict[str, bytes]] = {name: {} for name in TARGETS}

    def add(self, target: str, name: str, body: bytes, control: int = 0) -> None:
        data = bytes([control]) + body
        if len(data) > MAX_LEN:
            return
        digest = hashlib.sha1(data).hexdigest()[:12]
        if any(hashlib.sha1(v).hexdigest()[:12] == digest for v in self.files[target].values()):
            return
        self.files[target][f"{name}-{digest}"] = data

    def write(self) -> None:
        for target, files in self.files.items():
            d = os.path.join(CORPUS, target)
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
            for name, data in sorted(files.items()):
                with open(os.path.join(d, name), "wb") as fh:
                    fh.write(data)


def from_vectors(seeds: Seeds) -> None:
    with open(os.path.join(ROOT, "format-spec", "vectors", "vectors.json")) as fh:
        vectors = json.load(fh)["vectors"]
    for v in vectors:
        for target in VECTOR_TARGETS.get(v["kind"], []):
            seeds.add(target, f"vec-{v['name']}", bytes.fromhex(v["hex"]))
    # a whole global log: the EPOCH record of epoch 2, then a GLOBAL_COMMIT of that epoch
    by_name = {v["name"]: v for v in vectors}
    log = bytes.fromhex(by_name["record_epoch"]["hex"]) + bytes.fromhex(
        by_name["record_global_commit"]["hex"])
    seeds.add("global_log", "log-epoch-and-commit", log)
    seeds.add("global_log", "log-torn-tail", log[:-9])


def mixed_state(i: int) -> dict:
    g = np.random.default_rng(i)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(i)
    return {
        "model": model.state_dict(),
        "w": torch.from_numpy(g.standard_normal(600).astype(np.float32)),    # 2400 B, 3 chunks
        "zeros": np.zeros(1500, dtype=np.int16),                               # lz4 chunks
        "small": torch.arange(4, dtype=torch.float64) + i,                     # inline
        "half": torch.ones(3, 5, dtype=torch.bfloat16),
        "flags": np.array([True, False]),
        "step": i, "big": -(2 ** 70 + i), "nan": float("nan"), "neg0": -0.0, "inf": float("inf"),
        "raw": bytes(range(i, i + 5)), "t": (1, "two", None, [3.5]), "k": {7: "int key", 2 ** 64: 1},
    }


def mixed_store(path: str) -> None:
    with ckptstore.open(path, "a", chunk_size=1024, segment_size=6000) as s:
        for i in (1, 2, 3, 5):
            s.save(i, mixed_state(i), meta={"loss": 1.0 / i, "note": "seed"})


def delta_store(path: str) -> None:
    from ckptstore.torch import Checkpointer

    torch.manual_seed(1)
    model = torch.nn.Linear(6, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with ckptstore.open(path, "a", chunk_size=512, segment_size=6000) as s:
        ck = Checkpointer(s, model, opt, policy="every-iteration", base_every=3, group_commit=2)
        ck.save_base(0)
        for it in range(1, 6):
            model(torch.randn(3, 6)).sum().backward()
            ck.step(it)
            opt.zero_grad()
        ck.flush()


def from_store(seeds: Seeds, path: str, tag: str) -> None:
    layout = Layout(path)
    with open(layout.store_file, "rb") as fh:
        seeds.add("header", f"{tag}-STORE", fh.read())
    for seq in layout.list_segments():
        seg_path = layout.segment_path(seq)
        with open(seg_path, "rb") as fh:
            body = fh.read()
        seeds.add("segment", f"{tag}-seg{seq}", body)
        if seq == 1:
            seeds.add("store_open", f"{tag}-seg{seq}", body)
        else:  # renumber to 1 (store_open's file name); control 1 repairs the checks
            patched = body[:32] + (1).to_bytes(8, "little") + body[40:]
            seeds.add("store_open", f"{tag}-seg{seq}-as1", patched, control=1)
        f = SegmentFile(seg_path, seq)
        try:
            for item in scan_segment(f, 0, verify=True):
                assert isinstance(item, ScannedRecord) and item.error is None, item
                whole = body[item.loc.offset:item.loc.end]
                kind = rec.RecordType(item.type).name.lower()
                seeds.add("records", f"{tag}-{kind}", whole)
                payload = whole[rec.HEADER_SIZE:-rec.TRAILER_SIZE]
                target = PAYLOAD_TARGET.get(item.type)
                if target:
                    seeds.add(target, f"{tag}-{kind}", payload)
                if item.type == rec.RecordType.MANIFEST:
                    m = decode_manifest(payload)
                    for part in (m.state, m.meta):
                        seeds.add("state", f"{tag}-skeleton", json.dumps(part).encode())
        finally:
            f.close()


def from_delta_fixture(seeds: Seeds) -> None:
    fx = delta_fixture()
    seeds.add("delta", "fixture-delta1", json.dumps(fx["delta_skeleton"]).encode())
    seeds.add("replay_base", "fixture-base", json.dumps(fx["base_skeleton"]).encode())
    from ckptstore.format.state import flatten

    def hook(x, p):
        return x if isinstance(x, (torch.Tensor, np.ndarray)) else None

    skel2, _ = flatten(fx["records"][2], hook)
    seeds.add("delta", "fixture-delta2", json.dumps(skel2).encode())
    seeds.add("state", "fixture-delta1", json.dumps(fx["delta_skeleton"]).encode())


def roundtrip_seeds(seeds: Seeds) -> None:
    rng = random.Random(20240601)
    for i in range(24):
        seeds.add("state_roundtrip", f"random{i}", bytes(rng.randrange(256) for _ in range(64 + 8 * i)))


def job_head_seeds(seeds: Seeds) -> None:
    """Job HEADs (format-spec/remote.md §8.1): an empty cut, a two-epoch cut of two ranks with an
    unknown key, and shapes the decoder refuses (sealed, so each reaches the field checks)."""
    from ckptstore.remote.head import Extent, seal_json
    from ckptstore.remote.job_head import JobHead, LogEntry, StreamRef, encode_job_head

    d = bytes(range(16))
    empty = JobHead(generation=1, store_id=d, store_digest=d, epoch=0, end=0, latest=None,
                    count=0, streams=(), logs=())
    two = JobHead(generation=3, store_id=d, store_digest=d, epoch=2, end=300, latest=9, count=4,
                  streams=(StreamRef(1, 0, 5, d), StreamRef(1, 1, 2, d), StreamRef(2, 0, 1, d),
                           StreamRef(2, 1, 1, d)),
                  logs=(LogEntry(1, 200, (Extent(1, 0, 200, d),)),
                        LogEntry(2, 300, (Extent(2, 0, 100, d), Extent(2, 100, 200, d)))),
                  created_ns=7, extra={"note": "an unknown key"})
    seeds.add("job_head", "empty", encode_job_head(empty))
    good = encode_job_head(two)
    seeds.add("job_head", "two-epochs", good)
    seeds.add("job_head", "two-epochs-bad-check", good[:-3] + b"00\n")
    body = json.loads(good.partition(b"\n")[0])
    for name, change in [("streams-out-of-order", {"streams": body["streams"][::-1]}),
                         ("extents-gap", {"logs": [[1, 200, [[0, 100, d.hex()],
                                                             [150, 50, d.hex()]]],
                                                   body["logs"][1]]}),
                         ("epoch-not-newest", {"epoch": 1, "end": 200}),
                         ("version-2", {"v": 2})]:
        seeds.add("job_head", name, seal_json({**body, **change}))
        seeds.add("job_head", name + "-unsealed", seal_json({**body, **change})[:-3] + b"00\n",
                  control=1)


def main() -> None:
    seeds = Seeds()
    from_vectors(seeds)
    ids = itertools.count(1)
    with tempfile.TemporaryDirectory() as tmp, \
            mock.patch("ckptstore.storage.store_file.secrets.token_bytes", lambda n: bytes(range(n))), \
            mock.patch("time.time_ns", lambda: 1_700_000_000_000_000_000 + next(ids)):
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        mixed_store(os.path.join(tmp, "mixed"))
        from_store(seeds, os.path.join(tmp, "mixed"), "mixed")
        delta_store(os.path.join(tmp, "delta"))
        from_store(seeds, os.path.join(tmp, "delta"), "delta")
        from_delta_fixture(seeds)
    roundtrip_seeds(seeds)
    job_head_seeds(seeds)
    seeds.write()
    total = sum(len(v) for files in seeds.files.values() for v in files.values())
    for target, files in seeds.files.items():
        print(f"{target:16s} {len(files):4d} seeds {sum(map(len, files.values())):8d} bytes")
    print(f"total {total} bytes")


if __name__ == "__main__":
    main()
