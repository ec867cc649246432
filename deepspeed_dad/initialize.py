"""`initialize`: ``deepspeed.initialize`` that reads the config's ``"dad"`` block and attaches dAD.

`patch_deepspeed_initialize` installs the same behaviour in ``deepspeed.initialize`` itself, for
code that calls it on the user's behalf (Accelerate, the Hugging Face ``Trainer``).
"""
from __future__ import annotations

import copy
import functools
import inspect
import logging
from typing import Any, Callable, Tuple

from .accelerate_compat import let_accelerate_skip_dad_block
from .config import split_config
from .engine import attach

log = logging.getLogger(__name__)

_PATCH_MARK = "_dad_original"


def _deepspeed_initialize() -> Callable[..., Tuple[Any, Any, Any, Any]]:
    """DeepSpeed's own ``initialize``, even while `patch_deepspeed_initialize` is in effect."""
    import deepspeed
    return getattr(deepspeed.initialize, _PATCH_MARK, deepspeed.initialize)


def _initialize_with(ds_initialize: Callable[..., Tuple[Any, Any, Any, Any]], require_block: bool,
                     *args: Any, **kwargs: Any) -> Tuple[Any, Any, Any, Any]:
    bound = inspect.signature(ds_initialize).bind(*args, **kwargs)
    given = bound.arguments
    cli_args = given.get("args")
    # the places deepspeed.initialize takes its config from, in its own order of precedence
    source = given.get("config")
    if source is None:
        source = given.get("config_params")
    from_args = None
    if source is None and cli_args is not None:
        for attr in ("deepspeed_config", "deepscale_config"):
            if getattr(cli_args, attr, None) is not None:
                source, from_args = getattr(cli_args, attr), attr
                break
    config, block = split_config(source) if source is not None else (None, None)
    if block is None:
        if require_block:
            log.warning("the DeepSpeed config has no 'dad' block: DeepSpeed's own all-reduce is kept")
        return ds_initialize(*bound.args, **bound.kwargs)

    # DeepSpeed gets the config without the block, as a dict, through `config` only
    given["config"] = config
    given.pop("config_params", None)
    if from_args is not None:
        cli_args = copy.copy(cli_args)
        setattr(cli_args, from_args, None)
        given["args"] = cli_args
    result = ds_initialize(*bound.args, **bound.kwargs)
    if block.enabled:
        attach(result[0], block)
    else:
        log.info("the DeepSpeed config's 'dad' block has enabled=false: DeepSpeed's all-reduce is kept")
    return result


def initialize(*args: Any, **kwargs: Any) -> Tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` with dAD: same arguments, same return value.

    Reads the ``"dad"`` block (``enabled`` plus the keys of `dad_integrations.DADConfig`) from
    the config (``config``, ``config_params``, or the JSON file named by ``args.deepspeed_config``),
    validates it (an unknown or bad key raises `ValueError` naming it), gives DeepSpeed the config
    without the block, builds the engine and attaches dAD to it (`deepspeed_dad.attach`).
    Without a block, or with ``"enabled": false``, the engine keeps DeepSpeed's all-reduce.
    """
    return _initialize_with(_deepspeed_initialize(), True, *args, **kwargs)


def patch_deepspeed_initialize() -> None:
    """Make ``deepspeed.initialize`` itself honour the ``"dad"`` block, for every later call.

    For scripts whose engine is built by a library (Accelerate's ``prepare``, the Hugging Face
    ``Trainer``): after this call, an engine whose config holds an enabled ``"dad"`` block gets dAD
    (find it with `deepspeed_dad.get_attachment`), and DeepSpeed never sees the block. Configs
    without a block are passed through untouched. Idempotent; undo with
    `unpatch_deepspeed_initialize`. ``import deepspeed_dad.auto`` calls it.
    """
    import deepspeed
    let_accelerate_skip_dad_block()
    if hasattr(deepspeed.initialize, _PATCH_MARK):
        return
    original = deepspeed.initialize

    @functools.wraps(original)
    def initialize_with_dad(*args: Any, **kwargs: Any) -> Tuple[Any, Any, Any, Any]:
        return _initialize_with(original, False, *args, **kwargs)

    setattr(initialize_with_dad, _PATCH_MARK, original)
    deepspeed.initialize = initialize_with_dad
    log.info("deepspeed.initialize now attaches dAD to engines whose config has an enabled 'dad' block")


def unpatch_deepspeed_initialize() -> None:
    """Restore DeepSpeed's own ``initialize`` (engines made meanwhile keep their dAD)."""
    import deepspeed
    original = getattr(deepspeed.initialize, _PATCH_MARK, None)
    if original is not None:
        deepspeed.initialize = original

