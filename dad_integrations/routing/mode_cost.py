"""A stated mode that costs time: the models' prediction against the engine's own exchange.

Modes ``"exact"`` and ``"rank"`` take their route whatever the link; on a fast link that can be
slower than the engine's all-reduce (exact factors of many rows move more bytes than the gradient;
a rank route's compute outweighs the wire time it saves). `mode_cost_line` prices each weight's
routes with the link model (`link`) and, where measured, the compute model (`compute_model`),
as the router does (`router.unit_estimates`, `timing.StepTiming.route_seconds`), and returns one
line where the mode's exchange is predicted slower than the engine's own by more than `MARGIN`,
with what mode ``"auto"`` would choose. Only the exchange is predicted: the step's forward and
backward are the same under every route, so the step itself slows by less than the share said.

No collective, no measurement: the caller brings an agreed link (stated, or measured) and row
counts (agreed after a size exchange, or none for the rank routes, which need none).
"""
from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence, Tuple

import torch

from dad_integrations.builtin_routes import DENSE, EXACT
from dad_integrations.config import DADConfig
from dad_integrations.report import ParamReport
from dad_integrations.routing.compute_model import ComputeModel
from dad_integrations.routing.link import LinkModel
from dad_integrations.routing.router import RowCounts, UnitShape, choose, step_rules, unit_estimates
from dad_integrations.routing.timing import StepTiming, collective_of

MARGIN = 0.10  # the mode's predicted exchange may exceed the engine's own by this share unsaid


def mode_cost_line(config: DADConfig, units: Sequence[Tuple[UnitShape, Optional[RowCounts]]], *, world_size: int,
                   wire_dtype: torch.dtype, link: LinkModel, compute: Optional[ComputeModel] = None,
                   sharded: bool = False, name: str = "dAD") -> Optional[str]:
    """The warning line for ``config.mode`` (``"exact"`` or ``"rank"``) over ``units`` (each with
    its agreed row counts, None for none), or None where the mode is not predicted slower than
    all dense by more than `MARGIN` (or is ``"auto"``, which chooses by these models itself)."""
    if config.mode == "auto" or not units:
        return None
    # without a compute model, the wire alone (exact factors' compute is a copy; the rank routes' is not counted)
    timing = StepTiming(link, compute if compute is not None else ComputeModel())
    _, rules = step_rules(config, None)
    mode_s = dense_s = auto_s = 0.0
    auto_routes: Counter = Counter()
    for unit, rows in units:
        rows = rows or [[0] * len(unit.kinds)] * world_size
        # exact factors exchange their sizes every step in these modes
        est = unit_estimates(config, unit, rows, world_size, wire_dtype, sharded=sharded, size_exchange=True)
        seconds = timing.route_seconds(est, shape=unit.shape, uses=len(unit.kinds), rows_by_rank=rows,
                                       world_size=world_size, sharded=sharded, size_exchange=True)
        if not unit.has_factors and (config.mode == "exact" or not rules["rank_allowed"]):
            mine = DENSE
        else:
            mine = choose(config.mode, seconds, **rules)
        auto = choose("auto", seconds, **rules)
        mode_s, dense_s, auto_s = mode_s + seconds[mine], dense_s + seconds[DENSE], auto_s + seconds[auto]
        auto_routes[auto] += 1
    return _line(config, mode_s, dense_s, auto_s, auto_routes, link, sharded, name)


def report_cost_line(config: DADConfig, params: Sequence[ParamReport], *, link: LinkModel, sharded: bool = True,
                     name: str = "dAD") -> Optional[str]:
    """`mode_cost_line` from a step's report (the sharded engines' first step): each weight's
    counted bytes on its route's collective against its share of the engine's own reduction on
    the link (the wire alone), and auto as the cheaper of the two per weight."""
    if config.mode == "auto":
        return None
    mode_s = dense_s = auto_s = 0.0
    auto_routes: Counter = Counter()
    for p in params:
        if p.representation == "overhead":  # dAD's own collectives (row counts, checks): one call each
            mode_s += link.seconds("all_gather", p.sent_bytes, 1)
            continue
        own = getattr(p, "reduce_scatter_bytes", 0.0) or p.allreduce_bytes
        d = link.seconds(collective_of(DENSE, sharded), own, 0)
        m = d if p.representation == DENSE else link.seconds(
            collective_of(p.representation, sharded), p.sent_bytes, 2 if p.representation == EXACT else 0)
        mode_s, dense_s, auto_s = mode_s + m, dense_s + d, auto_s + min(m, d)
        auto_routes[p.representation if m < d else DENSE] += 1
    return _line(config, mode_s, dense_s, auto_s, auto_routes, link, sharded, name)


def _line(config: DADConfig, mode_s: float, dense_s: float, auto_s: float, auto_routes: Counter, link: LinkModel,
          sharded: bool, name: str) -> Optional[str]:
    if dense_s <= 0.0 or mode_s <= (1.0 + MARGIN) * dense_s:
        return None
    own = "reduce-scatter" if sharded else "all-reduce"
    chosen = ", ".join(f"{n} {rep}" for rep, n in sorted(auto_routes.items()))
    return (f"{name}: mode {config.mode} is predicted to slow the step here: its exchange {mode_s * 1e3:.2f} ms "
            f"a step against {dense_s * 1e3:.2f} ms for the engine's own {own} (+{(mode_s / dense_s - 1) * 100:.0f} %), "
            f"on link {link.brief()}; mode auto would take {auto_s * 1e3:.2f} ms ({chosen})")
