"""bf16 and fp16 models trained with dAD in every engine (tests/test_dtypes.py).

Usage: torchrun --standalone --nproc_per_node 2 dtype_worker.py OUT.json CASES.json
       horovodrun -np 2 -H localhost:2 --gloo python dtype_worker.py OUT.json CASES.json horovod

Each case names an ``engine`` (plain, ddp, accelerate, fsdp2, zero0-zero3, horovod), a ``dtype``
(bfloat16, float16) and a dAD ``config``; every rank trains the small GPT-2 of `models` for a few
steps on its own batches, its parameters in that dtype, and reports its losses, the routes the
reports name, whether the parameters moved, and whether every rank ends with the same parameters
(bit for bit). All cases of one launcher run in one job: engines start in seconds, jobs do not.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable, Dict, List

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

MODEL = "gpt2"
STEPS = 3
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _build(dtype: torch.dtype) -> nn.Module:
    return models.build(MODEL, seed=0).to(dtype)


def _flat(params) -> torch.Tensor:
    """Every parameter, full (DTensors gathered), as one fp64 vector."""
    out = []
    for p in params:
        t = p.detach()
        if hasattr(t, "full_tensor"):  # FSDP2's DTensor
            t = t.full_tensor()
        out.append(t.double().reshape(-1))
    return torch.cat(out)


def _train(step_fn: Callable[[dict], torch.Tensor], report: Callable[[], object], rank: int) -> dict:
    """``STEPS`` steps of ``step_fn`` (one batch -> its loss, after the optimizer step)."""
    losses: List[float] = []
    routes = set()
    for step in range(STEPS):
        data = models.batch(MODEL, 2 + rank, seed=1000 * step + rank)  # uneven batches
        losses.append(float(step_fn(data).detach()))
        rep = report()
        if rep is not None:
            routes.update(p.representation for p in rep.params)
    return {"losses": losses, "routes": sorted(routes)}


def _sgd_step(fwd: nn.Module, opt: torch.optim.Optimizer, backward: Callable = torch.Tensor.backward,
              after_backward: Callable = lambda: None) -> Callable[[dict], torch.Tensor]:
    """One training step through ``fwd``: loss, backward, (``after_backward``), optimizer step."""
    def step(data):
        loss = models.loss_of(MODEL, fwd, data)
        backward(loss)
        after_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def _finish(out: dict, initial: torch.Tensor, final: torch.Tensor, all_gather: Callable) -> dict:
    gathered = all_gather(final)
    out["identical"] = all(torch.equal(gathered[0], g) for g in gathered)
    out["moved"] = float((final - initial).norm() / initial.norm())
    out["finite"] = bool(torch.isfinite(final).all())
    return out


def _torch_all_gather(t: torch.Tensor) -> list:
    import torch.distributed as dist
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return gathered


def run_plain(case: dict) -> dict:
    import torch.distributed as dist
    from dad_integrations import DADSynchronizer, TorchDistributedAggregator
    model = _build(DTYPES[case["dtype"]])
    initial = _flat(model.parameters())
    sync = DADSynchronizer(model, TorchDistributedAggregator(), case["config"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    step = _sgd_step(model, opt, after_backward=sync.synchronize)
    out = _train(step, sync.last_step_report, dist.get_rank())
    sync.close()
    return _finish(out, initial, _flat(model.parameters()), _torch_all_gather)


def run_ddp(case: dict) -> dict:
    import torch.distributed as dist
    from dad_integrations import register_dad_comm_hook
    model = _build(DTYPES[case["dtype"]])
    initial = _flat(model.parameters())
    ddp = nn.parallel.DistributedDataParallel(model)
    sync = register_dad_comm_hook(ddp, case["config"])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

    step = _sgd_step(ddp, opt)
    out = _train(step, sync.last_step_report, dist.get_rank())
    sync.close()
    return _finish(out, initial, _flat(model.parameters()), _torch_all_gather)


_ACCELERATOR = []


def run_accelerate(case: dict) -> dict:
    from accelerate import Accelerator
    from dad_integrations.accelerate import enable_dad
    if not _ACCELERATOR:  # one per process (Accelerate's state is a singleton); DDP on CPU processes
        _ACCELERATOR.append(Accelerator(cpu=True))
    accelerator = _ACCELERATOR[0]
    model = _build(DTYPES[case["dtype"]])
    initial = _flat(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    prepared, opt = accelerator.prepare(model, opt)
    sync = enable_dad(accelerator, prepared, case["config"])

    step = _sgd_step(prepared, opt, backward=accelerator.backward)
    out = _train(step, sync.last_step_report, accelerator.process_index)
    sync.close()
    final = _flat(accelerator.unwrap_model(prepared).parameters())
    accelerator.free_memory()
    return _finish(out, initial, final, _torch_all_gather)


def run_fsdp2(case: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from dad_integrations.fsdp import enable_dad_fsdp
    model = _build(DTYPES[case["dtype"]])  # parameters, gradients and reduce-scatter in the dtype
    initial = _flat(model.parameters())
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    sync = enable_dad_fsdp(model, case["config"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    step = _sgd_step(model, opt)
    out = _train(step, sync.last_step_report, dist.get_rank())
    sync.close()
    return _finish(out, initial, _flat(model.parameters()), _torch_all_gather)


def run_zero(case: dict) -> dict:
    """DeepSpeed ZeRO stage ``case["stage"]`` in its own half precision: DeepSpeed casts the model
    (its "bf16" / "fp16" config; a model cast by hand without them DeepSpeed's optimizers refuse or
    keep in fp32). DeepSpeed's CPU accelerator claims no fp16 support (oneDNN), although torch runs
    this tiny fp16 model on CPU: as tests/workers/deepspeed_worker.py does, claim it, so the fp16
    engine (loss scaling included) runs. Its stage-0 fp16 engine moves the parameters far less than
    the others in these 3 steps: DeepSpeed's own doing (the same losses, bit for bit, without dAD)."""
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    import deepspeed_dad
    stage, dtype = case["stage"], case["dtype"]
    if dtype == "float16":
        get_accelerator().is_fp16_supported = lambda: True
    half = ({"bf16": {"enabled": True}} if dtype == "bfloat16" else
            {"fp16": {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2, "hysteresis": 1}})
    zero = {"stage": stage, "reduce_bucket_size": 3000, "overlap_comm": False, "contiguous_gradients": True}
    if stage == 3:
        zero.update({"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1000})
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 4,
           "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9,
           "wall_clock_breakdown": False, **half, "dad": case["config"]}
    model = models.build(MODEL, seed=0)
    initial = _flat(model.parameters()).to(DTYPES[dtype]).double()  # as DeepSpeed casts it
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    engine, *_ = deepspeed_dad.initialize(model=model, optimizer=opt, config=cfg)
    att = deepspeed_dad.get_attachment(engine)
    out_dtype = str(next(engine.module.parameters()).dtype).replace("torch.", "")

    def step(data):
        loss = models.loss_of(MODEL, engine, data)
        engine.backward(loss)
        engine.step()
        return loss

    out = _train(step, att.last_step_report, dist.get_rank())
    out["param_dtype"] = out_dtype
    params = list(engine.module.parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters(params):
            final = _flat(params)
    else:
        final = _flat(params)
    att.detach()
    return _finish(out, initial, final, _torch_all_gather)


def run_horovod(case: dict) -> dict:
    import horovod.torch as hvd
    from horovod_dad import DADOptimizer
    model = _build(DTYPES[case["dtype"]])
    initial = _flat(model.parameters())
    opt = DADOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
                       model=model, dad=case["config"])

    def step(data):
        opt.zero_grad()
        loss = models.loss_of(MODEL, model, data)
        loss.backward()
        opt.step()
        return loss

    out = _train(step, opt.last_step_report, hvd.rank())
    opt.close()
    return _finish(out, initial, _flat(model.parameters()),
                   lambda t: list(hvd.allgather(t.unsqueeze(0), name="dtype.final").unbind(0)))


RUNNERS: Dict[str, Callable[[dict], dict]] = {
    "plain": run_plain, "ddp": run_ddp, "accelerate": run_accelerate, "fsdp2": run_fsdp2,
    **{f"zero{s}": (lambda case, s=s: run_zero({**case, "stage": s})) for s in range(4)},
    "horovod": run_horovod}


def main() -> None:
    out_path, cases_path = sys.argv[1], sys.argv[2]
    with open(cases_path) as f:
        cases = json.load(f)
    torch.set_num_threads(1)

    def run(case: dict) -> dict:
        start = time.perf_counter()
        out = RUNNERS[case["engine"]](case)
        out["seconds"] = time.perf_counter() - start  # this suite is kept fast: where its time goes
        return out

    if sys.argv[3:] == ["horovod"]:
        import horovod.torch as hvd
        hvd.init()
        results = models.run_all(cases, run, lambda cid, mine: hvd.allgather_object(mine, name=f"results.{cid}"))
        if hvd.rank() == 0:
            with open(out_path, "w") as f:
                json.dump(results, f, indent=1)
        hvd.shutdown()
        return
    import torch.distributed as dist
    dist.init_process_group("gloo")
    models.write_and_exit(out_path, models.run_all(cases, run, models.gather_per_rank))


if __name__ == "__main__":
    main()
