"""Route trials under the sharded engines (FSDP2, ZeRO-2/3): one piece both adapters drive.

There each reduction call routes its weights by the models, per weight per step (`router.route`
with ``sharded=True``; `ShardedTrial` measures them at attach and the link again every
``route_refresh_steps``). `ShardedTrial` runs `trial.RouteTrial` and its watch on them as under DDP
(a measured link, objective ``"time"``, mode ``"auto"``): a dense-arm step sends every weight by
the engine's own reduce-scatter (capture off; residuals wait for the routes). All dense decided:
every weight takes the engine's reduce-scatter (its first step carries the residuals), capture off,
until the next refresh (or the one a missed watch asks for, the link measured again at its first
reduction).

The adapter calls, per step and on every rank alike:

* `forward` from a forward pre-hook on the root module (the step's span starts there:
  `trial.StepClock`);
* `open(step)` at the step's first reduction call, then `dense(step)` ("force dense this step?"),
  per call `note_call` (where its dense rest leaves the engine's reduction with a compressed
  weight), and per weight `held` (a whole set held since the last refresh) and `note(route)`;
* `end(step, agree)` once the step's last reduction is over (FSDP2: a callback queued on autograd's
  engine, which runs after FSDP's own final callback; ZeRO: after the engine's backward epilogue).
  ``agree`` is `link.agree_max` on the adapter's group: a collective, at the same point on every
  rank, with no reduction of the step in flight.

Whole sets (`partial_set`): at the end of a step that chose routes anew, the routes noted are priced
as a set, with what moving each call's dense rest off the engine's reduce-scatter costs, against
all dense and all compressed; where a whole set is cheaper it is held until the next refresh (all
dense: the all-dense hold above; all compressed: `held`), and said.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from dad_integrations.builtin_routes import DENSE, EXACT
from dad_integrations.comm.aggregator import FactorAggregator
from dad_integrations.config import DADConfig
from dad_integrations.report import ParamReport
from dad_integrations.routing.link import LinkModel, agree_max, job_probe_top, probe_link
from dad_integrations.routing.mode_cost import report_cost_line
from dad_integrations.routing.partial_set import LeaveCost, SetChoice, SetUnit, choose_set, measure_leave_cost
from dad_integrations.routing.trial import Agree, RouteTrial, StepClock, TrialOutcome, TrialOwner
from dad_integrations.routing.router import Route
from dad_integrations.routing.timing import LinkProbe, StepTiming, build_timing
from dad_integrations.capture.units import FactorUnit


class ShardedTrial(TrialOwner):
    """The timing models, the step's span, the route trial and the all-dense hold of one sharded
    adapter (see the module doc; what it shares with DDP's policy: `trial.TrialOwner`)."""

    def __init__(self, config: DADConfig, name: str = "dAD", log_decisions: bool = False):
        super().__init__(config, name, 0 if log_decisions else 1)  # rank 0 logs each decision with its evidence
        self.timing: Optional[StepTiming] = None  # the models (`start`), None where routes go by bytes
        # how the link is measured (a collective): on the engine's group; HSDP's adapter times the hop between nodes
        self.probe: LinkProbe = functools.partial(probe_link, kinds=("all_reduce", "all_gather", "all_to_all"))
        self._probed_step = 0
        self.clock = StepClock()
        self.units: List[FactorUnit] = []
        self.step: Optional[int] = None       # the open step (0-based), None between steps
        self._started = 0.0
        self._compressed = 0                  # weights routed off dense this step
        self._saved = 0.0                     # their predicted saving this step
        self._spare = 0.0                     # dense weights: what other routes are predicted to cost beyond
        self._routes: Dict[int, str] = {}     # unit index -> its route this step
        self._dense_until: Optional[int] = None  # all dense decided: every step before this one
        self.leave = LeaveCost()                  # leaving the engine's reduction (`start`)
        self._priced: List[SetUnit] = []          # this step's weights routed anew, as a set
        self._rests: Dict[int, Tuple[int, int]] = {}  # call -> its dense rest (bytes, tensors)
        self._held: Dict[int, Route] = {}         # a whole set taken: unit index -> its route
        self._held_until: Optional[int] = None    # ... every step before this one

    # -- set-up -----------------------------------------------------------------------------------
    def start(self, units: Sequence[FactorUnit], aggregator: FactorAggregator, device: torch.device) -> None:
        """Measure the models (a collective, at attach: every rank attaches together; not inside
        backward, where the compute model's timed backward of a probe layer could not run) and set up
        the trial where it applies."""
        self.units = list(units)
        if not self.units:
            return
        cfg = self.config
        self.timing = build_timing(cfg, [u.shape for u in self.units], aggregator, device, probe=self.probe)
        if self.timing is not None:  # a collective too, after the models
            self.leave = measure_leave_cost(device, aggregator)
        if (self.timing is not None and cfg.link is None and cfg.mode == "auto"
                and cfg.route_trial_steps > 0):
            self.trial = RouteTrial(cfg.route_trial_steps, rank=self.say_rank, name=self.name)

    def models(self, aggregator: FactorAggregator, device: torch.device, step: int) -> Optional[StepTiming]:
        """The models for synchronised step ``step`` (0-based), the link measured again (where the
        config states none) at the first reduction of every ``route_refresh_steps``-th step and of
        the step a missed watch makes a refresh (every rank alike)."""
        again = self.trial is not None and self.trial.refresh_at == step
        if (self.timing is not None and self.config.link is None and step > self._probed_step
                and (again or step % self.config.route_refresh_steps == 0)):
            self.timing = dataclasses.replace(self.timing, link=self.measure_link(aggregator, device))
            self._probed_step = step
        return self.timing

    def measure_link(self, aggregator: FactorAggregator, device: torch.device) -> LinkModel:
        """The link, probed (`probe`, a collective) up to the job's sizes: the timing's ``probe_top``,
        or the units' and buckets' where routes go by bytes (`link.job_probe_top`)."""
        top = (self.timing.probe_top if self.timing is not None
               else job_probe_top((u.shape for u in self.units), self.config.bucket_cap_mb))
        return self.probe(aggregator, device, top_bytes=top)

    # -- refreshes --------------------------------------------------------------------------------
    def refresh(self, step: int) -> bool:
        """Whether step ``step`` chooses routes anew (the exchanger's rule, step 0 included; the step
        after a missed watch)."""
        return step == 0 or self.chooses_anew(step)

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

    def note_call(self, rest: Tuple[int, int]) -> int:
        """A reduction call whose dense ``rest`` (bytes, tensors) leaves the engine's reduction with
        any compressed weight of it; returns the call's group for `note`."""
        self._rests[len(self._rests)] = rest
        return len(self._rests) - 1

    def held(self, step: int, unit: FactorUnit, counts: Dict[int, object]) -> Optional[Route]:
        """The unit's route in step ``step`` where a whole set is held (exact factors only with this
        call's agreed counts), else None: the router decides."""
        if self._held_until is None or step >= self._held_until:
            return None
        decision = self._held.get(unit.index)
        if decision is None or (decision.representation == EXACT and unit.index not in counts):
            return None
        return decision

    def note(self, unit: FactorUnit, decision: Route, nbytes: int = 0, group: Optional[int] = None) -> None:
        """One weight's route this step (``nbytes``: its gradient's in the engine's reduction, whose
        ``group`` leaves it together, `note_call`)."""
        if decision.seconds is not None:
            self._priced.append(SetUnit(unit.index, decision.representation or EXACT, decision.seconds, nbytes,
                                        1, group))
        self._routes[unit.index] = decision.representation or EXACT
        self.note_noise(unit.index, decision)
        if decision.representation not in (None, DENSE):
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
        whole = self._price_set(step)
        nxt = step + 1
        if self.refresh(nxt):
            self._held, self._held_until = {}, None
        trial = self.trial
        if trial is None:
            if whole is not None and whole.taken == "all dense":
                self._dense_until = self.next_refresh(step)
            if self.refresh(nxt) and self._dense_until is not None:  # routes anew: capture again
                self._dense_until = None
                self.use_rows()
            return None
        outcome = self.trial_step(step, self.clock.clock() - self._started, agree)
        if whole is not None and whole.taken == "all dense":  # after the trial read the set (`chosen`)
            self._dense_until = self.next_refresh(step)
        if outcome is not None:
            self._dense_until = None if outcome.kept else self.next_refresh(step)
            if self.timing is not None:
                self.timing = dataclasses.replace(self.timing, overhead_s=outcome.overhead_s)
            self.say_outcome(outcome)
        if self.refresh(nxt):
            trial.stop_watching()
            self._dense_until = None
        if self.dense(nxt):
            self.drop_rows()
        else:
            self.use_rows()
        return outcome

    def _price_set(self, step: int) -> Optional[SetChoice]:
        """After a step that chose its routes anew: the whole set to hold instead, where the routes
        noted are priced above one with their calls' leaving counted (`partial_set.choose_set`),
        said, with this step's routes, what a trial tries, set to it; else None."""
        priced, rests, self._priced, self._rests = self._priced, self._rests, [], {}
        if not priced or not self.refresh(step) or self.arm(step) is not None or self._held_until is not None:
            return None
        choice = choose_set(priced, self.leave, rests)
        if not choice.replaced:
            return None
        seconds = {u.index: u.seconds for u in priced}
        self._routes = dict(choice.routes)
        compressed = [i for i, rep in choice.routes.items() if rep != DENSE]
        self._compressed, self._spare = len(compressed), 0.0
        self._saved = sum(seconds[i].get(DENSE, 0.0) - seconds[i][choice.routes[i]] for i in compressed)
        if compressed:
            self._held = {i: Route(rep, rep == EXACT, seconds[i].get(DENSE, 0.0) - seconds[i][rep], 0.0,
                                   seconds=seconds[i]) for i, rep in choice.routes.items()}
            self._held_until = self.next_refresh(step)
            self.use_rows()
        else:
            self.drop_rows()
        self.say(f"{self.name} routes from step {step + 1}: {choice.clause()}")
        return choice

    def chosen(self, step: int) -> Tuple[Dict[int, str], bool, float, float]:
        """`TrialOwner.chosen`: this step's routes (`note`); no all-dense hold past a refresh."""
        self._dense_until = None
        return dict(self._routes), bool(self._compressed), self._saved, self._spare

    def note_report(self, step: int, params: Sequence[ParamReport],
                    probe: Optional[Callable[[], LinkModel]] = None) -> None:
        """Step ``step``'s report, before `end`: the routes a trial tries, and (no trial under way,
        after the first steady step and each refresh) the routes, where they changed."""
        if not params:
            return
        if step == 0:  # the step's counted bytes against the engine's own reduce-scatter
            self.say_mode_cost(probe or (lambda: None), lambda link: report_cost_line(
                self.config, params, link=link, sharded=True, name=self.name))
        summary = self.summary(step, params)
        active = self.trial is not None and (self.trial.active or (self.refresh(step) and self._compressed))
        if self.arm(step) is None and not active:
            self.say_routes(step, summary)

    def cancel(self) -> None:
        """A checkpoint was loaded: forget a trial in progress and the step's start."""
        if self.trial is not None:
            self.trial.cancel()
        self.clock.cancel()
        self.step = None
        self._dense_until = None
        self._held, self._held_until, self._priced, self._rests = {}, None, [], {}
        self.use_rows()


def agree_on(aggregator: FactorAggregator, device: torch.device) -> Agree:
    """`link.agree_max` on ``aggregator`` (the trial's agreement collective)."""
    return lambda values: agree_max(aggregator, values, device, name="dad.trial.agree")
