"""Quick checks of the benchmarks: ATOMO's estimator, the scale table's bytes against the
synchroniser's own accounting on 2 real ranks, and the smallest compare.py run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.atomo import atomo_probabilities, atomo_sample

ROOT = Path(__file__).resolve().parents[1]


def test_atomo_probabilities_minimise_variance_under_budget():
    sigma = torch.tensor([10.0, 1.0, 0.5, 0.25, 0.0])
    p = atomo_probabilities(sigma, 2)
    assert float(p.sum()) == pytest.approx(2.0)
    assert float(p[0]) == 1.0 and float(p[4]) == 0.0          # the dominant atom is capped at 1
    rest = p[1:4] / sigma[1:4]
    assert torch.allclose(rest, rest[0].expand(3))            # the others in proportion to sigma
    assert torch.equal(atomo_probabilities(sigma, 4), torch.tensor([1.0, 1, 1, 1, 0]))
    flat = atomo_probabilities(torch.ones(6), 3)
    assert torch.allclose(flat, torch.full((6,), 0.5))


def test_atomo_estimate_is_unbiased():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(12, 6, generator=g, dtype=torch.float64) @ torch.randn(6, 9, generator=g, dtype=torch.float64)
    total = torch.zeros_like(m)
    draws = 4000
    kept = 0
    for _ in range(draws):
        left, right = atomo_sample(m, 2, g)
        kept += left.shape[0]
        total += left.t() @ right
    mean = total / draws
    assert kept / draws == pytest.approx(2.0, abs=0.1)          # the budget is met on average
    assert float((mean - m).norm() / m.norm()) < 0.05           # and the estimate is unbiased


def test_scale_table_bytes_match_last_step_report():
    """The analytic bytes equal what `last_step_report()` accounts on 2 real ranks (tiny GPT-2 and
    BERT; exact, rank, auto with and without rank), and the full-size table is consistent."""
    from benchmarks import scale_table

    checks = scale_table.check()
    bad = [c for c in checks if not c["match"]]
    assert not bad, bad
    rows = scale_table.table(4, geometries=("gpt2-small",), shapes=((1, 128), (8, 512)), sites=(2, 256))
    by = {(r["batch"], r["seq"], r["sites"]): r for r in rows}
    small, big = by[(1, 128, 2)], by[(8, 512, 2)]
    assert small["dad-exact"] < small["allreduce"] < big["dad-exact"]   # dAD wins with few rows only
    assert big["dad-rank"] < big["allreduce"] / 20
    # beyond two sites the rank route all-reduces P and Q: flat in the sites (2 (S-1)/S), not (S-1)
    assert big["dad-rank"] < by[(8, 512, 256)]["dad-rank"] < 2.1 * big["dad-rank"]
    for r in rows:
        assert r["auto-lossless"] <= min(r["allreduce"], r["dad-exact"])
        assert r["dad-auto"] <= r["allreduce"]
        assert r["dad-auto"] <= r["powersgd"]  # same rank, position embeddings included


def test_compare_smallest_run_writes_every_key(tmp_path):
    out = tmp_path / "c.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.compare", "--smoke", "--nets", "loopback",
                           "--json", str(out), "--out", str(tmp_path), "--no-plots"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = json.loads(out.read_text())
    from benchmarks.compare import KEYS
    from benchmarks._ranks import METHODS

    assert [r["method"] for r in records] == list(METHODS)
    by = {r["method"]: r for r in records}
    for r in records:
        assert set(KEYS) <= set(r), r
        assert r["step_s_1gbit"] is None and r["step_s_100mbit"] is None  # not requested
        assert r["step_s_loopback"] > 0 and r["step_s_local"] > 0 and r["final_loss"] > 0
        assert r["bytes_per_step"] > 0
    assert by["fp16"]["bytes_per_step"] == pytest.approx(by["allreduce"]["bytes_per_step"] / 2)
    assert by["dad-rank"]["bytes_per_step"] < by["allreduce"]["bytes_per_step"]
    # dAD's own report agrees with what reached torch.distributed
    for m in ("dad-exact", "dad-rank", "dad-auto"):
        assert by[m]["bytes_per_step"] == pytest.approx(by[m]["bytes_counted_per_step"], rel=1e-9)
    assert by["dad-exact"]["final_loss"] == pytest.approx(by["allreduce"]["final_loss"], rel=1e-4)
    assert "skipped" in (tmp_path / "compare.md").read_text()


def test_convergence_smoke_writes_every_method(tmp_path):
    """`python -m benchmarks.convergence --smoke` at 2 ranks, the MLP and the tiny GPT-2 with SGD:
    every method (a PowerSGD variant with a longer warm-up among them) has a finite metric and
    sends bytes, dAD's own report matches the counter at torch.distributed, the table and both
    plots are written; the held-out loss at --report-steps is in the summary and its table, and
    --merge of two runs' JSON re-summarises their records together."""
    import math

    from benchmarks.convergence import DEFAULT_METHODS, main

    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.convergence", "--smoke", "--ranks", "2",
                           "--workloads", "mlp-adam,gpt2-sgd", "--report-steps", "4,6", "--gpt2-eval-every", "2",
                           "--powersgd-variant", 'powersgd-w4={"start_powerSGD_iter": 4}',
                           "--mlp-steps", "6", "--out", str(tmp_path), "--no-progress"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    data = json.loads((tmp_path / "convergence.json").read_text())
    records = data["records"]
    methods = sorted(DEFAULT_METHODS + ("powersgd-w4",))
    for workload in ("mlp-adam", "gpt2-sgd"):
        assert sorted(r["method"] for r in records if r["workload"] == workload) == methods
    assert {r["optimizer"] for r in records if r["workload"] == "gpt2-sgd"} == {"sgd"}
    for r in records:
        assert r["world_size"] == 2
        assert math.isfinite(r["metric"]) and 0 <= r["metric"] <= 100, r
        assert all(math.isfinite(x) for x in r["train_loss"] + r["eval_loss"])
        assert r["bytes_per_step"] > 0 and all(b > 0 for b in r["bytes_by_step"])
        assert len(r["cum_bytes"]) == len(r["train_loss"]) == r["steps"]
        assert r["rank_divergence"] < 1e-6  # every rank holds the same model
        if r["method"].startswith("dad-"):
            assert r["bytes_by_step"] == pytest.approx(r["bytes_report_by_step"], rel=1e-9)
    by = {r["method"]: r for r in records if r["workload"] == "mlp-adam"}
    assert by["powersgd"]["bytes_per_step"] < by["allreduce"]["bytes_per_step"] / 10
    # the variant all-reduces its first 4 steps (PowerSGD's own warm-up), then compresses
    ps4, ar = by["powersgd-w4"], by["allreduce"]
    assert ps4["config"]["start_powerSGD_iter"] == 4 and by["powersgd"]["config"]["start_powerSGD_iter"] == 2
    assert ps4["bytes_by_step"][:4] == pytest.approx(ar["bytes_by_step"][:4], rel=0.01)
    assert ps4["bytes_by_step"][4] == pytest.approx(by["powersgd"]["bytes_by_step"][4], rel=1e-9)
    assert {t["target"] for t in data["targets"]}  # the targets were checked
    for row in data["summary"]:
        rec = next(r for r in records if (r["workload"], r["method"]) == (row["workload"], row["method"]))
        assert row["eval_loss_at"]["6"]["mean"] == pytest.approx(rec["eval_loss"][rec["eval_steps"].index(6)])
        assert row["cum_bytes_at"]["4"] == pytest.approx(rec["cum_bytes"][3])
    md = (tmp_path / "convergence.md").read_text()
    assert "mlp-adam, 2 ranks" in md and "x PowerSGD" in md and "SGD (momentum 0.9)" in md
    assert "gpt2-sgd, 2 ranks: held-out loss at steps 4, 6" in md and "x powersgd @6" in md
    for name in ("convergence_loss.png", "convergence_bytes.png"):
        assert (tmp_path / name).stat().st_size > 0
    # --merge: the records of two files (here the same one twice: every seed counted twice) together
    merged = tmp_path / "merged"
    assert main(["--merge", f"{tmp_path / 'convergence.json'},{tmp_path / 'convergence.json'}", "--report-steps",
                 "6", "--loss-reference", "powersgd-w4", "--stem", "m", "--out", str(merged), "--no-plots"]) == 0
    rows = json.loads((merged / "m.json").read_text())["summary"]
    assert all(r["n_seeds"] == 2 and list(r["eval_loss_at"]) == ["6"] for r in rows)
    assert "x powersgd-w4 @6" in (merged / "m.md").read_text()


def test_allocation_peak_sees_a_step_of_known_size():
    """`AllocationPeak`, the sharded memory benchmark's meter: two live 4 MB tensors peak at 8 MB
    above the start, and freeing one of them leaves 4 MB net."""
    from benchmarks.sharded_memory import AllocationPeak

    with AllocationPeak() as mem:
        a = torch.ones(1 << 20)
        b = a * 2
        del a
    assert mem.peak >= 8 << 20 and mem.peak < 9 << 20, mem.peak
    assert mem.net == 4 << 20 and float(b[0]) == 2.0


def test_sharded_memory_smoke_writes_every_method(tmp_path):
    """`python -m benchmarks.sharded_memory --preset smoke --methods dad-exact,dad-rank4,dad-rank4-ef-rank16`:
    FSDP2, ZeRO-2 and ZeRO-3, each alone and with dAD inside it, on 2 ranks: a row per engine and
    method with a peak, dAD's rows with bytes sent, rank-dAD's state with its residuals counted
    (whole, or kept at rank 16: less, and more than the warm starts alone)."""
    from benchmarks.sharded_memory import ENGINES

    methods = ["engine", "dad-exact", "dad-rank4", "dad-rank4-ef-rank16"]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.sharded_memory", "--preset", "smoke",
                           "--methods", ",".join(methods[1:]), "--out-dir", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = json.loads((tmp_path / "sharded_memory.json").read_text())["rows"]
    assert sorted((r["engine"], r["method"]) for r in rows) == sorted((e, m) for e in ENGINES for m in methods)
    for r in rows:
        assert r["step_peak_bytes"] > 0 and r["state_bytes"] > 0 and r["ratio"] > 0
        assert (r["sent_bytes"] is None) == (r["method"] == "engine")
    state = {(r["engine"], r["method"]): r["state_bytes"] for r in rows}
    for engine in ENGINES:  # error feedback's residuals: one unsharded gradient per rank-routed weight
        assert state[engine, "dad-rank4"] > state[engine, "dad-rank4-ef-rank16"] > state[engine, "engine"]
        assert state[engine, "engine"] == state[engine, "dad-exact"]
    assert "vs engine" in (tmp_path / "sharded_memory.md").read_text()


def test_gpu_check_runs_on_cpu_and_skips_without_cuda(tmp_path):
    """benchmarks.gpu_check: its CPU form runs every part but NCCL (fp32 rebuild exact, bf16 reported,
    the compute model per layer); without CUDA the default form skips and exits 0."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--tiny", "--batch", "2",
                           "--seq", "16", "--reps", "1", "--json", str(out)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    fp32, bf16 = result["exactness"]
    assert fp32["max_rel_err"] < 1e-5 and bf16["max_rel_err"] < 5e-2 and fp32["weights"] > 0
    assert len(result["layer_overhead"]["layers"]) == fp32["weights"]
    assert result["nccl_ordering"] == {"skipped": "not on CUDA"} and result["failures"] == []
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check"], env=env, cwd=root,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "skipped" in proc.stdout


def test_robustness_smoke_writes_every_key(tmp_path):
    """`python -m benchmarks.robustness --smoke`: one run on loopback (in a network namespace where
    `unshare -rn` works here) with the bursty CPU hog on; the JSON and the table have their
    structure (auto's choice, its trials and representations, the two references), not timings."""
    from benchmarks.robustness import METHODS

    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.robustness", "--smoke", "--nets", "loopback",
                           "--runs", "1", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    data = json.loads((tmp_path / "robustness.json").read_text())
    assert list(data["summary"]) == ["loopback"] and data["meta"]["lossless_steps"] == 0
    summary = data["summary"]["loopback"]
    assert summary["runs"] == 1 and 0 <= summary["matched"] <= 1
    (run,) = data["runs"]["loopback"]
    settings = data["meta"]["settings"]
    assert run["auto_choice"] in ("dense", "compressed") and run["faster"] in ("dense", "compressed")
    assert run["matched"] == (run["auto_choice"] == run["faster"])
    assert run["dense_s"] > 0 and run["compressed_s"] > 0 and run["auto_steady_s"] > 0
    assert {m: len(run["times"][m]) for m in METHODS} == {"auto": settings["steps"], "dense": settings["ref_steps"],
                                                          "compressed": settings["ref_steps"]}
    assert len(run["eval_loss"]) == (settings["steps"] - 1) // settings["eval_every"]
    for t in run["auto_trials"]:
        assert {"step", "routes_s", "dense_s", "kept"} <= set(t)
    # the references route as stated: all dense, and every weight off the dense route
    refs = run["reference_representations"]
    assert set(refs["dense"]) == {"dense"} and sum(run["auto_representations"].values()) > 0
    assert sum(n for rep, n in refs["compressed"].items() if rep != "dense") > 0
    stats = data["meta"]["load_stats"]["loopback"]
    assert stats["bursts"] >= 1 and stats["busy_s"] > 0   # the hog ran, and stopped
    assert "| loopback | 1 |" in (tmp_path / "robustness.md").read_text()


def test_scale_powersgd_bytes_follow_the_hook():
    """`_scale_engines.powersgd_bytes`: vectors whole, matrices as P and Q where the hook compresses
    them (its own `_should_compress`), whole where it does not."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    from benchmarks._scale_engines import powersgd_bytes

    assert powersgd_bytes((2048,), 8192.0, 4) == 8192.0
    for shape in ((32000, 2048), (768, 2304), (8, 8), (9, 9), (64, 4, 4)):
        n, m = shape[0], int(torch.tensor(shape[1:]).prod())
        full = 4.0 * n * m
        squeeze = _should_compress(n, m, 4, 2)[0]
        expect = full * (n + m) * 4 / (n * m) if squeeze else full
        assert powersgd_bytes(shape, full, 4) == pytest.approx(expect)
    assert powersgd_bytes((8, 8), 256.0, 4) == 256.0  # (8 + 8) 4 * 2 = 128 > 64: sent whole


def test_scale_smoke_writes_every_model_and_method(tmp_path):
    """`benchmarks.scale --smoke` (in this process; its ranks are spawned): GPT-2 at tiny width under
    DDP (every DDP method, in turns, peaks from the memory phase) and Llama at tiny width under FSDP2
    and ZeRO-3 (each method alone) through the 124 M / 307 M code path: per method the attach time,
    every step's time, a peak RSS, bytes per step; dAD's routes per step, its bytes at most the
    engine's; the checks against each engine's plain run, issue 38's targets and the table written."""
    from benchmarks import scale
    from benchmarks._scale_engines import METHODS, PLAIN

    result = scale.main(["--smoke", "--out", str(tmp_path)])
    assert list(result["models"]) == ["gpt2-tiny", "llama-tiny"]
    assert result["load_before"] and result["load_after"]
    seen = set()
    for model in result["models"].values():
        ms = model["methods"]
        steps = {m: g["steps"] for g in model["groups"] for m in g["methods"]}
        for name, r in ms.items():
            seen.add(name)
            assert r["engine"] == METHODS[name][0]
            assert len(r["times"]) == steps[name] and min(r["times"]) > 0
            assert r["attach_s"] >= 0 and r["peak_rss_mb"] > 0 and r["bytes_last"] > 0
            assert ("routes" in r) == ("dad" in name)
            if "dad" in name:
                assert r["routes"] == r["routes_by_step"][-1] and min(r["routes"].values()) > 0
                plain = ms[PLAIN[r["engine"]]]
                # no more than the engine, but for dAD's own small collectives under FSDP2 / ZeRO (row
                # counts, a step's finiteness: 88 B a step here)
                slack = 0 if r["engine"] == "ddp" else 512
                assert r["bytes_last"] <= plain["bytes_last"] * (1 + 1e-9) + slack
                c = model["checks"][name]
                assert c["plain"] == PLAIN[r["engine"]] and len(c["step"]["ratios"]) == len(r["times"])
                assert c["peak_ratio"] > 0 and c["bytes_vs_powersgd"] > 0
        for name in ("powersgd", "dad-auto-100mbit"):  # one DDP bucket holds the whole model
            if name in ms:
                assert ms[name]["bucket_mb"] * 2 ** 20 >= 4 * ms[name]["n_params"]
    assert {e for e, _ in METHODS.values()} == {METHODS[m][0] for m in seen}  # every engine ran
    checks = {t["target"]: t for t in result["targets"]}
    assert any("1.10" in c for c in checks) and any("PowerSGD" in c for c in checks)
    assert all(t["met"] is None for t in checks.values())  # tiny widths, 2 steps: no target judged
    text = (tmp_path / "scale.md").read_text()
    assert "## gpt2-tiny" in text and "## llama-tiny" in text and "Issue 38's targets" in text


def test_scale_plans_group_and_filter_methods():
    """`scale.plan_groups`: a preset's groups kept, filtered by --methods (one outside the plan runs
    alone), every group at --steps, or regrouped per engine with its plain run first."""
    from benchmarks.scale import PRESETS, parse_args, plan_groups

    plan = PRESETS["default"]["plans"]["llama-307m"]
    assert plan_groups(plan, None, None, None)[0] == {"methods": ["allreduce", "dad-auto"], "steps": 20}
    got = plan_groups(plan, ["dad-auto", "fsdp2", "zero3-dad-auto"], None, None)
    assert got == [{"methods": ["dad-auto"], "steps": 20}, {"methods": ["fsdp2"], "steps": 12},
                   {"methods": ["zero3-dad-auto"], "steps": 20}]
    got = plan_groups(plan, ["fsdp2-dad-auto-100mbit", "dad-auto", "fsdp2", "allreduce"], 3, 2)
    assert got == [{"methods": ["allreduce", "dad-auto"], "steps": 3},
                   {"methods": ["fsdp2", "fsdp2-dad-auto-100mbit"], "steps": 3}]
    args = parse_args(["--quick", "--models", "llama-tiny", "--methods", "zero3,zero3-dad-auto"])
    assert args.plans["llama-tiny"] == [{"methods": ["zero3"], "steps": 12},
                                        {"methods": ["zero3-dad-auto"], "steps": 12}]
    with pytest.raises(SystemExit):
        parse_args(["--methods", "nope"])


def test_scale_targets_judge_the_measured_values():
    """`_scale_checks.targets`: each of issue 38's targets PASS / FAIL from the summaries it reads, "not
    run" where a run is missing; the step ratio's worst step and the memory ratio against the engine's."""
    from benchmarks._scale_checks import method_checks, target_lines, targets

    def rec(engine, times, peak, sent, group, routes=None, attach=0.0):
        r = {"engine": engine, "times": times, "peak_rss_mb": peak, "bytes_last": sent, "group": group,
             "attach_s": attach}
        if routes is not None:
            r.update(routes=routes, weights_over_powersgd=[], powersgd_bytes_model=sent / 2)
        return r

    pair = ["allreduce", "dad-auto"]
    gpt2 = {"allreduce": rec("ddp", [1.0] * 12, 100, 10, pair),
            "dad-auto": rec("ddp", [1.05] * 11 + [1.2], 110, 10, pair, {"dense": 5}, attach=2.0)}
    llama = {"allreduce": rec("ddp", [1.0] * 12, 100, 10, pair),
             "dad-auto": rec("ddp", [1.0] * 12, 100, 10, pair, {"dense": 5}, attach=6.0),
             "fsdp2": rec("fsdp2", [1.0] * 12, 100, 10, ["fsdp2"]),
             "fsdp2-dad-auto-100mbit": rec("fsdp2", [1.0] * 12, 120, 2, ["x"], {"rank": 5})}
    models = {n: {"methods": ms, "checks": method_checks(ms)} for n, ms in (("gpt2-124m", gpt2), ("llama-307m", llama))}
    c = models["gpt2-124m"]["checks"]["dad-auto"]["step"]
    assert c["step"] == 11 and c["max"] == pytest.approx(1.2) and c["same_turn"]
    assert models["llama-307m"]["checks"]["fsdp2-dad-auto-100mbit"]["peak_ratio"] == pytest.approx(1.2)
    got = {t["target"].split(":")[0]: t["met"] for t in targets(models)}
    assert got["fast link, gpt2-124m"] is False and got["fast link, llama-307m"] is True
    assert got["attach, llama-307m"] is False
    memory = {t["target"].split(": ")[1].split()[0]: t["met"] for t in targets(models) if "memory" in t["target"]}
    assert memory == {"fsdp2-dad-auto-100mbit": True, "zero3-dad-auto-100mbit": None}  # zero3's did not run
    assert got["bytes, llama-307m"] is True
    lines = target_lines(targets(models))
    assert lines[0].startswith("FAIL") and any(line.startswith("not run") for line in lines)
