"""Rank-r approximation of the *average*, by a shared power iteration whose P and Q are all-reduced.

PowerSGD's algorithm (Vogels et al., 2019) in dAD's codec layout. With ``M_s`` the (error-
compensated) local gradient of rank s and ``Q`` (n x r) the same on every rank (warm-started from
the last step's, which every rank holds alike):

    P = sum_s M_s Q            (all-reduce, m x r)      P <- orthonormal basis of P
    Q = sum_s M_s^T P          (all-reduce, n x r)      G ~= scale * P Q^T

Bytes per rank and weight: ``2 (S-1)/S r (m+n)``, flat in the number of sites S, where rank-dAD's
all-gather (`codecs.rank`) moves ``(S-1) r (m+n)``; the rebuild has rank r (of the average), not
S r. Where rows are few and there is no residual, ``M_s Q = D^T (X Q)`` and ``M_s^T P = X^T (D P)``
are computed from the factors (``N r (m+n)`` instead of ``m n r``).

Error feedback keeps ``M_s - P (P^T M_s)``, what this rank's own contribution lost; warm start keeps
the all-reduced Q. Both are committed at the end of the step, and only if the step was finite
(`RankCodec.commit`'s rule). Payloads of consecutive units share one all-reduce for P and one for Q
(bucketed by ``bucket_cap_mb``), as PowerSGD's DDP hook does per bucket.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..aggregator import FactorAggregator, Traffic
from ..config import DADConfig
from ..error_feedback import ErrorFeedback
from ..layers import Rows, compute_dtype
from ..low_rank import LocalGradient, method_costs, orthonormalize
from ..report import ParamReport
from ..sink import GradSink
from ..units import FactorUnit
from .rank import WarmStart, _cat

Item = Tuple[FactorUnit, LocalGradient, torch.Tensor, ParamReport]  # unit, M_s, Q, report entry


class RankAllReduceCodec:
    """Encode ``M_s Q``; after the P all-reduce, ``M_s^T P``; decode ``scale * P Q^T``."""

    def __init__(self, config: DADConfig, wire_dtype: Optional[torch.dtype], memory: ErrorFeedback):
        self.config = config
        self.wire_dtype = wire_dtype
        self.memory = memory
        # the last all-reduced Q (the same on every rank); without warm start a fresh Q drawn from a
        # seed every rank shares
        self.warm = WarmStart(config.warm_start)
        self._pending: list = []

    def local(self, unit: FactorUnit, rows: Sequence[Rows],
              local_grad: Callable[[nn.Parameter, torch.dtype], torch.Tensor], entry: ParamReport) -> LocalGradient:
        """This rank's ``M_s``: from the factors where that is cheaper and nothing is added to them."""
        p = unit.param
        m, n = p.shape
        r = min(self.config.rank, m, n)
        cdt = compute_dtype(p)
        n_rows = sum(int(left.shape[0]) for left, _ in rows)
        use_factors = (not self.memory.enabled and not unit.rows_unused and unit.factors_only)
        if use_factors:
            costs = method_costs(n_rows, m, n, r, 2, factors_available=True)
            use_factors = costs["factors"] < costs["dense"]
        entry.method = "factors" if use_factors else "dense"
        entry.components = r
        if use_factors:
            return LocalGradient(left=_cat([left.to(cdt) for left, _ in rows]),
                                 right=_cat([right.to(cdt) for _, right in rows]))
        return LocalGradient(dense=self.memory.compensate(unit.name, local_grad(p, cdt)))

    def start(self, items: List[Item], aggregator: FactorAggregator, sink: GradSink, scale: float,
              note: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        """All-reduce the P's of ``items``; the returned finish does the Q round and writes results."""
        wire = self.wire_dtype or items[0][0].param.dtype
        ps = [m_s.mm(q) for _, m_s, q, _ in items]
        flat = torch.cat([p.reshape(-1) for p in ps]).to(wire)
        p_handle = aggregator.all_reduce(flat, name=f"dad.powersgd.p.{items[0][0].name}", op="sum")
        _share(items, ps, p_handle.traffic)

        def finish() -> None:
            p_sum = note(p_handle.wait())
            bases, q_locals = [], []
            offset = 0
            for (unit, m_s, _, _), p in zip(items, ps):
                k = p.numel()
                basis = orthonormalize(p_sum[offset:offset + k].view(p.shape).to(p.dtype))
                offset += k
                bases.append(basis)
                q_locals.append(m_s.rmm(basis))
            q_flat = torch.cat([q.reshape(-1) for q in q_locals]).to(wire)
            q_handle = aggregator.all_reduce(q_flat, name=f"dad.powersgd.q.{items[0][0].name}", op="sum")
            _share(items, q_locals, q_handle.traffic)
            q_sum = note(q_handle.wait())
            offset = 0
            for (unit, m_s, _, _), basis, q_local in zip(items, bases, q_locals):
                k = q_local.numel()
                q_all = q_sum[offset:offset + k].view(q_local.shape).to(q_local.dtype)
                offset += k
                sink.write_product(unit.param, basis * scale, q_all.t())
                self._pending.append((unit, q_all, m_s, basis, q_local))

        return finish

    def initial_q(self, unit: FactorUnit, step: int) -> torch.Tensor:
        m, n = unit.param.shape
        return self.warm.initial(unit, n, min(self.config.rank, m, n), compute_dtype(unit.param), step)

    def commit(self, keep: bool) -> None:
        """End of step: keep the shared Q's and the residuals, or (a non-finite step) drop them."""
        pending, self._pending = self._pending, []
        if not keep:
            return
        for unit, q_all, m_s, basis, q_local in pending:
            self.warm.update(unit, q_all)
            if self.memory.enabled and m_s.dense is not None:
                self.memory.update(unit.name, m_s.dense, basis @ q_local.t())


class AllReduceBucket:
    """Consecutive units of this route, waiting to share one P and one Q all-reduce."""

    def __init__(self, cap_bytes: float):
        self.cap_bytes = cap_bytes
        self.items: List[Item] = []
        self._bytes = 0

    def add(self, item: Item) -> None:
        unit = item[0]
        m, n = unit.param.shape
        self.items.append(item)
        self._bytes += item[2].shape[1] * (m + n) * unit.param.element_size()

    def full(self) -> bool:
        return self._bytes >= self.cap_bytes

    def take(self) -> List[Item]:
        items, self.items, self._bytes = self.items, [], 0
        return items


def _share(items: List[Item], parts: List[torch.Tensor], traffic: Traffic) -> None:
    """Each unit's part of one collective's bytes."""
    total = sum(p.numel() for p in parts)
    for (_, _, _, entry), p in zip(items, parts):
        entry.add_traffic(traffic.share(p.numel() / total))
