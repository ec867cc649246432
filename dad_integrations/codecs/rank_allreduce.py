"""Rank-r approximation of the *average*, by a shared power iteration whose P and Q are all-reduced.

PowerSGD's algorithm (Vogels et al., 2019) in dAD's codec layout: `power_iteration` (the algorithm)
run by `rank.RankRoutes.shared_rounds` (warm start from the last all-reduced Q, the same on every
rank; error feedback keeps ``M_s - P^ (M_s^T P^)^T``, what this rank's own contribution lost);
bytes per layout: `routes.rank_allreduce`. Payloads of consecutive units share one all-reduce for P
and one for Q per round (bucketed by ``bucket_cap_mb``), as PowerSGD's DDP hook does per bucket.
`codecs.sharded_rank` runs the same under FSDP2 and ZeRO, `codecs.replicate_rank` on HSDP's
replicate hop.
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple, Union

import torch

from dad_integrations.builtin_routes import RANK_ALLREDUCE
from dad_integrations.comm.aggregator import FactorAggregator
from dad_integrations.capture.rows import Rows, compute_dtype
from dad_integrations.codecs.low_rank import LocalGradient
from dad_integrations.codecs.power_iteration import Note
from dad_integrations.report import ParamReport
from dad_integrations.capture.units import FactorUnit
from dad_integrations.codecs.rank import LocalGrad, RankItem, RankRoutes

Item = Tuple[FactorUnit, LocalGradient, torch.Tensor, ParamReport]  # unit, M_s, Q, report entry
Queued = Tuple[FactorUnit, LocalGradient, torch.Tensor, ParamReport, torch.Tensor]  # ... and M_s Q


class RankAllReduceCodec(RankRoutes):
    """Encode ``M_s Q``; after the P all-reduce, ``M_s^T P``; decode ``scale * P Q^T``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._owned: set = set()  # unit names whose M_s is this codec's own copy (grad + residual)

    def local(self, unit: FactorUnit, rows: Sequence[Rows], local_grad: LocalGrad, entry: ParamReport, *,
              dense: bool = False) -> LocalGradient:
        """This rank's ``M_s`` (`RankRoutes.item`)."""
        it = self.item(unit, rows, local_grad, RANK_ALLREDUCE, dense)
        entry.method, entry.components = it.method, it.rank
        (self._owned.add if it.owned else self._owned.discard)(unit.name)
        return it.local

    def queue_item(self, unit: FactorUnit, rows: Sequence[Rows], local_grad: LocalGrad, entry: ParamReport,
                   step: int, *, dense: bool = False) -> Item:
        """The unit's place in a shared bucket: its ``M_s`` (`local`) and warm-start Q (`WarmStart.initial`)."""
        m_s = self.local(unit, rows, local_grad, entry, dense=dense)
        m, n = unit.shape
        q = self.shared.initial(unit, n, min(self.config.rank, m, n), compute_dtype(unit.param), step)
        return unit, m_s, q, entry

    def start(self, items: Sequence[Union[Item, Queued]], aggregator: FactorAggregator,
              note: Note) -> Callable[[float], List[Tuple[torch.Tensor, torch.Tensor]]]:
        """All-reduce the P's of ``items`` (those from `AllReduceBucket` bring their ``M_s Q``);
        the returned finish does the remaining rounds (Q, and P and Q again per further power
        iteration) and returns each unit's ``(left, right)``, ``left @ right = scale P Q^T``."""
        done = [it[4] if len(it) > 4 else None for it in items]
        items = [it[:4] for it in items]
        rounds = self.shared_rounds([RankItem(u, RANK_ALLREDUCE, m_s, e.method, q.shape[1], u.name in self._owned)
                                     for u, m_s, q, e in items], self.shared, 0, "dad.powersgd",
                                    qs=[q for _, _, q, _ in items], done=done, sites=aggregator, note=note,
                                    wire=self.wire_dtype or items[0][0].param.dtype)

        def finish(scale: float) -> List[Tuple[torch.Tensor, torch.Tensor]]:
            out = []
            for (unit, _, _, entry), basis, q_all, traffic in zip(items, *rounds()):
                entry.add_traffic(traffic)
                out.append((basis * scale, q_all.t()))
                self._owned.discard(unit.name)
            return out

        return finish


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

    def ready_to_send(self) -> bool:
        return bool(self.items) and self._bytes >= self.cap_bytes

    def take(self) -> List[Queued]:
        items, self.items, self._bytes = self.items, [], 0
        return items
