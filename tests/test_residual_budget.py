"""Memory per rank and the residual budget (issue 38, item 5): the memory model's figures
(`routing.memory`), the rank a budget fits, the user's ``error_feedback_rank`` winning, the attach
line's figures in the residuals' own dtype, and one 2-rank FSDP2 job with a budget too small for
whole residuals (tests/workers/residual_budget_worker.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_torchrun
from dad_integrations.capture.assign import build_plan
from dad_integrations.codecs.error_feedback import LowRankErrorFeedback
from dad_integrations.config import DADConfig
from dad_integrations.engines import banner
from dad_integrations.routing import memory
from dad_integrations.routing.memory import (FIT_RANK_CAP, describe, fit_residual_rank, rank_memory,
                                             residual_bytes, state_bytes)

WORKERS = Path(__file__).parent / "workers"
GIB = 2 ** 30


def llama_7b_shapes():
    """Llama-7B's weight matrices: 32 layers of q, k, v, o (4096 x 4096) and the MLP (11008 x 4096,
    twice, and 4096 x 11008), the embedding and the head (32000 x 4096)."""
    h, f, v, layers = 4096, 11008, 32000, 32
    return [(h, h)] * 4 * layers + [(f, h), (f, h), (h, f)] * layers + [(v, h), (v, h)]


@pytest.mark.parametrize("engine,itemsize,per_param", [
    ("replicated", 4, 16.0), ("zero1", 4, 4 + 4 + 8 / 4), ("zero2", 4, 4 + 12 / 4), ("zero3", 4, 4.0),
    ("fsdp2", 4, 4.0), ("fsdp2", 2, 4.0), ("zero2", 2, 2 + 14 / 4), ("fsdp2", 8, 32 / 4)])
def test_engine_state_is_16_bytes_a_parameter_sharded_as_the_engine_shards(engine, itemsize, per_param):
    assert state_bytes(1000, 4, engine, itemsize) == pytest.approx(1000 * per_param)


def test_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="unknown engine 'zero4'"):
        state_bytes(10, 2, "zero4")


@pytest.mark.parametrize("name,kind", [("FSDP2", "fsdp2"), ("ZeRO-3", "zero3"), ("DeepSpeed ZeRO-2", "zero2"),
                                       ("DeepSpeed ZeRO-1", "zero1"), ("DeepSpeed ZeRO-0", "replicated"),
                                       ("DDP", "replicated"), ("Horovod", "replicated")])
def test_engines_named_as_the_banner_names_them(name, kind):
    assert memory.engine_kind(name) == kind


@pytest.mark.parametrize("q", [1, 2, 5, 7, 8, 40, 64])
def test_residual_numbers_are_what_the_low_rank_memory_keeps(q):
    shapes = [(12, 5), (3, 40), (8, 64), (64, 64)]
    mem = LowRankErrorFeedback(True, q)
    kept = [mem.pack(f"w{i}", torch.randn(m, n, dtype=torch.float64)) for i, (m, n) in enumerate(shapes)]
    numel = sum(t.numel() for k in kept for t in (k if isinstance(k, tuple) else (k,)))
    assert residual_bytes(shapes, q, 8) == numel * 8
    assert residual_bytes(shapes, None) == sum(m * n for m, n in shapes) * 4


def test_llama_7b_on_64_ranks_under_zero3():
    """The issue's figures: 25.1 GiB of whole residuals against 1.57 GiB of ZeRO-3's state; rank 16
    would hold 0.15 GiB; a 1x budget keeps them at the cap's rank, inside the state; the default
    (0.25x) at rank 40, inside a quarter of it, twice that at a step's end."""
    shapes = llama_7b_shapes()
    params = sum(m * n for m, n in shapes) + 65 * 4096  # and the norms
    one = rank_memory("zero3", params=params, world_size=64, routed=shapes, rank=4, residual_budget=1.0)
    assert one.state / GIB == pytest.approx(1.57, abs=0.005)
    assert one.whole_residuals / GIB == pytest.approx(25.1, abs=0.05)
    assert residual_bytes(shapes, 16) / GIB == pytest.approx(0.15, abs=0.005)
    assert one.fitted and one.residual_rank == FIT_RANK_CAP and one.residuals == residual_bytes(shapes, FIT_RANK_CAP)
    assert one.residuals <= one.state
    assert "error feedback up to 0.6 GiB (fp32, rank 64, 226 weights, fit to residual_budget 1.6 GiB; " \
           "whole: 25.1 GiB)" in describe(one)
    mem = rank_memory("zero3", params=params, world_size=64, routed=shapes, rank=4)
    assert mem.fitted and mem.residual_rank == 40 and mem.residuals <= 0.25 * mem.state
    assert mem.step_end_residuals == 2 * mem.residuals
    line = describe(mem)
    assert "error feedback up to 0.4 GiB (fp32, rank 40, 226 weights, fit to residual_budget 0.4 GiB; " \
           "whole: 25.1 GiB), 0.8 GiB at a step's end" in line, line


def test_budget_chooses_the_largest_rank_that_fits():
    shapes = [(64, 64), (64, 64), (8, 64)]  # rank q < 8: 4 (2 * 128 q + 72 q) = 1312 q bytes
    assert fit_residual_rank(shapes, residual_bytes(shapes)) is None   # whole fits
    assert fit_residual_rank(shapes, 7040) == 5 and fit_residual_rank(shapes, 1312 * 5 - 1) == 4
    assert fit_residual_rank(shapes, 1.0) == 1   # nothing fits: the least, said at attach
    # the pair outgrows the residual before q reaches min(m, n): the largest q that fits, not the first miss
    assert fit_residual_rank([(64, 64)], 64 * 64 * 4 - 1) == 31


def test_rank_memory_fits_only_where_a_budget_applies():
    shapes, params = [(64, 64), (64, 64), (8, 64)], 2 * 64 * 65 + 8 * 65
    kw = dict(params=params, world_size=2, routed=shapes, rank=2)
    assert rank_memory("fsdp2", residual_budget=1.0, **kw).residual_rank is None   # S = 2: whole fits in 1x
    default = rank_memory("fsdp2", **kw)                                 # not in the default's 0.25x
    assert default.fitted and default.budget == pytest.approx(0.25 * state_bytes(params, 2, "fsdp2"))
    assert default.residual_rank == fit_residual_rank(shapes, default.budget) == 15  # 4 (256 q + 512)
    small = rank_memory("fsdp2", residual_budget=0.1, **kw)
    assert small.fitted and small.residual_rank == 5 and small.residuals == 1312 * 5
    assert small.budget == pytest.approx(0.1 * state_bytes(params, 2, "fsdp2"))
    user = rank_memory("fsdp2", residual_budget=0.1, error_feedback_rank=3, **kw)   # the user's rank wins
    assert user.residual_rank == 3 and not user.fitted and user.residuals == residual_bytes(shapes, 3)
    assert rank_memory("replicated", residual_budget=0.1, **kw).residual_rank is None  # unsharded: no budget
    assert rank_memory("fsdp2", residual_budget=None, **kw).residual_rank is None
    hsdp = rank_memory("fsdp2", residual_budget=0.1, residual_share=0.5, **kw)         # sharded like the gradient
    assert hsdp.residual_rank is None and hsdp.residuals == residual_bytes(shapes) // 2
    assert rank_memory("fsdp2", error_feedback=False, **kw).residuals == 0
    assert rank_memory("fsdp2", **dict(kw, rank=None)).warm_starts == 0


@pytest.mark.parametrize("engine,itemsize", [("fsdp2", 4), ("zero3", 2), ("zero2", 4), ("zero2", 2)])
def test_a_1x_budget_never_applies_at_up_to_4_ranks(engine, itemsize):
    """At 1x, 2- and 4-rank jobs would keep whole residuals: a rank's state is at least 4 bytes a
    parameter there, whole fp32 residuals at most 4 (every parameter a routed weight)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        shapes = [tuple(int(d) for d in torch.randint(1, 300, (2,), generator=gen)) for _ in range(5)]
        params = sum(m * n for m, n in shapes)
        for world in (2, 3, 4):
            assert not rank_memory(engine, params=params, world_size=world, routed=shapes, rank=4,
                                   param_itemsize=itemsize, residual_budget=1.0).fitted


@pytest.mark.parametrize("engine,itemsize", [("fsdp2", 4), ("zero3", 2), ("fsdp2", 2), ("zero2", 4)])
def test_the_default_budget_keeps_rank_q_residuals_from_2_ranks(engine, itemsize):
    """The default (0.25x): whole fp32 residuals (4 bytes a routed parameter) exceed it from 2 ranks
    on where the routed weights are most parameters (under ZeRO-2, more than 5/8 of them); it keeps
    the largest rank that fits, inside the budget; unsharded engines and ``residual_budget: None``
    keep whole ones whatever the world size."""
    assert DADConfig().residual_budget == memory.DEFAULT_RESIDUAL_BUDGET == 0.25
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        shapes = [tuple(int(d) for d in torch.randint(80, 300, (2,), generator=gen)) for _ in range(5)]
        params = sum(m * n for m, n in shapes)
        for world in (2, 3, 4, 64):
            kw = dict(params=params, world_size=world, routed=shapes, rank=4, param_itemsize=itemsize)
            mem = rank_memory(engine, **kw)
            assert mem.fitted and mem.residuals <= mem.budget and mem.residual_rank <= FIT_RANK_CAP
            assert mem.budget == pytest.approx(0.25 * mem.state)
            assert not rank_memory("replicated", **kw).fitted and not rank_memory("zero1", **kw).fitted
            assert rank_memory(engine, residual_budget=None, **kw).residuals == residual_bytes(shapes)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "1"])
def test_residual_budget_is_checked(bad):
    with pytest.raises(ValueError, match="'residual_budget': must be a number > 0 or None"):
        DADConfig(residual_budget=bad)
    assert DADConfig.from_dict({"residual_budget": None}).residual_budget is None
    assert DADConfig.from_dict(DADConfig(residual_budget=0.25).to_dict()).residual_budget == 0.25


@pytest.mark.parametrize("dtype,itemsize", [(torch.bfloat16, 4), (torch.float16, 4), (torch.float32, 4),
                                            (torch.float64, 8)])
def test_attach_line_counts_residuals_in_the_dtype_they_are_kept_in(dtype, itemsize):
    """fp32 residuals for 16-bit weights (the gradient's dtype would say half)."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 128)).to(dtype)
    config = DADConfig(mode="rank", rank=2)
    units = build_plan(model, config).units
    line = banner.memory_line("DDP", config, model, units, world_size=2)
    whole = (256 * 256 + 128 * 256) * itemsize
    kind = "fp64" if itemsize == 8 else "fp32"
    assert line.startswith("dAD memory per rank: engine state ~"), line
    assert f"error feedback up to {memory.size(whole)} ({kind}, whole, 2 weights)" in line, line
    assert "fit to" not in line and "sharded" not in line
    exact = banner.memory_line("DDP", DADConfig(mode="exact"), model, units, world_size=2)
    assert "error feedback" not in exact and "warm starts" not in exact and "captured rows" in exact


def test_fsdp2_with_a_tiny_budget_keeps_rank_q_residuals(tmp_path):
    """2 ranks, FSDP2 on gloo, ``residual_budget: 0.1``: the rank routes hold rank-5 pairs, as much as
    the warning said, on every rank; the user's ``error_feedback_rank`` wins; exact factors and the
    lossless steps train bitwise as with whole residuals. At the default budget (0.25x) whole
    residuals (0.49x here) do not fit either: rank 15, said at attach at default log levels;
    ``residual_budget: null`` keeps them whole."""
    path = tmp_path / "out.json"
    run_torchrun(WORKERS / "residual_budget_worker.py", 2, [path], timeout=300)
    ranks = json.loads(path.read_text())["ranks"]
    for r in ranks:
        assert r["exact"]["params"] == r["exact-tiny"]["params"]
        assert r["lossless"]["params"] == r["lossless-tiny"]["params"]
        tiny = r["rank-tiny"]
        assert tiny["memory"] == "LowRankErrorFeedback" and tiny["q"] == 5
        assert sorted(tiny["held"]) == ["0.weight", "2.weight", "4.weight"]
        assert all(len(pair) == 2 and pair[0][1] == pair[1][1] == 5 for pair in tiny["held"].values()), tiny["held"]
        assert tiny["held_bytes"] == tiny["said_bytes"] == 1312 * 5
        assert r["rank-user"]["q"] == 3 and r["rank-user"]["said_bytes"] is None
        assert r["lossless"]["memory"] == "ErrorFeedback" and r["lossless-tiny"]["q"] == 5
    said = ranks[0]["rank-tiny"]["said"]
    warned = [s for s in said if "over 'residual_budget' (0.1x the rank's engine state" in s]
    assert len(warned) == 1 and "each is kept as its rank-5 part, 6.4 KiB a rank" in warned[0], said
    lines = [s for s in said if s.startswith("dAD memory per rank: ")]
    assert len(lines) == 1 and "(fp32, rank 5, 3 weights, fit to residual_budget 6.9 KiB; whole: 34.0 KiB)" in lines[0]
    assert not any("residual_budget" in s for s in ranks[0]["rank-user"]["said"])
    for r in ranks:
        assert r["rank-default"]["memory"] == "LowRankErrorFeedback" and r["rank-default"]["q"] == 15
        assert r["rank-default"]["held_bytes"] == r["rank-default"]["said_bytes"] == 4 * (2 * 128 * 15 + 8 * 64)
        assert r["rank-whole"]["memory"] == "ErrorFeedback" and r["rank-whole"]["held_bytes"] == 4 * (2 * 64 * 64 + 512)
    said = ranks[0]["rank-default"]["said"]
    assert len([s for s in said if "over 'residual_budget' (0.25x the rank's engine state, 17.3 KiB): each is kept "
                "as its rank-15 part, 17.0 KiB a rank" in s]) == 1, said
    assert not any("over 'residual_budget'" in s for s in ranks[0]["rank-whole"]["said"])
    assert "error feedback" not in next(s for s in ranks[0]["exact"]["said"] if s.startswith("dAD memory"))
    assert all(r[case]["said"] == [] for r in ranks[1:] for case in r)


def test_plan_memory_counts_residuals_of_rank_routes_and_rows_of_exact_ones():
    units = [((64, 64), [10], "rank_allreduce"), ((64, 64), [10], "exact"), ((8, 64), [10, 5], "dense"),
             ((32, 64), [10], "rank")]
    rows = memory.plan_memory(units, params=20000, world_size=8, rank=2, local_size=4, residual_budget=0.05)
    by = dict(rows)
    assert list(by) == ["DDP, Horovod, ZeRO-0", "ZeRO-1", "ZeRO-2", "FSDP2, ZeRO-3", "HSDP (4 a node)"]
    whole = residual_bytes([(64, 64), (32, 64)])
    assert by["DDP, Horovod, ZeRO-0"].residuals == whole and by["DDP, Horovod, ZeRO-0"].weights == 2
    assert by["FSDP2, ZeRO-3"].residual_rank == fit_residual_rank([(64, 64), (32, 64)], 0.05 * 20000 * 2)
    assert by["HSDP (4 a node)"].residuals == whole // 4 and by["HSDP (4 a node)"].state == 20000 * 4
    assert all(m.rows == 10 * (64 + 64) * 4 for m in by.values())   # the exact weight's only
    assert all(m.warm_starts == (64 + 64) * 2 * 4 for m in by.values())
    no_ef = dict(memory.plan_memory(units, params=20000, world_size=8, rank=2, error_feedback=False))
    assert no_ef["ZeRO-1"].rows == (10 * 128 + 10 * 128 + 10 * 96) * 4 and no_ef["ZeRO-1"].residuals == 0
    text = memory.render_memory(rows)
    assert text.splitlines()[0].startswith("memory per rank, GiB") and "(rank " in text.splitlines()[5]


def test_planner_prints_memory_per_rank(capsys):
    from dad_integrations import plan
    plan.main(["--model", "llama-small", "--sites", "16", "--tokens-per-rank", "64", "--sharded", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert set(out["memory"]) == {"DDP, Horovod, ZeRO-0", "ZeRO-1", "ZeRO-2", "FSDP2, ZeRO-3"}
    fsdp = out["memory"]["FSDP2, ZeRO-3"]
    assert fsdp["state"] == pytest.approx(out["memory"]["DDP, Horovod, ZeRO-0"]["state"] / 16)  # all sharded
    assert fsdp["residuals"] <= fsdp["state"] or fsdp["residual_rank"] == 1


def test_sharded_quality_smoke_holds_what_the_memory_model_says(tmp_path):
    """`python -m benchmarks.sharded_quality --smoke --steps 12` (2 ranks, FSDP2, rank routes from
    step 10): whole residuals against the default's rank-q ones, from the same weights; each holds
    at its last step what `routing.memory` says it holds; the table names both."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.sharded_quality", "--smoke", "--steps", "12", "--out",
                           str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(root)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "sharded_quality.json").read_text())
    by = {r["variant"]: r for r in data["records"]}
    assert set(by) == {"whole", "default"} and by["whole"]["residual_rank"] is None
    assert by["default"]["residual_rank"] == 12 and by["default"]["config"] == {"mode": "rank", "rank": 4,
                                                                                 "objective": "bytes"}
    for rec in by.values():
        assert rec["residual_numbers_held"] * 4 == rec["residual_bytes_model"] > 0
        assert rec["eval_loss"][0] == by["whole"]["eval_loss"][0]   # the same weights
    assert by["default"]["residual_bytes_model"] < by["whole"]["residual_bytes_model"] == by["default"][
        "whole_residual_bytes"]
    md = (tmp_path / "sharded_quality.md").read_text()
    assert "| whole |" in md and "| default |" in md and "rank 12" in md


@pytest.mark.parametrize("keep_rank", [None, 3])
def test_residuals_are_held_twice_only_until_the_step_ends(keep_rank):
    """What `RankMemory.step_end_residuals` counts: a step's new residuals wait beside the last ones
    (a non-finite step keeps those) and the last ones are released when the step ends finite; a
    non-finite step releases its own instead. Whole and rank-q (`keep_residuals_at`) alike."""
    import gc
    import weakref

    from dad_integrations.codecs.route_state import RouteState

    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Linear(12, 8))
    config = DADConfig(mode="rank", rank=2)
    units = build_plan(model, config).units
    state = RouteState(config)
    if keep_rank is not None:
        state.keep_residuals_at(keep_rank)
    shapes = [u.shape for u in units]
    one = residual_bytes(shapes, keep_rank)
    mem = rank_memory("fsdp2", params=16 * 12 + 12 * 8, world_size=2, routed=shapes, rank=2,
                      error_feedback_rank=keep_rank, residual_budget=None)
    assert mem.residuals == one and mem.step_end_residuals == 2 * one
    gen = torch.Generator().manual_seed(0)

    def held_bytes() -> int:
        return state.memory.numel() * 4

    def step(finite: bool) -> list:
        state.start_step()
        made = []
        for u in units:
            m, n = u.shape
            grad = torch.randn(m, n, generator=gen)
            p, q = torch.randn(m, 2, generator=gen), torch.randn(n, 2, generator=gen)
            packed = state.residual(u.name, state.memory.compensate(u.name, grad), p, q)
            made += [weakref.ref(t) for t in (packed if isinstance(packed, tuple) else (packed,))]
            state.hold(state.own, u, q, packed)
        pending = sum(t().numel() for t in made) * 4
        assert held_bytes() + pending == (one if not held_bytes() else 2 * one)  # the step's end
        state.end_step(finite)
        gc.collect()
        return made

    first = step(True)
    assert held_bytes() == one and not state.pending
    second = step(True)
    assert held_bytes() == one and all(r() is None for r in first)       # the last ones released
    third = step(False)                                                   # dropped: its own released
    assert held_bytes() == one and all(r() is None for r in third) and all(r() is not None for r in second)
