"""PyTorch's own DDP test cases with dAD's communication hook in place of DDP's reduction.

One torchrun job (2 ranks, gloo) runs every case of `workers/ddp_engine_worker.py`: PyTorch's
``torch.testing._internal.distributed.distributed_test`` methods as shipped, where they run on
CPU, ports of those that need CUDA, and comparisons with DDP's own all-reduce every step.
"""
from __future__ import annotations

import json

import pytest

from conftest import WORKERS, result, run_torchrun

TOL = 1e-5  # fp32 round-off, relative, floored at 1e-6 of the whole gradient's norm

PYTORCH_CASES = ["accumulate_gradients_no_sync", "accumulate_gradients_no_sync_grad_is_view",
                 "DistributedDataParallelCPU", "DistributedDataParallelCPU_grad_is_view",
                 "DistributedDataParallel_save_load_on_cpu", "DistributedDataParallel_save_load_on_cpu_grad_is_view",
                 "ddp_create_graph", "ddp_grad_div_uneven_inputs", "ddp_uneven_input_join_disable",
                 "ddp_uneven_input_exception", "ddp_uneven_inputs"]
# the ports of _test_DistributedDataParallel load the model before training (trains 3 steps) and
# after its third step (trains on to step 5, from the saved dAD state's step count)
REATTACHED_STEPS = {"DistributedDataParallel_save_load_on_cpu": [3, 5],
                    "DistributedDataParallel_save_load_on_cpu_grad_is_view": [3, 5]}
ACCUMULATE_CASES = ["accumulate_vs_allreduce_hook_net", "accumulate_vs_allreduce_hook_net_grad_is_view",
                    "accumulate_vs_allreduce_hook_mlp", "accumulate_vs_allreduce_hook_mlp_grad_is_view",
                    "accumulate_vs_allreduce_hook_mlp_grad_is_view_zero_between"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    try:
        import expecttest  # noqa: F401  (PyTorch's test code imports it)
    except ImportError:
        pytest.fail("PyTorch's distributed test code needs expecttest, in the 'test' extras: "
                    "pip install -e '.[test]' (scripts/setup_env.sh does)")
    out = tmp_path_factory.mktemp("ddp_engine") / "out.json"
    run_torchrun(WORKERS / "ddp_engine_worker.py", 2, [out], timeout=600)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", PYTORCH_CASES)
def test_pytorch_ddp_case_passes_with_dad_hook(results, case):
    """PyTorch's test method, run as shipped with every DDP it builds on dAD's hook, passes on
    every rank (its own assertions: gradients and parameters against one process's, to
    ``assertEqual``'s fp32 tolerance)."""
    for r in result(results, case):
        assert r["ok"]
        # a loaded model's hook is dAD's again: it ran every step since the load, through factors
        assert [d["steps"] for d in r["reattached"]] == REATTACHED_STEPS.get(case, []), r["reattached"]
        assert all(d["routes"] == ["exact"] for d in r["reattached"]), r["reattached"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["save_load_exact", "save_load_exact_grad_is_view", "save_load_rank_error_feedback"])
def test_saved_ddp_model_trains_on_with_dad(results, case):
    """``torch.save(ddp)`` / ``torch.load`` of a DDP model with the dAD hook after 2 steps; then
    the original, the loaded copy and a plain DDP train 3 more steps on the same data. The loaded
    copy's hook is attached again (the detached capture hooks that came with it are removed): its
    parameters and dAD state stay bit-identical to the original's (rank mode: warm starts and
    error-feedback residuals came with it), and in exact mode its gradients equal DDP's."""
    for rank, r in enumerate(result(results, case)):
        assert r["steps"] == r["original_steps"] == 5
        assert r["params_diff_vs_original"] == [0.0] * 3, f"rank {rank}: {r['params_diff_vs_original']}"
        assert r["state_diff_vs_original"] == 0.0
        assert r["hooks_per_module"] == 1  # the new capture's forward hook only
        assert r["params_equal_across_ranks"]
        if case.startswith("save_load_exact"):
            assert max(r["worst_vs_ddp"]) <= TOL, f"rank {rank}: {r['worst_vs_ddp']}"
            assert "exact" in r["routes"]
        else:
            assert r["saved_state_norm"] > 0, "no dAD state to carry: the test would be vacuous"
            assert "rank_allreduce" in r["routes"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ACCUMULATE_CASES)
def test_no_sync_accumulation_equals_allreduce_hook(results, case):
    """`_test_accumulate_gradients_no_sync`'s loop (grads never zeroed, a ``no_grad`` forward in
    ``no_sync`` first, then no_sync and synchronised backwards in turn, 6 iterations) with and
    without ``gradient_as_bucket_view``: every gradient equals that of the same DDP with PyTorch's
    ``allreduce_hook`` on every step, and synchronised gradients are bit-identical across ranks."""
    for rank, r in enumerate(result(results, case)):
        worst = r["worst_per_iter"]
        assert len(worst) == 6
        assert max(worst) <= TOL, f"rank {rank}: relative errors per iteration {worst}"
        assert all(r["synced_grads_equal_across_ranks"]), r["synced_grads_equal_across_ranks"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["join_vs_ddp", "join_vs_ddp_divide_by_ranks_training", "join_vs_ddp_no_sync"])
def test_join_equals_ddp_reduction(results, case):
    """``ddp.join()`` with uneven inputs (rank 0: 2 steps, rank 1: 5), gradients never zeroed,
    ``no_sync`` every other step in one case: every step's gradients on each rank equal those of
    DDP's own reduction (joined ranks add nothing, whatever their ``.grad`` holds; divided by the
    initial world size, or by the ranks still training), and so do the final parameters."""
    per_rank = result(results, case)
    for rank, r in enumerate(per_rank):
        assert len(r["worst_per_step"]) == (2 if rank == 0 else 5)
        assert max(r["worst_per_step"]) <= TOL, f"rank {rank}: {r['worst_per_step']}"
        assert r["final_params_max_abs_diff"] <= 1e-6
        assert r["params_equal_across_ranks"]


@pytest.mark.slow
def test_model_wrapped_in_a_new_ddp_closes_the_old_hook(results):
    """One model wrapped in a DDP with the dAD hook, then in a new one (as PyTorch's tests do case
    after case): the old hook's synchroniser is closed (its DDP raises if used: no rows captured
    for nobody), one capture hook per module is left, and the new DDP's gradients equal DDP's."""
    for r in result(results, "rewrap"):
        assert r["first_closed"]
        assert r["hooks_per_module"] == 1
        assert max(r["worst"]) <= TOL, r["worst"]
        assert "used after close()" in r["old_hook_error"]


def test_serialised_exchange_with_find_unused_parameters(tmp_path):
    """The NCCL ordering mode (dAD's exchange inline in DDP's last bucket hook, so it is enqueued
    before DDP's used-parameter map all-reduce on every rank), forced on gloo: gradients equal DDP's
    with ``find_unused_parameters=True`` and a layer used every other step; ranks identical."""
    import json

    from conftest import WORKERS, run_torchrun
    out = tmp_path / "out.json"
    run_torchrun(WORKERS / "ddp_serial_worker.py", 2, [out])
    ranks = json.loads(out.read_text())["ranks"]
    assert all(r["worst"] < 1e-5 and r["reports"] for r in ranks), ranks
    assert ranks[0]["digest"] == ranks[1]["digest"]
