"""Attaching an optimizer's `DADSynchronizer` to the model it updates: checked, attached at once
(``model=``), at the model's first forward (`discovery`), or later under Horovod elastic; and
Horovod's plain all-reduce for a step before any forward. Only the optimizer's parameters require
grad while it attaches; sparse gradients are made dense before dAD reads them (``sparse_as_dense``).

A base of `horovod_dad.optimizer._DADOptimizerMixin`, which holds the state these methods read.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator, List, Tuple

import torch
from torch import nn

from dad_integrations import DADConfig, DADSynchronizer
from dad_integrations.engines import banner

from ._horovod import hvd
from .aggregator import HorovodAggregator

log = logging.getLogger("horovod_dad.optimizer")  # the optimizer's logger, as before the split


def sparse_to_dense(p: nn.Parameter) -> None:
    """A post-accumulate-grad hook: a sparse gradient becomes dense."""
    if p.grad is not None and p.grad.is_sparse:
        p.grad = p.grad.to_dense()


@contextlib.contextmanager
def requiring_grad_only(model: nn.Module, params: List[nn.Parameter]) -> Iterator[None]:
    """Inside the block, of ``model``'s parameters exactly ``params`` require grad (so that the
    synchroniser's plan covers them and hooks can be registered on them); after it, each parameter's
    ``requires_grad`` is what it was at entry."""
    ours = {id(p) for p in params}
    everyone = dict.fromkeys(list(model.parameters()) + list(params))  # without repeats, in order
    flipped = [p for p in everyone if p.requires_grad != (id(p) in ours)]
    for p in flipped:
        p.requires_grad_(not p.requires_grad)
    try:
        yield
    finally:
        for p in flipped:
            p.requires_grad_(not p.requires_grad)


class ModelAttachment:
    """The attaching half of `DADOptimizer`'s classes (no state of its own)."""

    def _check_model(self, model: nn.Module, found: bool = False) -> None:
        """Refuse what dAD cannot synchronise, before anything is attached (``found``: ``model`` is
        the module `ModelFinder` found at its first forward)."""
        held = {id(p) for p in model.parameters()}
        outside = [self._parameter_names.get(p, "?") for p in self._requires_update if id(p) not in held]
        if outside and found:
            raise ValueError(
                f"DADOptimizer without model=: the first forward after it was built ran a "
                f"{type(model).__name__} that holds only some of the optimizer's parameters (not "
                f"{outside[:4]}{'...' if len(outside) > 4 else ''}); dAD must attach to one module that "
                f"holds all of them before its forward: pass model=")
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
        if outside:
            raise ValueError(f"parameters {outside} of the optimizer are not parameters of model=: dAD "
                             f"synchronises the parameters of the model it is attached to, so these would "
                             f"never be averaged; pass the module that holds all of them")

    def _on_model_found(self, module: nn.Module) -> None:
        """`ModelFinder`'s call, at the first forward of a module holding the optimizer's parameters."""
        try:
            self._check_model(module, found=True)
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
            self._dad_hooks.append(p.register_post_accumulate_grad_hook(sparse_to_dense))
        if os.environ.get("HOROVOD_ELASTIC") == "1":
            # no collective here: a new worker's would meet the running ones' state sync and hang;
            # TorchState's handler attaches dAD in hvd.elastic.run (horovod_dad.elastic)
            self._dad_deferred = (model, config, HorovodAggregator(process_set).prefix)
            return
        try:
            self._dad_sync = self._synchronizer(model, HorovodAggregator(process_set), config, "Horovod")
        except BaseException:
            self._remove_hooks()
            raise

    def _synchronizer(self, model: nn.Module, aggregator: HorovodAggregator, config: DADConfig,
                      engine: str) -> DADSynchronizer:
        """A `DADSynchronizer` scaled as Horovod's reduction, over the parameters Horovod's hooks
        cover: those of this optimizer that required grad when it was built, also if switched off
        now (a GAN's other half); the model's other parameters keep their local gradients (another
        optimizer's, say). Horovod users broadcast explicitly (``hvd.broadcast_parameters``)."""
        prescale, postscale = self._scale_factors()
        with requiring_grad_only(model, self._requires_update), banner.engine(engine):
            return DADSynchronizer(model, aggregator, config, prescale_factor=prescale, postscale_factor=postscale,
                                   backward_passes_per_step=self.backward_passes_per_step,
                                   broadcast_parameters=False)

    def _scale_factors(self) -> Tuple[float, float]:
        """Horovod's reduction as (prescale, postscale) of the sum over the process set."""
        if self.op == hvd.Average:
            f = self.gradient_predivide_factor
            return 1.0 / f, f / self.process_set.size()
        return 1.0, 1.0

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
