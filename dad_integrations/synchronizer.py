"""`DADSynchronizer`: synchronise a model's gradients with dAD instead of all-reduce.

Usage, in an ordinary training loop::

    sync = DADSynchronizer(model, TorchDistributedAggregator(), DADConfig(mode="auto"))
    loss.backward()
    sync.synchronize()        # every param.grad now holds the average over ranks, as DDP gives
    optimizer.step()

How a step runs. Forward hooks keep each captured layer's input rows, and a hook on the layer's
output keeps its output-gradient rows (`capture`). When backward first reaches a synchronised
parameter, the step's `exchange.window.StepWindow` opens and keeps what ``.grad`` already held (the
prior); when autograd has finished a weight and all its biases, their unit is ready, and the
`exchange.Exchanger` on a background thread (`worker`) exchanges the units in an order every rank
shares, each through the codec its route (`router`) picks; a dense bucket is all-reduced as soon
as it is full. `synchronize()` releases units that never got a gradient, lets the last dense
buckets go and waits; the results land in the step's sink (`.grad`, or DDP's buckets when DDP
drives the step through `ddp_hook`). A unit sure to go dense in a step (a held dense route, or
dense for good) skips the window's bookkeeping in its hooks: it needs no prior and no marks.

This class is the facade over those pieces: it wires the hooks, holds the step's lifecycle
(open, dispatch, finish), and carries what survives a checkpoint (`state_dict`).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Callable, Iterator, List, Mapping, Optional, Tuple, Type, Union

import torch
from torch import nn

from dad_integrations.engines import banner
from dad_integrations.comm.aggregator import FactorAggregator
from dad_integrations.comm.errors import note_step
from dad_integrations.exchange.checks import broadcast_model, check_same_model
from dad_integrations.capture.compiled import compiling, guard_compiled_hooks, is_compiled
from dad_integrations.capture.hooks import ForwardStartHook
from dad_integrations.config import WIRE_DTYPES, DADConfig
from dad_integrations.exchange.exchanger import Exchanger
from dad_integrations.report import StepReport
from dad_integrations.routing.trial import StepClock, in_backward
from dad_integrations.capture.sink import BucketViewSink, GradSink
from dad_integrations.capture.units import FactorUnit
from dad_integrations.capture.assign import build_plan
from dad_integrations.exchange.levels import build_levels
from dad_integrations.exchange.window import StepWindow
from dad_integrations.exchange.worker import Worker

if TYPE_CHECKING:
    from dad_integrations.routing.link import LinkModel

log = logging.getLogger(__name__)

_ENGINE_DRAIN_S = 0.05  # at exit: time given to the engine's threads to release finished collectives

STATE_VERSION = 2


class DADSynchronizer:
    """Synchronises every trainable parameter's gradient of ``model`` across ranks.

    Args:
        model: the model, identical in structure on every rank (checked here).
        aggregator: the collectives backend; None uses `TorchDistributedAggregator`.
        config: a `DADConfig` or a dict of its keys.
        prescale_factor: each rank's contribution is multiplied by it before the reduction.
        postscale_factor: the reduced sum is multiplied by it; None averages (``1 / world_size``).
            Together they express the engines' reductions: Horovod's ``op=Sum`` is
            ``postscale_factor=1``, its ``gradient_predivide_factor=f`` is ``prescale 1/f,
            postscale f/size``, as is DeepSpeed's.
        backward_passes_per_step: a weight's exchange starts at its k-th backward pass (Horovod's
            ``backward_passes_per_step``); factors of the earlier passes are kept and sent with it.
        broadcast_parameters: copy rank 0's parameters and buffers to every rank now, as DDP does
            when it wraps a model. Engines that broadcast themselves (DDP, DeepSpeed) or leave it to
            the user (Horovod's ``broadcast_parameters``) turn it off.
        compiled: whether the model runs under ``torch.compile``; None reads it from the model (a
            compiled module in it). Layer kinds that cannot capture under compile then hand their
            weights to the rank routes from the dense gradient, said at attach
            (`capture.compiled`). An engine that compiles the model after attach says True.
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

        # graphs compiled before now were built without capture and without guards on hooks
        guard_compiled_hooks()
        self.compiled = is_compiled(model) if compiled is None else bool(compiled)
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
        self._sink_type: Type[GradSink] = BucketViewSink if _driven_by_ddp else GradSink
        self._lock = threading.Lock()
        self._window: Optional[StepWindow] = None
        self._accumulating = False
        self._steps = 0
        self._verified = not self.config.verify_first_step
        self._report: Optional[StepReport] = None
        self._unit_of = {id(q): u for u in self._plan.units for q in u.params}
        self._param_ids = {u.index: tuple(id(q) for q in u.params) for u in self._plan.units}
        self._names = {id(p): n for n, p in model.named_parameters()}  # for reports
        # units the next step sends dense whatever their rows (`RoutePolicy.dense_for_sure`): their
        # hooks skip the window's bookkeeping (priors, marks); refreshed after every step
        self._bookless: frozenset = frozenset()
        self._param_hooks: list = []
        self._params_hooked = False
        self._set_param_hooks(True)
        # a step's span for route trials starts at its forward (what capture adds counts too)
        self._clock = StepClock()
        self._hooks = [ForwardStartHook(model, self._on_root_forward)]
        self._worker = Worker("dad-sync")
        self._closed = False
        # at exit, release a step left in flight (an error before synchronize()), so that its
        # thread ends cleanly instead of being torn down while it waits
        self._atexit = functools.partial(_abandon, weakref.ref(self))
        atexit.register(self._atexit)
        banner.announce("DADSynchronizer", self.config, process_rank=aggregator.rank,
                        world_size=aggregator.world_size, factor_weights=len(self._plan.units), dense_params=len(self._plan.dense))

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

    def set_link(self, link: Union["LinkModel", Mapping]) -> None:
        """Route by ``link`` (a `routing.link.LinkModel` or a config ``link`` dict; pass the same on every
        rank) from the next route refresh on (every ``route_refresh_steps``), in place of the
        measured or configured one; with ``objective="bytes"`` it has no effect."""
        from dad_integrations.routing.link import LinkModel
        self._exchanger.policy.set_link(LinkModel.from_spec(link))

    @property
    def timing(self):
        """The link and compute models routes are chosen by (`routing.timing.StepTiming`); None where the
        objective is bytes."""
        return self._exchanger.policy.timing

    @property
    def route_trials(self) -> list:
        """The route trials so far (`routing.trial.TrialOutcome`: the measured steps on a refresh's
        routes and all dense, and what was kept); empty where routes are not chosen by time on a
        measured link."""
        trial = self._exchanger.policy.trial
        return list(trial.outcomes) if trial is not None else []

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
                "units": {u.name: {"warm_q": ex.warm.q.get(u.name), "residual": ex.memory.state(u.name),
                                   "shared_q": ex.rank_allreduce.warm.q.get(u.name) if ex.rank_allreduce else None,
                                   "dense_only": u.dense_only, "rows_unused": u.rows_unused,
                                   "last_rows": ex.policy.last_rows.get(u.index)}
                          for u in self._plan.units}}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore `state_dict`'s state; tensors go to each parameter's device and compute dtype."""
        if self.backward_pending:
            raise RuntimeError("load_state_dict() was called between backward and synchronize()")
        units = state.get("units") if state.get("version") == STATE_VERSION else state  # version 1: by name
        by_name = {u.name: u for u in self._plan.units}
        unknown = sorted(set(units) - set(by_name))
        if unknown:
            raise ValueError(f"dAD state for unknown parameters {unknown}: was it saved from another model?")
        ex = self._exchanger
        for name, s in units.items():
            u = by_name[name]
            ex.warm.load(name, s.get("warm_q"), u.param)
            ex.memory.load(name, s.get("residual"), u.param)
            if ex.rank_allreduce is not None:
                ex.rank_allreduce.warm.load(name, s.get("shared_q"), u.param)
            u.rows_unused = bool(s.get("rows_unused", False))
            u.set_dense_only(bool(s.get("dense_only")))
            if s.get("last_rows") is not None:
                ex.policy.last_rows[u.index] = [list(map(int, r)) for r in s["last_rows"]]
        if state.get("version") == STATE_VERSION:
            self._steps = int(state["steps"])
            self._verified = bool(state["verified"]) or not self.config.verify_first_step
        if ex.policy.trial is not None:  # every rank loads alike: a trial in progress ends on all of them
            ex.policy.trial.cancel()
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

    # -- the step's lifecycle (also driven by `ddp_hook`) ---------------------------------------
    def _current_window(self) -> StepWindow:
        """The open step's window, opened now if there is none."""
        with self._lock:
            if self._window is None:
                guard_compiled_hooks()  # (dynamo imported after attach: guard from the first step on)
                self._window = StepWindow(self._plan.units, self._sink_type)
                self._window.started = self._clock.open()
                note_step(self._steps)  # for the messages of collectives that fail in it
            return self._window

    def _dispatch(self, window: StepWindow, job: Callable[[StepWindow], StepReport]) -> None:
        """Start the step's exchange on the worker (once per step)."""
        with window.lock:
            if window.future is None:
                window.future = self._worker.submit(functools.partial(job, window))

    def _exchange(self, window: StepWindow, postscale: Optional[float] = None) -> StepReport:
        """Run the step's exchange; ``postscale`` replaces ``postscale_factor`` for this step."""
        return self._exchanger.run(window, window.sink, step=self._steps, verify=not self._verified,
                                   prescale=self.prescale_factor,
                                   postscale=self.postscale_factor if postscale is None else postscale)

    def _end_step(self, window: StepWindow) -> List[str]:
        """Drop the step's window and rows; returns the weights whose rows arrived after their exchange."""
        late = [u.name for c in self._plan.captures for u in c.uses if u.pairs] + window.twice
        for c in self._plan.captures:
            c.clear()
        with self._lock:
            if self._window is window:
                self._window = None
        return late

    def _finish(self, report: StepReport, late: List[str]) -> None:
        """Count the finished step, then raise if this rank saw rows arrive after their exchange.

        The step is counted first: the error is this rank's alone, and a caller that goes on must
        find every rank in the same state (same step count, same first-step check), or the next
        step's collectives would not match.
        """
        self._report = report
        self._steps += 1
        # a step in which no rank had factor rows (synchronize() before any backward, as
        # hvd.broadcast_optimizer_state does) checked nothing: keep the check for the first real one;
        # max_rows is agreed by all ranks, so they keep or drop the check together
        if any(p.max_rows for p in report.params):
            self._verified = True
        self._plan_next_step()
        if late:
            raise RuntimeError(f"the gradients of {sorted(set(late))} came in twice in one step, after their "
                               f"exchange had started: a weight used in several reentrant-checkpointed "
                               f"segments (exclude it with the 'exclude' config key, or use "
                               f"use_reentrant=False), or backward run twice without no_sync()")

    def _plan_next_step(self) -> None:
        """Note which units the next step sends dense whatever their rows (see `_bookless`)."""
        policy, step, verify = self._exchanger.policy, self._steps, not self._verified
        self._bookless = frozenset(u.index for u in self._plan.units if policy.dense_for_sure(u, step, verify))

    def _set_param_hooks(self, on: bool) -> None:
        """Register (``on``) or remove the per-parameter hooks: the window's bookkeeping around each
        accumulation, and readiness outside DDP. Only a step driven by DDP's hook whose every unit
        is sure to go dense (`_bookless`) may run without them: DDP says when gradients are final,
        and such units keep no prior and no marks, so the hooks would only note that backward
        reached the parameters (~50 Python calls a step). The caller changes them between steps,
        never inside backward (`ddp_hook.DDPDriver.before_forward`)."""
        if on == self._params_hooked:
            return
        self._params_hooked = on
        if not on:
            for h in self._param_hooks:
                h.remove()
            self._param_hooks = []
            return
        units, dense = self._plan.units, self._plan.dense
        self._param_hooks = [p.register_hook(functools.partial(self._before_accumulate, u, p))
                             for u in units for p in u.params]
        self._param_hooks += [p.register_post_accumulate_grad_hook(functools.partial(self._after_accumulate, u))
                              for u in units for p in u.params]
        self._param_hooks += [p.register_post_accumulate_grad_hook(self._after_dense_accumulate) for _, p in dense]

    def _release(self) -> None:
        """Stop the worker thread, abandoning a step in flight (its waits return at once)."""
        self._closed = True
        self._exchanger.closed = True
        window = self._window
        if window is not None:
            window.release_all()
        self._worker.stop()

    # -- hooks ----------------------------------------------------------------------------------
    def _on_root_forward(self) -> None:
        """The model's forward: a training step may start here (`routing.trial.StepClock`); an
        evaluation under ``no_grad``, a recomputation in backward or a micro-step does not."""
        if self._window is None:
            self._clock.forward()

    def _on_forward(self) -> None:
        """A captured layer's forward: refused while the last backward's exchange is pending."""
        window = self._window
        if not compiling() and window is not None and window.future is not None and not in_backward():
            raise RuntimeError(
                f"a forward pass started after backward_passes_per_step={self.backward_passes_per_step} "
                f"backward pass(es) without synchronize(): call sync.synchronize() (or the optimizer's "
                f"step) after every step, accumulate micro-steps inside no_sync(), or increase "
                f"backward_passes_per_step")

    def _before_accumulate(self, unit: FactorUnit, p: nn.Parameter, grad: torch.Tensor) -> None:
        window = self._current_window()
        if unit.index in self._bookless:  # dense whatever .grad held before: no prior to keep
            window.touch(p)
        else:
            window.before_accumulate(p, unit)

    def _after_accumulate(self, unit: FactorUnit, p: nn.Parameter) -> None:
        window = self._current_window()
        if unit.index in self._bookless:  # no rows to mark; other gradients' marks still move
            window.note_accumulated(p)
        else:
            window.after_accumulate(p, unit)
        if self._accumulating or self._driven_by_ddp:  # DDP says when a unit is ready (ddp_hook)
            return
        passes = window.count_pass(p)
        if passes > self.backward_passes_per_step:  # its rows may be on the wire: fail at synchronize()
            window.twice.append(unit.name)
        k = self.backward_passes_per_step
        if passes >= k and all(window.passes.get(q, 0) >= k for q in self._param_ids[unit.index]):
            window.ready[unit.index].set()
            self._dispatch(window, self._exchange)

    def _after_dense_accumulate(self, p: nn.Parameter) -> None:
        window = self._current_window()
        window.touch(p)
        window.note_accumulated(p)  # it may share a DDP bucket with factor weights' gradients
        if not (self._accumulating or self._driven_by_ddp):
            window.count_pass(p)


def _abandon(ref: "weakref.ref[DADSynchronizer]") -> None:
    sync = ref()
    if sync is not None:
        sync._release()
        sync._worker.join(timeout=5.0)
        # A gloo worker thread drops its last reference to a finished collective's tensors a
        # moment after the wait returns, and that needs the GIL; once the interpreter finalises,
        # taking the GIL ends the thread inside a noexcept destructor (std::terminate). Hand the
        # GIL over briefly so those threads finish while they still can.
        time.sleep(_ENGINE_DRAIN_S)
