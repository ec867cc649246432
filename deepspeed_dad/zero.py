"""dAD under DeepSpeed ZeRO-2 and ZeRO-3: each rank rebuilds only the gradient partition it keeps.

`attach` selects this for stages 2 and 3 (`ZeroDAD`). ZeRO reduces gradients during backward, in
buckets: a reduction call receives the local gradients of a set of parameters and produces this
rank's partition of their average. `deepspeed_dad.zero_seams` replaces exactly that call, per
stage, for the parameters factors cover; everything else (biases, norms, weights routed dense,
the partition bookkeeping, accumulation over micro-steps, clipping, the optimizer step and the
all-gather of updated parameters) stays DeepSpeed's.

Each call goes to `dad_integrations.exchange.sharded.ShardedExchanger` as a `ShardedCall`: row
counts, the first call's check, routes, residual flushes and the step's finiteness are the
exchanger's; here is ZeRO's side of it:

* routes are weighed on the real partition ranges (`_estimates`): under ZeRO-2 a weight often lies
  in one rank's partition, and that rank receives every site's factors, so the estimates are the
  busiest rank's bytes and ties go by the mean over ranks;
* exact factors and rank-dAD's ``(P_s^T, Q_s^T)`` (r rows of a linear use) travel together in one
  all-to-all per run of weights (`codecs.partition_exact`): rank d owning w rows of an ``m x n``
  weight receives ``sum_{s != d} N_s (n + w)`` for exact factors, ``sum_{s != d} r (n + w)`` for
  rank-dAD; each rank rebuilds the covering rows of its range and keeps its elements, scaled as
  DeepSpeed scales its reduction;
* PowerSGD's all-reduce route (P and Q all-reduced, ``2 (S-1)/S r (m+n)`` per rank, flat in S):
  each rank rebuilds only the covering rows of its owned elements (`sharded_rank.reduced_elements`).

Weights are handled as their matrix view ``(shape[0], prod(shape[1:]))``: a partition's row-major
element range is the same in the weight and in the view. Linear uses over row blocks (MHA's packed
``in_proj_weight``) take exact factors as whole-row uses do; blocks on other uses keep a unit off
them (`_takes_exact`). A step is a backward that reduces; it ends after the engine's backward
epilogue (ZeRO reduces its last bucket there), where every rank agrees: a route trial's span ends
and the rank routes' state is kept only if every rank's local gradients were finite. That state is
per rank: ``save_checkpoint`` / ``load_checkpoint`` write and read one file per rank
(`deepspeed_dad.checkpointing`). An adaptive rank is refused under ZeRO-2/3.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Sequence, Set, Tuple

import torch

from dad_integrations.capture.hooks import ForwardStartHook
from dad_integrations.capture.rows import compute_dtype
from dad_integrations.capture.units import FactorUnit, build_plan, param_shape
from dad_integrations.codecs.partition_exact import PartitionExactCodec, PartitionItem, Range, exchange_bytes
from dad_integrations.codecs.rank_allreduce import rank_allreduce_rounds
from dad_integrations.codecs.sharded_exact import sharded_exact_covers
from dad_integrations.codecs.sharded_rank import RankItem, reduced_elements
from dad_integrations.config import DADConfig
from dad_integrations.engines import banner
from dad_integrations.exchange.checks import VERIFY_TOLERANCE, VERIFY_TOLERANCE_LOW_PRECISION, check_same_model
from dad_integrations.exchange.sharded import CallRoutes, ShardedCall, ShardedExchanger, ShardedFacade
from dad_integrations.report import ShardedParamReport, ShardedStepReport
from dad_integrations.routing.costs import sharded_rank_allreduce_bytes
from dad_integrations.routing.router import UnitShape
from dad_integrations.routing.sharded_trial import agree_on

from .aggregator import DeepSpeedAggregator
from .checkpointing import RankStateCheckpoints

log = logging.getLogger(__name__)


def check_zero(engine: Any, config: DADConfig) -> List[str]:
    """What dAD cannot honour under ZeRO-2/3 (each problem names its setting); [] when fine."""
    stage = int(engine.zero_optimization_stage())
    zc = engine._config.zero_config
    opt = engine.optimizer
    problems: List[str] = []
    if config.adaptive_tolerance is not None:
        problems.append(f"dad.adaptive_tolerance is not supported under ZeRO-{stage} (ranks are padded to 'rank' "
                        f"so that no count exchange is needed); remove it")
    for name, setting in (("offload_optimizer", zc.offload_optimizer), ("offload_param", zc.offload_param)):
        device = getattr(setting, "device", None)
        if setting is not None and str(getattr(device, "value", device)) != "none":
            problems.append(f"zero_optimization.{name} (device {getattr(device, 'value', device)}) is not supported "
                            f"with dAD under ZeRO-{stage}: the offloaded reduction path is not replaced; remove it")
    for key in ("zero_quantized_gradients", "zero_quantized_weights", "zero_quantized_nontrainable_weights"):
        if getattr(zc, key, False):
            problems.append(f"ZeRO++ zero_optimization.{key}=true is not supported with dAD (ZeRO++ quantizes and "
                            f"reduces gradients with its own all-to-all); set it to false")
    if getattr(zc, "zero_hpz_partition_size", 1) > 1:
        problems.append(f"ZeRO++ zero_optimization.zero_hpz_partition_size={zc.zero_hpz_partition_size} is not "
                        f"supported with dAD (hierarchical partitions); set it to 1")
    if opt is not None and stage == 2:
        if getattr(opt, "use_grad_accum_attribute", False) or (
                getattr(opt, "gradient_accumulation_dtype", opt.dtype) != opt.dtype):
            problems.append("data_types.grad_accum_dtype different from the parameters' dtype is not supported with "
                            "dAD under ZeRO-2 (gradients are reduced into separate fp32 partition buffers); "
                            "remove data_types.grad_accum_dtype")
        if getattr(opt, "zenflow", False):
            problems.append("ZenFlow is not supported with dAD")
    inner = getattr(opt, "optimizer", None)
    if inner is not None and "Muon" in type(inner).__name__:
        problems.append("the Muon optimizer needs whole gradients on several ranks; not supported with dAD under "
                        "ZeRO-2/3")
    return problems


class ZeroDAD(RankStateCheckpoints, ShardedFacade):
    """dAD attached to one ZeRO-2/3 engine; made by `deepspeed_dad.attach`.

    Attributes:
        engine, zero_stage, config, aggregator (its `DeepSpeedAggregator`), plan (the factor units),
        exchanger (the `ShardedExchanger`).
    """

    def __init__(self, engine: Any, config: DADConfig, world_size: int):
        from .zero_seams import Zero2Seam, Zero3Seam
        self.engine = engine
        self.zero_stage = int(engine.zero_optimization_stage())
        self.config = config
        self.aggregator = DeepSpeedAggregator()
        self._world = world_size
        self._names = {id(p): n for n, p in engine.module.named_parameters()}
        self.plan = build_plan(engine.module, config)
        device = next((p.device for p in engine.module.parameters()), torch.device("cpu"))
        check_same_model(self.plan, self.aggregator, device)
        self._unit_of: Dict[int, FactorUnit] = {}
        for unit in self.plan.units:
            unit.biases.clear()  # a bias is its own ZeRO partition element range: DeepSpeed reduces it
            self._unit_of[id(unit.param)] = unit
        self.exchanger = ShardedExchanger(
            config, self.plan.units, engine=f"ZeRO-{self.zero_stage}", fallback="DeepSpeed's reduction",
            process_rank=self.aggregator.rank, world_size=world_size, logger=log,
            overhead_names={"counts": "dad.zero.counts", "verify": "dad.zero.verify", "finite": "dad.zero.finite"})
        self._codec = PartitionExactCodec(self.exchanger.wire, device)
        self.exchanger.start(self.aggregator, device, self.plan.units)
        # a step's span for route trials starts at the module's forward (ZeRO-3's all-gathers included)
        self._forward_hook = ForwardStartHook(engine.module, self.exchanger.trial.forward)
        # an exchange's factors (counted in fp32) stay under a quarter of ZeRO's own reduction bucket,
        # which it reduces in place: the send and receive buffers add at most about half a bucket
        bucket = 4 * int(getattr(engine.optimizer, "reduce_bucket_size", 0) or 0)
        self._chunk_bytes = min(config.bucket_cap_mb * 2 ** 20, bucket / 4 if bucket else float("inf"))
        self._new_backward = True
        self._originals: Dict[str, Any] = {}
        prologue, epilogue = engine._backward_prologue, engine._backward_epilogue

        def backward_prologue(*args: Any, **kwargs: Any) -> Any:
            self._new_backward = True  # the next reduction call opens this backward's step
            return prologue(*args, **kwargs)

        def backward_epilogue(*args: Any, **kwargs: Any) -> Any:
            out = epilogue(*args, **kwargs)  # ZeRO reduces its last bucket in here
            ex = self.exchanger               # (not after a raise: a collective then could hang)
            ex.end_rank_step(self.aggregator)
            # the step's reductions are over, on every rank: its span ends, a trial agrees here
            ex.trial.end(ex.steps - 1, agree_on(self.aggregator, self._codec.device))
            return out

        self._patch("_backward_prologue", backward_prologue)
        self._patch("_backward_epilogue", backward_epilogue)
        if self.keeps_state:
            self._patch_checkpoints()
        seam = Zero2Seam if self.zero_stage == 2 else Zero3Seam
        self._seam = seam(self, engine.optimizer)
        banner.announce(f"DeepSpeed ZeRO-{self.zero_stage}", process_rank=self.aggregator.rank, world_size=world_size,
                        mode=config.mode, rank=config.rank, objective=config.objective,
                        factor_weights=len(self._unit_of), dense_params=banner.dense_count(engine.module, self.units))
        if self.aggregator.rank == 0:
            log.info("dAD replaces ZeRO-%d's gradient reduction for %d weights (mode %s, wire dtype %s)",
                     self.zero_stage, len(self._unit_of), config.mode, config.wire_dtype or "gradients' dtype")

    @property
    def synchronizer(self) -> "ZeroDAD":
        """The object `dad_integrations.engines` hands out (``last_step_report``): this one."""
        return self

    @property
    def units(self) -> List[FactorUnit]:
        return self.plan.units

    @property
    def _trial(self):
        return self.exchanger.trial

    @property
    def _rank(self):
        return self.exchanger.rank_codec

    def detach(self) -> None:
        """Give the engine its own reduction back and remove dAD's hooks."""
        self._seam.remove()
        self._forward_hook.remove()
        for name in self._originals:
            self.engine.__dict__.pop(name, None)
        self._originals.clear()
        for capture in self.plan.captures:
            capture.remove()
        from .engine import ATTR
        if getattr(self.engine, ATTR, None) is self:
            delattr(self.engine, ATTR)

    close = detach

    def _patch(self, name: str, replacement: Callable) -> None:
        # an instance attribute shadows the class method for this engine only; detach() deletes it
        self._originals[name] = getattr(self.engine, name)
        setattr(self.engine, name, replacement)

    def reduce(self, params: Sequence[torch.nn.Parameter], local: Sequence[torch.Tensor],
               ranges: Sequence[Sequence[Range]], scale: float, itemsize: int, dtype: torch.dtype,
               deliver: Callable[[torch.nn.Parameter, torch.Tensor], None]) -> Set[int]:
        """Rebuild this rank's owned elements of the average of every factor-covered parameter of
        one reduction call and hand each to ``deliver(param, owned)`` as soon as it is rebuilt (so
        at most one weight's owned part is alive beside DeepSpeed's buffers); return the ``id`` of
        every parameter delivered. The others are left to DeepSpeed (and reported as dense).
        ``local[i]`` is the flattened local gradient of ``params[i]`` (``dtype``), ``ranges[i]``
        every rank's owned ``[lo, hi)`` of it, ``scale`` what DeepSpeed's reduction multiplies the
        sum by."""
        if self._new_backward or self.exchanger.report is None:
            self._new_backward = False
            self.exchanger.begin_step()
        call = _ZeroCall(self, params, local, ranges, scale, itemsize, dtype, deliver)
        self.exchanger.reduce(call)
        return call.delivered


class _ZeroCall(ShardedCall):
    """One ZeRO reduction call, as `ShardedExchanger.reduce` takes it."""

    def __init__(self, zd: ZeroDAD, params, local, ranges, scale: float, itemsize: int, dtype: torch.dtype,
                 deliver: Callable[[torch.nn.Parameter, torch.Tensor], None]):
        self.zd, self.params, self.scale, self.itemsize, self.dtype, self._deliver = (
            zd, params, scale, itemsize, dtype, deliver)
        self.aggregator, self.rank_codec, self.S = zd.aggregator, zd.exchanger.rank_codec, zd._world
        self.route_wire = zd.exchanger.wire or dtype
        self._units: List[FactorUnit] = []
        self.grads: Dict[int, torch.Tensor] = {}
        self.ranges: Dict[int, list] = {}
        for p, g, r in zip(params, local, ranges):
            unit = zd._unit_of.get(id(p))
            if unit is not None:
                self._units.append(unit)
                self.grads[unit.index], self.ranges[unit.index] = g, list(r)
        self.items: Dict[int, PartitionItem] = {}
        self.delivered: Set[int] = set()

    def units(self) -> List[FactorUnit]:
        return self._units

    def local_of(self, unit: FactorUnit) -> torch.Tensor:
        return self.grads[unit.index]

    def add_residual(self, unit: FactorUnit, residual: torch.Tensor) -> None:
        local = self.grads[unit.index]
        local.add_(residual.reshape(-1).to(local.dtype))

    def prepare(self, rows) -> None:
        self.rows = rows

    def item(self, unit: FactorUnit) -> PartitionItem:
        # the matrix view (a conv's 4-D weight as (C_out, C_in k k)): ZeRO's flat partitions cut
        # the row-major flattening, which is the view's, so covering rows are the view's rows
        if unit.index not in self.items:
            self.items[unit.index] = PartitionItem(unit.index, tuple(unit.kinds), unit.shape, self.ranges[unit.index],
                                                   self.rows[unit.index], blocks=unit.blocks)
        return self.items[unit.index]

    def agree_counts(self, units, rows):
        items = [self.item(u) for u in units]
        traffic = self.zd._codec.agree_counts(items, self.aggregator)
        return {it.key: it.rows_by_rank() for it in items}, traffic, len(items)

    def checkable(self, unit: FactorUnit) -> bool:
        return _takes_exact(unit)

    def verify(self, units, rows):
        """Do the factors rebuild this rank's owned part of each unit's local gradient, on every rank?"""
        me, flags = self.aggregator.rank, []
        cdt = torch.float64 if self.dtype == torch.float64 else torch.float32
        for unit in units:
            it = self.item(unit)
            mine = self.zd._codec.local(it, me, cdt)
            lo, hi = it.ranges[me]
            autograd = self.grads[it.key][lo:hi].to(cdt) if hi > lo else mine
            low = self.dtype not in VERIFY_TOLERANCE or any(
                t.is_floating_point() and t.dtype not in VERIFY_TOLERANCE for pair in it.rows for t in pair)
            tol = VERIFY_TOLERANCE_LOW_PRECISION if low else VERIFY_TOLERANCE[self.dtype]
            err = float((mine - autograd).norm())
            flags.append(0.0 if err <= tol * max(float(autograd.norm()), 1e-30) or err <= 1e-12 else 1.0)
        handle = self.aggregator.all_reduce(torch.tensor(flags, device=self.zd._codec.device), name="dad.zero.verify")
        return [u for u, bad in zip(units, handle.wait().tolist()) if bad], handle.traffic

    def unit_shape(self, unit: FactorUnit) -> UnitShape:
        return UnitShape(tuple(unit.kinds), unit.shape, 0, self.dtype, unit.blocks)

    def estimates(self, unit: FactorUnit, counts):
        return self._estimates(self.item(unit), _takes_exact(unit))

    def reduce_dense(self, report: ShardedStepReport) -> None:
        for p in self.params:
            report.params.append(self._report(self.zd._names.get(id(p), "?"), "dense", p))

    def _report(self, name: str, representation: str, p: torch.nn.Parameter) -> ShardedParamReport:
        # DeepSpeed's reduce-scatter moves (S-1) of S pieces of ceil(numel/S) elements per rank
        shape = param_shape(p)
        numel = 1
        for d in shape:
            numel *= d
        return ShardedParamReport.of_shard(name, representation, tuple(shape), -(-numel // self.S), self.S,
                                           self.itemsize)

    def deliver(self, unit: FactorUnit, owned: torch.Tensor) -> None:
        self._deliver(unit.param, owned)
        self.delivered.add(id(unit.param))

    def exchange(self, routes: CallRoutes) -> None:
        report = routes.report
        routed: List[PartitionItem] = []   # exact factors, or (rank-dAD) P_s^T and Q_s^T as rows
        ranked: Dict[int, Tuple[int, str]] = {}   # components sent, how M_s was reduced
        shared: List[Tuple[FactorUnit, RankItem]] = []   # PowerSGD's all-reduce route
        for unit, rep in routes.routed:
            if rep == "exact":
                routed.append(self.item(unit))
            elif rep == "rank":
                item, components, method = self._rank_item(unit, routes.step)
                routed.append(item)
                ranked[unit.index] = (components, method)
            else:
                local = self.grads[unit.index].view(*unit.shape)
                shared.append((unit, self.rank_codec.local(unit, self.item(unit).rows,
                                                           lambda p, cdt: local.to(cdt), "rank_allreduce")))
        if shared:
            self._reduce_shared(shared, routes.step, report)
        units = {u.index: u for u in self._units}
        for chunk in _chunks(routed, self.zd._chunk_bytes):
            # one all-to-all per chunk: a whole DeepSpeed bucket's factors at once would hold all of
            # their send and receive buffers together (1.25x ZeRO's own peak at 4096 rows per rank)
            traffic = self.zd._codec.exchange(chunk, self.aggregator, compute_dtype(units[chunk[0].key].param),
                                              self.scale, lambda key, owned: self.deliver(units[key], owned))
            for it in chunk:
                unit = units[it.key]
                rep = self._report(unit.name, "rank" if it.key in ranked else "exact", unit.param)
                rep.rows = sum(left.shape[0] for left, _ in self.item(unit).rows)
                rep.max_rows = max(sum(k) for k in it.rows_by_rank())
                rep.method = "partition"
                if it.key in ranked:
                    rep.components, rep.method = ranked[it.key]
                rep.add_traffic(traffic[it.key])
                report.params.append(rep)
        for p in self.params:
            if id(p) not in self.delivered:
                report.params.append(self._report(self.zd._names.get(id(p), "?"), "dense", p))

    def _estimates(self, it: PartitionItem, exact: bool) -> Tuple[Dict[str, float], Dict[str, float]]:
        """Each route's bytes for one weight on its busiest rank, and sent per rank on average (what
        breaks a tie: at two sites rank-dAD and PowerSGD's route tie on a weight one rank owns,
        while rank-dAD's other rank receives nothing), from the real partition ranges (the same on
        every rank): DeepSpeed's reduce-scatter, exact factors where the counts were agreed, and with
        a ``rank``, rank-dAD's r rows (`partition_exact.exchange_bytes`) and PowerSGD's all-reduced
        P and Q, once per power iteration. ``exact`` False (`_takes_exact`) leaves "exact" out, so
        that no mode picks it."""
        S, wire, config = self.S, self.route_wire, self.zd.config
        numel = it.shape[0] * it.shape[1]
        dense = float((S - 1) * -(-numel // S) * self.itemsize)
        busiest, mean = {"dense": dense}, {"dense": dense}
        if exact and it.counts:
            busiest["exact"], mean["exact"] = exchange_bytes(it.kinds, it.shape, it.counts, it.ranges, wire, it.blocks)
        if self.rank_codec is not None:
            r = min(config.rank, *it.shape)
            busiest["rank"], mean["rank"] = exchange_bytes(("linear",), it.shape, [[[r]]] * S, it.ranges, wire)
            busiest["rank_allreduce"] = mean["rank_allreduce"] = rank_allreduce_rounds(config) * float(
                sharded_rank_allreduce_bytes(it.shape, r, wire, S))
        return busiest, mean

    def _rank_item(self, unit: FactorUnit, step: int) -> Tuple[PartitionItem, int, str]:
        """Rank-dAD's local half for one weight: this site's ``M_s`` (local gradient plus residual)
        reduced to rank r, as r rows ``(P_s^T, Q_s^T)`` of a linear use, for the same partition
        exchange as exact factors: rank d receives every site's ``Q_s`` and the columns of ``P_s^T``
        over its covering rows. Returns that item, the components this site sent and how it reduced."""
        it, local = self.item(unit), self.grads[unit.index].view(*unit.shape)
        ranked = self.rank_codec.local(unit, it.rows, lambda p, cdt: local.to(cdt), "rank")
        p, q, components = self.rank_codec.reduce_own(ranked, step)
        item = PartitionItem(it.key, ("linear",), it.shape, it.ranges, [(p.t(), q.t())])
        item.counts = [[[p.shape[1]]] for _ in range(self.S)]  # padded to r everywhere: no count exchange
        return item, components, ranked.method

    def _reduce_shared(self, shared: Sequence[Tuple[FactorUnit, RankItem]], step: int,
                       report: ShardedStepReport) -> None:
        """PowerSGD's exchange for the all-reduce-routed weights of one call; each rank rebuilds
        only the covering rows of its owned elements of ``scale P^ Q'^T`` and delivers those."""
        me = self.aggregator.rank

        def owned(item: RankItem, basis: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
            return reduced_elements(basis, q, *self.ranges[item.unit.index][me], self.scale)

        results = self.rank_codec.exchange([ri for _, ri in shared], self.aggregator, self.scale, step,
                                           self.route_wire, rebuild=owned)
        for (unit, ri), res in zip(shared, results):
            self.deliver(unit, res.shard)
            rep = self._report(unit.name, "rank_allreduce", unit.param)
            rep.rows = sum(left.shape[0] for left, _ in self.item(unit).rows)
            rep.components, rep.method = res.components, ri.method
            rep.add_traffic(res.traffic)
            report.params.append(rep)


def _takes_exact(unit: FactorUnit) -> bool:
    """Whether the partition exchange of exact factors can carry ``unit``: uses over whole rows or
    linear uses over row blocks (`codecs.partition_exact` slices every use's left by the covering
    rows of the matrix view it meets; `codecs.sharded_exact.sharded_exact_covers`). Units without
    uses (PowerSGD's floor) go dense or by a rank route."""
    return sharded_exact_covers(unit.kinds, unit.blocks)


def _chunks(items: Sequence[PartitionItem], cap_bytes: float) -> List[List[PartitionItem]]:
    """``items`` in order, cut into runs whose factors (every rank's rows, ``m + n`` numbers each,
    fp32) stay under ``cap_bytes``; an item larger than the cap is a run of its own. Decided on
    agreed counts, so every rank cuts the same runs."""
    runs: List[List[PartitionItem]] = []
    size = 0.0
    for it in items:
        nbytes = sum(sum(r) for r in it.rows_by_rank()) * (it.shape[0] + it.shape[1]) * 4.0
        if not runs or size + nbytes > cap_bytes:
            runs.append([])
            size = 0.0
        runs[-1].append(it)
        size += nbytes
    return runs
