"""Rank routes on HSDP's replicate hop: each node's gradient to rank r, only its row shards between nodes.

HSDP (FSDP2 on a 2-D ``("replicate", "shard")`` mesh) shards every weight ``m x n`` over the L
ranks of a node (rank s keeps rows ``[s c, (s+1) c)``, ``c = ceil(m/L)``) and replicates the
shards over the R nodes. After the reduce-scatter inside the node, rank s holds ``M_s``, its rows
of the *node's* sum ``M`` (plus its rows of the node's error-feedback residual); the hop between
nodes must then add the R nodes' ``M``. Sites are nodes here: both routes run
`power_iteration.PowerIteration` with the node as its ``rows`` group, so a right factor ``Q``
(n x r), the same on every rank of the node, is summed inside the node and crosses between nodes
once per node, cut into L pieces (one per local rank), never L times. Bytes: `routes.rank`,
`routes.rank_allreduce`.

**PowerSGD's all-reduce (``"rank_allreduce"``)**: flat PowerSGD on the job's gradient (the nodes as
its ``sites``: the same ``P^`` and ``Q'``), ``shard_s = scale P^_s Q'^T``.

**rank-dAD (``"rank"``)**: each node reduces its own ``M`` to rank r inside the node (warm-started
from the node's last ``Q_node``), then between nodes rank s all-gathers every node's ``P^_s`` (c x r)
and piece s of its ``Q_node``, and the pieces are all-gathered inside the node:

    shard_s = scale sum_nodes P^_{node,s} Q_node^T = scale [P^_{1,s} .. P^_{R,s}] [Q_1 .. Q_R]^T

The node is the site of error feedback: the residual ``M_s - P^_s Q_node^T`` is rank s's rows of the
node's, ``c x n``: sharded, unlike the 1-D codec's (`sharded_rank`). Every rank of a shard column
(the ranks holding the same rows on each node) computes from the same numbers in the same order, so
the replicas stay identical bit for bit, as HSDP's all-reduce keeps them. Non-finite steps: as
`codecs.rank` (`route_state.RouteState` also saves each residual tagged with its rows).
"""
from __future__ import annotations

from typing import Callable, List, Sequence

import torch

from dad_integrations.capture.rows import compute_dtype
from dad_integrations.capture.units import FactorUnit
from dad_integrations.codecs.power_iteration import piece_span, split_blocks
from dad_integrations.codecs.rank import RankItem
from dad_integrations.codecs.route_state import RouteState
from dad_integrations.codecs.sharded_rank import RankShard, ShardedRankCodec
from dad_integrations.comm.aggregator import FactorAggregator
from dad_integrations.config import DADConfig


class ReplicateRankCodec(ShardedRankCodec):
    """The two rank routes on the replicate hop (module doc). ``intra``: the node's L ranks (the
    shard group); ``cross``: the R ranks holding the same rows on each node (the replicate group).
    Error feedback, warm starts and a step's finiteness are its `RouteState`'s."""

    def __init__(self, config: DADConfig, wire_dtype, intra: FactorAggregator, cross: FactorAggregator):
        # each rank keeps its rows of its node's residual (module doc): the state says which
        super().__init__(config, wire_dtype, RouteState(config, shard=(intra.rank, intra.world_size)))
        self.intra, self.cross = intra, cross

    def node_local(self, unit: FactorUnit, node_rows: torch.Tensor, representation: str) -> RankItem:
        """``M_s``: this rank's rows (``c x n``, padded) of the node's sum, plus its residual."""
        return self.local(unit, [], lambda p, dtype: node_rows, representation)

    # -- the routes (`ShardedRankCodec.exchange` runs them, the all-gather route's first) ----------
    def _rank_allreduce(self, items: Sequence[RankItem], agg, scale: float, step: int, wire,
                        rebuild=None) -> List[RankShard]:
        bases, q_alls, traffic = self.shared_rounds(items, self.shared, step, "dad.replicate", sites=self.cross,
                                                    rows=self.intra, wire=wire)()
        return [RankShard((basis * scale) @ q_all.t(), t, it.rank)
                for it, basis, q_all, t in zip(items, bases, q_alls, traffic)]

    def _start_gather(self, items: Sequence[RankItem], agg, scale: float, step: int,
                      wire) -> Callable[[], List[RankShard]]:
        dtypes = [compute_dtype(it.unit.param) for it in items]
        bases, qs, _ = self.shared_rounds(items, self.own, step, "dad.replicate.node", rows=self.intra, wire=wire)()
        q_flat = torch.cat([q.reshape(-1) for q in qs])
        lo, hi = piece_span(q_flat.numel(), self.intra.world_size, self.intra.rank)
        send = torch.cat([torch.cat([b.reshape(-1) for b in bases]), q_flat[lo:hi]]).to(wire)
        handle = self.cross.all_gather(send, name=f"dad.replicate.rank.{items[0].unit.name}",
                                       first_dims=[send.numel()] * self.cross.world_size)
        p_numel = sum(b.numel() for b in bases)
        received = handle.wait()
        sizes = [b.numel() + q.numel() // self.intra.world_size for b, q in zip(bases, qs)]
        traffic = [handle.traffic.share(k / (float(sum(sizes)) or 1.0)) for k in sizes]
        joined = self._join_node_pieces(received, p_numel, q_flat.numel(), items)
        out = []
        for i, (it, t) in enumerate(zip(items, traffic)):
            left = torch.cat([j[0][i].to(dtypes[i]) for j in joined], dim=1) * scale  # per node: P^_{node,s}
            right = torch.cat([j[1][i].to(dtypes[i]) for j in joined], dim=1)         # per node: Q_node
            out.append(RankShard(left @ right.t(), t, it.rank))
        return lambda: out

    def _join_node_pieces(self, received: Sequence[torch.Tensor], p_numel: int, q_numel: int, items):
        """Per node (in the cross group's order): its P^_s blocks and its whole Q_node per item, the
        Q pieces all-gathered inside the node."""
        L = self.intra.world_size
        dims = [piece_span(q_numel, L, k)[1] - piece_span(q_numel, L, k)[0] for k in range(L)]
        mine = torch.cat([g[p_numel:] for g in received])  # piece s of every node's Q_node
        gathered = self.intra.all_gather(mine, name=f"dad.replicate.q_pieces.{items[0].unit.name}",
                                         first_dims=[d * len(received) for d in dims]).wait()
        per_node = []
        for k, g in enumerate(received):
            p_blocks = split_blocks(g[:p_numel], [(it.local.shape[0], it.rank) for it in items])
            q_flat = torch.cat([gathered[l].view(len(received), dims[l])[k] for l in range(L)])
            per_node.append((p_blocks, split_blocks(q_flat, [(it.unit.shape[1], it.rank) for it in items])))
        return per_node
