"""dAD under FSDP2 (``torch.distributed.fsdp.fully_shard``): the adapter.

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    sync = enable_dad_fsdp(model, {"mode": "exact"})   # before the first forward
    loss.backward()          # factor-covered weights skip FSDP2's reduce-scatter
    optimizer.step()         # every rank's sharded .grad holds its shard of the average
    sync.last_step_report()  # bytes, beside what FSDP2's reduce-scatter would move

FSDP2 hands each parameter group's flat, rank-chunked gradient buffers to a ``ReduceScatter``
(`FSDPModule.set_custom_reduce_scatter`; layout, scaling and call order in
``docs/internals/fsdp2_notes.md``). `DADReduceScatter` turns each call into a `ShardedCall` for
`exchange.sharded.ShardedExchanger`, which routes, checks and keeps the rank routes' state; here
are only FSDP's side of it: finding its groups and the parameters each call reduces
(`capture.sink.ShardSink` reads and writes its buffers), its scaling (results are scaled as its
reduce-scatter would scale them; FSDP then post-divides, casts and accumulates into the sharded
``.grad``), the exchanges of exact factors (`codecs.sharded_exact`) and rank routes
(`codecs.sharded_rank`) on a shard's rows, and FSDP's own reduce-scatter for the rest (on a
compacted buffer, with its op).

A step runs from the root's forward (a forward pre-hook: a route trial's span) to a callback queued
on autograd's engine at the step's first reduce-scatter, which runs after FSDP's own final callback,
queued at backward's start: the ranks agree there. Rows are sent only once autograd has added them
to the unsharded gradient (`capture.committed.CommittedRows`: FSDP's post-backward can run before
the weight's ``AccumulateGrad``). No-sync micro-steps need nothing: the hook is not called, the
captures keep their rows. Weights are handled as their matrix view ``(shape[0], prod(shape[1:]))``:
FSDP2's ``Shard(0)`` cuts its rows.

Limits (each falls back to FSDP's own reduce-scatter, logged once): HSDP, ``Shard(d>0)``, all-gather
extensions, TP (DTensor) parameters, several parameter groups per module, CPU offload. An adaptive
rank (``adaptive_tolerance``) is refused, and so is FSDP1 (`engines.fsdp_detect`).
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

from dad_integrations.capture.committed import CommittedRows
from dad_integrations.capture.hooks import ForwardStartHook
from dad_integrations.capture.sink import ShardSink, ShardSlot
from dad_integrations.capture.units import FactorUnit, build_plan
from dad_integrations.codecs.sharded_exact import ShardedExactCodec, exchange_row_counts
from dad_integrations.comm.torch_distributed import TorchDistributedAggregator
from dad_integrations.config import DADConfig
from dad_integrations.engines import banner
from dad_integrations.engines.fsdp_detect import reject_fsdp1
from dad_integrations.exchange.checks import agree_factors_rebuild
from dad_integrations.exchange.sharded import CallRoutes, ShardedCall, ShardedExchanger, ShardedFacade
from dad_integrations.report import ShardedParamReport, ShardedStepReport
from dad_integrations.routing.router import UnitShape
from dad_integrations.routing.sharded_trial import agree_on

log = logging.getLogger(__name__)

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


class FSDPDADSynchronizer(ShardedFacade):
    """dAD driven from FSDP2's reduce-scatter (see the module doc)."""

    def __init__(self, model: nn.Module, config: Union[DADConfig, Mapping, None] = None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("enable_dad_fsdp needs an initialised default process group")
        self.config = DADConfig() if config is None else DADConfig.from_dict(config)
        if self.config.adaptive_tolerance is not None:
            raise ValueError("enable_dad_fsdp: 'adaptive_tolerance' is not supported under FSDP2 (the sharded rank "
                             "routes exchange equal blocks of r components from every rank); leave it unset")
        reject_fsdp1(model, "enable_dad_fsdp")
        self.exchanger = ShardedExchanger(
            self.config, [], engine="FSDP2", fallback="FSDP's reduce-scatter", process_rank=dist.get_rank(),
            world_size=dist.get_world_size(), logger=log,
            overhead_names={"counts": "dad.fsdp.row_counts", "verify": "dad.fsdp.verify", "finite": "dad.fsdp.finite"})
        self._log_once = self.exchanger.log_once
        self._closed = False
        self._task: Optional[int] = None
        self._aggregators: Dict[int, TorchDistributedAggregator] = {}
        self._with_grad: Dict[int, list] = {}  # per group: the FSDPParams its post_backward reduces
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
        units = list(self._unit_of.values())
        self.exchanger.units = units
        self._committed = CommittedRows(units)  # see the module doc
        self.exchanger.start(TorchDistributedAggregator(), units[0].param.device if units else None, units)
        self._forward_hook = ForwardStartHook(model, self.exchanger.trial.forward)
        self._installed = groups
        for module, pg in groups:
            self._install(module, pg)
        banner.announce("FSDP2", process_rank=dist.get_rank(), world_size=dist.get_world_size(),
                        mode=self.config.mode, rank=self.config.rank, objective=self.config.objective,
                        factor_weights=len(units), dense_params=banner.dense_count(model, units))

    @property
    def _trial(self):
        return self.exchanger.trial

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

    def load_state_dict(self, state: Mapping) -> None:
        super().load_state_dict(state)
        self._task = None  # the next backward begins a step

    # -- the reduce-scatter -----------------------------------------------------------------------
    def _reduce(self, pg, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, op) -> None:
        agg = self._aggregators.setdefault(id(group), TorchDistributedAggregator(group))
        task = torch._C._current_graph_task_id()  # every group's call of one backward shares it
        ex = self.exchanger
        if ex.report is None or task != self._task or task < 0:
            self._task = task
            ex.begin_step()
            if ex.trial.trial is not None:  # its span ends where every rank agrees (module doc)
                end = functools.partial(ex.trial.end, ex.steps - 1, agree_on(agg, inp.device))
                if task < 0:
                    self._trial_end = end
                else:
                    Variable._execution_engine.queue_callback(end)
        ex.note_local(inp)  # the step's finiteness, agreed when it ends
        S = group.size()
        slots = self._slots(pg, inp, S)
        if slots is None:
            self._log_once(f"group {pg._module_fqn or '<root>'}: could not map FSDP's buffer to its parameters; "
                           f"FSDP's reduce-scatter used for the whole group")
            whole = ShardSlot(f"{pg._module_fqn}.*", None, 0, inp.numel() // S, inp.numel() // S, (inp.numel(),))
            _dense([whole], ShardSink([], out, inp, S), group, op, ex.report)
        else:
            predivide, scale = _scaling(pg, group, inp, op)
            ex.reduce(_FSDPCall(self, slots, ShardSink(slots, out, inp, S, predivide), group, op, scale, agg))
        end, self._trial_end = self._trial_end, None
        if end is not None:  # not inside a backward: this call is the step
            end()

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


class _FSDPCall(ShardedCall):
    """One FSDP reduce-scatter, as `ShardedExchanger.reduce` takes it."""

    def __init__(self, sync: FSDPDADSynchronizer, slots: List[ShardSlot], sink: ShardSink,
                 group: dist.ProcessGroup, op, scale: float, aggregator: TorchDistributedAggregator):
        self.sync, self.slots, self.sink, self.group, self.op, self.scale = sync, slots, sink, group, op, scale
        self.aggregator = aggregator
        self.route_wire = sync.exchanger.wire

    def units(self) -> List[FactorUnit]:
        return [u for u in (self.sync._unit_of.get(id(s.param)) for s in self.slots) if u is not None]

    def take_pairs(self, unit: FactorUnit, use) -> list:
        return self.sync._committed.take(use)

    def add_residual(self, unit: FactorUnit, residual: torch.Tensor) -> None:
        self.sink.add_local(unit.param, residual)

    def agree_counts(self, units, rows):
        counts, traffic = exchange_row_counts(units, rows, self.aggregator)
        return counts, traffic, sum(len(u.uses) for u in units)

    def verify(self, units, rows):
        _, failed, traffic = agree_factors_rebuild(units, rows, self.sink, self.aggregator)
        return failed, traffic

    def _biases(self, unit: FactorUnit) -> List[nn.Parameter]:
        return [b.param for b in unit.biases if self.sink.slot(b.param) is not None]

    def unit_shape(self, unit: FactorUnit) -> UnitShape:
        # the matrix view; row blocks on non-linear uses keep a unit off sharded exact factors
        return UnitShape(tuple(unit.kinds), unit.shape, sum(b.shape[0] for b in self._biases(unit)),
                         self.sink.inp.dtype, unit.blocks)

    def reduce_dense(self, report: ShardedStepReport) -> None:
        _dense(self.slots, self.sink, self.group, self.op, report)

    def at_step_end(self, end: Callable[[], None]) -> None:
        if torch._C._current_graph_task_id() < 0:
            end()  # not inside a backward: this call is the step
        else:       # after every group's reduce-scatter, FSDP's final callback included
            Variable._execution_engine.queue_callback(end)

    def exchange(self, routes: CallRoutes) -> None:
        sink, report, S, itemsize = self.sink, routes.report, self.aggregator.world_size, self.sink.inp.element_size()
        covered = set()
        # factors travel in FSDP's reduce dtype where the config names none, as the router counts
        # them (not in the sharded parameters' dtype: fp32 factors under a bf16 policy)
        codec = ShardedExactCodec(self.route_wire or sink.inp.dtype, sink.inp.device)
        for unit in routes.exact:
            biases = self._biases(unit)
            result = codec.exchange(unit, routes.rows[unit.index], routes.counts[unit.index], self.aggregator,
                                    self.scale)
            for p in [unit.param] + biases:
                sink.write(p, result.shards[p])
                covered.add(id(p))
                slot = sink.slot(p)
                report.params.append(ShardedParamReport.of_shard(slot.name, "exact", slot.shape, slot.numel, S,
                                                                 itemsize))
            weight = report.params[-1 - len(biases)]  # the bytes go to the weight, biases ride free
            weight.rows = sum(left.shape[0] for left, _ in routes.rows[unit.index])
            weight.max_rows, weight.method = max(sum(r) for r in routes.counts[unit.index]), result.method
            weight.add_traffic(result.traffic)
        if routes.ranked:  # biases stay on FSDP's reduce-scatter
            codec = self.sync.rank_codec
            items = [codec.local(unit, routes.rows[unit.index], sink.local_grad, rep) for unit, rep in routes.ranked]
            for item, result in zip(items, codec.exchange(items, self.aggregator, self.scale, routes.step,
                                                          sink.inp.dtype)):
                p = item.unit.param
                sink.write(p, result.shard)
                covered.add(id(p))
                slot = sink.slot(p)
                entry = ShardedParamReport.of_shard(slot.name, item.representation, slot.shape, slot.numel, S,
                                                    itemsize)
                entry.components, entry.method = result.components, item.method
                entry.add_traffic(result.traffic)
                report.params.append(entry)
        _dense([s for s in self.slots if id(s.param) not in covered], sink, self.group, self.op, report)


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
