"""FSDP2 HSDP through Accelerate and the Trainer across two simulated nodes: one ``accelerate launch``
per node (2 nodes x 2 CPU processes) with `examples/accelerate/hsdp_multi_node_cpu.yaml`, the
example's own config.

Its ``parallelism_config`` (``dp_replicate_size`` 2, ``dp_shard_size`` 2) makes Accelerate shard the
model on the mesh ``("dp_replicate", "dp_shard_cp")``: FSDP2 reduce-scatters inside the node and
`enable_dad` / `DADCallback` find the 2-D mesh and take the all-reduce between nodes
(`exchange.replicate_hop`). `workers/fsdp_on_cpu.py` lets Accelerate take its FSDP path on CPU
processes. The worker (`workers/hsdp_accelerate_worker.py`) runs every case in the one launch; the
tests read its results. Skipped, with the reason, where namespaces cannot be made (not root).
"""
from __future__ import annotations

import json
import os

import pytest
import yaml

from benchmarks.sim_cluster import SimCluster, probe
from conftest import ROOT, WORKERS

TOL = 1e-5  # fp32 round-off, relative per parameter (floored at 1e-6 of the whole gradient's norm)
CONFIG = ROOT / "examples" / "accelerate" / "hsdp_multi_node_cpu.yaml"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Every case's per-rank results (a case that raised fails the tests that read it)."""
    ok, reason = probe()
    if not ok:
        pytest.skip(f"no simulated cluster here: {reason}")
    config = yaml.safe_load(CONFIG.read_text())
    assert config["distributed_type"] == "FSDP" and config["fsdp_config"]["fsdp_version"] == 2
    assert config["parallelism_config"] == {"parallelism_config_dp_replicate_size": 2,
                                            "parallelism_config_dp_shard_size": 2}
    work = tmp_path_factory.mktemp("hsdp_accelerate")
    with SimCluster(nodes=2) as cluster:
        cluster.accelerate(WORKERS / "hsdp_accelerate_worker.py", [work / "out.json", work], local_size=2,
                           config_file=CONFIG, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"), timeout=300)
    return json.loads((work / "out.json").read_text())


def _case(results: dict, cid: str) -> list:
    per_rank = results[cid]
    for rank, r in enumerate(per_rank):
        if "exception" in r:
            pytest.fail(f"{cid} raised on rank {rank}:\n{r['exception']}")
    return per_rank


def test_enable_dad_takes_accelerates_replicate_hop(results):
    """enable_dad (exact) on the model Accelerate sharded with HSDP: every sharded gradient equals
    HSDP's own, both runs end with each shard equal to its replica on the other node, and the report
    puts every parameter on the replicate hop with bytes between nodes."""
    for rank, r in enumerate(_case(results, "accelerate")):
        assert r["mesh"] == ["dp_replicate", "dp_shard"] and r["shape"] == [2, 2], r
        assert r["hsdp"], "dAD did not find Accelerate's 2-D mesh"
        assert r["worst"][1] <= TOL, (rank, r["worst"])
        assert r["param_diff"] <= TOL, (rank, r["param_diff"])
        assert r["replicas"] == [True, True], (rank, r["replicas"])
        assert r["levels"] == ["replicate"], r["levels"]
        assert all(b > 0 for b in r["inter_bytes"]) and all(b > 0 for b in r["replicate_bytes"]), r


def test_save_state_restores_rank_routes_under_hsdp(results):
    """With rank routes, save_state writes each rank's dAD file beside Accelerate's FSDP2 checkpoint
    and load_state restores the residuals (they had moved on by a step) and the parameters."""
    per_rank = _case(results, "checkpoint")
    files = per_rank[0]["files"]
    assert "pytorch_model_fsdp_0" in files, files
    assert [f for f in files if f.startswith("dad_state")] == [f"dad_state_rank{r}.pt" for r in range(4)], files
    for rank, r in enumerate(per_rank):
        assert {"rank", "rank_allreduce"} & set(r["routes"]), r["routes"]
        assert r["residuals"] > 0 and r["same_keys"], r
        assert r["moved"] > 0, "the extra step left the residuals unchanged: the check would prove nothing"
        assert r["residual_diff"] == 0.0 and r["param_diff"] == 0.0, (rank, r)


def test_trainer_with_dad_callback_on_hsdp(results):
    """The Trainer with FSDP2 and ParallelismConfig(dp_replicate_size=2, dp_shard_size=2), plain and with
    DADCallback (exact), ends at the same parameters; the callback took the replicate hop."""
    for rank, r in enumerate(_case(results, "trainer")):
        assert r["mesh"] == ["dp_replicate", "dp_shard"] and r["hsdp"], r
        assert r["levels"] == ["replicate"] and r["inter_bytes"] > 0, r
        assert r["moved"] > 0, "training did not move the parameters"
        assert r["rel_diff"] <= TOL, f"rank {rank}: {r['rel_diff']:.2e} from the plain Trainer"
