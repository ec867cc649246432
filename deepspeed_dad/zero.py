"""dAD under DeepSpeed ZeRO-2 and ZeRO-3: each rank rebuilds only the gradient partition it keeps
(what stays DeepSpeed's, the modes and the limits: ``docs/guides/sharded.md``).

`attach` selects this for stages 2 and 3 (`ZeroDAD`). ZeRO reduces gradients during backward, in
buckets; `deepspeed_dad.zero_seams` replaces each reduction call for the parameters factors cover
and hands it to `exchange.sharded.ShardedExchanger` as an `exchange.partitions.PartitionCall`
(across nodes, an `exchange.node_partitions.NodePartitionCall`). A step is a backward that reduces;
it ends after the engine's backward epilogue (ZeRO reduces its last bucket there), where every rank
agrees: a route trial's span ends and the rank routes' state is kept only if every rank's local
gradients were finite.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Sequence, Set

import torch

from dad_integrations.capture.units import FactorUnit
from dad_integrations.capture.assign import build_plan
from dad_integrations.config import DADConfig
from dad_integrations.engines import banner
from dad_integrations.exchange.checks import check_same_model
from dad_integrations.exchange.levels import build_levels
from dad_integrations.exchange.node_partitions import NodePartitionCall, node_partition_layout
from dad_integrations.exchange.partitions import PartitionCall, PartitionLayout, Range
from dad_integrations.exchange.sharded import ShardedExchanger, ShardedFacade
from dad_integrations.routes import layouts
from dad_integrations.routes.registry import check_routes

from .attachment import ATTR, RankStateCheckpoints, shadow

log = logging.getLogger(__name__)


class ZeroDAD(RankStateCheckpoints, ShardedFacade):
    """dAD attached to one ZeRO-2/3 engine; made by `deepspeed_dad.attach`.

    Attributes:
        engine, zero_stage, config, aggregator (its `DeepSpeedAggregator`), plan (the factor units),
        exchanger (the `ShardedExchanger`).
    """

    def __init__(self, engine: Any, config: DADConfig):
        from .zero_seams import Zero2Seam, Zero3Seam
        world_size, config = self._take(engine, config, sharded=True)
        self.config = config
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
            config, engine=f"ZeRO-{self.zero_stage}", fallback="DeepSpeed's reduction",
            process_rank=self.aggregator.rank, world_size=world_size, logger=log,
            overhead_names={"counts": "dad.zero.counts", "verify": "dad.zero.verify", "finite": "dad.zero.finite"})
        self._forward_hook = self.exchanger.start(engine.module, self.aggregator, device, self.plan.units,
                                                  layout=layouts.layout_for("zero"), residual_note=False)
        # an exchange's factors (counted in fp32) stay under a quarter of ZeRO's own reduction bucket,
        # which it reduces in place: the send and receive buffers add at most about half a bucket
        bucket = 4 * int(getattr(engine.optimizer, "reduce_bucket_size", 0) or 0)
        chunk = min(config.bucket_cap_mb * 2 ** 20, bucket / 4 if bucket else float("inf"))
        self._layout = PartitionLayout(self.exchanger, self.aggregator, self._unit_of, self._names, device, chunk)
        # across nodes (a collective: groups, and links measured by time): dAD's routes between nodes only
        self.levels = build_levels(config, self.aggregator, device)
        self._nodes = node_partition_layout(self.levels, self._layout, self.plan.units)
        if self._nodes is not None:
            check_routes(config.routes, layouts.layout_for("zero", across_nodes=True))
        # across nodes the residuals live on each weight's owner (node sums): say what is held
        self.exchanger.say_residuals(layouts.layout_for("zero", across_nodes=self._nodes is not None),
                                     None if self._nodes is None else self._nodes.owner_of)
        self._new_backward = True
        prologue, epilogue = engine._backward_prologue, engine._backward_epilogue

        def backward_prologue(*args: Any, **kwargs: Any) -> Any:
            self._new_backward = True  # the next reduction call opens this backward's step
            return prologue(*args, **kwargs)

        def backward_epilogue(*args: Any, **kwargs: Any) -> Any:
            out = epilogue(*args, **kwargs)  # ZeRO reduces its last bucket in here
            ex = self.exchanger               # (not after a raise: a collective then could hang)
            ex.end_rank_step(self.aggregator)
            # the step's reductions are over, on every rank: its span ends, a trial agrees here
            ex.trial_end(self.aggregator, self._layout.device)()
            return out

        shadow(engine, {"_backward_prologue": backward_prologue, "_backward_epilogue": backward_epilogue},
               self._originals)
        if self.keeps_state:
            self._patch_checkpoints()
        seam = Zero2Seam if self.zero_stage == 2 else Zero3Seam
        self._seam = seam(self, engine.optimizer)
        banner.announce(f"DeepSpeed ZeRO-{self.zero_stage}", config, process_rank=self.aggregator.rank,
                        world_size=world_size, factor_weights=len(self._unit_of),
                        dense_params=banner.dense_count(engine.module, self.units),
                        hops=self.exchanger.describe_hops(self.aggregator, self.levels, self._nodes is not None),
                        memory=self.exchanger.memory_line)
        if self.aggregator.rank == 0:
            log.info("dAD replaces ZeRO-%d's gradient reduction for %d weights (mode %s, wire dtype %s)",
                     self.zero_stage, len(self._unit_of), config.mode, config.wire_dtype or "gradients' dtype")
        setattr(engine, ATTR, self)

    @property
    def synchronizer(self) -> "ZeroDAD":
        """The object `dad_integrations.engines` hands out (``last_step_report``): this one."""
        return self

    @property
    def units(self) -> List[FactorUnit]:
        return self.plan.units

    _rank = ShardedFacade.rank_codec

    def detach(self) -> None:
        """Give the engine its own reduction back and remove dAD's hooks."""
        self._seam.remove()
        self._remove_hooks()
        self._restore_engine()

    close = detach

    def reduce(self, params: Sequence[torch.nn.Parameter], local: Sequence[torch.Tensor],
               ranges: Sequence[Sequence[Range]], scale: float, itemsize: int,
               deliver: Callable[[torch.nn.Parameter, torch.Tensor], None]) -> Set[int]:
        """Rebuild this rank's owned elements of the average of every factor-covered parameter of
        one reduction call and hand each to ``deliver(param, owned)`` as soon as it is rebuilt (so
        at most one weight's owned part is alive beside DeepSpeed's buffers); return the ``id`` of
        every parameter delivered. The others are left to DeepSpeed (and reported as dense).
        ``local[i]`` is the flattened local gradient of ``params[i]`` (all of one dtype), ``ranges[i]``
        every rank's owned ``[lo, hi)`` of it, ``scale`` what DeepSpeed's reduction multiplies the
        sum by."""
        if self._new_backward or self.exchanger.report is None:
            self._new_backward = False
            self.exchanger.begin_step()
        kw = dict(scale=scale, itemsize=itemsize, dtype=local[0].dtype if local else torch.float32, deliver=deliver)
        call = (NodePartitionCall(self._layout, self._nodes, params, local, ranges, **kw) if self._nodes is not None
                else PartitionCall(self._layout, params, local, ranges, **kw))
        self.exchanger.reduce(call)
        return call.delivered
