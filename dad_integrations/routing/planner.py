"""The planner's library: a model's steady-state step, layer by layer, before any launch.

From the synchroniser's own plan (`capture.units.build_plan`), router (`routing.router.route`) and
cost model (`routing.costs`): per factor unit, the route dAD takes after the first (checked) step
and the bytes one rank sends, beside dense all-reduce and PyTorch's PowerSGD hook at the same rank
(`steady_state`; FSDP2's reduce-scatter for `sharded_steady_state`). Rows per step come from the
text formula (`use_rows`) or from a counted forward and backward (`count_rows`). The command line
(`python -m dad_integrations.plan`) builds the model and prints `render`'s tables.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from dad_integrations.capture.assign import build_plan
from dad_integrations.comm.aggregator import ring_allreduce_bytes
from dad_integrations.config import DADConfig
from dad_integrations.routing.costs import powersgd_bytes, reduce_scatter_bytes, size_exchange_bytes
from dad_integrations.routing.router import UnitShape, RouteContext, UnitEvidence, route, sharded_needs_counts, unit_estimates


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


def steady_state(plan, *, tokens: int, positions: int, world_size: int, mode: str, rank: Optional[int],
                 rank_route: str = DADConfig.rank_route, dtype: torch.dtype = torch.float32,
                 powersgd_rank: Optional[int] = None, timing=None, rows: Optional[RowCounts] = None) -> StepPlan:
    """Bytes one rank sends per unit in a steady-state step of ``mode`` (the router's decision from
    the counts of the unit's last size exchange), with ``tokens`` rows per captured call, or the
    counted ``rows`` per use (`count_rows`) where given.

    Size exchanges count where the route needs agreed rows; biases of rank-r and dense units go to
    the dense buckets, as the synchroniser sends them (a step where every rank has every gradient
    needs no flags: `codecs.dense`). ``powersgd_rank``
    (default ``rank``) adds PyTorch's PowerSGD hook per parameter; None when neither is set.
    With a ``timing`` (`timing.StepTiming`), routes are chosen by predicted time (objective
    ``"time"``), else by bytes.
    """
    s, item = world_size, dtype.itemsize
    config = DADConfig(mode=mode, rank=rank, rank_route=rank_route,
                       objective="time" if timing is not None else "bytes")
    psgd_rank = powersgd_rank if powersgd_rank is not None else rank

    def psgd(params) -> Optional[float]:
        if not psgd_rank:
            return None
        return sum(powersgd_bytes(tuple(p.shape), psgd_rank, s, item)[0] for p in params)

    counts = {"exact": 0, "rank": 0, "rank_allreduce": 0, "dense": 0}
    units: List[UnitRow] = []
    sent = 0.0  # everything but the dense buckets
    dense_param_numel = sum(p.numel() for _, p in plan.dense)
    dense_numel, dense_items = dense_param_numel, len(plan.dense)
    for u in plan.units:
        m, n = u.shape  # the matrix view: a convolution's (out, in x kernel)
        bias_numel = u.bias_numel
        shape = UnitShape(tuple(u.kinds), (m, n), bias_numel, dtype, u.blocks)
        use = unit_rows(u, tokens, positions, rows)
        rows_by_rank = [use] * s
        ctx = RouteContext(config, world_size=s, wire_dtype=dtype, timing=timing)
        decision = route(ctx, shape, UnitEvidence(last_rows=rows_by_rank))
        exchange = decision.exchange_sizes
        if decision.representation is None:  # decided on this step's counts, the same in steady state
            decision = route(ctx, shape, UnitEvidence(rows_by_rank=rows_by_rank))
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
        units.append(UnitRow(u.name, (m, n), use, rep, exchange,
                             own + ring_allreduce_bytes(d_numel * item, s),
                             ring_allreduce_bytes((m * n + bias_numel) * item, s), psgd(params),
                             d_numel, d_items, unit_kind(u)))
    total = sent
    if dense_items:
        total += ring_allreduce_bytes(dense_numel * item, s)
    dense_params = [p for _, p in plan.dense]
    dense_psgd = psgd(dense_params)
    unit_psgd = [r.powersgd for r in units]
    return StepPlan(
        units=units, dense_params=len(plan.dense), dense_param_numel=dense_param_numel,
        dense_dad=ring_allreduce_bytes(dense_param_numel * item, s),
        dense_allreduce=ring_allreduce_bytes(dense_param_numel * item, s), dense_powersgd=dense_psgd,
        dense_numel=dense_numel, dense_items=dense_items, total=total,
        allreduce=ring_allreduce_bytes((dense_param_numel + sum(m * n for m, n in (r.shape for r in units))
                                        + sum(u.bias_numel for u in plan.units)) * item, s),
        powersgd=None if dense_psgd is None else dense_psgd + sum(unit_psgd), counts=counts)


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
    """Bytes one rank sends per unit in a steady-state FSDP2 step (`fsdp.enable_dad_fsdp`): every
    unit's rows are exchanged each backward (`codecs.sharded_exact.exchange_row_counts`; not in
    mode ``"rank"``, `router.sharded_needs_counts`), the router decides with ``sharded=True`` on
    those counts, and the route's estimate is what the unit sends; parameters outside the units, and units routed dense, go through FSDP2's
    reduce-scatter (`costs.reduce_scatter_bytes`, in ``dtype``)."""
    s, item = world_size, dtype.itemsize
    config = DADConfig(mode=mode, rank=rank, rank_route=rank_route)
    exchanges_counts = sharded_needs_counts(config, step=config.lossless_steps)  # a steady-state step
    counts: Dict[str, int] = {}
    units: List[ShardedUnitRow] = []
    for u in plan.units:
        m, n = u.shape
        shape = UnitShape(tuple(u.kinds), (m, n), u.bias_numel, dtype, u.blocks)
        use = unit_rows(u, tokens, positions, rows)
        rows_by_rank = [use] * s
        ctx = RouteContext(config, world_size=s, wire_dtype=dtype, sharded=True)
        rep = route(ctx, shape, UnitEvidence(rows_by_rank=rows_by_rank)).representation
        est = unit_estimates(config, shape, rows_by_rank, s, dtype, sharded=True)
        counts[rep] = counts.get(rep, 0) + 1
        baseline = reduce_scatter_bytes((m, n), s, item) + sum(reduce_scatter_bytes(tuple(b.param.shape), s, item)
                                                               for b in u.biases)
        counts_exchange = (s - 1) * 8.0 * len(u.uses) if exchanges_counts else 0.0  # whatever the route
        dad = (baseline if rep == "dense" else est[rep]) + counts_exchange
        units.append(ShardedUnitRow(u.name, (m, n), use, rep, dad, baseline, unit_kind(u)))
    dense = sum(reduce_scatter_bytes(tuple(p.shape), s, item) for _, p in plan.dense)
    return ShardedStepPlan(units=units, dense_params=len(plan.dense), dense_reduce_scatter=dense,
                           total=dense + sum(r.dad for r in units),
                           reduce_scatter=dense + sum(r.reduce_scatter for r in units), counts=counts)


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


def plan_model(model: torch.nn.Module, *, sites: int, tokens_per_rank: int, rank: Optional[int],
               mode: str = "auto", rank_route: str = DADConfig.rank_route, dtype: torch.dtype = torch.float32,
               positions: Optional[int] = None, timing=None, rows: Optional[RowCounts] = None) -> StepPlan:
    """`steady_state` for ``model`` (its plan built, its capture hooks removed); by predicted time
    with a ``timing``; with counted ``rows`` (`forward_rows`) instead of the text formula."""
    if mode == "rank" and not rank:
        raise ValueError("--mode rank needs a rank (--rank >= 1)")
    dad_rank = rank if rank and mode != "exact" else None
    plan = build_plan(model, DADConfig(mode=mode, rank=dad_rank, rank_route=rank_route))
    for c in plan.captures:
        c.remove()  # only the plan is needed, not the hooks
    seq = min(tokens_per_rank, positions) if positions else tokens_per_rank
    return steady_state(plan, tokens=tokens_per_rank, positions=seq, world_size=sites, mode=mode,
                        rank=dad_rank, rank_route=rank_route, dtype=dtype, powersgd_rank=rank or None,
                        timing=timing, rows=rows)


# -- output -------------------------------------------------------------------------------------------
def _mb(b: Optional[float]) -> str:
    return "-" if b is None else f"{b / 2 ** 20:,.2f}"


def _table(header: str, columns: Sequence[Tuple[str, int]], units: Sequence[Sequence[str]],
           other: Sequence[str], total: Sequence[str], footer: Sequence[str]) -> str:
    """A plan as text: the name column, then ``columns`` (title, width; right-aligned but for the
    kind and the route), one line per factor unit, the other parameters, a rule and the totals."""
    name_w = max([len(u[0]) for u in units] + [len(other[0])])

    def line(cells: Sequence[str]) -> str:
        out = [f"{cells[0]:<{name_w}}"]
        for (title, width), cell in zip(columns, cells[1:]):
            out.append(f"{cell:<{width}}" if title in ("route", "kind") else f"{cell:>{width}}")
        return "  ".join(out)

    head = line(["layer"] + [title for title, _ in columns])
    rule = "-" * len(head)
    return "\n".join([header, "", head, rule] + [line(u) for u in units] + [line(other), rule, line(total), ""]
                     + list(footer))


def _kind_width(units) -> int:
    return max([len(r.kind) for r in units] + [5])


def _rows(rows: Sequence[int]) -> str:
    """Rows per use, ``+``-joined; ``-`` for a unit without uses (its dense gradient is routed)."""
    return "+".join(map(str, rows)) if rows else "-"


def render(step: StepPlan, header: str) -> str:
    """The plan as a text table, one line per factor unit, then the dense parameters and totals."""
    columns = [("kind", _kind_width(step.units)), ("shape", 12), ("rows", 11), ("route", 14), ("dAD MB", 10),
               ("all-reduce MB", 13), ("PowerSGD MB", 11)]
    units = [[r.name, r.kind, "x".join(map(str, r.shape)), _rows(r.rows), r.route, _mb(r.dad), _mb(r.allreduce),
              _mb(r.powersgd)] for r in step.units]
    other = [f"dense parameters ({step.dense_params})", "dense", f"{step.dense_param_numel:,} el", "", "dense",
             _mb(step.dense_dad), _mb(step.dense_allreduce), _mb(step.dense_powersgd)]
    total = ["total", "", "", "", "", _mb(step.total), _mb(step.allreduce), _mb(step.powersgd)]
    c = step.counts
    footer = [f"routes: {c['exact']} exact, {c['rank']} rank (all-gather), "
              f"{c['rank_allreduce']} rank (all-reduce), {c['dense']} dense",
              f"dAD / all-reduce: {step.total / step.allreduce:.4f}"
              + ("" if step.powersgd is None else f"; PowerSGD / all-reduce: {step.powersgd / step.allreduce:.4f}")]
    return _table(header, columns, units, other, total, footer)


def render_sharded(step: ShardedStepPlan, header: str) -> str:
    """The sharded plan as a text table: per factor unit, dAD's route and bytes beside FSDP2's
    reduce-scatter; then the other parameters and the totals."""
    columns = [("kind", _kind_width(step.units)), ("shape", 12), ("rows", 11), ("route", 14), ("dAD MB", 10),
               ("reduce-scatter MB", 17)]
    units = [[r.name, r.kind, "x".join(map(str, r.shape)), _rows(r.rows), r.route, _mb(r.dad),
              _mb(r.reduce_scatter)] for r in step.units]
    other = [f"other parameters ({step.dense_params})", "dense", "", "", "dense", _mb(step.dense_reduce_scatter),
             _mb(step.dense_reduce_scatter)]
    total = ["total", "", "", "", "", _mb(step.total), _mb(step.reduce_scatter)]
    footer = ["routes: " + ", ".join(f"{v} {k}" for k, v in sorted(step.counts.items())),
              f"dAD / reduce-scatter: {step.total / step.reduce_scatter:.4f}"]
    return _table(header, columns, units, other, total, footer)


def plan_sharded_model(model: torch.nn.Module, *, sites: int, tokens_per_rank: int, rank: Optional[int],
                       mode: str = "auto", rank_route: str = DADConfig.rank_route,
                       dtype: torch.dtype = torch.float32, positions: Optional[int] = None,
                       rows: Optional[RowCounts] = None) -> ShardedStepPlan:
    """`sharded_steady_state` for ``model`` (its plan built, its capture hooks removed)."""
    dad_rank = rank if rank and mode != "exact" else None
    plan = build_plan(model, DADConfig(mode=mode, rank=dad_rank, rank_route=rank_route))
    for c in plan.captures:
        c.remove()
    seq = min(tokens_per_rank, positions) if positions else tokens_per_rank
    return sharded_steady_state(plan, tokens=tokens_per_rank, positions=seq, world_size=sites, mode=mode,
                                rank=dad_rank, rank_route=rank_route, dtype=dtype, rows=rows)
