"""Gradient sinks: where a step reads each local gradient and writes each synchronised one: `GradSink`
(``.grad``: the plain API, Horovod, DeepSpeed), `BucketViewSink` (DDP's communication hook) and
`ShardSink` (FSDP2's reduce-scatter buffers, `fsdp`). The first two keep the window's priors
(gradients left from before, see `window`) out of the local gradient and add them back to the average.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import nn
from dad_integrations.capture.rows import as_matrix


class GradSink:
    """Reads and writes ``param.grad``."""

    prior_scale = 1.0  # what a prior counts for in the result (`BucketViewSink` under DDP's join)

    def __init__(self, priors: Dict[int, torch.Tensor]):
        self.priors = priors

    def dense_grad(self, p: nn.Parameter) -> Optional[torch.Tensor]:
        """What a dense bucket reduces for ``p`` (None: this rank has no gradient of it)."""
        return self._current(p)

    def add_local(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Add ``value`` to this rank's gradient of ``p`` before a dense bucket reduces it (an
        error-feedback residual flushed by a unit leaving a rank route)."""
        value = value.reshape(p.shape)
        if p.grad is None:
            p.grad = value.to(p.dtype).clone()
        else:
            p.grad.add_(value.to(p.grad.dtype))

    def local_grad(self, p: nn.Parameter, dtype: torch.dtype) -> torch.Tensor:
        """This rank's gradient of the current window (without any gradient left from before),
        as a matrix (`rows.as_matrix`) where ``p`` has more than two dimensions."""
        g = self._current(p)
        if g is None:
            return as_matrix(torch.zeros(p.shape, dtype=dtype, device=p.device))
        g = g.detach().to(dtype)
        prior = self.priors.get(id(p))
        return as_matrix(g - prior.to(dtype) if prior is not None else g)

    def write(self, p: nn.Parameter, average: torch.Tensor) -> None:
        """The synchronised gradient is ``prior + average`` (``average`` shaped as ``p`` or as its matrix)."""
        average = average.reshape(p.shape)
        prior = self.priors.get(id(p))
        self._store(p, average if prior is None else average + prior.to(average.dtype) * self.prior_scale)

    def write_product(self, p: nn.Parameter, left: torch.Tensor, right: torch.Tensor) -> None:
        """Write ``left @ right``, straight into ``.grad`` when nothing else is there (no temporary)."""
        grad = p.grad
        if (grad is not None and id(p) not in self.priors and grad.dtype == left.dtype
                and grad.is_contiguous()):
            torch.mm(left, right, out=as_matrix(grad))
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

    def write_dense_scaled(self, p: nn.Parameter, total: torch.Tensor, scale: float,
                           any_rank_had_grad: bool) -> None:
        """`write_dense` of ``scale * total`` (``total`` shaped as ``p``, a view of its bucket):
        one pass straight into the destination where it has ``total``'s dtype, not a scaling
        pass over the bucket and then a copy."""
        out = self._dense_target(p)
        if out is not None and out.dtype == total.dtype and not out.requires_grad:  # (create_graph: copy_)
            torch.mul(total.view_as(out), scale, out=out)
        else:
            self.write_dense(p, total.to(p.dtype).mul_(scale), any_rank_had_grad)

    def _dense_target(self, p: nn.Parameter) -> Optional[torch.Tensor]:
        return p.grad

    def _current(self, p: nn.Parameter) -> Optional[torch.Tensor]:
        return p.grad

    def _store(self, p: nn.Parameter, value: torch.Tensor) -> None:
        if p.grad is not None:
            p.grad.copy_(value)
        else:
            p.grad = value.to(p.dtype)


class BucketViewSink(GradSink):
    """Reads ``.grad`` and writes DDP's bucket views (DDP copies them into ``.grad``; a parameter
    DDP did not hand over is not ours to change).

    ``shadow``: DDP's ``join`` runs this step on a rank that has run out of inputs, handing over
    zero buckets to match the other ranks' collectives (``_DDPJoinHook``): this rank adds
    nothing, whatever its ``.grad`` holds (no gradient to the dense buckets, as DDP's unused
    parameters, and zeros to the rank routes). ``prior_scale``: what a prior (the same on every
    rank) counts for in the result: 1 where every rank sends it, as the average has it; under
    ``join`` only the ranks still training send theirs (DDP reduces whole buckets).
    """

    def __init__(self, priors: Dict[int, torch.Tensor]):
        super().__init__(priors)
        self.views: Dict[int, torch.Tensor] = {}
        self.shadow = False

    def _current(self, p: nn.Parameter) -> Optional[torch.Tensor]:
        return None if self.shadow else p.grad

    def write_product(self, p: nn.Parameter, left: torch.Tensor, right: torch.Tensor) -> None:
        self.write(p, left @ right)

    def write_dense(self, p: nn.Parameter, average: torch.Tensor, any_rank_had_grad: bool) -> None:
        self._store(p, average)

    def _dense_target(self, p: nn.Parameter) -> Optional[torch.Tensor]:
        return self.views.get(id(p))

    def write_unused(self, p: nn.Parameter) -> None:
        """No rank used ``p``: DDP keeps what its bucket holds, the average, zeros here."""
        self.write(p, torch.zeros(p.shape, dtype=p.dtype, device=p.device))

    def _store(self, p: nn.Parameter, value: torch.Tensor) -> None:
        view = self.views.get(id(p))
        if view is not None:  # a parameter DDP ignores is not ours to change either
            view.copy_(value.view_as(view))


@dataclass
class ShardSlot:
    """One parameter's place in FSDP2's reduce-scatter buffers (``docs/internals/fsdp2_notes.md``): the
    same ``offset`` in every rank's chunk, ``numel`` = ``rows`` (``ceil(shape[0] / S)``) times
    the other dims."""

    name: str
    param: nn.Parameter       # the sharded parameter
    offset: int
    numel: int
    rows: int
    shape: Tuple[int, ...]    # the parameter's global shape


class ShardSink:
    """Reads and writes FSDP2's reduce-scatter buffers: each parameter's whole local gradient from
    the input, this rank's padded shard of the result into the output chunk.

    ``inp`` is ``(S * chunk,)``: chunk r holds, per slot, rows ``[r c, (r+1) c)`` of this rank's
    local gradient (zero past the last row), already multiplied by FSDP's ``1/predivide``.
    ``out`` is this rank's ``(chunk,)``, in the same layout, for the reduced shards.
    """

    def __init__(self, slots: Sequence[ShardSlot], out: torch.Tensor, inp: torch.Tensor, world_size: int,
                 predivide: float = 1.0):
        self.slots = {id(s.param): s for s in slots}
        self.out, self.inp, self.world_size, self.predivide = out, inp, world_size, predivide
        self.chunk = out.numel()

    def slot(self, p: nn.Parameter) -> Optional[ShardSlot]:
        return self.slots.get(id(p))

    def _input(self, s: ShardSlot) -> torch.Tensor:
        """``s``'s part of every rank's input chunk, ``(S, numel)``."""
        return self.inp.view(self.world_size, self.chunk)[:, s.offset:s.offset + s.numel]

    def local_grad(self, p: nn.Parameter, dtype: torch.dtype) -> torch.Tensor:
        """This rank's whole (unsharded) local gradient of ``p``, as autograd computed it."""
        s = self.slot(p)
        if s is None:
            return as_matrix(torch.zeros(p.shape, dtype=dtype, device=self.inp.device))
        whole = self._input(s).reshape((self.world_size * s.rows,) + s.shape[1:])[:s.shape[0]]
        return as_matrix(whole.to(dtype) * self.predivide)

    def add_local(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Add ``value`` (``p``'s whole shape) to this rank's local gradient of ``p`` in the
        reduce-scatter input, so that FSDP's reduce-scatter sends it too."""
        s = self.slots[id(p)]
        value = value.reshape(s.shape)
        block = self._input(s).view((self.world_size, s.rows) + tuple(s.shape[1:]))
        for r in range(self.world_size):  # chunk r holds rows [r c, (r+1) c)
            part = value[r * s.rows:(r + 1) * s.rows]
            if part.shape[0]:
                block[r, :part.shape[0]].add_(part.to(block.dtype) / self.predivide)

    def write(self, p: nn.Parameter, shard: Optional[torch.Tensor]) -> None:
        """Write this rank's shard of ``p`` (its first rows; the padding rows after it are zeroed),
        or zeros where ``shard`` is None."""
        s = self.slots[id(p)]
        view = self.out[s.offset:s.offset + s.numel].view((s.rows,) + s.shape[1:])
        if shard is None:
            view.zero_()
            return
        k = shard.shape[0]
        view[:k].copy_(shard.reshape((k,) + tuple(s.shape[1:])))
        view[k:].zero_()

    def dense_input(self, slots: Sequence[ShardSlot]) -> torch.Tensor:
        """The input chunks of ``slots`` only (``S * sum numel``), for FSDP's own reduce-scatter."""
        return torch.cat([self._input(s) for s in slots], dim=1).reshape(-1)

    def write_dense(self, slots: Sequence[ShardSlot], result: torch.Tensor) -> None:
        """Scatter the reduce-scatter's ``result`` of `dense_input` back to each slot's place."""
        pos = 0
        for s in slots:
            self.out[s.offset:s.offset + s.numel].copy_(result[pos:pos + s.numel])
            pos += s.numel
