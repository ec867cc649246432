"""Merging dAD's per-rank states saved by a job of another number of processes (`merge_rank_states`):
mean error-feedback residuals, what every old rank shared carried over from rank 0, the rest restarted.

Used by `engines.checkpoint` when a checkpoint's world size is not the job's; every name is also
importable from there.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import torch

# What one unit's entry holds, and what becomes of it at another size (merge_rank_states' doc says why)
_UNIT_MEAN = ("residual",)
# HSDP's replicate hop (`codecs.replicate_rank`): a residual is rank s's rows of its node's, tagged
# ``shard: [s, L]``; the mean is taken per s (over the old nodes), and each new rank keeps its own s
_UNIT_SHARDED = ("shard", "residual_shards")
_UNIT_FROM_RANK0 = ("shared_q",)
_UNIT_RESTART = {"warm_q": None, "dense_only": False, "rows_unused": False, "last_rows": None}
_TOP_FROM_RANK0 = ("version", "steps")
_TOP_RESTART = {"verified": False}
# a state's tables: DADSynchronizer's per-weight flags (and, to version 2, its rank-route state); every
# synchroniser's rank-route state (`codecs.route_state`); a state may hold both
_UNIT_TABLES = ("units", "rank_routes")
# tables whose ranks may hold different weights: across nodes ZeRO's rank-route state lives on each
# weight's owners only (`exchange.node_partitions`); a rank without an entry held no residual (it
# adds zero to the mean), and the all-reduce route's Q is the same on every owner of a weight
_SPARSE_TABLES = ("rank_routes",)


def merge_rank_states(states: Iterable[Mapping]) -> Tuple[dict, str]:
    """One new rank's dAD state from the S old ranks' ``state_dict()``s (in rank order); returns it
    and a one-line summary of what carried over. Every new rank gets the same merge: the mean of the
    error-feedback residuals (rank-``q`` ones re-compressed to their best rank-``q`` part,
    `best_rank_q`), old rank 0's step count and all-reduce warm starts (in a sparse table the first
    holder's), and the rest restarted (``docs/checkpoints.md``, "Resuming at another size", says why).

    Raises `ValueError` for a key it does not know how to carry over (state of a newer format),
    or for old states that disagree on what must be the same everywhere (version, step count,
    which weights they hold).
    """
    merged: Optional[dict] = None
    layout: Tuple[str, ...] = ()
    tables: Dict[Optional[str], Dict[str, dict]] = {}  # merged, by table (None: version 1's only table)
    residuals: Dict[Tuple[Optional[str], str, Optional[int]], _Mean] = {}  # HSDP: per shard s too (else None)
    counts: Dict[Tuple[Optional[str], str, int], int] = {}
    old_ranks = 0
    for state in states:
        state = dict(state)
        keys = tuple(k for k in _UNIT_TABLES if k in state)
        own = {k: state.pop(k) for k in keys} or {None: state}  # version 1: the units' table alone
        top = state if keys else {}
        if merged is None:
            layout, merged, tables = keys, _merge_top(top), {k: {} for k in own}
        elif keys != layout or any(top.get(k) != merged.get(k) for k in _TOP_FROM_RANK0 if k in merged) or any(
                k not in _SPARSE_TABLES and set(t) != set(tables[k]) for k, t in own.items()):
            raise ValueError(f"the old ranks' dAD states disagree (rank {old_ranks} differs from rank 0 in its "
                             f"format, its weights or its step count): not one job's checkpoint")
        for k, t in own.items():
            for name, entry in t.items():
                if name not in tables[k]:  # (a sparse table: the weights some old rank holds)
                    tables[k][name] = _merge_unit(name, entry)
                else:  # the first holder's shared state
                    into = tables[k][name]
                    into.update({f: entry[f] for f in _UNIT_FROM_RANK0
                                 if into.get(f) is None and entry.get(f) is not None})
                s = None
                if entry.get("shard") is not None:
                    s, width = entry["shard"]
                    tables[k][name]["shard"] = [None, width]
                    counts[(k, name, s)] = counts.get((k, name, s), 0) + 1
                if entry.get("residual") is not None:
                    residuals.setdefault((k, name, s), _Mean()).add(entry["residual"])
        old_ranks += 1
    if merged is None:
        raise ValueError("no dAD state to merge")
    for (k, name, s), mean in residuals.items():
        # a node's residual is in units of its sum: the mean over nodes keeps what the average owes
        # at any node count of the same width, ``(1/(R' L)) R' e' = (1/(R L)) sum e``
        result = mean.result(counts.get((k, name, s), old_ranks))
        if s is None:
            tables[k][name]["residual"] = result
        else:
            tables[k][name].setdefault("residual_shards", {})[s] = result
    merged = tables[None] if not layout else {**merged, **tables}
    shared = sum(1 for t in tables.values() for e in t.values() if e.get("shared_q") is not None)
    low = sum(1 for m in residuals.values() if m.low_rank)
    summary = (f"error-feedback residuals of {len(residuals)} weight(s) averaged over the {old_ranks} old ranks"
               + (f" ({low} kept at their rank q: the mean's best rank-q part)" if low else "")
               + f"; the all-reduce route's warm starts of {shared} weight(s) carried over; the all-gather "
                 f"route's warm starts, the first-step check, row counts and dense-for-good decisions restart")
    return merged, summary


def _merge_top(top: Mapping) -> dict:
    unknown = sorted(set(top) - set(_TOP_FROM_RANK0) - set(_TOP_RESTART))
    if unknown:
        raise ValueError(f"dAD state keys {unknown} cannot be carried to another world size (unknown keys)")
    return {**{k: top[k] for k in _TOP_FROM_RANK0 if k in top}, **{k: v for k, v in _TOP_RESTART.items() if k in top}}


def _merge_unit(name: str, entry: Mapping) -> dict:
    unknown = sorted(set(entry) - set(_UNIT_MEAN) - set(_UNIT_FROM_RANK0) - set(_UNIT_RESTART) - set(_UNIT_SHARDED))
    if unknown:
        raise ValueError(f"dAD state of {name!r} has keys {unknown} that cannot be carried to another world "
                         f"size (unknown keys)")
    out = {k: v for k, v in _UNIT_RESTART.items() if k in entry}
    out.update({k: entry.get(k) for k in _UNIT_FROM_RANK0 if k in entry})
    out.update({k: None for k in _UNIT_MEAN if k in entry})
    return out


class _Mean:
    """The running sum of one weight's residuals: whole ones summed, rank-q pairs stacked (an old
    rank without one adds zero)."""

    def __init__(self) -> None:
        self.dense: Optional[torch.Tensor] = None
        self.lefts: List[torch.Tensor] = []
        self.rights: List[torch.Tensor] = []

    @property
    def low_rank(self) -> bool:
        return self.dense is None

    def add(self, residual: Any) -> None:
        if isinstance(residual, (tuple, list)):
            self.lefts.append(residual[0])
            self.rights.append(residual[1])
        else:
            self.dense = residual.clone() if self.dense is None else self.dense.add_(residual)

    def result(self, old_ranks: int) -> Any:
        if self.dense is None:
            matrix_rank = self.lefts[0].shape[1]  # the residuals' q
            return best_rank_q(torch.cat(self.lefts, 1), torch.cat(self.rights, 1) / old_ranks, matrix_rank)
        for u, v in zip(self.lefts, self.rights):  # pairs among whole ones (never saved so; kept correct anyway)
            self.dense += (u.double() @ v.double().t()).to(self.dense.dtype)
        return self.dense / old_ranks


def best_rank_q(left: torch.Tensor, right: torch.Tensor, matrix_rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The best rank-``matrix_rank`` approximation of ``left @ right.T`` as ``(U, V)``, ``U``
    orthonormal, as `error_feedback.LowRankErrorFeedback` keeps it: thin QR of both factors and the
    SVD of the small core (``left``: m x k, ``right``: n x k; costs ``O((m+n) k^2)``, in float64)."""
    dtype = left.dtype
    qa, ra = torch.linalg.qr(left.double())
    qb, rb = torch.linalg.qr(right.double())
    w, sigma, zh = torch.linalg.svd(ra @ rb.t(), full_matrices=False)
    keep = min(matrix_rank, sigma.numel())
    return (qa @ w[:, :keep]).to(dtype), (qb @ (zh[:keep].t() * sigma[:keep])).to(dtype)
