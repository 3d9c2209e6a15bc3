"""The remote layout's names and its commit point, the HEAD object (format-spec/remote.md).

A pure codec: names from numbers and digests, HEAD bytes in and a checked :class:`Head` out.
Object names are built only from integers and hex digests, never from anything a HEAD says
as a string: a reader derives every key it fetches from the HEAD's checked numbers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import xxhash

from ..errors import ChecksumMismatch, FormatError, UnsupportedVersionError

STORE_OBJECT = "STORE"
HEADS_DIR = "heads/"
SEGMENTS_DIR = "segments/"
INDEX_DIR = "index/"
HEAD_FORMAT = "ckptstore-remote-head"
HEAD_VERSION = 1
#: Bytes a HEAD object may have (a reader refuses a larger one before parsing it).
MAX_HEAD_BYTES = 64 << 20
_MAX_U63 = (1 << 63) - 1
_HEAD_RE = re.compile(r"^heads/(\d{20})$")
_EXTENT_RE = re.compile(r"^segments/(\d{10})/(\d{15})-(\d{15})-([0-9a-f]{32})$")
_INDEX_RE = re.compile(r"^index/(\d{15})-([0-9a-f]{32})$")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")


def digest(data: bytes | memoryview) -> bytes:
    """xxh3-128 of ``data`` (canonical 16 bytes, as everywhere in the format)."""
    return xxhash.xxh3_128_digest(data)


def head_name(generation: int) -> str:
    if not 0 < generation < 10**20:
        raise ValueError(f"HEAD generation {generation} out of range")
    return f"{HEADS_DIR}{generation:020d}"


def head_generation(name: str) -> int | None:
    """The generation a HEAD object's name carries, or None if ``name`` names no HEAD."""
    m = _HEAD_RE.match(name)
    return int(m.group(1)) if m and int(m.group(1)) > 0 else None


@dataclass(frozen=True)
class Extent:
    """Bytes ``[offset, offset + length)`` of segment ``seq``, one immutable object."""

    seq: int
    offset: int
    length: int
    digest: bytes

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def name(self) -> str:
        return (f"{SEGMENTS_DIR}{self.seq:010d}/{self.offset:015d}-{self.length:015d}-"
                f"{self.digest.hex()}")


def parse_extent_name(name: str) -> Extent | None:
    m = _EXTENT_RE.match(name)
    if m is None:
        return None
    return Extent(int(m.group(1)), int(m.group(2)), int(m.group(3)), bytes.fromhex(m.group(4)))


@dataclass(frozen=True)
class IndexRef:
    """The index object a HEAD names: an lz4 frame of ``length`` bytes (xxh3-128 ``digest``)
    holding a compact copy of the writer's LMDB index, ``raw_length`` bytes once decompressed.
    A cache: a reader validates it against the log like a local index (format-spec/remote.md)."""

    length: int
    raw_length: int
    digest: bytes

    @property
    def name(self) -> str:
        return f"{INDEX_DIR}{self.length:015d}-{self.digest.hex()}"


def is_index_name(name: str) -> bool:
    return _INDEX_RE.match(name) is not None


@dataclass(frozen=True)
class SegmentEntry:
    """A segment of the remote copy: its first ``length`` bytes, as consecutive extents."""

    seq: int
    length: int
    extents: tuple[Extent, ...]


@dataclass(frozen=True)
class Head:
    """A remote commit point: everything a reader needs to rebuild the store as it was."""

    generation: int
    store_id: bytes
    #: xxh3-128 of the 64-byte STORE object
    store_digest: bytes
    #: end of the last COMMIT record the copy holds, (seq, offset); None: nothing committed
    position: tuple[int, int] | None
    #: newest committed iteration, newest recoverable one (what a restore can load), and how
    #: many recoverable iterations the copy holds
    latest: int | None
    recoverable: int | None
    count: int
    #: highest ``supersedes`` of the copy's segment headers (informational)
    watermark: int
    segments: tuple[SegmentEntry, ...]
    created_ns: int = 0
    #: the index object (None: the HEAD names none; an older writer, or no index to copy)
    index: IndexRef | None = None
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def name(self) -> str:
        return head_name(self.generation)

    @property
    def nbytes(self) -> int:
        return sum(s.length for s in self.segments)

    def extents(self) -> list[Extent]:
        return [e for s in self.segments for e in s.extents]

    def objects(self) -> set[str]:
        """Every object this HEAD names (itself excluded)."""
        out = {STORE_OBJECT} | {e.name for e in self.extents()}
        if self.index is not None:
            out.add(self.index.name)
        return out

    def segment(self, seq: int) -> SegmentEntry | None:
        return next((s for s in self.segments if s.seq == seq), None)


def encode_head(h: Head) -> bytes:
    """The HEAD object: one line of ASCII JSON, then ``xxh3-128 <hex of that line>``."""
    body = {
        "format": HEAD_FORMAT, "v": HEAD_VERSION, "generation": h.generation,
        "store_id": h.store_id.hex(), "store": h.store_digest.hex(),
        "position": None if h.position is None else list(h.position),
        "latest": h.latest, "recoverable": h.recoverable, "iterations": h.count,
        "watermark": h.watermark, "created_ns": h.created_ns,
        "segments": [[s.seq, s.length, [[e.offset, e.length, e.digest.hex()] for e in s.extents]]
                     for s in h.segments],
        **h.extra,
    }
    if h.index is not None:
        body["index"] = [h.index.length, h.index.raw_length, h.index.digest.hex()]
    return seal_json(body)


def seal_json(body: dict) -> bytes:
    """A HEAD-like object: one line of ASCII JSON, ``\n``, then ``xxh3-128 <hex of that
    line>\n`` (the remote tier's HEAD objects, single-store and job, share this framing)."""
    line = json.dumps(body, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return line + b"\nxxh3-128 " + digest(line).hex().encode("ascii") + b"\n"


def unseal_json(data: bytes, fmt: str, version: int, what: str = "HEAD") -> dict:
    """The JSON object of a :func:`seal_json` object whose ``format`` is ``fmt``: FormatError
    (ChecksumMismatch for a failed check line) when it is not one, UnsupportedVersionError for a
    ``v`` other than ``version``."""
    if len(data) > MAX_HEAD_BYTES:
        raise FormatError(f"{what} is {len(data)} bytes (at most {MAX_HEAD_BYTES})")
    line, sep, rest = bytes(data).partition(b"\n")
    m = re.fullmatch(rb"xxh3-128 ([0-9a-f]{32})\n", rest)
    if not sep or m is None:
        raise FormatError(f"{what}: not a ckptstore {what} object (no check line)")
    got = digest(line).hex()
    if got != m.group(1).decode():
        raise ChecksumMismatch(what, m.group(1).decode(), got)
    try:
        body = json.loads(line.decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"{what}: not JSON ({e})") from None
    if not isinstance(body, dict) or body.get("format") != fmt:
        raise FormatError(f"{what}: not a ckptstore {what} object")
    if body.get("v") != version or type(body.get("v")) is not int:
        raise UnsupportedVersionError(f"{what} version {body.get('v')!r} (this reader knows "
                                      f"{version})")
    return body


def checked_int(v: object, what: str, low: int = 0, high: int = _MAX_U63) -> int:
    if type(v) is not int or not low <= v <= high:
        raise FormatError(f"HEAD: {what} must be an integer in {low}..{high}, not {v!r}")
    return v


def checked_opt_int(v: object, what: str) -> int | None:
    return None if v is None else checked_int(v, what)


def checked_hex16(v: object, what: str) -> bytes:
    if not isinstance(v, str) or not _HEX32.match(v):
        raise FormatError(f"HEAD: {what} must be 32 lowercase hex digits, not {v!r}")
    return bytes.fromhex(v)


def decode_head(data: bytes, generation: int) -> Head:
    """Check and decode a HEAD object named with ``generation``; FormatError (ChecksumMismatch
    for a failed check) says why it is refused."""
    body = unseal_json(data, HEAD_FORMAT, HEAD_VERSION)
    if checked_int(body.get("generation"), "generation", 1) != generation:
        raise FormatError(f"HEAD: generation {body.get('generation')} differs from its name's "
                          f"{generation}")
    segs_raw = body.get("segments")
    if not isinstance(segs_raw, list):
        raise FormatError("HEAD: segments must be a list")
    segments: list[SegmentEntry] = []
    for item in segs_raw:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[2], list)):
            raise FormatError(f"HEAD: malformed segment entry {item!r:.80}")
        seq = checked_int(item[0], "segment seq", 1, 10**10 - 1)
        length = checked_int(item[1], f"length of segment {seq}", 1)
        if segments and seq <= segments[-1].seq:
            raise FormatError(f"HEAD: segment {seq} out of order")
        extents: list[Extent] = []
        at = 0
        for x in item[2]:
            if not (isinstance(x, list) and len(x) == 3):
                raise FormatError(f"HEAD: malformed extent {x!r:.80} of segment {seq}")
            off = checked_int(x[0], "extent offset", 0, 10**15 - 1)
            n = checked_int(x[1], "extent length", 1, 10**15 - 1)
            if off != at:
                raise FormatError(f"HEAD: extents of segment {seq} are not consecutive at {at}")
            extents.append(Extent(seq, off, n, checked_hex16(x[2], "extent digest")))
            at = off + n
        if at != length:
            raise FormatError(f"HEAD: extents of segment {seq} cover {at} bytes, not {length}")
        segments.append(SegmentEntry(seq, length, tuple(extents)))
    pos_raw = body.get("position")
    position: tuple[int, int] | None = None
    if pos_raw is not None:
        if not (isinstance(pos_raw, list) and len(pos_raw) == 2):
            raise FormatError(f"HEAD: malformed position {pos_raw!r:.80}")
        position = (checked_int(pos_raw[0], "position seq", 1),
                    checked_int(pos_raw[1], "position offset"))
        seg = next((s for s in segments if s.seq == position[0]), None)
        if seg is None or position[1] > seg.length:
            raise FormatError(f"HEAD: position {position} lies outside its segments")
    index: IndexRef | None = None
    idx_raw = body.get("index")
    if idx_raw is not None:
        if not (isinstance(idx_raw, list) and len(idx_raw) == 3):
            raise FormatError(f"HEAD: malformed index entry {idx_raw!r:.80}")
        index = IndexRef(checked_int(idx_raw[0], "index length", 1, 10**15 - 1),
                         checked_int(idx_raw[1], "index raw length", 1),
                         checked_hex16(idx_raw[2], "index digest"))
    known = {"format", "v", "generation", "store_id", "store", "position", "latest",
             "recoverable", "iterations", "watermark", "created_ns", "segments", "index"}
    return Head(generation=generation, store_id=checked_hex16(body.get("store_id"), "store_id"),
                store_digest=checked_hex16(body.get("store"), "store digest"), position=position,
                latest=checked_opt_int(body.get("latest"), "latest"),
                recoverable=checked_opt_int(body.get("recoverable"), "recoverable"),
                count=checked_int(body.get("iterations", 0), "iterations"),
                watermark=checked_int(body.get("watermark", 0), "watermark"),
                segments=tuple(segments),
                created_ns=checked_int(body.get("created_ns", 0), "created_ns"),
                index=index, extra={k: v for k, v in body.items() if k not in known})
