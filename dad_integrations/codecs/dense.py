"""Dense buckets: the route for everything factors do not cover, as DDP and Horovod send it
(bytes: `routes.dense`).

Gradients are flattened into buckets of at most ``bucket_cap_mb``, reduced with one all-reduce
each, and scaled. Streaming (`DenseBuckets`): items join the open bucket in an order every rank
shares (the exchange order), and a full bucket goes on the wire at once, while backward computes
the rest, as DDP's buckets do (its items' gradients are final: a unit is routed only once autograd
has finished it); the first bucket is capped at `FIRST_BUCKET_MB`, as DDP's, so that the wire starts
early. Packing a bucket is its one copy; the result is written back with the postscale folded into
that write (`sink.GradSink.write_dense_scaled`).

Unused parameters. A parameter whose gradient is None on a rank must keep ``grad = None`` when no
rank used it (as with DDP). Instead of a flag per parameter on every step (DDP's
``find_unused_parameters`` map), a rank without a gradient sends zeros with a NaN *mark* in the
first element. A finite first element in the sum means every rank had a gradient (nothing extra
on the wire); a non-finite one (a mark, or a gradient that really is not finite) is resolved by one
more small all-reduce of, per such parameter, how many ranks had a gradient and the true first
elements. Every rank sees the same sums, so all agree on whether that round runs.

Finiteness costs one more pass over every bucket, read only where the caller asks
(`DenseBuckets.finish` with ``check_finite``).
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

import torch
from torch import nn

from dad_integrations.comm.aggregator import CommHandle, FactorAggregator, Traffic
from dad_integrations.capture.sink import GradSink

DenseItem = Tuple[str, nn.Parameter]
FLAGS = "[dense flags]"  # the report's name for the resolving round's bytes
FIRST_BUCKET_MB = 1.0    # DDP's first bucket (``dist._DEFAULT_FIRST_BUCKET_BYTES``)
Account = Callable[[str, Optional[nn.Parameter], Traffic], None]


def bucket_dtype(params: Iterable[nn.Parameter], wire_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """The dtype of the dense buckets for ``params``: ``wire_dtype``, else their common dtype, and
    fp32 where their dtypes differ (None where there are none)."""
    if wire_dtype is not None:
        return wire_dtype
    dtypes = {p.dtype for p in params}
    if not dtypes:
        return None
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


class DenseBuckets:
    """One step's dense buckets, sent as they fill (module doc): ``add`` items in the shared order once
    their gradients are final; `send` puts the open bucket on the wire early (when nothing more will
    join it before the caller waits for something else); `finish` sends the rest, waits, resolves
    unused parameters and writes ``postscale * sum(prescale * g)`` into ``sink`` (``postscale`` None
    averages). ``early()``: whether a bucket sent now overlaps backward (its items: ``overlapped``)."""

    def __init__(self, aggregator: FactorAggregator, sink: GradSink, *, bucket_cap_mb: float,
                 dtype: torch.dtype, account: Account, prescale: float = 1.0,
                 postscale: Optional[float] = None, first_bucket_mb: Optional[float] = FIRST_BUCKET_MB,
                 early: Callable[[], bool] = lambda: False):
        self.aggregator, self.sink, self.account = aggregator, sink, account
        self.dtype, self.prescale = dtype, prescale
        self.postscale = 1.0 / aggregator.world_size if postscale is None else postscale
        self.itemsize = dtype.itemsize
        self.cap = bucket_cap_mb * 2 ** 20
        self.first_cap = self.cap if first_bucket_mb is None else min(self.cap, first_bucket_mb * 2 ** 20)
        self.early = early
        self.overlapped: Set[str] = set()
        self._open: List[DenseItem] = []
        self._open_bytes = 0
        self._sent: List[Tuple[List[DenseItem], CommHandle]] = []

    def room(self) -> float:
        """Bytes the open bucket takes before it is full."""
        return (self.cap if self._sent else self.first_cap) - self._open_bytes

    def nbytes(self, params: Iterable[nn.Parameter]) -> int:
        """Bytes ``params`` take in a bucket."""
        return sum(p.numel() for p in params) * self.itemsize

    def add(self, name: str, p: nn.Parameter) -> None:
        """Append one parameter (its gradient final on this rank) to the open bucket; a full
        bucket goes on the wire."""
        nbytes = self.nbytes([p])
        if self._open and nbytes > self.room():
            self.send()
        self._open.append((name, p))
        self._open_bytes += nbytes
        if self.room() <= 0:
            self.send()

    def send(self) -> None:
        """Put the open bucket on the wire (nothing where it is empty)."""
        if not self._open:
            return
        bucket, self._open, self._open_bytes = self._open, [], 0
        flat = torch.cat([_local(self.sink.dense_grad(p), p, self.prescale, self.dtype) for _, p in bucket])
        handle = self.aggregator.all_reduce(flat, name=f"dad.dense.{len(self._sent)}", op="sum")
        if self.early():
            self.overlapped.update(name for name, _ in bucket)
        self._sent.append((bucket, handle))

    def finish(self, check_finite: bool = True) -> bool:
        """Send what is left, wait for every bucket and write the results; returns whether every
        reduced gradient is finite (True without looking, where ``check_finite`` is False)."""
        self.send()
        if not self._sent:
            return True
        sums: List[Tuple[DenseItem, torch.Tensor]] = []
        flats: List[torch.Tensor] = []
        for bucket, handle in self._sent:
            flat = handle.wait()
            flats.append(flat)
            for (name, p), total in zip(bucket, flat.split([p.numel() for _, p in bucket])):
                self.account(name, p, handle.traffic.share(p.numel() / max(flat.numel(), 1)))
                sums.append(((name, p), total))
        self._sent = []
        had_grad = self._resolve(sums, flats[0].device)
        # marks resolved: one check a bucket
        finite = not check_finite or all(bool(torch.isfinite(flat).all()) for flat in flats)
        for (name, p), total in sums:
            self.sink.write_dense_scaled(p, total.view_as(p), self.postscale, had_grad.get(id(p), True))
        return finite

    def _resolve(self, sums: List[Tuple[DenseItem, torch.Tensor]], device: torch.device) -> Dict[int, bool]:
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
        grads = [self.sink.dense_grad(p) for p, _ in unresolved]
        flags = [float(g is not None) for g in grads]
        firsts = [float(g.detach().reshape(-1)[:1].mul(self.prescale).to(self.dtype)[0])
                  if g is not None and p.numel() else 0.0 for g, (p, _) in zip(grads, unresolved)]
        handle = self.aggregator.all_reduce(torch.tensor(flags + firsts, dtype=self.dtype, device=device),
                                            name="dad.dense.flags", op="sum")
        out = handle.wait()
        self.account(FLAGS, None, handle.traffic)
        k = len(unresolved)
        for i, (p, total) in enumerate(unresolved):
            if total.numel():
                total[0] = out[k + i]
        return {id(p): bool(out[i] > 0) for i, (p, _) in enumerate(unresolved)}


def _local(grad: Optional[torch.Tensor], p: nn.Parameter, prescale: float, dtype: torch.dtype) -> torch.Tensor:
    """This rank's part of a bucket: its gradient, or zeros marked with a NaN first element."""
    if grad is not None:
        g = grad.detach()
        return (g if prescale == 1.0 else g * prescale).reshape(-1).to(dtype)
    out = torch.zeros(p.numel(), dtype=dtype, device=p.device)
    if p.numel():
        out[0] = float("nan")
    return out
