"""Which parameters go through factors and which through dense all-reduce.

A trainable parameter is a *factor unit* when every module that registers it is a captured layer
(`layers.layer_kind`) holding it as ``weight``: then the gradient is the sum of what its uses'
factors rebuild. GPT-2's tied ``wte``/``lm_head`` weight is one unit with an embedding use and a
linear use. A bias rides with its layer when that layer is its only owner. Everything else —
norms, parameters of other modules, layers excluded by name — is synchronised densely.
"""
from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from torch import nn

from .capture import ModuleCapture
from .config import DADConfig
from .layers import layer_kind


def param_shape(p: nn.Parameter) -> Tuple[int, ...]:
    """A parameter's full shape, also where an engine keeps only a partition in ``p.data``
    (DeepSpeed ZeRO-3 empties it and records the shape as ``ds_shape``)."""
    return tuple(getattr(p, "ds_shape", None) or p.shape)


@dataclass
class BiasUse:
    """A bias whose gradient is the sum of one captured layer's output-gradient rows."""

    name: str
    param: nn.Parameter
    capture: ModuleCapture


@dataclass
class FactorUnit:
    """One weight synchronised through factors, with its uses and the biases that ride with it.

    Per-step state (readiness, passes, priors) lives in the step's `StepWindow`; rank-dAD state
    (warm starts, residuals) in the rank codec. What stays here is the unit's route history.
    """

    index: int
    name: str
    param: nn.Parameter
    uses: List[ModuleCapture]
    biases: List[BiasUse]
    dense_only: bool = False          # failed the first-step check: dense from then on
    rows_unused: bool = False         # rank-reduced from its dense gradient: rows not captured

    @property
    def factors_only(self) -> bool:
        """All uses are linear-like, so rank reduction may run on the factors."""
        return all(c.kind != "embedding" for c in self.uses)

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
    captures: List[ModuleCapture]

    def signature(self) -> List[list]:
        """What every rank must agree on, in order: names, shapes, dtypes and routes."""
        sig = [["factor", u.name, list(param_shape(u.param)), str(u.param.dtype), u.kinds,
                [b.name for b in u.biases]] for u in self.units]
        sig += [["dense", n, list(param_shape(p)), str(p.dtype)] for n, p in self.dense]
        return sig

    def signature_bytes(self) -> bytes:
        return json.dumps(self.signature(), separators=(",", ":")).encode()


def build_plan(model: nn.Module, config: DADConfig, on_forward=None) -> SyncPlan:
    """Assign every trainable parameter of ``model`` to a factor unit or to the dense path."""
    names: Dict[int, str] = {}
    trainable: List[nn.Parameter] = []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in names:
            names[id(p)] = name
            trainable.append(p)

    # Every (module, attribute) that registers each parameter: a parameter shared with a module
    # dAD does not capture must go dense, since its factors would miss that use.
    owners: Dict[int, List[Tuple[str, nn.Module, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None and p.requires_grad:
                entry = (mod_name, module, attr)
                if entry not in owners.setdefault(id(p), []):
                    owners[id(p)].append(entry)

    def capturable(mod_name: str, module: nn.Module) -> Optional[str]:
        kind = layer_kind(module)
        if kind is None or kind not in config.layer_kinds:
            return None
        if any(fnmatch.fnmatchcase(mod_name, pat) for pat in config.exclude):
            return None
        return kind

    # refuse before any hook is installed, so that a refused model is left untouched
    for mod_name, module in model.named_modules():
        if capturable(mod_name, module) == "embedding" and module.sparse and module.weight.requires_grad:
            raise ValueError(f"module {mod_name!r}: sparse embedding gradients are not supported by dAD; "
                             f"use sparse=False or exclude the module with the 'exclude' config key")

    captures: Dict[int, ModuleCapture] = {}
    units: List[FactorUnit] = []
    unit_params = set()
    for p in trainable:
        regs = owners.get(id(p), [])
        if regs and all(attr == "weight" and capturable(n, m) for n, m, attr in regs) and len(param_shape(p)) == 2:
            uses = []
            for mod_name, module, _ in regs:
                if id(module) not in captures:
                    captures[id(module)] = ModuleCapture(mod_name, module, layer_kind(module), on_forward)
                uses.append(captures[id(module)])
            units.append(FactorUnit(0, names[id(p)], p, uses, []))
            unit_params.add(id(p))

    dense: List[Tuple[str, nn.Parameter]] = []
    by_module = {id(c.module): c for c in captures.values()}
    unit_of_module = {id(c.module): u for u in units for c in u.uses}
    for p in trainable:
        if id(p) in unit_params:
            continue
        regs = owners.get(id(p), [])
        if (len(regs) == 1 and regs[0][2] == "bias" and id(regs[0][1]) in by_module
                and by_module[id(regs[0][1])].kind != "embedding"):
            unit_of_module[id(regs[0][1])].biases.append(
                BiasUse(names[id(p)], p, by_module[id(regs[0][1])]))
        else:
            dense.append((names[id(p)], p))

    # Backward visits layers roughly in reverse registration order; so does the exchange, so that
    # each layer's collective can start as soon as its gradient rows exist.
    units.reverse()
    for i, u in enumerate(units):
        u.index = i
    return SyncPlan(units, dense, list(captures.values()))
