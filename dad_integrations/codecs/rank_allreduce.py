"""Rank-r approximation of the *average*, by a shared power iteration whose P and Q are all-reduced.

PowerSGD's algorithm (Vogels et al., 2019) in dAD's codec layout. With ``M_s`` the (error-
compensated) local gradient of rank s and ``Q`` (n x r) the same on every rank (warm-started from
the last step's, which every rank holds alike):

    P = sum_s M_s Q            (all-reduce, m x r)      P <- orthonormal basis of P
    Q = sum_s M_s^T P          (all-reduce, n x r)      G ~= scale * P Q^T

``power_iterations`` k repeats both rounds k times, each from the last round's all-reduced Q
(subspace iteration on the average: its error falls towards the truncated SVD's). Bytes per rank
and weight: ``k 2 (S-1)/S r (m+n)``, flat in the number of sites S, where
rank-dAD's all-gather (`codecs.rank`) moves ``(S-1) r (m+n)``; the rebuild has rank r (of the
average), not S r. Where rows are few and there is no residual, ``M_s Q = D^T (X Q)`` and
``M_s^T P = X^T (D P)`` are computed from the factors (``N r (m+n)`` instead of ``m n r``).

Error feedback keeps ``M_s - P (P^T M_s)``, what this rank's own contribution lost; warm start keeps
the all-reduced Q. Both are kept at the end of the step, and only if the step was finite
(`route_state.RouteState`). Payloads of consecutive units share one all-reduce for P and one for Q
per round (bucketed by ``bucket_cap_mb``), as PowerSGD's DDP hook does per bucket; their P's of one
shape go through one batched QR. The residual is computed while the last Q all-reduce is on the
wire, in place in the compensated gradient where that is this codec's own copy.

`power_iteration.PowerIteration` runs the rounds (over the sites' group); `codecs.sharded_rank`
runs the same under FSDP2 and ZeRO, `codecs.replicate_rank` on HSDP's replicate hop.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from dad_integrations.comm.aggregator import FactorAggregator
from dad_integrations.config import DADConfig
from dad_integrations.capture.rows import Rows, compute_dtype
from dad_integrations.codecs.low_rank import LocalGradient, method_costs
from dad_integrations.codecs.power_iteration import Note, PowerIteration
from dad_integrations.report import ParamReport
from dad_integrations.capture.sink import GradSink
from dad_integrations.capture.units import FactorUnit
from dad_integrations.codecs.rank import _cat
from dad_integrations.codecs.route_state import RouteState

Item = Tuple[FactorUnit, LocalGradient, torch.Tensor, ParamReport]  # unit, M_s, Q, report entry
Queued = Tuple[FactorUnit, LocalGradient, torch.Tensor, ParamReport, torch.Tensor]  # ... and M_s Q


class RankAllReduceCodec:
    """Encode ``M_s Q``; after the P all-reduce, ``M_s^T P``; decode ``scale * P Q^T``."""

    def __init__(self, config: DADConfig, wire_dtype: Optional[torch.dtype], state: RouteState):
        self.config = config
        self.wire_dtype = wire_dtype
        self.state = state
        # residuals, and the last all-reduced Q (the same on every rank; without warm start a fresh Q
        # drawn from a seed every rank shares)
        self.memory, self.warm = state.memory, state.shared
        self._owned: set = set()  # unit names whose M_s is this codec's own copy (grad + residual)

    def local(self, unit: FactorUnit, rows: Sequence[Rows],
              local_grad: Callable[[nn.Parameter, torch.dtype], torch.Tensor], entry: ParamReport, *,
              dense: bool = False) -> LocalGradient:
        """This rank's ``M_s``: from the factors where that is cheaper and nothing is added to them;
        ``dense``: from ``local_grad`` whatever the rows (a node's sum, `exchange.two_level`)."""
        p = unit.param
        m, n = unit.shape
        r = min(self.config.rank, m, n)
        cdt = compute_dtype(p)
        n_rows = sum(int(left.shape[0]) for left, _ in rows)
        use_factors = not dense and not self.memory.enabled and not unit.rows_unused and unit.factors_only
        if use_factors:
            costs = method_costs(n_rows, m, n, r, 2, factors_available=True)
            use_factors = costs["factors"] < costs["dense"]
        entry.method = "factors" if use_factors else "dense"
        entry.components = r
        if use_factors:
            return LocalGradient(left=_cat([left.to(cdt) for left, _ in rows]),
                                 right=_cat([right.to(cdt) for _, right in rows]))
        grad = local_grad(p, cdt)
        compensated = self.memory.compensate(unit.name, grad)
        (self._owned.add if compensated is not grad else self._owned.discard)(unit.name)
        return LocalGradient(dense=compensated)

    def start(self, items: Sequence[Union[Item, Queued]], aggregator: FactorAggregator, sink: GradSink,
              scale: float, note: Note) -> Callable[[], None]:
        """All-reduce the P's of ``items`` (those from `AllReduceBucket` bring their ``M_s Q``);
        the returned finish does the remaining rounds (Q, and P and Q again per further power
        iteration) and writes the results."""
        done = [it[4] if len(it) > 4 else None for it in items]
        items = [it[:4] for it in items]
        wire = self.wire_dtype or items[0][0].param.dtype
        rounds = PowerIteration([m_s for _, m_s, _, _ in items], [compute_dtype(u.param) for u, _, _, _ in items],
                                [q.shape[1] for _, _, q, _ in items], self.config.power_iterations,
                                sites=aggregator, wire=wire, name=f"dad.powersgd.{items[0][0].name}", note=note)
        rounds.start([q for _, _, q, _ in items], done)
        residuals: list = [None] * len(items)

        def residual(bases: List[torch.Tensor], q_locals: List[torch.Tensor]) -> None:
            """``M_s - P^ (M_s^T P^)^T``, what this rank's own contribution loses (while Q travels)."""
            for i, ((unit, m_s, _, _), basis, q_local) in enumerate(zip(items, bases, q_locals)):
                if m_s.dense is None:
                    continue
                residuals[i] = self.state.residual(unit.name, m_s.dense, basis, q_local, unit.name in self._owned)

        def finish() -> None:
            bases, _, q_alls = rounds.finish(residual)
            for (unit, _, _, entry), basis, q_all, res, traffic in zip(items, bases, q_alls, residuals,
                                                                       rounds.traffic):
                entry.add_traffic(traffic)
                sink.write_product(unit.param, basis * scale, q_all.t())
                self._owned.discard(unit.name)
                self.state.hold(self.warm, unit, q_all, res)

        return finish

    def initial_q(self, unit: FactorUnit, step: int) -> torch.Tensor:
        m, n = unit.shape
        return self.warm.initial(unit, n, min(self.config.rank, m, n), compute_dtype(unit.param), step)


class AllReduceBucket:
    """Consecutive units of this route, waiting to share one P and one Q all-reduce per round.

    Each unit's first product ``M_s Q`` is computed as it joins: while backward still runs,
    not after the bucket's last unit, when the step waits for the all-reduce (the same product
    and bits, `PowerIteration.start`)."""

    def __init__(self, cap_bytes: float):
        self.cap_bytes = cap_bytes
        self.items: List[Queued] = []
        self._bytes = 0

    def add(self, item: Item) -> None:
        unit, m_s, q, _ = item
        m, n = unit.shape
        self.items.append(tuple(item) + (m_s.mm(q),))
        self._bytes += q.shape[1] * (m + n) * unit.param.element_size()

    def full(self) -> bool:
        return self._bytes >= self.cap_bytes

    def take(self) -> List[Queued]:
        items, self.items, self._bytes = self.items, [], 0
        return items
