"""Predicted step time of a plan on a stated link: all-reduce, PowerSGD and dAD, and where dAD pays.

    python -m dad_integrations.plan --model gpt2 --sites 8 --tokens-per-rank 2048 --rank 4 \\
        --bandwidth 10gbit --latency-us 20

Per unit, the seconds one step spends on it beyond a step without communication: wire time on the
link (`link.LinkModel`, the stated bandwidth and latency) plus the route's local compute
(`compute_model`, measured here on ``--compute-device`` for the model's own weight shapes, each
timed at its bounded shape and scaled as at attach; ``none`` counts no compute). dAD's routes are
chosen by that prediction (objective ``"time"``), as the synchroniser chooses them on such a link;
PowerSGD's hook pays its wire time and, for each matrix it compresses, the same local work as dAD's
rank-r all-reduce route (the same algorithm).

Break-even bandwidth. Each method's step contribution is ``C + L + W / beta``: compute, latency and
bytes over the bandwidth. Against all-reduce's ``L_a + W_a / beta`` a compressed plan pays below
``beta* = (W_a - W) / (C + L - L_a)``. For dAD the compressed plan is what auto sends on a slow link
(its routes by bytes); for PowerSGD, its hook's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from dad_integrations.builtin_routes import DENSE, EXACT, RANK_ALLREDUCE
from dad_integrations.routing.link import LinkModel
from dad_integrations.routing.planner import StepPlan, _ms, _table, rate_below
from dad_integrations.routing.timing import StepTiming


@dataclass
class UnitTime:
    """Predicted seconds of one unit (or of the dense parameters) per step, by method."""

    name: str
    route: str
    dad: float
    allreduce: float
    powersgd: Optional[float]


@dataclass
class TimePlan:
    units: List[UnitTime]
    dad: float
    allreduce: float
    powersgd: Optional[float]
    break_even: Dict[str, Optional[float]]   # method -> bytes per second below which it pays (inf: always)


def _powersgd_compute(timing: StepTiming, shape, psgd: Optional[float], allreduce: float) -> float:
    compresses = psgd is not None and psgd < allreduce
    return timing.compute.seconds(RANK_ALLREDUCE, shape, rows_by_rank=[[0]], world_size=1) if compresses else 0.0


def time_plan(step: StepPlan, timing: StepTiming, *, sites: int, compressed: Optional[StepPlan] = None) -> TimePlan:
    """Per unit and in total, the predicted seconds of ``step`` (dAD's routes, chosen by time),
    all-reduce and PowerSGD; ``compressed`` (the same model's plan by bytes) gives dAD's break-even."""
    link = timing.link
    rows: List[UnitTime] = []
    psgd_compute = [_powersgd_compute(timing, r.shape, r.powersgd, r.allreduce) for r in step.units]
    for r, compute in zip(step.units, psgd_compute):
        dad = timing.route_seconds({r.route: r.dad}, shape=r.shape, uses=len(r.rows), rows_by_rank=[r.rows] * sites,
                                   world_size=sites, size_exchange=r.exchange_sizes)[r.route]
        psgd = None if r.powersgd is None else link.seconds("all_reduce", r.powersgd, 0) + compute
        rows.append(UnitTime(r.name, r.route, dad, link.seconds("all_reduce", r.allreduce, 0), psgd))
    dense = link.seconds("all_reduce", step.dense_allreduce, 0)
    dense_psgd = None if step.dense_powersgd is None else link.seconds("all_reduce", step.dense_powersgd, 0)
    rows.append(UnitTime(f"dense parameters ({step.dense_params})", DENSE,
                         link.seconds("all_reduce", step.dense_dad, 0), dense, dense_psgd))
    # the dense buckets' latency: one call per bucket, every method alike
    total_psgd = None if step.powersgd is None else sum(u.powersgd or 0.0 for u in rows)
    plan = TimePlan(rows, sum(u.dad for u in rows), sum(u.allreduce for u in rows), total_psgd, {})
    plan.break_even["dad"] = _break_even(compressed or step, timing, sites)
    if step.powersgd is not None:
        plan.break_even["powersgd"] = _solve(step.allreduce, step.powersgd, sum(psgd_compute), 0.0)
    return plan


def _break_even(step: StepPlan, timing: StepTiming, sites: int) -> Optional[float]:
    """Bandwidth below which ``step``'s routes beat all-reduce (inf: at any; None: at none)."""
    compute = latency = 0.0
    for r in step.units:
        compute += timing.compute.seconds(r.route, r.shape, rows_by_rank=[r.rows] * sites, world_size=sites,
                                          calls=len(r.rows))
        if r.route == EXACT:
            latency += (1 + int(r.exchange_sizes)) * timing.link.all_gather.alpha
    return _solve(step.allreduce, step.total, compute, latency)


def _solve(allreduce_bytes: float, method_bytes: float, compute: float, latency: float) -> Optional[float]:
    saved = allreduce_bytes - method_bytes
    cost = compute + latency
    if saved <= 0:
        return None
    return float("inf") if cost <= 0 else saved / cost


def render_time(plan: TimePlan, link: LinkModel, compute_note: str) -> str:
    """The predicted step-time contributions as a text table, then the totals and break-evens."""
    columns = [("route", 14), ("dAD ms", 9), ("all-reduce ms", 13), ("PowerSGD ms", 11)]
    units = [[u.name, u.route, _ms(u.dad), _ms(u.allreduce), _ms(u.powersgd)] for u in plan.units]
    total = ["total", "", _ms(plan.dad), _ms(plan.allreduce), _ms(plan.powersgd)]
    footer = [f"dAD (its compressed routes) pays {rate_below(plan.break_even.get('dad'), 'never', 'at any bandwidth')}"]
    if "powersgd" in plan.break_even:
        footer.append(f"PowerSGD pays {rate_below(plan.break_even['powersgd'], 'never', 'at any bandwidth')}")
    return _table(f"predicted step time beyond compute, per rank: link {link.describe()}; {compute_note}", columns,
                  units, total, footer)
