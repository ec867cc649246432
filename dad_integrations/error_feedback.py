"""Error feedback (GRACE's "memory"): what a lossy route left out, added to the next step.

A lossy codec sends ``C(M + e)`` for a local gradient ``M`` and keeps ``e' = (M + e) - C(M + e)``.
Over steps, nothing the compressor drops is lost, only delayed; PowerSGD relies on it, and
without it rank-dAD's average is biased. Memory: one dense residual per compressed weight, per
rank (residuals differ across ranks and are saved per rank).

A step whose gradient is not finite (an fp16 overflow that the loss scaler will skip) leaves the
residual as it was: the next finite step trains as if the bad one had not happened.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .layers import compute_dtype


class ErrorFeedback:
    """Residuals by unit name."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.residuals: Dict[str, torch.Tensor] = {}

    def compensate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """``grad + residual`` (a new tensor; ``grad`` is not changed)."""
        residual = self.residuals.get(name) if self.enabled else None
        return grad if residual is None else grad + residual

    def update(self, name: str, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """Keep what was not sent: ``compensated - sent``."""
        if self.enabled:
            self.residuals[name] = compensated - sent

    def set(self, name: str, residual: torch.Tensor) -> None:
        """Keep ``residual``, computed by the caller (`codecs.sharded_rank` computes it while the
        step's tensors are at hand and keeps it only once the step is known to be finite)."""
        if self.enabled:
            self.residuals[name] = residual

    def state(self, name: str) -> Optional[torch.Tensor]:
        return self.residuals.get(name)

    def load(self, name: str, residual: Optional[torch.Tensor], like: torch.Tensor) -> None:
        """Restore a residual onto ``like``'s device (in the dtype the codec computes in)."""
        if residual is None:
            self.residuals.pop(name, None)
        else:
            self.residuals[name] = residual.to(device=like.device, dtype=compute_dtype(like))

