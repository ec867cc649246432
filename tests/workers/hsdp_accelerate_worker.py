"""Runs inside `accelerate launch` with an FSDP2 HSDP config (2 machines x 2 CPU processes): dAD on the
replicate hop of the model Accelerate itself shards, through `enable_dad` and through the Trainer.

Usage (one launch per node of the simulated cluster, `benchmarks.sim_cluster`)::

    accelerate launch --config_file examples/accelerate/hsdp_multi_node_cpu.yaml \
        hsdp_accelerate_worker.py OUT.json WORKDIR

The config's ``parallelism_config`` (``dp_replicate_size`` 2 x ``dp_shard_size`` 2) makes Accelerate
build the mesh ``("dp_replicate", "dp_shard_cp")`` and ``fully_shard`` every block on it: HSDP. FSDP2
reduce-scatters inside the node; dAD takes the all-reduce between nodes. `fsdp_on_cpu` lets
Accelerate take its FSDP path on CPU processes. Cases, each rank's result gathered:

  "accelerate": GPT-2 (tiny, from a config) prepared twice from the same weights, one after the
      other (one prepared FSDP model at a time: Accelerate's ``clip_grad_norm_`` looks models up
      by parameter lists), the second with ``enable_dad(accelerator, model, {"mode": "exact"})``;
      uneven batches per rank, SGD, 3 steps. Every sharded gradient against HSDP's own, the report's
      levels and bytes between nodes, and each rank's shard against its replica on the other node.
  "checkpoint": the same model with rank routes (``mode: rank``): 2 steps, ``save_state``, one more
      step (the residuals move on), ``load_state``: the rank routes' residuals and the parameters
      are back to what was saved, and the folder holds each rank's ``dad_state_rank{r}.pt``.
  "trainer": ``transformers.Trainer`` with FSDP2 HSDP (``fsdp=True, fsdp_config={"version": 2}``
      and ``parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)``), plain
      and with ``DADCallback({"mode": "exact"})``; the final parameters compared.
"""
from __future__ import annotations

import copy
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import fsdp2_worker as fw  # noqa: E402
import models  # noqa: E402
from fsdp_on_cpu import allow_fsdp_on_cpu  # noqa: E402
from trainer_worker import ByteWindows  # noqa: E402

from dad_integrations.accelerate import enable_dad  # noqa: E402

allow_fsdp_on_cpu()

NAME = "gpt2"  # fsdp2_worker's tiny GPT-2 (2 blocks of width 32, tied embeddings)
STEPS = 3
RANK_CONFIG = {"mode": "rank", "rank": 2, "lossless_steps": 0}  # every weight by a rank route from step 1


def _full(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter, whole (sharded ones gathered over the 2-D mesh), flattened."""
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                      for p in model.parameters()])


def _local(model: torch.nn.Module) -> torch.Tensor:
    """This rank's shards, flattened."""
    return torch.cat([(p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1)
                      for p in model.parameters()])


def _local_grads(model: torch.nn.Module) -> dict:
    return {n: p.grad.to_local().detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _errors(ref: dict, mine: dict) -> dict:
    """Per parameter ``||g - g_ref|| / max(||g_ref||, 1e-6 ||whole g_ref||)``, over every rank's shard.
    HSDP's replicas hold the same shard twice: both count, which scales numerator and denominator alike."""
    if ref.keys() != mine.keys():
        raise AssertionError(f"gradients of different parameters: {sorted(ref.keys() ^ mine.keys())}")
    sq = []
    for n in ref:
        sq += [float((mine[n] - ref[n]).double().norm()) ** 2, float(ref[n].double().norm()) ** 2]
    t = torch.tensor(sq, dtype=torch.float64)
    dist.all_reduce(t)
    total = float(t[1::2].sum()) ** 0.5
    return {n: float(t[2 * i]) ** 0.5 / max(float(t[2 * i + 1]) ** 0.5, 1e-6 * total) for i, n in enumerate(ref)}


def _replicas_agree(model: torch.nn.Module, accelerator) -> bool:
    """Each rank's shards equal, bit for bit, those of the rank holding the same rows on the other
    node (the replicate dim of Accelerate's mesh)."""
    group = accelerator.torch_device_mesh["dp_replicate"].get_group()
    flat = _local(model)
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    return all(torch.equal(gathered[0], g) for g in gathered)


def _prepare(accelerator, init: torch.nn.Module):
    plain = copy.deepcopy(init)
    # SGD: parameters stay within round-off of each other, so every step compares like with like
    return accelerator.prepare(plain, torch.optim.SGD(plain.parameters(), lr=0.05))


def _step(accelerator, model, step: int) -> None:
    rank = accelerator.process_index
    data = fw.batch(NAME, 1 + rank % 2, seed=1000 * step + rank)  # uneven batches inside each node
    accelerator.backward(fw.loss_of(NAME, model, data))


def train(accelerator, init: torch.nn.Module, dad: bool) -> dict:
    """``STEPS`` SGD steps of ``init``'s copy through Accelerate's HSDP (with dAD exact when asked)."""
    model, opt = _prepare(accelerator, init)
    sync = enable_dad(accelerator, model, {"mode": "exact"}) if dad else None
    out = {"grads": [], "levels": set(), "inter": [], "replicate": []}
    for step in range(STEPS):
        _step(accelerator, model, step)
        out["grads"].append(_local_grads(model))
        if sync is not None:
            report = sync.last_step_report()
            out["levels"] |= {p.level for p in report.params if p.representation != "overhead"}
            out["inter"].append(report.totals.get("inter_bytes", 0.0))
            out["replicate"].append(report.totals.get("replicate_bytes", 0.0))
        opt.step()
        opt.zero_grad()
    out["params"] = _full(model)
    out["replicas"] = _replicas_agree(model, accelerator)
    if sync is not None:
        out["hsdp"] = sync._replicate is not None  # dAD found Accelerate's 2-D mesh
        sync.close()
    accelerator.free_memory()
    return out


def run_accelerate(accelerator, workdir: str) -> dict:
    from accelerate.utils import DistributedType
    assert accelerator.distributed_type == DistributedType.FSDP and accelerator.is_fsdp2
    mesh = accelerator.torch_device_mesh
    init = fw.build(NAME)
    ref = train(accelerator, init, dad=False)
    mine = train(accelerator, init, dad=True)
    worst = max((kv for r, m in zip(ref["grads"], mine["grads"]) for kv in _errors(r, m).items()),
                key=lambda kv: kv[1])
    a, b = ref["params"], mine["params"]
    return {"mesh": list(mesh.mesh_dim_names), "shape": list(mesh.mesh.shape), "hsdp": mine["hsdp"],
            "worst": list(worst), "param_diff": float((a - b).abs().max() / a.abs().max()),
            "replicas": [ref["replicas"], mine["replicas"]], "levels": sorted(mine["levels"]),
            "inter_bytes": mine["inter"], "replicate_bytes": mine["replicate"]}


def _residuals(sync) -> dict:
    codec = sync.rank_codec
    return {} if codec is None else {n: r.clone() for n, r in codec.memory.residuals.items()}


def run_checkpoint(accelerator, workdir: str) -> dict:
    """save_state / load_state with dAD's rank routes attached (see the module doc)."""
    model, opt = _prepare(accelerator, fw.build(NAME))
    sync = enable_dad(accelerator, model, RANK_CONFIG)
    for step in range(2):
        _step(accelerator, model, step)
        opt.step()
        opt.zero_grad()
    routes = sorted({p.representation for p in sync.last_step_report().params})
    saved, params = _residuals(sync), _full(model)
    folder = os.path.join(workdir, "state")
    accelerator.save_state(folder)
    _step(accelerator, model, 2)  # one more step: residuals and parameters move on
    opt.step()
    opt.zero_grad()
    moved = max((float((r - saved[n]).abs().max()) for n, r in _residuals(sync).items()), default=0.0)
    accelerator.load_state(folder)
    loaded = _residuals(sync)
    out = {"routes": routes, "residuals": len(saved), "moved": moved,
           "residual_diff": max((float((loaded[n] - r).abs().max()) for n, r in saved.items()), default=-1.0),
           "same_keys": sorted(loaded) == sorted(saved),
           "param_diff": float((_full(model) - params).abs().max()),
           "files": sorted(os.listdir(folder)) if accelerator.is_main_process else []}
    sync.close()
    accelerator.free_memory()
    return out


def run_trainer(accelerator, workdir: str) -> dict:
    from accelerate import ParallelismConfig
    from transformers import Trainer, TrainingArguments

    from dad_integrations.transformers import DADCallback

    init = fw.build(NAME)

    def train_with(callbacks: list) -> tuple:
        model = copy.deepcopy(init)
        args = TrainingArguments(output_dir=workdir, max_steps=3, per_device_train_batch_size=2,
                                 learning_rate=1e-3, logging_steps=3, report_to=[], save_strategy="no", seed=0,
                                 data_seed=0, disable_tqdm=True, use_cpu=True, fsdp=True,
                                 fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]},
                                 parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))
        trainer = Trainer(model=model, args=args, train_dataset=ByteWindows(count=24, low=3), callbacks=callbacks)
        assert trainer.is_fsdp_enabled, "the Trainer did not take its FSDP path"
        trainer.train()
        mesh = trainer.accelerator.torch_device_mesh
        return _full(trainer.model), list(mesh.mesh_dim_names)

    ref, _ = train_with([])
    callback = DADCallback({"mode": "exact"})
    mine, dims = train_with([callback])
    report = callback.sync.last_step_report()
    return {"rel_diff": float((mine - ref).norm() / ref.norm()), "moved": float((mine - _full(init)).norm()),
            "mesh": dims, "hsdp": callback.sync._replicate is not None,
            "levels": sorted({p.level for p in report.params if p.representation != "overhead"}),
            "inter_bytes": report.totals.get("inter_bytes", 0.0)}


CASES = {"accelerate": run_accelerate, "checkpoint": run_checkpoint, "trainer": run_trainer}


def main() -> None:
    from accelerate import Accelerator
    out_path, workdir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)  # the FSDP plugin and the parallelism config from the launcher
    results = {}
    for cid, run in CASES.items():
        try:
            mine = run(accelerator, os.path.join(workdir, cid))
        except Exception:
            mine = {"exception": traceback.format_exc()}
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
        results[cid] = per_rank
    models.write_and_exit(out_path, results)


if __name__ == "__main__":
    main()
