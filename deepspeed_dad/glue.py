"""Registers the DeepSpeed adapter with the core (`dad_integrations.engines`).

`register` runs when ``deepspeed_dad`` is imported, and the core finds it without that import
through the ``dad_integrations.engines`` entry point (``deepspeed = "deepspeed_dad.glue:register"``
in pyproject.toml), so `dad_integrations.accelerate.enable_dad` and ``DADCallback`` work under
DeepSpeed although the core never imports this package.
"""
from __future__ import annotations

from typing import Any

from dad_integrations.engines.registry import register_engine

from .attachment import get_attachment
from .checks import is_engine
from .engine import attach


def register() -> None:
    """Register the ``"deepspeed"`` engine adapter (idempotent); the core sees each attachment's
    synchronizer (None where there is no attachment)."""
    register_engine("deepspeed", is_engine=is_engine,
                    find=lambda engine: getattr(get_attachment(engine), "synchronizer", None),
                    attach=lambda engine, config: getattr(attach(engine, config), "synchronizer", None),
                    load_checkpoint_state=_load_checkpoint_state)


def _load_checkpoint_state(engine: Any, checkpoint_dir: str) -> bool:
    """Load dAD's state from the tag named by ``checkpoint_dir/latest`` (a Trainer checkpoint)."""
    attachment = get_attachment(engine)
    if attachment is None:
        return False
    tag_dir = attachment.checkpoint_tag_dir(checkpoint_dir)
    return tag_dir is not None and attachment.load_state(tag_dir)
