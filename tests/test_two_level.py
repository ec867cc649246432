"""Two-level topology and routes as plain unit tests: the topology every rank agrees on, the owners,
the hop costs and the route choice (pure functions of agreed inputs). The real multi-node jobs are
in tests/test_multinode.py."""
import pytest
import torch

from dad_integrations.comm.aggregator import CommHandle
from dad_integrations.comm.link_spec import level_link_specs
from dad_integrations.comm.topology import Topology, TopologyError, parse_topology, resolve_topology
from dad_integrations.config import DADConfig
from dad_integrations.exchange.levels import assign_owners
from dad_integrations.routing.compute_model import ComputeModel, ShapeCosts
from dad_integrations.routing.link import LinkModel
from dad_integrations.routing.router import UnitShape
from dad_integrations.routing.two_level import TwoLevelTiming, candidates, choose_two_level, hop_bytes

WIDE = UnitShape(("linear",), (1024, 1024), 1024, torch.float32)


class _Table:
    """An aggregator whose all-gather returns a given table (what every rank reported)."""

    def __init__(self, rows, rank=0, hint=None):
        self.rows, self.rank, self.world_size, self.hint = rows, rank, len(rows), hint

    def topology_hint(self):
        return self.hint

    def all_gather(self, tensor, *, name, first_dims=None):
        return CommHandle(lambda: [torch.tensor(r, dtype=torch.int64) for r in self.rows])


def test_topology_from_launcher_hints_groups_nodes_in_rank_order():
    # (node index, ranks per node, host digest) per rank: nodes from the launcher, not the hosts
    rows = [[0, 2, 7], [0, 2, 7], [1, 2, 7], [1, 2, 7]]
    topo = resolve_topology("auto", _Table(rows, rank=3, hint=(1, 2)), torch.device("cpu"))
    assert topo.nodes == ((0, 1), (2, 3)) and topo.node == 1 and topo.local_rank == 1 and topo.two_level
    assert topo.cross_ranks(0) == (0, 2) and topo.describe() == "2 nodes x 2 ranks"


def test_topology_from_hostnames_where_a_rank_has_no_hint():
    rows = [[-1, -1, 5], [-1, -1, 9], [-1, -1, 5], [-1, -1, 9]]  # interleaved placement
    topo = resolve_topology("auto", _Table(rows, rank=1), torch.device("cpu"))
    assert topo.nodes == ((0, 2), (1, 3)) and topo.local_rank == 0
    one_host = resolve_topology("auto", _Table([[-1, -1, 5]] * 4), torch.device("cpu"))
    assert not one_host.two_level


def test_topology_mismatch_raises_on_every_rank_before_any_collective():
    with pytest.raises(TopologyError, match="unequal numbers of ranks"):
        resolve_topology("auto", _Table([[0, 2, 1], [0, 2, 1], [1, 1, 1]]), torch.device("cpu"))
    with pytest.raises(TopologyError, match="does not divide"):
        resolve_topology(3, _Table([[0]] * 4), torch.device("cpu"))
    assert resolve_topology("flat", _Table([[0]] * 4), torch.device("cpu")).nodes == ((0, 1, 2, 3),)
    assert resolve_topology(2, _Table([[0]] * 4, rank=2), torch.device("cpu")) == Topology(((0, 1), (2, 3)), 2)


def test_config_topology_and_per_hop_link():
    assert parse_topology("4") == 4 and DADConfig(topology="flat").topology == "flat"
    for bad in (0, -2, "two", 1.5, True):
        with pytest.raises(ValueError, match="topology"):
            DADConfig(topology=bad)
    link = {"intra": {"bandwidth": "100gbit"}, "inter": {"bandwidth": "1gbit", "latency_us": 30}}
    assert set(level_link_specs(DADConfig(link=link).link)) == {"intra", "inter"}
    assert LinkModel.from_spec(link).all_reduce.beta == pytest.approx(1e9 / 8)  # flat: the slow hop
    with pytest.raises(ValueError, match="per hop"):
        DADConfig(link={"intra": {"bandwidth": "1gbit"}})


def test_owners_share_the_work_about_equally():
    costs = [100, 90, 50, 40, 30, 20, 10, 10]
    owners = assign_owners(costs, 2)
    loads = [sum(c for c, o in zip(costs, owners) if o == j) for j in range(2)]
    assert max(loads) - min(loads) <= max(costs) and sorted(set(owners)) == [0, 1]
    assert assign_owners(costs, 2) == owners  # deterministic: every rank assigns alike


def test_hop_bytes_compress_only_between_nodes():
    cfg = DADConfig(rank=4)
    dense = hop_bytes("dense", WIDE, None, nodes=2, local_size=4, config=cfg, wire_dtype=torch.float32)
    shared = hop_bytes("rank_allreduce", WIDE, None, nodes=2, local_size=4, config=cfg, wire_dtype=torch.float32)
    big = (1024 * 1024 + 1024) * 4
    assert dense.to_owner == pytest.approx(0.75 * big) and dense.between == pytest.approx(big)  # 2 (N-1)/N = 1
    assert shared.to_owner == dense.to_owner  # the reduce to the owner is dense
    assert shared.between == pytest.approx(4 * 2048 * 4 + 1024 * 4)  # P and Q, and the bias, between nodes
    assert shared.factors_back and shared.from_owner < dense.from_owner  # P and Q come back, not the matrix


def test_slow_inter_link_compresses_between_nodes_fast_one_stays_dense():
    cfg = DADConfig(rank=4, lossless_steps=0, objective="time")
    fast = LinkModel.uniform(50e9, 5e-6)
    # local work of 2 ms per weight and route (a CPU's order of magnitude for 1024 x 1024 at rank 4)
    compute = ComputeModel({(1024, 1024): ShapeCosts(rank_allreduce=2e-3, rank=2e-3, exact_per_row=1e-6)})
    for inter, expected in ((LinkModel.uniform(1e9 / 8, 50e-6), "rank_allreduce"), (fast, "dense")):
        rep, _, seconds = choose_two_level(cfg, WIDE, None, step=5, nodes=2, local_size=4,
                                           wire_dtype=torch.float32, timing=TwoLevelTiming(fast, inter, compute))
        assert rep == expected, seconds


def test_candidates_follow_mode_rank_and_lossless_steps():
    cfg = DADConfig(rank=4, lossless_steps=3)
    assert candidates(cfg, WIDE, 1, rows_known=True, dense_only=False) == ("dense", "exact")
    assert set(candidates(cfg, WIDE, 3, rows_known=False, dense_only=False)) == {"dense", "rank", "rank_allreduce"}
    assert set(candidates(DADConfig(mode="rank", rank=2, lossless_steps=0), WIDE, 0, rows_known=True,
                          dense_only=False)) == {"rank", "rank_allreduce"}
    assert candidates(DADConfig(mode="exact"), WIDE, 0, rows_known=True, dense_only=False) == ("exact",)
    assert candidates(cfg, WIDE, 5, rows_known=True, dense_only=True) == ("dense",)
