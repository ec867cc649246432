"""Route trials: the routes a refresh chose, measured against all-dense on the job's own steps.

Objective ``"time"`` predicts each route's seconds from micro-benchmarks (`link`, `compute_model`).
They miss what a real step adds around a compressed route (per-weight Python in the hooks and on
the worker, the capture's memory traffic, compute contending with backward for the same cores) and
what it saves (dense buckets overlapping backward): auto may compress where all-reduce is faster,
or stay dense where compression pays.

**What is timed** (`StepClock`): per step and rank, from the step's first forward (or, without one,
its first gradient hook) to the end of its exchange. Time between steps (evaluation, logging,
checkpoints, a data-loader stall, another job's steps) never counts.

**How** (`RouteTrial`). After a refresh that sends any weight by factors or a rank route, on a link
the job measures (a stated ``link`` is trusted), the next steps alternate the refresh's routes (R)
and every weight dense with capture off (D) in pairs, ``R D  D R  R D  D R`` (ABBA: a drifting load
moves both arms alike). A D step holds the routes' error-feedback residuals for the next R step
(`RouteTrial.holds_residuals`), so each arm costs what its steady steps cost (under DDP a D step is
DDP's own buckets). A round is ``route_trial_steps`` steps; at its end every rank takes each step's
slowest-rank time (one all-gather), so all decide alike, and per pair ``routes - dense``:

* the pairs' noise (`pair_noise`): how far the pairs' differences spread around their median (the
  median absolute deviation), as a share of the dense steps' median;
* the routes win a pair when they beat dense by the margin, the larger of `KEEP_MARGIN` and that
  noise; dense wins it where the routes do not beat it by `KEEP_MARGIN`;
* the routes decide when they win at least `CONSISTENT` (3 in 4) of the pairs so far by the
  margin; dense decides when it wins that share;
* else another round, up to `MAX_ROUNDS`; still split, the win is inside the noise, and every
  weight goes dense: the lower-risk arm (exact gradients, no residuals, the engine's own path, and
  a step no slower than the noise lets anyone tell). A compressed route that pays does not hide
  in the noise: on a link slow enough for it, it wins its pairs clearly; so auto never keeps
  compressed routes whose win is inconclusive. The outcome says the decision was within noise.

A burst of load from elsewhere spoils a pair, not the decision (and not the noise: a median
absolute deviation ignores one pair of four).

**Catching a wrong choice** (`Watch`). After every decision the chosen arm's steps are watched:
every ``route_trial_steps`` steps the ranks agree on their lower quartile (a paused rank stretches
one step, a slower link every step). After a trial the limit is the slower arm's trial median plus
`WATCH_MARGIN`. After a refresh that begins no trial (all dense chosen, or no trial fits) the first
interval is the baseline, plus what the models predict the other routes cost beyond it
(`Route.spare_s`, summed), plus `WATCH_MARGIN` (`RouteTrial.watch_untried`).

A miss makes the next step a refresh (`RouteTrial.refresh_at`): the link is measured again, routes
are chosen anew, and a trial (cause ``"watch"``) tries them where they compress. Where the arm
stays with no trial, the missed figure is its new baseline (the limit only rises: a lasting load is
taken in, and a link that changes while a baseline would be measured is still caught). A
watch-started trial that confirms the choice doubles the watch's interval.

**Calibration.** The miss between the predicted and the measured saving (median of the pairs),
spread over the compressed weights, is added to a per-weight overhead every later decision charges
to each non-dense route (`timing.StepTiming.overhead_s`).

**Where.** Every engine that routes by time on a measured link: the unsharded ones through
`exchange.policy`, FSDP2 and ZeRO-2/3 through `sharded_trial.ShardedTrial`.

Costs: half a trial's steps run on the slower arm, ``route_trial_steps / 2`` to
``MAX_ROUNDS * route_trial_steps / 2`` steps per refresh; a trial that would not end before the
next refresh is not started. The watch costs one all-gather of one number (two, the first interval
of a decision no trial checked) every ``route_trial_steps`` steps, and a link probe where it misses.
Nothing here draws random numbers.
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from dad_integrations.builtin_routes import DENSE
from dad_integrations.config import DADConfig
from dad_integrations.logs import say
from dad_integrations.report import ParamReport, route_summary
from dad_integrations.routing.link import LinkModel
from dad_integrations.routing.timing import StepTiming

log = logging.getLogger(__name__)

KEEP_MARGIN = 0.02   # compressed routes must beat all-dense by this share of the step (or the noise) to win a pair
CONSISTENT = 0.75    # share of the pairs one side must win to decide
MAX_ROUNDS = 3       # rounds of route_trial_steps before split evidence goes dense
NOISE_PAIRS = 3      # pairs from which their noise is measured (`pair_noise`)
WATCH_MARGIN = 0.10  # the chosen arm's steps may exceed both arms' (trial or predicted) figures by this share

def in_backward() -> bool:
    """True while autograd runs a backward pass (checkpointing recomputes forwards there)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


Agree = Callable[[Sequence[float]], List[float]]  # element-wise maximum over ranks (a collective)


class StepClock:
    """The span of one step that the choice of route changes (see the module doc).

    `forward` runs in a forward pre-hook of the model's root module, `open` when the step's window
    opens (its first gradient hook or reduction); the caller reads the end when its exchange ends. A forward counts only with
    gradients enabled, outside backward (checkpointing's recomputation) and while no step is open:
    an evaluation pass under ``no_grad`` starts nothing, and the last training forward before the
    step's backward starts it (micro-steps of one step are in its span)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._forward: Optional[float] = None

    def forward(self) -> None:
        """The root's forward, while no step is open (the caller knows): a step may start here."""
        if torch.is_grad_enabled() and not in_backward():
            self._forward = self.clock()

    def open(self) -> float:
        """A step opens: its start (its forward's, where one was seen)."""
        start, self._forward = self._forward, None
        return self.clock() if start is None else start

    def cancel(self) -> None:
        """Forget a forward seen (a step abandoned, a checkpoint loaded)."""
        self._forward = None


@dataclass(frozen=True)
class TrialOutcome:
    """One trial: the evidence every rank agreed on, and what was kept."""

    step: int                  # the step after which the trial began (a refresh, or a missed watch)
    compressed: int            # weights the tried routes send by factors or a rank route
    routes_s: float            # agreed median step time on those routes
    dense_s: float             # agreed median step time with every weight dense
    predicted_saving_s: float  # what the models predicted the routes would save per step
    kept: bool                 # the tried routes were kept (else every weight stays dense)
    overhead_s: float          # the per-weight overhead charged to non-dense routes from now on
    pairs: int = 0             # paired steps measured
    routes_won: int = 0        # pairs in which the routes beat dense by the margin (KEEP_MARGIN or the noise)
    median_difference_s: float = 0.0  # median over pairs of routes - dense
    conclusive: bool = True    # a side won CONSISTENT of the pairs (else inside the noise: all dense)
    cause: str = "refresh"     # "refresh": routes chosen anew; "watch": the last choice missed
    noise: float = 0.0         # the pairs' noise (`pair_noise`), a share of the dense steps' median

    def line(self, name: str, tried: str) -> str:
        """The decision line both owners say (``tried``: the routes the trial tried)."""
        return f"{name} route trial after step {self.step} ({self.cause}): {self.describe()}; routes tried: {tried}"

    def describe(self) -> str:
        verdict = "routes kept" if self.kept else "all dense"
        why = (f"routes faster in {self.routes_won} of {self.pairs} pairs" if self.conclusive else
               f"inconclusive ({self.routes_won} of {self.pairs} pairs for the routes), {noise_clause(self.noise)}: "
               f"the lower-risk arm taken")
        return (f"{verdict}: {self.compressed} weights compressed {self.routes_s * 1e3:.1f} ms/step, all dense "
                f"{self.dense_s * 1e3:.1f} ms/step (median difference {self.median_difference_s * 1e3:+.1f} ms, "
                f"predicted saving {self.predicted_saving_s * 1e3:.1f} ms); {why}")


def judge(routes: Sequence[float], dense: Sequence[float], margin: float = KEEP_MARGIN,
          consistent: float = CONSISTENT) -> Optional[bool]:
    """The decision rule on paired step times: True (the routes beat dense by the larger of
    ``margin`` and the pairs' noise, `pair_noise`, in ``consistent`` of the pairs), False (they do
    not beat it by ``margin`` in that share) or None (neither: inside the noise)."""
    pairs = len(routes)
    if not pairs:
        return None
    if _won(routes, dense, max(margin, pair_noise(routes, dense))) >= consistent * pairs:
        return True
    if pairs - _won(routes, dense, margin) >= consistent * pairs:
        return False
    return None


def pair_noise(routes: Sequence[float], dense: Sequence[float]) -> float:
    """The pairs' noise: the median absolute deviation of their differences (``routes - dense``),
    as a share of the dense steps' median; 0 below `NOISE_PAIRS` pairs (two differences cannot
    tell their noise from a real gap: the next round measures it). One outlying pair of four moves
    it not at all."""
    if len(routes) < NOISE_PAIRS:
        return 0.0
    differences = [r - d for r, d in zip(routes, dense)]
    middle = statistics.median(differences)
    base = statistics.median(dense)
    return statistics.median(abs(x - middle) for x in differences) / base if base > 0 else 0.0


def noise_clause(share: float) -> str:
    """How a decision inside the noise is said: ``"within noise (±4 %)"``."""
    return f"within noise (±{share * 100:.0f} %)"


@dataclass
class Watch:
    """The chosen arm's steps after a decision, checked against the trial or, without one, against
    their own first interval (see the module doc)."""

    arm: str             # "routes" or "dense"
    limit_s: Optional[float]  # a sustained step time above this is a miss; None: set by the first check
    interval: int        # steps per check
    since: int           # the first watched step
    spare_s: float = 0.0  # no trial: what the models predict the other routes cost beyond the arm's
    tried: bool = True   # the limit is a trial's figure (else the first interval's, `watch_untried`)
    baseline_s: Optional[float] = None  # untried: the baseline where not the first interval's (a missed figure)
    durations: Dict[int, float] = field(default_factory=dict)

    def due(self, step: int) -> bool:
        return step >= self.since and (step - self.since + 1) % self.interval == 0

    def summary(self, step: int) -> float:
        """This rank's lower quartile of the last ``interval`` steps (load only adds time)."""
        return _lower_quartile([self.durations.pop(k, None) for k in range(step - self.interval + 1, step + 1)])


@dataclass
class RouteTrial:
    """The trial in progress (if any), the watch after it, and the calibrated overhead; see the
    module doc. Every rank drives it alike: the same steps, the same agreed figures."""

    steps: int                                   # steps per round (route_trial_steps)
    start: Optional[int] = None                  # the step after which the trial began
    rounds: int = 0                              # rounds begun
    cause: str = "refresh"
    routes: Dict[int, str] = field(default_factory=dict)  # unit index -> the tried route
    predicted_saving_s: float = 0.0
    overhead_s: float = 0.0
    durations: Dict[int, float] = field(default_factory=dict)  # step -> this rank's seconds
    agreed: List[float] = field(default_factory=list)          # trial steps' agreed seconds, in order
    outcomes: List[TrialOutcome] = field(default_factory=list)
    watch: Optional[Watch] = None
    watch_interval: int = 0                      # grows while watch-started trials confirm the choice
    rank: int = 0                                # this rank in the trial's group: rank 0 says the watch's news
    name: str = "dAD"                            # what the watch's line starts with
    news: str = ""                               # the watch's last line, until the owner takes it (reports)
    refresh_at: Optional[int] = None             # the step a missed watch asked to choose routes anew
    missed: str = ""                             # what that watch saw (said where its refresh begins a trial)
    missed_arm: str = ""                         # the arm it watched
    missed_s: float = 0.0                        # the agreed figure it missed with

    @property
    def active(self) -> bool:
        return self.start is not None

    @property
    def pairs_per_round(self) -> int:
        return self.steps // 2

    def fits(self, step: int, next_refresh: int) -> bool:
        """Whether a trial begun after step ``step`` ends, at its longest, before ``next_refresh``."""
        return self.pairs_per_round > 0 and step + MAX_ROUNDS * 2 * self.pairs_per_round < next_refresh

    def begin(self, step: int, routes: Dict[int, str], predicted_saving_s: float, cause: Optional[str] = None) -> None:
        """Try ``routes`` against all-dense from step ``step + 1``; ``cause``: ``"watch"`` where step
        ``step`` is the refresh a missed watch asked for (`refresh_at`), else ``"refresh"``."""
        cause = cause or ("watch" if step == self.refresh_at else "refresh")
        self.start, self.rounds, self.cause = step, 1, cause
        self.routes = dict(routes)
        self.predicted_saving_s = float(predicted_saving_s)
        self.durations, self.agreed, self.watch = {}, [], None
        if cause == "refresh":
            self.watch_interval = self.steps
        elif self.missed:  # the agreed figures, the same on every rank: said once, by rank 0
            self.news = f"{self.missed}: a new route trial"
            say(self.news, rank=self.rank)

    def after_refresh(self, step: int, routes: Dict[int, str], compressed: bool, saving_s: float, spare_s: float,
                      next_refresh: int) -> None:
        """Routes were chosen anew in step ``step``: try them where any compresses and the trial fits, else watch."""
        if compressed and self.fits(step, next_refresh):
            self.begin(step, routes, saving_s)
        else:
            self.watch_untried(step, "routes" if compressed else "dense", 0.0 if compressed else spare_s)

    def watch_untried(self, step: int, arm: str, spare_s: float = 0.0) -> None:
        """Routes were chosen anew in step ``step`` and no trial begins: watch the ``arm`` steps from
        step ``step + 1`` against their first interval (or the missed one, where a missed watch's
        refresh kept its arm) plus ``spare_s`` (module doc)."""
        self.watch = None
        if not self.steps:
            return
        kept = step == self.refresh_at and arm == self.missed_arm
        if step != self.refresh_at:
            self.watch_interval = self.steps
        log.debug("%s: routes chosen anew at step %d, no trial: the %s steps watched from step %d", self.name,
                  step, arm, step + 1)
        self.watch = Watch(arm, None, max(self.watch_interval, 1), step + 1, max(0.0, float(spare_s)), tried=False,
                           baseline_s=self.missed_s if kept else None)

    def cancel(self) -> None:
        """Drop a trial in progress and the watch (a checkpoint was loaded: its steps are not these)."""
        self.start, self.durations, self.agreed, self.watch = None, {}, [], None
        self.refresh_at, self.missed, self.missed_arm, self.missed_s = None, "", "", 0.0

    def arm(self, step: int) -> Optional[str]:
        """``"routes"`` or ``"dense"`` for a step of the trial (``R D D R`` per two pairs), else None."""
        if self.start is None:
            return None
        k = step - self.start - 1
        if not 0 <= k < self.rounds * 2 * self.pairs_per_round:
            return None
        pair, second = divmod(k, 2)
        return ("routes", "dense")[(pair + second) % 2]

    def holds_residuals(self, step: int) -> bool:
        """Step ``step`` is a dense-arm step: error-feedback residuals wait for the trial's next
        routes step instead of being flushed (module doc). Every engine's adapter asks this."""
        return self.arm(step) == "dense"

    def end_of_step(self, step: int, seconds: Optional[float], agree: Agree,
                    next_refresh: int) -> Optional[TrialOutcome]:
        """Step ``step`` took ``seconds`` on this rank: note it; at the end of a round, agree and
        judge (a collective on every rank alike); returns the outcome when the trial is decided. A
        watched step that misses asks for a refresh at step ``step + 1`` (`refresh_at`) where the
        trial after it ends before ``next_refresh`` (which chooses routes anew anyway)."""
        if self.active:
            if seconds is not None and self.arm(step) is not None:
                self.durations[step] = seconds
            if step != self.start + self.rounds * 2 * self.pairs_per_round:
                return None
            return self._end_round(step, agree)
        watch = self.watch
        if watch is None:
            return None
        if seconds is not None:
            watch.durations[step] = seconds
        if not watch.due(step):
            return None
        if watch.limit_s is None:  # the first check of a decision no trial checked: the spare agreed too
            observed, spare = agree([watch.summary(step), watch.spare_s])
            baseline = observed if watch.baseline_s is None else watch.baseline_s
            if baseline <= 0.0:  # no step of the interval was timed (on any rank): the next one is the baseline
                return None
            watch.limit_s = (baseline + spare) * (1.0 + WATCH_MARGIN)
            log.debug("%s: the %s steps take %.1f ms (lower quartile of %d), baseline %.1f ms, the models' spare "
                      "%.1f ms: watched against %.1f ms", self.name, watch.arm, observed * 1e3, watch.interval,
                      baseline * 1e3, spare * 1e3, watch.limit_s * 1e3)
            if watch.baseline_s is None:
                return None
        else:
            (observed,) = agree([watch.summary(step)])
        log.debug("%s: step %d, the %s steps take %.1f ms (lower quartile of %d), limit %.1f ms", self.name, step,
                  watch.arm, observed * 1e3, watch.interval, watch.limit_s * 1e3)
        if observed > watch.limit_s and self.fits(step + 1, next_refresh):
            source = "the trial's" if watch.tried else "the baseline's"
            self.missed = (f"{self.name}: the {watch.arm} steps now take {observed * 1e3:.1f} ms (lower quartile "
                           f"of {watch.interval}), above {source} {watch.limit_s * 1e3:.1f} ms: the link measured "
                           f"again and routes chosen anew")
            self.missed_arm, self.missed_s, self.refresh_at, self.watch = watch.arm, observed, step + 1, None
            log.debug("%s", self.missed)
        return None

    def _end_round(self, step: int, agree: Agree) -> Optional[TrialOutcome]:
        first = step - 2 * self.pairs_per_round + 1
        local = [self.durations.get(k, 0.0) for k in range(first, step + 1)]
        self.agreed += agree(local)
        routes, dense = self._paired()
        verdict = judge(routes, dense)
        if verdict is None and self.rounds < MAX_ROUNDS:
            self.rounds += 1
            return None
        return self._decide(step, routes, dense, verdict)

    def _paired(self) -> Sequence[List[float]]:
        """The agreed times as (routes, dense) per pair."""
        routes, dense = [], []
        for pair in range(len(self.agreed) // 2):
            a, b = self.agreed[2 * pair], self.agreed[2 * pair + 1]
            r, d = (a, b) if pair % 2 == 0 else (b, a)
            routes.append(r)
            dense.append(d)
        return routes, dense

    def _decide(self, step: int, routes: List[float], dense: List[float], verdict: Optional[bool]) -> TrialOutcome:
        compressed = sum(rep != DENSE for rep in self.routes.values())
        kept = verdict is True  # split evidence is inside the noise: the lower-risk arm, all dense (module doc)
        noise = pair_noise(routes, dense)
        difference = statistics.median([r - d for r, d in zip(routes, dense)]) if routes else 0.0
        if compressed:
            self.overhead_s = max(0.0, self.overhead_s + (self.predicted_saving_s + difference) / compressed)
        routes_s = statistics.median(routes) if routes else 0.0
        dense_s = statistics.median(dense) if dense else 0.0
        outcome = TrialOutcome(self.start, compressed, routes_s, dense_s, self.predicted_saving_s, kept,
                               self.overhead_s, pairs=len(routes),
                               routes_won=_won(routes, dense, max(KEEP_MARGIN, noise)),
                               median_difference_s=difference, conclusive=verdict is not None, cause=self.cause,
                               noise=noise)
        if self.cause == "watch" and self.missed_arm == ("routes" if kept else "dense") and self.watch_interval > 0:
            self.watch_interval *= 2  # the choice confirmed: a lasting load need not re-trial as often
        self.outcomes.append(outcome)
        self.start = None
        self.watch = Watch("routes" if kept else "dense", max(routes_s, dense_s) * (1.0 + WATCH_MARGIN),
                           max(self.watch_interval, 1), step + 1) if self.steps else None
        return outcome

    def stop_watching(self) -> None:
        """Routes are chosen anew (a refresh): the last trial's figures no longer apply."""
        self.watch = None


class TrialOwner:
    """What both owners of a route trial keep, decide and say, stated once: `exchange.policy.RoutePolicy`
    (DDP, the synchroniser) and `sharded_trial.ShardedTrial` (FSDP2, ZeRO). They hold the models
    (``timing``), the trial, the units whose capture they switch, and say (rank ``say_rank`` shows it)
    the last decision, the routes where they change and a trial's outcome."""

    timing: Optional[StepTiming]
    units: Sequence  # of `capture.units.FactorUnit`

    def __init__(self, config: DADConfig, name: str, say_rank: int):
        self.config = config
        self.name = name
        self.say_rank = say_rank
        self.trial: Optional[RouteTrial] = None
        self.decision = ""       # the last decision said, with its evidence (reports)
        self._tried = ""         # the last routes-arm step's routes and bytes
        self._said_routes = ""   # the routes last said
        self.within_noise: Dict[int, float] = {}  # unit index -> its last choice's margin, where inside the noise

    # -- which steps choose anew ------------------------------------------------------------------
    def refresh(self, step: int) -> bool:
        """Whether step ``step`` chooses every route anew (the owner's rule, on `chooses_anew`)."""
        raise NotImplementedError

    def chooses_anew(self, step: int) -> bool:
        """Every ``route_refresh_steps`` and when the lossless steps end (not step 0, which chooses
        them anyway), and the step after a watch missed (`RouteTrial.refresh_at`)."""
        return self.measures_link(step) or (step > 0 and step == self._lossless)

    def measures_link(self, step: int) -> bool:
        """Whether the refresh of step ``step`` measures the link again first: every
        ``route_refresh_steps`` and after a watch missed, not where only the lossless steps end (the
        measurement of attach is then at most ``lossless_steps`` old, and a probe at the job's sizes
        would slow that step by about a third of a 124 M model's step on loopback)."""
        return (step > 0 and step % self.config.route_refresh_steps == 0
                or (self.trial is not None and self.trial.refresh_at == step))

    def next_refresh(self, step: int) -> int:
        """The first step after ``step`` that chooses every route again."""
        following = (step // self.config.route_refresh_steps + 1) * self.config.route_refresh_steps
        return min(following, self._lossless) if self._lossless > step else following

    @property
    def _lossless(self) -> int:
        return self.config.lossless_steps

    def arm(self, step: int) -> Optional[str]:
        """The trial's arm of step ``step`` (`RouteTrial.arm`), None outside a trial."""
        return self.trial.arm(step) if self.trial is not None else None

    def holds_residuals(self, step: int) -> bool:
        """A trial's dense-arm step: residuals wait for its next routes step (`RouteTrial.holds_residuals`)."""
        return self.trial is not None and self.trial.holds_residuals(step)

    @property
    def outcomes(self) -> List[TrialOutcome]:
        """The trials so far (`TrialOutcome`)."""
        return list(self.trial.outcomes) if self.trial is not None else []

    # -- the models' link -------------------------------------------------------------------------
    def flat_link(self) -> Optional[LinkModel]:
        """The link routes are priced on: the models' where routed by time, else the stated one (per
        hop: the one between nodes, which flat steps cross), else None."""
        if self.timing is not None:
            return self.timing.link
        return LinkModel.from_spec(self.config.link) if self.config.link is not None else None

    def set_link(self, link: LinkModel) -> None:
        """Route by ``link`` (the same on every rank) from the next refresh on."""
        if self.timing is not None:
            self.timing = dataclasses.replace(self.timing, link=link)

    # -- capture ----------------------------------------------------------------------------------
    def drop_rows(self) -> None:
        """Every unit goes dense next step: capture nothing (a step that costs what the engine's does)."""
        for u in self.units:
            if not u.rows_unused and not u.dense_only:
                u.stop_using_rows()

    def use_rows(self, indices: Optional[Sequence[int]] = None) -> None:
        """Capture the rows of the units of ``indices`` (all, where None) again, where some route can use them."""
        wanted = None if indices is None else set(indices)
        for u in self.units:
            if (wanted is None or u.index in wanted) and u.rows_unused and not u.dense_only:
                u.rows_unused = False
                u.update_capture()

    # -- the trial --------------------------------------------------------------------------------
    def chosen(self, step: int) -> Tuple[Dict[int, str], bool, float, float]:
        """The routes chosen anew in step ``step``, whether any compresses, their predicted saving and
        the dense units' spare: what `RouteTrial.after_refresh` tries or watches."""
        raise NotImplementedError

    def trial_step(self, step: int, seconds: Optional[float], agree: Agree) -> Optional[TrialOutcome]:
        """End of step ``step`` (``seconds``: its span on this rank; the trial exists): try or watch
        routes chosen anew, judge a trial, or watch the last decision; returns a trial's outcome."""
        trial, outcome = self.trial, None
        if not trial.active and (step == 0 or self.refresh(step)):
            trial.after_refresh(step, *self.chosen(step), self.next_refresh(step))
        else:
            outcome = trial.end_of_step(step, seconds, agree, self.next_refresh(step))
        if trial.news:  # a missed watch's refresh began a trial: its line is the last decision said
            self.decision, trial.news = trial.news, ""
        return outcome

    def say_outcome(self, outcome: TrialOutcome, how: str = "", after: str = "") -> None:
        """A trial's decision line (``how``: before the routes tried; ``after``: appended)."""
        self._said_routes = ""
        self.say(outcome.line(self.name, how + (self._tried or "none")) + after)

    # -- what users see ---------------------------------------------------------------------------
    def note_noise(self, index: int, decision) -> None:
        """Unit ``index`` was routed anew by ``decision`` (a `router.Route`): whether inside the noise."""
        if decision.within_noise > 0:
            self.within_noise[index] = decision.within_noise
        else:
            self.within_noise.pop(index, None)

    def noise_note(self) -> str:
        """The routes line's clause for choices made inside the noise (`router.timed_pick`):
        ``"; 13 weights within noise (±6 %), taken in the routes' tie order"``, or ""."""
        shares = self.within_noise.values()
        if not shares:
            return ""
        return f"; {len(shares)} weights {noise_clause(max(shares))}, taken in the routes' tie order"

    def say(self, line: str) -> None:
        """A decision, with its evidence: shown on rank 0 (`logs.say`), kept for the reports."""
        self.decision = line
        say(line, rank=self.say_rank)

    def summary(self, step: int, params: Sequence[ParamReport]) -> str:
        """Step ``step``'s routes (`report.route_summary`) where a trial may begin or tries them, or
        they may be said; "" on other steps (a steady step stays cheap). Notes the routes tried."""
        arm = self.arm(step)
        if not params or not (arm == "routes" or step <= 1 or self.refresh(step)):
            return ""
        summary = route_summary(params)
        if arm in (None, "routes"):
            self._tried = summary
        return summary

    def say_routes(self, step: int, summary: str) -> None:
        """After the first steady step and each refresh (no trial under way): the routes, where they
        changed since last said."""
        if not summary or step < 1 or (step > 1 and not self.refresh(step)) or summary == self._said_routes:
            return
        self._said_routes = summary
        how = (f"by the models, link {self.timing.link.brief()}" if self.timing is not None else
               f"mode {self.config.mode}" if self.config.mode != "auto" else "by bytes")
        self.say(f"{self.name} routes at step {step}: {summary} ({how}){self.noise_note()}")

    def say_mode_cost(self, probe: Callable[[], Optional[LinkModel]],
                      cost_line: Callable[[LinkModel], Optional[str]]) -> None:
        """After the first step: warn where mode exact or rank is predicted to slow the exchange past
        the engine's own (``cost_line``, `mode_cost`) on `flat_link`, or (objective time, no link
        stated) the link ``probe`` measures here: a collective, at the same point on every rank."""
        if self.config.mode not in ("exact", "rank"):
            return
        link = self.flat_link()
        if link is None and self.config.objective == "time":
            link = probe()
        line = cost_line(link) if link is not None else None
        if line is not None:
            say(line, rank=self.say_rank, level=logging.WARNING)


def _won(routes: Sequence[float], dense: Sequence[float], margin: float) -> int:
    """Pairs in which the routes beat dense by ``margin``."""
    return sum(r < (1.0 - margin) * d for r, d in zip(routes, dense))


def _lower_quartile(values: Sequence[Optional[float]]) -> float:
    known = sorted(v for v in values if v is not None)
    return known[len(known) // 4] if known else 0.0


class TimedRoutes:
    """What a synchroniser shows of its routing by time, over its `TrialOwner` (``self._trial``):
    ``set_link``, ``timing``, ``route_trials``; the same for every engine."""

    _trial: TrialOwner

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
        """The route trials so far (`TrialOutcome`); empty where routes are not chosen
        by time on a measured link in mode auto."""
        return self._trial.outcomes
