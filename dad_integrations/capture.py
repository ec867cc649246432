"""Capture of factors: hooks that pair each forward call's input rows with its output gradient.

A forward hook keeps a reference to the call's input (autograd keeps the same tensor alive for the
weight gradient, so this costs no memory) and registers a hook on the call's output tensor; that
hook receives exactly this call's output gradient. Pairing through the output tensor, not through
call order, makes several calls per step (weight reuse, recurrence, accumulation micro-steps) and
activation checkpointing come out right: a forward that autograd never back-propagates through
(non-reentrant checkpointing's recomputation) gets no gradient and its input is dropped at the
end of the step; a reentrant recomputation's first forward runs without grad and is not captured.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from .layers import Rows, rows_of_call


class ModuleCapture:
    """Collects ``(left, right)`` row pairs of one module's calls (see `layers`).

    ``on_forward`` is called at every captured forward (the synchroniser opens a step's window
    there, enabled or not); ``enabled`` switches the capture of rows off without removing the hooks.
    """

    def __init__(self, name: str, module: nn.Module, kind: str,
                 on_forward: Optional[Callable[[], None]] = None):
        self.name, self.module, self.kind = name, module, kind
        self.enabled = True
        self.pairs: List[Rows] = []
        self._pending: Dict[int, torch.Tensor] = {}
        self._calls = 0
        self._on_forward = on_forward
        self._handle = module.register_forward_hook(self._forward_hook, with_kwargs=True)

    def _forward_hook(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        if not (torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad):
            return
        if self._on_forward is not None:  # also when disabled: the step's window opens here
            self._on_forward()
        if not self.enabled:
            return
        inputs = args[0] if args else next(iter(kwargs.values()))
        key = self._calls
        self._calls += 1
        self._pending[key] = inputs.detach()
        output.register_hook(functools.partial(self._grad_hook, key))

    def _grad_hook(self, key: int, grad: torch.Tensor) -> None:
        inputs = self._pending.pop(key, None)
        if inputs is not None:
            self.pairs.append(rows_of_call(self.kind, self.module, inputs, grad.detach()))

    def take(self) -> List[Rows]:
        """The window's pairs; clears them and drops inputs that never got a gradient."""
        pairs, self.pairs = self.pairs, []
        self._pending.clear()
        return pairs

    def clear(self) -> None:
        self.pairs = []
        self._pending.clear()

    def remove(self) -> None:
        self._handle.remove()
        self.clear()
