"""Makes a ``"dad"`` block in a DeepSpeed config take effect with no import in the user's script.

Installed with the package: ``deepspeed_dad_hook.pth`` in site-packages (written by setup.py's
``build_py``, for wheels and editable installs alike) runs `install` at interpreter start-up. That
only puts a finder at the front of ``sys.meta_path`` which waits for ``import deepspeed``; a
process that never imports DeepSpeed pays for this module and one string comparison per import,
nothing else (no torch, no dAD). When DeepSpeed is imported, `wrap_deepspeed` wraps
``deepspeed.initialize``: a config without a ``"dad"`` block goes to DeepSpeed's own function
with the caller's arguments untouched; only a config with a block imports ``deepspeed_dad``, which
strips the block, builds the engine and attaches dAD (`deepspeed_dad.initialize.initialize_with_block`).
The same wrapper serves Accelerate and the Hugging Face ``Trainer``, which call
``deepspeed.initialize`` themselves; Accelerate's config walk is told to skip the block
(`skip_dad_block_in_accelerate`), whichever of the two is imported first.

Opt-out: ``DAD_DEEPSPEED_HOOK=0`` (read at each ``deepspeed.initialize``) keeps dAD from attaching
by itself; a config that still holds an enabled block then raises instead of being ignored.
This module imports only ``sys`` and ``os`` at start-up, as a ``.pth`` line must.
"""
from __future__ import annotations

import os
import sys

OPT_OUT = "DAD_DEEPSPEED_HOOK"
BLOCK_KEY = "dad"
ORIGINAL = "_dad_original"      # on the wrapper: DeepSpeed's own initialize
BY_HOOK = "_dad_by_hook"        # on the wrapper: installed by the import hook, not by an explicit call
_ACCELERATE_MARK = "_dad_skips_block"

_pending = {}  # module name -> callbacks to run once it is imported


def install() -> None:
    """Wrap ``deepspeed.initialize`` as soon as DeepSpeed is imported (now, if it already is)."""
    when_imported("deepspeed", wrap_deepspeed)


def opted_out() -> bool:
    """Whether ``DAD_DEEPSPEED_HOOK`` turns the automatic attachment off (``0``, ``false``, ``off``, ``no``)."""
    return os.environ.get(OPT_OUT, "").strip().lower() in ("0", "false", "off", "no")


def when_imported(name: str, callback) -> None:
    """Call ``callback(module)`` once module ``name`` has been imported (at once if it already is)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    _pending.setdefault(name, []).append(callback)
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())


class _PostImportFinder:
    """A meta-path finder that finds nothing itself: for a watched module it takes the spec the
    other finders give and has its loader run the callbacks after the module's code."""

    _busy = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _pending or fullname in self._busy:
            return None
        import importlib.util
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        except Exception:  # noqa: BLE001 -- the import system's own finders will say what is wrong
            return None
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _CallbackLoader(spec.loader, fullname)
        return spec

    def invalidate_caches(self) -> None:
        pass


class _CallbackLoader:
    """Runs the real loader, gives the module its real loader back, then the callbacks."""

    def __init__(self, loader, name: str):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec) if hasattr(self._loader, "create_module") else None

    def exec_module(self, module) -> None:
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        for callback in _pending.pop(self._name, []):
            callback(module)
        if not _pending:
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PostImportFinder)]

    def __getattr__(self, attr):  # get_resource_reader, is_package, ...: the real loader's
        return getattr(self._loader, attr)


def wrap_deepspeed(deepspeed, by_hook: bool = True):
    """Wrap ``deepspeed.initialize`` (idempotent); returns the wrapper.

    ``by_hook``: installed by the import hook (False: by `deepspeed_dad.patch_deepspeed_initialize`).
    """
    current = deepspeed.initialize
    if hasattr(current, ORIGINAL):
        return current
    import functools
    original = current

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        if not has_dad_block(original, args, kwargs):
            return original(*args, **kwargs)
        from deepspeed_dad.initialize import initialize_with_block
        return initialize_with_block(original, args, kwargs)

    setattr(initialize, ORIGINAL, original)
    setattr(initialize, BY_HOOK, by_hook)
    deepspeed.initialize = initialize
    when_imported("accelerate.utils.dataclasses", skip_dad_block_in_accelerate)
    return initialize


def config_source(ds_initialize, args: tuple, kwargs: dict):
    """The config ``deepspeed.initialize`` would read, in its order: ``config``, ``config_params``,
    ``args.deepspeed_config``, ``args.deepscale_config``; None if there is none or the call does
    not bind (DeepSpeed then raises its own error)."""
    import inspect
    try:
        given = inspect.signature(ds_initialize).bind(*args, **kwargs).arguments
    except TypeError:
        return None
    return config_in(given)[0]


def config_in(given: dict):
    """(config source, the attribute of ``args`` that holds it or None) of ``deepspeed.initialize``'s
    bound arguments, in its order (`config_source`); (None, None) if there is none."""
    for key in ("config", "config_params"):
        if given.get(key) is not None:
            return given[key], None
    for attr in ("deepspeed_config", "deepscale_config"):
        if getattr(given.get("args"), attr, None) is not None:
            return getattr(given["args"], attr), attr
    return None, None


def read_config(source):
    """A config source as DeepSpeed reads it: a dict, a JSON (hjson) file, or base64 JSON; None if unreadable."""
    if isinstance(source, dict):
        return source
    if not isinstance(source, (str, os.PathLike)):
        return None
    import json
    try:
        if os.path.exists(source):
            with open(source, "r", encoding="utf-8") as fh:
                text = fh.read()
        else:
            import base64
            text = base64.urlsafe_b64decode(source).decode("utf-8")
        try:
            loaded = json.loads(text)
        except ValueError:
            import hjson  # DeepSpeed's own parser, installed with it
            loaded = hjson.loads(text)
    except Exception:  # noqa: BLE001 -- unreadable here is unreadable for DeepSpeed: let it say so
        return None
    return loaded if isinstance(loaded, dict) else None


def has_dad_block(ds_initialize, args: tuple, kwargs: dict) -> bool:
    """Whether the config of this ``deepspeed.initialize`` call holds a ``"dad"`` block."""
    config = read_config(config_source(ds_initialize, args, kwargs))
    return config is not None and BLOCK_KEY in config


def skip_dad_block_in_accelerate(dataclasses_module) -> None:
    """Make Accelerate's DeepSpeed config walk leave the ``"dad"`` block alone (idempotent).

    Accelerate treats every ``"auto"`` string in the DeepSpeed config as a placeholder it must fill
    from the training arguments; ``"dad": {"mode": "auto"}`` would fail there with "`dad.mode`
    not found in kwargs". The block is dAD's: ``deepspeed.initialize`` strips it.
    """
    plugin = getattr(dataclasses_module, "DeepSpeedPlugin", None)
    original = getattr(plugin, "deepspeed_config_process", None)
    if original is None or getattr(original, _ACCELERATE_MARK, False):
        return
    import functools

    @functools.wraps(original)
    def deepspeed_config_process(self, prefix="", *args, **kwargs):
        if prefix == BLOCK_KEY + ".":  # the walk recurses through this method: skip the block's subtree
            return None
        return original(self, prefix, *args, **kwargs)

    setattr(deepspeed_config_process, _ACCELERATE_MARK, True)
    plugin.deepspeed_config_process = deepspeed_config_process
