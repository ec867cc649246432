"""Attach dAD to a DeepSpeed engine (ZeRO 0 and 1), in place of the engine's gradient all-reduce.

``engine.backward()`` reduces gradients in ``engine.allreduce_gradients()``, after autograd, at
gradient-accumulation boundaries only. `attach` swaps that method, on this engine only, for one
that waits for dAD (`DADSynchronizer.synchronize`, whose exchanges started during backward) and,
for ZeRO 1, lets the ZeRO optimizer copy each rank's partition out of the reduced gradients with
no collective (`_reduction_without_communication`). Off a boundary the backward runs inside the
synchroniser's ``no_sync()``: every micro-step's factors are sent once, at the boundary.

What stays DeepSpeed's: ``docs/guides/deepspeed.md``. Checkpoints: `deepspeed_dad.attachment`; the
engine's checks, scaling and wire dtype: `deepspeed_dad.checks`; ZeRO-2/3: `deepspeed_dad.zero`.
"""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Mapping, Optional, Union

import torch

from dad_integrations import DADConfig, DADSynchronizer, StepReport
from dad_integrations.engines import banner
from dad_integrations.logs import process_rank

from .attachment import ATTR, RankStateCheckpoints, shadow
from .checks import reduction_scales
from .config import DADBlock, parse_block

if TYPE_CHECKING:
    from .zero import ZeroDAD

log = logging.getLogger(__name__)


class DeepSpeedDAD(RankStateCheckpoints):
    """dAD attached to one DeepSpeed engine; made by `attach`.

    Attributes:
        engine: the engine.
        synchronizer: the `DADSynchronizer` on ``engine.module``.
        aggregator: its `DeepSpeedAggregator`.
    """

    def __init__(self, engine: Any, config: DADConfig):
        world, config = self._take(engine, config)
        stage = self.zero_stage
        prescale, postscale = reduction_scales(engine, world)
        # DeepSpeed broadcast rank 0's parameters when it built the engine
        with banner.engine(f"DeepSpeed ZeRO-{stage}"):
            self.synchronizer = DADSynchronizer(engine.module, self.aggregator, config,
                                                prescale_factor=prescale, postscale_factor=postscale,
                                                broadcast_parameters=False)
        self.config = self.synchronizer.config
        self._accumulating: Optional[contextlib.AbstractContextManager] = None
        # ZeRO engines also run a plain ``loss.backward()`` through hooks that call the prologue
        shadow(engine, {"allreduce_gradients": self._allreduce_gradients,
                        "backward": self._around(engine.backward, begin=True, end=True),
                        "_backward_prologue": self._around(engine._backward_prologue, begin=True, end=False),
                        "_backward_epilogue": self._around(engine._backward_epilogue, begin=False, end=True)},
               self._originals)
        self._patch_checkpoints()
        setattr(engine, ATTR, self)
        if self.aggregator.rank == 0:
            log.info("dAD replaces DeepSpeed's gradient all-reduce: ZeRO stage %d, mode %s, prescale %g, "
                     "postscale %g, wire dtype %s", stage, self.config.mode, prescale,
                     self.synchronizer.scale / prescale, config.wire_dtype or "gradients' dtype")

    # -- public ---------------------------------------------------------------------------------
    def last_step_report(self) -> Optional[StepReport]:
        """Bytes and representations of the last synchronised step (see `DADSynchronizer`)."""
        return self.synchronizer.last_step_report()

    def detach(self) -> None:
        """Give the engine its own all-reduce back and remove dAD's hooks."""
        self._end_backward()
        self._restore_engine()
        self.synchronizer.close()

    # -- the engine's methods, replaced ---------------------------------------------------------
    def _allreduce_gradients(self, *args: Any, **kwargs: Any) -> None:
        engine = self.engine
        boundary = engine.is_gradient_accumulation_boundary()
        if hasattr(engine.optimizer, "set_gradient_accumulation_boundary"):
            engine.optimizer.set_gradient_accumulation_boundary(boundary)
        if not boundary:  # ZeRO 0/1 reduce only at boundaries; the factors wait in no_sync()
            return
        self._end_backward()
        self.synchronizer.synchronize()
        if self.zero_stage == 1:
            with _reduction_without_communication(engine.optimizer):
                engine.optimizer.reduce_gradients(pipeline_parallel=engine.pipeline_parallelism)

    def _around(self, original: Callable, begin: bool, end: bool) -> Callable:
        """``original`` after `_begin_backward` (``begin``) and before `_end_backward` (``end``, also on a raise)."""
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if begin:
                self._begin_backward()
            try:
                return original(*args, **kwargs)
            finally:
                if end:
                    self._end_backward()
        wrapped.__doc__ = original.__doc__
        return wrapped

    def _begin_backward(self) -> None:
        """Enter the synchroniser's no_sync() for a backward that DeepSpeed would not reduce."""
        engine = self.engine
        if self._accumulating is None and (engine.inside_no_sync_ctxt
                                           or not engine.is_gradient_accumulation_boundary()):
            self._accumulating = self.synchronizer.no_sync()
            self._accumulating.__enter__()

    def _end_backward(self) -> None:
        if self._accumulating is not None:
            cm, self._accumulating = self._accumulating, None
            cm.__exit__(None, None, None)


def attach(engine: Any, config: Union[DADConfig, DADBlock, Mapping[str, Any], None] = None
           ) -> Optional[Union[DeepSpeedDAD, "ZeroDAD"]]:
    """Attach dAD to a DeepSpeed engine made elsewhere; returns the attachment (None if disabled).

    ZeRO stages 0 and 1 get `DeepSpeedDAD` (dAD in place of the all-reduce); stages 2 and 3 get
    `deepspeed_dad.zero.ZeroDAD` (each rank rebuilds only its gradient partition).

    Args:
        engine: a ``deepspeed.DeepSpeedEngine`` whose optimizer was configured.
        config: the ``"dad"`` block (a dict with ``enabled`` and `DADConfig` keys), a `DADConfig`,
            or None for the defaults. A block with ``"enabled": false`` attaches nothing.

    Every rank must call it at the same point (it creates a process group and checks that the
    models agree). Raises `ValueError` for bad keys and for engine settings dAD cannot honour.
    """
    block = parse_block({} if config is None else config)
    if getattr(engine, ATTR, None) is not None:
        raise ValueError("dAD is already attached to this engine")
    if not block.enabled:
        if process_rank() == 0:  # the same config on every rank
            log.info("the DeepSpeed config's 'dad' block has enabled=false: DeepSpeed's all-reduce is kept")
        return None
    if int(engine.zero_optimization_stage()) in (2, 3):
        from .zero import ZeroDAD
        return ZeroDAD(engine, block.config)
    return DeepSpeedDAD(engine, block.config)


@contextlib.contextmanager
def _reduction_without_communication(optimizer: Any) -> Iterator[None]:
    """ZeRO 1's gradient reduction with every collective replaced by the identity.

    dAD has already put the reduced gradient in every ``param.grad`` on every rank, so what is left
    of ZeRO 1's reduction is to copy this rank's partition out of it. Its all-reduce path
    (``gradient_reduction_w_predivide``, ``allreduce_bucket``) then does exactly that when the
    collective and its scaling are skipped; the reduce-scatter path is routed to the all-reduce
    path, whose partition copy is the same.
    """
    def reduced(tensor: torch.Tensor, communication_data_type: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        return tensor

    def bucket_reduced(bucket: List[torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        return optimizer.flatten(bucket)

    saved_reduce_scatter = getattr(optimizer, "reduce_scatter", False)
    optimizer.gradient_reduction_w_predivide = reduced
    optimizer.allreduce_bucket = bucket_reduced
    optimizer.reduce_scatter = False
    try:
        yield
    finally:
        del optimizer.gradient_reduction_w_predivide
        del optimizer.allreduce_bucket
        optimizer.reduce_scatter = saved_reduce_scatter
