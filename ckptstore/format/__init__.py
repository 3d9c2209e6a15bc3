"""Pure encoders and decoders of the on-disk format (format-spec/). No I/O, no clocks.

Everything here takes bytes (or buffers) and returns values, or takes values and returns bytes.
Decoders raise :class:`ckptstore.errors.FormatError` subclasses and nothing else on bad input.
"""
