"""Registry of engine adapters, so that the core never imports one.

The core's Accelerate and Transformers glue meets engines that own gradient reduction themselves
(DeepSpeed). An adapter package registers what the glue needs with `register_engine`, at its own
import and through the ``dad_integrations.engines`` entry point group (declared in the
distribution's metadata), which `get_engine` loads when a name is not registered yet:

    [project.entry-points."dad_integrations.engines"]
    deepspeed = "deepspeed_dad.glue:register"

An entry point names a callable without arguments that calls `register_engine`.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Union

from dad_integrations.config import DADConfig

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "dad_integrations.engines"


@dataclass(frozen=True)
class EngineAdapter:
    """What the core's glue calls on an engine that reduces gradients itself.

    Attributes:
        name: the engine's name (``"deepspeed"``).
        is_engine: whether an object is one of this engine's model wrappers.
        find: the `DADSynchronizer` attached to an engine (or to a wrapper of it), or None.
        attach: attach dAD to an engine with a config; returns its synchronizer (None if disabled).
        load_checkpoint_state: load the dAD state that the engine's own checkpointing saved inside
            a checkpoint folder, into an engine that got dAD after that checkpoint was loaded;
            returns whether there was any. Optional.
    """

    name: str
    is_engine: Callable[[Any], bool]
    find: Callable[[Any], Any]
    attach: Callable[[Any, Union[DADConfig, Mapping, None]], Any]
    load_checkpoint_state: Optional[Callable[[Any, str], bool]] = None


_ENGINES: Dict[str, EngineAdapter] = {}
_LOCK = threading.Lock()
_entry_points_loaded = False


def register_engine(name: str, *, is_engine: Callable[[Any], bool], find: Callable[[Any], Any],
                    attach: Callable[[Any, Union[DADConfig, Mapping, None]], Any],
                    load_checkpoint_state: Optional[Callable[[Any, str], bool]] = None) -> EngineAdapter:
    """Register (or replace) the adapter for engine ``name``; returns it. See `EngineAdapter`."""
    adapter = EngineAdapter(name, is_engine, find, attach, load_checkpoint_state)
    with _LOCK:
        _ENGINES[name] = adapter
    return adapter


def get_engine(name: str) -> EngineAdapter:
    """The adapter registered for ``name``, loading the installed entry points first if needed.

    Raises `LookupError` naming the missing adapter when none is installed.
    """
    if name not in _ENGINES:
        load_entry_points()
    try:
        return _ENGINES[name]
    except KeyError:
        raise LookupError(f"no dAD adapter for engine {name!r} is installed (entry point group "
                          f"{ENTRY_POINT_GROUP!r}); install dad-integrations with its {name} adapter, e.g. "
                          f"pip install 'dad-integrations[{name}]'") from None


def registered_engines() -> Dict[str, EngineAdapter]:
    """Every adapter: those registered so far and those the installed entry points provide."""
    load_entry_points()
    return dict(_ENGINES)


def load_entry_points() -> None:
    """Import every adapter declared in the ``dad_integrations.engines`` entry point group (once).

    An adapter that fails to load is logged and skipped: the engines it serves then raise in
    `get_engine`, the others keep working.
    """
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    from importlib.metadata import entry_points
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _ENGINES:
            continue
        try:
            ep.load()()
        except Exception as e:  # noqa: BLE001 -- one broken adapter must not hide the others
            log.warning("dAD: the engine adapter entry point %s = %s failed to load: %s", ep.name, ep.value, e)
    _entry_points_loaded = True
