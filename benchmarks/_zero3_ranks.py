"""The per-rank side of ``benchmarks.multinode --zero3``: DeepSpeed ZeRO-3's own reduce-scatter against
ZeRO-3 + dAD auto, taking turns step by step on one simulated cluster.

Started by ``torchrun --nnodes N`` in each node's namespace (`benchmarks.sim_cluster`), with
``DS_ACCELERATOR=cpu``. Both methods are DeepSpeed engines in the same processes, built from the same
weights (the byte-level Llama of ``examples/deepspeed/llama_multinode.py``) with the example's config
(``ds_config_zero3_multinode.json``: ZeRO-3, hpZ = ranks per node), on the same batches:

  zero3           ``deepspeed.initialize`` on the config without its "dad" block
  zero3-dad-auto  ``deepspeed_dad.initialize`` on the config as it is (dAD auto, rank 4)

Each step, for one method and then the other (the order alternates from step to step): the ranks
meet at a barrier and each node's first rank reads its inter-node interface's byte counter
(``GLOO_SOCKET_IFNAME``); forward; barrier, counter; backward and the optimizer step; barrier, counter.
Each count is less a barrier's own bytes (measured alone at the start). Per method and rank: the
seconds of forward and of backward + step (barrier waits not included), losses, inter-node bytes of
forward and of backward + step, and the bytes of the tensors the method holds per rank after the
last step (parameter partitions incl. hpZ's secondary copy, gradient partitions, fp32 master
partitions and optimizer state, dAD's residuals and warm starts). Process RSS is not split between
methods (both live in one process): only the process's peak is recorded. Rank 0 writes JSON.
"""
from __future__ import annotations

import importlib.util
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "deepspeed" / "llama_multinode.py"
CONFIG = ROOT / "examples" / "deepspeed" / "ds_config_zero3_multinode.json"
METHODS = ("zero3", "zero3-dad-auto")


def _example():
    """``examples/deepspeed/llama_multinode.py`` as a module (its model and counter reader)."""
    spec = importlib.util.spec_from_file_location("llama_multinode", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tx_bytes() -> int:
    path = f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes"
    with open(path) as f:
        return int(f.read())


def _unique_bytes(tensors: Iterable[Optional[torch.Tensor]], seen: set) -> int:
    """Bytes of ``tensors``' storages, each storage counted once (``seen``: storages counted already,
    across categories: a parameter partition that is a view of the flat group counts once)."""
    out = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        out += storage.nbytes()
    return out


class Method:
    """One method's engine, batches and figures."""

    def __init__(self, name: str, example, config: dict, init_state, args: dict):
        import deepspeed
        import deepspeed_dad
        from dad_examples.text_data import byte_lm_batches, stdlib_source_bytes

        self.name = name
        model = example.build_model(args["hidden"], args["layers"])
        model.load_state_dict(init_state)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args["lr"])
        if name == "zero3":
            config = {k: v for k, v in config.items() if k != "dad"}
            self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        else:
            self.engine, *_ = deepspeed_dad.initialize(model=model, optimizer=optimizer, config=config)
        self.att = deepspeed_dad.get_attachment(self.engine)
        rank, world = dist.get_rank(), dist.get_world_size()
        self.batches = byte_lm_batches(stdlib_source_bytes(max_bytes=1_000_000),  # the example's batches
                                       config["train_micro_batch_size_per_gpu"], args["seq_len"], rank=rank,
                                       world_size=world)
        self.forward_s: List[float] = []
        self.backward_s: List[float] = []
        self.losses: List[float] = []
        self.forward_inter: List[float] = []
        self.backward_inter: List[float] = []
        self.routes_by_step: List[List[str]] = []

    def step(self, turns, counting: bool, barrier_bytes: float) -> None:
        x = next(self.batches)
        dist.barrier(group=turns)
        tx0 = _tx_bytes() if counting else 0
        start = time.perf_counter()
        loss = self.engine(input_ids=x, labels=x).loss
        self.forward_s.append(time.perf_counter() - start)
        dist.barrier(group=turns)
        tx1 = _tx_bytes() if counting else 0
        start = time.perf_counter()
        self.engine.backward(loss)
        self.engine.step()
        self.backward_s.append(time.perf_counter() - start)
        dist.barrier(group=turns)
        tx2 = _tx_bytes() if counting else 0
        self.forward_inter.append(float(tx1 - tx0 - barrier_bytes) if counting else 0.0)
        self.backward_inter.append(float(tx2 - tx1 - barrier_bytes) if counting else 0.0)
        self.losses.append(float(loss.detach()))
        report = self.att.last_step_report() if self.att is not None else None
        self.routes_by_step.append(sorted({p.representation for p in report.params}) if report is not None else [])

    def held_bytes(self) -> Dict[str, int]:
        """Bytes of the tensors this method keeps per rank between steps, by kind, each storage once.
        ``reduce_bucket``: DeepSpeed's contiguous-gradient buffers (``reduce_bucket_size`` elements,
        allocated empty: mostly never touched, so not in ``total``)."""
        opt, seen = self.engine.optimizer, set()
        params = list(self.engine.module.parameters())
        out = {"params": _unique_bytes([p.ds_tensor for p in params] + list(opt.fp16_partitioned_groups_flat), seen),
               "grads": _unique_bytes([opt.grad_partitions_flat_buffer], seen),
               "master": _unique_bytes(opt.fp32_partitioned_groups_flat, seen),
               "optimizer": _unique_bytes((t for s in opt.optimizer.state.values() for t in s.values()), seen),
               "error_feedback": 0, "warm_starts": 0}
        out["params_hpz"] = _unique_bytes((getattr(p, "ds_secondary_tensor", None) for p in params), seen)  # hpZ's copy
        if self.att is not None:
            routes = self.att.state_dict().get("rank_routes") or {}
            for state in routes.values():
                residual = state.get("residual")
                out["error_feedback"] += _unique_bytes(residual if isinstance(residual, tuple) else [residual], seen)
                out["warm_starts"] += _unique_bytes([state.get("warm_q"), state.get("shared_q")], seen)
        out["total"] = sum(out.values())
        out["reduce_bucket"] = _unique_bytes((b.buffer for b in getattr(opt, "ipg_buckets", {}).values()), seen)
        return out


def main(spec_path: str) -> None:
    import deepspeed

    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_first = int(os.environ.get("LOCAL_RANK", 0)) == 0
    example = _example()
    args = dict(hidden=256, layers=4, seq_len=128, lr=1e-3, **spec.get("model", {}))
    with open(spec.get("config", CONFIG)) as f:
        config = json.load(f)
    config["train_batch_size"] = (config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]
                                  * world)
    init_state = {k: v.clone() for k, v in example.build_model(args["hidden"], args["layers"]).state_dict().items()}

    turns = dist.new_group(list(range(world)))
    dist.barrier(group=turns)
    before = _tx_bytes() if local_first else 0
    for _ in range(10):
        dist.barrier(group=turns)
    barrier_bytes = (_tx_bytes() - before) / 10 if local_first else 0.0

    methods = [Method(m, example, config, init_state, args) for m in spec.get("methods", METHODS)]
    for step in range(spec["steps"]):
        for m in (methods if step % 2 == 0 else methods[::-1]):  # no method always first
            m.step(turns, local_first, barrier_bytes)
    mine = {}
    for m in methods:
        report = m.att.last_step_report() if m.att is not None else None
        mine[m.name] = {"forward_s": m.forward_s, "backward_s": m.backward_s, "losses": m.losses,
                        "forward_inter": m.forward_inter, "backward_inter": m.backward_inter,
                        "held": m.held_bytes(), "routes_by_step": m.routes_by_step,
                        "routes": report.by_representation() if report is not None else None,
                        "route_trials": len(m.att.route_trials) if m.att is not None else 0}
    mine["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gathered: List[Optional[dict]] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump({"ranks": gathered, "world": world, "local": int(os.environ["LOCAL_WORLD_SIZE"]),
                       "barrier_bytes": barrier_bytes, "order": "alternating"}, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads may abort the interpreter's finalisation now and then


if __name__ == "__main__":
    main(sys.argv[1])
