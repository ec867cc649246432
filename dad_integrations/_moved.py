"""Old import paths that still work: the names a module lost to a move, each warning once.

A shim module (``dad_integrations.checkpoint``, ...) holds no code of its own: its ``__getattr__``
(PEP 562) fetches a moved name from its new home and issues one `FutureWarning` per name per
process, naming the new path (`FutureWarning`, not `DeprecationWarning`: scripts see it by default).
"""
from __future__ import annotations

import importlib
import threading
import warnings
from typing import Any, Callable, List, Mapping, Set, Tuple

from dad_integrations.logs import process_rank

_warned: Set[str] = set()  # "old.module.name"s already warned about in this process
_lock = threading.Lock()


def shim(old_module: str, moves: Mapping[str, str]) -> Tuple[List[str], Callable[[str], Any], Callable[[], List[str]]]:
    """``__all__``, ``__getattr__`` and ``__dir__`` for the shim ``old_module``: ``moves`` maps each
    old name to the module that now holds it under the same name (`import *` and ``dir()`` list
    them; each warns once)."""
    def __getattr__(name: str) -> Any:
        if name not in moves:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(moves[name]), name)
        _warn_once(f"{old_module}.{name}", f"{moves[name]}.{name}")
        return value

    return sorted(moves), __getattr__, lambda: sorted(moves)


def _warn_once(old: str, new: str) -> None:
    with _lock:  # once per name, even when two threads import it at the same moment
        if old in _warned:
            return
        _warned.add(old)
    if process_rank() == 0:  # every rank imports alike: rank 0 says it
        # stacklevel 3: past this helper and the module's __getattr__, to the line that imported it
        warnings.warn(f"{old} has moved to {new}; import it from there (the old path will be removed)",
                      FutureWarning, stacklevel=3)
