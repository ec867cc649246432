"""Gradient sinks: where a step reads each local gradient and writes each synchronised one.

* `GradSink`: the parameters' ``.grad`` (the plain API, Horovod, DeepSpeed).
* `BucketViewSink`: DDP's bucket views (the communication hook path): DDP copies whatever the
  hook leaves in its buckets into ``.grad``, and a parameter DDP did not hand over is not ours
  to change.

Both keep the window's priors (gradients left from before, see `window`) out of the local gradient
and add them back to the average.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn


class GradSink:
    """Reads and writes ``param.grad``."""

    def __init__(self, priors: Dict[int, torch.Tensor]):
        self.priors = priors

    def local_grad(self, p: nn.Parameter, dtype: torch.dtype) -> torch.Tensor:
        """This rank's gradient of the current window (without any gradient left from before)."""
        g = self._current(p)
        if g is None:
            return torch.zeros(p.shape, dtype=dtype, device=p.device)
        g = g.detach().to(dtype)
        prior = self.priors.get(id(p))
        return g - prior.to(dtype) if prior is not None else g

    def write(self, p: nn.Parameter, average: torch.Tensor) -> None:
        """The synchronised gradient is ``prior + average``."""
        prior = self.priors.get(id(p))
        self._store(p, average if prior is None else average + prior.to(average.dtype))

    def write_product(self, p: nn.Parameter, left: torch.Tensor, right: torch.Tensor) -> None:
        """Write ``left @ right``, straight into ``.grad`` when nothing else is there (no temporary)."""
        grad = p.grad
        if (grad is not None and id(p) not in self.priors and grad.dtype == left.dtype
                and grad.is_contiguous()):
            torch.mm(left, right, out=grad)
        else:
            self.write(p, left @ right)

    def write_unused(self, p: nn.Parameter) -> None:
        """No rank used ``p``: its gradient stays as it is (None), as with DDP."""

    def write_dense(self, p: nn.Parameter, average: torch.Tensor, any_rank_had_grad: bool) -> None:
        """A dense bucket's result (the all-reduce carried the priors already)."""
        if p.grad is not None:
            p.grad.copy_(average)
        elif any_rank_had_grad:
            p.grad = average.clone()

    def _current(self, p: nn.Parameter) -> Optional[torch.Tensor]:
        return p.grad

    def _store(self, p: nn.Parameter, value: torch.Tensor) -> None:
        if p.grad is not None:
            p.grad.copy_(value)
        else:
            p.grad = value.to(p.dtype)


class BucketViewSink(GradSink):
    """Reads ``.grad`` and writes DDP's bucket views (DDP copies them into ``.grad``)."""

    def __init__(self, priors: Dict[int, torch.Tensor]):
        super().__init__(priors)
        self.views: Dict[int, torch.Tensor] = {}

    def write_product(self, p: nn.Parameter, left: torch.Tensor, right: torch.Tensor) -> None:
        self.write(p, left @ right)

    def write_dense(self, p: nn.Parameter, average: torch.Tensor, any_rank_had_grad: bool) -> None:
        self._store(p, average)

    def write_unused(self, p: nn.Parameter) -> None:
        """No rank used ``p``: DDP keeps what its bucket holds, the average, zeros here."""
        self.write(p, torch.zeros(p.shape, dtype=p.dtype, device=p.device))

    def _store(self, p: nn.Parameter, value: torch.Tensor) -> None:
        view = self.views.get(id(p))
        if view is not None:  # a parameter DDP ignores is not ours to change either
            view.copy_(value.view_as(view))
