"""Runs inside `torchrun` (CPU accelerator, gloo): a plain DeepSpeed script, no dAD import, whose
config holds a "dad" block; the installed package's import hook (`deepspeed_dad_hook`) must make
``deepspeed.initialize`` attach dAD. Writes JSON results.

Usage: DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 ds_json_worker.py OUT.json CASES.json
Case kinds: "plain" (no block: the wrapped ``deepspeed.initialize`` against DeepSpeed's own function,
bit for bit, bytes per collective, and whether anything of dAD got imported), "block" (exact dAD
from the block, against DeepSpeed's own all-reduce; ``how``: ``config`` or ``args``, the file named
by ``--deepspeed_config`` as the deepspeed launcher passes it), "error" (must raise; ``env``: set
in ``os.environ`` for that call only).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from case_loop import run_cases  # noqa: E402

import deepspeed  # noqa: E402  the script's only engine import: no deepspeed_dad anywhere
from deepspeed import comm as dist  # noqa: E402

from dad_integrations.comm.counter import CollectiveCounter  # noqa: E402  (counting bytes only)

MODEL, MICRO, STEPS = "gpt2", 2, 3
COUNTER = None


def ds_config(extra: dict = None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "train_batch_size": MICRO * dist.get_world_size(), "zero_optimization": {"stage": 1},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
    cfg.update(extra or {})
    return cfg


def build(initialize, config: dict, how: str = "config"):
    model = models.build(MODEL)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if how == "config":
        return initialize(model=model, optimizer=opt, config=config)[0]
    path = os.path.join(tempfile.gettempdir(), f"dad_json_worker_{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    try:
        args = argparse.Namespace(deepspeed_config=path, local_rank=int(os.environ.get("LOCAL_RANK", 0)))
        return initialize(args=args, model=model, optimizer=opt)[0]
    finally:
        os.unlink(path)


def train(engine, exclude_group=None) -> list:
    """STEPS steps; per step the bytes handed to each deepspeed.comm collective (outside dAD's group)."""
    per_step = []
    for step in range(STEPS):
        COUNTER.reset()
        data = models.batch(MODEL, MICRO, seed=1000 * step + dist.get_rank())
        engine.backward(models.loss_of(MODEL, engine, data))
        engine.step()
        ops = COUNTER.by_function(exclude_group=exclude_group) if exclude_group is not None else COUNTER.by_function()
        per_step.append({name: int(t.handed) for name, t in ops.items()})
    return per_step


def flat(engine) -> torch.Tensor:
    return torch.cat([p.detach().double().reshape(-1) for p in engine.module.parameters()])


def ranks_agree(x: torch.Tensor) -> bool:
    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    torch.distributed.all_gather(gathered, x)
    return all(torch.equal(gathered[0], g) for g in gathered)


def own_initialize():
    """DeepSpeed's own ``initialize`` (the hook keeps it on its wrapper)."""
    return getattr(deepspeed.initialize, "_dad_original", deepspeed.initialize)


_REFERENCE: dict = {}


def reference() -> tuple:
    """DeepSpeed's own run without a block (engine, bytes per step), made once and shared by the cases."""
    if not _REFERENCE:
        engine = build(own_initialize(), ds_config())
        _REFERENCE["run"] = (engine, train(engine))
    return _REFERENCE["run"]


def run_plain(case: dict) -> dict:
    loaded_before = sorted(m for m in sys.modules if m.split(".")[0] == "deepspeed_dad")
    ref, ref_bytes = reference()
    mine = build(deepspeed.initialize, ds_config())
    my_bytes = train(mine)
    return {"hooked": hasattr(deepspeed.initialize, "_dad_original"), "loaded_before": loaded_before,
            "dad_adapter_imported": "deepspeed_dad" in sys.modules,
            "bitwise": bool(torch.equal(flat(ref), flat(mine))), "ref_bytes": ref_bytes, "bytes": my_bytes}


def run_block(case: dict) -> dict:
    ref, ref_bytes = reference()
    mine = build(deepspeed.initialize, ds_config({"dad": case["dad"]}), case.get("how", "config"))
    import deepspeed_dad  # only now, to read the attachment the hook made
    att = deepspeed_dad.get_attachment(mine)
    my_bytes = train(mine, att.aggregator.group if att is not None else None)
    initial = torch.cat([p.detach().double().reshape(-1) for p in models.build(MODEL).parameters()])
    out = {"attached": att is not None, "ref_bytes": ref_bytes, "bytes": my_bytes,
           "rel": float((flat(mine) - flat(ref)).norm() / flat(ref).norm()),
           "moved": float((flat(ref) - initial).norm() / initial.norm()),
           "identical": ranks_agree(flat(mine).float())}
    if att is not None:
        out["totals"] = att.last_step_report().totals
        att.detach()
    return out


def run_error(case: dict) -> dict:
    saved = {k: os.environ.get(k) for k in case.get("env", {})}
    os.environ.update(case.get("env", {}))
    try:
        engine = build(deepspeed.initialize, ds_config({"dad": case["dad"]}), case.get("how", "config"))
    except Exception as e:  # noqa: BLE001 -- the message is the result
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    import deepspeed_dad
    att = deepspeed_dad.get_attachment(engine)
    result = {"error": None, "attached": att is not None, "bytes": train(engine)}
    if att is not None:
        att.detach()
    return result


RUNNERS = {"plain": run_plain, "block": run_block, "error": run_error}


def main() -> None:
    global COUNTER
    out_path, cases_path = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(
        seconds=float(os.environ.get("DAD_TEST_TIMEOUT", 120))))
    COUNTER = CollectiveCounter(dist).install()
    with open(cases_path) as f:
        cases = json.load(f)
    run_cases(RUNNERS, cases, out_path, "ds_json_worker")


if __name__ == "__main__":
    main()
