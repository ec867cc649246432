"""Error feedback (GRACE's "memory"): what a lossy route left out, added to the next step.

A lossy codec sends ``C(M + e)`` for a local gradient ``M`` and keeps ``e' = (M + e) - C(M + e)``:
nothing the compressor drops is lost, only delayed (PowerSGD relies on it; without it rank-dAD's
average is biased). Two memories, one interface (`error_feedback_for` picks by the config):

- `ErrorFeedback` keeps each residual whole, ``m n`` numbers per compressed weight and rank, as
  PowerSGD's hook does (where they live under each layout: `routes.layouts.RESIDUALS`).
- `LowRankErrorFeedback` (``error_feedback_rank: q``) keeps the residual's best rank-``q`` part
  ``U V^T`` (``q (m+n)`` numbers), by `power_iteration.power_iteration` warm-started from the last
  one (``power_iterations`` rounds): the directions the compressor left out with most energy travel
  on, the tail below them is dropped. Exact whenever the residual's rank is at most ``q``.

A step whose gradient is not finite leaves the residual as it was: `route_state.RouteState` holds
`pack`'s result until the step's end and `keep`s it only then.
"""
from __future__ import annotations

import zlib
from typing import Dict, Optional, Tuple, Union

import torch

from dad_integrations.capture.rows import compute_dtype
from dad_integrations.codecs.power_iteration import LocalGradient, power_iteration

Packed = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


class ErrorFeedback:
    """Residuals by unit name, kept whole (`LowRankErrorFeedback`: as pairs ``(U, V)``)."""

    matrix_rank: Optional[int] = None

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.residuals: Dict[str, Packed] = {}

    def compensate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """``grad + residual`` (a new tensor; ``grad`` is not changed)."""
        held = self.residuals.get(name) if self.enabled else None
        if held is None:
            return grad
        return grad + held if isinstance(held, torch.Tensor) else torch.addmm(grad, held[0], held[1].t())

    def pack(self, name: str, residual: torch.Tensor) -> Packed:
        """What `keep` stores for ``residual`` (here: itself); nothing is stored yet."""
        return residual

    def keep(self, name: str, packed: Packed) -> None:
        """Store `pack`'s result as ``name``'s residual."""
        if self.enabled:
            self.residuals[name] = packed

    def state(self, name: str) -> Optional[Packed]:
        return self.residuals.get(name)

    def dense(self, name: str) -> Optional[torch.Tensor]:
        """``name``'s residual as one ``m x n`` tensor (None when there is none)."""
        held = self.residuals.get(name)
        return held if held is None or isinstance(held, torch.Tensor) else held[0] @ held[1].t()

    def load(self, name: str, residual: Optional[Packed], like: torch.Tensor) -> None:
        """Restore a residual onto ``like``'s device (in the dtype the codec computes in): a pair of
        this memory's rank as saved (bitwise), any other through `pack` (a pair expanded first)."""
        if residual is None:
            self.residuals.pop(name, None)
            return
        to = dict(device=like.device, dtype=compute_dtype(like))
        if isinstance(residual, (tuple, list)):
            u, v = (t.to(**to) for t in residual)
            if self.matrix_rank is not None and u.shape[1] == min(self.matrix_rank, *u.shape, v.shape[0]):
                self.residuals[name] = (u, v)
                return
            residual = u @ v.t()
        self.residuals[name] = self.pack(name, residual.to(**to))

    def numel(self) -> int:
        """Numbers held, over every weight (the memory's cost)."""
        return sum(sum(t.numel() for t in (r if isinstance(r, tuple) else (r,))) for r in self.residuals.values())


class LowRankErrorFeedback(ErrorFeedback):
    """Residuals kept as their rank-``matrix_rank`` part ``U V^T`` (module doc): ``q (m + n)`` numbers."""

    def __init__(self, enabled: bool, matrix_rank: int, iterations: int = 1):
        super().__init__(enabled)
        self.matrix_rank = matrix_rank
        self.iterations = iterations

    def pack(self, name: str, residual: torch.Tensor) -> Packed:
        """``(U, V)`` with ``U`` orthonormal (m x q): power iteration from the last residual's
        ``V`` (a seeded draw the first time), so the kept subspace follows the residual's. At
        ``q >= min(m, n)`` the residual itself (exact, and no more numbers than a pair)."""
        m, n = residual.shape
        q = min(self.matrix_rank, m, n)
        if q == min(m, n):
            return residual
        held = self.residuals.get(name)
        start = held[1] if isinstance(held, tuple) and held[1].shape == (n, q) else None
        if start is None:
            gen = torch.Generator(device=residual.device).manual_seed(zlib.crc32(name.encode()))
            start = torch.randn(n, q, generator=gen, device=residual.device, dtype=residual.dtype)
        return power_iteration(LocalGradient(dense=residual), start, self.iterations)


def residual_numbers(shape: Tuple[int, int], q: Optional[int] = None) -> int:
    """Numbers one residual of ``shape`` holds, whole (``q`` None) or at rank ``q`` as
    `LowRankErrorFeedback.pack` keeps it (the residual itself where ``q >= min(m, n)``)."""
    m, n = shape
    if q is None or min(q, m, n) == min(m, n):
        return m * n
    return q * (m + n)


def residual_bytes(shapes, q: Optional[int] = None, itemsize: int = 4) -> int:
    """Bytes of one residual per weight of ``shapes`` (``(m, n)`` each; `residual_numbers`) at ``itemsize``."""
    return sum(residual_numbers(s, q) for s in shapes) * itemsize


def _size(nbytes: float) -> str:
    return f"{nbytes / 2 ** 20:,.1f} MiB" if nbytes >= 0.05 * 2 ** 20 else f"{nbytes / 2 ** 10:,.1f} KiB"


EVERY_RANK = "one whole m x n residual per rank-routed weight, on every rank"


def sharded_residual_note(config, shapes, world_size: int, itemsize: int, held=None,
                          where: str = EVERY_RANK) -> Optional[str]:
    """Under FSDP2 or ZeRO: what whole residuals cost beside the gradient shards they sit next to,
    and how to bound it; None where the config keeps none. ``shapes``: the weights rank routes may
    take; ``held``: those one rank holds residuals of at most (default: all); ``where``: where they
    live (`routes.layouts.RESIDUALS`); ``itemsize``: the residuals' own (the compute dtype's)."""
    if (config.rank is None or config.mode == "exact" or not config.error_feedback
            or config.error_feedback_rank is not None or not shapes):
        return None
    held = list(shapes if held is None else held)
    mine, shards = residual_bytes(held, itemsize=itemsize), residual_bytes(shapes, itemsize=itemsize) / world_size
    low = sum(min(16, m, n) * (m + n) if min(m, n) > 16 else m * n for m, n in held) * itemsize
    kind = {2: "16-bit", 4: "fp32", 8: "fp64"}.get(itemsize, f"{itemsize}-byte")
    bound = (f"'error_feedback_rank': 16 would keep {_size(low)} (part of its gain: docs/reference/config.md, "
             f"error_feedback_rank), " if low < mine else "")  # small weights: a rank-16 pair holds more
    return (f"error feedback ({kind}) keeps {where}: up to {_size(mine)} a rank ({len(held)} of {len(shapes)} "
            f"weights), {mine / shards:.1f}x a rank's gradient shards of these weights ({_size(shards)}); "
            f"{bound}'error_feedback': false none")


def error_feedback_for(config) -> ErrorFeedback:
    """The memory ``config`` asks for: dense, or rank ``error_feedback_rank``."""
    if config.error_feedback and config.error_feedback_rank is not None:
        return LowRankErrorFeedback(True, config.error_feedback_rank, config.power_iterations)
    return ErrorFeedback(config.error_feedback)
