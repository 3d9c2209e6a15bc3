"""Fuzz targets for ckptstore's decoders (see fuzz/README.md)."""
