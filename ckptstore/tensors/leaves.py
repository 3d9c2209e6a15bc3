"""Array leaves: how torch tensors and numpy arrays become bytes and come back.

Saving takes a 1-D ``uint8`` view of each array's memory (no copy for contiguous CPU tensors;
one copy for GPU, non-contiguous, conjugate or negative-bit views). Loading allocates each array
once, empty, and hands its bytes to the reader to fill in place.

Accepted: ``torch.Tensor`` and ``torch.nn.Parameter`` with a strided layout and any non-quantized
dtype; ``numpy.ndarray`` with a boolean, integer, float or complex dtype of either byte order.
Everything else (sparse, quantized, nested, meta, tensor subclasses, object or structured arrays)
is refused with UnsupportedTypeError naming the path.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import CkptStoreError, FormatError, ShardedStateError, UnsupportedTypeError
from ..format.image import BLOCK, DATA_OFFSET, ChunkImage
from ..format.manifest import TensorEntry
from ..format.state import Path, format_path, path_name

_QUANTIZED = {"qint8", "qint32", "quint8", "quint4x2", "quint2x4"}
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: dt for name in dir(torch)
    if isinstance(dt := getattr(torch, name), torch.dtype) and str(dt) == f"torch.{name}"
    and name not in _QUANTIZED
}
_NUMPY_DTYPE = re.compile(r"^[<>|=][biufc]\d{1,2}$")
_EMPTY = memoryview(b"")
# memoryview(<ndarray>) calls below carry `type: ignore[arg-type]`: numpy's stubs declare
# ndarray.__buffer__ only for Python >= 3.12, so mypy at python_version 3.10 cannot see that arrays
# support the buffer protocol (they do, on every version).


#: a signed integer dtype of each element size: bitwise comparison of any dtype (NaNs included)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ImageTensor:
    """A tensor whose bytes lie inside a chunk image (format/image.py) in a host buffer: each
    chunk of its data sits where its CHUNK record's data will lie in the log, so the write path
    frames the records around it and writes the image with no copy (the Checkpointer captures
    gradients this way). It is a save-side leaf only: it is never loaded as such.

    Invariants: ``buffer`` is a 1-D uint8 CPU tensor; the image occupies
    ``buffer[offset:offset + image.size]`` and its first byte is page-aligned in memory; the
    element size divides :data:`~ckptstore.format.image.DATA_OFFSET` and the stride (checked by
    :meth:`fits`), so every chunk's data is a whole number of elements at an aligned address.
    """

    def __init__(self, buffer: torch.Tensor, offset: int, dtype: torch.dtype,
                 shape: tuple[int, ...], stride: int) -> None:
        esz = dtype.itemsize
        numel = math.prod(shape)
        if not self.fits(dtype, numel * esz, stride):
            raise ValueError(f"a {dtype} tensor of shape {shape} cannot lie in a chunk image")
        if (buffer.data_ptr() + offset) % BLOCK:
            raise ValueError("a chunk image must start page-aligned")
        self.buffer = buffer
        self.offset = offset
        self.dtype = dtype
        self.shape = tuple(shape)
        self.nbytes = numel * esz
        self.image = ChunkImage(self.nbytes, stride)
        typed = buffer.view(dtype)
        per = self.image.chunk_size // esz
        self._per = per
        self._full_rows = numel // per
        self._tail_len = numel - self._full_rows * per
        first = (offset + DATA_OFFSET) // esz
        self._full = typed.as_strided((self._full_rows, per), (stride // esz, 1), first) \
            if self._full_rows else None
        t0 = first + self._full_rows * (stride // esz)
        self._tail = typed[t0:t0 + self._tail_len] if self._tail_len else None
        self._memory: memoryview | None = None

    @staticmethod
    def fits(dtype: torch.dtype, nbytes: int, stride: int) -> bool:
        """Whether a tensor of ``dtype`` and ``nbytes`` can lie in a chunk image of ``stride``."""
        esz = dtype.itemsize
        return nbytes > 0 and esz in _BITS and DATA_OFFSET % esz == 0 and stride % esz == 0 \
            and not dtype.is_complex

    def _pieces(self, flat: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(image view, the matching part of ``flat``) for the full rows and the tail."""
        k = self._full_rows * self._per
        out = []
        if self._full is not None:
            out.append((self._full, flat[:k].view(self._full_rows, self._per)))
        if self._tail is not None:
            out.append((self._tail, flat[k:]))
        return out

    def copy_(self, src: torch.Tensor) -> "ImageTensor":
        """Copy ``src`` (same dtype and number of elements, any strides) into the image."""
        with torch.no_grad():
            for dst, part in self.copy_pairs(src):
                dst.copy_(part)
        return self

    def copy_pairs(self, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination in the image, source part) pairs whose copies fill the image with
        ``src`` (same dtype and number of elements): for a caller batching many copies into one
        ``torch._foreach_copy_``. A contiguous ``src``'s parts are views of it (sharing its
        version counter); any other ``src`` is flattened into a copy first."""
        return self._pieces(src.detach().reshape(-1))

    def same_bits(self, src: torch.Tensor) -> bool:
        """Whether the image holds exactly ``src``'s bits (NaN payloads included)."""
        bits = _BITS[src.element_size()]
        flat = src.detach().reshape(-1)
        return all(torch.equal(dst.view(bits), part.view(bits)) for dst, part in self._pieces(flat))

    def to_tensor(self) -> torch.Tensor:
        """A contiguous copy of the tensor (for consumers that need one; the write path does not)."""
        out = torch.empty(self.shape, dtype=self.dtype)
        flat = out.view(-1)
        with torch.no_grad():
            for src, part in self._pieces(flat):
                part.copy_(src)
        return out

    def memory(self) -> memoryview:
        """The whole image's bytes (writable: the write path frames records in it). Made once per
        ImageTensor (an arena's views are reused by every snapshot of the same structure)."""
        mem = self._memory
        if mem is None:
            mem = self._memory = memoryview(self.buffer[self.offset:self.offset + self.image.size].numpy())  # type: ignore[arg-type]
        return mem


class LentTensor:
    """A contiguous CPU tensor lent to a save by its owner instead of copied: the write path
    hashes and writes its chunks straight from its memory (format/image.py's lent framing,
    ckptstore/engine/write_path.py), so nothing copies it on the owner's time. It is a
    save-side leaf only: it is never loaded as such.

    Invariant (the lender's promise, enforced by :class:`ckptstore.ops.loan.Loan`): the bytes do
    not change from the save's submission until its job has written them; the persister reads
    them only after the lender confirmed that they did not change (the gradient capture checks
    the version counter and that the tensor is no longer the live gradient).
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu" or tensor.layout != torch.strided or \
                not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg():
            raise ValueError("only a dense, contiguous CPU tensor can be lent")
        self.tensor = tensor.detach()
        self.dtype = tensor.dtype
        self.shape = tuple(tensor.shape)
        self.nbytes = tensor.numel() * tensor.element_size()

    @property
    def address(self) -> int:
        """The memory address of the first byte."""
        return self.tensor.data_ptr()

    def memory(self) -> memoryview:
        """The bytes, read-only in spirit (the write path never writes them)."""
        return memoryview(self.tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


@dataclass
class ArrayLeaf:
    """One array found in a state, with what the manifest records about it."""

    path: Path
    lib: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    value: Any
    param: bool = False
    requires_grad: bool = False

    @property
    def name(self) -> str:
        return path_name(self.path)

    @property
    def image(self) -> ImageTensor | None:
        """The chunk image holding this leaf's bytes, when it lies in one."""
        return self.value if isinstance(self.value, ImageTensor) else None

    @property
    def lent(self) -> LentTensor | None:
        """The lent tensor holding this leaf's bytes, when it was lent (not copied)."""
        return self.value if isinstance(self.value, LentTensor) else None

    def byte_view(self) -> memoryview:
        """The array's bytes, C order, as a flat memoryview (kept alive by the view itself)."""
        if self.nbytes == 0:
            return _EMPTY
        if self.lib == "torch":
            v = self.value
            t: torch.Tensor = v.to_tensor() if isinstance(v, ImageTensor) else \
                v.tensor if isinstance(v, LentTensor) else v.detach()
            if t.device.type != "cpu":
                t = t.to("cpu")
            if t.is_conj():
                t = t.resolve_conj()
            if t.is_neg():
                t = t.resolve_neg()
            t = t.contiguous()
            return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        a = np.ascontiguousarray(self.value)
        return memoryview(a.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


#: torch dtype -> its name in TORCH_DTYPES (a dict lookup instead of str() per tensor)
_TORCH_DTYPE_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in TORCH_DTYPES.items()}


def dtensor_type() -> Any:
    """torch's DTensor class, or None when no DTensor can exist (its module was never imported)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_dtensor(t: Any) -> bool:
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def _torch_leaf(t: torch.Tensor, path: Path) -> ArrayLeaf:
    # the common case (a dense tensor of a known dtype) pays for no path formatting: every save
    # flattens hundreds of tensors in the caller's thread (the async stall)
    kind = type(t)
    if kind is not torch.Tensor and kind is not torch.nn.Parameter:
        if is_dtensor(t):  # a job store with a group has made each DTensor its local shard
            raise ShardedStateError(
                f"DTensor at {format_path(path)}: a sharded state is saved with save() by every "
                "rank of a job store opened with the process group its device mesh spans "
                "(ckptstore.open(path, \"a\", process_group=pg)); this save takes whole tensors",
                path=path)
        raise UnsupportedTypeError(f"tensor subclass {kind.__qualname__} at {format_path(path)} "
                                   "is not supported")
    if t.layout != torch.strided:
        raise UnsupportedTypeError(f"{t.layout} tensor at {format_path(path)}: only strided (dense) "
                                   "tensors are supported")
    if t.is_nested or t.is_quantized:
        raise UnsupportedTypeError(f"nested or quantized tensor at {format_path(path)} is not supported")
    if t.is_meta:
        raise UnsupportedTypeError(f"meta tensor at {format_path(path)} has no data to save")
    name = _TORCH_DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise UnsupportedTypeError(f"tensor dtype {t.dtype} at {format_path(path)} is not supported")
    return ArrayLeaf(path, "torch", name, tuple(t.shape), t.nbytes, t,
                     param=kind is torch.nn.Parameter, requires_grad=t.requires_grad)


def _numpy_leaf(a: np.ndarray, path: Path) -> ArrayLeaf:
    dt = a.dtype.str
    if not _NUMPY_DTYPE.match(dt) or a.dtype.names is not None or a.dtype.subdtype is not None:
        raise UnsupportedTypeError(
            f"numpy dtype {a.dtype} at {format_path(path)} is not supported "
            "(bool, int, uint, float and complex are)")
    return ArrayLeaf(path, "numpy", dt, tuple(a.shape), a.nbytes, a)


def leaf_hook(x: Any, path: Path) -> ArrayLeaf | None:
    """State-encoding hook: recognise tensors and arrays; None for anything else."""
    if isinstance(x, torch.Tensor):
        return _torch_leaf(x, path)
    if isinstance(x, (ImageTensor, LentTensor)):
        return ArrayLeaf(path, "torch", _TORCH_DTYPE_NAMES[x.dtype], x.shape, x.nbytes, x)
    if isinstance(x, np.ndarray):
        if type(x) is not np.ndarray:  # a subclass (masked array, matrix, memmap) would lose its type
            raise UnsupportedTypeError(
                f"numpy array subclass {type(x).__module__}.{type(x).__qualname__} at "
                f"{format_path(path)} is not supported; store np.asarray(x) (and its extra fields)")
        return _numpy_leaf(x, path)
    if isinstance(x, np.generic):
        raise UnsupportedTypeError(
            f"numpy scalar {type(x).__name__} at {format_path(path)}: store it as a Python number "
            "(.item()) or a 0-d array (np.asarray)")
    return None


def no_leaves(x: Any, path: Path) -> None:
    """Hook for structures that must not hold arrays (user meta)."""
    if isinstance(x, (torch.Tensor, np.ndarray, ImageTensor, LentTensor)):
        raise UnsupportedTypeError(f"meta holds an array at {format_path(path)}; meta must be JSON-like")
    return None


def allocate(entry: TensorEntry) -> tuple[Any, memoryview]:
    """Allocate an empty array for ``entry``; return it and a writable flat byte view of it.

    Raises FormatError when the entry's dtype is unknown or its shape and byte size disagree.
    """
    numel = math.prod(entry.shape)
    if entry.lib == "torch":
        dtype = TORCH_DTYPES.get(entry.dtype)
        if dtype is None:
            raise FormatError(f"tensor {entry.path}: unknown torch dtype {entry.dtype!r}")
        itemsize = dtype.itemsize
    else:
        if not _NUMPY_DTYPE.match(entry.dtype):
            raise FormatError(f"tensor {entry.path}: unsupported numpy dtype {entry.dtype!r}")
        try:
            np_dtype = np.dtype(entry.dtype)
        except TypeError:
            raise FormatError(f"tensor {entry.path}: unknown numpy dtype {entry.dtype!r}") from None
        itemsize = np_dtype.itemsize
    if numel * itemsize != entry.nbytes:
        raise FormatError(f"tensor {entry.path}: shape {list(entry.shape)} of {entry.dtype} is not "
                          f"{entry.nbytes} bytes")
    value: torch.Tensor | np.ndarray
    try:
        if entry.lib == "torch":
            assert dtype is not None  # checked above
            value = _empty_torch(entry.shape, dtype, entry.nbytes)
            view = (memoryview(value.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
                    if entry.nbytes else _EMPTY)
        else:
            value = np.empty(entry.shape, dtype=np_dtype)
            view = (memoryview(value.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
                    if entry.nbytes else _EMPTY)
    except (MemoryError, RuntimeError) as e:
        raise CkptStoreError(f"tensor {entry.path}: cannot allocate {entry.nbytes} bytes: {e}") from e
    except (TypeError, ValueError, OverflowError) as e:
        # a shape the library cannot represent: a dimension past int64 (torch), more dimensions or
        # a larger extent than numpy supports; with a zero dimension such a shape passes the size check
        raise FormatError(f"tensor {entry.path}: shape {list(entry.shape)[:8]} cannot be "
                          f"represented by {entry.lib}: {e}") from e
    return value, view


def empty_torch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor for a reader to fill (:func:`_empty_torch`: works under
    ``torch.use_deterministic_algorithms(True)`` for every dtype)."""
    return _empty_torch(shape, dtype, math.prod(shape) * dtype.itemsize)


def _empty_torch(shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)``. Under ``torch.use_deterministic_algorithms(True)``
    torch fills new tensors, which it cannot do for some dtypes (the bits types): those are
    allocated as bytes and viewed as ``dtype`` (the reader overwrites every byte anyway)."""
    try:
        return torch.empty(shape, dtype=dtype)
    except NotImplementedError:
        flat = torch.empty(nbytes, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)


def into_view(entry: TensorEntry, value: Any) -> tuple[Any, memoryview]:
    """``value`` (a caller's existing tensor) and a writable flat byte view of it, to be filled
    with ``entry``'s bytes. Raises FormatError when it cannot hold exactly that tensor."""
    dtype = TORCH_DTYPES.get(entry.dtype) if entry.lib == "torch" else None
    if (not isinstance(value, torch.Tensor) or dtype is None or value.dtype != dtype
            or tuple(value.shape) != tuple(entry.shape) or value.device.type != "cpu"
            or not value.is_contiguous() or value.requires_grad
            or value.numel() * value.element_size() != entry.nbytes):
        raise FormatError(f"tensor {entry.path}: the destination given is not a contiguous CPU "
                          f"{entry.dtype}{list(entry.shape)} tensor")
    if not entry.nbytes:
        return value, _EMPTY
    return value, memoryview(value.detach().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def finish(entry: TensorEntry, value: Any) -> Any:
    """Apply what the manifest records beyond bytes (Parameter, requires_grad)."""
    if entry.lib == "torch":
        if entry.param:
            return torch.nn.Parameter(value, requires_grad=entry.requires_grad)
        if entry.requires_grad:
            value.requires_grad_(True)
    return value
