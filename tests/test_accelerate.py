"""Accelerate and Transformers: real `accelerate launch` jobs with 2 CPU processes (gloo).

`enable_dad` against plain Accelerate DDP on the same data (also accumulating micro-steps with
``accelerator.accumulate``, with ``optimizer.zero_grad()`` between forward and backward, and under
bf16 mixed precision), DDP's own all-reduce gone from a
profiled step, `DADCallback` in `transformers.Trainer` against a plain Trainer run, and the
example script end to end. Checkpoints: ``save_state`` / ``load_state`` and Trainer resumption
carry dAD's per-rank state.
"""
import json

import pytest

from conftest import ROOT, WORKERS, check_resume, run_accelerate, run_torchrun
from dad_hook_site import hook_site, with_hook  # noqa: F401  (fixtures: the installed import hook)

TOL = 1e-5

FP32_CASES = {
    "grad-gpt2-exact": {"kind": "grad", "model": "gpt2", "config": {"mode": "exact"}},
    "grad-gpt2-exact-accumulate": {"kind": "grad", "model": "gpt2", "config": {"mode": "exact"}, "accumulate": 2},
    "grad-bert-exact-accumulate": {"kind": "grad", "model": "bert", "config": {"mode": "exact"}, "accumulate": 2},
    "grad-llama-auto": {"kind": "grad", "model": "llama", "config": {"mode": "auto"}},
    "train-gpt2-rank": {"kind": "grad", "model": "gpt2", "config": {"mode": "rank", "rank": 2}, "steps": 5},
    "replaced-gpt2": {"kind": "replaced", "model": "gpt2", "config": {"mode": "exact"}},
    # forward -> optimizer.zero_grad() -> accelerator.backward (PyTorch's ImageNet loop); under
    # accumulate() Accelerate zeroes on the synchronised micro-step only, dropping the earlier ones
    "grad-gpt2-exact-zero-after-forward": {"kind": "grad", "model": "gpt2", "config": {"mode": "exact"},
                                           "zero_after_forward": "none", "steps": 3},
    "grad-gpt2-auto-zero-after-forward-zeros": {"kind": "grad", "model": "gpt2", "config": {"mode": "auto"},
                                                "zero_after_forward": "zeros", "steps": 3, "batch": 1, "even": True},
    "grad-mlp-exact-zero-after-forward-accumulate": {"kind": "grad", "model": "mlp", "config": {"mode": "exact"},
                                                     "zero_after_forward": "zeros", "steps": 3, "accumulate": 2},
    "grad-gpt2-auto-zero-after-forward-accumulate": {"kind": "grad", "model": "gpt2", "config": {"mode": "auto"},
                                                     "zero_after_forward": "none", "steps": 3, "accumulate": 2,
                                                     "batch": 1, "even": True},
    "grad-gpt2-exact-zero-after-forward-accumulate-unverified": {  # no first-step check (dense fallback)
        "kind": "grad", "model": "gpt2", "config": {"mode": "exact", "verify_first_step": False},
        "zero_after_forward": "zeros", "steps": 3, "accumulate": 2},
}
BF16_CASES = {
    "grad-gpt2-exact-bf16": {"kind": "grad", "model": "gpt2", "config": {"mode": "exact"}, "accumulate": 2},
}


def _launch(tmp_path_factory, cases: dict, launch_args: tuple = ()) -> dict:
    work = tmp_path_factory.mktemp("accelerate")
    (work / "cases.json").write_text(json.dumps(cases))
    run_accelerate(WORKERS / "accelerate_worker.py", [work / "out.json", work / "cases.json"], launch_args)
    results = json.loads((work / "out.json").read_text())
    for case_id, per_rank in results.items():
        for rank, r in enumerate(per_rank):
            if "exception" in r:
                pytest.fail(f"{case_id} raised on rank {rank}:\n{r['exception']}")
    return results


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return _launch(tmp_path_factory, FP32_CASES)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return _launch(tmp_path_factory, BF16_CASES, ("--mixed_precision", "bf16"))


@pytest.mark.parametrize("case_id", [c for c in FP32_CASES if c.startswith("grad-")])
def test_enable_dad_gradients_equal_accelerate_ddp(fp32, case_id):
    """Every gradient at every optimizer step equals plain Accelerate DDP's; ranks end identical."""
    for rank, r in enumerate(fp32[case_id]):
        assert r["worst"] <= TOL, f"rank {rank}: relative error {r['worst']:.2e}"
        assert r["identical"], f"rank {rank}: parameters differ across ranks"


@pytest.mark.parametrize("case_id", [c for c in FP32_CASES if "zero-after-forward" in c])
def test_zero_after_forward_goes_through_factors(fp32, case_id):
    """The zero_grad-after-forward comparisons are not vacuous: weights went as exact factors, and
    none failed the first-step check (which would send it dense for good)."""
    for r in fp32[case_id]:
        assert "exact" in r["representations"], r["representations"]
        assert r["dense_only"] == [], r["dense_only"]


def test_accumulation_sends_both_micro_steps_once(fp32):
    """Over 2 micro-steps the exact factors of both go out in the one synchronised backward."""
    one = fp32["grad-gpt2-exact"][0]["sent"]
    two = fp32["grad-gpt2-exact-accumulate"][0]["sent"]
    assert 1.8 * one < two < 2.2 * one


def test_rank_dad_trains_with_fewer_bytes(fp32):
    for r in fp32["train-gpt2-rank"]:
        assert r["identical"]
        assert r["sent"] < 0.2 * r["allreduce"]


def test_ddp_allreduce_is_replaced_not_run_twice(fp32):
    """A profiled step of plain DDP all-reduces every gradient; with dAD, DDP all-reduces nothing."""
    for r in fp32["replaced-gpt2"]:
        assert r["ddp"] >= r["numel"]
        assert r["dad"] == 0


def test_bf16_mixed_precision(bf16):
    """Under bf16 autocast the factors are bf16: close to DDP's gradients, not bit-equal."""
    for r in bf16["grad-gpt2-exact-bf16"]:
        assert r["worst"] < 5e-2
        assert r["identical"]


def test_trainer_with_dad_callback(tmp_path):
    """Trainer + DADCallback (exact) ends where a plain Trainer ends; bytes are in its logs."""
    out = tmp_path / "trainer.json"
    run_accelerate(WORKERS / "trainer_worker.py", [out])
    for rank, r in enumerate(json.loads(out.read_text())):
        assert r["identical"], f"rank {rank}: parameters differ across ranks"
        assert r["moved"] > 0
        assert r["rel_diff"] < TOL, f"rank {rank}: {r['rel_diff']:.2e} from the plain Trainer"
        logged = [h for h in r["log_history"] if "loss" in h]
        assert logged and all(h["dad_sent_bytes_per_step"] > 0 and h["dad_allreduce_bytes_per_step"] > 0
                              for h in logged)


@pytest.mark.parametrize("stage,how", [(1, "json-only"), (3, "import")])
def test_trainer_on_deepspeed_takes_dad_from_the_config_block(tmp_path, monkeypatch, with_hook, stage, how):
    """Trainer + DeepSpeed ZeRO 1, and ZeRO-3 (Hugging Face's usual recipe for large models; each
    rank rebuilds its own partitions), with a "dad" block (exact) ends where DeepSpeed's own run
    ends. ZeRO 1: ``Trainer(args=TrainingArguments(deepspeed=config))`` and nothing else, no
    import, no callback (the installed import hook attaches dAD; its report shows dAD's bytes).
    ZeRO-3: ``import deepspeed_dad.auto`` and DADCallback, which finds the engine's dAD and logs
    its bytes (also against the reduce-scatter)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    out = tmp_path / "trainer_ds.json"
    run_torchrun(WORKERS / "trainer_worker.py", 2, [out, "deepspeed", stage, how])
    for rank, r in enumerate(json.loads(out.read_text())):
        assert r["identical"] and r["moved"] > 0
        assert r["dad_totals"] is not None, f"rank {rank}: no dAD on the Trainer's engine: the block was ignored"
        assert r["dad_totals"]["sent_bytes"] > 0
        assert r["rel_diff"] < TOL, f"rank {rank}: {r['rel_diff']:.2e} from DeepSpeed's own run"
        if how == "json-only":
            continue
        logged = [h for h in r["log_history"] if "loss" in h]
        assert logged and all(h["dad_sent_bytes_per_step"] > 0 for h in logged)
        if stage == 3:
            assert all(0 < h["dad_bytes_ratio_reduce_scatter"] for h in logged), logged


def test_example_on_deepspeed_through_accelerate(tmp_path, monkeypatch, with_hook):
    """accelerate launch with the DeepSpeed config: dAD from ds_config.json's "dad" block ("mode":
    "auto", which Accelerate's config walk must leave alone), the script importing nothing for it."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    proc = run_accelerate(ROOT / "examples" / "accelerate" / "finetune.py",
                          ["--max-steps", "3", "--batch-size", "4", "--seq-len", "32", "--output-dir", tmp_path],
                          config=ROOT / "examples" / "accelerate" / "deepspeed.yaml", exit_abort_reruns=1)
    assert "dAD replaces DeepSpeed's gradient all-reduce" in proc.stdout + proc.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    dad = metrics["runs"]["dad-auto"]
    assert metrics["world_size"] == 2 and dad["ranks_identical"]
    assert dad["sent_bytes_per_step"] < 0.2 * dad["allreduce_bytes"]


@pytest.mark.parametrize("family,mode", [("gpt2", "auto"), ("bert", "exact")])
def test_example_runs_end_to_end(tmp_path, family, mode):
    """examples/accelerate/finetune.py: summary table, metrics.json and the PNG plot."""
    proc = run_accelerate(ROOT / "examples" / "accelerate" / "finetune.py",
                          ["--family", family, "--dad-mode", mode, "--max-steps", "4", "--batch-size", "4",
                           "--seq-len", "32", "--output-dir", tmp_path])
    assert "ranks identical" in proc.stdout
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    # the lossy modes run PowerSGD at the same rank beside them, and dAD again routed by a slow link
    lossy = {"powersgd", f"dad-{mode}@100mbit"} if mode != "exact" else set()
    assert set(metrics["runs"]) == {"allreduce", f"dad-{mode}"} | lossy
    if mode != "exact":  # by time: on the stated slow link every weight is compressed
        slow = metrics["runs"][f"dad-{mode}@100mbit"]
        assert slow["link"] == "100mbit (stated)" and slow["routes"].split("/")[0] == slow["routes"].split("/")[1]
        assert metrics["runs"][f"dad-{mode}"]["link"] == "measured"
    for run in metrics["runs"].values():
        assert len(run["losses"]) == 4 and run["ranks_identical"]
    if mode != "exact":  # counted at torch.distributed: PowerSGD well below all-reduce after its first step
        runs = metrics["runs"]
        assert runs["powersgd"]["sent_bytes"][-1] < 0.5 * runs["allreduce"]["sent_bytes"][-1]
    assert (tmp_path / "loss_bytes.png").stat().st_size > 10_000


def test_single_process_is_a_noop_said_once(tmp_path):
    """Without several processes there is nothing to synchronise: None, and one log line."""
    import subprocess
    import sys
    script = (
        "import logging, torch\n"
        "from accelerate import Accelerator\n"
        "from dad_integrations.accelerate import enable_dad\n"
        "logging.basicConfig(level=logging.INFO, format='%(name)s: %(message)s')\n"
        "acc = Accelerator(cpu=True)\n"
        "model = acc.prepare(torch.nn.Linear(2, 2))\n"
        "assert enable_dad(acc, model, {'mode': 'exact'}) is None\n"
        "assert enable_dad(acc, model) is None\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("a single process has nothing to synchronise") == 1


def test_save_state_carries_dad_state(tmp_path):
    """accelerator.save_state / load_state with dAD (rank-dAD, error feedback): a resumed run ends
    where the straight one ends; every process writes and reads its own state file."""
    proc = run_accelerate(WORKERS / "resume_worker.py", ["accelerate", tmp_path / "out.json", tmp_path])
    check_resume(json.loads((tmp_path / "out.json").read_text()), ["dad_state_rank0.pt", "dad_state_rank1.pt"])
    assert "holds no dAD state" in proc.stderr  # the copy without dAD's files loads, with a note


def test_trainer_resume_carries_dad_state(tmp_path):
    """Trainer + DADCallback: checkpoint-3 holds every rank's dAD state, and
    train(resume_from_checkpoint=...) (from another output_dir) loads it before the first step."""
    run_accelerate(WORKERS / "resume_worker.py", ["trainer", tmp_path / "out.json", tmp_path])
    check_resume(json.loads((tmp_path / "out.json").read_text()), ["dad_state_rank0.pt", "dad_state_rank1.pt"])


@pytest.mark.parametrize("engine", ["trainer-deepspeed", "trainer-deepspeed-zero3"])
def test_trainer_on_deepspeed_resume_carries_dad_state(tmp_path, monkeypatch, engine):
    """Trainer + DeepSpeed ZeRO 1 and ZeRO-3, rank-dAD attached by DADCallback (no "dad" block,
    deepspeed_dad never imported by the script: found through the entry point): the engine's
    checkpoint carries dAD's state in its tag folder, and the callback loads it on resume."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    run_torchrun(WORKERS / "resume_worker.py", 2, [engine, tmp_path / "out.json", tmp_path])
    check_resume(json.loads((tmp_path / "out.json").read_text()),
                 ["global_step3/dad_state_rank0.pt", "global_step3/dad_state_rank1.pt"])


def test_plain_accelerator_on_cpu_launch_raises_in_enable_dad(tmp_path):
    """cpu_2proc.yaml starts two processes, but a plain ``Accelerator()`` on CPUs runs each alone
    (DistributedType.NO): enable_dad raises, naming the fix, instead of returning None."""
    script = tmp_path / "plain_accelerator.py"
    script.write_text(
        "import torch\n"
        "from accelerate import Accelerator\n"
        "from dad_integrations.accelerate import enable_dad\n"
        "acc = Accelerator()\n"
        "model = acc.prepare(torch.nn.Linear(2, 2))\n"
        "try:\n"
        "    print('RETURNED', enable_dad(acc, model, {'mode': 'exact'}), acc.distributed_type, flush=True)\n"
        "except ValueError as e:\n"
        "    print('RAISED', e, flush=True)\n")
    proc = run_accelerate(script, [])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("RAISED", "RETURNED"))]
    assert len(lines) == 2, proc.stdout[-3000:]
    for line in lines:
        assert line.startswith("RAISED"), line
        assert "started 2 processes" in line and "ACCELERATE_USE_CPU=1" in line and "cpu=True" in line


# test_sync's functions that fail with plain DDP too on this model (see docs/guides/accelerate.md)
TEST_SYNC_EXCLUDED = [f"gradient_accumulation_with_opt_and_scheduler[split=True,dispatch={d},sync_each_batch={e}]"
                      for d in (True, False) for e in (True, False)]


def test_accelerates_own_test_sync_with_dad(tmp_path, monkeypatch):
    """Accelerate's shipped test_sync.py (no_sync, trigger_sync_in_backward, accumulate with
    split_batches / dispatch_batches / sync_each_batch, with optimizer and scheduler) passes with
    enable_dad after prepare on a model of Linear layers, on the CPU path (MULTI_CPU); every weight
    went as exact factors."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")  # what a plain Accelerator() needs on CPUs
    monkeypatch.setenv("DAD_TEST_SYNC_SKIP", ";".join(TEST_SYNC_EXCLUDED))
    out = tmp_path / "test_sync.json"
    run_accelerate(WORKERS / "accelerate_test_sync_worker.py", [out])
    results = json.loads(out.read_text())
    assert results.pop("distributed_type") == "DistributedType.MULTI_CPU" and results.pop("num_processes") == 2
    assert len(results) == 19 - len(TEST_SYNC_EXCLUDED), sorted(results)
    for name, per_rank in results.items():
        for rank, r in enumerate(per_rank):
            assert r["passed"], f"{name} on rank {rank}: {r.get('assertion') or r.get('exception')}"
            if name != "dataloader_break":  # the one without a model
                assert r["syncs"] >= 1 and r["representations"] == ["exact"] and r["sent"] > 0, (name, r)
