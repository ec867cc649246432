"""Planning: per factor unit, the route dAD takes in steady state and the bytes one rank sends.

Rows per step and rank: every captured call sees ``tokens`` rows, except position embeddings,
which Hugging Face looks up once for ``(1, seq)`` ids (``positions`` rows).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .aggregator import ring_allreduce_bytes
from .config import DADConfig
from .costs import powersgd_bytes, size_exchange_bytes
from .router import UnitShape, route, unit_estimates
from .units import build_plan

POSITION_EMBEDDINGS = ("wpe", "position_embeddings")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class UnitRow:
    """One factor unit in steady state. Bytes are what one rank sends per step; ``dad`` includes
    the unit's share of the dense buckets (its dense numel plus one flag per dense item)."""

    name: str
    shape: Tuple[int, int]
    rows: List[int]               # rows per use
    route: str
    exchange_sizes: bool
    dad: float
    allreduce: float
    powersgd: Optional[float]
    dense_numel: int = 0
    dense_items: int = 0


@dataclass
class StepPlan:
    """A steady-state step: the units' rows, the dense parameters' share, and the totals."""

    units: List[UnitRow]
    dense_params: int             # parameters outside the units (plan.dense)
    dense_param_numel: int
    dense_dad: float              # plan.dense's share of the dense buckets (numel + flags)
    dense_allreduce: float
    dense_powersgd: Optional[float]
    dense_numel: int              # all of the dense buckets: plan.dense, dense units, rank/dense biases
    dense_items: int
    total: float                  # dAD, as `last_step_report()` accounts it
    allreduce: float
    powersgd: Optional[float]
    counts: Dict[str, int] = field(default_factory=dict)   # units per route


def use_rows(capture, tokens: int, positions: int) -> int:
    """Rows one step gives a captured layer: ``positions`` for position embeddings, else ``tokens``."""
    return positions if capture.name.endswith(POSITION_EMBEDDINGS) else tokens


def steady_state(plan, *, tokens: int, positions: int, world_size: int, mode: str, rank: Optional[int],
                 rank_route: str = "allgather", dtype: torch.dtype = torch.float32,
                 powersgd_rank: Optional[int] = None) -> StepPlan:
    """Bytes one rank sends per unit in a steady-state step of ``mode`` (the router's decision from
    the counts of the unit's last size exchange), with ``tokens`` rows per captured call.

    Size exchanges count where the route needs agreed rows; biases of rank-r and dense units go to
    the dense buckets with one flag per dense item, as the synchroniser sends them. ``powersgd_rank``
    (default ``rank``) adds PyTorch's PowerSGD hook per parameter; None when neither is set.
    """
    s, item = world_size, dtype.itemsize
    config = DADConfig(mode=mode, rank=rank, rank_route=rank_route)
    psgd_rank = powersgd_rank if powersgd_rank is not None else rank

    def psgd(params) -> Optional[float]:
        if not psgd_rank:
            return None
        return sum(powersgd_bytes(tuple(p.shape), psgd_rank, s, item)[0] for p in params)

    counts = {"exact": 0, "rank": 0, "rank_allreduce": 0, "dense": 0}
    rows: List[UnitRow] = []
    sent = 0.0  # everything but the dense buckets
    dense_param_numel = sum(p.numel() for _, p in plan.dense)
    dense_numel, dense_items = dense_param_numel, len(plan.dense)
    for u in plan.units:
        m, n = u.param.shape
        bias_numel = u.bias_numel
        shape = UnitShape(tuple(u.kinds), (m, n), bias_numel, dtype)
        use = [use_rows(c, tokens, positions) for c in u.uses]
        rows_by_rank = [use] * s
        decision = route(config, shape, world_size=s, wire_dtype=dtype, last_rows=rows_by_rank)
        exchange = decision.exchange_sizes
        if decision.representation is None:  # decided on this step's counts, the same in steady state
            decision = route(config, shape, world_size=s, wire_dtype=dtype, rows_by_rank=rows_by_rank)
        rep = decision.representation
        est = unit_estimates(config, shape, rows_by_rank, s, dtype)
        counts[rep] += 1
        own = size_exchange_bytes(len(u.uses), s) if exchange else 0.0
        d_numel = d_items = 0
        if rep == "exact":
            own += est["exact"]
        elif rep in ("rank", "rank_allreduce"):
            own += est[rep] - ring_allreduce_bytes(bias_numel * item, s)
            d_numel, d_items = bias_numel, len(u.biases)
        else:
            d_numel, d_items = m * n + bias_numel, 1 + len(u.biases)
        sent += own
        dense_numel += d_numel
        dense_items += d_items
        params = [u.param] + [b.param for b in u.biases]
        rows.append(UnitRow(u.name, (m, n), use, rep, exchange,
                            own + ring_allreduce_bytes((d_numel + d_items) * item, s),
                            ring_allreduce_bytes((m * n + bias_numel) * item, s), psgd(params),
                            d_numel, d_items))
    total = sent
    if dense_items:
        total += ring_allreduce_bytes((dense_numel + dense_items) * item, s)
    dense_params = [p for _, p in plan.dense]
    dense_psgd = psgd(dense_params)
    unit_psgd = [r.powersgd for r in rows]
    return StepPlan(
        units=rows, dense_params=len(plan.dense), dense_param_numel=dense_param_numel,
        dense_dad=ring_allreduce_bytes((dense_param_numel + len(plan.dense)) * item, s),
        dense_allreduce=ring_allreduce_bytes(dense_param_numel * item, s), dense_powersgd=dense_psgd,
        dense_numel=dense_numel, dense_items=dense_items, total=total,
        allreduce=ring_allreduce_bytes((dense_param_numel + sum(m * n for m, n in (r.shape for r in rows))
                                        + sum(u.bias_numel for u in plan.units)) * item, s),
        powersgd=None if dense_psgd is None else dense_psgd + sum(unit_psgd), counts=counts)
