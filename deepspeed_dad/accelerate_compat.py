"""Let Accelerate read a DeepSpeed config that holds a ``"dad"`` block.

Accelerate walks every key of the DeepSpeed config and treats the string ``"auto"`` as a
placeholder it must fill from the training arguments; ``"dad": {"mode": "auto"}`` then fails with
"`dad.mode` not found in kwargs". The ``"dad"`` block is ours, not DeepSpeed's: this skips it in
that walk (the patched ``deepspeed.initialize`` strips it before DeepSpeed sees the config).
"""
from __future__ import annotations

import functools

_MARK = "_dad_skips_block"


def let_accelerate_skip_dad_block() -> None:
    """Make Accelerate's DeepSpeed config processing leave the ``"dad"`` block alone (idempotent)."""
    try:
        from accelerate.utils.dataclasses import DeepSpeedPlugin
    except ImportError:  # no Accelerate: nothing to adapt
        return
    original = DeepSpeedPlugin.deepspeed_config_process
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def deepspeed_config_process(self, prefix="", *args, **kwargs):
        if prefix == "dad.":  # the walk recurses through this method: skip our block's subtree
            return None
        return original(self, prefix, *args, **kwargs)

    setattr(deepspeed_config_process, _MARK, True)
    DeepSpeedPlugin.deepspeed_config_process = deepspeed_config_process
