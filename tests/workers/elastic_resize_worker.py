"""Save dAD's state at one world size and resume it at another, under Accelerate, Trainer and
DeepSpeed (ZeRO 0, and ZeRO-2 whose sharded synchroniser keeps its own state format), in one
torchrun job.

Usage: torchrun --nproc_per_node N elastic_resize_worker.py OUT WORK ACTIONS
  ACTIONS: comma-separated ``resume:<folder>`` (resume what another job size saved in WORK/<folder>)
  and ``save:<folder>`` (train SAVE_AT steps and save into WORK/<folder>), run in that order.

Every engine trains rank-dAD with error feedback (whole residuals). A resume records, right after
the checkpoint was loaded and before the first step, the mean of the new ranks' residuals against
the mean of the old ranks' (read from their files), whether all new ranks hold the same residuals
and shared warm starts, then trains AFTER more steps and records whether every rank ends with the
same parameters and a finite loss.
"""
from __future__ import annotations

import glob
import logging
import math
import os
import sys
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from resume_worker import MODEL, batch, flat_params  # noqa: E402

CONFIG = {"mode": "rank", "rank": 2, "error_feedback": True}
SAVE_AT, AFTER = 3, 2
ENGINES = ("accelerate", "trainer", "deepspeed-z0", "deepspeed-z2")
ENGINE_CONFIG = {"accelerate": {**CONFIG, "rank_route": "allreduce"}}  # a shared warm start to carry over


def units_of(state: dict) -> Dict[str, dict]:
    return state["rank_routes"]


def residual_report(sync: Any, old_dir: str) -> dict:
    """The new ranks' mean residual against the old ranks' (their files), per weight; and whether
    every new rank holds the same residuals and shared warm starts (they must: one merge)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = units_of(sync.state_dict())
    files = sorted(glob.glob(os.path.join(old_dir, "**", "dad_state_rank*.pt"), recursive=True))
    old = [units_of(torch.load(f, weights_only=True)["state"]) for f in files]
    worst, count, same = 0.0, 0, True
    for name in sorted(mine):
        res = mine[name].get("residual")
        have = torch.tensor([0.0 if res is None else 1.0])
        dist.all_reduce(have)
        if have.item() == 0:
            continue
        assert have.item() == world, f"{name}: a residual on {have.item()} of {world} new ranks"
        res = res.detach().double().cpu()
        total = res.clone()
        dist.all_reduce(total)
        first = res.clone()
        dist.broadcast(first, 0)
        same &= bool(torch.equal(first, res))
        old_mean = sum(o[name]["residual"].double() for o in old) / len(old)
        worst = max(worst, float((total / world - old_mean).norm() / max(float(old_mean.norm()), 1e-30)))
        count += 1
    shared = [mine[n].get("shared_q") for n in sorted(mine) if mine[n].get("shared_q") is not None]
    shared_same, shared_as_saved = True, True
    for n in sorted(mine):
        q = mine[n].get("shared_q")
        if q is None:
            continue
        first = q.detach().double().cpu().clone()
        dist.broadcast(first, 0)
        shared_same &= bool(torch.equal(first, q.double().cpu()))
        shared_as_saved &= bool(torch.equal(q.double().cpu(), old[0][n]["shared_q"].double()))
    return {"old_files": len(files), "weights_with_residual": count, "mean_rel": worst, "residual_same": same,
            "shared_q": len(shared), "shared_q_same": shared_same, "shared_q_as_saved": shared_as_saved,
            "rank": rank}


def end_report(params: torch.Tensor, loss: float) -> dict:
    """Whether every rank ends with rank 0's parameters, and the last loss."""
    first = params.clone()
    dist.broadcast(first, 0)
    return {"params_same": bool(torch.equal(first, params)), "loss": loss, "loss_finite": math.isfinite(loss)}


# -- Accelerate (DDP) ---------------------------------------------------------------------------------
def accelerate(folder: str, resume: bool) -> Optional[dict]:
    from accelerate import Accelerator
    from dad_integrations.accelerate import enable_dad

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    model = models.build(MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = accelerator.prepare(model, opt)
    sync = enable_dad(accelerator, model, ENGINE_CONFIG["accelerate"])
    report = None
    if resume:
        accelerator.load_state(folder)
        report = residual_report(sync, folder)
    loss = float("nan")
    for step in range(SAVE_AT, SAVE_AT + AFTER) if resume else range(SAVE_AT):
        loss_t = models.loss_of(MODEL, model, batch(step, rank))
        accelerator.backward(loss_t)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = float(loss_t)
    if not resume:
        accelerator.save_state(folder)
    else:
        report.update(end_report(flat_params(accelerator.unwrap_model(model)), loss))
    sync.close()
    accelerator.free_memory()
    return report


# -- transformers.Trainer (DDP) ------------------------------------------------------------------------
def trainer(folder: str, resume: bool) -> Optional[dict]:
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from dad_integrations.transformers import DADCallback
    from trainer_worker import ByteWindows

    callback = DADCallback(CONFIG)
    seen: Dict[str, Any] = {}
    ckpt = os.path.join(folder, f"checkpoint-{SAVE_AT}")

    class Snapshot(TrainerCallback):
        """Right after DADCallback loaded the checkpoint, before the first step: the residuals."""

        def on_step_begin(self, args, state, control, **kwargs):
            if resume and "report" not in seen:
                seen["report"] = residual_report(callback.sync, ckpt)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                seen["loss"] = float(logs["loss"])

    args = TrainingArguments(output_dir=os.path.join(folder, "resumed") if resume else folder,
                             max_steps=SAVE_AT + AFTER if resume else SAVE_AT, per_device_train_batch_size=4,
                             learning_rate=3e-3, logging_steps=1, report_to=[], save_strategy="steps",
                             save_steps=SAVE_AT, seed=0, data_seed=0, disable_tqdm=True, max_grad_norm=1.0,
                             use_cpu=True, save_only_model=False)
    model = models.build(MODEL)
    t = Trainer(model=model, args=args, train_dataset=ByteWindows(), callbacks=[callback, Snapshot()])
    t.train(resume_from_checkpoint=ckpt if resume else None)
    if not resume:
        return None
    callback.sync.close()
    return {**seen["report"], **end_report(flat_params(model), seen.get("loss", float("nan")))}


# -- DeepSpeed ----------------------------------------------------------------------------------------
def deepspeed_engine(folder: str, resume: bool, stage: int) -> Optional[dict]:
    import deepspeed
    import deepspeed_dad

    rank = dist.get_rank()
    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage},
           "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
           # whole residuals (the default budget keeps rank-q ones under ZeRO-2, whose merge is the
           # mean's best rank-q part): the mean identity below is checked on whole ones
           "dad": {"enabled": True, **CONFIG, "residual_budget": None}}
    model = models.build(MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine, *_ = deepspeed_dad.initialize(model=model, optimizer=opt, config=cfg)
    att = deepspeed_dad.get_attachment(engine)
    report = None
    if resume:
        # ZeRO-1/2's optimizer partitions follow the data-parallel size, and DeepSpeed refuses to
        # load them at another (short of a universal checkpoint): its documented way on is
        # load_optimizer_states=False (weights and steps loaded; dAD's state still is)
        path, _ = engine.load_checkpoint(folder, load_optimizer_states=stage == 0)
        assert path is not None, f"nothing loaded from {folder}"
        assert engine.global_steps == SAVE_AT, engine.global_steps
        report = residual_report(att.synchronizer, folder)
    loss = float("nan")
    for step in range(SAVE_AT, SAVE_AT + AFTER) if resume else range(SAVE_AT):
        loss_t = models.loss_of(MODEL, engine, batch(step, rank))
        engine.backward(loss_t)
        engine.step()
        loss = float(loss_t)
    if not resume:
        engine.save_checkpoint(folder)
    else:
        report.update(end_report(flat_params(engine.module), loss))
    att.detach()
    return report


RUN = {"accelerate": accelerate, "trainer": trainer,
       "deepspeed-z0": lambda f, r: deepspeed_engine(f, r, 0), "deepspeed-z2": lambda f, r: deepspeed_engine(f, r, 2)}


def main() -> None:
    out_path, work, actions = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("dad_integrations.engines.checkpoint").setLevel(logging.INFO)
    torch.set_num_threads(1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import datetime
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=300))
    results: Dict[str, Any] = {"world_size": dist.get_world_size()}
    for action in actions:
        kind, folder = action.split(":")
        for engine in ENGINES:
            path = os.path.join(work, folder, engine)
            try:
                report = RUN[engine](path, kind == "resume")
            except Exception as exc:  # noqa: BLE001  reported per case; the other cases still run
                import traceback
                report = {"exception": traceback.format_exc()}
                logging.getLogger(__name__).error("%s %s: %r", action, engine, exc)
            dist.barrier()
            if kind == "resume":
                per_rank: List[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(per_rank, report)
                results[f"{action}/{engine}"] = per_rank
    models.write_and_exit(out_path, results)


if __name__ == "__main__":
    main()
