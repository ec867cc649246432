"""dAD at 124 M and 307 M parameters under DDP, FSDP2 and ZeRO-3: attach, steps, memory, bytes and
routes against each engine's own reduction and PowerSGD, and issue 38's targets.

    python -m benchmarks.scale [--quick|--smoke] [--targets] [--models ...] [--methods ...] [--out DIR]

Two gloo ranks on loopback, fp32, 1 x 128 byte tokens a rank (stdlib source, no downloads), SGD,
models built from configs: GPT-2 small (transformers' ``GPT2Config()``, 124 M) and a Llama with
TinyLlama's shapes and 4 layers (307 M). Each model runs in 2 fresh rank processes
(`benchmarks._scale_ranks`), one model after the other; the methods are
`benchmarks._scale_engines`'s: per engine its plain run (allreduce, fsdp2, zero3) and dAD in it
(``dad-auto`` at the config's defaults, ``-100mbit`` at a stated 100 Mbit/s), and PowerSGD's hook.

A preset is a plan: per model its groups of methods and each group's steps. The methods of a group
take turns step by step (side by side, so that load from elsewhere falls on all alike); groups run one
after the other. The default plan (about 10 minutes on a quiet 2-core machine, about 15 GB of memory:
two 307 M DDP methods alive together) measures what `--targets` judges:

  gpt2-124m   allreduce + dad-auto, 20 steps in turns        (fast link)
              powersgd + dad-auto-100mbit, 12 steps in turns (bytes against the hook)
  llama-307m  allreduce + dad-auto, 20 steps in turns        (fast link, attach)
              dad-auto-100mbit, 12 steps                     (bytes)
              fsdp2, fsdp2-dad-auto-100mbit, zero3, zero3-dad-auto-100mbit, 12 steps each, alone
                                                             (memory; bytes)

12 steps: past dAD's 10 lossless steps (the rank routes and their residuals exist from the 11th) and
PowerSGD's 10 all-reduced ones. 20 steps: the lossless steps and a route trial after them.

Per method (`results/scale.json`, `results/scale.md`):
  attach_s       the registration of dAD (its link probe and compute model included) or of DDP's hook;
                 ``wrap_s`` the engine's own wrapping (DDP, ``fully_shard``, ``deepspeed.initialize``)
  times          every step's time from the first (slower rank)
  step ratio     per step against the engine's plain run of the same index: the largest, at which
                 step, and the median; "turns" where the two took turns
  peak_rss_mb    the rank's peak RSS (VmHWM) with the method alone: from its steps where it is alone
                 in its group, else from ``mem_steps`` steps of it alone before the groups run
  bytes          the gradients' synchronisation per rank and step (`benchmarks._scale_engines`), last
                 step, against the plain run's and PowerSGD's (DDP's measured hook where it ran beside,
                 else the per-weight model of what the hook sends, summed)
  routes         weights per representation in dAD's last step (and every step's)

`--targets` prints each of issue 38's targets with its measured value and PASS / FAIL
(`benchmarks._scale_checks`), and exits with status 1 if one fails. The figures are a machine's:
run it on a quiet one.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from benchmarks._scale_checks import WARM, method_checks, target_lines, targets
from benchmarks._scale_engines import ENGINES, METHODS, PLAIN, engine_of
from benchmarks.workload import fmt_bytes, median

ROOT = Path(__file__).resolve().parents[1]

MODELS = {
    # transformers' GPT-2 small: 50257 x 768, 12 layers (124 M)
    "gpt2-124m": {"kind": "gpt2", "config": {}},
    # TinyLlama's shapes, 4 layers (307 M)
    "llama-307m": {"kind": "llama", "config": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                                   num_hidden_layers=4, num_attention_heads=32,
                                                   num_key_value_heads=4)},
    # the same code paths at tiny widths (tests)
    "gpt2-tiny": {"kind": "gpt2", "config": dict(vocab_size=256, n_positions=64, n_embd=32, n_layer=1, n_head=2)},
    "llama-tiny": {"kind": "llama", "config": dict(vocab_size=256, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=1, num_attention_heads=4,
                                                   num_key_value_heads=2, max_position_embeddings=64)},
}

RANK_ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TOKENIZERS_PARALLELISM": "false"}
Group = Tuple[Tuple[str, ...], int]  # methods taking turns, steps
FAST = (("allreduce", "dad-auto"), 20)  # the lossless steps and a route trial after them
SHARDED_ALONE: List[Group] = [(("fsdp2",), 12), (("fsdp2-dad-auto-100mbit",), 12), (("zero3",), 12),
                              (("zero3-dad-auto-100mbit",), 12)]
PRESETS = {
    # issue 38's targets: about 10 minutes on a quiet 2-core machine
    "default": dict(seq=128, mem_steps=0, plans={
        "gpt2-124m": [FAST, (("powersgd", "dad-auto-100mbit"), 12)],
        "llama-307m": [FAST, (("dad-auto-100mbit",), 12)] + SHARDED_ALONE}, models=("gpt2-124m", "llama-307m")),
    # a few minutes: GPT-2 small under every engine
    "quick": dict(seq=128, mem_steps=0, plans={
        "gpt2-124m": [(("allreduce", "dad-auto"), 12), (("powersgd", "dad-auto-100mbit"), 12)] + SHARDED_ALONE},
                  models=("gpt2-124m",)),
    # seconds, one launch for both models (tests): every engine's code path, in turns and alone
    "smoke": dict(seq=32, mem_steps=1, one_launch=True, plans={
        "gpt2-tiny": [(("allreduce", "dad-auto"), 2), (("powersgd", "dad-auto-100mbit"), 2)],
        "llama-tiny": [(("fsdp2",), 2), (("fsdp2-dad-auto-100mbit",), 2), (("zero3",), 2), (("zero3-dad-auto",), 2)]},
                  models=("gpt2-tiny", "llama-tiny")),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_const", dest="preset", const="quick", help="GPT-2 small only, 12 steps")
    g.add_argument("--smoke", action="store_const", dest="preset", const="smoke", help="tiny widths (tests)")
    p.set_defaults(preset="default")
    p.add_argument("--targets", action="store_true", help="print issue 38's targets, PASS / FAIL (exit 1 on a FAIL)")
    p.add_argument("--models", help=f"comma-separated subset of {tuple(MODELS)} (a model outside the preset's "
                   "plan gets its longest plan)")
    p.add_argument("--methods", help=f"comma-separated subset of {tuple(METHODS)} (one not in the plan runs alone)")
    p.add_argument("--steps", type=int, help="steps of every group (default: the plan's)")
    p.add_argument("--mem-steps", type=int, help="steps of each method of a group of several alone, for its "
                   "peak RSS (0: none)")
    p.add_argument("--together", type=int, help="regroup: at most this many methods of one engine in turns "
                   "(1: every method alone)")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for scale.json and scale.md")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    args = p.parse_args(argv)
    preset = PRESETS[args.preset]
    args.models = [m.strip() for m in args.models.split(",")] if args.models else list(preset["models"])
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    bad = [m for m in args.models if m not in MODELS] + [m for m in methods or () if m not in METHODS]
    if bad:
        p.error(f"unknown models or methods: {bad}")
    if args.together is not None and args.together < 1:
        p.error("--together must be at least 1")
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be at least 1")
    fallback = max(preset["plans"].values(), key=len)  # for a model outside the plan: its longest
    args.plans = {m: plan_groups(preset["plans"].get(m, fallback), methods, args.steps, args.together)
                  for m in args.models}
    args.mem_steps = preset["mem_steps"] if args.mem_steps is None else args.mem_steps
    args.seq = preset["seq"]
    args.one_launch = preset.get("one_launch", False)
    return args


def plan_groups(plan: Sequence[Group], methods: Optional[List[str]], steps: Optional[int],
                together: Optional[int]) -> List[dict]:
    """A model's groups (``{"methods", "steps"}``) from a preset's ``plan``: only ``methods`` (those
    outside the plan alone, at the plan's most steps), every group at ``steps``, or regrouped by
    engine, at most ``together`` methods in turns (each engine's plain method first)."""
    most = max(n for _, n in plan)
    groups = [(list(ms), n) for ms, n in plan]
    if methods is not None:
        planned = {m for ms, _ in groups for m in ms}
        groups = [([m for m in ms if m in methods], n) for ms, n in groups]
        groups += [([m], most) for m in methods if m not in planned]
        groups = [(ms, n) for ms, n in groups if ms]
    if together is not None:
        flat = [m for ms, _ in groups for m in ms]
        groups = []
        for engine in ENGINES:
            mine = sorted((m for m in flat if engine_of(m) == engine), key=lambda m: m != PLAIN[engine])
            groups += [(mine[i:i + together], most) for i in range(0, len(mine), together)]
    return [{"methods": ms, "steps": steps or n} for ms, n in groups]


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


def launch(args, plans: List[Tuple[str, List[dict]]], workdir: str) -> Dict[str, dict]:
    """Spawn 2 fresh rank processes for ``plans``, (model, its groups) run one after the other; per
    model their gathered per-rank results. Ranks that outlive ``args.timeout`` are ended and reported."""
    import torch.multiprocessing as mp

    from benchmarks._scale_ranks import rank_main

    names = [n for n, _ in plans]
    out = os.path.join(workdir, f"{names[0]}.json")
    runs = [{"name": n, "model": MODELS[n], "groups": groups} for n, groups in plans]
    spec = {"runs": runs, "mem_steps": args.mem_steps, "rank": args.rank, "lr": args.lr, "seed": args.seed,
            "batch": 1, "seq": args.seq, "powersgd_warmup": WARM, "out": out, "timeout_s": args.timeout}
    # the ranks' environment (spawned, they inherit it and this process' sys.path): one thread each,
    # gloo on loopback; this process' own is restored once they have started
    saved = {k: os.environ.get(k) for k in RANK_ENV}
    os.environ.update(RANK_ENV)
    try:
        ctx = mp.spawn(rank_main, args=(2, _free_port(), spec), nprocs=2, join=False)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    deadline = time.monotonic() + args.timeout
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise RuntimeError(f"{names}: ranks still running after {args.timeout:.0f} s")
    if not os.path.exists(out):
        raise RuntimeError(f"{names}: the ranks ended without results")
    with open(out) as fh:
        return json.load(fh)


def summarise(ranks: Dict[str, dict], warm: int) -> dict:
    """Per method over both ranks: the slower rank's step times, the larger peak, mean bytes."""
    per = [ranks[r] for r in sorted(ranks)]
    out: Dict[str, dict] = {}
    for m in per[0]:
        recs = [p[m] for p in per]
        times = [max(ts) for ts in zip(*(r["times"] for r in recs))]
        sent = [sum(s) / len(s) for s in zip(*(r["sent_by_step"] for r in recs))]
        peaks = [r["peak_rss_mb"] for r in recs if r.get("peak_rss_mb") is not None]
        steady = sent[warm:] or sent
        rec = {"engine": recs[0]["engine"], "n_params": recs[0]["n_params"], "bucket_mb": recs[0]["bucket_mb"],
               "attach_s": max(r["attach_s"] for r in recs), "wrap_s": max(r["wrap_s"] for r in recs),
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


def _s(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _x(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3f}"


def markdown(result: dict) -> str:
    lines = ["# Scale: 124 M and 307 M parameters under DDP, FSDP2 and ZeRO-3", "",
             f"Command: `{result['command']}`. 2 gloo ranks on loopback, fp32, 1 x {result['seq']} byte tokens a "
             f"rank, SGD (lr {result['lr']}).",
             f"Machine load (1/5/15-min averages): before {result['load_before']}, after {result['load_after']}; "
             f"wall time {result['wall_s']:.0f} s.", ""]
    if result.get("targets"):
        lines += ["## Issue 38's targets", "", "| target | value | limit | verdict | detail |", "|---|---|---|---|---|"]
        for t in result["targets"]:
            v = t["value"]
            val = "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
            verdict = "not run" if t["met"] is None else ("PASS" if t["met"] else "**FAIL**")
            lines.append(f"| {t['target']} | {val} | {t['limit']} | {verdict} | {t['detail']} |")
        lines.append("")
    for name, model in result["models"].items():
        ms, checks = model["methods"], model["checks"]
        n = next(iter(ms.values()))["n_params"]
        groups = "; ".join(f"{'/'.join(g['methods'])} ({g['steps']} steps)" for g in model["groups"])
        lines += [f"## {name} ({n / 1e6:.0f} M parameters)", "", f"Groups (methods in turns): {groups}.", "",
                  "| method | engine | attach (group / alone) | wrap | step median | max step ratio (step) "
                  "| peak RSS (x plain) | bytes/step last (x plain, x PowerSGD) | routes (last step) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for m, r in ms.items():
            c = checks.get(m, {})
            step = c.get("step")
            ratio = "-" if step is None else (f"{step['max']:.3f} ({step['step']}"
                                              f"{', turns' if step['same_turn'] else ''})")
            peak = "-" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb']:.0f} MB ({_x(c.get('peak_ratio'))})"
            routes = ", ".join(f"{k} {v}" for k, v in sorted(r.get("routes", {}).items())) or "-"
            lines.append(f"| {m} | {r['engine']} | {_s(r['attach_s'])} / {_s(r['attach_alone_s'])} "
                         f"| {_s(r['wrap_s'])} | {_s(r['step_s_median'])} | {ratio} | {peak} "
                         f"| {fmt_bytes(r['bytes_last'])} ({_x(c.get('bytes_vs_plain'))}, "
                         f"{_x(c.get('bytes_vs_powersgd'))}) | {routes} |")
        lines += ["", "Steps (s, slower rank, from the first):", ""]
        for m, r in ms.items():
            lines.append(f"- {m}: " + " ".join(f"{t:.2f}" for t in r["times"]))
        refs = {m: c["powersgd_ref"] for m, c in checks.items() if c.get("powersgd_ref")}
        if refs:
            lines += ["", "PowerSGD's bytes: " + "; ".join(f"{m} against the {ref}" for m, ref in refs.items()) + "."]
        for m, c in checks.items():
            over = c.get("weights_over_powersgd")
            if over and m.endswith("100mbit"):  # the byte guarantee's case (a fast link may send more)
                lines += ["", f"{m}: {len(over)} weight(s) above PowerSGD's bytes: " + ", ".join(
                    f"{w['name']} {w['sent']:,.0f} B vs {w['powersgd']:,.0f} B" for w in over[:8])]
        for m, r in ms.items():
            if r.get("decision"):
                lines += ["", f"{m}'s last decision: {r['decision']}"]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    result = {"command": "python -m benchmarks.scale " + " ".join(argv if argv is not None else sys.argv[1:]),
              "seq": args.seq, "lr": args.lr, "mem_steps": args.mem_steps, "rank": args.rank,
              "load_before": _uptime(), "models": {}}
    warm = WARM + 2  # bytes' steady mean: after the warm-up and PowerSGD's first compressed step
    if args.one_launch:
        launches = [[(m, args.plans[m]) for m in args.models]]
    else:  # a launch per group: at 307 M an engine's memory is not all given back, so each starts fresh
        launches = [[(m, [g])] for m in args.models for g in args.plans[m]]
    gathered: Dict[str, Dict[str, dict]] = {}  # model -> rank -> method -> record, over its launches
    with tempfile.TemporaryDirectory() as work:
        for plans in launches:
            t0 = time.perf_counter()
            ranks = launch(args, plans, work)
            names = [n for n, _ in plans]
            for name in names:
                for rank, records in ranks[name].items():
                    gathered.setdefault(name, {}).setdefault(rank, {}).update(records)
                methods = summarise(gathered[name], warm)
                result["models"][name] = {"methods": methods, "checks": method_checks(methods),
                                          "groups": args.plans[name], "load_after": _uptime()}
            print(f"{', '.join(names)}: {time.perf_counter() - t0:.0f} s, load {_uptime()}", flush=True)
            result["targets"] = targets(result["models"])
            _write(args, result, start)  # after every launch: a run cut short keeps what it measured
    print(markdown(result))
    if args.targets:
        print("\n".join(["Issue 38's targets:"] + target_lines(result["targets"])))
        if any(t["met"] is False for t in result["targets"]):
            raise SystemExit(1)
    return result


def _write(args, result: dict, start: float) -> None:
    result["load_after"] = _uptime()
    result["wall_s"] = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(result, indent=1))
    (out / "scale.md").write_text(markdown(result))


if __name__ == "__main__":
    main()
