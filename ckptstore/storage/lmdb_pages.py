"""A structural check of an LMDB data file, run before LMDB maps it (format-spec/format.md §16).

LMDB trusts its file: a damaged page number in a branch node or a node offset past its page makes
it read outside the file, and a read of a mapped page past the end of the file kills the process
with SIGBUS. The index is a cache and must never cost a load, let alone the process, so both the
writer and the readers check the file first and treat any inconsistency as an unusable index
(rebuilt by the writer, bypassed by readers).

:func:`check_data_file` reads the file with ordinary reads (never a mapping) and walks, from both
meta pages (LMDB may use either), the free-page tree, the main tree and every named database's
tree, checking what LMDB will dereference: each page number lies inside the file and the meta's
last page, names a page of the expected type whose header says that number, each node and its
key and data lie inside their page, overflow runs lie inside the file, no page is reached twice.
It does not judge keys or values: the index's seals and counts do that (storage/index.py).

The layout is LMDB's (``mdb.c``, 64-bit builds, data format version 1): a 16-byte page header
(``pgno u64, pad u16, flags u16, lower u16, upper u16``; overflow pages keep a ``u32`` page count
in place of lower/upper), 8-byte node headers (``lo u16, hi u16, flags u16, ksize u16``), and on
pages 0 and 1 the meta record after the page header.
"""

from __future__ import annotations

import struct

import numpy as np

from ..errors import IndexUnusable

_PAGE_HEADER = struct.Struct("<QHHHH")
_OVERFLOW_HEADER = struct.Struct("<QHHI")
_NODE = struct.Struct("<HHHH")
_DB = struct.Struct("<IHHQQQQQ")  # pad (psize on the free DB), flags, depth, 3 page counts, entries, root
_META = struct.Struct("<IIQQ")  # magic, version, address, mapsize; then two DBs, last_pg, txnid
_U64 = struct.Struct("<Q")

PAGE_HEADER_SIZE = 16
NODE_SIZE = 8
_MAGIC = 0xBEEFC0DE
_VERSION = 1
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META = 0x01, 0x02, 0x04, 0x08
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02
_P_INVALID = (1 << 64) - 1
_MAX_DEPTH = 32  # LMDB's cursor stack


def check_data_file(path: str) -> None:
    """Raise IndexUnusable unless every page LMDB may reach from either meta page of the data
    file at ``path`` is where and what LMDB expects (see the module docstring)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise IndexUnusable(f"index data file {path} cannot be read: {e}") from e
    _File(path, data).check()


class _File:
    def __init__(self, path: str, data: bytes) -> None:
        self.path = path
        self.data = data

    def fail(self, why: str) -> IndexUnusable:
        return IndexUnusable(f"index data file {self.path} is damaged: {why}")

    def check(self) -> None:
        psize = self._meta_psize(0)
        metas = [self._meta(0, psize), self._meta(psize, psize)]
        for free_db, main_db, last_pg in metas:
            self.last_pg = last_pg
            if (last_pg + 1) * psize > len(self.data):
                raise self.fail(f"its meta page names page {last_pg}, past the end of the file")
            self.psize = psize
            self.seen: set[int] = set()
            self.leaves: list[int] = []  # leaf pages of named databases, checked in bulk
            self._tree(free_db, subdatabases=False)
            self._tree(main_db, subdatabases=True)
            self._check_leaves()

    # ---- meta pages ----------------------------------------------------------------------------
    def _meta_psize(self, offset: int) -> int:
        db_free = self._read(_DB, offset + PAGE_HEADER_SIZE + _META.size, "meta page 0")
        psize = db_free[0]
        if psize < 512 or psize > 65536 or psize & (psize - 1):
            raise self.fail(f"meta page 0 names a page size of {psize}")
        return psize

    def _meta(self, offset: int, psize: int) -> tuple[tuple, tuple, int]:
        where = f"meta page {offset // psize}"
        _, _, flags, _, _ = self._read(_PAGE_HEADER, offset, where)
        magic, version, _, _ = self._read(_META, offset + PAGE_HEADER_SIZE, where)
        if not flags & _P_META or magic != _MAGIC or version != _VERSION:
            raise self.fail(f"{where} is not an LMDB meta page of data version {_VERSION}")
        base = offset + PAGE_HEADER_SIZE + _META.size
        free_db = self._read(_DB, base, where)
        main_db = self._read(_DB, base + _DB.size, where)
        (last_pg,) = self._read(_U64, base + 2 * _DB.size, where)
        return free_db, main_db, last_pg

    # ---- trees ---------------------------------------------------------------------------------
    def _tree(self, db: tuple, subdatabases: bool) -> None:
        root = db[7]
        if root != _P_INVALID:
            self._page(root, 0, subdatabases)

    def _page_offset(self, pgno: int, npages: int = 1) -> int:
        if not 2 <= pgno or pgno + npages - 1 > self.last_pg:
            raise self.fail(f"a node names page {pgno}, outside pages 2..{self.last_pg}")
        if pgno in self.seen:
            raise self.fail(f"page {pgno} is reached twice")
        self.seen.add(pgno)
        return pgno * self.psize

    def _page(self, pgno: int, depth: int, subdatabases: bool) -> None:
        if depth >= _MAX_DEPTH:
            raise self.fail(f"a tree is deeper than {_MAX_DEPTH} pages")
        off = self._page_offset(pgno)
        where = f"page {pgno}"
        own, _, flags, lower, upper = self._read(_PAGE_HEADER, off, where)
        if flags == _P_LEAF and not subdatabases:
            self.leaves.append(pgno)  # the bulk check below covers this page entirely
            return
        if own != pgno:
            raise self.fail(f"{where} says it is page {own}")
        branch = flags & _P_BRANCH
        if bool(branch) == bool(flags & _P_LEAF) or flags & (_P_OVERFLOW | _P_META):
            raise self.fail(f"{where} has page flags {flags:#x}")
        if not PAGE_HEADER_SIZE <= lower <= upper <= self.psize or (lower - PAGE_HEADER_SIZE) % 2:
            raise self.fail(f"{where} has bounds {lower}..{upper}")
        nkeys = (lower - PAGE_HEADER_SIZE) // 2
        if branch and nkeys == 0:
            raise self.fail(f"{where} is a branch page without nodes")
        ptrs = struct.unpack_from(f"<{nkeys}H", self.data, off + PAGE_HEADER_SIZE)
        for ptr in ptrs:
            if not upper <= ptr <= self.psize - NODE_SIZE:
                raise self.fail(f"{where} has a node at {ptr}, outside {upper}..{self.psize}")
            lo, hi, nflags, ksize = _NODE.unpack_from(self.data, off + ptr)
            end = ptr + NODE_SIZE + ksize
            if end > self.psize:
                raise self.fail(f"{where} has a key running past the page")
            if branch:
                self._page(lo | hi << 16 | nflags << 32, depth + 1, subdatabases)
                continue
            size = lo | hi << 16
            if nflags & ~(_F_BIGDATA | _F_SUBDATA):
                raise self.fail(f"{where} has a node with flags {nflags:#x}")
            if nflags & _F_BIGDATA:
                if end + 8 > self.psize:
                    raise self.fail(f"{where} has an overflow reference past the page")
                (first,) = _U64.unpack_from(self.data, off + end)
                self._overflow(first, size)
            elif end + size > self.psize:
                raise self.fail(f"{where} has a value running past the page")
            elif nflags & _F_SUBDATA:
                if not subdatabases or size != _DB.size:
                    raise self.fail(f"{where} names a database where none may be")
                self._tree(_DB.unpack_from(self.data, off + end), subdatabases=False)

    def _check_leaves(self) -> None:
        """The per-page and per-node checks of :meth:`_page` for every queued leaf page at once
        (numpy; a store of 10^5 iterations has ~10^5 leaf nodes). Nodes with a value on overflow
        pages are then checked one by one."""
        if not self.leaves:
            return
        u8 = np.frombuffer(self.data, dtype=np.uint8)
        u16 = u8[:len(u8) // 2 * 2].view("<u2")
        pgnos = np.array(self.leaves, dtype=np.int64)
        base = pgnos * self.psize
        own = u8[(base[:, None] + np.arange(8)).ravel()].reshape(-1, 8).view("<u8").ravel()
        flags, lower, upper = u16[base // 2 + 5], u16[base // 2 + 6].astype(np.int64), \
            u16[base // 2 + 7].astype(np.int64)
        bad = (own != pgnos) | (flags != _P_LEAF) | (lower < PAGE_HEADER_SIZE) | \
            (lower > upper) | (upper > self.psize) | ((lower - PAGE_HEADER_SIZE) % 2 != 0)
        if bad.any():
            raise self.fail(f"leaf page {int(pgnos[bad.argmax()])} has a damaged header")
        nkeys = (lower - PAGE_HEADER_SIZE) // 2
        page = np.repeat(np.arange(len(pgnos)), nkeys)
        slot = np.arange(int(nkeys.sum())) - np.repeat(np.cumsum(nkeys) - nkeys, nkeys)
        ptr = u16[(base[page] + PAGE_HEADER_SIZE) // 2 + slot].astype(np.int64)
        bad = (ptr < upper[page]) | (ptr > self.psize - NODE_SIZE) | (ptr % 2 != 0)
        if bad.any():
            raise self.fail(f"leaf page {int(pgnos[page[bad.argmax()]])} has a node outside it")
        node = (base[page] + ptr) // 2
        lo, hi = u16[node].astype(np.int64), u16[node + 1].astype(np.int64)
        nflags, ksize = u16[node + 2], u16[node + 3].astype(np.int64)
        end = ptr + NODE_SIZE + ksize
        big = (nflags & _F_BIGDATA) != 0
        size = lo | hi << 16
        bad = (end > self.psize) | ((nflags & np.uint16(0xFFFF ^ _F_BIGDATA)) != 0) | \
            (~big & (end + size > self.psize)) | (big & (end + 8 > self.psize))
        if bad.any():
            raise self.fail(f"leaf page {int(pgnos[page[bad.argmax()]])} has a node running past it")
        for i in np.flatnonzero(big):
            (first,) = _U64.unpack_from(self.data, int(base[page[i]] + end[i]))
            self._overflow(first, int(size[i]))

    def _overflow(self, pgno: int, size: int) -> None:
        npages = (PAGE_HEADER_SIZE + size + self.psize - 1) // self.psize
        off = self._page_offset(pgno, npages)
        own, _, flags, count = self._read(_OVERFLOW_HEADER, off, f"overflow page {pgno}")
        if own != pgno or not flags & _P_OVERFLOW or count != npages:
            raise self.fail(f"overflow page {pgno} does not hold a run of {npages} pages")
        self.seen.update(range(pgno + 1, pgno + npages))

    def _read(self, fmt: struct.Struct, offset: int, where: str) -> tuple:
        if offset + fmt.size > len(self.data):
            raise self.fail(f"{where} runs past the end of the file")
        return fmt.unpack_from(self.data, offset)
