"""Runs inside `accelerate launch` with an FSDP2 config (2 CPU processes): dAD through Accelerate and
the Trainer on the model Accelerate's own FSDP2 preparation shards.

Usage: accelerate launch --config_file FSDP2_CPU.yaml fsdp2_accelerate_worker.py OUT.json WORKDIR

The launcher's FSDP environment (``ACCELERATE_USE_FSDP``, ``FSDP_VERSION=2``, transformer-based
auto wrap) builds Accelerate's FSDP plugin; `fsdp_on_cpu` lets Accelerate take its FSDP path on
CPU processes. Cases (each rank's result gathered):

  "accelerate": GPT-2 (tied embeddings) and Llama prepared by ``accelerator.prepare(model,
      optimizer)`` twice from the same weights, one after the other, the second with
      ``enable_dad(accelerator, model, {"mode": "exact"})``; uneven batches,
      ``accelerator.accumulate`` over 2 micro-steps (GPT-2), ``clip_grad_norm_``, SGD; every
      sharded gradient compared after each synchronised backward (and after clipping), parameters
      at the end; then ``save_state`` / ``load_state`` (no dAD file: exact keeps no state).
  "trainer": ``transformers.Trainer`` with FSDP2 (``fsdp=True, fsdp_config={"version": 2}``),
      plain and with ``DADCallback({"mode": "exact"})``, gradient accumulation 2 and clipping;
      final parameters compared, the callback's metrics in the log history.
  "fsdp1": a model wrapped in FSDP1, Accelerate's plugin at ``fsdp_version: 1``: ``enable_dad``,
      ``enable_dad_fsdp`` and ``DADCallback`` each raise, naming FSDP1 and FSDP2.
"""
from __future__ import annotations

import copy
import logging
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from fsdp2_worker import LogLines  # noqa: E402
from fsdp_on_cpu import allow_fsdp_on_cpu  # noqa: E402
from trainer_worker import ByteWindows  # noqa: E402

from dad_integrations.accelerate import enable_dad  # noqa: E402

allow_fsdp_on_cpu()


def _full(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter, whole (sharded ones gathered), flattened."""
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                      for p in model.parameters()])


def _ranks_agree(flat: torch.Tensor) -> bool:
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


def _local_grads(model: torch.nn.Module) -> dict:
    """This rank's shard of every gradient, copied."""
    return {n: p.grad.to_local().detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _errors(ref: dict, mine: dict) -> dict:
    """Per parameter ||g - g_ref|| / max(||g_ref||, 1e-6 ||whole g_ref||) over all ranks' shards
    (as `fsdp2_worker.grad_errors`)."""
    if ref.keys() != mine.keys():
        raise AssertionError(f"gradients of different parameters: {sorted(ref.keys() ^ mine.keys())}")
    sq = []
    for n in ref:
        sq += [float((mine[n] - ref[n]).double().norm()) ** 2, float(ref[n].double().norm()) ** 2]
    t = torch.tensor(sq, dtype=torch.float64)
    dist.all_reduce(t)
    total = float(t[1::2].sum()) ** 0.5
    return {n: float(t[2 * i]) ** 0.5 / max(float(t[2 * i + 1]) ** 0.5, 1e-6 * total) for i, n in enumerate(ref)}


def _worst(pairs) -> list:
    """The worst (parameter, error) over steps of (reference, dAD) gradient dicts."""
    return max((kv for r, m in pairs for kv in _errors(r, m).items()), key=lambda kv: kv[1])


def train_with_accelerate(accelerator, name: str, init: torch.nn.Module, accumulate: int, dad: bool,
                          workdir: str) -> dict:
    """3 optimizer steps of ``init``'s copy through Accelerate's FSDP2 path (with dAD when asked):
    the gradients after each synchronised backward and after clipping, the norms, the parameters.

    One prepared model at a time: Accelerate's FSDP ``clip_grad_norm_`` finds its model by comparing
    parameter lists with ``==``, which raises when a second FSDP2 model was prepared before it."""
    from torch.distributed.fsdp import FSDPModule
    accelerator.gradient_accumulation_steps = accumulate
    accelerator.step = 0
    plain = copy.deepcopy(init)
    # SGD: parameters stay within round-off of each other, so every step compares like with like
    # (AdamW turns the round-off-only gradients of GPT-2's key biases into lr-sized steps)
    model, opt = accelerator.prepare(plain, torch.optim.SGD(plain.parameters(), lr=0.05))
    out = {"grads": [], "clipped": [], "norms": [], "reps": set()}
    logged = LogLines()
    logging.getLogger("dad_integrations").addHandler(logged)
    sync = enable_dad(accelerator, model, {"mode": "exact"}) if dad else None
    rank, steps, micro = accelerator.process_index, 0, 0
    while steps < 3:
        data = models.batch(name, 1 + rank, seed=1000 * steps + 10 * micro + rank)  # uneven batches
        with accelerator.accumulate(model):
            accelerator.backward(models.loss_of(name, model, data))
            if accelerator.sync_gradients:
                out["grads"].append(_local_grads(model))
                if sync is not None:
                    out["reps"] |= {p.representation for p in sync.last_step_report().params}
                norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
                out["norms"].append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
                out["clipped"].append(_local_grads(model))
            opt.step()
            opt.zero_grad()
        micro += 1
        if accelerator.sync_gradients:
            steps += 1
    out["params"] = _full(model)
    if sync is not None:
        totals = sync.last_step_report().totals
        out["sync"] = {"params_exact": totals["params_exact"], "sent": totals["sent_bytes"],
                       "reduce_scatter": totals["reduce_scatter_bytes"],
                       "fsdp_modules": sum(isinstance(m, FSDPModule) for m in model.modules()),
                       "fsdp_groups": len({id(pg) for m in model.modules() if isinstance(m, FSDPModule)
                                           for pg in m._get_fsdp_state()._fsdp_param_groups}),
                       "groups_hooked": len(sync._installed),
                       "dense_only": [u.name for u in sync.plan.units if u.dense_only]}
        # save_state / load_state with dAD enabled: Accelerate's FSDP2 checkpoint, and no dAD file
        folder = os.path.join(workdir, f"state-{name}")
        accelerator.save_state(folder)
        accelerator.load_state(folder)
        out["saved"] = sorted(os.listdir(folder)) if rank == 0 else []
        out["after_load"] = float((_full(model) - out["params"]).abs().max())
        sync.close()
    logging.getLogger("dad_integrations").removeHandler(logged)
    out["log"] = logged.lines
    accelerator.free_memory()
    return out


def run_accelerate_model(accelerator, name: str, accumulate: int, workdir: str) -> dict:
    """One model through Accelerate's FSDP2 path, without and with dAD (see the module doc)."""
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    assert accelerator.distributed_type == DistributedType.FSDP and accelerator.is_fsdp2
    # Accelerate keeps the first model's block classes in its plugin (one model family per
    # process); a second family starts again from the launcher's transformer-based policy
    plugin = accelerator.state.fsdp_plugin
    plugin.transformer_cls_names_to_wrap, plugin.auto_wrap_policy = None, transformer_auto_wrap_policy
    init = models.build(name)
    ref = train_with_accelerate(accelerator, name, init, accumulate, False, workdir)
    mine = train_with_accelerate(accelerator, name, init, accumulate, True, workdir)
    a, b = ref["params"], mine["params"]
    return {"worst": _worst(zip(ref["grads"], mine["grads"])),
            "clipped": _worst(zip(ref["clipped"], mine["clipped"])),
            "per_step": [_errors(r, m) for r, m in zip(ref["grads"], mine["grads"])],
            "norms": [ref["norms"], mine["norms"]],
            "param_diff": float((a - b).abs().max() / a.abs().max()), "identical": _ranks_agree(b),
            "representations": sorted(mine["reps"]), **mine["sync"],
            "saved": mine["saved"], "after_load": mine["after_load"], "log": mine["log"]}


def run_accelerate(workdir: str) -> dict:
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)  # the FSDP plugin comes from the launcher's environment
    return {name: run_accelerate_model(accelerator, name, accumulate, workdir)
            for name, accumulate in (("gpt2", 2), ("llama", 1))}


def run_trainer(workdir: str) -> dict:
    from transformers import Trainer, TrainingArguments

    from dad_integrations.transformers import DADCallback

    init = models.build("gpt2")

    def train(callbacks: list) -> tuple:
        model = copy.deepcopy(init)
        args = TrainingArguments(output_dir=workdir, max_steps=4, per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=2,
                                 report_to=[], save_strategy="no", seed=0, data_seed=0, disable_tqdm=True,
                                 max_grad_norm=0.5, use_cpu=True, fsdp=True,
                                 fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]})
        trainer = Trainer(model=model, args=args, train_dataset=ByteWindows(count=32, low=3), callbacks=callbacks)
        assert trainer.is_fsdp_enabled, "the Trainer did not take its FSDP path"
        trainer.train()
        return _full(trainer.model), trainer.state.log_history

    ref, _ = train([])
    callback = DADCallback({"mode": "exact"})
    mine, history = train([callback])
    totals = callback.sync.last_step_report().totals
    return {"rel_diff": float((mine - ref).norm() / ref.norm()),
            "moved": float((mine - _full(init)).norm()), "identical": _ranks_agree(mine),
            "sync": type(callback.sync).__name__, "params_exact": totals["params_exact"],
            "log_history": history}


def run_fsdp1(workdir: str) -> dict:
    """enable_dad (Accelerate's plugin at fsdp_version 1), enable_dad_fsdp and DADCallback on a model
    wrapped in FSDP1. Accelerate's own FSDP1 preparation does not run on CPU (it passes
    ``device_id=cpu:0``, which FSDP1 finds inconsistent with its CPU compute device), so torch's
    ``FullyShardedDataParallel`` wraps the model here, as Accelerate would."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FullyShardedDataParallel
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from dad_integrations.fsdp import enable_dad_fsdp
    from dad_integrations.transformers import DADCallback

    args = TrainingArguments(output_dir=workdir, use_cpu=True, report_to=[])  # resets Accelerate's state
    # a new Accelerator with an FSDP1 plugin in this process (PartialState holds the last type)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1,
                                                                                   sync_module_states=False))
    model = FullyShardedDataParallel(models.build("mlp"), device_id=torch.device("cpu"))
    model(models.batch("mlp", 2, seed=0)["x"]).sum().backward()  # a working FSDP1 model
    errors = {"fsdp_version": accelerator.state.fsdp_plugin.fsdp_version}  # FSDP1 according to Accelerate
    calls = {"enable_dad": lambda: enable_dad(accelerator, model, {"mode": "exact"}),
             "enable_dad_fsdp": lambda: enable_dad_fsdp(model, {"mode": "exact"}),
             "DADCallback": lambda: DADCallback({"mode": "exact"}).on_train_begin(
                 args, TrainerState(), TrainerControl(), model=model)}
    for label, call in calls.items():
        try:
            call()
            errors[label] = None
        except ValueError as e:
            errors[label] = str(e)
    return errors


CASES = {"accelerate": run_accelerate, "trainer": run_trainer, "fsdp1": run_fsdp1}
if len(sys.argv) > 3:
    CASES = {k: CASES[k] for k in sys.argv[3:]}


def main() -> None:
    out_path, workdir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    results = {}
    for cid, run in CASES.items():
        try:
            mine = run(os.path.join(workdir, cid))
        except Exception:
            mine = {"exception": traceback.format_exc()}
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
        results[cid] = per_rank
    models.write_and_exit(out_path, results)


if __name__ == "__main__":
    main()
