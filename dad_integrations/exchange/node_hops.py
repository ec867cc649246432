"""The hops inside a node of the two-level routes (`exchange.two_level`): byte layouts every rank of
the node knows beforehand, so neither hop exchanges sizes.

- **Hop 1, to the unit's owner** (`NodeHops.send_blocks`, `NodeHops.send_specs`): exact factors send
  each rank's rows (`codecs.exact.ExactCodec`'s packed buffer, its length from the agreed row
  counts); the rank routes send each rank's dense gradient in the compute dtype, which the owner
  sums in rank order (`node_sum`); the dense route sends ``[gradient, 1]`` in the dense buckets'
  dtype (``[0..., 0]`` where this rank has no gradient), so the sum also counts the ranks that had
  one, as DDP's buckets tell a gradient from none.
- **Hop 3, from the owner** (`NodeHops.result_specs`, `NodeHops.write`): the average, or where
  fewer bytes the factors every rank rebuilds it from: PowerSGD's ``P`` (scaled) and ``Q``, or
  every node's rank-r factors. Every rank of the node writes through the same code, the owner
  too, so the node's ranks end bit-identical; so do the nodes, whose owners rebuild from the same
  collectives' results.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
from torch import nn

from dad_integrations.builtin_routes import DENSE, EXACT, RANK
from dad_integrations.capture.rows import Rows, compute_dtype
from dad_integrations.capture.sink import GradSink
from dad_integrations.capture.units import FactorUnit
from dad_integrations.codecs.exact import ExactCodec
from dad_integrations.codecs.wire import BlockSpec, pack, packed_size, unpack
from dad_integrations.report import ParamReport
from dad_integrations.routes import layouts
from dad_integrations.routes.registry import HopBytes, has_codec, is_rank_route, raise_unsupported


@dataclass
class HopItem:
    """One unit, or one parameter that is always dense, in a two-level bucket: what its hops need."""

    name: str
    params: List[nn.Parameter]
    owner: int                                      # the local index that does its work
    unit: Optional[FactorUnit] = None
    rows: Optional[List[Rows]] = None               # this rank's rows; the owner's: the node's
    counts: Optional[List[int]] = None              # this rank's rows per use
    node_rows: Optional[List[List[int]]] = None     # by node, by use
    rank_rows: Optional[List[List[int]]] = None     # by rank of this node, by use
    rep: str = DENSE
    hop: HopBytes = HopBytes(0.0, 0.0, 0.0, False)  # its route's bytes by hop (`routes.registry.HopBytes`)
    entries: List[ParamReport] = field(default_factory=list)
    result: Optional[List[torch.Tensor]] = None     # the owner's: node sums, then hop 3's blocks

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def sums_at_owner(rep: str) -> bool:
    """Routes whose owner compresses the node's dense sum: the rank routes and those with a codec
    of their own (`routes.codec`)."""
    return is_rank_route(rep) or has_codec(rep)


class NodeHops:
    """Encode and decode both hops inside the node for one synchroniser's items."""

    def __init__(self, exact: ExactCodec, dense_dtype: torch.dtype, rank: Optional[int], nodes: int,
                 device: torch.device):
        self.exact, self.dense_dtype, self.rank, self.nodes, self.device = exact, dense_dtype, rank, nodes, device

    # -- hop 1 -------------------------------------------------------------------------------------
    def send_blocks(self, it: HopItem, sink: GradSink) -> List[torch.Tensor]:
        """This rank's contribution to the item, as blocks; raises for a route with no two-level exchange."""
        if it.rep == EXACT:
            return [self.exact.encode(it.unit, it.rows)]
        if it.rep == DENSE:
            out = []
            for q in it.params:
                g = sink.dense_grad(q)
                out.append(torch.zeros(q.numel() + 1, dtype=self.dense_dtype, device=self.device) if g is None
                           else torch.cat([g.detach().reshape(-1).to(self.dense_dtype),
                                           torch.ones(1, dtype=self.dense_dtype, device=self.device)]))
            return out
        if not sums_at_owner(it.rep):
            raise_unsupported(it.rep, layouts.TWO_LEVEL)
        return [sink.local_grad(q, compute_dtype(it.unit.param)).reshape(-1) for q in it.params]

    def send_specs(self, it: HopItem, local: int, mine: Sequence[torch.Tensor]) -> List[BlockSpec]:
        """The layout of what local rank ``local`` sends for the item: as this rank's blocks ``mine``,
        but exact factors' (their sizes from the agreed row counts)."""
        if it.rep == EXACT:
            return [(torch.uint8, tuple(self.exact.sizes(it.unit, [it.rank_rows[local]])))]
        return [(b.dtype, tuple(b.shape)) for b in mine]

    def receive(self, it: HopItem, by_rank: Sequence[List[torch.Tensor]]) -> None:
        """The owner's view of what the node sent: rows stacked in rank order (exact, into
        ``it.rows``) or the node's sums, in rank order (into ``it.result``)."""
        if it.rep == EXACT:
            it.rows = self.exact.stacked_rows(it.unit, [b[0] for b in by_rank], it.rank_rows)
            return
        it.result = [functools.reduce(torch.add, blocks[1:], blocks[0].clone()) for blocks in zip(*by_rank)]

    def to_owner(self, items: Sequence[HopItem], sink: GradSink, intra, local: int, name: str):
        """Hop 1 for a bucket: one all-to-all inside the node (``intra``, local size L) of every
        item's `send_blocks` to its owner; returns this rank's items (``local`` is its index), with
        the node's contributions stacked or summed (`receive`), and the collective's traffic."""
        size = intra.world_size
        sent = {id(it): self.send_blocks(it, sink) for it in sorted(items, key=lambda it: it.owner)}
        by_owner = [[b for it in items if it.owner == j for b in sent[id(it)]] for j in range(size)]
        send_sizes = [packed_size([(b.dtype, tuple(b.shape)) for b in blocks]) for blocks in by_owner]
        send = pack([b for blocks in by_owner for b in blocks], self.device)  # each block padded alone
        mine = [it for it in items if it.owner == local]
        recv_specs = [[s for it in mine for s in self.send_specs(it, k, sent[id(it)])] for k in range(size)]
        recv_sizes = [packed_size(specs) for specs in recv_specs]
        handle = intra.all_to_all_v(send, send_sizes, recv_sizes, name=name)
        per_rank = [iter(unpack(part, specs)) for part, specs in zip(handle.wait().split(recv_sizes), recv_specs)]
        for it in mine:  # every rank sends an item as many blocks
            self.receive(it, [[next(blocks) for _ in sent[id(it)]] for blocks in per_rank])
        return mine, handle.traffic

    @staticmethod
    def node_grad(it: HopItem):
        """The owner's node sum of the weight as the rank codecs' ``local_grad``."""
        m, n = it.unit.shape
        summed = it.result[0].view(m, n)
        return lambda p, dtype: summed if summed.dtype == dtype else summed.to(dtype)

    # -- hop 3 -------------------------------------------------------------------------------------
    @staticmethod
    def dense_average(total_with_flag: torch.Tensor, scale: float) -> torch.Tensor:
        """A dense block's all-reduced ``[sum, ranks that had a gradient]``, the sum scaled."""
        out = total_with_flag.clone()
        out[:-1].mul_(scale)
        return out

    @staticmethod
    def product_blocks(it: HopItem, left: torch.Tensor, right: torch.Tensor, scale: float) -> List[torch.Tensor]:
        """A rank route's hop-3 blocks: its factors where fewer bytes, else the product; then its
        biases' averages (their node sums, all-reduced, in ``it.result[1:]``)."""
        weight = [left.contiguous(), right.contiguous()] if it.hop.factors_back else [(left @ right).reshape(-1)]
        return weight + [r * scale for r in it.result[1:]]

    def result_specs(self, it: HopItem) -> List[BlockSpec]:
        """The layout of the owner's hop-3 blocks of the item."""
        if it.rep == DENSE:
            return [(self.dense_dtype, (q.numel() + 1,)) for q in it.params]
        cdt = compute_dtype(it.params[0])
        if it.rep == EXACT:
            return [(cdt, tuple(q.shape)) for q in it.params]
        m, n = it.unit.shape
        if it.hop.factors_back:
            r = min(self.rank, m, n) * (self.nodes if it.rep == RANK else 1)
            weight = [(cdt, (m, r)), (cdt, (r, n))]
        else:
            weight = [(cdt, (m * n,))]
        return weight + [(cdt, (q.numel(),)) for q in it.params[1:]]

    @staticmethod
    def write(it: HopItem, blocks: List[torch.Tensor], sink: GradSink) -> None:
        """Write the item's synchronised gradients from the owner's hop-3 blocks."""
        if it.rep == DENSE:
            for q, b in zip(it.params, blocks):
                if b[-1] > 0:  # some rank had a gradient
                    sink.write_dense(q, b[:-1].view(q.shape).to(q.dtype), True)
            return
        if it.rep == EXACT:
            if not any(any(r) for r in it.node_rows):
                sink.write_unused(it.unit.param)
                return
            for q, b in zip(it.params, blocks):
                sink.write(q, b)
            return
        m, n = it.unit.shape
        if it.hop.factors_back:
            sink.write_product(it.unit.param, blocks[0], blocks[1])
            rest = blocks[2:]
        else:
            sink.write(it.unit.param, blocks[0].view(m, n))
            rest = blocks[1:]
        for q, b in zip(it.params[1:], rest):
            sink.write_dense(q, b.view(q.shape).to(q.dtype), True)
