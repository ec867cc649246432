"""The job's topology: which ranks share a node, and the two levels of groups it gives.

dAD's two-level routes (`exchange.two_level`) reduce inside the node, compress only between nodes
and gather inside the node again. A `Topology` partitions the group's ranks into nodes of ``L``
ranks each, the same on every rank: from the config's ``topology`` (``"flat"``, or ranks per
node, consecutive), else from the launcher (`FactorAggregator.topology_hint`) or the hostnames,
agreed by one all-gather (`resolve_topology`). `level_aggregators` builds its two groups at attach:
this rank's node (``intra``) and the ranks with its local index on every node (``cross``). A
mismatch raises `TopologyError` at attach, on every rank alike: never a hang in a later collective.
"""
from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

__all__ = ["Topology", "TopologyError", "parse_topology", "resolve_topology", "level_aggregators"]


class TopologyError(ValueError):
    """The nodes the ranks report cannot carry two-level routes (or the stated topology is wrong)."""


@dataclass(frozen=True)
class Topology:
    """The group's ranks by node: ``nodes[k]`` lists node k's ranks (group ranks, ascending); every
    node has the same number of ranks. ``rank`` is this process' rank in the group."""

    nodes: Tuple[Tuple[int, ...], ...]
    rank: int

    @classmethod
    def flat(cls, world_size: int, rank: int) -> "Topology":
        """One node holding every rank: one level, today's flat exchange."""
        return cls((tuple(range(world_size)),), rank)

    @classmethod
    def consecutive(cls, world_size: int, local_size: int, rank: int) -> "Topology":
        """Nodes of ``local_size`` consecutive ranks (torchrun's and horovodrun's placement)."""
        if local_size < 1 or world_size % local_size:
            raise TopologyError(f"topology: a local size of {local_size} does not divide the world of "
                                f"{world_size} ranks; state the ranks per node, or 'flat'")
        return cls(tuple(tuple(range(k, k + local_size)) for k in range(0, world_size, local_size)), rank)

    @property
    def world_size(self) -> int:
        return sum(len(n) for n in self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def local_size(self) -> int:
        """Ranks per node, ``L``."""
        return len(self.nodes[0])

    @property
    def node(self) -> int:
        """The index of this rank's node."""
        return next(k for k, ranks in enumerate(self.nodes) if self.rank in ranks)

    @property
    def local_rank(self) -> int:
        """This rank's index inside its node: the owner index of `exchange.two_level`."""
        return self.nodes[self.node].index(self.rank)

    @property
    def two_level(self) -> bool:
        """Whether there are two levels at all: more than one node, more than one rank on each."""
        return self.num_nodes > 1 and self.local_size > 1

    def intra_ranks(self, node: int) -> Tuple[int, ...]:
        return self.nodes[node]

    def cross_ranks(self, local_rank: int) -> Tuple[int, ...]:
        """The ranks with local index ``local_rank`` on every node, in node order."""
        return tuple(n[local_rank] for n in self.nodes)

    def describe(self) -> str:
        if not self.two_level:
            return f"flat ({self.world_size} ranks)"
        return f"{self.num_nodes} nodes x {self.local_size} ranks"


def parse_topology(value: Any) -> Any:
    """The config's ``topology``, checked: ``"auto"``, ``"flat"`` or a positive number of ranks per
    node (an int, or its string). Raises ValueError naming the key."""
    if value in ("auto", "flat"):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"topology must be 'auto', 'flat' or the number of ranks per node (>= 1), got {value!r}")
    return value


def _host_key() -> int:
    """A 62-bit digest of this host's name (all-gathered as an int64)."""
    return int.from_bytes(hashlib.sha256(socket.gethostname().encode()).digest()[:8], "big") >> 2


def resolve_topology(spec: Any, aggregator: Any, device: torch.device) -> Topology:
    """The topology of ``aggregator``'s group under the config's ``topology`` ``spec``; for ``"auto"``
    one all-gather (every rank calls it at the same point) of the launcher hints where every rank
    has one, else of the hostnames: every rank decides, and checks, on the same table."""
    spec = parse_topology(spec)
    s, rank = aggregator.world_size, aggregator.rank
    if spec == "flat" or s == 1:
        return Topology.flat(s, rank)
    if isinstance(spec, int):
        return Topology.consecutive(s, spec, rank)
    hint = aggregator.topology_hint()
    if hint is not None and hint[1] == s:  # the launcher put every rank on one node: no gather needed
        return Topology.flat(s, rank)
    node, local = hint if hint is not None else (-1, -1)
    mine = torch.tensor([node, local, _host_key()], dtype=torch.int64, device=device)
    table = [t.tolist() for t in aggregator.all_gather(mine, name="dad.topology",
                                                       first_dims=[3] * s).wait()]
    hinted = all(row[0] >= 0 for row in table)
    keys = [row[0] if hinted else row[2] for row in table]
    # nodes in the order of their lowest rank
    nodes = tuple(tuple(r for r in range(s) if keys[r] == k) for k in dict.fromkeys(keys))
    sizes = sorted({len(n) for n in nodes})
    if len(sizes) > 1:
        raise TopologyError(f"topology: nodes have unequal numbers of ranks ({[len(n) for n in nodes]}, found "
                            f"from {'the launcher' if hinted else 'the hostnames'}); two-level routes need "
                            "the same number on every node: set topology to 'flat'")
    if hinted and any(row[1] != len(nodes[0]) for row in table):
        raise TopologyError(f"topology: the launcher reports {sorted({row[1] for row in table})} ranks per node "
                            f"but the node indices group {len(nodes[0])}; set topology explicitly")
    return Topology(nodes, rank)


def level_aggregators(topology: Topology, aggregator: Any) -> Tuple[Any, Any]:
    """The ``(intra, cross)`` aggregators of this rank (`FactorAggregator.split`); every rank of the
    group must call it at the same point (it creates groups)."""
    intra = aggregator.split([topology.intra_ranks(k) for k in range(topology.num_nodes)])
    cross = aggregator.split([topology.cross_ranks(j) for j in range(topology.local_size)])
    return intra, cross


# (node index, ranks per node) as each launcher names them: torchrun (and accelerate launch),
# DeepSpeed's launcher, horovodrun
LAUNCHER_ENV = (("GROUP_RANK", "LOCAL_WORLD_SIZE"), ("CROSS_RANK", "LOCAL_SIZE"),
                ("HOROVOD_CROSS_RANK", "HOROVOD_LOCAL_SIZE"))


def launcher_hint(env: Optional[dict] = None) -> Optional[Tuple[int, int]]:
    """``(node index, ranks per node)`` from the first launcher's variables set (`LAUNCHER_ENV`),
    else None."""
    env = os.environ if env is None else env
    for node_key, size_key in LAUNCHER_ENV:
        try:
            return int(env[node_key]), int(env[size_key])
        except (KeyError, ValueError):
            continue
    return None


def checked_partition(partition: Sequence[Sequence[int]], world_size: int) -> List[List[int]]:
    """``partition`` as lists, checked to cover ``range(world_size)`` once."""
    flat = sorted(r for part in partition for r in part)
    if flat != list(range(world_size)):
        raise TopologyError(f"a split must cover every rank of the group once, got {partition}")
    return [list(p) for p in partition]
