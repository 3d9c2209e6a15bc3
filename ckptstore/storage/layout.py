"""Names of the files and folders inside a store directory (format-spec/format.md, "Layout").

Names inside a store are derived from sequence numbers only; nothing from a state dict ever
becomes a path.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

STORE_FILE = "STORE"
LOCK_FILE = "LOCK"
SEGMENT_DIR = "segments"
INDEX_DIR = "index"
QUARANTINE_DIR = "quarantine"
SEGMENT_SUFFIX = ".seg"
GC_TEMP_SUFFIX = ".gc-tmp"
_SEGMENT_RE = re.compile(r"^(\d{10})\.seg$")


@dataclass(frozen=True)
class Layout:
    root: str

    @property
    def store_file(self) -> str:
        return os.path.join(self.root, STORE_FILE)

    @property
    def lock_file(self) -> str:
        return os.path.join(self.root, LOCK_FILE)

    @property
    def segment_dir(self) -> str:
        return os.path.join(self.root, SEGMENT_DIR)

    @property
    def index_dir(self) -> str:
        return os.path.join(self.root, INDEX_DIR)

    @property
    def quarantine_dir(self) -> str:
        return os.path.join(self.root, QUARANTINE_DIR)

    def segment_path(self, seq: int) -> str:
        return os.path.join(self.segment_dir, segment_name(seq))

    def gc_temp_path(self, seq: int) -> str:
        return os.path.join(self.segment_dir, segment_name(seq) + GC_TEMP_SUFFIX)

    def quarantine_path(self, seq: int, offset: int) -> str:
        """Where the tail of segment ``seq`` cut at ``offset`` is kept."""
        if type(offset) is not int or offset < 0:
            raise ValueError(f"quarantine offset {offset!r} out of range")
        return os.path.join(self.quarantine_dir, f"{segment_name(seq).removesuffix(SEGMENT_SUFFIX)}-{offset}.tail")

    def list_segments(self) -> list[int]:
        """Sequence numbers of the segment files present, ascending."""
        try:
            names = os.listdir(self.segment_dir)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _SEGMENT_RE.match(n)))

    def list_gc_temps(self) -> list[str]:
        try:
            names = os.listdir(self.segment_dir)
        except FileNotFoundError:
            return []
        return [os.path.join(self.segment_dir, n) for n in names if n.endswith(GC_TEMP_SUFFIX)]


def is_segment_seq(seq: int) -> bool:
    """Whether ``seq`` can name a segment file (ten decimal digits, from 1)."""
    return 0 < seq < 10**10


def segment_name(seq: int) -> str:
    if not is_segment_seq(seq):
        raise ValueError(f"segment sequence number {seq} out of range")
    return f"{seq:010d}{SEGMENT_SUFFIX}"
