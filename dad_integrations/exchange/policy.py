"""Route policy: which route each unit takes in a step, and what carries over between steps to
decide it. The exchanger (`exchanger.Exchanger`) runs the collectives and asks its `RoutePolicy`.

- **Choosing** (`RoutePolicy.decide`): the router
  (`routing.router.route`) decides from the unit's shape and what is known of its rows: auto's
  prediction from the last agreed row counts (`last_rows`) before a size exchange, every rank's
  counts after one.
- **Holding** (objective ``"time"``): routes are chosen at a refresh (`RoutePolicy.refresh`:
  every ``route_refresh_steps``, and when the lossless steps end) and held until the next, so that
  they change together, on every rank, whatever the models learn in between.
- **Deciding ahead** (`RoutePolicy.decide_ahead`, `exchange.ahead`, DDP): a choosing step is routed
  at its first bucket on the rows its forward counted; where every unit goes dense, it goes by
  DDP's own buckets, and the first-step check waits for the first step that sends factors.
- **Whole sets** (`routing.partial_set`, objective ``"time"``): after a step that chose routes
  anew, a partial set (a few weights compressed) is priced with what moving every other gradient
  off DDP's own buckets costs, against all dense and all compressed; the cheapest is held.
- **Trying** (`routing.trial`, on a measured link in mode ``"auto"``): after a refresh its routes
  are tried against all dense, and every decision's steps are watched.
- **Capture on and off**: a unit whose rows no route of the coming steps uses stops capturing
  them (the hooks' work saved; a step whose every unit goes dense costs what DDP's does), and
  captures them again before a step whose route may use them.

The policy's collectives, on every rank alike: at the end of a step (`RoutePolicy.end_step`), a
trial's agreement on step times (`routing.link.agree_max`) and, before a refresh that measures an
unstated link again (`TrialOwner.measures_link`), the link probe (`routing.link.probe_link`); at a
choosing step's first bucket under DDP, the agreement on the forward's row counts
(`exchange.ahead`). Measuring the models at
construction (`routing.timing.build_timing`) is a collective too.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from dad_integrations.builtin_routes import DENSE, EXACT
from dad_integrations.capture.rows import compute_dtype
from dad_integrations.capture.units import FactorUnit, SyncPlan
from dad_integrations.codecs.route_state import RouteState
from dad_integrations.comm.aggregator import FactorAggregator
from dad_integrations.config import DADConfig
from dad_integrations.report import ParamReport
from dad_integrations.routes.registry import is_rank_route
from dad_integrations.routing.link import LinkModel, job_probe_top, probe_link
from dad_integrations.routing.mode_cost import mode_cost_line
from dad_integrations.routing.partial_set import (LeaveCost, SetChoice, SetUnit, choose_set, grad_bytes,
                                                  measure_leave_cost)
from dad_integrations.routing.router import Route, RouteContext, RowCounts, UnitEvidence, UnitShape, route
from dad_integrations.routing.sharded_trial import agree_on
from dad_integrations.routing.timing import StepTiming, build_timing
from dad_integrations.routing.trial import RouteTrial, TrialOwner

log = logging.getLogger(__name__)
TWO_LEVEL = "two_level"  # a route trial's routes arm when it tries two-level steps (`exchange.two_level`)


class RoutePolicy(TrialOwner):
    """The routes of each step, and what decides them across steps: agreed row counts, each unit's
    last route, the link and compute models (`timing`, objective ``"time"``) and the route trial
    (`trial`; what it shares with the sharded engines': `routing.trial.TrialOwner`). Every rank
    holds the same policy state and asks it in the same order."""

    def __init__(self, plan: SyncPlan, aggregator: FactorAggregator, config: DADConfig, device: torch.device,
                 state: RouteState):
        super().__init__(config, "dAD", aggregator.rank)
        self.plan = plan
        self.aggregator = aggregator
        self.device = device
        self.state = state  # read only: which residuals a dense step still owes
        self.last_rows: Dict[int, RowCounts] = {}  # unit index -> row counts of its last size exchange
        self.last_route: Dict[int, str] = {}       # unit index -> representation of its last step
        self.saved: Dict[int, float] = {}          # unit index -> predicted seconds its route saves (by time)
        self.spare: Dict[int, float] = {}          # unit index -> predicted seconds another route costs beyond dense
        # objective "time": the agreed link and compute models (measured here: a collective),
        # timed in the dtype the rank codecs compute in (fp32 for fp16/bf16 weights)
        self.timing: Optional[StepTiming] = (
            build_timing(config, [u.shape for u in plan.units], aggregator, device,
                         dtype=compute_dtype(plan.units[0].param)) if plan.units else None)
        # what a step's dense gradients pay to leave DDP's buckets once one weight compresses (a
        # collective where timed: after the models, on every rank alike)
        self.leave: LeaveCost = (measure_leave_cost(device, aggregator) if self.timing is not None else LeaveCost())
        self.priced: Dict[int, Dict[str, float]] = {}  # unit index -> its routes' seconds, chosen anew this step
        self.set_clause = ""  # a replaced partial set, for the next routes line said
        # on a measured link, routes that compress are checked against all-dense on the job's steps
        self.trial: Optional[RouteTrial] = (
            RouteTrial(config.route_trial_steps, rank=aggregator.rank)
            if self.timing is not None and config.link is None and config.mode == "auto" else None)
        self.clock: Callable[[], float] = time.perf_counter  # the end of a step's span (`StepClock`)
        # the next step goes at two levels (`exchange.two_level`): nothing is held dense for it
        self.two_level = False
        # a two-level step's routes by unit, and the seconds a step is predicted to save at two
        # levels against the flat routes: what a route trial tries after a refresh that chose them
        self.two_level_routes: Dict[int, str] = {}
        self.two_level_saving = 0.0
        self.two_level_vetoed = False  # a route trial found the two-level steps slower than all dense
        self.wire_dtype: Optional[torch.dtype] = None  # the factors' (the exchanger's), for `mode_cost_line`
        # the step whose routes were last decided ahead of backward (`decide_ahead`; once any were,
        # the first-step check waits for a step that sends factors)
        self.ahead_step: Optional[int] = None

    @property
    def units(self) -> Sequence[FactorUnit]:
        return self.plan.units

    # -- which steps choose anew, which hold ------------------------------------------------------
    def refresh(self, step: int) -> bool:
        """Whether step ``step`` chooses every route again (objective ``"time"``; `TrialOwner.chooses_anew`:
        not step 0, which exchanges every unit's sizes anyway)."""
        return self.timing is not None and self.chooses_anew(step)

    def _held_route(self, unit: FactorUnit, step: int, verify: bool) -> Optional[str]:
        """By time, a unit keeps the route of the last refresh until the next (the models may have
        changed in between: routes change together, at a refresh, on every rank)."""
        if self.timing is None or unit.dense_only:
            return None
        if self.ahead_step == step:  # decided ahead of this step's backward: every unit dense
            return DENSE
        if verify and not self.ahead:
            return None
        arm = self.arm(step)
        if arm is not None and self.two_level_trial():  # its flat arm: the flat router's routes, anew
            return None
        if arm is not None:  # a route trial's step: all dense, or the routes it tries
            return DENSE if arm == "dense" else self.trial.routes.get(unit.index, DENSE)
        if self.refresh(step):
            return None
        held = self.last_route.get(unit.index)
        if held == TWO_LEVEL:  # what a kept trial of two-level steps holds: a flat step routes anew
            return None
        return None if held == EXACT and unit.rows_unused else held  # exact needs its rows

    def dense_for_sure(self, unit: FactorUnit, step: int, verify: bool) -> bool:
        """Whether ``unit`` goes through the dense buckets in step ``step`` whatever its rows say: a
        held dense route (objective "time", between refreshes) or dense for good. Such a step needs
        none of the unit's rows, priors or restart marks (the all-reduce carries what ``.grad``
        holds), so the hooks skip that bookkeeping, and routing it needs no early wake-up."""
        if self.two_level:
            return not verify and unit.dense_only
        return (not verify or self.ahead) and (unit.dense_only or self._held_route(unit, step, verify) == DENSE)

    def holds_residuals(self, step: int) -> bool:
        """A route trial's dense step (`RouteTrial.holds_residuals`; not of a two-level trial):
        residuals wait, and the step goes as a steady dense step does (DDP's own buckets, `native_dense`)."""
        return super().holds_residuals(step) and not self.two_level_trial()

    def two_level_trial(self) -> bool:
        """Whether the route trial under way tries two-level steps (`exchange.two_level`) against the
        flat routes (its other arm: the flat router's routes, chosen anew each step) instead of
        the flat routes against all dense."""
        return self.trial is not None and TWO_LEVEL in self.trial.routes.values()

    def native_dense(self, step: int, verify: bool) -> bool:
        """Whether step ``step`` can go by the engine's own bucket all-reduce, untouched (DDP's
        buckets, `ddp_hook`): every unit dense whatever its rows (held dense between refreshes, a
        route trial's dense step, or dense for good) and nothing owed to be flushed. Such a step is
        what DDP's is, with no per-parameter packing on dAD's worker (`Exchanger.run_native`)."""
        state, units = self.state, self.units
        if self.two_level or (verify and not self.ahead) or state.pending or not all(
                self.dense_for_sure(u, step, verify) for u in units):
            return False
        if self.holds_residuals(step):
            return True
        return not (state.memory.enabled and any(state.memory.dense(u.name) is not None for u in units))

    @property
    def ahead(self) -> bool:
        """Whether routes were ever decided ahead of backward (`decide_ahead`)."""
        return self.ahead_step is not None

    # -- every unit's route, ahead of backward (`exchange.ahead`) ------------------------------------
    def decides_ahead(self, step: int, verify: bool) -> bool:
        """Whether step ``step`` is routed at its first bucket, on its forward's counts: a step that
        chooses routes (the unchecked first, a refresh) by time in mode auto, flat, outside a trial."""
        return (self.timing is not None and self.config.mode == "auto" and not self.two_level
                and self.arm(step) is None and (self.refresh(step) or (verify and not self.ahead)))

    def decide_ahead(self, step: int, rows: Dict[int, RowCounts]) -> bool:
        """Route every unit on ``rows`` (every rank's forward counts by unit index, agreed); where every
        unit goes dense, hold that for step ``step`` and on (as a refresh's routes are held) and return
        True. Otherwise keep nothing and return False: the step decides unit by unit."""
        decisions = {}
        for u in self.units:
            if u.dense_only:
                continue
            ctx = RouteContext(self.config, self.aggregator.world_size, self.wire_dtype or u.param.dtype, step=step,
                               refresh=True, timing=self.timing)
            decision = route(ctx, UnitShape.of(u), UnitEvidence(rows_by_rank=rows[u.index],
                                                                current=self.last_route.get(u.index)))
            if decision.representation != DENSE:
                return False
            decisions[u.index] = decision
        for index, decision in decisions.items():
            self.last_rows[index] = rows[index]
            self.last_route[index] = DENSE
            self._note_chosen(index, decision)
        self.ahead_step = step
        return True

    # -- one unit's route --------------------------------------------------------------------------
    def decide(self, unit: FactorUnit, ctx: RouteContext, step: int, verify: bool,
               agree: Callable[[], RowCounts]) -> Tuple[Route, Optional[RowCounts]]:
        """The unit's route this step: held (by time, between refreshes: the route chosen at the
        last one) or the router's. Where the route exchanges sizes, ``agree`` agrees every rank's
        row counts first and the router decides on them (a held route stays, unless the first-step
        check sent the unit dense for good). Returns it and the counts (None without a size
        exchange); the unit keeps it until the next refresh, with (chosen anew) its predicted saving
        for a route trial."""
        shape = UnitShape.of(unit)
        held = self._held_route(unit, step, verify)
        if held is not None:
            decision = Route(held, held == EXACT)
        else:
            evidence = UnitEvidence(dense_only=unit.dense_only, last_rows=self.last_rows.get(unit.index),
                                    current=self.last_route.get(unit.index))
            decision = route(dataclasses.replace(ctx, refresh=self.refresh(step)), shape, evidence)
        rows_by_rank = None
        if decision.exchange_sizes:
            rows_by_rank = self.last_rows[unit.index] = agree()
            if held is None or unit.dense_only:
                decision = route(ctx, shape, UnitEvidence(dense_only=unit.dense_only, rows_by_rank=rows_by_rank,
                                                          current=self.last_route.get(unit.index)))
        if held is None:
            self._note_chosen(unit.index, decision)
        self.last_route[unit.index] = decision.representation
        return decision, rows_by_rank

    def _note_chosen(self, index: int, decision: Route) -> None:
        """Unit ``index`` was routed anew by ``decision``: its predicted saving and spare seconds (what
        a route trial and its watch read), its routes' seconds (what a route set is priced on) and
        whether it was inside the noise."""
        self.saved[index] = decision.saved_s
        self.spare[index] = decision.spare_s
        if decision.seconds is not None:
            self.priced[index] = decision.seconds
        self.note_noise(index, decision)

    def settle_capture(self, unit: FactorUnit, decision: Route, method: Optional[str], verify: bool) -> None:
        """After the unit's codec has started (``method``: how a rank route reduced it): stop
        capturing rows that no route of the coming steps uses."""
        if unit.rows_unused:
            return
        if is_rank_route(decision.representation) and method == "dense" and not decision.exchange_sizes:
            # the unit's route for good (mode rank; auto's prediction, held), from the dense gradient
            unit.stop_using_rows()
        elif decision.representation == DENSE and self.timing is not None and not verify:
            # dense by time until the next refresh (not a unit only flushing its residual through
            # the dense buckets: its route may be exact)
            unit.stop_using_rows()

    # -- between steps -------------------------------------------------------------------------------
    def end_step(self, step: int, started: Optional[float], params: Sequence[ParamReport] = ()) -> None:
        """Step ``step``'s exchange is over (``started``: the start of its span, `StepClock`;
        ``params``: its report): its span to the route trial, what users see of the routes, then
        the next step's preparation."""
        tried = self.arm(step) is not None  # a trial's step says no routes (read before the trial ends)
        summary = self.summary(step, params)
        self._price_set(step, tried)
        self._run_trial(step, None if started is None else self.clock() - started)
        if step == 0 and self.units:
            self.say_mode_cost(self._probe, self._mode_cost_line)
        if not tried and (self.trial is None or not self.trial.active):
            if summary and self.set_clause:
                summary = f"{summary} [{self.set_clause}]"
            self.say_routes(step, summary)
            if self.set_clause and self._said_routes == summary:
                self.set_clause = ""
        self._prepare_refresh(step + 1)

    def _price_set(self, step: int, tried: bool) -> None:
        """After a step whose routes were chosen anew (by time, flat): keep them, or, where they are a
        partial set priced above a whole one with the leaving of DDP's buckets counted, hold the
        cheaper whole set until the next refresh (`routing.partial_set`)."""
        priced, self.priced = self.priced, {}
        if not priced or self.two_level or tried or not (step == 0 or self.refresh(step)):
            return
        choice = choose_set(self._set_units(priced), self.leave,
                            {0: (grad_bytes([q for _, q in self.plan.dense]), len(self.plan.dense))})
        if choice.replaced:
            self._hold_set(choice, priced)

    def _set_units(self, priced: Dict[int, Dict[str, float]]) -> list:
        """The units as `partial_set.SetUnit`: those chosen anew with their routes' seconds, the
        others fixed on their route (one step of DDP: one group)."""
        out = []
        for u in self.units:
            rep = DENSE if u.dense_only else self.last_route.get(u.index, DENSE)
            seconds = priced.get(u.index) if not u.dense_only else None
            out.append(SetUnit(u.index, rep, seconds if seconds is not None else {rep: 0.0}, grad_bytes(u.params),
                               len(u.params)))
        return out

    def _hold_set(self, choice: SetChoice, priced: Dict[int, Dict[str, float]]) -> None:
        """Hold ``choice``'s whole set from the next step: routes, their predicted savings (what a
        route trial tries), and capture where the route changes its need of rows."""
        for u in self.units:
            rep = choice.routes[u.index]
            if rep == self.last_route.get(u.index) or u.dense_only:
                continue
            self.last_route[u.index] = rep
            seconds = priced.get(u.index, {})
            self.saved[u.index] = seconds.get(DENSE, 0.0) - seconds.get(rep, 0.0)
            self.spare[u.index] = 0.0
            if rep == EXACT:
                self.use_rows([u.index])
            elif rep == DENSE and not u.rows_unused:
                u.stop_using_rows()
        self.set_clause = choice.clause()
        if self.aggregator.rank == 0:
            log.info("%s: %s", self.name, self.set_clause)

    def _probe(self) -> LinkModel:
        """Measure the flat link (a collective, at the same point on every rank)."""
        top = self.timing.probe_top if self.timing is not None else job_probe_top(
            (u.shape for u in self.units), self.config.bucket_cap_mb)
        return probe_link(self.aggregator, self.device, kinds=("all_reduce", "all_gather"), top_bytes=top)

    def _mode_cost_line(self, link: LinkModel) -> Optional[str]:
        """`routing.mode_cost.mode_cost_line` on the units' shapes and last agreed row counts."""
        units = [(UnitShape.of(u), self.last_rows.get(u.index)) for u in self.units if not u.dense_only]
        return mode_cost_line(self.config, units, world_size=self.aggregator.world_size,
                              wire_dtype=self.wire_dtype or self.units[0].param.dtype, link=link,
                              compute=self.timing.compute if self.timing is not None else None)

    def _prepare_refresh(self, next_step: int) -> None:
        """Before a refresh step: measure the link again (where it is not stated) and capture every
        unit's rows in that step, so that exact factors are a candidate again. Before a route
        trial's step on the routes it tries: capture the rows of the units it sends by exact
        factors (its dense steps switched capture off)."""
        arm = self.arm(next_step)
        if arm is not None and self.two_level_trial():  # either arm may send exact factors
            self.use_rows()
        elif arm == "routes":
            self.use_rows([i for i, rep in self.trial.routes.items() if rep == EXACT])
        elif arm == "dense":
            self.drop_rows()
        if not self.refresh(next_step):
            return
        if self.trial is not None:
            self.trial.stop_watching()
        if self.config.link is None and self.measures_link(next_step):
            self.set_link(self._probe())
        self.use_rows()

    def _run_trial(self, step: int, seconds: Optional[float]) -> None:
        """End of step ``step`` (``seconds``: its span on this rank): start a route trial after
        routes were chosen anew (or watch them, where none begins), judge one, or watch the last
        decision (`routing.trial`)."""
        trial = self.trial
        if trial is None:
            return
        two_level = self.two_level_trial()
        outcome = self.trial_step(step, seconds, agree_on(self.aggregator, self.device))
        if outcome is None:
            return
        if two_level:  # two-level steps against the flat routes: the loser waits for the next refresh
            self.two_level_vetoed = not outcome.kept
            self.use_rows()
        else:
            self.timing = dataclasses.replace(self.timing, overhead_s=outcome.overhead_s)
            for u in self.units:  # what the next steps take until the next refresh
                self.last_route[u.index] = trial.routes.get(u.index, DENSE) if outcome.kept else DENSE
            if outcome.kept:  # exact factors need their rows from the next step on
                self.use_rows([i for i, rep in trial.routes.items() if rep == EXACT])
            else:
                self.drop_rows()
        self.say_outcome(outcome, "two levels, " if two_level else "",
                         f"; overhead per compressed weight now {outcome.overhead_s * 1e3:.2f} ms")

    def chosen(self, step: int) -> Tuple[Dict[int, str], bool, float, float]:
        """`TrialOwner.chosen`, flat or (this step went at two levels) two-level."""
        units = self.units
        if self.two_level:  # this step went at two levels: try them against the flat routes
            routes = {u.index: TWO_LEVEL for u in units}
            compressed = [i for i, rep in self.two_level_routes.items() if rep != DENSE]
            saving, spare = self.two_level_saving, 0.0
        else:
            routes = {u.index: self.last_route.get(u.index, DENSE) for u in units}
            compressed = [i for i, rep in routes.items() if rep != DENSE]
            saving, spare = sum(self.saved.get(i, 0.0) for i in compressed), sum(self.spare.get(i, 0.0) for i in routes)
        return routes, bool(compressed), saving, spare
