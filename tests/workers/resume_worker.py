"""Checkpoint and resume with dAD's per-rank state, on real engines (2 CPU processes).

Usage (OUT is a JSON file, WORK a folder every rank sees):
  accelerate launch --config_file examples/accelerate/cpu_2proc.yaml resume_worker.py accelerate OUT WORK
  accelerate launch --config_file examples/accelerate/cpu_2proc.yaml resume_worker.py trainer OUT WORK
  DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 resume_worker.py deepspeed|accelerate-deepspeed|trainer-deepspeed[-zero3] OUT WORK
  horovodrun -np 2 -H localhost:2 --gloo python resume_worker.py horovod OUT WORK

Each engine trains rank-dAD with error feedback three times from the same weights on the same data:
"straight" (STEPS steps, saving a checkpoint after SAVE_AT of them with the engine's own
mechanism), "resumed" (everything built anew: model, optimizer, dAD; the checkpoint loaded, the
remaining steps trained) and "no-dad-state" (as resumed, from a copy of the checkpoint without dAD's
files). Per rank it writes how far the resumed runs end from the straight one (parameters and dAD
state) and which dAD files the checkpoint holds.
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
import sys
from typing import Any, Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

CONFIG = {"mode": "rank", "rank": 2, "error_feedback": True}
STEPS, SAVE_AT = 6, 3
MODEL = "gpt2"


# -- comparisons ------------------------------------------------------------------------------------
def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])


def flat_state(sync: Any) -> torch.Tensor:
    """Every tensor of dAD's state (and the dense-for-good flags), in parameter-name order."""
    parts: List[torch.Tensor] = []
    state = sync.state_dict()
    parts.append(torch.tensor([float(state["steps"])]))
    # the rank routes' state, then (DADSynchronizer) each weight's flags
    entries = sorted(state["rank_routes"].items()) + sorted(state.get("units", {}).items())
    for name, entry in entries:
        for key, value in sorted(entry.items()):
            if isinstance(value, torch.Tensor):
                parts.append(value.detach().float().reshape(-1).cpu())
            elif isinstance(value, bool):
                parts.append(torch.tensor([float(value)]))
    return torch.cat(parts) if parts else torch.zeros(0)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))


def summarise(runs: Dict[str, tuple], ckpt: str) -> dict:
    """Distances of the resumed runs from the straight one, and the dAD files of the checkpoint."""
    p0, s0 = runs["straight"]
    out: Dict[str, Any] = {"state_numel": int(s0.numel()), "state_norm": float(s0.norm()),
                           # a weighted sum, to tell whether ranks hold different state
                           "state_fingerprint": float((s0.double() * torch.arange(1, s0.numel() + 1)).sum())}
    for label in ("resumed", "no-dad-state"):
        p, s = runs[label]
        out[label] = {"params_equal": bool(torch.equal(p, p0)), "params_rel": rel(p, p0),
                      "state_equal": bool(s.shape == s0.shape and torch.equal(s, s0)), "state_rel": rel(s, s0)}
    out["files"] = sorted(os.path.relpath(os.path.join(d, f), ckpt) for d, _, fs in os.walk(ckpt)
                          for f in fs if f.startswith("dad_state"))
    return out


def copy_without_dad(ckpt: str, dest: str, is_main: bool, barrier: Callable[[], None]) -> None:
    """A copy of the checkpoint without dAD's files (one rank copies, all wait)."""
    if is_main:
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(ckpt, dest, ignore=lambda _, names: [n for n in names if n.startswith("dad_state")])
    barrier()


def batch(step: int, rank: int, size: int = 3) -> dict:
    return models.batch(MODEL, size + rank, seed=1000 * step + rank)


# -- Accelerate (DDP) -------------------------------------------------------------------------------
def run_accelerate(work: str) -> list:
    import torch.distributed as dist
    from accelerate import Accelerator
    from dad_integrations.accelerate import enable_dad

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    ckpt, bare = os.path.join(work, "ckpt"), os.path.join(work, "ckpt-no-dad")

    def train(start: int, load: Optional[str]) -> tuple:
        model = models.build(MODEL)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, opt = accelerator.prepare(model, opt)
        sync = enable_dad(accelerator, model, CONFIG)
        if load is not None:
            accelerator.load_state(load)
        for step in range(start, STEPS):
            accelerator.backward(models.loss_of(MODEL, model, batch(step, rank)))
            opt.step()
            opt.zero_grad(set_to_none=True)
            if load is None and step + 1 == SAVE_AT:
                accelerator.save_state(ckpt)
        out = flat_params(accelerator.unwrap_model(model)), flat_state(sync)
        accelerator.free_memory()
        return out

    runs = {"straight": train(0, None)}
    runs["resumed"] = train(SAVE_AT, ckpt)
    copy_without_dad(ckpt, bare, accelerator.is_main_process, accelerator.wait_for_everyone)
    runs["no-dad-state"] = train(SAVE_AT, bare)
    result = summarise(runs, ckpt)
    per_rank = [None] * accelerator.num_processes
    dist.all_gather_object(per_rank, result)
    return per_rank


# -- transformers.Trainer ---------------------------------------------------------------------------
def run_trainer(work: str, deepspeed: bool = False, stage: int = 1) -> list:
    import torch.distributed as dist
    from transformers import Trainer, TrainingArguments
    from dad_integrations.transformers import DADCallback
    from trainer_worker import DEEPSPEED, ByteWindows

    init = models.build(MODEL)
    dataset = ByteWindows()
    if deepspeed:
        # Accelerate counts one process under DeepSpeed on CPUs, so the Trainer does not shard
        # the data: give each rank its own windows, or their dAD states would be equal
        dataset.data = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(1 + int(os.environ["RANK"])))

    def train(out_dir: str, resume: Optional[str]) -> tuple:
        model = copy.deepcopy(init)
        config = {**DEEPSPEED, "zero_optimization": {"stage": stage}}
        device_args = {"deepspeed": config, "ddp_backend": "gloo"} if deepspeed else {"use_cpu": True}
        args = TrainingArguments(output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=4,
                                 learning_rate=3e-3, logging_steps=100, report_to=[], save_strategy="steps",
                                 save_steps=SAVE_AT, seed=0, data_seed=0, disable_tqdm=True, max_grad_norm=1.0,
                                 **device_args)
        callback = DADCallback(CONFIG)  # under DeepSpeed: no "dad" block, the callback attaches dAD
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[callback])
        trainer.train(resume_from_checkpoint=resume)
        params = list(model.parameters())
        with (_zero3_gathered(params) if deepspeed and stage == 3 else contextlib.nullcontext()):
            return flat_params(model), flat_state(callback.sync)

    ckpt = os.path.join(work, "straight", f"checkpoint-{SAVE_AT}")
    bare = os.path.join(work, "elsewhere", f"checkpoint-{SAVE_AT}")
    runs = {"straight": train(os.path.join(work, "straight"), None)}
    # output_dir differs from the checkpoint's: the callback must use the path given to train()
    runs["resumed"] = train(os.path.join(work, "resumed"), ckpt)
    copy_without_dad(ckpt, bare, dist.get_rank() == 0, dist.barrier)
    runs["no-dad-state"] = train(os.path.join(work, "no-dad"), bare)
    result = summarise(runs, ckpt)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, result)
    return per_rank


def _zero3_gathered(params: list):
    import deepspeed
    return deepspeed.zero.GatheredParameters(params)


# -- DeepSpeed engines --------------------------------------------------------------------------------
def run_deepspeed(work: str) -> list:
    import deepspeed
    import deepspeed_dad
    from deepspeed import comm as dist

    rank = dist.get_rank()
    results = {}
    for stage in (0, 1, 2, 3):
        ckpt, bare = os.path.join(work, f"z{stage}"), os.path.join(work, f"z{stage}-no-dad")
        cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1,
               "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
               "gradient_clipping": 1.0, "steps_per_print": 10 ** 9, "dad": {"enabled": True, **CONFIG}}

        def train(load: Optional[str]) -> tuple:
            model = models.build(MODEL)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
            engine, *_ = deepspeed_dad.initialize(model=model, optimizer=opt, config=cfg)
            start = 0
            if load is not None:
                path, _ = engine.load_checkpoint(load)  # tag from the 'latest' file
                assert path is not None, f"nothing loaded from {load}"
                start = engine.global_steps
            for step in range(start, STEPS):
                engine.backward(models.loss_of(MODEL, engine, batch(step, rank)))
                engine.step()
                if load is None and step + 1 == SAVE_AT:
                    engine.save_checkpoint(ckpt)  # default tag global_step3
            att = deepspeed_dad.get_attachment(engine)
            params = list(engine.module.parameters())
            with (deepspeed.zero.GatheredParameters(params) if stage == 3 else contextlib.nullcontext()):
                out = flat_params(engine.module), flat_state(att.synchronizer)
            att.detach()
            return out

        runs = {"straight": train(None)}
        runs["resumed"] = train(ckpt)
        copy_without_dad(ckpt, bare, rank == 0, dist.barrier)
        runs["no-dad-state"] = train(bare)
        results[f"z{stage}"] = summarise(runs, ckpt)
    per_rank = [None] * dist.get_world_size()
    torch.distributed.all_gather_object(per_rank, results)
    return per_rank


def run_accelerate_deepspeed(work: str) -> list:
    """Accelerate with a DeepSpeed plugin: ``save_state`` calls the engine's ``save_checkpoint``."""
    import deepspeed_dad.auto  # noqa: F401  the one added line for Accelerate + DeepSpeed
    import deepspeed_dad
    from accelerate import Accelerator, DeepSpeedPlugin

    config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10 ** 9, "dad": {"enabled": True, **CONFIG}}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    rank = torch.distributed.get_rank()
    ckpt, bare = os.path.join(work, "ckpt"), os.path.join(work, "ckpt-no-dad")

    def train(start: int, load: Optional[str]) -> tuple:
        model = models.build(MODEL)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, opt = accelerator.prepare(model, opt)
        if load is not None:
            accelerator.load_state(load)
        for step in range(start, STEPS):
            accelerator.backward(models.loss_of(MODEL, model, batch(step, rank)))
            opt.step()
            opt.zero_grad()
            if load is None and step + 1 == SAVE_AT:
                accelerator.save_state(ckpt)
        att = deepspeed_dad.get_attachment(model)
        out = flat_params(accelerator.unwrap_model(model)), flat_state(att.synchronizer)
        att.detach()
        accelerator.free_memory()
        return out

    runs = {"straight": train(0, None)}
    runs["resumed"] = train(SAVE_AT, ckpt)
    copy_without_dad(ckpt, bare, rank == 0, torch.distributed.barrier)
    runs["no-dad-state"] = train(SAVE_AT, bare)
    result = summarise(runs, ckpt)
    per_rank = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(per_rank, result)
    return per_rank


# -- Horovod -------------------------------------------------------------------------------------------
def run_horovod(work: str) -> list:
    import horovod.torch as hvd
    from horovod_dad import DADOptimizer

    rank = hvd.rank()
    ckpt = os.path.join(work, "ckpt")
    path = os.path.join(ckpt, f"rank{rank}.pt")

    def train(start: int, load: Optional[dict]) -> tuple:
        model = models.build(MODEL)
        opt = DADOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3),
                           named_parameters=model.named_parameters(), model=model, dad=CONFIG)
        if load is not None:
            model.load_state_dict(load["model"])
            opt.load_state_dict(load["optimizer"])
        for step in range(start, STEPS):
            models.loss_of(MODEL, model, batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
            if load is None and step + 1 == SAVE_AT:
                os.makedirs(ckpt, exist_ok=True)
                # per rank: the optimizer's state dict carries this rank's dAD state under "dad"
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        out = flat_params(model), flat_state(opt.dad_synchronizer)
        opt.close()
        return out

    runs = {"straight": train(0, None)}
    saved = torch.load(path, weights_only=True)
    has_dad = "dad" in saved["optimizer"]
    runs["resumed"] = train(SAVE_AT, saved)
    saved = torch.load(path, weights_only=True)
    del saved["optimizer"]["dad"]
    runs["no-dad-state"] = train(SAVE_AT, saved)
    result = summarise(runs, ckpt)
    result["state_dict_has_dad"] = has_dad
    return hvd.allgather_object(result, name="resume.results")


def main() -> None:
    engine, out_path, work = sys.argv[1], sys.argv[2], sys.argv[3]
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("dad_integrations.engines.checkpoint").setLevel(logging.INFO)
    torch.set_num_threads(1)
    if engine == "horovod":
        import horovod.torch as hvd
        hvd.init()
        is_main = hvd.rank() == 0
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if engine in ("deepspeed", "accelerate-deepspeed"):
            import datetime
            import deepspeed
            deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120))
        is_main = None
    runner = {"accelerate": run_accelerate, "trainer": run_trainer, "deepspeed": run_deepspeed,
              "accelerate-deepspeed": run_accelerate_deepspeed,
              "trainer-deepspeed": lambda w: run_trainer(w, deepspeed=True),
              "trainer-deepspeed-zero3": lambda w: run_trainer(w, deepspeed=True, stage=3),
              "horovod": run_horovod}[engine]
    per_rank = runner(work)
    if is_main is None:  # torch.distributed
        models.write_and_exit(out_path, per_rank)
    elif is_main:
        with open(out_path, "w") as f:
            json.dump(per_rank, f, indent=1)


if __name__ == "__main__":
    main()
