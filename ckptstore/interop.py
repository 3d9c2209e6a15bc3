"""``ckptstore.interop``, the documented import path of import from and export to other tools'
checkpoint formats: re-exports :mod:`ckptstore.integrations.interop` (its docstring says which
sources and formats, and how)."""

from .integrations.interop import (EXPORT_FORMATS, KINDS, DirImportReport, ImportResult,
                                   LoadedSource, detect_kind, export_checkpoint, flat_tensors,
                                   import_checkpoint, import_dir, iteration_from_name, load_source,
                                   scan_dir, write_state)

__all__ = ["KINDS", "EXPORT_FORMATS", "LoadedSource", "ImportResult", "DirImportReport",
           "detect_kind", "iteration_from_name", "load_source", "import_checkpoint", "scan_dir",
           "import_dir", "flat_tensors", "write_state", "export_checkpoint"]
