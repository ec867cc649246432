"""Bytes one step puts on the link between simulated nodes, read inside a node's namespace.

The per-rank sides of the multi-node benchmarks (`_multinode_ranks`, `_hsdp_ranks`) run each
method's step between two barriers; each node's first local rank reads its inter-node interface's
byte counter (`GLOO_SOCKET_IFNAME`, the veth of `benchmarks.sim_cluster`) before and after, less
what a barrier alone sends. Summed over the nodes, that is the step's bytes between nodes (both
directions' senders, TCP/IP headers included).
"""
from __future__ import annotations

import os
from typing import Callable

import torch.distributed as dist


def tx_bytes() -> int:
    """What left this node over its inter-node interface so far."""
    with open(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes") as f:
        return int(f.read())


class NodeBytes:
    """Counts one step's bytes between nodes on this node (zero on ranks that are not the node's first)."""

    def __init__(self, group, reps: int = 10):
        self.group = group
        self.first = int(os.environ.get("LOCAL_RANK", 0)) == 0
        dist.barrier(group=group)
        before = tx_bytes() if self.first else 0
        for _ in range(reps):
            dist.barrier(group=group)
        self.barrier = (tx_bytes() - before) / reps if self.first else 0.0

    def step(self, run: Callable[[], None]) -> float:
        """Run ``run`` between two barriers; its bytes out of this node (less a barrier's)."""
        dist.barrier(group=self.group)
        start = tx_bytes() if self.first else 0
        run()
        dist.barrier(group=self.group)
        return (tx_bytes() - start - self.barrier) if self.first else 0.0
