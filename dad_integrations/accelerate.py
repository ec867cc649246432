"""Hugging Face Accelerate: switch a prepared model's gradient synchronisation to dAD.

    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    sync = enable_dad(accelerator, model, {"mode": "auto", "rank": 4})
    ...                                   # the training loop is unchanged
    sync.last_step_report().totals        # bytes sent, and what all-reduce would have sent

What it does, by Accelerate's distributed type:

* DDP (multi-GPU, multi-node, multi-CPU): a DDP communication hook (`register_dad_comm_hook`),
  so DDP's own all-reduce is replaced, not run twice. ``accelerator.accumulate(model)`` /
  ``no_sync`` accumulation, ``accelerator.clip_grad_norm_`` and mixed precision keep working.
* DeepSpeed: DeepSpeed owns gradient reduction there; dAD is switched on by the ``"dad"`` block of
  the DeepSpeed config (see `deepspeed_dad`), and this returns the synchroniser attached to the
  engine (or attaches one when ``config`` is given and the block is absent).
* A single process: nothing to synchronise; returns None and says so once in the log.
* FSDP, Megatron-LM, XLA: rejected with an error (they shard gradients; dAD replaces an all-reduce).
"""
from __future__ import annotations

import logging
from typing import Mapping, Optional, Union

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .config import DADConfig
from .ddp_hook import register_dad_comm_hook
from .synchronizer import DADSynchronizer

log = logging.getLogger(__name__)

_DDP_TYPES = ("MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
              "MULTI_HPU", "MULTI_NEURON")
_said_single_process = False


def enable_dad(accelerator, model: nn.Module,
               config: Union[DADConfig, Mapping, None] = None) -> Optional[DADSynchronizer]:
    """Synchronise ``model``'s gradients with dAD; call once, after ``accelerator.prepare(...)``.

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model``.
        model: the prepared model (the DDP wrapper or the model it wraps).
        config: a `DADConfig` or a dict of its keys; None uses the defaults (``mode="auto"``).

    Returns:
        The `DADSynchronizer` (for ``last_step_report()``), or None in a single process.
    """
    kind = getattr(accelerator.distributed_type, "value", str(accelerator.distributed_type))
    if kind == "NO" or accelerator.num_processes == 1:
        global _said_single_process
        if not _said_single_process:
            log.info("dAD: a single process has nothing to synchronise; training runs unchanged")
            _said_single_process = True
        return None
    if kind == "DEEPSPEED":
        return _enable_on_deepspeed(accelerator, model, config)
    if kind not in _DDP_TYPES:
        raise ValueError(f"dAD does not support Accelerate's distributed type {kind}: it replaces "
                         f"DDP's or DeepSpeed's gradient all-reduce, and {kind} shards gradients instead")
    ddp = _find_ddp(accelerator, model)
    sync = register_dad_comm_hook(ddp, config)
    log.info("dAD enabled on Accelerate (%s, %d processes) as DDP's communication hook",
             kind, accelerator.num_processes)
    return sync


def _find_ddp(accelerator, model: nn.Module) -> DistributedDataParallel:
    """The DDP wrapper Accelerate made of ``model`` (passed wrapped or not)."""
    if isinstance(model, DistributedDataParallel):
        return model
    for candidate in getattr(accelerator, "_models", []):
        if isinstance(candidate, DistributedDataParallel) and candidate.module is model:
            return candidate
    raise ValueError("enable_dad() needs the model returned by accelerator.prepare(...) (wrapped in "
                     "DistributedDataParallel); call it after prepare()")


def _enable_on_deepspeed(accelerator, model: nn.Module,
                         config: Union[DADConfig, Mapping, None]) -> Optional[DADSynchronizer]:
    import deepspeed_dad

    engine = model if hasattr(model, "zero_optimization_stage") else None
    for candidate in getattr(accelerator, "_models", []):
        if engine is None and getattr(candidate, "module", None) is model:
            engine = candidate
    if engine is None:
        raise ValueError("enable_dad() needs the DeepSpeed engine returned by accelerator.prepare(...)")
    attachment = deepspeed_dad.get_attachment(engine)
    if attachment is None:
        if config is None:
            raise ValueError("dAD is not enabled on this DeepSpeed engine: add a \"dad\" block to the "
                             "DeepSpeed config (see deepspeed_dad), or pass config= to enable_dad()")
        attachment = deepspeed_dad.attach(engine, config)
    return attachment.synchronizer if attachment is not None else None
