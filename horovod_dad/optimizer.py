"""`DADOptimizer`: a drop-in for ``hvd.DistributedOptimizer`` that synchronises with dAD.

Like Horovod's, it builds a subclass of the wrapped optimizer's class at run time, so the object
is still an ``SGD`` / ``AdamW`` / ... (``state_dict``, ``param_groups``, LR schedulers work), and it
keeps Horovod's protocol: ``synchronize()``, ``skip_synchronize()``, ``step()``, ``zero_grad()``,
``set_backward_passes_per_step()``, the same argument checks and the same errors. What travels is
decided by a `DADSynchronizer` attached to ``model``: layer factors, rank-r factors or bucketed dense
all-reduce, over Horovod's collectives (`HorovodAggregator`).

Arguments and dAD:

=========================  ===================================================================
``named_parameters``       checked as Horovod checks them (tuples, unique names, every optimizer
                           parameter named); dAD names its collectives after ``model``'s modules
``compression``            ``Compression.none``; ``Compression.fp16`` sends factors and dense
                           buckets as float16 (``wire_dtype="float16"``); any other compressor
                           raises ``ValueError`` (it cannot be applied to factors)
``backward_passes_per_step``  as Horovod: the exchange starts at the k-th backward pass, with the
                           factors of all k passes; ``step()`` earlier sends what is there
``op``                     ``hvd.Average`` and ``hvd.Sum``; ``hvd.Adasum``, ``Min``, ``Max``,
                           ``Product`` raise ``ValueError`` (dAD rebuilds sums of factors)
``gradient_predivide_factor``  as Horovod (only with ``op=Average``): prescale ``1/f``, postscale ``f/size``
``num_groups`` / ``groups``  validated as Horovod validates them; they only group Horovod's
                           all-reduces for fusion, which dAD's own buckets (``bucket_cap_mb``)
                           replace, so the result is unchanged
``sparse_as_dense``        sparse embedding gradients need ``sparse_as_dense=True`` (they then go
                           through the dense buckets and are made sparse again, as in Horovod);
                           with ``False`` a model with sparse embeddings raises ``ValueError``
``process_set``            collectives run over it; a process outside it steps locally, as in Horovod
``model`` (new, optional)  the module whose factors are captured; it must hold every parameter
                           of the optimizer (not wrapped in DDP); only the optimizer's parameters
                           are synchronised, as with Horovod. Without it (as Horovod's own
                           scripts and tests call it) dAD attaches at the first forward of a
                           module holding the optimizer's parameters (`discovery`); a step before
                           any forward all-reduces the gradients as Horovod does
``dad`` (new)              a `DADConfig` or a dict of its keys
=========================  ===================================================================

Differences from Horovod, on purpose: ``zero_grad(set_to_none=True)`` is accepted;
``step()`` inside ``skip_synchronize()`` after a backward without ``synchronize()`` raises (the
gradients would be read while dAD rebuilds them); a ``step()`` right after ``synchronize()``
warns as Horovod does but does not exchange the same gradients again.
"""
from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from dad_integrations import DADConfig, DADSynchronizer, StepReport
from dad_integrations.engines import banner

from ._horovod import Compression, hvd
from .aggregator import HorovodAggregator
from .discovery import ModelFinder

log = logging.getLogger(__name__)

_OP_NAMES = {hvd.Average: "Average", hvd.Sum: "Sum", hvd.Adasum: "Adasum"}
for _name in ("Min", "Max", "Product"):
    if hasattr(hvd, _name):
        _OP_NAMES.setdefault(getattr(hvd, _name), _name)

_HOROVOD_OPTIMIZER_MODULE = hvd.DistributedOptimizer.__module__

_ZERO_GRAD_RACE = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                   "optimizer.synchronize(). This is prohibited as it can cause a race condition.")


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

    Same arguments as ``hvd.DistributedOptimizer`` (see the module docstring for how each one
    maps onto dAD), plus ``model`` (where factors are captured; None finds it at the first
    forward, see `discovery`) and ``dad`` (a `DADConfig` or a dict of its keys, e.g.
    ``{"mode": "auto", "rank": 4}``). Returns an instance of a subclass of ``optimizer``'s class
    sharing its ``param_groups``, as Horovod does.

    Raises:
        ValueError: an argument Horovod rejects, or one dAD cannot honour (``op=hvd.Adasum``, a
            custom compressor, sparse gradients without ``sparse_as_dense=True``, optimizer
            parameters outside ``model``), or a bad ``dad`` key. Without ``model=``, the checks
            that need the model raise at its first forward.
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
    # what dAD cannot express
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op=hvd.{_OP_NAMES.get(op, op)} is not supported with dAD: dAD rebuilds the sum "
                         f"of every rank's gradient factors, so only op=hvd.Average and op=hvd.Sum can be "
                         f"expressed (use hvd.DistributedOptimizer for Adasum)")
    if isinstance(gradient_predivide_factor, bool) or not isinstance(gradient_predivide_factor, (int, float)) \
            or not 0 < gradient_predivide_factor < float("inf"):
        raise ValueError(f"gradient_predivide_factor must be a positive number, got {gradient_predivide_factor!r}")
    config = DADConfig() if dad is None else DADConfig.from_dict(dad)
    config = _apply_compression(config, compression)
    _check_groups(groups)
    # `step` lives in the built class itself, as in Horovod's: Horovod's helpers step without
    # synchronising through super(type(opt), opt).step(), which must reach the wrapped class
    cls = type(optimizer.__class__.__name__, (_DADOptimizerMixin, optimizer.__class__),
               {"step": _DADOptimizerMixin._synchronizing_step})
    return cls(optimizer.param_groups, named_parameters=named_parameters, compression=compression,
               backward_passes_per_step=backward_passes_per_step, op=op,
               gradient_predivide_factor=float(gradient_predivide_factor), groups=groups,
               sparse_as_dense=bool(sparse_as_dense), process_set=process_set, model=model, config=config)


class _DADOptimizerMixin(torch.optim.Optimizer):
    """Horovod's ``_DistributedOptimizer`` protocol over a `DADSynchronizer`.

    Put first in the bases of a class built at run time, so ``super()`` reaches the wrapped
    optimizer's class.
    """

    def __init__(self, params: Any, *, named_parameters: Any, compression: Any, backward_passes_per_step: int,
                 op: Any, gradient_predivide_factor: float, groups: Any, sparse_as_dense: bool,
                 process_set: Any, model: Optional[nn.Module], config: DADConfig):
        super().__init__(params)
        # hvd.broadcast_optimizer_state steps a fresh optimizer without synchronising only when
        # `optimizer.__module__` is Horovod's optimizer module (otherwise every rank must step, or
        # the ranks whose state is empty wait in the exchange: a hang on resume). This optimizer
        # keeps Horovod's protocol, so it takes Horovod's path; its class stays ours.
        self.__module__ = _HOROVOD_OPTIMIZER_MODULE
        self._compression = compression
        self._parameter_names = _check_named_parameters(named_parameters, self.param_groups)
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
        self._requires_update: List[nn.Parameter] = _unique(
            p for g in self.param_groups for p in g["params"] if p.requires_grad)
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

    def _check_model(self, model: nn.Module) -> None:
        """Refuse what dAD cannot synchronise, before anything is attached."""
        sparse_modules = [(n, m) for n, m in model.named_modules()
                          if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and
                          any(m.weight is p for p in self._requires_update)]
        if sparse_modules and not self.sparse_as_dense:
            raise ValueError(f"modules {[n for n, _ in sparse_modules]} produce sparse gradients, which Horovod "
                             f"all-gathers as sparse tensors; dAD needs dense gradients: pass "
                             f"sparse_as_dense=True (or build the embeddings with sparse=False)")
        if sparse_modules:
            # dense buckets, then sparse again before the update (Horovod's sparse_as_dense)
            self._config = DADConfig.from_dict(dict(self._config.to_dict(), exclude=list(self._config.exclude) + [
                n for n, _ in sparse_modules]))
            self._sparse_params = [m.weight for _, m in sparse_modules]
        model_params = {id(p) for p in model.parameters()}
        outside = [self._parameter_names.get(p, "?") for p in self._requires_update if id(p) not in model_params]
        if outside:
            raise ValueError(f"parameters {outside} of the optimizer are not parameters of model=: dAD "
                             f"synchronises the parameters of the model it is attached to, so these would "
                             f"never be averaged; pass the module that holds all of them")

    def _on_model_found(self, module: nn.Module) -> None:
        """`ModelFinder`'s call, at the first forward of a module holding the optimizer's parameters."""
        try:
            held = {id(p) for p in module.parameters()}
            missing = [self._parameter_names.get(p, "?") for p in self._requires_update if id(p) not in held]
            if missing:
                raise ValueError(
                    f"DADOptimizer without model=: the first forward after it was built ran a "
                    f"{type(module).__name__} that holds only some of the optimizer's parameters (not "
                    f"{missing[:4]}{'...' if len(missing) > 4 else ''}); dAD must attach to one module that "
                    f"holds all of them before its forward: pass model=")
            self._check_model(module)
            self._attach(module)
        except BaseException as e:
            self._attach_error = e  # synchronize() raises it too: never step on local gradients
            raise
        if self._pending_dad_state is not None:
            self._dad_sync.load_state_dict(self._pending_dad_state)
            self._pending_dad_state = None

    def _attach(self, model: nn.Module) -> None:
        """Attach the `DADSynchronizer` (and the sparse-as-dense hooks) to ``model``."""
        config, process_set = self._config, self.process_set
        if self._groups is not None and process_set.rank() == 0:
            log.info("dAD: groups=%r only groups Horovod's all-reduces for fusion; dAD buckets dense "
                     "gradients by bucket_cap_mb=%s instead", self._groups, config.bucket_cap_mb)
        # Horovod's sparse_as_dense: sparse gradients become dense before dAD reads them. Registered
        # before the synchroniser's hooks, so they run first. (Passes are counted, and a forward
        # before the exchange of the last k passes is refused, by the synchroniser itself.)
        for p in self._sparse_params:
            self._dad_hooks.append(p.register_post_accumulate_grad_hook(_sparse_to_dense))
        prescale, postscale = self._scale_factors()
        if os.environ.get("HOROVOD_ELASTIC") == "1":
            # no collective here: a new worker's would meet the running ones' state sync and hang;
            # TorchState's handler attaches dAD in hvd.elastic.run (horovod_dad.elastic)
            self._dad_deferred = (model, config, HorovodAggregator(process_set).prefix)
            return
        try:
            # The plan covers what Horovod's hooks cover: the parameters of this optimizer that
            # required grad when it was built, also if switched off now (a GAN's other half); the
            # model's other parameters keep their local gradients (another optimizer's, say).
            # Horovod users broadcast explicitly (hvd.broadcast_parameters), as with Horovod's optimizer.
            with _requiring_grad_only(model, self._requires_update), banner.engine("Horovod"):
                self._dad_sync = DADSynchronizer(model, HorovodAggregator(process_set), config,
                                                 prescale_factor=prescale, postscale_factor=postscale,
                                                 backward_passes_per_step=self.backward_passes_per_step,
                                                 broadcast_parameters=False)
        except BaseException:
            self._remove_hooks()
            raise

    def _scale_factors(self) -> Tuple[float, float]:
        """Horovod's reduction as (prescale, postscale) of the sum over the process set."""
        if self.op == hvd.Average:
            f = self.gradient_predivide_factor
            return 1.0 / f, f / self.process_set.size()
        return 1.0, 1.0

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
        """Synchronise (unless inside ``skip_synchronize()``), then the wrapped optimizer's step.

        Installed as ``step`` of the class `DADOptimizer` builds, not defined on the mixin, so
        that ``super(type(opt), opt).step()`` is the wrapped optimizer's step, as with Horovod's."""
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
            raise AssertionError(_ZERO_GRAD_RACE)
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
        """Load the wrapped optimizer's state (and dAD's, when the dict carries it)."""
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
        elif dad_state is not None:  # loaded when dAD attaches (model found at the first forward)
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

    def _allreduce_unattached(self) -> None:
        """Horovod's reduction of every gradient, as its ``synchronize()`` gives for gradients its
        hooks missed; names from ``named_parameters``, the same on every rank."""
        prescale, postscale = self._scale_factors()
        handles = []
        for p in self._requires_update:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dense = p.grad.to_dense() if p.grad.is_sparse else p.grad
            wire, ctx = self._compression.compress(dense)
            wire = wire.contiguous()
            wire.mul_(prescale)
            name = f"dad.unattached.{self._parameter_names.get(p)}"
            handles.append((p, wire, ctx, hvd.allreduce_async_(wire, name=name, op=hvd.Sum,
                                                                process_set=self.process_set)))
        for p, wire, ctx, handle in handles:
            out = self._compression.decompress(hvd.synchronize(handle), ctx).mul_(postscale)
            p.grad = out.to_sparse() if p.grad.is_sparse else out.to(p.grad.dtype)
        if handles and self.process_set.rank() == 0:
            log.info("dAD: step() before any forward since DADOptimizer was built: %d gradients "
                     "all-reduced as Horovod does", len(handles))

    def _remove_hooks(self) -> None:
        for h in self._dad_hooks:
            h.remove()
        self._dad_hooks = []


def _sparse_to_dense(p: nn.Parameter) -> None:
    if p.grad is not None and p.grad.is_sparse:
        p.grad = p.grad.to_dense()


def _apply_compression(config: DADConfig, compression: Any) -> DADConfig:
    """Horovod's fp16 compression is dAD's float16 wire; other compressors cannot act on factors."""
    if compression is Compression.none:
        return config
    if compression is Compression.fp16:
        if config.wire_dtype not in (None, "float16"):
            raise ValueError(f"compression=hvd.Compression.fp16 conflicts with dad wire_dtype="
                             f"{config.wire_dtype!r}; choose one")
        return DADConfig.from_dict(dict(config.to_dict(), wire_dtype="float16"))
    raise ValueError(f"compression={getattr(compression, '__name__', compression)!r} is not supported with dAD: "
                     f"only hvd.Compression.none and hvd.Compression.fp16 (float16 factors and buckets) "
                     f"can be applied to gradient factors; see also the dad 'wire_dtype' key")


def _check_groups(groups: Any) -> None:
    """Horovod's validation of ``groups`` (a positive integer or a list of lists of tensors)."""
    if groups is None:
        return
    if not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    if isinstance(groups, list):
        seen = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))


def _check_named_parameters(named_parameters: Any, param_groups: List[dict]) -> Dict[nn.Parameter, str]:
    """Horovod's checks of ``named_parameters``; returns parameter -> name."""
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    else:
        named_parameters = [(f"allreduce.noname.{i}.{j}", v) for i, group in enumerate(param_groups)
                            for j, v in enumerate(group["params"])]
    if any(not isinstance(p, tuple) for p in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced "
                         "by model.named_parameters().")
    seen, dups = set(), set()
    for k, _ in named_parameters:
        (dups if k in seen else seen).add(k)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: %s"
                         % ", ".join(sorted(dups)))
    all_ids = {id(v) for group in param_groups for v in group["params"]}
    unnamed = all_ids - {id(v) for _, v in named_parameters}
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                         "Python object ids: %s" % ", ".join(str(i) for i in unnamed))
    return {v: k for k, v in named_parameters}


@contextlib.contextmanager
def _requiring_grad_only(model: nn.Module, params: List[nn.Parameter]) -> Iterator[None]:
    """Inside the block, of ``model``'s parameters exactly ``params`` require grad (so that the
    synchroniser's plan covers them and hooks can be registered on them); after it, each parameter's
    ``requires_grad`` is what it was at entry."""
    ours = {id(p) for p in params}
    flipped = [p for p in _unique(list(model.parameters()) + list(params)) if p.requires_grad != (id(p) in ours)]
    for p in flipped:
        p.requires_grad_(not p.requires_grad)
    try:
        yield
    finally:
        for p in flipped:
            p.requires_grad_(not p.requires_grad)


def _unique(params: Iterable[nn.Parameter]) -> List[nn.Parameter]:
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
