"""The ``"dad"`` block of a DeepSpeed JSON config: reading, validating and stripping it.

DeepSpeed must never see the block (its config parser knows nothing about it, and Accelerate or
the Trainer may validate the config too), so every entry point splits the config into the part
DeepSpeed reads and the dAD block, and hands DeepSpeed a copy without it.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple, Union

from dad_integrations import DADConfig
from deepspeed_dad_hook import BLOCK_KEY, read_config

ConfigSource = Union[str, os.PathLike, Mapping[str, Any], None]


@dataclass(frozen=True)
class DADBlock:
    """A validated ``"dad"`` block: ``enabled`` plus the keys of `DADConfig`."""

    enabled: bool
    config: DADConfig


def parse_block(block: Any) -> DADBlock:
    """Validate a ``"dad"`` block; raises `ValueError` naming the bad or unknown key.

    ``enabled`` defaults to true (a block is written to switch dAD on); every other key is a
    `DADConfig` key.
    """
    if isinstance(block, DADBlock):
        return block
    if isinstance(block, DADConfig):
        return DADBlock(True, DADConfig.from_dict(block))
    if not isinstance(block, Mapping):
        raise ValueError(f"the DeepSpeed config's {BLOCK_KEY!r} block must be a JSON object, "
                         f"got {type(block).__name__}")
    values = dict(block)
    enabled = values.pop("enabled", True)
    if not isinstance(enabled, bool):
        raise ValueError(f"the DeepSpeed config's {BLOCK_KEY!r} block: dad config key 'enabled': must be true or "
                         f"false, got {enabled!r}")
    try:
        config = DADConfig.from_dict(values)
    except ValueError as e:  # name the block: the job may never have mentioned dAD anywhere else
        raise ValueError(f"the DeepSpeed config's {BLOCK_KEY!r} block: {e}") from None
    return DADBlock(enabled, config)


def load_config(source: ConfigSource) -> Optional[dict]:
    """A DeepSpeed config as a fresh dict: from a dict (deep-copied), a JSON (or hjson) file path,
    base64-encoded JSON (as DeepSpeed accepts), or None."""
    if source is None:
        return None
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    if isinstance(source, (str, os.PathLike)):
        loaded = read_config(source)
        if loaded is None:
            raise ValueError(f"DeepSpeed config {os.fspath(source)!r} is neither a JSON file holding an object "
                             f"nor base64-encoded JSON")
        return loaded
    raise ValueError(f"a DeepSpeed config must be a dict or a path to a JSON file, got {type(source).__name__}")


def split_config(source: ConfigSource) -> Tuple[Optional[dict], Optional[DADBlock]]:
    """Split a DeepSpeed config into (config without the ``"dad"`` block, validated block or None).

    The caller's dict is never modified; the returned config is a copy.
    """
    config = load_config(source)
    if config is None or BLOCK_KEY not in config:
        return config, None
    block = parse_block(config.pop(BLOCK_KEY))
    return config, block
