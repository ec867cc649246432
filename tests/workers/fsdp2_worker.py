"""Runs inside `torchrun` (gloo): dAD under FSDP2 against FSDP2's own reduce-scatter, same model and data.

Usage: torchrun --standalone --nproc_per_node 2 fsdp2_worker.py OUT.json [CASE ...]

Each case builds a model, copies it, applies ``fully_shard`` per block and to the root on both
(with the case's mixed precision policy, ``reshard_after_forward``, and ``Shard(1)`` placements
where asked), enables dAD on the copy, and runs the same batches (uneven per rank where asked)
through both, comparing every sharded gradient with FSDP's after each backward, then taking an
AdamW step on both. It records per-parameter relative errors (global over ranks, the denominator floored at 1e-6
of the whole gradient's norm), the parameters' largest difference after the steps, every rank's
parameters' checksum, and the report's bytes beside the bytes FSDP's reduce-scatter really handed
to torch.distributed in the reference run, and the adapter's log lines (fallbacks are logged once).
"""
from __future__ import annotations

import copy
import logging
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
from torch.distributed.tensor import Shard

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

from dad_integrations.fsdp import enable_dad_fsdp  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, h):
        return h + self.fc2(torch.tanh(self.fc1(self.norm(h))))


class TinyMLP(nn.Module):
    """Odd sizes (17, 33: shards padded on 2 ranks), a layer called twice, a bias-free head."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(10, 17)
        self.blocks = nn.ModuleList([Block(17, 33), Block(17, 33)])
        self.head = nn.Linear(17, 5, bias=False)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for block in self.blocks:
            h = block(h)
        h = self.blocks[1](h)  # a second call of the last block (its weights used twice)
        return self.head(h)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return TinyMLP()
    if name in ("llama", "bert"):  # small configs from models.py (BERT: masked LM, padded batches)
        return models.build(name)
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0, tie_word_embeddings=True))


def blocks_of(name: str, model: nn.Module):
    if name == "mlp":
        return list(model.blocks)
    if name == "llama":
        return list(model.model.layers)
    if name == "bert":
        return list(model.bert.encoder.layer)
    return list(model.transformer.h)


def batch(name: str, size: int, seed: int) -> dict:
    if name in ("llama", "bert"):
        return models.batch(name, size, seed)
    g = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return {"x": torch.randn(size, 3, 10, generator=g), "y": torch.randn(size, 3, 5, generator=g)}
    ids = torch.randint(1, 64, (size, 8), generator=g)
    return {"input_ids": ids, "labels": ids}


def loss_of(name: str, model: nn.Module, data: dict) -> torch.Tensor:
    if name == "mlp":
        return nn.functional.mse_loss(model(data["x"]), data["y"])
    return model(**data).loss


class CountingReduceScatter(DefaultReduceScatter):
    """FSDP's default reduce-scatter, counting the bytes it hands to torch.distributed."""

    def __init__(self):
        self.input_bytes = 0

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.input_bytes += input_tensor.numel() * input_tensor.element_size()
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


# mixed precision policies that run on CPU with gloo (fp16 reduces with SUM and a predivide)
POLICIES = {
    "bf16-fp32": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
    "fp16": MixedPrecisionPolicy(param_dtype=torch.float16),
}


def shard(name: str, model: nn.Module, case: dict, counter=None) -> nn.Module:
    kwargs = {"mp_policy": POLICIES[case["mp"]]} if case.get("mp") else {}
    if "reshard" in case:
        kwargs["reshard_after_forward"] = case["reshard"]
    for block in blocks_of(name, model):
        fully_shard(block, **kwargs)
    if case.get("groups"):  # Accelerate's layout: the untied embedding alone, the final norm and head
        fully_shard(model.get_input_embeddings(), **kwargs)  # together, kept unsharded after forward
        fully_shard([model.model.norm, model.get_output_embeddings()], **{**kwargs, "reshard_after_forward": False})
    if case.get("shard1"):  # one weight of the root's group sharded by columns (10 of them: even)
        column = model.get_parameter(case["shard1"])
        kwargs["shard_placement_fn"] = lambda p: Shard(1) if p is column else None
    fully_shard(model, **kwargs)
    if case.get("force_sum"):  # SUM on the wire, FSDP divides afterwards
        for m in [model] + blocks_of(name, model):
            m.set_force_sum_reduction_for_comms(True)
    if counter is not None:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_reduce_scatter(counter)
    return model


def grad_errors(ref: nn.Module, mine: nn.Module) -> dict:
    """Per parameter ||g - g_ref|| / max(||g_ref||, 1e-6 ||whole g_ref||), over all ranks' shards."""
    names, sq = [], []
    for (name, a), (_, b) in zip(ref.named_parameters(), mine.named_parameters()):
        ga = a.grad.to_local() if a.grad is not None else None
        gb = b.grad.to_local() if b.grad is not None else None
        if (ga is None) != (gb is None):
            raise AssertionError(f"{name}: gradient present in one model only")
        if ga is None:
            continue
        names.append(name)
        sq += [float((gb - ga).double().norm()) ** 2, float(ga.double().norm()) ** 2]
    t = torch.tensor(sq, dtype=torch.float64)
    dist.all_reduce(t)
    total = float(t[1::2].sum()) ** 0.5
    return {n: float(t[2 * i]) ** 0.5 / max(float(t[2 * i + 1]) ** 0.5, 1e-6 * total) for i, n in enumerate(names)}


def run_case(case: dict) -> dict:
    name, mode = case["model"], case["mode"]
    rank = dist.get_rank()
    ref = build(name)
    mine = copy.deepcopy(ref)
    # mixed precision: the first step's gradients in fp32 (no policy) too, which dAD's and FSDP's
    # low-precision ones are both measured against
    full = shard(name, copy.deepcopy(ref), {}) if case.get("mp") else None
    counter = CountingReduceScatter()
    shard(name, ref, case, counter)
    shard(name, mine, case)
    logged = LogLines()
    logging.getLogger("dad_integrations.fsdp").addHandler(logged)
    sync = enable_dad_fsdp(mine, {"mode": mode})
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_mine = torch.optim.AdamW(mine.parameters(), lr=1e-2)
    worst, first, reports, vs_fp32 = {}, {}, [], {}
    micro = case.get("micro", 1)
    for step in range(case.get("steps", 3)):
        counter.input_bytes = 0
        for k in range(micro):
            last = k == micro - 1
            for model in (ref, mine):
                model.set_requires_gradient_sync(last)
            size = case.get("batch", 2) + (rank if case.get("uneven") else 0)
            data = batch(name, size, seed=1000 * step + 10 * k + rank)
            loss_of(name, ref, data).backward()
            loss_of(name, mine, data).backward()
            if full is not None and step == 0:
                loss_of(name, full, data).backward()
        errors = grad_errors(ref, mine)
        for n, e in errors.items():
            worst[n] = max(worst.get(n, 0.0), e)
        if step == 0:  # both models still equal: only the reduction differs (what mixed precision reads)
            first = errors
            if full is not None:
                vs_fp32 = {"fsdp": grad_errors(full, ref), "dad": grad_errors(full, mine)}
        rep = sync.last_step_report()
        totals = rep.totals
        world = dist.get_world_size()
        reports.append({"totals": totals,
                        "fsdp_reduce_scatter_bytes": (world - 1) / world * counter.input_bytes,
                        "params": [[p.name, p.representation, p.sent_bytes, p.reduce_scatter_bytes]
                                   for p in rep.params]})
        opt_ref.step()
        opt_mine.step()
        opt_ref.zero_grad()
        opt_mine.zero_grad()
    diffs, abs_diffs = {}, {}
    checksum = 0.0
    for (n, a), (_, b) in zip(ref.named_parameters(), mine.named_parameters()):
        fa, fb = a.full_tensor(), b.full_tensor()
        abs_diffs[n] = float((fa - fb).abs().max())
        diffs[n] = abs_diffs[n] / max(float(fa.abs().max()), 1e-12)
        checksum += float(fb.double().sum())
    sums = [None] * dist.get_world_size()
    dist.all_gather_object(sums, checksum)
    sync.close()
    logging.getLogger("dad_integrations.fsdp").removeHandler(logged)
    return {"grad_errors": worst, "first_step_errors": first, "vs_fp32": vs_fp32, "param_diffs": diffs,
            "param_abs_diffs": abs_diffs,
            "checksums": sums, "reports": reports, "log": logged.lines}


class LogLines(logging.Handler):
    """Keeps the adapter's log messages."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


CASES = {
    "mlp-exact": {"model": "mlp", "mode": "exact"},
    "mlp-exact-uneven": {"model": "mlp", "mode": "exact", "uneven": True},
    "mlp-auto-uneven": {"model": "mlp", "mode": "auto", "uneven": True, "batch": 1},
    "mlp-auto": {"model": "mlp", "mode": "auto", "batch": 1},
    "mlp-exact-accum": {"model": "mlp", "mode": "exact", "uneven": True, "micro": 2},
    "gpt2-exact-uneven": {"model": "gpt2", "mode": "exact", "uneven": True, "batch": 1},
    "gpt2-auto": {"model": "gpt2", "mode": "auto", "batch": 1},
    "llama-exact-uneven": {"model": "llama", "mode": "exact", "uneven": True, "batch": 1},
    "bert-exact-noreshard": {"model": "bert", "mode": "exact", "batch": 1, "reshard": False},
    "llama-exact-groups": {"model": "llama", "mode": "exact", "batch": 1, "reshard": True, "groups": True},
    "llama-auto-noreshard": {"model": "llama", "mode": "auto", "batch": 1, "reshard": False},
    # mixed precision: 2 steps (only the first compares equal models: the test reads that one)
    "gpt2-exact-bf16-fp32": {"model": "gpt2", "mode": "exact", "batch": 1, "mp": "bf16-fp32", "steps": 2},
    "gpt2-exact-bf16": {"model": "gpt2", "mode": "exact", "batch": 1, "mp": "bf16", "steps": 2},
    "mlp-exact-fp16": {"model": "mlp", "mode": "exact", "mp": "fp16", "steps": 2},
    "gpt2-auto-bf16": {"model": "gpt2", "mode": "auto", "batch": 1, "mp": "bf16", "steps": 2},
    "mlp-exact-sum": {"model": "mlp", "mode": "exact", "uneven": True, "force_sum": True},
    "mlp-exact-shard1": {"model": "mlp", "mode": "exact", "shard1": "inp.weight"},
}


def main() -> None:
    dist.init_process_group("gloo")
    out_path = sys.argv[1]
    names = sys.argv[2:] or list(CASES)
    # rank 0's results (a case compares against all ranks itself); a failing case gives its traceback
    models.write_and_leave(out_path, models.run_all({cid: CASES[cid] for cid in names}, run_case,
                                                    lambda cid, mine: mine))


if __name__ == "__main__":
    main()
