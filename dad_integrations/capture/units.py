"""Factor units and the plan they form: which parameters go through factors, which through dense
all-reduce (plain data; `capture.assign.build_plan` makes them from a model).

A trainable parameter is a *factor unit* when every module that registers it is a captured layer:
its gradient is the sum of what its uses' factors rebuild (GPT-2's tied ``wte``/``lm_head``: an
embedding use and a linear use). A bias rides with its layer when that layer is its only owner.
Every other parameter with two or more dimensions is a unit *without uses*: the rank routes from
its dense gradient, as PowerSGD views it. The rest (norms, other biases, excluded layers) is dense.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import List, Optional, Tuple

from torch import nn

from dad_integrations.builtin_routes import DENSE
from dad_integrations.capture.hooks import Use
from dad_integrations.capture.rows import matrix_shape


def param_shape(p: nn.Parameter) -> Tuple[int, ...]:
    """A parameter's full shape, also where an engine keeps only a partition in ``p.data``
    (DeepSpeed ZeRO-3 empties it and records the shape as ``ds_shape``)."""
    return tuple(getattr(p, "ds_shape", None) or p.shape)


@dataclass
class BiasUse:
    """A bias whose gradient is the sum of one captured use's output-gradient rows (``capture``),
    plus those of ``more`` uses of the same weight where the bias is split in row blocks as the
    weight is (a packed attention projection called on q, k and v slices)."""

    name: str
    param: nn.Parameter
    capture: Use
    more: Tuple[Use, ...] = ()

    @property
    def uses(self) -> Tuple[Use, ...]:
        return (self.capture,) + tuple(self.more)


@dataclass
class FactorUnit:
    """One weight synchronised through factors, with its uses and the biases that ride with it.

    Per-step state (readiness, passes, priors) lives in the step's `StepWindow`; rank-dAD state
    (warm starts, residuals) in the rank codec. What stays here is the unit's route history.
    """

    index: int
    name: str
    param: nn.Parameter
    uses: List[Use]
    biases: List[BiasUse]
    dense_only: bool = False          # failed the first-step check: dense from then on
    rows_unused: bool = False         # rank-reduced from its dense gradient: rows not captured

    @property
    def shape(self) -> Tuple[int, int]:
        """The weight's matrix view, ``(shape[0], prod(shape[1:]))`` (PowerSGD's)."""
        return matrix_shape(param_shape(self.param))

    @property
    def has_factors(self) -> bool:
        """Whether the unit has uses (without, its only routes are dense and the rank routes)."""
        return bool(self.uses)

    @property
    def blocks(self) -> Optional[Tuple[Optional[Tuple[int, int]], ...]]:
        """Per use, its row block of the matrix view; None where every use covers every row."""
        blocks = tuple(c.block for c in self.uses)
        return blocks if any(b is not None for b in blocks) else None

    @property
    def factors_only(self) -> bool:
        """All uses are linear-like over whole rows, so rank reduction may run on the factors."""
        return self.has_factors and self.blocks is None and all(c.kind != "embedding" for c in self.uses)

    @property
    def kinds(self) -> List[str]:
        return [c.kind for c in self.uses]

    @property
    def params(self) -> List[nn.Parameter]:
        """The weight, then the biases that ride with it."""
        return [self.param] + [b.param for b in self.biases]

    @property
    def bias_numel(self) -> int:
        return sum(b.param.numel() for b in self.biases)

    def set_dense_only(self, dense_only: bool) -> None:
        """Route the unit through dense all-reduce for good; its rows are then of no use."""
        self.dense_only = dense_only
        self.update_capture()

    def stop_using_rows(self) -> None:
        """The unit is reduced from its dense gradient from now on: stop capturing rows."""
        self.rows_unused = True
        self.update_capture()

    def update_capture(self) -> None:
        """Capture the unit's rows only while some route can use them."""
        for capture in self.uses:
            capture.enabled = not (self.dense_only or self.rows_unused)


@dataclass
class SyncPlan:
    units: List[FactorUnit]
    dense: List[Tuple[str, nn.Parameter]]   # synchronised by bucketed all-reduce every step
    captures: List[Use]

    def signature(self) -> List[list]:
        """What every rank must agree on, in order: names, shapes, dtypes and routes."""
        sig = [["factor", u.name, list(param_shape(u.param)), str(u.param.dtype), u.kinds,
                [b.name for b in u.biases]] for u in self.units]
        sig += [[DENSE, n, list(param_shape(p)), str(p.dtype)] for n, p in self.dense]
        return sig

    def signature_bytes(self) -> bytes:
        return json.dumps(self.signature(), separators=(",", ":")).encode()
