"""``ckptstore.hf``, the documented import path of the Hugging Face ``Trainer`` callback:
re-exports :mod:`ckptstore.integrations.hf` (importing it imports ``transformers``)."""

from .integrations.hf import META_KEY, StoreCallback

__all__ = ["StoreCallback", "META_KEY"]
