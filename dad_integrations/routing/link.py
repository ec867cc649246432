"""The link model: how long one collective of a given kind and size takes on the job's group.

Per collective kind, the classic ``t = alpha + bytes / beta`` (Hockney's model): ``alpha`` the
latency of one call, ``beta`` the bandwidth one rank sees. ``bytes`` is what the cost model
(`costs`) counts for the call on one rank (``2 (S-1)/S n`` for a ring all-reduce of ``n`` bytes,
``(S-1) n`` for an all-gather), so a fitted ``beta`` folds the algorithm's own factors in and
the model predicts what the router weighs, not a wire rate.

Kinds: ``"all_reduce"`` (dense buckets, PowerSGD's P and Q), ``"all_gather"`` (exact and rank-r
factors, size exchanges) and ``"all_to_all"`` (the sharded codecs' slices; FSDP2's and ZeRO's
reduce-scatter, the sharded dense baseline, is timed as one too).

Where it comes from (`probe_link`): a few collectives of each kind and two sizes, timed on the
job's own group at attach and again every ``route_refresh_steps``, fitted per kind, and agreed
across ranks by taking the slowest rank's figures (an all-gather of them), so every rank decides
alike. A config's ``link`` states it instead (`LinkModel.from_spec`), for planning and tests.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import torch

from dad_integrations.comm.aggregator import FactorAggregator, wire_bytes
from dad_integrations.comm.link_spec import KINDS, LinkCost, parse_link_spec

# probe sizes in bytes: one small call for the latency, one large enough for the bandwidth
PROBE_BYTES = (4 * 2 ** 10, 64 * 2 ** 10, 1 * 2 ** 20)
PROBE_REPS = 3


@dataclass(frozen=True)
class LinkModel:
    """One `LinkCost` per collective kind (`KINDS`)."""

    all_reduce: LinkCost
    all_gather: LinkCost
    all_to_all: LinkCost
    measured: bool = False

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
        """``[alpha, 1/beta]`` per kind: the figures ranks agree on (larger is slower)."""
        out = []
        for kind in KINDS:
            c: LinkCost = getattr(self, kind)
            out += [c.alpha, 1.0 / c.beta]
        return out

    @classmethod
    def from_list(cls, values: Sequence[float], measured: bool = False) -> "LinkModel":
        costs = {k: LinkCost(float(values[2 * i]), 1.0 / float(values[2 * i + 1])) for i, k in enumerate(KINDS)}
        return cls(**costs, measured=measured)

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


def fit_link_cost(samples: Sequence[Tuple[float, float]]) -> LinkCost:
    """Least-squares ``alpha, beta`` from ``(bytes, seconds)`` samples, clamped to physical values
    (``alpha >= 0``; a flat or noisy fit falls back to the slowest observed rate)."""
    xs = [float(b) for b, _ in samples]
    ys = [float(t) for _, t in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
    alpha = my - slope * mx
    # noise. Where in doubt the link is taken as fast, which routes weights dense: all-reduce's own
    # step, never slower than the baseline (a slow guess would compress where it does not pay)
    if slope <= 0:  # a larger call no slower: all latency
        alpha, slope = max(min(ys), 0.0), 0.0
    elif alpha < 0:  # a large call relatively slow: no latency, the largest call's rate
        largest = max(range(len(xs)), key=lambda i: xs[i])
        alpha, slope = 0.0, ys[largest] / xs[largest]
    slope = max(slope, 1e-15)  # at most a petabyte per second: never divide by zero
    return LinkCost(max(alpha, 0.0), 1.0 / slope)


def probe_link(aggregator: FactorAggregator, device: torch.device, *, kinds: Sequence[str] = KINDS,
               sizes: Sequence[int] = PROBE_BYTES, reps: int = PROBE_REPS) -> LinkModel:
    """Time a few collectives of each kind on the group and fit `LinkModel`, agreed across ranks.

    Every rank runs the same calls in the same order (a collective itself), then the ranks take
    the slowest figures of any rank. Kinds the backend lacks (no ``all_to_all``) take the
    all-gather's figures. Costs ``len(kinds) * len(sizes) * (reps + 1)`` collectives.
    """
    s = aggregator.world_size
    fitted: Dict[str, LinkCost] = {}
    for kind in kinds:
        samples = []
        for size in sizes:
            numel = max(s, size // 4 // s * s)
            x = torch.zeros(numel, dtype=torch.float32, device=device)
            times = []
            for rep in range(reps + 1):  # the first call warms the path up
                t0 = time.perf_counter()
                try:
                    _call(aggregator, kind, x, f"dad.link.{kind}.{size}.{rep}")
                except NotImplementedError:
                    break
                synchronize(device)
                if rep:
                    times.append(time.perf_counter() - t0)
            if not times:
                break
            # the bytes the cost model counts for the call (ring models): the fitted rates predict them
            samples.append((wire_bytes(kind, numel * 4, s)[0], statistics.median(times)))
        if len(samples) == len(sizes):
            fitted[kind] = fit_link_cost(samples)
    for kind in KINDS:
        fitted.setdefault(kind, fitted.get("all_gather") or fitted["all_reduce"])
    local = LinkModel(**fitted, measured=True)
    return LinkModel.from_list(agree_max(aggregator, local.to_list(), device, name="dad.link.agree"),
                               measured=True)


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
