"""What a `DADSynchronizer` carries over a checkpoint, per weight: rank-dAD warm starts, error-feedback
residuals, whether it went dense for good, auto's last agreed row counts."""
from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence

from dad_integrations.capture.units import FactorUnit
from dad_integrations.exchange.exchanger import Exchanger

STATE_VERSION = 2


def units_state(ex: Exchanger, units: Sequence[FactorUnit]) -> Dict[str, Dict[str, Any]]:
    """This rank's state of each weight, by name (they differ across ranks: save them per rank)."""
    return {u.name: {"warm_q": ex.warm.q.get(u.name), "residual": ex.memory.state(u.name),
                     "shared_q": ex.rank_allreduce.warm.q.get(u.name) if ex.rank_allreduce else None,
                     "dense_only": u.dense_only, "rows_unused": u.rows_unused,
                     "last_rows": ex.policy.last_rows.get(u.index)}
            for u in units}


def load_units_state(ex: Exchanger, units: Sequence[FactorUnit], state: Mapping) -> None:
    """Load each weight's state from a `DADSynchronizer.state_dict` (or version 1's, by name);
    tensors go to each parameter's device and compute dtype. Raises `ValueError` for weights
    this model does not have."""
    units_in = state.get("units") if state.get("version") == STATE_VERSION else state  # version 1: by name
    by_name = {u.name: u for u in units}
    unknown = sorted(set(units_in) - set(by_name))
    if unknown:
        raise ValueError(f"dAD state for unknown parameters {unknown}: was it saved from another model?")
    for name, s in units_in.items():
        u = by_name[name]
        ex.warm.load(name, s.get("warm_q"), u.param)
        ex.memory.load(name, s.get("residual"), u.param)
        if ex.rank_allreduce is not None:
            ex.rank_allreduce.warm.load(name, s.get("shared_q"), u.param)
        u.rows_unused = bool(s.get("rows_unused", False))
        u.set_dense_only(bool(s.get("dense_only")))
        if s.get("last_rows") is not None:
            ex.policy.last_rows[u.index] = [list(map(int, r)) for r in s["last_rows"]]
