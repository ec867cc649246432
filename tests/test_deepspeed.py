"""dAD on real DeepSpeed engines (CPU accelerator, gloo, 2 ranks under torchrun) against DeepSpeed's own
gradient all-reduce on the same data. One job runs every case (`workers/deepspeed_worker.py`); the
tests read its JSON. Also single-process tests of the "dad" block parsing.
"""
from __future__ import annotations

import json
import os

import pytest

from conftest import WORKERS, check_resume, result, run_torchrun

deepspeed = pytest.importorskip("deepspeed")

TOL = 1e-5        # fp32: parameters after several steps, relative to DeepSpeed's
TOL_BF16 = 2e-2   # bf16 gradients: DeepSpeed sums bf16 tensors, dAD rebuilds in fp32 and rounds once
TOL_FP16 = 5e-3   # fp16 gradients or fp16 on the wire
SCALAR_BYTES = 16  # what DeepSpeed itself may still all-reduce in a step (a flag or norm), not gradients

EXACT = {"mode": "exact"}
FP16 = {"fp16": {"enabled": True, "initial_scale_power": 21, "hysteresis": 1, "loss_scale_window": 2}}

MATCH = {
    "z0-exact": {"stage": 0},
    "z1-exact": {"stage": 1},
    "z0-gas2": {"stage": 0, "gas": 2},
    "z1-gas2": {"stage": 1, "gas": 2},
    "z0-clip": {"stage": 0, "ds": {"gradient_clipping": 0.05}},
    "z1-gas2-clip": {"stage": 1, "gas": 2, "ds": {"gradient_clipping": 0.05}},
    "z0-predivide": {"stage": 0, "ds": {"gradient_predivide_factor": 4.0}},
    "z1-predivide": {"stage": 1, "ds": {"gradient_predivide_factor": 4.0,
                                        "zero_optimization": {"stage": 1, "reduce_scatter": False}}},
    "z0-prescale": {"stage": 0, "ds": {"prescale_gradients": True}},
    "z1-adamw": {"stage": 1, "optimizer": "adamw"},
    "z0-attach": {"stage": 0, "how": "attach"},
    "z1-patched": {"stage": 1, "how": "patched"},
    "z0-args-path": {"stage": 0, "how": "args"},
    "z0-bf16": {"stage": 0, "ds": {"bf16": {"enabled": True}}},
    "z1-bf16-gas2": {"stage": 1, "gas": 2, "ds": {"bf16": {"enabled": True}}},
    "z0-comm-fp16": {"stage": 0, "ds": {"communication_data_type": "fp16"}},
    "z1-fp16-overflow": {"stage": 1, "fp16_on_cpu": True, "steps": 5, "ds": FP16},
    # zero_grad between forward and backward: with gas 1 a no-op (step() zeroed already); with gas 2
    # it drops the boundary's earlier micro-step, which DeepSpeed then does not reduce either
    "z0-zero-after-forward": {"stage": 0, "zero_after_forward": "optimizer-zeros"},
    "z1-zero-after-forward": {"stage": 1, "zero_after_forward": "engine"},
    "z0-gas2-zero-after-forward-mlp": {"stage": 0, "gas": 2, "zero_after_forward": "engine", "model": "mlp"},
    "z1-gas2-zero-after-forward": {"stage": 1, "gas": 2, "zero_after_forward": "optimizer-zeros"},
    # without the first-step check, which would otherwise send for good dense what fails to rebuild
    "z0-gas2-zero-after-forward-unverified": {"stage": 0, "gas": 2, "zero_after_forward": "engine",
                                              "dad": {"mode": "exact", "verify_first_step": False}},
}
FP32_EXACT = [k for k in MATCH if not any(t in k for t in ("bf16", "fp16"))]

ERRORS = {
    "err-unknown-key": ({"dad": {"enabled": True, "mdoe": "exact"}}, "mdoe"),
    "err-bad-mode": ({"dad": {"mode": "fast"}}, "'mode'"),
    "err-bad-enabled": ({"dad": {"enabled": "yes"}}, "'enabled'"),
    "err-rank-missing": ({"dad": {"mode": "rank"}}, "'rank'"),
    # ZeRO-2/3 themselves are tested in test_zero.py; there an adaptive rank is refused
    "err-zero2-adaptive-rank": ({"stage": 2, "dad": {"mode": "rank", "rank": 2, "adaptive_tolerance": 0.9}},
                                "adaptive_tolerance"),
    "err-zero3-adaptive-rank": ({"stage": 3, "dad": {"mode": "auto", "rank": 2, "adaptive_tolerance": 0.9}},
                                "adaptive_tolerance"),
    "err-wire-contradiction": ({"dad": {"mode": "exact", "wire_dtype": "float16"},
                                "ds": {"communication_data_type": "bf16"}}, "contradictory"),
    "err-comm-fp32-bf16": ({"dad": EXACT, "ds": {"bf16": {"enabled": True}, "communication_data_type": "fp32"}},
                           "communication_data_type"),
    "err-overlap": ({"stage": 1, "dad": EXACT,
                     "ds": {"zero_optimization": {"stage": 1, "overlap_comm": True}}}, "overlap_comm"),
    "err-bf16-fp32-accum": ({"stage": 1, "dad": EXACT,
                             "ds": {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}},
                            "BF16 optimizer"),
}


def _cases() -> dict:
    cases = {}
    for cid, extra in MATCH.items():
        cases[cid] = {"kind": "match", "dad": EXACT, **extra}
    for mode, dad in (("rank", {"mode": "rank", "rank": 4}), ("auto", {"mode": "auto", "rank": 4})):
        cases[f"train-{mode}"] = {"kind": "train", "steps": 20, "optimizer": "adamw", "lr": 3e-3, "dad": dad}
    for cid, (extra, _) in ERRORS.items():
        cases[cid] = {"kind": "error", **extra}
    cases["disabled"] = {"kind": "error", "dad": {"enabled": False, "mode": "exact"}, "steps": 1}
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    work = tmp_path_factory.mktemp("deepspeed")
    (work / "cases.json").write_text(json.dumps(CASES))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    run_torchrun(WORKERS / "deepspeed_worker.py", 2, [work / "out.json", work / "cases.json"], timeout=600)
    return json.loads((work / "out.json").read_text())


def _param_bytes(r: dict) -> int:
    return r["ref_bytes"][-1]["engine_ops"]["all_reduce"] - SCALAR_BYTES


@pytest.mark.slow
@pytest.mark.parametrize("case_id", FP32_EXACT)
def test_exact_matches_deepspeed(ds, case_id):
    for r in result(ds, case_id):
        assert r["moved"] > 1e-4, "training did not move the parameters: the comparison would be vacuous"
        if MATCH[case_id].get("optimizer") == "adamw":
            # Adam divides by the gradient's running RMS, so where the true gradient is zero (GPT-2's
            # key biases: softmax cancels them) it turns round-off of either run into lr-sized steps;
            # the whole model is compared then, each parameter only loosely
            assert r["worst"] <= 1e-3, (case_id, r["worst"])
        else:
            assert r["worst"] <= TOL, (case_id, r["worst"], r["per_param"])
        assert r["model"] <= TOL
        assert r["identical"] and r["ref_identical"]
        assert r["losses"][0] == r["ref_losses"][0]
        # every weight stayed on factors (none failed the first-step check and fell back to dense)
        assert r["dense_only"] == [], r["dense_only"]


@pytest.mark.slow
@pytest.mark.parametrize("case_id", FP32_EXACT)
def test_engine_allreduce_is_replaced(ds, case_id):
    """No gradient bytes reach DeepSpeed's own collectives; dAD's group carries them instead."""
    for r in result(ds, case_id):
        for ref_step, step in zip(r["ref_bytes"], r["dad_bytes"]):
            assert ref_step["engine_ops"].get("all_reduce", 0) > 1_000  # DeepSpeed's gradient all-reduce (the MLP: 4 kB)
            assert step["engine_ops"].get("all_reduce", 0) <= SCALAR_BYTES, step
            assert "reduce_scatter_tensor" not in step["engine_ops"] and "reduce" not in step["engine_ops"]
            assert step["dad"] > 0
        # ZeRO 1 still all-gathers the updated parameter partitions, as it must
        if MATCH[case_id]["stage"] == 1:
            assert r["dad_bytes"][-1]["engine_ops"].get("all_gather_into_tensor", 0) > 0


@pytest.mark.slow
def test_scaling_follows_deepspeed(ds):
    assert result(ds, "z0-exact")[0]["prescale"] == 1.0
    assert result(ds, "z0-predivide")[0]["prescale"] == 0.25
    assert result(ds, "z1-predivide")[0]["prescale"] == 0.25
    assert result(ds, "z0-prescale")[0]["prescale"] == 0.5
    for cid in ("z0-exact", "z0-predivide", "z0-prescale", "z1-exact"):
        assert result(ds, cid)[0]["scale"] == pytest.approx(0.5)  # the mean over 2 ranks


@pytest.mark.slow
@pytest.mark.parametrize("case_id", ["z0-bf16", "z1-bf16-gas2"])
def test_bf16_matches_deepspeed(ds, case_id):
    for r in result(ds, case_id):
        assert r["moved"] > 1e-4
        assert r["worst"] <= TOL_BF16, (case_id, r["worst"])
        assert r["identical"]
        assert r["dad_bytes"][-1]["engine_ops"].get("all_reduce", 0) <= SCALAR_BYTES


@pytest.mark.slow
def test_communication_data_type_becomes_wire_dtype(ds):
    for r in result(ds, "z0-comm-fp16"):
        assert r["wire"] == "float16"
        assert r["worst"] <= TOL_FP16 and r["identical"]
        assert r["dad_bytes"][-1]["dad"] < result(ds, "z0-exact")[0]["dad_bytes"][-1]["dad"] * 0.6


@pytest.mark.slow
def test_fp16_overflow_steps_skipped_as_deepspeed(ds):
    """Dynamic loss scaling from 2^21 overflows at first: DeepSpeed skips those steps and lowers the
    scale; with dAD the same steps are skipped and the same scale is reached."""
    for r in result(ds, "z1-fp16-overflow"):
        ref_skipped, skipped = r["skipped"]
        assert ref_skipped > 0 and skipped == ref_skipped
        assert ref_skipped < 5, "every step overflowed: nothing was trained"
        assert r["loss_scale"][0] == r["loss_scale"][1]
        assert r["moved"] > 0 and r["worst"] <= TOL_FP16 and r["identical"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["rank", "auto"])
def test_rank_and_auto_train_with_fewer_bytes(ds, mode):
    for r in result(ds, f"train-{mode}"):
        losses = r["dad"]["losses"]
        assert sum(losses[-5:]) / 5 < sum(losses[:3]) / 3 - 0.5, losses
        assert r["dad"]["identical"]
        ds_bytes = r["deepspeed"]["bytes"][-1]["engine"]
        for step in r["dad"]["bytes"]:
            assert step["engine"] <= SCALAR_BYTES
            assert step["dad"] < ds_bytes / 3
        totals = r["dad"]["totals"]
        assert totals["sent_bytes"] < totals["allreduce_bytes"] / 3
        assert totals["params_rank"] + totals["params_rank_allreduce"] > 0  # the all-reduce route at 2 ranks


@pytest.mark.slow
@pytest.mark.parametrize("case_id", sorted(ERRORS))
def test_config_errors_are_clear(ds, case_id):
    expected = ERRORS[case_id][1]
    for r in result(ds, case_id):
        assert r["error"] is not None, f"{case_id} was accepted"
        assert expected in r["error"], r["error"]


@pytest.mark.slow
def test_disabled_block_keeps_deepspeed_allreduce(ds):
    for r in result(ds, "disabled"):
        assert r["error"] is None and r["attached"] is False
        assert r["bytes"][0]["engine_ops"]["all_reduce"] > 1000 and r["bytes"][0]["dad"] == 0


# -- single process: the block ---------------------------------------------------------------------
def test_split_config_strips_block_and_keeps_caller_dict(tmp_path):
    from deepspeed_dad import split_config
    cfg = {"train_batch_size": 4, "dad": {"enabled": True, "mode": "rank", "rank": 2}}
    stripped, block = split_config(cfg)
    assert "dad" not in stripped and "dad" in cfg
    assert block.enabled and block.config.mode == "rank" and block.config.rank == 2
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    stripped, block = split_config(str(path))
    assert stripped == {"train_batch_size": 4} and block.config.rank == 2
    assert split_config({"train_batch_size": 4}) == ({"train_batch_size": 4}, None)


def test_parse_block_names_bad_keys():
    from deepspeed_dad import parse_block
    with pytest.raises(ValueError, match="rnak"):
        parse_block({"rnak": 4})
    with pytest.raises(ValueError, match="'enabled'"):
        parse_block({"enabled": 1})
    with pytest.raises(ValueError, match="JSON object"):
        parse_block(["mode", "exact"])
    assert parse_block({"enabled": False}).enabled is False


@pytest.mark.slow
def test_accelerate_deepspeed_plugin_picks_up_dad_block(tmp_path):
    """Accelerate builds the engine itself; ``import deepspeed_dad.auto`` is the one added line."""
    pytest.importorskip("accelerate")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    out = tmp_path / "acc.json"
    run_torchrun(WORKERS / "accelerate_ds_worker.py", 2, [out], timeout=300)
    per_rank = json.loads(out.read_text())
    for r in per_rank:
        assert r["distributed_type"] == "DistributedType.DEEPSPEED" and r["engine"] == "DeepSpeedEngine"
        assert r["attached"] and r["identical"]
        assert all(s > 0 for s in r["sent"]) and len(r["sent"]) == len(r["losses"])
        assert sum(r["losses"][-2:]) < sum(r["losses"][:2])


@pytest.mark.slow
def test_checkpoint_carries_dad_state(tmp_path):
    """engine.save_checkpoint / load_checkpoint (default tag, 'latest'), ZeRO 0, 1, 2 and 3: a
    resumed rank-dAD run with error feedback ends where the straight one ends; each rank's state is
    in the tag folder next to DeepSpeed's files."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    run_torchrun(WORKERS / "resume_worker.py", 2, ["deepspeed", tmp_path / "out.json", tmp_path], timeout=600)
    per_rank = json.loads((tmp_path / "out.json").read_text())
    for stage in ("z0", "z1", "z2", "z3"):
        check_resume([r[stage] for r in per_rank],
                     ["global_step3/dad_state_rank0.pt", "global_step3/dad_state_rank1.pt"])


@pytest.mark.slow
def test_accelerate_save_state_on_deepspeed_carries_dad_state(tmp_path):
    """Accelerate with a DeepSpeed plugin: save_state calls the engine's save_checkpoint, so dAD's
    state lands in its tag folder (pytorch_model/) and load_state restores it."""
    pytest.importorskip("accelerate")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    run_torchrun(WORKERS / "resume_worker.py", 2, ["accelerate-deepspeed", tmp_path / "out.json", tmp_path],
                 timeout=600)
    check_resume(json.loads((tmp_path / "out.json").read_text()),
                 ["pytorch_model/dad_state_rank0.pt", "pytorch_model/dad_state_rank1.pt"])
