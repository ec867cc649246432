"""The per-rank side of ``benchmarks.multinode --hsdp``: FSDP2 HSDP's own reduction against dAD on
its replicate hop, and flat PowerSGD, taking turns step by step on one simulated cluster.

Started by ``torchrun --nnodes N`` in each node's namespace (`benchmarks.sim_cluster`). Methods:

  hsdp            FSDP2 on a 2-D ("replicate", "shard") mesh: reduce-scatter inside the node,
                  all-reduce of each shard between nodes
  hsdp-dad-exact  the same, dAD exact on the hop between nodes
  hsdp-dad-auto   the same, dAD ``{"rank": R}`` with its defaults (routes by measured time)
  hsdp-dad-rank   the same, dAD's rank routes forced (``mode: "rank"``)
  powersgd        DDP (no sharding) with PyTorch's PowerSGD hook at rank R, one bucket: the flat
                  lossy baseline the issue's quality target names

Each trains its own copy of the byte-level model (GPT-2 or Llama, from a config) from the same
weights on the same batches. Before each method's step the ranks meet at a barrier, each node's
first rank reads its inter-node interface's byte counter, the step runs, the ranks meet again and
the counter is read again (less a barrier's own bytes). Per method and rank: step seconds, losses,
inter-node bytes, bytes of the tensors the method holds per rank (parameter, gradient and
optimizer shards, dAD's or PowerSGD's error-feedback state), held-out loss. Rank 0 writes JSON.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from benchmarks.node_bytes import NodeBytes
from benchmarks.workload import Workload, build_model

EVAL_BATCHES = 4


def _build(family: str, w: Workload):
    if family == "gpt2":
        return build_model(w)
    from transformers import LlamaConfig, LlamaForCausalLM
    from dad_examples.text_data import VOCAB_SIZE
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=w.n_embd, intermediate_size=2 * w.n_embd,
                         num_hidden_layers=w.n_layer, num_attention_heads=w.n_head, num_key_value_heads=w.n_head,
                         max_position_embeddings=w.seq, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config)


def _blocks(family: str, model):
    return list(model.transformer.h) if family == "gpt2" else list(model.model.layers)


def _bytes(tensors) -> int:
    out = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        out += t.numel() * t.element_size()
    return out


class Method:
    """One method's model, optimizer, batches and figures."""

    def __init__(self, name: str, family: str, w: Workload, init_state, data: bytes, mesh, rank_r: int,
                 warmup: int):
        from dad_examples.text_data import byte_lm_batches
        from torch.distributed.fsdp import fully_shard

        self.name, self.sync, self.hook_state = name, None, None
        rank, world = dist.get_rank(), dist.get_world_size()
        model = _build(family, w)
        model.load_state_dict(init_state)
        self.model = model
        if name.startswith("hsdp"):
            for block in _blocks(family, model):
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.fwd = model
            if name == "hsdp-dad-exact":
                from dad_integrations.fsdp import enable_dad_fsdp
                self.sync = enable_dad_fsdp(model, {"mode": "exact"})
            elif name == "hsdp-dad-auto":
                from dad_integrations.fsdp import enable_dad_fsdp
                self.sync = enable_dad_fsdp(model, {"rank": rank_r})
            elif name == "hsdp-dad-rank":  # the rank routes forced (after the lossless steps)
                from dad_integrations.fsdp import enable_dad_fsdp
                self.sync = enable_dad_fsdp(model, {"rank": rank_r, "mode": "rank"})
        else:  # powersgd: flat DDP, one bucket (PyTorch's PowerSGD hook hangs on gloo with several)
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
            from torch.nn.parallel import DistributedDataParallel
            group = dist.new_group(list(range(world)))
            self.fwd = DistributedDataParallel(model, process_group=group, bucket_cap_mb=256)
            state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=rank_r,
                                                start_powerSGD_iter=warmup, use_error_feedback=True,
                                                warm_start=True, random_seed=w.seed)
            self.fwd.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            self.hook_state = state
        self.opt = torch.optim.AdamW(model.parameters(), lr=w.lr)
        self.batches = byte_lm_batches(data, w.batch, w.seq, rank=rank, world_size=world, seed=w.seed)
        self.times: List[float] = []
        self.losses: List[float] = []
        self.routes: set = set()

    def step(self) -> None:
        x = next(self.batches)
        start = time.perf_counter()
        loss = self.fwd(input_ids=x, labels=x).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)  # gradients stay held, as a training loop keeps them
        self.times.append(time.perf_counter() - start)
        self.losses.append(float(loss.detach()))
        if self.sync is not None and self.sync.last_step_report() is not None:
            self.routes |= {p.representation for p in self.sync.last_step_report().params}

    def held_bytes(self) -> Dict[str, int]:
        """Bytes of what this method keeps per rank between steps."""
        params = list(self.model.parameters())
        out = {"params": _bytes(params), "grads": _bytes(p.grad for p in params),
               "optimizer": _bytes(t for s in self.opt.state.values() for t in s.values()
                                   if isinstance(t, torch.Tensor)), "error_feedback": 0}
        if self.sync is not None and self.sync.rank_codec is not None:
            memory = self.sync.rank_codec.memory
            out["error_feedback"] = _bytes(r if isinstance(r, torch.Tensor) else r[0] for r in memory.residuals.values())
        elif self.hook_state is not None:
            out["error_feedback"] = _bytes(self.hook_state.error_dict.values())
        return out

    @torch.no_grad()
    def eval_loss(self, batches) -> float:
        self.model.eval()
        loss = sum(float(self.fwd(input_ids=x, labels=x).loss) for x in batches) / len(batches)
        self.model.train()
        return loss


def main(spec_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from dad_examples.text_data import byte_lm_batches, stdlib_source_bytes

    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world // local, local), mesh_dim_names=("replicate", "shard"))
    w = Workload(**spec["workload"])
    family = spec.get("family", "gpt2")
    data = stdlib_source_bytes(max_bytes=spec.get("data_bytes", 2_000_000), seed=w.seed)
    torch.manual_seed(w.seed)
    init_state = _build(family, w).state_dict()
    eval_iter = byte_lm_batches(data, w.batch, w.seq, seed=w.seed, split="eval")
    eval_batches = [next(eval_iter) for _ in range(EVAL_BATCHES)]
    counter = NodeBytes(dist.new_group(list(range(world))))

    methods = [Method(m, family, w, init_state, data, mesh, spec["rank"], spec["warmup"]) for m in spec["methods"]]
    inter: Dict[str, List[float]] = {m.name: [] for m in methods}
    for step in range(spec["steps"]):
        for m in (methods if step % 2 == 0 else methods[::-1]):  # no method always first
            inter[m.name].append(counter.step(m.step))
    mine = {}
    for m in methods:
        report = m.sync.last_step_report() if m.sync is not None else None
        mine[m.name] = {"times": m.times, "losses": m.losses, "inter": inter[m.name],
                        "eval_loss": m.eval_loss(eval_batches), "held": m.held_bytes(),
                        "routes": sorted(m.routes),
                        "reported_inter": report.totals.get("inter_bytes") if report is not None else None,
                        "replicate_bytes": report.totals.get("replicate_bytes") if report is not None else None}
        if m.sync is not None:
            m.sync.close()
    gathered: List[Optional[dict]] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump({"ranks": gathered, "world": world, "local": local}, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
