"""Tensor Merkle trees: a tensor's bytes as an ordered list of chunk addresses under one root.

Tree payload (record type TREE)::

    0   16  root        tree_root(nbytes, chunk_size, addresses)
    16  8   nbytes      u64, total raw bytes of the tensor
    24  8   chunk_size  u64, every chunk but the last holds exactly chunk_size bytes
    32  8   n_chunks    u64, == ceil(nbytes / chunk_size) (0 for an empty tensor)
    40  16n addresses   chunk addresses in byte order

``root = xxh3_128(b"CKT1" || u64 nbytes || u64 chunk_size || addresses...)``. Two tensors with equal
roots have equal bytes (up to xxh3_128 collisions; see the threat model), so an unchanged tensor is
found by its root and never written again; ``diff`` compares roots, then addresses.

A snapshot root is ``xxh3_128(b"CKS1" || for each tensor in manifest order: u32 len(path) || path
(utf-8) || root)``: equal snapshot roots mean equal tensor contents at equal paths.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterable, Sequence

import xxhash

from ..errors import ChecksumMismatch, FormatError
from .chunk import ADDRESS_SIZE, MAX_CHUNK_SIZE

_HEAD = struct.Struct("<16sQQQ")
TREE_HEADER_SIZE = _HEAD.size
#: A tensor of more than 2**48 bytes is out of scope for v1; bounds what a decoder accepts.
MAX_TENSOR_BYTES = 1 << 48


@dataclass(frozen=True)
class Tree:
    """A tensor's chunk list. ``root`` is derived; construct with :func:`make_tree`."""

    root: bytes
    nbytes: int
    chunk_size: int
    addresses: tuple[bytes, ...]

    def chunk_spans(self) -> Iterable[tuple[int, int, bytes]]:
        """Yield (start, end, address) for each chunk, in byte order."""
        for i, addr in enumerate(self.addresses):
            start = i * self.chunk_size
            yield start, min(start + self.chunk_size, self.nbytes), addr


def expected_chunks(nbytes: int, chunk_size: int) -> int:
    return -(-nbytes // chunk_size)


def tree_root(nbytes: int, chunk_size: int, addresses: Sequence[bytes]) -> bytes:
    h = xxhash.xxh3_128()
    h.update(b"CKT1")
    h.update(struct.pack("<QQ", nbytes, chunk_size))
    for a in addresses:
        h.update(a)
    return h.digest()


def make_tree(nbytes: int, chunk_size: int, addresses: Sequence[bytes]) -> Tree:
    if len(addresses) != expected_chunks(nbytes, chunk_size):
        raise ValueError(f"{len(addresses)} chunk addresses for {nbytes} bytes in {chunk_size}-byte chunks")
    return Tree(tree_root(nbytes, chunk_size, addresses), nbytes, chunk_size, tuple(addresses))


def encode_tree(tree: Tree) -> bytes:
    return _HEAD.pack(tree.root, tree.nbytes, tree.chunk_size, len(tree.addresses)) + b"".join(
        tree.addresses)


def decode_tree(buf: bytes | memoryview) -> Tree:
    """Decode and verify a tree payload (its root must match its contents)."""
    if len(buf) < TREE_HEADER_SIZE:
        raise FormatError(f"tree payload of {len(buf)} bytes is shorter than its header")
    root, nbytes, chunk_size, n = _HEAD.unpack(bytes(buf[:TREE_HEADER_SIZE]))
    if not 0 < chunk_size <= MAX_CHUNK_SIZE:
        raise FormatError(f"tree chunk size {chunk_size} out of range")
    if nbytes > MAX_TENSOR_BYTES:
        raise FormatError(f"tree size {nbytes} out of range")
    if n != expected_chunks(nbytes, chunk_size):
        raise FormatError(f"tree of {nbytes} bytes in {chunk_size}-byte chunks lists {n} chunks")
    if len(buf) != TREE_HEADER_SIZE + n * ADDRESS_SIZE:
        raise FormatError(f"tree payload is {len(buf)} bytes, expected {TREE_HEADER_SIZE + n * ADDRESS_SIZE}")
    body = bytes(buf[TREE_HEADER_SIZE:])
    addresses = tuple(body[i:i + ADDRESS_SIZE] for i in range(0, len(body), ADDRESS_SIZE))
    actual = tree_root(nbytes, chunk_size, addresses)
    if actual != root:
        raise ChecksumMismatch("tree root", root.hex(), actual.hex())
    return Tree(root, nbytes, chunk_size, addresses)


def snapshot_root(tensor_roots: Iterable[tuple[str, bytes]]) -> bytes:
    """Root over (path, tensor root) pairs in manifest order."""
    h = xxhash.xxh3_128()
    h.update(b"CKS1")
    for path, root in tensor_roots:
        p = path.encode("utf-8", "surrogatepass")  # keys are data, any str
        h.update(struct.pack("<I", len(p)))
        h.update(p)
        h.update(root)
    return h.digest()
