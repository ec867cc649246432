"""dAD under FSDP2 (``torch.distributed.fsdp.fully_shard``): the adapter.

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    sync = enable_dad_fsdp(model, {"mode": "exact"})   # before the first forward
    loss.backward()          # factor-covered weights skip FSDP2's reduce-scatter
    optimizer.step()         # every rank's sharded .grad holds its shard of the average
    sync.last_step_report()  # bytes, beside what FSDP2's reduce-scatter would move

FSDP2 hands each parameter group's flat, rank-chunked gradient buffers to a ``ReduceScatter``
(`FSDPModule.set_custom_reduce_scatter`). `fsdp_seams.DADReduceScatter` turns each call into a
row-shard layout's call (`exchange.row_shards`) over FSDP's engine part (`FSDPEngineCall`) for
`exchange.sharded.ShardedExchanger`, which routes, checks and keeps the rank routes' state.
Here is only FSDP's side of it (its internals in `fsdp_seams`; layout, scaling, call order, the
committed-rows trap and the limits in ``docs/internals/fsdp2_notes.md``): its groups and the
parameters each call reduces, its scaling, and its own reduce-scatter for the rest.

A step runs from the root's forward (a route trial's span) to a callback queued on autograd's
engine at the step's first reduce-scatter, after FSDP's own final callback: the ranks agree there.
Rows are sent only once autograd has added them to the unsharded gradient (`capture.committed`).
Under HSDP (a 2-D ``("replicate", "shard")`` mesh) FSDP keeps the reduce-scatter inside the node
and dAD takes the all-reduce between nodes (`exchange.replicate_hop`). What dAD cannot take falls
back to FSDP's own reduce-scatter, logged once; ``adaptive_tolerance`` and FSDP1 are refused.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from dad_integrations import fsdp_seams as seams
from dad_integrations.capture.committed import CommittedRows
from dad_integrations.capture.units import FactorUnit
from dad_integrations.capture.assign import build_plan
from dad_integrations.codecs.replicate_rank import ReplicateRankCodec
from dad_integrations.comm.link_spec import level_link_specs
from dad_integrations.comm.torch_distributed import TorchDistributedAggregator
from dad_integrations.config import WIRE_DTYPES, DADConfig
from dad_integrations.engines import banner
from dad_integrations.engines.fsdp_detect import reject_fsdp1
from dad_integrations.logs import OnceLogger
from dad_integrations.exchange.replicate_hop import ReplicateGroups, ReplicateHopCall
from dad_integrations.exchange.row_shards import RowShardCall
from dad_integrations.exchange.sharded import EngineCall, ShardedExchanger, ShardedFacade
from dad_integrations.fsdp_seams import DADReduceScatter
from dad_integrations.report import ShardedParamReport, ShardedStepReport
from dad_integrations.routes import layouts

log = logging.getLogger(__name__)

__all__ = ["enable_dad_fsdp", "FSDPDADSynchronizer", "DADReduceScatter", "ShardedParamReport",
           "ShardedStepReport"]


def enable_dad_fsdp(model: nn.Module, config: Union[DADConfig, Mapping, None] = None) -> "FSDPDADSynchronizer":
    """Replace FSDP2's gradient reduce-scatter by dAD for every weight factors cover.

    Call on every rank after ``fully_shard`` and before the first forward; returns the synchroniser
    (``last_step_report()``, ``close()``).
    """
    return FSDPDADSynchronizer(model, config)


class FSDPDADSynchronizer(ShardedFacade):
    """dAD driven from FSDP2's reduce-scatter (see the module doc)."""

    row_layout = RowShardCall  # the layout of a 1-D mesh's calls (another: docs/architecture.md)

    def __init__(self, model: nn.Module, config: Union[DADConfig, Mapping, None] = None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("enable_dad_fsdp needs an initialised default process group")
        self.config = DADConfig() if config is None else DADConfig.from_dict(config)
        if self.config.adaptive_tolerance is not None:
            raise ValueError("enable_dad_fsdp: 'adaptive_tolerance' is not supported under FSDP2 (the sharded rank "
                             "routes exchange equal blocks of r components from every rank); leave it unset")
        reject_fsdp1(model, "enable_dad_fsdp")
        self._log_once = OnceLogger(log, "dAD/FSDP2: ", rank=dist.get_rank())  # the model's: rank 0 says it
        self._closed, self._task = False, None  # _task: the open step's autograd graph task
        self._aggregators: Dict[int, TorchDistributedAggregator] = {}
        self._with_grad: Dict[int, list] = {}  # per group: the FSDPParams its post_backward reduces
        groups = seams.param_groups(model, self._log_once)
        if not groups:
            raise ValueError("enable_dad_fsdp: no fully_shard-ed module (with a shard mesh dim) in the model")
        self._replicate = self._replicate_groups([pg for _, pg in groups])  # HSDP: None on a 1-D mesh
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
        self._committed = CommittedRows(units)  # see the module doc
        rep = self._replicate
        config = self.config if rep is None else hsdp_config(self.config)
        world = TorchDistributedAggregator() if rep is None else rep.world
        self.exchanger = ShardedExchanger(
            config, engine="FSDP2", fallback="FSDP's reduce-scatter" if rep is None else "HSDP's own reduction",
            process_rank=dist.get_rank(), world_size=dist.get_world_size(), logger=log,
            overhead_names={"counts": "dad.fsdp.row_counts", "verify": "dad.fsdp.verify", "finite": "dad.fsdp.finite"},
            rank_codec=None if rep is None or config.rank is None else ReplicateRankCodec(
                config, WIRE_DTYPES[config.wire_dtype], rep.intra, rep.cross))
        self.exchanger.log_once = self._log_once
        self._forward_hook = self.exchanger.start(model, world, units[0].param.device if units else None, units,
                                                  link_probe=None if rep is None else rep.probe_link,
                                                  layout=layouts.layout_for("fsdp2" if rep is None else "hsdp"))
        self._installed = groups
        for module, pg in groups:
            if rep is not None:
                seams.take_replicate_hop(pg)
            seams.install(module, pg, self._reduce, self._with_grad)
        banner.announce("FSDP2", self.config, process_rank=dist.get_rank(), world_size=dist.get_world_size(),
                        factor_weights=len(units), dense_params=banner.dense_count(model, units),
                        hops=self.exchanger.describe_hops(world, layout=None if rep is None else "HSDP"),
                        memory=self.exchanger.memory_line)

    def _replicate_groups(self, pgs: list) -> Optional[ReplicateGroups]:
        """HSDP's groups (`exchange.replicate_hop`) where the model is sharded on a 2-D mesh; refuses,
        before anything is changed, what dAD cannot take there."""
        hsdp = [pg for pg in pgs if seams.is_hsdp(pg)]
        if not hsdp:
            return None
        reason = seams.hsdp_supported()
        if reason is not None:
            raise ValueError(f"enable_dad_fsdp: the model is sharded with HSDP, but {reason}")
        if len(hsdp) < len(pgs):
            raise ValueError("enable_dad_fsdp: the model mixes HSDP (2-D mesh) and 1-D fully_shard groups; "
                             "shard every module on the same mesh")
        infos = [pg.mesh_info for pg in hsdp]
        key = {(id(i.shard_process_group), id(i.replicate_process_group)) for i in infos}
        if len(key) > 1:
            raise ValueError("enable_dad_fsdp: HSDP modules on different meshes; shard every module on one mesh")
        info = infos[0]
        grid = seams.hsdp_grid(info)
        if sum(len(row) for row in grid) != dist.get_world_size():
            raise ValueError(f"enable_dad_fsdp: the HSDP mesh holds {sum(len(r) for r in grid)} ranks, the job "
                             f"{dist.get_world_size()}; dAD takes meshes over the whole job")
        groups = ReplicateGroups(TorchDistributedAggregator(), TorchDistributedAggregator(info.shard_process_group),
                                 TorchDistributedAggregator(info.replicate_process_group), grid, dist.get_rank())
        if (dist.get_process_group_ranks(info.shard_process_group) != grid[groups.node]
                or dist.get_process_group_ranks(info.replicate_process_group) != groups.column(groups.shard)):
            raise ValueError("enable_dad_fsdp: the HSDP mesh's process groups do not follow its rank grid")
        return groups

    def _unsupported(self, p: torch.Tensor) -> Optional[str]:
        entry = self._fp_of.get(id(p))
        return "not sharded by a handled FSDP group" if entry is None else seams.shard_problem(entry[1])

    def close(self) -> None:
        """Give the reductions back to FSDP and remove the capture hooks."""
        if self._closed:
            return
        self._closed = True
        self._remove_hooks()
        for module, pg in self._installed:
            seams.uninstall(module, pg)
            seams.give_back_replicate_hop(pg)
        self._committed.remove()

    def load_state_dict(self, state: Mapping) -> None:
        super().load_state_dict(state)
        self._task = None  # the next backward begins a step

    # -- the reduce-scatter -----------------------------------------------------------------------
    def _reduce(self, pg, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, op) -> None:
        rep = self._replicate
        if rep is not None and not pg.all_reduce_grads:
            raise RuntimeError("dAD/FSDP2: set_requires_all_reduce(False) (HSDP's reduce-scatter-only "
                               "accumulation) is not supported with dAD, which takes the all-reduce between "
                               "nodes; accumulate with set_requires_gradient_sync(False) (Accelerate's no_sync), "
                               "which dAD handles without any reduction")
        agg = rep.world if rep is not None else self._aggregators.setdefault(id(group), TorchDistributedAggregator(group))
        task = torch._C._current_graph_task_id()  # every group's call of one backward shares it
        ex = self.exchanger
        if ex.report is None or task != self._task or task < 0:
            self._task = task
            ex.begin_step()
            # the step's end, where every rank agrees: a route trial's span ends, its routes are said
            end = ex.trial_end(agg, inp.device)
            if task < 0:
                self._trial_end = end
            else:
                Variable._execution_engine.queue_callback(end)
        ex.state.note_local(inp)  # the step's finiteness, agreed when it ends
        S = group.size()
        fps = self._with_grad.pop(id(pg), None)
        slots = None if fps is None or self._closed else seams.slots_of(fps, self._names, inp, S)
        whole = slots is None
        if whole:
            self._log_once(f"group {pg._module_fqn or '<root>'}: could not map FSDP's buffer to its parameters; "
                           f"FSDP's reduce-scatter used for the whole group")
            slots = [seams.whole_slot(pg, inp, S)]
        engine = FSDPEngineCall(self, slots, group, op if rep is None else dist.ReduceOp.SUM)  # HSDP: the node's sum
        if rep is not None:
            predivide, scale = seams.hsdp_scaling(pg, seams.hsdp_info(pg), inp)
            call = ReplicateHopCall(engine, slots, out, inp, predivide, scale, rep, ex.wire, ex.rank_codec, ex.config)
        else:
            predivide, scale = seams.scaling(pg, group, inp, op)
            call = self.row_layout(engine, slots, out, inp, predivide, agg, scale, ex.wire, ex.rank_codec)
        if whole:
            call.reduce_dense(ex.report)
        else:
            ex.reduce(call)
        end, self._trial_end = self._trial_end, None
        if end is not None:  # not inside a backward: this call is the step
            end()


class FSDPEngineCall(EngineCall):
    """One reduce-scatter call's engine part (`exchange.sharded.EngineCall`), from ``sync``: its
    units, their committed rows, the step's end, and FSDP's reduce-scatter over ``group`` by ``op``
    (under HSDP: inside the node, a sum)."""

    def __init__(self, sync: Any, slots: list, group: dist.ProcessGroup, op):
        super().__init__([u for u in (sync._unit_of.get(id(s.param)) for s in slots) if u is not None])
        self.sync, self.group, self.op = sync, group, op

    def take_pairs(self, unit: FactorUnit, use) -> list:
        return self.sync._committed.take(use)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        dist.reduce_scatter_tensor(out, inp, op=self.op, group=self.group)

    def at_step_end(self, end: Callable[[], None]) -> None:
        if torch._C._current_graph_task_id() < 0:
            end()  # not inside a backward: this call is the step
        else:       # after every group's reduce-scatter, FSDP's final callback included
            Variable._execution_engine.queue_callback(end)


def hsdp_config(config: DADConfig) -> DADConfig:
    """Under HSDP dAD's routes run between nodes: a ``link`` stated per hop gives its ``inter`` part."""
    levels = level_link_specs(config.link) if isinstance(config.link, Mapping) else None
    return config if levels is None else dataclasses.replace(config, link=dict(levels["inter"]))
