"""The optimizer's state dict with this rank's dAD state under ``"dad"`` (rank-dAD warm starts,
error-feedback residuals, weights sent dense for good), loaded at once or when dAD attaches.

A base of `horovod_dad.optimizer._DADOptimizerMixin`, which holds the state these methods read;
``super()`` reaches the wrapped optimizer's class.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping


class OptimizerState:
    """The state-dict half of `DADOptimizer`'s classes (no state of its own)."""

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state dict, plus this rank's dAD state under ``"dad"``
        (rank-dAD warm starts, error-feedback residuals, weights sent dense for good)."""
        state = super().state_dict()
        if self._dad_sync is not None:
            state["dad"] = self._dad_sync.state_dict()
        elif self._pending_dad_state is not None:
            state["dad"] = self._pending_dad_state
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load the wrapped optimizer's state (and dAD's, when the dict carries it)."""
        if self._backward_pending():
            raise AssertionError("optimizer.load_state_dict() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize()")
        state_dict = dict(state_dict)
        dad_state = state_dict.pop("dad", None)
        self._synchronized = False
        self._should_synchronize = True
        super().load_state_dict(state_dict)
        if dad_state is not None and self._dad_sync is not None:
            self._dad_sync.load_state_dict(dad_state)
        elif dad_state is not None:  # loaded when dAD attaches (model found at the first forward)
            self._pending_dad_state = dad_state
