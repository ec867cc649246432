"""Dense buckets: the route for everything factors do not cover, as DDP and Horovod send it.

Gradients are flattened into buckets of at most ``bucket_cap_mb``, reduced with one all-reduce
each, and scaled. A parameter whose gradient is None on a rank contributes zeros; a flag per
parameter, summed in the first bucket, tells whether any rank had a gradient at all, so that
parameters no rank used keep ``grad = None`` (as with DDP). Bytes per rank: ``2 (S-1)/S`` of the
bucket, like a ring all-reduce.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..aggregator import FactorAggregator, Traffic
from ..sink import GradSink

DenseItem = Tuple[str, nn.Parameter]
FLAGS = "[dense flags]"


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


def allreduce_dense(items: Sequence[DenseItem], aggregator: FactorAggregator, sink: GradSink, *,
                    bucket_cap_mb: float, wire_dtype: Optional[torch.dtype],
                    account: Callable[[str, Optional[nn.Parameter], Traffic], None],
                    prescale: float = 1.0, postscale: Optional[float] = None) -> bool:
    """Reduce the gradients of ``items`` over ranks: ``postscale * sum(prescale * g)``, into ``sink``.

    ``postscale`` None averages (``1 / world_size``). ``prescale`` is applied before the wire cast,
    as Horovod's and DeepSpeed's gradient pre-division is, to keep fp16 sums in range.
    ``account`` gets each parameter's share of its bucket's traffic (and the flags' share, under
    the name `FLAGS` with no parameter). Returns whether every reduced gradient is finite.
    """
    if not items:
        return True
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
        pending.append((bucket, aggregator.all_reduce(flat, name=f"dad.dense.{b}", op="sum"), flat.numel()))

    flags = None
    finite = True
    position = {id(p): i for i, (_, p) in enumerate(items)}
    for b, (bucket, handle, numel) in enumerate(pending):
        flat = handle.wait()
        finite = finite and bool(torch.isfinite(flat).all())
        if b == 0:
            flags = flat[-len(items):].tolist()
            account(FLAGS, None, handle.traffic.share(len(items) / numel))
        offset = 0
        for name, p in bucket:
            account(name, p, handle.traffic.share(p.numel() / numel))
            avg = flat[offset:offset + p.numel()].view_as(p).to(p.dtype).mul_(postscale)
            offset += p.numel()
            sink.write_dense(p, avg, flags[position[id(p)]] > 0)
    return finite


def _prescaled(grad: torch.Tensor, prescale: float) -> torch.Tensor:
    return grad.detach() if prescale == 1.0 else grad.detach() * prescale
