"""Import checkpoints written by other tools into a store, and export iterations to their formats.

    import ckptstore
    from ckptstore.interop import export_checkpoint, import_checkpoint, import_dir

    with ckptstore.open("runs/gpt", mode="a") as store:
        import_checkpoint(store, 100, "old/step_100.pt")            # a torch.save file
        import_checkpoint(store, None, "hf-run/checkpoint-500")      # iteration 500, from the name
        report = import_dir(store, "old-run/")                       # every checkpoint in it
        report.logical_bytes, report.written_bytes                   # what dedup saved
        export_checkpoint(store, 500, "out/dcp-500", "dcp")           # also "torch", "safetensors"

**Sources** (the kind is detected from the files, or given as ``kind=``):

* ``"torch"``: a file written by ``torch.save``, read with ``torch.load(path, weights_only=True)``
  and nothing else. A file that needs more (a pickled class, a numpy array, ``TrainingArguments``)
  raises :class:`~ckptstore.errors.ImportSourceError` naming the file and what torch refused;
  there is no fallback to full unpickling.
* ``"safetensors"``: a ``.safetensors`` file (``safetensors.torch.load_file``); the state is its
  flat ``{name: tensor}`` dict and its string metadata is kept in the meta.
* ``"dcp"``: a ``torch.distributed.checkpoint`` directory (``FileSystemWriter`` layout:
  ``.metadata`` and ``*.distcp`` files), read in this one process by DCP's own reader into plain
  CPU tensors and nested like DCP's own ``dcp_to_torch_save`` does (DCP's flattening map; dict
  keys come back as DCP saved them, as strings). Every file the metadata names is checked to be
  there and long enough before anything is read. **Trust:** DCP's ``.metadata`` is a pickle,
  loaded by DCP itself (``FileSystemReader.read_metadata``): importing a DCP directory trusts that
  file exactly as ``dcp.load`` does, so import only directories you would ``dcp.load``. Its
  tensors are read by DCP with ``torch.load(weights_only=True)``, and its non-tensor items
  (``BYTE_IO``: learning rates, step counters, param lists), which DCP's default planner unpickles
  fully, are read here with ``torch.load(weights_only=True)`` too (refused: ImportSourceError).
  Once imported, nothing ckptstore reads from its own store is pickled.
* ``"hf"``: a Hugging Face ``Trainer`` ``checkpoint-N/`` directory: the model
  (``model.safetensors``; or ``model-0000x-of-0000y.safetensors`` shards with
  ``model.safetensors.index.json``; or ``pytorch_model.bin``, or its shards with
  ``pytorch_model.bin.index.json``, weights_only), ``optimizer.pt`` and ``scheduler.pt``
  (weights_only), ``rng_state.pth`` / ``rng_state_K.pth`` (weights_only; a file that does not
  load that way, e.g. one holding numpy's RNG state, is skipped with an
  :class:`~ckptstore.errors.ImportSkippedWarning` naming it), ``trainer_state.json`` and
  ``config.json`` (stored as JSON-like state). The state is ``{"model": {...}, "optimizer": ...,
  "scheduler": ..., "rng_state": ..., "trainer_state": {...}, "config": {...}}`` (what the
  directory has); the iteration defaults to N. ``training_args.bin`` (a pickle of
  ``TrainingArguments``) is never read; it and other files (tokenizer, ...) are listed as skipped.

The meta of an imported iteration is the caller's ``meta`` plus ``meta["import"]``: the source's
kind and absolute path, the string metadata of the safetensors files read (``"metadata"``; for
``"hf"`` keyed by file name), the files skipped (``"skipped"``: file and why);
for ``"hf"`` also ``global_step``, ``epoch`` and ``log``, the numbers ``trainer_state.json``
logged at the checkpoint's step (so ``gc --keep-best N --metric import.log.loss`` works on an
imported run).

**Nothing is lost.** An import is one :meth:`~ckptstore.Store.save`: the source is read and
checked completely first (a value the store cannot hold raises ImportSourceError naming the file
and the path in the state), then written and committed atomically; any failure leaves the store
as it was. Iterations must increase (:class:`~ckptstore.errors.IterationOrderError`, checked before
the source is read). :func:`import_dir` checks every entry it will import (kind, name, order,
required files) before the first save; each import is then its own commit, so a failure while
reading a later source (a file torch refuses) leaves the earlier ones committed and intact.

**Export** (:func:`write_state`, :func:`export_checkpoint`, ``ckptstore restore --format``):
``"torch"`` (``torch.save`` of the state as loaded), ``"safetensors"`` (tensors flattened to
``a/b/c`` names, other values as JSON in the metadata key ``ckptstore.values``), ``"dcp"`` (a DCP
directory written by ``dcp.save(..., no_dist=True)``; numpy arrays become torch tensors, DCP turns
int dict keys into strings). Every format is written under a temporary name beside the target
and renamed into place, so the target is either complete or absent; a DCP target must not exist
or be an empty directory.
"""

from .exporting import EXPORT_FORMATS, export_checkpoint, flat_tensors, write_state
from .importing import DirImportReport, ImportResult, import_checkpoint, import_dir
from .sources import KINDS, LoadedSource, detect_kind, iteration_from_name, load_source, scan_dir

__all__ = ["KINDS", "EXPORT_FORMATS", "LoadedSource", "ImportResult", "DirImportReport",
           "detect_kind", "iteration_from_name", "load_source", "import_checkpoint", "scan_dir",
           "import_dir", "flat_tensors", "write_state", "export_checkpoint"]
