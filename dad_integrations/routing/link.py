"""The link model: how long one collective of a given kind and size takes on the job's group.

Per collective kind, the classic ``t = alpha + bytes / beta`` (Hockney's model): ``alpha`` the
latency of one call, ``beta`` the bandwidth one rank sees. ``bytes`` is what the cost model
(`costs`) counts for the call on one rank (``2 (S-1)/S n`` for a ring all-reduce of ``n`` bytes,
``(S-1) n`` for an all-gather), so a fitted ``beta`` folds the algorithm's own factors in and
the model predicts what the router weighs, not a wire rate.

Kinds: ``"all_reduce"`` (dense buckets, PowerSGD's P and Q), ``"all_gather"`` (exact and rank-r
factors, size exchanges) and ``"all_to_all"`` (the sharded codecs' slices; FSDP2's and ZeRO's
reduce-scatter, the sharded dense baseline, is timed as one too).

Where it comes from (`probe_link`): collectives of each kind, timed on the job's own group at
attach and again every ``route_refresh_steps``, fitted per kind, and agreed across ranks by taking
the slowest rank's figures (an all-gather of them), so every rank decides alike. A config's
``link`` states it instead (`LinkModel.from_spec`), for planning and tests.

Probe sizes (`probe_top`, `probe_ladder`). The model is used to price what a step sends: dense
buckets of up to ``bucket_cap_mb`` (25 MiB by default) and whole weights (a 50257 x 768 embedding
is 154 MB), so it is measured up to those sizes. Sizes run geometrically (x4) from 4 KiB, where
the latency dominates, to the largest of the bucket cap and the largest weight, capped at
``PROBE_CEILING`` (64 MiB). The cap costs no accuracy: a call is in its bandwidth regime once its
bytes are well past ``alpha * beta``, which is under 1 MiB even for 100 Gbit/s at 50 us, so 64 MiB
holds the default bucket with room and a larger call is predicted by the same line; what larger
probes would add is time and memory. Each probe holds at most the size it times: an all-gather's
output (``S`` inputs) is the size, so its input is ``size / S``; every buffer is dropped before the
next size is made.

Time is bounded by ``budget_s`` per kind (1 s by default): after each size the ranks agree on its
slowest time (a small all-gather), and the next size (4x the bytes) is probed only if its calls are
predicted to fit in what is left. On a slow link the ladder so stops early, already deep in the
bandwidth regime: at 100 Mbit/s a 2-rank all-reduce of 1 MiB takes 84 ms, and the ladder stops
there after about 0.35 s. On loopback or a fast fabric it reaches the top. A kind costs ``reps``
timed calls per size probed (their fastest counts: a slower one waited on a loaded core), one
warm-up call before the first, and one agreement per size.

The fit (`fit_link_cost`) gives each end of the ladder the parameter it measures. ``1 / beta`` is
the least-squares slope over the large sizes, those within 16x of the largest (the top three of a
full ladder): their times are almost all bandwidth, and a fit over every size would let the small
sizes' relative noise, or a faster protocol for small calls, set the rate that prices a 25 MiB
bucket. ``alpha`` is the median of what the smaller sizes' times leave over once the bytes are
paid at that rate: a 1 % error on a 64 MiB call would be a millisecond of "latency" in an
unweighted fit.

Noise (``LinkModel.noise``): how far the timed calls of the largest size probed spread, as a share
of their median (half their range, at most `NOISE_CAP`), the largest over kinds and ranks. The
largest size is the one in the bandwidth regime, which prices a step's large messages. It costs no
call: read off the calls already timed, agreed with the figures. A stated link has none.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from dad_integrations.comm.aggregator import FactorAggregator, wire_bytes
from dad_integrations.comm.link_spec import KINDS, LinkCost, parse_link_spec

PROBE_FLOOR = 4 * 2 ** 10       # the smallest probe: latency-bound on any link
PROBE_RATIO = 4                 # geometric spacing of the probe sizes
PROBE_CEILING = 64 * 2 ** 20    # the largest probe, whatever the job sends (module doc)
DEFAULT_TOP = 25 * 2 ** 20      # the default dense bucket (``bucket_cap_mb``): where no sizes are given
PROBE_REPS = 3
PROBE_BUDGET_S = 1.0            # seconds per kind, warm-up included (module doc)
BANDWIDTH_SPAN = 16             # the fit's large sizes: within this factor of the largest (module doc)
NOISE_CAP = 0.5                 # the noise counts at most this share of a prediction (module doc)


@dataclass(frozen=True)
class LinkModel:
    """One `LinkCost` per collective kind (`KINDS`); ``noise``: the share by which a prediction may
    be off from the probe's noise (module doc; 0 where stated)."""

    all_reduce: LinkCost
    all_gather: LinkCost
    all_to_all: LinkCost
    measured: bool = False
    noise: float = 0.0

    def seconds(self, kind: str, nbytes: float, calls: int = 1) -> float:
        """Predicted time of ``calls`` collectives of ``kind`` moving ``nbytes`` in all (per rank);
        zero bytes in zero calls cost nothing."""
        cost: LinkCost = getattr(self, kind)
        if nbytes <= 0 and calls <= 0:
            return 0.0
        return calls * cost.alpha + nbytes / cost.beta

    @classmethod
    def uniform(cls, bandwidth: float, latency_s: float, measured: bool = False) -> "LinkModel":
        c = LinkCost(float(latency_s), float(bandwidth))
        return cls(c, c, c, measured)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> "LinkModel":
        """The config's ``link`` (`comm.link_spec.parse_link_spec`); bad keys raise `ValueError`
        naming them."""
        if isinstance(spec, LinkModel):
            return spec
        return cls(**parse_link_spec(spec))

    def to_list(self) -> List[float]:
        """``[alpha, 1/beta]`` per kind, then the noise: the figures ranks agree on (larger is slower)."""
        out = []
        for kind in KINDS:
            c: LinkCost = getattr(self, kind)
            out += [c.alpha, 1.0 / c.beta]
        return out + [self.noise]

    @classmethod
    def from_list(cls, values: Sequence[float], measured: bool = False) -> "LinkModel":
        costs = {k: LinkCost(float(values[2 * i]), 1.0 / float(values[2 * i + 1])) for i, k in enumerate(KINDS)}
        noise = float(values[2 * len(KINDS)]) if len(values) > 2 * len(KINDS) else 0.0
        return cls(**costs, measured=measured, noise=noise)

    def to_spec(self) -> dict:
        """The config's ``link`` form of this model (per kind), e.g. to route another run by it."""
        return {k: {"bandwidth": getattr(self, k).beta, "latency_us": getattr(self, k).alpha * 1e6} for k in KINDS}

    def brief(self) -> str:
        """The all-reduce figures users compare links by, and where they came from:
        ``"all-reduce 1.2 Gbit/s, 45 us (measured)"``."""
        c = self.all_reduce
        gbit = c.beta * 8 / 1e9
        rate = f"{gbit:,.0f}" if gbit >= 100 else f"{gbit:.3g}"  # (a fit all latency: a huge rate, in full)
        return f"all-reduce {rate} Gbit/s, {c.alpha * 1e6:.0f} us ({'measured' if self.measured else 'stated'})"

    def describe(self) -> str:
        parts = [f"{k} {getattr(self, k).alpha * 1e6:.0f} us + {getattr(self, k).beta * 8 / 1e9:.3g} Gbit/s"
                 for k in KINDS]
        return ", ".join(parts)


def probe_top(unit_bytes: Iterable[int] = (), bucket_bytes: float = DEFAULT_TOP, *,
              ceiling: int = PROBE_CEILING) -> int:
    """The largest probe, in bytes: the largest message a step sends (a dense bucket of
    ``bucket_bytes``, or a weight of ``unit_bytes`` alone), at most ``ceiling`` and at least
    `PROBE_FLOOR`."""
    largest = max([int(bucket_bytes), *(int(b) for b in unit_bytes)])
    return max(PROBE_FLOOR, min(largest, int(ceiling)))


def job_probe_top(shapes: Iterable[Tuple[int, int]], bucket_cap_mb: float, itemsize: int = 4) -> int:
    """`probe_top` for a job's weights of ``shapes`` (every weight's, repeats included; ``itemsize``
    bytes an element: fp32, the widest the wire sends, by default) and dense buckets of
    ``bucket_cap_mb``, which never hold more than all the weights together (a small model's step
    sends less than one bucket)."""
    sizes = [int(m) * int(n) * itemsize for m, n in shapes]
    return probe_top(sizes, min(bucket_cap_mb * 2 ** 20, sum(sizes)) if sizes else bucket_cap_mb * 2 ** 20)


def probe_ladder(top: int) -> Tuple[int, ...]:
    """The sizes probed, in bytes: `PROBE_FLOOR` times powers of `PROBE_RATIO` below ``top``, then
    ``top`` itself."""
    if top < PROBE_FLOOR:
        raise ValueError(f"dAD: a link probe of {top} bytes: at least {PROBE_FLOOR} needed")
    sizes = []
    size = PROBE_FLOOR
    while size < top:
        sizes.append(size)
        size *= PROBE_RATIO
    return (*sizes, int(top))


def fit_link_cost(samples: Sequence[Tuple[float, float]]) -> LinkCost:
    """``alpha, beta`` from ``(bytes, seconds)`` samples: ``1 / beta`` the least-squares slope over
    the large sizes (within `BANDWIDTH_SPAN` of the largest; all sizes where fewer than two are),
    ``alpha`` the median of what the smaller sizes' times leave over (module doc). Clamped to
    physical values (``alpha >= 0``; a flat or noisy fit falls back to the slowest observed rate)."""
    points = sorted((float(b), float(t)) for b, t in samples)
    large = [p for p in points if p[0] * BANDWIDTH_SPAN >= points[-1][0]]
    if len(large) < 2:
        large = points
    slope = _slope(large)
    small = points[:len(points) - len(large)] or points
    alpha = statistics.median(t - b * slope for b, t in small)
    ys = [t for _, t in points]
    # noise. Where in doubt the link is taken as fast, which routes weights dense: all-reduce's own
    # step, never slower than the baseline (a slow guess would compress where it does not pay)
    if slope <= 0:  # a larger call no slower: all latency
        alpha, slope = max(min(ys), 0.0), 0.0
    elif alpha < 0:  # a large call relatively slow: no latency, the largest call's rate
        alpha, slope = 0.0, points[-1][1] / points[-1][0]
    slope = max(slope, 1e-15)  # at most a petabyte per second: never divide by zero
    return LinkCost(max(alpha, 0.0), 1.0 / slope)


def _slope(points: Sequence[Tuple[float, float]]) -> float:
    """The least-squares slope of seconds on bytes (0 where the bytes do not vary)."""
    mx = statistics.fmean(b for b, _ in points)
    my = statistics.fmean(t for _, t in points)
    var = sum((b - mx) ** 2 for b, _ in points)
    return sum((b - mx) * (t - my) for b, t in points) / var if var > 0 else 0.0


def probe_link(aggregator: FactorAggregator, device: torch.device, *, kinds: Sequence[str] = KINDS,
               top_bytes: int = DEFAULT_TOP, reps: int = PROBE_REPS,
               budget_s: float = PROBE_BUDGET_S) -> LinkModel:
    """Time collectives of each kind on the group and fit `LinkModel`, agreed across ranks.

    Sizes: `probe_ladder` up to ``top_bytes`` (agreed first: the largest any rank asks for), cut
    short where the next size would overrun ``budget_s`` for the kind (module doc). Every rank runs
    the same calls in the same order (a collective itself), then the ranks take the slowest figures
    of any rank. Kinds the backend lacks (no ``all_to_all``) take the all-gather's figures.
    """
    top = int(agree_max(aggregator, [float(top_bytes)], device, name="dad.link.top")[0])
    ladder = probe_ladder(top)
    fitted: Dict[str, LinkCost] = {}
    noise = 0.0
    for kind in kinds:
        probed = _probe_kind(aggregator, device, kind, ladder, reps, budget_s)
        if probed is not None:
            samples, spread = probed
            fitted[kind] = fit_link_cost(samples)
            noise = max(noise, spread)
    for kind in KINDS:
        fitted.setdefault(kind, fitted.get("all_gather") or fitted["all_reduce"])
    local = LinkModel(**fitted, measured=True, noise=noise)
    return LinkModel.from_list(agree_max(aggregator, local.to_list(), device, name="dad.link.agree"),
                               measured=True)


def _probe_kind(aggregator: FactorAggregator, device: torch.device, kind: str, ladder: Sequence[int], reps: int,
                budget_s: float) -> Optional[Tuple[List[Tuple[float, float]], float]]:
    """``(wire bytes, agreed seconds)`` per size of ``ladder`` probed for ``kind``, and this rank's
    noise at the largest size probed (module doc); None where the backend lacks it. Every rank stops
    at the same size: the decision reads agreed times only."""
    s = aggregator.world_size
    samples: List[Tuple[float, float]] = []
    spent = 0.0
    for i, size in enumerate(ladder):
        # an all-gather's output is S inputs: its input is size / S, so no probe holds more than size
        per_rank = size // s if kind == "all_gather" else size
        numel = max(s, per_rank // 4 // s * s)
        x = torch.zeros(numel, dtype=torch.float32, device=device)
        times = []
        for rep in range(reps + (i == 0)):  # the first call of a kind warms its path up
            t0 = time.perf_counter()
            try:
                _call(aggregator, kind, x, f"dad.link.{kind}.{size}.{rep}")
            except NotImplementedError:
                return None
            synchronize(device)
            if rep or i:
                times.append(time.perf_counter() - t0)
        del x  # dropped before the next, larger size is made
        # the fastest call: the others waited on something else (a loaded core, another job), and
        # where in doubt the link is taken as fast (`fit_link_cost`); the slowest rank's is agreed
        took = agree_max(aggregator, [min(times)], device, name=f"dad.link.{kind}.{size}.t")[0]
        # the bytes the cost model counts for the call (ring models): the fitted rates predict them
        samples.append((wire_bytes(kind, numel * 4, s)[0], took))
        spent += took * (reps + (i == 0))
        middle = statistics.median(times)
        spread = min((max(times) - min(times)) / 2 / middle, NOISE_CAP) if middle > 0 else 0.0
        if i + 1 < len(ladder) and spent + took * reps * ladder[i + 1] / size > budget_s:
            break  # the next size would overrun the budget (bytes scale the time at most linearly)
    return samples, spread


def agree_max(aggregator: FactorAggregator, values: Sequence[float], device: torch.device, *,
              name: str) -> List[float]:
    """Element-wise maximum over ranks of ``values`` (one all-gather; every rank gets the same)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    gathered = aggregator.all_gather(t, name=name, first_dims=[t.numel()] * aggregator.world_size).wait()
    return torch.stack([g.to(torch.float64) for g in gathered]).max(dim=0).values.cpu().tolist()


def _call(aggregator: FactorAggregator, kind: str, x: torch.Tensor, name: str) -> None:
    s = aggregator.world_size
    if kind == "all_reduce":
        aggregator.all_reduce(x, name=name, op="sum").wait()
    elif kind == "all_gather":
        aggregator.all_gather(x, name=name, first_dims=[x.numel()] * s).wait()
    else:
        aggregator.all_to_all(x.view(s, -1), name=name).wait()


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a timed call ends there)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
