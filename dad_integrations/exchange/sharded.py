"""The sharded exchanger: what FSDP2 and DeepSpeed ZeRO-2/3 share when dAD takes their reduce-scatter.

A sharded engine reduces gradients in calls (FSDP2: one per parameter group, ZeRO: one per bucket);
each rank keeps its shard of the average. An adapter hands each call over as two parts composed: its
engine part (`EngineCall`: the units, their rows, the engine's own reduce-scatter, the step's end)
held by a layout part (`ShardedCall`: how each unit's route is exchanged over the region a rank
keeps, `exchange.row_shards`, `partitions`, `replicate_hop`, `node_partitions`), so that engines and
layouts combine freely. `ShardedExchanger.reduce` runs the rest, alike for every engine and layout
and in the same order on every rank:

1. a route trial's dense step (or all dense decided): every weight by the engine's own reduction,
   capture drained, residuals flushed into it unless the trial holds them;
2. each unit's rows; row counts agreed where a route needs them (`router.sharded_needs_counts`);
3. the first call of each unit: do its factors rebuild its local gradient on every rank? A unit
   that fails goes by the engine's reduction for good;
4. per unit, its route (`router.route` with ``sharded=True``, the engine's own byte estimates where
   it has them); a unit leaving the rank routes flushes its error-feedback residual into the
   engine's reduction (`RouteState.flush`);
5. the call's exchanges (the adapter's), then the step's finiteness: once per step, when the
   engine's last reduction is over, the ranks agree whether every local gradient was finite and
   keep the rank routes' residuals and warm starts only if so (`RouteState.end_step`).

It also holds what carries over between steps (the step count, the rank routes' `RouteState`, the
route trial) and shows it through `ShardedFacade`, the adapters' common public face.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from dad_integrations.builtin_routes import DENSE, EXACT
from dad_integrations.capture.hooks import ForwardStartHook
from dad_integrations.capture.rows import Rows, compute_dtype, concat_rows
from dad_integrations.capture.units import FactorUnit
from dad_integrations.codecs.error_feedback import residual_bytes, sharded_residual_note
from dad_integrations.codecs.route_state import STATE_VERSION, RouteState, route_table
from dad_integrations.codecs.sharded_rank import ShardedRankCodec
from dad_integrations.comm.aggregator import FactorAggregator, Traffic
from dad_integrations.comm.errors import note_step
from dad_integrations.config import WIRE_DTYPES, DADConfig
from dad_integrations.exchange.levels import Levels, describe_hops
from dad_integrations.logs import OnceLogger
from dad_integrations.report import ShardedParamReport, ShardedStepReport
from dad_integrations.routes import layouts
from dad_integrations.routes.layouts import RESIDUALS, Layout
from dad_integrations.routes.registry import check_routes, has_codec, is_rank_route, raise_unsupported
from dad_integrations.routing.router import (Route, RouteContext, RowCounts, UnitEvidence, UnitShape, route,
                                             sharded_needs_counts)
from dad_integrations.routing.memory import RankMemory, describe, dtype_name, engine_kind, rank_memory, size
from dad_integrations.routing.sharded_trial import ShardedTrial, agree_on
from dad_integrations.routing.trial import TimedRoutes
from dad_integrations.routing.timing import LinkProbe

log = logging.getLogger(__name__)

Estimates = Tuple[Optional[Dict[str, float]], Optional[Dict[str, float]]]


@dataclass
class CallRoutes:
    """One call's decisions, for the adapter's exchanges: the units that go by exact factors or a
    rank route, with their representation, in the call's order; every other parameter goes by the
    engine's reduction."""

    step: int                                  # 0-based, as the router counts
    counts: Dict[int, RowCounts]               # unit index -> agreed row counts (where exchanged)
    report: ShardedStepReport
    routed: List[Tuple[FactorUnit, str]] = field(default_factory=list)

    @property
    def exact(self) -> List[FactorUnit]:
        return [u for u, rep in self.routed if rep == EXACT]

    @property
    def ranked(self) -> List[Tuple[FactorUnit, str]]:
        return [(u, rep) for u, rep in self.routed if is_rank_route(rep)]

    @property
    def coded(self) -> List[Tuple[FactorUnit, str]]:
        """Units on a route that brings its own codec (`routes.codec`)."""
        return [(u, rep) for u, rep in self.routed if has_codec(rep)]


def filled(entry: ShardedParamReport, *traffic: Traffic, **fields) -> ShardedParamReport:
    """``entry`` with ``fields`` set and each collective's bytes added (the layouts' report entries)."""
    for key, value in fields.items():
        setattr(entry, key, value)
    for t in traffic:
        entry.add_traffic(t)
    return entry


class EngineCall:
    """The engine part of one reduction call: what its engine hands over, whatever the layout (an
    adapter subclasses it; a layout, `ShardedCall`, holds it as ``engine``)."""

    def __init__(self, units: Sequence[FactorUnit] = ()):
        self._units = list(units)

    def units(self) -> List[FactorUnit]:
        """The factor units this call reduces, in its order (dense-only ones included)."""
        return self._units

    def take_pairs(self, unit: FactorUnit, use) -> list:
        """The captured (left, right) pairs of ``use`` that are ready to send (and forget them)."""
        return use.take()

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """The engine's own reduce-scatter of ``inp`` into ``out`` (the row layouts' dense reduction)."""
        raise NotImplementedError

    def at_step_end(self, end: Callable[[], None]) -> None:
        """Run ``end`` once the step's last reduction is over (where the adapter does not call
        `ShardedExchanger.end_rank_step` itself)."""


class ShardedCall:
    """The layout part of one reduction call: how its units' routes are exchanged over the region
    each rank keeps, for the engine part it holds (``engine``; override what applies)."""

    LAYOUT: Layout = layouts.ROW_SHARDS  # the layout its routes run on (`routes.layouts`)

    engine: EngineCall
    aggregator: FactorAggregator               # the call's group
    route_wire: Optional[torch.dtype] = None   # the wire dtype the router counts in

    rows: Dict[int, List[Rows]]                # unit index -> rows per use (`prepare`)

    def prepare(self, rows: Dict[int, List[Rows]]) -> None:
        """This call's rows per unit (``unit.index``), given before any decision is taken."""
        self.rows = rows

    def local_of(self, unit: FactorUnit) -> Optional[torch.Tensor]:
        """The unit's local gradient, where the step's finiteness is read per unit (None: the
        adapter notes the whole call, `RouteState.note_local`)."""
        return None

    def add_residual(self, unit: FactorUnit, residual: torch.Tensor) -> None:
        """Add a flushed residual (``m x n``) to the unit's local gradient, before the engine reduces it."""
        raise NotImplementedError

    def agree_counts(self, units: Sequence[FactorUnit]) -> Tuple[Dict[int, RowCounts], Traffic, int]:
        """Every rank's row counts of ``units`` (one collective): counts, bytes, overhead size."""
        raise NotImplementedError

    def checkable(self, unit: FactorUnit) -> bool:
        """Whether the first call's check applies: the unit may take exact factors."""
        return unit.has_factors

    def verify(self, units: Sequence[FactorUnit]) -> Tuple[List[FactorUnit], Traffic]:
        """Do ``units``' factors rebuild their local gradients on every rank? Returns the failed ones."""
        raise NotImplementedError

    def unit_shape(self, unit: FactorUnit) -> UnitShape:
        raise NotImplementedError

    def leaving(self, units: Sequence[FactorUnit]) -> Optional[Tuple[Dict[int, int], Tuple[int, int]]]:
        """What leaves the engine's own reduction where one of ``units`` takes another route
        (`routing.partial_set`): each unit's bytes there, and the rest's (bytes, tensors); None where
        the engine reduces its dense rest as it is whatever the routes (ZeRO's partitions)."""
        return None

    def estimates(self, unit: FactorUnit, counts: Optional[RowCounts]) -> Estimates:
        """The engine's own byte estimates and ties for ``unit`` (None: the cost model's)."""
        return None, None

    def route(self, ctx: RouteContext, unit: FactorUnit, evidence: UnitEvidence) -> Route:
        """The unit's route (`router.route`; a call whose exchanges differ, as ZeRO's across nodes
        (`exchange.node_partitions`), prices its own)."""
        return route(ctx, self.unit_shape(unit), evidence)

    def reduce_dense(self, report: ShardedStepReport) -> None:
        """Every parameter of the call by the engine's own reduction."""
        raise NotImplementedError

    def exchange(self, routes: CallRoutes) -> None:
        """Run the call's exchanges: exact factors, rank routes, the engine's reduction for the rest."""
        raise NotImplementedError


class ShardedExchanger(TimedRoutes):
    """Routes, checks and rank-route state of one sharded engine's reductions (see the module doc).

    Args:
        config: the dAD config.
        engine: the engine's name in messages (``"FSDP2"``, ``"ZeRO-3"``).
        fallback: what the engine's own reduction is called in messages.
        overhead_names: report names of the ``counts``, ``verify`` and ``finite`` collectives.
        process_rank: this process's rank in the engine's group (rank 0 logs decisions).
        world_size: the engine's group size.
        logger: where its messages go (the adapter's logger: users configure logging by engine).
    """

    def __init__(self, config: DADConfig, *, engine: str, fallback: str,
                 overhead_names: Mapping[str, str], process_rank: int, world_size: int,
                 logger: logging.Logger = log, rank_codec: Optional[ShardedRankCodec] = None):
        self.config, self.engine, self.fallback = config, engine, fallback
        self.names = dict(overhead_names)
        self.process_rank, self.world_size = process_rank, world_size
        self.wire = WIRE_DTYPES[config.wire_dtype]
        # the rank routes' codec (None without a rank; an adapter may bring its own: HSDP's replicate
        # hop, `codecs.replicate_rank`) and their error feedback and warm starts
        self.rank_codec = rank_codec or (ShardedRankCodec(config, self.wire) if config.rank is not None else None)
        self.state: RouteState = self.rank_codec.state if self.rank_codec is not None else RouteState(config)
        self._trial = ShardedTrial(config, f"dAD/{engine}", log_decisions=process_rank == 0)
        self.log = logger
        self.log_once = OnceLogger(logger, f"dAD/{engine}: ", rank=process_rank)  # agreed: rank 0 says it
        self.report: Optional[ShardedStepReport] = None
        self.steps = 0                    # steps begun (a backward that reduces)
        self._verified: set = set()       # units whose first call was checked
        self._rank_touched = False        # this step took a rank route or flushed a residual
        self._units_noted: List[FactorUnit] = []  # the units `say_residuals` counts
        self.residual_bytes_said: Optional[int] = None  # the figure `say_residuals` said
        self.memory: Optional[RankMemory] = None  # what a rank holds (`say_residuals`: the attach line)
        self._params, self._param_itemsize = 0, 4     # the model's, counted at `start`

    @property
    def trial(self) -> ShardedTrial:
        return self._trial

    def start(self, model: torch.nn.Module, aggregator: FactorAggregator, device: torch.device,
              units: Sequence[FactorUnit], link_probe: Optional[LinkProbe] = None, layout: Optional[Layout] = None,
              residual_note: bool = True) -> ForwardStartHook:
        """At attach, on every rank together: check the config's routes run on ``layout`` (the
        engine's calls'), say what error feedback costs beside the shards (rank 0; ``residual_note``
        False: the adapter calls `say_residuals` once it knows where residuals live), and measure
        the models where routes go by time. Returns the forward pre-hook where a step's span for
        route trials starts, ``model``'s forward (the engine's all-gathers included): ``remove()``
        it at detach."""
        if layout is not None:
            check_routes(self.config.routes, layout)
        self._units_noted = list(units)
        trained = [p for p in model.parameters() if p.requires_grad]
        self._params = sum(int(getattr(p, "ds_numel", p.numel())) for p in trained)  # ZeRO-3 empties p.data
        self._param_itemsize = trained[0].element_size() if trained else 4
        if residual_note:
            self.say_residuals(layout or layouts.ROW_SHARDS)
        if link_probe is not None:  # the link routes are timed on, where not the group's own (HSDP)
            self._trial.probe = link_probe
        if units:
            self._trial.start(units, aggregator, device)
        return ForwardStartHook(model, self._trial.forward)

    def say_residuals(self, layout: Layout, owner_of: Optional[Mapping[str, int]] = None) -> Optional[str]:
        """Per rank, what error feedback's residuals will hold (`routing.memory`), in their own dtype
        (the compute dtype: fp32 for bf16 and fp16 weights), where ``layout`` keeps them
        (`routes.layouts.RESIDUALS`): on every rank, or on each weight's owner (``owner_of``: unit
        name -> local index), whose busiest one the figure counts. Where whole residuals exceed
        ``residual_budget``, keeps them at the rank that fits (`RouteState.keep_residuals_at`) and
        rank 0 warns so; else rank 0 warns what whole ones cost (`sharded_residual_note`). Sets
        ``memory`` (the attach line's figures) and ``residual_bytes_said`` (None where nothing is
        said); returns the warning (rank 0)."""
        units = [u for u in self._units_noted if not u.dense_only]
        self.residual_bytes_said = None
        held = units
        if layout.residuals == "owner" and owner_of:
            by_owner: Dict[int, List[FactorUnit]] = {}
            for u in units:
                by_owner.setdefault(owner_of[u.name], []).append(u)
            held = max(by_owner.values(), key=lambda us: (sum(u.shape[0] * u.shape[1] for u in us), -len(us)),
                       default=[])
        itemsize = torch.empty((), dtype=compute_dtype(units[0].param)).element_size() if units else 4
        self.memory = self._memory([u.shape for u in held], [u.shape for u in units if u.has_factors], itemsize,
                                   rows_sharded=layout.residuals == "rows" or self.state.shard is not None)
        if layout.residuals == "rows" or self.state.shard is not None:
            return None  # sharded like the gradient (HSDP's replicate hop): nothing beyond the engine's
        mem, note = self.memory, None
        if mem.fitted:
            self.state.keep_residuals_at(mem.residual_rank)
            self.residual_bytes_said = mem.residuals
            note = (f"whole {dtype_name(itemsize)} error-feedback residuals would hold {size(mem.whole_residuals)} a "
                    f"rank, over 'residual_budget' ({self.config.residual_budget:g}x the rank's engine state, "
                    f"{size(mem.budget)}): each is kept as its rank-{mem.residual_rank} part, {size(mem.residuals)} "
                    f"a rank ('error_feedback_rank' chooses the rank; 'residual_budget' the bound)")
        else:
            note = sharded_residual_note(self.config, [u.shape for u in units], self.world_size, itemsize,
                                         held=[u.shape for u in held],
                                         where=RESIDUALS[layout.residuals].replace("`", ""))
            if note is not None:
                self.residual_bytes_said = residual_bytes([u.shape for u in held], itemsize=itemsize)
        if note is not None and self.process_rank == 0:
            self.log.warning("dAD/%s: %s", self.engine, note)
            return note
        return None

    @property
    def memory_line(self) -> Optional[str]:
        """The attach line of what a rank holds (`routing.memory.describe`; None before `say_residuals`)."""
        return None if self.memory is None else describe(self.memory)

    def _memory(self, held: List[Tuple[int, int]], captured: List[Tuple[int, int]], itemsize: int,
                rows_sharded: bool) -> RankMemory:
        """`routing.memory.rank_memory` of this engine: ``held`` the shapes whose residuals a rank
        keeps (each its ``1/L`` under HSDP, ``rows_sharded``), ``captured`` those with rows."""
        cfg, shard = self.config, self.state.shard
        width = shard[1] if shard is not None else self.world_size
        return rank_memory(engine_kind(self.engine), params=self._params, world_size=self.world_size,
                           state_world_size=width, routed=held, captured=captured,
                           rank=None if cfg.mode == "exact" else cfg.rank, error_feedback=cfg.error_feedback,
                           error_feedback_rank=cfg.error_feedback_rank, residual_budget=cfg.residual_budget,
                           param_itemsize=self._param_itemsize, residual_itemsize=itemsize,
                           residual_share=1.0 / width if rows_sharded else 1.0, warm_start=cfg.warm_start)

    def describe_hops(self, aggregator: FactorAggregator, levels: Optional[Levels] = None,
                      two_level: Optional[bool] = None, layout: Optional[str] = None) -> str:
        """The attach line of the job's nodes and links (`exchange.levels.describe_hops`)."""
        timing = self._trial.timing
        return describe_hops(self.config, aggregator, levels, timing.link if timing is not None else None,
                             two_level=two_level, layout=layout)

    def trial_end(self, aggregator: FactorAggregator, device: torch.device) -> Callable[[], None]:
        """What ends the open step's route-trial span, for the adapter to run where every rank
        agrees that the step's last reduction is over (a collective may run)."""
        step, report, end = self.steps - 1, self.report, self._trial.end

        def run() -> None:
            if report is not None:  # what users see of the step's routes (rank 0); the link a mode's
                # cost is priced on, where none is modelled, measured here (on every rank alike)
                self._trial.note_report(step, report.params,
                                        probe=lambda: self._trial.measure_link(aggregator, device))
            end(step, agree_on(aggregator, device))
        return run

    # -- a step -----------------------------------------------------------------------------------
    def begin_step(self) -> ShardedStepReport:
        """The step's first reduction call: a new report, nothing pending in the rank routes (a step
        that never reached its end leaves no trace), the route trial's step opened, the step noted
        for the messages of collectives that fail in it (`comm.errors.note_step`)."""
        self.steps += 1
        note_step(self.steps - 1)
        timing = self._trial.timing
        self.report = ShardedStepReport(self.steps, self.world_size, decision=self._trial.decision,
                                        links={"flat": timing.link.brief()} if timing is not None else {})
        self.state.start_step()
        self._rank_touched = False
        self._trial.open(self.steps - 1)
        return self.report

    def end_rank_step(self, aggregator: FactorAggregator, report: Optional[ShardedStepReport] = None) -> None:
        """After a step that took a rank route or flushed a residual: agree its finiteness over the
        ranks (one all-reduce of one number), keep or drop its rank-route state."""
        if not self._rank_touched:
            return
        self._rank_touched = False
        traffic = self.state.end_step(aggregator=aggregator)
        report = report if report is not None else self.report
        if report is not None:
            report.params.append(ShardedParamReport.overhead(self.names["finite"], 1, traffic))

    def _touch_rank(self, call: ShardedCall, unit: FactorUnit) -> None:
        local = call.local_of(unit)
        if local is not None:
            self.state.note_local(local)
        if not self._rank_touched:
            self._rank_touched = True
            call.engine.at_step_end(functools.partial(self.end_rank_step, call.aggregator, self.report))

    def _flush(self, call: ShardedCall, unit: FactorUnit) -> bool:
        """A unit off the rank routes with a residual left: it rides the engine's reduction now."""
        def add(residual: torch.Tensor) -> None:
            self._touch_rank(call, unit)
            call.add_residual(unit, residual)
        return self.state.flush(unit.name, add)

    # -- a call -----------------------------------------------------------------------------------
    def reduce(self, call: ShardedCall) -> None:
        """Route and exchange one reduction call of the open step (see the module doc)."""
        report = self.report
        step = report.step - 1
        cfg = self.config
        rows: Dict[int, List[Rows]] = {}
        live: List[FactorUnit] = []
        for unit in call.engine.units():  # rows are drained whatever the route: a step's rows are its own
            taken = [call.engine.take_pairs(unit, c) for c in unit.uses]
            if unit.dense_only:
                continue
            live.append(unit)
            rows[unit.index] = taken
        if self._trial.dense(step):  # a route trial's dense step, or all dense decided
            if not self._trial.holds_residuals(step):
                for unit in live:
                    self._flush(call, unit)
            call.reduce_dense(report)
            return
        rows = {u.index: [concat_rows(pairs, c.kind, u.shape, u.param, c.block)
                          for pairs, c in zip(rows[u.index], u.uses)] for u in live}
        call.prepare(rows)
        # units without uses (PowerSGD's floor) have no rows: no size exchange, no check
        factored = [u for u in live if u.has_factors]
        counts: Dict[int, RowCounts] = {}
        if factored and sharded_needs_counts(cfg, step):
            counts, traffic, numel = call.agree_counts(factored)
            report.params.append(ShardedParamReport.overhead(self.names["counts"], numel, traffic))
        live = self._verify(call, live, report)
        timing = self._trial.models(call.aggregator, live[0].param.device, step) if live else None
        ctx = RouteContext(cfg, call.aggregator.world_size, call.route_wire, step=step, sharded=True, timing=timing)
        routes = CallRoutes(step, counts, report)
        leaving = call.leaving(live)  # what a compressed weight moves off the engine's reduction
        group = self._trial.note_call(leaving[1]) if leaving is not None else None
        for unit in live:
            decision = self._trial.held(step, unit, counts)  # a whole set held since the last refresh
            if decision is None:
                estimates, ties = call.estimates(unit, counts.get(unit.index))
                decision = call.route(ctx, unit, UnitEvidence(rows_by_rank=counts.get(unit.index),
                                                              estimates=estimates, ties=ties))
            self._trial.note(unit, decision, leaving[0].get(unit.index, 0) if leaving is not None else 0, group)
            rep = decision.representation
            if rep not in (DENSE, EXACT) and not is_rank_route(rep) and not has_codec(rep):
                raise_unsupported(rep, call.LAYOUT)
            if not is_rank_route(rep) and self._flush(call, unit):
                continue  # its residual rides the engine's reduction this step
            if rep != DENSE:
                routes.routed.append((unit, rep))
        call.exchange(routes)
        for unit, _ in routes.ranked:
            self._touch_rank(call, unit)

    def _verify(self, call: ShardedCall, live: List[FactorUnit], report: ShardedStepReport) -> List[FactorUnit]:
        """The first call of each unit: its factors must rebuild its local gradient on every rank."""
        todo = [u for u in live if u.index not in self._verified and call.checkable(u)
                ] if self.config.verify_first_step else []
        if not todo:
            return live
        failed, traffic = call.verify(todo)
        report.params.append(ShardedParamReport.overhead(self.names["verify"], len(todo), traffic))
        self._verified.update(u.index for u in todo)
        for unit in failed:
            self.log_once(f"{unit.name}: its factors do not rebuild its local gradient on some rank (a use "
                          f"outside the captured layers?): {self.fallback} from now on")
            unit.set_dense_only(True)
        return [u for u in live if not u.dense_only]


class ShardedFacade(TimedRoutes):
    """The public face FSDP2's and ZeRO's adapters share, over their `ShardedExchanger`
    (``self.exchanger``): reports, per-rank state, routing by time (`routing.trial.TimedRoutes`)."""

    exchanger: ShardedExchanger
    plan: object
    _forward_hook: ForwardStartHook  # `ShardedExchanger.start`'s

    def _remove_hooks(self) -> None:
        """At detach: the route trials' forward hook and the plan's capture hooks."""
        self._forward_hook.remove()
        for capture in self.plan.captures:
            capture.remove()

    def last_step_report(self) -> Optional[ShardedStepReport]:
        """The report of the latest backward that reduced gradients (None before the first): per
        parameter its bytes, beside what the engine's reduce-scatter of it would move."""
        return self.exchanger.report

    @property
    def _trial(self) -> ShardedTrial:
        return self.exchanger.trial

    @property
    def keeps_state(self) -> bool:
        """Whether `state_dict` holds anything between steps: only the rank routes do (error-feedback
        residuals, warm starts); exact factors and the engine's reduction keep nothing."""
        return self.exchanger.state.enabled

    @property
    def rank_codec(self) -> Optional[ShardedRankCodec]:
        return self.exchanger.rank_codec

    def state_dict(self) -> dict:
        """This rank's dAD state: the steps taken (``lossless_steps`` counts them) and, per
        rank-routed weight, its warm starts and residual. They differ across ranks: save per rank
        (`engines.checkpoint.save_rank_state`)."""
        ex = self.exchanger
        return {"version": STATE_VERSION, "steps": ex.steps, "rank_routes": ex.state.state_dict()}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore `state_dict`'s state, or version 1's (the same table), tensors onto each weight's
        device and compute dtype; call it between steps. Raises, naming them, for weights this model
        does not have."""
        ex = self.exchanger
        if state.get("version") not in (1, STATE_VERSION):
            raise ValueError(f"dAD/{ex.engine} state of version {state.get('version')!r}, expected {STATE_VERSION}")
        ex.state.load_state_dict(route_table(state), {u.name: u.param for u in self.plan.units})
        ex.steps, ex.report = int(state.get("steps", 0)), None
        ex.trial.cancel()  # every rank loads alike: a trial in progress ends on all of them
