"""`DADCallback`: train with ``transformers.Trainer`` and dAD in place of gradient all-reduce.

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[DADCallback({"mode": "auto", "rank": 4})])
    trainer.train()

Launch as usual (``accelerate launch``, ``torchrun``). When training begins the callback finds the
DDP wrapper the Trainer made and installs dAD as its communication hook (`enable_dad`); under
DeepSpeed it picks up the synchroniser attached from the config's ``"dad"`` block. At every log
it adds the bytes dAD sent per optimizer step, what all-reduce would have sent, and their ratio
to the Trainer's own metrics (``dad_sent_bytes_per_step``, ``dad_allreduce_bytes_per_step``,
``dad_bytes_ratio``), so they reach the console, ``log_history`` and any reporting integration.
"""
from __future__ import annotations

import gc
import logging
from typing import Mapping, Optional, Union

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from .config import DADConfig
from .ddp_hook import register_dad_comm_hook
from .synchronizer import DADSynchronizer

log = logging.getLogger(__name__)


class DADCallback(TrainerCallback):
    """Switch a ``Trainer``'s gradient synchronisation to dAD and log the bytes it saves.

    Args:
        config: a `DADConfig` or a dict of its keys (ignored under DeepSpeed when the DeepSpeed
            config has a ``"dad"`` block, which then rules).
    """

    def __init__(self, config: Union[DADConfig, Mapping, None] = None):
        self.config = DADConfig() if config is None else DADConfig.from_dict(config)
        self.sync: Optional[DADSynchronizer] = None
        self._sent = self._allreduce = 0.0
        self._steps = 0

    def on_train_begin(self, args, state, control, model: Optional[nn.Module] = None, **kwargs) -> None:
        """Install dAD on the DDP wrapper (or find the DeepSpeed engine's) around ``model``."""
        # the process count from torch.distributed: Accelerate under DeepSpeed on CPUs counts one
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if self.sync is not None or world <= 1:
            if world <= 1:
                log.info("dAD: a single process has nothing to synchronise; training runs unchanged")
            return
        wrapper = _wrapper_of(model)
        if wrapper is None:
            raise RuntimeError("DADCallback found neither a DistributedDataParallel wrapper nor a DeepSpeed "
                               "engine around the model: launch with accelerate launch or torchrun on "
                               "several processes (FSDP and other sharded setups are not supported)")
        if isinstance(wrapper, DistributedDataParallel):
            self.sync = register_dad_comm_hook(wrapper, self.config)
        else:
            import deepspeed_dad
            attachment = deepspeed_dad.get_attachment(wrapper) or deepspeed_dad.attach(wrapper, self.config)
            self.sync = attachment.synchronizer if attachment is not None else None
        log.info("dAD enabled for Trainer (%s)", type(wrapper).__name__)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        """Add the optimizer step's bytes to the running totals."""
        report = self.sync.last_step_report() if self.sync is not None else None
        if report is not None:
            totals = report.totals
            self._sent += totals["sent_bytes"]
            self._allreduce += totals["allreduce_bytes"]
            self._steps += 1

    def on_log(self, args, state, control, logs: Optional[dict] = None, **kwargs) -> None:
        """Put the mean bytes per step since the last log into the Trainer's metrics."""
        if logs is None or not self._steps or "loss" not in logs:
            return
        metrics = {"dad_sent_bytes_per_step": self._sent / self._steps,
                   "dad_allreduce_bytes_per_step": self._allreduce / self._steps,
                   "dad_bytes_ratio": self._sent / self._allreduce if self._allreduce else 0.0}
        logs.update(metrics)
        # the Trainer appended a copy of ``logs`` to log_history before calling us
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)
        self._sent = self._allreduce = 0.0
        self._steps = 0


def _wrapper_of(model: Optional[nn.Module]):
    """The DDP wrapper or DeepSpeed engine around ``model`` (callbacks only see the bare model)."""
    if model is None:
        return None
    for obj in gc.get_objects():
        if isinstance(obj, nn.Module) and obj is not model and getattr(obj, "module", None) is model:
            if isinstance(obj, DistributedDataParallel) or type(obj).__name__ == "DeepSpeedEngine":
                return obj
    return None
