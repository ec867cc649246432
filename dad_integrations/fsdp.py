"""dAD under FSDP2 (``torch.distributed.fsdp.fully_shard``): the adapter.

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    sync = enable_dad_fsdp(model, {"mode": "exact"})   # before the first forward
    loss.backward()          # factor-covered weights skip FSDP2's reduce-scatter
    optimizer.step()         # every rank's sharded .grad holds its shard of the average
    sync.last_step_report()  # bytes, beside what FSDP2's reduce-scatter would move

FSDP2 hands each parameter group's flat, rank-chunked gradient buffers to a ``ReduceScatter``
(`FSDPModule.set_custom_reduce_scatter`; layout, scaling and call order in ``docs/internals/fsdp2_notes.md``).
`DADReduceScatter` fills this rank's output chunk from the core's pieces:

* `codecs.sharded_exact`: the algebra and its collectives (rows ``a:b`` of the average from exact
  factors; bytes per rank ``(S-1) N n + (S-1)/S N m`` against the reduce-scatter's ``(S-1)/S m n``);
* `codecs.sharded_rank`: the rank-r routes (every ``Q_s`` all-gathered and rows ``a:b`` of every
  ``P_s`` by all-to-all, ``(S-1) r (n + m/S)``; or PowerSGD's all-reduced P and Q), with error
  feedback (one unsharded residual per rank-routed weight and rank, or its rank-q part with
  ``error_feedback_rank``) and warm starts, kept at the end
  of each backward only if every rank's gradients were finite;
* `router.route(..., sharded=True)`: per weight, factors, a rank route or FSDP's reduce-scatter (``auto``);
* `sharded_trial.ShardedTrial`: by time on a measured link, route trials against all dense (a step's
  span: from the root's forward, a forward pre-hook, to a callback queued on autograd's engine at the
  step's first reduce-scatter, which runs after FSDP's own final callback, queued at backward's start;
  the ranks agree there). Dense steps and all dense decided: every weight by FSDP's reduce-scatter,
  capture off (a trial's dense steps hold the residuals; all dense decided flushes them into it);
* `sink.ShardSink`: FSDP's buffers (local gradients read as matrix views, shards and padding written);
* `checks.factors_rebuild_local_grad`: the first call's check; `capture.CommittedRows`: rows are
  sent only once autograd has added them to the unsharded gradient (FSDP's post-backward can run
  before the weight's ``AccumulateGrad``).

Weights are handled as their matrix view ``(shape[0], prod(shape[1:]))`` (`FactorUnit.shape`):
FSDP2's ``Shard(0)`` cuts dim 0, the view's rows, so a shard of a conv's 4-D weight is a row block
of its matrix. Units without uses (PowerSGD's coverage floor: raw ``nn.Parameter``s, convolutions
no kind captures) have no rows: no size exchange, no first-call check, and their routes are FSDP's
reduce-scatter or a rank route from the dense local gradient. Linear uses over row blocks (MHA's
packed ``in_proj_weight`` and its q/k/v slices) take sharded exact factors as whole-row uses do
(`codecs.sharded_exact`: each block's columns land in the ranks whose rows they are).

Here: finding FSDP's groups and the parameters each call reduces, FSDP's scaling (results are
scaled as its reduce-scatter would scale them; FSDP then post-divides, casts and accumulates into
the sharded ``.grad``), FSDP's own reduce-scatter for the rest (on a compacted buffer, with its op),
and the report. No-sync micro-steps need nothing: the hook is not called, the captures keep rows.

Limits (each falls back to FSDP's own reduce-scatter, logged once): HSDP, ``Shard(d>0)``, all-gather
extensions, TP (DTensor) parameters, several parameter groups per module, CPU offload. An adaptive
rank (``adaptive_tolerance``) is refused, and so is FSDP1 (`fsdp_detect`: why, and to use FSDP2).
"""
from __future__ import annotations

import functools
import logging
import math
from typing import Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.distributed_c10d import ReduceOp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (DefaultAllocMixin, DefaultReduceScatter,
                                                                    _get_gradient_divide_factors)
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

from dad_integrations.engines import banner
from dad_integrations.comm.aggregator import Traffic
from dad_integrations.capture.committed import CommittedRows
from dad_integrations.capture.hooks import ForwardStartHook
from dad_integrations.exchange.checks import agree_factors_rebuild
from dad_integrations.codecs.sharded_exact import ShardedExactCodec, exchange_row_counts
from dad_integrations.codecs.sharded_rank import ROUTES as RANK_ROUTES, RankItem, ShardedRankCodec, load_rank_route_state
from dad_integrations.config import WIRE_DTYPES, DADConfig
from dad_integrations.codecs.error_feedback import sharded_residual_note
from dad_integrations.engines.fsdp_detect import reject_fsdp1
from dad_integrations.capture.layers import concat_rows
from dad_integrations.report import ShardedParamReport, ShardedStepReport
from dad_integrations.routing.router import UnitShape, RouteContext, UnitEvidence, route, sharded_needs_counts
from dad_integrations.routing.sharded_trial import ShardedTrial, TimedRoutes, agree_on
from dad_integrations.capture.sink import ShardSink, ShardSlot
from dad_integrations.comm.torch_distributed import TorchDistributedAggregator
from dad_integrations.capture.units import FactorUnit, build_plan

log = logging.getLogger(__name__)

FSDP_STATE_VERSION = 1

__all__ = ["enable_dad_fsdp", "FSDPDADSynchronizer", "DADReduceScatter", "ShardedParamReport",
           "ShardedStepReport"]


def enable_dad_fsdp(model: nn.Module, config: Union[DADConfig, Mapping, None] = None) -> "FSDPDADSynchronizer":
    """Replace FSDP2's gradient reduce-scatter by dAD for every weight factors cover.

    Call on every rank after ``fully_shard`` and before the first forward; returns the synchroniser
    (``last_step_report()``, ``close()``).
    """
    return FSDPDADSynchronizer(model, config)


class DADReduceScatter(DefaultAllocMixin, ReduceScatter):
    """The ``ReduceScatter`` installed on one FSDP parameter group."""

    def __init__(self, sync: "FSDPDADSynchronizer", param_group):
        self.sync, self.param_group = sync, param_group

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        self.sync._reduce(self.param_group, output_tensor, input_tensor, group, op)


class FSDPDADSynchronizer(TimedRoutes):
    """dAD driven from FSDP2's reduce-scatter (see the module doc)."""

    def __init__(self, model: nn.Module, config: Union[DADConfig, Mapping, None] = None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("enable_dad_fsdp needs an initialised default process group")
        self.config = DADConfig() if config is None else DADConfig.from_dict(config)
        if self.config.adaptive_tolerance is not None:
            raise ValueError("enable_dad_fsdp: 'adaptive_tolerance' is not supported under FSDP2 (the sharded rank "
                             "routes exchange equal blocks of r components from every rank); leave it unset")
        self._wire = WIRE_DTYPES[self.config.wire_dtype]
        # rank routes' error feedback and warm starts (None without a rank)
        self.rank_codec = ShardedRankCodec(self.config, self._wire) if self.config.rank is not None else None
        self._rank_end_queued = False
        self._logged: set = set()
        self._closed = False
        self._report: Optional[ShardedStepReport] = None
        self._task: Optional[int] = None
        self._aggregators: Dict[int, TorchDistributedAggregator] = {}
        self._with_grad: Dict[int, list] = {}  # per group: the FSDPParams its post_backward reduces
        self._verified: set = set()            # groups whose first call was checked
        reject_fsdp1(model, "enable_dad_fsdp")
        # one entry per group: `fully_shard([norm, lm_head])` (Accelerate's tail) makes several modules
        # share one FSDP state and group, which must be hooked once
        groups, seen = [], set()
        for m in model.modules():
            for pg in (self._groups_of(m) if isinstance(m, FSDPModule) else []):
                if id(pg) not in seen:
                    seen.add(id(pg))
                    groups.append((m, pg))
        if not groups:
            raise ValueError("enable_dad_fsdp: no fully_shard-ed module (with a 1-D shard mesh) in the model")
        self._fp_of = {id(fp.sharded_param): (pg, fp) for _, pg in groups for fp in pg.fsdp_params}
        self._names = {id(p): n for n, p in model.named_parameters()}
        self.plan = build_plan(model, self.config)
        # objective "time": the models, and route trials on a measured link (`sharded_trial`)
        self._trial = ShardedTrial(self.config, "dAD/FSDP2", log_decisions=dist.get_rank() == 0)
        self._trial_end: Optional[Callable[[], None]] = None  # a step's end outside backward
        self._unit_of: Dict[int, FactorUnit] = {}
        for unit in self.plan.units:
            reason = self._unsupported(unit.param)
            if reason is not None:
                self._log_once(f"{unit.name}: {reason}: FSDP's reduce-scatter kept")
                unit.set_dense_only(True)
                continue
            pg = self._fp_of[id(unit.param)][0]
            for b in list(unit.biases):
                if self._unsupported(b.param) is not None or self._fp_of[id(b.param)][0] is not pg:
                    self._log_once(f"{b.name}: not in its weight's FSDP group as a row block: dense")
                    unit.biases.remove(b)
            self._unit_of[id(unit.param)] = unit
        self._committed = CommittedRows(list(self._unit_of.values()))  # see the module doc's last paragraph
        units = list(self._unit_of.values())
        # matrix views (`FactorUnit.shape`): a conv's (C_out, C_in, k, k) weight is reduced as
        # (C_out, C_in k k), PowerSGD's view; FSDP2's Shard(0) cuts its rows
        note = sharded_residual_note(self.config, [u.shape for u in units], dist.get_world_size(),
                                     units[0].param.element_size() if units else 4)
        if note is not None and dist.get_rank() == 0:  # said once, at attach: memory the user did not expect
            log.warning("dAD/FSDP2: %s", note)
        if units:  # objective "time": the link and compute models, measured here by every rank together
            self._trial.start(units, TorchDistributedAggregator(), units[0].param.device)
        # a step's span for route trials starts at the root's forward (FSDP's all-gathers included)
        self._forward_hook = ForwardStartHook(model, self._trial.forward)
        self._installed = groups
        for module, pg in groups:
            self._install(module, pg)
        banner.announce("FSDP2", process_rank=dist.get_rank(), world_size=dist.get_world_size(),
                        mode=self.config.mode, rank=self.config.rank, objective=self.config.objective,
                        factor_weights=len(units), dense_params=banner.dense_count(model, units))

    # -- set-up -----------------------------------------------------------------------------------
    def _groups_of(self, module: FSDPModule) -> list:
        pgs = list(module._get_fsdp_state()._fsdp_param_groups)
        if len(pgs) > 1:
            self._log_once(f"{type(module).__name__} has {len(pgs)} parameter groups: FSDP's reduce-scatter kept")
            return []
        kept = [pg for pg in pgs if type(pg.mesh_info) is FSDPMeshInfo]  # not HSDP/replicate (subclasses)
        if len(kept) < len(pgs):
            self._log_once(f"{type(module).__name__}: HSDP/replicate mesh, FSDP's own reduction kept")
        return kept

    def _unsupported(self, p: torch.Tensor) -> Optional[str]:
        entry = self._fp_of.get(id(p))
        if entry is None:
            return "not sharded by a handled FSDP group"
        fp = entry[1]
        if fp.fsdp_placement.dim != 0:
            return f"sharded as {fp.fsdp_placement}, not a row block along dim 0"
        if getattr(fp, "is_dtensor", False):
            return "already a DTensor (tensor parallel)"
        if hasattr(fp.sharded_param._local_tensor, "fsdp_pre_all_gather"):
            return "has FSDP all-gather extensions"
        if getattr(fp, "offload_to_cpu", False):
            return "CPU offload (untested)"
        return None

    def _install(self, module: FSDPModule, pg) -> None:
        original = pg.post_backward  # bound method of the group's class

        def post_backward(*args, **kwargs):
            # what FSDP's post_backward is about to reduce (the hook is not told): FSDPParams with a
            # gradient, in the group's order, as `foreach_reduce` lays out its buffer
            if pg.reduce_grads:
                self._with_grad[id(pg)] = [
                    fp for fp in pg.fsdp_params if hasattr(fp, "_unsharded_param") and (
                        fp.unsharded_accumulated_grad is not None or fp.unsharded_param.grad is not None
                        or (pg.reduce_scatter_unused_params and fp.unsharded_param.requires_grad))]
            return original(*args, **kwargs)

        pg.post_backward = post_backward
        module.set_custom_reduce_scatter(DADReduceScatter(self, pg))

    def close(self) -> None:
        """Give the reductions back to FSDP and remove the capture hooks."""
        if self._closed:
            return
        self._closed = True
        self._forward_hook.remove()
        for module, pg in self._installed:
            pg.__dict__.pop("post_backward", None)
            module.set_custom_reduce_scatter(DefaultReduceScatter())
        for capture in self.plan.captures:
            capture.remove()
        self._committed.remove()

    def last_step_report(self) -> Optional[ShardedStepReport]:
        """The report of the latest backward that reduced gradients (None before the first)."""
        return self._report

    # -- state ------------------------------------------------------------------------------------
    @property
    def keeps_state(self) -> bool:
        """Whether `state_dict` holds anything between steps: only the rank routes do (error-feedback
        residuals, warm starts); exact factors and the reduce-scatter keep nothing."""
        return self.rank_codec is not None

    def state_dict(self) -> dict:
        """This rank's dAD state: the steps taken (``lossless_steps`` counts them) and, per
        rank-routed weight, its warm starts and residual. They differ across ranks: save per rank
        (`checkpoint.save_rank_state`)."""
        return {"version": FSDP_STATE_VERSION, "steps": self._report.step if self._report else 0,
                "rank_routes": self.rank_codec.state_dict() if self.rank_codec is not None else {}}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore `state_dict`'s state (tensors onto each weight's device and compute dtype); call
        it between steps. Raises, naming them, for weights this model does not have."""
        if state.get("version") != FSDP_STATE_VERSION:
            raise ValueError(f"dAD/FSDP2 state of version {state.get('version')!r}, expected {FSDP_STATE_VERSION}")
        load_rank_route_state(self.rank_codec, dict(state.get("rank_routes") or {}),
                              {u.name: u.param for u in self.plan.units})
        steps = int(state.get("steps", 0))
        # the next backward is step steps + 1 (as `_reduce` counts), and its report replaces this one
        self._report = ShardedStepReport(steps, dist.get_world_size()) if steps else None
        self._task = None
        self._trial.cancel()  # every rank loads alike: a trial in progress ends on all of them

    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.warning("dAD/FSDP2: %s", message)

    # -- the reduce-scatter -----------------------------------------------------------------------
    def _reduce(self, pg, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, op) -> None:
        self._reduce_call(pg, out, inp, group, op)
        end, self._trial_end = self._trial_end, None
        if end is not None:  # not inside a backward: this call is the step
            end()

    def _open_trial_step(self, step: int, group: dist.ProcessGroup, device: torch.device) -> None:
        """The step's first reduction: its span is timed to the end of its last one, where every
        rank agrees (`sharded_trial`): a callback queued on autograd's engine now runs after every
        group's reduce-scatter, FSDP's final callback (queued at backward's start) included."""
        if self._trial.trial is None or self._trial.step == step:
            return
        self._trial.open(step)
        agg = self._aggregators.setdefault(id(group), TorchDistributedAggregator(group))
        end = functools.partial(self._trial.end, step, agree_on(agg, device))
        if torch._C._current_graph_task_id() < 0:
            self._trial_end = end
        else:
            Variable._execution_engine.queue_callback(end)

    def _reduce_call(self, pg, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, op) -> None:
        S = group.size()
        task = torch._C._current_graph_task_id()  # every group's call of one backward shares it
        if self._report is None or task != self._task or task < 0:
            self._task = task
            self._report = ShardedStepReport(self._report.step + 1 if self._report else 1, S)
            if self.rank_codec is not None:  # (a backward that raised never ran the last step's end)
                self.rank_codec.start_step()
                self._rank_end_queued = False
        report = self._report
        step = report.step - 1  # 0-based, as the router counts
        self._open_trial_step(step, group, inp.device)
        if self.rank_codec is not None:
            self.rank_codec.note_local(inp)  # the step's finiteness, agreed when it ends
        slots = self._slots(pg, inp, S)
        if slots is None:
            self._log_once(f"group {pg._module_fqn or '<root>'}: could not map FSDP's buffer to its parameters; "
                           f"FSDP's reduce-scatter used for the whole group")
            whole = ShardSlot(f"{pg._module_fqn}.*", None, 0, inp.numel() // S, inp.numel() // S, (inp.numel(),))
            return self._dense([whole], ShardSink([], out, inp, S), group, op, report)
        predivide, scale = _scaling(pg, group, inp, op)
        sink = ShardSink(slots, out, inp, S, predivide)
        agg = self._aggregators.setdefault(id(group), TorchDistributedAggregator(group))
        units = [u for u in (self._unit_of.get(id(s.param)) for s in slots) if u is not None and not u.dense_only]
        if self._trial.dense(step):  # a route trial's dense step, or all dense decided: FSDP's reduce-scatter
            hold = self._trial.holds_residuals(step)
            for unit in units:
                for c in unit.uses:
                    self._committed.take(c)  # (capture is off from the step after the decision)
                if not hold:
                    self._flush_residual(unit, sink, agg, report)
            return self._dense(slots, sink, group, op, report)
        rows = {u.index: [concat_rows(self._committed.take(c), c.kind, u.shape, u.param, c.block)
                          for c in u.uses] for u in units}
        # units without uses (PowerSGD's floor: raw parameters, uncaptured convolutions) have no rows:
        # they take no part in the size exchange nor in the first call's check
        factored = [u for u in units if u.has_factors]
        counts: Dict[int, List[List[int]]] = {}
        if factored and sharded_needs_counts(self.config, report.step - 1):
            counts, traffic = exchange_row_counts(factored, rows, agg)
            report.params.append(_overhead("dad.fsdp.row_counts", sum(len(u.uses) for u in factored), traffic))
        if factored and self.config.verify_first_step and id(pg) not in self._verified:
            passed, failed, traffic = agree_factors_rebuild(factored, rows, sink, agg)
            report.params.append(_overhead("dad.fsdp.verify", len(passed) + len(failed), traffic))
            for unit in failed:
                self._log_once(f"{unit.name}: its factors do not rebuild its local gradient on some rank "
                               f"(a use outside the captured layers?): FSDP's reduce-scatter from now on")
                unit.set_dense_only(True)
            units = [u for u in units if not u.dense_only]
        self._verified.add(id(pg))
        # factors travel in FSDP's reduce dtype where the config names none, as the router counts
        # them and as the reduce-scatter and the rank routes send (not in the sharded parameters'
        # dtype: fp32 factors on the wire under a bf16 policy, counted as bf16 by auto)
        codec = ShardedExactCodec(self._wire or inp.dtype, inp.device)
        timing = self._trial.models(agg, inp.device, step) if units else None
        covered, ranked = set(), []
        for unit in units:
            biases = [b.param for b in unit.biases if sink.slot(b.param) is not None]
            # the matrix view; row blocks on non-linear uses keep a unit off sharded exact factors
            # (`costs.sharded_exact_covers`)
            shape = UnitShape(tuple(unit.kinds), unit.shape, sum(b.shape[0] for b in biases), inp.dtype, unit.blocks)
            decision = route(RouteContext(self.config, world_size=S, wire_dtype=self._wire, sharded=True, step=step, timing=timing), shape, UnitEvidence(rows_by_rank=counts.get(unit.index)))
            self._trial.note(unit, decision)
            if decision.representation in RANK_ROUTES:
                ranked.append(self.rank_codec.local(unit, rows[unit.index], sink.local_grad, decision.representation))
                continue  # exchanged together below; biases stay on FSDP's reduce-scatter
            if self._flush_residual(unit, sink, agg, report):
                continue  # its residual rides FSDP's reduce-scatter this step
            if decision.representation != "exact":
                continue  # FSDP's reduce-scatter moves no more bytes
            result = codec.exchange(unit, rows[unit.index], counts[unit.index], agg, scale)
            for p in [unit.param] + biases:
                sink.write(p, result.shards[p])
                covered.add(id(p))
                slot = sink.slot(p)
                report.params.append(ShardedParamReport.of_shard(slot.name, "exact", slot.shape, slot.numel, S,
                                                                 inp.element_size()))
            weight = report.params[-1 - len(biases)]  # the bytes go to the weight, biases ride free
            weight.rows = sum(left.shape[0] for left, _ in rows[unit.index])
            weight.max_rows, weight.method = max(sum(r) for r in counts[unit.index]), result.method
            weight.add_traffic(result.traffic)
        if ranked:
            self._rank_routes(ranked, sink, agg, scale, report, covered)
        self._dense([s for s in slots if id(s.param) not in covered], sink, group, op, report)

    def _flush_residual(self, unit: FactorUnit, sink: ShardSink, agg: TorchDistributedAggregator,
                        report: ShardedStepReport) -> bool:
        """A weight off the rank routes with an error-feedback residual left (its route changed:
        rows fell, or objective "time" chose again): add the residual to its local gradient in
        FSDP's reduce-scatter input, which then carries the mean residual, what the ranks still owed.
        Every rank holds a residual for the same weights (they took the same routes)."""
        residual = self.rank_codec.flush(unit.name) if self.rank_codec is not None else None
        if residual is None:
            return False
        sink.add_local(unit.param, residual)
        self._queue_rank_end(agg, report)  # put back if the step turns out not finite
        return True

    def _rank_routes(self, items: List[RankItem], sink: ShardSink, agg: TorchDistributedAggregator, scale: float,
                     report: ShardedStepReport, covered: set) -> None:
        """Exchange the rank-routed weights of this call and write their shards; the step's residuals
        and warm starts are kept or dropped when backward is over (`ShardedRankCodec.end_step`)."""
        shards = self.rank_codec.exchange(items, agg, scale, report.step - 1, sink.inp.dtype)
        for item, result in zip(items, shards):
            p = item.unit.param
            sink.write(p, result.shard)
            covered.add(id(p))
            slot = sink.slot(p)
            entry = ShardedParamReport.of_shard(slot.name, item.representation, slot.shape, slot.numel,
                                                agg.world_size, sink.inp.element_size())
            entry.components, entry.method = result.components, item.method
            entry.add_traffic(result.traffic)
            report.params.append(entry)
        self._queue_rank_end(agg, report)

    def _queue_rank_end(self, agg: TorchDistributedAggregator, report: ShardedStepReport) -> None:
        """Once per step: agree on its finiteness when backward is over (`_end_rank_step`)."""
        if not self._rank_end_queued:
            self._rank_end_queued = True
            end = functools.partial(self._end_rank_step, agg, report)
            if torch._C._current_graph_task_id() < 0:
                end()  # not inside a backward: this call is the step
            else:       # after every group's reduce-scatter, FSDP's final callback included
                Variable._execution_engine.queue_callback(end)

    def _end_rank_step(self, agg: TorchDistributedAggregator, report: ShardedStepReport) -> None:
        self._rank_end_queued = False
        report.params.append(_overhead("dad.fsdp.finite", 1, self.rank_codec.end_step(agg)))

    def _slots(self, pg, inp: torch.Tensor, S: int) -> Optional[List[ShardSlot]]:
        """Each reduced parameter's place in the buffers, or None where they do not add up."""
        fps = self._with_grad.pop(id(pg), None)
        if fps is None or self._closed:
            return None
        slots, offset = [], 0
        for fp in fps:
            numel = math.prod(fp.padded_sharded_param_size)
            p = fp.sharded_param
            slots.append(ShardSlot(self._names.get(id(p), "?"), p, offset, numel,
                                   int(fp.padded_sharded_param_size[0]), tuple(p.shape)))
            offset += numel
        return slots if offset * S == inp.numel() else None

    @staticmethod
    def _dense(dense: List[ShardSlot], sink: ShardSink, group, op, report: ShardedStepReport) -> None:
        """FSDP's own reduce-scatter, on a buffer holding only ``dense``'s chunks."""
        if not dense:
            return
        if sum(s.numel for s in dense) == sink.chunk:  # nothing went by factors: the buffer as it is
            dist.reduce_scatter_tensor(sink.out, sink.inp, op=op, group=group)
        else:
            compact = sink.dense_input(dense)
            result = torch.empty(compact.numel() // sink.world_size, dtype=compact.dtype, device=compact.device)
            dist.reduce_scatter_tensor(result, compact, op=op, group=group)
            sink.write_dense(dense, result)
        report.params += [ShardedParamReport.of_shard(s.name, "dense", s.shape, s.numel, sink.world_size,
                                                      sink.inp.element_size()) for s in dense]


def _scaling(pg, group: dist.ProcessGroup, inp: torch.Tensor, op) -> Tuple[float, float]:
    """FSDP's predivide (already applied to ``inp``) and what its reduce-scatter multiplies the sum
    of the predivided gradients by: ``1/S`` for AVG, ``1/factor`` for PREMUL_SUM, 1 for SUM."""
    pre, _, rs_op, _ = _get_gradient_divide_factors(group, None, inp.dtype, inp.device.type,
                                                    pg.gradient_divide_factor, pg.force_sum_reduction_for_comms)
    pre = pre or 1.0
    if rs_op == ReduceOp.AVG:
        return pre, 1.0 / pre / group.size()
    if rs_op == ReduceOp.SUM:
        return pre, 1.0 / pre
    return pre, 1.0 / pre / float(pg.gradient_divide_factor)


def _overhead(name: str, numel: int, traffic: Traffic) -> ShardedParamReport:
    rep = ShardedParamReport(name, "overhead", (numel,))
    rep.add_traffic(traffic)
    return rep
