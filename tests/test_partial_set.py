"""Whole route sets (`routing.partial_set`): a set that compresses a few weights is priced with what
moving every other gradient off the engine's path costs, against all dense and all compressed, and
the cheapest is kept; on reduced widths, then a real 2-rank DDP job on a stated link."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import WORKERS, result, run_torchrun
from dad_integrations import DADConfig
from dad_integrations.builtin_routes import DENSE, RANK, RANK_ALLREDUCE
from dad_integrations.routing.compute_model import ComputeModel, ShapeCosts
from dad_integrations.routing.link import LinkModel
from dad_integrations.routing.partial_set import (COPY_PASSES, LeaveCost, SetUnit, choose_set, measure_leave_cost,
                                                  set_seconds)
from dad_integrations.routing.router import Route, RouteContext, UnitEvidence, UnitShape, route
from dad_integrations.routing.timing import StepTiming

MB = 2 ** 20
SLOW_COPY = LeaveCost(per_byte_s=1e-9, per_tensor_s=1e-5)   # 1 GB/s a pass: leaving 4 MB costs 8 ms


def _units(dense_b: float = 0.5e-3, compressed_b: float = 0.7e-3):
    """``a`` saves 4 ms compressed and is chosen so; ``b`` (4 MB) could compress but is left dense."""
    return [SetUnit(0, RANK_ALLREDUCE, {DENSE: 5e-3, RANK_ALLREDUCE: 1e-3}, nbytes=16 * 1024, tensors=2),
            SetUnit(1, DENSE, {DENSE: dense_b, RANK_ALLREDUCE: compressed_b}, nbytes=4 * MB, tensors=2)]


def test_partial_set_priced_with_leaving_and_replaced_by_all_compressed():
    units = _units()
    choice = choose_set(units, SLOW_COPY)
    leave_b = SLOW_COPY.seconds(4 * MB, 2)
    assert choice.chosen_s == pytest.approx(1e-3 + 0.5e-3 + leave_b)
    assert choice.dense_s == pytest.approx(5.5e-3) and choice.compressed_s == pytest.approx(1.7e-3)
    assert choice.chosen_s > max(choice.dense_s, choice.compressed_s)  # slower than both wholes
    assert choice.partial and choice.taken == "all compressed"
    assert choice.routes == {0: RANK_ALLREDUCE, 1: RANK_ALLREDUCE}
    assert "set: all compressed" in choice.clause() and "partial set" in choice.clause()


def test_partial_set_replaced_by_all_dense_when_the_rest_stays_dense():
    """The parameters always dense (norms, biases) leave too: with 32 MB of them, the weight's 4 ms
    saving does not pay for moving them, and all dense (the engine's path) is kept."""
    units = _units(compressed_b=3e-3)
    rest = {0: (32 * MB, 10)}
    choice = choose_set(units, SLOW_COPY, rest)
    assert choice.taken == "all dense" and set(choice.routes.values()) == {DENSE}
    assert choice.compressed_s == pytest.approx(1e-3 + 3e-3 + SLOW_COPY.seconds(32 * MB, 10))


def test_partial_set_that_truly_wins_is_kept():
    fast_copy = LeaveCost(per_byte_s=1e-13, per_tensor_s=1e-7)
    choice = choose_set(_units(), fast_copy)
    assert not choice.replaced and choice.routes == {0: RANK_ALLREDUCE, 1: DENSE} and choice.clause() == ""
    assert choice.chosen_s < min(choice.dense_s, choice.compressed_s)


def test_all_dense_and_zero_cost_are_unchanged():
    units = [SetUnit(0, DENSE, {DENSE: 1e-3, RANK: 2e-3}, nbytes=MB), SetUnit(1, DENSE, {DENSE: 1e-3}, nbytes=MB)]
    choice = choose_set(units, SLOW_COPY, {0: (MB, 1)})
    assert not choice.replaced and choice.chosen_s is None  # nothing leaves: not even priced
    # without a leaving cost the router's per-weight choice is the cheapest set: kept
    assert not choose_set(_units(), LeaveCost()).replaced


def test_groups_leave_apart():
    """FSDP2: a reduction call leaves on its own; a call with nothing compressed stays on the engine's path."""
    units = [SetUnit(0, RANK, {DENSE: 2e-3, RANK: 1e-3}, nbytes=MB, group="call0"),
             SetUnit(1, DENSE, {DENSE: 1e-3}, nbytes=MB, group="call0"),
             SetUnit(2, DENSE, {DENSE: 1e-3}, nbytes=8 * MB, group="call1")]
    routes = {0: RANK, 1: DENSE, 2: DENSE}
    assert set_seconds(units, routes, SLOW_COPY) == pytest.approx(3e-3 + SLOW_COPY.seconds(MB, 1))
    assert SLOW_COPY.seconds(MB, 1) == pytest.approx(COPY_PASSES * (MB * 1e-9 + 1e-5))


def _sharded_step(pieces, step: int, units, rest: int, leaving: bool = True) -> list:
    """One step as the sharded adapters drive `ShardedTrial`: one call, ``a`` compressed, ``b`` (4 MB)
    dense (its rank route 0.2 ms slower), the call's other parameters ``rest`` bytes; returns the routes."""
    pieces.open(step)
    if pieces.dense(step):
        pieces.end(step, lambda values: list(values))
        return [DENSE, DENSE]
    group = pieces.note_call((rest, 4)) if leaving else None
    taken = []
    for unit, nbytes, route_ in zip(units, (16 * 1024, 4 * MB), (
            Route(RANK_ALLREDUCE, False, 4e-3, 0.0, seconds={DENSE: 5e-3, RANK_ALLREDUCE: 1e-3}),
            Route(DENSE, False, 0.0, 0.0, seconds={DENSE: 0.5e-3, RANK_ALLREDUCE: 0.7e-3}))):
        decision = pieces.held(step, unit, {}) or route_
        pieces.note(unit, decision, nbytes, group)
        taken.append(decision.representation)
    pieces.end(step, lambda values: list(values))
    return taken


@pytest.mark.parametrize("leaving", [True, False])
def test_sharded_trial_holds_the_cheaper_whole_set(leaving):
    """`ShardedTrial` (FSDP2, ZeRO) driven as the adapters drive it, no processes, stated link: a
    refresh's partial set whose call leaves the engine's reduce-scatter is replaced until the next
    refresh (all dense: the engine's own; all compressed: held); a layout that keeps its dense rest
    (ZeRO: no group) keeps the router's routes."""
    from dad_integrations.routing.sharded_trial import ShardedTrial

    units = [type("Unit", (), {"index": i})() for i in range(2)]
    for rest, whole in ((32 * MB, [DENSE, DENSE]), (0, [RANK_ALLREDUCE, RANK_ALLREDUCE])):
        pieces = ShardedTrial(DADConfig(mode="auto", rank=4, objective="time", lossless_steps=0,
                                        link={"bandwidth": "1gbit"}, route_refresh_steps=3))
        pieces.leave = SLOW_COPY  # (`start` measures it: a collective)
        taken = [_sharded_step(pieces, step, units, rest, leaving) for step in range(4)]
        partial = [RANK_ALLREDUCE, DENSE]
        assert taken == ([partial, whole, whole, partial] if leaving else [partial] * 4), taken
        assert ("set: " in pieces.decision) == leaving


def _timing(bandwidth: str) -> StepTiming:
    link = LinkModel.from_spec({"bandwidth": bandwidth, "latency_us": 0})
    costs = {(64, 64): ShapeCosts(1e-4, 1e-4, 1e-7), (8, 8): ShapeCosts(1e-4, 1e-4, 1e-7)}
    return StepTiming(link, ComputeModel(costs, 0.0))


def _route(bandwidth: str, shape, config=None, world_size=2):
    cfg = config or DADConfig(mode="auto", rank=4, objective="time", lossless_steps=0)
    unit = UnitShape(("linear",), shape, shape[0], torch.float32)
    ctx = RouteContext(cfg, world_size=world_size, wire_dtype=torch.float32, step=5, timing=_timing(bandwidth))
    return route(ctx, unit, UnitEvidence(rows_by_rank=[[16]] * world_size))


def test_router_prices_what_a_set_may_take():
    """`Route.seconds`: the routes the unit may take, within the byte cap (PowerSGD's bytes): what
    the all-compressed alternative picks from."""
    wide = _route("100mbit", (64, 64), world_size=4)
    assert wide.representation == RANK_ALLREDUCE and DENSE in wide.seconds
    assert RANK not in wide.seconds  # at 4 ranks rank-dAD's all-gather sends more than PowerSGD's P and Q
    nocap = _route("100mbit", (64, 64), DADConfig(mode="auto", rank=4, objective="time", lossless_steps=0,
                                                 byte_cap=False), world_size=4)
    assert RANK in nocap.seconds
    # an 8 x 8 weight: P and Q are as many numbers as the gradient; compressing it only adds work
    small = _route("100mbit", (8, 8))
    assert small.representation == DENSE and RANK_ALLREDUCE in small.seconds
    # on a fast link every weight is dense: the set is all dense, nothing to price
    fast = [_route("1000gbit", s) for s in ((64, 64), (8, 8))]
    assert all(r.representation == DENSE for r in fast)
    units = [SetUnit(i, r.representation, r.seconds, nbytes=1024) for i, r in enumerate(fast)]
    assert not choose_set(units, SLOW_COPY).replaced


def test_measured_leave_cost_is_positive_and_bounded():
    cost = measure_leave_cost(torch.device("cpu"))
    assert cost.per_byte_s > 0 and cost.per_tensor_s > 0
    assert cost.seconds(64 * MB, 100) < 10.0  # a sanity bound, not a speed claim


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory):
    work = tmp_path_factory.mktemp("partial_set")
    run_torchrun(WORKERS / "partial_set_worker.py", 2, [work / "out.json"])
    return json.loads((work / "out.json").read_text())


def test_ddp_takes_all_dense_where_leaving_costs_more(ddp_job):
    """A stated 100 Mbit/s link: the router compresses the 64 x 64 weight, but 32 MB of dense
    gradient would leave DDP's buckets for it: from step 1 every weight is dense, and once the
    residual is flushed the steps go by DDP's own buckets. The routes line says the set taken."""
    per_rank = result(ddp_job, "leave")
    assert per_rank[0]["routes"] == per_rank[1]["routes"]
    r = per_rank[0]
    assert r["routes"][0]["a.weight"] != DENSE and r["routes"][0]["c.weight"] == DENSE  # a partial set
    assert all(set(routes.values()) == {DENSE} for routes in r["routes"][1:])
    assert r["native_calls"][0] == 0 and all(n >= 1 for n in r["native_calls"][2:]), r["native_calls"]
    assert "set: all dense, the partial set priced" in r["decision"][1]


def test_ddp_keeps_a_partial_set_that_wins(ddp_job):
    per_rank = result(ddp_job, "keep")
    assert per_rank[0]["routes"] == per_rank[1]["routes"]
    r = per_rank[0]
    assert all(routes["a.weight"] == RANK_ALLREDUCE and routes["c.weight"] == DENSE for routes in r["routes"][1:])
    assert all(n == 0 for n in r["native_calls"])
    assert "set:" not in r["decision"][1]
