"""Let Accelerate read a DeepSpeed config that holds a ``"dad"`` block.

Accelerate walks every key of the DeepSpeed config and treats the string ``"auto"`` as a
placeholder it must fill from the training arguments; ``"dad": {"mode": "auto"}`` then fails with
"`dad.mode` not found in kwargs". The ``"dad"`` block is ours, not DeepSpeed's: this skips it in
that walk (the wrapped ``deepspeed.initialize`` strips it before DeepSpeed sees the config). The
import hook does the same when Accelerate is imported (`deepspeed_dad_hook.skip_dad_block_in_accelerate`).
"""
from __future__ import annotations

import deepspeed_dad_hook as hook


def let_accelerate_skip_dad_block() -> None:
    """Make Accelerate's DeepSpeed config processing leave the ``"dad"`` block alone (idempotent)."""
    try:
        import accelerate.utils.dataclasses as dataclasses
    except ImportError:  # no Accelerate: nothing to adapt
        return
    hook.skip_dad_block_in_accelerate(dataclasses)
