"""Predicted seconds of each route of one unit: its wire time on the link plus its local compute.

``objective="time"`` (the default) has auto weigh routes by what users pay, step time, instead of
bytes. For one unit and representation::

    seconds = link.seconds(kind, bytes, calls) + compute.seconds(representation, shape, rows)

``bytes`` is the cost model's own estimate (`costs`), so the two objectives see the same traffic;
``kind`` is the collective the route uses (`collective_of`); ``calls`` counts the collectives a unit
issues alone (exact factors and their size exchange: one all-gather each), which pay the link's
latency per call. The bucketed routes (dense buckets, the rank routes' shared buckets) pay it once
per bucket, shared by many units, and count none here.

No route is credited with overlap: with DDP's bucket sizes most of a small model's bytes sit in
the last bucket, sent when backward ends, and the compressed routes' compute, on a thread beside
backward, delays the step on a device with no spare core or stream (`benchmarks/README.md`). So
dense all-reduce's predicted time is its wire time, and since dense is always a candidate, auto's
predicted step is never slower than all-reduce's. What the models miss, route trials measure on
the job's own steps, calibrating ``StepTiming.overhead_s`` (`trial`).

Noise. Both models know how far their own timings spread (`compute_model.ComputeModel.noise`,
``link.LinkModel.noise``); `StepTiming.route_noise` sums them per route: the seconds by which a
route's prediction may be off from measurement noise alone. The router takes routes whose
predictions differ by less than that as equal (`router.choose_at`), so near-equal routes do not
flip between identical runs on a machine's load.

`StepTiming` carries the two models every rank agreed on; `build_timing` measures them (or takes
the config's stated link) for a synchroniser's units.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple

import torch

from dad_integrations.builtin_routes import DENSE, EXACT
from dad_integrations.comm.aggregator import FactorAggregator
from dad_integrations.routing.compute_model import ComputeModel, measure_compute
from dad_integrations.config import DADConfig
from dad_integrations.routing.link import DEFAULT_TOP, LinkModel, job_probe_top, probe_link
from dad_integrations.rng import isolated
from dad_integrations.routes import layouts
from dad_integrations.routes.registry import get_route

log = logging.getLogger(__name__)

# measures a link (a collective): ``probe(aggregator, device, top_bytes=...)``, as `probe_link`
LinkProbe = Callable[..., LinkModel]


def collective_of(route: str, sharded: bool = False) -> str:
    """The collective kind the link model times for ``route``: its wire hop on the flat layout,
    or on FSDP2's row shards for the sharded engines (the engine's reduce-scatter is timed as an
    all-to-all; the factor routes' all-gather of right factors or Q's carries most of their
    bytes). ZeRO's partitions and HSDP's hop are timed with the row shards' kinds too."""
    return get_route(route).collective(layouts.ROW_SHARDS if sharded else layouts.FLAT)


@dataclass(frozen=True)
class StepTiming:
    """The link and compute models every rank agreed on; ``overhead_s``: seconds per step charged
    to each non-dense route of a weight on top of the models, calibrated by the job's own steps
    (`trial`); ``probe_top``: the largest link probe for the job's sizes (`link.job_probe_top`), which
    a refresh measures up to again."""

    link: LinkModel
    compute: ComputeModel
    overhead_s: float = 0.0
    probe_top: int = DEFAULT_TOP

    def route_seconds(self, estimates: Dict[str, float], *, shape: Tuple[int, int], uses: int,
                      rows_by_rank: Sequence[Sequence[int]], world_size: int, sharded: bool = False,
                      size_exchange: bool = False) -> Dict[str, float]:
        """Predicted seconds per representation of one unit, from its byte ``estimates``."""
        out = {}
        for rep, nbytes in estimates.items():
            calls = (1 + int(size_exchange)) if rep == EXACT else 0
            out[rep] = (self.link.seconds(collective_of(rep, sharded), nbytes, calls)
                        + self.compute.seconds(rep, shape, rows_by_rank=rows_by_rank, world_size=world_size,
                                               calls=uses)
                        + (self.overhead_s if rep != DENSE else 0.0))
        return out

    def route_noise(self, estimates: Dict[str, float], *, shape: Tuple[int, int], uses: int,
                    rows_by_rank: Sequence[Sequence[int]], world_size: int, sharded: bool = False,
                    size_exchange: bool = False) -> Dict[str, float]:
        """Seconds by which each representation's `route_seconds` may be off from the models'
        measured noise alone: its wire time times the link's noise, plus its compute's (module doc)."""
        out = {}
        for rep, nbytes in estimates.items():
            calls = (1 + int(size_exchange)) if rep == EXACT else 0
            out[rep] = (self.link.seconds(collective_of(rep, sharded), nbytes, calls) * self.link.noise
                        + self.compute.noise(rep, shape, rows_by_rank=rows_by_rank, world_size=world_size,
                                             calls=uses))
        return out


def wants_timing(config: DADConfig) -> bool:
    """Whether ``config``'s routes are chosen by predicted time (and so need the models)."""
    return config.objective == "time" and config.mode != "exact"


def build_timing(config: DADConfig, shapes: Iterable[Tuple[int, int]], aggregator: FactorAggregator,
                 device: torch.device, *, link_kinds: Sequence[str] = ("all_reduce", "all_gather"),
                 dtype: torch.dtype = torch.float32, probe: Optional[LinkProbe] = None) -> Optional[StepTiming]:
    """Measure (or, for a stated ``link``, take) the models for units of ``shapes``; None where
    the config does not choose by time. The link is probed up to the sizes the step sends (the
    dense buckets' ``bucket_cap_mb``, the largest weight; `link.job_probe_top`). A collective: every
    rank calls it at the same point."""
    if not wants_timing(config):
        return None
    shapes = list(shapes)
    top = job_probe_top(shapes, config.bucket_cap_mb)
    # the measurement draws from dAD's own generators; whatever draws from the global ones (a
    # probe layer's initialisation, a kernel's) runs on a copy: the caller's dropout masks stay
    # those of the run without dAD (`rng`)
    with isolated(device):
        if config.link is not None:
            link = LinkModel.from_spec(config.link)
        else:
            link = (probe(aggregator, device, top_bytes=top) if probe is not None
                    else probe_link(aggregator, device, kinds=link_kinds, top_bytes=top))
        compute = measure_compute(shapes, rank=config.rank, world_size=aggregator.world_size,
                                  iterations=config.power_iterations, error_feedback=config.error_feedback,
                                  device=device, dtype=dtype, aggregator=aggregator)
    if aggregator.rank == 0:  # the details; the attach line users see says the link (`exchange.levels`)
        log.debug("dAD: routes by predicted time; link %s (%s, noise %.0f %%); capture %.1f us per call",
                  link.describe(), "measured" if link.measured else "stated", link.noise * 100,
                  compute.capture_per_call * 1e6)
    return StepTiming(link, compute, probe_top=top)
