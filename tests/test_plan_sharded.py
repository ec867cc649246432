"""The sharded planner by hop (`routing.plan_sharded`, ``--sharded --bandwidth``): FSDP2's row shards,
ZeRO-3's partitions and HSDP's two hops, each weight's bytes the routes' own byte models on the
layout its engine runs (what the exchangers' reports count), seconds the link over those bytes.
A small model on the CPU: the trace's (an embedding and three linear layers)."""
import json

import pytest
import torch
from torch import nn

from dad_integrations.builtin_routes import DENSE, RANK_ALLREDUCE
from dad_integrations.capture.assign import build_plan
from dad_integrations.config import DADConfig
from dad_integrations.plan import main
from dad_integrations.routes import layouts
from dad_integrations.routes.hops import reduce_scatter_bytes
from dad_integrations.routes.registry import UnitSizing, get_route
from dad_integrations.routing.compute_model import ComputeModel
from dad_integrations.routing.link import LinkModel
from dad_integrations.routing.plan_sharded import as_step_plan, sharded_time_plan, zero3_counts, zero3_ranges
from dad_integrations.routing.planner import sharded_steady_state, stated_compute
from dad_integrations.routing.timing import StepTiming

F32 = torch.float32


def _plan(mode="auto", rank=4):
    model = nn.Sequential(nn.Embedding(50, 32), nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32), nn.Linear(32, 10))
    plan = build_plan(model, DADConfig(mode=mode, rank=rank))
    for c in plan.captures:
        c.remove()
    return plan


def _hops(plan, engine, mode="auto", rank=4, sites=4, tokens=24, **kw):
    return sharded_time_plan(plan, engine=engine, tokens=tokens, positions=tokens, world_size=sites, mode=mode,
                             rank=rank, **kw)


@pytest.mark.parametrize("mode, rank", [("auto", 4), ("exact", None), ("rank", 4)])
def test_fsdp2_hops_are_the_sharded_byte_plan(mode, rank):
    """FSDP2's one hop: per weight the route and bytes (with its row counts) of the sharded byte plan
    (`sharded_steady_state`), the reduce-scatter its baseline; `as_step_plan` gives that plan back."""
    plan = _plan(mode, rank)
    ref = sharded_steady_state(plan, tokens=24, positions=24, world_size=4, mode=mode, rank=rank)
    tp = _hops(plan, "fsdp2", mode, rank)
    assert tp.hops == ["group"] and tp.engine == "FSDP2"
    for a, b in zip(ref.units, tp.units):
        assert (a.route, a.rows) == (b.route, b.rows)
        assert a.dad == pytest.approx(b.bytes["group"] + b.counts_bytes, rel=1e-12)
        assert a.reduce_scatter == pytest.approx(b.engine_bytes["group"], rel=1e-12)
    back = as_step_plan(tp)
    assert back.total == pytest.approx(ref.total) and back.reduce_scatter == pytest.approx(ref.reduce_scatter)
    assert back.counts == ref.counts
    assert tp.dad == 0.0 and tp.engine_total == 0.0  # no timing: by bytes, no seconds


def test_zero3_prices_its_partitions():
    """ZeRO-3: each parameter cut in ``ceil(numel/S)`` ranges (DeepSpeed's ``partition_numel``); a
    weight's bytes are its route's on the partitions (the busiest rank's), its biases reduce-scattered
    beside it, and the engine's own ``(S-1) ceil(numel/S)`` elements per parameter."""
    assert zero3_ranges(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert zero3_ranges(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    # an embedding's ids spread over each range's covering rows (50 x 32 over 4 ranks: 400 elements, 13 rows each)
    assert zero3_counts(("embedding",), (50, 32), [24], zero3_ranges(1600, 4)) == [[24, 6, 6, 6, 6]]
    plan = _plan("rank", 4)
    tp = _hops(plan, "zero3", "rank", 4)
    assert tp.engine == "ZeRO-3" and tp.counts_bytes == 0.0  # mode rank agrees no row counts
    for u, r in zip(plan.units, tp.units):
        m, n = u.shape
        sizing = UnitSizing((), (m, n), F32, F32, rank=4, world_size=4, ranges=zero3_ranges(m * n, 4))
        expected = get_route(r.route).bytes_on(layouts.PARTITIONS, sizing)[0]
        bias = 3 * -(-u.bias_numel // 4) * 4.0 if u.bias_numel else 0.0
        assert r.bytes["group"] == pytest.approx(expected + bias, rel=1e-12), r.name
        assert r.engine_bytes["group"] == 3 * -(-(m * n) // 4) * 4.0 + bias


def test_hsdp_inside_and_between_nodes():
    """HSDP on 2 nodes of 2 ranks: inside a node FSDP2's reduce-scatter over the node's ranks; between
    nodes the route's bytes on the replicate hop (PowerSGD's P and Q of the shard), the engine's the
    shard's all-reduce."""
    plan = _plan("rank", 4)
    intra, inter = LinkModel.uniform(1e10, 0.0), LinkModel.uniform(1e8, 0.0)
    tp = _hops(plan, "fsdp2", "rank", 4, rank_route="allreduce", nodes=2, intra=intra,
               timing=StepTiming(inter, ComputeModel()))
    assert tp.engine == "HSDP" and tp.hops == ["inside", "between"]
    for u, r in zip(plan.units, tp.units):
        assert r.route == RANK_ALLREDUCE
        sizing = UnitSizing((), u.shape, F32, F32, rank=4, bias_numel=u.bias_numel, nodes=2, local=2)
        inside = reduce_scatter_bytes(u.shape, 2, 4) + (reduce_scatter_bytes((u.bias_numel,), 2, 4)
                                                         if u.bias_numel else 0.0)
        assert r.bytes == {"inside": inside, "between": get_route(RANK_ALLREDUCE).bytes_on(layouts.REPLICATE_HOP,
                                                                                            sizing)}
        assert r.engine_bytes["between"] == get_route(DENSE).bytes_on(layouts.REPLICATE_HOP, sizing)
        assert r.seconds == {"inside": pytest.approx(inside / 1e10), "between": pytest.approx(r.bytes["between"] / 1e8)}
    with pytest.raises(ValueError, match="not planned in this version"):
        _hops(plan, "zero3", nodes=2, intra=intra)


def test_time_plan_adds_up_and_routes_by_time():
    """By time: each hop's seconds are its bytes over the link; the step is the weights' seconds and
    the row counts'; with compute slow enough every weight stays on the engine's reduce-scatter."""
    plan = _plan()
    link = LinkModel.uniform(1.25e8, 0.0)  # 1 Gbit/s
    for engine in ("fsdp2", "zero3"):
        tp = _hops(plan, engine, timing=StepTiming(link, ComputeModel()))
        everything = tp.units + [tp.other]
        assert tp.hop_seconds["group"] == pytest.approx(tp.hop_bytes["group"] / 1.25e8)
        assert tp.engine_total == pytest.approx(tp.engine_hop_bytes["group"] / 1.25e8)
        assert tp.dad == pytest.approx(sum(r.dad_seconds for r in everything) + tp.counts_seconds)
        assert tp.dad < tp.engine_total
    slow = stated_compute([u.shape for u in plan.units], rank=4, world_size=4, iterations=1, error_feedback=True,
                          itemsize=4, flops=1e3, memory_bw=1e3)
    tp = _hops(plan, "fsdp2", timing=StepTiming(LinkModel.uniform(1e12, 0.0), slow))
    assert set(tp.counts) == {DENSE}


def test_cli_sharded_bandwidth(capsys, tmp_path):
    """``--sharded --bandwidth`` prints the hop table (the refusal is gone) and ``--json`` carries it;
    ``--engine`` needs ``--sharded``."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 500,
                               "max_position_embeddings": 64, "architectures": ["LlamaForCausalLM"]}))
    base = ["--model", str(cfg), "--sites", "4", "--tokens-per-rank", "64", "--rank", "4", "--sharded",
            "--compute-device", "none"]
    for engine, name in (("fsdp2", "FSDP2"), ("zero3", "ZeRO-3")):
        assert main(base + ["--engine", engine, "--bandwidth", "1gbit"]) == 0
        text = capsys.readouterr().out
        assert f"predicted {name} step" in text and "hop group" in text and f"{name}'s own reduction" in text
        assert main(base + ["--engine", engine, "--bandwidth", "1gbit", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        t = out["time"]
        assert out["engine"] == engine and t["hops"] == ["group"] and set(t["links"]) == {"group"}
        assert {"bytes", "seconds", "engine_bytes", "engine_seconds", "compute"} <= set(t["units"][0])
        assert t["dad"] <= t["engine_total"] + t["counts_seconds"]
    hsdp = ["--model", str(cfg), "--nodes", "2", "--local-size", "2", "--tokens-per-rank", "64", "--rank", "4",
            "--sharded", "--intra-bw", "900GB/s", "--inter-bw", "1gbit", "--compute-device", "none"]
    assert main(hsdp) == 0
    text = capsys.readouterr().out
    assert "sharded (HSDP: 2 nodes x 2 ranks)" in text and "hop inside" in text and "hop between" in text
    with pytest.raises(SystemExit):
        main(base[:-3] + ["--engine", "zero3"])
    assert "give --sharded" in capsys.readouterr().err


# bytes one rank sent in step 3 of `benchmarks.collective_trace`'s cases (2 ranks; HSDP 2 x 2), rank 0,
# its row counts and finiteness flags aside: per ring all-reduce 2 (S-1)/S, all-gather (S-1), reduce-scatter
# (S-1)/S of the tensor, all-to-all what leaves the rank
TRACED = [("fsdp2", "rank", "allreduce", 1, {"group": 5268}), ("fsdp2", "rank", "allgather", 1, {"group": 4020}),
          ("fsdp2", "exact", "auto", 1, {"group": 20544}), ("zero3", "rank", "allreduce", 1, {"group": 5268}),
          ("zero3", "rank", "allgather", 1, {"group": 4020}),
          ("fsdp2", "exact", "auto", 2, {"inside": 41088, "between": 25632})]


@pytest.mark.parametrize("engine, mode, rank_route, nodes, sent", TRACED)
def test_hops_equal_what_the_traced_engines_sent(engine, mode, rank_route, nodes, sent):
    """On the collective trace's model (24 rows a rank), each hop's bytes are what FSDP2, ZeRO-3 and
    HSDP sent in the traced steps."""
    plan = _plan(mode, 4 if mode == "rank" else None)
    tp = _hops(plan, engine, mode, 4 if mode == "rank" else None, sites=2 * nodes, rank_route=rank_route,
               nodes=nodes, intra=LinkModel.uniform(1e9, 0.0) if nodes > 1 else None)
    assert tp.hop_bytes == pytest.approx(sent, rel=1e-12)
