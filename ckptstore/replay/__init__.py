"""Replay: re-executing recorded optimizer steps to rebuild the training state at any iteration.

``replayer`` drives it (base snapshot + delta records -> state, format-spec/deltas.md);
``parallel`` pipelines record reads and runs steady deltas as tiled, multi-threaded windows;
``gradcodecs`` encode gradients on the trainer's side and decode them here; ``native`` holds
optional C kernels, used only where they reproduce torch's bits. This package reads records
through the small :class:`~ckptstore.replay.replayer.RecordSource` interface, never the store's
internals.
"""

from .replayer import (ApproximateReplayWarning, IncrementalReplayer, ReplayReport, fingerprint,
                       fingerprint_digest, optimizer_class, parameter_norm, replay_range, replay_to)

__all__ = ["ApproximateReplayWarning", "IncrementalReplayer", "ReplayReport", "fingerprint",
           "fingerprint_digest", "optimizer_class", "parameter_norm", "replay_range", "replay_to"]
