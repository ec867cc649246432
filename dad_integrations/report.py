"""The per-step report: what each parameter sent, how, beside what all-reduce would have sent."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

from dad_integrations.builtin_routes import BUILT_IN, DENSE


@dataclass
class ParamReport:
    """One parameter (or one dense bucket's share) in one step.

    representation: ``"exact"``, ``"rank"``, ``"rank_allreduce"``, ``"dense"``, or ``"overhead"``
        (bucket flags);
    rows: local rows captured (exact/rank); components: rank-dAD components sent;
    handed_bytes: bytes of the tensors this rank handed to collectives (padding included);
    sent_bytes / received_bytes: this rank's wire bytes (ring algorithms);
    allreduce_bytes: what a ring all-reduce of this parameter's gradient sends per rank;
    overlapped: its exchange began while backward was still running (before `synchronize()`);
    level: ``"flat"``, or ``"two_level"`` where only the hop between nodes carried its route
        (`exchange.two_level`); inter_bytes: there, what this rank received over that hop.
    """

    name: str
    representation: str
    shape: tuple
    rows: int = 0
    max_rows: int = 0
    components: int = 0
    method: str = ""
    handed_bytes: float = 0.0
    sent_bytes: float = 0.0
    received_bytes: float = 0.0
    allreduce_bytes: float = 0.0
    overlapped: bool = False
    level: str = "flat"
    inter_bytes: float = 0.0

    def add_traffic(self, traffic) -> None:
        """Add the bytes of a collective (an `aggregator.Traffic`) or of its share."""
        self.handed_bytes += traffic.handed
        self.sent_bytes += traffic.sent
        self.received_bytes += traffic.received


@dataclass
class StepReport:
    """All parameters of one synchronised step.

    links: each hop's link the routes were chosen by (``"flat"``, or ``"intra"`` and ``"inter"``
        at two levels), as said at attach (``"all-reduce 1.2 Gbit/s, 45 us (measured)"``);
    decision: the last route decision said (a route trial's, a watch's, a refresh's), with its
        evidence: the line rank 0 showed (`logs.say`).
    """

    step: int
    world_size: int
    params: List[ParamReport] = field(default_factory=list)
    links: Dict[str, str] = field(default_factory=dict)
    decision: str = ""

    @property
    def totals(self) -> Dict[str, float]:
        """Sums over parameters, and ``ratio``: bytes sent over all-reduce's."""
        keys = ("handed_bytes", "sent_bytes", "received_bytes", "allreduce_bytes")
        out = {k: float(sum(getattr(p, k) for p in self.params)) for k in keys}
        out["ratio"] = out["sent_bytes"] / out["allreduce_bytes"] if out["allreduce_bytes"] else 0.0
        for rep in BUILT_IN:
            out[f"params_{rep}"] = sum(1 for p in self.params if p.representation == rep)
        return out

    def by_representation(self) -> Dict[str, Dict[str, float]]:
        """Bytes sent and all-reduce bytes grouped by representation."""
        out: Dict[str, Dict[str, float]] = {}
        for p in self.params:
            agg = out.setdefault(p.representation, {"params": 0, "sent_bytes": 0.0, "allreduce_bytes": 0.0})
            agg["params"] += 1
            agg["sent_bytes"] += p.sent_bytes
            agg["allreduce_bytes"] += p.allreduce_bytes
        return out

    def to_dict(self) -> dict:
        return {"step": self.step, "world_size": self.world_size, "totals": self.totals,
                "params": [asdict(p) for p in self.params], "links": dict(self.links), "decision": self.decision}

    def routes_by_hop(self) -> str:
        """The step's routes per hop and their bytes against all-reduce's, in one phrase (`route_summary`)."""
        return route_summary(self.params)

    def table(self, limit: Optional[int] = None) -> str:
        """A fixed-width table, one line per parameter, then the totals."""
        head = f"{'parameter':<44} {'repr':<8} {'rows':>6} {'r':>3} {'sent':>11} {'all-reduce':>11}"
        lines = [head, "-" * len(head)]
        for p in self.params[:limit]:
            lines.append(f"{p.name[-44:]:<44} {p.representation:<8} {p.rows:>6} {p.components:>3} "
                         f"{_fmt(p.sent_bytes):>11} {_fmt(p.allreduce_bytes):>11}")
        t = self.totals
        lines.append("-" * len(head))
        lines.append(f"{'total':<44} {'':<8} {'':>6} {'':>3} {_fmt(t['sent_bytes']):>11} "
                     f"{_fmt(t['allreduce_bytes']):>11}   ratio {t['ratio']:.3f}")
        return "\n".join(lines)


@dataclass
class ShardedParamReport(ParamReport):
    """`ParamReport` under FSDP2 or ZeRO-2/3, plus what the engine's reduce-scatter of this parameter
    would send per rank (``(S-1)/S`` of its padded gradient: FSDP2 pads dim 0, ZeRO the flat size)."""

    reduce_scatter_bytes: float = 0.0
    # HSDP: what its own all-reduce of this shard between nodes would send per rank
    replicate_bytes: float = 0.0

    @classmethod
    def of_shard(cls, name: str, representation: str, shape: tuple, shard_numel: int, world_size: int,
                 itemsize: int) -> "ShardedParamReport":
        """A parameter whose padded shard has ``shard_numel`` elements; ``"dense"`` ones went through
        the reduce-scatter (its bytes are their traffic), the others carry it as their baseline."""
        S, chunk, numel = world_size, shard_numel * itemsize, math.prod(shape)
        rep = cls(name, representation, tuple(shape), reduce_scatter_bytes=(S - 1) * chunk,
                  allreduce_bytes=2.0 * (S - 1) / S * numel * itemsize)
        if representation == DENSE:
            rep.handed_bytes, rep.sent_bytes, rep.received_bytes = S * chunk, (S - 1) * chunk, (S - 1) * chunk
        return rep

    @classmethod
    def overhead(cls, name: str, numel: int, traffic) -> "ShardedParamReport":
        """A collective of dAD's own (row counts, the first call's check, a step's finiteness)."""
        rep = cls(name, "overhead", (numel,))
        rep.add_traffic(traffic)
        return rep


@dataclass
class ShardedStepReport(StepReport):
    """A step under FSDP2 or ZeRO-2/3 (one backward); ``totals`` adds ``reduce_scatter_bytes`` and
    ``ratio_reduce_scatter`` (bytes sent over the reduce-scatter's)."""

    @property
    def totals(self) -> Dict[str, float]:
        out = super().totals
        rs = float(sum(getattr(p, "reduce_scatter_bytes", 0.0) for p in self.params))
        out["reduce_scatter_bytes"] = rs
        out["ratio_reduce_scatter"] = out["sent_bytes"] / rs if rs else 0.0
        rep = float(sum(getattr(p, "replicate_bytes", 0.0) for p in self.params))
        if rep:  # HSDP: bytes between nodes against its own all-reduce's
            out["replicate_bytes"] = rep
            out["inter_bytes"] = float(sum(p.inter_bytes for p in self.params))
            out["ratio_replicate"] = out["inter_bytes"] / rep
        return out


HOP_NAMES = {"flat": "flat", "two_level": "between nodes"}


def route_summary(params: Sequence[ParamReport]) -> str:
    """Routes per hop (weights per route) and the bytes against the engine's own (all-reduce's; the
    sharded engines' reduce-scatter's):
    ``"flat: 10 exact, 18 dense; sent 0.31x all-reduce's bytes"``; at two levels the hop between
    nodes counts what this rank received over it."""
    counts = sorted(Counter((p.level, p.representation) for p in params if p.representation != "overhead").items())
    hops = [f"{HOP_NAMES.get(level, level)}: " + ", ".join(f"{n} {rep}" for (at, rep), n in counts if at == level)
            for level in sorted({level for (level, _), _ in counts})]
    sent = sum(p.sent_bytes for p in params)
    allreduce = sum(p.allreduce_bytes for p in params)
    scatter = sum(getattr(p, "reduce_scatter_bytes", 0.0) for p in params)  # the sharded engines' own
    text = "; ".join(hops) if hops else "no weights"
    if scatter:
        text += f"; sent {sent / scatter:.2f}x the reduce-scatter's bytes"
    elif allreduce:
        text += f"; sent {sent / allreduce:.2f}x all-reduce's bytes"
    inter = sum(p.inter_bytes for p in params)
    if inter:
        text += f", {_fmt(inter)} received between nodes"
    return text


def _fmt(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(nbytes) < 1024 or unit == "GB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{nbytes:.0f} B"
        nbytes /= 1024
    return f"{nbytes:.1f} GB"
