"""FSDP2 HSDP across nodes: HSDP's own reduction against dAD on its replicate hop, and flat PowerSGD.

    python -m benchmarks.multinode --hsdp                          # GPT-2 and Llama 4x256 at 1 Gbit/s
    python -m benchmarks.multinode --hsdp --rates 1gbit,100mbit --quality

A fresh simulated cluster (`benchmarks.sim_cluster`: 2 nodes x 2 ranks, the link between nodes
shaped) per rate and model; one ``torchrun --nnodes 2`` per node runs every method, taking turns
step by step (`_hsdp_ranks`: hsdp, hsdp-dad-exact, hsdp-dad-auto, powersgd). Figures per method:
the median step of the slowest rank over the second half of the steps (after dAD's lossless steps
and route trial), inter-node bytes per step from the veth's counters (both nodes, TCP/IP headers
included), the tensors each method holds per rank (parameter, gradient and optimizer shards, and
error-feedback state), held-out loss. ``--quality``: 300 steps x 3 seeds at 1 Gbit/s of flat
PowerSGD and dAD with its rank routes forced (``mode: "rank"``; auto's choice at a given link is
in the speed rows), both at rank 4 and the same warm-up, 4 x 64 tokens a rank. Writes ``benchmarks/results/multinode_hsdp.{json,md}``.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
from pathlib import Path
from typing import Dict

from benchmarks.sim_cluster import SimCluster

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("hsdp", "hsdp-dad-exact", "hsdp-dad-auto", "powersgd")
QUALITY_METHODS = ("powersgd", "hsdp-dad-rank")
TRIAL_STEPS = 8  # dAD's route trial: this many dense and compressed steps each (config route_trial_steps)
WORKLOAD = dict(n_embd=256, n_layer=4, n_head=4, seq=128, batch=4)
QUALITY_WORKLOAD = dict(WORKLOAD, seq=64)  # 300 steps x 3 seeds must fit a session on 2 cores
log = logging.getLogger("benchmarks.multinode_hsdp")


def run(rate: str, family: str, methods, steps: int, seed: int, rank: int, lossless: int, work: Path,
        workload: dict = WORKLOAD) -> dict:
    """One cluster at ``rate``: the ranks' JSON."""
    out = work / f"hsdp_{family}_{rate}_{seed}.json"
    spec = {"workload": dict(workload, seed=seed), "family": family, "methods": list(methods), "steps": steps,
            "rank": rank, "warmup": lossless, "out": str(out)}
    spec_path = work / f"hsdp_{family}_{rate}_{seed}_spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, DAD_LOSSLESS_STEPS=str(lossless), TOKENIZERS_PARALLELISM="false")
    with SimCluster(nodes=2, rate=rate) as cluster:
        cluster.torchrun(ROOT / "benchmarks" / "_hsdp_ranks.py", [spec_path], nproc_per_node=2, env=env,
                         timeout=7200, capture=True)
    return json.loads(out.read_text())


def summarise(run_out: dict, settled: int = 0) -> Dict[str, dict]:
    """Per method, over the same steps for every method: from the later of half the run and
    ``settled`` (dAD's lossless steps and route trial over)."""
    ranks = run_out["ranks"]
    out = {}
    for m in ranks[0]:
        n = len(ranks[0][m]["times"])
        timed = range(min(max(n // 2, settled), n - 1), n)
        out[m] = {"step_s": statistics.median(max(r[m]["times"][i] for r in ranks) for i in timed),
                  "inter_bytes": statistics.median(sum(r[m]["inter"][i] for r in ranks) for i in timed),
                  "held_bytes": max(sum(r[m]["held"].values()) for r in ranks),
                  "ef_bytes": max(r[m]["held"]["error_feedback"] for r in ranks),
                  "eval_loss": ranks[0][m]["eval_loss"],
                  "train_loss": statistics.fmean(ranks[0][m]["losses"][-10:]),
                  "routes": ranks[0][m]["routes"], "steps": n}
    return out


def table(title: str, rows: Dict[str, dict]) -> str:
    base = rows.get("hsdp", {})
    lines = [title, "", "| method | step | x HSDP's step | inter-node MB/step | x HSDP's bytes | held MiB/rank "
             "(EF) | held-out loss | dAD's routes |", "|---|---|---|---|---|---|---|---|"]
    for m, e in rows.items():
        step_ratio = e["step_s"] / base["step_s"] if base else float("nan")
        byte_ratio = e["inter_bytes"] / base["inter_bytes"] if base else float("nan")
        lines.append(f"| {m} | {e['step_s'] * 1e3:.0f} ms | {step_ratio:.3f} | {e['inter_bytes'] / 1e6:.2f} | "
                     f"{byte_ratio:.3f} | {e['held_bytes'] / 2 ** 20:.1f} ({e['ef_bytes'] / 2 ** 20:.1f}) | "
                     f"{e['eval_loss']:.4f} | {', '.join(r for r in e['routes'] if r != 'overhead') or '-'} |")
    return "\n".join(lines)


def main(args) -> int:
    """``benchmarks.multinode --hsdp``: speed rows per rate and model, then the quality runs."""
    out = Path(args.out + "_hsdp")
    results: dict = {"speed": {}, "quality": {}}
    families = args.families.split(",")
    with tempfile.TemporaryDirectory(prefix="dad-multinode-hsdp-") as tmp:
        for rate in args.rates.split(","):
            for family in families:
                log.info("HSDP %s %s: %d methods x %d steps ...", family, rate, len(METHODS), args.steps)
                raw = run(rate, family, METHODS, args.steps, args.seed, args.rank, args.lossless, Path(tmp))
                results.setdefault("raw", {})[f"{family} {rate}"] = raw
                results["speed"][f"{family} {rate}"] = summarise(raw, args.lossless + 2 * TRIAL_STEPS + 1)
        if args.quality:
            for seed in range(3):
                log.info("HSDP quality: seed %d, 300 steps at 1gbit ...", seed)
                results["quality"][seed] = summarise(run("1gbit", "gpt2", QUALITY_METHODS, 300, seed, args.rank,
                                                         args.lossless, Path(tmp), QUALITY_WORKLOAD))
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(results, indent=1))
    text = [f"`python -m benchmarks.multinode --hsdp --steps {args.steps} --rates {args.rates} "
            f"--families {args.families} --lossless {args.lossless}{' --quality' if args.quality else ''}`", ""]
    for key, rows in results["speed"].items():
        family, rate = key.split()
        text += [table(f"FSDP2 HSDP, {family} 4x256 (byte-level), 2 nodes x 2 ranks, {rate} between nodes", rows), ""]
    if results["quality"]:
        text += ["Quality: held-out loss after 300 steps at 1 Gbit/s, GPT-2 4x256, 4 x 64 tokens a rank, rank 4", "",
                 "| seed | " + " | ".join(QUALITY_METHODS) + " | dad-rank / PowerSGD |",
                 "|---" * (len(QUALITY_METHODS) + 2) + "|"]
        for seed, rows in results["quality"].items():
            p = rows["powersgd"]["eval_loss"]
            text.append(f"| {seed} | " + " | ".join(f"{rows[m]['eval_loss']:.4f}" for m in QUALITY_METHODS)
                        + f" | {rows['hsdp-dad-rank']['eval_loss'] / p:.4f} |")
    Path(f"{out}.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    return 0
