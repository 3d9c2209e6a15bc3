"""Corruption handling: flip or cut bytes of a store and prove that

* fsck (read-only) detects it: not clean, names the file and the damaged record's offset, and
  lists exactly the iterations whose data covered the damaged bytes (expected sets are computed
  from the pristine store: which record holds the offset, which iterations reference it);
* every unaffected iteration still loads bit-exact (mode "r");
* loading an affected iteration raises a ckptstore error, never returns wrong bytes, never raises
  anything else;
* fsck --repair never removes an intact committed iteration.

Plus: an unknown STORE format version, garbage after the last commit, an uncommitted tail cut at
random offsets, a deleted segment, and the CLI's exit codes.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import ckptstore
from ckptstore.cli import main as cli_main
from ckptstore.errors import (CkptStoreError, DamagedCheckpointError, FormatError, NotFoundError,
                              UnsupportedVersionError)
from ckptstore.format import records as rec
from ckptstore.format.chunk import CHUNK_HEADER_SIZE, Codec, decode_chunk_header
from ckptstore.format.commit import decode_commit
from ckptstore.format.header import StoreHeader, decode_store_header, encode_store_header
from ckptstore.format.manifest import decode_manifest
from ckptstore.format.tree import decode_tree
from ckptstore.ops.fsck import check
from ckptstore.storage.layout import Layout
from ckptstore.storage.segments import ScannedRecord, SegmentFile, scan_segment

from _crashkit import CHUNK_SIZE, FreezeOps, state_for
from conftest import chunk_record_flags, create_store_without_features

SEGMENT_SIZE = 96 << 10  # several segments for a small store
ITERATIONS = [1, 2, 3, 4, 5, 6, 8, 9, 12, 15]
SEED = int(os.environ.get("CKPTSTORE_SEED", "1337"))
RANDOM_TRIALS = int(os.environ.get("CKPTSTORE_CORRUPTION_TRIALS", "40"))


# ---- the pristine store and its record map ----------------------------------------------------

@dataclass(frozen=True)
class Record:
    seq: int
    offset: int
    end: int
    type: int
    length: int

    @property
    def key(self) -> tuple[int, int]:
        return (self.seq, self.offset)

    @property
    def payload_offset(self) -> int:
        return self.offset + rec.HEADER_SIZE

    @property
    def trailer_offset(self) -> int:
        return self.end - rec.TRAILER_SIZE


@dataclass
class StoreMap:
    """Every record of the pristine store and what each committed iteration depends on."""

    path: Path
    records: list[Record] = field(default_factory=list)
    sizes: dict[int, int] = field(default_factory=dict)
    deps: dict[int, set[tuple[int, int]]] = field(default_factory=dict)
    commit_of: dict[int, Record] = field(default_factory=dict)
    manifest_of: dict[int, Record] = field(default_factory=dict)
    chunk_at: dict[bytes, Record] = field(default_factory=dict)
    codec_of: dict[tuple[int, int], int] = field(default_factory=dict)
    tree_at: dict[bytes, Record] = field(default_factory=dict)

    def record_at(self, seq: int, offset: int) -> Record:
        for r in self.records:
            if r.seq == seq and r.offset <= offset < r.end:
                return r
        raise AssertionError(f"no record at segment {seq} offset {offset}")

    def affected_by(self, keys: set[tuple[int, int]]) -> set[int]:
        return {it for it, d in self.deps.items() if d & keys}

    def users(self, r: Record) -> set[int]:
        return self.affected_by({r.key})

    def of_type(self, t: int) -> list[Record]:
        return [r for r in self.records if r.type == t]


def build_map(path: Path) -> StoreMap:
    layout = Layout(str(path))
    m = StoreMap(path)
    manifests: dict[tuple[int, int], object] = {}
    trees: dict[bytes, object] = {}
    for seq in layout.list_segments():
        f = SegmentFile(layout.segment_path(seq), seq)
        try:
            m.sizes[seq] = f.size()
            for item in scan_segment(f, 0, verify=True):
                assert isinstance(item, ScannedRecord) and item.error is None, item
                r = Record(seq, item.loc.offset, item.loc.end, item.type, item.loc.length)
                m.records.append(r)
                if item.type == rec.RecordType.CHUNK:
                    ch = decode_chunk_header(f.pread(r.payload_offset, CHUNK_HEADER_SIZE))
                    assert ch.address not in m.chunk_at, "pristine store holds a chunk twice"
                    m.chunk_at[ch.address] = r
                    m.codec_of[r.key] = int(ch.codec)
                elif item.type == rec.RecordType.TREE:
                    tree = decode_tree(item.payload)
                    assert tree.root not in m.tree_at, "pristine store holds a tree twice"
                    m.tree_at[tree.root] = r
                    trees[tree.root] = tree
                elif item.type == rec.RecordType.MANIFEST:
                    manifests[r.key] = (r, decode_manifest(item.payload))
                elif item.type == rec.RecordType.COMMIT:
                    c = decode_commit(item.payload)
                    mrec, man = manifests[(c.manifest_seq, c.manifest_offset)]
                    deps = {r.key, mrec.key}
                    for t in man.tensors:
                        if t.inline is not None or t.nbytes == 0:
                            continue
                        deps.add(m.tree_at[t.root].key)
                        deps |= {m.chunk_at[a].key for a in trees[t.root].addresses}
                    m.deps[c.iteration] = deps
                    m.commit_of[c.iteration] = r
                    m.manifest_of[c.iteration] = mrec
        finally:
            f.close()
    assert sorted(m.deps) == ITERATIONS
    return m


@pytest.fixture(scope="module", params=["framing_checks", "full_checks"])
def pristine(request, tmp_path_factory) -> StoreMap:
    """The store every trial damages a copy of: one created now (CHUNK records with
    FRAMING_CHECK trailers), and one with STORE flags 0 (every record's trailer over its whole
    payload, as older releases wrote)."""
    path = tmp_path_factory.mktemp("pristine") / "store"
    if request.param == "full_checks":
        create_store_without_features(path, CHUNK_SIZE, SEGMENT_SIZE)
    with ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=SEGMENT_SIZE) as w:
        for it in ITERATIONS:
            w.save(it, state_for(it))
    m = build_map(path)
    # The store exercises what the trials rely on: several segments, shared chunks and trees,
    # compressed and raw chunks, commits in several segments.
    assert len(m.sizes) >= 5
    assert any(len(m.users(r)) > 1 for r in m.of_type(rec.RecordType.CHUNK))
    assert any(len(m.users(r)) > 1 for r in m.of_type(rec.RecordType.TREE))
    assert {Codec.RAW, Codec.LZ4} <= set(m.codec_of.values())
    assert len({r.seq for r in m.commit_of.values()}) >= 3
    flags = set(chunk_record_flags(path))
    assert flags == ({rec.FRAMING_CHECK} if request.param == "framing_checks" else {0}), flags
    report = check(path)
    assert report.clean and report.iterations == ITERATIONS and not report.notes, report.lines()
    return m


@pytest.fixture(scope="module")
def expected_states() -> dict:
    return {it: state_for(it) for it in ITERATIONS}


def fresh_copy(pristine: StoreMap, tmp_path: Path, name: str) -> Path:
    dest = tmp_path / name
    shutil.copytree(pristine.path, dest)
    return dest


def flip(path: Path, offset: int, n: int, rng: random.Random) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ rng.randint(1, 255) for b in old))


# ---- the checks every damaged store must pass -------------------------------------------------

def _named(report, it: int) -> bool:
    return any(re.search(rf"\biteration {it}\b", line) for line in report.lines())


def assert_contained(store: Path, pristine: StoreMap, expected_states, *, seq: int, offset: int,
                     expected: set[int], where: str, damaged: set[tuple[int, int]],
                     silent_load_ok: bool = False) -> None:
    """fsck detects and locates the damage at (seq, offset), lists exactly ``expected`` and names
    each of them; reads stay correct; repair keeps every intact iteration. ``damaged``: keys of the
    records hit. ``silent_load_ok``: the damaged bytes are outside what the read path verifies, so
    a load may also succeed (bit-exact)."""
    seg_path = Layout(str(store)).segment_path(seq)
    intact = set(ITERATIONS) - expected

    report = check(store)
    lines = "\n".join(report.lines())
    assert not report.clean, f"{where}: fsck did not notice:\n{lines}"
    start = pristine.record_at(seq, offset).offset
    assert any(d.path == seg_path and d.offset == start for d in report.damage), \
        f"{where}: no damage reported at {seg_path} offset {start}:\n{lines}"
    vanished = set(ITERATIONS) - set(report.iterations)
    listed = set(report.damaged_iterations) | vanished
    assert listed == expected, (f"{where}: fsck lists affected iterations {sorted(listed)} "
                                f"(damaged {sorted(report.damaged_iterations)}, vanished "
                                f"{sorted(vanished)}), expected {sorted(expected)}:\n{lines}")
    unnamed = sorted(it for it in expected if not _named(report, it))
    assert not unnamed, f"{where}: fsck never names affected iterations {unnamed}:\n{lines}"
    lost = set(report.lost_iterations)
    assert lost <= vanished, f"{where}: committed iterations reported lost {lost - vanished}:\n{lines}"

    _assert_reads(store, expected_states, intact, expected, where, silent_load_ok, "before repair")

    repaired = check(store, repair=True)
    assert intact <= set(repaired.iterations), (
        f"{where}: fsck --repair removed intact iterations "
        f"{sorted(intact - set(repaired.iterations))}:\n" + "\n".join(repaired.lines()))
    _assert_reads(store, expected_states, intact, expected, where, silent_load_ok, "after repair")


def _assert_reads(store: Path, expected_states, intact: set[int], affected: set[int], where: str,
                  silent_load_ok: bool, when: str) -> None:
    with ckptstore.open(store, "r") as r:
        listed = set(r.iterations())
        assert intact <= listed, f"{where} ({when}): intact iterations not listed: {intact - listed}"
        for it in sorted(intact):
            _same(expected_states[it], r.load(it), f"{where} ({when}): intact iteration {it}")
        for it in sorted(affected):
            try:
                got = r.load(it)
            except (DamagedCheckpointError, FormatError):
                continue
            except NotFoundError:
                assert it not in listed, f"{where} ({when}): listed iteration {it} not found"
                continue
            except CkptStoreError as e:
                pytest.fail(f"{where} ({when}): iteration {it}: unexpected ckptstore error {e!r}")
            except Exception as e:  # noqa: BLE001 -- the point of the test
                pytest.fail(f"{where} ({when}): iteration {it}: non-ckptstore exception {e!r}")
            # A load that succeeds must be bit-exact; only unverified bytes may be damaged then.
            _same(expected_states[it], got, f"{where} ({when}): damaged iteration {it} loaded")
            assert silent_load_ok, f"{where} ({when}): damaged iteration {it} loaded without error"


def _same(a, b, where: str) -> None:
    from conftest import _same as same

    same(a, b, where)


# ---- random flips --------------------------------------------------------------------------------

def _flip_expectation(pristine: StoreMap, seq: int, offset: int, n: int) -> tuple[set[int], bool]:
    """(affected iterations, whether a load may still succeed bit-exact) for flipping bytes
    [offset, offset + n) of segment ``seq`` (all inside one record)."""
    r = pristine.record_at(seq, offset)
    affected = pristine.users(r)
    # A chunk's record trailer is not part of what the read path verifies: chunk bytes are checked
    # against their content address instead, so a damaged trailer may still load (bit-exact).
    silent = r.type == rec.RecordType.CHUNK and offset >= r.trailer_offset
    return affected, silent


def test_random_byte_flips(pristine, expected_states, tmp_path):
    rng = random.Random(SEED)
    total = sum(pristine.sizes.values())
    seen_types: dict[str, int] = {}
    for trial in range(RANDOM_TRIALS):
        pos = rng.randrange(total)
        for seq, size in sorted(pristine.sizes.items()):
            if pos < size:
                break
            pos -= size
        r = pristine.record_at(seq, pos)
        n = min(rng.choice([1, 1, 2, 4]), r.end - pos)
        store = fresh_copy(pristine, tmp_path, f"t{trial}")
        flip(Path(Layout(str(store)).segment_path(seq)), pos, n, rng)
        expected, silent = _flip_expectation(pristine, seq, pos, n)
        kind = rec.RecordType(r.type).name
        seen_types[kind] = seen_types.get(kind, 0) + 1
        assert_contained(
            store, pristine, expected_states, seq=seq, offset=pos, expected=expected,
            damaged={r.key}, silent_load_ok=silent,
            where=f"trial {trial} (seed {SEED}): {n} bytes flipped at segment {seq} offset {pos} "
                  f"({kind} record at {r.offset}..{r.end})")
        shutil.rmtree(store)
    assert sum(seen_types.values()) == RANDOM_TRIALS, seen_types
    print(f"{RANDOM_TRIALS} random flips by record type: {seen_types}")


# ---- targeted flips ------------------------------------------------------------------------------

def _targets(m: StoreMap) -> dict[str, tuple[int, int, set[int], bool]]:
    """name -> (segment, offset, expected affected iterations, silent load ok)."""
    chunks = m.of_type(rec.RecordType.CHUNK)
    shared = max(chunks, key=lambda r: len(m.users(r)))
    raw = next(r for r in chunks if m.codec_of[r.key] == Codec.RAW and len(m.users(r)) == 1)
    lz4 = next(r for r in chunks if m.codec_of[r.key] == Codec.LZ4)
    trees = m.of_type(rec.RecordType.TREE)
    shared_tree = max(trees, key=lambda r: len(m.users(r)))
    last = ITERATIONS[-1]
    mid = ITERATIONS[len(ITERATIONS) // 2]
    data = rec.HEADER_SIZE + CHUNK_HEADER_SIZE
    t = {
        "raw chunk data": (raw, data + (raw.length - CHUNK_HEADER_SIZE) // 2),
        "shared chunk data": (shared, data + 100),
        "lz4 chunk data": (lz4, data + (lz4.length - CHUNK_HEADER_SIZE) // 2),
        "chunk record header (length)": (raw, 9),
        "chunk record header (magic)": (shared, 0),
        "chunk address": (raw, rec.HEADER_SIZE + 3),
        "chunk codec": (raw, rec.HEADER_SIZE + 16),
        "chunk raw_length": (lz4, rec.HEADER_SIZE + 24),
        "chunk trailer": (raw, raw.length + rec.HEADER_SIZE + 2),
        "shared tree payload": (shared_tree, rec.HEADER_SIZE + 40),
        "tree record header": (shared_tree, 5),
        "manifest payload": (m.manifest_of[mid], rec.HEADER_SIZE + m.manifest_of[mid].length // 2),
        "manifest record header": (m.manifest_of[mid], 12),
        "last manifest payload": (m.manifest_of[last], rec.HEADER_SIZE + 30),
        "commit payload (iteration field)": (m.commit_of[mid], rec.HEADER_SIZE + 1),
        "commit payload (digest)": (m.commit_of[mid], rec.HEADER_SIZE + 40),
        "commit trailer": (m.commit_of[mid], rec.HEADER_SIZE + m.commit_of[mid].length + 1),
        "last commit payload": (m.commit_of[last], rec.HEADER_SIZE + 50),
        "commit record header": (m.commit_of[mid], 9),
        "last commit record header": (m.commit_of[last], 9),
        "segment header payload": (m.record_at(2, 0), rec.HEADER_SIZE + 20),
        "segment header record header": (m.record_at(3, 0), 2),
    }
    out = {}
    for name, (r, delta) in t.items():
        off = r.offset + delta
        assert r.offset <= off < r.end, name
        expected, silent = _flip_expectation(m, r.seq, off, 1)
        out[name] = (r.seq, off, expected, silent)
    return out


TARGETS = ["raw chunk data", "shared chunk data", "lz4 chunk data", "chunk record header (length)",
           "chunk record header (magic)", "chunk address", "chunk codec", "chunk raw_length",
           "chunk trailer", "shared tree payload", "tree record header", "manifest payload",
           "manifest record header", "last manifest payload",
           "commit payload (iteration field)", "commit payload (digest)", "commit trailer",
           "last commit payload", "commit record header", "last commit record header",
           "segment header payload", "segment header record header"]


@pytest.mark.parametrize("target", TARGETS)
def test_targeted_flip(pristine, expected_states, tmp_path, target):
    seq, off, expected, silent = _targets(pristine)[target]
    if target.startswith(("shared", "chunk record header (magic)")):
        assert len(expected) > 1, f"{target}: not shared"
    store = fresh_copy(pristine, tmp_path, "s")
    flip(Path(Layout(str(store)).segment_path(seq)), off, 1, random.Random(off))
    assert_contained(store, pristine, expected_states, seq=seq, offset=off, expected=expected,
                     damaged={pristine.record_at(seq, off).key}, silent_load_ok=silent,
                     where=f"{target} (segment {seq} offset {off})")


# ---- truncation ----------------------------------------------------------------------------------

def _truncation_expectation(m: StoreMap, seq: int, at: int) -> set[int]:
    lost = {r.key for r in m.records if r.seq == seq and r.end > at}
    return m.affected_by(lost)


def test_truncated_last_segment(pristine, expected_states, tmp_path):
    """Cutting the last segment is indistinguishable from a crash during a save (the cut records
    simply never happened): the survivors must be exactly the iterations committed before the cut,
    intact, and the writer's recovery must leave a clean store."""
    rng = random.Random(SEED + 5)
    seq = max(pristine.sizes)
    for trial in range(8):
        at = rng.randrange(1, pristine.sizes[seq])
        store = fresh_copy(pristine, tmp_path, f"t{trial}")
        os.truncate(Layout(str(store)).segment_path(seq), at)
        expected = _truncation_expectation(pristine, seq, at)
        survivors = set(ITERATIONS) - expected
        where = f"truncation trial {trial} (seed {SEED}): last segment {seq} cut at {at}"
        report = check(store)
        assert not report.damage and not report.damaged_iterations, f"{where}: {report.lines()}"
        assert set(report.iterations) == survivors, f"{where}: {report.lines()}"
        _assert_reads(store, expected_states, survivors, expected, where, False, "before recovery")
        with ckptstore.open(store, "a") as w:
            assert set(w.iterations()) == survivors
        report = check(store)
        assert report.clean and not report.notes, f"{where}: after recovery: {report.lines()}"
        _assert_reads(store, expected_states, survivors, expected, where, False, "after recovery")
        shutil.rmtree(store)


def test_truncated_older_segments(pristine, expected_states, tmp_path):
    """Cutting an older segment is damage: located at the torn record, attributed to exactly the
    iterations that used the lost records, contained for every other iteration."""
    rng = random.Random(SEED + 7)
    older = sorted(pristine.sizes)[:-1]
    for trial in range(12):
        seq = rng.choice(older)
        at = rng.randrange(1, pristine.sizes[seq])
        while pristine.record_at(seq, at).offset == at:  # cut inside a record: a torn one
            at = rng.randrange(1, pristine.sizes[seq])
        store = fresh_copy(pristine, tmp_path, f"t{trial}")
        os.truncate(Layout(str(store)).segment_path(seq), at)
        lost = {r.key for r in pristine.records if r.seq == seq and r.end > at}
        assert_contained(
            store, pristine, expected_states, seq=seq, offset=at,
            expected=pristine.affected_by(lost), damaged=lost,
            where=f"truncation trial {trial} (seed {SEED}): segment {seq} cut at {at}")
        shutil.rmtree(store)


def test_truncation_through_an_older_commit(pristine, expected_states, tmp_path):
    last_seq = max(pristine.sizes)
    it = next(i for i in ITERATIONS if pristine.commit_of[i].seq != last_seq
              and pristine.commit_of[i].end == pristine.sizes[pristine.commit_of[i].seq])
    c = pristine.commit_of[it]  # the commit that ends an older segment: cut through its middle
    store = fresh_copy(pristine, tmp_path, "s")
    os.truncate(Layout(str(store)).segment_path(c.seq), c.offset + 60)
    assert_contained(store, pristine, expected_states, seq=c.seq, offset=c.offset + 60,
                     expected={it}, damaged={c.key},
                     where=f"segment {c.seq} cut inside the commit of iteration {it}")


@pytest.fixture(scope="module")
def tailed(pristine, tmp_path_factory) -> tuple[Path, int, int]:
    """The pristine store plus an uncommitted tail (a save crashed at its 6th write, mid-record):
    (path, segment holding the tail, offset where the tail starts)."""
    path = tmp_path_factory.mktemp("tailed") / "store"
    shutil.copytree(pristine.path, path)
    w = ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=1 << 20, file_ops=FreezeOps(6, 0.5),
                       direct_io=False)  # buffered: one write per record, so the 6th is mid-save
    with pytest.raises(ckptstore.StoreIOError):
        w.save(ITERATIONS[-1] + 1, state_for(ITERATIONS[-1] + 1))
    w.close()
    last = pristine.commit_of[ITERATIONS[-1]]
    layout = Layout(str(path))
    assert layout.list_segments()[-1] == last.seq, "the crashed save rolled a segment"
    assert os.path.getsize(layout.segment_path(last.seq)) > last.end + CHUNK_SIZE
    report = check(path)
    assert report.clean and report.iterations == ITERATIONS, report.lines()
    assert any("uncommitted tail" in n for n in report.notes), report.lines()
    return path, last.seq, last.end


def test_truncated_tail_is_only_a_note(tailed, expected_states, tmp_path):
    path, seq, tail_start = tailed
    size = os.path.getsize(Layout(str(path)).segment_path(seq))
    rng = random.Random(SEED + 11)
    for trial in range(8):
        at = tail_start if trial == 0 else rng.randrange(tail_start + 1, size)
        store = tmp_path / f"t{trial}"
        shutil.copytree(path, store)
        seg = Layout(str(store)).segment_path(seq)
        os.truncate(seg, at)
        where = f"tail cut at {at} (tail {tail_start}..{size})"
        report = check(store)
        assert report.clean, f"{where}: {report.lines()}"
        assert report.iterations == ITERATIONS, f"{where}: {report.lines()}"
        has_note = any("uncommitted tail" in n for n in report.notes)
        assert has_note == (at > tail_start), f"{where}: {report.lines()}"
        _assert_reads(store, expected_states, set(ITERATIONS), set(), where, False, "with tail")
        with ckptstore.open(store, "a") as w:
            assert w.iterations() == ITERATIONS
        assert os.path.getsize(seg) == tail_start, f"{where}: the writer open did not cut the tail"
        report = check(store)
        assert report.clean and not report.notes, f"{where}: after recovery: {report.lines()}"
        shutil.rmtree(store)


def test_garbage_after_last_commit_is_cut(pristine, expected_states, tmp_path):
    rng = random.Random(SEED + 13)
    last = pristine.commit_of[ITERATIONS[-1]]
    for trial, garbage in enumerate([
        bytes(rng.randrange(256) for _ in range(5000)),
        rec.MAGIC + bytes(rng.randrange(256) for _ in range(300)),  # a false record start
        rec.encode_header(rec.RecordType.CHUNK, 1 << 20) + b"\0" * 100,  # a torn, valid header
        b"\0" * 4096,  # a zero-filled extension
    ]):
        store = fresh_copy(pristine, tmp_path, f"g{trial}")
        seg = Layout(str(store)).segment_path(last.seq)
        with open(seg, "ab") as f:
            f.write(garbage)
        report = check(store)
        where = f"garbage {trial} ({len(garbage)} bytes)"
        assert report.clean and report.iterations == ITERATIONS, f"{where}: {report.lines()}"
        assert any("uncommitted tail" in n for n in report.notes), f"{where}: {report.lines()}"
        with ckptstore.open(store, "a") as w:
            assert w.iterations() == ITERATIONS
        assert os.path.getsize(seg) == last.end, f"{where}: garbage not cut"
        report = check(store)
        assert report.clean and not report.notes, f"{where}: after recovery: {report.lines()}"
        _assert_reads(store, expected_states, set(ITERATIONS), set(), where, False, "after cut")


# ---- whole files -------------------------------------------------------------------------------

def test_deleted_segment(pristine, expected_states, tmp_path):
    """A missing segment (any but the newest) is damage; every iteration that used one of its
    records is affected (damaged, or gone with its commit), every other one loads bit-exact, before
    and after repair."""
    for seq in sorted(pristine.sizes)[:-1]:
        store = fresh_copy(pristine, tmp_path, f"d{seq}")
        os.unlink(Layout(str(store)).segment_path(seq))
        expected = pristine.affected_by({r.key for r in pristine.records if r.seq == seq})
        where = f"segment {seq} deleted (it held records of iterations {sorted(expected)})"
        report = check(store)
        lines = "\n".join(report.lines())
        assert not report.clean, f"{where}: fsck did not notice:\n{lines}"
        vanished = set(ITERATIONS) - set(report.iterations)
        listed = set(report.damaged_iterations) | vanished
        assert listed == expected, f"{where}: fsck lists {sorted(listed)}:\n{lines}"
        _assert_reads(store, expected_states, set(ITERATIONS) - expected, expected, where, False,
                      "segment deleted")
        repaired = check(store, repair=True)
        assert set(ITERATIONS) - expected <= set(repaired.iterations), repaired.lines()
        _assert_reads(store, expected_states, set(ITERATIONS) - expected, expected, where, False,
                      "after repair")
        shutil.rmtree(store)


def test_deleted_segment_names_lost_iterations(pristine, tmp_path):
    problems = []
    for seq in sorted(pristine.sizes)[:-1]:
        store = fresh_copy(pristine, tmp_path, f"d{seq}")
        os.unlink(Layout(str(store)).segment_path(seq))
        expected = pristine.affected_by({r.key for r in pristine.records if r.seq == seq})
        report = check(store)
        unnamed = sorted(it for it in expected if not _named(report, it))
        if unnamed:
            problems.append(f"segment {seq}: unnamed iterations {unnamed}; report {report.lines()}")
        shutil.rmtree(store)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("victim", [1, 3])
def test_deleted_segment_holding_whole_checkpoints(tmp_path, assert_same, victim):
    import numpy as np

    path = tmp_path / "store"

    def state(i):
        return {"x": np.random.default_rng(i).standard_normal(4000)}  # no dedup between iterations

    with ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=40_000) as w:
        for i in range(1, 6):
            w.save(i, state(i))
    layout = Layout(str(path))
    assert layout.list_segments() == [1, 2, 3, 4, 5]  # one checkpoint per segment
    os.unlink(layout.segment_path(victim))
    report = check(path)
    assert not report.clean, f"a deleted segment went unnoticed: {report.lines()}"
    assert any(layout.segment_path(victim) in line for line in report.lines()), report.lines()
    assert cli_main(["fsck", str(path)]) == 1
    with ckptstore.open(path, "r") as r:
        for i in set(range(1, 6)) - {victim}:
            assert_same(state(i), r.load(i))
    assert _named(report, victim), f"iteration {victim} is lost but not named: {report.lines()}"


def _one_per_segment(path: Path, n: int = 5) -> dict[int, object]:
    """``n`` snapshots, one per segment (no dedup between them); returns the states."""
    import numpy as np

    states = {i: {"x": np.random.default_rng(i).standard_normal(4000)} for i in range(1, n + 1)}
    with ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=40_000) as w:
        for i, st in states.items():
            w.save(i, st)
    assert Layout(str(path)).list_segments() == list(range(1, n + 1))
    return states


@pytest.mark.parametrize("with_index", [True, False])
def test_renamed_segment_does_not_hide_a_missing_one(tmp_path, assert_same, with_index):
    """§15 step 2: a renamed segment (its header verifies but names another seq) is damage whose
    ``supersedes`` is known (0 here), so it makes no missing segment "possibly collected": segment
    4 deleted next to it is certainly missing, and iteration 4, committed only there, is named
    lost from the index. Without the index no trace of iteration 4 is left: fsck still reports
    segment 4 as missing with committed checkpoints lost. Iteration 2 (moved with its segment;
    its commit names a manifest location that is gone) is named from its orphaned manifest."""
    path = tmp_path / "store"
    states = _one_per_segment(path)
    layout = Layout(str(path))
    os.rename(layout.segment_path(2), layout.segment_path(7))
    os.unlink(layout.segment_path(4))
    if not with_index:
        shutil.rmtree(layout.index_dir)
    report = check(path)
    lines = "\n".join(report.lines())
    assert report.iterations == [1, 3, 5], lines
    assert any("names sequence 2, file name says 7" in str(d) for d in report.damage), lines
    for seq in (2, 4):
        assert any(d.path == layout.segment_path(seq) and "missing: checkpoints committed in it "
                   "are lost" in d.reason for d in report.damage), lines
    assert not any("unless a gc collected" in line for line in report.lines()), lines
    assert sorted(report.lost_iterations) == ([2, 4] if with_index else [2]), lines
    assert "per the index" in report.lost_iterations.get(4, "per the index"), lines
    with ckptstore.open(path, "r") as r:
        for i in (1, 3, 5):
            assert_same(states[i], r.load(i))


def test_damaged_gc_marker_keeps_missing_segments_uncertain(tmp_path, assert_same):
    """§15 step 2: a gc marker whose header is damaged may supersede anything below it, so the
    segments its gc collected are reported as possibly collected, and the stale index entries of
    the iterations that gc dropped (their segments gone) are not evidence of a lost checkpoint.
    A renamed segment's verified ``supersedes`` bounds the same uncertainty: the marker renamed
    instead of damaged is no gc marker (W is not taken from a misnamed file), but the old
    segments up to its ``supersedes`` stay "possibly collected"."""
    path = tmp_path / "store"
    states = _one_per_segment(path)
    layout = Layout(str(path))
    stale_index = tmp_path / "index-before-gc"
    shutil.copytree(layout.index_dir, stale_index)
    with ckptstore.open(path, "a") as w:
        w.gc(keep_last=2)
        assert w.iterations() == [4, 5]
    segs = layout.list_segments()
    marker = segs[-1]
    assert min(segs) > 5 and os.path.getsize(layout.segment_path(marker)) == \
        rec.OVERHEAD + 48  # the record-less marker
    shutil.rmtree(layout.index_dir)
    shutil.copytree(stale_index, layout.index_dir)  # names 1..5 in the collected segments
    for how in ("flip", "rename"):
        store = tmp_path / how
        shutil.copytree(path, store)
        mpath = Layout(str(store)).segment_path(marker)
        if how == "flip":
            flip(Path(mpath), 30, 1, random.Random(2))  # inside the header's payload
        else:
            os.rename(mpath, Layout(str(store)).segment_path(marker + 3))
        report = check(store)
        lines = "\n".join(report.lines())
        assert report.iterations == [4, 5], f"{how}: {lines}"
        assert not report.lost_iterations and not report.damaged_iterations, f"{how}: {lines}"
        assert any(d.path == layout.segment_path(1).replace(str(path), str(store))
                   and "segments 1..5 are missing (5 files) (unless a gc collected them" in
                   d.reason for d in report.damage), f"{how}: {lines}"
        with ckptstore.open(store, "r") as r:
            for i in (4, 5):
                assert_same(states[i], r.load(i))


def test_cut_below_the_gc_marker_keeps_it(tmp_path, assert_same):
    """§15 step 2: a tail cut that reaches below a gc marker (here: the COMMIT of the last copied
    checkpoint is damaged, so recovery quarantines and cuts from the end of the one before) keeps
    the marker, which carries the watermark, and empties the copies between the position and it
    down to their header instead of deleting them: the live segments stay consecutive, nothing
    the gc collected counts as missing, and the next writer appends after the marker."""
    path = tmp_path / "store"
    states = _one_per_segment(path)
    with ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=40_000) as w:
        w.gc(keep_last=3)
    layout = Layout(str(path))
    copies_and_marker = layout.list_segments()
    assert copies_and_marker == [6, 7, 8, 9]  # one copy per kept iteration, then the marker
    last_copy = Path(layout.segment_path(8))
    data = bytearray(last_copy.read_bytes())
    commit_at = data.rindex(rec.MAGIC)  # the last record: iteration 5's copied COMMIT
    data[commit_at + rec.HEADER_SIZE + 3] ^= 0xFF
    last_copy.write_bytes(bytes(data))

    with ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=40_000) as w:
        assert w.iterations() == [3, 4]
        assert layout.list_segments() == [6, 7, 8, 9]
        header_only = rec.OVERHEAD + 48
        assert os.path.getsize(layout.segment_path(8)) == header_only  # emptied, not deleted
        assert os.path.getsize(layout.segment_path(9)) == header_only  # the marker, kept
        assert os.listdir(layout.quarantine_dir)  # the damaged commit is kept for inspection
        w.save(6, states[1])
    report = check(path)
    assert report.clean and report.notes == [
        "quarantine/ holds 1 cut tail that may contain a damaged commit; inspect, then delete it"
    ], report.lines()
    assert report.iterations == [3, 4, 6]
    assert layout.list_segments() == [6, 7, 8, 9, 10]
    with ckptstore.open(path, "r") as r:
        for i in (3, 4):
            assert_same(states[i], r.load(i))
        assert_same(states[1], r.load(6))


def test_damaged_header_of_a_segment_with_records_is_no_gc_marker(tmp_path, assert_same):
    """§15 step 2: a segment whose header is damaged but which holds valid records after it is no
    gc marker (a marker is a header record alone), so segment 3 deleted below it is certainly
    missing and iteration 3, committed only there, is named lost from the index. A damaged
    header alone (the marker case, test_damaged_gc_marker_keeps_missing_segments_uncertain)
    keeps it uncertain."""
    path = tmp_path / "store"
    states = _one_per_segment(path)
    layout = Layout(str(path))
    os.unlink(layout.segment_path(3))
    flip(Path(layout.segment_path(4)), 30, 1, random.Random(5))  # header payload of segment 4
    report = check(path)
    lines = "\n".join(report.lines())
    assert any(d.path == layout.segment_path(3) and "missing: checkpoints committed in it are "
               "lost" in d.reason for d in report.damage), lines
    assert 3 in report.lost_iterations and "per the index" in report.lost_iterations[3], lines
    assert set(report.iterations) >= {1, 2, 5}, lines
    with ckptstore.open(path, "r") as r:
        for i in set(report.iterations) - set(report.damaged_iterations):
            assert_same(states[i], r.load(i))


@pytest.mark.parametrize("content", ["garbage", "segment copy"])
def test_stray_far_ahead_segment_reports_missing_run_as_one_range(tmp_path, capsys, content):
    """A stray 0000009999.seg: the thousands of numbers between the last segment and it are one
    damage line (a range), not one line per number; committed checkpoints are untouched."""
    path = tmp_path / "store"
    _one_per_segment(path, 3)
    layout = Layout(str(path))
    stray = Path(layout.segment_path(9999))
    if content == "garbage":
        stray.write_bytes(random.Random(3).randbytes(300))
    else:
        shutil.copyfile(layout.segment_path(2), stray)
    report = check(path)
    lines = report.lines()
    assert not report.clean and report.iterations == [1, 2, 3], lines
    assert len(lines) < 10, lines
    missing = [d for d in report.damage if "missing" in d.reason]
    assert len(missing) == 1 and missing[0].path == layout.segment_path(4), lines
    assert missing[0].reason.startswith("segments 4..9998 are missing (9995 files)"), lines
    assert f"{layout.segment_path(4)}: segments 4..9998 are missing" in "\n".join(lines)
    assert cli_main(["fsck", str(path)]) == 1
    assert len(capsys.readouterr().out.splitlines()) < 10


# ---- commits that are damaged or gone: naming and quarantine -----------------------------------

def _small_store(path: Path, n: int = 4) -> dict[int, Record]:
    """A store of ``n`` small snapshots in one segment; returns iteration -> its COMMIT record."""
    import numpy as np

    with ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=1 << 20) as w:
        for i in range(1, n + 1):
            w.save(i, {"x": np.full(3000, i, dtype=np.float32)})
    return {it: r for it, r in build_commit_map(path).items()}


def build_commit_map(path: Path) -> dict[int, Record]:
    layout = Layout(str(path))
    out = {}
    for seq in layout.list_segments():
        f = SegmentFile(layout.segment_path(seq), seq)
        try:
            for item in scan_segment(f, 0):
                if isinstance(item, ScannedRecord) and item.type == rec.RecordType.COMMIT:
                    c = decode_commit(item.payload)
                    out[c.iteration] = Record(seq, item.loc.offset, item.loc.end, item.type,
                                              item.loc.length)
        finally:
            f.close()
    return out


@pytest.mark.parametrize("with_index", [True, False])
def test_damaged_header_of_the_last_commit_is_damage_not_tail(tmp_path, with_index):
    """Every byte of the last COMMIT record's header, flipped: fsck reports the damage and names
    the iteration (from its checksummed manifest, with or without the index), and the writer
    quarantines the tail holding the commit instead of cutting it silently."""
    import numpy as np

    base = tmp_path / "base"
    commits = _small_store(base)
    last = commits[4]
    for i in range(rec.HEADER_SIZE):
        store = tmp_path / f"h{i}"
        shutil.copytree(base, store)
        layout = Layout(str(store))
        if not with_index:
            shutil.rmtree(layout.index_dir)
        seg = layout.segment_path(last.seq)
        flip(Path(seg), last.offset + i, 1, random.Random(i))
        where = f"header byte {i} of the last commit flipped"
        report = check(store)
        lines = "\n".join(report.lines())
        assert not report.clean and report.iterations == [1, 2, 3], f"{where}:\n{lines}"
        assert any(d.path == seg and d.offset == last.offset for d in report.damage), f"{where}:\n{lines}"
        assert list(report.lost_iterations) == [4], f"{where}:\n{lines}"
        assert "(manifest at " in report.lost_iterations[4] and "has no valid commit" in \
            report.lost_iterations[4], f"{where}:\n{lines}"
        assert cli_main(["fsck", str(store)]) == 1
        with ckptstore.open(store, "a") as w:
            assert w.iterations() == [1, 2, 3]
            w.save(5, {"x": np.zeros(10)})
        assert os.path.getsize(seg) > last.offset
        q = sorted(os.listdir(layout.quarantine_dir))
        assert len(q) == 1, f"{where}: the damaged commit was cut without quarantine: {q}"
        kept = Path(layout.quarantine_dir, q[0]).read_bytes()
        original = Path(base / "segments" / os.path.basename(seg)).read_bytes()
        cut = int(q[0].split("-")[1].split(".")[0])
        assert kept[last.offset - cut + rec.HEADER_SIZE:last.end - cut] == \
            original[last.offset + rec.HEADER_SIZE:last.end], f"{where}: quarantine lost the commit"
        shutil.rmtree(store)


def test_torn_last_commit_is_only_a_tail(tmp_path):
    """The counterpart: the last COMMIT record cut at every length (a crash mid-append: its save
    never reached the index) is an uncommitted tail -- clean, nobody named lost, no quarantine.
    The same cut under an index that lists the commit (it was durable, then lost) is named."""
    base = tmp_path / "base"
    commits = _small_store(base, 2)
    last = commits[2]
    assert last.end - last.offset == 128
    # inside the header, at its end, inside the payload, at the trailer, inside the trailer
    for cut in (last.offset + n for n in (1, 8, 16, 23, 24, 25, 60, 100, 119, 120, 121, 127)):
        store = tmp_path / f"c{cut}"
        shutil.copytree(base, store)
        layout = Layout(str(store))
        os.truncate(layout.segment_path(last.seq), cut)
        where = f"last commit cut at {cut - last.offset} of {last.end - last.offset} bytes"
        if cut == last.offset + 60:
            report = check(store)
            assert list(report.lost_iterations) == [2] and "per the index" in \
                report.lost_iterations[2], f"{where}: {report.lines()}"
        shutil.rmtree(layout.index_dir)  # the state a crash during save(2) leaves
        report = check(store)
        assert report.clean and report.iterations == [1], f"{where}: {report.lines()}"
        assert any("uncommitted tail" in n for n in report.notes), f"{where}: {report.lines()}"
        with ckptstore.open(store, "a") as w:
            assert w.iterations() == [1]
        assert not os.path.exists(layout.quarantine_dir), f"{where}: a torn tail was quarantined"
        shutil.rmtree(store)


@pytest.mark.parametrize("where", ["payload", "header"])
def test_lost_commit_inside_a_group_commit(tmp_path, where):
    """Group commit (deltas): M2 M3 M4 C2 C3 C4. Damage to C3 names exactly iteration 3 as lost
    (its commit window ends at C4, whose manifest follows M3), not 2 or 4; 4 is unrecoverable."""
    import numpy as np

    path = tmp_path / "store"
    with ckptstore.open(path, "a", chunk_size=CHUNK_SIZE) as w:
        w.save(1, {"x": np.arange(5000, dtype=np.float32)})
        for it in (2, 3, 4):
            w.save_delta(it, {"d": np.full(50, it, dtype=np.float32)}, durable=False)
        w.flush()
        w.save(5, {"x": np.arange(5000, dtype=np.float32) * 5})
    commits = build_commit_map(path)
    c3 = commits[3]
    assert commits[2].offset < c3.offset < commits[4].offset and c3.offset - commits[2].offset == 128
    shutil.rmtree(Layout(str(path)).index_dir)  # evidence from the log alone
    off = c3.offset + (rec.HEADER_SIZE + 5 if where == "payload" else 3)
    flip(Path(Layout(str(path)).segment_path(c3.seq)), off, 1, random.Random(3))
    report = check(path)
    lines = "\n".join(report.lines())
    assert report.iterations == [1, 2, 4, 5], lines
    assert list(report.lost_iterations) == [3], lines
    assert set(report.damaged_iterations) == {4}, lines
    assert "chain broken at iteration 3 (lost)" in report.damaged_iterations[4][0], lines


def _store_after_gc_failed_before_marker(path, states: dict) -> Layout:
    """Save ``states`` (iteration -> state) in segment 1, then run a gc keeping the last two that
    fails just before its marker rename (its commit point): segment 2 is the renamed copy, so
    every kept checkpoint is committed twice. Returns the store's layout."""
    from ckptstore.storage.fileops import FileOps

    class FailMarkerRename(FileOps):
        def _rename(self, src, dst):
            if len(Layout(str(path)).list_gc_temps()) == 1:  # only the marker is left
                raise OSError(5, "simulated failure before the gc commit point")
            super()._rename(src, dst)

    w = ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=1 << 20,
                       file_ops=FailMarkerRename())
    for i, st in states.items():
        w.save(i, st)
    with pytest.raises(ckptstore.StoreIOError):
        w.gc(keep_last=2)
    w.close()
    layout = Layout(str(path))
    assert layout.list_segments() == [1, 2]  # the old segment and the renamed copy
    return layout


def test_damaged_duplicate_commit_of_an_interrupted_gc_loses_nothing(tmp_path, assert_same):
    """A gc that failed before its marker leaves copies next to the old segments: every kept
    checkpoint is committed twice. Damage to a copy's COMMIT is damage, but its iteration is still
    committed (the original), so nothing may be reported lost."""
    import numpy as np

    path = tmp_path / "store"
    states = {i: {"x": np.full(3000, i, dtype=np.float32)} for i in range(1, 5)}
    layout = _store_after_gc_failed_before_marker(path, states)
    copy = {it: r for it, r in build_commit_map(path).items() if r.seq == 2}
    assert sorted(copy) == [3, 4]
    flip(Path(layout.segment_path(2)), copy[3].offset + 9, 1, random.Random(1))
    report = check(path)
    lines = "\n".join(report.lines())
    assert report.iterations == [1, 2, 3, 4], lines
    assert not report.lost_iterations and not report.damaged_iterations, lines
    assert any(d.offset == copy[3].offset for d in report.damage), lines
    with ckptstore.open(path, "r") as r:
        for i, st in states.items():
            assert_same(st, r.load(i))


def test_damaged_later_copy_of_a_chunk_falls_back_to_the_intact_original(tmp_path, assert_same):
    """§15/§16: chunk payloads are checked on read, so the location replay indexes last for a
    chunk (here: a copy written by a gc that failed before its marker) may be damaged while the
    original record is intact. fsck (verified replay) reports the damaged record and no damaged
    iteration; a reader falls back to the earlier record and loads every iteration bit-exact;
    after fsck --repair (whose index holds only verified chunks) so does the writer."""
    import numpy as np

    path = tmp_path / "store"
    states = {i: {"x": np.random.default_rng(i).standard_normal(3000)} for i in range(1, 5)}
    layout = _store_after_gc_failed_before_marker(path, states)
    f = SegmentFile(layout.segment_path(2), 2)
    try:
        chunks = [item for item in scan_segment(f, 0) if isinstance(item, ScannedRecord)
                  and item.type == rec.RecordType.CHUNK]
    finally:
        f.close()
    victim = chunks[len(chunks) // 2]
    flip(Path(layout.segment_path(2)), victim.loc.payload_offset + CHUNK_HEADER_SIZE + 5, 1,
         random.Random(4))
    report = check(path)
    lines = "\n".join(report.lines())
    assert report.iterations == [1, 2, 3, 4], lines
    assert not report.damaged_iterations and not report.lost_iterations, lines
    assert [(d.path, d.offset) for d in report.damage] == \
        [(layout.segment_path(2), victim.loc.offset)], lines
    with ckptstore.open(path, "r") as r:
        for i, st in states.items():
            assert_same(st, r.load(i))
    check(path, repair=True)
    with ckptstore.open(path, "a") as w:
        for i, st in states.items():
            assert_same(st, w.load(i))


def test_unknown_store_version(pristine, tmp_path, capsys):
    store = fresh_copy(pristine, tmp_path, "v")
    layout = Layout(str(store))
    with open(layout.store_file, "rb") as f:
        h = decode_store_header(f.read())
    with open(layout.store_file, "wb") as f:
        f.write(encode_store_header(StoreHeader(h.format_version + 1, h.store_id, h.chunk_size,
                                                h.segment_size, h.created_ns)))
    for mode in ("r", "a"):
        with pytest.raises(UnsupportedVersionError) as e:
            ckptstore.open(store, mode)
        assert "version 2" in str(e.value) and "STORE" in str(e.value)
    with pytest.raises(UnsupportedVersionError):
        check(store)
    assert cli_main(["fsck", str(store)]) == 1
    assert "version" in capsys.readouterr().err


def test_damaged_store_file(pristine, tmp_path, capsys):
    rng = random.Random(SEED + 17)
    seg_bytes = {s: Path(Layout(str(pristine.path)).segment_path(s)).read_bytes()
                 for s in pristine.sizes}
    for trial in range(10):
        store = fresh_copy(pristine, tmp_path, f"h{trial}")
        layout = Layout(str(store))
        if trial < 8:
            flip(Path(layout.store_file), rng.randrange(64), 1, rng)
        else:
            os.truncate(layout.store_file, rng.randrange(64))
        for mode in ("r", "a"):
            with pytest.raises(FormatError) as e:
                ckptstore.open(store, mode)
            assert e.value.path == layout.store_file and e.value.offset == 0, e.value
        with pytest.raises(FormatError) as e:
            check(store)
        assert e.value.path == layout.store_file
        assert cli_main(["fsck", str(store)]) == 1
        assert layout.store_file in capsys.readouterr().err
        with pytest.raises(FormatError):
            check(store, repair=True)
        for s, data in seg_bytes.items():  # a refused repair changes nothing
            assert Path(layout.segment_path(s)).read_bytes() == data
        shutil.rmtree(store)


# ---- CLI -----------------------------------------------------------------------------------------

def test_cli_fsck_exit_codes(pristine, expected_states, tmp_path, capsys):
    assert cli_main(["fsck", str(pristine.path)]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("clean") and f"{len(ITERATIONS)} committed iterations" in out

    store = fresh_copy(pristine, tmp_path, "c")
    seq, off, expected, _ = _targets(pristine)["shared chunk data"]
    flip(Path(Layout(str(store)).segment_path(seq)), off, 1, random.Random(1))
    assert cli_main(["fsck", str(store)]) == 1
    out = capsys.readouterr().out
    assert "NOT CLEAN" in out and Layout(str(store)).segment_path(seq) in out
    for it in expected:
        assert f"DAMAGED iteration {it}:" in out
    # --repair cannot restore lost bytes: still damaged (exit 1), intact iterations kept.
    assert cli_main(["fsck", "--repair", str(store)]) == 1
    capsys.readouterr()
    with ckptstore.open(store, "r") as r:
        assert set(ITERATIONS) - expected <= set(r.iterations())

    store = fresh_copy(pristine, tmp_path, "t")
    with open(Layout(str(store)).segment_path(max(pristine.sizes)), "ab") as f:
        f.write(b"\x17" * 999)  # a crash's tail: a note, still clean
    assert cli_main(["fsck", str(store)]) == 0
    assert "uncommitted tail" in capsys.readouterr().out
    assert cli_main(["fsck", str(tmp_path / "nope")]) == 1
