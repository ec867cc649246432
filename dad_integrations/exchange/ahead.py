"""Routes decided ahead of backward, on the rows the forward counted (DDP's steps).

A step that chooses routes (the first, and every refresh) normally decides each unit once its
rows are in: it exchanges every rank's row counts unit by unit (with the first step's check of
the factors), and so the whole step leaves DDP's own buckets for dAD's path. On a fast link every
unit then goes dense anyway, and the step has paid for the exchange, the per-parameter packing of
every gradient and, on the first step, the check, for nothing: at 307 M parameters on loopback
the first step took 2.9x DDP's.

Here the forward has already said how many rows each use will give: a linear-like layer one per
input row, an embedding one per id (`capture.Use.forward_rows`, counted by the layer kinds that
can tell; any other kind leaves the count unknown and the step decides as before). At the step's
first bucket, before any gradient leaves, the ranks agree on those counts in one all-gather
(`agree_forward_rows`, a few integers per unit) and the router routes every unit on them
(`exchange.policy.RoutePolicy.decide_ahead`). Where every unit goes dense, the step goes by DDP's
buckets as they are (`policy.native_dense`), and it is held until the next refresh as any
decision is. The check of the factors waits for the first step that sends them (a step in which
no rank used factors checks nothing: `synchronizer_step.StepLifecycle._finish`). Where some unit
would not go dense, nothing is kept and the step decides unit by unit as before, on the counts its
rows give: the forward's count of an embedding includes padding ids its rows drop, so it is an
upper bound, and only an all-dense decision is taken from it.

Cost: one all-gather of ``2 + uses`` integers per unit at a choosing step (about a millisecond
on loopback for GPT-2's 50 units), and the router's arithmetic for every unit.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from dad_integrations.capture.units import FactorUnit
from dad_integrations.comm.aggregator import FactorAggregator
from dad_integrations.routing.router import RowCounts

UNKNOWN = -1  # a rank's flag: some use's count is not known ahead of backward


def forward_rows(units: Sequence[FactorUnit]) -> Optional[List[int]]:
    """This rank's forward counts, one per use of every unit in order; None where one is unknown."""
    out: List[int] = []
    for u in units:
        for use in u.uses:
            if use.forward_rows is None:
                return None
            out.append(int(use.forward_rows))
    return out


def agree_forward_rows(units: Sequence[FactorUnit], aggregator: FactorAggregator,
                       device: torch.device) -> Optional[Dict[int, RowCounts]]:
    """Every rank's forward counts (`forward_rows`), by unit index, by rank, by use; None where any
    rank does not know one (every rank gets the same answer: one all-gather, the same size on each)."""
    mine = forward_rows(units)
    n = sum(len(u.uses) for u in units)
    local = torch.tensor([UNKNOWN] * (n + 1) if mine is None else [0] + mine, dtype=torch.int64, device=device)
    gathered = aggregator.all_gather(local, name="dad.ahead.rows",
                                     first_dims=[local.numel()] * aggregator.world_size).wait()
    by_rank = [t.cpu().tolist() for t in gathered]
    if any(r[0] == UNKNOWN for r in by_rank):
        return None
    out: Dict[int, RowCounts] = {}
    k = 1
    for u in units:
        width = len(u.uses)
        out[u.index] = [r[k:k + width] for r in by_rank]
        k += width
    return out
