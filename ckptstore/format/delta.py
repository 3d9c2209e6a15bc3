"""Delta records (format-spec/deltas.md): the names a base snapshot and a delta record share.

A base snapshot written by :class:`ckptstore.torch.Checkpointer` carries a section under
:data:`REPLAY_KEY` that tells a replayer how to rebuild the optimizer; every delta record of the
chain that starts at that base is read against it. Pure constants: the trainer side (which writes
them) and the replay side (which reads them) both import them from here.
"""

from __future__ import annotations

#: The key of the replay section in a base snapshot's state (and of delta records' metadata).
REPLAY_KEY = "ckptstore.replay"
#: The version of that section; a replayer refuses any other.
REPLAY_VERSION = 1
#: The optimizers replay may construct (deterministic step from params, grads and state): an
#: allowlist of ``torch.optim`` class names, so nothing a store names is ever imported.
OPTIMIZER_NAMES = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam",
                   "RAdam", "Rprop")
