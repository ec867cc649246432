"""The planner's library: a model's steady-state step, layer by layer, before any launch.

From the synchroniser's own plan (`capture.units.build_plan`), router (`routing.router.route`) and
cost model (`routing.costs`): per factor unit, the route dAD takes after the first (checked) step
and the bytes one rank sends, beside dense all-reduce and PyTorch's PowerSGD hook at the same rank
(`steady_state`; FSDP2's reduce-scatter for `sharded_steady_state`). Rows per step come from the
text formula (`use_rows`) or from a counted forward and backward (`count_rows`). The command line
(`python -m dad_integrations.plan`) builds the model and prints `render`'s tables.

On a cluster of nodes, `plan_levels` adds each unit's route flat and at two levels
(`routing.two_level.compare_levels`, the comparison the synchroniser runs), the inter-node
break-even bandwidths (`break_even_bandwidth`, by bisection) and the bytes each node sends between
nodes; `stated_compute` prices the routes' local work on a stated device.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from dad_integrations.builtin_routes import BUILT_IN, DENSE, EXACT, RANK, RANK_ALLREDUCE
from dad_integrations.capture.assign import build_plan
from dad_integrations.comm.aggregator import ring_allreduce_bytes
from dad_integrations.comm.link_spec import KINDS, LinkCost
from dad_integrations.comm.topology import Topology
from dad_integrations.config import DADConfig
from dad_integrations.routing.compute_model import ComputeModel, ShapeCosts
from dad_integrations.routing.costs import powersgd_bytes, reduce_scatter_bytes, size_exchange_bytes
from dad_integrations.routing.link import LinkModel
from dad_integrations.routing.router import (Route, RouteContext, UnitEvidence, UnitShape, route, sharded_needs_counts,
                                             unit_estimates)
from dad_integrations.routing.timing import StepTiming
from dad_integrations.routes.registry import is_rank_route
from dad_integrations.routing.two_level import LevelUnit, TwoLevelTiming, choose_two_level, compare_levels, hop_bytes


POSITION_EMBEDDINGS = ("wpe", "position_embeddings")


@dataclass
class UnitRow:
    """One factor unit in steady state. Bytes are what one rank sends per step; ``dad`` includes
    the unit's share of the dense buckets (its dense numel)."""

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
    kind: str = ""                # the layer kind (`unit_kind`)


@dataclass
class StepPlan:
    """A steady-state step: the units' rows, the dense parameters' share, and the totals."""

    units: List[UnitRow]
    dense_params: int             # parameters outside the units (plan.dense)
    dense_param_numel: int
    dense_dad: float              # plan.dense's share of the dense buckets
    dense_allreduce: float
    dense_powersgd: Optional[float]
    dense_numel: int              # all of the dense buckets: plan.dense, dense units, rank/dense biases
    dense_items: int
    total: float                  # dAD, as `last_step_report()` accounts it
    allreduce: float
    powersgd: Optional[float]
    counts: Dict[str, int] = field(default_factory=dict)   # units per route


RowCounts = Dict[str, List[int]]   # unit name -> rows per use, one step on one rank


def use_rows(capture, tokens: int, positions: int) -> int:
    """Rows one step gives a captured layer: ``positions`` for position embeddings, else ``tokens``."""
    return positions if capture.name.endswith(POSITION_EMBEDDINGS) else tokens


def unit_rows(u, tokens: int, positions: int, counted: Optional[RowCounts]) -> List[int]:
    """Rows per use of unit ``u``: counted by a dummy forward (`count_rows`) where given, else by
    the text formula (`use_rows`)."""
    if counted is not None:
        return list(counted.get(u.name, [0] * len(u.uses)))
    return [use_rows(c, tokens, positions) for c in u.uses]


def unit_kind(u) -> str:
    """The layer kind of a unit: the registry kinds of the modules that run its uses (``+``-joined
    for a weight used by two kinds, GPT-2's tied ``wte``/``lm_head``: ``embedding+linear``), or
    ``floor`` for a unit without uses (no kind captures it: its dense gradient takes dense or the
    rank routes, as PowerSGD's hook compresses every matrix)."""
    from dad_integrations.capture.layers import layer_kind

    if not u.uses:
        return "floor"
    names: List[str] = []
    for c in u.uses:
        name = layer_kind(c.module) or c.kind  # (a kind's use always has a registered module)
        if name not in names:
            names.append(name)
    return "+".join(names)


def _steady_routes(plan, ctx: RouteContext, tokens: int, positions: int, rows: Optional[RowCounts]):
    """Per unit of ``plan``: (unit, its shape, rows per use, its steady-state `Route`, every route's
    bytes) under ``ctx``, every rank with the same rows. Flat: the router's prediction from the
    counts of the unit's last size exchange, decided on the step's counts where it exchanges them;
    sharded: decided on the counts every reduction call agrees on."""
    s = ctx.world_size
    for u in plan.units:
        shape = UnitShape.of(u, ctx.wire_dtype)
        use = unit_rows(u, tokens, positions, rows)
        by_rank = [use] * s
        decision = route(ctx, shape, UnitEvidence(rows_by_rank=by_rank) if ctx.sharded else
                         UnitEvidence(last_rows=by_rank))
        if decision.representation is None:  # decided on this step's counts, the same in steady state
            decision = Route(route(ctx, shape, UnitEvidence(rows_by_rank=by_rank)).representation, True)
        yield u, shape, use, decision, unit_estimates(ctx.config, shape, by_rank, s, ctx.wire_dtype,
                                                      sharded=ctx.sharded)


def steady_state(plan, *, tokens: int, positions: int, world_size: int, mode: str, rank: Optional[int],
                 rank_route: str = DADConfig.rank_route, dtype: torch.dtype = torch.float32,
                 powersgd_rank: Optional[int] = None, timing=None, rows: Optional[RowCounts] = None) -> StepPlan:
    """Bytes one rank sends per unit in a steady-state step of ``mode`` (`_steady_routes`), with
    ``tokens`` rows per captured call, or the counted ``rows`` per use (`count_rows`) where given.
    Biases of rank-r and dense units go to the dense buckets, as the synchroniser sends them.
    ``powersgd_rank`` (default ``rank``) adds PyTorch's PowerSGD hook per parameter; None when
    neither is set. With a ``timing`` (`timing.StepTiming`), routes are chosen by predicted time."""
    s, item = world_size, dtype.itemsize
    config = DADConfig(mode=mode, rank=rank, rank_route=rank_route,
                       objective="time" if timing is not None else "bytes")
    psgd_rank = powersgd_rank if powersgd_rank is not None else rank
    ctx = RouteContext(config, world_size=s, wire_dtype=dtype, timing=timing)
    units: List[UnitRow] = []
    sent = 0.0  # everything but the dense buckets
    dense_param_numel = sum(p.numel() for _, p in plan.dense)
    dense_numel, dense_items = dense_param_numel, len(plan.dense)
    for u, shape, use, decision, est in _steady_routes(plan, ctx, tokens, positions, rows):
        (m, n), bias_numel = shape.shape, u.bias_numel  # the matrix view: a convolution's (out, in x kernel)
        rep, exchange = decision.representation, decision.exchange_sizes
        own = size_exchange_bytes(len(u.uses), s) if exchange else 0.0
        d_numel = d_items = 0
        if rep == EXACT:
            own += est[EXACT]
        elif is_rank_route(rep):
            own += est[rep] - ring_allreduce_bytes(bias_numel * item, s)
            d_numel, d_items = bias_numel, len(u.biases)
        else:
            d_numel, d_items = m * n + bias_numel, 1 + len(u.biases)
        sent += own
        dense_numel += d_numel
        dense_items += d_items
        units.append(UnitRow(u.name, (m, n), use, rep, exchange, own + ring_allreduce_bytes(d_numel * item, s),
                             est[DENSE], _powersgd(u.params, psgd_rank, s, item), d_numel, d_items, unit_kind(u)))
    total = sent
    if dense_items:
        total += ring_allreduce_bytes(dense_numel * item, s)
    dense_psgd = _powersgd([p for _, p in plan.dense], psgd_rank, s, item)
    dense_dad = ring_allreduce_bytes(dense_param_numel * item, s)
    return StepPlan(
        units=units, dense_params=len(plan.dense), dense_param_numel=dense_param_numel, dense_dad=dense_dad,
        dense_allreduce=dense_dad, dense_powersgd=dense_psgd, dense_numel=dense_numel, dense_items=dense_items,
        total=total, allreduce=ring_allreduce_bytes((dense_param_numel + sum(m * n for m, n in (r.shape for r in units))
                                                     + sum(u.bias_numel for u in plan.units)) * item, s),
        powersgd=None if dense_psgd is None else dense_psgd + sum(r.powersgd for r in units),
        counts=route_counts(units, BUILT_IN))


def route_counts(rows, first: Sequence[str] = ()) -> Dict[str, int]:
    """Units per route of a plan's ``rows``: ``first`` in order (0 where none), then the others as met."""
    return {**dict.fromkeys(first, 0), **Counter(r.route for r in rows)}


def _powersgd(params, rank: Optional[int], sites: int, item: int) -> Optional[float]:
    """Bytes one rank sends for ``params`` under PyTorch's PowerSGD hook at ``rank`` (None without)."""
    return sum(powersgd_bytes(tuple(p.shape), rank, sites, item)[0] for p in params) if rank else None


# -- sharded (FSDP2) ------------------------------------------------------------------------------------
@dataclass
class ShardedUnitRow:
    """One factor unit under FSDP2 in steady state: bytes one rank sends per step by dAD's route
    (its row-count exchange included) and by FSDP2's reduce-scatter, weight and biases together."""

    name: str
    shape: Tuple[int, int]
    rows: List[int]
    route: str
    dad: float
    reduce_scatter: float
    kind: str = ""


@dataclass
class ShardedStepPlan:
    """A steady-state sharded step: the units, the parameters outside them (always reduce-scattered),
    and the totals (``total``: dAD, as `ShardedStepReport.totals["sent_bytes"]` accounts it)."""

    units: List[ShardedUnitRow]
    dense_params: int
    dense_reduce_scatter: float
    total: float
    reduce_scatter: float
    counts: Dict[str, int] = field(default_factory=dict)


def sharded_steady_state(plan, *, tokens: int, positions: int, world_size: int, mode: str,
                         rank: Optional[int], rank_route: str = DADConfig.rank_route,
                         dtype: torch.dtype = torch.float32, rows: Optional[RowCounts] = None) -> ShardedStepPlan:
    """Bytes one rank sends per unit in a steady-state FSDP2 step (`fsdp.enable_dad_fsdp`): each
    unit's row counts (`router.sharded_needs_counts`) and its route's estimate (`_steady_routes`);
    parameters outside the units, and units routed dense, go through FSDP2's reduce-scatter."""
    s, item = world_size, dtype.itemsize
    config = DADConfig(mode=mode, rank=rank, rank_route=rank_route)
    exchanges_counts = sharded_needs_counts(config, step=config.lossless_steps)  # a steady-state step
    units: List[ShardedUnitRow] = []
    ctx = RouteContext(config, world_size=s, wire_dtype=dtype, sharded=True)
    for u, shape, use, decision, est in _steady_routes(plan, ctx, tokens, positions, rows):
        (m, n), rep = shape.shape, decision.representation
        baseline = reduce_scatter_bytes((m, n), s, item) + sum(reduce_scatter_bytes(tuple(b.param.shape), s, item)
                                                               for b in u.biases)
        counts_exchange = (s - 1) * 8.0 * len(u.uses) if exchanges_counts else 0.0  # whatever the route
        dad = (baseline if rep == DENSE else est[rep]) + counts_exchange
        units.append(ShardedUnitRow(u.name, (m, n), use, rep, dad, baseline, unit_kind(u)))
    dense = sum(reduce_scatter_bytes(tuple(p.shape), s, item) for _, p in plan.dense)
    return ShardedStepPlan(units=units, dense_params=len(plan.dense), dense_reduce_scatter=dense,
                           total=dense + sum(r.dad for r in units),
                           reduce_scatter=dense + sum(r.reduce_scatter for r in units), counts=route_counts(units))


def count_rows(model: torch.nn.Module, plan, inputs: Dict[str, torch.Tensor]) -> RowCounts:
    """Rows per use of every unit of ``plan`` in one step: one forward and backward of ``inputs``
    with the plan's captures enabled, each use's rows summed over its calls (a pair's left block
    has one row per row: output-gradient rows, input rows or token ids, whatever the layout).

    On the meta device nothing is computed; where a capture drops rows by value (an embedding's
    padding rows) the meta tensors count them all: the dummy batch holds no padding.
    """
    out = model(**inputs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    try:  # masks on meta tensors (embedding padding): assume every element is kept
        import torch.fx.experimental._config as fx_config
        keep_all = fx_config.patch(meta_nonzero_assume_all_nonzero=True)
    except (ImportError, AttributeError):  # pragma: no cover - older torch
        import contextlib
        keep_all = contextlib.nullcontext()
    with keep_all:
        logits.float().sum().backward()
    counted = {u.name: [sum(int(pair[0].shape[0]) for pair in c.pairs) for c in u.uses] for u in plan.units}
    for p in model.parameters():
        p.grad = None
    for c in plan.captures:
        c.clear()
    return counted


def unit_plan(model: torch.nn.Module, *, mode: str, rank: Optional[int], rank_route: str):
    """``model``'s plan (its capture hooks removed: only the units are needed) and dAD's rank under
    ``mode`` (None in mode exact or without a rank)."""
    dad_rank = rank if rank and mode != "exact" else None
    plan = build_plan(model, DADConfig(mode=mode, rank=dad_rank, rank_route=rank_route))
    for c in plan.captures:
        c.remove()
    return plan, dad_rank


def _model_plan(model: torch.nn.Module, tokens_per_rank: int, positions: Optional[int], **route):
    """`unit_plan` for the ``*_model`` wrappers, with the position embeddings' rows (``tokens_per_rank``,
    at most ``positions``): (plan, dAD's rank, position rows)."""
    plan, dad_rank = unit_plan(model, **route)
    return plan, dad_rank, min(tokens_per_rank, positions) if positions else tokens_per_rank


def plan_model(model: torch.nn.Module, *, sites: int, tokens_per_rank: int, rank: Optional[int],
               mode: str = "auto", rank_route: str = DADConfig.rank_route, dtype: torch.dtype = torch.float32,
               positions: Optional[int] = None, timing=None, rows: Optional[RowCounts] = None) -> StepPlan:
    """`steady_state` for ``model`` (its plan built, its capture hooks removed); by predicted time
    with a ``timing``; with counted ``rows`` (`forward_rows`) instead of the text formula."""
    if mode == "rank" and not rank:
        raise ValueError("--mode rank needs a rank (--rank >= 1)")
    plan, dad_rank, seq = _model_plan(model, tokens_per_rank, positions, mode=mode, rank=rank, rank_route=rank_route)
    return steady_state(plan, tokens=tokens_per_rank, positions=seq, world_size=sites, mode=mode,
                        rank=dad_rank, rank_route=rank_route, dtype=dtype, powersgd_rank=rank or None,
                        timing=timing, rows=rows)


# -- output -------------------------------------------------------------------------------------------
def _mb(b: Optional[float]) -> str:
    return "-" if b is None else f"{b / 2 ** 20:,.2f}"


def _table(header: str, columns: Sequence[Tuple[str, int]], units: Sequence[Sequence[str]], total: Sequence[str],
           footer: Sequence[str]) -> str:
    """A plan as text: the name column, then ``columns`` (title, width; right-aligned but for the
    kind and the routes), one line per factor unit (and the other parameters), a rule and the totals."""
    name_w = max(len(u[0]) for u in list(units) + [total])

    def line(cells: Sequence[str]) -> str:
        out = [f"{cells[0]:<{name_w}}"]
        for (title, width), cell in zip(columns, cells[1:]):
            out.append(f"{cell:<{width}}" if title == "kind" or "route" in title else f"{cell:>{width}}")
        return "  ".join(out)

    head = line(["layer"] + [title for title, _ in columns])
    rule = "-" * len(head)
    return "\n".join([header, "", head, rule] + [line(u) for u in units] + [rule, line(total), ""]
                     + list(footer))


def _step_table(step, header: str, other: Tuple[str, str, float], baselines: Sequence[Tuple[str, int, str]],
                footer: Sequence[str]) -> str:
    """`render`'s and `render_sharded`'s table: per factor unit its kind, rows (``-`` without uses:
    its dense gradient is routed), dAD's route and MB, then each of ``baselines`` (title, width, the
    attribute of the rows and, ``dense_`` before it, of the plan); then the parameters outside the
    units (``other``: their label, numel and dAD's bytes) and the totals."""
    attrs = [a for _, _, a in baselines]
    columns = [("kind", max([len(r.kind) for r in step.units] + [5])), ("shape", 12), ("rows", 11), ("route", 14),
               ("dAD MB", 10), *[(title, width) for title, width, _ in baselines]]
    units = [[r.name, r.kind, "x".join(map(str, r.shape)), "+".join(map(str, r.rows)) or "-", r.route, _mb(r.dad),
              *[_mb(getattr(r, a)) for a in attrs]] for r in step.units]
    label, numel, dad = other
    units.append([f"{label} ({step.dense_params})", DENSE, numel, "", DENSE, _mb(dad),
                  *[_mb(getattr(step, "dense_" + a)) for a in attrs]])
    total = ["total", "", "", "", "", _mb(step.total), *[_mb(getattr(step, a)) for a in attrs]]
    return _table(header, columns, units, total, footer)


def render(step: StepPlan, header: str) -> str:
    """The plan as a text table, one line per factor unit, then the dense parameters and totals."""
    c = step.counts
    footer = [f"routes: {c[EXACT]} exact, {c[RANK]} rank (all-gather), "
              f"{c[RANK_ALLREDUCE]} rank (all-reduce), {c[DENSE]} dense",
              f"dAD / all-reduce: {step.total / step.allreduce:.4f}"
              + ("" if step.powersgd is None else f"; PowerSGD / all-reduce: {step.powersgd / step.allreduce:.4f}")]
    return _step_table(step, header, ("dense parameters", f"{step.dense_param_numel:,} el", step.dense_dad),
                       [("all-reduce MB", 13, "allreduce"), ("PowerSGD MB", 11, "powersgd")], footer)


def render_sharded(step: ShardedStepPlan, header: str) -> str:
    """The sharded plan as a text table: per factor unit, dAD's route and bytes beside FSDP2's
    reduce-scatter; then the other parameters and the totals."""
    footer = ["routes: " + ", ".join(f"{v} {k}" for k, v in sorted(step.counts.items())),
              f"dAD / reduce-scatter: {step.total / step.reduce_scatter:.4f}"]
    return _step_table(step, header, ("other parameters", "", step.dense_reduce_scatter),
                       [("reduce-scatter MB", 17, "reduce_scatter")], footer)


def plan_sharded_model(model: torch.nn.Module, *, sites: int, tokens_per_rank: int, rank: Optional[int],
                       mode: str = "auto", rank_route: str = DADConfig.rank_route,
                       dtype: torch.dtype = torch.float32, positions: Optional[int] = None,
                       rows: Optional[RowCounts] = None) -> ShardedStepPlan:
    """`sharded_steady_state` for ``model`` (its plan built, its capture hooks removed)."""
    plan, dad_rank, seq = _model_plan(model, tokens_per_rank, positions, mode=mode, rank=rank, rank_route=rank_route)
    return sharded_steady_state(plan, tokens=tokens_per_rank, positions=seq, world_size=sites, mode=mode,
                                rank=dad_rank, rank_route=rank_route, dtype=dtype, rows=rows)


# -- a stated compute model ------------------------------------------------------------------------------
def stated_compute(shapes, *, rank: Optional[int], world_size: int, iterations: int, error_feedback: bool,
                   itemsize: int, flops: float, memory_bw: float) -> ComputeModel:
    """A compute model from a stated device instead of a measured one: each route's local work
    (`routing.compute_model`'s flops and passes over the ``m n`` matrix) at the slower of ``flops``
    per second and ``memory_bw`` bytes per second (a roofline). No kernel launches, no capture hooks:
    a lower bound, for planning a device one does not have at hand."""
    def roof(flop_count: float, passes: float, mn: int) -> float:
        return max(flop_count / flops, passes * mn * itemsize / memory_bw)

    k, ef = iterations, error_feedback
    costs: Dict[Tuple[int, int], ShapeCosts] = {}
    for m, n in sorted(set(tuple(s) for s in shapes)):
        mn, r = m * n, min(rank or 0, m, n)
        # both rank routes: k rounds of M Q and M^T P (a pass each); with error feedback the
        # compensation M = G + E and the residual's update E = M - P Q^T (3 passes each)
        shared = roof(4 * k * mn * r, 2 * k + (6 if ef else 0), mn)
        costs[(m, n)] = ShapeCosts(
            rank_allreduce=shared + roof(2 * mn * r, 1, mn) if r else 0.0,           # the rebuild P Q^T
            # the rank-S r rebuild; with error feedback, the residual's own product P Q^T first
            rank=shared + roof(2 * (world_size + int(ef)) * r * mn, 1 + int(ef), mn) if r else 0.0,
            exact_per_row=max(2 * mn / flops, (m + n) * itemsize / memory_bw))       # its GEMM, per row
    return ComputeModel(costs)


# -- two levels: nodes of several ranks ------------------------------------------------------------------
BANDWIDTHS = (1e5, 1e14)   # bytes per second a break-even is searched in (0.8 Mbit/s to 800 Tbit/s)


@dataclass
class LevelUnitRow:
    """One factor unit of a cluster's steady-state step, flat and at two levels (`plan_levels`).
    Bytes: what one rank sends on each hop (``between``: the unit's owner, hence its node);
    ``flat_bytes``: one rank on the flat route, and as much leaves each node (a ring over the ranks
    in node order crosses between nodes once per node). Seconds: the unit's predicted share of the
    step (at two levels the owners' share, `TwoLevelTiming.seconds`)."""

    name: str
    shape: Tuple[int, int]
    flat_route: str
    flat_bytes: float
    flat_seconds: float
    route: str
    to_owner: float
    between: float
    from_owner: float
    seconds: float
    compresses_below: Optional[float]   # inter-node bytes/s below which it compresses (inf: any; None: never)


@dataclass
class LevelPlan:
    """A cluster's steady-state step: per unit `LevelUnitRow`; ``flat`` and ``two_level``, the
    predicted seconds dAD compares (`routing.two_level.compare_levels`, factor units only);
    ``all_dense`` and ``compressed``, every unit at two levels dense (a hierarchical all-reduce) or
    on its route of fewest bytes between nodes; ``break_even``, the inter-node bytes/s below which
    ``compressed`` beats ``all_dense``; ``node_bytes``, bytes one node sends between nodes per step."""

    nodes: int
    local_size: int
    units: List[LevelUnitRow]
    flat: float
    two_level: float
    two_level_faster: bool
    all_dense: float
    compressed: float
    break_even: Optional[float]
    node_bytes: Dict[str, Optional[float]]


def with_bandwidth(link: LinkModel, bandwidth: float) -> LinkModel:
    """``link`` with every kind's bandwidth set to ``bandwidth`` (latencies kept)."""
    return LinkModel(*(LinkCost(getattr(link, k).alpha, bandwidth) for k in KINDS), measured=link.measured)


def break_even_bandwidth(pays: Callable[[float], bool], bounds: Tuple[float, float] = BANDWIDTHS,
                         steps: int = 60) -> Optional[float]:
    """The bandwidth below which ``pays`` holds, by bisection on its logarithm within ``bounds``
    (``pays`` must hold below some bandwidth and not above it); inf where it holds at the top,
    None where it fails at the bottom."""
    lo, hi = bounds
    if pays(hi):
        return float("inf")
    if not pays(lo):
        return None
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if pays(mid) else (lo, mid)
    return math.sqrt(lo * hi)


def _inter_break_even(timing: TwoLevelTiming, pays: Callable[[TwoLevelTiming], bool]) -> Optional[float]:
    """`break_even_bandwidth` of ``pays`` on ``timing`` with each bandwidth between nodes."""
    return break_even_bandwidth(
        lambda beta: pays(dataclasses.replace(timing, inter=with_bandwidth(timing.inter, beta))))


def _unit_break_even(config: DADConfig, unit: LevelUnit, node_rows, *, step: int, topology: Topology,
                     timing: TwoLevelTiming) -> Optional[float]:
    """Inter-node bandwidth below which ``unit`` leaves dense at two levels (by time)."""
    def compresses(at: TwoLevelTiming) -> bool:
        rep, _, _ = choose_two_level(config, unit.shape, node_rows, step=step, nodes=topology.num_nodes,
                                     local_size=topology.local_size, wire_dtype=unit.wire_dtype, timing=at,
                                     dense_only=unit.dense_only)
        return rep != DENSE

    return _inter_break_even(timing, compresses)


def _step_break_even(pairs, timing: TwoLevelTiming, local_size: int) -> Tuple[float, float, Optional[float]]:
    """Seconds of every unit dense and compressed at two levels, on ``timing``, and the inter-node
    bandwidth below which compressed is faster. ``pairs``: per unit ``(unit, node_rows, dense
    hops, compressed route, its hops)``."""
    def seconds(at: TwoLevelTiming) -> Tuple[float, float]:
        dense = sum(at.seconds(DENSE, d, u.shape, rows, local_size) for u, rows, d, _, _ in pairs)
        packed = sum(at.seconds(rep, h, u.shape, rows, local_size) for u, rows, _, rep, h in pairs)
        return dense, packed

    def pays(at: TwoLevelTiming) -> bool:
        dense, packed = seconds(at)
        return packed < dense

    return (*seconds(timing), _inter_break_even(timing, pays))


def plan_levels(plan, *, tokens: int, positions: int, nodes: int, local_size: int, mode: str,
                rank: Optional[int], intra: LinkModel, inter: LinkModel, compute: ComputeModel,
                rank_route: str = DADConfig.rank_route, dtype: torch.dtype = torch.float32,
                powersgd_rank: Optional[int] = None, rows: Optional[RowCounts] = None) -> LevelPlan:
    """A steady-state step of ``plan`` on ``nodes`` nodes of ``local_size`` ranks, with ``intra``
    and ``inter`` as a job's ``link: {"intra": ..., "inter": ...}`` states them (``inter``: each
    rank's share of the link between nodes, every rank sending at once) and ``compute``: each
    unit's route flat and at two levels, and whether the step runs at two levels, as the
    synchroniser decides it (`routing.two_level.compare_levels`); the break-even bandwidths; and
    the bytes one node sends between nodes for all-reduce, PowerSGD (``powersgd_rank``, default
    ``rank``) and dAD."""
    topology = Topology.consecutive(nodes * local_size, local_size, 0)
    s, item = topology.world_size, dtype.itemsize
    config = DADConfig(mode=mode, rank=rank, rank_route=rank_route, objective="time")
    step = max(config.lossless_steps, 1)  # a steady-state step: rank routes allowed
    units = [LevelUnit(UnitShape.of(u, dtype), [unit_rows(u, tokens, positions, rows)] * s, dtype) for u in plan.units]
    timing = TwoLevelTiming(intra, inter, compute)
    levels = compare_levels(config, units, step=step, topology=topology, flat_timing=StepTiming(inter, compute),
                            timing=timing)
    by_bytes = dataclasses.replace(config, objective="bytes")
    cache: Dict[tuple, Optional[float]] = {}  # units of one shape and rows share their break-even
    pairs, out = [], []
    args = dict(nodes=nodes, local_size=local_size, config=config, wire_dtype=dtype)
    for u, unit, c in zip(plan.units, units, levels.units):
        key = (unit.shape, tuple(map(tuple, c.node_rows or ())))
        if key not in cache:
            cache[key] = _unit_break_even(config, unit, c.node_rows, step=step, topology=topology, timing=timing)
        rep, hops, _ = choose_two_level(by_bytes, unit.shape, c.node_rows, step=step, nodes=nodes,
                                        local_size=local_size, wire_dtype=dtype, timing=None)
        pairs.append((unit, c.node_rows, hop_bytes(DENSE, unit.shape, c.node_rows, **args), rep, hops[rep]))
        h = c.hops
        out.append(LevelUnitRow(u.name, u.shape, c.flat_route, c.flat_bytes, c.flat_seconds, c.route, h.to_owner,
                                h.between, h.from_owner, c.seconds, cache[key]))
    all_dense, compressed, break_even = _step_break_even(pairs, timing, local_size)
    return LevelPlan(nodes, local_size, out, levels.flat, levels.two_level, levels.two_level_faster, all_dense,
                     compressed, break_even,
                     _node_bytes(plan, levels, pairs, nodes=nodes, sites=s, item=item,
                                 powersgd_rank=powersgd_rank if powersgd_rank is not None else rank))


def _node_bytes(plan, levels, pairs, *, nodes: int, sites: int, item: int,
                powersgd_rank: Optional[int]) -> Dict[str, Optional[float]]:
    """Bytes one node sends between nodes per step, by method. A flat collective is counted as a
    ring over the ranks in node order, which leaves each node once: a node sends what one rank
    sends. At two levels, each unit's owner sends its node's share (hop 2). The parameters outside
    the units are all-reduced dense by every method (flat, or between nodes at two levels)."""
    params = [q for u in plan.units for q in u.params] + [p for _, p in plan.dense]
    numel = sum(q.numel() for q in params)
    dense_numel = sum(p.numel() for _, p in plan.dense)
    return {"allreduce": ring_allreduce_bytes(numel * item, sites),
            "powersgd": _powersgd(params, powersgd_rank, sites, item),
            "dad_flat": sum(c.flat_bytes for c in levels.units) + ring_allreduce_bytes(dense_numel * item, sites),
            "allreduce_two_level": sum(d.between for _, _, d, _, _ in pairs)
            + ring_allreduce_bytes(dense_numel * item, nodes),
            "dad_two_level": sum(c.hops.between for c in levels.units) + ring_allreduce_bytes(dense_numel * item, nodes)}


def plan_levels_model(model: torch.nn.Module, *, nodes: int, local_size: int, tokens_per_rank: int,
                      rank: Optional[int], intra: LinkModel, inter: LinkModel, compute: ComputeModel,
                      mode: str = "auto", rank_route: str = DADConfig.rank_route, dtype: torch.dtype = torch.float32,
                      positions: Optional[int] = None, rows: Optional[RowCounts] = None) -> LevelPlan:
    """`plan_levels` for ``model`` (its plan built, its capture hooks removed)."""
    plan, dad_rank, seq = _model_plan(model, tokens_per_rank, positions, mode=mode, rank=rank, rank_route=rank_route)
    return plan_levels(plan, tokens=tokens_per_rank, positions=seq, nodes=nodes, local_size=local_size, mode=mode,
                       rank=dad_rank, intra=intra, inter=inter, compute=compute, rank_route=rank_route, dtype=dtype,
                       powersgd_rank=rank or None, rows=rows)


def _gbit(b: Optional[float], never: str = "never", anywhere: str = "any") -> str:
    """A bandwidth in Gbit/s, three digits or whole ones; ``anywhere`` for inf, ``never`` for None."""
    if b is None:
        return never
    if b == float("inf"):
        return anywhere
    g = b * 8 / 1e9
    return f"{g:,.0f}" if g >= 1000 else f"{g:.3g}"


def render_levels(lp: LevelPlan, header: str) -> str:
    """The two-level plan as text: per factor unit the flat and two-level routes, MB and ms, and
    the bandwidth below which it compresses between nodes; then the steps and the bytes per node."""
    columns = [("shape", 12), ("flat route", 14), ("flat MB", 9), ("flat ms", 8), ("route", 14), ("to owner MB", 11),
               ("between MB", 10), ("from owner MB", 13), ("ms", 7), ("compress below", 14)]
    units = [[r.name, "x".join(map(str, r.shape)), r.flat_route, _mb(r.flat_bytes), _ms(r.flat_seconds), r.route,
              _mb(r.to_owner), _mb(r.between), _mb(r.from_owner), _ms(r.seconds), _gbit(r.compresses_below)]
             for r in lp.units]
    total = ["total", "", "", _mb(sum(r.flat_bytes for r in lp.units)), _ms(lp.flat), "",
             _mb(sum(r.to_owner for r in lp.units)), _mb(sum(r.between for r in lp.units)),
             _mb(sum(r.from_owner for r in lp.units)), _ms(lp.two_level), ""]
    counts = route_counts(lp.units, BUILT_IN)
    nb = lp.node_bytes
    by_node = [("all-reduce, flat", nb["allreduce"]), ("PowerSGD, flat", nb["powersgd"]),
               ("dAD, flat routes", nb["dad_flat"]), ("all-reduce, two levels (hierarchical)", nb["allreduce_two_level"]),
               ("dAD, two levels", nb["dad_two_level"])]
    label_w = max(len(k) for k, _ in by_node)
    footer = [
        "routes at two levels: " + ", ".join(f"{v} {k}" for k, v in counts.items()),
        f"predicted step of the factor units: flat {_ms(lp.flat)} ms, two levels {_ms(lp.two_level)} ms: "
        f"dAD runs {'two levels' if lp.two_level_faster else 'flat'}",
        f"at two levels, every unit dense (a hierarchical all-reduce) {_ms(lp.all_dense)} ms, every unit on its "
        f"route of fewest bytes between nodes {_ms(lp.compressed)} ms",
        "break-even: two-level compressed routes beat hierarchical dense "
        + rate_below(lp.break_even, "at no inter-node bandwidth", "at any inter-node bandwidth", " between nodes"),
        "",
        "MB one node sends between nodes per step (flat: a ring over the ranks in node order, which leaves each "
        "node once):"]
    footer += [f"  {k:<{label_w}}  {_mb(v):>10}" for k, v in by_node]
    return _table(header, columns, units, total, footer)


def _ms(s: Optional[float]) -> str:
    return "-" if s is None else f"{s * 1e3:,.2f}"


def rate_below(b: Optional[float], never: str, anywhere: str, unit: str = "") -> str:
    """A break-even bandwidth as text: ``never`` for None, ``anywhere`` for inf, else "below ..."."""
    return _gbit(b, never, anywhere) if b is None or b == float("inf") else f"below {_gbit(b)} Gbit/s{unit}"
