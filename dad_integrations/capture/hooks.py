"""Capture of factors: hooks that pair each forward call's input rows with its output gradient.

A forward hook keeps a reference to the call's input (autograd keeps it alive anyway) and
registers a hook on the call's output tensor, which receives exactly this call's output gradient.
Pairing through the output tensor, not call order, makes several calls per step (weight reuse,
recurrence, micro-steps) and activation checkpointing come out right: a forward never
back-propagated gets no gradient, and its input is dropped at the end of the step. While dynamo
traces, the same hooks take the compiled path (`compiled`), feeding the same ``pairs``.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from dad_integrations.capture import compiled
from dad_integrations.capture.rows import Block, Rows

RowsOfCall = Callable[[nn.Module, torch.Tensor, torch.Tensor], Rows]


def owner_of(module: nn.Module, attr: str) -> Tuple[Optional[nn.Module], str]:
    """The module holding dotted ``attr`` from ``module`` (None: no such path), and its last name."""
    *path, leaf = attr.split(".")
    for part in path:
        module = getattr(module, part, None)
    return module, leaf


def resolve(module: nn.Module, attr: str) -> torch.Tensor:
    """The tensor at dotted path ``attr`` from ``module`` (``"out_proj.weight"``), looked up now:
    under FSDP2 a module holds its unsharded parameters only while its forward runs."""
    owner, leaf = owner_of(module, attr)
    return getattr(owner, leaf)


class Use:
    """The row pairs of one use of a weight: what one layer's calls add to its gradient.

    ``kind`` is the pairs' row layout (`rows`: ``"linear"``, ``"conv1d"``, ``"embedding"``),
    ``block`` the rows of the weight's matrix view they cover (None: all), ``module`` the module
    whose forward runs the use, and ``attr`` the dotted path from it to the weight. A capture (the
    hooks, ``fed_by``) feeds one or several uses; ``enabled`` switches a use's capture off, hooks left in place.
    """

    fed_by: Optional["HookedCapture"] = None  # set by the capture that feeds this use

    def __init__(self, name: str, module: nn.Module, kind: str, attr: str = "weight", block: Block = None):
        self.name, self.module, self.kind, self.attr, self.block = name, module, kind, attr, block
        self.enabled = True
        self.pairs: List[Rows] = []
        # rows this step's forwards will give the use, counted as they run (captured or not; None:
        # a call this capture cannot count ahead of its gradient): what routes are decided on
        # before backward (`exchange.ahead`)
        self.forward_rows: Optional[int] = 0

    def param(self) -> torch.Tensor:
        """The weight this use adds to, as the module holds it now (read at every captured forward:
        a plain attribute without `resolve`'s split)."""
        attr = self.attr
        return resolve(self.module, attr) if "." in attr else getattr(self.module, attr)

    def take(self) -> List[Rows]:
        """The window's pairs; clears them (a capture: and drops inputs that never got a gradient)."""
        pairs, counted = self.pairs, self.forward_rows
        self.clear()
        self.forward_rows = counted  # the step's count holds until the step ends
        return pairs

    def clear(self) -> None:
        self.pairs = []

    def __getstate__(self) -> dict:  # rows never travel with a pickled model
        return dict(self.__dict__, pairs=[], enabled=False)


def call_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """A forward hook's first input, positional or keyword."""
    return args[0] if args else next(iter(kwargs.values()))


class HookedCapture:
    """Base of a capture whose hooks feed one or several uses (a linear layer's weight, an attention
    module's projections, a recurrent layer's weights, a grouped convolution's groups): it registers
    its hooks through `hook` (`hook_input_calls`: rows from each call's input, by `_add`), calls
    `opened` at every forward it captures and pairs each call with its own output gradient through
    `on_grad` (a hook on the output tensor; `clear` drops what never got one) or, compiled,
    `compiled_key` (its rows arrive at `_add_delivered`).

    Pickled with the model (its forward hooks hold it), it goes detached: hooks that do nothing,
    no synchroniser; `remove_detached_captures` removes it from a loaded model.
    """

    _calls = 0

    def __init__(self, name: str, module: nn.Module, by_key: Dict[str, Use],
                 on_forward: Optional[Callable[[], None]] = None):
        self.name, self.module, self.by_key, self.uses = name, module, by_key, list(by_key.values())
        for use in self.uses:
            use.fed_by = self
        self._on_forward = on_forward
        self._handles: list = []
        self.detached = False
        self.arrived: Optional[Callable[[], None]] = None  # told when a compiled call's rows arrive
        self._key: Optional[torch.Tensor] = None  # a subclass that captures under compile registers one
        self._pending: Dict[int, Callable] = {}

    def compiled_key(self) -> torch.Tensor:
        """The key of this capture's compiled path (`compiled.tap`), registered on first use."""
        if self._key is None:
            self._key = compiled.register(self._delivered)
        return self._key

    def on_grad(self, output: torch.Tensor, take: Callable[[torch.Tensor], None]) -> None:
        """Call ``take(grad)`` (detached) when ``output``'s gradient arrives."""
        key = self._calls
        self._calls += 1
        self._pending[key] = take
        output.register_hook(functools.partial(self._grad_hook, key))

    def _grad_hook(self, key: int, grad: torch.Tensor) -> None:
        take = self._pending.pop(key, None)
        if take is not None:
            take(grad.detach())

    def _wanted(self) -> bool:
        """Whether some use keeps rows now."""
        return any(u.enabled for u in self.uses)

    def _delivered(self, saved: list, grads: list) -> None:
        """A compiled call's saved tensors and outputs' gradients (in its backward, eagerly)."""
        if not self.detached and grads[0] is not None and self._wanted():
            if self.arrived is not None:
                self.arrived()
            self._add_delivered(saved, grads)

    def hook(self, handle) -> None:
        """Keep a hook handle, removed with the capture."""
        self._handles.append(handle)

    def hook_input_calls(self) -> None:
        """Capture each call from its input and output gradient (`_input_hook`, rows by `_add`)."""
        self.compiled_key()
        self.hook(self.module.register_forward_hook(self._input_hook, with_kwargs=True))

    def _input_hook(self, module: nn.Module, args: tuple, kwargs: dict, output):
        if self.detached or not (torch.is_grad_enabled() and isinstance(output, torch.Tensor)
                                 and output.requires_grad):
            return None
        if not self.uses[0].param().requires_grad:
            # frozen for now (a GAN's other half): no gradient will take these rows, and kept they
            # would join the next step that trains the weight
            return None
        x = call_input(args, kwargs)
        if compiled.compiling():
            # the output wrapped so that its backward delivers the rows; whether a use is enabled
            # is read when they arrive: a flag read while tracing would be guarded on (recompiles)
            for u in self.uses:
                u.forward_rows = None
            return compiled.tap(self.compiled_key(), [x], [output])[0]
        self.opened()  # also when disabled: the step's window opens here
        self.count_rows(x)
        if self._wanted():
            x = x.detach()
            self.on_grad(output, lambda grad: self._add(x, grad))

    def _add(self, x: torch.Tensor, grad: torch.Tensor) -> None:  # pragma: no cover - `_input_hook`'s users
        raise NotImplementedError

    def count_rows(self, x: torch.Tensor) -> None:
        """Note the rows a call of input ``x`` will give each use (`Use.forward_rows`); a capture that
        cannot tell before the gradient leaves them unknown."""
        for u in self.uses:
            u.forward_rows = None

    def _add_delivered(self, saved: list, grads: list) -> None:
        """A compiled call's rows (`_input_hook`'s, by default)."""
        self._add(saved[0], grads[0])

    def opened(self) -> None:
        """A captured forward runs: the step's window opens (whether or not rows are kept)."""
        if self._on_forward is not None and not self.detached:
            self._on_forward()

    def clear(self) -> None:
        """Drop the rows of the window, and whatever waits for a gradient."""
        for u in self.uses:
            u.pairs = []
            u.forward_rows = 0
        self._pending.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        compiled.unregister(self._key)
        self._key = None
        self.clear()

    transient: tuple = ("_pending",)  # names of per-step attributes (dicts): pickled empty

    def __getstate__(self) -> dict:
        state = dict(self.__dict__, _on_forward=None, detached=True, arrived=None, _key=None)
        state.update({k: {} for k in self.transient})
        return state


class ModuleCapture(HookedCapture, Use):
    """Collects ``(left, right)`` row pairs of one module's calls: one use (see `layers`) that is its
    own capture, its rows from ``rows_of_call(module, input, output_grad)``."""

    def __init__(self, name: str, module: nn.Module, kind: str, rows_of_call: RowsOfCall,
                 on_forward: Optional[Callable[[], None]] = None,
                 count_of_call: Optional[Callable[[torch.Tensor], int]] = None):
        Use.__init__(self, name, module, kind)
        HookedCapture.__init__(self, name, module, {"weight": self}, on_forward)
        self.rows_of_call = rows_of_call
        self.count_of_call = count_of_call
        self.hook_input_calls()

    def _add(self, x: torch.Tensor, grad: torch.Tensor) -> None:
        self.pairs.append(self.rows_of_call(self.module, x, grad))

    def count_rows(self, x: torch.Tensor) -> None:
        if self.count_of_call is None or self.forward_rows is None:
            self.forward_rows = None
        else:
            self.forward_rows += self.count_of_call(x)

    def __getstate__(self) -> dict:
        return dict(HookedCapture.__getstate__(self), pairs=[], enabled=False)


class ForwardStartHook:
    """A forward pre-hook on the model's root that tells its owner a forward starts (a route
    trial's step clock: `route_trial.StepClock`). Like the captures it pickles detached (a hook
    that does nothing, no owner), and `remove_detached_captures` removes it from a loaded model."""

    def __init__(self, module: nn.Module, on_forward: Callable[[], None]):
        self._on_forward = on_forward
        self.detached = False
        self._handle = module.register_forward_pre_hook(self, prepend=True)

    def __call__(self, module: nn.Module, args) -> None:
        # not while dynamo traces: a clock read there is a graph break (a compiled step's span
        # starts at its backward instead)
        if self._on_forward is not None and not compiled.compiling():
            self._on_forward()

    def remove(self) -> None:
        self._handle.remove()

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _on_forward=None, detached=True)


def remove_detached_captures(model: nn.Module) -> int:
    """Remove the hooks of the captures that came with a loaded (unpickled) ``model``; returns how many."""
    removed = set()
    for module in model.modules():
        for hook in list(module._forward_hooks.values()) + list(module._forward_pre_hooks.values()):
            capture = getattr(hook, "__self__", None)
            if getattr(hook, "func", None) is not None:  # a functools.partial of a capture's method
                capture = getattr(hook.func, "__self__", capture)
            if isinstance(hook, ForwardStartHook):
                capture = hook
            if (isinstance(capture, (HookedCapture, ForwardStartHook))
                    and getattr(capture, "detached", False)
                    and id(capture) not in removed):
                capture.remove()
                removed.add(id(capture))
    return len(removed)
