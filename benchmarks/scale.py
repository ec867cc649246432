"""dAD at 124 M and 307 M parameters: attach, steps, memory, bytes and routes against DDP and PowerSGD.

    python -m benchmarks.scale [--quick|--smoke] [--models gpt2-124m,llama-307m] [--out DIR]

Two gloo ranks on loopback, fp32, 1 x 128 byte tokens a rank (stdlib source, no downloads), models
built from configs: GPT-2 small (transformers' ``GPT2Config()``, 124 M) and a Llama with
TinyLlama's shapes and 4 layers (307 M). Each model runs in 2 fresh rank processes
(`benchmarks._scale_ranks`), one model after the other.

Methods, each as DDP's communication hook:
  allreduce          DDP's all-reduce, DDP's default 25 MB buckets (the engine)
  powersgd           PyTorch's PowerSGD hook, rank 4, error feedback and warm start, compressing after
                     as many all-reduced steps as dAD's ``lossless_steps`` (10); one DDP bucket (several
                     hang on gloo)
  dad-auto           `register_dad_comm_hook` with the config at its defaults (``mode="auto"``: the link
                     measured at attach, routes by time), DDP's default buckets
  dad-auto-100mbit   auto, rank 4, a stated link of 100 Mbit/s (the byte guarantee's case), one bucket

Per method (`results/scale.json`, `results/scale.md`):
  attach_s           the registration call (dAD: its link probe and compute model included), timed
                     beside the others and alone (``attach_alone_s``)
  times              every step's time from the first; for dad-auto, per step against all-reduce's
                     step of the same turn: the largest and the median ratio (issue 38's target: none
                     above 1.10)
  peak_rss_mb        the rank's peak RSS with the method alone (attach and ``mem_steps`` steps),
                     against all-reduce's
  bytes              sent per rank and step (last step and mean after the warm-up), against all-reduce's
                     and PowerSGD's; for dAD per weight against what PowerSGD's hook sends for it
  routes             weights per representation in dAD's last step (and every step's)

Memory: two ranks of the 307 M model hold about 3.7 GB each per method with SGD (weights, gradients,
DDP's bucket), so ``--together`` methods are alive at a time and take turns (by default 2 at 124 M;
at 307 M 1: each method alone, one after the other); SGD instead of AdamW for the same reason.
FSDP2 and ZeRO-3 are not run here (`benchmarks.sharded_memory` measures them at small widths).
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
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks._scale_ranks import METHODS, _groups
from benchmarks.workload import fmt_bytes, median

ROOT = Path(__file__).resolve().parents[1]

MODELS = {
    # transformers' GPT-2 small: 50257 x 768, 12 layers (124 M)
    "gpt2-124m": {"kind": "gpt2", "config": {}, "together": 2},
    # TinyLlama's shapes, 4 layers (307 M)
    "llama-307m": {"kind": "llama", "config": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                                   num_hidden_layers=4, num_attention_heads=32,
                                                   num_key_value_heads=4), "together": 1},
    # the same code path at tiny widths (tests)
    "gpt2-tiny": {"kind": "gpt2", "config": dict(vocab_size=256, n_positions=64, n_embd=32, n_layer=1, n_head=2)},
    "llama-tiny": {"kind": "llama", "config": dict(vocab_size=256, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=1, num_attention_heads=4,
                                                   num_key_value_heads=2, max_position_embeddings=64), "together": 1},
}

PRESETS = {
    # ~15 minutes on 2 shared cores: dAD's 10 lossless steps and a route trial inside the 20 steps
    "default": dict(models=("gpt2-124m", "llama-307m"), steps=20, mem_steps=12, seq=128),
    # a few minutes: GPT-2 small only
    "quick": dict(models=("gpt2-124m",), steps=12, mem_steps=2, seq=128),
    # seconds: tests
    "smoke": dict(models=("gpt2-tiny", "llama-tiny"), steps=2, mem_steps=1, seq=32),
}
RATIO_LIMIT = 1.10
WARM = 10  # dAD's lossless steps at the config's default, and PowerSGD's all-reduced steps here


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_const", dest="preset", const="quick", help="GPT-2 small only, few steps")
    g.add_argument("--smoke", action="store_const", dest="preset", const="smoke", help="tiny widths (tests)")
    p.set_defaults(preset="default")
    p.add_argument("--models", help=f"comma-separated subset of {tuple(MODELS)}")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {METHODS}")
    p.add_argument("--steps", type=int, help="timed steps per method")
    p.add_argument("--mem-steps", type=int, help="steps of each method alone for its peak RSS (0: none)")
    p.add_argument("--together", type=int, help="methods alive at a time (memory; the model's default: 2 at "
                   "124 M, 1 at 307 M); 1: each alone, no turns, its peak read from its steps")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for scale.json and scale.md")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per model")
    args = p.parse_args(argv)
    preset = PRESETS[args.preset]
    args.models = [m.strip() for m in args.models.split(",")] if args.models else list(preset["models"])
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODELS] + [m for m in args.methods if m not in METHODS]
    if bad:
        p.error(f"unknown models or methods: {bad}")
    if args.together is not None and args.together < 1:
        p.error("--together must be at least 1")
    args.steps = preset["steps"] if args.steps is None else args.steps
    args.mem_steps = preset["mem_steps"] if args.mem_steps is None else args.mem_steps
    args.seq = preset["seq"]
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _uptime() -> str:
    try:
        with open("/proc/loadavg") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "unknown"


def together(args, name: str) -> int:
    """Methods alive at a time for model ``name``: ``--together``, else the model's own default
    (2 of the 307 M model's methods take about 15 GB on two ranks; 1: each alone)."""
    return args.together if args.together is not None else MODELS[name].get("together", 2)


def run_model(args, name: str, workdir: str) -> dict:
    """Spawn 2 rank processes for one model; their gathered per-rank results."""
    out = os.path.join(workdir, f"{name}.json")
    spec = {"model": MODELS[name], "methods": args.methods, "steps": args.steps, "mem_steps": args.mem_steps,
            "together": together(args, name), "rank": args.rank, "lr": args.lr, "seed": args.seed, "batch": 1,
            "seq": args.seq, "powersgd_warmup": WARM, "out": out, "timeout_s": args.timeout}
    spec_file = os.path.join(workdir, f"{name}.spec.json")
    with open(spec_file, "w") as fh:
        json.dump(spec, fh)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    from benchmarks.cpu_load import die_with_parent

    proc = subprocess.run([sys.executable, "-m", "benchmarks.scale", "--_ranks", spec_file], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=args.timeout, preexec_fn=die_with_parent)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    with open(out) as fh:
        return json.load(fh)


def _spawn(spec_file: str) -> None:
    import torch.multiprocessing as mp

    from benchmarks._scale_ranks import rank_main

    with open(spec_file) as fh:
        spec = json.load(fh)
    mp.spawn(rank_main, args=(2, _free_port(), spec), nprocs=2, join=True)


def summarise(ranks: Dict[str, dict], methods: List[str], warm: int) -> dict:
    """Per method over both ranks: the slower rank's step times, the larger peak, mean bytes."""
    per = [ranks[r] for r in sorted(ranks)]
    out: Dict[str, dict] = {}
    for m in methods:
        recs = [p[m] for p in per]
        times = [max(ts) for ts in zip(*(r["times"] for r in recs))]
        sent = [sum(s) / len(s) for s in zip(*(r["sent_by_step"] for r in recs))]
        peaks = [r["peak_rss_mb"] for r in recs if r.get("peak_rss_mb") is not None]
        steady = sent[warm:] or sent
        rec = {"n_params": recs[0]["n_params"], "bucket_mb": recs[0]["bucket_mb"],
               "attach_s": max(r["attach_s"] for r in recs), "ddp_wrap_s": max(r["ddp_wrap_s"] for r in recs),
               "attach_alone_s": max((r["attach_alone_s"] for r in recs if "attach_alone_s" in r), default=None),
               "times": times, "step_s_median": median(times), "peak_rss_mb": max(peaks) if peaks else None,
               "bytes_by_step": sent, "bytes_last": sent[-1], "bytes_steady": sum(steady) / len(steady),
               "losses": recs[0]["losses"], "group": recs[0]["group"]}
        r0 = recs[0]
        if "routes_by_step" in r0:
            rec.update(routes=r0["routes_by_step"][-1] if r0["routes_by_step"] else {},
                       routes_by_step=r0["routes_by_step"], decision=r0.get("decision", ""),
                       links=r0.get("links", {}), trials=r0.get("trials", []))
            weights = r0.get("weights", [])
            over = [w for w in weights if w["sent"] > w["powersgd"] * (1 + 1e-9)]
            rec.update(weights_over_powersgd=[{k: w[k] for k in ("name", "shape", "representation", "sent",
                                                                 "powersgd")} for w in over],
                       powersgd_bytes_model=sum(w["powersgd"] for w in weights),
                       allreduce_bytes_model=sum(w["allreduce"] for w in weights))
        out[m] = rec
    return out


def targets(methods: Dict[str, dict]) -> List[dict]:
    """Issue 38's checks on one model: dad-auto's steps against all-reduce's (same turn), its
    peak against all-reduce's, dad-auto-100mbit's bytes against PowerSGD's (total and per weight)."""
    out = []
    ar, auto, slow, psgd = (methods.get(k) for k in ("allreduce", "dad-auto", "dad-auto-100mbit", "powersgd"))
    if ar and auto:
        ratios = [a / b for a, b in zip(auto["times"], ar["times"])]
        worst = max(range(len(ratios)), key=ratios.__getitem__)
        out.append({"target": f"dad-auto: no step above {RATIO_LIMIT:.2f} x all-reduce's (same turn)",
                    "value": ratios[worst], "median": median(ratios), "ratios": ratios,
                    "met": ratios[worst] <= RATIO_LIMIT,
                    "detail": f"worst step {worst}: {auto['times'][worst]:.2f} s vs {ar['times'][worst]:.2f} s; "
                              f"median ratio {median(ratios):.3f}"})
        if ar["peak_rss_mb"] and auto["peak_rss_mb"]:
            out.append({"target": "dad-auto peak RSS / all-reduce's", "value": auto["peak_rss_mb"] / ar["peak_rss_mb"],
                        "met": None, "detail": f"{auto['peak_rss_mb']:.0f} MB vs {ar['peak_rss_mb']:.0f} MB"})
    compressed = slow is not None and len(slow["times"]) > WARM  # both past their uncompressed warm-up
    if slow and psgd and compressed:
        ratio = slow["bytes_last"] / psgd["bytes_last"] if psgd["bytes_last"] else None
        out.append({"target": "dad-auto-100mbit bytes <= PowerSGD's (last step, counted)", "value": ratio,
                    "met": None if ratio is None else ratio <= 1.0,
                    "detail": f"{slow['bytes_last']:,.0f} B vs {psgd['bytes_last']:,.0f} B"})
    if slow and not compressed:
        out.append({"target": "dad-auto-100mbit bytes against PowerSGD's", "value": None, "met": None,
                    "detail": f"not compared: the last step is inside the {WARM} uncompressed warm-up steps"})
    if slow and compressed:
        over = slow.get("weights_over_powersgd", [])
        out.append({"target": "dad-auto-100mbit: no weight above PowerSGD's bytes for it", "value": len(over),
                    "met": not over, "detail": ", ".join(f"{w['name']} {w['sent']:,.0f} B vs {w['powersgd']:,.0f} B"
                                                         for w in over[:5]) or "none"})
    return out


def _s(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f} s"


def markdown(result: dict) -> str:
    lines = ["# Scale: 124 M and 307 M parameters", "",
             f"Command: `{result['command']}`. 2 gloo ranks on loopback, fp32, 1 x {result['seq']} byte tokens a "
             f"rank, SGD (lr {result['lr']}), {result['steps']} timed steps per method.",
             f"Machine load (1/5/15-min averages): before {result['load_before']}, after {result['load_after']}; "
             f"wall time {result['wall_s']:.0f} s.", ""]
    for name, model in result["models"].items():
        ms = model["methods"]
        ar = ms.get("allreduce")
        ps = ms.get("powersgd")
        n = next(iter(ms.values()))["n_params"]
        k = model["together"]
        how = (f"Methods in turns, {k} alive at a time ({', '.join('/'.join(g) for g in _groups(list(ms), k))}); "
               f"peak RSS from {result['mem_steps']} steps of each method alone." if k > 1 else
               "Each method alone, one after the other (no turns: memory); peak RSS from its timed steps.")
        lines += [f"## {name} ({n / 1e6:.0f} M parameters)", "", how, "",
                  "| method | attach (turns / alone) | step median | max step | peak RSS (x all-reduce) "
                  "| bytes/step last (x all-reduce, x PowerSGD) | routes (last step) |",
                  "|---|---|---|---|---|---|---|"]
        for m, r in ms.items():
            peak = "-" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb']:.0f} MB"
            if r["peak_rss_mb"] and ar and ar["peak_rss_mb"]:
                peak += f" ({r['peak_rss_mb'] / ar['peak_rss_mb']:.2f})"
            rel = []
            for ref in (ar, ps):
                rel.append(f"{r['bytes_last'] / ref['bytes_last']:.3f}" if ref and ref["bytes_last"] else "-")
            routes = ", ".join(f"{k} {v}" for k, v in sorted(r.get("routes", {}).items())) or "-"
            attach = f"{_s(r['attach_s'])} / {_s(r['attach_alone_s'])}"
            lines.append(f"| {m} | {attach} | {_s(r['step_s_median'])} "
                         f"| {_s(max(r['times']))} | {peak} | {fmt_bytes(r['bytes_last'])} ({rel[0]}, {rel[1]}) "
                         f"| {routes} |")
        lines += ["", "Steps (s, slower rank, from the first):", ""]
        for m, r in ms.items():
            lines.append(f"- {m}: " + " ".join(f"{t:.2f}" for t in r["times"]))
        lines += ["", "| check | value | met | detail |", "|---|---|---|---|"]
        for t in model["targets"]:
            v = t["value"]
            val = "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
            met = "-" if t["met"] is None else ("yes" if t["met"] else "**no**")
            lines.append(f"| {t['target']} | {val} | {met} | {t['detail']} |")
        for m, r in ms.items():
            if r.get("decision"):
                lines += ["", f"{m}'s last decision: {r['decision']}"]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    result = {"command": "python -m benchmarks.scale " + " ".join(argv if argv is not None else sys.argv[1:]),
              "seq": args.seq, "lr": args.lr, "steps": args.steps, "mem_steps": args.mem_steps,
              "rank": args.rank, "load_before": _uptime(), "models": {}}
    warm = WARM + 2  # bytes' steady mean: after the warm-up and PowerSGD's first compressed step
    with tempfile.TemporaryDirectory() as work:
        for name in args.models:
            t0 = time.perf_counter()
            ranks = run_model(args, name, work)
            methods = summarise(ranks, args.methods, warm)
            result["models"][name] = {"methods": methods, "targets": targets(methods),
                                      "together": together(args, name), "wall_s": time.perf_counter() - t0,
                                      "load_after": _uptime()}
            print(f"{name}: {time.perf_counter() - t0:.0f} s, load {_uptime()}", flush=True)
            _write(args, result, start)  # after every model: a run cut short keeps what it measured
    print(markdown(result))
    return result


def _write(args, result: dict, start: float) -> None:
    result["load_after"] = _uptime()
    result["wall_s"] = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(result, indent=1))
    (out / "scale.md").write_text(markdown(result))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_ranks":
        _spawn(sys.argv[2])
    else:
        main()
