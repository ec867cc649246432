"""The router: which representation each factor unit takes this step, and whether sizes are exchanged.

A pure function of things every rank agrees on (the config, the unit's shape, the world size, the
row counts of the unit's size exchanges, whether this is the checked first step), so that every
rank takes the same decision and issues the same collectives in the same order.

Routes are the registry's (`dad_integrations.routes`: ``dense``, ``exact``, ``rank_allreduce``,
``rank``, one module each with its bytes per layout); which a mode allows is `allowed_routes`, the
one statement of that rule that every layout's chooser asks.

The two rank routes need no row counts; which one a weight takes is ``rank_route``'s choice, by
bytes where it is ``"auto"`` (a tie, as at two sites, goes by the registry's tie order: the
all-reduce). Embeddings take them too (from their dense local gradient, as PowerSGD compresses them).

Against PowerSGD. PowerSGD's hook sends each matrix as ``r (m+n)`` all-reduced (or dense where
that does not compress it twofold) and everything else dense. Auto with ``rank=r`` takes the
fewest bytes among routes that include both of those (``"rank_allreduce"`` is PowerSGD's
exchange; ``"dense"`` its all-reduce), so in steady state it never sends more, weight by weight.
By time the same holds for every compressed route (`byte_capped`, config key ``byte_cap``): one
that would send more than the lesser of those two is no candidate; dense always is.

Size exchanges. Exact factors have a row count per rank, which the ranks agree on (one small
all-gather per unit) before the factors' all-gather. The first step (verification) exchanges
sizes for every unit. After it, mode ``"rank"`` never exchanges sizes, and mode ``"auto"``
predicts each unit's route from the counts of its last size exchange: a unit predicted to go
dense or rank-r sends no size exchange at all (so a dense unit moves exactly what all-reduce
moves); one predicted to go exact exchanges sizes, which refreshes its counts, and then decides
on the current counts. Counts of a unit that goes dense or rank-r are not refreshed: if rows
later shrink, it stays on that route (sticky after the first steps; it never costs more bytes
than its route).

Sharded (FSDP2, ZeRO: ``sharded=True``): the baseline is the engine's reduce-scatter, always a
candidate, so auto never sends more than it per weight; every route is priced on the
``row_shards`` layout (`costs.estimate_bytes`). Each sharded reduction call agrees on its weights'
row counts (one all-gather) before routing, except in mode ``"rank"`` past the lossless
steps (`sharded_needs_counts`).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from dad_integrations.builtin_routes import DENSE, EXACT, RANK_ALLREDUCE
from dad_integrations.config import DADConfig
from dad_integrations.routes import layouts
from dad_integrations.routes.registry import (UnitSizing, estimates_on, get_route, rank_route_names, routes_for,
                                              tie_order)
from dad_integrations.routing.costs import size_exchange_bytes
from dad_integrations.routing.timing import StepTiming

RowCounts = Sequence[Sequence[int]]           # by rank, by use
# by time, a unit changes route only for a predicted gain above this share (or the routes' noise)
SWITCH_MARGIN = 0.25
# by time, routes predicted within this share of the fastest (or their measured noise, where larger)
# tie, and ties go by the registry's order (`routes`; docs/concepts/routing-by-time.md)
TIE_BAND = 0.05


def step_rules(config: DADConfig, step: Optional[int]) -> Tuple[DADConfig, Dict[str, object]]:
    """The config step ``step`` is routed under, and `allowed_routes`' keywords for it: before
    ``lossless_steps`` no lossy route (auto, without a rank); an adaptive rank applies to each
    site's own factors, so it takes the all-gather route."""
    lossy = step is None or step >= config.lossless_steps
    if not lossy and config.rank is not None:
        config = dataclasses.replace(config, mode="auto", rank=None, adaptive_tolerance=None)
    rank_route = "allgather" if config.adaptive_tolerance is not None else config.rank_route
    return config, dict(rank_allowed=config.rank is not None, rank_route=rank_route, lossy_allowed=lossy)


def allowed_routes(mode: str, available: Iterable[str], *, rank_allowed: bool,
                   rank_route: str = DADConfig.rank_route, lossy_allowed: bool = True) -> List[str]:
    """The routes a unit may take among ``available`` (those priced for it), the one statement of
    the modes' rules: ``"exact"`` takes exact factors where it can, else dense; ``"rank"`` a rank
    route of ``rank_route`` where one is available; ``"auto"`` (and ``"rank"`` without one) the
    lossless routes, and ``"auto"`` the rank routes too. Without ``rank_allowed`` (no rank, the
    lossless steps) no rank route; without ``lossy_allowed`` (the lossless steps) no other lossy
    route either (the opt-in ones a config names, which ``"auto"`` weighs beside the others)."""
    available = list(available)
    if mode == "exact":
        return [EXACT if EXACT in available else DENSE]
    ranks = [k for k in rank_route_names(rank_route) if k in available] if rank_allowed else []
    if mode == "rank" and ranks:
        return ranks
    lossless = [k for k in available if get_route(k).lossless]
    others = [k for k in available if lossy_allowed and not get_route(k).lossless and not get_route(k).is_rank]
    return lossless + (ranks + others if mode == "auto" else [])


def choose_at(config: DADConfig, step: Optional[int], estimates: Dict[str, float],
              ties: Optional[Dict[str, float]] = None, *, seconds: Optional[Dict[str, float]] = None,
              current: Optional[str] = None, noise: Optional[Dict[str, float]] = None) -> str:
    """The one pick of a unit's route, every layout's: `choose` under ``config`` in step ``step``
    (`step_rules`) by ``estimates`` (bytes; ``ties`` break theirs), or, given ``seconds``, by time
    (`timed_pick`; ``noise``: each route's measured noise in seconds)."""
    if seconds is None:
        config, rules = step_rules(config, step)
        return choose(config.mode, estimates, ties=ties, **rules)
    return timed_pick(config, step, estimates, seconds, current=current, noise=noise)[0]


def timed_pick(config: DADConfig, step: Optional[int], estimates: Dict[str, float], seconds: Dict[str, float], *,
               current: Optional[str] = None, noise: Optional[Dict[str, float]] = None) -> Tuple[str, float]:
    """A unit's route by predicted ``seconds`` (the ``estimates``' bytes breaking exact ties), and
    whether the pick was inside the noise: the margin it was made within, as a share of the
    fastest route's seconds (0: a clear pick).

    The margin between the fastest route and another is the larger of `TIE_BAND` of the fastest's
    seconds and the two routes' measured ``noise`` (`timing.StepTiming.route_noise`). In mode auto
    the routes within it of the fastest are equal, and the registry's tie order picks among them
    (dense, exact, PowerSGD's all-reduce, rank-dAD: lossless first, then the fewer bytes), an order
    no timing moves: identical runs pick alike. A ``current`` route (hysteresis) is kept unless
    another is predicted faster by more than `SWITCH_MARGIN`, or than their noise where that is
    larger and ``current`` comes first in the tie order. ``within`` is the widest margin over the
    slower route's seconds."""
    config, rules = step_rules(config, step)
    pick = functools.partial(choose, config.mode, **rules)
    seconds = byte_capped(config, estimates, seconds)
    noise = noise or {}
    best = pick(seconds, ties=estimates)
    fastest = seconds[best]

    def margin(k: str, a: str, floor: float) -> float:
        return max(floor * seconds[a], noise.get(k, 0.0) + noise.get(a, 0.0))

    within = 0.0
    if config.mode == "auto":
        band = {k: 0.0 for k, t in seconds.items() if t - fastest <= margin(k, best, TIE_BAND)}
        equal = allowed_routes(config.mode, band, **rules)
        if len(equal) > 1:  # a decision inside the noise: said in the routes line (`trial.TrialOwner`)
            within = max(margin(k, best, TIE_BAND) / max(seconds[k], fastest, 1e-12) for k in equal if k != best)
        best = pick(band)
    if current in seconds and current != best:
        # the noise widens the hold only towards the tie order's earlier route (a compressed route
        # whose gain over dense is inside the noise is not kept, as at a first choice)
        hold = margin(current, best, SWITCH_MARGIN) if tie_order(current) < tie_order(best) else \
            SWITCH_MARGIN * seconds[best]
        if seconds[current] - seconds[best] <= hold and pick({**seconds, current: -1.0}) == current:
            best = current  # still allowed, and not worth a switch
    return best, within


def byte_capped(config: DADConfig, estimates: Dict[str, float], seconds: Dict[str, float]) -> Dict[str, float]:
    """``seconds`` without the compressed routes that send more bytes (``estimates``) than PowerSGD's
    hook would for the weight at the same rank: the lesser of its all-reduced ``P``, ``Q`` and dense
    (config key ``byte_cap``; mode auto with a rank, where the rank routes are priced). Dense stays.
    By bytes no cap is needed: PowerSGD's two routes are among the candidates."""
    if not (config.byte_cap and config.mode == "auto" and RANK_ALLREDUCE in estimates and DENSE in estimates):
        return seconds
    cap = min(estimates[RANK_ALLREDUCE], estimates[DENSE]) * (1 + 1e-12)
    return {k: t for k, t in seconds.items() if k == DENSE or estimates.get(k, 0.0) <= cap}


def candidates_at(config: DADConfig, step: Optional[int], available: Iterable[str]) -> List[str]:
    """`allowed_routes` under ``config`` in step ``step`` (`step_rules`)."""
    config, rules = step_rules(config, step)
    return allowed_routes(config.mode, available, **rules)


@dataclass(frozen=True)
class UnitShape:
    """What routing needs to know of a unit: its uses' layer kinds, weight shape, bias size, dtype."""

    kinds: Tuple[str, ...]
    shape: Tuple[int, int]
    bias_numel: int
    dtype: torch.dtype
    blocks: Optional[Tuple[Optional[Tuple[int, int]], ...]] = None  # the uses' row blocks (`rows`)

    @property
    def has_factors(self) -> bool:
        """A unit without uses (PowerSGD's floor) has no exact factors: dense or a rank route."""
        return bool(self.kinds)

    @classmethod
    def of(cls, unit, dtype: Optional[torch.dtype] = None) -> "UnitShape":
        """The shape of a `capture.units.FactorUnit` (``dtype``: its weight's unless given)."""
        return cls(tuple(unit.kinds), unit.shape, unit.bias_numel, dtype or unit.param.dtype, unit.blocks)


@dataclass(frozen=True)
class Route:
    """A unit's route this step.

    ``representation`` is None when it is decided on this step's row counts (after the size
    exchange); ``exchange_sizes`` says whether the unit's size exchange runs. ``saved_s``: by
    time, the seconds per step the representation is predicted to save against dense (what a
    route trial checks, `route_trial`). ``spare_s``: by time in mode auto, where the unit goes
    dense, the seconds its fastest other route is predicted to take beyond dense (what the watch
    of a decision no trial checked allows its steps to slow by, `trial.RouteTrial.watch_untried`).
    ``seconds``: by time, the predicted seconds of every route the unit may take this step (allowed
    and within the byte cap, dense among them): what a route set is priced on (`partial_set`).
    ``within_noise``: by time, where another route was predicted within the margin of the chosen one
    (`timed_pick`), that margin as a share of the fastest's seconds; 0 for a clear pick.
    """

    representation: Optional[str]
    exchange_sizes: bool
    saved_s: float = 0.0
    spare_s: float = 0.0
    within_noise: float = 0.0
    seconds: Optional[Dict[str, float]] = dataclasses.field(default=None, compare=False)


@dataclass(frozen=True)
class RouteContext:
    """What every unit of one step is routed under, the same on every rank.

    Attributes:
        config: the synchroniser's config (mode, rank).
        world_size: number of ranks.
        wire_dtype: the dtype factors travel in.
        step: the synchronised step's index; steps below ``config.lossless_steps`` take no rank route.
        first_step: the checked first step, in which every unit exchanges sizes (and its check).
        refresh: a step on which ``objective="time"`` chooses every route again: sizes are
            exchanged, as on the first step.
        sharded: decide on the sharded engines' numbers (reduce-scatter against sharded factors and
            rank routes).
        timing: the agreed link and compute models; with ``config.objective == "time"`` the
            decision is by predicted seconds (`timing.StepTiming.route_seconds`) instead of bytes,
            the bytes breaking ties.
    """

    config: DADConfig
    world_size: int
    wire_dtype: torch.dtype
    step: Optional[int] = None
    first_step: bool = False
    refresh: bool = False
    sharded: bool = False
    timing: Optional[StepTiming] = None


@dataclass(frozen=True)
class UnitEvidence:
    """What is known of one unit when it is routed (every field agreed across ranks).

    Attributes:
        dense_only: the unit failed the first-step check: dense for good.
        rows_by_rank: this step's agreed counts; given, the decision is final.
        last_rows: the counts of the unit's last size exchange (auto's prediction).
        estimates: agreed bytes per representation to decide on, in place of the cost model's (with
            ``rows_by_rank``, or in mode rank): an adapter that knows its exchange's exact sizes
            (ZeRO's partitions, `deepspeed_dad.zero`).
        ties: with ``estimates``, agreed bytes that break their ties before the order of
            the registry's tie order does (ZeRO: estimates on the busiest rank, ties by the mean over ranks).
        current: the unit's route so far; by time, it is kept unless another is predicted faster
            by more than `SWITCH_MARGIN` or their measured noise (a switch must pay for the noise
            of the measurements and for the residual it flushes).
    """

    dense_only: bool = False
    rows_by_rank: Optional[RowCounts] = None
    last_rows: Optional[RowCounts] = None
    estimates: Optional[Dict[str, float]] = None
    ties: Optional[Dict[str, float]] = None
    current: Optional[str] = None


NO_EVIDENCE = UnitEvidence()


def route(ctx: RouteContext, unit: UnitShape, seen: UnitEvidence = NO_EVIDENCE) -> Route:
    """The route of one unit this step: ``ctx`` for the step, ``seen`` for what is known of the
    unit (see their attributes)."""
    world_size, wire_dtype, first_step, sharded = ctx.world_size, ctx.wire_dtype, ctx.first_step, ctx.sharded
    config, rules = step_rules(ctx.config, ctx.step)
    rank_allowed = rules["rank_allowed"]
    if seen.dense_only:
        return Route(DENSE, first_step)
    if not unit.has_factors:  # no rows: decided without counts, never a size exchange
        if config.mode == "exact" or not rank_allowed:
            return Route(DENSE, False)
    timed = ctx.timing if config.objective == "time" else None

    def decide(rows: RowCounts, given: Optional[Dict[str, float]], exchange: bool,
               size_exchange: bool = False) -> Route:
        est = given if given is not None else unit_estimates(config, unit, rows, world_size, wire_dtype,
                                                             sharded=sharded, size_exchange=size_exchange)
        if timed is None:
            return Route(choose_at(ctx.config, ctx.step, est, seen.ties), exchange)
        where = dict(shape=unit.shape, uses=len(unit.kinds), rows_by_rank=rows, world_size=world_size,
                     sharded=sharded, size_exchange=size_exchange)
        seconds = timed.route_seconds(est, **where)
        best, within = timed_pick(ctx.config, ctx.step, est, seconds, current=seen.current,
                                  noise=timed.route_noise(est, **where))
        capped = byte_capped(config, est, seconds)
        allowed = {k: capped[k] for k in candidates_at(ctx.config, ctx.step, capped)}
        return Route(best, exchange, seconds.get(DENSE, seconds[best]) - seconds[best],
                     spare_seconds(seconds, best) if config.mode == "auto" else 0.0, within,
                     {**allowed, best: seconds[best]})

    if (config.mode == "rank" and rank_allowed) or not unit.has_factors:  # rank routes need no counts
        no_rows = [[0] * len(unit.kinds)] * world_size
        return decide(no_rows, seen.estimates, first_step and unit.has_factors)
    if seen.rows_by_rank is not None:
        return decide(seen.rows_by_rank, seen.estimates, True)
    if first_step or ctx.refresh or config.mode == "exact" or seen.last_rows is None:
        return Route(EXACT if config.mode == "exact" else None, True)
    predicted = decide(seen.last_rows, None, False, size_exchange=True)
    if predicted.representation != EXACT:
        return predicted                # no counts needed
    return Route(None, True)            # exact predicted: refresh the counts, decide on them


def spare_seconds(seconds: Dict[str, float], chosen: str) -> float:
    """Where ``chosen`` is dense: the predicted seconds of the fastest other route priced
    (``seconds``) beyond dense's; 0 otherwise, or where no other route is priced."""
    others = [t for k, t in seconds.items() if k != DENSE]
    return max(0.0, min(others) - seconds[DENSE]) if chosen == DENSE and others else 0.0


def rank_only(config: DADConfig, step: int) -> bool:
    """Mode ``"rank"`` past the lossless steps: every weight takes a rank route (r rows, whatever the
    batch), so no route needs row counts."""
    return config.mode == "rank" and config.rank is not None and step >= config.lossless_steps


def sharded_needs_counts(config: DADConfig, step: int) -> bool:
    """Whether a sharded reduction call (FSDP2, ZeRO) of synchronised step ``step`` (0-based) agrees
    on every rank's row counts before routing (not where `rank_only`)."""
    return not rank_only(config, step)


def unit_sizing(config: DADConfig, unit: UnitShape, rows: Optional[RowCounts], wire_dtype: torch.dtype,
                **where) -> UnitSizing:
    """What the routes' byte models need of ``unit`` under ``config``; ``where``: the layout's
    sizes (``world_size``, or ``nodes`` and ``local``, `routes.registry.UnitSizing`)."""
    return UnitSizing(tuple(unit.kinds), tuple(unit.shape), unit.dtype, wire_dtype, rank=config.rank or 0,
                      rounds=config.power_iterations, bias_numel=unit.bias_numel, blocks=unit.blocks, rows=rows,
                      **where)


def unit_estimates(config: DADConfig, unit: UnitShape, rows_by_rank: RowCounts, world_size: int,
                   wire_dtype: torch.dtype, *, sharded: bool = False, size_exchange: bool = False) -> Dict[str, float]:
    """Bytes per rank of each of ``config``'s routes for one unit (its byte model, `routes`) on the
    flat layout (`costs.estimate_bytes`), or on the sharded engines' row shards where ``sharded``
    (`costs.estimate_bytes` on ``row_shards``; ``unit.dtype`` is then the engine's reduce dtype);
    ``size_exchange``: exact factors exchange their sizes first (`costs.size_exchange_bytes`)."""
    sizing = unit_sizing(config, unit, rows_by_rank, wire_dtype, world_size=world_size)
    est = estimates_on(layouts.ROW_SHARDS if sharded else layouts.FLAT, sizing, routes_for(config.routes))
    if size_exchange and EXACT in est:
        est[EXACT] += size_exchange_bytes(len(unit.kinds), world_size)
    return est


def choose(mode: str, estimates: Dict[str, float], *, rank_allowed: bool,
           rank_route: str = DADConfig.rank_route, ties: Optional[Dict[str, float]] = None,
           lossy_allowed: bool = True) -> str:
    """The route of one unit among `allowed_routes`, given agreed estimates (bytes or seconds);
    equal estimates are decided by ``ties`` (where given), then by the registry's tie order."""
    allowed = allowed_routes(mode, estimates, rank_allowed=rank_allowed, rank_route=rank_route,
                             lossy_allowed=lossy_allowed)
    ties = ties or {}
    return min(allowed, key=lambda k: (estimates[k], ties.get(k, 0.0), tie_order(k)))
