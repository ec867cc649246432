"""The examples' PowerSGD baseline: PyTorch's DDP hook, warmed up as long as dAD is.

PowerSGD all-reduces its first ``start_powerSGD_iter`` steps uncompressed, dAD its first
``lossless_steps``; the examples give both the same start, so that their tables compare the
compressors, not their warm-ups.
"""
from __future__ import annotations

from typing import Mapping, Optional

from torch import nn

from dad_integrations import DADConfig


def warmup_steps(dad_config: Optional[Mapping]) -> int:
    """PowerSGD's ``start_powerSGD_iter`` matching ``dad_config``'s lossless steps (its defaults
    included; the hook needs at least 2 with error feedback)."""
    lossless = DADConfig.from_dict(dict(dad_config or {})).lossless_steps
    return max(2, lossless)


def register_powersgd(ddp_model: nn.Module, rank: int, seed: int, warmup: int) -> None:
    """PyTorch's PowerSGD hook on a DDP model: rank ``rank``, error feedback and warm start,
    compressing from step ``warmup`` (the hook's own default waits 1000 steps)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    if not hasattr(ddp_model, "register_comm_hook"):
        raise SystemExit("the PowerSGD baseline needs DDP (a multi-process launch without DeepSpeed)")
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                        start_powerSGD_iter=warmup, use_error_feedback=True, warm_start=True,
                                        random_seed=seed)
    ddp_model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
