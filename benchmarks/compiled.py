"""dAD under ``torch.compile``: eager and compiled steps of plain DDP, DDP + PowerSGD and DDP + dAD.

    python -m benchmarks.compiled --steps 12 [--backend inductor] [--link 100mbit] [--out benchmarks/results/compiled]

Two gloo ranks (``torchrun``, one intra-op thread each) train the same small GPT-2 (a transformers
config: 2 layers of 128, vocabulary 256, 2 sequences of 32 tokens per rank: 64 rows, few enough
for exact factors to pay) from the same weights on the same batches with these methods, each
eager and compiled (``torch.compile`` of the DDP wrapper, the ``--backend``):

  ddp        DistributedDataParallel's own all-reduce
  powersgd   PyTorch's PowerSGD hook (rank 4, error feedback, warm start), DDP in one bucket
             (PyTorch's hook hangs on gloo with several buckets)
  dad-exact  dAD's communication hook, mode exact
  dad-auto   dAD's communication hook, mode auto with rank 4, objective time at the stated slow ``--link``
             (the config's ``link``, so routes are chosen for that link, not loopback's)

The methods take turns step by step (the order reversed every other step), so that a shared
machine's load falls on all alike. First each method runs ``--warmup`` steps alone, a compiled
one after ``torch._dynamo.reset()`` so that its graph breaks and graphs are its own; then one
uncounted round (recompiling what the resets dropped); then ``--steps`` measured steps. Per
method: the median step (slowest rank), bytes received per step (dAD's report; DDP's and
PowerSGD's computed from their ring all-reduces), and for the compiled methods dynamo's counters
(``torch._dynamo.utils.counters``): graph breaks and graphs compiled, in the first steps and in
the measured steps (a graph compiled there is a recompile). The link is loopback: a "stated link" column adds each
method's bytes at the stated bandwidth (its ring all-reduce or all-gather time) to its measured step.
Every compiled exact dAD gradient is compared with compiled DDP's (relative error, floored at 1e-6
of the whole gradient's norm). Results go to ``OUT.json`` and ``OUT.md``.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("ddp", "powersgd", "dad-exact", "dad-auto")
log = logging.getLogger("benchmarks.compiled")


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4, help="steps left out of the medians (compiles, PowerSGD's start)")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--link", default="100mbit", help="the stated slow link (dad-auto's config, the stated-link column)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compiled"))
    ap.add_argument("--rank-job", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# -- one rank ----------------------------------------------------------------------------------------
def rank_job(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import GPT2Config, GPT2LMHeadModel

    from dad_integrations import register_dad_comm_hook
    from dad_integrations.comm.link_spec import parse_bandwidth

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    init = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=128, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=None, eos_token_id=None))
    link_bps = parse_bandwidth(args.link)

    def build(method: str, compiled: bool):
        model = copy.deepcopy(init)
        sync = None
        if method == "powersgd":
            ddp = DDP(model, bucket_cap_mb=10 ** 4)  # one bucket (see the module doc)
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                                start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        else:
            ddp = DDP(model)
            if method == "dad-exact":
                sync = register_dad_comm_hook(ddp, {"mode": "exact"}, compiled=compiled)
            elif method == "dad-auto":
                sync = register_dad_comm_hook(ddp, {"mode": "auto", "rank": 4, "objective": "time", "lossless_steps": 0,
                                                    "link": {"bandwidth": args.link}}, compiled=compiled)
        fwd = torch.compile(ddp, backend=args.backend) if compiled else ddp
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return {"model": model, "fwd": fwd, "opt": opt, "sync": sync, "times": [], "bytes": []}

    runs: Dict[str, dict] = {}
    for compiled in (False, True):
        for m in METHODS:
            runs[f"{m}/{'compiled' if compiled else 'eager'}"] = build(m, compiled)
    names = list(runs)
    params = sum(p.numel() for p in init.parameters())
    from torch._dynamo.utils import counters
    counts: Dict[str, dict] = {n: {"graph_breaks": 0, "frames": 0, "warm_graph_breaks": 0, "warm_frames": 0}
                               for n in names}
    errors: List[float] = []
    seen: Dict[str, int] = {}

    def batch(step: int):
        g = torch.Generator().manual_seed(1000 * step + rank)
        return torch.randint(0, 256, (2, 32), generator=g)

    def one_step(n: str, ids, key: str, grads: dict) -> None:
        r = runs[n]
        before_gb = sum(counters["graph_break"].values())
        before_fr = counters["stats"].get("unique_graphs", 0)
        dist.barrier()
        t0 = time.perf_counter()
        r["opt"].zero_grad(set_to_none=True)
        r["fwd"](input_ids=ids, labels=ids).loss.backward()
        if n in ("ddp/compiled", "dad-exact/compiled"):
            grads[n] = [p.grad.detach().clone() for p in r["model"].parameters()]
        r["opt"].step()
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        r["times"].append(float(t))
        if key is not None:
            for reason, k in counters["graph_break"].items():  # why, first line (breaks are few)
                if k > seen.get(reason, 0):
                    counts[n].setdefault("reasons", []).append(reason.split("\n")[0][:160] + " / "
                                                               + reason.split("context:")[-1][:160].strip())
            seen.update(counters["graph_break"])
            counts[n][key + "graph_breaks"] += sum(counters["graph_break"].values()) - before_gb
            counts[n][key + "frames"] += counters["stats"].get("unique_graphs", 0) - before_fr
        r["bytes"].append(_bytes(n, r, params, world))

    # First steps, each compiled method alone after a reset of dynamo's caches: its graph breaks and
    # graphs are its own, not those of a method that happened to trace the shared code first. Then
    # a round of every method (what the resets dropped compiles again, uncounted), then the
    # measured steps, the methods taking turns.
    import torch._dynamo
    for n in names:
        if n.endswith("/compiled"):
            torch._dynamo.reset()
            counters.clear()
            seen.clear()
        for step in range(args.warmup):
            one_step(n, batch(step), "warm_" if n.endswith("/compiled") else None, {})
    for n in names:
        one_step(n, batch(args.warmup), None, {})
    for n in names:
        runs[n]["times"], runs[n]["bytes"] = [], []
    for step in range(args.steps):
        ids = batch(args.warmup + 1 + step)
        grads = {}
        for n in (names if step % 2 == 0 else names[::-1]):
            one_step(n, ids, "", grads)
        a, b = grads["ddp/compiled"], grads["dad-exact/compiled"]
        whole = sum(float(x.norm()) ** 2 for x in a) ** 0.5
        errors.append(max(float((y - x).norm()) / max(float(x.norm()), 1e-6 * whole) for x, y in zip(a, b)))
    out = {}
    for n in names:
        r = runs[n]
        kept = r["times"]
        out[n] = {"step_s": sorted(kept)[len(kept) // 2], "times": r["times"],
                  "bytes_per_step": sorted(r["bytes"])[len(kept) // 2],
                  **counts[n]}
        out[n]["stated_link_s"] = out[n]["step_s"] + out[n]["bytes_per_step"] / link_bps
    result = {"methods": out, "exact_vs_ddp_compiled": errors, "steps": args.steps, "warmup": args.warmup,
              "backend": args.backend, "link": args.link, "world": world, "params": params}
    if rank == 0:
        Path(args.rank_job).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo's threads may abort the interpreter's finalisation (see tests/workers/models.py)


def _bytes(name: str, run: dict, params: int, world: int) -> float:
    """Bytes this rank received in the step: dAD's report; the ring all-reduce of DDP's gradients
    (fp32); PowerSGD's P and Q all-reduces after its warm-up (rank 4 per matrix, the rest dense)."""
    method = name.split("/")[0]
    ring = 2 * (world - 1) / world
    if method == "ddp":
        return ring * params * 4
    if method == "powersgd":
        numel = 0
        for p in run["model"].parameters():
            if p.dim() >= 2:
                m, k = p.shape[0], p.numel() // p.shape[0]
                numel += 4 * (m + k)
            else:
                numel += p.numel()
        return ring * numel * 4
    report = run["sync"].last_step_report()
    return float(report.totals["received_bytes"]) if report else 0.0


# -- the launcher --------------------------------------------------------------------------------------
def main(argv=None) -> None:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.rank_job:
        rank_job(args)
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    job = out.with_suffix(".rank.json")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "benchmarks.compiled", "--rank-job", str(job), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--backend", args.backend, "--link", args.link]
    subprocess.run(cmd, env=env, cwd=ROOT, check=True)
    result = json.loads(job.read_text())
    job.unlink()
    result["command"] = "python -m benchmarks.compiled " + " ".join(argv if argv is not None else sys.argv[1:])
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(render(result))
    print(render(result))


def render(r: dict) -> str:
    m = r["methods"]
    lines = [f"# dAD under torch.compile ({r['world']} gloo ranks, backend {r['backend']})", "",
             f"`{r.get('command', 'python -m benchmarks.compiled')}`: medians of {r['steps']} measured steps "
             f"after {r['warmup']} first steps per method; GPT-2 of {r['params'] / 1e6:.2f} M parameters; stated link {r['link']} "
             f"(loopback underneath).", "",
             "| method | eager s/step | compiled s/step | eager/compiled | bytes/step | compiled at the stated link s "
             "| graph breaks (first steps / measured) | graphs compiled (first steps / measured) |",
             "|---|---|---|---|---|---|---|---|"]
    for meth in METHODS:
        e, c = m[f"{meth}/eager"], m[f"{meth}/compiled"]
        lines.append(f"| {meth} | {e['step_s']:.4f} | {c['step_s']:.4f} | {e['step_s'] / c['step_s']:.2f} | "
                     f"{c['bytes_per_step'] / 1e3:.0f} kB | {c['stated_link_s']:.4f} | "
                     f"{c['warm_graph_breaks']} / {c['graph_breaks']} | {c['warm_frames']} / {c['frames']} |")
    speed = {meth: m[f"{meth}/eager"]["step_s"] / m[f"{meth}/compiled"]["step_s"] for meth in METHODS}
    lines += ["", "Targets:", "",
              f"- graph breaks, compiled dAD exact: {m['dad-exact/compiled']['warm_graph_breaks']} against compiled "
              f"DDP's {m['ddp/compiled']['warm_graph_breaks']}; graphs compiled in the measured steps: "
              f"{m['dad-exact/compiled']['frames']} (dAD exact), {m['dad-auto/compiled']['frames']} (dAD auto)",
              f"- compiling speeds up dAD exact {speed['dad-exact']:.2f}x, plain DDP {speed['ddp']:.2f}x: "
              f"ratio {speed['dad-exact'] / speed['ddp']:.2f} (target >= 0.9)",
              f"- at the stated link, compiled dAD auto {m['dad-auto/compiled']['stated_link_s']:.4f} s against compiled "
              f"PowerSGD {m['powersgd/compiled']['stated_link_s']:.4f} s",
              f"- compiled dAD exact against compiled DDP, worst relative gradient error over all steps: "
              f"{max(r['exact_vs_ddp_compiled']):.2e} (target 1e-5)", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
