"""The exchanger: one step's collectives, unit by unit, in an order every rank shares.

Units go in reverse registration order (the order backward finishes them). For each unit, when
its weight and biases are final (`StepWindow.ready`): the router's decision, a size exchange if
the route needs agreed row counts (with the first-step check riding along), then its codec's
collective: one all-gather of exact factors, or a place in the rank-r bucket (one all-gather per
``bucket_cap_mb``), or a place in the dense buckets (`codecs.dense.DenseBuckets`: a full bucket is
all-reduced at once, the last one when the last unit is routed). The rebuild of one unit overlaps
the next unit's collective, and collectives started before backward ends overlap the rest of
backward. When backward is over (`StepWindow.flush`), the parameters that are always dense
(norms, excluded parameters) follow in the last buckets, and the step waits for every bucket.

Costs per weight (m x n), S ranks, N local rows: exact factors gather ``N (m+n)`` numbers per rank
and rebuild with one ``S N m n`` matmul; rank-r factors gather ``r (m+n)`` per rank and rebuild with
one ``S r m n`` matmul; dense buckets move ``2 (S-1)/S m n`` like all-reduce.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from dad_integrations.comm.aggregator import FactorAggregator, Traffic, ring_allreduce_bytes
from dad_integrations.exchange.checks import factors_rebuild_local_grad
from dad_integrations.codecs.dense import DenseBuckets, bucket_dtype
from dad_integrations.codecs.exact import ExactCodec, local_rebuild
from dad_integrations.codecs.finite import finite_flag
from dad_integrations.codecs.rank import RankBucket, RankCodec, WarmStart
from dad_integrations.codecs.rank_allreduce import AllReduceBucket, RankAllReduceCodec
from dad_integrations.config import DADConfig
from dad_integrations.codecs.error_feedback import error_feedback_for
from dad_integrations.capture.layers import Rows, compute_dtype, concat_rows
from dad_integrations.report import ParamReport, StepReport
from dad_integrations.routing.router import Route, RowCounts, UnitShape, RouteContext, UnitEvidence, route
from dad_integrations.capture.sink import GradSink
from dad_integrations.routing.link import agree_max, probe_link
from dad_integrations.routing.trial import RouteTrial, next_refresh, refresh_due
from dad_integrations.routing.timing import StepTiming, build_timing
from dad_integrations.capture.units import FactorUnit, SyncPlan
from dad_integrations.exchange.window import StepWindow

log = logging.getLogger(__name__)

Finish = Callable[[], None]


class StepClosed(RuntimeError):
    """The synchroniser was closed while a step was in flight."""


class Exchanger:
    """Runs the collectives of each step; holds what carries over between steps (agreed row counts,
    warm starts and error-feedback residuals of the rank codec)."""

    def __init__(self, plan: SyncPlan, aggregator: FactorAggregator, config: DADConfig,
                 wire_dtype: Optional[torch.dtype], device: torch.device):
        self.plan = plan
        self.aggregator = aggregator
        self.config = config
        self.wire_dtype = wire_dtype
        self.device = device
        self.exact = ExactCodec(wire_dtype, device)
        self.memory = error_feedback_for(config)
        self.warm = WarmStart(config.warm_start)
        lossy = config.rank is not None
        self.rank = RankCodec(config, wire_dtype, self.memory, self.warm) if lossy else None
        self.rank_allreduce = RankAllReduceCodec(config, wire_dtype, self.memory) if lossy else None
        self.last_rows: Dict[int, RowCounts] = {}  # unit index -> row counts of its last size exchange
        self.last_route: Dict[int, str] = {}       # unit index -> representation of its last step
        self.closed = False
        self._finite = True  # every synchronised result of the step so far is finite
        # one dtype for every dense bucket, whatever goes dense in a step (as one call over all of them)
        self.dense_dtype = bucket_dtype([q for u in plan.units for q in u.params] + [q for _, q in plan.dense],
                                        wire_dtype) or torch.float32
        # objective "time": the agreed link and compute models (measured at attach: a collective),
        # timed in the dtype the rank codecs compute in (fp32 for fp16/bf16 weights)
        self.timing: Optional[StepTiming] = (
            build_timing(config, {u.shape for u in plan.units}, aggregator, device,
                         dtype=compute_dtype(plan.units[0].param)) if plan.units else None)
        # on a measured link, routes that compress are checked against all-dense on the job's steps
        self.trial: Optional[RouteTrial] = (
            RouteTrial(config.route_trial_steps)
            if self.timing is not None and config.link is None and config.mode == "auto" else None)
        self.clock: Callable[[], float] = time.perf_counter  # the end of a step's span (`StepClock`)
        self._saved: Dict[int, float] = {}  # unit index -> predicted seconds its route saves (by time)

    def refresh_due(self, step: int) -> bool:
        """Whether step ``step`` chooses every route again (objective ``"time"``): every
        ``route_refresh_steps``, and when the lossless steps end (not step 0, which exchanges
        every unit's sizes anyway)."""
        return self.timing is not None and refresh_due(step, self.config.route_refresh_steps,
                                                       self.config.lossless_steps)

    def _held_route(self, unit: FactorUnit, step: int, verify: bool) -> Optional[str]:
        """By time, a unit keeps the route of the last refresh until the next (the models may have
        changed in between: routes change together, at a refresh, on every rank)."""
        if self.timing is None or verify or unit.dense_only:
            return None
        arm = self.trial.arm(step) if self.trial is not None else None
        if arm is not None:  # a route trial's step: all dense, or the routes it tries
            return "dense" if arm == "dense" else self.trial.routes.get(unit.index, "dense")
        if self.refresh_due(step):
            return None
        held = self.last_route.get(unit.index)
        return None if held == "exact" and unit.rows_unused else held  # exact needs its rows

    def dense_for_sure(self, unit: FactorUnit, step: int, verify: bool) -> bool:
        """Whether ``unit`` goes through the dense buckets in step ``step`` whatever its rows say: a
        held dense route (objective "time", between refreshes) or dense for good. Such a step needs
        none of the unit's rows, priors or restart marks (the all-reduce carries what ``.grad``
        holds), so the hooks skip that bookkeeping, and routing it needs no early wake-up."""
        return not verify and (unit.dense_only or self._held_route(unit, step, verify) == "dense")

    def _await(self, window: StepWindow, i: int, sure: List[bool], dense: DenseBuckets) -> None:
        """Wait until unit ``i`` is ready. Units sure to go dense that do not fill the open dense
        bucket need nothing done before the unit that fills it: wait for that one first (then most
        of those before it are ready too), so that the worker wakes about once per bucket, not once
        per unit (each wake takes the GIL from the autograd thread). Order and results are
        unchanged: every unit is still routed in exchange order, once it is ready."""
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

    def set_link(self, link) -> None:
        """Route by ``link`` (a `link.LinkModel`, the same on every rank) from the next refresh on."""
        if self.timing is not None:
            self.timing = dataclasses.replace(self.timing, link=link)

    def _prepare_refresh(self, next_step: int) -> None:
        """Before a refresh step: measure the link again (where it is not stated) and capture every
        unit's rows in that step, so that exact factors are a candidate again. Before a route
        trial's step on the routes it tries: capture the rows of the units it sends by exact
        factors (its dense steps switched capture off)."""
        arm = self.trial.arm(next_step) if self.trial is not None else None
        if arm == "routes":
            self._use_rows(i for i, rep in self.trial.routes.items() if rep == "exact")
        elif arm == "dense":
            self._drop_rows()
        if not self.refresh_due(next_step):
            return
        if self.trial is not None:
            self.trial.stop_watching()
        if self.config.link is None:
            self.set_link(probe_link(self.aggregator, self.device, kinds=("all_reduce", "all_gather")))
        self._use_rows(u.index for u in self.plan.units)

    def _drop_rows(self) -> None:
        """Every unit goes dense next step: capture nothing (a step that costs what DDP's does)."""
        for u in self.plan.units:
            if not u.rows_unused and not u.dense_only:
                u.stop_using_rows()

    def _use_rows(self, indices) -> None:
        """Capture the rows of the units of ``indices`` again (where some route can use them)."""
        wanted = set(indices)
        for u in self.plan.units:
            if u.index in wanted and u.rows_unused and not u.dense_only:
                u.rows_unused = False
                u.update_capture()

    def _next_refresh(self, step: int) -> int:
        """The first step after ``step`` that chooses every route again."""
        return next_refresh(step, self.config.route_refresh_steps, self.config.lossless_steps)

    def _run_trial(self, step: int, seconds: Optional[float]) -> None:
        """End of step ``step`` (``seconds``: its span on this rank): start a route trial after
        routes were chosen anew, judge one, or watch the last decision (`route_trial`)."""
        trial = self.trial
        if trial is None:
            return
        if not trial.active and (step == 0 or self.refresh_due(step)):
            compressed = [u.index for u in self.plan.units if self.last_route.get(u.index, "dense") != "dense"]
            if compressed and trial.fits(step, self._next_refresh(step)):
                trial.begin(step, {u.index: self.last_route.get(u.index, "dense") for u in self.plan.units},
                            sum(self._saved.get(i, 0.0) for i in compressed))
            return

        def agree(values):
            return agree_max(self.aggregator, values, self.device, name="dad.trial.agree")

        outcome = trial.end_of_step(step, seconds, agree, self._next_refresh(step))
        if outcome is None:
            return
        self.timing = dataclasses.replace(self.timing, overhead_s=outcome.overhead_s)
        for u in self.plan.units:  # what the next steps take until the next refresh
            self.last_route[u.index] = trial.routes.get(u.index, "dense") if outcome.kept else "dense"
        if outcome.kept:  # exact factors need their rows from the next step on
            self._use_rows(i for i, rep in trial.routes.items() if rep == "exact")
        else:
            self._drop_rows()
        if self.aggregator.rank == 0:
            log.info("dAD route trial after step %d (%s): %s; overhead per compressed weight now %.2f ms",
                     outcome.step, outcome.cause, outcome.describe(), outcome.overhead_s * 1e3)

    def run(self, window: StepWindow, sink: GradSink, *, step: int, verify: bool, prescale: float,
            postscale: Optional[float]) -> StepReport:
        """Exchange every unit and the dense buckets of one step; returns its report. ``window.started``
        (`route_trial.StepClock`) to the end of this call is the step's span a route trial times."""
        s = self.aggregator.world_size
        scale = prescale * (1.0 / s if postscale is None else postscale)
        report: Dict[str, ParamReport] = {}

        def account(name: str, p: Optional[nn.Parameter], traffic: Traffic) -> None:
            if name not in report:
                shape = tuple(p.shape) if p is not None else ()
                ar = ring_allreduce_bytes(p.numel() * p.element_size(), s) if p is not None else 0.0
                report[name] = ParamReport(name, "dense" if p is not None else "overhead", shape,
                                           allreduce_bytes=ar)
            report[name].add_traffic(traffic)

        dense = DenseBuckets(self.aggregator, sink, bucket_cap_mb=self.config.bucket_cap_mb, dtype=self.dense_dtype,
                             account=account, prescale=prescale, postscale=postscale,
                             early=lambda: not window.flush.is_set())
        self._finite = True
        bucket = RankBucket(self.config.bucket_cap_mb * 2 ** 20)
        shared = AllReduceBucket(self.config.bucket_cap_mb * 2 ** 20)
        previous: List[Finish] = []
        sure = [self.dense_for_sure(u, step, verify) for u in self.plan.units]
        for i, unit in enumerate(self.plan.units):
            self._await(window, i, sure, dense)
            self._check_open()
            current: List[Finish] = []
            finish = self._unit(unit, window, sink, scale, step, verify, report, dense, bucket, shared)
            if finish is not None:
                current.append(finish)
            while bucket.ready_to_send():
                current.append(self._send_rank_bucket(bucket, window, sink, scale))
            if shared.full():
                current.append(self.rank_allreduce.start(shared.take(), self.aggregator, sink, scale, self._note))
            for f in previous:
                f()  # rebuild the last units while this one's collective runs
            previous = current
        while bucket.items:
            previous.append(self._send_rank_bucket(bucket, window, sink, scale))
        if shared.items:
            previous.append(self.rank_allreduce.start(shared.take(), self.aggregator, sink, scale, self._note))
        if not self.plan.dense:
            dense.send()  # every unit is routed: the last units' bucket need not wait for backward's end
        # else the always-dense parameters (norms, biases of dense layers) join it when backward
        # ends, which follows the last unit closely: one collective fewer (a gloo call's latency,
        # 0.5-2.5 ms here) instead of a small bucket of their own
        for f in previous:
            f()
        window.flush.wait()  # backward is over: every dense gradient is final
        self._check_open()
        for name, q in self.plan.dense:
            dense.add(name, q)
        # whether the results are finite only decides whether rank-route state is kept
        finite = dense.finish(check_finite=self._state_pending())
        for name, entry in report.items():
            if entry.representation == "dense":
                entry.overlapped = name in dense.overlapped  # its all-reduce began during backward
        keep = finite and self._finite
        if self.rank is not None:
            self.rank.commit(keep=keep)
            self.rank_allreduce.commit(keep=keep)
        self.memory.settle_flushed(sent=keep)  # a skipped step: the residuals it flushed are still owed
        self._close_step(window, step)
        return StepReport(step, s, list(report.values()))

    def _close_step(self, window: StepWindow, step: int) -> None:
        """The step's exchange is over: its span to the route trial, the next step's preparation."""
        started = getattr(window, "started", None)
        self._run_trial(step, None if started is None else self.clock() - started)
        self._prepare_refresh(step + 1)

    def native_dense(self, step: int, verify: bool) -> bool:
        """Whether step ``step`` can go by the engine's own bucket all-reduce, untouched (DDP's
        buckets, `ddp_hook`): every unit dense whatever its rows (held dense between refreshes, a
        route trial's dense step, or dense for good) and nothing owed to be flushed. Such a step is
        what DDP's is, with no per-parameter packing on dAD's worker (`run_native`)."""
        if verify or self.memory.flushed or not all(self.dense_for_sure(u, step, verify) for u in self.plan.units):
            return False
        if self._holds_residuals(step):
            return True
        return not (self.memory.enabled and any(self.memory.dense(u.name) is not None for u in self.plan.units))

    def _holds_residuals(self, step: int) -> bool:
        """A route trial's dense step (`RouteTrial.holds_residuals`): residuals wait, and the step
        goes as a steady dense step does (DDP's own buckets, `native_dense`)."""
        return self.trial is not None and self.trial.holds_residuals(step)

    def start_native(self, buffer: torch.Tensor, prescale: float):
        """Put one of DDP's buckets on the wire as it is (`native_dense`), in the dense buckets' wire
        dtype; returns what `run_native` finishes."""
        send = buffer if buffer.dtype == self.dense_dtype else buffer.to(self.dense_dtype)
        if prescale != 1.0:
            send.mul_(prescale)  # in place, as DDP's own hook divides its bucket
        return buffer, send, self.aggregator.all_reduce(send, name="dad.dense.native", op="sum")

    def run_native(self, window: StepWindow, buckets: List[tuple], names: Dict[int, str], *, step: int,
                   postscale: Optional[float]) -> StepReport:
        """Finish a step of DDP's own buckets (`start_native`): wait, scale in place, report."""
        s = self.aggregator.world_size
        scale = 1.0 / s if postscale is None else postscale
        report: List[ParamReport] = []
        for buffer, send, handle, params in buckets:
            total = handle.wait()
            if total is buffer:
                buffer.mul_(scale)
            else:
                torch.mul(total, scale, out=total)
                buffer.copy_(total)
            numel = max(buffer.numel(), 1)
            for p in params:
                entry = ParamReport(names.get(id(p), "?"), "dense", tuple(p.shape), overlapped=True,
                                    allreduce_bytes=ring_allreduce_bytes(p.numel() * p.element_size(), s))
                entry.add_traffic(handle.traffic.share(p.numel() / numel))
                report.append(entry)
        for u in self.plan.units:  # rows a forward still captured (after the checked first step) are
            window.take_rows(u)    # of no use: dense until the next refresh, capture off, as `_unit` does
        self._drop_rows()
        self._close_step(window, step)
        return StepReport(step, s, report)

    def _state_pending(self) -> bool:
        """Whether a non-finite step would drop something: this step's rank-route state (warm
        starts, residuals) or residuals it flushed."""
        return bool(self.memory.flushed) or any(c is not None and c.has_pending for c in (self.rank, self.rank_allreduce))

    def _note(self, tensor: torch.Tensor) -> torch.Tensor:
        """Remember whether a synchronised result is finite (the same on every rank: all see it)."""
        if self._finite and self.config.rank is not None:
            self._finite = bool(finite_flag(tensor))
        return tensor

    def _check_open(self) -> None:
        if self.closed:
            raise StepClosed("dAD synchroniser closed with a step in flight")

    def _unit(self, unit: FactorUnit, window: StepWindow, sink: GradSink, scale: float, step: int,
              verify: bool, report: Dict[str, ParamReport], dense: DenseBuckets,
              bucket: RankBucket, shared: AllReduceBucket) -> Optional[Finish]:
        """Route one unit and start its collective; returns what finishes it (or None)."""
        agg, cfg, p = self.aggregator, self.config, unit.param
        s = agg.world_size
        m, n = unit.shape
        overlapped = not window.flush.is_set()
        rows = [concat_rows(pairs, use.kind, (m, n), p, use.block) for pairs, use in zip(window.take_rows(unit), unit.uses)]
        if unit.index in window.restarts:
            _rederive_priors(unit, rows, window)
        counts = [int(r[0].shape[0]) for r in rows]
        wire = self.wire_dtype or p.dtype
        shape = UnitShape(tuple(unit.kinds), (m, n), unit.bias_numel, p.dtype, unit.blocks)
        ctx = RouteContext(cfg, s, wire, step=step, first_step=verify, timing=self.timing)
        sticky = self._held_route(unit, step, verify)
        if sticky is not None:  # by time, between refreshes: the route chosen at the last one
            decision = Route(sticky, sticky == "exact")
        else:
            decision = route(dataclasses.replace(ctx, refresh=self.refresh_due(step)), shape,
                             UnitEvidence(dense_only=unit.dense_only, last_rows=self.last_rows.get(unit.index)))
        traffic = Traffic()
        rows_by_rank = None
        if decision.exchange_sizes:
            ok = unit.dense_only or not verify or not unit.has_factors or factors_rebuild_local_grad(unit, rows, sink)
            rows_by_rank, traffic = self._agree(unit, ok, counts)
            self.last_rows[unit.index] = rows_by_rank
            if sticky is None or unit.dense_only:
                decision = route(ctx, shape, UnitEvidence(dense_only=unit.dense_only, rows_by_rank=rows_by_rank,
                                                          current=self.last_route.get(unit.index)))
        if sticky is None:
            self._saved[unit.index] = decision.saved_s
        rep = decision.representation
        flush = not self._holds_residuals(step) and self._flush_residual(unit, rep, sink)
        self.last_route[unit.index] = rep
        if flush:
            rep = "dense"  # it carries the residual this step; its route applies from the next

        entry = ParamReport(unit.name, rep, tuple(p.shape), rows=sum(counts),
                            max_rows=max(sum(r) for r in rows_by_rank) if rows_by_rank else 0,
                            allreduce_bytes=ring_allreduce_bytes(p.numel() * p.element_size(), s),
                            overlapped=overlapped)
        report[unit.name] = entry
        for b in unit.biases:
            report[b.name] = ParamReport(b.name, rep if rep == "exact" else "dense", tuple(b.param.shape),
                                         allreduce_bytes=ring_allreduce_bytes(
                                             b.param.numel() * b.param.element_size(), s))
        finish = None
        if rep == "dense":
            dense.add(unit.name, p)
            for b in unit.biases:
                dense.add(b.name, b.param)
        elif rep == "exact":
            handle = agg.all_gather(self.exact.encode(unit, rows), name=f"dad.exact.{unit.name}",
                                    first_dims=self.exact.sizes(unit, rows_by_rank))
            traffic = traffic + handle.traffic

            def finish() -> None:
                grads = self.exact.decode(unit, handle.wait(), rows_by_rank, scale)
                if grads is None:
                    sink.write_unused(p)
                    return
                for q, g in grads.items():
                    sink.write(q, self._note(g))
        elif rep == "rank_allreduce":
            for b in unit.biases:
                dense.add(b.name, b.param)
            m_s = self.rank_allreduce.local(unit, rows, sink.local_grad, entry)
            shared.add((unit, m_s, self.rank_allreduce.initial_q(unit, step), entry))
        else:
            for b in unit.biases:
                dense.add(b.name, b.param)
            payload = self.rank.encode(unit, rows, sink.local_grad, entry, step)
            if cfg.adaptive_tolerance is None:  # r rows on every rank: it can share a bucket's all-gather
                bucket.add(unit, payload, entry)
            else:
                handle = agg.all_gather(payload, name=f"dad.rank.{unit.name}")
                traffic = traffic + handle.traffic

                def finish() -> None:
                    sink.write_product(p, *self.rank.decode(unit, self._note(torch.cat(handle.wait())), scale))
        if (rep in ("rank", "rank_allreduce") and entry.method == "dense" and not decision.exchange_sizes
                and not unit.rows_unused):
            # a rank route with no size exchange is the unit's route for good (mode rank; auto's
            # sticky prediction), and it reduces from the dense gradient: its rows are of no use,
            # so stop capturing them (saves the hooks' work; reports show 0 rows from then on)
            unit.stop_using_rows()
        elif (self.last_route[unit.index] == "dense" and self.timing is not None and not unit.rows_unused
              and not verify):
            # routed by time and dense until the next refresh: capture nothing, so that a step whose
            # every unit goes dense costs what DDP's does (rows come back before the refresh). Not a
            # unit only flushing its residual through the dense buckets: its route may be exact
            unit.stop_using_rows()
        entry.add_traffic(traffic)
        return finish

    def _flush_residual(self, unit: FactorUnit, rep: str, sink: GradSink) -> bool:
        """A unit off the rank routes with a residual left (`ErrorFeedback.flush`): add it to the
        local gradient, so that this dense step sends it; returns whether it did."""
        if rep in ("rank", "rank_allreduce"):
            return False
        residual = self.memory.flush(unit.name)
        if residual is None:
            return False
        sink.add_local(unit.param, residual)
        return True

    def _agree(self, unit: FactorUnit, ok: bool, counts: List[int]) -> Tuple[List[List[int]], Traffic]:
        """Exchange every rank's row counts and first-step check; returns the counts by rank."""
        agg = self.aggregator
        meta = torch.tensor([unit.index, int(ok)] + counts, dtype=torch.int64, device=self.device)
        handle = agg.all_gather(meta, name=f"dad.meta.{unit.name}", first_dims=[meta.numel()] * agg.world_size)
        metas = handle.wait()
        if any(int(t[0]) != unit.index for t in metas):
            raise RuntimeError(f"ranks disagree on the exchange order at {unit.name!r}: "
                               f"{[int(t[0]) for t in metas]}")
        if not all(int(t[1]) for t in metas):
            unit.set_dense_only(True)
            if agg.rank == 0:
                log.warning("dAD: the factors of %r do not rebuild its local gradient (is the weight used "
                            "outside its layers, or changed by a gradient hook?); it goes dense from now on",
                            unit.name)
        return [[int(v) for v in t[2:]] for t in metas], handle.traffic

    def _send_rank_bucket(self, bucket: RankBucket, window: StepWindow, sink: GradSink, scale: float) -> Finish:
        """One all-gather for the rank-r payloads of several units (fewer, larger collectives)."""
        items = bucket.take()
        flat = torch.cat([payload.reshape(-1) for _, payload, _ in items])
        agg = self.aggregator
        handle = agg.all_gather(flat, name=f"dad.rank.{items[0][0].name}", first_dims=[flat.numel()] * agg.world_size)
        overlapped = not window.flush.is_set()  # sent while backward still runs?
        for _, payload, entry in items:
            entry.add_traffic(handle.traffic.share(payload.numel() / flat.numel()))
            entry.overlapped = overlapped

        def finish() -> None:
            gathered = [self._note(g) for g in handle.wait()]
            offset = 0
            for unit, payload, _ in items:
                k = payload.numel()
                stacked = torch.cat([g[offset:offset + k].view(payload.shape) for g in gathered])
                sink.write_product(unit.param, *self.rank.decode(unit, stacked, scale))
                offset += k

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
    for q, local in local_rebuild(unit, rows, cdt).items():
        if id(q) in known:
            continue
        if q.grad is None:
            window.priors.pop(id(q), None)
        else:
            window.priors[id(q)] = q.grad.detach().to(cdt) - local

