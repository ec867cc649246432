"""Finiteness of a gradient or a synchronised result in one cheap pass.

``torch.isfinite(t).all()`` writes a boolean mask as large as ``t`` and reduces it; one ``aminmax``
pass reads ``t`` once and writes two numbers (min and max propagate NaN, and an Inf is a min or a
max): the check the codecs run per weight or per bucket.
"""
from __future__ import annotations

import torch


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on ``t``'s device: every element of ``t`` is finite (no host sync)."""
    if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
        return torch.ones((), dtype=torch.bool, device=t.device)
    if t.is_complex():
        return torch.isfinite(t).all()
    low, high = torch.aminmax(t)
    return torch.isfinite(low) & torch.isfinite(high)
