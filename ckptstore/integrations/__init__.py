"""Framework integrations and interchange: clients of the public API, apart from the core.

* :mod:`ckptstore.integrations.dcp`: the storage layer of ``torch.distributed.checkpoint``
  (``StorageWriter``/``StorageReader``, whole-checkpoint loads and layouts);
* :mod:`ckptstore.integrations.hf`: a Hugging Face ``Trainer`` callback;
* :mod:`ckptstore.integrations.lightning`: a Lightning ``CheckpointIO``;
* :mod:`ckptstore.integrations.interop`: import from ``torch.save``/safetensors files, DCP
  directories and Hugging Face Trainer checkpoints, export to ``torch.save``/safetensors/DCP;
* :mod:`ckptstore.integrations.store_ref`: a store handed to an integration, or opened from its
  path.

Their documented import paths are the short ones, ``ckptstore.dcp``, ``ckptstore.hf``,
``ckptstore.lightning`` and ``ckptstore.interop`` (modules that re-export these). Nothing in the
core imports this package, and this file imports none of its modules: ``import ckptstore`` never
imports ``transformers``, ``lightning`` or ``torch.distributed.checkpoint``.
"""
