"""Optional native (C) kernels for replay, built on first use with the system C compiler.

Nothing here is needed for correctness: every kernel has a pure-torch equivalent that runs when
the kernel is unavailable (no compiler, ``CKPTSTORE_NATIVE=0``) or when it has not been shown to
reproduce torch's results bit for bit on this machine (see :mod:`ckptstore.replay.native.adam`).
"""
