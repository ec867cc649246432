"""Runs inside `torchrun` (CPU accelerator, gloo): dAD under DeepSpeed ZeRO-2/3 against DeepSpeed's own
reduction, same initial model, same batches (uneven across ranks); writes JSON results.

Usage: DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 zero_worker.py OUT.json CASES.json

Case kinds: "match" (after every boundary backward, the fp32 gradient partition each rank owns is
compared with the reference engine's, per parameter, the error summed over ranks and floored at
1e-6 of the whole gradient's norm; then both engines step; at the end the parameters are compared
and checked equal on every rank; bytes of DeepSpeed's own collectives and of dAD's group per step),
"rank" (rank-dAD: the error-feedback identity against DeepSpeed's average at fixed parameters, a
non-finite step, the state through a checkpoint, training; `run_rank`; ``save_state``: dAD's state
and the residuals' sums saved there at the end), "resume" (that state loaded at another world size:
the mean residual carried over; `run_resume`), "error" (a config that must be refused: the message),
"ds_match" (`deepspeed_worker`'s "match", for ZeRO 0 and 1, in the same launch).
"""
from __future__ import annotations

import datetime
import json
import os
import sys
from typing import Dict, Optional, Tuple

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from case_loop import run_cases  # noqa: E402

import deepspeed  # noqa: E402
from deepspeed import comm as dist  # noqa: E402

import deepspeed_dad  # noqa: E402
from dad_integrations.comm.counter import CollectiveCounter  # noqa: E402

COUNTER: Optional[CollectiveCounter] = None
OUT_DIR = "."


def build_model(name: str):
    if name == "gpt2":  # 2 layers x 64 wide, tied wte / lm_head
        from transformers import GPT2Config, GPT2LMHeadModel
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                          bos_token_id=0, eos_token_id=0))
    return models.build(name)


def ds_config(case: dict, micro: int) -> dict:
    gas = case.get("gas", 1)
    zero = {"stage": case["stage"], "reduce_bucket_size": case.get("bucket", 3000),
            "overlap_comm": case.get("overlap", False), "contiguous_gradients": case.get("contiguous", True)}
    if case["stage"] == 3:  # gather every parameter per module use: the small model stays small
        zero.update({"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1000})
    zero.update(case.get("zero", {}))
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "train_batch_size": micro * gas * dist.get_world_size(), "zero_optimization": zero,
           "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    cfg.update(case.get("ds", {}))
    return cfg


def build_engine(case: dict, micro: int, dad: Optional[dict]):
    model = build_model(case["model"])
    opt = torch.optim.SGD(model.parameters(), lr=case.get("lr", 0.1), momentum=0.9)
    cfg = ds_config(case, micro)
    if dad is None:
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    elif case.get("how") == "patched":  # what Accelerate and the Trainer go through
        deepspeed_dad.patch_deepspeed_initialize()
        try:
            engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={**cfg, "dad": dad})
        finally:
            deepspeed_dad.unpatch_deepspeed_initialize()
    else:
        engine, *_ = deepspeed_dad.initialize(model=model, optimizer=opt, config={**cfg, "dad": dad})
    return engine


def owned_partitions(engine, ranges: Optional[Dict[str, Tuple[int, int]]] = None) -> Dict[str, torch.Tensor]:
    """This rank's fp32 gradient partition of every parameter (its owned elements), by name; and,
    into ``ranges``, where they lie in the flattened parameter (``[lo, hi)``)."""
    opt, me = engine.optimizer, dist.get_rank()
    names = {id(p): n for n, p in engine.module.named_parameters()}
    ranges = {} if ranges is None else ranges
    out = {}
    if engine.zero_optimization_stage() == 3:
        for p in engine.module.parameters():
            owned = max(0, min(p.partition_numel(), p.ds_numel - me * p.partition_numel()))
            out[names[id(p)]] = deepspeed.utils.safe_get_local_grad(p).reshape(-1)[:owned].double()
            ranges[names[id(p)]] = (me * p.partition_numel(), me * p.partition_numel() + owned)
        return out
    for i, params in enumerate(opt.params_in_partition):
        flat = torch.cat([t.reshape(-1) for t in opt.averaged_gradients[i]]).double()
        for p in params:
            pid = opt.get_param_id(p)
            dest = opt.grad_partition_insertion_offset[i][me][pid]
            start = opt.grad_start_offset[i][me][pid]
            num = min(p.numel() - start, int(opt.partition_size[i]) - dest)
            out[names[id(p)]] = flat[dest:dest + num]
            ranges[names[id(p)]] = (start, start + num)
    return out


def partition_errors(ref: Dict[str, torch.Tensor], mine: Dict[str, torch.Tensor], names) -> Dict[str, float]:
    sq = []
    for n in names:
        a, b = ref.get(n), mine.get(n)
        if (a is None) != (b is None) or (a is not None and a.shape != b.shape):
            raise AssertionError(f"{n}: partitions differ in layout")
        sq += [0.0, 0.0] if a is None else [float((b - a).norm()) ** 2, float(a.norm()) ** 2]
    t = torch.tensor(sq, dtype=torch.float64)
    torch.distributed.all_reduce(t)
    total = float(t[1::2].sum()) ** 0.5
    return {n: float(t[2 * i]) ** 0.5 / max(float(t[2 * i + 1]) ** 0.5, 1e-6 * total) for i, n in enumerate(names)}


def full_params(engine) -> Dict[str, torch.Tensor]:
    params = list(engine.module.named_parameters())
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {n: p.detach().double().clone() for n, p in params}
    return {n: p.detach().double().clone() for n, p in params}


def ranks_agree(flat: torch.Tensor) -> bool:
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    torch.distributed.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


def counted(group) -> dict:
    ops = {name: int(t.handed) for name, t in COUNTER.by_function(exclude_group=group).items()}
    return {"engine_ops": ops, "dad": int(COUNTER.traffic(group=group).handed) if group is not None else 0}


def run_match(case: dict) -> dict:
    name, micro, steps, gas = case["model"], case.get("batch", 2), case.get("steps", 3), case.get("gas", 1)
    rank = dist.get_rank()
    ref = build_engine(case, micro, None)
    mine = build_engine(case, micro, case["dad"])
    att = deepspeed_dad.get_attachment(mine)
    group = att.aggregator.group
    names = [n for n, _ in ref.module.named_parameters()]
    worst: Dict[str, float] = {}
    reports, ref_bytes, dad_bytes, losses = [], [], [], []
    for step in range(steps):
        for engine, sink in ((ref, ref_bytes), (mine, dad_bytes)):
            COUNTER.reset()
            for m in range(gas):
                size = micro + (rank if case.get("uneven", True) else 0)
                data = models.batch(name, size, seed=10_000 * step + 100 * m + rank)
                loss = models.loss_of(name, engine, data)
                engine.backward(loss)
                if m < gas - 1:
                    engine.step()
                if engine is mine:
                    losses.append(float(loss.detach()))
            sink.append(counted(group))
        for n, e in partition_errors(owned_partitions(ref), owned_partitions(mine), names).items():
            worst[n] = max(worst.get(n, 0.0), e)
        rep = att.last_step_report()
        reports.append({"totals": rep.totals, "params": [[p.name, p.representation, p.sent_bytes,
                                                          p.reduce_scatter_bytes, list(p.shape)] for p in rep.params],
                        "levels": sorted({(p.level, p.representation) for p in rep.params})})
        ref.step()
        mine.step()
    a, b = full_params(ref), full_params(mine)
    param_diffs = {n: float((b[n] - a[n]).abs().max()) / max(float(a[n].abs().max()), 1e-12) for n in names}
    flat = torch.cat([b[n].reshape(-1) for n in names])
    out = {"grad_errors": worst, "param_diffs": param_diffs, "identical": ranks_agree(flat),
           "ref_identical": ranks_agree(torch.cat([a[n].reshape(-1) for n in names])),
           "dense_only": [u.name for u in att.units if u.dense_only], "reports": reports,
           "ref_bytes": ref_bytes, "dad_bytes": dad_bytes, "losses": losses,
           "units": len(att.units), "factor_units": sum(1 for u in att.units if u.has_factors)}
    att.detach()
    return out


def rank_state(att) -> Dict[str, torch.Tensor]:
    """The rank route's residuals and warm starts, by parameter name and key, cloned."""
    names = {id(u.param): n for u in att.units for n, p in att.engine.module.named_parameters() if p is u.param}
    by_unit = {u.name: names[id(u.param)] for u in att.units}
    out = {}
    for unit, state in att.state_dict()["rank_routes"].items():
        for key, t in state.items():
            if isinstance(t, tuple):  # a residual kept at rank q (error_feedback_rank): (U, V)
                out.update({f"{by_unit[unit]}.{key}.{i}": f.detach().clone() for i, f in enumerate(t)})
            elif isinstance(t, torch.Tensor):
                out[f"{by_unit[unit]}.{key}"] = t.detach().clone()
    return out


def dense_residuals(att) -> Dict[str, torch.Tensor]:
    """Each rank-routed weight's residual as one m x n tensor (whole or rebuilt from U V^T), by
    parameter name."""
    names = {id(u.param): n for u in att.units for n, p in att.engine.module.named_parameters() if p is u.param}
    memory = att._rank.memory
    return {names[id(u.param)]: memory.dense(u.name).detach().clone() for u in att.units
            if memory.state(u.name) is not None}


def unit_shapes(att) -> Dict[str, Tuple[int, int]]:
    """Every unit's matrix view, by parameter name (the same on every rank)."""
    names = {id(u.param): n for u in att.units for n, p in att.engine.module.named_parameters() if p is u.param}
    return {names[id(u.param)]: tuple(u.shape) for u in att.units}


def ef_expected(ref_owned: Dict[str, torch.Tensor], ranges: Dict[str, Tuple[int, int]], before: dict,
                after: dict, shapes: Dict[str, Tuple[int, int]]) -> Dict[str, torch.Tensor]:
    # before / after: `dense_residuals` at the step's start and end; shapes: `unit_shapes`
    """What the error-feedback identity says dAD's partitions hold: DeepSpeed's average plus
    ``1/S sum_s (e_old_s - e_new_s)`` over this rank's owned elements (every rank-routed weight).
    Summed over every unit, on every rank alike: across nodes only a weight's owners hold one."""
    S = dist.get_world_size()
    out = dict(ref_owned)
    for name in sorted(shapes):  # a weight in before only flushed its residual
        zero = torch.zeros(shapes[name], dtype=torch.float64)
        old = before[name] if name in before else zero
        new = after[name] if name in after else zero
        diff = (old - new).double().reshape(-1)
        torch.distributed.all_reduce(diff)
        if name in ranges:  # (ZeRO-2: a rank may own nothing of a weight)
            lo, hi = ranges[name]
            out[name] = ref_owned[name] + diff[lo:hi] / S
    return out


def run_rank(case: dict) -> dict:
    """Rank-dAD under ZeRO. With ``lr`` 0 both engines stay at the initial parameters, so that at every
    step the error-feedback identity can be checked against DeepSpeed's own average; with a
    ``nonfinite_step`` rank 1's loss is NaN there (the last step checked); with a ``resume_step`` the
    state goes through ``save_checkpoint`` / ``load_checkpoint`` (one step run between them)."""
    name, micro, steps, gas = case["model"], case.get("batch", 2), case.get("steps", 3), case.get("gas", 1)
    rank = dist.get_rank()
    ref = build_engine(case, micro, None)
    mine = build_engine(case, micro, case["dad"])
    att = deepspeed_dad.get_attachment(mine)
    names = [n for n, _ in ref.module.named_parameters()]
    identity, losses, ref_losses, routes, changed, nonfinite, resumed = [], [], [], [], [], {}, {}
    levels: list = []  # per step: (level, representation) pairs of the report
    flushed: list = []  # weights whose residual left with a step's dense reduction
    reports = []  # per step: [name, representation, sent, reduce-scatter bytes, shape] per parameter

    def run(engine, step: int, bad: bool = False) -> None:
        size = case["batch_by_step"][step] if "batch_by_step" in case else micro  # rows may fall
        for m in range(gas):
            seed = 7 + rank if case.get("fixed_batch") else 10_000 * step + 100 * m + rank
            loss = models.loss_of(name, engine, models.batch(name, size + rank, seed=seed))
            if bad and rank == 1:
                loss = loss * float("nan")
            engine.backward(loss)
            if m < gas - 1:
                engine.step()
            if m == gas - 1:
                (losses if engine is mine else ref_losses).append(float(loss.detach()))

    for step in range(steps):
        before, before_residuals = rank_state(att), dense_residuals(att)
        bad = step == case.get("nonfinite_step")
        run(ref, step, bad)
        run(mine, step, bad)
        after = rank_state(att)
        changed.append(any(k not in before or not torch.equal(before[k], after[k]) for k in after))
        routes.append(sorted({p.representation for p in att.last_step_report().params}))
        levels.append(sorted({(p.level, p.representation) for p in att.last_step_report().params}))
        reports.append([[p.name, p.representation, p.sent_bytes, p.reduce_scatter_bytes, list(p.shape)]
                        for p in att.last_step_report().params])
        ranges: Dict[str, Tuple[int, int]] = {}
        ref_owned, mine_owned = owned_partitions(ref, ranges), owned_partitions(mine)
        if bad:
            nonfinite = {"state_kept": not changed[-1],
                         # finite where DeepSpeed's is not (the other way is allowed: a rank-r
                         # approximation of a gradient with a NaN is NaN in every row)
                         "missed": [n for n in ref_owned if bool((~torch.isfinite(ref_owned[n])
                                                                  & torch.isfinite(mine_owned[n])).any())],
                         "nonfinite_params": sum(not bool(torch.isfinite(t).all()) for t in mine_owned.values())}
            break
        after_residuals = dense_residuals(att)
        flushed += [n for n in before_residuals if n not in after_residuals]  # sent with this step
        if case.get("lr", 0.1) == 0 and gas == 1:
            expected = ef_expected(ref_owned, ranges, before_residuals, after_residuals, unit_shapes(att))
            identity.append(max(partition_errors(expected, mine_owned, names).values()))
        ref.step()
        mine.step()
        if step == case.get("resume_step"):
            folder = os.path.join(OUT_DIR, f"ckpt-{case['stage']}-{case['model']}")
            mine.save_checkpoint(folder, tag="resume")
            saved, saved_steps = rank_state(att), att.state_dict()["steps"]
            run(mine, step + 1)      # the state moves on ...
            mine.step()
            moved = rank_state(att)
            mine.load_checkpoint(folder, tag="resume")   # ... and comes back
            back = rank_state(att)
            resumed = {"numel": sum(t.numel() for t in saved.values()),
                       "moved": any(not torch.equal(saved[k], moved[k]) for k in saved),
                       "state_equal": saved.keys() == back.keys() and all(torch.equal(saved[k], back[k])
                                                                          for k in saved),
                       "steps": [saved_steps, att.state_dict()["steps"]],
                       "files": sorted(f for f in os.listdir(os.path.join(folder, "resume")) if "dad" in f)}
    if case.get("save_state"):  # dAD's state alone (`RankStateCheckpoints.save_state`), for a resize
        att.save_state(case["save_state"])
        held = dense_residuals(att)
        sums = {n: summed(held[n] if n in held else torch.zeros(shape)) for n, shape in sorted(unit_shapes(att).items())}
        if rank == 0:
            torch.save(sums, os.path.join(case["save_state"], "residual_sums.pt"))
    b = full_params(mine)
    out = {"identity": identity, "losses": losses, "ref_losses": ref_losses, "routes": routes, "changed": changed,
           "levels": levels,
           "nonfinite": nonfinite, "reports": reports, "flushed": flushed,
           "resumed": resumed, "identical": ranks_agree(torch.cat([b[n].reshape(-1) for n in names])),
           "finite": all(bool(torch.isfinite(b[n]).all()) for n in names),
           "dense_only": [u.name for u in att.units if u.dense_only]}
    att.detach()
    return out


def summed(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().double().clone()
    torch.distributed.all_reduce(t)
    return t


def run_resume(case: dict) -> dict:
    """dAD's state saved by a job of another shape (``load``: `run_rank`'s ``save_state``, from
    ``old_world`` ranks) loaded into this one (`RankStateCheckpoints.load_state`): the mean residual
    per weight over the new ranks must be the old mean (what the average still owes), then a few
    steps train on alike on every rank."""
    name, micro = case["model"], case.get("batch", 2)
    mine = build_engine(case, micro, case["dad"])
    att = deepspeed_dad.get_attachment(mine)
    loaded = att.load_state(case["load"])
    old = torch.load(os.path.join(case["load"], "residual_sums.pt"))
    new = dense_residuals(att)
    S = dist.get_world_size()
    worst = 0.0
    for n, total in sorted(old.items()):
        new_mean = summed(new[n] if n in new else torch.zeros_like(total)) / S
        old_mean = total / case["old_world"]
        worst = max(worst, float((new_mean - old_mean).norm()) / max(float(old_mean.norm()), 1e-30))
    for step in range(2):
        loss = models.loss_of(name, mine, models.batch(name, micro + dist.get_rank(), seed=500 + step))
        mine.backward(loss)
        mine.step()
    b = full_params(mine)
    names = [n for n, _ in mine.module.named_parameters()]
    out = {"loaded": loaded, "weights": len(old), "worst": worst,
           "identical": ranks_agree(torch.cat([b[n].reshape(-1) for n in names])),
           "finite": all(bool(torch.isfinite(b[n]).all()) for n in names)}
    att.detach()
    return out


def run_trial(case: dict) -> dict:
    """A route trial under ZeRO (`zero.ZeroDAD`, `sharded_trial`): a measured link the models
    misjudge (`set_link` to 1 Mbit/s after attach: every weight compressed at step 0), compressed
    routes slowed by a real sleep (`models.slow_compressed_routes`), rounds of 4 steps (R D D R at
    steps 1-4), all dense decided at step 4 and kept until the next refresh. ``slow: "dense"``:
    DeepSpeed's reduction of a whole bucket slowed instead, so the routes are kept from step 5. A reference engine
    (learning rate 0) takes dAD's parameters before every step: dense steps' partitions equal
    DeepSpeed's own reduction."""
    import dataclasses
    import hashlib
    import time
    name, micro = case["model"], case.get("batch", 2)
    ref = build_engine({**case, "lr": 0.0}, micro, None)
    mine = build_engine(case, micro, case["dad"])
    att = deepspeed_dad.get_attachment(mine)
    if case.get("slow") == "dense":  # DeepSpeed's reduction of a whole bucket slowed, not its small runs
        seam = att._seam
        original = seam._originals["average_tensor"]

        def slow_average_tensor(tensor, *args, **kwargs):
            if tensor.numel() >= 1000:
                time.sleep(0.05)
            return original(tensor, *args, **kwargs)
        seam._originals["average_tensor"] = slow_average_tensor
    else:
        models.slow_compressed_routes(att.aggregator, 0.05)
    att.set_link({"bandwidth": "1mbit", "latency_us": 100})
    names = [n for n, _ in ref.module.named_parameters()]
    out = {"routes": [], "arms": [], "errors": {}, "captured": []}
    for step in range(case["steps"]):
        with torch.no_grad():
            for a, b in zip(ref.module.parameters(), mine.module.parameters()):
                a.data.copy_(b.data)
        data = models.batch(name, micro, seed=10_000 * step + dist.get_rank())
        out["arms"].append(att._trial.arm(step))  # (before the step: a decision ends the trial)
        for engine in (ref, mine):
            engine.backward(models.loss_of(name, engine, data))
        errors = partition_errors(owned_partitions(ref), owned_partitions(mine), names)
        out["errors"][step] = max(errors.values())
        rep = att.last_step_report()
        out["routes"].append(sorted({p.representation for p in rep.params if p.representation != "overhead"}))
        out["captured"].append(sum(c.enabled for c in att.plan.captures))  # (for the next step)
        ref.step()
        mine.step()
    params = full_params(mine)
    digest = hashlib.sha1(b"".join(params[n].float().numpy().tobytes() for n in names)).hexdigest()
    trials = [dataclasses.asdict(t) for t in att.route_trials]
    att.detach()
    return {**out, "trials": trials, "digest": digest}


def run_error(case: dict) -> dict:
    try:
        engine = build_engine(case, 2, case["dad"])
    except (ValueError, TypeError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    att = deepspeed_dad.get_attachment(engine)
    if att is not None:
        att.detach()
    return {"error": None}


def run_ds_match(case: dict) -> dict:
    """`deepspeed_worker`'s "match" (ZeRO 0 or 1 against a plain engine), in this launch: one
    process start instead of two where a test checks both (its bytes counted by this worker's
    counter)."""
    import deepspeed_worker
    deepspeed_worker.COUNTER = COUNTER
    return deepspeed_worker.run_match(case)


def main() -> None:
    global COUNTER, OUT_DIR
    out_path, cases_path = sys.argv[1], sys.argv[2]
    OUT_DIR = os.path.dirname(os.path.abspath(out_path))
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(
        seconds=float(os.environ.get("DAD_TEST_TIMEOUT", 120))))
    COUNTER = CollectiveCounter(dist).install()
    with open(cases_path) as f:
        cases = json.load(f)
    # these cases check whole residuals (identities, flushes, resumes, non-finite steps): the default
    # residual budget (0.25x the sharded state) would keep rank-q ones; tests/test_residual_budget.py checks it
    for case in cases.values():
        dad = case.get("dad") if isinstance(case, dict) else None
        if isinstance(dad, dict) and "rank" in dad and "error_feedback_rank" not in dad:
            dad.setdefault("residual_budget", None)
    run_cases({"match": run_match, "rank": run_rank, "error": run_error, "trial": run_trial, "resume": run_resume,
               "ds_match": run_ds_match}, cases, out_path, "zero_worker")

if __name__ == "__main__":
    main()
