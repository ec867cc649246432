"""The compute model: the local work each route adds to a step, measured on the job's device.

What each route computes for one weight (m x n) on top of what the step does without dAD, S
sites, N rows per site, rank r, ``k`` power iterations:

- ``"dense"``: nothing (the bucket copy is what every all-reduce does);
- ``"rank_allreduce"`` (PowerSGD's algorithm): error-feedback compensation, ``k`` rounds of
  ``M Q``, an orthonormalisation of ``P`` and ``M^T P``, the rebuild ``P Q^T`` into ``.grad`` and
  the residual update: ``~4 k m n r + 2 m n r`` flops and three passes over ``m n`` memory;
- ``"rank"`` (rank-dAD's all-gather): the same local power iteration, then a rank-``S r``
  rebuild: ``2 S r m n`` flops;
- ``"exact"``: the capture hooks on every call, packing ``N (m+n)`` numbers, and a rebuild of
  ``2 S N m n`` flops, which grows with the number of sites (the paper's ViT blow-up).

These are memory-bound at small r and launch-bound on a GPU for small layers, so they are not
derived from a peak flop rate: `measure_compute` times the rank routes' own kernel sequence, the
exact rebuild at a reference row count (scaled linearly in rows: it is one GEMM with an ``S N``
inner dimension), and one captured call of a small layer against an uncaptured one. Ranks agree
by taking the slowest rank's figures, so every rank routes alike.

Bounded shapes. Timing a 32000 x 4096 embedding as it is would take seconds and hold several
copies of it; so a weight of more than ``BOUND_ELEMENTS`` (2^22, 16 MiB in fp32) is timed as
``bounded_shape``: each dimension capped at ``BOUND_DIM`` (2048, or the rank where that is larger,
so the power iteration's r is the one of the full shape), and its seconds scaled to the full shape
by ``m n / m' n'`` (`scale`). That ratio is every term's: at a fixed r the power iteration's
``4 k m n r`` and the rebuilds' ``2 m n r``, ``2 S r m n`` flops, the exact rebuild's
``2 rows m n``, and the memory-bound compensation and residual passes over ``m n`` numbers all grow
as ``m n``. Only the exact route's packing (``m + n`` per row) grows more slowly, and scaling it by
``m n`` over-counts a term the GEMM dwarfs. Several full shapes share one bounded shape (every
Llama-7B matrix is timed as 2048 x 2048), so each bounded shape is timed once. The exact rebuild
is timed at ``EXACT_REFERENCE_ROWS`` rows per site, at most ``EXACT_MAX_ROWS`` in all.

Why these bounds: 2^22 elements keeps the shapes of models up to about 1 B parameters (GPT-2's
768- and 1024-wide matrices, TinyLlama's 2048 x 2048 and 256 x 2048) timed as they are, with no
scaling error; a 16 MiB buffer (four of them per probe) outgrows CPU caches and a GPU's L2, so the
bounded probe streams from memory as the full shape does; and at 2^22 elements a pass takes about a
millisecond on a CPU and tens of microseconds on a GPU, more than a kernel launch. Where launches
still dominate (a GPU's small probes), scaling over-counts them: the estimate errs towards dense.
No probe buffer holds more than 2^22 numbers (`bounded_shape` and the row cap) at a rank up to 2048.

Noise. Each figure is the median of ``REPS`` timed calls after a warm-up. One bounded shape's
figures are timed in turns (exact, PowerSGD's, rank-dAD's, then again): a burst of load from
elsewhere slows one call of each, which every median drops, instead of all calls of one route,
which would move that route's median alone and swap two near-equal routes. The model keeps how
far each figure's calls spread: half their range (``(max - min) / 2``, at most `NOISE_CAP` of the
median), per figure (``ComputeModel.spreads``) and for the capture hooks; and every figure's
spread is at least the machine's, the widest relative spread of any route figure at attach. On a
CPU shared with other work a call is preempted or not, whole scheduler quanta at a time: three
calls of one figure can all be slowed (a 1.4 ms power iteration measured at 25 ms three times,
while its neighbour's ran at 1.5 ms), and only the other figures' spread shows it. `ComputeModel.noise` turns it into
seconds of a route's prediction: the route's own compute over the figures plus their spreads,
less its compute over the figures. On a loaded machine a median of three moves by about that much
from run to run, so the router takes two routes whose predictions differ by less than their
noise as equal (`router.choose_at`). The spreads cost nothing more to measure: they are read off
the calls the medians already time, and agreed with them (the largest over ranks).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from dad_integrations.comm.aggregator import FactorAggregator
from dad_integrations.routing.link import agree_max, synchronize
from dad_integrations.codecs.power_iteration import LocalGradient, power_iteration
from dad_integrations.rng import isolated, private_generator
from dad_integrations.routes.registry import get_route

Shape = Tuple[int, int]
BOUND_ELEMENTS = 1 << 22     # a weight of more numbers is timed as its bounded shape and scaled
BOUND_DIM = 2048             # a bounded shape's dimensions, at most (or the rank, where larger)
EXACT_REFERENCE_ROWS = 256   # rows per site at which the exact rebuild is timed
EXACT_MAX_ROWS = 1024        # and at most this many in all (the rebuild is linear in rows)
REPS = 3
NOISE_CAP = 1.0              # a figure's spread counts at most its median (module doc)


def bounded_shape(shape: Shape, rank: Optional[int] = None) -> Shape:
    """The shape ``measure_compute`` times for a weight of ``shape``: itself up to
    ``BOUND_ELEMENTS`` numbers, else each dimension capped at ``BOUND_DIM`` (or at ``rank``, where
    that is larger: the power iteration then runs at the full shape's r)."""
    m, n = (int(d) for d in shape)
    if m < 1 or n < 1:
        raise ValueError(f"a weight shape has positive dimensions, got {tuple(shape)}")
    if m * n <= BOUND_ELEMENTS:
        return m, n
    cap = max(BOUND_DIM, rank or 0)
    return min(m, cap), min(n, cap)


def scale(shape: Shape, timed: Shape) -> float:
    """The factor from seconds timed at ``timed`` to ``shape``'s: ``m n / m' n'``, every route
    term's flop and byte ratio at the same r (see the module doc)."""
    return (shape[0] * shape[1]) / (timed[0] * timed[1])


@dataclass(frozen=True)
class ShapeCosts:
    """Seconds of local work for one weight shape (m x n)."""

    rank_allreduce: float   # per step, PowerSGD's local work at rank r
    rank: float             # per step, rank-dAD's local reduction and rank-S r rebuild
    exact_per_row: float    # exact rebuild and packing, per row summed over sites (S N rows)


@dataclass(frozen=True)
class ComputeModel:
    """Local seconds per route and weight shape, and the capture hooks' cost per call."""

    shapes: Dict[Shape, ShapeCosts] = field(default_factory=dict)
    capture_per_call: float = 0.0
    timed_as: Dict[Shape, Shape] = field(default_factory=dict)  # measured: each shape's bounded shape
    spreads: Dict[Shape, ShapeCosts] = field(default_factory=dict)  # measured: each figure's spread (seconds)
    capture_spread: float = 0.0                                     # and the capture's, per call

    def seconds(self, representation: str, shape: Shape, *, rows_by_rank: Sequence[Sequence[int]],
                world_size: int, calls: int = 1) -> float:
        """Predicted local seconds of route ``representation`` for one weight this step (the route's
        own `routes.RouteSpec.compute` over this model's figures)."""
        spec = get_route(representation)
        costs = self.shapes.get(tuple(shape))
        if costs is None:  # a shape nobody measured (a planner's stated model): no compute known
            return 0.0
        return spec.compute(costs, self.capture_per_call, rows_by_rank, world_size, calls)

    def noise(self, representation: str, shape: Shape, *, rows_by_rank: Sequence[Sequence[int]],
              world_size: int, calls: int = 1) -> float:
        """Seconds by which `seconds` may be off from the timing's noise alone: the route's compute
        over every figure plus its spread, less its compute over the figures (0 where no spread is
        known: a stated model, or a shape nobody measured)."""
        costs, spread = self.shapes.get(tuple(shape)), self.spreads.get(tuple(shape))
        if costs is None or (spread is None and not self.capture_spread):
            return 0.0
        spread = spread or ShapeCosts(0.0, 0.0, 0.0)
        high = ShapeCosts(*(c + d for c, d in zip(_figures(costs), _figures(spread))))
        spec = get_route(representation)
        top = spec.compute(high, self.capture_per_call + self.capture_spread, rows_by_rank, world_size, calls)
        return max(0.0, top - spec.compute(costs, self.capture_per_call, rows_by_rank, world_size, calls))

    def to_list(self, shapes: Sequence[Shape]) -> List[float]:
        """The figures ranks agree on (larger is slower): the capture's, each shape's, then their
        spreads in the same order."""
        out, spreads = [self.capture_per_call], [self.capture_spread]
        for s in shapes:
            out += _figures(self.shapes[s])
            spreads += _figures(self.spreads.get(s, ShapeCosts(0.0, 0.0, 0.0)))
        return out + spreads

    @classmethod
    def from_list(cls, shapes: Sequence[Shape], values: Sequence[float]) -> "ComputeModel":
        k = 1 + 3 * len(shapes)
        figures, spreads = values[:k], values[k:] or [0.0] * k

        def per_shape(vals: Sequence[float]) -> Dict[Shape, ShapeCosts]:
            return {s: ShapeCosts(*(float(v) for v in vals[1 + 3 * i: 4 + 3 * i])) for i, s in enumerate(shapes)}
        return cls(per_shape(figures), float(figures[0]), spreads=per_shape(spreads), capture_spread=float(spreads[0]))


def _figures(costs: ShapeCosts) -> List[float]:
    return [costs.rank_allreduce, costs.rank, costs.exact_per_row]


def measure_compute(shapes: Iterable[Shape], *, rank: Optional[int], world_size: int, iterations: int,
                    error_feedback: bool, device: torch.device, dtype: torch.dtype = torch.float32,
                    aggregator: Optional[FactorAggregator] = None,
                    clock: Callable[[], float] = time.perf_counter) -> ComputeModel:
    """Each route's local seconds for every distinct ``shape`` on ``device``: timed once per
    distinct `bounded_shape` and scaled to the shape (see the module doc), with each figure's
    spread; with an ``aggregator``, the slowest rank's figures and spreads, agreed by every rank.
    ``clock`` reads the time (a test's seam: timings it chooses, on the real kernels)."""
    distinct = sorted(set(tuple(s) for s in shapes))
    timed_as = {s: bounded_shape(s, rank) for s in distinct}
    rows = min(world_size * EXACT_REFERENCE_ROWS, EXACT_MAX_ROWS)
    timed: Dict[Shape, ShapeCosts] = {}
    spread: Dict[Shape, ShapeCosts] = {}
    for m, n in sorted(set(timed_as.values())):
        gen = private_generator(device)  # test matrices from dAD's own generator: the caller's stay put
        g = torch.randn(m, n, device=device, dtype=dtype, generator=gen)
        out = torch.empty_like(g)
        steps = [_exact_step(g, rows, gen, out)]
        if rank:
            steps += [_rank_step(g, rank, iterations, world_size, error_feedback, gen, out, shared=True),
                      _rank_step(g, rank, iterations, world_size, error_feedback, gen, out)]
        figures = _timed_together(steps, device, clock)
        (exact, exact_spread), (shared, shared_spread), (own, own_spread) = (figures + [(0.0, 0.0)] * 2)[:3]
        timed[(m, n)] = ShapeCosts(shared, own, exact / rows)
        spread[(m, n)] = ShapeCosts(shared_spread, own_spread, exact_spread / rows)
        del g, out, steps  # each bounded shape's buffers dropped before the next one's are made
    spread = _pooled(timed, spread)
    costs = {s: _scaled(timed[b], scale(s, b)) for s, b in timed_as.items()}
    spreads = {s: _scaled(spread[b], scale(s, b)) for s, b in timed_as.items()}
    capture, capture_spread = _capture_seconds(device, dtype, clock)
    model = ComputeModel(costs, capture, timed_as, spreads, capture_spread)
    if aggregator is None or aggregator.world_size == 1:
        return model
    agreed = agree_max(aggregator, model.to_list(distinct), device, name="dad.compute.agree")
    return replace(ComputeModel.from_list(distinct, agreed), timed_as=timed_as)


def _pooled(timed: Dict[Shape, ShapeCosts], spread: Dict[Shape, ShapeCosts]) -> Dict[Shape, ShapeCosts]:
    """Each figure's spread, at least the machine's: the widest relative spread any figure showed
    (module doc). A figure whose calls were all slowed alike shows none of its own."""
    shares = [d / c for b in timed for c, d in zip(_figures(timed[b]), _figures(spread[b])) if c > 0]
    widest = max(shares, default=0.0)
    return {b: ShapeCosts(*(max(d, widest * c) for c, d in zip(_figures(timed[b]), _figures(spread[b]))))
            for b in timed}


def _scaled(costs: ShapeCosts, factor: float) -> ShapeCosts:
    if factor == 1:  # timed as it is: the figures unchanged, to the bit
        return costs
    return ShapeCosts(costs.rank_allreduce * factor, costs.rank * factor, costs.exact_per_row * factor)


def _timed(fn: Callable[[], None], device: torch.device, clock: Callable[[], float] = time.perf_counter,
           reps: int = REPS) -> Tuple[float, float]:
    """Median seconds of ``fn`` after one warm-up call, and the calls' spread (`_timed_together`)."""
    return _timed_together([fn], device, clock, reps)[0]


def _timed_together(fns: Sequence[Callable[[], None]], device: torch.device,
                    clock: Callable[[], float] = time.perf_counter, reps: int = REPS) -> List[Tuple[float, float]]:
    """Per function of ``fns``, its median seconds after one warm-up call and the calls' spread:
    half their range, at most `NOISE_CAP` of the median (module doc). The calls take turns, one
    of each per round: a burst of load from elsewhere slows one call of every function, which
    their medians drop alike, rather than every call of one function, which would move its
    median alone (and two near-equal routes' order with it)."""
    for fn in fns:
        fn()
    synchronize(device)
    times: List[List[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, took in zip(fns, times):
            t0 = clock()
            fn()
            synchronize(device)
            took.append(clock() - t0)
    out = []
    for took in times:
        middle = statistics.median(took)
        out.append((middle, min((max(took) - min(took)) / 2, NOISE_CAP * max(middle, 0.0))))
    return out


def _rank_step(g: torch.Tensor, rank: int, iterations: int, world_size: int, error_feedback: bool,
               gen: torch.Generator, out: torch.Tensor, *, shared: bool = False) -> Callable[[], None]:
    """A rank route's local work on the ``m x n`` gradient ``g``: error-feedback compensation, the
    routes' own power iteration (`power_iteration`), the residual, and the rebuild: ``P Q^T``
    (``shared``: PowerSGD's) or rank-dAD's rank-``S r`` one (``out``: scratch of ``g``'s shape)."""
    (m, n), device, dtype = g.shape, g.device, g.dtype
    r = min(rank, m, n)
    residual = torch.zeros_like(g) if error_feedback else None
    q = torch.randn(n, r, device=device, dtype=dtype, generator=gen)
    gathered = None if shared else [torch.randn(world_size * r, k, device=device, dtype=dtype, generator=gen)
                                    for k in (m, n)]

    def step() -> None:
        mat = g + residual if residual is not None else g
        p, qq = power_iteration(LocalGradient(dense=mat), q, iterations)
        if shared or residual is not None:
            torch.mm(p, qq.t(), out=out)
        if residual is not None:
            torch.sub(mat, out, out=residual)
        if gathered is not None:
            torch.mm(gathered[0].t(), gathered[1], out=out)

    return step


def _exact_step(g: torch.Tensor, rows: int, gen: torch.Generator, out: torch.Tensor) -> Callable[[], None]:
    """The exact route's local work on an ``m x n`` weight (``g``'s shape; ``out``: scratch of it):
    packing one site's factors and the rebuild from ``rows`` rows (summed over sites)."""
    (m, n), device, dtype = g.shape, g.device, g.dtype
    left = torch.randn(EXACT_REFERENCE_ROWS, m, device=device, dtype=dtype, generator=gen)
    right = torch.randn(EXACT_REFERENCE_ROWS, n, device=device, dtype=dtype, generator=gen)
    gl = torch.randn(rows, m, device=device, dtype=dtype, generator=gen)
    gr = torch.randn(rows, n, device=device, dtype=dtype, generator=gen)

    def step() -> None:
        torch.cat([left.reshape(-1), right.reshape(-1)])  # packing the factors
        torch.mm(gl.t(), gr, out=out)

    return step


def _capture_seconds(device: torch.device, dtype: torch.dtype, clock: Callable[[], float],
                     calls: int = 20) -> Tuple[float, float]:
    """Per call: a small layer's forward and backward with dAD's capture hooks, minus without; and
    the spread of that difference (both timings' spreads)."""
    from dad_integrations.capture.hooks import ModuleCapture
    from dad_integrations.capture.layers.linear import linear_rows

    with isolated(torch.device("cpu")):  # the layer initialises itself from the global CPU generator
        layer = nn.Linear(8, 8).to(device=device, dtype=dtype)
    x = torch.randn(4, 8, device=device, dtype=dtype, generator=private_generator(device))

    def run() -> None:
        for _ in range(calls):
            layer(x).sum().backward()

    bare, bare_spread = _timed(run, device, clock)
    capture = ModuleCapture("dad.compute.probe", layer, "linear", linear_rows)
    try:
        hooked, hooked_spread = _timed(lambda: (run(), capture.clear()), device, clock)
    finally:
        capture.remove()
    return max(hooked - bare, 0.0) / calls, (bare_spread + hooked_spread) / calls
