"""Which trainable parameters are factor units, and which go dense: `build_plan`.

Kinds claim parameters by priority (`capture.layers.registry`); a parameter is a factor unit when
every registration of it is claimed as a weight. The units and the plan they form are plain data
(`capture.units`).
"""
from __future__ import annotations

import fnmatch
import logging
from typing import Dict, List, Sequence, Tuple

from torch import nn

from dad_integrations.capture.hooks import Use, owner_of
from dad_integrations.capture.layers import Claim, LayerKind, kind_of, registered_kinds
from dad_integrations.capture.units import BiasUse, FactorUnit, SyncPlan, param_shape
from dad_integrations.config import DADConfig
from dad_integrations.logs import OnceLogger, process_rank

log = logging.getLogger(__name__)
_log_once = OnceLogger(log, level=logging.INFO)


def build_plan(model: nn.Module, config: DADConfig, on_forward=None, compiled: bool = False) -> SyncPlan:
    """Assign every trainable parameter of ``model`` to a factor unit or to the dense path (the rules:
    `capture.units`). A bias rides with its use's unit where that use covers the whole weight. With
    ``compiled``, kinds that cannot capture while dynamo traces (``LayerKind.compiles`` False) claim
    nothing: their weights become units without uses."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]  # (shared ones once)
    names: Dict[int, str] = {id(p): name for name, p in named}
    trainable: List[nn.Parameter] = [p for _, p in named]
    owners = _registrations(model)

    def excluded(mod_name: str) -> bool:
        return any(fnmatch.fnmatchcase(mod_name, pat) for pat in config.exclude)

    _refuse_sparse_embeddings(model, config, excluded)  # before any hook: a refused model is untouched
    claimed = _claims(model, config, excluded, compiled)
    captures: Dict[int, Tuple[object, Dict[str, Use]]] = {}

    def uses_of(mod_name: str, module: nn.Module, kind: LayerKind, keys: Sequence[str]) -> List[Use]:
        if id(module) not in captures:
            captures[id(module)] = kind.capture(mod_name, module, on_forward)
        return [captures[id(module)][1][k] for k in keys]

    units: List[FactorUnit] = []
    unit_of_use: Dict[int, FactorUnit] = {}
    for p in trainable:
        regs = owners.get(id(p), [])
        found = [claimed.get((id(m), attr)) for _, m, attr in regs]
        if regs and all(f is not None and not f[3].bias for f in found) and len(param_shape(p)) >= 2:
            uses = [u for mod_name, module, kind, claim in found for u in uses_of(mod_name, module, kind, claim.uses)]
            unit = FactorUnit(0, names[id(p)], p, uses, [])
            units.append(unit)
            unit_of_use.update({id(u): unit for u in uses})

    covered = {id(u.param) for u in units}
    dense: List[Tuple[str, nn.Parameter]] = []
    for p in trainable:
        if id(p) in covered or _rides_as_bias(p, names[id(p)], owners.get(id(p), []), claimed, captures, unit_of_use):
            continue
        if (config.uncaptured_matrices == "rank" and len(param_shape(p)) >= 2
                and not any(excluded(mod_name) for mod_name, _, _ in owners.get(id(p), []))):
            units.append(FactorUnit(0, names[id(p)], p, [], []))  # PowerSGD's floor: rank routes
            continue
        dense.append((names[id(p)], p))

    # Backward visits layers roughly in reverse registration order; so does the exchange, so that
    # each layer's collective can start as soon as its gradient rows exist.
    order = {id(p): i for i, p in enumerate(trainable)}
    units.sort(key=lambda u: order[id(u.param)], reverse=True)
    for i, u in enumerate(units):
        u.index = i
    return SyncPlan(units, dense, [c for c, _ in captures.values()])


Registrations = Dict[int, List[Tuple[str, nn.Module, str]]]
Claims = Dict[Tuple[int, str], Tuple[str, nn.Module, LayerKind, Claim]]


def _registrations(model: nn.Module) -> Registrations:
    """Every (module name, module, attribute) that registers each trainable parameter: a parameter
    shared with a module dAD does not capture must go dense, since its factors would miss that use."""
    owners: Registrations = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None and p.requires_grad:
                entry = (mod_name, module, attr)
                if entry not in owners.setdefault(id(p), []):
                    owners[id(p)].append(entry)
    return owners


def _refuse_sparse_embeddings(model: nn.Module, config: DADConfig, excluded) -> None:
    for mod_name, module in model.named_modules():
        if (isinstance(module, nn.Embedding) and "embedding" in config.layer_kinds and not excluded(mod_name)
                and kind_of(module, config.layer_kinds) is not None and module.sparse
                and module.weight.requires_grad):
            raise ValueError(f"module {mod_name!r}: sparse embedding gradients are not supported by dAD; "
                             f"use sparse=False or exclude the module with the 'exclude' config key")


def _claims(model: nn.Module, config: DADConfig, excluded, compiled: bool = False) -> Claims:
    """Claims by priority: (id(owner module), attribute) -> (capturing module's name, module, kind, claim)."""
    claimed: Claims = {}
    for kind in registered_kinds():
        if kind.name not in config.layer_kinds:
            continue
        for mod_name, module in model.named_modules():
            if excluded(mod_name) or not kind.accepts(module):
                continue
            claims = kind.claims(module)
            if compiled and not kind.compiles:
                # still registered by the claim (a composite keeps `linear` off its children),
                # but with no uses: the weights fall to the floor below
                if process_rank() == 0:  # the model's: the same on every rank
                    log.warning("dAD: %r (%s) is not captured under torch.compile (dynamo cannot trace its "
                                "capture): its weights are routed from their dense gradients (rank routes "
                                "where the mode allows, else dense)", mod_name, kind.name)
                for c in claims:
                    claimed.setdefault(_registration(module, c.attr), None)
                continue
            computed = [c.attr for c in claims if not _is_parameter(module, c.attr)]
            if computed:
                # a parametrization (weight norm: wav2vec2's positional conv) computes the weight
                # from other parameters in forward: rows would rebuild that product's gradient, not
                # theirs. They take the routes of any uncaptured parameter.
                _log_once("dAD: %s of %r (%s) is computed from other parameters (a parametrization such as "
                          "weight norm), not captured: its parameters go dense or by the rank routes of "
                          "uncaptured matrices", computed, mod_name, kind.name,
                          key=f"computed-{kind.name}-{type(module).__name__}")
                continue
            keys = [_registration(module, c.attr) for c in claims]
            if any(k in claimed for k in keys):
                continue  # a composite of higher priority claimed part of it
            for k, c in zip(keys, claims):
                claimed[k] = (mod_name, module, kind, c)
    return claimed


def _rides_as_bias(p: nn.Parameter, name: str, regs, claimed: Claims, captures, unit_of_use) -> bool:
    """Attach ``p`` to its weight's unit as a bias where its claim's uses cover the whole weight (one
    use), or split it over several (each adds into its use's block; a whole-height use into all of
    it: packed attention's self-attention call beside its sliced calls; sharded exact factors sum
    such a bias over its uses). Returns whether it did."""
    found = claimed.get((id(regs[0][1]), regs[0][2])) if len(regs) == 1 else None
    if found is None or not found[3].bias or id(found[1]) not in captures:
        return False
    by_key = captures[id(found[1])][1]
    uses = [by_key.get(k) for k in found[3].uses]
    unit = unit_of_use.get(id(uses[0]))
    if (unit is not None and all(unit_of_use.get(id(u)) is unit and u.kind != "embedding" for u in uses)
            and (len(uses) > 1 or uses[0].block is None)):
        unit.biases.append(BiasUse(name, p, uses[0], tuple(uses[1:])))
        return True
    return False


def _is_parameter(module: nn.Module, attr: str) -> bool:
    """Whether dotted ``attr`` from ``module`` names a registered parameter (not one computed in
    forward by a parametrization or a hook, as ``weight_norm`` does)."""
    owner, leaf = owner_of(module, attr)
    return isinstance(owner, nn.Module) and owner._parameters.get(leaf) is not None


def _registration(module: nn.Module, attr: str) -> Tuple[int, str]:
    """The (id(owner module), attribute) of the parameter at dotted ``attr`` from ``module``."""
    owner, leaf = owner_of(module, attr)
    return id(owner), leaf
