"""A route defined entirely in this file runs on every engine dAD attaches to.

The route, ``bf16_sr``, sends each weight's local gradient in bf16 with stochastic rounding (an
unbiased round to one of the two nearest bf16 values), all-gathered, and sums the gathered payloads
in fp32 in rank order (bit-identical on every rank). It is one codec (`BF16StochasticRounding`) and
one registration (`routes.codec_route`), named in the config's ``routes``.

One ``torchrun`` job of 2 CPU ranks (this file is its worker: ``python tests/test_custom_route.py
OUT.json``) runs it under the synchroniser, DDP's communication hook, FSDP2 and DeepSpeed ZeRO-2
and ZeRO-3. Per engine: every weight took the route; the bytes the route's byte model predicts for
each weight equal the bytes its collective counted; one SGD step (lr 1) moved the parameters by the
average gradient to bf16 rounding (not to fp32 round-off: the route really ran), identically on
every rank. A second job of 4 ranks as 2 nodes of 2 runs it between nodes: two-level DDP (the
synchroniser with ``topology: 2``) and FSDP2 HSDP on a 2 x 2 mesh, the hop between nodes as
predicted; and refuses at attach, naming them, a route on a layout it does not declare and a route
nobody registered.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import torch

from dad_integrations.codecs.wire import BlockSpec
from dad_integrations.routes import GradientCodec, codec_route, register_route, route_names

ROUTE = "bf16_sr"
WORLD = 2
STEPS = 2  # the first exchanges row counts beside the route; the second is the route alone


# --8<-- [start:route]
class BF16StochasticRounding(GradientCodec):
    """bf16 on the wire, rounded stochastically (unbiased), all-gathered and summed in fp32."""

    collective = "all_gather"

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def payload_specs(self, numel: int) -> List[BlockSpec]:
        return [(torch.bfloat16, (numel,))]

    def encode(self, block: torch.Tensor) -> List[torch.Tensor]:
        bits = block.float().contiguous().view(torch.int32)
        noise = torch.randint(0, 1 << 16, bits.shape, generator=self.generator, dtype=torch.int32)
        # add uniform noise below bf16's last bit, then truncate: rounds up with the right odds
        rounded = ((bits + noise) & ~0xFFFF).view(torch.float32)
        return [rounded.to(torch.bfloat16)]

    def decode(self, payloads: Sequence[List[torch.Tensor]]) -> torch.Tensor:
        total = payloads[0][0].float()
        for blocks in payloads[1:]:
            total = total + blocks[0].float()
        return total


def register() -> None:
    if ROUTE not in route_names():
        register_route(codec_route(ROUTE, BF16StochasticRounding(), summary="bf16, stochastically rounded"))
# --8<-- [end:route]


# -- the worker (inside torchrun) ---------------------------------------------------------------------
CONFIG = {"mode": "auto", "objective": "bytes", "lossless_steps": 0, "routes": [ROUTE], "verify_first_step": False,
          "layer_kinds": ["linear"]}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(48, 96, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(96, 24, bias=False))


def _batch(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(64, 48, generator=g)  # 64 rows: exact factors would cost more than bf16


def _reference_grads() -> Dict[str, torch.Tensor]:
    """The average gradient of the last step (of `STEPS` plain SGD steps at lr 1 on the average)."""
    import torch.distributed as dist
    model = _model()
    for _ in range(STEPS - 1):
        model(_batch(dist.get_rank())).square().mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.data -= p.grad / dist.get_world_size()
            p.grad = None
    model(_batch(dist.get_rank())).square().mean().backward()
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        out[name] = g / dist.get_world_size()
    return out


def _moved(before: Dict[str, torch.Tensor], after: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> dict:
    """The SGD step (lr 1) as a gradient, against the reference average: relative error per weight,
    and whether every rank holds the same parameters."""
    import torch.distributed as dist
    errors, same = {}, True
    for name, g in ref.items():
        step = before[name] - after[name]
        errors[name] = float((step - g).norm() / g.norm())
        gathered = [torch.empty_like(after[name]) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, after[name].contiguous())
        same = same and all(torch.equal(gathered[0], t) for t in gathered)
    return {"errors": errors, "ranks_identical": same}


def _entries(report, layout: str, world: int, ranges: Dict[str, list] = None) -> List[dict]:
    """Each weight on the route: the bytes its byte model predicts and the bytes counted. ZeRO's
    partitions predict the mean over ranks of what each sends (their ranges differ): the counted
    side is then that mean too."""
    import torch.distributed as dist
    from dad_integrations.routes import UnitSizing, get_route
    out = []
    for e in sorted(report.params, key=lambda e: e.name):
        if e.representation != ROUTE:
            continue
        sizing = UnitSizing(("linear",), tuple(e.shape), torch.float32, None, world_size=world,
                            ranges=(ranges or {}).get(e.name))
        predicted = get_route(ROUTE).bytes_on(layout, sizing)
        sent = torch.tensor([e.sent_bytes], dtype=torch.float64)
        if isinstance(predicted, tuple):  # (busiest rank, mean over ranks)
            dist.all_reduce(sent)
            predicted, sent = predicted[1], sent / world
        out.append({"name": e.name, "predicted": float(predicted), "sent": float(sent)})
    return out


def _zero_ranges(engine, stage: int) -> Dict[str, list]:
    """Every rank's owned element range ``[lo, hi)`` of each weight, by name (ZeRO's partitions)."""
    import torch.distributed as dist
    opt, me = engine.optimizer, dist.get_rank()
    names = {id(p): n for n, p in engine.module.named_parameters()}
    mine = {}
    if stage == 3:
        for p in engine.module.parameters():
            pn = p.partition_numel()
            mine[names[id(p)]] = (min(me * pn, p.ds_numel), min((me + 1) * pn, p.ds_numel))
    else:
        for i, params in enumerate(opt.params_in_partition):
            for p in params:
                pid = opt.get_param_id(p)
                start = opt.grad_start_offset[i][me][pid]
                dest = opt.grad_partition_insertion_offset[i][me][pid]
                mine[names[id(p)]] = (start, start + min(p.numel() - start, int(opt.partition_size[i]) - dest))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {n: [r.get(n, (0, 0)) for r in every] for n in names.values()}


def _train(model: torch.nn.Module, forward, step=None, params=None) -> Dict[str, torch.Tensor]:
    """`STEPS` SGD steps (lr 1) of ``forward``'s squared output; returns the parameters before the
    last (``step``: the engine's step in place of the optimiser's; ``params``: how to read them)."""
    import torch.distributed as dist
    params = params or (lambda: _full(model))
    opt = torch.optim.SGD(model.parameters(), lr=1.0) if step is None else None
    for _ in range(STEPS):
        before = params()
        loss = forward(_batch(dist.get_rank())).square().mean()
        if opt is None:
            step(loss)
            continue
        loss.backward()
        opt.step()
        opt.zero_grad()
    return before


def _full(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("module.", "").replace("_fsdp_wrapped_module.", "")] = t.detach().clone().float()
    return out


def run_synchronizer(ref) -> dict:
    from dad_integrations import DADConfig, DADSynchronizer, TorchDistributedAggregator
    model = _model()
    sync = DADSynchronizer(model, TorchDistributedAggregator(), DADConfig(**CONFIG))
    before = _train(model, model, step=lambda loss: _sync_step(model, sync, loss))
    out = {**_moved(before, _full(model), ref), "bytes": _entries(sync.last_step_report(), "flat", WORLD)}
    sync.close()
    return out


def run_ddp_hook(ref) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from dad_integrations import register_dad_comm_hook
    model = _model()
    ddp = DDP(model)
    state = register_dad_comm_hook(ddp, CONFIG)
    before = _train(model, ddp)
    return {**_moved(before, _full(model), ref), "bytes": _entries(state.last_step_report(), "flat", WORLD)}


def run_fsdp2(ref) -> dict:
    from torch.distributed.fsdp import fully_shard
    from dad_integrations.fsdp import enable_dad_fsdp
    model = _model()
    for block in (model[0], model[2]):
        fully_shard(block)
    fully_shard(model)
    sync = enable_dad_fsdp(model, CONFIG)
    before = _train(model, model)
    out = {**_moved(before, _full(model), ref), "bytes": _entries(sync.last_step_report(), "row_shards", WORLD)}
    sync.close()
    return out


def run_zero(stage: int, ref) -> dict:
    import deepspeed_dad
    model = _model()
    zero = {"stage": stage, "reduce_bucket_size": 10 ** 6}
    if stage == 3:
        zero.update({"stage3_param_persistence_threshold": 0})
    cfg = {"train_micro_batch_size_per_gpu": 64, "train_batch_size": 64 * WORLD, "zero_optimization": zero,
           "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9, "dad": CONFIG}
    engine, *_ = deepspeed_dad.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                          config=cfg)
    before = _train(engine, engine, step=lambda loss: (engine.backward(loss), engine.step()),
                    params=lambda: _zero_params(engine, stage))
    report = deepspeed_dad.get_attachment(engine).last_step_report()
    after = _zero_params(engine, stage)
    return {**_moved(before, after, ref), "bytes": _entries(report, "partitions", WORLD, _zero_ranges(engine, stage))}


def _sync_step(model: torch.nn.Module, sync, loss: torch.Tensor) -> None:
    """Backward, the synchroniser's average, one SGD step at lr 1."""
    loss.backward()
    sync.synchronize()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
            p.grad = None


def _zero_params(engine, stage: int) -> Dict[str, torch.Tensor]:
    import deepspeed
    if stage != 3:
        return _full(engine.module)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return _full(engine.module)


def worker(out: Path) -> None:
    import torch.distributed as dist
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    register()
    dist.init_process_group("gloo")
    ref = _reference_grads()
    results = {"synchronizer": run_synchronizer(ref), "ddp_hook": run_ddp_hook(ref), "fsdp2": run_fsdp2(ref),
               "zero2": run_zero(2, ref), "zero3": run_zero(3, ref)}
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _between(report, layout: str, nodes: int, local: int) -> List[dict]:
    """Each weight on the route: the hop between nodes as predicted and as counted (by the rank that
    sent it: at two levels only the weight's owner on each node crosses)."""
    import torch.distributed as dist
    from dad_integrations.routes import UnitSizing, get_route
    out = []
    for e in sorted(report.params, key=lambda e: e.name):
        if e.representation != ROUTE:
            continue
        predicted = get_route(ROUTE).bytes_on(layout, UnitSizing(("linear",), tuple(e.shape), torch.float32, None,
                                                                 nodes=nodes, local=local))
        predicted = getattr(predicted, "between", predicted)
        sent = torch.tensor([e.inter_bytes], dtype=torch.float64)
        dist.all_reduce(sent, op=dist.ReduceOp.MAX)
        out.append({"name": e.name, "level": e.level, "predicted": float(predicted), "sent": float(sent)})
    return out


def run_two_level(ref) -> dict:
    """DDP across 2 nodes of 2 (stated by ``topology``): the owners run the route between nodes."""
    from dad_integrations import DADConfig, DADSynchronizer, TorchDistributedAggregator
    model = _model()
    sync = DADSynchronizer(model, TorchDistributedAggregator(), DADConfig(**CONFIG, topology=2))
    # step 0 is flat (the checked step), step 1 on at two levels
    before = _train(model, model, step=lambda loss: _sync_step(model, sync, loss))
    out = {**_moved(before, _full(model), ref), "bytes": _between(sync.last_step_report(), "two_level", 2, 2)}
    sync.close()
    return out


def run_hsdp(ref) -> dict:
    """FSDP2 HSDP on a (2 replicas x 2 shards) mesh: the route on the hop between replicas."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from dad_integrations.fsdp import enable_dad_fsdp
    dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _model()
    for block in (model[0], model[2]):
        fully_shard(block, mesh=dm)
    fully_shard(model, mesh=dm)
    sync = enable_dad_fsdp(model, CONFIG)
    before = _train(model, model)
    out = {**_moved(before, _full(model), ref), "bytes": _between(sync.last_step_report(), "replicate_hop", 2, 2)}
    sync.close()
    return out


def _refused(routes: list, **extra) -> str:
    from dad_integrations import DADConfig, DADSynchronizer, TorchDistributedAggregator
    try:
        DADSynchronizer(_model(), TorchDistributedAggregator(), DADConfig(**{**CONFIG, "routes": routes}, **extra))
    except ValueError as e:
        return str(e)
    return ""


def nodes_worker(out: Path) -> None:
    """4 ranks as 2 nodes of 2: two-level DDP and HSDP; then routes the job cannot run, refused."""
    import dataclasses
    import torch.distributed as dist
    register()
    dist.init_process_group("gloo")
    ref = _reference_grads()
    results = {"two_level": run_two_level(ref), "hsdp": run_hsdp(ref)}
    spec = codec_route("flat_only", BF16StochasticRounding(), summary="flat only")
    register_route(dataclasses.replace(spec, bytes={"flat": spec.bytes["flat"]},
                                       collectives={"flat": spec.collectives["flat"]}))
    results["refused"] = {"layout": _refused(["flat_only"], topology=2), "unknown": _refused(["int3"])}
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


# -- the tests --------------------------------------------------------------------------------------------
def _run(tmp_path, nproc: int, mode: str) -> dict:
    from conftest import run_torchrun
    out = tmp_path / f"{mode}.json"
    run_torchrun(Path(__file__), nproc, [mode, out], timeout=600)
    return json.loads(out.read_text())


def test_a_route_defined_in_this_file_runs_on_every_engine(tmp_path):
    results = _run(tmp_path, WORLD, "engines")
    for engine, r in results.items():
        assert len(r["bytes"]) == 2, (engine, r)  # both weights took the route
        for e in r["bytes"]:
            assert e["predicted"] == e["sent"] > 0, (engine, e)
        for name, err in r["errors"].items():
            # bf16 rounding (about 2^-9 per entry), not fp32 round-off and not a lost gradient
            assert 1e-5 < err < 1e-2, (engine, name, err)
        assert r["ranks_identical"], engine


def test_the_route_runs_between_nodes_and_refusals_name_route_and_layout(tmp_path):
    results = _run(tmp_path, 4, "nodes")
    for engine in ("two_level", "hsdp"):
        r = results[engine]
        assert len(r["bytes"]) == 2, (engine, r)
        for e in r["bytes"]:
            assert e["level"] in ("two_level", "replicate") and e["predicted"] == e["sent"] > 0, (engine, e)
        for name, err in r["errors"].items():
            assert 1e-5 < err < 1e-2, (engine, name, err)
        assert r["ranks_identical"], engine
    refused = results["refused"]
    assert "'flat_only'" in refused["layout"] and "'two_level'" in refused["layout"], refused
    assert "'int3'" in refused["unknown"] and "bf16_sr" in refused["unknown"], refused


def test_the_route_is_one_registration():
    from dad_integrations.routes import get_route, unregister_route
    register()
    try:
        spec = get_route(ROUTE)
        assert spec.opt_in and not spec.lossless and spec.codec is not None
        assert set(spec.layouts) == {"flat", "row_shards", "partitions", "two_level", "replicate_hop"}
    finally:
        unregister_route(ROUTE)  # this process's registry as the other tests expect it


if __name__ == "__main__":
    mode, target = sys.argv[1], Path(sys.argv[2])
    (worker if mode == "engines" else nodes_worker)(target)
