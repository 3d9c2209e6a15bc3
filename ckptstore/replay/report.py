"""How a replayed state relates to the training state it stands for (:class:`ReplayReport`), and
the warning an approximate replay raises (:class:`ApproximateReplayWarning`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field


class ApproximateReplayWarning(UserWarning):
    """A replayed state went through lossy gradient payloads (or another device) and is not the
    exact training state; the attached report says by how much it can differ."""


@dataclass
class ReplayReport:
    """How a replayed state relates to the training state it stands for."""

    base: int
    iteration: int
    deltas: int = 0
    exact: bool = True
    reasons: list[str] = field(default_factory=list)
    lossy_steps: int = 0
    #: largest per-entry gradient error of any lossy payload applied (measured at encode time)
    grad_max_abs_error: float = 0.0
    #: a per-entry bound on |replayed parameter - trained parameter| (up to float rounding); only
    #: for optimizers whose step is affine in the gradient (SGD), else None
    param_error_bound: float | None = 0.0
    #: measured: largest relative difference between the replayed and the trained parameter norm
    #: at recorded fingerprints (lossy replays only)
    measured_norm_rel_error: float | None = None
    fingerprints_checked: int = 0

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def summary(self) -> str:
        if self.exact:
            return f"iteration {self.iteration}: exact replay of {self.deltas} deltas from base {self.base}"
        bound = "unbounded analytically" if self.param_error_bound is None \
            else f"per-entry parameter error <= {self.param_error_bound:.3g}"
        meas = "" if self.measured_norm_rel_error is None \
            else f", measured relative norm error {self.measured_norm_rel_error:.3g}"
        return (f"iteration {self.iteration}: APPROXIMATE replay ({'; '.join(self.reasons)}): "
                f"{self.lossy_steps} lossy steps, gradient error <= {self.grad_max_abs_error:.3g} per "
                f"entry, {bound}{meas}")


def warn_if_approximate(report: ReplayReport) -> None:
    """Warn (ApproximateReplayWarning, attributed to the replay function's caller) unless
    ``report`` is of an exact replay."""
    if not report.exact:
        warnings.warn(report.summary(), ApproximateReplayWarning, stacklevel=3)
