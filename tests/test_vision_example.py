"""examples/accelerate/finetune_vision.py end to end: a small CNN on scikit-learn's digits under
`accelerate launch` (2 CPU processes, gloo, a few steps), against all-reduce and PowerSGD.

The conftest pins ``DAD_OBJECTIVE=bytes``, which the example takes as its default objective: auto
then never sends more than PowerSGD at the same rank, weight by weight. Its convolutions are
units either way: a layer kind's (factors) or, where none captures them, PowerSGD's floor (their
dense gradients take the rank routes); the assertions hold for both.
"""
import json

import pytest

from conftest import ROOT, run_accelerate

pytest.importorskip("sklearn")

STEPS = 4


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    out = tmp_path_factory.mktemp("vision")
    proc = run_accelerate(ROOT / "examples" / "accelerate" / "finetune_vision.py",
                          ["--arch", "cnn", "--max-steps", STEPS, "--batch-size", 16, "--output-dir", out])
    return proc, json.loads((out / "metrics.json").read_text())


def test_prints_the_table_with_heldout_loss_and_accuracy(cnn):
    proc, metrics = cnn
    header = next(line for line in proc.stdout.splitlines() if line.startswith("run "))
    for column in ("held-out loss", "held-out acc", "bytes sent/step/rank", "steady bytes/step", "vs all-reduce",
                   "ranks identical"):
        assert column in header
    rows = [line.split("|")[0].strip() for line in proc.stdout.splitlines() if "|" in line][1:]
    assert rows == ["allreduce", "powersgd", "dad-auto"]  # objective bytes: no slow-link run
    assert metrics["world_size"] == 2 and metrics["args"]["objective"] == "bytes"
    for name, run in metrics["runs"].items():
        assert len(run["losses"]) == STEPS and run["ranks_identical"], name
        assert 0.0 <= run["heldout_accuracy"] <= 1.0 and run["heldout_loss"] > 0, name


def test_dad_auto_sends_at_most_powersgds_steady_bytes(cnn):
    """In steady state (PowerSGD's hook compresses from step 2, dAD's first step checks its
    factors) dAD auto sends at most PowerSGD's bytes at rank 4, far below all-reduce; every
    weight, the convolutions included, is sent compressed."""
    _, metrics = cnn
    runs = metrics["runs"]
    dad, psgd, allreduce = runs["dad-auto"], runs["powersgd"], runs["allreduce"]
    assert dad["steady_sent_bytes_per_step"] <= psgd["steady_sent_bytes_per_step"]
    assert dad["sent_bytes"][-1] <= psgd["sent_bytes"][-1]
    assert dad["steady_sent_bytes_per_step"] < 0.2 * allreduce["steady_sent_bytes_per_step"]
    convs = [name for name in dad["kinds"] if name.startswith("features.")]
    assert len(convs) == 3 and all(dad["kinds"][name] != "dense" for name in convs), dad["kinds"]
