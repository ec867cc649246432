"""Let Accelerate run its FSDP path (FSDP2, and HSDP with a ``parallelism_config``) on CPU processes.

Accelerate (checked on 1.15 and 1.16) turns an FSDP plugin into ``DistributedType.FSDP`` only on
GPU-class devices: `AcceleratorState.__init__` does it in its ``MULTI_GPU``/``MULTI_XPU``/... branch,
and CPU processes (``MULTI_CPU``) silently train with DDP instead. `allow_fsdp_on_cpu` adds, after
the ``__init__`` that initialises the state, what that branch does (distributed type, the plugin's
mixed precision, the plugin) and what ``__init__`` ends with (the type copied into `PartialState`,
which every later ``AcceleratorState()`` copies back), for ``MULTI_CPU`` states given a plugin.
Everything else is Accelerate's and Transformers' own code: the plugin read from the launcher's
environment or built by ``TrainingArguments``, the device mesh of a ``parallelism_config``,
``prepare`` (``fsdp2_prepare_model``: ``fully_shard`` per block, the tied tail group, the root),
``accumulate`` / ``no_sync``, ``clip_grad_norm_``, ``save_state``, and the Trainer's FSDP handling
(which asks ``accelerator.state.fsdp_plugin``).

Examples call it only when they run on CPUs (`on_cpu`): on GPUs Accelerate takes its FSDP path by
itself. The tests use it through ``tests/workers/fsdp_on_cpu.py``.
"""
from __future__ import annotations

import functools
import os


def on_cpu() -> bool:
    """True where Accelerate will run this process on the CPU: told so (``ACCELERATE_USE_CPU``, as
    ``accelerate launch`` with ``use_cpu: true`` or the simulated cluster set it), or no GPU-class
    device."""
    import torch
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        return True
    return not (torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()))


def allow_fsdp_on_cpu() -> None:
    """Patch `AcceleratorState.__init__` once (see the module doc); idempotent. Call before the
    first ``Accelerator()`` (or ``TrainingArguments``) of the process."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    if getattr(original, "_fsdp_on_cpu", False):
        return

    @functools.wraps(original)
    def init(self, *args, fsdp_plugin=None, **kwargs):
        # not initialised yet: no state, or only PartialState's copy (`AcceleratorState.initialized`)
        fresh = AcceleratorState._shared_state in ({}, PartialState._shared_state)
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fresh and fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = self.distributed_type

    init._fsdp_on_cpu = True
    AcceleratorState.__init__ = init
