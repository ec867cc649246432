"""`DADSynchronizer`: synchronise a model's gradients with dAD instead of all-reduce.

Usage, in an ordinary training loop::

    sync = DADSynchronizer(model, TorchDistributedAggregator(), DADConfig(mode="auto"))
    loss.backward()
    sync.synchronize()        # every param.grad now holds the average over ranks, as DDP gives
    optimizer.step()

How a step runs: ``docs/concepts/step.md``. Backward opens the step's `exchange.window.StepWindow`
(keeping what ``.grad`` held); the `exchange.Exchanger` exchanges each unit on a background thread
once autograd has finished its weight and biases, into the step's sink (`.grad`, or DDP's buckets).
This class is the facade: it wires the hooks (`synchronizer_hooks`), holds the step's lifecycle
(`synchronizer_step`), and carries what survives a checkpoint (`state_dict`).
"""
from __future__ import annotations

import atexit
import contextlib
import logging
from typing import Iterator, List, Mapping, Optional, Tuple, Union

from torch import nn

from dad_integrations.engines import banner
from dad_integrations.comm.aggregator import FactorAggregator
from dad_integrations.exchange.checks import broadcast_model, check_same_model
from dad_integrations.capture.compiled import guard_compiled_hooks, is_compiled
from dad_integrations.config import WIRE_DTYPES, DADConfig
from dad_integrations.exchange.exchanger import Exchanger
from dad_integrations.report import StepReport
from dad_integrations.capture.units import FactorUnit
from dad_integrations.capture.assign import build_plan
from dad_integrations.codecs.route_state import STATE_VERSION, route_table
from dad_integrations.exchange.levels import build_levels
from dad_integrations.synchronizer_hooks import ParamHooks
from dad_integrations.synchronizer_step import StepLifecycle
from dad_integrations.routing.trial import TimedRoutes

log = logging.getLogger(__name__)


class DADSynchronizer(StepLifecycle, ParamHooks, TimedRoutes):
    """Synchronises every trainable parameter's gradient of ``model`` across ranks.

    Args:
        model: the model, identical in structure on every rank (checked here).
        aggregator: the collectives backend; None uses `TorchDistributedAggregator`.
        config: a `DADConfig` or a dict of its keys.
        prescale_factor: each rank's contribution is multiplied by it before the reduction.
        postscale_factor: the reduced sum is multiplied by it; None averages (``1 / world_size``).
            Together they express the engines' reductions (Horovod's ``op`` and predivide factor,
            DeepSpeed's `deepspeed_dad.reduction_scales`).
        backward_passes_per_step: a weight's exchange starts at its k-th backward pass (Horovod's
            ``backward_passes_per_step``); factors of the earlier passes are kept and sent with it.
        broadcast_parameters: copy rank 0's parameters and buffers to every rank now, as DDP does;
            engines that broadcast themselves or leave it to the user (Horovod) turn it off.
        compiled: whether the model runs under ``torch.compile`` (None: a compiled module in it; an
            engine that compiles it after attach says True); layer kinds that cannot capture under
            compile then hand their weights to the rank routes (`capture.compiled`).
    """

    def __init__(self, model: nn.Module, aggregator: Optional[FactorAggregator] = None,
                 config: Union[DADConfig, Mapping, None] = None, *, prescale_factor: float = 1.0,
                 postscale_factor: Optional[float] = None, backward_passes_per_step: int = 1,
                 broadcast_parameters: bool = True, compiled: Optional[bool] = None,
                 _driven_by_ddp: bool = False):
        self.config = DADConfig() if config is None else DADConfig.from_dict(config)
        if aggregator is None:
            from dad_integrations.comm.torch_distributed import TorchDistributedAggregator
            aggregator = TorchDistributedAggregator()
        if not isinstance(aggregator, FactorAggregator):
            raise TypeError(f"aggregator must be a FactorAggregator, got {type(aggregator).__name__}")
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise ValueError("the model is wrapped in DistributedDataParallel, whose all-reduce would run "
                             "besides dAD's: attach dAD to the bare model (or use the Accelerate "
                             "integration, which replaces DDP's all-reduce with a communication hook)")
        self.model = model
        self.aggregator = aggregator
        self.prescale_factor = float(prescale_factor)
        self.postscale_factor = None if postscale_factor is None else float(postscale_factor)
        self.set_backward_passes_per_step(backward_passes_per_step)
        try:
            device = next(model.parameters()).device
        except StopIteration:
            raise ValueError("the model has no parameters") from None

        self.compiled = is_compiled(model) if compiled is None else bool(compiled)
        guard_compiled_hooks(announce=self.compiled)  # graphs compiled before now: no capture, no guards
        self._plan = build_plan(model, self.config, on_forward=self._on_forward, compiled=self.compiled)
        try:
            check_same_model(self._plan, aggregator, device)
            if broadcast_parameters:
                broadcast_model(model, aggregator)
        except BaseException:
            for c in self._plan.captures:
                c.remove()
            raise
        self._exchanger = Exchanger(self._plan, aggregator, self.config, WIRE_DTYPES[self.config.wire_dtype],
                                    device, levels=build_levels(self.config, aggregator, device))
        self._driven_by_ddp = _driven_by_ddp
        self._init_step_state()
        self._names = {id(p): n for n, p in model.named_parameters()}  # for reports
        self._init_hooks(model)
        self._start_worker()
        banner.announce("DADSynchronizer", self.config, process_rank=aggregator.rank, world_size=aggregator.world_size,
                        factor_weights=len(self._plan.units), dense_params=len(self._plan.dense),
                        hops=self._exchanger.describe_hops(),
                        memory=banner.memory_line("DADSynchronizer", self.config, model, self._plan.units,
                                                  aggregator.world_size))

    # -- public API -----------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait until every parameter's gradient holds its average over ranks."""
        if self._driven_by_ddp:
            raise RuntimeError("this synchroniser is driven by DDP's communication hook: gradients are "
                               "synchronised when backward ends, do not call synchronize()")
        if self._accumulating:
            raise RuntimeError("synchronize() was called inside no_sync(); call it after the block")
        if self._closed:
            raise RuntimeError("synchronize() was called after close()")
        window = self._current_window()
        self._dispatch(window, self._exchange)
        window.release_all()
        try:
            report = window.future.result()
        finally:
            late = self._end_step(window)
        self._finish(report, late)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate micro-steps: factors are kept, and the next `synchronize()` sends them once."""
        previous, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = previous

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Start each weight's exchange at its ``passes``-th backward pass (1: every backward)."""
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")
        self.backward_passes_per_step = passes

    @property
    def scale(self) -> float:
        """The factor applied to the sum over ranks of the local gradients."""
        post = 1.0 / self.aggregator.world_size if self.postscale_factor is None else self.postscale_factor
        return self.prescale_factor * post

    @property
    def backward_pending(self) -> bool:
        """A backward has reached a synchronised parameter since the last synchronised step (without
        the per-parameter hooks, `_set_param_hooks`: a step's window is open)."""
        window = self._window
        return window is not None and (window.touched or not self._params_hooked)

    def last_step_report(self) -> Optional[StepReport]:
        """Per parameter: representation, rows, bytes handed/sent/received, and totals."""
        return self._report

    @property
    def _trial(self):
        """Its routing by time (`routing.trial.TimedRoutes`: ``set_link``, ``timing``, ``route_trials``)."""
        return self._exchanger.policy

    @property
    def units(self) -> List[FactorUnit]:
        """The weights synchronised through factors, in exchange order."""
        return list(self._plan.units)

    @property
    def dense_parameters(self) -> List[Tuple[str, nn.Parameter]]:
        """Parameters always synchronised by dense all-reduce."""
        return list(self._plan.dense)

    def state_dict(self) -> dict:
        """This rank's dAD state: per weight its rank-dAD warm start and error-feedback residual
        (they differ across ranks: save them per rank) and whether it went dense for good; the
        step count, the first-step check and auto's last agreed row counts."""
        ex = self._exchanger
        return {"version": STATE_VERSION, "steps": self._steps, "verified": self._verified,
                "units": {u.name: {"dense_only": u.dense_only, "rows_unused": u.rows_unused,
                                   "last_rows": ex.policy.last_rows.get(u.index)} for u in self._plan.units},
                "rank_routes": ex.state.state_dict()}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore `state_dict`'s state, or one of version 2 (the rank routes' entries inside ``units``)
        or 1 (the units' table alone, by name); tensors go to each parameter's device and compute
        dtype. Raises `ValueError` for weights this model does not have."""
        if self.backward_pending:
            raise RuntimeError("load_state_dict() was called between backward and synchronize()")
        ex, versioned = self._exchanger, state.get("version") in (2, STATE_VERSION)
        units_in = state.get("units", {}) if versioned else state
        by_name = {u.name: u for u in self._plan.units}
        unknown = sorted(set(units_in) - set(by_name))
        if unknown:
            raise ValueError(f"dAD state for unknown parameters {unknown}: was it saved from another model?")
        ex.state.load_state_dict(route_table(state), {u.name: u.param for u in self._plan.units})
        for name, s in units_in.items():
            u = by_name[name]
            u.rows_unused = bool(s.get("rows_unused", False))
            u.set_dense_only(bool(s.get("dense_only")))
            if s.get("last_rows") is not None:
                ex.policy.last_rows[u.index] = [list(map(int, r)) for r in s["last_rows"]]
        if versioned:  # the step count and the first-step check (versions 2 and 3)
            self._steps = int(state["steps"])
            self._verified = bool(state["verified"]) or not self.config.verify_first_step
        if self._exchanger.policy.trial is not None:  # every rank loads alike: a trial in progress ends on all
            self._exchanger.policy.trial.cancel()
        self._clock.cancel()
        self._plan_next_step()

    def close(self) -> None:
        """Remove every hook; the model trains as if dAD had never been attached.

        In DDP mode the communication hook stays (DDP cannot unregister one) and raises when used:
        wrap the model in a new DDP to train on without dAD.
        """
        for h in self._hooks:
            h.remove()
        for c in self._plan.captures:
            c.remove()
        self._hooks = []
        self._set_param_hooks(False)
        self._release()
        atexit.unregister(self._atexit)
