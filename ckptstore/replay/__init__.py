"""Replay: re-executing recorded optimizer steps to rebuild the training state at any iteration.

``replayer`` drives it (base snapshot + delta records -> state, format-spec/deltas.md), checking
the recorded ``fingerprints`` and stating how exact the result is (``report``);
``parallel`` pipelines record reads and runs steady deltas as tiled, multi-threaded windows;
``gradcodecs`` encode gradients on the trainer's side and decode them here; ``native`` holds
optional C kernels, used only where they reproduce torch's bits. This package reads records
through the small :class:`~ckptstore.replay.replayer.RecordSource` interface, never the store's
internals.
"""

from .fingerprints import fingerprint, fingerprint_digest, parameter_norm
from .replayer import IncrementalReplayer, optimizer_class, replay_range, replay_to
from .report import ApproximateReplayWarning, ReplayReport

__all__ = ["ApproximateReplayWarning", "IncrementalReplayer", "ReplayReport", "fingerprint",
           "fingerprint_digest", "optimizer_class", "parameter_norm", "replay_range", "replay_to"]
