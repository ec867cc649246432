"""Bucketed dense all-reduce: the path for everything factors do not cover.

Gradients are flattened into buckets of at most ``bucket_cap_mb``, reduced with one collective
each, and averaged. A parameter whose gradient is None on a rank contributes zeros; a flag per
parameter, summed in the first bucket, tells whether any rank had a gradient at all, so that
parameters no rank used keep ``grad = None`` (as with DDP).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .aggregator import FactorAggregator, Traffic

DenseItem = Tuple[str, nn.Parameter]


def _buckets(items: Sequence[DenseItem], cap_bytes: float, itemsize: int) -> List[List[DenseItem]]:
    out: List[List[DenseItem]] = [[]]
    size = 0
    for item in items:
        nbytes = item[1].numel() * itemsize
        if out[-1] and size + nbytes > cap_bytes:
            out.append([])
            size = 0
        out[-1].append(item)
        size += nbytes
    return out


def allreduce_dense(items: Sequence[DenseItem], aggregator: FactorAggregator, *,
                    bucket_cap_mb: float, wire_dtype: Optional[torch.dtype],
                    account: Callable[[str, nn.Parameter, Traffic], None],
                    prescale: float = 1.0, postscale: Optional[float] = None,
                    write: Optional[Callable[[nn.Parameter, torch.Tensor], None]] = None) -> None:
    """Reduce the gradients of ``items`` over ranks in place: ``postscale * sum(prescale * g)``.

    ``postscale`` None averages (``1 / world_size``). ``prescale`` is applied before the wire cast,
    as Horovod's and DeepSpeed's gradient pre-division is, to keep fp16 sums in range.
    ``account`` gets each parameter's share of the traffic; ``write``, when given, receives each
    result instead of ``.grad`` (DDP's bucket views).
    """
    if not items:
        return
    s = aggregator.world_size
    postscale = 1.0 / s if postscale is None else postscale
    device = items[0][1].device
    dtype = wire_dtype or items[0][1].dtype
    if any((wire_dtype or p.dtype) != dtype for _, p in items):
        dtype = torch.float32  # mixed gradient dtypes share fp32 buckets
    itemsize = torch.empty((), dtype=dtype).element_size()
    buckets = _buckets(items, bucket_cap_mb * 2 ** 20, itemsize)

    pending = []
    for b, bucket in enumerate(buckets):
        parts = [_prescaled(p.grad, prescale).reshape(-1).to(dtype) if p.grad is not None
                 else torch.zeros(p.numel(), dtype=dtype, device=device) for _, p in bucket]
        if b == 0:  # how many ranks hold a gradient, per parameter
            parts.append(torch.tensor([p.grad is not None for _, p in items], dtype=dtype, device=device))
        flat = torch.cat(parts)
        before = aggregator.traffic()
        handle = aggregator.all_reduce(flat, name=f"dad.dense.{b}", op="sum")
        pending.append((bucket, handle, aggregator.traffic() - before, flat.numel()))

    flags = None
    position = {id(p): i for i, (_, p) in enumerate(items)}
    for b, (bucket, handle, traffic, numel) in enumerate(pending):
        flat = handle.wait()
        if b == 0:
            flags = flat[-len(items):].tolist()
        offset = 0
        for name, p in bucket:
            account(name, p, traffic.share(p.numel() / numel))
            avg = flat[offset:offset + p.numel()].view_as(p).to(p.dtype).mul_(postscale)
            offset += p.numel()
            if write is not None:
                write(p, avg)
            elif p.grad is not None:
                p.grad.copy_(avg)
            elif flags[position[id(p)]] > 0:
                p.grad = avg.clone()
        if b == 0:
            account("[dense flags]", None, traffic.share(len(items) / numel))



def _prescaled(grad: torch.Tensor, prescale: float) -> torch.Tensor:
    return grad.detach() if prescale == 1.0 else grad.detach() * prescale
