"""Small models and data for the multi-process tests (built from configs: nothing downloaded)."""
from __future__ import annotations

import traceback
from typing import Any, Callable, Dict, NoReturn

import torch
from torch import nn


class MLP(nn.Module):
    """Linear layers with leading dimensions, a reused layer (two calls per step) and a norm."""

    def __init__(self, functional_reuse: bool = False, checkpoint: str = ""):
        super().__init__()
        self.inp = nn.Linear(12, 24)
        self.hidden = nn.Linear(24, 24)
        self.norm = nn.LayerNorm(24)
        self.out = nn.Linear(24, 6, bias=False)
        self.functional_reuse = functional_reuse
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = torch.tanh(self.hidden(h))
        if self.checkpoint == "shared":         # a weight used inside and outside a reentrant segment
            h = torch.utils.checkpoint.checkpoint(self._second, h, use_reentrant=True)
        else:
            h = self._second(h)
        if self.functional_reuse:               # a use of a weight outside its module
            h = h + 0.1 * nn.functional.linear(h, self.hidden.weight)
        if self.checkpoint == "head":           # reentrant: the first forward runs without grad
            return torch.utils.checkpoint.checkpoint(self._head, h, use_reentrant=True)
        return self._head(h)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(h))

    def _second(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.hidden(h))       # the same weight, a second call


class DynamicMLP(nn.Module):
    """Uses ``extra`` only for batches of more than 3 examples: with uneven batches some ranks
    skip it, so its exchange must still happen, in the same order, on every rank."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.extra = nn.Linear(16, 16)
        self.out = nn.Linear(16, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        if x.shape[0] > 3:
            h = h + torch.tanh(self.extra(h))
        return self.out(h)


def _extra(name: str):
    from layer_models import registry
    return registry().get(name)


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    extra = _extra(name)
    if extra is not None:
        return extra.build()
    if name in ("mlp", "mlp_functional", "mlp_ckpt", "mlp_ckpt_shared"):
        return MLP(functional_reuse=name == "mlp_functional",
                   checkpoint={"mlp_ckpt": "head", "mlp_ckpt_shared": "shared"}.get(name, ""))
    if name == "embedding":  # padding_idx and scale_grad_by_freq, which change the gradient rows
        return nn.Sequential(nn.Embedding(20, 8, padding_idx=0, scale_grad_by_freq=True), nn.Linear(8, 12))
    if name == "mlp_dynamic":  # a layer only some ranks use, depending on their batch
        return DynamicMLP()
    if name == "mlp_narrow":  # every gradient has rank <= 3
        return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 3))
    from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                              LlamaForCausalLM)
    if name in ("gpt2", "gpt2_ckpt"):
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                           bos_token_id=0, eos_token_id=0))
        if name == "gpt2_ckpt":
            model.gradient_checkpointing_enable()
            model.train()
        return model
    if name == "bert":
        return BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, intermediate_size=48,
                                          max_position_embeddings=32, hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0, pad_token_id=0))
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                            num_hidden_layers=2, num_attention_heads=2,
                                            num_key_value_heads=1, max_position_embeddings=32,
                                            bos_token_id=1, eos_token_id=2, pad_token_id=0))
    raise ValueError(name)


def batch(name: str, size: int, seed: int) -> dict:
    """A batch of ``size`` examples for model ``name``, deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    extra = _extra(name)
    if extra is not None:
        return extra.batch(size, g)
    if name == "embedding":  # few ids, so that they repeat; 0 is the padding id
        ids = torch.randint(0, 6, (size, 5), generator=g)
        return {"x": ids, "y": torch.randn(size, 5, 12, generator=g)}
    if name.startswith("mlp"):
        width = 3 if name == "mlp_narrow" else 12
        return {"x": torch.randn(size, 5, width, generator=g), "y": torch.randn(size, 5, width if name == "mlp_narrow" else 6, generator=g)}
    ids = torch.randint(3, 64, (size, 16), generator=g)
    if name == "bert":
        mask = torch.ones_like(ids)
        mask[:, 12:] = 0  # padded tail
        ids = ids.masked_fill(mask == 0, 0)
        labels = torch.full_like(ids, -100)
        labels[:, 2:6] = ids[:, 2:6]
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return {"input_ids": ids, "labels": ids}


def loss_of(name: str, model: nn.Module, data: dict) -> torch.Tensor:
    extra = _extra(name)
    if extra is not None:
        return extra.loss(model, data)
    if name.startswith("mlp") or name == "embedding":
        return nn.functional.mse_loss(model(data["x"]), data["y"])
    return model(**data).loss


def rel_err(mine, ref, floor: float) -> float:
    """||mine - ref|| / ||ref||, the denominator floored at ``floor``: some gradients (BERT's key
    biases, which softmax cancels) are zero up to round-off, where a plain ratio means nothing."""
    if mine is None or ref is None:
        return 0.0 if mine is None and ref is None else float("inf")
    mine = mine.to_dense() if mine.is_sparse else mine
    ref = ref.to_dense() if ref.is_sparse else ref
    return float((mine - ref).float().norm()) / max(float(ref.float().norm()), floor)


def grad_errors(ref: nn.Module, mine: nn.Module) -> Dict[str, float]:
    """Every parameter's gradient error against the reference model's, floored at 1e-6 of the
    whole reference gradient's norm."""
    total = sum(float(p.grad.float().norm()) ** 2 for p in ref.parameters() if p.grad is not None) ** 0.5
    return {name: rel_err(b.grad, a.grad, 1e-6 * total)
            for (name, a), b in zip(ref.named_parameters(), mine.parameters())}


def gather_per_rank(case_id: str, mine: dict) -> list:
    """`run_all`'s usual ``gather``: every rank's result of one case, by rank (torch.distributed's
    ``all_gather_object`` on the default group)."""
    import torch.distributed as dist

    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    return per_rank


def run_all(cases: Dict[str, dict], run: Callable[[dict], dict],
            gather: Callable[[str, dict], Any]) -> Dict[str, Any]:
    """Run every case (one that raises gives its traceback) and gather every rank's result with
    the engine's own collective, case by case, so that one failing case cannot hang the others."""
    results = {}
    for case_id, case in cases.items():
        try:
            mine = run(case)
        except Exception:
            mine = {"exception": traceback.format_exc()}
        results[case_id] = gather(case_id, mine)
    return results


def write_and_exit(out_path: str, results: Dict[str, Any]) -> NoReturn:
    """torch.distributed workers' last act: rank 0 writes ``results`` as JSON, every rank waits for
    it, leaves the default group and ends the process at once with status 0.

    Why at once: after FSDP2 (one DTensor is enough) or DeepSpeed ZeRO-2/3 ran, something in C++
    still holds the gloo process group past ``destroy_process_group`` (its worker threads still
    run: read from /proc/self/task; a plain all-reduce job's end with it). Interpreter finalisation then frees it while Python is torn down, and once
    in a while the process aborts with "terminate called without an active exception" after its
    work is done. ``os._exit`` skips finalisation; the results are on disk by then."""
    import json
    import logging
    import os
    import sys

    import torch.distributed as dist
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


SLOWED = ("dad.sharded.", "dad.partition.factors")  # the sharded engines' compressed routes' collectives


def slow_compressed_routes(aggregator, seconds: float = 0.15):
    """Make ``aggregator``'s (a real one: its collectives still run) compressed-route collectives
    sleep ``seconds`` first: what a step costs where they are slow, whatever the models predict.
    The size exchange, finiteness flags, link probes and route-trial agreement are left alone."""
    import time

    def slowed(call):
        def run(tensor, *args, name, **kwargs):
            if name.startswith(SLOWED) and not name.endswith(("finite", ".rows")):
                time.sleep(seconds)
            return call(tensor, *args, name=name, **kwargs)
        return run

    for method in ("all_gather", "all_reduce", "all_to_all", "all_to_all_v"):
        setattr(aggregator, method, slowed(getattr(aggregator, method)))
    return aggregator
