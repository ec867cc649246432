"""dAD across nodes: a simulated 2-node x 2-rank cluster, the link between nodes shaped.

    python -m benchmarks.multinode                      # 10 Gbit/s, 1 Gbit/s, 100 Mbit/s; 40 steps
    python -m benchmarks.multinode --quality            # + 300 steps x 3 seeds at 1 Gbit/s

Each rate gets a fresh cluster (`benchmarks.sim_cluster`: two network namespaces joined by a veth
pair shaped by ``tc tbf``; the ranks of a node talk over its unshaped loopback) and one ``torchrun
--nnodes 2`` per node. Methods train the byte-level GPT-2 (4 layers of 256, 4 x 128 tokens a rank)
from the same weights on the same batches, one step each in turn (`_multinode_ranks`):

  allreduce  DDP's all-reduce (one 25 MB bucket for every DDP method: PowerSGD's hook on gloo
             hangs with several)
  fp16       DDP's fp16 compression hook
  powersgd   PyTorch's PowerSGD hook, rank 4, flat (every rank compresses every matrix)
  dad-flat   dAD, rank 4, ``topology: "flat"``: today's one-level routes
  dad-auto   dAD, rank 4, its defaults: the topology from the launcher, two-level routes where
             predicted faster

Figures per method and rate: the median step of the slowest rank (after the lossless steps and any
route trial, the same steps for every method), inter-node bytes per step from the veth's own
counters (both directions, TCP/IP headers included) beside dAD's own report, error-feedback memory
per rank, and held-out loss. ``--quality``: loss after 300 steps for PowerSGD and dAD, 3 seeds, at
equal warm-up (PowerSGD starts compressing when dAD's lossless steps end). Writes
``benchmarks/results/multinode.{json,md}`` and ``multinode_time_to_loss.png``.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks.sim_cluster import SimCluster, inter_node_bytes, probe

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
METHODS = ("allreduce", "fp16", "powersgd", "dad-flat", "dad-auto")
RATES = ("10gbit", "1gbit", "100mbit")
WORKLOAD = dict(n_embd=256, n_layer=4, n_head=4, seq=128, batch=4)
log = logging.getLogger("benchmarks.multinode")


def run_rate(rate: str, methods, steps: int, seed: int, rank: int, lossless: int, work: Path) -> dict:
    """One cluster at ``rate``, every method for ``steps`` steps; the ranks' JSON plus the run's
    total inter-node bytes from the cluster's own counters."""
    spec = {"workload": dict(WORKLOAD, seed=seed), "methods": list(methods), "steps": steps,
            "opts": {"rank": rank, "dad_error_feedback": True, "powersgd_warmup": max(2, lossless)},
            "out": str(work / f"{rate}_{seed}.json")}
    spec_path = work / f"{rate}_{seed}_spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {"DAD_LOSSLESS_STEPS": str(lossless), "TOKENIZERS_PARALLELISM": "false"}
    import os
    with SimCluster(nodes=2, rate=rate) as cluster:
        before = cluster.counters()
        started = time.perf_counter()
        cluster.torchrun(ROOT / "benchmarks" / "_multinode_ranks.py", [spec_path], nproc_per_node=2,
                         env=dict(os.environ, **env), timeout=3600, capture=True)
        wall = time.perf_counter() - started
        total = inter_node_bytes(before, cluster.counters())
    out = json.loads(Path(spec["out"]).read_text())
    if os.environ.get("DAD_MULTINODE_KEEP"):  # the ranks' raw results, for a look at one run
        Path(os.environ["DAD_MULTINODE_KEEP"]).write_text(json.dumps(out))
    out.update(rate=rate, seed=seed, wall_s=wall, total_inter_bytes=total)
    return out


def summarise(run: dict, warm: int) -> Dict[str, dict]:
    """Per method: median slowest-rank step over the same steps for every method (after ``warm``
    and after every dAD method's last route trial), inter-node bytes per step (both nodes),
    error-feedback bytes per rank (the largest), held-out loss, what dAD ran."""
    ranks = run["ranks"]
    out = {}
    settled = max([warm] + [r[m].get("settled", 0) for r in ranks for m in r])
    for m in ranks[0]:
        per_step = [max(r[m]["times"][i] for r in ranks) for i in range(len(ranks[0][m]["times"]))]
        timed = per_step[settled:] or per_step
        inter = [sum(r[m]["inter"][i] for r in ranks) for i in range(len(per_step))][settled:]
        out[m] = {"step_s": statistics.median(timed), "inter_bytes": statistics.median(inter) if inter else None,
                  "ef_bytes": max(r[m]["ef_bytes"] for r in ranks), "eval_loss": ranks[0][m]["eval_loss"],
                  "levels": ranks[0][m]["levels"], "two_level": ranks[0][m]["two_level_steps"],
                  "timed_steps": len(timed), "per_step": per_step, "losses": ranks[0][m]["losses"]}
    return out


def table(summaries: Dict[str, Dict[str, dict]]) -> str:
    lines = ["| method | " + " | ".join(f"step {r} | inter-node MB/step {r}" for r in summaries) +
             f" | EF memory / rank ({list(summaries)[-1]}) | held-out loss |",
             "|---|" + "---|---|" * len(summaries) + "---|---|"]
    first = next(iter(summaries.values()))
    last = list(summaries.values())[-1]  # the slowest link: where compression and its memory are on
    for m in first:
        cells = []
        for s in summaries.values():
            e = s.get(m)
            cells += [f"{e['step_s'] * 1e3:.0f} ms" if e else "-",
                      f"{e['inter_bytes'] / 1e6:.2f}" if e and e["inter_bytes"] is not None else "-"]
        ef = last[m]["ef_bytes"]
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {ef / 1e6:.2f} MB | {first[m]['eval_loss']:.4f} |")
    return "\n".join(lines)


def ratios(summaries: Dict[str, Dict[str, dict]]) -> List[str]:
    """dad-auto's step against the best of all-reduce, fp16 and flat PowerSGD, per rate."""
    out = []
    for rate, s in summaries.items():
        if "dad-auto" not in s:
            continue
        base = {m: s[m]["step_s"] for m in ("allreduce", "fp16", "powersgd") if m in s}
        best = min(base, key=base.get)
        ratio = s["dad-auto"]["step_s"] / base[best]
        bytes_ratio = (s["dad-auto"]["inter_bytes"] / s["powersgd"]["inter_bytes"]
                       if "powersgd" in s and s["powersgd"]["inter_bytes"] else float("nan"))
        out.append(f"- {rate}: dad-auto {ratio:.3f}x the best baseline ({best}); inter-node bytes "
                   f"{bytes_ratio:.2f}x flat PowerSGD's; two-level steps: {s['dad-auto']['two_level']}")
    return out


def plot(summaries: Dict[str, Dict[str, dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summaries), figsize=(5 * len(summaries), 4), squeeze=False)
    for ax, (rate, s) in zip(axes[0], summaries.items()):
        for m, e in s.items():
            t, acc = [], 0.0
            for dt in e["per_step"]:
                acc += dt
                t.append(acc)
            ax.plot(t, e["losses"][:len(t)], label=m, lw=1)
        ax.set_title(f"2 nodes x 2 ranks, {rate} between nodes")
        ax.set_xlabel("wall-clock s (slowest rank)")
        ax.set_ylabel("training loss")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- DeepSpeed ZeRO-3 across nodes (examples/deepspeed/llama_multinode.py) ---------------------------------
ZERO3_METHODS = ("zero3", "zero3-dad-auto")
QGZ_NOTE = ("qgZ (zero_quantized_gradients) does not run on CPU: DeepSpeed 0.19.8's all_to_all_quant_reduce "
            "(runtime/comm/coalesced_collectives.py:34) loads QuantizerBuilder, which the CPU accelerator "
            "does not implement (ops/op_builder/cpu/no_impl.py:21: \"This op had not been implemented on CPU "
            "backend.\")")
ZERO3_TURNS = ("both methods in the same processes (one torchrun --nnodes 2 per node), built from the same weights "
               "and fed the same batches, one step each in turn, the order alternating from step to step; "
               "inter-node bytes from each node's interface counter between barriers (after forward and after "
               "backward + step), less a barrier's own; step = forward + backward + step of the slowest rank, "
               "barrier waits excluded; medians over the second half of the steps")


def run_zero3(rate: str, steps: int, work: Path):
    """ZeRO-3's own reduce-scatter against dAD auto on the example's Llama and config, one fresh cluster
    at ``rate``, the methods taking turns step by step in the same processes (`_zero3_ranks`); per
    method the medians over the second half of the steps (`summarise_zero3`); and the run's own
    figures (the largest process peak RSS, both methods in it)."""
    import os
    spec = {"steps": steps, "methods": list(ZERO3_METHODS), "out": str(work / f"zero3_{rate}.json")}
    spec_path = work / f"zero3_{rate}_spec.json"
    spec_path.write_text(json.dumps(spec))
    with SimCluster(nodes=2, rate=rate) as cluster:
        cluster.torchrun(ROOT / "benchmarks" / "_zero3_ranks.py", [spec_path], nproc_per_node=2,
                         env=dict(os.environ, DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false"),
                         timeout=3600, capture=True)
    run = json.loads(Path(spec["out"]).read_text())
    if os.environ.get("DAD_MULTINODE_KEEP"):  # the ranks' raw results, for a look at one run
        Path(os.environ["DAD_MULTINODE_KEEP"]).write_text(json.dumps(run))
    rows = summarise_zero3(run)
    rss = max(r["peak_rss_bytes"] for r in run["ranks"])
    return rows, {"process_peak_rss_bytes": rss, "barrier_bytes": run["barrier_bytes"]}


def summarise_zero3(run: dict) -> Dict[str, dict]:
    """Per method: medians over the second half of the steps of the slowest rank's step (forward +
    backward + step) and of both nodes' inter-node bytes (forward, backward + step); the most any
    rank holds; the loss averaged over the ranks (last 5 steps); dAD's routes."""
    ranks = run["ranks"]
    out = {}
    for m in ZERO3_METHODS:
        if m not in ranks[0]:
            continue
        n = len(ranks[0][m]["losses"])
        first = n // 2
        per_step = [max(r[m]["forward_s"][i] + r[m]["backward_s"][i] for r in ranks) for i in range(n)]
        fwd = [sum(r[m]["forward_inter"][i] for r in ranks) for i in range(n)]
        bwd = [sum(r[m]["backward_inter"][i] for r in ranks) for i in range(n)]
        losses = [statistics.fmean(r[m]["losses"][i] for r in ranks) for i in range(n)]
        held = {k: max(r[m]["held"][k] for r in ranks) for k in ranks[0][m]["held"]}
        out[m] = {"step_s": statistics.median(per_step[first:]),
                  "forward_s": statistics.median(max(r[m]["forward_s"][i] for r in ranks) for i in range(first, n)),
                  "backward_s": statistics.median(max(r[m]["backward_s"][i] for r in ranks) for i in range(first, n)),
                  "forward_inter_bytes": statistics.median(fwd[first:]),
                  "backward_inter_bytes": statistics.median(bwd[first:]),
                  "held_bytes": held, "final_loss": statistics.fmean(losses[-5:]),
                  "routes": ranks[0][m]["routes"], "route_trials": ranks[0][m]["route_trials"],
                  "steps": n, "timed_steps": n - first, "per_step": per_step, "losses": losses,
                  "forward_inter_per_step": fwd, "backward_inter_per_step": bwd}
    return out


def zero3_table(rate: str, rows: Dict[str, dict], rss: Optional[float] = None) -> str:
    base = rows.get("zero3")

    def ratio(e: dict, key: str) -> str:
        of = (lambda x: x["total"]) if key == "held_bytes" else (lambda x: x)
        return f"{of(e[key]) / of(base[key]):.3f}" if base and of(base[key]) else "-"

    lines = [f"ZeRO-3, Llama 4x256 (byte-level), 2 nodes x 2 ranks, {rate} between nodes, hpZ 2 (backward's "
             "all-gather inside the node: backward's inter-node bytes are the gradient reduction's); "
             f"{ZERO3_TURNS}", "",
             "| method | step | x ZeRO-3 | inter-node MB/step backward | x ZeRO-3 | forward | held tensors / rank | "
             "x ZeRO-3 | of which dAD state | loss (last 5, mean of ranks) |", "|---" * 10 + "|"]
    for m, e in rows.items():
        h = e["held_bytes"]
        lines.append(f"| {m} | {e['step_s'] * 1e3:.0f} ms | {ratio(e, 'step_s')} | "
                     f"{e['backward_inter_bytes'] / 1e6:.2f} | {ratio(e, 'backward_inter_bytes')} | "
                     f"{e['forward_inter_bytes'] / 1e6:.2f} | {h['total'] / 2 ** 20:.2f} MiB | "
                     f"{ratio(e, 'held_bytes')} | {(h['error_feedback'] + h['warm_starts']) / 2 ** 20:.2f} MiB | "
                     f"{e['final_loss']:.4f} |")
    lines += ["", "Held tensors: parameter partitions, gradient partitions, fp32 master partitions, AdamW's state, "
              "dAD's error-feedback residuals and warm starts, per rank after the last step (the most of any "
              "rank; hpZ's secondary partitions are dropped at every optimizer step, none are held between "
              "steps; DeepSpeed's reduce bucket, allocated but mostly untouched, is left out). Process RSS "
              "cannot be split between two engines in one process: not reported per method"
              + (f" (peak RSS of a process, both engines: {rss / 2 ** 20:.0f} MiB)." if rss else "."),
              "", f"qgZ: {QGZ_NOTE}."]
    return "\n".join(lines)


def main_zero3(args) -> int:
    out = Path(args.out + "_zero3")
    results, runs = {}, {}
    with tempfile.TemporaryDirectory(prefix="dad-multinode-zero3-") as tmp:
        for rate in args.rates.split(","):
            log.info("ZeRO-3 %s: %d steps per method, taking turns ...", rate, args.steps)
            results[rate], runs[rate] = run_zero3(rate, args.steps, Path(tmp))
    text = [f"`python -m benchmarks.multinode --zero3 --steps {args.steps} --rates {args.rates}`", ""]
    text += [zero3_table(rate, rows, runs[rate]["process_peak_rss_bytes"]) + "\n" for rate, rows in results.items()]
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps({"steps": args.steps, "turns": ZERO3_TURNS, "results": results,
                                               "runs": runs, "qgz": QGZ_NOTE}, indent=1))
    Path(f"{out}.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default=",".join(RATES))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--lossless", type=int, default=10, help="dAD's lossless steps (PowerSGD's warm-up)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quality", action="store_true", help="also 300 steps x 3 seeds at 1gbit (powersgd, dad-auto)")
    ap.add_argument("--out", default=str(RESULTS / "multinode"))
    ap.add_argument("--render", metavar="JSON", help="only redo the table and plot of a saved results file")
    ap.add_argument("--zero3", action="store_true", help="the ZeRO-3 row: DeepSpeed's reduce-scatter against dAD "
                    "auto on examples/deepspeed/llama_multinode.py's model and config, taking turns step by step "
                    "(benchmarks/_zero3_ranks.py; writes OUT_zero3.{json,md})")
    ap.add_argument("--hsdp", action="store_true", help="the FSDP2 HSDP rows (benchmarks/multinode_hsdp.py; "
                    "writes OUT_hsdp.{json,md}); --rates defaults to 1gbit there")
    ap.add_argument("--families", default="gpt2,llama", help="models of the --hsdp rows")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[multinode] %(message)s")
    if args.render:
        return render(Path(args.render), Path(args.out))
    ok, why = probe()
    if not ok:
        print(f"cannot build a simulated cluster here: {why}", file=sys.stderr)
        return 2
    if args.zero3:
        return main_zero3(args)
    if args.hsdp:
        from benchmarks import multinode_hsdp
        if args.rates == ",".join(RATES):
            args.rates = "1gbit"
        return multinode_hsdp.main(args)
    methods = args.methods.split(",")
    summaries, raw = {}, {}
    with tempfile.TemporaryDirectory(prefix="dad-multinode-") as tmp:
        for rate in args.rates.split(","):
            log.info("%s: %d methods x %d steps on 2 nodes x 2 ranks ...", rate, len(methods), args.steps)
            run = run_rate(rate, methods, args.steps, args.seed, args.rank, args.lossless, Path(tmp))
            raw[rate] = run
            summaries[rate] = summarise(run, args.lossless + 2)
            log.info("%s: done in %.0f s", rate, run["wall_s"])
        quality = {}
        if args.quality:
            for seed in range(3):
                log.info("quality: seed %d, 300 steps at 1gbit ...", seed)
                run = run_rate("1gbit", ["powersgd", "dad-auto"], 300, seed, args.rank, args.lossless, Path(tmp))
                s = summarise(run, args.lossless + 2)
                quality[seed] = {m: {"eval_loss": e["eval_loss"], "final_train_loss": statistics.fmean(e["losses"][-20:])}
                                 for m, e in s.items()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = f"python -m benchmarks.multinode {' '.join(argv or sys.argv[1:])}"
    Path(f"{out}.json").write_text(json.dumps({"command": command, "summaries": summaries, "quality": quality,
                                               "runs": {r: {k: v for k, v in x.items() if k != "ranks"}
                                                        for r, x in raw.items()}}, indent=1))
    return render(Path(f"{out}.json"), out)


def restep(summaries: Dict[str, Dict[str, dict]]) -> None:
    """Each rate's medians over the same steps for every method: after the latest method's warm-up
    (what `summarise` does; here for results saved per method, ``per_step`` and ``timed_steps``)."""
    for s in summaries.values():
        settled = max(len(e["per_step"]) - e["timed_steps"] for e in s.values())
        for e in s.values():
            e["step_s"] = statistics.median(e["per_step"][settled:] or e["per_step"])
            e["timed_steps"] = len(e["per_step"]) - settled


def render(results: Path, out: Path) -> int:
    """The markdown table, ratios and plot of a saved results file (`--render` redoes them)."""
    saved = json.loads(results.read_text())
    summaries, quality = saved["summaries"], saved.get("quality") or {}
    restep(summaries)
    text = ["# 2 nodes x 2 ranks (simulated), GPT-2 4x256, 4x128 tokens a rank", "",
            f"`{saved.get('command', 'python -m benchmarks.multinode')}`", "", table(summaries), ""]
    text += ratios(summaries)
    if saved.get("note"):
        text += ["", saved["note"]]
    if quality:
        text += ["", "| seed | PowerSGD held-out loss | dad-auto held-out loss | ratio |", "|---|---|---|---|"]
        for seed, q in quality.items():
            a, b = q["powersgd"]["eval_loss"], q["dad-auto"]["eval_loss"]
            text.append(f"| {seed} | {a:.4f} | {b:.4f} | {b / a:.4f} |")
    Path(f"{out}.md").write_text("\n".join(text) + "\n")
    plot(summaries, Path(f"{out}_time_to_loss.png"))
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
