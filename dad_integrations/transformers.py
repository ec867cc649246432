"""`DADCallback`: train with ``transformers.Trainer`` and dAD in place of gradient all-reduce
(``docs/guides/accelerate.md``).

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[DADCallback({"mode": "auto", "rank": 4})])
    trainer.train()

The callback attaches dAD when training begins (DDP's hook, the DeepSpeed engine's ``"dad"`` block,
or FSDP2's reduce-scatter; FSDP1 is refused, `fsdp_detect`), adds ``dad_*`` byte metrics to every
log, and carries dAD's per-rank state in the Trainer's checkpoints (`on_save`, and on resume).
"""
from __future__ import annotations

import gc
import logging
import os
import sys
from typing import Any, Mapping, Optional, Union

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from dad_integrations.engines import banner
from dad_integrations.engines.checkpoint import keeps_state, load_rank_state, save_rank_state
from dad_integrations.config import DADConfig
from dad_integrations.ddp_hook import register_dad_comm_hook
from dad_integrations.engines.registry import EngineAdapter, registered_engines
from dad_integrations.engines.fsdp_detect import fsdp2_modules, reject_fsdp1
from dad_integrations.synchronizer import DADSynchronizer

log = logging.getLogger(__name__)


class DADCallback(TrainerCallback):
    """Switch a ``Trainer``'s gradient synchronisation to dAD and log the bytes it saves.

    Args:
        config: a `DADConfig` or a dict of its keys (ignored under DeepSpeed when the DeepSpeed
            config has a ``"dad"`` block, which then rules).
    """

    def __init__(self, config: Union[DADConfig, Mapping, None] = None):
        self.config = DADConfig() if config is None else DADConfig.from_dict(config)
        self.sync: Optional[DADSynchronizer] = None  # or an FSDPDADSynchronizer under FSDP2
        self._engine: Any = None  # the DeepSpeed engine, whose own checkpoints carry dAD's state
        self._sent = self._allreduce = self._reduce_scatter = 0.0
        self._steps = 0

    @banner.engine("Transformers Trainer")  # the attach below announces itself by this name
    def on_train_begin(self, args, state, control, model: Optional[nn.Module] = None, **kwargs) -> None:
        """Install dAD on the DDP wrapper (or find the DeepSpeed engine's) around ``model``, or inside
        FSDP2's reduce-scatter of the sharded ``model``; when resuming from a checkpoint, load this
        rank's dAD state from it."""
        # the process count from torch.distributed: Accelerate under DeepSpeed on CPUs counts one
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if self.sync is not None or world <= 1:
            if world <= 1:
                log.info("dAD: a single process has nothing to synchronise; training runs unchanged")
            return
        # under FSDP the Trainer hands callbacks the sharded model itself
        reject_fsdp1(model, "DADCallback")
        resume = _resume_checkpoint(args, state)
        if fsdp2_modules(model):
            from dad_integrations.fsdp import enable_dad_fsdp  # imports FSDP2's internals: only when FSDP runs
            self.sync = enable_dad_fsdp(getattr(model, "_orig_mod", model), self.config)
            what = "FSDP2: inside its gradient reduce-scatter"
        else:
            wrapper, adapter = _wrapper_of(model)
            if wrapper is None:
                raise RuntimeError("DADCallback found neither a DistributedDataParallel wrapper, a DeepSpeed "
                                   "engine nor an FSDP2 (fully_shard) model: launch with accelerate launch or "
                                   "torchrun on several processes")
            what = type(wrapper).__name__
            if adapter is None:
                # Trainer(torch_compile=True) compiles the wrapper: after this call, unseen from here
                self.sync = register_dad_comm_hook(wrapper, self.config,
                                                   compiled=True if getattr(args, "torch_compile", False) else None)
            else:
                self._engine = wrapper
                self.sync = adapter.find(wrapper)
                if self.sync is None:
                    # attached only now: the engine's load_checkpoint, which restores dAD's state,
                    # has already run without it
                    self.sync = adapter.attach(wrapper, self.config)
                    if self.sync is not None and resume is not None and adapter.load_checkpoint_state is not None:
                        adapter.load_checkpoint_state(wrapper, resume)
        if resume is not None and self._engine is None and keeps_state(self.sync):  # FSDP2's exact/auto keep none
            payload = load_rank_state(self.sync, resume, dist.get_rank(), world)
            if payload is not None and payload.get("global_step", state.global_step) != state.global_step:
                raise ValueError(f"{resume}: its dAD state was saved at step {payload['global_step']}, "
                                 f"but training resumes at step {state.global_step}")
        if dist.get_rank() == 0:  # the same on every rank
            log.info("dAD enabled for Trainer (%s)", what)

    def on_save(self, args, state, control, **kwargs) -> None:
        """Write this rank's dAD state into the checkpoint folder the Trainer has just written.

        Under DeepSpeed the engine's ``save_checkpoint`` has already written it (into the folder's
        tag), and a ``save_only_model`` checkpoint cannot be resumed, so neither gets a file here; nor
        does a state that holds nothing (FSDP2's exact and auto modes without a rank, `keeps_state`).
        """
        if self.sync is None or self._engine is not None or args.save_only_model or not keeps_state(self.sync):
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        save_rank_state(self.sync, folder, dist.get_rank(), dist.get_world_size(), global_step=state.global_step)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        """Add the optimizer step's bytes to the running totals."""
        report = self.sync.last_step_report() if self.sync is not None else None
        if report is not None:
            totals = report.totals
            self._sent += totals["sent_bytes"]
            self._allreduce += totals["allreduce_bytes"]
            self._reduce_scatter += totals.get("reduce_scatter_bytes", 0.0)  # FSDP2's baseline
            self._steps += 1

    def on_log(self, args, state, control, logs: Optional[dict] = None, **kwargs) -> None:
        """Put the mean bytes per step since the last log into the Trainer's metrics."""
        if logs is None or not self._steps or "loss" not in logs:
            return
        metrics = {"dad_sent_bytes_per_step": self._sent / self._steps,
                   "dad_allreduce_bytes_per_step": self._allreduce / self._steps,
                   "dad_bytes_ratio": self._sent / self._allreduce if self._allreduce else 0.0}
        if self._reduce_scatter:
            metrics["dad_reduce_scatter_bytes_per_step"] = self._reduce_scatter / self._steps
            metrics["dad_bytes_ratio_reduce_scatter"] = self._sent / self._reduce_scatter
        logs.update(metrics)
        # the Trainer appended a copy of ``logs`` to log_history before calling us
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)
        self._sent = self._allreduce = self._reduce_scatter = 0.0
        self._steps = 0


def _wrapper_of(model: Optional[nn.Module]) -> tuple[Any, Optional[EngineAdapter]]:
    """The DDP wrapper (adapter None) or the engine and its adapter (DeepSpeed) around ``model``
    (callbacks only see the bare model)."""
    if model is None:
        return None, None
    others = []
    for obj in gc.get_objects():
        # type(obj), not isinstance: isinstance falls back to reading ``obj.__class__``, which on
        # ``torch.distributed.reduce_op`` (a deprecated object whose every attribute read warns)
        # printed a FutureWarning from this scan
        if issubclass(type(obj), nn.Module) and obj is not model and getattr(obj, "module", None) is model:
            if isinstance(obj, DistributedDataParallel):
                return obj, None
            others.append(obj)
    if others:
        for adapter in registered_engines().values():
            for obj in others:
                if adapter.is_engine(obj):
                    return obj, adapter
    return None, None


def _resume_checkpoint(args, state) -> Optional[str]:
    """The checkpoint folder ``trainer.train(resume_from_checkpoint=...)`` resumes from, or None.

    Callbacks are not told it: it is read from the frame of ``_inner_training_loop`` (which calls
    ``on_train_begin``); without that frame a resumed state (``global_step > 0`` at train begin)
    points to the Trainer's own naming, ``output_dir/checkpoint-{global_step}``.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_inner_training_loop" and "resume_from_checkpoint" in frame.f_locals:
            path = frame.f_locals["resume_from_checkpoint"]
            return None if path is None else os.fspath(path)
        frame = frame.f_back
    if state.global_step > 0:
        return os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
    return None
