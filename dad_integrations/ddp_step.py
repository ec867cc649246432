"""How a DDP-driven step runs and ends: a step of DDP's buckets as they are (each bucket scaled and
all-reduced from the hook, `ddp_hook`'s module doc, "Out of the way when dense"), the step's end on
dAD's worker thread or inline in the last bucket's hook (NCCL with ``find_unused_parameters``), and,
in a DDP that has entered ``join``, the ranks still training counted ("Uneven inputs").

The base of `ddp_hook.DDPDriver`, which holds the state these methods read.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from dad_integrations.exchange.ahead import agree_forward_rows
from dad_integrations.report import ParamReport, StepReport
from dad_integrations.routing.trial import in_backward

OnDone = Callable[[Optional[BaseException]], None]


class DDPSteps:
    """The step-running half of `ddp_hook.DDPDriver` (no state of its own)."""

    def on_native_bucket(self, bucket: dist.GradBucket, on_done: OnDone) -> bool:
        """If this step goes by DDP's buckets as they are (`_native`, decided at its first bucket):
        put ``bucket`` on the wire now (`Exchanger.start_native`: scaled before the sum, as DDP
        scales its own) and, at the last bucket, end the step right here, on the autograd thread
        (DDP waits for the buckets' futures next anyway: a hop to dAD's worker would only add thread
        wake-ups); returns whether it did (False: the per-parameter path, `on_bucket`). Asked before
        the bucket's per-parameter views are cut: a native step needs none."""
        sync = self._live_sync()
        window = sync._current_window()
        if window.native is None:
            window.native = [] if self._native(window) else False
        if window.native is False:
            return False
        with window.lock:
            window.native.append(sync._exchanger.start_native(bucket.buffer(), sync.scale) + (bucket.parameters(),))
            window.done.append(on_done)
        if bucket.is_last():
            self._run_step(window, inline=True)
        return True

    def _join_config(self):
        """DDP's ``join`` config where it has entered ``join``, else None."""
        config = getattr(self.ddp() if self.ddp is not None else None, "_join_config", None)
        return config if config is not None and config.enable else None

    def _native(self, window) -> bool:
        """Whether this step goes by DDP's buckets as they are (`RoutePolicy.native_dense`); not in a
        ``join`` (its shadow and divisor are dAD's to apply). A step that chooses routes chooses them
        here first, on the rows its forward counted (`exchange.ahead`): a collective, at every rank's
        first bucket."""
        sync = self.sync
        if self._join_config() is not None:
            return False
        exchanger, step, verify = sync._exchanger, sync._steps, not sync._verified
        policy = exchanger.policy
        if policy.decides_ahead(step, verify):
            rows = agree_forward_rows(sync._plan.units, sync.aggregator, exchanger.device)
            if rows is not None:
                policy.decide_ahead(step, rows)
        return policy.native_dense(step, verify)

    def _park_hooks(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Before a training forward with no step open: a step whose every unit is sure to go dense
        (`DADSynchronizer._bookless`) runs without the per-parameter hooks, which would only note
        that backward reached each parameter; a step that needs them gets them back. A forward
        inside ``no_sync()`` opens the step's window now, as its backward's first hook would."""
        sync = self.sync
        if sync._window is not None:  # a step is open (micro-steps): its hooks stay as they are
            return
        parked = len(sync._bookless) == len(sync._plan.units)
        sync._set_param_hooks(not parked)
        if parked and not ddp.require_backward_grad_sync:
            sync._clock.forward()
            sync._current_window()

    def _run_step(self, window, inline: bool = False) -> None:
        """The step's last bucket is in: end the step on the worker, or here (``inline``, `_serialised`)."""
        if inline or self._serialised():
            window.future = Future()
            window.future.set_result(self._step(window))
        else:
            self.sync._dispatch(window, self._step)

    def _serialised(self) -> bool:
        """Whether this step's exchange runs inline, in the last bucket's hook: on NCCL with
        ``find_unused_parameters=True``, so that every dAD collective is enqueued before DDP's
        used-parameter map's, on every rank (``docs/guarantees.md``, "Collective order (NCCL)").
        ``serialise`` (True/False) overrides the choice."""
        if self.serialise is not None:
            return self.serialise
        ddp = self.ddp() if self.ddp is not None else None
        if ddp is None or not getattr(ddp, "find_unused_parameters", False):
            return False
        try:
            return "nccl" in str(dist.get_backend(ddp.process_group)).lower()
        except (RuntimeError, ValueError):
            return False

    def _joined(self) -> bool:
        """This rank has joined (``ddp.join()``): DDP hands over buckets outside any backward."""
        return self._join_config() is not None and not in_backward()

    def _join_postscale(self, window) -> Tuple[Optional[float], Optional[ParamReport]]:
        """In a DDP that has entered ``join`` (`ddp_hook`'s module doc, "Uneven inputs"): the step's
        postscale, having set the window's prior scale, and the traffic of counting the ranks still
        training. Elsewhere (None, None)."""
        if self._join_config() is None:
            return None, None
        sync = self.sync
        flag = torch.tensor([0.0 if window.sink.shadow else 1.0], device=sync._exchanger.device)
        handle = sync.aggregator.all_reduce(flag, name="dad.join.training", op="sum")
        active = int(handle.wait()[0])
        entry = ParamReport("[join: ranks training]", "overhead", ())
        entry.add_traffic(handle.traffic)
        world = sync.aggregator.world_size
        postscale = None if getattr(self.ddp(), "_divide_by_initial_world_size", True) else 1.0 / active
        window.sink.prior_scale = active * (1.0 / world if postscale is None else postscale)
        return postscale, entry

    def _step(self, window) -> StepReport:
        sync = self.sync
        error: Optional[BaseException] = None
        report = None
        try:
            if window.native:
                report = sync._exchanger.run_native(window, window.native, sync._names, step=sync._steps)
                counted = None
            else:
                postscale, counted = self._join_postscale(window)
                report = sync._exchange(window, postscale)
            if counted is not None:
                report.params.append(counted)
        except BaseException as e:
            error = e
        with window.lock:
            done, window.done = window.done, []
        late = sync._end_step(window)
        if error is None:
            try:
                sync._finish(report, late)
            except BaseException as e:
                error = e
        for callback in done:
            callback(error)
        if error is not None:
            raise error
        return report


def raise_in_backward(future: torch.futures.Future) -> None:
    """DDP reads a hook's failed future as ``Unable to cast <error> to Tensor``, a bare RuntimeError.
    An autograd callback, queued here before DDP's own final one, waits on the future first (DDP
    waits on it next anyway), so that backward raises dAD's own error (a `CollectiveError`, its
    chain intact). Outside backward (DDP's join hook) DDP's final callback is not run either."""
    if not in_backward():
        return
    try:
        torch.autograd.Variable._execution_engine.queue_callback(future.wait)
    except RuntimeError:  # no callback queue here (e.g. under compiled autograd): DDP's message stands
        pass
