"""Sharded rank-r routes (rank-dAD and PowerSGD's all-reduce under FSDP2 and ZeRO): each rank
rebuilds only its own rows (or elements) of the rank-r average (bytes: `routes.rank`,
`routes.rank_allreduce`).

A weight ``m x n`` is sharded along dim 0 over S ranks: rank d keeps rows ``[a, b) = [d c, min((d+1) c,
m))``, ``c = ceil(m/S)`` (`exact.shard_span`). **All-gather route (rank-dAD).** Each site reduces its
own ``M_s ~= P_s Q_s^T`` (`rank.RankRoutes.reduce_own`) and sends ``(P_s^T, Q_s^T)``, r pseudo-rows of
one linear use, by the exact codec's row-shard exchange (`exact.encode_sliced`): every ``Q_s^T``
all-gathered, rank d's columns of every ``P_s^T`` by all-to-all, as ZeRO's partitions send them through
the exact codec (`exchange.partitions`); the sites' rows stacked, ``shard_d = scale * [P_1[a:b] ..
P_S[a:b]] [Q_1 .. Q_S]^T`` is one ``(c x S r) (S r x n)`` matmul (`exact.decode_sliced`), 1/S of the
unsharded one.

**All-reduce route (PowerSGD).** The flat route's rounds (`rank.RankRoutes.shared_rounds`), then
``shard_d = scale * P^[a:b] Q'^T``: only the rebuild shrinks. A reduce-scatter of P does not suffice:
the orthonormalisation mixes all rows of P, and ``M_s^T P^`` needs all of ``P^`` on site s, the only
one that holds ``M_s``.

**Error feedback** keeps one *unsharded* residual (m x n) per rank-routed weight and rank, S times
that weight's gradient shard (site s compresses its whole ``M_s``, which no other rank knows);
``error_feedback_rank: q`` keeps its rank-q part instead, as does a ``residual_budget`` whole
residuals exceed (`routing.memory`). **Non-finite steps**: as `codecs.rank`;
every rank sees only its shard, so the ranks agree on the step's finiteness from their local
gradients (`RouteState.note_local`). Embeddings, units without uses and units whose uses cover row
blocks are reduced from the dense local gradient, as its matrix view (`FactorUnit.shape`: FSDP2's
Shard(0) cuts its rows, ZeRO's flat partitions its row-major flattening).

The pure functions (`reduced_shard`, `reduced_elements`) hold the all-reduce route's algebra;
`ShardedRankCodec` runs the collectives, every rank calling it alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from dad_integrations.builtin_routes import RANK, RANK_ALLREDUCE
from dad_integrations.comm.aggregator import FactorAggregator, Traffic
from dad_integrations.capture.rows import Rows, compute_dtype
from dad_integrations.capture.units import FactorUnit
from dad_integrations.codecs.exact import covering_rows, decode_sliced, encode_sliced, shard_span
from dad_integrations.codecs.rank import LocalGrad, RankItem, RankRoutes

ROUTES = (RANK, RANK_ALLREDUCE)
SharedRebuild = Callable[["RankItem", torch.Tensor, torch.Tensor], torch.Tensor]  # (item, P^, Q') -> its part


def reduced_shard(basis: torch.Tensor, q: torch.Tensor, rank: int, world_size: int, scale: float) -> torch.Tensor:
    """Rows ``a:b`` of ``scale * basis @ q^T``, the all-reduce route's rebuild of rank's shard."""
    a, b, _ = shard_span(rank, world_size, basis.shape[0])
    return (basis[a:b] * scale) @ q.t()


def reduced_elements(basis: torch.Tensor, q: torch.Tensor, lo: int, hi: int, scale: float) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the flattened ``scale * basis @ q^T`` from its covering rows only (a
    ZeRO partition cuts a weight at any element)."""
    n = q.shape[0]
    if hi <= lo:
        return basis.new_zeros(0)
    first, last = covering_rows(lo, hi, n)
    return ((basis[first:last] * scale) @ q.t()).reshape(-1)[lo - first * n:hi - first * n]


@dataclass
class RankShard:
    """One unit's result: this rank's rows ``a:b`` of the scaled rank-r average, its bytes, and the
    components this rank sent (fewer only where its gradient's rank is lower; NaN rows count)."""

    shard: torch.Tensor
    traffic: Traffic
    components: int


class ShardedRankCodec(RankRoutes):
    """The two rank routes under sharding, with error feedback and warm starts from ``state``
    (module doc): `local` then `exchange` for the units that take a rank route, every rank alike."""

    def local(self, unit: FactorUnit, rows: Sequence[Rows], local_grad: LocalGrad, representation: str) -> RankItem:
        """``M_s`` for a rank route (`RankRoutes.item`)."""
        if representation not in ROUTES:
            raise ValueError(f"not a rank route: {representation!r}")
        return self.item(unit, rows, local_grad, representation)

    # -- the collectives --------------------------------------------------------------------------
    def exchange(self, items: Sequence[RankItem], aggregator: FactorAggregator, scale: float, step: int,
                 wire: torch.dtype, rebuild: Optional[SharedRebuild] = None) -> List[RankShard]:
        """Each item's shard (in ``items``' order). The all-gather route's units share one all-gather
        and one all-to-all, the all-reduce route's one all-reduce for P and one for Q; ``wire`` is
        the dtype on the wire where the config sets none (the reduce-scatter's). ``rebuild(item,
        P^, Q')`` gives an all-reduce-routed item's part of ``scale P^ Q'^T`` (default: this rank's
        row block, `reduced_shard`; ZeRO's partitions take `reduced_elements`)."""
        if not items:
            return []
        wire = self.wire_dtype or wire
        gather = [i for i, it in enumerate(items) if it.representation == RANK]
        shared = [i for i, it in enumerate(items) if it.representation == RANK_ALLREDUCE]
        out: Dict[int, RankShard] = {}
        finish = self._start_gather([items[i] for i in gather], aggregator, scale, step, wire) if gather else None
        if shared:  # its two rounds run while the all-gather route's collectives are in flight
            out.update(zip(shared, self._rank_allreduce([items[i] for i in shared], aggregator, scale, step, wire,
                                                        rebuild)))
        if finish is not None:
            out.update(zip(gather, finish()))
        return [out[i] for i in range(len(items))]

    def _start_gather(self, items: Sequence[RankItem], agg: FactorAggregator, scale: float, step: int,
                      wire: torch.dtype) -> Callable[[], List[RankShard]]:
        """All-gather every site's ``Q_s^T`` and all-to-all its ``P_s^T``'s columns (`exact.encode_sliced` of
        each item's pseudo-rows, the items side by side); the returned finish rebuilds each unit's shard."""
        S, rank = agg.world_size, agg.rank
        q_parts, p_parts, components = [], [], []
        for it in items:
            p, q, k = self.reduce_own(it, step)
            q_part, p_part = encode_sliced([(p.t(), q.t())], [[it.rank]] * S, it.unit.shape[0], S, wire)
            q_parts.append(q_part)
            p_parts.append(p_part.reshape(S, -1))
            components.append(k)
        flat_q, send = torch.cat(q_parts), torch.cat(p_parts, dim=1)
        name = f"dad.sharded.rank.{items[0].unit.name}"
        gather = agg.all_gather(flat_q, name=f"{name}.q", first_dims=[flat_q.numel()] * S)
        to_all = agg.all_to_all(send, name=f"{name}.p")

        def finish() -> List[RankShard]:
            qs, received = gather.wait(), to_all.wait()
            out, q0, p0 = [], 0, 0
            for it, q_part, p_part, k in zip(items, q_parts, p_parts, components):
                a, b, c = shard_span(rank, S, it.unit.shape[0])
                shard, _ = decode_sliced(("linear",), it.unit.shape, [g[q0:q0 + q_part.numel()] for g in qs],
                                         received[:, p0:p0 + p_part.shape[1]].reshape(S, it.rank, c),
                                         [[it.rank]] * S, rank, (), compute_dtype(it.unit.param), stacked=True)
                traffic = (gather.traffic.share(q_part.numel() / flat_q.numel())
                           + to_all.traffic.share(p_part.shape[1] / send.shape[1]))
                out.append(RankShard(shard[:b - a].mul_(scale), traffic, k))
                q0, p0 = q0 + q_part.numel(), p0 + p_part.shape[1]
            return out

        return finish

    def _rank_allreduce(self, items: Sequence[RankItem], agg: FactorAggregator, scale: float, step: int,
                        wire: torch.dtype, rebuild: Optional[SharedRebuild]) -> List[RankShard]:
        """PowerSGD's rounds for ``items`` over ``agg`` (`RankRoutes.shared_rounds`), then each part."""
        S, rank = agg.world_size, agg.rank
        if rebuild is None:
            def rebuild(it: RankItem, basis: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
                return reduced_shard(basis, q, rank, S, scale)
        bases, q_alls, traffic = self.shared_rounds(items, self.shared, step, "dad.sharded.powersgd", sites=agg,
                                                    wire=wire)()
        return [RankShard(rebuild(it, basis, q_all), t, it.rank)
                for it, basis, q_all, t in zip(items, bases, q_alls, traffic)]
