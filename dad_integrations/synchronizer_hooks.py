"""The synchroniser's hooks: per parameter around each gradient accumulation (the window's
bookkeeping, and a unit's readiness outside DDP), and on the model's and the captured layers' forward.

`DADSynchronizer`'s base (it holds the state these methods read).
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from dad_integrations.capture.compiled import compiling
from dad_integrations.capture.hooks import ForwardStartHook
from dad_integrations.capture.units import FactorUnit
from dad_integrations.routing.trial import StepClock, in_backward


class ParamHooks:
    """The hooks `DADSynchronizer` registers."""

    def _init_hooks(self, model: nn.Module) -> None:
        """Register the hooks on ``model`` and on the plan's parameters (the step's state is set)."""
        self._unit_of = {id(q): u for u in self._plan.units for q in u.params}
        self._param_ids = {u.index: tuple(id(q) for q in u.params) for u in self._plan.units}
        # units the next step sends dense whatever their rows (`RoutePolicy.dense_for_sure`): their
        # hooks skip the window's bookkeeping (priors, marks); refreshed after every step
        self._bookless: frozenset = frozenset()
        self._param_hooks: list = []
        self._params_hooked = False
        self._set_param_hooks(True)
        # a step's span for route trials starts at its forward (what capture adds counts too)
        self._clock = StepClock()
        self._hooks = [ForwardStartHook(model, self._on_root_forward)]

    def _set_param_hooks(self, on: bool) -> None:
        """Register (``on``) or remove the per-parameter hooks: the window's bookkeeping around each
        accumulation, and readiness outside DDP. Only a DDP-driven step whose every unit is sure to
        go dense runs without them, changed between steps (`ddp_step.DDPSteps._park_hooks`)."""
        if on == self._params_hooked:
            return
        self._params_hooked = on
        if not on:
            for h in self._param_hooks:
                h.remove()
            self._param_hooks = []
            return
        units, dense = self._plan.units, self._plan.dense
        self._param_hooks = [p.register_hook(functools.partial(self._before_accumulate, u, p))
                             for u in units for p in u.params]
        self._param_hooks += [p.register_post_accumulate_grad_hook(functools.partial(self._after_accumulate, u))
                              for u in units for p in u.params]
        self._param_hooks += [p.register_post_accumulate_grad_hook(self._after_dense_accumulate) for _, p in dense]

    def _on_root_forward(self) -> None:
        """The model's forward: a training step may start here (`routing.trial.StepClock`); an
        evaluation under ``no_grad``, a recomputation in backward or a micro-step does not."""
        if self._window is None:
            self._clock.forward()

    def _on_forward(self) -> None:
        """A captured layer's forward: refused while the last backward's exchange is pending."""
        window = self._window
        if not compiling() and window is not None and window.future is not None and not in_backward():
            raise RuntimeError(
                f"a forward pass started after backward_passes_per_step={self.backward_passes_per_step} "
                f"backward pass(es) without synchronize(): call sync.synchronize() (or the optimizer's "
                f"step) after every step, accumulate micro-steps inside no_sync(), or increase "
                f"backward_passes_per_step")

    def _before_accumulate(self, unit: FactorUnit, p: nn.Parameter, grad: torch.Tensor) -> None:
        window = self._current_window()
        if unit.index in self._bookless:  # dense whatever .grad held before: no prior to keep
            window.touch(p)
        else:
            window.before_accumulate(p, unit)

    def _after_accumulate(self, unit: FactorUnit, p: nn.Parameter) -> None:
        window = self._current_window()
        if unit.index in self._bookless:  # no rows to mark; other gradients' marks still move
            window.note_accumulated(p)
        else:
            window.after_accumulate(p, unit)
        if self._accumulating or self._driven_by_ddp:  # DDP says when a unit is ready (ddp_hook)
            return
        passes = window.count_pass(p)
        if passes > self.backward_passes_per_step:  # its rows may be on the wire: fail at synchronize()
            window.twice.append(unit.name)
        k = self.backward_passes_per_step
        if passes >= k and all(window.passes.get(q, 0) >= k for q in self._param_ids[unit.index]):
            window.ready[unit.index].set()
            self._dispatch(window, self._exchange)

    def _after_dense_accumulate(self, p: nn.Parameter) -> None:
        window = self._current_window()
        window.touch(p)
        window.note_accumulated(p)  # it may share a DDP bucket with factor weights' gradients
        if not (self._accumulating or self._driven_by_ddp):
            window.count_pass(p)
