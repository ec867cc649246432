"""Rank-r factors, all-gathered (rank-dAD): each rank sends ``P_s, Q_s`` with ``G_s ~= P_s Q_s^T``.

Every rank reduces its own local gradient to rank r (`low_rank.reduce_rank`: power iteration on
the factors or on the dense gradient, or an exact truncated SVD when rows are few), sends
``[P_s^T | Q_s^T]`` (r x (m+n)), and rebuilds ``G ~= scale * [P_1 .. P_S][Q_1 .. Q_S]^T``, a
rank ``S r`` matrix, with one ``S r m n`` matmul. Bytes per rank: ``(S-1) r (m+n)``; the biases
go through the dense buckets.

Warm start (as PowerSGD): each step's power iteration starts from the previous step's Q, so one
iteration suffices once training settles. Error feedback: the local residual is added to the next
step's gradient; the reduction then runs on the dense compensated gradient. Both are the
synchroniser's `route_state.RouteState`.

Non-finite gradients: a rank whose local gradient holds NaN or Inf sends a non-finite payload, so
every rank rebuilds a non-finite gradient, as all-reduce gives: the power iteration spreads the NaN
into P and Q by itself (no pass over the gradient to check it); where the reduction could raise on
that rank alone (the exact SVD) or would drop components (adaptive tolerance), the input is checked
and r rows of NaN go instead. New warm starts and residuals are held back until the step is over
(`RouteState.end_step`): a step with any non-finite gradient (one a loss scaler will skip) keeps
those of the step before, on every rank alike, so the next finite step trains as if it had not
happened.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from dad_integrations.config import DADConfig
from dad_integrations.capture.rows import Rows, compute_dtype
from dad_integrations.codecs.low_rank import LocalGradient, choose_method, reduce_rank
from dad_integrations.report import ParamReport
from dad_integrations.capture.units import FactorUnit
from dad_integrations.codecs.finite import finite_flag
from dad_integrations.codecs.route_state import RouteState


class RankCodec:
    """Encode a unit's local gradient as ``[P^T | Q^T]``; decode every rank's into a rank-S·r product."""

    def __init__(self, config: DADConfig, wire_dtype: Optional[torch.dtype], state: RouteState):
        self.config = config
        self.wire_dtype = wire_dtype
        self.state = state  # residuals and this route's warm starts (each rank's own Q_s)
        self.memory, self.warm = state.memory, state.own

    def encode(self, unit: FactorUnit, rows: Sequence[Rows], local_grad: Callable[[nn.Parameter, torch.dtype], torch.Tensor],
               entry: ParamReport, step: int, *, dense: bool = False) -> torch.Tensor:
        """This rank's payload (``r`` rows of ``m + n``; fewer with adaptive tolerance); ``dense``:
        from ``local_grad`` whatever the rows (a node's sum, `exchange.two_level`)."""
        cfg, p = self.config, unit.param
        m, n = unit.shape
        r = min(cfg.rank, m, n)
        cdt = compute_dtype(p)
        n_rows = sum(int(left.shape[0]) for left, _ in rows)
        method = "dense" if dense or self.memory.enabled or unit.rows_unused else choose_method(
            n_rows, m, n, r, cfg.power_iterations, factors_available=unit.factors_only)
        owned = False
        if method == "dense":
            local = local_grad(p, cdt)
            grad = LocalGradient(dense=self.memory.compensate(unit.name, local))
            owned = grad.dense is not local
        else:
            grad = LocalGradient(left=_cat([left.to(cdt) for left, _ in rows]),
                                 right=_cat([right.to(cdt) for _, right in rows]))
        entry.method = method
        wire = self.wire_dtype or p.dtype
        if not _reduction_is_safe(grad, method, cfg.adaptive_tolerance):
            entry.components = r
            return torch.full((r, m + n), float("nan"), dtype=wire, device=p.device)
        low = reduce_rank(grad, r, method=method, q_init=self.warm.initial(unit, n, r, cdt, step),
                          iterations=cfg.power_iterations, tolerance=cfg.adaptive_tolerance)
        # the residual now, not at the step's end: without a residual yet, the compensated gradient is the
        # local gradient itself, which may be .grad, and the decode overwrites .grad with the average
        self.state.hold(self.warm, unit, low.warm, self.state.residual(unit.name, grad.dense, low.p, low.q, owned))
        pq, qq = low.p, low.q
        if cfg.adaptive_tolerance is None and low.components < r:  # fixed sizes: no size exchange
            pq = torch.nn.functional.pad(pq, (0, r - low.components))
            qq = torch.nn.functional.pad(qq, (0, r - low.components))
        entry.components = low.components
        return torch.cat([pq.t(), qq.t()], dim=1).to(wire)

    @staticmethod
    def decode(unit: FactorUnit, factors: torch.Tensor, scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(left, right)`` with ``left @ right = scale * sum_s P_s Q_s^T``, from every rank's
        ``[P^T | Q^T]`` rows, stacked."""
        p = unit.param
        m = unit.shape[0]
        factors = factors.to(compute_dtype(p))
        # the scale goes on the (S r x m) block, not on the m x n result: one pass fewer
        return (factors[:, :m] * scale).t(), factors[:, m:]


class RankBucket:
    """Rank-r payloads of consecutive units, waiting to share one all-gather.

    Every rank sends exactly r rows per unit (without adaptive tolerance), so the ranks agree on
    the bucket's size and contents without any exchange. A bucket goes when it reaches
    ``cap_bytes`` (the config's ``bucket_cap_mb``), when a payload of another dtype follows it,
    or when the step's last unit is done. Fewer collectives matter: each costs a round trip and,
    on CPUs, a wake-up of the exchange thread on every rank. With the default cap the payloads of
    a model usually fit one bucket, which then goes when backward is over.
    """

    def __init__(self, cap_bytes: float):
        self.cap_bytes = cap_bytes
        self.items: List[Tuple[FactorUnit, torch.Tensor, ParamReport]] = []

    def add(self, unit: FactorUnit, payload: torch.Tensor, entry: ParamReport) -> None:
        self.items.append((unit, payload, entry))

    def ready_to_send(self) -> bool:
        """A full run of same-dtype payloads waits at the front (more may follow it)."""
        run = self._front_run()
        return run < len(self.items) or sum(p.numel() * p.element_size() for _, p, _ in self.items) >= self.cap_bytes

    def take(self) -> List[Tuple[FactorUnit, torch.Tensor, ParamReport]]:
        """The front run of payloads that share a dtype."""
        run = self._front_run()
        items, self.items = self.items[:run], self.items[run:]
        return items

    def _front_run(self) -> int:
        dtype = self.items[0][1].dtype if self.items else None
        return next((i for i, (_, p, _) in enumerate(self.items) if p.dtype != dtype), len(self.items))


def _reduction_is_safe(grad: LocalGradient, method: str, tolerance: Optional[float]) -> bool:
    """May this rank reduce ``grad`` and send the result, finite or not?

    A power iteration spreads a NaN or Inf of the gradient into P and Q by itself, and
    `low_rank.reduce_rank` then keeps all r components, so every rank rebuilds a non-finite result
    without a check (one pass and, on a GPU, one host sync per weight fewer). The exact SVD may raise
    on non-finite input, on this rank alone, and an adaptive tolerance would send no component for
    a NaN energy: those check the input first (the SVD's factor rows are few)."""
    if method != "svd" and tolerance is None:
        return True
    tensors = (grad.dense,) if grad.dense is not None else (grad.left, grad.right)
    return all(bool(finite_flag(t)) for t in tensors)


def _cat(tensors: List[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` without the copy when there is one tensor (a weight with one use)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
