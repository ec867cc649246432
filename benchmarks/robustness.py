"""Does auto choose the faster routes in a real training loop on a busy machine? (issue 25, item 4)

    python -m benchmarks.robustness                 # 3 links x 10 runs; results/robustness.json, .md
    python -m benchmarks.robustness --smoke --nets loopback --runs 1   # seconds: for tests

Per link (loopback, unshaped; 1 Gbit/s and 100 Mbit/s shaped with ``tc tbf``: `net_shaping`),
every link in a private network namespace of its own, the unshaped one too (where namespaces are
not permitted the shaped links are skipped and loopback runs on the host's), one launch of 2 gloo
ranks runs ``--runs`` independent runs. Each run, from fresh models (a seed of its own), attaches
three DDP models of the compare benchmark's byte-level GPT-2 (`benchmarks.workload`), each with
its own DDP and dAD process groups, and dAD as DDP's communication hook:

- ``auto``: ``{"mode": "auto", "rank": 4, "objective": "time", "lossless_steps": 0}``, every other
  key at its default: the link measured on its group at attach, route trials on. ``lossless_steps``
  is 0 so that the first route choice and its trial come at once (with the default, the first
  ``lossless_steps`` steps are all-reduce's and the run would be that much longer);
- ``dense``: the same with a stated fast link ``{"bandwidth": "1000tbit"}``: every weight dense;
- ``compressed``: the same with a stated slow link ``{"bandwidth": "1mbit"}``: every weight by
  the rank routes.

They take turns step by step (the two references' steps spread evenly over auto's), so that the
load falls on all of them alike; before each step the ranks meet at an untimed barrier, so that no
method is charged for the other rank finishing another method's step. Auto's loop is a user's: it
runs a held-out evaluation (``--eval-batches`` forward batches through the DDP model under
``torch.no_grad()``, ``model.eval()``) before every ``--eval-every``-th step. A bursty CPU hog
(`benchmarks.cpu_load`: one core, busy 0.2-2 s, idle 0.2-2 s, seeded) runs beside the ranks in
the same namespace for the whole launch and is killed at its end (``--no-load`` turns it off).

Per run: a step's time is forward to the optimizer's end, the slowest rank's; the ground truth is
the faster of ``dense`` and ``compressed`` by the median of their paired differences (their k-th
steps run back to back, in alternating order, so a burst of load falls on both of a pair; the
first ``--ref-warmup`` pairs left out); auto's choice is whether its last route trial kept the compressed routes
(``sync.route_trials[-1].kept``; with no trial, whether any weight left the dense route), and its
last step's representations are recorded; auto's steady step is the median of its last
``--steady`` steps. ``--steps`` (auto's steps per run) defaults to 1 + 24 + ``--steady``: the first
step, a route trial of up to 24 steps, then the steady steps.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks import net_shaping
from benchmarks.cpu_load import die_with_parent
from benchmarks.workload import Workload, median

NETS = ("loopback", "1gbit", "100mbit")
METHODS = ("auto", "dense", "compressed")
LINKS = {"dense": {"bandwidth": "1000tbit"}, "compressed": {"bandwidth": "1mbit"}}
TRIAL_STEPS = 24   # the longest route trial after the first step that the default --steps allows for
TIE = 0.05         # a wrong choice whose routes are within this share of the faster counts as a near-tie
ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("benchmarks.robustness")

PRESETS = {
    # the compare benchmark's quick workload; ~11-13 min for 3 links x 10 runs on 2 shared cores
    "default": dict(n_embd=256, n_layer=2, n_head=4, seq=64, batch=4, runs=10, steady=10, steps=None,
                    ref_steps=12, ref_warmup=2, eval_every=5, eval_batches=3, rank=4),
    # seconds: for tests
    "smoke": dict(n_embd=32, n_layer=1, n_head=2, seq=16, batch=2, runs=1, steady=2, steps=16,
                  ref_steps=4, ref_warmup=1, eval_every=5, eval_batches=1, rank=2),
}
# rough step seconds of the default workload (README's compare table, 2 cores), for the estimate:
# (all dense, compressed, seconds per run outside the steps: attach, probes, close)
NOMINAL = {"loopback": (0.06, 0.065, 3.0), "1gbit": (0.16, 0.065, 3.5), "100mbit": (1.2, 0.1, 5.0)}
LOAD_FACTOR = 1.3  # the hog takes half a core of two, on average


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_const", dest="preset", const="smoke", default="default",
                   help="tiny model, few steps (seconds; for tests)")
    p.add_argument("--nets", default=",".join(NETS), help=f"comma-separated subset of {NETS}")
    for key, kind in (("n_embd", int), ("n_layer", int), ("n_head", int), ("seq", int), ("batch", int),
                      ("runs", int), ("steady", int), ("steps", int), ("ref_steps", int), ("ref_warmup", int),
                      ("eval_every", int), ("eval_batches", int), ("rank", int)):
        p.add_argument("--" + key.replace("_", "-"), type=kind, default=None, help=f"override the preset's {key}")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0, help="run i of every link starts from seed + i")
    p.add_argument("--no-load", action="store_true", help="no background CPU hog")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for robustness.json, .md")
    p.add_argument("--phase-timeout", type=float, default=1200, help="seconds per link (the hog's bound too)")
    p.add_argument("--dad-log", default="WARNING", help="log level of dad_integrations in the ranks (INFO: trials)")
    p.add_argument("--_phase", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    s = dict(PRESETS[args.preset])
    for key in list(s):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    if s["steps"] is None:
        s["steps"] = 1 + TRIAL_STEPS + s["steady"]
    args.settings = s
    args.nets = [n.strip() for n in args.nets.split(",") if n.strip()]
    bad = [n for n in args.nets if n not in NETS]
    if bad:
        p.error(f"unknown nets {bad}; known: {NETS}")
    return args


def dad_config(method: str, rank: int) -> dict:
    cfg = {"mode": "auto", "rank": rank, "objective": "time", "lossless_steps": 0}
    if method in LINKS:
        cfg["link"] = dict(LINKS[method])
    return cfg


def estimate_s(settings: dict, nets: List[str]) -> float:
    """A rough wall time for the default workload: auto's steps (its trial half all-dense), the
    references' steps, evaluations and attaches, times `LOAD_FACTOR`, plus 20 s of start per link."""
    s = settings
    total = 0.0
    for net in nets:
        dense, comp, fixed = NOMINAL[net]
        trial_dense = TRIAL_STEPS // 2
        auto = trial_dense * dense + (s["steps"] - trial_dense) * min(dense, comp)
        refs = s["ref_steps"] * (dense + comp)
        evals = s["steps"] // s["eval_every"] * s["eval_batches"] * 0.02
        total += 20 + s["runs"] * LOAD_FACTOR * (auto + refs + evals + fixed)
    return total


# -- the ranks ---------------------------------------------------------------------------------

def rank_main(rank: int, world: int, port: int, spec: dict) -> None:
    import torch
    import torch.distributed as dist

    die_with_parent()  # a rank never outlives its launch
    if os.getppid() != spec["launcher_pid"]:
        sys.exit(1)  # the launch ended before this rank started
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    logging.basicConfig(level=logging.INFO, format=f"[robustness r{rank}] %(message)s")
    logging.getLogger("dad_integrations").setLevel(spec["dad_log"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    try:
        _run_phase(spec)
    finally:
        dist.destroy_process_group()


class Method:
    """One method's DDP model with dAD as its hook, optimizer and batches; `step()` trains and times."""

    def __init__(self, name: str, w: Workload, init_state, data: bytes, groups, spec: dict, seed: int):
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from benchmarks.workload import build_model
        from dad_examples.text_data import byte_lm_batches
        from dad_integrations import TorchDistributedAggregator, register_dad_comm_hook

        self.name = name
        model = build_model(w)
        model.load_state_dict(init_state)
        model.train()
        ddp_group, dad_group = groups
        self.ddp = DistributedDataParallel(model, process_group=ddp_group)
        self.sync = register_dad_comm_hook(self.ddp, dad_config(name, spec["settings"]["rank"]),
                                           aggregator=TorchDistributedAggregator(dad_group))
        self.opt = torch.optim.AdamW(model.parameters(), lr=w.lr)
        self.batches = byte_lm_batches(data, w.batch, w.seq, rank=dist.get_rank(), world_size=dist.get_world_size(),
                                       seed=seed)
        self.times: List[float] = []
        self.evals: List[float] = []

    def step(self) -> None:
        x = next(self.batches)
        start = time.perf_counter()
        loss = self.ddp(input_ids=x, labels=x).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.times.append(time.perf_counter() - start)

    def evaluate(self, batches) -> None:
        """A user's held-out evaluation: through the DDP model, in eval mode, without gradients."""
        import torch

        self.ddp.eval()
        with torch.no_grad():
            loss = sum(float(self.ddp(input_ids=x, labels=x).loss) for x in batches) / len(batches)
        self.ddp.train()
        self.evals.append(loss)

    def representations(self) -> Dict[str, int]:
        report = self.sync.last_step_report()
        return dict(Counter(p.representation for p in report.params if p.representation != "overhead"))

    def trials(self) -> List[dict]:
        return [{k: getattr(t, k) for k in ("step", "compressed", "routes_s", "dense_s", "predicted_saving_s",
                                            "kept") if hasattr(t, k)} for t in self.sync.route_trials]

    def close(self) -> None:
        self.sync.close()
        self.ddp = self.sync = self.opt = None


def _schedule(steps: int, ref_steps: int) -> List[int]:
    """How many reference steps are due once auto has taken step i (0-based): spread evenly."""
    return [min(ref_steps, -(-(i + 1) * ref_steps // steps)) for i in range(steps)]


def _run_phase(spec: dict) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.workload import build_model
    from dad_examples.text_data import byte_lm_batches, stdlib_source_bytes

    rank, world = dist.get_rank(), dist.get_world_size()
    s = spec["settings"]
    base = Workload(**spec["workload"])
    # every method its own DDP group and dAD group, made once (every rank in the same order)
    groups = {m: (dist.new_group(list(range(world))), dist.new_group(list(range(world)))) for m in METHODS}
    turns = dist.new_group(list(range(world)))
    data = stdlib_source_bytes(max_bytes=1_000_000, seed=base.seed)
    eval_iter = byte_lm_batches(data, base.batch, base.seq, seed=base.seed, split="eval")
    eval_batches = [next(eval_iter) for _ in range(s["eval_batches"])]
    due = _schedule(s["steps"], s["ref_steps"])
    runs = []
    bar = None
    if rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=s["runs"], desc=f"robustness {spec['net']}", unit="run", file=sys.stderr,
                   dynamic_ncols=True)
    for i in range(s["runs"]):
        seed = base.seed + i
        w = Workload(**{**asdict(base), "seed": seed})
        torch.manual_seed(seed)
        init_state = build_model(w).state_dict()
        started = time.perf_counter()
        methods = {m: Method(m, w, init_state, data, groups[m], spec, seed) for m in METHODS}
        attach_s = time.perf_counter() - started
        auto, refs = methods["auto"], [methods["dense"], methods["compressed"]]
        for step in range(s["steps"]):
            # the references' k-th steps run back to back (a pair), their order alternating
            for ref in (refs if len(refs[0].times) % 2 == 0 else refs[::-1]):
                while len(ref.times) < due[step]:
                    dist.barrier(group=turns)
                    ref.step()
            dist.barrier(group=turns)
            if step and step % s["eval_every"] == 0:
                auto.evaluate(eval_batches)  # the loop's evaluation, right before auto's step
            auto.step()
        mine = {m: {"times": r.times, "representations": r.representations(), "trials": r.trials(),
                    "evals": r.evals} for m, r in methods.items()}
        for r in methods.values():
            r.close()
        del methods, auto, refs
        gc.collect()
        gathered: List[Optional[dict]] = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            rec = summarise_run(i, seed, gathered, s)
            rec["attach_s"] = attach_s
            rec["wall_s"] = time.perf_counter() - started
            runs.append(rec)
            bar.update(1)
            log.info("%s run %d: auto %s (trial %s), all dense %.1f ms, compressed %.1f ms: faster %s (%.0f%%) -> %s; "
                     "auto steady %.1f ms = %.2f x best", spec["net"], i, rec["auto_choice"],
                     _fmt_trial(rec["auto_trials"]), rec["dense_s"] * 1e3, rec["compressed_s"] * 1e3, rec["faster"],
                     rec["margin"] * 100, "match" if rec["matched"] else "MISS", rec["auto_steady_s"] * 1e3,
                     rec["auto_vs_best"])
    if rank == 0:
        bar.close()
        with open(spec["out"], "w") as fh:
            json.dump({"net": spec["net"], "runs": runs}, fh)
    dist.barrier()


def _fmt_trial(trials: List[dict]) -> str:
    if not trials:
        return "none"
    t = trials[-1]
    return (f"{t['routes_s'] * 1e3:.1f} vs {t['dense_s'] * 1e3:.1f} ms dense, "
            f"{'kept' if t['kept'] else 'not kept'}, {len(trials)} in all")


def summarise_run(i: int, seed: int, per_rank: List[dict], s: dict) -> dict:
    """One run's record from every rank's times: per step the slowest rank."""
    def slowest(method: str) -> List[float]:
        return [max(ts) for ts in zip(*(r[method]["times"] for r in per_rank))]

    times = {m: slowest(m) for m in METHODS}
    warm = s["ref_warmup"]
    dense_s = median(times["dense"][warm:] or times["dense"])
    comp_s = median(times["compressed"][warm:] or times["compressed"])
    # the ground truth: the median of the paired differences (the references' k-th steps ran back to
    # back, so a burst of load falls on both of a pair); the medians' verdict is kept beside it
    pairs = list(zip(times["dense"], times["compressed"]))[warm:] or list(zip(times["dense"], times["compressed"]))
    paired = median([d - c for d, c in pairs])
    # auto's steady steps against the references' steps taken in the same stretch of the run
    due = _schedule(s["steps"], s["ref_steps"])
    first = due[s["steps"] - s["steady"] - 1] if s["steps"] > s["steady"] else 0
    window = {m: times[m][first:] or times[m][-1:] for m in ("dense", "compressed")}
    auto0 = per_rank[0]["auto"]
    trials = auto0["trials"]
    reps = auto0["representations"]
    routed = sum(n for rep, n in reps.items() if rep != "dense")
    choice = ("compressed" if trials[-1]["kept"] else "dense") if trials else ("compressed" if routed else "dense")
    faster = "compressed" if paired > 0 else "dense"
    best = min(dense_s, comp_s)
    steady = median(times["auto"][-s["steady"]:])
    window_best = min(median(window["dense"]), median(window["compressed"]))
    return {"run": i, "seed": seed, "auto_choice": choice, "auto_trials": trials,
            "auto_representations": reps, "auto_representations_compressed": routed > 0,
            "dense_s": dense_s, "compressed_s": comp_s, "paired_dense_minus_compressed_s": paired,
            "faster": faster, "faster_by_medians": "compressed" if comp_s < dense_s else "dense",
            "margin": abs(paired) / best, "matched": choice == faster,
            "near_tie": choice != faster and abs(paired) <= TIE * best,
            "auto_steady_s": steady, "auto_vs_best": steady / best,
            "auto_vs_best_same_window": steady / window_best,
            "reference_representations": {m: per_rank[0][m]["representations"] for m in ("dense", "compressed")},
            "times": times, "eval_loss": auto0["evals"]}


# -- the launcher --------------------------------------------------------------------------------

def run_phase_inside(spec_path: str) -> None:
    """One link: shape it (in the namespace), start the hog there, spawn 2 ranks, stop the hog."""
    import torch.multiprocessing as mp

    from benchmarks.compare import _free_port
    from benchmarks.cpu_load import bursty_load, read_stats

    with open(spec_path) as fh:
        spec = json.load(fh)
    if spec["namespace"]:
        net_shaping.setup_inside(None if spec["net"] == "loopback" else spec["net"])
    stats = spec["out"] + ".load.json"
    load = spec["load"]
    spec["launcher_pid"] = os.getpid()
    with bursty_load(load["seed"] if load else 0, spec["timeout_s"], enabled=bool(load), stats_path=stats):
        mp.spawn(rank_main, args=(2, _free_port(), spec), nprocs=2, join=True)
    with open(spec["out"]) as fh:
        result = json.load(fh)
    result["load"] = read_stats(stats) if load else None
    with open(spec["out"], "w") as fh:
        json.dump(result, fh)


def run_phase(args, net: str, workdir: str, namespace: bool) -> dict:
    s = args.settings
    out_file = os.path.join(workdir, f"phase-{net}.json")
    spec_file = os.path.join(workdir, f"spec-{net}.json")
    w = Workload(n_embd=s["n_embd"], n_layer=s["n_layer"], n_head=s["n_head"], seq=s["seq"], batch=s["batch"],
                 lr=args.lr, seed=args.seed)
    spec = {"net": net, "out": out_file, "workload": asdict(w), "settings": s, "namespace": namespace,
            "timeout_s": args.phase_timeout, "dad_log": args.dad_log.upper(),
            "load": None if args.no_load else {"seed": args.seed + 1000 * (1 + NETS.index(net))}}
    with open(spec_file, "w") as fh:
        json.dump(spec, fh)
    cmd = [sys.executable, "-m", "benchmarks.robustness", "--_phase", spec_file]
    if namespace:
        cmd = net_shaping.namespace_prefix() + cmd
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    start = time.perf_counter()
    # the launch (and with it the hog, `cpu_load`) dies with this process
    proc = subprocess.run(cmd, env=env, cwd=ROOT, timeout=args.phase_timeout + 60, preexec_fn=die_with_parent)
    if proc.returncode != 0:
        raise RuntimeError(f"link {net} failed ({proc.returncode}); its output is above")
    with open(out_file) as fh:
        result = json.load(fh)
    result["wall_s"] = time.perf_counter() - start
    return result


def summarise_link(runs: List[dict]) -> dict:
    n = len(runs)
    return {"runs": n, "matched": sum(r["matched"] for r in runs),
            "near_ties": sum(r["near_tie"] for r in runs),
            "auto_compressed": sum(r["auto_choice"] == "compressed" for r in runs),
            "faster_compressed": sum(r["faster"] == "compressed" for r in runs),
            "dense_s": median([r["dense_s"] for r in runs]),
            "compressed_s": median([r["compressed_s"] for r in runs]),
            "auto_steady_s": median([r["auto_steady_s"] for r in runs]),
            "auto_vs_best": median([r["auto_vs_best"] for r in runs]),
            "auto_vs_best_max": max(r["auto_vs_best"] for r in runs),
            "auto_vs_best_same_window": median([r["auto_vs_best_same_window"] for r in runs]),
            "target_met": sum(r["matched"] for r in runs) >= 0.9 * n}


def markdown(summary: Dict[str, dict], meta: dict) -> str:
    lines = ["| link | runs | auto matched the faster | near-ties among misses | auto chose compressed "
             "| compressed faster | all dense (median) | compressed (median) | auto steady (median) "
             "| auto / best (median, worst) | auto / best, same stretch |", "|" + "---|" * 11]
    for net, m in summary.items():
        lines.append(f"| {net} | {m['runs']} | {m['matched']} / {m['runs']}{'' if m['target_met'] else ' (MISSED)'} "
                     f"| {m['near_ties']} | {m['auto_compressed']} | {m['faster_compressed']} "
                     f"| {m['dense_s'] * 1e3:.1f} ms | {m['compressed_s'] * 1e3:.1f} ms "
                     f"| {m['auto_steady_s'] * 1e3:.1f} ms | {m['auto_vs_best']:.3f} x, {m['auto_vs_best_max']:.3f} x "
                     f"| {m['auto_vs_best_same_window']:.3f} x |")
    s = meta["settings"]
    lines += ["",
              f"- per run: auto {s['steps']} steps (its trial, then the last {s['steady']} steps are its steady "
              f"state), the all-dense and compressed references {s['ref_steps']} steps each (medians without their "
              f"first {s['ref_warmup']}), taking turns with auto's; held-out evaluation of {s['eval_batches']} "
              f"batches before every {s['eval_every']}th step of auto; lossless_steps 0",
              f"- background load: {'bursty CPU hog (benchmarks.cpu_load)' if meta['load'] else 'off'}",
              "- the faster: by the median of paired differences (the references' k-th steps run back to back, "
              "in alternating order); the medians are the references' steps over the whole run",
              f"- a near-tie: auto's choice was the slower, by at most {TIE:.0%} (paired)",
              "- auto / best, same stretch: against the references' steps taken during auto's steady steps",
              "- target (issue 25): auto matches the faster in at least 9 of 10 runs on every link"]
    for net, why in meta["skipped"].items():
        lines.append(f"- {net}: skipped ({why})")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._phase:
        run_phase_inside(args._phase)
        return 0
    logging.basicConfig(level=logging.INFO, format="[robustness] %(message)s")
    s = args.settings
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    namespace_ok, why_not = net_shaping.probe("1gbit")
    skipped: Dict[str, str] = {}
    nets = []
    for net in args.nets:
        if net != "loopback" and not namespace_ok:
            skipped[net] = f"cannot shape a private loopback here: {why_not}"
            log.warning("skipping %s: %s", net, skipped[net])
        else:
            nets.append(net)
    log.info("%d runs per link on %s; per run auto %d steps, references %d steps each; load %s; lossless_steps 0",
             s["runs"], ", ".join(nets), s["steps"], s["ref_steps"], "off" if args.no_load else "on")
    if args.preset == "default":
        log.info("estimated wall time: ~%.0f min (2 shared CPU cores)", estimate_s(s, nets) / 60)
    started = time.perf_counter()
    phases: Dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="dad-robustness-") as work:
        for net in nets:
            log.info("%s: %d runs on 2 ranks%s ...", net, s["runs"], " in a network namespace" if namespace_ok else "")
            phases[net] = run_phase(args, net, work, namespace_ok)
            log.info("%s: done in %.0f s", net, phases[net]["wall_s"])
    summary = {net: summarise_link(p["runs"]) for net, p in phases.items()}
    meta = {"settings": s, "preset": args.preset, "lr": args.lr, "seed": args.seed, "load": not args.no_load,
            "lossless_steps": 0, "configs": {m: dad_config(m, s["rank"]) for m in METHODS},
            "namespace": namespace_ok, "skipped": skipped, "total_wall_s": time.perf_counter() - started,
            "load_stats": {net: p.get("load") for net, p in phases.items()},
            "phase_wall_s": {net: p["wall_s"] for net, p in phases.items()}}
    with open(out / "robustness.json", "w") as fh:
        json.dump({"summary": summary, "meta": meta, "runs": {net: p["runs"] for net, p in phases.items()}}, fh,
                  indent=1)
    text = markdown(summary, meta)
    (out / "robustness.md").write_text(text + "\n")
    print(text, flush=True)
    log.info("total %.0f s; %s", meta["total_wall_s"], out / "robustness.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
