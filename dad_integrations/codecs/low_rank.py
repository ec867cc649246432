"""Rank-r reduction of one site's local gradient, for rank-dAD.

The local gradient ``M`` (m x n) of a weight is known as factors ``M = L^T R`` (``N`` captured rows)
or densely (`power_iteration.LocalGradient`). Three ways to get ``M ~= P Q^T`` with r components,
chosen per call by flop count (`method_costs`): ``"factors"``, the power iteration on the factors
(never forming M: best when N is small); ``"dense"``, the same on the dense gradient (best when N
is large, and the only choice for embeddings); ``"svd"``, the exact truncated SVD through thin QRs
of ``L^T`` and ``R^T`` (best when N is tiny). The iteration (`power_iteration`, the one the shared
routes run) warm-starts from the previous step's Q, as in PowerSGD; unlike the paper authors' code
it returns exactly r components (fewer only where the gradient's rank is lower).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from dad_integrations.codecs.power_iteration import HALF, LocalGradient, power_iteration, qr


@dataclass
class LowRank:
    """``M ~= p @ q.T``; ``components`` counts the nonzero columns; ``method`` says how;
    ``warm`` (n x r) seeds the next step's power iteration."""

    p: torch.Tensor
    q: torch.Tensor
    components: int
    method: str
    warm: Optional[torch.Tensor]


def svd(a: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD ``a = U diag(S) Vh``, for any float dtype (fp16/bf16 in fp32, as `power_iteration.qr`)."""
    if a.dtype in HALF:
        return tuple(t.to(a.dtype) for t in torch.linalg.svd(a.float(), full_matrices=False))
    return torch.linalg.svd(a, full_matrices=False)


def truncated_svd(left: torch.Tensor, right: torch.Tensor, rank: int) -> tuple:
    """Best rank-``rank`` approximation of ``left^T right`` as ``(p, q)``, via thin QRs.

    ``left^T = A_L B_L`` and ``right^T = A_R B_R`` give ``M = A_L (B_L B_R^T) A_R^T``; the SVD of
    the small core ``B_L B_R^T`` is the SVD of M, rotated.
    """
    a_l, b_l = qr(left.t())
    a_r, b_r = qr(right.t())
    u, s, vh = svd(b_l @ b_r.t())
    r = min(rank, s.shape[0])
    return a_l @ (u[:, :r] * s[:r]), a_r @ vh[:r].t()


def method_costs(rows: int, m: int, n: int, rank: int, iterations: int, *,
                 factors_available: bool) -> dict:
    """Estimated flops of each available method (the dense gradient is always available)."""
    ortho = 2 * m * rank * rank
    costs = {"dense": iterations * (4 * m * n * rank + ortho)}
    if factors_available:
        k = min(rows, m, n)
        costs["factors"] = iterations * (4 * rows * rank * (m + n) + ortho)
        costs["svd"] = 2 * rows * rows * (m + n) + 2 * k * k * rows + 10 * k ** 3 + 2 * k * rank * (m + n)
    return costs


def choose_method(rows: int, m: int, n: int, rank: int, iterations: int, *,
                  factors_available: bool) -> str:
    """The cheapest method by flops; ties prefer the exact SVD."""
    costs = method_costs(rows, m, n, rank, iterations, factors_available=factors_available)
    order = {"svd": 0, "factors": 1, "dense": 2}
    return min(costs, key=lambda k: (costs[k], order[k]))


def reduce_rank(m: LocalGradient, rank: int, *, method: str, q_init: Optional[torch.Tensor],
                iterations: int, tolerance: Optional[float] = None) -> LowRank:
    """Rank-``rank`` factors of ``m`` by ``method`` (see `choose_method`).

    ``q_init`` (n x rank) seeds the power iteration (warm start). With ``tolerance``, keep the
    fewest components whose share of ``||M||_F^2`` reaches it. Components with no energy (the
    gradient's rank is lower than ``rank``) are dropped.
    """
    rows, cols = m.shape
    rank = min(rank, rows, cols)
    if method == "svd":
        p, q = truncated_svd(m.left, m.right, rank)
    elif method in ("factors", "dense") and rank == min(rows, cols):
        # full rank: M = M I^T (or I (M^T)^T), exactly; a power iteration from a warm start of lower rank
        # (last step's gradient spanned less) would miss the directions this step's gradient adds
        dense = m.dense if m.dense is not None else m.to_dense()
        eye = torch.eye(rank, dtype=dense.dtype, device=dense.device)
        p, q = (dense, eye) if cols <= rows else (eye, dense.t())
    elif method in ("factors", "dense"):
        if method == "dense" and m.dense is None:
            m = LocalGradient(dense=m.to_dense())
        p, q = power_iteration(m, q_init[:, :rank], iterations)
    else:
        raise ValueError(f"unknown rank-reduction method {method!r}")

    # one of p, q has orthonormal columns, so a component's energy is |p_i|^2 |q_i|^2
    energy = p.pow(2).sum(0) * q.pow(2).sum(0)
    # one host sync, on r numbers: every component counts (no sorting, no copies), or the gradient was
    # not finite and all of them go (NaN spread into p and q: every rank's rebuild turns non-finite)
    if tolerance is None and p.shape[1] == rank and bool(
            ((energy > energy.max() * 1e-12) | ~torch.isfinite(energy.sum())).all()):
        return LowRank(p, q, rank, method, q)
    order = torch.argsort(energy, descending=True)
    energy = energy[order]
    top = float(energy[0]) if energy.numel() else 0.0
    keep = int((energy > top * 1e-12).sum()) if top > 0 else 0
    if tolerance is not None and keep > 0:
        total = float(m.energy())
        if total > 0:
            share = torch.cumsum(energy[:keep], 0) / total
            keep = min(keep, int((share < tolerance).sum()) + 1)
    idx = order[:keep]
    warm = q if q.shape[1] == rank else q_init
    return LowRank(p[:, idx].contiguous(), q[:, idx].contiguous(), keep, method, warm)
