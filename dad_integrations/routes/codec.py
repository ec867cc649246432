"""A route's own codec over a (local matrix block, sum group), and the route built from it.

A codec says what one rank sends of its block and how the group's payloads rebuild the sum:

- `GradientCodec.payload_specs`: the blocks it packs for a block of ``numel`` numbers (dtype and
  shape each), the same specs the exchange sends, so its byte model is exact by construction;
- `GradientCodec.encode`: a rank's block as those blocks;
- `GradientCodec.decode`: every rank's payload (``collective = "all_gather"``, in rank order) or
  the summed payload (``"all_reduce"``) as the sum of the blocks, in fp32. Summing the gathered
  payloads in rank order keeps every rank's result bit-identical.

`codec_route` turns a codec into a `registry.RouteSpec` that runs on the flat layout (DDP's hook,
the synchroniser: `start_codec`, the codec's collective over the whole block), on the sharded
ones, FSDP2's row shards and ZeRO's partitions (`start_codec_chunks`, qgZ's pattern: each rank's
part of every block encoded and sent to it by one all-to-all, summed there in fp32 in rank order),
and across nodes on the hop between them: two-level DDP (the node's sum, by its owner, over the
owners) and HSDP's replicate hop (each rank's shard of its node's sum, over its replicas). ZeRO's
partitions across nodes are not among them (refused at attach). Biases stay on the dense path
beside it, as with the rank routes.

Bytes per rank for a weight of ``m n`` numbers, ``P(k)`` the payload of ``k`` numbers, S ranks:
flat all-gather ``(S-1) P(m n)``, flat all-reduce ``2 (S-1)/S P(m n)``; row shards
``(S-1) P(ceil(m/S) n)``; partitions what each rank's range packs to.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import List, Sequence, Tuple

import torch

from dad_integrations.codecs.wire import BlockSpec, pack, packed_size, unpack
from dad_integrations.comm.aggregator import CommHandle, FactorAggregator
from dad_integrations.routes.hops import (between_bias, flat_bias, from_owner, node_itemsize, replicate_bias,
                                          ring_allreduce_bytes, shard_bias, to_owner_dense)
from dad_integrations.routes.registry import HopBytes, RouteSpec, UnitSizing, per_layout


class GradientCodec(ABC):
    """What a route sends of a rank's block and how the group's payloads sum (module doc)."""

    collective: str = "all_gather"  # or "all_reduce": the payload's first block summed in place

    @abstractmethod
    def payload_specs(self, numel: int) -> List[BlockSpec]:
        """The blocks `encode` packs for a block of ``numel`` numbers."""

    @abstractmethod
    def encode(self, block: torch.Tensor) -> List[torch.Tensor]:
        """A rank's flat fp32 block as the blocks of `payload_specs`."""

    @abstractmethod
    def decode(self, payloads: Sequence[List[torch.Tensor]]) -> torch.Tensor:
        """The sum over the group, flat fp32, from every rank's blocks (all-gather, rank order) or
        from the one summed payload (all-reduce)."""

    def payload_bytes(self, numel: int) -> int:
        return packed_size(self.payload_specs(numel))

    def group_bytes(self, numel: int, world_size: int) -> float:
        """Bytes one rank sends for a block of ``numel`` numbers over ``world_size`` ranks."""
        nbytes = self.payload_bytes(numel)
        if self.collective == "all_gather":
            return float((world_size - 1) * nbytes)
        return ring_allreduce_bytes(nbytes, world_size)


def start_codec(codec: GradientCodec, block: torch.Tensor, group: FactorAggregator, *, name: str) -> CommHandle:
    """Encode ``block`` (flat), run the codec's collective over ``group``; ``wait()`` returns the
    group's sum, flat fp32."""
    blocks = codec.encode(block.reshape(-1).float())
    specs = codec.payload_specs(block.numel())
    if codec.collective == "all_reduce":
        if len(blocks) != 1:
            raise ValueError(f"{name}: an all-reduce codec packs one block, got {len(blocks)}")
        handle = group.all_reduce(blocks[0].contiguous(), name=name)
        return CommHandle(lambda: codec.decode([[handle.wait()]]), handle.traffic)
    payload = pack(blocks, block.device)
    handle = group.all_gather(payload, name=name, first_dims=[payload.shape[0]] * group.world_size)
    return CommHandle(lambda: codec.decode([unpack(t, specs) for t in handle.wait()]), handle.traffic)


def start_codec_chunks(codec: GradientCodec, chunks: Sequence[torch.Tensor], group: FactorAggregator, *,
                       name: str) -> CommHandle:
    """The sharded form (qgZ's pattern): ``chunks[d]`` (flat, rank d's part of this rank's local
    block) encoded and sent to rank d by one all-to-all; ``wait()`` returns the sum of every
    rank's part for this rank, decoded in rank order. Every rank's chunk sizes must agree (the
    engine's shard layout)."""
    me, device = group.rank, chunks[0].device
    blocks = [codec.encode(c.reshape(-1).float()) if c.numel() else [] for c in chunks]
    send_sizes = [packed_size(codec.payload_specs(c.numel())) if c.numel() else 0 for c in chunks]
    mine = chunks[me].numel()
    specs = codec.payload_specs(mine) if mine else []
    recv_sizes = [packed_size(specs)] * group.world_size
    payload = torch.cat([pack(b, device) for b in blocks if b]) if any(blocks) else torch.empty(0, dtype=torch.uint8)
    handle = group.all_to_all_v(payload, send_sizes, recv_sizes, name=name)

    def finish() -> torch.Tensor:
        got = handle.wait()
        if not mine:
            return torch.zeros(0, device=device)
        size = recv_sizes[0]
        return codec.decode([unpack(got[s * size:(s + 1) * size], specs) for s in range(group.world_size)])

    return CommHandle(finish, handle.traffic)


def codec_route(name: str, codec: GradientCodec, *, summary: str, order: int = 10, lossless: bool = False,
                state: Tuple[str, ...] = ()) -> RouteSpec:
    """A `registry.RouteSpec` for ``codec`` on the layouts the generic exchange runs (flat, row
    shards, partitions), its bytes from the codec's payload specs; register it with
    `registry.register_route` and name it in a config's ``routes``."""
    kind = codec.collective

    def flat(s: UnitSizing) -> float:
        m, n = s.shape
        return codec.group_bytes(m * n, s.world_size) + flat_bias(s)

    def row_shards(s: UnitSizing) -> float:
        m, n = s.shape
        return (s.world_size - 1) * codec.payload_bytes(-(-m // s.world_size) * n) + shard_bias(s)

    def partitions(s: UnitSizing) -> Tuple[float, float]:
        sizes = [codec.payload_bytes(hi - lo) if hi > lo else 0 for lo, hi in s.ranges]
        S, total = s.world_size, sum(sizes)
        # rank d sends every other rank its part and receives its own from each of them
        sent = [total - sizes[d] for d in range(S)]
        received = [(S - 1) * sizes[d] for d in range(S)]
        return float(max(max(sent), max(received))), sum(sent) / S

    def two_level(s: UnitSizing) -> HopBytes:
        m, n = s.shape
        between = codec.group_bytes(m * n, s.nodes) + between_bias(s)
        return HopBytes(to_owner_dense(s), between, *from_owner(s, (m * n + s.bias_numel) * node_itemsize(s)))

    def replicate_hop(s: UnitSizing) -> float:
        m, n = s.shape
        return codec.group_bytes(-(-m // s.local) * n, s.nodes) + replicate_bias(s)

    return RouteSpec(name=name, summary=summary, order=order, lossless=lossless, needs_rows=False,
                     compute=lambda costs, capture, rows, world_size, calls: 0.0, state=state, codec=codec,
                     opt_in=True, **per_layout(flat=((kind,), flat), row_shards=(("all_to_all",), row_shards),
                                               partitions=(("all_to_all",), partitions),
                                               two_level=(("all_to_all", kind, "all_gather"), two_level),
                                               replicate_hop=((kind,), replicate_hop)))

