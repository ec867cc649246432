"""Horovod's own optimizer tests (v0.28.1 test/parallel/test_torch.py) with horovod_dad.DADOptimizer
(mode exact, no ``model=``) in place of hvd.DistributedOptimizer, in one `horovodrun --gloo` job of
two ranks (tests/workers/horovod_port_worker.py); plus the resume recipe around
``hvd.broadcast_optimizer_state`` and a model used before its optimizer was built.

Each ported test keeps Horovod's name and checks; most add a twin run with hvd.DistributedOptimizer
whose parameters and gradients the dAD run must match to fp32 round-off.
"""
from __future__ import annotations

import json

import pytest

from conftest import WORKERS, result
from test_horovod import TOL, _horovodrun

# Horovod's tests that run here, by name (their adaptations are in each one's docstring)
PORTED = ["test_broadcast_state", "test_broadcast_state_options", "test_broadcast_state_no_grad",
          "test_force_allreduce", "test_model_parallelism", "test_duplicate_names",
          "test_missing_named_parameters", "test_no_named_parameters", "test_optimizer_no_named_parameters",
          "test_dynamic_requires_grad", "test_gradient_clipping", "test_synchronize_step_warning",
          "test_sparse_embeddings", "test_optimizer_process_sets"]
# how many parameter comparisons with the Horovod twin each one makes (a vacuous twin fails)
TWINS = {"test_model_parallelism": 1, "test_no_named_parameters": 1,
         "test_optimizer_no_named_parameters": 1, "test_dynamic_requires_grad": 12, "test_sparse_embeddings": 1,
         "forward_before_build": 3, "two_optimizers_one_model": 3}


@pytest.fixture(scope="module")
def port(tmp_path_factory):
    work = tmp_path_factory.mktemp("hvdport")
    out = work / "out.json"
    _horovodrun(2, [WORKERS / "horovod_port_worker.py", out, work], out, timeout=600)
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", PORTED)
def test_horovods_optimizer_tests_pass(port, name):
    """Horovod's checks hold on every rank; where a twin ran, parameters and gradients equal
    hvd.DistributedOptimizer's (relative 1e-5, floored at 1e-6 of the whole model's norm)."""
    for r in result(port, name):
        assert r["failures"] == [], r["failures"][:5]
        # test_force_allreduce: one twin per optimizer and option set (22 with torch 2.13)
        twins = 2 * len(r["ran"]) if name == "test_force_allreduce" else TWINS.get(name, 0)
        assert r["compared"] == twins
        assert r["worst"] <= TOL


def test_every_torch_optimizer_is_covered(port):
    """test_broadcast_state and test_force_allreduce go through every torch.optim optimizer but
    L-BFGS and SparseAdam (Horovod's list); Muon, which takes 2-D parameters only, is left out
    because plain torch cannot step these models with it either."""
    for name in ("test_broadcast_state", "test_force_allreduce"):
        ran = result(port, name)[0]["ran"]
        assert {"Adadelta", "Adagrad", "Adam", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop",
                "SGD"} <= set(ran), ran
    assert result(port, "test_broadcast_state")[0]["skipped"] == ["Muon"]


def test_delta_optimizer_adasum_is_refused(port):
    """test_delta_optimizer uses op=hvd.Adasum (and needs MPI and GPUs): dAD cannot express
    Adasum, so DADOptimizer raises ValueError at construction, on every rank."""
    for r in result(port, "test_delta_optimizer"):
        assert r["error"].startswith("op=hvd.Adasum is not supported with dAD")


def test_sparse_without_sparse_as_dense_is_refused(port):
    """test_sparse_embeddings with sparse_as_dense=False: Horovod all-gathers sparse gradients,
    dAD refuses them with a ValueError at the first forward (where it meets the model)."""
    for r in result(port, "test_sparse_embeddings"):
        assert r["errors"]["False"].startswith("modules ['embedding'] produce sparse gradients")
        assert "True" not in r["errors"]


def test_broadcast_optimizer_state_resume_matches_uninterrupted_run(port):
    """Horovod's resume recipe: rank 0 loads a checkpoint into a fresh model and DADOptimizer,
    broadcast_parameters and broadcast_optimizer_state (rank 1's empty state is stepped locally, as
    Horovod does for its own optimizer; before, rank 1 waited in dAD's exchange for ever); the
    remaining steps end where the uninterrupted run ends, on every rank."""
    for r in result(port, "resume_broadcast"):
        assert r["rel"] <= 1e-6 and r["identical"] and r["attached"]
        assert r["state_steps"] == [3.0] * 7  # after the broadcast: rank 0's Adam step counts on every rank (not 1)


def test_model_used_before_the_optimizer_was_built(port):
    """A forward before DADOptimizer was built, its backward after: that step all-reduces as
    Horovod does; dAD attaches at the next forward; every step equals Horovod's (AdamW, two param
    groups, per-rank batches)."""
    for r in result(port, "forward_before_build"):
        assert r["attached"] == [False, True, True]
        assert "exact" in r["representations"]
        assert r["failures"] == [] and r["worst"] <= TOL


def test_two_optimizers_over_one_model_each_exchange_their_own(port):
    """Two DADOptimizers over disjoint parts of one model, no model=: both find it; each one's
    synchroniser covers only its optimizer's weights (before, each exchanged every weight of the
    model, twice the bytes), and three steps equal Horovod's two optimizers'."""
    for r in result(port, "two_optimizers_one_model"):
        assert r["units"] == [["hidden.weight", "inp.weight"], ["out.weight"]]
        assert r["failures"] == [] and r["compared"] == TWINS["two_optimizers_one_model"] and r["worst"] <= TOL
