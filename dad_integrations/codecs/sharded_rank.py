"""Sharded rank-r routes (rank-dAD and PowerSGD's all-reduce under FSDP2): each rank rebuilds only
its own rows of the rank-r average.

Notation: a weight ``m x n`` sharded along dim 0 over S ranks; rank d keeps rows
``[a, b) = [d c, min((d+1) c, m))``, ``c = ceil(m/S)`` (`exact.shard_span`; trailing shards
may be short or empty, FSDP pads each to c rows); ``M_s`` is site s's local gradient plus its
error-feedback residual; ``w`` the wire itemsize; ``scale`` what FSDP's reduce-scatter would
multiply the sum of the local gradients by (``1/S`` for its default average).

**All-gather route (rank-dAD, ``"rank"``).** Each site reduces its own ``M_s`` to rank r,
``M_s ~= P_s Q_s^T`` (`low_rank.reduce_rank`: power iteration on the factors or on the dense
gradient, or a truncated SVD when rows are few; warm-started from the site's last ``Q_s``). Without
sharding every rank gathers every ``[P_s^T | Q_s^T]`` and rebuilds ``scale * sum_s P_s Q_s^T``. Row i
of that is ``scale * sum_s P_s[i] Q_s^T``, so rank d needs every ``Q_s`` whole but of ``P_s`` only the
rows ``a:b``:

    shard_d = scale * sum_s P_s[a:b] Q_s^T = scale * [P_1[a:b] .. P_S[a:b]] [Q_1 .. Q_S]^T

* an all-gather of every site's ``Q_s^T`` (r x n): ``(S-1) r n`` numbers per rank;
* an all-to-all of ``P_s``'s row blocks (block d = rows ``[d c, (d+1) c)``, zero past m):
  ``(S-1) c r``, about ``(S-1)/S m r`` per rank;

``(S-1) r (n + c) w`` in all (`routes.rank`), against ``(S-1) r (m+n) w`` unsharded and
FSDP2's reduce-scatter's ``(S-1) c n b``. The rebuild is one ``(c x S r) (S r x n)`` matmul, 1/S of
the unsharded one.

**All-reduce route (PowerSGD, ``"rank_allreduce"``).** ``Q`` (n x r) is the same on every rank (the
last step's all-reduced Q, or a draw from a seed every rank shares):

    P = sum_s M_s Q  (all-reduce, m x r)    P^ = orth(P)    Q' = sum_s M_s^T P^  (all-reduce, n x r)
    shard_d = scale * P^[a:b] Q'^T

``2 (S-1)/S r (m+n) w`` (`routes.rank_allreduce`), the same bytes as unsharded: only
the rebuild shrinks (``c r n`` instead of ``m r n``). A reduce-scatter of P does not suffice: the
orthonormalisation mixes all rows of P, and the Q round needs all of ``P^`` on every site
(``M_s^T P^`` runs over all m rows of ``M_s``, which only site s holds). Rows could be
orthonormalised in place after a reduce-scatter (Cholesky-QR through the ``r x r`` Gram matrix
``sum_d P[rows_d]^T P[rows_d]``, one tiny all-reduce), but ``P^`` would then have to be all-gathered
for the Q round: reduce-scatter plus all-gather are the all-reduce's bytes, with a round trip more.
Where rows are few and there is no residual, ``M_s Q = D^T (X Q)`` and ``M_s^T P^ = X^T (D P^)``
come from the factors (``N r (m+n)`` flops instead of ``m n r``).

**Error feedback and warm start**, as in the unsharded codecs (`codecs.rank`,
`codecs.rank_allreduce`): the residual ``M_s - P_s Q_s^T`` (all-gather) or ``M_s - P^ (P^^T M_s)``
(all-reduce) is added to the next step's local gradient; the all-gather route warm-starts from the
site's own ``Q_s``, the all-reduce from the shared ``Q'``. Memory: the residual is one *unsharded*
(m x n, compute dtype) buffer per rank-routed weight and rank, S times that weight's gradient shard
(what FSDP saves by sharding the gradient, error feedback spends again); it cannot be sharded, since
site s compresses its whole ``M_s``, and no rank but s knows ``M_s``. ``error_feedback_rank: q``
keeps its rank-q part instead (`error_feedback.LowRankErrorFeedback`, ``q (m+n)`` numbers, packed
as soon as the residual is computed, so no whole residual waits for the step's end either);
``error_feedback: false`` frees it.

**Non-finite steps.** A site whose local gradient holds NaN or Inf sends a non-finite ``P_s`` and
``Q_s``, so every rank rebuilds a non-finite shard, as the reduce-scatter gives: a power iteration
spreads the NaN by itself (both routes); the all-gather route's exact SVD, which could raise on
that rank alone, checks its factors first and sends NaN instead. New residuals and warm starts
wait in the synchroniser's `route_state.RouteState` until the step is over: one all-reduce of one
number tells every rank whether any rank's local gradients (all of FSDP's reduce-scatter inputs of
the step, `RouteState.note_local`) were non-finite, and such a step (one a loss scaler skips) keeps
the state of the step before, on every rank alike.

**Embeddings** (token ids, no linear factors) are reduced from their dense local gradient, which
FSDP's reduce-scatter input holds whole, as the unsharded codecs reduce them (PowerSGD compresses
them too); the ids play no part, so both routes work for them unchanged.

**Units without uses** (PowerSGD's coverage floor: raw ``nn.Parameter``s, convolutions no kind
captures) and units whose uses cover row blocks are reduced from the dense local gradient too, as
its matrix view ``(shape[0], prod(shape[1:]))`` (`FactorUnit.shape`; FSDP2's Shard(0) cuts its
rows, ZeRO's flat partitions its row-major flattening, which is the view's).

The pure functions (`row_blocks`, `gathered_shard`, `reduced_shard`) hold the algebra;
`ShardedRankCodec` runs the collectives through a `FactorAggregator`, every rank calling it with
the same units and routes in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from dad_integrations.comm.aggregator import FactorAggregator, Traffic
from dad_integrations.config import DADConfig
from dad_integrations.capture.rows import Rows, compute_dtype
from dad_integrations.codecs.low_rank import LocalGradient, choose_method, method_costs, reduce_rank
from dad_integrations.capture.units import FactorUnit
from dad_integrations.codecs.exact import covering_rows, shard_span
from dad_integrations.codecs.power_iteration import PowerIteration
from dad_integrations.codecs.rank import _cat, _reduction_is_safe
from dad_integrations.codecs.route_state import RouteState

ROUTES = ("rank", "rank_allreduce")
LocalGrad = Callable[[nn.Parameter, torch.dtype], torch.Tensor]
SharedRebuild = Callable[["RankItem", torch.Tensor, torch.Tensor], torch.Tensor]  # (item, P^, Q') -> its part


def row_blocks(p: torch.Tensor, world_size: int) -> torch.Tensor:
    """``(S, c, r)``: block d holds rows ``[d c, (d+1) c)`` of ``p`` (m x r), zero past m (what rank
    d receives of this site's P in the all-to-all)."""
    m, r = p.shape
    c = -(-m // world_size)
    out = p.new_zeros(world_size * c, r)
    out[:m] = p
    return out.view(world_size, c, r)


def gathered_shard(p_blocks: torch.Tensor, q_ts: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * sum_s p_blocks[s] @ q_ts[s]`` as one ``(c x S r) (S r x n)`` matmul: ``p_blocks``
    ``(S, c, r)`` holds every site's rows of its P for this rank, ``q_ts`` ``(S, r, n)`` every site's
    ``Q_s^T``. Returns the padded shard ``(c, n)`` (zero past m)."""
    world, c, r = p_blocks.shape
    left = p_blocks.permute(1, 0, 2).reshape(c, world * r) * scale  # the scale on the small side
    return left @ q_ts.reshape(world * r, -1)


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
class RankItem:
    """One unit's local side of a rank route this step."""

    unit: FactorUnit
    representation: str      # "rank" (all-gather) or "rank_allreduce"
    local: LocalGradient     # M_s, plus the residual where error feedback is on
    method: str              # how M_s is held and reduced: "dense", "factors", "svd"
    rank: int                # r = min(config.rank, m, n)
    finite: bool             # read by the all-gather route only (True for the all-reduce route)


@dataclass
class RankShard:
    """One unit's result: this rank's rows ``a:b`` of the scaled rank-r average, its bytes, and the
    components this rank sent (fewer only where its gradient's rank is lower; NaN rows count)."""

    shard: torch.Tensor
    traffic: Traffic
    components: int


class ShardedRankCodec:
    """The two rank routes under sharding, with error feedback and warm starts from ``state``
    (module doc): `local` then `exchange` for the units that take a rank route, every rank alike."""

    def __init__(self, config: DADConfig, wire_dtype: Optional[torch.dtype], state: Optional[RouteState] = None):
        self.config = config
        self.wire_dtype = wire_dtype
        self.state = state or RouteState(config)
        # residuals, each site's own Q_s (all-gather route), the all-reduced Q (all-reduce route)
        self.memory, self.warm, self.shared = self.state.memory, self.state.own, self.state.shared

    # -- one unit's local side ------------------------------------------------------------------
    def local(self, unit: FactorUnit, rows: Sequence[Rows], local_grad: LocalGrad, representation: str) -> RankItem:
        """``M_s`` for ``representation``: from the factors where that is cheaper and nothing is added
        to them (no error feedback, linear-like uses over whole rows: `FactorUnit.factors_only`), else
        the dense local gradient (``local_grad``, the matrix view) plus the residual."""
        if representation not in ROUTES:
            raise ValueError(f"not a rank route: {representation!r}")
        cfg, p = self.config, unit.param
        m, n = unit.shape  # (param_shape: ZeRO-3 empties p.data; FSDP2's DTensor has the global shape)
        r = min(cfg.rank, m, n)
        cdt = compute_dtype(p)
        method = "dense"
        # no rows given: a node's sum across nodes (`exchange.node_partitions`), dense by nature
        if not self.memory.enabled and unit.factors_only and rows:
            n_rows = sum(int(left.shape[0]) for left, _ in rows)
            if representation == "rank":
                method = choose_method(n_rows, m, n, r, cfg.power_iterations, factors_available=True)
            else:
                costs = method_costs(n_rows, m, n, r, 2, factors_available=True)
                method = "factors" if costs["factors"] < costs["dense"] else "dense"
        if method == "dense":
            local = LocalGradient(dense=self.memory.compensate(unit.name, local_grad(p, cdt)))
        else:
            local = LocalGradient(left=_cat([left.to(cdt) for left, _ in rows]),
                                  right=_cat([right.to(cdt) for _, right in rows]))
        # only the all-gather route reads it, and only for the exact SVD (which may raise on NaN on
        # one site alone): power iterations spread a NaN by themselves (`codecs.rank`), and the check
        # is a pass over the gradient and, on a GPU, a host sync per weight
        finite = _reduction_is_safe(local, method, None) if representation == "rank" else True
        return RankItem(unit, representation, local, method, r, finite)

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
        gather = [i for i, it in enumerate(items) if it.representation == "rank"]
        shared = [i for i, it in enumerate(items) if it.representation == "rank_allreduce"]
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
        """All-gather every site's ``Q_s^T`` and all-to-all its P's row blocks; the returned finish
        rebuilds each unit's shard."""
        S, rank = agg.world_size, agg.rank
        q_parts, p_parts, components = [], [], []
        for it in items:
            p, q, k = self.reduce_own(it, step)
            q_parts.append(q.t().reshape(-1).to(wire))
            p_parts.append(row_blocks(p, S).reshape(S, -1).to(wire))
            components.append(k)
        flat_q, send = torch.cat(q_parts), torch.cat(p_parts, dim=1)
        name = f"dad.sharded.rank.{items[0].unit.name}"
        gather = agg.all_gather(flat_q, name=f"{name}.q", first_dims=[flat_q.numel()] * S)
        to_all = agg.all_to_all(send, name=f"{name}.p")

        def finish() -> List[RankShard]:
            qs, received = gather.wait(), to_all.wait()
            out, q0, p0 = [], 0, 0
            for it, q_part, p_part, k in zip(items, q_parts, p_parts, components):
                m, n = it.unit.shape
                cdt = compute_dtype(it.unit.param)
                a, b, c = shard_span(rank, S, m)
                q_ts = torch.stack([g[q0:q0 + q_part.numel()].view(it.rank, n) for g in qs]).to(cdt)
                p_blocks = received[:, p0:p0 + p_part.shape[1]].reshape(S, c, it.rank).to(cdt)
                shard = gathered_shard(p_blocks, q_ts, scale)[:b - a]
                traffic = (gather.traffic.share(q_part.numel() / flat_q.numel())
                           + to_all.traffic.share(p_part.shape[1] / send.shape[1]))
                out.append(RankShard(shard, traffic, k))
                q0, p0 = q0 + q_part.numel(), p0 + p_part.shape[1]
            return out

        return finish

    def reduce_own(self, it: RankItem, step: int) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """This site's ``(P_s, Q_s)`` padded to r columns, and its component count; NaN where its
        gradient is not finite. The warm start and residual wait in the `RouteState` until the step's end.
        (The all-gather route's local half; `deepspeed_dad.zero` sends the pair its own way.)"""
        unit, r = it.unit, it.rank
        m, n = unit.shape
        cdt = compute_dtype(unit.param)
        device = it.local.dense.device if it.local.dense is not None else it.local.left.device
        if not it.finite:  # every rank's rebuild turns non-finite, none raises alone
            nan = float("nan")
            return (torch.full((m, r), nan, dtype=cdt, device=device),
                    torch.full((n, r), nan, dtype=cdt, device=device), r)
        low = reduce_rank(it.local, r, method=it.method, q_init=self.warm.initial(unit, n, r, cdt, step),
                          iterations=self.config.power_iterations)
        self.state.hold(self.warm, unit, low.warm, self.state.residual(unit.name, it.local.dense, low.p, low.q))
        p, q = low.p, low.q
        if low.components < r:  # equal blocks on every rank: no size exchange
            p = torch.nn.functional.pad(p, (0, r - low.components))
            q = torch.nn.functional.pad(q, (0, r - low.components))
        return p, q, low.components

    def _rank_allreduce(self, items: Sequence[RankItem], agg: FactorAggregator, scale: float, step: int,
                        wire: torch.dtype, rebuild: Optional[SharedRebuild]) -> List[RankShard]:
        """PowerSGD's rounds for ``items`` (`power_iteration.PowerIteration` over ``agg``): per power
        iteration, P all-reduced, orthonormalised, Q all-reduced."""
        S, rank = agg.world_size, agg.rank
        if rebuild is None:
            def rebuild(it: RankItem, basis: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
                return reduced_shard(basis, q, rank, S, scale)
        dtypes = [compute_dtype(it.unit.param) for it in items]
        rounds = PowerIteration([it.local for it in items], dtypes, [it.rank for it in items],
                                self.config.power_iterations, sites=agg, wire=wire,
                                name=f"dad.sharded.powersgd.{items[0].unit.name}")
        # param_shape: ZeRO-3 empties p.data
        rounds.start([self.shared.initial(it.unit, it.unit.shape[1], it.rank, dtype, step)
                      for it, dtype in zip(items, dtypes)])
        residuals: list = [None] * len(items)

        def residual(bases: List[torch.Tensor], q_locals: List[torch.Tensor]) -> None:
            """While the last Q all-reduce is on the wire: ``M_s - P^ (M_s^T P^)^T`` as the memory keeps it."""
            if self.memory.enabled:
                for i, (it, basis, q_local) in enumerate(zip(items, bases, q_locals)):
                    if it.local.dense is not None:
                        residuals[i] = self.state.residual(it.unit.name, it.local.dense, basis, q_local)

        bases, _, q_alls = rounds.finish(residual)
        out = []
        for it, basis, q_all, res, traffic in zip(items, bases, q_alls, residuals, rounds.traffic):
            self.state.hold(self.shared, it.unit, q_all, res)
            out.append(RankShard(rebuild(it, basis, q_all), traffic, it.rank))
        return out
