"""Rows that autograd has already added to a weight's gradient (FSDP2's post-backward order)."""
from __future__ import annotations

import functools
from typing import Dict, List, Sequence

import torch
from torch import nn

from dad_integrations.capture.compiled import compiling
from dad_integrations.capture.hooks import Use, resolve
from dad_integrations.capture.rows import Rows
from dad_integrations.capture.units import FactorUnit


class CommittedRows:
    """The captured rows of each unit that autograd has already added to the weight's gradient.

    Under FSDP2 a module's post-backward can run before the weight's ``AccumulateGrad`` (it is
    triggered by the gradients of the module's inputs), while the capture already holds rows of a
    later call. So rows move here only from a post-accumulate-grad hook on the parameter the module
    used in forward (FSDP's unsharded one), registered from a forward hook that runs first (before
    FSDP's own post-forward reshards a ``fully_shard``-ed module); see ``docs/internals/fsdp2_notes.md``.
    """

    def __init__(self, units: Sequence[FactorUnit]):
        self._committed: Dict[int, List[Rows]] = {}  # per capture
        self._watched: Dict[int, tuple] = {}         # per used parameter: (parameter, handle)
        self._hooks = [c.module.register_forward_hook(functools.partial(self._watch, u, c.attr), prepend=True)
                       for u in units for c in u.uses]
        # compiled: the forward hook is traced (no side effects there), so the watch starts when a
        # compiled call's rows arrive, in backward, while FSDP holds the unsharded parameter and
        # before the compiled backward's gradients are accumulated (`capture.compiled`)
        for u in units:
            for c in u.uses:
                if c.fed_by is not None:
                    c.fed_by.arrived = functools.partial(self._watch_now, u, c)

    def take(self, capture: Use) -> List[Rows]:
        """The committed rows of ``capture`` since the last take."""
        return self._committed.pop(id(capture), [])

    def remove(self) -> None:
        for handle in self._hooks + [h for _, h in self._watched.values()]:
            handle.remove()
        self._watched.clear()
        self._committed.clear()

    def _watch_now(self, unit: FactorUnit, use: Use) -> None:
        self._watch(unit, use.attr, use.module, (), None)

    def _watch(self, unit: FactorUnit, attr: str, module: nn.Module, args, output) -> None:
        if compiling():
            return
        p = resolve(module, attr)
        if id(p) not in self._watched and p.requires_grad:
            self._watched[id(p)] = (p, p.register_post_accumulate_grad_hook(functools.partial(self._commit, unit)))

    def _commit(self, unit: FactorUnit, param: torch.Tensor) -> None:
        """Autograd has added every call's contribution captured so far to the gradient."""
        for capture in unit.uses:  # (not `take()`: inputs still waiting for their gradient stay)
            self._committed.setdefault(id(capture), []).extend(capture.pairs)
            capture.pairs = []

