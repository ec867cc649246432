"""Byte-model pieces several routes share: the collectives' per-rank bytes and the three-hop
layouts' hops inside a node (`registry.HopBytes`)."""
from __future__ import annotations

from typing import Optional, Sequence

from dad_integrations.comm.aggregator import ring_allreduce_bytes
from dad_integrations.routes.registry import ByteModel, HopBytes, UnitSizing


def reduce_scatter_bytes(shape: Sequence[int], world_size: int, itemsize: int) -> float:
    """Bytes one rank sends in FSDP2's reduce-scatter of one parameter's gradient: ``S - 1`` of its
    ``S`` chunks of ``ceil(shape[0] / S)`` rows (dim 0 padded to ``S`` equal chunks)."""
    rest = 1
    for d in shape[1:]:
        rest *= d
    return (world_size - 1) * -(-shape[0] // world_size) * rest * itemsize


def node_itemsize(s: UnitSizing) -> int:
    """The itemsize of the hops inside a node: the compute dtype (fp32 for bf16 and fp16 weights,
    `capture.rows.compute_dtype`)."""
    return max(s.grad_dtype.itemsize, 4)


def to_owner_dense(s: UnitSizing) -> float:
    """Hop 1 of a dense or rank route: every rank's dense gradient to the owner (a reduce-scatter)."""
    m, n = s.shape
    return (s.local - 1) / s.local * (m * n + s.bias_numel) * node_itemsize(s)


def from_owner(s: UnitSizing, back: float) -> HopBytes:
    """Hop 3's bytes: ``back`` (the factors) where fewer than the average's, else the average."""
    m, n = s.shape
    dense_back = (m * n + s.bias_numel) * node_itemsize(s)
    share = (s.local - 1) / s.local
    return share * min(back, dense_back), back < dense_back


def on_node_partitions(two_level: ByteModel) -> ByteModel:
    """A route's ``node_partitions`` byte model from its ``two_level`` one (ZeRO's partitions across
    nodes): hops 1 and 2 as two levels' (an upper bound for hop 2: an owner receives only the
    covering rows of its node's share), hop 3 only the node's ``1/N`` of the weight,
    ``(L-1)/L m n b / N``."""
    def model(s: UnitSizing) -> Optional[HopBytes]:
        hops = two_level(s)
        if hops is None:
            return None
        m, n = s.shape
        return HopBytes(hops.to_owner, hops.between, (s.local - 1) / s.local * m * n * node_itemsize(s) / s.nodes,
                        False)

    return model


def flat_bias(s: UnitSizing) -> float:
    """The biases beside a factor route, all-reduced densely on the wire over the flat group."""
    return ring_allreduce_bytes(s.bias_numel * s.wire.itemsize, s.world_size)


def shard_bias(s: UnitSizing) -> float:
    """The biases through FSDP2's reduce-scatter, in the gradients' dtype (several counted as one)."""
    return reduce_scatter_bytes((s.bias_numel,), s.world_size, s.grad_dtype.itemsize) if s.bias_numel else 0.0


def between_bias(s: UnitSizing) -> float:
    """The biases of the node's sum, all-reduced densely between nodes (two levels)."""
    return ring_allreduce_bytes(s.bias_numel * node_itemsize(s), s.nodes)


def replicate_bias(s: UnitSizing) -> float:
    """A shard's biases, all-reduced densely between nodes (HSDP's replicate hop)."""
    gb = s.grad_dtype.itemsize
    return ring_allreduce_bytes(-(-s.bias_numel // s.local) * gb, s.nodes) if s.bias_numel else 0.0
