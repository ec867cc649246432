"""The exchanger: one step's collectives, unit by unit, in an order every rank shares.

Units go in reverse registration order (the order backward finishes them). For each unit, when
its weight and biases are final (`StepWindow.ready`): its route (`policy.RoutePolicy`), a size
exchange if the route needs agreed row counts (with the first-step check riding along), then its
codec's collective: one all-gather of exact factors, or a place in the rank-r bucket (one
all-gather per ``bucket_cap_mb``), or a place in the dense buckets (`codecs.dense.DenseBuckets`: a
full bucket is all-reduced at once, the last one when the last unit is routed). The rebuild of one
unit overlaps the next unit's collective, and collectives started before backward ends overlap the
rest of backward. When backward is over (`StepWindow.flush`), the parameters that are always dense
(norms, excluded parameters) follow in the last buckets, and the step waits for every bucket. Each
route's bytes are its module's (`dad_integrations.routes`).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from dad_integrations.builtin_routes import DENSE, EXACT, RANK, RANK_ALLREDUCE
from dad_integrations.comm.aggregator import FactorAggregator, Traffic
from dad_integrations.exchange.checks import why_factors_fail, factors_rebuild_local_grad
from dad_integrations.codecs.dense import DenseBuckets, bucket_dtype
from dad_integrations.codecs.exact import ExactCodec, rebuild_unit
from dad_integrations.codecs.rank import RankBucket, RankCodec
from dad_integrations.codecs.rank_allreduce import AllReduceBucket, RankAllReduceCodec
from dad_integrations.config import DADConfig
from dad_integrations.codecs.route_state import RouteState
from dad_integrations.capture.rows import Rows, compute_dtype, concat_rows
from dad_integrations.report import ParamReport, StepReport
from dad_integrations.routes import layouts
from dad_integrations.routes.codec import start_codec
from dad_integrations.routes.registry import check_routes, get_route, has_codec, is_rank_route, raise_unsupported
from dad_integrations.routing.router import Route, RowCounts, RouteContext
from dad_integrations.capture.sink import GradSink
from dad_integrations.capture.units import FactorUnit, SyncPlan
from dad_integrations.exchange.policy import RoutePolicy
from dad_integrations.exchange.levels import Levels, describe_hops
from dad_integrations.exchange.two_level import TwoLevelExchanger, param_entry, share_traffic, unit_entries
from dad_integrations.exchange.window import StepWindow

log = logging.getLogger(__name__)

Finish = Callable[[], None]


class StepClosed(RuntimeError):
    """The synchroniser was closed while a step was in flight."""


@dataclass
class _Step:
    """One step's exchange in flight: what each unit's collective joins, and where results go."""

    window: StepWindow
    sink: GradSink
    step: int
    verify: bool          # the first step: the factors are checked, every unit's sizes exchanged
    scale: float          # prescale x postscale: what a rebuilt sum is multiplied by
    report: Dict[str, ParamReport]
    dense: DenseBuckets
    bucket: RankBucket        # rank-r payloads sharing one all-gather
    shared: AllReduceBucket   # the rank-r all-reduce route's payloads


class Exchanger:
    """Runs the collectives of each step; holds what carries over between steps for the rank codecs
    (`state`: warm starts, error-feedback residuals). Which route each unit takes is its `policy`'s
    (`policy.RoutePolicy`)."""

    def __init__(self, plan: SyncPlan, aggregator: FactorAggregator, config: DADConfig,
                 wire_dtype: Optional[torch.dtype], device: torch.device, levels: Optional[Levels] = None):
        # at attach: a route it cannot run raises, naming it (its layouts: `routes.layouts.ENGINES`)
        check_routes(config.routes, layouts.layout_for("synchronizer"))
        if levels is not None and levels.topology.two_level:
            check_routes(config.routes, layouts.layout_for("synchronizer", across_nodes=True))
        self.plan, self.aggregator, self.config = plan, aggregator, config
        self.wire_dtype, self.device = wire_dtype, device
        self.exact = ExactCodec(wire_dtype, device)
        self.state = RouteState(config)
        lossy = config.rank is not None
        self.rank_codec = RankCodec(config, wire_dtype, self.state) if lossy else None
        self.rank_allreduce = RankAllReduceCodec(config, wire_dtype, self.state) if lossy else None
        self.closed = False
        self._starts = {EXACT: self._start_exact, DENSE: None, RANK: self._start_rank,
                        RANK_ALLREDUCE: self._start_rank_allreduce, "codec": self._start_codec}
        # one dtype for every dense bucket, whatever goes dense in a step (as one call over all of them)
        self.dense_dtype = bucket_dtype([q for u in plan.units for q in u.params] + [q for _, q in plan.dense],
                                        wire_dtype) or torch.float32
        self.policy = RoutePolicy(plan, aggregator, config, device, self.state)  # measures the models
        self.policy.wire_dtype = wire_dtype
        # two levels (nodes of several ranks): steps that compress only between nodes, where faster
        self.two_level: Optional[TwoLevelExchanger] = None
        if levels is not None and levels.topology.two_level:
            if levels.timing is not None and self.policy.timing is not None:
                levels.timing = dataclasses.replace(levels.timing, compute=self.policy.timing.compute)
            self.two_level = TwoLevelExchanger(self, levels)

    def _await(self, window: StepWindow, i: int, sure: List[bool], dense: DenseBuckets) -> None:
        """Wait until unit ``i`` is ready; where the units sure to go dense after it do not fill the
        open dense bucket, for the unit that fills it first, so that the worker wakes about once per
        bucket, not per unit (each wake takes the GIL from the autograd thread). Order and results
        do not depend on it."""
        units = self.plan.units
        j, room = i, dense.room()
        while j + 1 < len(units) and sure[j]:
            room -= dense.nbytes(units[j].params)
            if room <= 0:
                break
            j += 1
        if j > i:
            window.ready[units[j].index].wait()
        window.ready[units[i].index].wait()

    def run(self, window: StepWindow, sink: GradSink, *, step: int, verify: bool, prescale: float,
            postscale: Optional[float]) -> StepReport:
        """Exchange every unit and the dense buckets of one step; returns its report. ``window.started``
        (`routing.trial.StepClock`) to the end of this call is the step's span a route trial times."""
        st = self._open_step(window, sink, step, verify, prescale, postscale)
        if self.policy.two_level:
            st.report.update(self.two_level.run(window, sink, step=step, scale=st.scale))
            self.policy.two_level_routes = dict(self.two_level.routes)
            return self._finish_step(st)
        previous = self._exchange_units(st)
        if not self.plan.dense:
            st.dense.send()  # every unit is routed: the last units' bucket need not wait for backward's end
        # else the always-dense parameters (norms, biases of dense layers) join it when backward
        # ends, which follows the last unit closely: one collective fewer (a call's latency)
        # than a small bucket of their own
        for f in previous:
            f()
        window.flush.wait()  # backward is over: every dense gradient is final
        self._check_open()
        for name, q in self.plan.dense:
            st.dense.add(name, q)
        return self._finish_step(st)

    def _open_step(self, window: StepWindow, sink: GradSink, step: int, verify: bool, prescale: float,
                   postscale: Optional[float]) -> _Step:
        """The step's buckets and report; dense traffic is accounted per parameter as it goes."""
        s = self.aggregator.world_size
        report: Dict[str, ParamReport] = {}

        def account(name: str, p: Optional[nn.Parameter], traffic: Traffic) -> None:
            if name not in report:
                report[name] = param_entry(name, DENSE, p, s) if p is not None else ParamReport(name, "overhead", ())
            report[name].add_traffic(traffic)

        dense = DenseBuckets(self.aggregator, sink, bucket_cap_mb=self.config.bucket_cap_mb, dtype=self.dense_dtype,
                             account=account, prescale=prescale, postscale=postscale,
                             early=lambda: not window.flush.is_set())
        self.state.start_step()
        return _Step(window, sink, step, verify, prescale * (1.0 / s if postscale is None else postscale), report,
                     dense, RankBucket(self.config.bucket_cap_mb * 2 ** 20),
                     AllReduceBucket(self.config.bucket_cap_mb * 2 ** 20))

    def _exchange_units(self, st: _Step) -> List[Finish]:
        """Route every unit in exchange order and start its collectives, finishing each unit's while
        the next one's run; returns what finishes the last ones (the open buckets' sends included)."""
        previous: List[Finish] = []
        sure = [self.policy.dense_for_sure(u, st.step, st.verify) for u in self.plan.units]
        sends = ((st.bucket, self._send_rank_bucket), (st.shared, self._send_shared))  # the rank routes' buckets
        for i, unit in enumerate(self.plan.units):
            self._await(st.window, i, sure, st.dense)
            self._check_open()
            current: List[Finish] = []
            finish = self._unit(unit, st)
            if finish is not None:
                current.append(finish)
            for bucket, send in sends:
                while bucket.ready_to_send():
                    current.append(send(st))
            for f in previous:
                f()  # rebuild the last units while this one's collective runs
            previous = current
        for bucket, send in sends:
            while bucket.items:
                previous.append(send(st))
        return previous

    def _finish_step(self, st: _Step) -> StepReport:
        """Wait for the dense buckets, keep or drop the step's rank-route state, close the step."""
        # whether the results are finite only decides whether rank-route state is kept
        finite = st.dense.finish(check_finite=self.state.pending)
        for name, entry in st.report.items():
            if entry.representation == DENSE:
                entry.overlapped = name in st.dense.overlapped  # its all-reduce began during backward
        self.state.end_step(finite)
        params = list(st.report.values())
        self._close_step(st.window, st.step, params)
        return self._report(st.step, params)

    def describe_hops(self) -> str:
        """The attach line of the job's nodes and links (`exchange.levels.describe_hops`)."""
        return describe_hops(self.config, self.aggregator, self.two_level.levels if self.two_level else None,
                             self.policy.flat_link())

    def _report(self, step: int, params: List[ParamReport]) -> StepReport:
        """The step's report, with each hop's link and the last decision said (`report.StepReport`)."""
        link = self.policy.flat_link()
        links = {"flat": link.brief()} if link is not None else {}
        levels = self.two_level.levels if self.two_level is not None else None
        if levels is not None and levels.timing is not None:
            links.update(intra=levels.timing.intra.brief(), inter=levels.timing.inter.brief())
        return StepReport(step, self.aggregator.world_size, params, links=links, decision=self.policy.decision)

    def _close_step(self, window: StepWindow, step: int, params: Sequence[ParamReport] = ()) -> None:
        """The step's exchange is over (``params``: its report): its span to the route trial, the
        next step's preparation (whether it goes flat or at two levels among them)."""
        self.policy.end_step(step, getattr(window, "started", None), params)
        if self.two_level is not None:
            self.two_level.choose_level(step + 1, self.policy)

    def start_native(self, buffer: torch.Tensor, scale: float):
        """Put one of DDP's buckets on the wire as it is (`RoutePolicy.native_dense`), in the dense
        buckets' wire dtype, multiplied by ``scale`` (the step's prescale x postscale) before the
        sum: DDP's own bucket is divided by the world size before its all-reduce, so the results
        are DDP's bit for bit at any world size, and the step's end has nothing left to compute.
        Returns what `run_native` finishes."""
        send = buffer if buffer.dtype == self.dense_dtype else buffer.to(self.dense_dtype)
        if scale != 1.0:
            send.mul_(scale)  # in place: DDP copies the bucket into .grad when the step is over
        return buffer, send, self.aggregator.all_reduce(send, name="dad.dense.native", op="sum")

    def run_native(self, window: StepWindow, buckets: List[tuple], names: Dict[int, str], *,
                   step: int) -> StepReport:
        """Finish a step of DDP's own buckets (`start_native`): report, wait for them, close the step.
        What needs no result (the report: each bucket's traffic is known once it is started; rows
        to drop) is done before the wait, while the last bucket is on the wire."""
        s = self.aggregator.world_size
        report: List[ParamReport] = []
        for buffer, send, handle, params in buckets:
            numel = max(buffer.numel(), 1)
            for p in params:
                entry = param_entry(names.get(id(p), "?"), DENSE, p, s, overlapped=True)
                entry.add_traffic(handle.traffic.share(p.numel() / numel))
                report.append(entry)
        for u in self.plan.units:  # rows a forward still captured (after the checked first step) are
            if any(use.pairs for use in u.uses):  # of no use: dense until the next refresh, capture
                window.take_rows(u)               # off, as `_unit` does (else the step would see them late)
        self.policy.drop_rows()
        for buffer, send, handle, params in buckets:
            total = handle.wait()
            if total is not buffer:  # sent in the wire dtype
                buffer.copy_(total)
        self._close_step(window, step, report)  # the step's span (route trials) ends here
        return self._report(step, report)

    def _check_open(self) -> None:
        if self.closed:
            raise StepClosed("dAD synchroniser closed with a step in flight")

    # -- one unit ------------------------------------------------------------------------------------
    def _unit(self, unit: FactorUnit, st: _Step) -> Optional[Finish]:
        """Route one unit and start its collective; returns what finishes it (or None)."""
        overlapped = not st.window.flush.is_set()
        rows = self._take_rows(unit, st.window)
        counts = [int(r[0].shape[0]) for r in rows]
        decision, rows_by_rank, traffic = self._decide(unit, rows, counts, st)
        rep = decision.representation
        # off the rank routes with a residual left: this dense step sends it (`RouteState.flush`)
        if not is_rank_route(rep) and not self.policy.holds_residuals(st.step) and self.state.flush(
                unit.name, functools.partial(st.sink.add_local, unit.param)):
            rep = DENSE  # it carries the residual this step; its route applies from the next
        max_rows = max(sum(r) for r in rows_by_rank) if rows_by_rank else 0
        entry = unit_entries(st.report, unit, rep, self.aggregator.world_size,
                             dict(rows=sum(counts), overlapped=overlapped, max_rows=max_rows))[0]
        finish = self._start(unit, rep, rows, rows_by_rank, entry, st)
        self.policy.settle_capture(unit, decision, entry.method, st.verify)
        entry.add_traffic(traffic)
        return finish

    def _take_rows(self, unit: FactorUnit, window: StepWindow) -> List[Rows]:
        """The unit's rows of this step, per use (its priors re-derived after a restart)."""
        m, n = unit.shape
        rows = [concat_rows(pairs, use.kind, (m, n), unit.param, use.block)
                for pairs, use in zip(window.take_rows(unit), unit.uses)]
        if unit.index in window.restarts:
            _rederive_priors(unit, rows, window)
        return rows

    def _decide(self, unit: FactorUnit, rows: List[Rows], counts: List[int],
                st: _Step) -> Tuple[Route, Optional[RowCounts], Traffic]:
        """The unit's route this step (`RoutePolicy.decide`), every rank's row counts (None without
        a size exchange) and their traffic."""
        ctx = RouteContext(self.config, self.aggregator.world_size, self.wire_dtype or unit.param.dtype, step=st.step,
                           first_step=st.verify, timing=self.policy.timing)
        traffic = Traffic()

        def agree() -> RowCounts:
            nonlocal traffic
            ok = (unit.dense_only or not st.verify or not unit.has_factors
                  or factors_rebuild_local_grad(unit, rows, st.sink))
            rows_by_rank, traffic = self._agree(unit, ok, counts)
            return rows_by_rank

        decision, rows_by_rank = self.policy.decide(unit, ctx, st.step, st.verify, agree)
        return decision, rows_by_rank, traffic

    def _start(self, unit: FactorUnit, rep: str, rows: List[Rows], rows_by_rank: Optional[RowCounts],
               entry: ParamReport, st: _Step) -> Optional[Finish]:
        """Start the unit's route (one ``_start_*`` each; a route with a codec of its own:
        `_start_codec`; dense: a place in the dense buckets); returns what finishes it (or None). A
        collective started for the unit alone adds its traffic to ``entry``. Exact factors carry the
        unit's biases; every other route puts them in the dense buckets first (after a dense weight)."""
        key = "codec" if has_codec(rep) else rep
        if key not in self._starts:
            raise_unsupported(rep, layouts.FLAT)
        if rep == DENSE:
            st.dense.add(unit.name, unit.param)
        if rep != EXACT:
            for b in unit.biases:
                st.dense.add(b.name, b.param)
        start = self._starts[key]
        return start(unit, rep, rows, rows_by_rank, entry, st) if start is not None else None

    def _start_exact(self, unit: FactorUnit, rep: str, rows: List[Rows], rows_by_rank: RowCounts, entry: ParamReport,
                     st: _Step) -> Finish:
        """The all-gather of the unit's exact factors; its finish rebuilds the average."""
        handle, decoded = self.exact.gather(self.aggregator, [(unit, rows, rows_by_rank)], f"dad.exact.{unit.name}")
        entry.add_traffic(handle.traffic)
        sink, scale = st.sink, st.scale

        def finish() -> None:
            grads, = decoded(scale)
            if grads is None:
                sink.write_unused(unit.param)
                return
            for q, g in grads.items():
                sink.write(q, self.state.note(g))

        return finish

    def _start_codec(self, unit: FactorUnit, rep: str, rows: List[Rows], rows_by_rank: Optional[RowCounts],
                     entry: ParamReport, st: _Step) -> Finish:
        """A route with its own codec (`routes.codec`): the unit's local gradient encoded, its
        collective over the group; its finish writes the scaled sum."""
        p, sink, scale = unit.param, st.sink, st.scale
        handle = start_codec(get_route(rep).codec, sink.local_grad(p, torch.float32), self.aggregator,
                             name=f"dad.{rep}.{unit.name}")
        entry.add_traffic(handle.traffic)

        def finish() -> None:
            sink.write(p, self.state.note(handle.wait().mul_(scale).view(p.shape).to(p.dtype)))

        return finish

    def _start_rank_allreduce(self, unit: FactorUnit, rep: str, rows: List[Rows], rows_by_rank: Optional[RowCounts],
                              entry: ParamReport, st: _Step) -> None:
        """A place in the rank-r all-reduce route's bucket (`_send_shared`)."""
        st.shared.add(self.rank_allreduce.queue_item(unit, rows, st.sink.local_grad, entry, st.step))

    def _start_rank(self, unit: FactorUnit, rep: str, rows: List[Rows], rows_by_rank: Optional[RowCounts],
                    entry: ParamReport, st: _Step) -> Optional[Finish]:
        """The unit's rank-r payload: in the rank bucket (`_send_rank_bucket`: r rows on every rank),
        or with ``adaptive_tolerance`` (its row count differs by rank) an all-gather of its own."""
        payload = self.rank_codec.encode(unit, rows, st.sink.local_grad, entry, st.step)
        if self.config.adaptive_tolerance is None:
            st.bucket.add(unit, payload, entry)
            return None
        handle = self.aggregator.all_gather(payload, name=f"dad.rank.{unit.name}")
        entry.add_traffic(handle.traffic)
        return self._write_products(st, [unit], lambda scale: [
            self.rank_codec.decode(unit, self.state.note(torch.cat(handle.wait())), scale)])

    def _agree(self, unit: FactorUnit, ok: bool, counts: List[int]) -> Tuple[List[List[int]], Traffic]:
        """Exchange every rank's row counts and first-step check; returns the counts by rank."""
        agg = self.aggregator
        meta = torch.tensor([unit.index, int(ok)] + counts, dtype=torch.int64, device=self.device)
        handle = agg.all_gather(meta, name=f"dad.meta.{unit.name}", first_dims=[meta.numel()] * agg.world_size)
        metas = handle.wait()
        if any(int(t[0]) != unit.index for t in metas):
            raise RuntimeError(f"ranks disagree on the exchange order at {unit.name!r}: "
                               f"{[int(t[0]) for t in metas]}")
        passed, rows_by_rank = [bool(int(t[1])) for t in metas], [[int(v) for v in t[2:]] for t in metas]
        if not all(passed):
            unit.set_dense_only(True)
            if agg.rank == 0:
                log.warning("dAD: %s; it goes dense from now on", why_factors_fail(unit.name, passed, rows_by_rank))
        return rows_by_rank, handle.traffic

    # -- the shared buckets of the rank routes ------------------------------------------------------
    def _send_shared(self, st: _Step) -> Finish:
        """The rank-r all-reduce route's bucket (`RankAllReduceCodec.start`)."""
        items = st.shared.take()
        return self._write_products(st, [unit for unit, *_ in items],
                                    self.rank_allreduce.start(items, self.aggregator, self.state.note))

    def _send_rank_bucket(self, st: _Step) -> Finish:
        """One all-gather for the rank-r payloads of several units (fewer, larger collectives)."""
        items = st.bucket.take()
        handle, decoded = self.rank_codec.gather(self.aggregator, [(unit, payload) for unit, payload, _ in items],
                                                 f"dad.rank.{items[0][0].name}", self.state.note)
        share_traffic([entry for _, _, entry in items], handle.traffic, [payload.numel() for _, payload, _ in items])
        overlapped = not st.window.flush.is_set()  # sent while backward still runs?
        for _, _, entry in items:
            entry.overlapped = overlapped
        return self._write_products(st, [unit for unit, _, _ in items], decoded)

    @staticmethod
    def _write_products(st: _Step, units: List[FactorUnit], decoded: Callable[[float], list]) -> Finish:
        """What waits for a rank route's batch and writes each unit's ``left @ right``."""
        sink, scale = st.sink, st.scale

        def finish() -> None:
            for unit, factors in zip(units, decoded(scale)):
                sink.write_product(unit.param, *factors)

        return finish


def _rederive_priors(unit: FactorUnit, rows: List[Rows], window: StepWindow) -> None:
    """After a restart (``.grad`` changed between micro-steps), the prior of each of the unit's
    parameters: read at the restart where it was (exact), else what ``.grad`` holds beyond the
    rows kept (a local rebuild, so round-off of this rank's own)."""
    known = window.restart_priors(unit)
    for q in unit.params:
        if id(q) in known:
            if known[id(q)] is None:
                window.priors.pop(id(q), None)
            else:
                window.priors[id(q)] = known[id(q)]
    if all(id(q) in known for q in unit.params):
        return
    cdt = compute_dtype(unit.param)
    for q, local in rebuild_unit(unit, rows, cdt).items():
        if id(q) in known:
            continue
        if q.grad is None:
            window.priors.pop(id(q), None)
        else:
            window.priors[id(q)] = q.grad.detach().to(cdt) - local

