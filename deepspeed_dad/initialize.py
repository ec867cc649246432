"""`initialize`: ``deepspeed.initialize`` that reads the config's ``"dad"`` block and attaches dAD.

``deepspeed.initialize`` itself does the same once the package is installed: its import hook
(`deepspeed_dad_hook`) wraps it and hands calls whose config holds a block to
`initialize_with_block`. `patch_deepspeed_initialize` installs that wrapper by hand where the hook
is not active (``python -S``, the package only on ``PYTHONPATH``) and overrides the opt-out.
"""
from __future__ import annotations

import copy
import inspect
import logging
import os
from typing import Any, Callable, Tuple

import deepspeed_dad_hook as hook
from dad_integrations.logs import process_rank

from .config import BLOCK_KEY, split_config
from .engine import attach

log = logging.getLogger(__name__)

_explicit = False  # patch_deepspeed_initialize was called: the opt-out does not apply


def _initialize_with(ds_initialize: Callable[..., Tuple[Any, Any, Any, Any]], by_hook: bool,
                     *args: Any, **kwargs: Any) -> Tuple[Any, Any, Any, Any]:
    bound = inspect.signature(ds_initialize).bind(*args, **kwargs)
    given = bound.arguments
    source, from_args = hook.config_in(given)  # where deepspeed.initialize takes its config from
    config, block = split_config(source)
    if block is None:
        if not by_hook and process_rank() == 0:  # the same config on every rank
            log.warning("the DeepSpeed config has no 'dad' block: DeepSpeed's own all-reduce is kept")
        return ds_initialize(*args, **kwargs)  # the caller's arguments, untouched
    if by_hook and block.enabled and hook.opted_out() and not _explicit:  # (`initialize_with_block`)
        raise ValueError(f"the DeepSpeed config has an enabled {BLOCK_KEY!r} block, but "
                         f"{hook.OPT_OUT}={os.environ.get(hook.OPT_OUT)} turns off dAD's automatic attachment: "
                         f"remove the block (or set \"enabled\": false), unset {hook.OPT_OUT}, or build the "
                         f"engine with deepspeed_dad.initialize")

    # DeepSpeed gets the config without the block, as a dict, through `config` only
    given["config"] = config
    given.pop("config_params", None)
    if from_args is not None:
        given["args"] = copy.copy(given["args"])
        setattr(given["args"], from_args, None)
    result = ds_initialize(*bound.args, **bound.kwargs)
    attach(result[0], block)  # a disabled block attaches nothing, and says so
    return result


def initialize(*args: Any, **kwargs: Any) -> Tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` with dAD: same arguments, same return value.

    Reads the ``"dad"`` block (``enabled`` plus the keys of `dad_integrations.DADConfig`) from
    the config (``config``, ``config_params``, or the JSON file named by ``args.deepspeed_config``),
    validates it (an unknown or bad key raises `ValueError` naming it), gives DeepSpeed the config
    without the block, builds the engine and attaches dAD to it (`deepspeed_dad.attach`).
    Without a block, or with ``"enabled": false``, the engine keeps DeepSpeed's all-reduce.
    """
    import deepspeed
    # DeepSpeed's own ``initialize``, even while `patch_deepspeed_initialize` is in effect
    return _initialize_with(getattr(deepspeed.initialize, hook.ORIGINAL, deepspeed.initialize), False, *args, **kwargs)


def initialize_with_block(ds_initialize: Callable[..., Tuple[Any, Any, Any, Any]], args: tuple,
                          kwargs: dict) -> Tuple[Any, Any, Any, Any]:
    """What the wrapped ``deepspeed.initialize`` runs for a config that holds a ``"dad"`` block, as
    `initialize` does; under the opt-out (``DAD_DEEPSPEED_HOOK=0``, no `patch_deepspeed_initialize`)
    an enabled block raises rather than be ignored without a word."""
    return _initialize_with(ds_initialize, True, *args, **kwargs)


def patch_deepspeed_initialize() -> None:
    """Make ``deepspeed.initialize`` itself honour the ``"dad"`` block, for every later call, as the
    import hook does (module doc), also despite ``DAD_DEEPSPEED_HOOK=0``. Find an engine's dAD with
    `deepspeed_dad.get_attachment`. Idempotent; undo with `unpatch_deepspeed_initialize`.
    ``import deepspeed_dad.auto`` calls it.
    """
    global _explicit
    import deepspeed
    hook.wrap_deepspeed(deepspeed, by_hook=False)  # and Accelerate's config walk skips the block
    _explicit = True
    if process_rank() == 0:
        log.info("deepspeed.initialize now attaches dAD to engines whose config has an enabled 'dad' block")


def unpatch_deepspeed_initialize() -> None:
    """Undo `patch_deepspeed_initialize` (engines made meanwhile keep their dAD).

    DeepSpeed's own ``initialize`` comes back unless the import hook installed the wrapper; then
    the wrapper stays, so that a block is never ignored, and the opt-out applies again.
    """
    global _explicit
    import deepspeed
    _explicit = False
    original = getattr(deepspeed.initialize, hook.ORIGINAL, None)
    if original is not None and not getattr(deepspeed.initialize, hook.BY_HOOK, False):
        deepspeed.initialize = original

