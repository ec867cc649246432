"""Compute overhead of dAD's capture and rank reduction against the backward pass, on one device.

    python -m benchmarks.gpu_overhead                        # GPT-2 small geometry, CUDA, fp32 + bf16
    python -m benchmarks.gpu_overhead --tiny --device cpu    # a tiny geometry, to check it runs

One process, no communication. For each precision (fp32, and bf16 autocast) it times, with the
device synchronised around every measured span (medians over ``--reps``):

  forward_s / backward_s     the plain model's forward and backward
  capture_s                  forward + backward with dAD's capture hooks installed, minus the plain
                             forward + backward (keeping input rows, pairing output-gradient rows)
  rank_reduction_s           rank-r reduction of every captured weight, as rank-dAD does it (the
                             method `low_rank.choose_method` picks per layer, warm-started)
  rebuild_s                  rebuilding every weight's average from S sites' rank-r factors
  dad_step_overhead_s        a whole rank-dAD step over an aggregator that moves nothing (S sites
                             simulated), minus the plain forward + backward
and each as a fraction of ``backward_s``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import Callable, Dict, List

import torch

from benchmarks.workload import NullAggregator, median


def build(tiny: bool, seq: int, device: torch.device):
    from transformers import GPT2Config, GPT2LMHeadModel

    if tiny:
        cfg = GPT2Config(vocab_size=256, n_positions=seq, n_embd=64, n_layer=2, n_head=2)
    else:  # GPT-2 small geometry (124M parameters), weights random
        cfg = GPT2Config(n_positions=max(seq, 1024))
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    model = GPT2LMHeadModel(cfg).to(device)
    model.loss_type = "ForCausalLM"
    return model, cfg


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t)
    return median(out)


def measure(precision: str, args, device: torch.device) -> Dict[str, float]:
    from dad_integrations import DADConfig, DADSynchronizer
    from dad_integrations.codecs.low_rank import LocalGradient, choose_method, reduce_rank
    from dad_integrations.capture.assign import build_plan

    torch.manual_seed(0)
    model, cfg = build(args.tiny, args.seq, device)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)
    def amp():
        if precision == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def fwd():
        with amp():
            return model(input_ids=x, labels=x).loss

    state = {}

    def forward_only():
        state["loss"] = fwd()

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        fwd().backward()

    t_fwd = timed(forward_only, device, args.reps)
    t_fb = timed(fwd_bwd, device, args.reps)

    # capture hooks only
    plan = build_plan(model, DADConfig(mode="rank", rank=args.rank))

    def fwd_bwd_capture():
        model.zero_grad(set_to_none=True)
        fwd().backward()
        for c in plan.captures:
            c.clear()

    t_fb_cap = timed(fwd_bwd_capture, device, args.reps)

    # rows of one step, for the reduction and rebuild timings
    model.zero_grad(set_to_none=True)
    fwd().backward()
    units = []
    for u in plan.units:
        rows = [c.take() for c in u.uses]
        left = [torch.cat([a for a, _ in r]) for r in rows]
        right = [torch.cat([b for _, b in r]) for r in rows]
        units.append((u, left, right))
    for c in plan.captures:
        c.remove()
    warm: Dict[int, torch.Tensor] = {}

    def reduction():
        for u, left, right in units:
            m, n = u.param.shape
            r = min(args.rank, m, n)
            nrows = sum(int(t.shape[0]) for t in left)
            method = choose_method(nrows, m, n, r, 1, factors_available=u.factors_only)
            if method == "dense":
                g = LocalGradient(dense=u.param.grad.float())
            else:
                g = LocalGradient(left=torch.cat([t.float() for t in left]), right=torch.cat([t.float() for t in right]))
            q0 = warm.get(u.index)
            if q0 is None:
                q0 = torch.randn(n, r, device=device)
            low = reduce_rank(g, r, method=method, q_init=q0, iterations=1)
            warm[u.index] = low.warm

    t_red = timed(reduction, device, args.reps)
    factors = [(torch.randn(args.sites * min(args.rank, *u.param.shape), sum(u.param.shape), device=device), u)
               for u, _, _ in units]

    def rebuild():
        for f, u in factors:
            m = u.param.shape[0]
            (f[:, :m].t() @ f[:, m:]).div_(args.sites)

    t_reb = timed(rebuild, device, args.reps)

    # a whole rank-dAD step, no communication
    model2, _ = build(args.tiny, args.seq, device)
    model2.load_state_dict(model.state_dict())
    sync = DADSynchronizer(model2, NullAggregator(0, args.sites), DADConfig(mode="rank", rank=args.rank))

    def dad_step():
        model2.zero_grad(set_to_none=True)
        with amp():
            loss = model2(input_ids=x, labels=x).loss
        loss.backward()
        sync.synchronize()

    t_dad = timed(dad_step, device, args.reps)
    sync.close()
    t_bwd = t_fb - t_fwd
    out = {"precision": precision, "forward_s": t_fwd, "backward_s": t_bwd, "capture_s": t_fb_cap - t_fb,
           "rank_reduction_s": t_red, "rebuild_s": t_reb, "dad_step_overhead_s": t_dad - t_fb}
    for k in ("capture_s", "rank_reduction_s", "rebuild_s", "dad_step_overhead_s"):
        out[k[:-2] + "_of_backward"] = out[k] / t_bwd if t_bwd > 0 else None
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a tiny GPT-2 (for a CPU check), not GPT-2 small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--sites", type=int, default=8, help="sites whose factors the rebuild sums")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    rows: List[dict] = []
    for precision in args.precisions.split(","):
        rows.append(measure(precision.strip(), args, device))
    name = "tiny" if args.tiny else "GPT-2 small"
    print(f"{name} geometry, batch {args.batch} x {args.seq}, rank {args.rank}, {args.sites} sites, "
          f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'})")
    print("| precision | forward | backward | capture | rank reduction | rebuild | whole dAD step overhead |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        def f(k):
            return f"{r[k] * 1000:.2f} ms ({r[k[:-2] + '_of_backward'] * 100:.1f}%)"
        print(f"| {r['precision']} | {r['forward_s'] * 1000:.2f} ms | {r['backward_s'] * 1000:.2f} ms | "
              f"{f('capture_s')} | {f('rank_reduction_s')} | {f('rebuild_s')} | {f('dad_step_overhead_s')} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
