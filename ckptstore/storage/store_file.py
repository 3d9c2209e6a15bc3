"""The STORE file: the store's identity and parameters (format-spec/format.md, "STORE file").

Written once, atomically, when a writer creates the store; read by every open.
"""

from __future__ import annotations

import os
import secrets
import time

from ..errors import FormatError
from ..format.chunk import MAX_CHUNK_SIZE
from ..format.header import (FORMAT_VERSION, NEW_STORE_FEATURES, STORE_HEADER_SIZE, StoreHeader,
                             decode_store_header, encode_store_header)
from .fileops import FileOps, io_errors
from .layout import Layout


def create_store(layout: Layout, ops: FileOps, chunk_size: int, segment_size: int,
                 flags: int = NEW_STORE_FEATURES) -> None:
    """Create the segment directory and make its entry durable, then the STORE file (temp file,
    fsync, rename, directory fsync): the store exists once the rename is durable, and never
    without ``segments/`` (a lost mkdir may otherwise land after the rename, format-spec §3).
    ``flags``: the STORE flags (0 makes a store that ckptstore releases before FRAMING_CHECKS
    read too). The caller holds the writer lock."""
    if not 0 < chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be in 1..{MAX_CHUNK_SIZE}")
    ops.makedirs(layout.segment_dir)
    header = StoreHeader(FORMAT_VERSION, secrets.token_bytes(16), chunk_size, segment_size,
                         time.time_ns(), flags)
    ops.fsync_dir(layout.root)
    ops.write_file_atomic(layout.store_file, encode_store_header(header))
    ops.fsync_dir(os.path.dirname(os.path.abspath(layout.root)))


def read_store_header(layout: Layout, versions: tuple[int, ...] = (FORMAT_VERSION,)) -> StoreHeader:
    """The decoded STORE file; FormatError (with file and offset) when it is damaged,
    UnsupportedVersionError when its version is not in ``versions``."""
    with io_errors("read", layout.store_file):
        with open(layout.store_file, "rb") as f:
            buf = f.read(STORE_HEADER_SIZE + 1)
    try:
        return decode_store_header(buf, versions)
    except FormatError as e:
        raise e.located(layout.store_file, 0) from None
