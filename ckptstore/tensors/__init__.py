"""The tensors layer (no I/O): array leaves to and from byte views (:mod:`.leaves`), and loading into
tensors the caller already has (:mod:`.inplace`). Above ``format/``, below ``storage/``.

The names the layers above use are re-exported here from :mod:`.leaves`."""

from .leaves import (TORCH_DTYPES, ArrayLeaf, ImageTensor, LentTensor, allocate, empty_torch,
                     finish, into_view, leaf_hook, no_leaves)

__all__ = ["TORCH_DTYPES", "ArrayLeaf", "ImageTensor", "LentTensor", "allocate", "empty_torch",
           "finish", "into_view", "leaf_hook", "no_leaves"]
