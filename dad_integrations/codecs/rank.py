"""Rank-r factors, all-gathered (rank-dAD), and what every rank route's codec shares.

Every rank reduces its own local gradient to rank r (`low_rank.reduce_rank`: power iteration on the
factors or on the dense gradient, or an exact truncated SVD when rows are few), sends
``[P_s^T | Q_s^T]`` and rebuilds ``G ~= scale * [P_1 .. P_S][Q_1 .. Q_S]^T``, a rank ``S r`` matrix,
with one ``S r m n`` matmul. Bytes per layout: `routes.rank`.

`RankRoutes` is what every rank route's codec (flat, two levels, FSDP2 and ZeRO, HSDP's replicate
hop) shares: this rank's ``M_s`` (`RankRoutes.item`), its own reduction (`RankRoutes.reduce_own`) and
PowerSGD's shared rounds (`RankRoutes.shared_rounds`), each with its warm start and error-feedback
residual, held in the `route_state.RouteState` until the step is over.

Non-finite gradients: a rank whose local gradient holds NaN or Inf sends a non-finite payload, so
every rank rebuilds a non-finite gradient, as all-reduce gives: the power iteration spreads the NaN
by itself (no pass over the gradient); where the reduction could raise on that rank alone (the exact
SVD) or would drop components (adaptive tolerance), the input is checked and r rows of NaN go
instead. Such a step (one a loss scaler will skip) keeps the state of the step before, on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from dad_integrations.builtin_routes import RANK
from dad_integrations.comm.aggregator import FactorAggregator
from dad_integrations.config import DADConfig
from dad_integrations.capture.rows import Rows, compute_dtype
from dad_integrations.codecs.low_rank import LocalGradient, choose_method, method_costs, reduce_rank
from dad_integrations.codecs.power_iteration import PowerIteration
from dad_integrations.codecs.error_feedback import ErrorFeedback
from dad_integrations.report import ParamReport
from dad_integrations.capture.units import FactorUnit
from dad_integrations.codecs.finite import finite_flag
from dad_integrations.codecs.route_state import RouteState, WarmStart

LocalGrad = Callable[[nn.Parameter, torch.dtype], torch.Tensor]
Rounds = Callable[[], Tuple[List[torch.Tensor], List[torch.Tensor], list]]  # per item P^, Q', traffic


@dataclass
class RankItem:
    """One unit's local side of a rank route this step."""

    unit: FactorUnit
    representation: str      # "rank" (all-gather) or "rank_allreduce"
    local: LocalGradient     # M_s, plus the residual where error feedback is on
    method: str              # how M_s is held and reduced: "dense", "factors", "svd"
    rank: int                # r = min(config.rank, m, n)
    owned: bool = False      # M_s is the codec's own copy (gradient plus residual): the residual may reuse it


class RankRoutes:
    """Error feedback (`memory`) and warm starts (`own`: each rank's ``Q_s``; `shared`: PowerSGD's
    all-reduced Q) from ``state``, and the steps every rank route's codec runs (module doc)."""

    def __init__(self, config: DADConfig, wire_dtype: Optional[torch.dtype], state: Optional[RouteState] = None):
        self.config = config
        self.wire_dtype = wire_dtype
        self.state = state or RouteState(config)
        self.own, self.shared = self.state.own, self.state.shared

    @property
    def memory(self) -> ErrorFeedback:
        """The state's error feedback (read each time: a residual budget may set it at attach)."""
        return self.state.memory

    def item(self, unit: FactorUnit, rows: Sequence[Rows], local_grad: LocalGrad, representation: str,
             dense: bool = False) -> RankItem:
        """``M_s`` for ``representation``: from the factors where that is cheaper and nothing is added
        to them (no error feedback, linear-like uses over whole captured rows: `FactorUnit.factors_only`),
        else the dense local gradient (``local_grad``, the matrix view) plus the residual; ``dense``:
        from ``local_grad`` whatever the rows (a node's sum, `exchange.two_level`); no rows: a node's
        sum across nodes (`exchange.node_partitions`, `codecs.replicate_rank`), dense by nature."""
        p, (m, n) = unit.param, unit.shape  # (unit.shape: ZeRO-3 empties p.data; FSDP2's DTensor is global)
        r, cdt = min(self.config.rank, m, n), compute_dtype(p)
        method = "dense"
        if rows and unit.factors_only and not (dense or self.memory.enabled or unit.rows_unused):
            n_rows = sum(int(left.shape[0]) for left, _ in rows)
            if representation == RANK:
                method = choose_method(n_rows, m, n, r, self.config.power_iterations, factors_available=True)
            else:  # PowerSGD's products: the factors or the dense gradient
                costs = method_costs(n_rows, m, n, r, 2, factors_available=True)
                method = "factors" if costs["factors"] < costs["dense"] else "dense"
        if method != "dense":
            return RankItem(unit, representation, LocalGradient(left=_cat([left.to(cdt) for left, _ in rows]),
                                                                right=_cat([right.to(cdt) for _, right in rows])),
                            method, r)
        local = local_grad(p, cdt)
        compensated = self.memory.compensate(unit.name, local)
        return RankItem(unit, representation, LocalGradient(dense=compensated), method, r, compensated is not local)

    def reduce_own(self, it: RankItem, step: int, tolerance: Optional[float] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """This site's ``(P_s, Q_s)`` and its component count, padded to r columns without ``tolerance``
        (equal blocks on every rank: no size exchange); NaN where the reduction is not safe (module
        doc). The warm start and residual wait in the `RouteState` until the step's end."""
        unit, r = it.unit, it.rank
        m, n = unit.shape
        cdt = compute_dtype(unit.param)
        if not _reduction_is_safe(it.local, it.method, tolerance):  # every rank's rebuild turns non-finite
            nan = float("nan")
            return (torch.full((m, r), nan, dtype=cdt, device=it.local.device),
                    torch.full((n, r), nan, dtype=cdt, device=it.local.device), r)
        low = reduce_rank(it.local, r, method=it.method, q_init=self.own.initial(unit, n, r, cdt, step),
                          iterations=self.config.power_iterations, tolerance=tolerance)
        # the residual now, not at the step's end: without a residual yet, the compensated gradient is the
        # local gradient itself, which may be .grad, and the decode overwrites .grad with the average
        self.state.hold(self.own, unit, low.warm,
                        self.state.residual(unit.name, it.local.dense, low.p, low.q, it.owned))
        p, q = low.p, low.q
        if tolerance is None and low.components < r:
            p = torch.nn.functional.pad(p, (0, r - low.components))
            q = torch.nn.functional.pad(q, (0, r - low.components))
        return p, q, low.components

    def shared_rounds(self, items: Sequence[RankItem], store: WarmStart, step: int, name: str, *,
                      qs: Optional[Sequence[torch.Tensor]] = None, done: Optional[Sequence[torch.Tensor]] = None,
                      **groups) -> Rounds:
        """`PowerIteration` of the items' ``M_s`` (``groups``: its ``sites``, ``rows``, ``wire`` and
        ``note``) from ``qs`` (default: ``store``'s warm starts; ``done``: their ``M_s Q``). The returned
        finish runs the remaining rounds, computes each residual ``M_s - P^ (M_s^T P^)^T`` while the
        last Q sum is on the wire, holds it and the new Q in ``store``, and returns per item ``P^``
        (this rank's rows of it), the summed Q and its traffic."""
        dtypes = [compute_dtype(it.unit.param) for it in items]
        rounds = PowerIteration([it.local for it in items], dtypes, [it.rank for it in items],
                                self.config.power_iterations, name=f"{name}.{items[0].unit.name}", **groups)
        rounds.start(qs or [store.initial(it.unit, it.unit.shape[1], it.rank, dtype, step)
                            for it, dtype in zip(items, dtypes)], done)
        residuals: list = [None] * len(items)

        def residual(bases: List[torch.Tensor], q_locals: List[torch.Tensor]) -> None:
            for i, (it, basis, q_local) in enumerate(zip(items, bases, q_locals)):
                if it.local.dense is not None:
                    residuals[i] = self.state.residual(it.unit.name, it.local.dense, basis, q_local, it.owned)

        def finish() -> Tuple[List[torch.Tensor], List[torch.Tensor], list]:
            bases, _, q_alls = rounds.finish(residual)
            for it, q_all, res in zip(items, q_alls, residuals):
                self.state.hold(store, it.unit, q_all, res)
            return bases, q_alls, rounds.traffic

        return finish


class RankCodec(RankRoutes):
    """Encode a unit's local gradient as ``[P^T | Q^T]``; decode every rank's into a rank-S·r product."""

    def encode(self, unit: FactorUnit, rows: Sequence[Rows], local_grad: LocalGrad, entry: ParamReport, step: int,
               *, dense: bool = False) -> torch.Tensor:
        """This rank's payload (``r`` rows of ``m + n``; fewer with adaptive tolerance); ``dense``:
        from ``local_grad`` whatever the rows (a node's sum, `exchange.two_level`)."""
        it = self.item(unit, rows, local_grad, RANK, dense)
        entry.method = it.method
        p, q, entry.components = self.reduce_own(it, step, self.config.adaptive_tolerance)
        return torch.cat([p.t(), q.t()], dim=1).to(self.wire_dtype or unit.param.dtype)

    @staticmethod
    def decode(unit: FactorUnit, factors: torch.Tensor, scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(left, right)`` with ``left @ right = scale * sum_s P_s Q_s^T``, from every rank's
        ``[P^T | Q^T]`` rows, stacked."""
        p = unit.param
        m = unit.shape[0]
        factors = factors.to(compute_dtype(p))
        # the scale goes on the (S r x m) block, not on the m x n result: one pass fewer
        return (factors[:, :m] * scale).t(), factors[:, m:]

    def gather(self, group: FactorAggregator, units: Sequence[Tuple[FactorUnit, torch.Tensor]], name: str,
               note: Callable[[torch.Tensor], torch.Tensor]):
        """One all-gather of several units' payloads (fewer, larger collectives); returns its handle
        and what waits for it and `decode`s each unit's every-rank rows, stacked in rank order, at a
        given scale."""
        flat = torch.cat([p.reshape(-1) for _, p in units])
        handle = group.all_gather(flat, name=name, first_dims=[flat.numel()] * group.world_size)

        def decoded(scale: float) -> List[Tuple[torch.Tensor, torch.Tensor]]:
            pieces = [note(g).split([p.numel() for _, p in units]) for g in handle.wait()]
            return [self.decode(unit, torch.cat([pc[j].view(p.shape) for pc in pieces]), scale)
                    for j, (unit, p) in enumerate(units)]

        return handle, decoded


class RankBucket:
    """Rank-r payloads of consecutive units, waiting to share one all-gather (each collective costs
    a round trip). Every rank sends r rows per unit (without adaptive tolerance), so the ranks agree
    on the bucket without any exchange. A bucket goes when it reaches ``cap_bytes`` (the config's
    ``bucket_cap_mb``), when a payload of another dtype follows it, or when the step's last unit is done."""

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
    """May this rank reduce ``grad`` and send the result, finite or not (module doc)? Only the exact
    SVD and an adaptive tolerance check the input (the SVD's factor rows are few); a power iteration
    spreads a NaN by itself, one pass and, on a GPU, one host sync per weight fewer."""
    if method != "svd" and tolerance is None:
        return True
    tensors = (grad.dense,) if grad.dense is not None else (grad.left, grad.right)
    return all(bool(finite_flag(t)) for t in tensors)


def _cat(tensors: List[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` without the copy when there is one tensor (a weight with one use)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
