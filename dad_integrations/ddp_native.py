"""A DDP step that goes by DDP's buckets as they are: each bucket scaled and all-reduced from the
hook the moment DDP hands it over, the step ended in the last bucket's hook, and between such
steps the synchroniser's per-parameter hooks parked (`ddp_hook`'s module doc, "Out of the way
when dense").

A base of `ddp_hook.DDPDriver`, which holds the state these methods read.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch import nn


class NativeSteps:
    """The native-step half of `ddp_hook.DDPDriver` (no state of its own)."""

    def on_native_bucket(self, bucket: dist.GradBucket, on_done: Callable[[Optional[BaseException]], None]) -> bool:
        """If this step goes by DDP's buckets as they are (`_native`, decided at its first bucket):
        put ``bucket`` on the wire now and, at the last bucket, end the step; returns whether it
        did (False: the per-parameter path, `on_bucket`). Asked before the bucket's per-parameter
        views are cut: a native step needs none."""
        window = self._live_sync()._current_window()
        if window.native is None:
            window.native = [] if self._native(window) else False
        if window.native is False:
            return False
        self._add_native(window, bucket.buffer(), bucket.parameters(), bucket.is_last(), on_done)
        return True

    def _add_native(self, window, buffer: torch.Tensor, params: List[torch.Tensor], last: bool,
                    on_done: Callable[[Optional[BaseException]], None]) -> None:
        """One bucket of a native step on the wire (`Exchanger.start_native`: scaled before the sum,
        as DDP scales its own). The last bucket ends the step right here, on the autograd thread:
        every collective of the step is issued by then and DDP waits for the buckets' futures next
        anyway; a hop to dAD's worker thread would only add thread wake-ups and GIL hand-overs."""
        sync = self.sync
        with window.lock:
            window.native.append(sync._exchanger.start_native(buffer, sync.scale) + (params,))
            window.done.append(on_done)
        if last:
            self._run_step(window, inline=True)

    def _native(self, window) -> bool:
        """Whether this step goes by DDP's buckets as they are (`RoutePolicy.native_dense`); not in a
        ``join`` (its shadow and divisor are dAD's to apply)."""
        ddp = self.ddp() if self.ddp is not None else None
        config = getattr(ddp, "_join_config", None)
        if config is not None and config.enable:
            return False
        sync = self.sync
        return sync._exchanger.policy.native_dense(sync._steps, not sync._verified)

    def _park_hooks(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Before a training forward with no step open: a step whose every unit is sure to go dense
        (`DADSynchronizer._bookless`, refreshed when a step ends) runs without the per-parameter
        hooks (they would only note that backward reached each parameter: ~50 Python calls from
        the autograd thread a step, which DDP's own step does not pay); a step that needs them
        gets them back. Changed here because this is between steps and outside backward; DDP runs
        this hook before every forward whose backward it reduces, so no backward is missed. A
        forward inside ``no_sync()`` opens the step's window now, as its backward's first hook
        would: the step's span (route trials) starts at its first micro-step, and
        `DADSynchronizer.load_state_dict` refuses to load between micro-steps."""
        sync = self.sync
        if sync._window is not None:  # a step is open (micro-steps): its hooks stay as they are
            return
        parked = len(sync._bookless) == len(sync._plan.units)
        sync._set_param_hooks(not parked)
        if parked and not ddp.require_backward_grad_sync:
            sync._clock.forward()
            sync._current_window()
