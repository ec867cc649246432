"""Fine-tune a Hugging Face model with Accelerate, synchronising gradients with dAD.

    accelerate launch --config_file examples/accelerate/cpu_2proc.yaml examples/accelerate/finetune.py
    accelerate launch --config_file examples/accelerate/fsdp2.yaml examples/accelerate/finetune.py
                                          # GPU nodes, FSDP2: dAD inside its reduce-scatter

The script trains three times from the same weights on the same batches: with Accelerate's
ordinary DDP all-reduce, with PyTorch's PowerSGD DDP hook at the same rank as dAD (the lossy
baseline a user would otherwise pick), and with dAD (``--dad-mode``) installed by one added line,
``enable_dad(accelerator, model, config)``. It prints a summary table, writes ``metrics.json``
and a plot of loss and bytes per step (``loss_bytes.png``) to ``--output-dir``. Bytes of the
PowerSGD run are counted where they reach ``torch.distributed``, dAD's come from its own report,
and all-reduce's are a ring all-reduce's of the gradients.

Under FSDP2 (``examples/accelerate/fsdp2.yaml``) the same one line puts dAD inside FSDP2's
gradient reduce-scatter; the baseline run (``fsdp2``) is FSDP2's own reduce-scatter, ``(S-1)/S`` of
the gradients per rank, and there is no PowerSGD run (a DDP hook). ``--rank 0`` makes auto lossless
(factors only for the weights where they move fewer bytes); ``--dad-mode exact`` sends factors for
every weight (more bytes than the reduce-scatter unless the tokens per rank are few against the
layer widths).

Tasks: causal language modelling (``--family gpt2`` or ``llama``) and sequence classification
(``--family bert``). By default a small model is built from a config and trained on text that
ships with Python (the standard library's source: byte tokens; for classification, which package
a window of source comes from), so nothing is downloaded. ``--model_name_or_path`` loads a hub
model and its tokenizer instead, where the network allows.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm

from dad_integrations.accelerate import enable_dad
from dad_integrations import CollectiveCounter

# Under DeepSpeed (examples/accelerate/deepspeed.yaml) nothing here switches dAD on: DeepSpeed builds
# its engine inside accelerator.prepare(), and the installed package's import hook attaches dAD
# to it because ds_config.json holds an enabled "dad" block (README, DeepSpeed section).
from dad_examples.powersgd_baseline import register_powersgd, warmup_steps
from dad_examples.text_data import VOCAB_SIZE, stdlib_package_snippets, stdlib_source_bytes

log = logging.getLogger("finetune")

FAMILIES = ("gpt2", "llama", "bert")
CLASSIFICATION_PACKAGES = ("json", "email", "asyncio", "xml")


@dataclass
class RunResult:
    """One training run, as every rank agrees on it."""

    name: str
    losses: List[float] = field(default_factory=list)
    sent_bytes: List[float] = field(default_factory=list)       # per optimizer step and rank
    allreduce_bytes: float = 0.0     # a ring all-reduce of the gradients (FSDP2: its reduce-scatter)
    step_seconds: List[float] = field(default_factory=list)
    ranks_identical: Optional[bool] = None
    link: str = "-"                  # dAD under objective "time": the link it routed by
    routes: str = "-"                # dAD: weights sent compressed (factors or rank-r) / all, last step

    def summary(self, window: int = 5) -> Dict[str, float]:
        tail = self.losses[-window:]
        timed = self.step_seconds[1:] or self.step_seconds  # the first step pays one-off costs
        sent = sum(self.sent_bytes) / max(len(self.sent_bytes), 1)
        # the median is the steady state: dAD's lossless steps (10 by default) and PowerSGD's as
        # many warm-up steps all-reduce uncompressed, dAD checks its factors on the first
        steady = sorted(self.sent_bytes)[len(self.sent_bytes) // 2] if self.sent_bytes else 0.0
        return {"final_loss": sum(tail) / len(tail), "sent_bytes_per_step": sent,
                "steady_sent_bytes_per_step": steady,
                "ratio_to_allreduce": sent / self.allreduce_bytes if self.allreduce_bytes else 0.0,
                "seconds_per_step": sorted(timed)[len(timed) // 2]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=FAMILIES, default="gpt2",
                   help="model family (gpt2, llama: causal LM; bert: sequence classification)")
    p.add_argument("--model_name_or_path", default=None,
                   help="load this hub model and tokenizer instead of building a small one (needs network)")
    p.add_argument("--dad-mode", choices=("exact", "rank", "auto"), default="auto")
    p.add_argument("--rank", type=int, default=4,
                   help="rank of rank-dAD (modes rank and auto); 0: auto without rank routes (lossless)")
    p.add_argument("--no-error-feedback", action="store_true",
                   help="turn off error feedback (on by default: rank routes keep what they left out "
                        "of each weight for the next step; memory: one gradient per rank-routed weight)")
    p.add_argument("--lossless-steps", type=int, default=None,
                   help="dAD's first N steps take no rank route (default: the config's, 10); PowerSGD's "
                        "hook all-reduces as many first steps (at least 2)")
    p.add_argument("--objective", choices=("time", "bytes"), default="time",
                   help="what dAD's auto minimises per weight: predicted step time (on the link measured "
                        "on this job's group) or bytes")
    p.add_argument("--slow-link", default="100mbit",
                   help="with objective time, a second dAD run routes by this stated link (what auto "
                        "does on a slow network; the data still crosses this machine's loopback); "
                        "'none' skips it")
    p.add_argument("--max-steps", type=int, default=60, help="optimizer steps per run")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per process and micro-step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-baseline", action="store_true", help="skip the all-reduce and PowerSGD runs")
    p.add_argument("--no-powersgd", action="store_true", help="skip the PowerSGD run")
    p.add_argument("--cpu", action="store_true", help="train on CPU even where GPUs exist")
    p.add_argument("--output-dir", default="runs/accelerate")
    args = p.parse_args()
    if args.max_steps < 1 or args.grad_accum < 1:
        p.error("--max-steps and --grad-accum must be >= 1")
    return args


def build_model(args: argparse.Namespace):
    """A hub model, or a small one from a config (no dropout, so runs compare step for step)."""
    import transformers as tf

    if args.model_name_or_path:
        auto = tf.AutoModelForSequenceClassification if args.family == "bert" else tf.AutoModelForCausalLM
        kwargs = {"num_labels": len(CLASSIFICATION_PACKAGES)} if args.family == "bert" else {}
        return auto.from_pretrained(args.model_name_or_path, **kwargs)
    common = dict(vocab_size=VOCAB_SIZE)
    if args.family == "gpt2":
        config = tf.GPT2Config(n_positions=args.seq_len, n_embd=128, n_layer=2, n_head=4, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None, **common)
        model = tf.GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"  # the loss it would pick anyway, minus a warning
        return model
    if args.family == "llama":
        config = tf.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=args.seq_len, bos_token_id=None, eos_token_id=None,
                                pad_token_id=None, **common)
        model = tf.LlamaForCausalLM(config)
        model.loss_type = "ForCausalLM"
        return model
    config = tf.BertConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                           max_position_embeddings=args.seq_len, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0, num_labels=len(CLASSIFICATION_PACKAGES),
                           pad_token_id=0, **common)
    return tf.BertForSequenceClassification(config)


def build_dataset(args: argparse.Namespace) -> TensorDataset:
    """Token windows of the standard library's source (and package labels for classification)."""
    n = args.max_steps * args.grad_accum * args.batch_size * 8  # enough for 8 processes
    if args.family == "bert":
        per_class = -(-n // len(CLASSIFICATION_PACKAGES))
        tokens, labels = stdlib_package_snippets(CLASSIFICATION_PACKAGES, args.seq_len, per_class, seed=args.seed)
        if args.model_name_or_path:
            tokens = _retokenize(args, [bytes(t.tolist()) for t in tokens])
        return TensorDataset(tokens, labels)
    data = stdlib_source_bytes(max_bytes=max(n * args.seq_len, 200_000), seed=args.seed)
    if args.model_name_or_path:
        tokens = _retokenize(args, [data[i:i + 4 * args.seq_len] for i in range(0, len(data), 4 * args.seq_len)])
    else:
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        tokens = tokens[: len(tokens) // args.seq_len * args.seq_len].view(-1, args.seq_len)
    return TensorDataset(tokens, tokens)


def _retokenize(args: argparse.Namespace, texts: List[bytes]) -> torch.Tensor:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok([t.decode("utf-8", "replace") for t in texts], truncation=True, padding="max_length",
              max_length=args.seq_len, return_tensors="pt")
    return enc["input_ids"]


def train(name: str, args: argparse.Namespace, accelerator: Accelerator, init_state: dict,
          dataset: TensorDataset, dad_config: Optional[dict], powersgd_rank: Optional[int] = None) -> RunResult:
    """One run: Accelerate's usual loop; with ``dad_config`` one added line switches to dAD;
    with ``powersgd_rank`` DDP runs PyTorch's PowerSGD hook instead of its all-reduce."""
    set_seed(args.seed)  # the same shuffling in both runs
    model = build_model(args)
    model.load_state_dict(init_state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if _deepspeed(accelerator):  # the config's "dad" block rules; the baseline takes dAD off again
        import deepspeed_dad
        attachment = deepspeed_dad.get_attachment(model)
        if dad_config is None and attachment is not None:
            attachment.detach()
        sync = attachment.synchronizer if dad_config is not None and attachment is not None else None
        if dad_config is not None:
            if sync is None:
                raise SystemExit("no dAD on the DeepSpeed engine: under DeepSpeed an enabled \"dad\" block in "
                                 "the DeepSpeed config, not --dad-mode/--rank, switches dAD on (through the "
                                 "import hook of the installed package: pip install -e .)")
            name = f"dad-{sync.config.mode}"  # the block's mode, which rules here
    else:
        sync = enable_dad(accelerator, model, dad_config) if dad_config is not None else None  # <- dAD
    if powersgd_rank is not None:
        register_powersgd(model, powersgd_rank, args.seed, args.powersgd_warmup)
    # the hook's collectives go through torch.distributed's Python API, where a counter sees them
    # (DDP's own all-reduce does not: that run is accounted as a ring all-reduce of the gradients)
    counter = CollectiveCounter(torch.distributed) if powersgd_rank is not None else None

    world = accelerator.num_processes
    itemsize = _fsdp2_reduce_itemsize(accelerator)
    grad_bytes = sum(p.numel() * (itemsize or p.element_size()) for p in model.parameters() if p.requires_grad)
    # the dense exchange: a ring all-reduce, or under FSDP2 its reduce-scatter (half of it)
    dense_factor = 1.0 if _fsdp2(accelerator) else 2.0
    result = RunResult(name, allreduce_bytes=dense_factor * (world - 1) / world * grad_bytes)
    model.train()
    bar = tqdm(total=args.max_steps, desc=f"{name:>9}", disable=not accelerator.is_local_main_process)
    batches = _endless(loader)
    start = time.perf_counter()
    micro_losses: List[torch.Tensor] = []
    while len(result.losses) < args.max_steps:
        input_ids, labels = next(batches)
        if counter is not None and not micro_losses:
            counter.reset()  # a new optimizer step
        with accelerator.accumulate(model), (counter if counter is not None else contextlib.nullcontext()):
            loss = model(input_ids=input_ids, labels=labels).loss
            accelerator.backward(loss)
            micro_losses.append(loss.detach())
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if not accelerator.sync_gradients:
            continue
        result.step_seconds.append(time.perf_counter() - start)
        step_loss = accelerator.reduce(torch.stack(micro_losses).mean(), reduction="mean")
        micro_losses = []
        result.losses.append(float(step_loss))
        if sync is not None:
            step_report = sync.last_step_report()
            result.sent_bytes.append(float(step_report.totals["sent_bytes"]))
            weights = [q for q in step_report.params if len(q.shape) == 2]
            result.routes = f"{sum(q.representation != 'dense' for q in weights)}/{len(weights)}"
        elif counter is not None:
            result.sent_bytes.append(float(counter.traffic().sent))
        else:
            result.sent_bytes.append(result.allreduce_bytes if world > 1 else 0.0)
        bar.update(1)
        bar.set_postfix(loss=f"{result.losses[-1]:.3f}")
        start = time.perf_counter()
    bar.close()
    result.ranks_identical = _ranks_identical(accelerator, model)
    if sync is not None and getattr(sync, "timing", None) is not None:
        link = (dad_config or {}).get("link")
        result.link = f"{link['bandwidth']} (stated)" if link else "measured"
    accelerator.free_memory()
    return result


def _deepspeed(accelerator: Accelerator) -> bool:
    return getattr(accelerator.distributed_type, "value", "") == "DEEPSPEED"


def _fsdp2(accelerator: Accelerator) -> bool:
    return bool(getattr(accelerator, "is_fsdp2", False))


def _fsdp2_reduce_itemsize(accelerator: Accelerator) -> Optional[int]:
    """Bytes per gradient element FSDP2 reduce-scatters under its mixed precision policy (None:
    the parameters' own)."""
    policy = accelerator.state.fsdp_plugin.mixed_precision_policy if _fsdp2(accelerator) else None
    dtype = (getattr(policy, "reduce_dtype", None) or getattr(policy, "param_dtype", None)) if policy else None
    return torch.empty(0, dtype=dtype).element_size() if dtype is not None else None


def _endless(loader):
    while True:
        yield from loader


def _ranks_identical(accelerator: Accelerator, model) -> bool:
    # FSDP2's parameters are shards (DTensors): compare the whole ones
    flat = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                      for p in accelerator.unwrap_model(model).parameters()])
    gathered = accelerator.gather(flat.unsqueeze(0))
    return bool(all(torch.equal(gathered[0], g) for g in gathered[1:]))


def report(args: argparse.Namespace, runs: List[RunResult], world: int, dense: str = "all-reduce") -> None:
    """Summary table, metrics.json and loss/bytes plot (rank 0); ``dense``: the baseline's name."""
    os.makedirs(args.output_dir, exist_ok=True)
    rows = [(r.name, r.summary(), r.ranks_identical) for r in runs]
    header = (f"{'run':<16}| final loss | bytes sent/step/rank | steady bytes/step | {'vs ' + dense:>13} | s/step "
              f"| compressed | routed by link   | ranks identical")
    lines = [header, "-" * len(header)]
    for (name, s, same), r in zip(rows, runs):
        lines.append(f"{name:<16}| {s['final_loss']:10.4f} | {s['sent_bytes_per_step']:20,.0f} | "
                     f"{s['steady_sent_bytes_per_step']:17,.0f} | {s['ratio_to_allreduce']:13.3f} | "
                     f"{s['seconds_per_step']:6.3f} | {r.routes:>10} | {r.link:<16} | {'yes' if same else 'NO'}")
    print("\n".join(lines), flush=True)
    metrics = {"args": vars(args), "world_size": world,
               "runs": {r.name: {**asdict(r), **r.summary()} for r in runs}}
    with open(os.path.join(args.output_dir, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    _plot(runs, os.path.join(args.output_dir, "loss_bytes.png"))
    log.info("wrote %s and %s", os.path.join(args.output_dir, "metrics.json"),
             os.path.join(args.output_dir, "loss_bytes.png"))


def _plot(runs: List[RunResult], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_bytes) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        steps = range(1, len(r.losses) + 1)
        ax_loss.plot(steps, r.losses, label=r.name)
        ax_bytes.plot(steps, r.sent_bytes, label=r.name)
    ax_loss.set(xlabel="optimizer step", ylabel="training loss", title="Loss")
    ax_bytes.set(xlabel="optimizer step", ylabel="bytes sent per step and rank", title="Communication",
                 yscale="log")
    for ax in (ax_loss, ax_bytes):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    # DeepSpeed brings its own accelerator (DS_ACCELERATOR=cpu on a CPU machine)
    on_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    handlers = []
    if on_deepspeed and not torch.cuda.is_available():
        # without a GPU Accelerate finds no backend for DeepSpeed and counts one process; name it
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    # one DDP bucket (an explicit cap: DDP's default first bucket is 1 MB): PowerSGD's hook chains
    # collectives in future callbacks, which on gloo with several buckets can hang
    handlers.append(DistributedDataParallelKwargs(bucket_cap_mb=256))
    accelerator = Accelerator(cpu=args.cpu or not (torch.cuda.is_available() or on_deepspeed),
                              gradient_accumulation_steps=args.grad_accum, kwargs_handlers=handlers)
    logging.basicConfig(level=logging.INFO if accelerator.is_main_process else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)
    init_state = build_model(args).state_dict()
    dataset = build_dataset(args)
    dad_config = {"mode": args.dad_mode, "rank": None if args.dad_mode == "exact" or not args.rank else args.rank,
                  "objective": args.objective}
    if args.no_error_feedback:
        dad_config["error_feedback"] = False
    if args.lossless_steps is not None:
        dad_config["lossless_steps"] = args.lossless_steps
    args.powersgd_warmup = warmup_steps(dad_config)  # PowerSGD warms up as long as dAD
    runs = []
    fsdp2 = _fsdp2(accelerator)  # the baseline is FSDP2's reduce-scatter; PowerSGD is a DDP hook
    if not args.no_baseline:
        runs.append(train("fsdp2" if fsdp2 else "allreduce", args, accelerator, init_state, dataset, None))
        if (not args.no_powersgd and args.dad_mode != "exact" and accelerator.num_processes > 1
                and not on_deepspeed and not fsdp2):
            runs.append(train("powersgd", args, accelerator, init_state, dataset, None, powersgd_rank=args.rank))
    runs.append(train(f"dad-{args.dad_mode}", args, accelerator, init_state, dataset, dad_config))
    if (args.objective == "time" and args.dad_mode != "exact" and args.slow_link != "none" and not on_deepspeed
            and accelerator.num_processes > 1):
        slow = {**dad_config, "link": {"bandwidth": args.slow_link}}
        runs.append(train(f"dad-{args.dad_mode}@{args.slow_link}", args, accelerator, init_state, dataset, slow))
    if accelerator.is_main_process:
        report(args, runs, accelerator.num_processes, "reduce-scatter" if fsdp2 else "all-reduce")
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
