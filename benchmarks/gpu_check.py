"""What a CPU machine cannot check, in one short run on CUDA devices.

    python -m benchmarks.gpu_check --json benchmarks/results/gpu_check.json    # a few minutes
    python -m benchmarks.gpu_check --device cpu --tiny                          # the same checks, small, on CPU
    python -m benchmarks.gpu_check --render benchmarks/results/gpu_check.json > benchmarks/results/gpu_check.md

Without CUDA (and without ``--device cpu``) it prints that it skipped and exits 0. Parts:

1. **Exactness of capture and rebuild** in fp32 and under bf16 autocast: every captured weight's
   gradient rebuilt from its own captured rows (`codecs.exact.rebuild_unit`) against autograd's,
   relative error (floored at 1e-6 of the whole gradient's norm). fp32 must be at round-off
   (< 1e-5); bf16 is reported (rows are bf16 activations, the rebuild runs in fp32).
2. **Overhead per layer against backward** on GPT-2-small geometry: the compute model's own
   measurement (`compute_model.measure_compute`: each route's local work per weight shape, the
   figures objective "time" routes by) beside the backward pass, per layer and in total, and the
   whole step's overhead over an aggregator that moves nothing (`benchmarks.gpu_overhead`).
3. **NCCL ordering** (two or more GPUs): dAD's collectives run on a worker thread and their own
   communicator beside the engine's (DDP's buckets, FSDP2's all-gathers). Two processes train DDP
   with dAD's communication hook (mode exact, several DDP buckets) and plain
   `DADSynchronizer` steps with rank routes, under a 60 s NCCL timeout: a deadlock fails the check
   instead of hanging, and the exact gradients must equal DDP's all-reduce.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from datetime import timedelta
from typing import Dict, List

import torch

from benchmarks.gpu_overhead import build, measure, timed


def exactness(precision: str, tiny: bool, device: torch.device, batch: int, seq: int) -> Dict[str, float]:
    """Max relative error of every weight's rebuild from its captured rows against autograd's."""
    from dad_integrations import DADConfig
    from dad_integrations.codecs.exact import rebuild_unit
    from dad_integrations.capture.rows import concat_rows
    from dad_integrations.capture.assign import build_plan

    torch.manual_seed(0)
    model, cfg = build(tiny, seq, device)
    plan = build_plan(model, DADConfig(mode="exact"))
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with amp:
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    total = sum(float(p.grad.float().norm()) ** 2 for p in model.parameters() if p.grad is not None) ** 0.5
    worst = 0.0
    for u in plan.units:
        rows = [concat_rows(c.take(), c.kind, tuple(u.param.shape), u.param) for c in u.uses]
        for q, g in rebuild_unit(u, rows, torch.float32).items():
            err = float((g - q.grad.float()).norm()) / max(float(q.grad.float().norm()), 1e-6 * total)
            worst = max(worst, err)
    for c in plan.captures:
        c.remove()
    return {"precision": precision, "max_rel_err": worst, "weights": len(plan.units)}


def layer_overhead(tiny: bool, device: torch.device, batch: int, seq: int, rank: int, sites: int,
                   reps: int) -> Dict[str, object]:
    """Per layer: the compute model's seconds per route beside the plain backward pass."""
    from dad_integrations import DADConfig
    from dad_integrations.routing.compute_model import measure_compute
    from dad_integrations.capture.assign import build_plan

    model, cfg = build(tiny, seq, device)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        model(input_ids=x, labels=x).loss.backward()

    def fwd():
        with torch.no_grad():
            model(input_ids=x, labels=x)

    backward = timed(fwd_bwd, device, reps) - timed(fwd, device, reps)
    plan = build_plan(model, DADConfig(mode="auto", rank=rank))
    for c in plan.captures:
        c.remove()
    shapes = [tuple(u.param.shape) for u in plan.units]
    compute = measure_compute(shapes, rank=rank, world_size=sites, iterations=1, error_feedback=True, device=device)
    layers = []
    for u in plan.units:
        c = compute.shapes[tuple(u.param.shape)]
        rows = [[batch * seq] * len(u.uses)] * sites
        layers.append({"name": u.name, "shape": list(u.param.shape), "rank_allreduce_s": c.rank_allreduce,
                       "rank_s": c.rank,
                       "exact_s": compute.seconds("exact", tuple(u.param.shape), rows_by_rank=rows, world_size=sites,
                                                  calls=len(u.uses))})
    totals = {k: sum(layer[k] for layer in layers) for k in ("rank_allreduce_s", "rank_s", "exact_s")}
    backward = max(backward, 1e-9)  # a tiny model on a noisy CPU can time backward at zero
    return {"backward_s": backward, "capture_per_call_s": compute.capture_per_call, "layers": layers,
            "totals": totals, "of_backward": {k: v / backward for k, v in totals.items()}}


def _nccl_worker(rank: int, world: int, port: int, out_path: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dad_integrations import DADConfig, DADSynchronizer, TorchDistributedAggregator
    from dad_integrations.ddp_hook import register_dad_comm_hook

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    device = torch.device("cuda", rank)
    result = {"rank": rank}
    try:
        torch.manual_seed(0)
        ref, cfg = build(True, 64, device)
        mine, _ = build(True, 64, device)
        mine.load_state_dict(ref.state_dict())
        ddp_ref = DDP(ref, device_ids=[rank], bucket_cap_mb=0.05)      # several buckets on purpose
        ddp_mine = DDP(mine, device_ids=[rank], bucket_cap_mb=0.05)
        register_dad_comm_hook(ddp_mine, DADConfig(mode="exact"))
        worst = 0.0
        for step in range(5):
            g = torch.Generator(device=device).manual_seed(10 * step + rank)
            x = torch.randint(0, cfg.vocab_size, (4, 64), device=device, generator=g)
            for m in (ddp_ref, ddp_mine):
                m.zero_grad(set_to_none=True)
                m(input_ids=x, labels=x).loss.backward()
            for a, b in zip(ref.parameters(), mine.parameters()):
                if a.grad is not None:
                    worst = max(worst, float((a.grad - b.grad).norm()) / max(float(a.grad.norm()), 1e-12))
        result["ddp_hook_exact_max_rel_err"] = worst
        model, _ = build(True, 64, device)
        sync = DADSynchronizer(model, TorchDistributedAggregator(), DADConfig(mode="rank", rank=4))
        for step in range(5):
            x = torch.randint(0, cfg.vocab_size, (4, 64), device=device)
            model(input_ids=x, labels=x).loss.backward()
            sync.synchronize()
            model.zero_grad(set_to_none=True)
        result["rank_steps"] = 5
        result["ok"] = True
    except Exception as e:  # a timeout (deadlock) or an error: reported, not hung
        result["ok"] = False
        result["error"] = repr(e)
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def nccl_ordering() -> Dict[str, object]:
    """Part 3 on two GPUs (skipped with fewer)."""
    if torch.cuda.device_count() < 2:
        return {"skipped": f"{torch.cuda.device_count()} CUDA device(s): the NCCL check needs two"}
    import socket
    import tempfile

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "nccl")
    mp.spawn(_nccl_worker, args=(2, port, out), nprocs=2, join=True)
    return {"ranks": [json.load(open(f"{out}.{r}")) for r in range(2)]}


def render(out: Dict[str, object]) -> str:
    """The results of one run as markdown (docs/benchmarks.md includes it)."""
    lo = out["layer_overhead"]
    a = out.get("args", {"tiny": False, "batch": 8, "seq": 1024, "rank": 4, "sites": 8})  # older runs: defaults
    lines = [f"Device: {out['device']}; {'a tiny GPT-2' if a['tiny'] else 'GPT-2 small geometry'}, batch "
             f"{a['batch']} x {a['seq']} tokens, rank {a['rank']}, {a['sites']} sites simulated.", "",
             "| check | result |", "|---|---|"]
    for e in out["exactness"]:
        lines.append(f"| rebuild from captured rows, {e['precision']} | max relative error "
                     f"{e['max_rel_err']:.2e} over {e['weights']} weights |")
    lines.append(f"| backward pass | {lo['backward_s'] * 1e3:.2f} ms |")
    for k, v in lo["totals"].items():
        lines.append(f"| compute model, route `{k[:-2]}`, all weights | {v * 1e3:.2f} ms "
                     f"({lo['of_backward'][k] * 100:.1f} % of backward) |")
    for s in out["step_overhead"]:
        share = s["dad_step_overhead_of_backward"]
        lines.append(f"| {s['precision']}: rank reduction of every weight | {s['rank_reduction_s'] * 1e3:.2f} ms "
                     f"({s['rank_reduction_of_backward'] * 100:.1f} % of a {s['backward_s'] * 1e3:.2f} ms backward) |")
        lines.append(f"| {s['precision']}: whole rank-dAD step over a null aggregator, minus forward+backward | "
                     f"{s['dad_step_overhead_s'] * 1e3:.2f} ms "
                     f"({'n/a' if share is None else f'{share * 100:.1f} %'} of backward) |")
    nccl = out["nccl_ordering"]
    lines.append("| NCCL ordering | " + (f"skipped: {nccl['skipped']}" if "skipped" in nccl else
                                          ", ".join(f"rank {r['rank']}: {'ok' if r.get('ok') else r.get('error')}"
                                                    for r in nccl["ranks"])) + " |")
    lines.append(f"| failures | {'; '.join(out['failures']) or 'none'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny GPT-2 instead of GPT-2 small geometry")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--sites", type=int, default=8)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--render", metavar="JSON", help="print a saved run's results as markdown and exit")
    args = p.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            print(render(json.load(f)), end="")
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here: skipped (run it where one is, or pass --device cpu --tiny)")
        return 0
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the CPU tests run; two threads per rank oversubscribe small machines
    out: Dict[str, object] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "args": {k: getattr(args, k) for k in ("tiny", "batch", "seq", "rank", "sites")}}
    out["exactness"] = [exactness(pr, args.tiny, device, args.batch, args.seq) for pr in ("fp32", "bf16")]
    out["layer_overhead"] = layer_overhead(args.tiny, device, args.batch, args.seq, args.rank, args.sites, args.reps)
    overhead_args = argparse.Namespace(tiny=args.tiny, seq=args.seq, batch=args.batch, rank=args.rank,
                                       sites=args.sites, reps=args.reps)
    out["step_overhead"] = [measure(pr, overhead_args, device) for pr in ("fp32", "bf16")]
    out["nccl_ordering"] = nccl_ordering() if device.type == "cuda" else {"skipped": "not on CUDA"}
    failures: List[str] = []
    fp32 = out["exactness"][0]["max_rel_err"]
    if fp32 > 1e-5:
        failures.append(f"fp32 rebuild off by {fp32:.2e}")
    for r in out["nccl_ordering"].get("ranks", []):
        if not r.get("ok") or r.get("ddp_hook_exact_max_rel_err", 1.0) > 1e-5:
            failures.append(f"NCCL rank {r['rank']}: {r}")
    out["failures"] = failures
    lo = out["layer_overhead"]
    print(f"device {out['device']}; exactness: " + ", ".join(
        f"{e['precision']} {e['max_rel_err']:.2e} over {e['weights']} weights" for e in out["exactness"]))
    print(f"backward {lo['backward_s'] * 1e3:.2f} ms; per step, compute model: " + ", ".join(
        f"{k[:-2]} {v * 1e3:.2f} ms ({lo['of_backward'][k] * 100:.1f} % of backward)" for k, v in lo["totals"].items()))
    for s in out["step_overhead"]:
        share = s["dad_step_overhead_of_backward"]  # None where backward timed at zero (tiny, noisy)
        print(f"{s['precision']}: whole rank-dAD step overhead {s['dad_step_overhead_s'] * 1e3:.2f} ms "
              f"({'n/a' if share is None else f'{share * 100:.1f} %'} of backward)")
    print(f"NCCL ordering: {out['nccl_ordering']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if failures:
        print("FAILED: " + "; ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
