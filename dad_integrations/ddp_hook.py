"""dAD as a DDP communication hook: DDP's own all-reduce is replaced, not run besides dAD.

DDP hands each gradient bucket to a communication hook and copies whatever the hook's future
returns into the parameters' ``.grad``. `register_dad_comm_hook` installs a hook that passes the
bucket's finished local gradients to a `DADSynchronizer` running on ``ddp.module``: captured
weights travel as factors, the rest of the bucket through dAD's dense buckets, and the averaged
results are written back into the bucket. Buckets arrive in the same order on every rank; the step
runs on the synchroniser's worker thread, overlapping the rest of backward, and every bucket's
future completes when the step is over (DDP waits for them at the end of backward).

Out of the way when dense. A step whose every weight is dense whatever its rows (held dense by
objective "time" between refreshes, a route trial's dense step, dense for good) and that owes
nothing (no residual to flush, not the checked first step, not in ``join``) is DDP's own step:
each bucket is scaled and all-reduced as it is, from the hook, the moment DDP hands it over (one
collective per DDP bucket, the same numbers as DDP's bit for bit), and the step ends in the last
bucket's hook, with no per-parameter work, no worker thread and, between such steps, none of the
synchroniser's per-parameter hooks (`DDPDriver.on_native_bucket`, `DDPDriver._park_hooks`).

What DDP users keep: ``ddp.no_sync()`` accumulation (the hook is not called, factors keep
accumulating and go with the next synchronised backward), gradient clipping and optimizers after
backward, mixed precision. Costs are those of `DADSynchronizer`.

Uneven inputs (``ddp.join()``). A rank that has run out of inputs shadows the others'
collectives: DDP's join hook hands each bucket, zeroed, to the hook outside any backward. dAD then
runs the step with this rank adding nothing (`sink.BucketViewSink.shadow`: no rows, no dense
gradient, whatever ``.grad`` holds), so the others' collectives match. DDP's own reduction sums
what the ranks still training hold in ``.grad`` and divides by the initial world size, or with
``join(divide_by_initial_world_size=False)`` by the ranks still training; dAD does the same: one
more all-reduce, of one number, counts those ranks in every step of a DDP that has entered
``join`` (DDP keeps its join config afterwards, and so its own extra collectives too), and a
gradient left in ``.grad`` from before the step (the window's prior, the same on every rank) counts
once per rank still training (`sink.BucketViewSink.prior_scale`).

Pickling (``torch.save(ddp)``, as PyTorch's DDP tests do). DDP pickles its hooks with it; the
hook's state (`DDPDriver`) pickles as PowerSGD's state does: without its process group (and
without the synchroniser's threads), with the config and this rank's dAD state
(`DADSynchronizer.state_dict`). DDP's unpickling builds a new reducer without the hook; the
loaded model's first forward with gradients enabled attaches a new synchroniser over a new group
of DDP's (default) group's ranks, loads that state and registers the hook again, so training goes
on with dAD. Like any DDP training forward, that first forward must run on every rank. A DDP
registered with ``compiled=True`` (compiled itself) has no such pre-hook (`_wrapper_compiled`:
traced, it did nothing, and it cost a graph break): loaded, it is attached again by calling
`register_dad_comm_hook` on it (with no config: the saved config and state).
"""
# No `from __future__ import annotations` here: DDP inspects the hook's annotations and
# accepts only the real `dist.GradBucket` / `Future[Tensor]` objects, not strings.
import logging
import weakref
from concurrent.futures import Future
from datetime import timedelta
from typing import Callable, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from dad_integrations.engines import banner
from dad_integrations.comm.aggregator import FactorAggregator
from dad_integrations.capture.compiled import compiling, is_compiled
from dad_integrations.capture.hooks import remove_detached_captures
from dad_integrations.config import DADConfig
from dad_integrations.comm.groups import new_group_like
from dad_integrations.report import ParamReport, StepReport
from dad_integrations.synchronizer import DADSynchronizer, in_backward

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
        remove_detached_captures(ddp.module)
    if ddp._comm_hooks:
        raise RuntimeError("this DDP model has a communication hook already (DDP takes one, registered once)")
    _close_previous(ddp.module)
    sync = _attach(ddp, loaded[0]._loaded["config"] if loaded and config is None else config, aggregator,
                   timeout, compiled)
    if loaded and config is None:
        sync.load_state_dict(loaded[0]._loaded["state"])
    driver = DDPDriver(sync, timeout=timeout, own_aggregator=aggregator is not None)
    driver.ddp = weakref.ref(ddp)
    _DRIVERS[ddp.module] = driver
    ddp.register_comm_hook(driver, _dad_comm_hook)
    if not _wrapper_compiled(ddp, compiled):
        # kept by DDP's pickling: the loaded model's first forward attaches dAD again (`DDPDriver`)
        ddp.register_forward_pre_hook(driver.before_forward)
    return driver.sync


def _wrapper_compiled(ddp: nn.parallel.DistributedDataParallel, compiled: Optional[bool]) -> bool:
    """Whether ``ddp`` itself runs under ``torch.compile`` (said by ``compiled=True``, with no compiled
    module inside it): then it gets no forward pre-hook. Under compile the pre-hook would only be
    traced, doing nothing (`DDPDriver.before_forward`), and a hook on DDP costs a graph break: after
    DDP's own break (its logger's ``set_runtime_stats_and_log``), dynamo traces the ``forward`` of a
    built-in module that has hooks as a frame of its own (``trace_rules.check_verbose``: "inbuilt
    nn.Module.forward allowed - module has hooks") and meets the same break again there."""
    return bool(compiled) and not is_compiled(ddp.module)


# per module, the hook of the last DDP around it (weak: a dropped model takes its entry along)
_DRIVERS: "weakref.WeakKeyDictionary[nn.Module, DDPDriver]" = weakref.WeakKeyDictionary()


def _close_previous(module: nn.Module) -> None:
    """The module was wrapped in a DDP with the dAD hook before (PyTorch's tests wrap one model
    in a new DDP case after case): the new DDP takes over, as DDP's own reducer does; close the
    old hook's synchroniser, whose hooks on the module would go on capturing rows for nobody."""
    previous = _DRIVERS.pop(module, None)
    if previous is not None and previous.sync is not None and not previous.sync._closed:
        log.info("dAD: the model was wrapped in a new DDP; the dAD hook of the previous one is closed")
        previous.sync.close()


def _attach(ddp: nn.parallel.DistributedDataParallel, config: Union[DADConfig, Mapping, None],
            aggregator: Optional[FactorAggregator], timeout: Optional[timedelta],
            compiled: Optional[bool] = None) -> DADSynchronizer:
    if aggregator is None:
        from dad_integrations.comm.torch_distributed import TorchDistributedAggregator
        aggregator = TorchDistributedAggregator(_ranks_group(ddp.process_group, timeout))
    # DDP broadcast rank 0's parameters and buffers when it wrapped the model
    with banner.engine("DDP (comm hook)"):
        return DADSynchronizer(ddp.module, aggregator, config, broadcast_parameters=False, compiled=compiled,
                               _driven_by_ddp=True)


class DDPDriver:
    """Drives a `DADSynchronizer`'s steps from DDP's buckets instead of its own weight hooks.

    Buckets come in the same order on every rank. A unit is ready when the buckets of its weight
    and of all its biases have arrived (results go into those buckets, see `sink.BucketViewSink`);
    the step runs on the synchroniser's worker thread, and the step's futures complete when it is
    over. An all-dense step goes by DDP's buckets as they are (`on_native_bucket`).

    It is DDP's hook state, and pickles as PowerSGD's does (see the module doc): the config and
    this rank's dAD state go, the synchroniser and its group do not; ``sync`` is None once loaded,
    until `before_forward` attaches a new one.
    """

    def __init__(self, sync: DADSynchronizer, *, timeout: Optional[timedelta] = None,
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
        self.sync = None
        self.serialise = None
        self.ddp = None
        self.timeout = saved["timeout"]
        self.own_aggregator = saved["own_aggregator"]
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

    def _reattach(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Attach a new synchroniser to a loaded DDP, with the saved state; register the hook."""
        saved = self._loaded
        if self.own_aggregator and dist.get_rank() == 0:
            log.warning("dAD: the loaded DDP model's hook was registered with an aggregator of the user's, "
                        "which does not pickle; it is re-attached over DDP's (default) process group")
        remove_detached_captures(ddp.module)
        _close_previous(ddp.module)
        sync = _attach(ddp, saved["config"], None, self.timeout)
        sync.load_state_dict(saved["state"])
        # DDP's unpickling kept this hook in _comm_hooks but built its reducer without it
        ddp._comm_hooks = [(h, s) for h, s in ddp._comm_hooks if s is not self]
        ddp.register_comm_hook(self, _dad_comm_hook)
        self.sync, self._loaded, self.own_aggregator = sync, None, False
        self.ddp = weakref.ref(ddp)
        _DRIVERS[ddp.module] = self

    def on_bucket(self, params: List[torch.Tensor], views: List[torch.Tensor], last: bool,
                  on_done: Callable[[Optional[BaseException]], None], buffer: Optional[torch.Tensor] = None) -> None:
        """DDP handed over a bucket of finished local gradients; results are written into ``views``."""
        sync = self._live_sync()
        window = sync._current_window()
        if window.native is None:  # the step's first bucket decides
            window.native = [] if buffer is not None and self._native(window) else False
        if window.native is not False:  # a native step (see `on_native_bucket`): views are not used
            self._add_native(window, buffer, params, last, on_done)
            return
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

    def _live_sync(self) -> DADSynchronizer:
        """The synchroniser the hook drives; raises where there is none to drive (loaded, or closed)."""
        sync = self.sync
        if sync is None:  # DDP's unpickled reducer has no hook: this cannot be reached from DDP
            raise RuntimeError("the dAD communication hook of a loaded DDP model ran before its first forward")
        if sync._closed:
            raise RuntimeError("the dAD communication hook was used after close()")
        return sync

    def _run_step(self, window, inline: bool = False) -> None:
        """The step's last bucket is in: end the step on the worker, or here (``inline``, `_serialised`)."""
        if inline or self._serialised():
            window.future = Future()
            window.future.set_result(self._step(window))
        else:
            self.sync._dispatch(window, self._step)

    def _native(self, window) -> bool:
        """Whether this step goes by DDP's buckets as they are (`RoutePolicy.native_dense`); not in a
        ``join`` (its shadow and divisor are dAD's to apply)."""
        ddp = self.ddp() if self.ddp is not None else None
        config = getattr(ddp, "_join_config", None)
        if config is not None and config.enable:
            return False
        sync = self.sync
        return sync._exchanger.policy.native_dense(sync._steps, not sync._verified)

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
    driver.on_bucket(params, views, bucket.is_last(), done, buffer)
    return future


def _raise_in_backward(future: torch.futures.Future) -> None:
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


def _ranks_group(process_group, timeout: Optional[timedelta] = None):
    """A new group over the ranks of DDP's group: dAD's collectives run on a background thread,
    and must not interleave with the user's (or DDP's) own on a shared group. It takes ``timeout``,
    else DDP's group's timeout, so that a stalled rank fails as soon as it would with DDP."""
    ranks = dist.get_process_group_ranks(process_group)
    if len(ranks) != dist.get_world_size():
        # dist.new_group must be called by every rank of the default group, which a DDP over a
        # subgroup cannot promise here
        raise ValueError("DDP runs on a subgroup: pass aggregator=TorchDistributedAggregator(group) with a "
                         "group made for dAD on every rank (dist.new_group(ranks))")
    return new_group_like(ranks, base=process_group, timeout=timeout)
