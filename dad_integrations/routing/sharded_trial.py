"""Route trials under the sharded engines (FSDP2, ZeRO-2/3): one piece both adapters drive.

There each reduction call routes its weights by the models, per weight per step (`router.route`
with ``sharded=True``; `timing.EngineTiming` measures them at attach and the link again every
``route_refresh_steps``). `ShardedTrial` runs `trial.RouteTrial` and its watch on them as under DDP
(a measured link, objective ``"time"``, mode ``"auto"``): a dense-arm step sends every weight by
the engine's own reduce-scatter (capture off; residuals wait for the routes). All dense decided:
every weight takes the engine's reduce-scatter (its first step carries the residuals), capture off,
until the next refresh (or the one a missed watch asks for, the link measured again at its first
reduction).

The adapter calls, per step and on every rank alike:

* `forward` from a forward pre-hook on the root module (the step's span starts there:
  `trial.StepClock`);
* `open(step)` at the step's first reduction call, then `dense(step)` ("force dense this step?")
  and `note(route)` for each weight it routes;
* `end(step, agree)` once the step's last reduction is over (FSDP2: a callback queued on autograd's
  engine, which runs after FSDP's own final callback; ZeRO: after the engine's backward epilogue).
  ``agree`` is `link.agree_max` on the adapter's group: a collective, at the same point on every
  rank, with no reduction of the step in flight.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Dict, List, Optional, Sequence

import torch

from dad_integrations.comm.aggregator import FactorAggregator
from dad_integrations.config import DADConfig
from dad_integrations.logs import say
from dad_integrations.report import ParamReport, route_summary
from dad_integrations.routing.link import LinkModel, agree_max
from dad_integrations.routing.mode_cost import report_cost_line
from dad_integrations.routing.trial import (Agree, RouteTrial, StepClock, TrialOutcome, next_refresh, refresh_due,
                                            routes_line)
from dad_integrations.routing.router import Route
from dad_integrations.routing.timing import EngineTiming, StepTiming
from dad_integrations.capture.units import FactorUnit

log = logging.getLogger(__name__)


class ShardedTrial:
    """The timing models, the step's span, the route trial and the all-dense hold of one sharded
    adapter (see the module doc)."""

    def __init__(self, config: DADConfig, name: str = "dAD", log_decisions: bool = False):
        self.config = config
        self.name = name
        self.log_decisions = log_decisions    # rank 0 logs each decision with its evidence
        self.engine = EngineTiming(config)
        self.clock = StepClock()
        self.trial: Optional[RouteTrial] = None
        self.units: List[FactorUnit] = []
        self.step: Optional[int] = None       # the open step (0-based), None between steps
        self._started = 0.0
        self._compressed = 0                  # weights routed off dense this step
        self._saved = 0.0                     # their predicted saving this step
        self._spare = 0.0                     # dense weights: what other routes are predicted to cost beyond
        self._routes: Dict[int, str] = {}     # unit index -> its route this step
        self._dense_until: Optional[int] = None  # all dense decided: every step before this one
        self._dropped: set = set()            # units whose capture this piece switched off
        self.decision = ""                    # the last decision said, with its evidence (reports)
        self._tried = ""                      # the last routes-arm step's routes and bytes
        self._said_routes = ""

    # -- set-up -----------------------------------------------------------------------------------
    def start(self, units: Sequence[FactorUnit], aggregator: FactorAggregator, device: torch.device) -> None:
        """Measure the models (a collective, at attach) and set up the trial where it applies."""
        self.units = list(units)
        if not self.units:
            return
        self.engine.start([u.shape for u in self.units], aggregator, device)
        cfg = self.config
        if (self.engine.timing is not None and cfg.link is None and cfg.mode == "auto"
                and cfg.route_trial_steps > 0):
            self.trial = RouteTrial(cfg.route_trial_steps, rank=self._rank, name=self.name)

    @property
    def timing(self) -> Optional[StepTiming]:
        return self.engine.timing

    def set_link(self, link: LinkModel) -> None:
        """Route by ``link`` (the same on every rank) from now on (until the next measurement)."""
        if self.engine.timing is not None:
            self.engine.timing = dataclasses.replace(self.engine.timing, link=link)

    def models(self, aggregator: FactorAggregator, device: torch.device, step: int) -> Optional[StepTiming]:
        """`EngineTiming.get`: the models for step ``step`` (measured again at a refresh, and at the
        one a missed watch asked for)."""
        return self.engine.get(aggregator, device, step, again=self.trial is not None and self.trial.refresh_at == step)

    @property
    def outcomes(self) -> List[TrialOutcome]:
        return list(self.trial.outcomes) if self.trial is not None else []

    # -- refreshes --------------------------------------------------------------------------------
    def refresh(self, step: int) -> bool:
        """Whether step ``step`` chooses routes anew (the exchanger's rule, step 0 included; the step
        after a missed watch)."""
        return (step == 0 or refresh_due(step, self.config.route_refresh_steps, self._lossless)
                or (self.trial is not None and self.trial.refresh_at == step))

    def next_refresh(self, step: int) -> int:
        return next_refresh(step, self.config.route_refresh_steps, self._lossless)

    @property
    def _lossless(self) -> int:
        return self.config.lossless_steps if self.config.rank is not None else 0

    # -- per step ---------------------------------------------------------------------------------
    def forward(self) -> None:
        """The root module's forward (`trial.StepClock`)."""
        if self.trial is not None and self.step is None:
            self.clock.forward()

    def open(self, step: int) -> None:
        """The first reduction call of step ``step`` (later calls of the same step change nothing)."""
        if self.step == step:
            return
        self.step = step
        self._compressed, self._saved, self._spare, self._routes = 0, 0.0, 0.0, {}
        if self.trial is not None:
            self._started = self.clock.open()

    def dense(self, step: int) -> bool:
        """Every weight of step ``step`` goes by the engine's own reduce-scatter (a dense-arm step,
        or all dense decided until the next refresh, except a watch-started trial's routes steps)."""
        arm = self.arm(step)
        if arm is not None:  # a trial's step: its arm (a watch-started trial tries the routes, hold or not)
            return arm == "dense"
        return self._dense_until is not None and step < self._dense_until

    def arm(self, step: int) -> Optional[str]:
        return self.trial.arm(step) if self.trial is not None else None

    def holds_residuals(self, step: int) -> bool:
        """A trial's dense-arm step: residuals wait for its next routes step
        (`trial.RouteTrial.holds_residuals`); once all dense is decided they are flushed."""
        return self.trial is not None and self.trial.holds_residuals(step)

    def note(self, unit: FactorUnit, decision: Route) -> None:
        """One weight's route this step."""
        self._routes[unit.index] = decision.representation or "exact"
        if decision.representation not in (None, "dense"):
            self._compressed += 1
            self._saved += decision.saved_s
        else:
            self._spare += decision.spare_s

    def end(self, step: int, agree: Agree) -> Optional[TrialOutcome]:
        """Step ``step``'s reductions are over (every rank calls this alike): begin, judge or watch
        a trial (``agree`` may run), then set the next step's capture."""
        if self.step != step:
            return None
        self.step = None
        trial = self.trial
        if trial is None:
            return None
        seconds = self.clock.clock() - self._started
        outcome = None
        if not trial.active and self.refresh(step):
            self._dense_until = None
            trial.after_refresh(step, dict(self._routes), bool(self._compressed), self._saved, self._spare,
                                self.next_refresh(step))
        else:
            outcome = trial.end_of_step(step, seconds, agree, self.next_refresh(step))
        if trial.news:  # a missed watch's refresh began a trial: its line is the last decision said
            self.decision, trial.news = trial.news, ""
        if outcome is not None:
            self._dense_until = None if outcome.kept else self.next_refresh(step)
            if self.engine.timing is not None:
                self.engine.timing = dataclasses.replace(self.engine.timing, overhead_s=outcome.overhead_s)
            self._said_routes = ""
            self.say(outcome.line(self.name, self._tried or "none"))
        nxt = step + 1
        if self.refresh(nxt):
            trial.stop_watching()
            self._dense_until = None
        if self.dense(nxt):
            self._drop_rows()
        else:
            self._use_rows()
        return outcome

    @property
    def _rank(self) -> int:
        return 0 if self.log_decisions else 1

    def say(self, line: str) -> None:
        """A decision, with its evidence: shown on rank 0 (`logs.say`), kept for the reports."""
        self.decision = line
        say(line, rank=self._rank)

    def note_report(self, step: int, params: Sequence[ParamReport],
                    probe: Optional[Callable[[], LinkModel]] = None) -> None:
        """Step ``step``'s report, before `end`: the routes a trial tries, and (no trial under way,
        after the first steady step and each refresh) the routes, where they changed."""
        if not params:
            return
        if step == 0:
            self._say_mode_cost(params, probe)
        arm = self.arm(step)
        if not (arm == "routes" or step <= 1 or self.refresh(step)):
            return  # nothing to try or say this step: no summary built (steady steps stay cheap)
        summary = route_summary(params)
        if arm in (None, "routes"):
            self._tried = summary
        active = self.trial is not None and (self.trial.active or (self.refresh(step) and self._compressed))
        if (arm is None and not active and (step == 1 or (step > 1 and self.refresh(step)))
                and summary != self._said_routes):
            self._said_routes = summary
            self.say(routes_line(self.name, step, summary, self.timing, self.config.mode))

    def _say_mode_cost(self, params: Sequence[ParamReport], probe: Optional[Callable[[], LinkModel]] = None) -> None:
        """After the first step: warn where mode exact or rank is predicted to slow the exchange past
        the engine's own reduce-scatter (`mode_cost.report_cost_line`: the step's counted bytes on the
        models' link, the stated one, or (exact mode on a measured link, objective time) the link
        ``probe`` measures here: a collective, at the same point on every rank)."""
        cfg = self.config
        if cfg.mode not in ("exact", "rank"):
            return
        link = self.timing.link if self.timing is not None else (
            LinkModel.from_spec(cfg.link) if cfg.link is not None else None)
        if link is None and cfg.objective == "time" and probe is not None:
            link = probe()
        if link is not None:
            line = report_cost_line(cfg, params, link=link, sharded=True, name=self.name)
            if line is not None:
                say(line, rank=self._rank, level=logging.WARNING)

    def cancel(self) -> None:
        """A checkpoint was loaded: forget a trial in progress and the step's start."""
        if self.trial is not None:
            self.trial.cancel()
        self.clock.cancel()
        self.step = None
        self._dense_until = None
        self._use_rows()

    def _drop_rows(self) -> None:
        for u in self.units:
            if not u.rows_unused and not u.dense_only:
                u.stop_using_rows()
                self._dropped.add(u.index)

    def _use_rows(self) -> None:
        for u in self.units:
            if u.index in self._dropped:
                u.rows_unused = False
                u.update_capture()
        self._dropped.clear()


def agree_on(aggregator: FactorAggregator, device: torch.device) -> Agree:
    """`link.agree_max` on ``aggregator`` (the trial's agreement collective)."""
    return lambda values: agree_max(aggregator, values, device, name="dad.trial.agree")


class TimedRoutes:
    """What a sharded synchroniser with a `ShardedTrial` (``self._trial``) shows of its routing by
    time, as `DADSynchronizer` does: ``set_link``, ``timing``, ``route_trials``."""

    _trial: ShardedTrial

    def set_link(self, link) -> None:
        """Route by ``link`` (a `link.LinkModel` or a config ``link`` dict; the same on every rank)
        in place of the measured one, until it is measured again (every ``route_refresh_steps``);
        with ``objective="bytes"`` it has no effect."""
        self._trial.set_link(LinkModel.from_spec(link))

    @property
    def timing(self) -> Optional[StepTiming]:
        """The link and compute models routes are chosen by; None where the objective is bytes."""
        return self._trial.timing

    @property
    def route_trials(self) -> List[TrialOutcome]:
        """The route trials so far (`trial.TrialOutcome`); empty where routes are not chosen
        by time on a measured link in mode auto."""
        return self._trial.outcomes
