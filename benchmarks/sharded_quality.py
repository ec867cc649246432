"""Held-out loss under FSDP2 with each error-feedback memory: whole residuals against the default.

    python -m benchmarks.sharded_quality [--steps 300] [--seeds 3] [--ranks 2] [--variant NAME=JSON ...]
                                          [--smoke] [--out DIR]

Under FSDP2 and ZeRO-2/3 the residual budget (``residual_budget``, `routing.memory`) keeps each
rank route's error-feedback residual as its rank-``q`` part where whole ones would exceed the budget,
which at the default they do from 2 ranks on. This benchmark measures what that costs in quality:
gloo ranks on 127.0.0.1 (one thread each) train `benchmarks.convergence`'s ``gpt2`` workload (the
byte-level GPT-2 of `benchmarks.workload`, n_embd 256, 2 layers, 4 heads, seq 128, AdamW lr 1e-3,
8 sequences a step over all ranks, held-out loss over 8 fixed batches of 8 sequences) with every
block and the root ``fully_shard``-ed and dAD in FSDP2's reduce-scatter (`enable_dad_fsdp`),
``mode: "rank"``, rank 4 (every factored weight on a rank route from the first lossy step, so the
residuals are what is compared), once per variant:

  whole     ``residual_budget: null``: whole fp32 residuals, as before the budget bound
  default   the config's defaults (the residual budget's fit)

(``--variant NAME=JSON`` adds or replaces one: its keys over the common ones.) Every variant of a
seed starts from the same weights and sees the same batches, the variants taking turns step by step
(a shared machine's load falls on all of them alike). Per variant: the held-out loss at the end
(mean ± std over seeds), its ratio to ``whole``'s, and the residual numbers a rank held at the end
(`ErrorFeedback.numel`) beside the memory model's figure (`ShardedExchanger.memory`).

Outputs in ``--out`` (default ``benchmarks/results``): ``sharded_quality.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("benchmarks.sharded_quality")

COMMON = {"mode": "rank", "rank": 4, "objective": "bytes"}
VARIANTS: Dict[str, dict] = {"whole": {"residual_budget": None}, "default": {}}
GPT2 = {"model": {"n_embd": 256, "n_layer": 2, "n_head": 4, "seq": 128, "batch": None}, "global_batch": 8,
        "lr": 1e-3, "steps": 300, "eval_every": 50, "eval_batches": 8, "eval_batch": 8, "rank": 4}
SMOKE = {"model": {"n_embd": 32, "n_layer": 1, "n_head": 2, "seq": 16, "batch": 2}, "global_batch": 4,
         "lr": 1e-3, "steps": 4, "eval_every": 2, "eval_batches": 2, "eval_batch": 2, "rank": 2}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int)
    p.add_argument("--seeds", type=int, default=3, help="seeds first-seed .. first-seed + N - 1")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--variant", action="append", default=[], metavar="NAME=JSON")
    p.add_argument("--only", help="comma-separated variants to run (default: all)")
    p.add_argument("--smoke", action="store_true", help="a tiny GPT-2, 4 steps, 1 seed (tests)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--stem", default="sharded_quality")
    p.add_argument("--timeout", type=float, default=600)
    return p.parse_args(argv)


def _variants(args: argparse.Namespace) -> Dict[str, dict]:
    out = dict(VARIANTS)
    for item in args.variant:
        name, _, text = item.partition("=")
        out[name] = json.loads(text or "{}")
    if args.only:
        out = {k: out[k] for k in args.only.split(",")}
    return out


# -- one rank ---------------------------------------------------------------------------------------
def _train_seed(settings: dict, variants: Dict[str, dict], seed: int) -> List[dict]:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from benchmarks._convergence_ranks import ByteGPT2
    from dad_integrations.fsdp import enable_dad_fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    task = ByteGPT2(dict(settings, optimizer="adamw"), seed, rank, world)
    torch.manual_seed(seed)
    init = {k: v.clone() for k, v in task.build_model().state_dict().items()}
    runs = []
    for name, keys in variants.items():
        model = task.build_model()
        model.load_state_dict(init)
        model.train()
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        sync = enable_dad_fsdp(model, dict(COMMON, **keys))
        runs.append({"name": name, "model": model, "sync": sync, "opt": task.optimizer(model.parameters()),
                     "evals": [], "losses": []})
    batches, evals_at = task.batches(), set(task.eval_steps)
    for step in range(task.steps + 1):
        if step in evals_at:
            for r in runs:
                r["evals"].append(task.evaluate(r["model"])["loss"])
            if rank == 0:
                log.info("seed %d step %d held-out loss: %s", seed, step,
                         ", ".join(f"{r['name']} {r['evals'][-1]:.4f}" for r in runs))
        if step == task.steps:
            break
        batch = next(batches)
        for r in runs:  # the variants take turns on the same batch
            loss = task.loss(r["model"], batch)
            loss.backward()
            r["opt"].step()
            r["opt"].zero_grad(set_to_none=True)
            r["losses"].append(float(loss.detach()))
    out = []
    for r in runs:
        ex = r["sync"].exchanger
        mem = ex.memory
        out.append({"variant": r["name"], "seed": seed, "config": dict(COMMON, **variants[r["name"]]),
                    "eval_steps": list(task.eval_steps), "eval_loss": r["evals"],
                    "final_eval_loss": r["evals"][-1],
                    "train_loss": r["losses"], "residual_numbers_held": ex.state.memory.numel(),
                    "residual_rank": None if mem is None else mem.residual_rank,
                    "residual_bytes_model": None if mem is None else mem.residuals,
                    "whole_residual_bytes": None if mem is None else mem.whole_residuals})
        r["sync"].close()
    return out


def rank_main(rank: int, world: int, port: int, spec: dict) -> None:
    """One rank (``torch.multiprocessing.spawn``): every seed; rank 0 writes ``spec["json"]``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s")
    if rank != 0:
        logging.getLogger("dad_integrations").setLevel(logging.WARNING)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=spec["timeout"]))
    try:
        records: List[dict] = []
        for seed in spec["seeds"]:
            records += _train_seed(spec["settings"], spec["variants"], seed)
            if rank == 0:  # after every seed: a run cut short keeps what it finished
                Path(spec["json"]).write_text(json.dumps({"records": records, "spec": spec}, indent=1))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# -- the launcher -----------------------------------------------------------------------------------
def summarise(records: Sequence[dict], reference: str = "whole") -> List[dict]:
    """Per variant: final held-out loss mean ± std over seeds, its ratio to ``reference``'s mean and
    per seed (``paired``: the same weights and batches), and the residual numbers held."""
    by: Dict[str, List[dict]] = {}
    for rec in records:
        by.setdefault(rec["variant"], []).append(rec)
    ref = by.get(reference)
    ref_mean = statistics.mean(r["final_eval_loss"] for r in ref) if ref else None
    ref_by_seed = {r["seed"]: r["final_eval_loss"] for r in ref or ()}
    rows = []
    for name, recs in by.items():
        losses = [r["final_eval_loss"] for r in recs]
        mean = statistics.mean(losses)
        rows.append({"variant": name, "seeds": len(recs), "mean": mean,
                     "std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                     "ratio": mean / ref_mean if ref_mean else None, "residual_rank": recs[0]["residual_rank"],
                     "residual_numbers_held": recs[0]["residual_numbers_held"],
                     "residual_bytes_model": recs[0]["residual_bytes_model"],
                     "whole_residual_bytes": recs[0]["whole_residual_bytes"], "config": recs[0]["config"],
                     "per_seed": losses, "paired": [r["final_eval_loss"] / ref_by_seed[r["seed"]] for r in recs
                                                    if r["seed"] in ref_by_seed]})
    return rows


def markdown(rows: Sequence[dict], command: str, wall_s: float, steps: int, world: int) -> str:
    """The table of `summarise`'s rows."""
    lines = [f"# Held-out loss under FSDP2 by error-feedback memory ({world} ranks, {steps} steps)", "",
             f"Command: `{command}` ({wall_s / 60:.1f} min, 2 cores shared). Config over the defaults: "
             f"{json.dumps(COMMON)}.", "",
             "| variant | keys | residuals kept | residual bytes a rank (held / model) | held-out loss (mean ± std) "
             "| / whole | per seed | / whole per seed |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kept = "whole" if r["residual_rank"] is None else f"rank {r['residual_rank']}"
        held = r["residual_numbers_held"] * 4
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.4f}"
        keys = json.dumps({k: v for k, v in r["config"].items() if k not in COMMON}) or "{}"
        lines.append(f"| {r['variant']} | `{keys}` | {kept} | {held / 2 ** 20:.2f} / "
                     f"{(r['residual_bytes_model'] or 0) / 2 ** 20:.2f} MiB (whole "
                     f"{(r['whole_residual_bytes'] or 0) / 2 ** 20:.2f}) | {r['mean']:.4f} ± {r['std']:.4f} | {ratio} "
                     f"| {', '.join(f'{x:.4f}' for x in r['per_seed'])} "
                     f"| {', '.join(f'{x:.4f}' for x in r['paired'])} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    import sys

    import torch.multiprocessing as mp

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    settings = dict(SMOKE if args.smoke else GPT2)
    if args.steps:
        settings["steps"] = args.steps
    seeds = list(range(args.first_seed, args.first_seed + (1 if args.smoke else args.seeds)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.stem}.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = {"settings": settings, "variants": _variants(args), "seeds": seeds, "json": str(path),
            "timeout": args.timeout}
    start = time.perf_counter()
    mp.spawn(rank_main, args=(args.ranks, port, spec), nprocs=args.ranks, join=True)
    wall = time.perf_counter() - start
    records = json.loads(path.read_text())["records"]
    rows = summarise(records)
    command = "python -m benchmarks.sharded_quality " + " ".join(sys.argv[1:] if argv is None else argv)
    (out / f"{args.stem}.md").write_text(markdown(rows, command.strip(), wall, settings["steps"], args.ranks))
    path.write_text(json.dumps({"records": records, "summary": rows, "wall_s": wall, "spec": spec}, indent=1))
    for r in rows:
        log.info("%s: %.4f ± %.4f (x%s)", r["variant"], r["mean"], r["std"],
                 "-" if r["ratio"] is None else f"{r['ratio']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
