"""Memory per rank: what the engine's own state holds, and what dAD keeps beside it.

A pure model (numbers in, bytes out), read at attach (the attach line, the residual budget) and by
the planner. Per rank, for a job of ``P`` parameters on ``S`` ranks:

- **Engine state** (`state_bytes`): what Adam training keeps per parameter, counted as the ZeRO
  paper does: the parameter and its gradient in the parameter's dtype, Adam's two moments in fp32
  and, for 16-bit parameters, an fp32 master copy: 16 bytes a parameter at fp32 (4 + 4 + 8) and at
  bf16 or fp16 (2 + 2 + 12). An estimate: the optimizer is not known at attach (SGD keeps less,
  activations and buffers are not counted). Each engine shards part of it over ``S``: DDP, Horovod
  and ZeRO-0 none, ZeRO-1 the optimizer's, ZeRO-2 also the gradients, ZeRO-3 and FSDP2 everything
  (under HSDP, over the ranks of a node).
- **Error-feedback residuals** (`residual_bytes`), in the dtype the rank routes compute in (fp32
  for bf16 and fp16 weights, `capture.rows.compute_dtype`): per rank-routed ``m x n`` weight one
  whole ``m n`` residual, or, kept at rank ``q`` (`codecs.error_feedback.LowRankErrorFeedback`),
  the pair ``U, V``: ``q (m + n)`` numbers where ``q < min(m, n)``, else the ``m n`` residual
  itself. Whole residuals are not sharded (a rank compresses its whole local gradient): under
  FSDP2 and ZeRO they cost ``S`` times the weight's gradient shard. At a step's end they are held
  twice (`RankMemory.step_end_residuals`): the step's new residuals wait beside the last ones until
  the ranks agree the step was finite (`codecs.route_state.RouteState`: a non-finite step keeps
  the last ones), so a rank's peak holds both.
- **Warm starts** (`warm_start_bytes`): the last ``n x r`` factor ``Q`` of each rank-routed weight.
- **Captured rows** (`row_bytes`): ``m + n`` numbers per row of each captured use (the output
  gradient's row and the input's), in the activations' dtype, alive from the forward to the
  step's exchange; they scale with the tokens a rank runs.

**Residual budget** (`fit_residual_rank`): under FSDP2 and ZeRO-2/3 whole residuals may hold more
than the sharded state itself (Llama-7B on 64 ranks: about 25 GiB of residuals against 1.6 GiB of
state). ``residual_budget`` (a config key) bounds them at that many times the rank's engine
state; where whole residuals of the weights the rank routes may take exceed it, they are kept at
the largest rank ``q`` (at most `FIT_RANK_CAP`) whose residuals fit (`RankMemory`). Its default,
0.25 (`config.DEFAULT_RESIDUAL_BUDGET`), keeps what dAD adds near a quarter of the engine's state:
whole fp32 residuals hold 4 bytes a routed parameter, the budget ``0.25 x 16 / S`` under FSDP2
and ZeRO-3, so it binds from 2 ranks on wherever most parameters are routed weights (ZeRO-2 from
2 ranks where more than 5/8 of them are).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple, Union

from dad_integrations.builtin_routes import EXACT, RANK, RANK_ALLREDUCE
from dad_integrations.codecs.error_feedback import residual_bytes
from dad_integrations.config import DEFAULT_RESIDUAL_BUDGET

Shape = Tuple[int, int]

# engine -> which of (parameters, gradients, optimizer state) it shards over the ranks
SHARDING = {
    "replicated": (False, False, False),   # DDP, Horovod, DeepSpeed ZeRO-0, a DADSynchronizer
    "zero1": (False, False, True),
    "zero2": (False, True, True),
    "zero3": (True, True, True),
    "fsdp2": (True, True, True),
}
BUDGETED = ("zero2", "zero3", "fsdp2")
# the largest rank a budget's fit keeps: each step's power iteration on a residual costs about
# 4 m n q flops, the route's own at rank q; past it a larger budget buys compute, not feedback
FIT_RANK_CAP = 64  # the engines whose sharded state the residual budget is relative to


def engine_kind(name: str) -> str:
    """The `SHARDING` key of an engine named as the attach line names it (``"FSDP2"``, ``"ZeRO-3"``,
    ``"DeepSpeed ZeRO-1"``, ``"DDP"`` ...)."""
    low = name.lower().replace("-", "")
    for stage in ("zero1", "zero2", "zero3"):
        if stage in low:
            return stage
    return "fsdp2" if "fsdp" in low else "replicated"


def optimizer_bytes(param_itemsize: int) -> int:
    """Adam's state per parameter: two moments in fp32 (or the parameter's wider dtype) and an
    fp32 master copy of a 16-bit parameter."""
    return 2 * max(param_itemsize, 4) + (4 if param_itemsize < 4 else 0)


def state_bytes(params: int, world_size: int, engine: str, param_itemsize: int = 4) -> float:
    """The engine's own state per rank (module doc): 16 bytes a parameter at fp32 and 16-bit,
    each part over ``world_size`` where ``engine`` (a `SHARDING` key) shards it."""
    if engine not in SHARDING:
        raise ValueError(f"unknown engine {engine!r}: one of {tuple(SHARDING)}")
    shard_p, shard_g, shard_o = SHARDING[engine]
    s = max(int(world_size), 1)
    parts = ((param_itemsize, shard_p), (param_itemsize, shard_g), (optimizer_bytes(param_itemsize), shard_o))
    return sum(params * size / (s if sharded else 1) for size, sharded in parts)


def warm_start_bytes(shapes: Iterable[Shape], rank: Optional[int], itemsize: int = 4) -> int:
    """Bytes of the warm starts: one ``n x min(r, m, n)`` factor per rank-routed weight (0 without a rank)."""
    return 0 if rank is None else sum(n * min(rank, m, n) for m, n in shapes) * itemsize


def row_bytes(shapes: Iterable[Shape], rows: int, itemsize: int = 4) -> int:
    """Bytes of ``rows`` captured rows of each weight of ``shapes`` (``m + n`` numbers a row)."""
    return sum(m + n for m, n in shapes) * rows * itemsize


def fit_residual_rank(shapes: Sequence[Shape], budget: float, itemsize: int = 4) -> Optional[int]:
    """The largest ``q`` up to `FIT_RANK_CAP` whose residuals of ``shapes`` fit in ``budget`` bytes;
    None where whole ones fit; 1 where none does (the least error feedback keeps; the caller says
    so). Bytes are not monotone in ``q`` (a weight's pair outgrows it before ``q`` reaches
    ``min(m, n)``, where it is kept whole), so every ``q`` up to the cap is counted."""
    if residual_bytes(shapes, None, itemsize) <= budget:
        return None
    fits = [q for q in range(1, FIT_RANK_CAP + 1) if residual_bytes(shapes, q, itemsize) <= budget]
    return fits[-1] if fits else 1


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds (bytes; module doc): the engine's state and dAD's residuals (at
    ``residual_rank``, None: whole), warm starts and captured rows (``rows`` of each captured
    weight; ``row_bytes_per_row``: per row of every captured weight). ``whole_residuals``: what
    whole residuals would hold; ``budget``: the residual budget in bytes (None: none applies)."""

    engine: str
    world_size: int
    state: float
    residuals: int
    residual_rank: Optional[int]
    whole_residuals: int
    warm_starts: int
    rows: int
    row_bytes_per_row: int
    budget: Optional[float] = None
    itemsize: int = 4
    weights: int = 0

    @property
    def dad(self) -> int:
        """What dAD adds: residuals, warm starts and rows."""
        return self.residuals + self.warm_starts + self.rows

    @property
    def step_end_residuals(self) -> int:
        """Residual bytes at a step's end: the held ones and the step's new ones, which wait for the
        step's finiteness beside them (module doc)."""
        return 2 * self.residuals

    @property
    def fitted(self) -> bool:
        """The budget chose rank-q residuals."""
        return self.budget is not None and self.residual_rank is not None


def rank_memory(engine: str, *, params: int, world_size: int, routed: Sequence[Shape], captured: Sequence[Shape] = (),
                rank: Optional[int] = None, error_feedback: bool = True, error_feedback_rank: Optional[int] = None,
                residual_budget: Optional[float] = DEFAULT_RESIDUAL_BUDGET, param_itemsize: int = 4,
                residual_itemsize: int = 4,
                rows: Union[int, Sequence[int]] = 0, residual_share: float = 1.0,
                state_world_size: Optional[int] = None, warm_start: bool = True) -> RankMemory:
    """Memory per rank of a job on ``engine`` (a `SHARDING` key) of ``params`` parameters on
    ``world_size`` ranks: ``routed`` the weights the rank routes may take (where the rank holds
    their residuals), ``captured`` those whose rows are captured, ``rows`` rows of each (or per
    weight of ``captured``, all its uses' together).
    ``residual_share``: the part of each residual a rank keeps (HSDP's replicate hop: ``1/L``,
    where no budget applies). ``state_world_size``: the ranks the state is sharded over (HSDP: a
    node's). The residuals' rank: ``error_feedback_rank`` where set, else the budget's fit
    (`fit_residual_rank`) on the `BUDGETED` engines, else whole."""
    state = state_bytes(params, state_world_size or world_size, engine, param_itemsize)
    holds = rank is not None and error_feedback
    whole = int(residual_bytes(routed, None, residual_itemsize) * residual_share) if holds else 0
    q, budget = error_feedback_rank, None
    if holds and q is None and residual_budget is not None and engine in BUDGETED and residual_share == 1.0:
        budget = residual_budget * state
        q = fit_residual_rank(routed, budget, residual_itemsize)
    held = int(residual_bytes(routed, q, residual_itemsize) * residual_share) if holds else 0
    per_row = row_bytes(captured, 1, param_itemsize)
    each = [rows] * len(captured) if isinstance(rows, int) else list(rows)
    held_rows = sum(row_bytes([shape], r, param_itemsize) for shape, r in zip(captured, each))
    return RankMemory(engine, world_size, state, held, q if holds else None, whole,
                      warm_start_bytes(routed, rank if warm_start else None, residual_itemsize),
                      held_rows, per_row, budget, residual_itemsize, len(routed))


def size(nbytes: float) -> str:
    """``nbytes`` in GiB, MiB or KiB, one decimal."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20)):
        if nbytes >= 0.1 * scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes / 2 ** 10:,.1f} KiB"


def dtype_name(itemsize: int) -> str:
    return {2: "16-bit", 4: "fp32", 8: "fp64"}.get(itemsize, f"{itemsize}-byte")


def describe(mem: RankMemory) -> str:
    """The attach line of ``mem`` (one line, rank 0, through the banner's channel)."""
    sharded = any(SHARDING[mem.engine])
    parts = [f"engine state ~{size(mem.state)} (Adam estimate, 16 B a parameter{', sharded' if sharded else ''})"]
    if mem.whole_residuals:
        kind = "whole" if mem.residual_rank is None else f"rank {mem.residual_rank}"
        fit = f", fit to residual_budget {size(mem.budget)}; whole: {size(mem.whole_residuals)}" if mem.fitted else ""
        parts.append(f"error feedback up to {size(mem.residuals)} ({dtype_name(mem.itemsize)}, {kind}, "
                     f"{mem.weights} weights{fit}), {size(mem.step_end_residuals)} at a step's end")
    if mem.warm_starts:
        parts.append(f"warm starts {size(mem.warm_starts)}")
    if mem.row_bytes_per_row:
        parts.append(f"captured rows up to {size(mem.row_bytes_per_row)} per token")
    return "dAD memory per rank: " + "; ".join(parts)


# -- the planner ------------------------------------------------------------------------------------
PLAN_ENGINES = (("DDP, Horovod, ZeRO-0", "replicated"), ("ZeRO-1", "zero1"), ("ZeRO-2", "zero2"),
                ("FSDP2, ZeRO-3", "fsdp2"))
RANK_ROUTES = (RANK, RANK_ALLREDUCE)


def plan_memory(units: Sequence[Tuple[Shape, Sequence[int], str]], *, params: int, world_size: int,
                rank: Optional[int], param_itemsize: int = 4, residual_itemsize: int = 4,
                local_size: Optional[int] = None, error_feedback: bool = True,
                error_feedback_rank: Optional[int] = None,
                residual_budget: Optional[float] = DEFAULT_RESIDUAL_BUDGET) -> List[Tuple[str, RankMemory]]:
    """Memory per rank of a planned step under every engine (`PLAN_ENGINES`; HSDP too where
    ``local_size`` ranks a node shard the model, ``1 < local_size < world_size``): ``units`` per
    weight its shape, rows per use and steady-state route. Residuals and warm starts count the
    weights on a rank route, rows those whose route sends them (exact factors; a rank route only
    without error feedback, whose residual needs the dense gradient: others stop capturing), the
    defaults of a config elsewhere."""
    routed = [shape for shape, _, route in units if route in RANK_ROUTES]
    rows_used = (EXACT,) + (() if error_feedback else RANK_ROUTES)  # (a residual needs the dense gradient)
    captured = [(shape, sum(rows)) for shape, rows, route in units if route in rows_used and sum(rows)]
    kw = dict(params=params, world_size=world_size, routed=routed, captured=[c[0] for c in captured],
              rows=[c[1] for c in captured], rank=rank, error_feedback=error_feedback,
              error_feedback_rank=error_feedback_rank, residual_budget=residual_budget,
              param_itemsize=param_itemsize, residual_itemsize=residual_itemsize)
    out = [(label, rank_memory(engine, **kw)) for label, engine in PLAN_ENGINES]
    if local_size is not None and 1 < local_size < world_size:
        out.append((f"HSDP ({local_size} a node)", rank_memory("fsdp2", state_world_size=local_size,
                                                               residual_share=1.0 / local_size, **kw)))
    return out


def render_memory(rows: Sequence[Tuple[str, RankMemory]]) -> str:
    """`plan_memory`'s table: per engine the state, residuals (their rank where not whole; and at a
    step's end, `RankMemory.step_end_residuals`), warm starts, captured rows and what dAD adds (held
    between steps) against the state, in GiB per rank."""
    def gib(b: float) -> str:
        return f"{b / 2 ** 30:,.3f}"

    mem = rows[0][1] if rows else None
    head = (f"memory per rank, GiB (engine state: Adam, 16 B a parameter, sharded as the engine shards it; "
            f"residuals {dtype_name(mem.itemsize) if mem else 'fp32'}, of the {mem.weights if mem else 0} weights on "
            f"rank routes; residual_budget fits a rank under ZeRO-2/3 and FSDP2)")
    table = [("engine", "state", "residuals", "at a step's end", "warm starts", "rows", "dAD / state")]
    for label, m in rows:
        kept = "" if m.residual_rank is None else f" (rank {m.residual_rank})"
        table.append((label, gib(m.state), gib(m.residuals) + kept, gib(m.step_end_residuals), gib(m.warm_starts),
                      gib(m.rows), f"{m.dad / m.state:.2f}x" if m.state else "-"))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in table]
    return "\n".join([head, *lines])
