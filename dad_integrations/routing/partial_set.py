"""Set pricing: a step's routes priced as a whole, with what leaving the engine's path costs.

The router prices each weight alone (`router.route`), as if a dense weight cost the same whatever
the others do. It does not: the engine's own path for dense gradients is only kept where nothing
around them is compressed.

- **DDP** (the synchroniser, `exchange.policy`): a step whose every weight is dense goes by DDP's
  own buckets, untouched (`RoutePolicy.native_dense`). Once one weight of the step takes another
  route, every parameter goes through dAD's path: each gradient is copied into dAD's dense buckets
  (`codecs.dense.DenseBuckets`), all-reduced, and written back into DDP's bucket, which DDP copies
  into ``.grad`` as before; with per-parameter hooks and bookkeeping on the way.
- **FSDP2** (`exchange.row_shards`): a reduction call with a compressed weight packs the rest of
  its buffer into a compact input for the engine's reduce-scatter and writes the result back; a
  call with none reduce-scatters the engine's buffer as it is.
- **ZeRO** (`exchange.partitions`): DeepSpeed reduces the dense rest itself; no weight leaves.

So a set that compresses a few weights pays the leaving for every other one, and is priced above
both wholes by what the router sees weight by weight: on the 307 M Llama, the k/v projections
alone ran 1.67x DDP's step, slower than compressing everything.

The cost (`LeaveCost`), per group that leaves (a DDP step, an FSDP2 call)::

    leave = COPY_PASSES * (bytes_left * per_byte_s + tensors_left * per_tensor_s)

``bytes_left`` and ``tensors_left`` are the dense gradients of the group (its dense weights and
the parameters that are always dense, norms and biases); the two passes are the pack and the
write-back. ``per_byte_s`` and ``per_tensor_s`` are measured at attach (`measure_leave_cost`) on a
bounded buffer (``PROBE_BYTES``, a few milliseconds) and agreed across ranks (the slowest rank's:
one small all-gather, objective ``"time"`` only). What the term leaves out: overlap lost with
backward (no route is credited with overlap, `timing`) and the dAD path's Python work per
parameter beyond a copy launch; the route trial measures those on a measured link.

The rule (`choose_set`), at every refresh: a chosen set that compresses anything is priced with
the leaving against all-dense (the engine's path, no leaving) and all-compressed (the weights the
router compressed on their routes, each other weight that has one on its fastest non-dense route
among those the router allowed it, so within the byte cap, `router.byte_capped`; the same set where
the router compressed every such weight). The cheapest of
the three is kept; ties keep the chosen set. So auto never keeps a partial set (a few weights
compressed) slower than both wholes, nor compresses a few weights where moving the rest costs more
than they save. A pure function of agreed numbers: every rank decides alike, with a stated link as
with a measured one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, Hashable, Mapping, Optional, Sequence, Tuple

import torch

from dad_integrations.builtin_routes import DENSE
from dad_integrations.comm.aggregator import FactorAggregator
from dad_integrations.routing.link import agree_max, synchronize

COPY_PASSES = 2              # a gradient that leaves is packed once and written back once
PROBE_BYTES = 16 * 2 ** 20   # the per-byte probe: past CPU caches and a GPU's L2, as real buckets are
PROBE_TENSORS = 64           # the per-tensor probe: this many tiny copies
PROBE_REPS = 3
Rest = Mapping[Hashable, Tuple[int, int]]  # group -> (bytes, tensors) always dense in it


@dataclass(frozen=True)
class LeaveCost:
    """Seconds one copy pass costs per byte and per tensor (module doc); zero costs nothing."""

    per_byte_s: float = 0.0
    per_tensor_s: float = 0.0

    def seconds(self, nbytes: float, tensors: int) -> float:
        """Predicted seconds for ``tensors`` gradients of ``nbytes`` in all to leave the engine's path."""
        return COPY_PASSES * (nbytes * self.per_byte_s + tensors * self.per_tensor_s)


def measure_leave_cost(device: torch.device, aggregator: Optional[FactorAggregator] = None) -> LeaveCost:
    """`LeaveCost` on ``device``: the fastest of `PROBE_REPS` pack-and-write-back passes over
    `PROBE_BYTES` (per byte) and over `PROBE_TENSORS` one-number tensors (per tensor); with an
    ``aggregator`` of several ranks, the slowest rank's figures (a collective)."""
    src = torch.zeros(PROBE_BYTES // 4, device=device)
    pieces = list(src.chunk(4))
    tiny = [torch.zeros(1, device=device) for _ in range(PROBE_TENSORS)]

    def passes(parts) -> float:
        best = float("inf")
        for _ in range(PROBE_REPS + 1):  # the first warms up
            t0 = time.perf_counter()
            flat = torch.cat(parts)
            for part, back in zip(parts, flat.split([p.numel() for p in parts])):
                part.copy_(back)
            synchronize(device)
            best = min(best, time.perf_counter() - t0)
        return best / COPY_PASSES

    per_tensor = passes(tiny) / PROBE_TENSORS
    per_byte = max(passes(pieces) - len(pieces) * per_tensor, 0.0) / PROBE_BYTES
    del src, pieces, tiny
    if aggregator is not None and aggregator.world_size > 1:
        per_byte, per_tensor = agree_max(aggregator, [per_byte, per_tensor], device, name="dad.leave.agree")
    return LeaveCost(float(per_byte), float(per_tensor))


@dataclass(frozen=True)
class SetUnit:
    """One weight of a route set: its ``chosen`` route, the predicted ``seconds`` of each route it may
    take (dense among them; `router.Route.seconds`), the ``nbytes`` and ``tensors`` of its gradient
    on the engine's path (weight and riding biases), and the ``group`` that leaves the path together
    (None: the engine keeps its dense rest whatever this unit takes, as ZeRO does)."""

    index: int
    chosen: str
    seconds: Mapping[str, float]
    nbytes: int
    tensors: int = 1
    group: Hashable = 0

    @property
    def compressible(self) -> bool:
        return any(k != DENSE for k in self.seconds)

    def best_compressed(self) -> str:
        """Its fastest route other than dense (by predicted seconds, then name: every rank alike)."""
        return min((k for k in self.seconds if k != DENSE), key=lambda k: (self.seconds[k], k))


@dataclass(frozen=True)
class SetChoice:
    """`choose_set`'s decision: ``routes`` by unit index, ``taken`` (``"chosen"``, ``"all dense"``,
    ``"all compressed"``), each set's predicted seconds (None: not priced, nothing compressed) and
    whether the chosen set was ``partial`` (some weights that could compress left dense)."""

    routes: Dict[int, str]
    taken: str = "chosen"
    chosen_s: Optional[float] = None
    dense_s: Optional[float] = None
    compressed_s: Optional[float] = None
    partial: bool = field(default=False)

    @property
    def replaced(self) -> bool:
        return self.taken != "chosen"

    def clause(self) -> str:
        """One short clause for the routes line, where the chosen set was replaced ("" otherwise)."""
        if not self.replaced:
            return ""
        chosen = "partial set" if self.partial else "set chosen"
        return (f"set: {self.taken}, the {chosen} priced {self.chosen_s * 1e3:.1f} ms with leaving the "
                f"engine's path, all dense {self.dense_s * 1e3:.1f} ms, "
                f"all compressed {self.compressed_s * 1e3:.1f} ms")


def set_seconds(units: Sequence[SetUnit], routes: Mapping[int, str], leave: LeaveCost, rest: Rest = None) -> float:
    """Predicted seconds of ``routes`` over ``units``: each unit's route, plus the leaving of every
    group with a compressed unit (its dense units and its ``rest``, the parameters always dense)."""
    rest = rest or {}
    total = sum(u.seconds.get(routes[u.index], 0.0) for u in units)
    leaving = {u.group for u in units if routes[u.index] != DENSE and u.group is not None}
    for g in leaving:
        nbytes, tensors = rest.get(g, (0, 0))
        for u in units:
            if u.group == g and routes[u.index] == DENSE:
                nbytes, tensors = nbytes + u.nbytes, tensors + u.tensors
        total += leave.seconds(nbytes, tensors)
    return total


def choose_set(units: Sequence[SetUnit], leave: LeaveCost, rest: Rest = None) -> SetChoice:
    """The route set to keep (module doc): the chosen one where nothing leaves the engine's path or
    it is the cheapest of the three with the leaving counted, else the cheaper whole (dense on a tie)."""
    chosen = {u.index: u.chosen for u in units}
    if all(rep == DENSE for rep in chosen.values()):
        return SetChoice(chosen)
    partial = any(u.compressible and chosen[u.index] == DENSE for u in units)
    if set_seconds(units, chosen, leave, rest) <= sum(u.seconds.get(chosen[u.index], 0.0) for u in units):
        return SetChoice(chosen)  # nothing leaves: the router's weight-by-weight choice stands
    dense = {u.index: DENSE if u.compressible else u.chosen for u in units}
    # a weight the router compressed keeps its route (its pick among them, tie band and switch margin included)
    whole = {u.index: u.best_compressed() if u.compressible and u.chosen == DENSE else u.chosen for u in units}
    prices = {name: set_seconds(units, r, leave, rest) for name, r in
              (("chosen", chosen), ("all dense", dense), ("all compressed", whole))}
    taken = min(prices, key=lambda k: (prices[k], k != "chosen", k != "all dense"))
    routes = {"chosen": chosen, "all dense": dense, "all compressed": whole}[taken]
    return SetChoice(routes, taken, prices["chosen"], prices["all dense"], prices["all compressed"], partial)


def grad_bytes(params: Sequence[torch.nn.Parameter]) -> int:
    """Bytes of ``params``' gradients (in their own dtype: what the engine's buckets hold)."""
    return sum(p.numel() * p.element_size() for p in params)
