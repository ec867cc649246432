"""Accelerate and the Trainer on FSDP2: one `accelerate launch` (2 CPU processes) with the FSDP2
config of `examples/accelerate/fsdp2.yaml`, made to run on CPUs.

Accelerate 1.15 takes its FSDP path only on GPU-class devices; `workers/fsdp_on_cpu.py` lets it
take that path on CPU processes too (the three statements of its GPU branch), so the model is
sharded by Accelerate's own FSDP2 preparation (transformer blocks from ``_no_split_modules``, the
tied or untied embedding and head groups, the root) and trained through ``accumulate``,
``clip_grad_norm_``, ``save_state``/``load_state`` and the Trainer's FSDP handling. The worker
(`workers/fsdp2_accelerate_worker.py`) runs every case; the tests read its results.
"""
from __future__ import annotations

import json

import pytest
import yaml

from conftest import ROOT, WORKERS, run_accelerate

TOL = 1e-5  # fp32 round-off, relative per parameter (floored at 1e-6 of the whole gradient's norm)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Every case's per-rank results (a case that raised fails the tests that read it)."""
    work = tmp_path_factory.mktemp("fsdp2_accelerate")
    config = yaml.safe_load((ROOT / "examples" / "accelerate" / "fsdp2.yaml").read_text())
    assert config["distributed_type"] == "FSDP" and config["fsdp_config"]["fsdp_version"] == 2
    # the GPU example's settings, on 2 CPU processes in fp32 (exactness is read against fp32 runs)
    config.update(use_cpu=True, num_processes=2, mixed_precision="no")
    config.pop("gpu_ids", None)
    (work / "fsdp2_cpu.yaml").write_text(yaml.safe_dump(config))
    run_accelerate(WORKERS / "fsdp2_accelerate_worker.py", [work / "out.json", work], timeout=900,
                   config=work / "fsdp2_cpu.yaml")
    return json.loads((work / "out.json").read_text())


def _case(results: dict, cid: str) -> list:
    per_rank = results[cid]
    for rank, r in enumerate(per_rank):
        if "exception" in r:
            pytest.fail(f"{cid} raised on rank {rank}:\n{r['exception']}")
    return per_rank


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_enable_dad_on_accelerate_fsdp2_equals_fsdp2(results, model):
    """enable_dad on Accelerate's FSDP2 model: sharded gradients (after each synchronised backward,
    accumulated over 2 micro-steps for GPT-2, and after clip_grad_norm_) and parameters equal
    Accelerate's FSDP2 run without dAD; every factor-covered weight went exact."""
    for rank, r in enumerate(_case(results, "accelerate")):
        r = r[model]
        assert r["worst"][1] <= TOL, (rank, r["worst"])
        assert r["clipped"][1] <= TOL, (rank, r["clipped"])
        ref_norms, dad_norms = r["norms"]
        assert dad_norms == pytest.approx(ref_norms, rel=TOL)
        assert r["param_diff"] <= TOL and r["identical"], r
        assert "exact" in r["representations"] and r["params_exact"] > 0
        assert r["dense_only"] == [], r["dense_only"]  # none failed the first-step check
        assert not r["log"], r["log"]


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_accelerate_groups_hooked_once(results, model):
    """Accelerate's tail (final norm, head, and the tied embedding) is one FSDP group over several
    modules: dAD hooks each parameter group once."""
    r = _case(results, "accelerate")[0][model]
    assert r["fsdp_modules"] > r["fsdp_groups"] == r["groups_hooked"], r


def test_save_state_with_dad_on_fsdp2(results):
    """save_state / load_state work with dAD on; exact keeps no state, so no dAD file is written."""
    for model in ("gpt2", "llama"):
        r = _case(results, "accelerate")[0][model]
        assert "pytorch_model_fsdp_0" in r["saved"], r["saved"]
        assert not any(name.startswith("dad_state") for name in r["saved"]), r["saved"]
        assert r["after_load"] == 0.0


def test_trainer_fsdp2_with_dad_callback(results):
    """Trainer with FSDP2 (fsdp_config version 2), gradient accumulation 2 and clipping: with
    DADCallback (exact) it ends where the plain Trainer ends; the bytes are in its logs, beside
    FSDP2's reduce-scatter."""
    for rank, r in enumerate(_case(results, "trainer")):
        assert r["sync"] == "FSDPDADSynchronizer" and r["params_exact"] > 0
        assert r["identical"] and r["moved"] > 0
        assert r["rel_diff"] <= TOL, f"rank {rank}: {r['rel_diff']:.2e} from the plain Trainer"
        logged = [h for h in r["log_history"] if "loss" in h]
        assert logged and all(h["dad_sent_bytes_per_step"] > 0 and h["dad_reduce_scatter_bytes_per_step"] > 0
                              for h in logged)


@pytest.mark.parametrize("entry", ["enable_dad", "enable_dad_fsdp", "DADCallback"])
def test_fsdp1_refused_with_reason(results, entry):
    """FSDP1 (a real FullyShardedDataParallel model; Accelerate's plugin at fsdp_version 1): each
    entry point raises, saying why and to use FSDP2."""
    for r in _case(results, "fsdp1"):
        assert r["fsdp_version"] == 1
        message = r[entry]
        assert message is not None, f"{entry} accepted an FSDP1 model"
        assert message.startswith(entry) and "FSDP1" in message and "FlatParameter" in message
        assert "fully_shard" in message and "fsdp_version: 2" in message
