"""Train a small vision model with Accelerate on scikit-learn's digits, synchronising gradients with dAD.

    ACCELERATE_USE_CPU=1 accelerate launch --config_file examples/accelerate/cpu_2proc.yaml \\
        examples/accelerate/finetune_vision.py                   # a small CNN (default)
    ... examples/accelerate/finetune_vision.py --arch vit        # a tiny ViT (transformers, from a config)

The text quick-start (``finetune.py``) beyond text: the same three-way comparison, from the same
weights on the same batches, with Accelerate's DDP all-reduce, PyTorch's PowerSGD hook at dAD's
rank, and dAD switched on by one added line, ``enable_dad(accelerator, model, config)``; with
objective ``"time"`` once more routed by a stated slow link (``--slow-link``). It prints held-out
loss and accuracy and the bytes each run sent per step and rank, and writes ``metrics.json``.

Data: ``sklearn.datasets.load_digits`` (1,797 8 x 8 grey images of the digits 0-9, shipped with
scikit-learn: nothing is downloaded), scaled to [0, 1], upsampled to ``--image-size`` (16 by
default), split 80/20 into training and held-out images by a fixed permutation.

What each weight can send. A convolution's weight gradient is again ``D^T X`` (``D``: output
gradients, one row per image and output position; ``X``: the unfolded input patches), so its
exact factors cost ``images x positions x (out + in x kernel)`` numbers: many more rows than a
linear layer's, so a convolution usually takes dense or a rank route. Where no layer kind captures
it, a convolution is PowerSGD's *floor*: its dense gradient, viewed as ``(out, in x kernel)``,
takes dense or the rank-``r`` routes as PowerSGD's hook would. Either way auto with
``rank=r`` and objective ``"bytes"`` sends at most PowerSGD's bytes at rank ``r``, weight by weight.
ViT: patch embedding (a convolution), position embeddings and class token (raw parameters: the
floor), attention and MLP linear layers (factors, or rank routes from them).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dad_integrations.accelerate import enable_dad
from dad_integrations import CollectiveCounter
from dad_examples.powersgd_baseline import register_powersgd, warmup_steps

log = logging.getLogger("finetune_vision")

ARCHS = ("cnn", "vit")
CLASSES = 10


@dataclass
class RunResult:
    """One training run, as every rank agrees on it."""

    name: str
    losses: List[float] = field(default_factory=list)          # training loss per optimizer step
    sent_bytes: List[float] = field(default_factory=list)      # per optimizer step and rank
    allreduce_bytes: float = 0.0                               # a ring all-reduce of the gradients
    step_seconds: List[float] = field(default_factory=list)
    heldout_loss: float = float("nan")
    heldout_accuracy: float = float("nan")
    ranks_identical: Optional[bool] = None
    link: str = "-"                  # dAD under objective "time": the link it routed by
    routes: str = "-"                # dAD: weights sent compressed (factors or rank-r) / all, last step
    kinds: Dict[str, str] = field(default_factory=dict)       # dAD: route per weight, last step

    def summary(self) -> Dict[str, float]:
        timed = self.step_seconds[1:] or self.step_seconds  # the first step pays one-off costs
        sent = sum(self.sent_bytes) / max(len(self.sent_bytes), 1)
        # the median is the steady state: dAD's lossless steps (10 by default) and PowerSGD's as
        # many warm-up steps all-reduce uncompressed, dAD checks its factors on the first
        steady = sorted(self.sent_bytes)[len(self.sent_bytes) // 2] if self.sent_bytes else 0.0
        return {"heldout_loss": self.heldout_loss, "heldout_accuracy": self.heldout_accuracy,
                "sent_bytes_per_step": sent, "steady_sent_bytes_per_step": steady,
                "ratio_to_allreduce": sent / self.allreduce_bytes if self.allreduce_bytes else 0.0,
                "seconds_per_step": sorted(timed)[len(timed) // 2] if timed else 0.0}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=ARCHS, default="cnn",
                   help="cnn: three convolutions and two linear layers; vit: a 2-layer ViT from a config")
    p.add_argument("--image-size", type=int, default=16, help="digits upsampled from 8 x 8 to this size")
    p.add_argument("--dad-mode", choices=("exact", "rank", "auto"), default="auto")
    p.add_argument("--rank", type=int, default=4,
                   help="rank of rank-dAD and PowerSGD (modes rank and auto); 0: auto without rank routes")
    p.add_argument("--objective", choices=("time", "bytes"), default=os.environ.get("DAD_OBJECTIVE", "time"),
                   help="what dAD's auto minimises per weight (default: $DAD_OBJECTIVE, else time)")
    p.add_argument("--slow-link", default="100mbit",
                   help="with objective time, a second dAD run routes by this stated link; 'none' skips it")
    p.add_argument("--max-steps", type=int, default=100, help="optimizer steps per run")
    p.add_argument("--batch-size", type=int, default=32, help="images per process and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-powersgd", action="store_true", help="skip the PowerSGD run")
    p.add_argument("--cpu", action="store_true", help="train on CPU even where GPUs exist")
    p.add_argument("--output-dir", default="runs/accelerate_vision")
    args = p.parse_args()
    if args.max_steps < 1 or args.image_size < 8:
        p.error("--max-steps must be >= 1 and --image-size >= 8")
    return args


# -- data and models ----------------------------------------------------------------------------------
def digits(image_size: int, seed: int) -> Tuple[TensorDataset, TensorDataset]:
    """scikit-learn's digits as (1, size, size) float images in [0, 1]: 80 % training, 20 % held out."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    if image_size != 8:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    train, held = order[:cut], order[cut:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[held], y[held])


class SmallCNN(nn.Module):
    """conv 3x3 (16) - conv 3x3 stride 2 (32) - conv 3x3 stride 2 (32) - linear 64 - linear 10."""

    def __init__(self, image_size: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(32, 32, 3, stride=2, padding=1), nn.ReLU())
        side = -(-image_size // 4)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * side * side, 64), nn.ReLU(), nn.Linear(64, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class TinyViT(nn.Module):
    """Hugging Face's ``ViTForImageClassification`` from a tiny config (no downloads, no dropout):
    4 x 4 patches of the grey image, 2 layers of width 64; returns logits."""

    def __init__(self, image_size: int):
        super().__init__()
        from transformers import ViTConfig, ViTForImageClassification

        config = ViTConfig(image_size=image_size, patch_size=4, num_channels=1, hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=128, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0, num_labels=CLASSES)
        self.vit = ViTForImageClassification(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.vit(pixel_values=x).logits


def build_model(args: argparse.Namespace) -> nn.Module:
    return SmallCNN(args.image_size) if args.arch == "cnn" else TinyViT(args.image_size)


@torch.no_grad()
def evaluate(model: nn.Module, dataset: TensorDataset) -> Tuple[float, float]:
    """Held-out mean cross-entropy and accuracy (every rank holds the same weights: no exchange)."""
    model.eval()
    x, y = dataset.tensors
    device = next(model.parameters()).device
    logits = model(x.to(device))
    loss = F.cross_entropy(logits, y.to(device)).item()
    accuracy = (logits.argmax(-1).cpu() == y).float().mean().item()
    model.train()
    return loss, accuracy


# -- one run ------------------------------------------------------------------------------------------
def train(name: str, args: argparse.Namespace, accelerator: Accelerator, init_state: dict, train_set: TensorDataset,
          heldout: TensorDataset, dad_config: Optional[dict], powersgd_rank: Optional[int] = None) -> RunResult:
    """One run: Accelerate's usual loop; with ``dad_config`` one added line switches to dAD;
    with ``powersgd_rank`` DDP runs PyTorch's PowerSGD hook instead of its all-reduce."""
    set_seed(args.seed)  # the same shuffling in every run
    model = build_model(args)
    model.load_state_dict(init_state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    sync = enable_dad(accelerator, model, dad_config) if dad_config is not None else None  # <- dAD
    if powersgd_rank is not None:
        register_powersgd(model, powersgd_rank, args.seed, args.powersgd_warmup)
    # the hook's collectives go through torch.distributed's Python API, where a counter sees them
    # (DDP's own all-reduce does not: that run is accounted as a ring all-reduce of the gradients)
    counter = CollectiveCounter(torch.distributed) if powersgd_rank is not None else None

    world = accelerator.num_processes
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    result = RunResult(name, allreduce_bytes=2.0 * (world - 1) / world * grad_bytes)
    model.train()
    batches = _endless(loader)
    start = time.perf_counter()
    while len(result.losses) < args.max_steps:
        images, labels = next(batches)
        if counter is not None:
            counter.reset()
        with counter if counter is not None else contextlib.nullcontext():
            loss = F.cross_entropy(model(images), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        result.step_seconds.append(time.perf_counter() - start)
        result.losses.append(float(accelerator.reduce(loss.detach(), reduction="mean")))
        if sync is not None:
            report = sync.last_step_report()
            result.sent_bytes.append(float(report.totals["sent_bytes"]))
            weights = [q for q in report.params if len(q.shape) >= 2]
            result.routes = f"{sum(q.representation != 'dense' for q in weights)}/{len(weights)}"
            result.kinds = {q.name: q.representation for q in weights}
        elif counter is not None:
            result.sent_bytes.append(float(counter.traffic().sent))
        else:
            result.sent_bytes.append(result.allreduce_bytes if world > 1 else 0.0)
        start = time.perf_counter()
    result.heldout_loss, result.heldout_accuracy = evaluate(accelerator.unwrap_model(model), heldout)
    result.ranks_identical = _ranks_identical(accelerator, model)
    if sync is not None and getattr(sync, "timing", None) is not None:
        link = (dad_config or {}).get("link")
        result.link = f"{link['bandwidth']} (stated)" if link else "measured"
    accelerator.free_memory()
    return result


def _endless(loader):
    while True:
        yield from loader


def _ranks_identical(accelerator: Accelerator, model: nn.Module) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in accelerator.unwrap_model(model).parameters()])
    gathered = accelerator.gather(flat.unsqueeze(0))
    return bool(all(torch.equal(gathered[0], g) for g in gathered[1:]))


def report(args: argparse.Namespace, runs: List[RunResult], world: int) -> None:
    """The summary table (held-out loss and accuracy, bytes per step and rank) and metrics.json."""
    os.makedirs(args.output_dir, exist_ok=True)
    header = (f"{'run':<16}| held-out loss | held-out acc | bytes sent/step/rank | steady bytes/step | "
              f"vs all-reduce | s/step | compressed | routed by link   | ranks identical")
    lines = [header, "-" * len(header)]
    for r in runs:
        s = r.summary()
        lines.append(f"{r.name:<16}| {s['heldout_loss']:13.4f} | {s['heldout_accuracy']:12.3f} | "
                     f"{s['sent_bytes_per_step']:20,.0f} | {s['steady_sent_bytes_per_step']:17,.0f} | "
                     f"{s['ratio_to_allreduce']:13.3f} | {s['seconds_per_step']:6.3f} | {r.routes:>10} | "
                     f"{r.link:<16} | {'yes' if r.ranks_identical else 'NO'}")
    print("\n".join(lines), flush=True)
    metrics = {"args": vars(args), "world_size": world,
               "runs": {r.name: {**asdict(r), **r.summary()} for r in runs}}
    with open(os.path.join(args.output_dir, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    log.info("wrote %s", os.path.join(args.output_dir, "metrics.json"))


def main() -> None:
    args = parse_args()
    # one DDP bucket: PowerSGD's hook chains collectives in future callbacks, which on gloo with
    # several buckets can hang (as in finetune.py)
    accelerator = Accelerator(cpu=args.cpu or not torch.cuda.is_available(),
                              kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=256)])
    logging.basicConfig(level=logging.INFO if accelerator.is_main_process else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)
    init_state = build_model(args).state_dict()
    train_set, heldout = digits(args.image_size, args.seed)
    rank = None if args.dad_mode == "exact" or not args.rank else args.rank
    dad_config = {"mode": args.dad_mode, "rank": rank, "objective": args.objective}
    args.powersgd_warmup = warmup_steps(dad_config)  # PowerSGD warms up as long as dAD
    runs = [train("allreduce", args, accelerator, init_state, train_set, heldout, None)]
    if not args.no_powersgd and args.rank and accelerator.num_processes > 1:
        runs.append(train("powersgd", args, accelerator, init_state, train_set, heldout, None, powersgd_rank=args.rank))
    runs.append(train(f"dad-{args.dad_mode}", args, accelerator, init_state, train_set, heldout, dad_config))
    if (args.objective == "time" and args.dad_mode != "exact" and args.slow_link != "none"
            and accelerator.num_processes > 1):
        slow = {**dad_config, "link": {"bandwidth": args.slow_link}}
        runs.append(train(f"dad-{args.dad_mode}@{args.slow_link}", args, accelerator, init_state, train_set,
                          heldout, slow))
    if accelerator.is_main_process:
        report(args, runs, accelerator.num_processes)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
