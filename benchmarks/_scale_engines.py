"""The engines of `benchmarks.scale`: one method is one model under one engine, with or without dAD.

Every method builds the same weights (``spec["seed"]``), trains with plain SGD (no optimizer state:
two methods of the 307 M model fit on two ranks beside other jobs) and times one step as forward,
backward, synchronisation and the optimizer step. Per engine the *plain* method is the engine's own
gradient reduction, the reference its dAD methods are compared with:

  engine  plain       dAD
  ddp     allreduce   dad-auto, dad-auto-100mbit (`register_dad_comm_hook`); also powersgd, PyTorch's
                      PowerSGD hook, the byte reference
  fsdp2   fsdp2       fsdp2-dad-auto, fsdp2-dad-auto-100mbit (`enable_dad_fsdp`); every decoder block
                      and the root ``fully_shard``-ed
  zero3   zero3       zero3-dad-auto, zero3-dad-auto-100mbit: DeepSpeed ZeRO-3 on the CPU accelerator,
                      the config's ``"dad"`` block (split off by `deepspeed_dad.split_config` and
                      attached by `deepspeed_dad.attach`, what ``deepspeed_dad.initialize`` does, so
                      that the attach is timed apart from DeepSpeed's own initialisation)

``dad-auto``: the config at its defaults (``mode="auto"``: the link measured at attach, routes by
time). ``-100mbit``: auto, rank ``spec["rank"]``, a stated link of 100 Mbit/s (rank routes: the byte
guarantee's and the residual memory's case).

Bytes per step (``sent``), of the gradients' synchronisation, per rank: dAD's own count
(`last_step_report`) for dAD; for DDP's hooks the collectives counted at ``torch.distributed`` (ring
model, as `benchmarks.compare` counts them); for FSDP2's and ZeRO-3's own reduce-scatter its ring
model, ``(S - 1)`` padded shards of every gradient (`reduce_scatter_bytes`: the figure dAD's sharded
reports give as the engine's), as neither engine's collectives can be counted at
``torch.distributed`` (FSDP2 calls ``all_gather_single`` / ``reduce_scatter_single``, DeepSpeed
keeps its own references). The parameter all-gathers of FSDP2 and ZeRO-3 are alike with and without
dAD and are not counted.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from benchmarks.workload import lm_step
from dad_integrations.comm.counter import CollectiveCounter

STATED_LINK = {"bandwidth": "100mbit", "latency_us": 100}
DDP_DEFAULT_BUCKET_MB = 25  # DDP's own default: all-reduce and dad-auto meet DDP as users do
ZERO_BUCKET = 10 ** 7  # elements (40 MB fp32): DeepSpeed's default 5e8 would allocate 2 GB buffers per rank
ENGINES = ("ddp", "fsdp2", "zero3")
# method: (engine, dAD config kind: None, "auto" or "auto-100mbit")
METHODS: Dict[str, Tuple[str, Optional[str]]] = {
    "allreduce": ("ddp", None), "dad-auto": ("ddp", "auto"), "powersgd": ("ddp", None),
    "dad-auto-100mbit": ("ddp", "auto-100mbit"),
    "fsdp2": ("fsdp2", None), "fsdp2-dad-auto": ("fsdp2", "auto"), "fsdp2-dad-auto-100mbit": ("fsdp2", "auto-100mbit"),
    "zero3": ("zero3", None), "zero3-dad-auto": ("zero3", "auto"), "zero3-dad-auto-100mbit": ("zero3", "auto-100mbit"),
}
PLAIN = {"ddp": "allreduce", "fsdp2": "fsdp2", "zero3": "zero3"}  # each engine's own reduction


def engine_of(method: str) -> str:
    return METHODS[method][0]


def dad_config(kind: Optional[str], rank: int) -> Optional[dict]:
    """The dAD config of a method's ``kind`` (None: no dAD)."""
    if kind is None:
        return None
    if kind == "auto":
        return {"mode": "auto"}
    if kind == "auto-100mbit":
        return {"mode": "auto", "rank": rank, "link": dict(STATED_LINK)}
    raise ValueError(f"unknown dAD config kind {kind!r}")


def preload(methods) -> None:
    """Import what ``methods``' engines and models need, up front (then `gc.freeze` can set the
    imported objects aside: a collection between methods scans only what the methods made)."""
    import importlib

    engines = {engine_of(m) for m in methods}
    modules = ["transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
               "dad_integrations"]
    modules += ["dad_integrations.fsdp"] if "fsdp2" in engines else []
    modules += ["deepspeed", "deepspeed_dad"] if "zero3" in engines else []
    for name in modules:
        importlib.import_module(name)


def build_model(spec: dict) -> torch.nn.Module:
    """The model of ``spec["model"]`` from its config (``kind`` gpt2 or llama), dropout off,
    weights from ``spec["seed"]`` (every method and rank builds the same weights)."""
    m = spec["model"]
    torch.manual_seed(spec["seed"])
    if m["kind"] == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(**m["config"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(cfg)
    elif m["kind"] == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**m["config"]))
    else:
        raise ValueError(f"unknown model kind {m['kind']!r}: gpt2 or llama")
    model.loss_type = "ForCausalLM"
    model.train()
    return model


def blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder blocks FSDP2 shards one by one (GPT-2's ``transformer.h``, Llama's ``model.layers``)."""
    inner = getattr(model, "transformer", None) or model.model
    return inner.h if hasattr(inner, "h") else inner.layers


def powersgd_bytes(shape: tuple, allreduce_bytes: float, rank: int) -> float:
    """What PyTorch's PowerSGD hook sends for one weight, in the ring model that prices its
    all-reduce at ``allreduce_bytes``: vectors all-reduced whole; a matrix (viewed as
    ``shape[0] x rest``) as P and Q, ``(n + m) r`` values, where that is under half of ``n m``
    (the hook's ``_should_compress`` with its default ``min_compression_rate`` 2), else whole."""
    if len(shape) <= 1:
        return allreduce_bytes
    n = shape[0]
    m = 1
    for d in shape[1:]:
        m *= d
    compressed = (n + m) * rank
    return allreduce_bytes * compressed / (n * m) if compressed * 2 < n * m else allreduce_bytes


def reduce_scatter_bytes(model: torch.nn.Module, engine: str, world: int) -> float:
    """What one rank sends in the ring model of ``engine``'s reduce-scatter of every gradient: ``S - 1``
    of its padded shards (FSDP2: ``ceil(dim 0 / S)`` rows; ZeRO-3: DeepSpeed's partition, ``ds_tensor``)."""
    total = 0.0
    for p in model.parameters():
        if engine == "zero3":
            shard = p.ds_tensor.numel()
        else:
            shape = tuple(p.shape)
            rest = p.numel() // shape[0] if shape and shape[0] else 0
            shard = -(-shape[0] // world) * rest if shape else 1
        total += (world - 1) * shard * p.element_size()
    return total


class Method:
    """One method's model under its engine, dAD where it has it, and its batches; `step()` trains and
    times one step. ``wrap_s``: the engine's own wrapping; ``attach_s``: the registration of the
    method's synchronisation (dAD's attach, its link probe and compute model included; DDP's hooks)."""

    def __init__(self, name: str, spec: dict, data: bytes, counter: CollectiveCounter):
        from dad_examples.text_data import byte_lm_batches

        self.name, self.counter, self.rank_r = name, counter, spec["rank"]
        self.engine, kind = METHODS[name]
        self.sync = None
        model = build_model(spec)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.bucket_mb: Optional[float] = None
        self.losses: List[float] = []
        dad = dad_config(kind, spec["rank"])
        build = {"ddp": self._ddp, "fsdp2": self._fsdp2, "zero3": self._zero3}[self.engine]
        self._train: Callable[[torch.Tensor], None] = build(model, dad, spec)
        world = dist.get_world_size()
        self.batches = byte_lm_batches(data, spec["batch"], spec["seq"], rank=dist.get_rank(), world_size=world,
                                       seed=spec["seed"])
        self.times: List[float] = []
        self.sent: List[float] = []
        self.routes: List[Dict[str, int]] = []
        self.report = None

    # -- the engines ----------------------------------------------------------------------------

    def _ddp(self, model: torch.nn.Module, dad: Optional[dict], spec: dict) -> Callable[[torch.Tensor], None]:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel

        from dad_integrations import DADConfig, register_dad_comm_hook

        # one bucket for PowerSGD's hook (several hang on gloo: the guide's PowerSGD/gloo fact) and
        # for the dAD run compared with it byte for byte; DDP's default buckets for the others
        one = self.name in ("powersgd", "dad-auto-100mbit")
        self.bucket_mb = self.n_params * 4 / 2 ** 20 + 1 if one else DDP_DEFAULT_BUCKET_MB
        group = dist.new_group(list(range(dist.get_world_size())))  # its own, on every rank in the same order
        start = time.perf_counter()
        ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=self.bucket_mb)
        self.wrap_s = time.perf_counter() - start
        start = time.perf_counter()
        if self.name == "allreduce":
            ddp.register_comm_hook(group, default_hooks.allreduce_hook)
        elif self.name == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=group, matrix_approximation_rank=spec["rank"],
                start_powerSGD_iter=spec["powersgd_warmup"], use_error_feedback=True, warm_start=True,
                random_seed=spec["seed"])
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        else:
            self.sync = register_dad_comm_hook(ddp, DADConfig.from_dict(dad))
        self.attach_s = time.perf_counter() - start
        self.model, self.wrapped = model, ddp
        self.opt = torch.optim.SGD(model.parameters(), lr=spec["lr"])
        return lm_step(ddp, self.opt, losses=self.losses)  # DDP's hook synchronises in backward

    def _fsdp2(self, model: torch.nn.Module, dad: Optional[dict], spec: dict) -> Callable[[torch.Tensor], None]:
        from torch.distributed.fsdp import fully_shard

        from dad_integrations.fsdp import enable_dad_fsdp

        start = time.perf_counter()
        for block in blocks(model):
            fully_shard(block)
        fully_shard(model)
        self.wrap_s = time.perf_counter() - start
        start = time.perf_counter()
        self.sync = enable_dad_fsdp(model, dad) if dad else None
        self.attach_s = time.perf_counter() - start if dad else 0.0
        self.model = self.wrapped = model
        self.opt = torch.optim.SGD(model.parameters(), lr=spec["lr"])
        return lm_step(model, self.opt, losses=self.losses)  # FSDP2 (and dAD in it) reduce in backward

    def _zero3(self, model: torch.nn.Module, dad: Optional[dict], spec: dict) -> Callable[[torch.Tensor], None]:
        import deepspeed
        import deepspeed_dad

        micro = spec["batch"]
        config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
                  "train_batch_size": micro * dist.get_world_size(), "zero_allow_untested_optimizer": True,
                  "steps_per_print": 10 ** 9,
                  "zero_optimization": {"stage": 3, "overlap_comm": False, "contiguous_gradients": True,
                                        "reduce_bucket_size": ZERO_BUCKET, "allgather_bucket_size": ZERO_BUCKET,
                                        "stage3_prefetch_bucket_size": ZERO_BUCKET}}
        if dad:
            config["dad"] = dad
        config, block = deepspeed_dad.split_config(config)
        opt = torch.optim.SGD(model.parameters(), lr=spec["lr"])
        start = time.perf_counter()
        engine, self.opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        self.wrap_s = time.perf_counter() - start
        start = time.perf_counter()
        self.sync = deepspeed_dad.attach(engine, block) if block is not None else None
        self.attach_s = time.perf_counter() - start if block is not None else 0.0
        self.model, self.wrapped = engine.module, engine

        def step(x: torch.Tensor) -> None:
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            self.losses.append(float(loss.detach()))

        return step

    # -- steps and results ------------------------------------------------------------------------

    def step(self) -> None:
        x = next(self.batches)
        self.counter.reset()
        with self.counter:
            start = time.perf_counter()
            self._train(x)
            self.times.append(time.perf_counter() - start)
        if self.sync is not None:
            self.report = self.sync.last_step_report()
            self.sent.append(self.report.totals["sent_bytes"])
            self.routes.append(dict(Counter(p.representation for p in self.report.params
                                            if p.representation != "overhead")))
        elif self.engine == "ddp":
            self.sent.append(self.counter.traffic().sent)
        else:
            self.sent.append(reduce_scatter_bytes(self.model, self.engine, dist.get_world_size()))

    def summary(self) -> dict:
        out = {"engine": self.engine, "attach_s": self.attach_s, "ddp_wrap_s": self.wrap_s, "wrap_s": self.wrap_s,
               "bucket_mb": self.bucket_mb, "n_params": self.n_params, "times": self.times, "sent_by_step": self.sent,
               "losses": self.losses}
        if self.sync is not None:
            out["routes_by_step"] = self.routes
            out["decision"] = self.report.decision if self.report is not None else ""
            out["links"] = dict(self.report.links) if self.report is not None else {}
            out["trials"] = [{"step": t.step, "pairs": t.pairs} for t in self.sync.route_trials]
            if self.report is not None:
                out["weights"] = [{"name": p.name, "shape": list(p.shape), "representation": p.representation,
                                   "sent": p.sent_bytes, "allreduce": p.allreduce_bytes,
                                   "reduce_scatter": getattr(p, "reduce_scatter_bytes", None),
                                   "powersgd": powersgd_bytes(tuple(p.shape), p.allreduce_bytes, self.rank_r)}
                                  for p in self.report.params if p.representation != "overhead"]
        return out

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
        if self.engine == "zero3":
            self.wrapped.destroy()
        self.sync = self.wrapped = self.model = self.opt = self.report = self._train = None
