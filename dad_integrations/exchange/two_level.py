"""Two-level steps: reduce inside the node, compress only between nodes, gather inside the node.

The hops and what each moves are `routing.two_level`'s. On ``N`` nodes of ``L`` ranks
(`comm.topology`) every unit has an *owner*, one local index, fixed at attach so that the unit's
error-feedback residual and warm start live on one rank per node (``1/L`` of flat PowerSGD's
memory per rank); `exchange.levels.assign_owners` gives each about ``1/L`` of the step's work. A
step goes bucket by bucket (``bucket_cap_mb`` of gradients, in exchange order, as backward
finishes them): its routes (`routing.two_level.choose_two_level`, on row counts all-gathered over
the whole group where a unit may go exact: every rank decides alike); to the owners (one
all-to-all inside the node, `exchange.node_hops`); between nodes, each kind of route's collective
over the owner's cross group, only where the bucket has such units, the same on every member of
the group; from the owners (one all-gather inside the node), which every rank writes alike.

The first step (its factors checked) stays flat; so does every step when the router predicts the
flat routes faster (`Exchanger`). Codecs, residuals and warm starts are the flat exchanger's: a
residual left by a flat step on a rank that does not own the unit is flushed into that rank's
gradient (sent, never lost), one on the owner is compensated into its node's sum.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from dad_integrations.builtin_routes import DENSE, EXACT, RANK, RANK_ALLREDUCE
from dad_integrations.capture.rows import compute_dtype
from dad_integrations.capture.sink import GradSink
from dad_integrations.capture.units import FactorUnit
from dad_integrations.exchange.node_hops import HopItem, NodeHops, sums_at_owner
from dad_integrations.routes.codec import start_codec
from dad_integrations.routes.registry import get_route, has_codec, is_rank_route
from dad_integrations.codecs.exact import agree_rows
from dad_integrations.codecs.wire import pack, packed_size, unpack
from dad_integrations.comm.aggregator import Traffic, ring_allreduce_bytes
from dad_integrations.exchange.levels import Levels, assign_owners, level_probe_top, measure_levels
from dad_integrations.report import ParamReport
from dad_integrations.routing.router import Route, UnitShape, rank_only
from dad_integrations.routing.two_level import LevelUnit, choose_two_level, compare_levels, node_rows_of

log = logging.getLogger(__name__)


def param_entry(name: str, rep: str, p: torch.Tensor, world_size: int, **fields) -> ParamReport:
    """A parameter's report entry, with what all-reduce would move for it."""
    return ParamReport(name, rep, tuple(p.shape), allreduce_bytes=ring_allreduce_bytes(p.numel() * p.element_size(),
                                                                                        world_size), **fields)


def unit_entries(report: Dict[str, ParamReport], unit: FactorUnit, rep: str, world_size: int, weight: dict,
                 **fields) -> List[ParamReport]:
    """The report entries of a unit's weight (with ``weight``'s fields) and biases, which ride
    exact factors and go dense beside every other route."""
    names = [unit.name] + [b.name for b in unit.biases]
    for i, (name, q) in enumerate(zip(names, unit.params)):
        report[name] = param_entry(name, rep if i == 0 or rep in (EXACT, DENSE) else DENSE, q, world_size,
                                   **fields, **(weight if i == 0 else {}))
    return [report[name] for name in names]


def share_traffic(entries: Sequence[ParamReport], traffic: Traffic, weights: Sequence[float],
                  between: bool = False) -> None:
    """Attribute one collective's traffic to ``entries`` by ``weights`` (``between``: bytes between nodes)."""
    weights = [max(float(w), 0.0) for w in weights]
    total = sum(weights) or 1.0
    for entry, w in zip(entries, weights):
        share = traffic.share(w / total)
        entry.add_traffic(share)
        if between:
            entry.inter_bytes += share.received


class TwoLevelExchanger:
    """Runs the two-level steps of one synchroniser (see the module doc). Shares the flat
    exchanger's codecs and `RouteState`, so a step may be flat or two-level, whichever is
    predicted faster, without losing a residual."""

    def __init__(self, flat, levels: Levels):
        """``flat``: the synchroniser's `exchanger.Exchanger`, whose codecs, state and rows this shares."""
        self.flat, self.levels, self.plan, self.config = flat, levels, flat.plan, flat.config
        self.world, self.wire_dtype, self.device = flat.aggregator, flat.wire_dtype, flat.device
        self.dense_dtype, self.state = flat.dense_dtype, flat.state
        self.exact, self.rank_codec, self.rank_allreduce = flat.exact, flat.rank_codec, flat.rank_allreduce
        self.hops = NodeHops(self.exact, self.dense_dtype, self.config.rank, levels.topology.num_nodes, self.device)
        topo, plan = levels.topology, self.plan
        self.local, self.L, self.N = topo.local_rank, topo.local_size, topo.num_nodes
        costs = [float(u.param.numel()) for u in plan.units] + [float(q.numel()) for _, q in plan.dense]
        names = [u.name for u in plan.units] + [name for name, _ in plan.dense]
        self.owner_of: Dict[str, int] = dict(zip(names, assign_owners(costs, self.L)))
        self.chosen = False  # the last refresh's choice: two-level steps until the next
        self.routes: Dict[int, str] = {}  # the last two-level step's, by unit index

    # -- flat or two levels -------------------------------------------------------------------------
    def prefer(self, step: int, policy) -> bool:
        """Whether step ``step`` goes at two levels: decided at the first step after the checked
        one and at every refresh (`RoutePolicy.refresh`), held in between. By bytes (or on no
        models), always: no flat route sends fewer bytes between nodes. By time, where the step's
        predicted seconds at two levels (`TwoLevelTiming`) beat the flat routes' (`StepTiming`), each
        unit on its fastest route, on the row counts of its last size exchange."""
        if step < 1:
            return False
        if step > 1 and not policy.refresh(step):
            return self.chosen and not policy.two_level_vetoed
        policy.two_level_vetoed = False
        if step > 1 and self.levels.measured:  # links are measured again at each refresh, as the flat one
            self.levels.timing = dataclasses.replace(self.levels.timing, **dict(zip(
                ("intra", "inter"), measure_levels(self.world, self.levels.intra, self.levels.cross, self.device,
                                                top_bytes=level_probe_top(self.config)))))
        flat_timing, timing = policy.timing, self.levels.timing
        if flat_timing is None or timing is None or self.config.objective != "time":
            choice = True
        else:
            flat, two = self.predicted_seconds(step, policy.last_rows, flat_timing)
            choice = two < flat
            policy.two_level_saving = flat - two
            policy.say(f"dAD: step {step} on, {'two levels' if choice else 'flat'}: predicted {two * 1e3:.2f} ms "
                       f"a step at two levels, {flat * 1e3:.2f} ms flat")
        self.chosen = choice
        return choice

    def predicted_seconds(self, step: int, last_rows: Dict[int, Sequence[Sequence[int]]],
                          flat_timing) -> Tuple[float, float]:
        """The step's predicted seconds ``(flat, two levels)``, each unit on its fastest route
        (`routing.two_level.compare_levels`), on the row counts of its last size exchange."""
        s = self.world.world_size
        units = [LevelUnit(UnitShape.of(u), last_rows.get(u.index) or [[0] * len(u.kinds)] * s,
                           self.wire_dtype or u.param.dtype, u.dense_only) for u in self.plan.units]
        c = compare_levels(self.config, units, step=step, topology=self.levels.topology, flat_timing=flat_timing,
                           timing=self.levels.timing)
        return c.flat, c.two_level

    def choose_level(self, step: int, policy) -> None:
        """Whether step ``step`` goes at two levels (``policy.two_level``): as a route trial of
        two-level steps tries, else as `prefer` says. Where the level changes, warm starts drop (a
        flat step's Q is every rank's, a two-level step's only its owners'), and rows are captured
        again (two-level exact factors use them)."""
        before = policy.two_level
        arm = policy.trial.arm(step) if policy.two_level_trial() else None
        policy.two_level = arm == "routes" if arm is not None else self.prefer(step, policy)
        if before != policy.two_level:
            self.state.drop_warm_starts()
            if policy.two_level:
                policy.use_rows(u.index for u in self.plan.units)

    # -- the step ---------------------------------------------------------------------------------
    def run(self, window, sink: GradSink, *, step: int, scale: float) -> Dict[str, ParamReport]:
        """Exchange every unit and dense parameter of one step; returns the report entries."""
        report: Dict[str, ParamReport] = {}
        self.routes = {}
        cap = self.config.bucket_cap_mb * 2 ** 20
        bucket: List[HopItem] = []
        size = 0
        for unit in self.plan.units:
            window.ready[unit.index].wait()
            self.flat._check_open()
            bucket.append(HopItem(unit.name, list(unit.params), self.owner_of[unit.name], unit=unit,
                                  rows=self.flat._take_rows(unit, window)))
            size += sum(q.numel() * q.element_size() for q in unit.params)
            if size >= cap:
                self._bucket(bucket, sink, step, scale, report)
                bucket, size = [], 0
        window.flush.wait()  # backward is over: the always-dense parameters are final
        self.flat._check_open()
        bucket += [HopItem(name, [q], self.owner_of[name]) for name, q in self.plan.dense]
        if bucket:
            self._bucket(bucket, sink, step, scale, report)
        return report

    def _bucket(self, items: List[HopItem], sink: GradSink, step: int, scale: float, report) -> None:
        self._route(items, step)
        self.routes.update({it.unit.index: it.rep for it in items if it.unit is not None})
        for it in items:
            if it.unit is not None and not it.unit.dense_only:  # a rank route reduces the node's dense sum
                self.flat.policy.settle_capture(it.unit, Route(it.rep, False), "dense", verify=False)
            # residuals this rank holds but will not compensate this step go into its gradient
            if it.unit is not None and not (it.owner == self.local and is_rank_route(it.rep)):
                self.state.flush(it.name, functools.partial(sink.add_local, it.unit.param))
            it.entries = self._entries(it, report)
        # 2. to the owners: one all-to-all inside the node; this rank's items come back with the
        # node's contributions summed (dense, rank routes) or stacked (exact)
        mine, traffic = self.hops.to_owner(items, sink, self.levels.intra, self.local,
                                           f"dad.twolevel.to_owner.{items[0].name}")
        self._share(items, traffic, lambda it: it.hop.to_owner or it.numel)
        self._between(mine, scale, step)
        self._from_owner(items, sink)

    # -- 1. routes --------------------------------------------------------------------------------
    def _route(self, items: List[HopItem], step: int) -> None:
        """Every item's route; row counts all-gathered over the group where any unit may go exact."""
        for it in items:
            if it.unit is not None:
                it.counts = [int(r[0].shape[0]) for r in it.rows]
        lossless = not rank_only(self.config, step)
        maybe = [it for it in items if lossless and it.unit is not None and it.unit.has_factors
                 and not (it.unit.dense_only or it.unit.rows_unused)]
        if maybe:
            table, _ = agree_rows([it.counts for it in maybe], self.world, f"dad.twolevel.counts.{maybe[0].name}",
                                  self.device)
            topo = self.levels.topology
            for it, by_rank in zip(maybe, table):
                it.rank_rows = [by_rank[r] for r in topo.intra_ranks(topo.node)]
                it.node_rows = node_rows_of(by_rank, topo)
        for it in items:
            if it.unit is None:
                it.rep = DENSE
                continue
            u = it.unit
            it.rep, hops, _ = choose_two_level(self.config, UnitShape.of(u), it.node_rows, step=step, nodes=self.N,
                                               local_size=self.L, wire_dtype=self.wire_dtype or u.param.dtype,
                                               timing=self.levels.timing, dense_only=u.dense_only)
            it.hop = hops[it.rep]

    def _entries(self, it: HopItem, report: Dict[str, ParamReport]) -> List[ParamReport]:
        """The item's report entries (`unit_entries`; a dense parameter's own)."""
        if it.unit is None:
            report[it.name] = param_entry(it.name, DENSE, it.params[0], self.world.world_size, level="two_level")
            return [report[it.name]]
        return unit_entries(report, it.unit, it.rep, self.world.world_size, dict(rows=sum(it.counts or [])),
                            level="two_level")

    # -- 3. between nodes -------------------------------------------------------------------------
    def _between(self, mine: List[HopItem], scale: float, step: int) -> None:
        """Hop 2 for this rank's items, over its cross group: each kind of route present starts its
        batch's collective, in a fixed order (dense sums first: the routes that sum at the owner
        send their biases there), then each batch is finished; leaves each item's hop-3 blocks in
        ``it.result``."""
        kinds = ["codec" if has_codec(it.rep) else it.rep for it in mine]
        batches = [(self._dense, [(it, i) for it in mine for i in range(len(it.params))
                                  if it.rep == DENSE or (i > 0 and sums_at_owner(it.rep))])]
        batches += [(start, [it for it, k in zip(mine, kinds) if k == kind]) for kind, start in (
            (EXACT, self._exact), (RANK, self._rank), ("codec", self._codec), (RANK_ALLREDUCE, self._rank_allreduce))]
        finishes = [start(batch, scale, step) for start, batch in batches if batch]
        for finish in finishes:
            finish()

    def _dense(self, parts: List[Tuple[HopItem, int]], scale: float, step: int) -> Callable[[], None]:
        """The node sums all-reduced as one buffer; dense items get their average."""
        flat = torch.cat([it.result[i].to(self.dense_dtype) for it, i in parts])
        handle = self.levels.cross.all_reduce(flat, name=f"dad.twolevel.dense.{parts[0][0].name}", op="sum")
        self._share([it for it, _ in parts], handle.traffic, lambda it: it.numel, between=True)

        def finish() -> None:
            total = self.state.note(handle.wait())
            for (it, i), part in zip(parts, total.split([it.result[i].numel() for it, i in parts])):
                it.result[i] = part
            for it in [it for it, i in parts if i == 0 and it.rep == DENSE]:
                it.result = [self.hops.dense_average(r, scale) for r in it.result]

        return finish

    def _exact(self, items: List[HopItem], scale: float, step: int) -> Callable[[], None]:
        """Every node's stacked rows, all-gathered; each owner rebuilds the average."""
        handle, decoded = self.exact.gather(self.levels.cross, [(it.unit, it.rows, it.node_rows) for it in items],
                                            f"dad.twolevel.exact.{items[0].name}")
        self._share(items, handle.traffic, lambda it: it.hop.between, between=True)

        def finish() -> None:
            for it, grads in zip(items, decoded(scale)):
                it.result = [self.state.note(grads[q]) if grads is not None else
                             torch.zeros(q.shape, dtype=compute_dtype(q), device=self.device) for q in it.params]

        return finish

    def _rank(self, items: List[HopItem], scale: float, step: int) -> Callable[[], None]:
        """Each node sum's rank-r factors, all-gathered in one payload."""
        handle, decoded = self.rank_codec.gather(
            self.levels.cross, [(it.unit, self.rank_codec.encode(it.unit, [], self.hops.node_grad(it), it.entries[0],
                                                                 step, dense=True)) for it in items],
            f"dad.twolevel.rank.{items[0].name}", self.state.note)
        self._share(items, handle.traffic, lambda it: it.hop.between, between=True)

        return self._products(items, decoded, scale)

    def _codec(self, items: List[HopItem], scale: float, step: int) -> Callable[[], None]:
        """Each item's own codec over the node sums (`routes.codec.start_codec`)."""
        handles = [start_codec(get_route(it.rep).codec, it.result[0], self.levels.cross,
                               name=f"dad.twolevel.{it.rep}.{it.name}") for it in items]
        for it, handle in zip(items, handles):
            self._share([it], handle.traffic, lambda it: 1.0, between=True)

        def finish() -> None:
            for it, handle in zip(items, handles):  # the average back, beside its biases' (dense, above)
                it.result = [self.state.note(handle.wait().mul_(scale))] + [r * scale for r in it.result[1:]]

        return finish

    def _rank_allreduce(self, items: List[HopItem], scale: float, step: int) -> Callable[[], None]:
        """PowerSGD's rounds over the node sums (`RankAllReduceCodec.start`)."""
        codec = self.rank_allreduce
        rounds = codec.start([codec.queue_item(it.unit, [], self.hops.node_grad(it), it.entries[0], step, dense=True)
                              for it in items], self.levels.cross, self.state.note)

        def decoded(scale: float) -> list:
            before = [it.entries[0].received_bytes for it in items]
            out = rounds(scale)
            for it, b in zip(items, before):  # the codec added its rounds' share to the entries
                it.entries[0].inter_bytes += it.entries[0].received_bytes - b
            return out

        return self._products(items, decoded, scale)

    def _products(self, items: List[HopItem], decoded: Callable[[float], list], scale: float) -> Callable[[], None]:
        """What waits for a rank route's batch and leaves each item's hop-3 blocks (`NodeHops.product_blocks`)."""

        def finish() -> None:
            for it, factors in zip(items, decoded(scale)):
                it.result = self.hops.product_blocks(it, *factors, scale)

        return finish

    # -- 4. from the owner ------------------------------------------------------------------------
    def _from_owner(self, items: List[HopItem], sink: GradSink) -> None:
        """From the owners: one all-gather inside the node of every owner's results; every rank
        writes them, and notes whether they are finite (so that every rank, not only the owners,
        keeps or drops the step's rank-route state alike)."""
        mine, note = [it for it in items if it.owner == self.local], self.state.note
        blocks = [b.to(dtype) for it in mine for b, (dtype, _) in zip(it.result, self.hops.result_specs(it))]
        payload = pack(blocks, self.device)
        specs = [[s for it in items if it.owner == j for s in self.hops.result_specs(it)] for j in range(self.L)]
        handle = self.levels.intra.all_gather(payload, name=f"dad.twolevel.from_owner.{items[0].name}",
                                              first_dims=[packed_size(s) for s in specs])
        got = handle.wait()
        self._share(items, handle.traffic, lambda it: it.hop.from_owner or it.numel)
        per_owner = [iter(unpack(got[j], specs[j])) for j in range(self.L)]
        for it in items:
            blocks = per_owner[it.owner]
            self.hops.write(it, [note(next(blocks)) for _ in self.hops.result_specs(it)], sink)

    # -- reports ----------------------------------------------------------------------------------
    @staticmethod
    def _share(items: Sequence[HopItem], traffic: Traffic, weight: Callable[[HopItem], float],
               between: bool = False) -> None:
        """Attribute one collective's traffic to the items' weight entries, by ``weight``."""
        share_traffic([it.entries[0] for it in items], traffic, [weight(it) for it in items], between)
