"""The benchmark's workload and measuring tools: a small byte-level GPT-2 on stdlib source,
a communication-free aggregator, and peak-memory readings. (Bytes of collectives that do not
report their own are counted by `dad_integrations.comm.counter.CollectiveCounter`.)"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from dad_integrations.comm.aggregator import CommHandle, FactorAggregator


@dataclass
class Workload:
    n_embd: int = 256
    n_layer: int = 2
    n_head: int = 4
    seq: int = 64
    batch: int = 4          # sequences per rank and step
    lr: float = 1e-3
    seed: int = 0


def build_model(w: Workload):
    """A byte-level GPT-2 (vocabulary 256, tied embeddings), no dropout, from a config."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from dad_examples.text_data import VOCAB_SIZE

    config = GPT2Config(vocab_size=VOCAB_SIZE, n_positions=w.seq, n_embd=w.n_embd, n_layer=w.n_layer,
                        n_head=w.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return model


class NullAggregator(FactorAggregator):
    """A `FactorAggregator` that communicates nothing but behaves as ``world_size`` identical ranks.

    Running dAD over it performs every computation of a real step (capture, rank reduction,
    packing, rebuild of ``world_size`` contributions) without a single byte on a wire: the
    difference to a plain step is dAD's compute overhead.
    """

    def __init__(self, rank: int, world_size: int):
        super().__init__()
        self._rank, self._world = rank, world_size

    def _all_gather(self, tensor, name, first_dims):
        dims = first_dims or [tensor.shape[0]] * self._world
        out = []
        for n in dims:
            if n <= tensor.shape[0]:
                out.append(tensor[:n])
            else:
                pad = tensor.new_zeros((n - tensor.shape[0],) + tuple(tensor.shape[1:]))
                out.append(torch.cat([tensor, pad]))
        return CommHandle(lambda: out)

    def _all_reduce(self, tensor, name, op):
        # a sum of equal contributions; not of the byte-packed broadcast at attach (rank 0's bytes,
        # zeros elsewhere: its sum is rank 0's bytes, which world_size times would corrupt the weights)
        if op == "sum" and tensor.is_floating_point():
            tensor.mul_(self._world)
        return CommHandle(lambda: tensor)


def lm_step(fwd, opt: torch.optim.Optimizer, sync=None,
            losses: Optional[List[float]] = None) -> Callable[[torch.Tensor], None]:
    """One training step of the byte LM on a batch ``x``: forward (``fwd``, the model or its DDP
    wrapper), backward, dAD's ``sync.synchronize()`` where there is one, the optimizer; the loss
    is appended to ``losses`` where given."""

    def step(x: torch.Tensor) -> None:
        loss = fwd(input_ids=x, labels=x).loss
        loss.backward()
        if sync is not None:
            sync.synchronize()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if losses is not None:
            losses.append(float(loss.detach()))

    return step


def gloo_rank(rank: int, world: int, port: int, timeout_s: float, body: Callable[[], None]) -> None:
    """One benchmark rank: bound to its launcher's life, one thread, the gloo group on loopback at
    ``port`` for ``body``, left again however ``body`` ends."""
    import datetime
    import os

    import torch.distributed as dist
    from benchmarks.cpu_load import die_with_parent

    die_with_parent()  # a rank never outlives its launcher
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        body()
    finally:
        dist.destroy_process_group()


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: CUDA's allocator counter, or the process' RSS high-water mark."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass


def peak_memory_mb(device: torch.device) -> Optional[float]:
    """Peak since `reset_peak_memory`: CUDA allocated bytes, or the process' peak RSS (VmHWM)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    try:
        return _status_kb("VmHWM") / 1024
    except OSError:
        return None


def current_rss_mb() -> Optional[float]:
    try:
        return _status_kb("VmRSS") / 1024
    except OSError:
        return None


def fmt_bytes(b: Optional[float]) -> str:
    """``b`` bytes as B / KB / MB / GB for tables; ``-`` for None."""
    if b is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if b < 1024 or unit == "GB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return f"{b:.1f} GB"


def median(xs: List[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def lower_quartile(xs: List[float]) -> float:
    """The 25th percentile (linear between order statistics). Under an on/off background load a
    step's time has two modes; the median lands in either by chance where the load is on about
    half the time, the lower quartile stays in the unloaded one (load only adds time)."""
    s = sorted(xs)
    pos = 0.25 * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
