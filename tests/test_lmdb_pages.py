"""storage/lmdb_pages.py: the page-structure check that runs before LMDB maps an index file.

Each damage below is one LMDB would follow out of its page or out of the file (a SIGBUS when the
read lands past the end of the mapped file); the check must refuse each, and pass a healthy file.
"""

from __future__ import annotations

import os
import struct

import pytest

from ckptstore.errors import IndexUnusable
from ckptstore.format.commit import Commit
from ckptstore.storage.index import ChunkRef, CommitEntry, IndexBatch, Position
from ckptstore.storage.lmdb_index import LmdbIndex
from ckptstore.storage.lmdb_pages import check_data_file
from ckptstore.storage.segments import Loc

PAGE = 4096


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> bytes:
    """An index with multi-level trees (branch pages) in every named database."""
    path = str(tmp_path_factory.mktemp("pages") / "index")
    idx = LmdbIndex(path, b"s" * 16)
    for start in range(1, 3001, 500):
        b = IndexBatch()
        for it in range(start, start + 500):
            b.commits.append(CommitEntry(Commit(it, 1, it * 100, 50, bytes(16), bytes(16), 0, 0, 0, 0),
                                         Loc(1, it * 200, 96)))
            b.chunks[it.to_bytes(16, "little")] = ChunkRef(Loc(1, it * 300, 100), 0)
        b.position, b.segments = Position(1, (start + 499) * 200 + 120), (1,)
        idx.apply(b)
    idx.close()
    return open(os.path.join(path, "data.mdb"), "rb").read()


def _pages(data: bytes, flag: int) -> list[int]:
    return [p for p in range(2, len(data) // PAGE)
            if struct.unpack_from("<Q", data, p * PAGE)[0] == p and
            struct.unpack_from("<H", data, p * PAGE + 10)[0] == flag and
            struct.unpack_from("<H", data, p * PAGE + 12)[0] > 16]


def _refused(tmp_path, data: bytearray, match: str) -> None:
    path = tmp_path / "data.mdb"
    path.write_bytes(bytes(data))
    with pytest.raises(IndexUnusable, match=match):
        check_data_file(str(path))


def _first_node(data: bytes, pgno: int) -> int:
    return pgno * PAGE + struct.unpack_from("<H", data, pgno * PAGE + 16)[0]


def test_a_healthy_file_passes(tmp_path, healthy):
    path = tmp_path / "data.mdb"
    path.write_bytes(healthy)
    check_data_file(str(path))
    assert _pages(healthy, 0x01), "the fixture must have branch pages"


def test_a_branch_pointer_past_the_last_page(tmp_path, healthy):
    data = bytearray(healthy)
    for pgno in _pages(healthy, 0x01):  # every branch page, so the live tree is hit too
        node = _first_node(healthy, pgno)
        struct.pack_into("<HHH", data, node, 0xFFFF, 0x7FFF, 0)
    _refused(tmp_path, data, "outside pages")


def test_a_leaf_value_running_past_its_page(tmp_path, healthy):
    data = bytearray(healthy)
    for pgno in _pages(healthy, 0x02):
        node = _first_node(healthy, pgno)
        struct.pack_into("<H", data, node + 2, 0x7FFF)  # the value's size, high half
    _refused(tmp_path, data, "running past")


def test_a_leaf_node_outside_its_page(tmp_path, healthy):
    data = bytearray(healthy)
    for pgno in _pages(healthy, 0x02):
        struct.pack_into("<H", data, pgno * PAGE + 16, PAGE - 2)
    _refused(tmp_path, data, "outside")


def test_a_page_that_is_not_what_it_says(tmp_path, healthy):
    data = bytearray(healthy)
    for pgno in _pages(healthy, 0x02):
        struct.pack_into("<Q", data, pgno * PAGE, pgno + 1)
    _refused(tmp_path, data, "page")


def test_a_meta_page_naming_pages_past_the_file(tmp_path, healthy):
    data = bytearray(healthy)
    for meta in (0, PAGE):  # last_pg: after the page header, the meta's 24-byte head and two DBs
        struct.pack_into("<Q", data, meta + 16 + 24 + 2 * 48, len(healthy) // PAGE + 10)
    _refused(tmp_path, data, "past the end")


def test_not_an_lmdb_file(tmp_path):
    _refused(tmp_path, bytearray(3 * PAGE), "meta page|page size")
