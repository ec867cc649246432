"""`ModelFinder`: the module that holds an optimizer's parameters, found at its first forward.

``hvd.DistributedOptimizer`` needs no model: it hooks the parameters themselves. dAD captures the
inputs of the layers that use them, so it needs the modules, and a parameter does not know its
module. A global forward pre-hook (``torch.nn.modules.module.register_module_forward_pre_hook``)
watches every module's forward from the optimizer's construction on. Pre-hooks run outermost
first, so the first module seen whose parameters include any of the optimizer's is the model the
script calls; it is handed over before its forward runs, so that hooks attached to it (and to its
submodules) already see that forward. The hook is removed once it has found one, and when the
optimizer is collected.
"""
from __future__ import annotations

import weakref
from typing import Callable, Iterable, Optional

from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook


class ModelFinder:
    """Calls ``on_found(module)`` at the first forward of a module holding any of ``params``.

    ``on_found`` must be a bound method: only a weak reference to it is kept, so that a pending
    finder does not keep its optimizer alive (a dead one removes the hook).
    """

    def __init__(self, params: Iterable[nn.Parameter], on_found: Callable[[nn.Module], None]):
        self._ids = frozenset(id(p) for p in params)
        self._on_found = weakref.WeakMethod(on_found)
        self._unrelated: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # seen, none of ours
        self._handle: Optional[object] = register_module_forward_pre_hook(self._pre_hook)
        weakref.finalize(on_found.__self__, self.remove)

    @property
    def pending(self) -> bool:
        """No module has been found yet."""
        return self._handle is not None

    def remove(self) -> None:
        """Stop watching (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _pre_hook(self, module: nn.Module, args: tuple) -> None:
        if self._handle is None or module in self._unrelated:
            return
        if not any(id(p) in self._ids for p in module.parameters()):
            self._unrelated.add(module)  # a model of another optimizer, a teacher, a metric
            return
        on_found = self._on_found()
        self.remove()
        if on_found is not None:
            on_found(module)
