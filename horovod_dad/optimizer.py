"""`DADOptimizer`: a drop-in for ``hvd.DistributedOptimizer`` that synchronises with dAD.

Like Horovod's, it builds a subclass of the wrapped optimizer's class at run time, so the object
is still an ``SGD`` / ``AdamW`` / ... and keeps Horovod's protocol (``synchronize()``,
``skip_synchronize()``, ``step()``, ``zero_grad()``, ``set_backward_passes_per_step()``); a
`DADSynchronizer` attached to ``model`` decides what travels, over Horovod's collectives
(`HorovodAggregator`). Its arguments: `horovod_dad.arguments`; attaching: `horovod_dad.attaching`;
what differs from Horovod, on purpose: ``docs/guides/horovod.md``. The state dict carries this
rank's dAD state under ``"dad"``.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from dad_integrations import DADConfig, DADSynchronizer, StepReport

from ._horovod import Compression, hvd
from .arguments import check_named_parameters, dad_config_for
from .attaching import ModelAttachment
from .discovery import ModelFinder


def DADOptimizer(optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, nn.Parameter]]] = None,
                 compression: Any = Compression.none,
                 backward_passes_per_step: int = 1,
                 op: Any = hvd.Average,
                 gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0,
                 groups: Any = None,
                 sparse_as_dense: bool = False,
                 process_set: Any = hvd.global_process_set,
                 *, model: Optional[nn.Module] = None,
                 dad: Union[DADConfig, Mapping[str, Any], None] = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that gradients are averaged over Horovod ranks with dAD.

    Same arguments as ``hvd.DistributedOptimizer`` (see `horovod_dad.arguments` for how each one
    maps onto dAD), plus ``model`` (where factors are captured; None finds it at the first
    forward, see `discovery`) and ``dad`` (a `DADConfig` or a dict of its keys, e.g.
    ``{"mode": "auto", "rank": 4}``). Returns an instance of a subclass of ``optimizer``'s class
    sharing its ``param_groups``, as Horovod does.

    Raises:
        ValueError: an argument Horovod rejects, one dAD cannot honour (`horovod_dad.arguments`;
            without ``model=``, those about the model at its first forward), or a bad ``dad`` key.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if model is not None and not isinstance(model, nn.Module):
        raise ValueError(f"model= must be the nn.Module whose parameters the optimizer updates, "
                         f"got {type(model).__name__}")
    # Horovod's own checks, in Horovod's order and words
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` "
                      "and will be removed in v0.23.0.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    config = dad_config_for(op, gradient_predivide_factor, dad, compression, groups)  # what dAD cannot express
    # `step` lives in the built class itself, as in Horovod's: Horovod's helpers step without
    # synchronising through super(type(opt), opt).step(), which must reach the wrapped class
    cls = type(optimizer.__class__.__name__, (_DADOptimizerMixin, optimizer.__class__),
               {"step": _DADOptimizerMixin._synchronizing_step})
    return cls(optimizer.param_groups, named_parameters=named_parameters, compression=compression,
               backward_passes_per_step=backward_passes_per_step, op=op,
               gradient_predivide_factor=float(gradient_predivide_factor), groups=groups,
               sparse_as_dense=bool(sparse_as_dense), process_set=process_set, model=model, config=config)


class _DADOptimizerMixin(ModelAttachment, torch.optim.Optimizer):
    """Horovod's ``_DistributedOptimizer`` protocol over a `DADSynchronizer`.

    Put first in the bases of a class built at run time, so ``super()`` reaches the wrapped
    optimizer's class.
    """

    def __init__(self, params: Any, *, named_parameters: Any, compression: Any, backward_passes_per_step: int,
                 op: Any, gradient_predivide_factor: float, groups: Any, sparse_as_dense: bool,
                 process_set: Any, model: Optional[nn.Module], config: DADConfig):
        super().__init__(params)
        # Horovod's module, so that hvd.broadcast_optimizer_state steps a fresh optimizer without
        # synchronising (docs/guides/horovod.md: else the ranks with empty state hang); the class stays ours
        self.__module__ = hvd.DistributedOptimizer.__module__
        self._compression = compression
        self._parameter_names = check_named_parameters(named_parameters, self.param_groups)
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._groups = groups
        self._config = config
        self._synchronized = False
        self._should_synchronize = True
        # as Horovod: the parameters that require grad when the optimizer is built (a GAN may
        # switch requires_grad off and on later)
        self._requires_update: List[nn.Parameter] = list(dict.fromkeys(  # without repeats, in order
            p for g in self.param_groups for p in g["params"] if p.requires_grad))
        self._dad_hooks: List[Any] = []
        self._dad_sync: Optional[DADSynchronizer] = None
        self._dad_deferred: Optional[tuple] = None  # Horovod elastic: attached at TorchState's sync
        self._sparse_params: List[nn.Parameter] = []
        self._finder: Optional[ModelFinder] = None
        self._pending_dad_state: Optional[Mapping[str, Any]] = None
        self._attach_error: Optional[BaseException] = None

        # Like Horovod: nothing to do on a single process (unless elastic) or outside the process set.
        self._active = process_set.included() and (hvd.size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1")
        if model is not None:
            self._check_model(model)
            if self._active:
                self._attach(model)
        elif self._active and self._requires_update:
            self._finder = ModelFinder(self._requires_update, self._on_model_found)

    # -- Horovod's protocol ---------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait until every gradient holds its reduction over the process set (dAD's rebuild)."""
        if self._attach_error is not None:
            raise RuntimeError(f"dAD could not attach to the model: {self._attach_error}") from self._attach_error
        if self._dad_sync is None:
            if self._dad_deferred is not None:
                raise RuntimeError("under Horovod elastic, dAD attaches when hvd.elastic.TorchState(model, "
                                   "optimizer) syncs in hvd.elastic.run (build the optimizer with model=, and "
                                   "the State before hvd.elastic.run); with another State, call "
                                   "horovod_dad.elastic.reattach(optimizer) in its sync()")
            if self._finder is not None and self._finder.pending:
                # no forward since the optimizer was built (its backward may be of an earlier one):
                # what Horovod does for gradients its hooks did not see, a plain all-reduce
                self._allreduce_unattached()
            self._synchronized = True
            return
        self._dad_sync.synchronize()
        # Horovod all-reduces a zero tensor for a parameter no rank used, so its gradient ends up
        # zero, not None; keep that, so that optimizers see what they see under Horovod.
        for p in self._requires_update:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for p in self._sparse_params:
            if p.grad is not None and not p.grad.is_sparse:
                p.grad = p.grad.to_sparse()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within it, ``step()`` does not synchronise (call ``synchronize()`` before it)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def _synchronizing_step(self, closure: Any = None) -> Any:
        """Synchronise (unless inside ``skip_synchronize()``), then the wrapped optimizer's step
        (``step`` of the class `DADOptimizer` builds, not of the mixin: see there)."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
                if self._backward_pending():  # a backward since synchronize(): exchange it too
                    self.synchronize()
            else:
                self.synchronize()
        elif self._backward_pending():
            raise AssertionError("optimizer.step() was called inside optimizer.skip_synchronize() after "
                                 "loss.backward() without optimizer.synchronize(): dAD is still rebuilding "
                                 "the gradients; call optimizer.synchronize() before the block")
        self._synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As the wrapped optimizer's; refused between ``backward()`` and the exchange, as in Horovod."""
        if self._backward_pending():
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                                 "or optimizer.synchronize(). This is prohibited as it can cause a race condition.")
        return super().zero_grad(set_to_none=set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Start each exchange at the ``passes``-th backward pass (Horovod's argument)."""
        self.backward_passes_per_step = passes
        if self._dad_sync is not None:
            self._dad_sync.set_backward_passes_per_step(passes)

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state dict, plus this rank's dAD state under ``"dad"``
        (rank-dAD warm starts, error-feedback residuals, weights sent dense for good)."""
        state = super().state_dict()
        if self._dad_sync is not None:
            state["dad"] = self._dad_sync.state_dict()
        elif self._pending_dad_state is not None:
            state["dad"] = self._pending_dad_state
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load the wrapped optimizer's state (and dAD's, when the dict carries it: at once, or when
        dAD attaches at the model's first forward)."""
        if self._backward_pending():
            raise AssertionError("optimizer.load_state_dict() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize()")
        state_dict = dict(state_dict)
        dad_state = state_dict.pop("dad", None)
        self._synchronized = False
        self._should_synchronize = True
        super().load_state_dict(state_dict)
        if dad_state is not None and self._dad_sync is not None:
            self._dad_sync.load_state_dict(dad_state)
        elif dad_state is not None:
            self._pending_dad_state = dad_state

    # -- dAD extras -----------------------------------------------------------------------------
    @property
    def dad_synchronizer(self) -> Optional[DADSynchronizer]:
        """The `DADSynchronizer` doing the exchange (None on one process or outside the process set)."""
        return self._dad_sync

    def last_step_report(self) -> Optional[StepReport]:
        """Bytes and representation per parameter of the last exchange (None before the first)."""
        return None if self._dad_sync is None else self._dad_sync.last_step_report()

    def close(self) -> None:
        """Detach dAD from the model (hooks removed); the optimizer then steps on local gradients."""
        if self._finder is not None:
            self._finder.remove()
            self._finder = None
        self._remove_hooks()
        if self._dad_sync is not None:
            self._dad_sync.close()
            self._dad_sync = None

    # -- internals ------------------------------------------------------------------------------
    def _backward_pending(self) -> bool:
        return self._dad_sync is not None and self._dad_sync.backward_pending
