"""Route trials: the routes a refresh chose, measured against all-dense on the job's own steps.

Objective ``"time"`` predicts each route's seconds from micro-benchmarks (`link`, `compute_model`).
They miss what a real step adds around a compressed route (per-weight Python in the hooks and on
the worker, the capture's memory traffic, compressed-route compute contending with backward for the
same cores) and what it saves (dense buckets overlapping backward). Where they err, auto compresses
on a link where all-reduce is faster: the one thing objective "time" promises not to do.

So after a refresh that sends any weight by factors or a rank route, on a link the job measures
(a stated ``link`` is the user's word and is trusted), the job times its own steps::

    steps s .. s+T          the refresh's routes      (s: settling; s+1 .. s+T timed)
    steps s+T+1 .. s+2T+2   every weight dense, capture off (s+T+1: settling, residuals flushed;
                            s+T+2 .. s+2T+1 timed; s+2T+2 runs while the decision is taken)

with ``T = route_trial_steps``. A step's time runs from the start of its exchange to the start of
the next (a whole iteration: the rest of backward, the exchange, the optimizer, data, forward).
Each half is summarised by its lower quartile (load from elsewhere on a shared machine only adds
time, so the low end is the routes' own cost; the halves run one after the other and see
different bursts). Every rank takes the slowest rank's figures (one all-gather of two numbers at
the end of step s+2T+2), so all decide alike: the refresh's routes are kept from step s+2T+3 only
where their figure beats all-dense's by `KEEP_MARGIN`; otherwise every weight stays dense, capture off, until
the next refresh, and the step costs what all-reduce's does.

The measurement also calibrates the model: ``predicted - measured`` saving of the trialled routes,
spread over their weights, is added to a per-weight overhead that every later decision charges to
each non-dense route (`timing.StepTiming.overhead_s`), so that the next refresh compresses only
weights whose predicted saving pays for what the micro-benchmarks missed. Cost: at most ``2T + 3``
steps per refresh (every ``route_refresh_steps``, 200 by default) run the slower of the two plans;
a trial that does not end before the next refresh is not started.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

KEEP_MARGIN = 0.02  # compressed routes must beat all-dense's step time by this share to stay


@dataclass(frozen=True)
class TrialOutcome:
    """One trial: the step times every rank agreed on, and what was kept."""

    step: int                 # the refresh step whose routes were tried
    compressed: int           # weights the refresh sent by factors or a rank route
    routes_s: float           # agreed step time (lower quartile) on those routes
    dense_s: float            # agreed step time (lower quartile) with every weight dense
    predicted_saving_s: float  # what the models predicted the routes would save per step
    kept: bool                # the refresh's routes were kept (else every weight stays dense)
    overhead_s: float         # the per-weight overhead charged to non-dense routes from now on


@dataclass
class RouteTrial:
    """The state of the trial in progress (if any) and the calibrated overhead; see the module doc."""

    steps: int
    start: Optional[int] = None                 # the refresh step being tried
    routes: Dict[int, str] = field(default_factory=dict)  # unit index -> the refresh's route
    predicted_saving_s: float = 0.0
    overhead_s: float = 0.0
    durations: Dict[int, float] = field(default_factory=dict)  # step -> seconds
    outcomes: List[TrialOutcome] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.start is not None

    def fits(self, step: int, next_refresh: int) -> bool:
        """Whether a trial of refresh ``step`` ends before the refresh at ``next_refresh``."""
        return self.steps > 0 and step + 2 * self.steps + 2 < next_refresh

    def begin(self, step: int, routes: Dict[int, str], predicted_saving_s: float) -> None:
        self.start, self.routes = step, dict(routes)
        self.predicted_saving_s = float(predicted_saving_s)
        self.durations = {}

    def cancel(self) -> None:
        """Drop a trial in progress (a checkpoint was loaded: its steps are not this trial's)."""
        self.start, self.durations = None, {}

    def forces_dense(self, step: int) -> bool:
        """Step ``step`` belongs to the all-dense half of the trial."""
        return self.active and self.start + self.steps < step <= self.start + 2 * self.steps + 2

    def decides_at(self, step: int) -> bool:
        """The trial is decided at the end of step ``step`` (its last dense step)."""
        return self.active and step == self.start + 2 * self.steps + 2

    def observe(self, step: int, seconds: float) -> None:
        """The duration of step ``step`` (known when step ``step + 1`` starts)."""
        if self.active and step > self.start:
            self.durations[step] = seconds

    def step_times(self) -> Sequence[float]:
        """This rank's step time (lower quartile of the timed steps) on the refresh's routes and
        with every weight dense."""
        s, t = self.start, self.steps
        return (_lower_quartile([self.durations.get(k) for k in range(s + 1, s + t + 1)]),
                _lower_quartile([self.durations.get(k) for k in range(s + t + 2, s + 2 * t + 2)]))

    def decide(self, routes_s: float, dense_s: float) -> TrialOutcome:
        """Close the trial on the agreed step times: whether to keep its routes, and the new overhead."""
        compressed = sum(rep != "dense" for rep in self.routes.values())
        kept = routes_s < (1.0 - KEEP_MARGIN) * dense_s
        if compressed:
            measured_saving = dense_s - routes_s
            self.overhead_s = max(0.0, self.overhead_s + (self.predicted_saving_s - measured_saving) / compressed)
        outcome = TrialOutcome(self.start, compressed, routes_s, dense_s, self.predicted_saving_s, kept,
                               self.overhead_s)
        self.outcomes.append(outcome)
        self.start = None
        return outcome


def _lower_quartile(values: Sequence[Optional[float]]) -> float:
    known = sorted(v for v in values if v is not None)
    return known[len(known) // 4] if known else 0.0
