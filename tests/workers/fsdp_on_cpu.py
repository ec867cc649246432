"""Let Accelerate run its FSDP path on CPU processes (tests only).

Accelerate 1.15 turns an FSDP plugin into ``DistributedType.FSDP`` only on GPU-class devices:
`AcceleratorState.__init__` does it in its ``MULTI_GPU``/``MULTI_XPU``/... branch, and CPU
processes (``MULTI_CPU``) silently train with DDP instead. `allow_fsdp_on_cpu` adds, after the
``__init__`` that initialises the state, what that branch does (distributed type, the plugin's
mixed precision, the plugin) and what ``__init__`` ends with (the type copied into `PartialState`,
which every later ``AcceleratorState()`` copies back), for ``MULTI_CPU`` states given a plugin. Everything else is Accelerate's
and Transformers' own code: the plugin read from the launcher's environment or built by
``TrainingArguments``, ``prepare`` (``fsdp2_prepare_model``: ``fully_shard`` per block, the tied
tail group, the root), ``accumulate`` / ``no_sync``, ``clip_grad_norm_``, ``save_state``, and
the Trainer's FSDP handling (which asks ``accelerator.state.fsdp_plugin``).
"""
from __future__ import annotations

import functools

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType


def allow_fsdp_on_cpu() -> None:
    """Patch `AcceleratorState.__init__` once (see the module doc); idempotent."""
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
