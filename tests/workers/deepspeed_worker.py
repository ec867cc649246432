"""Runs inside `torchrun` (CPU accelerator, gloo): dAD on real DeepSpeed engines against DeepSpeed's
own all-reduce, on the same data; writes JSON results.

Usage: DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 deepspeed_worker.py OUT.json CASES.json
Case kinds: "match" (parameters after several steps against a plain DeepSpeed engine, bytes at
every deepspeed.comm collective per step; ``zero_after_forward``: the user zeroes gradients between
every forward and backward, see `zero_grad_after_forward`), "train" (a short run on real text: loss and bytes),
"error" (a config that must be refused: the message, on every rank).
"""
from __future__ import annotations

import datetime
import json
import os
import sys
from typing import Any, Dict, Optional

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from case_loop import run_cases  # noqa: E402

import deepspeed  # noqa: E402
from deepspeed import comm as dist  # noqa: E402

import deepspeed_dad  # noqa: E402
from dad_integrations.comm.counter import CollectiveCounter  # noqa: E402
from dad_examples.text_data import VOCAB_SIZE, byte_lm_batches, stdlib_source_bytes  # noqa: E402

# bytes handed to deepspeed.comm's collectives; dAD's own group told apart from DeepSpeed's
COUNTER: Optional[CollectiveCounter] = None
DAD_GROUP: Any = None


def step_bytes() -> dict:
    """Bytes counted since the last reset: dAD's group, every other (DeepSpeed's own) collective,
    and those per function."""
    if DAD_GROUP is None:
        dad, engine_ops = 0, COUNTER.by_function()
    else:
        dad, engine_ops = COUNTER.traffic(group=DAD_GROUP).handed, COUNTER.by_function(exclude_group=DAD_GROUP)
    ops = {name: int(t.handed) for name, t in engine_ops.items()}
    return {"engine": sum(ops.values()), "dad": int(dad), "engine_ops": ops}


def ds_config(case: dict, micro: int) -> dict:
    gas = case.get("gas", 1)
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "train_batch_size": micro * gas * dist.get_world_size(),
           "zero_optimization": {"stage": case.get("stage", 0)},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    cfg.update(case.get("ds", {}))
    return cfg


def build_engine(name: str, case: dict, micro: int, dad: Optional[dict], how: str = "initialize"):
    model = models.build(name) if name != "bytegpt2" else byte_gpt2()
    if case.get("optimizer", "sgd") == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=case.get("lr", 1e-3))
    else:  # the update is linear in the gradient: parameters compare the synchronised gradients
        opt = torch.optim.SGD(model.parameters(), lr=case.get("lr", 0.1), momentum=0.9)
    cfg = ds_config(case, micro)
    if dad is None:
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    elif how == "initialize":
        engine, *_ = deepspeed_dad.initialize(model=model, optimizer=opt, config={**cfg, "dad": dad})
    elif how == "attach":
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        deepspeed_dad.attach(engine, dad)
    elif how == "args":  # the config file named by --deepspeed_config, as the deepspeed launcher passes it
        import argparse
        import tempfile
        path = os.path.join(tempfile.gettempdir(), f"dad_ds_config_{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump({**cfg, "dad": dad}, f)
        args = argparse.Namespace(deepspeed_config=path, local_rank=int(os.environ.get("LOCAL_RANK", 0)))
        engine, *_ = deepspeed_dad.initialize(args=args, model=model, optimizer=opt)
        os.unlink(path)
    elif how == "patched":  # what Accelerate and the Trainer go through
        deepspeed_dad.patch_deepspeed_initialize()
        try:
            engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={**cfg, "dad": dad})
        finally:
            deepspeed_dad.unpatch_deepspeed_initialize()
    else:
        raise ValueError(how)
    global DAD_GROUP
    att = deepspeed_dad.get_attachment(engine)
    DAD_GROUP = att.aggregator.group if att is not None else None
    return engine


def zero_grad_after_forward(engine, how: Optional[str]) -> None:
    """The user's zero_grad between forward and backward: ``"engine"`` (``engine.zero_grad()``, sets
    None) or ``"optimizer-zeros"`` (``engine.optimizer.zero_grad(set_to_none=False)``); None: nothing."""
    if how == "engine":
        engine.zero_grad()
    elif how == "optimizer-zeros":
        engine.optimizer.zero_grad(set_to_none=False)
    elif how is not None:
        raise ValueError(how)


def run_steps(engine, name: str, case: dict, micro: int, steps: int):
    """``steps`` optimizer steps of ``gas`` micro-batches; per step the counted bytes."""
    rank = dist.get_rank()
    per_step = []
    losses = []
    for step in range(steps):
        COUNTER.reset()
        for m in range(case.get("gas", 1)):
            data = models.batch(name, micro, seed=10_000 * step + 100 * m + rank)
            loss = models.loss_of(name, engine, data)
            zero_grad_after_forward(engine, case.get("zero_after_forward"))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        per_step.append(step_bytes())
    return per_step, losses


def flat_params(engine) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])


def ranks_agree(flat: torch.Tensor) -> bool:
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    torch.distributed.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


def run_match(case: dict) -> dict:
    name, micro, steps = case.get("model", "gpt2"), case.get("batch", 2), case.get("steps", 3)
    if case.get("fp16_on_cpu"):
        # DeepSpeed's CPU accelerator refuses fp16 where oneDNN lacks fp16 kernels, although torch
        # runs these tiny fp16 models on CPU: claim support, to test loss scaling and skipped steps
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True
    ref = build_engine(name, case, micro, None)
    initial = flat_params(ref).double()
    ref_steps, ref_losses = run_steps(ref, name, case, micro, steps)
    mine = build_engine(name, case, micro, case["dad"], case.get("how", "initialize"))
    att = deepspeed_dad.get_attachment(mine)
    my_steps, my_losses = run_steps(mine, name, case, micro, steps)
    worst, per_param = 0.0, {}
    for (pname, a), b in zip(ref.module.named_parameters(), mine.module.parameters()):
        e = float((b.detach().double() - a.detach().double()).norm() / max(float(a.detach().double().norm()), 1e-12))
        per_param[pname] = e
        worst = max(worst, e)
    a, b = flat_params(ref).double(), flat_params(mine).double()
    model_diff = float((b - a).norm() / a.norm())
    moved = float((a - initial).norm() / initial.norm())  # how far training moved the parameters
    report = att.last_step_report()
    out = {"worst": worst, "model": model_diff, "moved": moved, "per_param": per_param, "identical": ranks_agree(flat_params(mine)),
           "ref_identical": ranks_agree(flat_params(ref)), "ref_bytes": ref_steps, "dad_bytes": my_steps,
           "ref_losses": ref_losses, "losses": my_losses, "skipped": [ref.skipped_steps, mine.skipped_steps],
           "loss_scale": [getattr(e.optimizer, "loss_scale", None) for e in (ref, mine)],
           "totals": report.totals, "scale": att.synchronizer.scale,
           "dense_only": [u.name for u in att.synchronizer.units if u.dense_only],
           "prescale": att.synchronizer.prescale_factor, "wire": att.config.wire_dtype,
           "levels": sorted({p.level for p in report.params})}
    att.detach()
    return out


def byte_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB_SIZE, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0))


def run_train(case: dict) -> dict:
    """A short run on real text (Python's own sources, bytes as tokens)."""
    micro, steps, seq = case.get("batch", 4), case.get("steps", 20), case.get("seq", 32)
    text = stdlib_source_bytes(max_bytes=300_000)
    out = {}
    for label, dad in (("deepspeed", None), ("dad", case["dad"])):
        engine = build_engine("bytegpt2", case, micro, dad)
        batches = byte_lm_batches(text, micro, seq, rank=dist.get_rank(), world_size=dist.get_world_size())
        losses, per_step = [], []
        n = steps if dad is not None else case.get("ref_steps", 2)
        for _ in range(n):
            COUNTER.reset()
            x = next(batches)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            counted = step_bytes()
            per_step.append({"engine": counted["engine"], "dad": counted["dad"]})
        att = deepspeed_dad.get_attachment(engine)
        out[label] = {"losses": losses, "bytes": per_step, "identical": ranks_agree(flat_params(engine))}
        if att is not None:
            out[label]["totals"] = att.last_step_report().totals
            out[label]["representations"] = att.last_step_report().by_representation()
            att.detach()
    return out


def run_error(case: dict) -> dict:
    """A config dAD must refuse: every rank raises, naming the problem."""
    try:
        engine = build_engine(case.get("model", "mlp"), case, 2, case["dad"], case.get("how", "initialize"))
    except (ValueError, TypeError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    att = deepspeed_dad.get_attachment(engine)
    result: Dict[str, Any] = {"error": None, "attached": att is not None}
    if case.get("steps"):  # e.g. "enabled": false: DeepSpeed's own all-reduce must still run
        per_step, _ = run_steps(engine, case.get("model", "mlp"), case, 2, case["steps"])
        result["bytes"] = per_step
    if att is not None:
        att.detach()
    return result


RUNNERS = {"match": run_match, "train": run_train, "error": run_error}


def main() -> None:
    global COUNTER
    out_path, cases_path = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(
        seconds=float(os.environ.get("DAD_TEST_TIMEOUT", 120))))
    COUNTER = CollectiveCounter(dist).install()
    with open(cases_path) as f:
        cases = json.load(f)
    run_cases(RUNNERS, cases, out_path, "deepspeed_worker")

if __name__ == "__main__":
    main()
