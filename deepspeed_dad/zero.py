"""dAD under DeepSpeed ZeRO-2 and ZeRO-3: each rank rebuilds only the gradient partition it keeps.

`attach` selects this for stages 2 and 3 (`ZeroDAD`). ZeRO reduces gradients during backward, in
buckets: a reduction call receives the local gradients of a set of parameters and produces this
rank's partition of their average. `deepspeed_dad.zero_seams` replaces exactly that call, per
stage, for the parameters factors cover; everything else (biases, norms, weights routed dense,
the partition bookkeeping, accumulation over micro-steps, clipping, the optimizer step and the
all-gather of updated parameters) stays DeepSpeed's. Per call (`ZeroDAD.reduce`):

1. the factors of each covered weight in the call: the rows its captures hold (all uses, all
   calls of this backward), and every rank's owned element range of the flattened weight;
2. one all-gather of the row counts (and, for embedding uses, of the ids per owner);
3. on the first call of each weight, the check that its factors rebuild this rank's owned part of
   its local gradient (`verify_first_step`; agreed by an all-reduce of flags, a failure sends the
   weight through DeepSpeed's reduction for good);
4. per weight, the route (`router.route`): ``exact``; in ``auto`` whichever of exact factors, the
   dense reduce-scatter and (with a ``rank``) the two rank routes moves fewest bytes on the
   weight's busiest rank, sized from the agreed counts and the real partition ranges (`_estimates`:
   under ZeRO-2 a weight often lies in one rank's partition, and that rank receives every site's
   factors); in ``rank``, the rank route ``rank_route`` names (by bytes where it is ``auto``);
5. for a rank-dAD weight (``rank_route: allgather``), this site's local gradient plus its
   error-feedback residual reduced to rank r, ``M_s ~= P_s Q_s^T`` (`codecs.sharded_rank
   .ShardedRankCodec`: power iteration, warm start, residual), which is a sum of r outer products:
   ``(P_s^T, Q_s^T)`` travel as r factor rows;
6. one all-to-all (`codecs.partition_exact`) per run of weights, exact factors and rank-r rows
   alike; each rank rebuilds the covering rows of its range and keeps its elements, scaled as
   DeepSpeed scales its reduction. A rank d owning w rows of an ``m x n`` weight receives
   ``sum_{s != d} r (n + w)`` for it in rank-dAD, ``sum_{s != d} N_s (n + w)`` for exact factors;
7. for a weight on PowerSGD's all-reduce route (``rank_route: allreduce``, or ``auto`` where it is
   fewer bytes: from a few sites on, since rank-dAD's exchange grows with S and this one does
   not), P and Q all-reduced, ``2 (S-1)/S r (m+n)`` per rank, and each rank rebuilds the covering
   rows of its owned elements of ``P^ Q'^T`` (`sharded_rank.reduced_elements`).

Weights are handled as their matrix view ``(shape[0], prod(shape[1:]))`` (`FactorUnit.shape`): a
partition's row-major element range is the same in the weight and in the view. Units without uses
(PowerSGD's coverage floor: raw ``nn.Parameter``s, convolutions no kind captures) skip steps 2 and
3 and go by DeepSpeed's reduction or a rank route from their dense local gradient. Linear uses over
row blocks (MHA's packed ``in_proj_weight`` called on its q/k/v slices) take exact factors as
whole-row uses do: each block's left columns go to the ranks whose covering rows they meet
(`codecs.partition_exact.use_span`); blocks on other uses keep a unit off them (`_takes_exact`:
"exact" is left out of its estimates, so no mode picks it, and no rebuild checks it).

Every rank makes the same calls with the same parameters in the same order (DeepSpeed's buckets
agree across ranks), so the collectives of steps 2, 3, 6 and 7 match. The report of a backward
(`last_step_report`) lists each parameter's bytes beside what DeepSpeed's reduce-scatter of it
would move.

Route trials (`dad_integrations.routing.sharded_trial`: by time, on a measured link, in mode auto): a step's
span runs from the module's forward (a forward pre-hook) to the end of the engine's backward
epilogue (ZeRO's last bucket is reduced there), where every rank agrees; a step is a backward that
reduces (with gradient accumulation, a micro-step). On a dense step, and after all dense is decided
until the next refresh, every weight goes by DeepSpeed's reduction, capture off (a trial's dense
steps hold the residuals for its routes steps; all dense decided flushes them into it).

Rank-dAD's residuals and warm starts are kept only once the backward is over and every rank's local
gradients were finite (the wrapped ``_backward_epilogue``: one all-reduce of one number), as under
FSDP2; they are per rank, so ``save_checkpoint`` / ``load_checkpoint`` write and read one file per
rank (`deepspeed_dad.checkpointing`). The residual is one unsharded ``m x n`` buffer per rank-routed
weight (a site compresses its whole local gradient), what ZeRO saves by sharding gradients error
feedback spends again; ``error_feedback_rank: q`` keeps its rank-q part (``q (m+n)`` numbers) and
``error_feedback: false`` frees it. An adaptive rank is refused under ZeRO-2/3.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from dad_integrations.config import WIRE_DTYPES, DADConfig
from dad_integrations.engines import banner
from dad_integrations.capture.hooks import ForwardStartHook
from dad_integrations.exchange.checks import VERIFY_TOLERANCE, VERIFY_TOLERANCE_LOW_PRECISION, check_same_model
from dad_integrations.codecs.partition_exact import PartitionExactCodec, PartitionItem, Range, exchange_bytes
from dad_integrations.codecs.rank_allreduce import rank_allreduce_rounds
from dad_integrations.codecs.sharded_rank import RankItem, ShardedRankCodec, load_rank_route_state, reduced_elements
from dad_integrations.codecs.sharded_exact import sharded_exact_covers
from dad_integrations.routing.costs import sharded_rank_allreduce_bytes
from dad_integrations.codecs.error_feedback import sharded_residual_note
from dad_integrations.capture.layers import compute_dtype, concat_rows
from dad_integrations.report import ShardedParamReport, ShardedStepReport
from dad_integrations.routing.router import UnitShape, RouteContext, UnitEvidence, route, sharded_needs_counts
from dad_integrations.routing.sharded_trial import ShardedTrial, TimedRoutes, agree_on
from dad_integrations.capture.units import FactorUnit, build_plan, param_shape

from .aggregator import DeepSpeedAggregator
from .checkpointing import RankStateCheckpoints

log = logging.getLogger(__name__)
ZERO_STATE_VERSION = 1


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


class ZeroDAD(RankStateCheckpoints, TimedRoutes):
    """dAD attached to one ZeRO-2/3 engine; made by `deepspeed_dad.attach`.

    Attributes:
        engine, zero_stage, config, aggregator (its `DeepSpeedAggregator`), plan (the factor units).
    """

    def __init__(self, engine: Any, config: DADConfig, world_size: int):
        from .zero_seams import Zero2Seam, Zero3Seam
        self.engine = engine
        self.zero_stage = int(engine.zero_optimization_stage())
        self.config = config
        self.aggregator = DeepSpeedAggregator()
        self._world = world_size
        self._wire = WIRE_DTYPES[config.wire_dtype]
        self._names = {id(p): n for n, p in engine.module.named_parameters()}
        self.plan = build_plan(engine.module, config)
        device = next((p.device for p in engine.module.parameters()), torch.device("cpu"))
        check_same_model(self.plan, self.aggregator, device)
        self._unit_of: Dict[int, FactorUnit] = {}
        for unit in self.plan.units:
            unit.biases.clear()  # a bias is its own ZeRO partition element range: DeepSpeed reduces it
            self._unit_of[id(unit.param)] = unit
        self._codec = PartitionExactCodec(self._wire, device)
        # rank routes: rank-dAD's own factors by the partition exchange (`_rank_item`), PowerSGD's
        # all-reduced P and Q rebuilt over each rank's owned elements (`_reduce_shared`)
        self._rank = ShardedRankCodec(config, self._wire) if config.rank is not None else None
        self._rank_in_step = False
        # objective "time": the models (matrix views), and route trials on a measured link
        self._trial = ShardedTrial(config, f"dAD/ZeRO-{self.zero_stage}", log_decisions=self.aggregator.rank == 0)
        self._trial.start(self.plan.units, self.aggregator, device)
        # a step's span for route trials starts at the module's forward (ZeRO-3's all-gathers included)
        self._forward_hook = ForwardStartHook(engine.module, self._trial.forward)
        # an exchange's factors (counted in fp32) stay under a quarter of ZeRO's own reduction bucket,
        # which it reduces in place: the send and receive buffers add at most about half a bucket
        bucket = 4 * int(getattr(engine.optimizer, "reduce_bucket_size", 0) or 0)
        self._chunk_bytes = min(config.bucket_cap_mb * 2 ** 20, bucket / 4 if bucket else float("inf"))
        self._verified: set = set()
        self._logged: set = set()
        self._report: Optional[ShardedStepReport] = None
        self._new_backward = True
        self._steps = 0
        self._originals: Dict[str, Any] = {}
        prologue, epilogue = engine._backward_prologue, engine._backward_epilogue

        def backward_prologue(*args: Any, **kwargs: Any) -> Any:
            self._new_backward = True  # the next reduction call opens this backward's report
            return prologue(*args, **kwargs)

        def backward_epilogue(*args: Any, **kwargs: Any) -> Any:
            out = epilogue(*args, **kwargs)  # ZeRO reduces its last bucket in here
            self._end_rank_step()            # not after a raise: a collective then could hang
            # the step's reductions are over, on every rank: its span ends, a trial agrees here
            self._trial.end(self._steps - 1, agree_on(self.aggregator, self._codec.device))
            return out

        self._patch("_backward_prologue", backward_prologue)
        self._patch("_backward_epilogue", backward_epilogue)
        if self.keeps_state:
            self._patch_checkpoints()
        seam = Zero2Seam if self.zero_stage == 2 else Zero3Seam
        self._seam = seam(self, engine.optimizer)
        units = list(self._unit_of.values())
        banner.announce(f"DeepSpeed ZeRO-{self.zero_stage}", process_rank=self.aggregator.rank, world_size=world_size,
                        mode=config.mode, rank=config.rank, objective=config.objective,
                        factor_weights=len(units), dense_params=banner.dense_count(engine.module, units))
        if self.aggregator.rank == 0:
            log.info("dAD replaces ZeRO-%d's gradient reduction for %d weights (mode %s, wire dtype %s)",
                     self.zero_stage, len(self._unit_of), config.mode, config.wire_dtype or "gradients' dtype")
            units = self.plan.units
            note = sharded_residual_note(config, [u.shape for u in units], world_size,
                                         units[0].param.element_size() if units else 4)
            if note is not None:
                log.warning("dAD/ZeRO-%d: %s", self.zero_stage, note)

    # -- public ---------------------------------------------------------------------------------
    @property
    def synchronizer(self) -> "ZeroDAD":
        """The object `dad_integrations.engines` hands out (``last_step_report``): this one."""
        return self

    @property
    def units(self) -> List[FactorUnit]:
        return self.plan.units

    def last_step_report(self) -> Optional[ShardedStepReport]:
        """The report of the latest backward that reduced gradients (None before the first):
        per parameter its bytes, beside DeepSpeed's reduce-scatter (``reduce_scatter_bytes``)."""
        return self._report

    @property
    def keeps_state(self) -> bool:
        """Whether `state_dict` holds anything between steps: only the rank route does (error-feedback
        residuals, warm starts; then ``save_checkpoint`` / ``load_checkpoint`` carry it per rank)."""
        return self._rank is not None

    def state_dict(self) -> dict:
        """This rank's dAD state: the backwards taken (``lossless_steps`` counts them) and, per
        rank-routed weight, its warm start and residual (they differ across ranks: saved per rank)."""
        return {"version": ZERO_STATE_VERSION, "steps": self._steps,
                "rank_routes": self._rank.state_dict() if self._rank is not None else {}}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`'s state (call it between steps). Raises, naming them, for weights this
        model does not have, or rank-route state without a ``rank`` in the config."""
        if state.get("version") != ZERO_STATE_VERSION:
            raise ValueError(f"dAD/ZeRO state of version {state.get('version')!r}, expected {ZERO_STATE_VERSION}")
        load_rank_route_state(self._rank, dict(state.get("rank_routes") or {}),
                              {u.name: u.param for u in self.plan.units})
        self._steps = int(state.get("steps", 0))
        self._trial.cancel()  # every rank loads alike: a trial in progress ends on all of them

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

    # -- the reduction ----------------------------------------------------------------------------
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
        S = self._world
        if self._new_backward or self._report is None:
            self._new_backward = False
            self._steps += 1
            self._report = ShardedStepReport(self._steps, S)
            if self._rank is not None:
                self._rank.start_step()
            self._trial.open(self._steps - 1)
        report = self._report
        if self._trial.dense(self._steps - 1):  # a route trial's dense step, or all dense decided
            hold = self._trial.holds_residuals(self._steps - 1)
            for p, g in zip(params, local):
                unit = self._unit_of.get(id(p))
                if unit is not None and not unit.dense_only:
                    for c in unit.uses:
                        c.take()  # (capture is off from the step after the decision)
                    if not hold:
                        self._flush_residual(unit, g)  # it rides DeepSpeed's own reduction
                report.params.append(_param_report(self._names.get(id(p), "?"), "dense", param_shape(p), S,
                                                   itemsize, dense=True))
            return set()
        items: List[PartitionItem] = []
        grads: Dict[int, torch.Tensor] = {}
        for p, g, r in zip(params, local, ranges):
            unit = self._unit_of.get(id(p))
            if unit is None:
                continue
            # the matrix view (a conv's 4-D weight as (C_out, C_in k k)): ZeRO's flat partitions cut
            # the row-major flattening, which is the view's, so covering rows are the view's rows
            shape = unit.shape
            rows = [concat_rows(c.take(), c.kind, shape, p, c.block) for c in unit.uses]
            if unit.dense_only:
                continue
            items.append(PartitionItem(unit.index, tuple(unit.kinds), shape, list(r), rows, blocks=unit.blocks))
            grads[unit.index] = g
        by_key = {u.index: u for u in self.plan.units}
        # units without uses (PowerSGD's floor) have no rows: no counts, no check
        factored = [it for it in items if it.kinds]
        if factored and sharded_needs_counts(self.config, self._steps - 1):
            traffic = self._codec.agree_counts(factored, self.aggregator)
            report.params.append(_overhead("dad.zero.counts", len(factored), traffic))
        if items:
            items = self._verify(items, grads, by_key, report, dtype)
        routed: List[PartitionItem] = []   # exact factors, or (rank-dAD) P_s^T and Q_s^T as rows
        ranked: Dict[int, Tuple[int, str]] = {}   # components sent, how M_s was reduced
        shared: List[Tuple[PartitionItem, RankItem]] = []   # PowerSGD's all-reduce route
        timing = self._trial.models(self.aggregator, self._codec.device, self._steps - 1) if items else None
        for it in items:
            unit = by_key[it.key]
            busiest, mean = self._estimates(it, itemsize, self._wire or dtype, _takes_exact(unit))
            decision = route(RouteContext(self.config, world_size=S, wire_dtype=self._wire or dtype, sharded=True, step=self._steps - 1, timing=timing), UnitShape(it.kinds, it.shape, 0, dtype, unit.blocks), UnitEvidence(rows_by_rank=it.rows_by_rank() or None, estimates=busiest, ties=mean))
            self._trial.note(unit, decision)
            if decision.representation not in ("rank", "rank_allreduce") and self._flush_residual(
                    unit, grads[it.key]):
                continue  # its residual rides DeepSpeed's own reduction this step
            if decision.representation == "exact":
                routed.append(it)
            elif decision.representation == "rank":
                item, components, method = self._rank_item(it, by_key[it.key], grads[it.key])
                routed.append(item)
                ranked[it.key] = (components, method)
            elif decision.representation == "rank_allreduce":
                shared.append((it, self._shared_item(it, by_key[it.key], grads[it.key])))
        delivered: Set[int] = set()
        if shared:
            for unit, rep in self._reduce_shared(shared, by_key, scale, dtype, itemsize, deliver):
                delivered.add(id(unit.param))
                report.params.append(rep)
        for chunk in _chunks(routed, self._chunk_bytes):
            # one all-to-all per chunk: a whole DeepSpeed bucket's factors at once would hold all of
            # their send and receive buffers together (1.25x ZeRO's own peak at 4096 rows per rank)
            traffic = self._codec.exchange(chunk, self.aggregator, compute_dtype(by_key[chunk[0].key].param), scale,
                                           lambda key, owned: deliver(by_key[key].param, owned))
            for it in chunk:
                unit = by_key[it.key]
                delivered.add(id(unit.param))
                rep = _param_report(unit.name, "rank" if it.key in ranked else "exact", param_shape(unit.param), S,
                                    itemsize)
                rep.rows = sum(left.shape[0] for left, _ in it.rows)
                rep.max_rows = max(sum(k) for k in it.rows_by_rank())
                rep.method = "partition"
                if it.key in ranked:
                    rep.components, rep.method = ranked[it.key]
                rep.add_traffic(traffic[it.key])
                report.params.append(rep)
        for p in params:
            if id(p) not in delivered:
                report.params.append(_param_report(self._names.get(id(p), "?"), "dense", param_shape(p), S, itemsize,
                                                   dense=True))
        return delivered

    def _flush_residual(self, unit: FactorUnit, local: torch.Tensor) -> bool:
        """A weight off the rank routes with an error-feedback residual left (its route changed:
        rows fell, or objective "time" chose again): add the residual to its flattened local
        gradient, which DeepSpeed's own reduction then averages, so that the average carries the
        mean residual, what the ranks still owed (`fsdp.FSDPDADSynchronizer._flush_residual`'s rule). Every
        rank took the same routes, so every rank holds a residual for the same weights."""
        residual = self._rank.flush(unit.name) if self._rank is not None else None
        if residual is None:
            return False
        # the step's finiteness decides whether the flushed residual was sent or is owed again
        self._rank_in_step = True
        self._rank.note_local(local)
        local.add_(residual.reshape(-1).to(local.dtype))
        return True

    def _estimates(self, it: PartitionItem, itemsize: int, wire: torch.dtype, exact: bool = True
                   ) -> Tuple[Dict[str, float], Dict[str, float]]:
        """Each route's bytes for one weight on its busiest rank, and sent per rank on average (what
        breaks a tie: at two sites rank-dAD and PowerSGD's route tie on a weight one rank owns,
        while rank-dAD's other rank receives nothing), from the real partition ranges (the same on
        every rank): DeepSpeed's reduce-scatter, exact factors where the counts were agreed, and with
        a ``rank``, rank-dAD's r rows (`partition_exact.exchange_bytes`) and PowerSGD's all-reduced
        P and Q, once per power iteration (alike on every rank). ``exact`` False (a unit without
        uses, or with row blocks on a non-linear use: `_takes_exact`) leaves "exact" out, so that no mode picks it."""
        S = self._world
        numel = it.shape[0] * it.shape[1]
        dense = float((S - 1) * -(-numel // S) * itemsize)
        busiest, mean = {"dense": dense}, {"dense": dense}
        if exact and it.counts:
            busiest["exact"], mean["exact"] = exchange_bytes(it.kinds, it.shape, it.counts, it.ranges, wire, it.blocks)
        if self._rank is not None:
            r = min(self.config.rank, *it.shape)
            busiest["rank"], mean["rank"] = exchange_bytes(("linear",), it.shape, [[[r]]] * S, it.ranges, wire)
            rounds = rank_allreduce_rounds(self.config)  # P and Q all-reduced once per power iteration
            busiest["rank_allreduce"] = mean["rank_allreduce"] = rounds * float(
                sharded_rank_allreduce_bytes(it.shape, r, wire, S))
        return busiest, mean

    def _rank_item(self, it: PartitionItem, unit: FactorUnit, local: torch.Tensor
                   ) -> Tuple[PartitionItem, int, str]:
        """Rank-dAD's local half for one weight: this site's ``M_s`` (local gradient plus residual)
        reduced to rank r (`ShardedRankCodec`: warm start, error feedback kept until the backward is
        over), as r rows ``(P_s^T, Q_s^T)`` of a linear use, for the same partition exchange as
        exact factors: rank d receives every site's ``Q_s`` and the columns of ``P_s^T`` over its
        covering rows. Returns that item, the components this site sent and how it reduced."""
        m, n = it.shape
        self._rank_in_step = True
        self._rank.note_local(local)
        ranked = self._rank.local(unit, it.rows, lambda p, cdt: local.view(m, n).to(cdt), "rank")
        p, q, components = self._rank.reduce_own(ranked, self._steps - 1)
        item = PartitionItem(it.key, ("linear",), it.shape, it.ranges, [(p.t(), q.t())])
        item.counts = [[[p.shape[1]]] for _ in range(self._world)]  # padded to r everywhere: no count exchange
        return item, components, ranked.method

    def _shared_item(self, it: PartitionItem, unit: FactorUnit, local: torch.Tensor) -> RankItem:
        """The all-reduce route's local half for one weight: ``M_s`` (local gradient plus residual)."""
        m, n = it.shape
        self._rank_in_step = True
        self._rank.note_local(local)
        return self._rank.local(unit, it.rows, lambda p, cdt: local.view(m, n).to(cdt), "rank_allreduce")

    def _reduce_shared(self, shared: Sequence[Tuple[PartitionItem, RankItem]], by_key: Dict[int, FactorUnit],
                       scale: float, dtype: torch.dtype, itemsize: int,
                       deliver: Callable[[torch.nn.Parameter, torch.Tensor], None]
                       ) -> List[Tuple[FactorUnit, ShardedParamReport]]:
        """PowerSGD's exchange for the all-reduce-routed weights of one call (P all-reduced, made
        orthonormal, Q all-reduced: ``2 (S-1)/S r (m+n)`` per rank, flat in S); each rank rebuilds
        only the covering rows of its owned elements of ``scale P^ Q'^T`` and delivers those."""
        me, S = self.aggregator.rank, self._world
        ranges = {it.key: it.ranges[me] for it, _ in shared}

        def owned(item: RankItem, basis: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
            return reduced_elements(basis, q, *ranges[item.unit.index], scale)

        results = self._rank.exchange([ri for _, ri in shared], self.aggregator, scale, self._steps - 1,
                                      self._wire or dtype, rebuild=owned)
        out = []
        for (it, ri), res in zip(shared, results):
            unit = by_key[it.key]
            deliver(unit.param, res.shard)
            rep = _param_report(unit.name, "rank_allreduce", param_shape(unit.param), S, itemsize)
            rep.rows = sum(left.shape[0] for left, _ in it.rows)
            rep.components, rep.method = res.components, ri.method
            rep.add_traffic(res.traffic)
            out.append((unit, rep))
        return out

    def _end_rank_step(self) -> None:
        """After a backward whose reductions took rank routes (or flushed a residual): keep its residuals and warm starts
        if every rank's local gradients were finite (one all-reduce of one number), else keep the
        backward before's, on every rank alike (a step a loss scaler skips leaves no trace)."""
        if self._rank is None or not self._rank_in_step:
            return
        self._rank_in_step = False
        traffic = self._rank.end_step(self.aggregator)
        if self._report is not None:
            self._report.params.append(_overhead("dad.zero.finite", 1, traffic))

    def _verify(self, items: List[PartitionItem], grads: Dict[int, torch.Tensor], by_key: Dict[int, FactorUnit],
                report: ShardedStepReport, dtype: torch.dtype) -> List[PartitionItem]:
        """The first call of each weight: do its factors rebuild this rank's owned part of its local
        gradient, on every rank? Those that fail go through DeepSpeed's reduction from now on."""
        # only units that may take exact factors (`_takes_exact`) are checked: the others' routes
        # (dense, rank from the dense gradient) never read their rows
        todo = [it for it in items if it.key not in self._verified and _takes_exact(by_key[it.key])
                ] if self.config.verify_first_step else []
        if not todo:
            return items
        me = self.aggregator.rank
        flags = []
        for it in todo:
            cdt = torch.float64 if dtype == torch.float64 else torch.float32
            mine = self._codec.local(it, me, cdt)
            lo, hi = it.ranges[me]
            autograd = grads[it.key][lo:hi].to(cdt) if hi > lo else mine
            low = dtype not in VERIFY_TOLERANCE or any(
                t.is_floating_point() and t.dtype not in VERIFY_TOLERANCE for pair in it.rows for t in pair)
            tol = VERIFY_TOLERANCE_LOW_PRECISION if low else VERIFY_TOLERANCE[dtype]
            err = float((mine - autograd).norm())
            flags.append(0.0 if err <= tol * max(float(autograd.norm()), 1e-30) or err <= 1e-12 else 1.0)
        handle = self.aggregator.all_reduce(torch.tensor(flags, device=self._codec.device), name="dad.zero.verify")
        failed = {it.key for it, bad in zip(todo, handle.wait().tolist()) if bad}
        report.params.append(_overhead("dad.zero.verify", len(todo), handle.traffic))
        for it in todo:
            self._verified.add(it.key)
            if it.key in failed:
                unit = by_key[it.key]
                self._log_once(f"{unit.name}: its factors do not rebuild its local gradient on some rank (a use "
                               f"outside the captured layers?): DeepSpeed's reduction from now on")
                unit.set_dense_only(True)
        return [it for it in items if it.key not in failed]

    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.warning("dAD/ZeRO: %s", message)


def _takes_exact(unit: FactorUnit) -> bool:
    """Whether the partition exchange of exact factors can carry ``unit``: uses over whole rows or
    linear uses over row blocks (`codecs.partition_exact` slices every use's left by the covering
    rows of the matrix view it meets; `costs.sharded_exact_covers`). Units without uses (PowerSGD's
    floor) go dense or by a rank route."""
    return sharded_exact_covers(unit.kinds, unit.blocks)


def _param_report(name: str, representation: str, shape: tuple, world: int, itemsize: int,
                  dense: bool = False) -> ShardedParamReport:
    numel = 1
    for d in shape:
        numel *= d
    # DeepSpeed's reduce-scatter moves (S-1) of S pieces of ceil(numel/S) elements per rank
    return ShardedParamReport.of_shard(name, "dense" if dense else representation, tuple(shape),
                                       -(-numel // world), world, itemsize)


def _overhead(name: str, numel: int, traffic) -> ShardedParamReport:
    rep = ShardedParamReport(name, "overhead", (numel,))
    rep.add_traffic(traffic)
    return rep


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
