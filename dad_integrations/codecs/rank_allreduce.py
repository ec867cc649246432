"""Rank-r approximation of the *average*, by a shared power iteration whose P and Q are all-reduced.

PowerSGD's algorithm (Vogels et al., 2019) in dAD's codec layout. With ``M_s`` the (error-
compensated) local gradient of rank s and ``Q`` (n x r) the same on every rank (warm-started from
the last step's, which every rank holds alike):

    P = sum_s M_s Q            (all-reduce, m x r)      P <- orthonormal basis of P
    Q = sum_s M_s^T P          (all-reduce, n x r)      G ~= scale * P Q^T

``power_iterations`` k repeats both rounds k times, each from the last round's all-reduced Q
(subspace iteration on the average: its error falls towards the truncated SVD's). Bytes per rank
and weight: ``k 2 (S-1)/S r (m+n)`` (`rank_allreduce_rounds`), flat in the number of sites S, where
rank-dAD's all-gather (`codecs.rank`) moves ``(S-1) r (m+n)``; the rebuild has rank r (of the
average), not S r. Where rows are few and there is no residual, ``M_s Q = D^T (X Q)`` and
``M_s^T P = X^T (D P)`` are computed from the factors (``N r (m+n)`` instead of ``m n r``).

Error feedback keeps ``M_s - P (P^T M_s)``, what this rank's own contribution lost; warm start keeps
the all-reduced Q. Both are kept at the end of the step, and only if the step was finite
(`route_state.RouteState`). Payloads of consecutive units share one all-reduce for P and one for Q
per round (bucketed by ``bucket_cap_mb``), as PowerSGD's DDP hook does per bucket; their P's of one
shape go through one batched QR. The residual is computed while the last Q all-reduce is on the
wire, in place in the compensated gradient where that is this codec's own copy.

`SharedPowerIteration` holds the rounds; `codecs.sharded_rank` runs the same under FSDP2 and ZeRO.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from dad_integrations.comm.aggregator import CommHandle, FactorAggregator, Traffic
from dad_integrations.config import DADConfig
from dad_integrations.capture.rows import Rows, compute_dtype
from dad_integrations.codecs.low_rank import LocalGradient, method_costs, orthonormalize_flat
from dad_integrations.report import ParamReport
from dad_integrations.capture.sink import GradSink
from dad_integrations.capture.units import FactorUnit
from dad_integrations.codecs.rank import _cat
from dad_integrations.codecs.route_state import RouteState

Item = Tuple[FactorUnit, LocalGradient, torch.Tensor, ParamReport]  # unit, M_s, Q, report entry
Queued = Tuple[FactorUnit, LocalGradient, torch.Tensor, ParamReport, torch.Tensor]  # ... and M_s Q
Note = Callable[[torch.Tensor], torch.Tensor]


def rank_allreduce_rounds(config: DADConfig) -> int:
    """All-reduce rounds per step of PowerSGD's route, unsharded, FSDP2 and ZeRO alike: one of P
    (m x r) and one of Q (n x r) per power iteration. Bytes per rank and weight:
    ``rounds * 2 (S-1)/S * r (m+n) * wire itemsize`` (biases go through the dense buckets)."""
    return config.power_iterations


class SharedPowerIteration:
    """PowerSGD's rounds for several weights at once, each round one all-reduce of their P's and
    one of their Q's: ``P = sum_s M_s Q``, ``P^ = orth(P)``, ``Q = sum_s M_s^T P^``.

    Buffers: the P's are written straight into one flat buffer (``(m, r)`` row-major blocks) and
    the Q's into another (``(r, n)`` blocks, ``Q^T``): the products need no concatenation, and the
    all-reduced Q's come out column-major, the layout the next ``M Q`` reads fastest.
    """

    def __init__(self, grads: Sequence[LocalGradient], dtypes: Sequence[torch.dtype], rank: Sequence[int],
                 aggregator: FactorAggregator, wire: torch.dtype, name: str, rounds: int, note: Note):
        self.grads, self.dtypes, self.rank = list(grads), list(dtypes), list(rank)
        self.aggregator, self.wire, self.name, self.rounds, self.note = aggregator, wire, name, rounds, note
        self.traffic = [Traffic() for _ in self.grads]  # each weight's share of every round
        self._p: Optional[CommHandle] = None

    def start(self, qs: Sequence[torch.Tensor], ps: Optional[Sequence[Optional[torch.Tensor]]] = None) -> None:
        """The first round's P all-reduce, from ``qs`` (n x r each, the same on every rank); ``ps``
        holds each weight's ``M_s Q`` where already computed (None: computed here)."""
        self._p = self._p_round(qs, ps)

    def finish(self, before_last_wait: Optional[Callable[[List[torch.Tensor], List[torch.Tensor]], None]] = None
               ) -> Tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]:
        """The remaining rounds; returns per weight ``P^`` (m x r), this rank's own ``M_s^T P^`` and
        the all-reduced Q (n x r each) of the last round. ``before_last_wait(bases, q_locals)``
        runs while the last Q all-reduce is on the wire."""
        for i in range(self.rounds):
            shapes = [(g.shape[0], r) for g, r in zip(self.grads, self.rank)]
            bases = orthonormalize_flat(self.note(self._p.wait()), shapes, self.dtypes)
            q_flat, q_locals = self._products([(r, g.shape[1]) for g, r in zip(self.grads, self.rank)],
                                              [lambda out, g=g, b=b: g.rmm_t(b, out=out)
                                               for g, b in zip(self.grads, bases)])
            # the all-reduce sums in place: the send buffer must not be this rank's own Q's
            q_handle = self._all_reduce(q_flat.to(self.wire, copy=True), "q", [q.numel() for q in q_locals])
            q_locals = [q.t() for q in q_locals]
            if i + 1 == self.rounds and before_last_wait is not None:
                before_last_wait(bases, q_locals)
            q_sum, q_alls, offset = self.note(q_handle.wait()), [], 0
            for q, dtype in zip(q_locals, self.dtypes):
                q_alls.append(q_sum[offset:offset + q.numel()].view(q.shape[1], q.shape[0]).to(dtype).t())
                offset += q.numel()
            if i + 1 < self.rounds:
                self._p = self._p_round(q_alls)
        return bases, q_locals, q_alls

    def _p_round(self, qs: Sequence[torch.Tensor], done: Optional[Sequence[Optional[torch.Tensor]]] = None
                 ) -> CommHandle:
        done = done or [None] * len(qs)
        flat, ps = self._products([(g.shape[0], r) for g, r in zip(self.grads, self.rank)],
                                  [(lambda out, g=g, q=q: g.mm(q, out=out)) if p is None else (lambda out, p=p: p)
                                   for g, q, p in zip(self.grads, qs, done)])
        return self._all_reduce(flat.to(self.wire), "p", [p.numel() for p in ps])

    def _products(self, shapes: Sequence[Tuple[int, int]], products: Sequence[Callable]
                  ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """One flat buffer (the first weight's dtype) holding every ``product(out)``, and each
        product in its weight's dtype (a view of the buffer where that is the buffer's)."""
        device = self.grads[0].device
        flat = torch.empty(sum(a * b for a, b in shapes), dtype=self.dtypes[0], device=device)
        views, offset = [], 0
        for (a, b), product, dtype in zip(shapes, products, self.dtypes):
            view = flat[offset:offset + a * b].view(a, b)
            result = product(view) if dtype == flat.dtype else product(None)
            if result is not view:  # computed before, or of another compute dtype than the buffer's
                view.copy_(result)
            views.append(result)
            offset += a * b
        return flat, views

    def _all_reduce(self, flat: torch.Tensor, kind: str, sizes: List[int]) -> CommHandle:
        handle = self.aggregator.all_reduce(flat, name=f"{self.name}.{kind}", op="sum")
        total = sum(sizes)
        for i, k in enumerate(sizes):
            self.traffic[i] = self.traffic[i] + handle.traffic.share(k / total)
        return handle


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
        rounds = SharedPowerIteration([m_s for _, m_s, _, _ in items],
                                      [compute_dtype(u.param) for u, _, _, _ in items],
                                      [q.shape[1] for _, _, q, _ in items], aggregator, wire,
                                      f"dad.powersgd.{items[0][0].name}", rank_allreduce_rounds(self.config), note)
        rounds.start([q for _, _, q, _ in items], done)
        residuals: list = [None] * len(items)

        def residual(bases: List[torch.Tensor], q_locals: List[torch.Tensor]) -> None:
            """``M_s - P^ (M_s^T P^)^T``, what this rank's own contribution loses (while Q travels)."""
            if not self.memory.enabled:
                return
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
    and bits, `SharedPowerIteration.start`)."""

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
