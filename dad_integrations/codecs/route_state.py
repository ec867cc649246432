"""What the rank routes carry from one step to the next: one `RouteState` per synchroniser, whatever
its layout (flat, two levels, FSDP2's row shards, HSDP's replicate hop, ZeRO's partitions).

- **Warm starts.** rank-dAD's power iteration starts from this rank's last ``Q_s`` (`own`),
  PowerSGD's from the last all-reduced ``Q``, the same on every rank that summed it (`shared`);
  without one (the first step, ``warm_start: false``, another r) from a seed every rank shares.
- **Error feedback** (`memory`, `error_feedback.ErrorFeedback`): what a rank route left out of a
  weight's local gradient (`residual`), added to its next one. A weight leaving the rank routes
  hands its residual to the dense step that sends it (`flush`).
- **Pending and commit.** A step's new warm starts and residuals wait (`hold`) until it ends
  (`end_step`). A step with a non-finite gradient on any rank (one a loss scaler skips) drops them
  and owes again the residuals it flushed, on every rank alike: the next finite step trains as if
  the bad one had not happened. A step that never reached its end leaves no trace (`start_step`).
- **Finiteness**, known one of two ways. Results every rank sees alike (a flat step's averages,
  `note`) need no agreement. Where a rank sees only its shard of the result (FSDP2, ZeRO), its
  local gradients are noted (`note_local`) and the ranks agree at the step's end, one all-reduce
  of one number.
- **One checkpoint format** (`state_dict`), under ``"rank_routes"`` in every synchroniser's state:
  per weight that holds any, ``{"warm_q", "shared_q", "residual"}`` (a residual kept at rank q is a
  pair ``(U, V)``); under HSDP also ``"shard": [s, L]`` (the residual is rows s of L of its node's,
  `codecs.replicate_rank`). They differ across ranks: each rank saves its own
  (`engines.checkpoint`). `route_table` also reads the formats written before it.
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from dad_integrations.capture.rows import compute_dtype
from dad_integrations.capture.units import FactorUnit
from dad_integrations.codecs.error_feedback import LowRankErrorFeedback, Packed, error_feedback_for
from dad_integrations.codecs.finite import finite_flag
from dad_integrations.comm.aggregator import FactorAggregator, Traffic
from dad_integrations.comm.groups import process_rank
from dad_integrations.config import DADConfig

log = logging.getLogger(__name__)

STATE_VERSION = 3  # every synchroniser's state: ``{"version", "steps", "rank_routes", ...}``
ENTRY = ("warm_q", "shared_q", "residual")  # one weight's entry in ``rank_routes``


class WarmStart:
    """The last Q per unit name, seeding the next power iteration."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.q: Dict[str, Optional[torch.Tensor]] = {}

    def initial(self, unit: FactorUnit, n: int, r: int, dtype: torch.dtype, step: int) -> torch.Tensor:
        q = self.q.get(unit.name) if self.enabled else None
        if q is None or q.shape != (n, r):
            # the same seed on every rank: ranks start from one subspace
            gen = torch.Generator(device=unit.param.device).manual_seed(1_000_003 * unit.index + step)
            q = torch.randn(n, r, generator=gen, device=unit.param.device, dtype=dtype)
        return q

    def update(self, unit: FactorUnit, q: Optional[torch.Tensor]) -> None:
        if self.enabled:
            self.q[unit.name] = q

    def load(self, name: str, q: Optional[torch.Tensor], like: torch.Tensor) -> None:
        if q is not None:
            self.q[name] = q.to(device=like.device, dtype=compute_dtype(like))


class RouteState:
    """Warm starts, error feedback, a step's pending state and finiteness, and their checkpoint
    (module doc). ``shard``: ``(s, L)`` where each rank keeps rows s of L of its node's residual
    (HSDP's replicate hop); None where residuals are whole."""

    def __init__(self, config: DADConfig, shard: Optional[Tuple[int, int]] = None):
        self.enabled = config.rank is not None  # no rank: no rank route, nothing to hold
        self.memory = error_feedback_for(config)
        self.own = WarmStart(config.warm_start)     # rank-dAD: each rank's own Q_s
        self.shared = WarmStart(config.warm_start)  # PowerSGD's all-reduced Q
        self.shard = shard
        self.iterations = config.power_iterations
        self._pending: List[Tuple[WarmStart, FactorUnit, Optional[torch.Tensor], Optional[Packed]]] = []
        self._flushed: List[Tuple[str, Packed]] = []
        self._finite = True                             # every result noted this step
        self._local_ok: Optional[torch.Tensor] = None   # every local gradient noted (on the device: no sync)
        self._device: Optional[torch.device] = None

    def keep_residuals_at(self, q: int) -> None:
        """From now on keep each residual as its rank-``q`` part (`LowRankErrorFeedback`; a residual
        budget's fit, chosen at attach). Raises where residuals are held already: none may be lost."""
        if self.memory.residuals:
            raise RuntimeError("dAD: the error-feedback memory changes only before residuals are held")
        self.memory = LowRankErrorFeedback(self.memory.enabled, q, self.iterations)

    # -- a step ---------------------------------------------------------------------------------
    def start_step(self) -> None:
        """A new step: what a step that never ended held is dropped, the residuals it flushed are owed."""
        self._settle(False)
        self._finite, self._local_ok = True, None

    def residual(self, name: str, compensated: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                 in_place: bool = False) -> Optional[Packed]:
        """``compensated - p q^T``, what a rank route left out, as the memory keeps it (None without
        error feedback): computed now, while the step's tensors are at hand, and packed at once (no
        whole residual waits where the memory keeps rank q). One fused ``addmm``, in place where
        ``in_place`` says ``compensated`` is the codec's own copy (the local gradient plus the last
        residual) and neither factor views it (a full-rank reduction returns the gradient itself)."""
        if not self.memory.enabled:
            return None
        if in_place and not _shares_storage(compensated, p) and not _shares_storage(compensated, q):
            return self.memory.pack(name, compensated.addmm_(p, q.t(), alpha=-1))
        return self.memory.pack(name, torch.addmm(compensated, p, q.t(), alpha=-1))

    def hold(self, store: WarmStart, unit: FactorUnit, q: Optional[torch.Tensor], residual: Optional[Packed]) -> None:
        """This step's warm start for ``store`` (`own` or `shared`) and `residual`, kept at `end_step`
        if the step is finite."""
        self._pending.append((store, unit, q, residual))

    def flush(self, name: str, add: Callable[[torch.Tensor], None]) -> bool:
        """A weight left the rank routes (its rows fell, routing by time chose again, a checkpoint
        brought a residual): ``add`` its residual, one ``m x n`` tensor, to the local gradient of the
        dense step that sends it, so the average carries the mean residual, what the ranks still
        owed. Every rank took the same routes, so every rank flushes the same weights. Owed again if
        the step is not finite (`end_step`). Returns whether there was one."""
        residual = self.memory.dense(name) if self.memory.enabled else None
        if residual is None:
            return False
        self._flushed.append((name, self.memory.residuals.pop(name)))
        add(residual)
        return True

    @property
    def pending(self) -> bool:
        """A non-finite step would drop something: new warm starts or residuals, or flushed ones."""
        return bool(self._pending or self._flushed)

    def note(self, tensor: torch.Tensor) -> torch.Tensor:
        """Note whether a result every rank sees alike is finite (read while the step is so far)."""
        if self._finite and self.enabled:
            self._finite = bool(finite_flag(tensor))
        return tensor

    def note_local(self, tensor: torch.Tensor) -> None:
        """Fold one of this rank's local gradients into the step's finiteness, agreed at `end_step`."""
        if self.enabled:
            self._device = tensor.device
            ok = finite_flag(tensor)
            self._local_ok = ok if self._local_ok is None else self._local_ok & ok

    def end_step(self, finite: bool = True, aggregator: Optional[FactorAggregator] = None) -> Traffic:
        """Keep what the step held if it was ``finite``, every result noted was and (given the
        ``aggregator`` of the local gradients noted) every rank's local gradients were, agreed by one
        all-reduce of one number; else drop it. Returns the agreement's bytes."""
        keep, traffic = finite and self._finite, Traffic()
        if aggregator is not None:
            bad = torch.zeros(1, device=self._device) if self._local_ok is None else (
                ~self._local_ok).to(torch.float32).reshape(1)
            handle = aggregator.all_reduce(bad, name="dad.sharded.rank.finite", op="sum")
            keep, traffic = keep and float(handle.wait()[0]) == 0.0, handle.traffic
        if not keep and self.pending and process_rank() == 0:  # agreed: every rank drops alike
            log.info("dAD: a non-finite step: rank-route residuals and warm starts kept from the step before")
        self._settle(keep)
        self._finite, self._local_ok = True, None
        return traffic

    def _settle(self, keep: bool) -> None:
        pending, flushed, self._pending, self._flushed = self._pending, self._flushed, [], []
        for store, unit, q, residual in pending if keep else ():
            store.update(unit, q)
            if residual is not None:
                self.memory.keep(unit.name, residual)
        for name, stored in () if keep else flushed:
            self.memory.keep(name, stored)

    def drop_warm_starts(self) -> None:
        """Every warm start restarts from the shared seed (the steps change level)."""
        self.own.q.clear()
        self.shared.q.clear()

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, dict]:
        """Per weight name that holds any: its warm starts and residual (module doc)."""
        names = sorted(set(self.own.q) | set(self.shared.q) | set(self.memory.residuals))
        out = {name: {"warm_q": self.own.q.get(name), "shared_q": self.shared.q.get(name),
                      "residual": self.memory.state(name)} for name in names}
        for entry in out.values() if self.shard is not None else ():
            entry["shard"] = list(self.shard)
        return out

    def load_state_dict(self, table: Mapping[str, Mapping], params: Mapping[str, nn.Parameter]) -> None:
        """Replace this state with ``table`` (`state_dict`'s, or `route_table`'s of an older state),
        tensors onto each weight's (``params``, by name) device and compute dtype. Raises, naming
        them, for weights not in ``params``, or for state where the config has no rank."""
        unknown = sorted(set(table) - set(params))
        if unknown:
            raise ValueError(f"dAD state for unknown weights {unknown}: was it saved from another model?")
        if not self.enabled and any(e.get(k) is not None for e in table.values() for k in ENTRY):
            raise ValueError("this dAD state holds rank-route state, but the config has no 'rank'")
        self._pending, self._flushed = [], []
        self.drop_warm_starts()
        self.memory.residuals.clear()
        for name, entry in table.items():
            entry = self._own_rows(name, entry) if self.shard is not None else entry
            self.own.load(name, entry.get("warm_q"), params[name])
            self.shared.load(name, entry.get("shared_q"), params[name])
            self.memory.load(name, entry.get("residual"), params[name])

    def _own_rows(self, name: str, entry: Mapping) -> Mapping:
        """HSDP: ``entry`` with this rank's rows of its node's residual: its own, or their mean over
        the old nodes (``residual_shards``, `engines.merge` at another node count). The shard width
        L must be the saved one (a resharded residual would need every node's rows)."""
        s, width = self.shard
        saved = entry.get("shard")
        if saved is not None and saved[1] != width:
            raise ValueError(f"dAD state of {name!r} was saved with {saved[1]} shards per node, this job has "
                             f"{width}: HSDP's rank-route residuals resume at the same shard width (any node "
                             f"count), or set 'error_feedback': false to start them afresh")
        shards = entry.get("residual_shards")
        if shards is not None:
            return {**entry, "residual": shards.get(s, shards.get(str(s)))}
        if saved is not None and saved[0] is not None and saved[0] != s:
            raise ValueError(f"dAD state of {name!r} holds rows {saved[0]} of the node's residual, but this "
                             f"rank keeps rows {s}: not this rank's file")
        return entry


def route_table(state: Mapping) -> Dict[str, dict]:
    """The ``rank_routes`` table of a saved state, in any format written so far: this one (version 3,
    every synchroniser), FSDP2's and ZeRO's version 1 (the same table), a `DADSynchronizer`'s version
    2 (the entries inside ``units``) and version 1 (the units' table alone)."""
    if "rank_routes" in state:
        return dict(state["rank_routes"] or {})
    units = state.get("units", {}) if state.get("version") == 2 else state
    return {name: {k: e.get(k) for k in ENTRY} for name, e in units.items() if any(e.get(k) is not None for k in ENTRY)}


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
