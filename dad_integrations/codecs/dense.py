"""Dense buckets: the route for everything factors do not cover, as DDP and Horovod send it.

Gradients are flattened into buckets of at most ``bucket_cap_mb``, reduced with one all-reduce
each, and scaled. Bytes per rank: ``2 (S-1)/S`` of the bucket, like a ring all-reduce, and no more.

Unused parameters. A parameter whose gradient is None on a rank must keep ``grad = None`` when no
rank used it (as with DDP), so the ranks have to learn who had a gradient. Instead of a flag per
parameter on every step (DDP's ``find_unused_parameters`` map: a number per parameter), a rank
without a gradient sends zeros with a NaN *mark* in the first element. A finite first element in
the sum means every rank had a gradient (the common case: nothing extra on the wire); a
non-finite one (a mark, or a gradient that really is not finite) is resolved by one more small
all-reduce of, per such parameter, how many ranks had a gradient and the true first elements.
Every rank sees the same sums, so all agree on whether that round runs.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..aggregator import FactorAggregator, Traffic
from ..sink import GradSink

DenseItem = Tuple[str, nn.Parameter]
FLAGS = "[dense flags]"  # the report's name for the resolving round's bytes


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
    ``account`` gets each parameter's share of its bucket's traffic (and the resolving round's,
    under the name `FLAGS` with no parameter). Returns whether every reduced gradient is finite.
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
        flat = torch.cat([_local(p, prescale, dtype) for _, p in bucket])
        pending.append((bucket, aggregator.all_reduce(flat, name=f"dad.dense.{b}", op="sum")))

    sums: List[Tuple[DenseItem, torch.Tensor]] = []
    flats: List[torch.Tensor] = []
    for bucket, handle in pending:
        flat = handle.wait()
        flats.append(flat)
        offset = 0
        for name, p in bucket:
            account(name, p, handle.traffic.share(p.numel() / max(flat.numel(), 1)))
            sums.append(((name, p), flat[offset:offset + p.numel()]))
            offset += p.numel()
    had_grad = _resolve(sums, aggregator, prescale, dtype, device, account)
    finite = all(bool(torch.isfinite(flat).all()) for flat in flats)  # marks resolved: one check a bucket
    for (name, p), total in sums:
        avg = total.view_as(p).to(p.dtype).mul_(postscale)
        sink.write_dense(p, avg, had_grad.get(id(p), True))
    return finite


def _local(p: nn.Parameter, prescale: float, dtype: torch.dtype) -> torch.Tensor:
    """This rank's part of a bucket: its gradient, or zeros marked with a NaN first element."""
    if p.grad is not None:
        g = p.grad.detach()
        return (g if prescale == 1.0 else g * prescale).reshape(-1).to(dtype)
    out = torch.zeros(p.numel(), dtype=dtype, device=p.device)
    if p.numel():
        out[0] = float("nan")
    return out


def _resolve(sums: List[Tuple[DenseItem, torch.Tensor]], aggregator: FactorAggregator, prescale: float,
             dtype: torch.dtype, device: torch.device,
             account: Callable[[str, Optional[nn.Parameter], Traffic], None]) -> Dict[int, bool]:
    """For each parameter whose summed first element is not finite (a rank without a gradient, or a
    gradient that is not finite) or that has no elements: whether any rank had a gradient; its
    first element is replaced by the true sum. One all-reduce, only when there is such a parameter."""
    nonempty = [(p, total) for (_, p), total in sums if total.numel()]
    marked = []  # one check for all first elements (one device sync, not one per parameter)
    if nonempty:
        bad = (~torch.isfinite(torch.stack([total[0] for _, total in nonempty]))).nonzero().flatten().tolist()
        marked = [nonempty[i] for i in bad]
    unresolved = [(p, total) for (_, p), total in sums if not total.numel()] + marked
    if not unresolved:
        return {}
    flags = [float(p.grad is not None) for p, _ in unresolved]
    firsts = [float(p.grad.detach().reshape(-1)[:1].mul(prescale).to(dtype)[0])
              if p.grad is not None and p.numel() else 0.0 for p, _ in unresolved]
    handle = aggregator.all_reduce(torch.tensor(flags + firsts, dtype=dtype, device=device),
                                   name="dad.dense.flags", op="sum")
    out = handle.wait()
    account(FLAGS, None, handle.traffic)
    k = len(unresolved)
    for i, (p, total) in enumerate(unresolved):
        if total.numel():
            total[0] = out[k + i]
    return {id(p): bool(out[i] > 0) for i, (p, _) in enumerate(unresolved)}
