"""The registry of layer kinds: which modules' weights dAD rebuilds from factors, and how.

A kind is one module in this package holding one `LayerKind` subclass, registered with
`register_kind` (Opacus's ``grad_sample/`` layout). It declares ``accepts(module)`` (``priority``
orders kinds: ``nn.MultiheadAttention`` claims its child ``out_proj`` before ``linear`` can),
``claims(module)`` (the parameters it rebuilds, each by which uses) and ``capture(...)`` (the hooks,
and the `capture.Use` objects they feed: row layout, row block, module). Byte costs follow from the
uses' layouts and blocks, so the router and the planner need nothing per kind. A parameter no kind
claims falls to the coverage floor (`capture.assign.build_plan`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, Type

import torch
from torch import nn

from dad_integrations.capture.hooks import ModuleCapture, Use
from dad_integrations.capture.rows import Rows
from dad_integrations.config import add_layer_kind


@dataclass(frozen=True)
class Claim:
    """One parameter of a module that a kind rebuilds from factors.

    ``attr`` is its dotted path from the module (``"weight"``, ``"out_proj.weight"``,
    ``"weight_hh_l1"``); ``uses`` the keys of the capture's uses whose rows add up to its gradient
    (a weight) or, with ``bias``, the one use whose output-gradient rows sum to it.
    """

    attr: str
    uses: Tuple[str, ...] = ("weight",)
    bias: bool = False


class LayerKind:
    """One layer kind; subclasses live one per module in `layers` and register with `register_kind`."""

    name: str = ""
    priority: int = 0
    # whether the kind captures while dynamo traces (``torch.compile``: `capture.compiled`); a kind
    # that does not has its weights routed from their dense gradients where compile is in use
    compiles: bool = True
    capture_class: Optional[type] = None  # the default `capture`'s hooks (a `HookedCapture` with ``by_key``)

    def accepts(self, module: nn.Module) -> bool:
        """Whether this kind captures ``module`` (stock forward only: a subclass with its own
        forward may use the weight differently)."""
        raise NotImplementedError

    def claims(self, module: nn.Module) -> List[Claim]:
        """The parameters of an accepted ``module`` that its uses rebuild."""
        raise NotImplementedError

    def capture(self, name: str, module: nn.Module, on_forward: Optional[Callable[[], None]]
                ) -> Tuple[object, Dict[str, Use]]:
        """Install the hooks on ``module``: ``(capture, uses by key)``. The capture has ``name``,
        ``uses``, ``clear()`` and ``remove()`` (`capture.ModuleCapture`, `capture.HookedCapture`);
        by default a ``capture_class(name, module, on_forward)`` with its uses in ``by_key``."""
        if self.capture_class is None:
            raise NotImplementedError
        c = self.capture_class(name, module, on_forward)
        return c, dict(c.by_key)


class ModuleKind(LayerKind):
    """A kind whose modules (a ``base`` running its own forward) have one use, their ``weight``, fed
    by a `ModuleCapture` with rows ``rows(module, input, output_grad)`` in ``layout``; a ``bias``
    rides."""

    base: Optional[type] = None
    layout = "linear"
    rows: Callable[[nn.Module, torch.Tensor, torch.Tensor], Rows]
    # the rows a call of input x gives, before its gradient (`capture.Use.forward_rows`); None: not
    # known ahead (routes are then decided on the exchanged counts only)
    forward_count: Optional[Callable[[torch.Tensor], int]] = None

    def accepts(self, module: nn.Module) -> bool:
        return self.base is not None and runs_stock_forward(module, self.base)

    def claims(self, module: nn.Module) -> List[Claim]:
        return [Claim("weight")] + ([Claim("bias", bias=True)] if getattr(module, "bias", None) is not None else [])

    def capture(self, name, module, on_forward):
        c = ModuleCapture(name, module, self.layout, type(self).rows, on_forward, type(self).forward_count)
        return c, {"weight": c}


_KINDS: Dict[str, LayerKind] = {}


def register_kind(cls: Type[LayerKind]) -> Type[LayerKind]:
    """Class decorator: register one instance of a `LayerKind` under its ``name``, a name the config
    key ``layer_kinds`` accepts (captured by default by configs made after). Register it on every
    rank before attaching dAD; the first step's check sends a kind's wrong rows dense, with a warning."""
    if not isinstance(cls, type) or not issubclass(cls, LayerKind):
        raise TypeError(f"register_kind: expected a LayerKind subclass, got {cls!r}")
    if not cls.name or cls.name in _KINDS:
        raise ValueError(f"layer kind {cls.__name__}: needs a new name, got {cls.name!r}")
    _KINDS[cls.name] = cls()
    add_layer_kind(cls.name)
    return cls


def registered_kinds() -> List[LayerKind]:
    """Every registered kind, highest priority first (ties: registration order)."""
    return sorted(_KINDS.values(), key=lambda k: -k.priority)


def get_kind(name: str) -> LayerKind:
    return _KINDS[name]


def kind_of(module: nn.Module, allowed: Optional[Tuple[str, ...]] = None) -> Optional[LayerKind]:
    """The highest-priority kind (among ``allowed`` names) that accepts ``module``, else None."""
    for kind in registered_kinds():
        if (allowed is None or kind.name in allowed) and kind.accepts(module):
            return kind
    return None


def layer_kind(module: nn.Module) -> Optional[str]:
    """The name of the kind that captures ``module``, else None."""
    kind = kind_of(module)
    return kind.name if kind is not None else None


def leading_rows(x: torch.Tensor) -> int:
    """The rows of an input whose last dimension is the features (every leading one flattened)."""
    return x.numel() // x.shape[-1] if x.dim() else 1


def runs_stock_forward(module: nn.Module, base: type) -> bool:
    """``module`` is a ``base`` that runs ``base``'s own forward."""
    return isinstance(module, base) and type(module).forward is base.forward
