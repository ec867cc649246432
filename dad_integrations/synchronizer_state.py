"""What a `DADSynchronizer` carries over a checkpoint: the rank routes' warm starts and
error-feedback residuals (``rank_routes``, `codecs.route_state`, as every synchroniser saves them)
and, per weight, whether it went dense for good and auto's last agreed row counts (``units``)."""
from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence

from dad_integrations.capture.units import FactorUnit
from dad_integrations.codecs.route_state import STATE_VERSION, route_table
from dad_integrations.exchange.exchanger import Exchanger


def sync_state(ex: Exchanger, units: Sequence[FactorUnit], steps: int, verified: bool) -> Dict[str, Any]:
    """This rank's state (it differs across ranks: save it per rank)."""
    return {"version": STATE_VERSION, "steps": steps, "verified": verified,
            "units": {u.name: {"dense_only": u.dense_only, "rows_unused": u.rows_unused,
                               "last_rows": ex.policy.last_rows.get(u.index)} for u in units},
            "rank_routes": ex.state.state_dict()}


def load_units_state(ex: Exchanger, units: Sequence[FactorUnit], state: Mapping) -> bool:
    """Load `sync_state`'s state, or one of version 2 (the rank routes' entries inside ``units``) or
    1 (the units' table alone, by name); tensors go to each parameter's device and compute dtype.
    Returns whether it holds the step count and the first-step check (versions 2 and 3). Raises
    `ValueError` for weights this model does not have."""
    versioned = state.get("version") in (2, STATE_VERSION)
    units_in = state.get("units", {}) if versioned else state  # (none in FSDP2's and ZeRO's: their routes load)
    by_name = {u.name: u for u in units}
    unknown = sorted(set(units_in) - set(by_name))
    if unknown:
        raise ValueError(f"dAD state for unknown parameters {unknown}: was it saved from another model?")
    ex.state.load_state_dict(route_table(state), {u.name: u.param for u in units})
    for name, s in units_in.items():
        u = by_name[name]
        u.rows_unused = bool(s.get("rows_unused", False))
        u.set_dense_only(bool(s.get("dense_only")))
        if s.get("last_rows") is not None:
            ex.policy.last_rows[u.index] = [list(map(int, r)) for r in s["last_rows"]]
    return versioned
