"""How a DDP-driven step ends: on dAD's worker thread or inline in the last bucket's hook (NCCL with
``find_unused_parameters``), and, in a DDP that has entered ``join``, with the ranks still
training counted (`ddp_hook`'s module doc, "Uneven inputs").

A base of `ddp_hook.DDPDriver`, which holds the state these methods read.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from dad_integrations.report import ParamReport, StepReport
from dad_integrations.routing.trial import in_backward


class StepEnd:
    """The step-ending half of `ddp_hook.DDPDriver` (no state of its own)."""

    def _run_step(self, window, inline: bool = False) -> None:
        """The step's last bucket is in: end the step on the worker, or here (``inline``, `_serialised`)."""
        if inline or self._serialised():
            window.future = Future()
            window.future.set_result(self._step(window))
        else:
            self.sync._dispatch(window, self._step)

    def _serialised(self) -> bool:
        """Whether this step's exchange runs inline, in the last bucket's hook: on NCCL, a DDP with
        ``find_unused_parameters=True`` all-reduces its used-parameter map on its own communicator,
        from the autograd thread, right after that hook returns; dAD's worker thread would race it,
        and NCCL operations on two communicators enqueued in different orders on different ranks can
        deadlock. Inline, every dAD collective is enqueued before the map's, on every rank (the step
        then overlaps nothing). ``serialise`` (True/False) overrides the choice."""
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
        ddp = self.ddp() if self.ddp is not None else None
        config = getattr(ddp, "_join_config", None)
        return bool(config is not None and config.enable and not in_backward())

    def _join_postscale(self, window) -> Tuple[Optional[float], Optional[ParamReport]]:
        """In a DDP that has entered ``join``: the step's postscale (DDP's divisor: the ranks still
        training with ``divide_by_initial_world_size=False``, else None for all ranks), having
        set the window's prior scale; the traffic of counting those ranks (every rank, joined or
        not, runs that collective in the step). Elsewhere (None, None)."""
        ddp = self.ddp() if self.ddp is not None else None
        config = getattr(ddp, "_join_config", None)
        if config is None or not config.enable:
            return None, None
        sync = self.sync
        flag = torch.tensor([0.0 if window.sink.shadow else 1.0], device=sync._exchanger.device)
        handle = sync.aggregator.all_reduce(flag, name="dad.join.training", op="sum")
        active = int(handle.wait()[0])
        entry = ParamReport("[join: ranks training]", "overhead", ())
        entry.add_traffic(handle.traffic)
        world = sync.aggregator.world_size
        postscale = None if getattr(ddp, "_divide_by_initial_world_size", True) else 1.0 / active
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
