"""Multi-process checks under torchrun (gloo): dAD against DDP's all-reduce on the same data.

Two torchrun jobs (2 and 4 ranks) run every case once; the tests below read their results.
"""
from __future__ import annotations

import pytest

from conftest import result, run_cases

MODELS = ["mlp", "gpt2", "bert", "llama"]
TOL = 1e-5  # fp32 round-off
AUTO_BATCH = 1  # few rows, so that "auto" sends factors for the wider layers and all-reduces the rest


def _two_rank_cases() -> dict:
    cases = {}
    for model in MODELS:
        for mode in ("exact", "auto"):
            for uneven in (False, True):
                cases[f"grad-{model}-{mode}-{'uneven' if uneven else 'equal'}"] = {
                    "kind": "grad", "model": model, "config": {"mode": mode}, "uneven": uneven,
                    "batch": AUTO_BATCH if mode == "auto" else 3}
            cases[f"nosync-{model}-{mode}"] = {"kind": "grad", "model": model, "config": {"mode": mode},
                                              "accumulate": 2, "uneven": True, "batch": 1}
        for mode, cfg in (("exact", {"mode": "exact"}), ("rank", {"mode": "rank", "rank": 4}),
                          ("auto", {"mode": "auto"}), ("auto-rank", {"mode": "auto", "rank": 4})):
            if model in ("gpt2", "llama") or mode == "exact":
                cases[f"train-{model}-{mode}"] = {"kind": "train", "model": model, "config": cfg, "steps": 20}
    cases.update({
        "grad-gpt2-checkpointing": {"kind": "grad", "model": "gpt2_ckpt", "config": {"mode": "exact"}},
        "grad-gpt2-overlap": {"kind": "grad", "model": "gpt2", "config": {"mode": "exact"},
                              "sleep_before_sync": 0.5},
        "grad-mlp-reentrant-checkpoint": {"kind": "grad", "model": "mlp_ckpt", "config": {"mode": "exact"}},
        "grad-mlp-dynamic-graph": {"kind": "grad", "model": "mlp_dynamic", "config": {"mode": "exact"},
                                   "uneven": True, "unused": True},
        "grad-embedding-padding-freq": {"kind": "grad", "model": "embedding", "config": {"mode": "exact"},
                                        "uneven": True},
        "grad-mlp-functional-use": {"kind": "grad", "model": "mlp_functional", "config": {"mode": "exact"}},
        "grad-mlp-zero-tensors": {"kind": "grad", "model": "mlp", "config": {"mode": "exact"}, "zero": "zeros",
                                  "steps": 3},
        "grad-mlp-no-zeroing": {"kind": "grad", "model": "mlp", "config": {"mode": "exact"}, "zero": "keep",
                                "steps": 3},
        "grad-rank-above-true-rank": {"kind": "grad", "model": "mlp_narrow",
                                      "config": {"mode": "rank", "rank": 3}, "uneven": True},
        "grad-rank-gpt2": {"kind": "grad", "model": "gpt2", "config": {"mode": "rank", "rank": 4}, "steps": 3},
        "grad-rank-adaptive": {"kind": "grad", "model": "gpt2",
                               "config": {"mode": "rank", "rank": 8, "adaptive_tolerance": 0.5}},
        "grad-autocast-bf16": {"kind": "grad", "model": "gpt2", "config": {"mode": "exact"},
                               "autocast": "bfloat16"},
        # the all-gather route's rebuild: the mean of the sites' own rank-r approximations
        "rankq-gpt2": {"kind": "rank_quality", "model": "gpt2", "uneven": True,
                       "config": {"mode": "rank", "rank": 2, "power_iterations": 10, "rank_route": "allgather"}},
        "rankq-mlp": {"kind": "rank_quality", "model": "mlp", "batch": 8,
                      "config": {"mode": "rank", "rank": 2, "power_iterations": 10, "rank_route": "allgather"}},
        "grad-wire-fp16": {"kind": "grad", "model": "gpt2", "config": {"mode": "exact", "wire_dtype": "float16"}},
        "train-gpt2-error-feedback": {"kind": "train", "model": "gpt2", "steps": 20,
                                      "config": {"mode": "rank", "rank": 2, "error_feedback": True}},
        "train-gpt2-adaptive-bf16": {"kind": "train", "model": "gpt2", "steps": 20,
                                     "config": {"mode": "auto", "rank": 4, "adaptive_tolerance": 0.9,
                                                "wire_dtype": "bfloat16"}},
        "bytes-gpt2-exact": {"kind": "bytes", "model": "gpt2", "config": {"mode": "exact"}, "uneven": True},
        "bytes-gpt2-rank": {"kind": "bytes", "model": "gpt2", "config": {"mode": "rank", "rank": 4}},
        "bytes-gpt2-auto": {"kind": "bytes", "model": "gpt2", "config": {"mode": "auto", "rank": 4}},
        "bytes-gpt2-auto-lossless": {"kind": "bytes", "model": "gpt2", "config": {"mode": "auto"},
                                     "batch": 1, "steps": 3},
        "bytes-gpt2-auto-growing": {"kind": "bytes", "model": "gpt2", "config": {"mode": "auto"},
                                    "batch_by_step": [1, 1, 6, 1], "steps": 4},
        "grad-gpt2-auto-growing": {"kind": "grad", "model": "gpt2", "config": {"mode": "auto"},
                                   "batch_by_step": [1, 1, 6, 1], "steps": 4},
        "bytes-gpt2-adaptive": {"kind": "bytes", "model": "gpt2",
                                "config": {"mode": "rank", "rank": 8, "adaptive_tolerance": 0.5}},
        # engine reductions: sums, pre-division, and exchanges started at the k-th backward pass
        "grad-gpt2-sum": {"kind": "grad", "model": "gpt2", "config": {"mode": "auto"}, "uneven": True,
                          "sync": {"postscale_factor": 1.0}},
        "grad-mlp-predivide": {"kind": "grad", "model": "mlp", "config": {"mode": "exact"},
                               "sync": {"prescale_factor": 0.25, "postscale_factor": 2.0}},
        "grad-gpt2-passes-2": {"kind": "grad", "model": "gpt2", "config": {"mode": "exact"}, "uneven": True,
                               "accumulate": 2, "sync": {"backward_passes_per_step": 2}},
        # dAD as DDP's communication hook (the Accelerate path): DDP's no_sync accumulation too
        "grad-ddphook-gpt2-exact": {"kind": "grad", "model": "gpt2", "config": {"mode": "exact"},
                                    "ddp_hook": True, "uneven": True, "steps": 3},
        "grad-ddphook-gpt2-accumulate": {"kind": "grad", "model": "gpt2", "config": {"mode": "auto"},
                                         "ddp_hook": True, "accumulate": 2},
        "grad-ddphook-bert-exact": {"kind": "grad", "model": "bert", "config": {"mode": "exact"},
                                    "ddp_hook": True},
        "grad-ddphook-mlp-dynamic": {"kind": "grad", "model": "mlp_dynamic", "config": {"mode": "exact"},
                                     "ddp_hook": True, "unused": True, "steps": 3},
        "grad-ddphook-gpt2-no-zeroing": {"kind": "grad", "model": "gpt2", "config": {"mode": "exact"},
                                         "ddp_hook": True, "zero": "keep", "steps": 3},
        # forward -> zero_grad() -> backward (PyTorch's ImageNet loop), and zero_grad between micro-steps
        "grad-mlp-zero-after-forward-exact": {"kind": "grad", "model": "mlp", "config": {"mode": "exact"},
                                              "zero_after_forward": "none", "steps": 3, "uneven": True},
        "grad-gpt2-zero-after-forward-auto": {"kind": "grad", "model": "gpt2", "config": {"mode": "auto"},
                                              "zero_after_forward": "zeros", "steps": 3, "batch": 1},
        "grad-ddphook-mlp-zero-after-forward": {"kind": "grad", "model": "mlp", "config": {"mode": "exact"},
                                                "ddp_hook": True, "zero_after_forward": "zeros", "steps": 3},
        "grad-mlp-zero-between-micro-steps": {"kind": "grad", "model": "mlp", "config": {"mode": "exact"},
                                              "zero_after_forward": "zeros", "accumulate": 3, "uneven": True},
        "grad-gpt2-zero-between-micro-steps-auto": {"kind": "grad", "model": "gpt2", "config": {"mode": "auto"},
                                                    "zero_after_forward": "none", "accumulate": 2, "batch": 1},
        "grad-ddphook-gpt2-zero-between-micro-steps": {"kind": "grad", "model": "gpt2",
                                                       "config": {"mode": "exact"}, "ddp_hook": True,
                                                       "zero_after_forward": "none", "accumulate": 2},
        # a non-finite loss on one rank: non-finite everywhere, as all-reduce gives
        "nonfinite-mlp-rank-svd": {"kind": "nonfinite", "model": "mlp",
                                   "config": {"mode": "rank", "rank": 2, "error_feedback": False}},
        "nonfinite-mlp-rank-inf": {"kind": "nonfinite", "model": "mlp", "bad": "inf",
                                   "config": {"mode": "rank", "rank": 2, "error_feedback": False}},
        # a step the loss scaler skips leaves no trace (defaults: error feedback on)
        # auto at rank r against PowerSGD's hook at rank r, bytes counted at torch.distributed
        "vs-powersgd-gpt2-auto": {"kind": "vs_powersgd", "model": "gpt2", "batch": 4,
                                  "config": {"mode": "auto", "rank": 2}},
        "scaler-skip-gpt2-auto-rank": {"kind": "scaler_skip", "model": "gpt2", "config": {"mode": "auto", "rank": 2}},
        "scaler-skip-gpt2-rank-allreduce": {"kind": "scaler_skip", "model": "gpt2",
                                            "config": {"mode": "rank", "rank": 2, "rank_route": "allreduce"}},
        "nonfinite-gpt2-rank-error-feedback": {"kind": "nonfinite", "model": "gpt2",
                                               "config": {"mode": "rank", "rank": 2, "error_feedback": True}},
        "nonfinite-gpt2-auto-rank": {"kind": "nonfinite", "model": "gpt2", "config": {"mode": "auto", "rank": 4}},
        # rank-dAD's own power iteration on the dense residual-compensated gradient spreads the NaN
        "nonfinite-gpt2-rank-allgather": {"kind": "nonfinite", "model": "gpt2",
                                          "config": {"mode": "rank", "rank": 2, "rank_route": "allgather"}},
        "nonfinite-gpt2-exact": {"kind": "nonfinite", "model": "gpt2", "config": {"mode": "exact"}},
        "broadcast-seeded-differently": {"kind": "broadcast", "config": {"mode": "exact"}},
        # rank-r all-reduce (PowerSGD's shared power iteration)
        "grad-rank-allreduce-above-true-rank": {"kind": "grad", "model": "mlp_narrow", "uneven": True,
                                                "config": {"mode": "rank", "rank": 3, "rank_route": "allreduce"}},
        "train-gpt2-rank-allreduce": {"kind": "train", "model": "gpt2", "steps": 20,
                                      "config": {"mode": "rank", "rank": 2, "rank_route": "allreduce",
                                                 "error_feedback": True}},
        "bytes-gpt2-rank-allreduce": {"kind": "bytes", "model": "gpt2",
                                      "config": {"mode": "rank", "rank": 4, "rank_route": "allreduce"}},
        # power_iterations 2: two rounds of P and Q all-reduce per step
        "train-gpt2-rank-allreduce-iters2": {"kind": "train", "model": "gpt2", "steps": 12,
                                             "config": {"mode": "rank", "rank": 2, "rank_route": "allreduce",
                                                        "power_iterations": 2}},
        "bytes-gpt2-rank-allreduce-iters2": {"kind": "bytes", "model": "gpt2",
                                             "config": {"mode": "rank", "rank": 4, "rank_route": "allreduce",
                                                        "power_iterations": 2}},
        "nonfinite-gpt2-rank-allreduce": {"kind": "nonfinite", "model": "gpt2",
                                          "config": {"mode": "rank", "rank": 2, "rank_route": "allreduce",
                                                     "error_feedback": True}},
        "error-mismatch": {"kind": "error", "model": "mlp", "other": "mlp_narrow"},
        "error-reentrant-shared": {"kind": "error", "model": "mlp_ckpt_shared", "config": {"mode": "exact"}},
    })
    return cases


def _four_rank_cases() -> dict:
    cases = {}
    for model in MODELS:
        for mode in ("exact", "auto"):
            cases[f"grad-{model}-{mode}-uneven"] = {"kind": "grad", "model": model, "config": {"mode": mode},
                                                    "uneven": True, "batch": 1}
    cases["nosync-gpt2-exact"] = {"kind": "grad", "model": "gpt2", "config": {"mode": "exact"},
                                  "accumulate": 2, "uneven": True}
    for mode, cfg in (("exact", {"mode": "exact"}), ("rank", {"mode": "rank", "rank": 4}),
                      ("auto-rank", {"mode": "auto", "rank": 4})):
        cases[f"train-gpt2-{mode}"] = {"kind": "train", "model": "gpt2", "config": cfg, "steps": 20}
    cases["bytes-gpt2-exact"] = {"kind": "bytes", "model": "gpt2", "config": {"mode": "exact"}, "uneven": True}
    return cases


TWO, FOUR = _two_rank_cases(), _four_rank_cases()


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_cases(tmp_path_factory, 2, TWO)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_cases(tmp_path_factory, 4, FOUR)


def _runs(fixture_name: str, cases: dict, kind: str, exclude: tuple = ()):
    return [pytest.param(fixture_name, cid, id=f"{fixture_name}-{cid}") for cid, c in cases.items()
            if c["kind"] == kind and cid.split("-")[0] in ("grad", "nosync") and not cid.startswith(exclude)] \
        if kind == "grad" else \
        [pytest.param(fixture_name, cid, id=f"{fixture_name}-{cid}") for cid, c in cases.items() if c["kind"] == kind]


LOSSLESS = [p for p in _runs("two", TWO, "grad") + _runs("four", FOUR, "grad")
            if not any(k in p.values[1] for k in ("rank-gpt2", "adaptive", "fp16", "autocast"))]


@pytest.mark.parametrize("world,case_id", LOSSLESS)
def test_gradients_equal_ddp(world, case_id, request):
    """Every parameter's synchronised gradient equals DDP's average to fp32 round-off, on every rank."""
    for rank, r in enumerate(result(request.getfixturevalue(world), case_id)):
        bad = {k: v for k, v in r["per_param"].items() if v > TOL}
        assert not bad, f"rank {rank}: relative error above {TOL}: {bad}"


def test_functional_use_falls_back_to_dense(two):
    """A weight also used outside its module fails the first-step check and goes dense, still exact."""
    for r in result(two, "grad-mlp-functional-use"):
        assert r["dense_only"] == ["hidden.weight"]
        assert r["worst"] <= TOL


def test_autocast_bf16_keeps_factors(two):
    """Under bf16 autocast the factors still pass the first-step check (bf16 rows, fp32 inputs) and
    the result is as close to DDP's as bf16 allows (both sides round differently)."""
    for r in result(two, "grad-autocast-bf16"):
        assert r["dense_only"] == [] and "exact" in r["representations"]
        assert r["worst"] < 5e-2


def test_embedding_padding_and_frequency_scaling_stay_on_factors(two):
    for r in result(two, "grad-embedding-padding-freq"):
        assert r["dense_only"] == [] and r["worst"] <= TOL


def test_exact_mode_uses_factors(two):
    for r in result(two, "grad-gpt2-exact-equal"):
        assert "exact" in r["representations"]


@pytest.mark.parametrize("model", ["gpt2", "bert", "llama"])
def test_auto_mixes_factors_and_all_reduce(two, model):
    """With few rows "auto" sends factors for some layers and all-reduces others, still exactly."""
    for r in result(two, f"grad-{model}-auto-equal"):
        assert {"exact", "dense"} <= set(r["representations"]), r["representations"]


def test_exchange_overlaps_backward(two):
    """Units start their exchange from backward hooks, not from synchronize(): with synchronize()
    called half a second after backward, every unit's exchange has begun before it."""
    for r in result(two, "grad-gpt2-overlap"):
        assert sorted(r["overlapped"]) == sorted(r["units"])


def test_rank_returns_exactly_r_components(two):
    """rank-dAD sends exactly r components per weight (not r-1 or r-2), on every step and rank."""
    for r in result(two, "grad-rank-gpt2"):
        assert r["components"], "no weight went through rank-dAD"
        for name, comps, shape in r["components"]:
            assert comps == min(4, *shape), (name, comps, shape)


@pytest.mark.parametrize("case_id", ["grad-rank-above-true-rank", "grad-rank-allreduce-above-true-rank"])
def test_rank_at_or_above_true_rank_is_exact(two, case_id):
    for r in result(two, case_id):
        assert r["components"] and all(c <= 3 for _, c, _ in r["components"])
        assert r["worst"] <= TOL


@pytest.mark.parametrize("model", ["gpt2", "mlp"])
def test_rank_average_within_best_rank_r_bound(two, model):
    """The rebuilt gradient is the mean of the sites' rank-r approximations: its distance to DDP's
    mean is at most the mean of the sites' best rank-r (SVD) errors, within 5%."""
    for r in result(two, f"rankq-{model}"):
        assert r["errors"]
        for name, (actual, bound) in r["errors"].items():
            assert actual <= 1.05 * bound + 1e-7, (name, actual, bound)


def test_rank_adaptive_sends_at_most_rank(two):
    for r in result(two, "grad-rank-adaptive"):
        comps = [c for _, c, _ in r["components"]]
        assert comps and all(1 <= c <= 8 for c in comps) and min(comps) < 8


def test_rank_is_lossy_but_close(two):
    """rank-dAD's error is bounded; fp16 on the wire costs about fp16 precision."""
    for r in result(two, "grad-rank-gpt2"):
        assert 0 < r["worst"] < 1.5
    for r in result(two, "grad-wire-fp16"):
        assert 0 < r["worst"] < 1e-2


@pytest.mark.parametrize("world,case_id", _runs("two", TWO, "train") + _runs("four", FOUR, "train"))
def test_ranks_end_bit_identical(world, case_id, request):
    """After 20 optimizer steps every rank holds bit-identical parameters, in every mode."""
    per_rank = result(request.getfixturevalue(world), case_id)
    assert all(r["identical"] for r in per_rank)
    losses = per_rank[0]["losses"]
    assert all(l == l for l in losses), "loss became NaN"
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, "loss did not fall"


@pytest.mark.parametrize("world,case_id", _runs("two", TWO, "bytes") + _runs("four", FOUR, "bytes"))
def test_byte_accounting_matches_collectives(world, case_id, request):
    """The report's bytes equal the sizes of the tensors actually handed to torch.distributed."""
    for r in result(request.getfixturevalue(world), case_id):
        s = r["world_size"]
        for step in r["steps"]:
            assert step["handed"] == pytest.approx(step["recorded"], rel=1e-9)
            assert step["sent"] > 0
            # the all-reduce reference: a ring all-reduce of every trainable parameter's gradient
            assert step["allreduce"] == pytest.approx(2 * (s - 1) / s * r["param_bytes"], rel=1e-9)
            by_rep = step["by_representation"]
            assert sum(v["sent_bytes"] for v in by_rep.values()) == pytest.approx(step["sent"], rel=1e-9)
            assert step["json"]["sent_bytes"] == pytest.approx(step["sent"], rel=1e-12)
            if "rank" in case_id or "auto" in case_id or "adaptive" in case_id:
                assert step["sent"] < step["allreduce"]


@pytest.mark.parametrize("case_id", ["bytes-gpt2-auto", "bytes-gpt2-auto-lossless", "bytes-gpt2-auto-growing"])
def test_auto_never_sends_more_than_allreduce_per_layer(two, case_id):
    """After the first (verification) step, no layer in auto mode moves more than all-reduce:
    units that go dense or rank-r skip the size exchange. Only a step whose row counts grew past
    the prediction may pay one size exchange on a unit that then goes dense."""
    for r in result(two, case_id):
        s = r["world_size"]
        growing = "growing" in case_id
        for i, step in enumerate(r["steps"][1:], start=1):
            reps = {rep for _, rep, _, _ in step["params"]}
            layers = {}  # a layer: its weight and bias (an exact unit's bias rides free in its factors)
            for name, rep, sent, ar in step["params"]:
                if rep != "overhead":
                    acc = layers.setdefault(name.rsplit(".", 1)[0], [0.0, 0.0])
                    acc[0] += sent
                    acc[1] += ar
            excess = {name: sent - ar for name, (sent, ar) in layers.items() if sent > ar * (1 + 1e-9) + 1e-9}
            if growing and i == 2:
                assert all(e <= (s - 1) * 8 * 4 for e in excess.values()), excess
            else:
                assert not excess, (i, excess, reps)
        if "lossless" in case_id:  # both routes in use, so the test covers the exact path too
            assert {"exact", "dense"} <= {rep for _, rep, _, _ in r["steps"][-1]["params"]}


def test_power_iterations_multiply_the_all_reduce_routes_bytes(two):
    """``power_iterations`` 2 runs two rounds of PowerSGD's P and Q all-reduce: the route's bytes
    per step are twice those of one round, to the byte (the bias buckets' do not change)."""
    for one, two_rounds in zip(result(two, "bytes-gpt2-rank-allreduce"), result(two, "bytes-gpt2-rank-allreduce-iters2")):
        a, b = one["steps"][-1]["by_representation"], two_rounds["steps"][-1]["by_representation"]
        assert a["rank_allreduce"]["sent_bytes"] > 0
        assert b["rank_allreduce"]["sent_bytes"] == pytest.approx(2 * a["rank_allreduce"]["sent_bytes"], rel=1e-9)
        assert b["dense"]["sent_bytes"] == pytest.approx(a["dense"]["sent_bytes"], rel=1e-9)


def test_mismatched_models_raise_on_every_rank(two):
    for r in result(two, "error-mismatch"):
        assert r["error"] and "differs across ranks" in r["error"]


def test_weight_shared_across_reentrant_segments_raises(two):
    """DDP refuses it too; dAD must say so rather than send half the rows."""
    for r in result(two, "error-reentrant-shared"):
        assert r["error"] and "reentrant" in r["error"]


@pytest.mark.parametrize("case_id", [cid for cid, c in TWO.items() if c["kind"] == "nonfinite"])
def test_nonfinite_gradients_spread_as_allreduce_gives(two, case_id):
    """A NaN/Inf loss on one rank: every rank ends with a non-finite gradient wherever DDP's is, no
    rank raises alone, the bad step leaves warm starts and residuals as they were, and the next
    step is finite again."""
    for rank, r in enumerate(result(two, case_id)):
        assert r["mismatched"] == [], f"rank {rank}: finite where all-reduce is not: {r['mismatched']}"
        assert r["state_kept"], f"rank {rank}: the non-finite step changed dAD's state"
        assert r["finite_after"], f"rank {rank}: the step after the non-finite one is not finite"


def test_attach_broadcasts_rank0_parameters_and_buffers(two):
    """Ranks seeded differently hold rank 0's parameters and buffers after attaching, as under DDP."""
    assert all(r["identical"] for r in result(two, "broadcast-seeded-differently"))


@pytest.mark.parametrize("case_id", ["scaler-skip-gpt2-auto-rank", "scaler-skip-gpt2-rank-allreduce"])
def test_scaler_skipped_step_leaves_no_trace(two, case_id):
    """A step whose gradients overflow (GradScaler skips it and halves its scale) must not poison the
    error-feedback residuals or the warm starts: the run ends bit for bit where the same run without
    that step ends, parameters and dAD state, with ranks identical."""
    for rank, r in enumerate(result(two, case_id)):
        assert r["skipped"], f"rank {rank}: the scaler did not skip the non-finite step"
        assert r["scales"][0] == r["scales"][1] < 2.0 ** 10
        assert r["state_numel"] > 0 and r["same_state_keys"], "no residuals or warm starts: the test is vacuous"
        assert any(k.startswith("rank") for k in r["routes"]), r["routes"]
        assert r["params_rel"] <= 1e-6, f"rank {rank}: parameters {r['params_rel']:.2e} off the run without the step"
        assert r["state_rel"] <= 1e-6, f"rank {rank}: dAD state {r['state_rel']:.2e} off"
        assert r["identical"]


def test_auto_never_sends_more_than_powersgd_hook(two):
    """GPT-2 (with position embeddings), auto at rank 2 against DDP + PowerSGD's hook at rank 2,
    bytes counted where they reach torch.distributed, every steady-state step."""
    for rank, r in enumerate(result(two, "vs-powersgd-gpt2-auto")):
        ours, theirs = r["sent"]["dad"], r["sent"]["powersgd"]
        assert max(ours) <= min(theirs), (rank, ours, theirs, r["routes"])
        assert "rank" in r["routes"] or "rank_allreduce" in r["routes"], r["routes"]
