"""dAD side by side with all-reduce, fp16 compression, PowerSGD and spectral ATOMO.

    python -m benchmarks.compare --quick --json benchmarks/results/compare.json

Launches its own 2 CPU ranks (gloo) for each network condition, each in a private network namespace
(`benchmarks.net_shaping`), so that every condition sees the same stack: its loopback unshaped, and
shaped to 10 Gbit/s, 1 Gbit/s and 100 Mbit/s (the shaped ones skipped, with a message and null
columns, where namespaces or tc are not permitted; the unshaped one then runs on the host's loopback). Every method trains
the same byte-level GPT-2 (from a config) from the same weights on the same stdlib-source batches.

Per method (one JSON record each):
  bytes_per_step      bytes one rank sends per step (dAD: `last_step_report()`; DDP hooks: the
                      tensors they hand to torch.distributed, ring model)
  step_s_<net>        median step time (forward, backward, synchronisation, optimizer), slowest rank
  step_lq_s_<net>     the same steps' lower quartile (under ``--load`` step times are bimodal: the
                      median falls in the loaded or the unloaded mode by chance)
  step_s_local        the same step with no communication at all (plain model, same per-rank batch,
                      both ranks running at once as in the distributed runs)
  compute_overhead_s  step time of the method with its communication removed (dAD over an
                      aggregator that moves nothing; DDP hooks over a 1-rank group) minus step_s_local:
                      capture, rank reduction / compression and rebuild, timed apart from the wire
  peak_mem_mb         peak RSS of a rank process while the method trains (torch runtime included)
  final_loss          held-out loss after the run's steps (loopback run)

Every dAD method runs as DDP's communication hook (`register_dad_comm_hook`, as Accelerate and the
Trainer attach it), with the DDP bucket the other methods have. dad-auto routes by predicted time
(the default objective: the link measured on each condition's group at attach), dad-auto-bytes by
bytes. Plots: bytes, step time by link, loss by step, and loss
against wall-clock time on each link (time-to-loss).

Each method's decisions see only its own steps: every method has its own process group (DDP's
hooks one each, dAD one per synchroniser), and before each step the ranks meet at a barrier on a
group of their own (outside the timed span), so that neither a method's step time nor a route
trial's clock includes the other rank still finishing the previous method's step. A route
trial's steps, and dAD's link probes at attach and at a refresh, run inside the method's own turn;
the trials' outcomes are recorded per method (`compare_details.json`, ``trials``).

``--load`` runs a bursty CPU hog (`benchmarks.cpu_load`: one core, busy 0.2-2 s, idle 0.2-2 s,
seeded) inside each condition's namespace for the whole phase, as another job on a shared
machine.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks import net_shaping
from benchmarks._ranks import METHODS, dad_config
from benchmarks.workload import Workload, fmt_bytes
from dad_examples.powersgd_baseline import warmup_steps
from dad_integrations import DADConfig

NETS = ("loopback", "10gbit", "1gbit", "100mbit")
SHAPED = NETS[1:]
ROOT = Path(__file__).resolve().parents[1]
KEYS = ("method", "bytes_per_step", "step_s_loopback", "step_s_10gbit", "step_s_1gbit", "step_s_100mbit", "step_s_local",
        "compute_overhead_s", "peak_mem_mb", "final_loss")

PRESETS = {
    # ~10-12 minutes on 2 shared CPU cores (10 lossless steps, dad-auto's route trial of 8 steps,
    # or up to 24 where the evidence is split; the medians start after it: 23-33 steady steps where
    # it decides in one round)
    "quick": dict(n_embd=256, n_layer=2, n_head=4, seq=64, batch=4, steps=52, shaped_steps=44,
                  local_steps=40, nocomm_steps=40, mem_steps=3, warmup=2, rounds=52, rank=4),
    "default": dict(n_embd=256, n_layer=4, n_head=4, seq=128, batch=4, steps=80, shaped_steps=60,
                    local_steps=80, nocomm_steps=80, mem_steps=3, warmup=3, rounds=80, rank=4),
    # seconds: for tests
    "smoke": dict(n_embd=32, n_layer=1, n_head=2, seq=16, batch=2, steps=4, shaped_steps=3,
                  local_steps=4, nocomm_steps=4, mem_steps=2, warmup=1, rounds=4, rank=2),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_const", dest="preset", const="quick",
                   help="small model and few steps (a few minutes on 2 CPU cores)")
    g.add_argument("--smoke", action="store_const", dest="preset", const="smoke",
                   help="tiny model, a handful of steps (seconds; for tests)")
    p.set_defaults(preset="default")
    p.add_argument("--json", metavar="PATH", help="write one record per method here")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"),
                   help="folder for the markdown table, plots and run details")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {METHODS}")
    p.add_argument("--nets", default=",".join(NETS), help=f"comma-separated subset of {NETS}")
    for key in ("n_embd", "n_layer", "n_head", "seq", "batch", "steps", "shaped_steps", "local_steps",
                "nocomm_steps", "mem_steps", "warmup", "rounds", "rank"):
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None, help=f"override the preset's {key}")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dad-no-error-feedback", action="store_true",
                   help="dad-rank and dad-auto without error feedback (on by default)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--phase-timeout", type=float, default=900, help="seconds per network condition")
    p.add_argument("--load", action="store_true",
                   help="a bursty CPU hog (benchmarks.cpu_load) runs beside the ranks in every condition")
    # internal: run one phase (inside the namespace for shaped links)
    p.add_argument("--_phase", help=argparse.SUPPRESS)
    p.add_argument("--_spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    settings = dict(PRESETS[args.preset])
    for key in list(settings):
        v = getattr(args, key)
        if v is not None:
            settings[key] = v
    args.settings = settings
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.nets = [n.strip() for n in args.nets.split(",") if n.strip()]
    bad = [m for m in args.methods if m not in METHODS] + [n for n in args.nets if n not in NETS]
    if bad:
        p.error(f"unknown methods or nets: {bad}")
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_phase_inside(spec_path: str) -> None:
    """Entry point of one phase: shape the link (in a namespace), spawn 2 ranks."""
    import torch.multiprocessing as mp

    from benchmarks._ranks import rank_main
    from benchmarks.cpu_load import bursty_load, read_stats

    with open(spec_path) as fh:
        spec = json.load(fh)
    if spec.get("namespace"):
        net_shaping.setup_inside(None if spec["net"] == "loopback" else spec["net"])
    load = spec.get("load")
    stats = spec["out"] + ".load.json"
    # the hog starts inside the namespace (same conditions as the ranks) and ends with the phase
    with bursty_load(load["seed"] if load else 0, spec["timeout_s"], enabled=bool(load), stats_path=stats):
        mp.spawn(rank_main, args=(2, _free_port(), spec), nprocs=2, join=True)
    if load:
        with open(spec["out"]) as fh:
            result = json.load(fh)
        result["load"] = read_stats(stats)
        with open(spec["out"], "w") as fh:
            json.dump(result, fh)


def _phase_spec(args, net: str, out_file: str) -> dict:
    s = args.settings
    shaped = net != "loopback"
    w = Workload(n_embd=s["n_embd"], n_layer=s["n_layer"], n_head=s["n_head"], seq=s["seq"], batch=s["batch"],
                 lr=args.lr, seed=args.seed)
    # PowerSGD warms up as long as dAD's lossless steps (the config's default, 10); medians and
    # byte means start after both (`warm_steps`)
    auto = DADConfig.from_dict(dad_config("dad-auto", s["rank"], not args.dad_no_error_feedback))
    powersgd_warmup = warmup_steps(auto.to_dict())
    return {"net": net, "out": out_file, "methods": args.methods, "workload": asdict(w),
            "namespace": shaped or args.namespace_ok,
            "opts": {"rank": s["rank"], "dad_error_feedback": not args.dad_no_error_feedback,
                     "powersgd_warmup": powersgd_warmup},
            "steps": s["shaped_steps"] if shaped else s["steps"],
            "local_steps": min(s["local_steps"], s["shaped_steps"]) if shaped else s["local_steps"],
            "nocomm_steps": 0 if shaped else s["nocomm_steps"],
            "mem_steps": 0 if shaped else s["mem_steps"],
            "warmup": warm_steps(s["warmup"], powersgd_warmup),
            "rounds": min(s["rounds"], s["shaped_steps"]) if shaped else s["rounds"],
            "timeout_s": args.phase_timeout,
            "load": {"seed": args.seed + NETS.index(net)} if args.load else None}


def warm_steps(warmup: int, lossless: int) -> int:
    """Steps left out of the step-time medians and byte means, at least: the preset's ``warmup``
    (one-off costs, dAD's checked first step), or the lossless / uncompressed warm-up and its first
    compressed step (PowerSGD builds its state there). The ranks also leave out every step up to
    the end of dad-auto's last route trial (its length depends on the evidence: `_ranks.Runner.settled`)."""
    return max(warmup, lossless + 1)


def run_phase(args, net: str, workdir: str) -> dict:
    out_file = os.path.join(workdir, f"phase-{net}.json")
    spec_file = os.path.join(workdir, f"spec-{net}.json")
    with open(spec_file, "w") as fh:
        json.dump(_phase_spec(args, net, out_file), fh)
    cmd = [sys.executable, "-m", "benchmarks.compare", "--_phase", net, "--_spec", spec_file]
    if net != "loopback" or args.namespace_ok:
        cmd = net_shaping.namespace_prefix() + cmd
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    start = time.perf_counter()
    from benchmarks.cpu_load import die_with_parent

    # the phase (its ranks and the hog of --load with it) dies with this process
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.phase_timeout,
                          preexec_fn=die_with_parent)
    if proc.returncode != 0:
        raise RuntimeError(f"phase {net} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    with open(out_file) as fh:
        result = json.load(fh)
    result["wall_s"] = time.perf_counter() - start
    return result


def _per_rank(phase: dict, key: str) -> List[dict]:
    return [phase["rank_results"][r].get(key, {}) for r in sorted(phase["rank_results"])]


def assemble(args, phases: Dict[str, Optional[dict]], skipped: Dict[str, str]) -> List[dict]:
    loop = phases["loopback"]
    records = []

    def slowest(phase, key, stat="step_s"):
        vals = [r.get(stat) for r in _per_rank(phase, key)]
        return max(vals) if vals and None not in vals else None

    local = slowest(loop, "local")
    for m in args.methods:
        ranks = _per_rank(loop, m)
        nocomm = slowest(loop, f"{m}:nocomm") if args.settings["nocomm_steps"] else None
        mems = [r.get("peak_mem_mb") for r in ranks if r.get("peak_mem_mb") is not None]
        rec = {
            "method": m,
            "bytes_per_step": sum(r["sent_per_step"] for r in ranks) / len(ranks),
            "bytes_received_per_step": sum(r["received_per_step"] for r in ranks) / len(ranks),
            "step_s_loopback": slowest(loop, m),
            **{f"step_s_{net}": slowest(phases[net], m) if phases.get(net) else None for net in SHAPED},
            "step_s_local": local,
            "compute_overhead_s": None if nocomm is None else nocomm - local,
            "peak_mem_mb": max(mems) if mems else None,
            "final_loss": ranks[0]["eval_loss"],
            "train_loss_last5": sum(sum(r["losses"][-5:]) / len(r["losses"][-5:]) for r in ranks) / len(ranks),
            "bytes_counted_per_step": sum(r["counted_per_step"] for r in ranks) / len(ranks),
        }
        for net in SHAPED:
            if phases.get(net):
                rec[f"step_s_local_{net}"] = slowest(phases[net], "local")
        for net in NETS:
            if phases.get(net):
                rec[f"step_lq_s_{net}"] = slowest(phases[net], m, "step_lq_s")
        records.append(rec)
    return records


def auto_targets(records: List[dict]) -> List[dict]:
    """Issue "Seconds, not bytes": dad-auto (by time) against the fastest of all-reduce, fp16 and
    PowerSGD on every link, against the no-communication step at 1 Gbit/s, and PowerSGD's loss."""
    by = {r["method"]: r for r in records}
    auto = by.get("dad-auto")
    if auto is None:
        return []
    out = []
    peers = [m for m in ("allreduce", "fp16", "powersgd") if m in by]
    for method in ("dad-auto", "dad-auto-fp16"):  # the second: fp16 on the wire, as fp16's hook
        if method not in by:
            continue
        for net in NETS:
            key = f"step_s_{net}"
            times = {m: by[m][key] for m in peers if by[m].get(key) is not None}
            if by[method].get(key) is None or not times:
                continue
            best = min(times, key=times.get)
            ratio = by[method][key] / times[best]
            out.append({"target": f"{method} step on {net} <= 1.02 x the fastest peer's", "value": ratio,
                        "limit": 1.02, "met": ratio <= 1.02,
                        "detail": f"{by[method][key] * 1e3:.1f} ms vs {best} {times[best] * 1e3:.1f} ms"})
    # issue 25's targets (with the background load, `--load`): each auto against its like-for-like
    # peers, on the steady steps' median and on their lower quartile (`workload.lower_quartile`: the
    # hog's on/off load makes step times bimodal, and the median then falls in either mode)
    for stat, prefix in (("median", "step_s_"), ("lower quartile", "step_lq_s_")):
        for method, like in (("dad-auto", ("allreduce", "powersgd")), ("dad-auto-fp16", ("fp16", "powersgd"))):
            if method not in by:
                continue
            for net in NETS:
                key = prefix + net
                times = {m: by[m][key] for m in like if m in by and by[m].get(key) is not None}
                if by[method].get(key) is None or not times:
                    continue
                best = min(times, key=times.get)
                ratio = by[method][key] / times[best]
                out.append({"target": f"{method} step ({stat}) on {net} <= 1.05 x the best of {' and '.join(like)}",
                            "value": ratio, "limit": 1.05, "met": ratio <= 1.05,
                            "detail": f"{by[method][key] * 1e3:.1f} ms vs {best} {times[best] * 1e3:.1f} ms"})
    local = auto.get("step_s_local_1gbit")
    if auto.get("step_s_1gbit") is not None and local:
        ratio = auto["step_s_1gbit"] / local
        out.append({"target": "dad-auto step at 1 Gbit/s <= 1.15 x no-communication step", "value": ratio,
                    "limit": 1.15, "met": ratio <= 1.15,
                    "detail": f"{auto['step_s_1gbit'] * 1e3:.1f} ms vs {local * 1e3:.1f} ms (local, same phase)"})
    if "powersgd" in by:
        ratio = auto["final_loss"] / by["powersgd"]["final_loss"]
        out.append({"target": "dad-auto held-out loss <= 1.01 x PowerSGD's", "value": ratio, "limit": 1.01,
                    "met": ratio <= 1.01, "detail": f"{auto['final_loss']:.4f} vs {by['powersgd']['final_loss']:.4f}"})
    return out


def check_targets(records: List[dict], phases: Dict[str, Optional[dict]]) -> List[dict]:
    by = {r["method"]: r for r in records}
    out = auto_targets(records)
    if "dad-rank" not in by:
        return out
    dr = by["dad-rank"]
    ar = by.get("allreduce")
    ps = by.get("powersgd")
    t1 = dr.get("step_s_1gbit")
    local_1g = dr.get("step_s_local_1gbit")
    if t1 is not None and local_1g:
        out.append({"target": "dad-rank step at 1 Gbit/s <= 1.15 x no-communication step",
                    "value": t1 / local_1g, "limit": 1.15, "met": t1 / local_1g <= 1.15,
                    "detail": f"{t1:.4f} s vs {local_1g:.4f} s (local, same phase)"})
    if t1 is not None and ps and ps.get("step_s_1gbit") is not None:
        out.append({"target": "dad-rank step at 1 Gbit/s < PowerSGD's", "value": t1 / ps["step_s_1gbit"],
                    "limit": 1.0, "met": t1 < ps["step_s_1gbit"],
                    "detail": f"{t1:.4f} s vs {ps['step_s_1gbit']:.4f} s"})
    if ar:
        ratio = dr["bytes_per_step"] / ar["bytes_per_step"]
        out.append({"target": "dad-rank bytes <= 1/20 of fp32 all-reduce", "value": ratio, "limit": 0.05,
                    "met": ratio <= 0.05, "detail": f"{dr['bytes_per_step']:,.0f} vs {ar['bytes_per_step']:,.0f} B"})
        rel = abs(dr["final_loss"] - ar["final_loss"]) / ar["final_loss"]
        out.append({"target": "dad-rank final loss within 2% of all-reduce's", "value": rel, "limit": 0.02,
                    "met": rel <= 0.02, "detail": f"{dr['final_loss']:.4f} vs {ar['final_loss']:.4f}"})
    loop = phases["loopback"]
    if "dad-auto" in by:
        worst, where = 0.0, None
        for r in _per_rank(loop, "dad-auto"):
            layers: Dict[str, List[float]] = {}  # weight + bias (an exact unit's bias rides free)
            for p in r.get("report", []):
                if p["representation"] != "overhead":
                    acc = layers.setdefault(p["name"].rsplit(".", 1)[0], [0.0, 0.0])
                    acc[0] += p["sent"]
                    acc[1] += p["allreduce"]
            for name, (sent, ar) in layers.items():
                if sent - ar > worst + 1e-6:
                    worst, where = sent - ar, name
        out.append({"target": "dad-auto never sends more than all-reduce on any layer", "value": worst,
                    "limit": 0.0, "met": worst <= 1e-6 * 1,
                    "detail": "largest excess 0 B" if where is None else f"{worst:.0f} B on {where}"})
    return out


def _fmt_s(v: Optional[float]) -> str:
    return "null" if v is None else f"{v * 1000:.1f} ms"


def markdown_table(records: List[dict]) -> str:
    ar = next((r["bytes_per_step"] for r in records if r["method"] == "allreduce"), None)
    head = ("| method | bytes/step/rank | x all-reduce | step loopback | step 10 Gbit/s | step 1 Gbit/s "
            "| step 100 Mbit/s | step local | compute overhead | peak mem | final loss |")
    lines = [head, "|" + "---|" * 11]
    for r in records:
        ratio = f"{r['bytes_per_step'] / ar:.4f}" if ar else "-"
        mem = "-" if r["peak_mem_mb"] is None else f"{r['peak_mem_mb']:.0f} MB"
        over = "-" if r["compute_overhead_s"] is None else f"{r['compute_overhead_s'] * 1000:+.1f} ms"
        lines.append(f"| {r['method']} | {fmt_bytes(r['bytes_per_step'])} | {ratio} | {_fmt_s(r['step_s_loopback'])} "
                     f"| {_fmt_s(r.get('step_s_10gbit'))} | {_fmt_s(r['step_s_1gbit'])} | {_fmt_s(r['step_s_100mbit'])} "
                     f"| {_fmt_s(r['step_s_local'])} "
                     f"| {over} | {mem} | {r['final_loss']:.4f} |")
    return "\n".join(lines)


def quartile_table(records: List[dict]) -> str:
    """Steady steps' lower quartile per link (slowest rank): each method's step with the
    background load's on/off modes split (`workload.lower_quartile`)."""
    lines = ["| method | " + " | ".join(f"lower quartile {n}" for n in NETS) + " |", "|" + "---|" * (len(NETS) + 1)]
    for r in records:
        lines.append(f"| {r['method']} | " + " | ".join(_fmt_s(r.get(f"step_lq_s_{n}")) for n in NETS) + " |")
    return "\n".join(lines)


def plots(records: List[dict], phases: Dict[str, Optional[dict]], out: Path) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["method"] for r in records]
    files = []
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, [r["bytes_per_step"] for r in records], color="tab:blue")
    ax.set_yscale("log")
    ax.set_ylabel("bytes sent per rank per step")
    ax.set_title("Bytes on the wire (2 ranks)")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(out / "compare_bytes.png", dpi=110)
    plt.close(fig)
    files.append("compare_bytes.png")

    fig, ax = plt.subplots(figsize=(8, 3.8))
    nets = [n for n in NETS if any(r.get(f"step_s_{n}") is not None for r in records)]
    width = 0.8 / max(len(nets), 1)
    for i, net in enumerate(nets):
        ax.bar([x + i * width for x in range(len(names))],
               [(r.get(f"step_s_{net}") or 0) * 1000 for r in records], width, label=net)
    if records[0]["step_s_local"]:
        ax.axhline(records[0]["step_s_local"] * 1000, color="k", ls="--", lw=1, label="no communication")
    ax.set_xticks([x + width * (len(nets) - 1) / 2 for x in range(len(names))], names, rotation=30)
    ax.set_yscale("log")
    ax.set_ylabel("median step time (ms)")
    ax.legend(fontsize=8)
    ax.set_title("Step time by link")
    fig.tight_layout()
    fig.savefig(out / "compare_step_time.png", dpi=110)
    plt.close(fig)
    files.append("compare_step_time.png")

    fig, ax = plt.subplots(figsize=(7, 3.5))
    loop = phases["loopback"]
    for m in names:
        losses = _per_rank(loop, m)[0]["losses"]
        ax.plot(range(1, len(losses) + 1), losses, label=m, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (rank 0)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "compare_loss.png", dpi=110)
    plt.close(fig)
    files.append("compare_loss.png")

    # time-to-loss: training loss (rank 0, 5-step running mean) against its cumulative step time
    ran = [n for n in NETS if phases.get(n)]
    fig, axes = plt.subplots(1, len(ran), figsize=(4.2 * len(ran), 3.6), squeeze=False)
    for ax, net in zip(axes[0], ran):
        for m in names:
            r = _per_rank(phases[net], m)[0]
            if not r.get("times"):
                continue
            clock, total = [], 0.0
            for t in r["times"]:
                total += t
                clock.append(total)
            losses = r["losses"]
            smooth = [sum(losses[max(0, i - 4):i + 1]) / len(losses[max(0, i - 4):i + 1]) for i in range(len(losses))]
            ax.plot(clock, smooth, label=m, lw=1)
        ax.set(xlabel="wall-clock seconds (sum of step times)", ylabel="training loss", title=net)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "compare_time_to_loss.png", dpi=110)
    plt.close(fig)
    files.append("compare_time_to_loss.png")
    return files


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._phase:
        run_phase_inside(args._spec)
        return 0
    if "loopback" not in args.nets:
        args.nets.insert(0, "loopback")  # losses, bytes and the local step come from it
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    phases: Dict[str, Optional[dict]] = {n: None for n in NETS}
    skipped: Dict[str, str] = {}
    # every condition in a namespace of its own where that is allowed, the unshaped one too
    args.namespace_ok = net_shaping.probe("1gbit")[0]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dad-compare-") as work:
        for net in NETS:
            if net not in args.nets:
                skipped[net] = "not requested (--nets)"
                continue
            if net != "loopback":
                ok, why = net_shaping.probe(net)
                if not ok:
                    skipped[net] = why
                    print(f"[compare] skipping the {net} column: cannot shape a private loopback here: {why}",
                          flush=True)
                    continue
            print(f"[compare] {net}: running {len(args.methods)} methods on 2 ranks ...", flush=True)
            phases[net] = run_phase(args, net, work)
            print(f"[compare] {net}: done in {phases[net]['wall_s']:.0f} s "
                  f"(measured link: {phases[net]['link_bytes_per_s'] * 8 / 1e6:.0f} Mbit/s per rank in an "
                  f"all-gather)", flush=True)
    records = assemble(args, phases, skipped)
    targets = check_targets(records, phases)
    table = markdown_table(records)
    meta = {"settings": args.settings, "preset": args.preset, "lr": args.lr, "seed": args.seed, "load": args.load,
            "dad_error_feedback": not args.dad_no_error_feedback, "skipped": skipped,
            "link_bytes_per_s": {n: p["link_bytes_per_s"] for n, p in phases.items() if p},
            "phase_wall_s": {n: p["wall_s"] for n, p in phases.items() if p},
            "total_wall_s": time.perf_counter() - started, "targets": targets,
            "phases": phases}
    with open(out / "compare_details.json", "w") as fh:
        json.dump({"records": records, "meta": meta}, fh, indent=1)
    lines = [table, "", quartile_table(records), ""]
    for net, why in skipped.items():
        lines.append(f"- column {net}: skipped ({why})")
    if args.load:
        for net, p in phases.items():
            if p and p.get("load"):
                lines.append(f"- background load on {net}: bursty CPU hog, {p['load']['bursts']} bursts, busy "
                             f"{p['load']['busy_s']:.0f} s of {p['load']['total_s']:.0f} s")
    for net, p in phases.items():
        for m in args.methods:
            for t in (_per_rank(p, m)[0].get("trials", []) if p else []):
                lines.append(f"- {m} route trial on {net} (refresh step {t['step']}): {t['compressed']} weights "
                             f"compressed {t['routes_s'] * 1e3:.1f} ms/step, all dense {t['dense_s'] * 1e3:.1f} "
                             f"ms/step (routes faster in {t.get('routes_won', '?')} of {t.get('pairs', '?')} pairs): "
                             f"{'routes kept' if t['kept'] else 'all dense'}")
    for t in targets:
        lines.append(f"- {'MET ' if t['met'] else 'MISSED'} {t['target']}: {t['value']:.4g} (limit {t['limit']}); "
                     f"{t['detail']}")
    text = "\n".join(lines)
    (out / "compare.md").write_text(text + "\n")
    if not args.no_plots:
        plots(records, phases, out)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as fh:
            json.dump(records, fh, indent=1)
    print(text, flush=True)
    print(f"[compare] total {time.perf_counter() - started:.0f} s; details in {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
