"""Runs inside `torchrun` (gloo): dAD on FSDP2 HSDP's replicate hop against HSDP's own reduction.

Usage: torchrun --nproc_per_node 4 hsdp_worker.py OUT.json CASE [CASE ...]   (one node, 2x2 mesh)
       or one torchrun per node of the simulated cluster (`benchmarks.sim_cluster`).

The mesh is ``(nodes, local)`` with dims ``("replicate", "shard")``, nodes from torchrun's
``LOCAL_WORLD_SIZE`` (several nodes) or 2 (one node, 4 ranks). Each case builds a model, copies it,
HSDP-shards both, enables dAD on the copy and runs the same batches through both:

* ``exact``: every sharded gradient against HSDP's (relative, floored at 1e-6 of the whole
  gradient's norm), AdamW steps, parameters' checksums per rank (replicas must agree), bytes
  between nodes per the report; a state dict round trip (``get_model_state_dict`` and DCP) with dAD
  attached;
* ``auto``: rank 4, a stated slow link between nodes: routes, bytes between nodes against HSDP's,
  losses, and the error-feedback identity of the rank routes;
* ``resume``: the rank routes' state saved per rank after 2 steps (``save_rank_state``) and loaded
  into a fresh synchroniser (on this job's shape; the test's second job loads it on another).
"""
from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(__file__))
import fsdp2_worker as fw  # noqa: E402

from dad_integrations.engines.checkpoint import load_rank_state, save_rank_state  # noqa: E402
from dad_integrations.fsdp import enable_dad_fsdp  # noqa: E402

LR = 1e-2
SLOW = {"intra": {"bandwidth": "10gbit", "latency_us": 50}, "inter": {"bandwidth": "100mbit", "latency_us": 200}}


def mesh():
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    local = 2 if local == world else local  # one node: a 2-wide shard dim
    return init_device_mesh("cpu", (world // local, local), mesh_dim_names=("replicate", "shard"))


def hsdp(name: str, model, dm):
    for block in fw.blocks_of(name, model):
        fully_shard(block, mesh=dm)
    fully_shard(model, mesh=dm)
    return model


def checksum(model) -> float:
    return float(sum(p.to_local().double().sum() for p in model.parameters()))


def step(name, model, data, opt=None):
    loss = fw.loss_of(name, model, data)
    loss.backward()
    return float(loss)


def run_exact(case: dict, dm, out: dict) -> None:
    name = case.get("model", "gpt2")
    rank = dist.get_rank()
    ref = hsdp(name, fw.build(name), dm)
    mine = hsdp(name, fw.build(name), dm)
    sync = enable_dad_fsdp(mine, {"mode": "exact"})
    opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (ref, mine)]
    worst, inter, replicate = 0.0, 0.0, 0.0
    for i in range(case.get("steps", 3)):
        data = fw.batch(name, 4, seed=100 * i + rank)
        for m in (ref, mine):
            step(name, m, data)
        errors = fw.grad_errors(ref, mine)
        worst = max(worst, max(errors.values()))
        totals = sync.last_step_report().totals
        inter, replicate = totals.get("inter_bytes", 0.0), totals.get("replicate_bytes", 0.0)
        for o in opts:
            o.step()
            o.zero_grad()
    params = [checksum(m) for m in (ref, mine)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, params)
    out.update(worst=worst, checksums=gathered, inter_bytes=inter, replicate_bytes=replicate,
               routes=sorted({p.representation for p in sync.last_step_report().params}),
               state_dict=state_dict_round_trip(mine, case))
    sync.close()


def state_dict_round_trip(model, case: dict) -> dict:
    """``get_model_state_dict`` (full and sharded) and a DCP save/load with dAD attached."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    import torch.distributed.checkpoint as dcp
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    sharded = get_model_state_dict(model)
    placements = sorted({str(v.placements) for v in sharded.values() if hasattr(v, "placements")})
    folder = case["dir"] + "/dcp"
    dcp.save(sharded, checkpoint_id=folder)
    before = checksum(model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    loaded = get_model_state_dict(model)
    dcp.load(loaded, checkpoint_id=folder)
    set_model_state_dict(model, loaded)
    return {"full_keys": len(full), "placements": placements, "restored": abs(checksum(model) - before) < 1e-9}


def run_auto(case: dict, dm, out: dict) -> None:
    name = case.get("model", "gpt2")
    rank = dist.get_rank()
    config = {"mode": case.get("mode", "auto"), "rank": 4, "link": SLOW, "lossless_steps": 0,
              "rank_route": case.get("rank_route", "auto")}
    ref = hsdp(name, fw.build(name), dm)
    mine = hsdp(name, fw.build(name), dm)
    sync = enable_dad_fsdp(mine, config)
    opt = torch.optim.AdamW(mine.parameters(), lr=LR)
    losses, identity, ratios, routes = [], 0.0, [], set()
    for i in range(case.get("steps", 4)):
        with torch.no_grad():  # the reference follows dAD's parameters: its gradient is the true average
            for a, b in zip(ref.parameters(), mine.parameters()):
                a.to_local().copy_(b.to_local())
        data = fw.batch(name, 4, seed=0 if case.get("fixed") else 100 * i + rank)
        before = node_residuals(sync)
        losses.append(step(name, mine, data))
        step(name, ref, data)
        report = sync.last_step_report()
        routes |= {p.representation for p in report.params}
        totals = report.totals
        ratios.append(totals["inter_bytes"] / totals["replicate_bytes"])
        identity = max(identity, ef_identity(ref, mine, sync, before, dm))
        opt.step()
        opt.zero_grad()
        ref.zero_grad()
    out.update(losses=losses, identity=identity, ratios=ratios, routes=sorted(routes))
    if case.get("save"):
        save_rank_state(sync, case["save"], rank, dist.get_world_size())
        out["saved_residuals"] = float(sum(r.double().norm() ** 2 for r in node_residuals(sync).values()))
    sync.close()


def node_residuals(sync) -> dict:
    codec = sync.rank_codec
    return {} if codec is None else {n: r.clone() for n, r in codec.memory.residuals.items()}


def ef_identity(ref, mine, sync, before: dict, dm) -> float:
    """Rank routes keep ``avg_dAD = avg_true + (1/W) sum_nodes (e_old - e_new)`` for each shard:
    the largest relative miss over the rank-routed weights (0 where none is)."""
    after = node_residuals(sync)
    world = dist.get_world_size()
    worst = 0.0
    routed = {p.name for p in sync.last_step_report().params if p.representation in ("rank", "rank_allreduce")}
    replicate = dm.get_group("replicate")
    for (name, a), (_, b) in zip(ref.named_parameters(), mine.named_parameters()):
        if name not in routed:
            continue
        true, got = a.grad.to_local().reshape(a.grad.to_local().shape[0], -1), b.grad.to_local()
        got = got.reshape(got.shape[0], -1)
        delta = before.get(name, torch.zeros_like(after[name])) - after[name]
        dist.all_reduce(delta, group=replicate)
        expect = true + delta[:true.shape[0]] / world
        err = torch.tensor([float((got - expect).double().norm()) ** 2, float(expect.double().norm()) ** 2])
        dist.all_reduce(err)
        worst = max(worst, float(err[0]) ** 0.5 / max(float(err[1]) ** 0.5, 1e-12))
    return worst


def run_resume(case: dict, dm, out: dict) -> None:
    """Load a saved state (another job's, maybe of another shape) and take a step."""
    name = case.get("model", "gpt2")
    mine = hsdp(name, fw.build(name), dm)
    sync = enable_dad_fsdp(mine, {"mode": "rank", "rank": 4, "link": SLOW, "lossless_steps": 0})
    payload = load_rank_state(sync, case["load"], dist.get_rank(), dist.get_world_size())
    out["resized_from"] = payload.get("resized_from")
    out["loaded_residuals"] = float(sum(r.double().norm() ** 2 for r in node_residuals(sync).values()))
    step(name, mine, fw.batch(name, 4, seed=7 + dist.get_rank()))
    out["finite"] = all(bool(torch.isfinite(p.grad.to_local()).all()) for p in mine.parameters() if p.grad is not None)
    sync.close()


def run_refusal(case: dict, dm, out: dict) -> None:
    """``set_requires_all_reduce(False)`` (reduce-scatter-only accumulation) raises, naming it, on
    every rank before any collective; the synchroniser then gives the reduction back."""
    name = case.get("model", "gpt2")
    mine = hsdp(name, fw.build(name), dm)
    sync = enable_dad_fsdp(mine, {"mode": "exact"})
    mine.set_requires_all_reduce(False)
    try:
        step(name, mine, fw.batch(name, 4, seed=dist.get_rank()))
        out["raised"] = None
    except RuntimeError as e:
        out["raised"] = str(e)
    sync.close()


RUNNERS = {"exact": run_exact, "auto": run_auto, "resume": run_resume, "refusal": run_refusal}


def main() -> None:
    out_path, cases = sys.argv[1], [json.loads(c) for c in sys.argv[2:]]
    dist.init_process_group("gloo")
    dm = mesh()
    results = {}
    tmp = os.path.dirname(os.path.abspath(out_path))  # shared by every rank (DCP writes there)
    for case in cases:
        out: dict = {}
        case.setdefault("dir", case.get("dir") or os.path.join(tmp, case["kind"]))
        try:
            RUNNERS[case["kind"]](case, dm, out)
        except Exception as e:  # reported to the test, which names the case
            import traceback
            out["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, out)
        results[case.get("id", case["kind"])] = per_rank
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
