"""Horovod elastic with `DADOptimizer`: ``hvd.elastic.TorchState(model, optimizer)`` unchanged
(``docs/checkpoints.md``, "Elastic jobs"). Importing `horovod_dad` puts `DADOptimizerStateHandler`
first in Horovod's registry of state handlers; its ``sync()``, run on every rank after each (re)start,
re-attaches dAD at Horovod's current size (`reattach`: a new aggregator with the old one's name
prefix, which every process drew alike) before broadcasting the optimizer's state as Horovod does.
The error-feedback residuals become each weight's mean over the ranks that held one (one sum
all-reduce per weight); the rest of dAD's state restarts on every rank alike (a new worker has none).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import torch

from dad_integrations.synchronizer import DADSynchronizer

from ._horovod import hvd
from .aggregator import HorovodAggregator

log = logging.getLogger(__name__)


def reattach(optimizer: Any) -> Optional[DADSynchronizer]:
    """Rebuild ``optimizer``'s synchroniser for Horovod's current size and rank (module doc);
    every rank of the process set calls it at once. Returns the new synchroniser."""
    old: Optional[DADSynchronizer] = optimizer.dad_synchronizer
    if old is not None:
        model, config, prefix = old.model, old.config, old.aggregator.prefix
        residuals = _residuals(old)
        old.close()
    elif optimizer._dad_deferred is not None:  # built under elastic: attached here the first time
        (model, config, prefix), residuals = optimizer._dad_deferred, {}
    else:
        return None  # one process outside elastic, or outside the process set: nothing to attach
    aggregator = HorovodAggregator(optimizer.process_set, prefix=prefix)
    new = optimizer._synchronizer(model, aggregator, config, "Horovod (elastic)")  # scaled by the current size
    optimizer._dad_sync = new
    kept = _mean_residuals(new, residuals, aggregator._prefix)
    if aggregator.rank == 0:
        log.info("dAD: re-attached for %d Horovod processes; error-feedback residuals of %d weight(s) averaged "
                 "over the ranks that held them, warm starts and the first-step check restart",
                 aggregator.world_size, kept)
    return new


def _residuals(sync: DADSynchronizer) -> Dict[str, torch.Tensor]:
    """This rank's residuals, whole (a rank-q one expanded), by weight name."""
    memory = sync._exchanger.state.memory
    return {u.name: memory.dense(u.name) for u in sync.units if memory.dense(u.name) is not None}


def _mean_residuals(sync: DADSynchronizer, residuals: Dict[str, torch.Tensor], prefix: str) -> int:
    """Load into ``sync`` each weight's mean residual over the ranks that hold one; returns how many."""
    means: Dict[str, dict] = {}
    for unit in sync.units:  # the same order on every rank
        mine = residuals.get(unit.name)
        p = unit.param
        flat = torch.zeros(p.numel() + 1, dtype=torch.float32, device=p.device)
        if mine is not None:
            flat[:-1] = mine.reshape(-1).float()
            flat[-1] = 1.0
        total = hvd.allreduce(flat, op=hvd.Sum, name=f"{prefix}elastic.residual.{unit.name}",
                              process_set=sync.aggregator._process_set)
        count = float(total[-1])
        if count > 0:
            means[unit.name] = {"residual": (total[:-1] / count).reshape(p.shape)}
    sync.load_state_dict({**sync.state_dict(), "rank_routes": means})  # a new synchroniser's: nothing else
    return len(means)


def _register() -> None:
    """Put the handler first in Horovod's registry (once), where ``TorchState`` looks it up."""
    try:
        from horovod.torch.elastic import state as elastic_state
    except ImportError:  # a Horovod without elastic support
        return
    from .optimizer import _DADOptimizerMixin

    class DADOptimizerStateHandler(elastic_state.OptimizerStateHandler):
        """Horovod's optimizer handler, with dAD re-attached before each sync (module doc)."""

        def sync(self) -> None:
            reattach(self.value)
            # a new worker's optimizer has no state yet: Horovod initialises it with a step on zero
            # gradients, on that worker alone, so dAD must not exchange in it
            with self.value.skip_synchronize():
                super().sync()

    registry = elastic_state.get_handler_registry()
    if not any(handler.__name__ == DADOptimizerStateHandler.__name__ for _, handler in registry):
        registry.insert(0, (_DADOptimizerMixin, DADOptimizerStateHandler))


_register()
