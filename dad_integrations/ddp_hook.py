"""dAD as a DDP communication hook: DDP's own all-reduce is replaced, not run besides dAD
(what DDP users keep: ``docs/guides/torch-distributed.md``).

DDP hands each gradient bucket to a communication hook and copies what the hook's future returns
into ``.grad``. `register_dad_comm_hook`'s hook passes the bucket's finished local gradients to a
`DADSynchronizer` on ``ddp.module``: captured weights travel as factors, the rest through dAD's
dense buckets, and the averages are written back into the bucket. Buckets arrive in the same order
on every rank; the step runs on the synchroniser's worker thread, overlapping the rest of backward,
and every bucket's future completes when the step is over.

Out of the way when dense. A step whose every weight is dense whatever its rows and that owes
nothing (no residual to flush, not the checked first step, not in ``join``) is DDP's own step: each
bucket is scaled and all-reduced as it is, from the hook (DDP's numbers bit for bit), and the step
ends in the last bucket's hook, with no per-parameter work, no worker thread and, between such
steps, none of the synchroniser's per-parameter hooks (`DDPDriver.on_native_bucket`, `_park_hooks`).

Uneven inputs (``ddp.join()``). DDP's join hook hands a joined rank's buckets, zeroed, to the hook
outside any backward; dAD runs the step with this rank adding nothing (`sink.BucketViewSink.shadow`),
so the others' collectives match. As DDP divides by the initial world size, or with
``divide_by_initial_world_size=False`` by the ranks still training, dAD counts those ranks with one
more all-reduce of one number in every step of a DDP that has entered ``join``, and a gradient left
in ``.grad`` from before the step counts once per rank still training (`BucketViewSink.prior_scale`).

Pickling (``torch.save(ddp)``). The hook's state (`DDPDriver`) pickles as PowerSGD's does: without
its process group and threads, with the config and this rank's dAD state. DDP's unpickling builds
a reducer without the hook; the loaded model's first forward with gradients enabled (on every rank)
attaches a new synchroniser over a new group of DDP's (default) group's ranks, loads that state and
registers the hook again. A DDP registered with ``compiled=True`` has no such pre-hook
(`_wrapper_compiled`): loaded, it is attached again by `register_dad_comm_hook` (with no config:
the saved config and state).
"""
# No `from __future__ import annotations` here: DDP inspects the hook's annotations and
# accepts only the real `dist.GradBucket` / `Future[Tensor]` objects, not strings.
import logging
import weakref
from datetime import timedelta
from typing import List, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from dad_integrations.comm.aggregator import FactorAggregator
from dad_integrations.capture.compiled import compiling
from dad_integrations.config import DADConfig
from dad_integrations.routing.trial import in_backward
from dad_integrations.synchronizer import DADSynchronizer
from dad_integrations.ddp_attach import DRIVERS as _DRIVERS, attach as _attach, wrapper_compiled as _wrapper_compiled
from dad_integrations.ddp_step import DDPSteps, OnDone, raise_in_backward as _raise_in_backward

log = logging.getLogger(__name__)


def register_dad_comm_hook(ddp: nn.parallel.DistributedDataParallel,
                           config: Union[DADConfig, Mapping, None] = None,
                           aggregator: Optional[FactorAggregator] = None, *,
                           timeout: Optional[timedelta] = None,
                           compiled: Optional[bool] = None) -> DADSynchronizer:
    """Replace ``ddp``'s gradient all-reduce with dAD; returns the synchroniser (for its reports).

    Call once, after wrapping the model and before the first backward. ``aggregator`` defaults to
    a `TorchDistributedAggregator` over a new group of DDP's process group's ranks, whose timeout
    is ``timeout``, or where None that of DDP's process group (a stalled rank fails backward
    within it, as with DDP's own all-reduce); unused with ``aggregator``. ``compiled``: the DDP
    runs under ``torch.compile`` (``torch.compile(ddp)`` after this call); None reads it from the
    model (compiled before DDP wrapped it). See `DADSynchronizer`.
    """
    if not isinstance(ddp, nn.parallel.DistributedDataParallel):
        raise TypeError(f"expected a DistributedDataParallel model, got {type(ddp).__name__}")
    # a loaded DDP's hook not attached yet (`_wrapper_compiled`: no pre-hook attaches it): replaced,
    # its config and state taken where no config is given
    loaded = [s for _, s in ddp._comm_hooks if isinstance(s, DDPDriver) and s.sync is None]
    if loaded and len(loaded) == len(ddp._comm_hooks):
        ddp._comm_hooks = []
    if ddp._comm_hooks:
        raise RuntimeError("this DDP model has a communication hook already (DDP takes one, registered once)")
    saved = loaded[0]._loaded if loaded and config is None else {"config": config, "state": None}
    sync = _attach(ddp, saved["config"], aggregator, timeout, compiled, state=saved["state"])
    driver = DDPDriver(sync, timeout=timeout, own_aggregator=aggregator is not None)
    driver._drive(ddp)
    if not _wrapper_compiled(ddp, compiled):
        # kept by DDP's pickling: the loaded model's first forward attaches dAD again (`DDPDriver`)
        ddp.register_forward_pre_hook(driver.before_forward)
    return driver.sync


class DDPDriver(DDPSteps):
    """Drives a `DADSynchronizer`'s steps from DDP's buckets instead of its own weight hooks (module
    doc): a unit is ready when the buckets of its weight and all its biases are in. It is DDP's hook
    state; ``sync`` is None once loaded, until `before_forward` attaches one."""

    def __init__(self, sync: Optional[DADSynchronizer], *, timeout: Optional[timedelta] = None,
                 own_aggregator: bool = False):
        self.sync: Optional[DADSynchronizer] = sync
        self.timeout = timeout
        self.own_aggregator = own_aggregator
        self.ddp: Optional["weakref.ref[nn.parallel.DistributedDataParallel]"] = None  # the DDP it drives
        self._loaded: Optional[dict] = None  # what a loaded driver attaches with
        self.serialise: Optional[bool] = None  # see `_serialised`; None decides by DDP's backend

    def __getstate__(self) -> dict:
        if self.sync is None:  # loaded and not attached yet: pickles as it was loaded
            return dict(self._loaded)
        return {"config": self.sync.config.to_dict(), "state": self.sync.state_dict(),
                "timeout": self.timeout, "own_aggregator": self.own_aggregator}

    def __setstate__(self, saved: dict) -> None:
        self.__init__(None, timeout=saved["timeout"], own_aggregator=saved["own_aggregator"])
        self._loaded = saved

    def before_forward(self, ddp: nn.parallel.DistributedDataParallel, args: tuple) -> None:
        """DDP's forward pre-hook: on a loaded model, attach dAD before the first training forward;
        between steps, park or bring back the synchroniser's per-parameter hooks (`_park_hooks`).
        Not while dynamo traces (``torch.compile(ddp)``): what it does is Python state, a graph break
        in a traced hook; the compiled step keeps the per-parameter hooks it started with (on)."""
        if compiling() or not torch.is_grad_enabled() or in_backward():
            return
        if self.sync is None:
            self._reattach(ddp)
        if not self.sync._closed:
            self._park_hooks(ddp)

    def _reattach(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Attach a new synchroniser to a loaded DDP, with the saved state; register the hook."""
        if self.own_aggregator and dist.get_rank() == 0:
            log.warning("dAD: the loaded DDP model's hook was registered with an aggregator of the user's, "
                        "which does not pickle; it is re-attached over DDP's (default) process group")
        sync = _attach(ddp, self._loaded["config"], None, self.timeout, state=self._loaded["state"])
        # DDP's unpickling kept this hook in _comm_hooks but built its reducer without it
        ddp._comm_hooks = [(h, s) for h, s in ddp._comm_hooks if s is not self]
        self.sync, self._loaded, self.own_aggregator = sync, None, False
        self._drive(ddp)

    def _drive(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Become ``ddp``'s communication hook (and the hook of the last DDP around its module)."""
        self.ddp = weakref.ref(ddp)
        _DRIVERS[ddp.module] = self
        ddp.register_comm_hook(self, _dad_comm_hook)

    def on_bucket(self, params: List[torch.Tensor], views: List[torch.Tensor], last: bool, on_done: OnDone) -> None:
        """DDP handed over a bucket of finished local gradients (not a native step's, `on_native_bucket`);
        results are written into ``views``."""
        sync = self._live_sync()
        window = sync._current_window()
        if not window.sink.views and self._joined():  # the step's first bucket, shadowed by join
            window.sink.shadow = True
            for c in sync._plan.captures:  # rows of no_sync micro-steps before joining: DDP sends zeros
                c.clear()
        with window.lock:
            for p, v in zip(params, views):
                window.sink.views[id(p)] = v
            window.done.append(on_done)
        for p in params:
            unit = sync._unit_of.get(id(p))
            if unit is not None and all(id(q) in window.sink.views for q in unit.params):
                window.ready[unit.index].set()
        serial = self._serialised()
        if not serial:
            sync._dispatch(window, self._step)
        if last:
            window.release_all()  # after on_done is in: the step may end from here on
            if serial:
                self._run_step(window)

    def _live_sync(self) -> DADSynchronizer:
        """The synchroniser the hook drives; raises where there is none to drive (loaded, or closed)."""
        sync = self.sync
        if sync is None:  # DDP's unpickled reducer has no hook: this cannot be reached from DDP
            raise RuntimeError("the dAD communication hook of a loaded DDP model ran before its first forward")
        if sync._closed:
            raise RuntimeError("the dAD communication hook was used after close()")
        return sync


def _dad_comm_hook(driver: DDPDriver, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: hand the bucket to dAD; the future yields the averaged bucket."""
    buffer = bucket.buffer()
    future: torch.futures.Future = torch.futures.Future()

    def done(error: Optional[BaseException]) -> None:
        if error is None:
            future.set_result(buffer)
        else:
            future.set_exception(error)

    _raise_in_backward(future)
    if driver.on_native_bucket(bucket, done):
        return future
    params = bucket.parameters()
    views: List[torch.Tensor] = []
    offset = 0
    for p in params:  # the bucket holds its parameters' gradients flattened, in this order
        views.append(buffer[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    driver.on_bucket(params, views, bucket.is_last(), done)
    return future

