"""Peak RSS under FSDP2 with dAD's rank routes: whole error-feedback residuals against a residual budget's.

    python -m benchmarks.budget_memory [--model gpt2-124m|llama-307m] [--steps 14] [--budget 0.25]

Two gloo ranks on loopback, fp32, 1 x 128 byte tokens a rank (stdlib source, no downloads), the
models of `benchmarks.scale` built from configs, ``fully_shard``-ed per block and at the root, SGD
(Adam's moments would add the same to every method). Each method runs in 2 fresh processes, its
``--steps`` steps past dAD's 10 lossless ones (so that the rank routes hold their residuals), and
records each rank's peak RSS (VmHWM) and what error feedback holds:

  fsdp2                FSDP2's own reduce-scatter (the engine)
  auto-100mbit-whole   dAD auto, rank 4, a stated 100 Mbit/s link, ``residual_budget: null`` (whole
                       residuals)
  auto-100mbit         the same with ``residual_budget`` at its default (0.25x: rank-q residuals from
                       2 ranks on)
  auto-100mbit-budget  the same with ``residual_budget: --budget``

Prints per method the peak RSS against the engine's and the residual bytes held (rank 0), as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks._scale_engines import STATED_LINK, build_model
from benchmarks.scale import MODELS
from benchmarks.workload import gloo_rank, lm_step, peak_memory_mb

METHODS = ("fsdp2", "auto-100mbit-whole", "auto-100mbit", "auto-100mbit-budget")


def _held(sync) -> int:
    if sync is None or sync.exchanger.rank_codec is None:
        return 0
    residuals = sync.exchanger.state.memory.residuals.values()
    return sum(t.numel() * t.element_size() for r in residuals for t in (r if isinstance(r, tuple) else (r,)))


def _body(spec: dict) -> None:
    from torch.distributed.fsdp import fully_shard

    from dad_examples.text_data import byte_lm_batches, stdlib_source_bytes
    from dad_integrations.fsdp import enable_dad_fsdp

    torch.set_num_threads(1)
    model = build_model(spec)
    blocks = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    sync, method = None, spec["method"]
    if method != "fsdp2":
        cfg = {"mode": "auto", "rank": 4, "link": STATED_LINK}
        if method.endswith("budget"):
            cfg["residual_budget"] = spec["budget"]
        elif method.endswith("whole"):
            cfg["residual_budget"] = None
        sync = enable_dad_fsdp(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=spec["lr"])
    step = lm_step(model, opt)
    data = stdlib_source_bytes(max_bytes=1_000_000, seed=0)
    batches = byte_lm_batches(data, 1, spec["seq"], rank=dist.get_rank(), world_size=dist.get_world_size(), seed=0)
    for _ in range(spec["steps"]):
        step(next(batches))
    out = {"peak_rss_mb": peak_memory_mb(torch.device("cpu")), "residual_bytes": _held(sync),
           "residual_rank": None if sync is None else sync.exchanger.state.memory.matrix_rank,
           "memory_line": None if sync is None else sync.exchanger.memory_line}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    if dist.get_rank() == 0:
        with open(spec["out"], "w") as fh:
            json.dump(gathered, fh)
    if sync is not None:
        sync.close()


def _rank(rank: int, world: int, port: int, spec: dict) -> None:
    gloo_rank(rank, world, port, 1800, lambda: _body(spec))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(method: str, model: str, steps: int, budget: float, seq: int = 128) -> list:
    """Each rank's figures for ``method`` (2 fresh processes)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"model": MODELS[model], "seed": 0, "method": method, "steps": steps, "budget": budget,
                "seq": seq, "lr": 1e-3, "out": os.path.join(tmp, "out.json")}
        mp.spawn(_rank, args=(2, _port(), spec), nprocs=2, join=True)
        with open(spec["out"]) as fh:
            return json.load(fh)


def main(argv: Optional[list] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt2-124m", choices=sorted(MODELS))
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seq", type=int, default=128, help="tokens a rank per step (the tiny models: at most 64)")
    args = p.parse_args(argv)
    out = {m: run(m, args.model, args.steps, args.budget, args.seq) for m in args.methods.split(",")}
    base = max(r["peak_rss_mb"] for r in out.get("fsdp2", [{"peak_rss_mb": float("nan")}]))
    for m, ranks in out.items():
        peak = max(r["peak_rss_mb"] for r in ranks)
        print(f"{m:22s} peak RSS {peak:8.0f} MB ({peak / base:.2f}x fsdp2); residuals held "
              f"{ranks[0]['residual_bytes'] / 2 ** 20:,.1f} MiB (rank {ranks[0]['residual_rank']})")
    print(json.dumps({"model": args.model, "steps": args.steps, "budget": args.budget, "methods": out}, indent=1))


if __name__ == "__main__":
    main()
