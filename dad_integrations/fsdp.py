"""dAD under FSDP2 (``torch.distributed.fsdp.fully_shard``): factors instead of the reduce-scatter.

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    sync = enable_dad_fsdp(model, {"mode": "exact"})   # before the first forward
    loss.backward()          # factor-covered weights skip FSDP2's reduce-scatter
    optimizer.step()         # every rank's sharded .grad holds its shard of the average
    sync.last_step_report()  # bytes, beside what FSDP2's reduce-scatter would move

FSDP2 hands each parameter group's flat, rank-chunked gradient buffer to a ``ReduceScatter``
object (`FSDPModule.set_custom_reduce_scatter`; layout and scaling in ``docs/fsdp2_notes.md``).
`DADReduceScatter` fills this rank's chunk itself:

* a weight the core's `build_plan` covers by factors (``nn.Linear``, HF ``Conv1D``,
  ``nn.Embedding``, tied uses together) and whose shard is a row block along dim 0: each rank
  rebuilds only its rows ``a:b`` of the average. Every kind's gradient is ``left^T right`` in
  `layers`' orientation, with dim 0 on ``left``'s columns, so the rows are ``left[:, a:b]^T right``:
  the output-gradient columns of a ``Linear``, the input columns of a ``Conv1D``. For those the
  ranks all-gather ``right`` and exchange ``left``'s column slices by all-to-all (DESIGN section 4:
  ``(S-1) N n + (S-1)/S N m`` per rank, rows padded to the longest rank). A unit with an embedding
  use (GPT-2's tied ``wte``/``lm_head``) all-gathers the exact codec's whole factors and keeps the
  token ids in ``[a, b)``. A bias riding with the weight is the sum of its output-gradient rows,
  restricted to its own shard;
* everything else (norms, parameters factors do not cover, layouts not handled, weights ``auto``
  sends dense) goes through FSDP's own reduce-scatter, on a compacted buffer of just those
  parameters' chunks, with FSDP's op.

Results are scaled as FSDP's reduce-scatter would have (``AVG``, or ``SUM`` after its predivide,
or ``1/factor`` for `set_gradient_divide_factor`); FSDP then post-divides, casts and accumulates
into the sharded ``.grad`` as usual. ``set_requires_gradient_sync(False)`` micro-steps need nothing:
the hook is not called, the captures keep collecting rows, and the next synchronised backward
sends them all.

Prototype limits (each falls back to FSDP's own reduce-scatter, logged once): HSDP, ``Shard(d>0)``,
all-gather extensions, TP (DTensor) parameters, several parameter groups per module. Mode
``"rank"`` (and ``auto`` with a rank) is not supported yet. Embedding ids are all-gathered whole
(an all-to-all by id owner would cut them and their rows to ``~1/S``).

Rows are sent only once autograd has accumulated them into the unsharded gradient: FSDP's
post-backward of a module is triggered by its *inputs'* gradients and can run before the weight's
``AccumulateGrad`` (a module called twice, with gradients accumulated from a no-sync micro-step,
showed it), so a post-accumulate-grad hook on the unsharded parameter commits the captured rows.
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import ReduceOp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (DefaultAllocMixin, DefaultReduceScatter,
                                                                    _get_gradient_divide_factors)
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, DDPMeshInfo

from .aggregator import Traffic, ring_allreduce_bytes
from .checks import VERIFY_TOLERANCE, VERIFY_TOLERANCE_LOW_PRECISION
from .codecs.exact import ExactCodec, local_rebuild
from .config import DADConfig
from .costs import exact_block_specs
from .layers import compute_dtype, deterministic_index_add, output_grad_rows
from .report import ParamReport, StepReport
from .torch_distributed import TorchDistributedAggregator
from .units import FactorUnit, build_plan
from .wire import packed_size, unpack

log = logging.getLogger(__name__)

__all__ = ["enable_dad_fsdp", "FSDPDADSynchronizer", "DADReduceScatter", "ShardedParamReport",
           "ShardedStepReport"]

_WIRE_DTYPES = {None: None, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ShardedParamReport(ParamReport):
    """`ParamReport` plus what FSDP2's reduce-scatter of this parameter would send per rank
    (``(S-1)/S`` of its dim-0-padded gradient)."""

    reduce_scatter_bytes: float = 0.0


@dataclass
class ShardedStepReport(StepReport):
    """A step under FSDP2; ``totals`` adds ``reduce_scatter_bytes`` and ``ratio_reduce_scatter``
    (bytes sent over the reduce-scatter's)."""

    @property
    def totals(self) -> Dict[str, float]:
        out = super().totals
        rs = float(sum(getattr(p, "reduce_scatter_bytes", 0.0) for p in self.params))
        out["reduce_scatter_bytes"] = rs
        out["ratio_reduce_scatter"] = out["sent_bytes"] / rs if rs else 0.0
        return out


@dataclass
class _Slot:
    """One FSDPParam's place in a reduce-scatter call."""

    name: str
    fsdp_param: object
    offset: int            # element offset inside every rank's chunk
    numel: int             # padded sharded numel
    rows: int              # padded sharded dim 0 (ceil(m / S))
    shape: Tuple[int, ...]  # the parameter's global shape


def enable_dad_fsdp(model: nn.Module, config: Union[DADConfig, Mapping, None] = None) -> "FSDPDADSynchronizer":
    """Replace FSDP2's gradient reduce-scatter by dAD for every weight factors cover.

    Call on every rank after ``fully_shard`` and before the first forward; returns the synchroniser
    (``last_step_report()``, ``close()``).
    """
    return FSDPDADSynchronizer(model, config)


class DADReduceScatter(DefaultAllocMixin, ReduceScatter):
    """The ``ReduceScatter`` installed on one FSDP parameter group."""

    def __init__(self, sync: "FSDPDADSynchronizer", param_group):
        self.sync = sync
        self.param_group = param_group

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        self.sync._reduce(self.param_group, output_tensor, input_tensor, group, op)
        return None


class FSDPDADSynchronizer:
    """dAD driven from FSDP2's reduce-scatter (see the module doc)."""

    def __init__(self, model: nn.Module, config: Union[DADConfig, Mapping, None] = None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("enable_dad_fsdp needs an initialised default process group")
        self.config = DADConfig() if config is None else DADConfig.from_dict(config)
        if self.config.mode == "rank" or self.config.rank is not None:
            raise ValueError("enable_dad_fsdp: rank-dAD under FSDP2 is not supported yet; use mode 'exact' "
                             "or 'auto' without 'rank'")
        self.model = model
        self._wire = _WIRE_DTYPES[self.config.wire_dtype]
        self._logged: set = set()
        self._closed = False
        self._reports: List[ShardedStepReport] = []
        self._task: Optional[int] = None
        self._step = 0
        self._aggregators: Dict[int, TorchDistributedAggregator] = {}
        self._with_grad: Dict[int, list] = {}
        self._verified: set = set()            # ids of param groups whose first call was checked
        # Rows become the hook's to send only once autograd has accumulated the weight's gradient
        # (FSDP's post_backward can run between a call's output gradient and that accumulation):
        self._committed: Dict[int, list] = {}  # per capture id: pairs already in the local gradient
        self._watched: Dict[int, tuple] = {}   # per unsharded parameter id: (parameter, hook handle)
        self._hooks: list = []

        groups = []
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            state = module._get_fsdp_state()
            pgs = list(state._fsdp_param_groups)
            if len(pgs) > 1:
                self._log_once(f"FSDP module {type(module).__name__} has {len(pgs)} parameter groups: "
                               f"its parameters keep FSDP's reduce-scatter")
                continue
            for pg in pgs:
                mesh = pg.mesh_info
                if not isinstance(mesh, FSDPMeshInfo) or isinstance(mesh, DDPMeshInfo):
                    self._log_once(f"FSDP group {pg._module_fqn or '<root>'}: HSDP/replicate mesh, "
                                   f"FSDP's own reduction kept")
                    continue
                groups.append((module, pg))
        if not groups:
            raise ValueError("enable_dad_fsdp: no fully_shard-ed module (with a 1-D shard mesh) in the model")

        # Which group and FSDPParam hold each (sharded) parameter.
        self._fp_of: Dict[int, Tuple[object, object]] = {}
        for _, pg in groups:
            for fp in pg.fsdp_params:
                self._fp_of[id(fp.sharded_param)] = (pg, fp)

        self.plan = build_plan(model, self.config)
        self._unit_of_weight: Dict[int, FactorUnit] = {}
        self._owner_of_bias: Dict[int, FactorUnit] = {}
        self._names: Dict[int, str] = {}
        for name, p in model.named_parameters():
            self._names.setdefault(id(p), name)
        for unit in self.plan.units:
            reason = self._unsupported(unit.param)
            if reason is not None:
                self._log_once(f"{unit.name}: {reason}: FSDP's reduce-scatter kept")
                unit.set_dense_only(True)
                continue
            pg = self._fp_of[id(unit.param)][0]
            kept = []
            for b in unit.biases:
                if self._unsupported(b.param) is None and self._fp_of[id(b.param)][0] is pg:
                    kept.append(b)
                    self._owner_of_bias[id(b.param)] = unit
                else:
                    self._log_once(f"{b.name}: not in its weight's FSDP group as a row block: dense")
            unit.biases = kept
            self._unit_of_weight[id(unit.param)] = unit
            for capture in unit.uses:
                self._hooks.append(capture.module.register_forward_hook(
                    functools.partial(self._watch_unsharded, unit)))

        self._installed = []
        for module, pg in groups:
            self._install(module, pg)

    # -- set-up -----------------------------------------------------------------------------------
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
            # what FSDP's post_backward is about to reduce: parameters with a gradient, in order
            if pg.reduce_grads:
                self._with_grad[id(pg)] = [
                    fp for fp in pg.fsdp_params if hasattr(fp, "_unsharded_param") and (
                        fp.unsharded_accumulated_grad is not None or fp.unsharded_param.grad is not None
                        or (pg.reduce_scatter_unused_params and fp.unsharded_param.requires_grad))]
            return original(*args, **kwargs)

        pg.post_backward = post_backward
        module.set_custom_reduce_scatter(DADReduceScatter(self, pg))
        self._installed.append((module, pg))

    def _watch_unsharded(self, unit: FactorUnit, module: nn.Module, args, output) -> None:
        """During forward ``module.weight`` is FSDP's unsharded parameter: hook its accumulation once."""
        p = module.weight
        if id(p) not in self._watched and p.requires_grad:
            handle = p.register_post_accumulate_grad_hook(functools.partial(self._commit, unit))
            self._watched[id(p)] = (p, handle)

    def _commit(self, unit: FactorUnit, param: torch.Tensor) -> None:
        """Autograd has added every call's contribution captured so far to the unsharded gradient."""
        for capture in unit.uses:
            if capture.pairs:
                self._committed.setdefault(id(capture), []).extend(capture.pairs)
                capture.pairs = []

    def close(self) -> None:
        """Give the reductions back to FSDP and remove the capture hooks."""
        if self._closed:
            return
        self._closed = True
        for module, pg in self._installed:
            pg.__dict__.pop("post_backward", None)
            module.set_custom_reduce_scatter(DefaultReduceScatter())
        for capture in self.plan.captures:
            capture.remove()
        for h in self._hooks:
            h.remove()
        for _, handle in self._watched.values():
            handle.remove()
        self._watched.clear()
        self._committed.clear()

    def last_step_report(self) -> Optional[ShardedStepReport]:
        """The report of the latest backward that reduced gradients (None before the first)."""
        return self._reports[-1] if self._reports else None

    # -- the reduce-scatter -----------------------------------------------------------------------
    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.warning("dAD/FSDP2: %s", message)

    def _aggregator(self, group: dist.ProcessGroup) -> TorchDistributedAggregator:
        agg = self._aggregators.get(id(group))
        if agg is None:
            agg = self._aggregators[id(group)] = TorchDistributedAggregator(group)
        return agg

    def _report(self, world: int) -> ShardedStepReport:
        task = torch._C._current_graph_task_id()
        if not self._reports or task != self._task or task < 0:
            self._task = task
            self._step += 1
            self._reports = [ShardedStepReport(self._step, world)]
        return self._reports[-1]

    def _reduce(self, pg, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, op) -> None:
        S, rank = group.size(), group.rank()
        report = self._report(S)
        fps = self._with_grad.pop(id(pg), None)
        itemsize = inp.element_size()
        if fps is None or self._closed or sum(math.prod(fp.padded_sharded_param_size) for fp in fps) * S != inp.numel():
            self._log_once(f"group {pg._module_fqn or '<root>'}: could not map FSDP's buffer to its parameters; "
                           f"FSDP's reduce-scatter used for the whole group")
            dist.reduce_scatter_tensor(out, inp, op=op, group=group)
            report.params.append(ShardedParamReport(f"{pg._module_fqn}.*", "dense", (inp.numel(),),
                                                    sent_bytes=(S - 1) / S * inp.numel() * itemsize,
                                                    received_bytes=(S - 1) / S * inp.numel() * itemsize,
                                                    reduce_scatter_bytes=(S - 1) / S * inp.numel() * itemsize))
            return
        chunk = inp.numel() // S
        slots: List[_Slot] = []
        offset = 0
        for fp in fps:
            numel = math.prod(fp.padded_sharded_param_size)
            p = fp.sharded_param
            slots.append(_Slot(self._names.get(id(p), fp._param_fqn if hasattr(fp, "_param_fqn") else "?"),
                               fp, offset, numel, int(fp.padded_sharded_param_size[0]), tuple(p.shape)))
            offset += numel

        weight_slots: Dict[int, _Slot] = {}
        units: List[FactorUnit] = []
        for s in slots:
            unit = self._unit_of_weight.get(id(s.fsdp_param.sharded_param))
            if unit is not None and not unit.dense_only:
                weight_slots[unit.index] = s
                units.append(unit)
        bias_slots: Dict[int, _Slot] = {}
        for s in slots:
            owner = self._owner_of_bias.get(id(s.fsdp_param.sharded_param))
            if owner is not None and owner.index in weight_slots:
                bias_slots[id(s.fsdp_param.sharded_param)] = s

        scale = self._scale(pg, group, inp.dtype, inp.device, op)
        rows = {u.index: self._rows(u) for u in units}
        rows_by_rank = self._exchange_counts(units, rows, group, report)

        if units and self.config.verify_first_step and id(pg) not in self._verified:
            units = self._verify(pg, units, rows, inp, chunk, S, weight_slots, bias_slots, group, report)
        self._verified.add(id(pg))

        covered = set()
        for unit in units:
            ws = weight_slots[unit.index]
            bslots = [bias_slots[id(b.param)] for b in unit.biases if id(b.param) in bias_slots]
            dense_bytes = (S - 1) * (ws.numel + sum(b.numel for b in bslots)) * itemsize
            codec = ExactCodec(self._wire, inp.device)
            sizes = codec.sizes(unit, rows_by_rank[unit.index])
            sliced = unit.factors_only and S > 1
            if sliced:  # all-gather of right, all-to-all of left's column slices
                longest = [max(r[u] for r in rows_by_rank[unit.index]) for u in range(len(unit.uses))]
                w = torch.empty((), dtype=codec.wire(unit)).element_size()
                exact_bytes = (S - 1) * sum(longest) * (unit.param.shape[1] + ws.rows) * w
            else:       # the exact codec's whole factors, all-gathered
                exact_bytes = (S - 1) * max(sizes)
            if self.config.mode == "auto" and exact_bytes >= dense_bytes:
                continue  # the reduce-scatter moves no more bytes: keep it
            if sliced:
                self._exact_sliced(unit, codec, rows[unit.index], rows_by_rank[unit.index], ws, bslots, out,
                                   rank, scale, group, report)
            else:
                self._exact(unit, codec, rows[unit.index], rows_by_rank[unit.index], sizes, ws, bslots, out,
                            rank, scale, group, report)
            covered.add(id(ws.fsdp_param))
            covered.update(id(b.fsdp_param) for b in bslots)

        dense = [s for s in slots if id(s.fsdp_param) not in covered]
        self._dense(dense, out, inp, chunk, S, group, op, report)

    def _scale(self, pg, group, reduce_dtype, device, op) -> float:
        """What FSDP's reduce-scatter (after its predivide) multiplies the sum of gradients by."""
        pre, _post, rs_op, _ = _get_gradient_divide_factors(group, None, reduce_dtype, device.type,
                                                            pg.gradient_divide_factor,
                                                            pg.force_sum_reduction_for_comms)
        scale = 1.0 / pre if pre else 1.0
        if rs_op == ReduceOp.AVG:
            return scale / group.size()
        if rs_op == ReduceOp.SUM:
            return scale
        return scale / float(pg.gradient_divide_factor)  # PREMUL_SUM(1/factor)

    def _rows(self, unit: FactorUnit) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Per use, this step's rows concatenated over calls (empty blocks when none)."""
        m, n = unit.param.shape
        dtype = unit.param.dtype
        out = []
        for capture in unit.uses:
            pairs = self._committed.pop(id(capture), [])
            if pairs:
                left = torch.cat([l for l, _ in pairs]) if len(pairs) > 1 else pairs[0][0]
                right = torch.cat([r for _, r in pairs]) if len(pairs) > 1 else pairs[0][1]
            elif capture.kind == "embedding":
                left = torch.zeros(0, dtype=torch.long, device=unit.param.device)
                right = torch.zeros(0, n, dtype=dtype, device=unit.param.device)
            else:
                left = torch.zeros(0, m, dtype=dtype, device=unit.param.device)
                right = torch.zeros(0, n, dtype=dtype, device=unit.param.device)
            out.append((left, right))
        return out

    def _exchange_counts(self, units, rows, group, report) -> Dict[int, List[List[int]]]:
        """Every rank's row count per unit and use (one small all-gather for the whole call)."""
        if not units:
            return {}
        mine = torch.tensor([l.shape[0] for u in units for l, _ in rows[u.index]], dtype=torch.int64,
                            device=units[0].param.device)
        handle = self._aggregator(group).all_gather(mine, name="dad.fsdp.rows",
                                                    first_dims=[mine.numel()] * group.size())
        gathered = [t.tolist() for t in handle.wait()]
        overhead = ShardedParamReport("dad.fsdp.row_counts", "overhead", (mine.numel(),))
        overhead.add_traffic(handle.traffic)
        report.params.append(overhead)
        out, k = {}, 0
        for u in units:
            nu = len(u.uses)
            out[u.index] = [g[k:k + nu] for g in gathered]
            k += nu
        return out

    def _verify(self, pg, units, rows, inp, chunk, S, weight_slots, bias_slots, group, report) -> List[FactorUnit]:
        """First call of a group: do the factors rebuild autograd's local gradient on every rank?
        Units that fail anywhere go dense for good."""
        pre = _get_gradient_divide_factors(group, None, inp.dtype, inp.device.type, pg.gradient_divide_factor,
                                           pg.force_sum_reduction_for_comms)[0] or 1.0
        view = inp.view(S, chunk)
        flags = torch.zeros(len(units), dtype=torch.float32, device=inp.device)
        for i, unit in enumerate(units):
            cdt = torch.float64 if unit.param.dtype == torch.float64 else torch.float32
            low = any(t.is_floating_point() and t.dtype not in VERIFY_TOLERANCE for pair in rows[unit.index]
                      for t in pair)
            tol = VERIFY_TOLERANCE_LOW_PRECISION if low else VERIFY_TOLERANCE.get(unit.param.dtype,
                                                                                 VERIFY_TOLERANCE_LOW_PRECISION)
            for p, mine in local_rebuild(unit, rows[unit.index], cdt).items():
                slot = weight_slots[unit.index] if p is unit.param else bias_slots.get(id(p))
                if slot is None:
                    continue
                local = _full_local(view, slot).to(cdt) * pre
                err = float((mine - local).norm())
                if err > tol * max(float(local.norm()), 1e-30) and err > 1e-12:
                    flags[i] = 1.0
        traffic = Traffic()
        handle = self._aggregator(group).all_reduce(flags, name="dad.fsdp.verify", op="sum")
        flags = handle.wait()
        traffic = traffic + handle.traffic
        overhead = ShardedParamReport("dad.fsdp.verify", "overhead", (len(units),))
        overhead.add_traffic(traffic)
        report.params.append(overhead)
        kept = []
        for unit, bad in zip(units, flags.tolist()):
            if bad:
                self._log_once(f"{unit.name}: its factors do not rebuild its local gradient on some rank "
                               f"(a use outside the captured layers?): FSDP's reduce-scatter from now on")
                unit.set_dense_only(True)
            else:
                kept.append(unit)
        return kept

    def _exact(self, unit, codec, rows, rows_by_rank, sizes, ws: _Slot, bslots: Sequence[_Slot], out, rank,
               scale, group, report) -> None:
        """All-gather the unit's factors; write this rank's rows of the average into ``out``."""
        handle = self._aggregator(group).all_gather(codec.encode(unit, rows), name=f"dad.fsdp.{unit.name}",
                                                    first_dims=sizes)
        buffers = handle.wait()
        shape = tuple(unit.param.shape)
        cdt = compute_dtype(unit.param)
        per_rank = [unpack(buf, exact_block_specs(unit.kinds, shape, r, codec.wire(unit)))
                    for buf, r in zip(buffers, rows_by_rank)]
        c = ws.rows
        a, b = min(rank * c, shape[0]), min((rank + 1) * c, shape[0])
        shard = torch.zeros((c,) + shape[1:], dtype=cdt, device=out.device)
        gathered = []
        for u, kind in enumerate(unit.kinds):
            left = torch.cat([blk[2 * u] for blk in per_rank])
            right = torch.cat([blk[2 * u + 1] for blk in per_rank]).to(cdt)
            if kind == "embedding":
                ids = left.long()
                keep = (ids >= a) & (ids < b)
                deterministic_index_add(shard, ids[keep] - a, right[keep])
            else:
                left = left.to(cdt)
                if b > a:
                    shard[:b - a].addmm_(left[:, a:b].t(), right)
            gathered.append((left, right))
        shard.mul_(scale)
        out[ws.offset:ws.offset + ws.numel].copy_(shard.reshape(-1))
        rep = ShardedParamReport(unit.name, "exact", shape, rows=sum(l.shape[0] for l, _ in rows),
                                 max_rows=max(sum(r) for r in rows_by_rank),
                                 allreduce_bytes=ring_allreduce_bytes(math.prod(shape) * out.element_size(),
                                                                      group.size()),
                                 reduce_scatter_bytes=(group.size() - 1) * ws.numel * out.element_size())
        rep.add_traffic(handle.traffic)
        report.params.append(rep)
        for bias in unit.biases:
            bs = next((s for s in bslots if s.fsdp_param.sharded_param is bias.param), None)
            if bs is None:
                continue
            u = unit.uses.index(bias.capture)
            d = output_grad_rows(bias.capture.kind, gathered[u])
            cb = bs.rows
            ab, bb = min(rank * cb, bs.shape[0]), min((rank + 1) * cb, bs.shape[0])
            value = torch.zeros(cb, dtype=cdt, device=out.device)
            value[:bb - ab] = d[:, ab:bb].sum(0)
            out[bs.offset:bs.offset + bs.numel].copy_(value.mul_(scale))
            report.params.append(ShardedParamReport(
                bias.name, "exact", bs.shape, allreduce_bytes=ring_allreduce_bytes(
                    math.prod(bs.shape) * out.element_size(), group.size()),
                reduce_scatter_bytes=(group.size() - 1) * bs.numel * out.element_size()))

    def _exact_sliced(self, unit, codec, rows, rows_by_rank, ws: _Slot, bslots: Sequence[_Slot], out, rank,
                      scale, group, report) -> None:
        """DESIGN section 4: every rank's ``right`` (all-gather, ``(S-1) N n``) and, from every rank,
        only this rank's columns ``a:b`` of ``left`` (all-to-all, ``(S-1)/S N m``); rebuild rows a:b."""
        S = group.size()
        shape = tuple(unit.param.shape)
        m, n = shape
        cdt = compute_dtype(unit.param)
        wire = codec.wire(unit)
        c = ws.rows
        a, b = min(rank * c, m), min((rank + 1) * c, m)
        nuses = len(unit.uses)
        counts = [[r[u] for r in rows_by_rank] for u in range(nuses)]      # per use, per rank
        longest = [max(cu) for cu in counts]
        # right: one all-gather of this rank's blocks of every use (padded to the longest rank)
        right_mine = torch.cat([rt.to(wire).reshape(-1) for _, rt in rows]) if rows else torch.zeros(0)
        handle = self._aggregator(group).all_gather(
            right_mine, name=f"dad.fsdp.{unit.name}.right",
            first_dims=[sum(counts[u][s] for u in range(nuses)) * n for s in range(S)])
        # left: to each rank d, columns [d c, (d+1) c) of every use, rows padded to the longest rank
        send = torch.zeros(S, sum(longest), c, dtype=wire, device=out.device)
        row0 = 0
        for u, (lt, _) in enumerate(rows):
            lt = lt.to(wire)
            for d in range(S):
                lo, hi = min(d * c, m), min((d + 1) * c, m)
                send[d, row0:row0 + lt.shape[0], :hi - lo] = lt[:, lo:hi]
            row0 += longest[u]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        a2a_bytes = (S - 1) * send[0].numel() * send.element_size()
        rights = handle.wait()
        shard = torch.zeros((c, n), dtype=cdt, device=out.device)
        d_sums = [None] * nuses
        for s in range(S):
            pos, row0 = 0, 0
            for u in range(nuses):
                k = counts[u][s]
                right = rights[s][pos:pos + k * n].view(k, n).to(cdt)
                left = recv[s, row0:row0 + k].to(cdt)                      # (k, c): columns a:b, padded
                pos += k * n
                row0 += longest[u]
                if k:
                    shard.addmm_(left.t(), right)
                    d = left if unit.kinds[u] == "linear" else right
                    d_sums[u] = d.sum(0) if d_sums[u] is None else d_sums[u] + d.sum(0)
        shard.mul_(scale)
        out[ws.offset:ws.offset + ws.numel].copy_(shard.reshape(-1))
        rep = ShardedParamReport(unit.name, "exact", shape, rows=sum(l.shape[0] for l, _ in rows),
                                 max_rows=max(sum(r) for r in rows_by_rank), method="sliced",
                                 allreduce_bytes=ring_allreduce_bytes(m * n * out.element_size(), S),
                                 reduce_scatter_bytes=(S - 1) * ws.numel * out.element_size())
        rep.add_traffic(handle.traffic)
        rep.add_traffic(Traffic(handed=send.numel() * send.element_size(), sent=a2a_bytes, received=a2a_bytes,
                                calls=1))
        report.params.append(rep)
        for bias in unit.biases:
            bs = next((s for s in bslots if s.fsdp_param.sharded_param is bias.param), None)
            if bs is None:
                continue
            u = unit.uses.index(bias.capture)
            cb = bs.rows
            value = torch.zeros(cb, dtype=cdt, device=out.device)
            if d_sums[u] is not None:
                if unit.kinds[u] == "linear":   # D's columns a:b are the bias' shard (same padding)
                    value.copy_(d_sums[u][:cb])
                else:                           # conv1d: D is whole; the bias is sharded on its own
                    ab, bb = min(rank * cb, bs.shape[0]), min((rank + 1) * cb, bs.shape[0])
                    value[:bb - ab] = d_sums[u][ab:bb]
            out[bs.offset:bs.offset + bs.numel].copy_(value.mul_(scale))
            report.params.append(ShardedParamReport(
                bias.name, "exact", bs.shape, allreduce_bytes=ring_allreduce_bytes(
                    math.prod(bs.shape) * out.element_size(), S),
                reduce_scatter_bytes=(S - 1) * bs.numel * out.element_size()))

    def _dense(self, dense: Sequence[_Slot], out, inp, chunk, S, group, op, report) -> None:
        """FSDP's own reduce-scatter, on a buffer holding only ``dense``'s chunks."""
        if not dense:
            return
        itemsize = inp.element_size()
        if sum(s.numel for s in dense) == chunk:   # nothing went by factors: the buffer as it is
            dist.reduce_scatter_tensor(out, inp, op=op, group=group)
        else:
            view = inp.view(S, chunk)
            compact = torch.cat([view[:, s.offset:s.offset + s.numel] for s in dense], dim=1).reshape(-1)
            result = torch.empty(compact.numel() // S, dtype=inp.dtype, device=inp.device)
            dist.reduce_scatter_tensor(result, compact, op=op, group=group)
            pos = 0
            for s in dense:
                out[s.offset:s.offset + s.numel].copy_(result[pos:pos + s.numel])
                pos += s.numel
        for s in dense:
            wire = (S - 1) * s.numel * itemsize
            report.params.append(ShardedParamReport(
                s.name, "dense", s.shape, handed_bytes=S * s.numel * itemsize, sent_bytes=wire,
                received_bytes=wire, allreduce_bytes=ring_allreduce_bytes(math.prod(s.shape) * itemsize, S),
                reduce_scatter_bytes=wire))


def _full_local(view: torch.Tensor, slot: _Slot) -> torch.Tensor:
    """This rank's whole local (unsharded) gradient of ``slot``'s parameter from FSDP's input buffer."""
    S = view.shape[0]
    block = view[:, slot.offset:slot.offset + slot.numel].reshape((S * slot.rows,) + slot.shape[1:])
    return block[:slot.shape[0]]
