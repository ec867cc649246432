"""`DADSynchronizer`: synchronise a model's gradients with dAD instead of all-reduce.

Usage, in an ordinary training loop::

    sync = DADSynchronizer(model, TorchDistributedAggregator(), DADConfig(mode="auto"))
    loss.backward()
    sync.synchronize()        # every param.grad now holds the average over ranks, as DDP gives
    optimizer.step()

How a step runs. Forward hooks keep each captured layer's input rows; a hook on the layer's output
keeps its output-gradient rows (`capture`). When autograd has finished a weight's local gradient
(a post-accumulate-grad hook), its unit is ready, and a single background thread exchanges the
units in a fixed order that every rank shares (reverse registration order, which backward
follows): a size exchange, then one all-gather of the unit's exact factors, or its rank-r
factors into a bucket shared with the next units (one all-gather per ``bucket_cap_mb``; small
payloads usually fill one bucket, sent when backward ends), or a place in the dense buckets. The
rebuild of one unit overlaps the next unit's collective, and exact exchanges overlap the rest of
backward. `synchronize()` releases units that never got a gradient, all-reduces the dense
buckets and waits.

Size exchanges. Exact factors have a row count per rank, which the ranks agree (one small
all-gather per unit) before the factors' all-gather. The first step (verification) exchanges sizes
for every unit. After it, mode "rank" never exchanges sizes, and mode "auto" predicts each unit's
route from the counts of its last size exchange: a unit predicted to go dense or rank-r sends no
size exchange at all (so a dense unit moves exactly what all-reduce moves); one predicted to go
exact exchanges sizes, which refreshes its counts, and then decides on the current counts. Counts
of a unit that goes dense or rank-r are not refreshed: if rows later shrink, it stays on that
route (the choice is sticky after the first steps; it never costs more bytes than its route).

Costs per weight (m x n), S ranks, N local rows: exact factors gather ``N (m+n)`` numbers per
rank and rebuild with one ``S N m n`` matmul; rank-r factors gather ``r (m+n)`` per rank and
rebuild with one ``S r m n`` matmul; dense buckets move ``2 (S-1)/S m n`` like all-reduce.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import queue
import threading
import weakref
from concurrent.futures import Future
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from .aggregator import FactorAggregator, Traffic, ring_allreduce_bytes
from .config import DADConfig
from .dense import allreduce_dense
from .layers import Rows, add_rebuilt_grad, output_grad_rows
from .low_rank import LocalGradient, choose_method, reduce_rank
from .plan import FactorUnit, build_plan
from .policy import ID_DTYPE, choose_representation, estimate_bytes, exact_block_specs
from .report import ParamReport, StepReport
from .wire import pack, packed_size, unpack

log = logging.getLogger(__name__)

WIRE_DTYPES = {None: None, "float16": torch.float16, "bfloat16": torch.bfloat16}
# relative error allowed between the factors' local rebuild and autograd's local gradient
VERIFY_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3}
VERIFY_TOLERANCE_LOW_PRECISION = 5e-2


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
    """

    def __init__(self, model: nn.Module, aggregator: Optional[FactorAggregator] = None,
                 config: Union[DADConfig, Mapping, None] = None, *, prescale_factor: float = 1.0,
                 postscale_factor: Optional[float] = None, backward_passes_per_step: int = 1,
                 _driven_by_ddp: bool = False):
        self.config = DADConfig() if config is None else DADConfig.from_dict(config)
        if aggregator is None:
            from .torch_distributed import TorchDistributedAggregator
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
        self._wire = WIRE_DTYPES[self.config.wire_dtype]
        try:
            self._device = next(model.parameters()).device
        except StopIteration:
            raise ValueError("the model has no parameters") from None

        self._lock = threading.Lock()
        self._future: Optional[Future] = None
        self._flush = threading.Event()
        self._window_open = False
        self._priors: Dict[int, torch.Tensor] = {}
        self._accumulating = False
        self._steps = 0
        self._verified = not self.config.verify_first_step
        self._report: Optional[StepReport] = None
        self._twice: List[str] = []   # weights whose gradient was accumulated twice in one step
        self._agreed: Dict[int, List[List[int]]] = {}  # unit index -> row counts of its last size exchange
        self._done: List[Callable[[Optional[BaseException]], None]] = []  # DDP futures to complete

        self._plan = build_plan(model, self.config, on_forward=self._open_window)
        self._unit_of = {id(q): u for u in self._plan.units for q in _params_of(u)}
        try:
            self._check_same_model()
        except BaseException:
            for c in self._plan.captures:
                c.remove()
            raise
        # DDP mode: DDP's comm hook hands over buckets of finished gradients, and the results go
        # back into those buckets (DDP copies them into .grad), so the weight hooks are not used.
        self._ddp_mode = _driven_by_ddp
        self._targets: Dict[int, torch.Tensor] = {}
        self._hooks = [] if _driven_by_ddp else [
            u.param.register_post_accumulate_grad_hook(functools.partial(self._on_weight_ready, u))
            for u in self._plan.units]
        self._worker = _Worker("dad-sync")
        self._abandoned = False
        # at exit, release a step left in flight (an error before synchronize()), so that its
        # thread ends cleanly instead of being torn down while it waits
        self._atexit = functools.partial(_abandon, weakref.ref(self))
        atexit.register(self._atexit)
        if aggregator.rank == 0:
            log.info("dAD attached: %d weights through factors, %d parameters dense, mode %s, %d ranks",
                     len(self._plan.units), len(self._plan.dense), self.config.mode, aggregator.world_size)

    # -- public API -----------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait until every parameter's gradient holds its average over ranks."""
        if self._ddp_mode:
            raise RuntimeError("this synchroniser is driven by DDP's communication hook: gradients are "
                               "synchronised when backward ends, do not call synchronize()")
        if self._accumulating:
            raise RuntimeError("synchronize() was called inside no_sync(); call it after the block")
        if self._abandoned:
            raise RuntimeError("synchronize() was called after close()")
        self._dispatch()
        self._release_all()
        try:
            report = self._future.result()
        finally:
            late = self._end_step()
        self._finish(report, late)

    def _release_all(self) -> None:
        """Backward is over: every unit and the dense buckets may go.

        The flush goes last: once it is set the worker may finish the step and reset every flag
        (in DDP mode on its own thread), so nothing may be set after it.
        """
        for unit in self._plan.units:
            unit.ready.set()
        self._flush.set()

    def _end_step(self) -> List[str]:
        """Reset the per-step state; returns the weights whose rows arrived after their exchange."""
        late = [c.name for c in self._plan.captures if c.pairs] + self._twice
        self._twice = []
        self._future = None
        self._flush.clear()
        for unit in self._plan.units:
            unit.ready.clear()
            unit.passes = 0
        for c in self._plan.captures:
            c.clear()
        self._priors.clear()
        self._targets.clear()
        self._window_open = False
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
        if late:
            raise RuntimeError(f"the gradients of {sorted(set(late))} came in twice in one step, after their "
                               f"exchange had started: a weight used in several reentrant-checkpointed "
                               f"segments (exclude it with the 'exclude' config key, or use "
                               f"use_reentrant=False), or backward run twice without no_sync()")

    # -- DDP communication hook path (see `ddp_hook`) --------------------------------------------
    def _ddp_bucket(self, params: List[torch.Tensor], views: List[torch.Tensor], last: bool,
                    on_done: Callable[[Optional[BaseException]], None]) -> None:
        """DDP handed over a bucket of finished local gradients; results are written into ``views``.

        Buckets come in the same order on every rank; the step runs on the worker thread, and
        ``on_done`` (which completes DDP's futures) is called once the whole step is over.
        """
        if self._abandoned:
            raise RuntimeError("the dAD communication hook was used after close()")
        with self._lock:
            for p, v in zip(params, views):
                self._targets[id(p)] = v
            self._done.append(on_done)
        for p in params:
            unit = self._unit_of.get(id(p))
            # its results go into DDP's buckets: the weight's and every bias's must be here
            if unit is not None and all(id(q) in self._targets for q in _params_of(unit)):
                unit.ready.set()
        with self._lock:
            if self._future is None:
                self._future = self._worker.submit(self._ddp_step)
        if last:
            self._release_all()

    def _ddp_step(self) -> StepReport:
        error: Optional[BaseException] = None
        report = None
        try:
            report = self._exchange()
        except BaseException as e:
            error = e
        with self._lock:
            done, self._done = self._done, []
            late = self._end_step()
        if error is None:
            try:
                self._finish(report, late)
            except BaseException as e:
                error = e
        for callback in done:
            callback(error)
        if error is not None:
            raise error
        return report

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

    def last_step_report(self) -> Optional[StepReport]:
        """Per parameter: representation, rows, bytes handed/sent/received, and totals."""
        return self._report

    @property
    def units(self) -> List[FactorUnit]:
        """The weights synchronised through factors, in exchange order."""
        return list(self._plan.units)

    @property
    def dense_parameters(self) -> List[Tuple[str, nn.Parameter]]:
        """Parameters always synchronised by dense all-reduce."""
        return list(self._plan.dense)

    def state_dict(self) -> dict:
        """rank-dAD state (warm-start factors, error-feedback residuals), by parameter name."""
        return {u.name: {"warm_q": u.warm_q, "residual": u.residual, "dense_only": u.dense_only}
                for u in self._plan.units}

    def load_state_dict(self, state: Mapping[str, Mapping]) -> None:
        by_name = {u.name: u for u in self._plan.units}
        unknown = sorted(set(state) - set(by_name))
        if unknown:
            raise ValueError(f"state for unknown parameters {unknown}")
        for name, s in state.items():
            u = by_name[name]
            u.warm_q, u.residual = s.get("warm_q"), s.get("residual")
            _set_dense_only(u, bool(s.get("dense_only")))

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
        self._release()
        atexit.unregister(self._atexit)

    def _release(self) -> None:
        """Stop the worker thread, abandoning a step in flight (its waits return at once)."""
        self._abandoned = True
        self._flush.set()
        for unit in self._plan.units:
            unit.ready.set()
        self._worker.stop()

    # -- hooks ----------------------------------------------------------------------------------
    def _open_window(self) -> None:
        """First captured forward after a synchronize: remember gradients that were not cleared."""
        if self._future is not None and not in_backward():
            raise RuntimeError("a forward pass started before synchronize() was called for the previous "
                               "backward: call sync.synchronize() after every backward, or accumulate "
                               "micro-steps inside sync.no_sync()")
        if self._window_open:
            return
        params = [p for u in self._plan.units for p in [u.param] + [b.param for b in u.biases]
                  if p.grad is not None]
        if params:
            nonzero = torch.stack([p.grad.ne(0).any() for p in params]).tolist()
            self._priors = {id(p): p.grad.detach().clone() for p, nz in zip(params, nonzero) if nz}
        self._window_open = True

    def _on_weight_ready(self, unit: FactorUnit, param: torch.Tensor) -> None:
        if self._accumulating:
            return
        unit.passes += 1
        if unit.passes < self.backward_passes_per_step:
            return  # an earlier micro-step: its rows stay captured and go with the last one
        if unit.ready.is_set():  # its rows may already be on the wire: fail the step at synchronize()
            self._twice.append(unit.name)
        unit.ready.set()
        self._dispatch()

    def _dispatch(self) -> None:
        with self._lock:
            if self._future is None:
                self._future = self._worker.submit(self._exchange)

    # -- the step, on the background thread -----------------------------------------------------
    def _exchange(self) -> StepReport:
        report: Dict[str, ParamReport] = {}
        dense_units: List[Tuple[str, nn.Parameter]] = []
        verify = not self._verified
        bucket = _RankBucket(self.config.bucket_cap_mb * 2 ** 20)
        previous: List[Callable[[], None]] = []
        for unit in self._plan.units:
            unit.ready.wait()
            if self._abandoned:
                raise RuntimeError("dAD synchroniser closed with a step in flight")
            current: List[Callable[[], None]] = []
            finish = self._exchange_unit(unit, verify, report, dense_units, bucket)
            if finish is not None:
                current.append(finish)
            while bucket.ready_to_send():
                current.append(self._send_rank_bucket(bucket))
            for finish in previous:
                finish()  # rebuild the last units while this one's collective runs
            previous = current
        while bucket.items:
            previous.append(self._send_rank_bucket(bucket))
        for finish in previous:
            finish()
        self._flush.wait()  # backward is over: every dense gradient is final
        if self._abandoned:
            raise RuntimeError("dAD synchroniser closed with a step in flight")

        s = self.aggregator.world_size

        def account(name: str, p: Optional[nn.Parameter], traffic: Traffic) -> None:
            if name not in report:
                shape = tuple(p.shape) if p is not None else ()
                ar = ring_allreduce_bytes(p.numel() * p.element_size(), s) if p is not None else 0.0
                report[name] = ParamReport(name, "dense" if p is not None else "overhead", shape,
                                           allreduce_bytes=ar)
            _add_traffic(report[name], traffic)

        allreduce_dense(self._plan.dense + dense_units, self.aggregator,
                        bucket_cap_mb=self.config.bucket_cap_mb, wire_dtype=self._wire, account=account,
                        prescale=self.prescale_factor, postscale=self.postscale_factor,
                        write=self._write_dense if self._ddp_mode else None)
        return StepReport(self._steps, s, list(report.values()))

    def _exchange_unit(self, unit: FactorUnit, verify: bool, report: Dict[str, ParamReport],
                       dense_units: List[Tuple[str, nn.Parameter]],
                       bucket: "_RankBucket") -> Optional[Callable[[], None]]:
        agg, cfg = self.aggregator, self.config
        s = agg.world_size
        p = unit.param
        m, n = p.shape
        overlapped = not self._flush.is_set()
        rows = [_concat_rows(c.take(), c.kind, (m, n), p) for c in unit.uses]
        counts = [int(r[0].shape[0]) for r in rows]

        ok = True
        if verify and not unit.dense_only:
            ok = self._verify(unit, rows)
        before = agg.traffic()
        wire = self._wire or p.dtype  # None: factors travel in the gradients' dtype
        rank_allowed = cfg.rank is not None and not all(k == "embedding" for k in unit.kinds)
        bias_numel = sum(b.param.numel() for b in unit.biases)

        def estimates_for(rows_by_rank: List[List[int]]) -> Dict[str, float]:
            return estimate_bytes(kinds=unit.kinds, shape=(m, n), rows_by_rank=rows_by_rank,
                                  bias_numel=bias_numel, rank=cfg.rank or 0, grad_dtype=p.dtype,
                                  wire_dtype=wire, world_size=s)

        # Routes that need no agreed row counts skip the size exchange (after the checked first step).
        fixed_route = unit.dense_only or (cfg.mode == "rank" and rank_allowed)
        predicted = None
        if not verify and not fixed_route and cfg.mode != "exact" and unit.index in self._agreed:
            # auto (and rank mode's embedding-only units): predict from the counts of the unit's last
            # size exchange (agreed by all ranks); dense and rank-r need no counts, so they go
            # without an exchange
            estimates = estimates_for(self._agreed[unit.index])
            estimates["exact"] += self._size_exchange_bytes(unit)
            predicted = choose_representation(cfg.mode, estimates, rank_allowed=rank_allowed)
        need_counts = verify or not (fixed_route or predicted in ("dense", "rank"))
        rows_by_rank = self._agree(unit, ok, counts) if need_counts else None
        if unit.dense_only:
            rep = "dense"
        elif rows_by_rank is None:
            rep = predicted or "rank"
        else:
            self._agreed[unit.index] = rows_by_rank
            rep = choose_representation(cfg.mode, estimates_for(rows_by_rank), rank_allowed=rank_allowed)

        entry = ParamReport(unit.name, rep, (m, n), rows=sum(counts),
                            max_rows=max(sum(r) for r in rows_by_rank) if rows_by_rank else 0,
                            allreduce_bytes=ring_allreduce_bytes(p.numel() * p.element_size(), s),
                            overlapped=overlapped)
        report[unit.name] = entry
        for b in unit.biases:
            report[b.name] = ParamReport(b.name, rep if rep == "exact" else "dense", tuple(b.param.shape),
                                         allreduce_bytes=ring_allreduce_bytes(
                                             b.param.numel() * b.param.element_size(), s))
        if rep == "dense":
            dense_units.append((unit.name, p))
            dense_units.extend((b.name, b.param) for b in unit.biases)
            finish = None
        elif rep == "exact":
            finish = self._send_exact(unit, rows, rows_by_rank, wire)
        else:
            dense_units.extend((b.name, b.param) for b in unit.biases)
            finish = self._send_rank(unit, rows, wire, entry, bucket)
            if cfg.mode == "rank" and entry.method == "dense" and not verify and not unit.rows_unused:
                # mode rank reduces this weight from its dense gradient: its rows are of no use, so
                # stop capturing them (saves the hooks' work; reports show 0 rows from then on, and
                # the power iteration stays on the dense gradient for good)
                unit.rows_unused = True
                _update_capture(unit)
        _add_traffic(entry, agg.traffic() - before)
        return finish

    def _size_exchange_bytes(self, unit: FactorUnit) -> float:
        """Bytes this rank sends in `_agree` for ``unit`` (an all-gather of 2 + uses int64)."""
        return (self.aggregator.world_size - 1) * 8.0 * (2 + len(unit.uses))

    def _agree(self, unit: FactorUnit, ok: bool, counts: List[int]) -> List[List[int]]:
        """Exchange every rank's row counts (and first-step check); returns the counts by rank."""
        agg = self.aggregator
        meta = torch.tensor([unit.index, int(ok)] + counts, dtype=torch.int64, device=self._device)
        metas = agg.all_gather(meta, name=f"dad.meta.{unit.name}",
                               first_dims=[meta.numel()] * agg.world_size).wait()
        if any(int(t[0]) != unit.index for t in metas):
            raise RuntimeError(f"ranks disagree on the exchange order at {unit.name!r}: "
                               f"{[int(t[0]) for t in metas]}")
        if not all(int(t[1]) for t in metas):
            _set_dense_only(unit, True)
            if agg.rank == 0:
                log.warning("dAD: the factors of %r do not rebuild its local gradient (is the weight used "
                            "outside its layers, or changed by a gradient hook?); it goes dense from now on",
                            unit.name)
        return [[int(v) for v in t[2:]] for t in metas]

    def _send_exact(self, unit: FactorUnit, rows: List[Rows], rows_by_rank: List[List[int]],
                    wire: torch.dtype) -> Callable[[], None]:
        p = unit.param
        shape = tuple(p.shape)
        blocks = []
        for kind, (left, right) in zip(unit.kinds, rows):
            blocks += [left.to(ID_DTYPE) if kind == "embedding" else left.to(wire), right.to(wire)]
        sizes = [packed_size(exact_block_specs(unit.kinds, shape, r, wire)) for r in rows_by_rank]
        handle = self.aggregator.all_gather(pack(blocks, self._device), name=f"dad.exact.{unit.name}",
                                            first_dims=sizes)

        def finish() -> None:
            buffers = handle.wait()
            if not any(any(r) for r in rows_by_rank):
                if self._ddp_mode:  # DDP keeps what its bucket holds: the average, zeros here
                    self._set_grad(p, torch.zeros(shape, dtype=_compute_dtype(p), device=p.device))
                return  # no rank used this weight: its gradient stays as it is (None), as with DDP
            cdt = _compute_dtype(p)
            per_rank = [unpack(buf, exact_block_specs(unit.kinds, shape, r, wire))
                        for buf, r in zip(buffers, rows_by_rank)]
            grad = torch.zeros(shape, dtype=cdt, device=p.device)
            gathered = []
            for u, kind in enumerate(unit.kinds):
                left = torch.cat([blk[2 * u] for blk in per_rank])
                right = torch.cat([blk[2 * u + 1] for blk in per_rank])
                left = left.long() if kind == "embedding" else left.to(cdt)
                gathered.append((left, right.to(cdt)))
                add_rebuilt_grad(kind, grad, gathered[-1])
            self._set_grad(p, grad.mul_(self.scale))
            for b in unit.biases:
                u = unit.uses.index(b.capture)
                self._set_grad(b.param, output_grad_rows(b.capture.kind, gathered[u]).sum(0).mul_(self.scale))

        return finish

    def _send_rank(self, unit: FactorUnit, rows: List[Rows], wire: torch.dtype, entry: ParamReport,
                   bucket: "_RankBucket") -> Optional[Callable[[], None]]:
        cfg, p = self.config, unit.param
        m, n = p.shape
        r = min(cfg.rank, m, n)
        cdt = _compute_dtype(p)
        n_rows = sum(int(left.shape[0]) for left, _ in rows)
        method = "dense" if cfg.error_feedback or unit.rows_unused else choose_method(
            n_rows, m, n, r, cfg.power_iterations, factors_available=unit.factors_only)
        if method == "dense":
            local = self._local_grad(p, cdt)
            if cfg.error_feedback and unit.residual is not None:
                local = local + unit.residual
            grad = LocalGradient(dense=local)
        else:
            grad = LocalGradient(left=_cat([left.to(cdt) for left, _ in rows]),
                                 right=_cat([right.to(cdt) for _, right in rows]))
        q_init = unit.warm_q if cfg.warm_start and unit.warm_q is not None else None
        if q_init is None or q_init.shape != (n, r):
            gen = torch.Generator(device=p.device).manual_seed(1_000_003 * unit.index + self._steps)
            q_init = torch.randn(n, r, generator=gen, device=p.device, dtype=cdt)
        low = reduce_rank(grad, r, method=method, q_init=q_init, iterations=cfg.power_iterations,
                          tolerance=cfg.adaptive_tolerance)
        if cfg.warm_start:
            unit.warm_q = low.warm
        if cfg.error_feedback:
            unit.residual = grad.to_dense() - low.p @ low.q.t()
        pq, qq = low.p, low.q
        if cfg.adaptive_tolerance is None and low.components < r:  # fixed sizes: no size exchange
            pq = torch.nn.functional.pad(pq, (0, r - low.components))
            qq = torch.nn.functional.pad(qq, (0, r - low.components))
        payload = torch.cat([pq.t(), qq.t()], dim=1).to(wire)
        entry.components, entry.method = low.components, method
        if cfg.adaptive_tolerance is None:  # r rows on every rank: it can share a bucket's all-gather
            bucket.add(unit, payload, entry)
            return None
        handle = self.aggregator.all_gather(payload, name=f"dad.rank.{unit.name}")

        def finish() -> None:
            self._set_rank_grad(unit, torch.cat(handle.wait()))

        return finish

    def _send_rank_bucket(self, bucket: "_RankBucket") -> Callable[[], None]:
        """One all-gather for the rank-r payloads of several units (fewer, larger collectives)."""
        items = bucket.take()
        flat = torch.cat([payload.reshape(-1) for _, payload, _ in items])
        agg = self.aggregator
        before = agg.traffic()
        handle = agg.all_gather(flat, name=f"dad.rank.{items[0][0].name}", first_dims=[flat.numel()] * agg.world_size)
        traffic = agg.traffic() - before
        overlapped = not self._flush.is_set()  # sent while backward still runs?
        for _, payload, entry in items:
            _add_traffic(entry, traffic.share(payload.numel() / flat.numel()))
            entry.overlapped = overlapped

        def finish() -> None:
            gathered = handle.wait()
            offset = 0
            for unit, payload, _ in items:
                k = payload.numel()
                self._set_rank_grad(unit, torch.cat([g[offset:offset + k].view(payload.shape) for g in gathered]))
                offset += k

        return finish

    def _set_rank_grad(self, unit: FactorUnit, factors: torch.Tensor) -> None:
        """Rebuild ``scale * sum_s P_s Q_s^T`` from every rank's ``[P^T | Q^T]`` rows, stacked."""
        p = unit.param
        m = p.shape[0]
        factors = factors.to(_compute_dtype(p))
        # the scale goes on the (S r x m) block, not on the m x n result: one pass fewer
        left, right = (factors[:, :m] * self.scale).t(), factors[:, m:]
        grad = p.grad
        if (grad is not None and id(p) not in self._priors and id(p) not in self._targets
                and grad.dtype == left.dtype and grad.is_contiguous()):
            torch.mm(left, right, out=grad)  # straight into .grad: no m x n temporary and copy
        else:
            self._set_grad(p, left @ right)

    # -- helpers --------------------------------------------------------------------------------
    def _write_dense(self, p: nn.Parameter, average: torch.Tensor) -> None:
        """DDP mode: results go into DDP's bucket views (DDP copies them into ``.grad``)."""
        target = self._targets.get(id(p))
        if target is not None:  # a parameter DDP ignores is not ours to change either
            target.copy_(average.view_as(target))

    def _local_grad(self, p: nn.Parameter, dtype: torch.dtype) -> torch.Tensor:
        """This rank's gradient of the current window (without any gradient left from before)."""
        if p.grad is None:
            return torch.zeros(p.shape, dtype=dtype, device=p.device)
        g = p.grad.detach().to(dtype)
        prior = self._priors.get(id(p))
        return g - prior.to(dtype) if prior is not None else g

    def _set_grad(self, p: nn.Parameter, average: torch.Tensor) -> None:
        """``p.grad = prior + average``, in place where a gradient tensor exists."""
        prior = self._priors.get(id(p))
        value = average if prior is None else average + prior.to(average.dtype)
        if self._ddp_mode:
            self._write_dense(p, value)
        elif p.grad is not None:
            p.grad.copy_(value)
        else:
            p.grad = value.to(p.dtype)

    def _verify(self, unit: FactorUnit, rows: List[Rows]) -> bool:
        """Do this rank's factors rebuild the gradient autograd computed locally?"""
        cdt = torch.float64 if unit.param.dtype == torch.float64 else torch.float32
        rebuilt = torch.zeros(unit.param.shape, dtype=cdt, device=unit.param.device)
        low_precision = False
        for kind, (left, right) in zip(unit.kinds, rows):
            # under autocast the output-gradient rows are bf16/fp16 while the inputs may be fp32
            low_precision |= any(t.is_floating_point() and t.dtype not in VERIFY_TOLERANCE for t in (left, right))
            add_rebuilt_grad(kind, rebuilt, (left if kind == "embedding" else left.to(cdt), right.to(cdt)))
        checks = [(rebuilt, self._local_grad(unit.param, cdt))]
        for b in unit.biases:
            d = output_grad_rows(b.capture.kind, rows[unit.uses.index(b.capture)])
            checks.append((d.to(cdt).sum(0), self._local_grad(b.param, cdt)))
        tol = VERIFY_TOLERANCE_LOW_PRECISION if low_precision else VERIFY_TOLERANCE.get(
            unit.param.dtype, VERIFY_TOLERANCE_LOW_PRECISION)
        for mine, autograd in checks:
            err = float((mine - autograd).norm())
            if err > tol * max(float(autograd.norm()), 1e-30) and err > 1e-12:
                return False
        return True

    def _check_same_model(self) -> None:
        """All ranks must hold the same parameters in the same routes, or collectives would hang."""
        mine = self._plan.signature_bytes()
        buf = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(self._device)
        theirs = [bytes(t.cpu().tolist()) for t in
                  self.aggregator.all_gather(buf, name="dad.signature").wait()]
        if all(t == mine for t in theirs):
            return
        own = json.loads(mine)
        for rank, t in enumerate(theirs):
            if t == mine:
                continue
            other = json.loads(t)
            for i in range(max(len(own), len(other))):
                a = own[i] if i < len(own) else None
                b = other[i] if i < len(other) else None
                if a != b:
                    raise ValueError(
                        f"the model differs across ranks: parameter #{i} is {a} on rank "
                        f"{self.aggregator.rank} but {b} on rank {rank}; every rank must build the same "
                        f"model (names, shapes, dtypes, trainable parameters) before attaching dAD")
        raise ValueError("the model differs across ranks")


def _abandon(ref: "weakref.ref[DADSynchronizer]") -> None:
    sync = ref()
    if sync is not None:
        sync._release()
        sync._worker.join(timeout=5.0)


class _RankBucket:
    """Rank-r payloads of consecutive units, waiting to share one all-gather.

    Every rank sends exactly r rows per unit (without adaptive tolerance), so the ranks agree on
    the bucket's size and contents without any exchange. A bucket goes when it reaches
    ``cap_bytes`` (the config's ``bucket_cap_mb``), when a payload of another dtype follows it,
    or when the step's last unit is done. Fewer collectives matter: each costs a round trip and,
    on CPUs, a wake-up of the exchange thread on every rank. With the default cap the payloads of
    a model usually fit one bucket, which then goes when backward is over.
    """

    def __init__(self, cap_bytes: float):
        self.cap_bytes = cap_bytes
        self.items: List[Tuple[FactorUnit, torch.Tensor, ParamReport]] = []

    def add(self, unit: FactorUnit, payload: torch.Tensor, entry: ParamReport) -> None:
        self.items.append((unit, payload, entry))

    def ready_to_send(self) -> bool:
        """A full run of same-dtype payloads waits at the front (more may follow it)."""
        run = self._front_run()
        return run < len(self.items) or sum(p.numel() * p.element_size() for _, p, _ in self.items) >= self.cap_bytes

    def take(self) -> List[Tuple[FactorUnit, torch.Tensor, ParamReport]]:
        """The front run of payloads that share a dtype."""
        run = self._front_run()
        items, self.items = self.items[:run], self.items[run:]
        return items

    def _front_run(self) -> int:
        dtype = self.items[0][1].dtype if self.items else None
        return next((i for i, (_, p, _) in enumerate(self.items) if p.dtype != dtype), len(self.items))


class _Worker:
    """One daemon thread running submitted jobs in order.

    A daemon, unlike a ``ThreadPoolExecutor`` thread, so that a step abandoned after an error
    (its thread waiting for a backward that never comes) cannot keep the process from exiting.
    """

    def __init__(self, name: str):
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object]) -> Future:
        future: Future = Future()
        self._jobs.put((fn, future))
        return future

    def stop(self) -> None:
        self._jobs.put(None)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # handed to synchronize(), which raises it
                    future.set_exception(e)


def _concat_rows(pairs: List[Rows], kind: str, shape: Tuple[int, int], p: nn.Parameter) -> Rows:
    """One (left, right) block per use: all calls' rows, in call order of arrival."""
    if pairs:
        return torch.cat([a for a, _ in pairs]), torch.cat([b for _, b in pairs])
    m, n = shape
    if kind == "embedding":
        return (torch.zeros(0, dtype=torch.int64, device=p.device),
                torch.zeros(0, n, dtype=p.dtype, device=p.device))
    return torch.zeros(0, m, dtype=p.dtype, device=p.device), torch.zeros(0, n, dtype=p.dtype, device=p.device)


def _params_of(unit: FactorUnit) -> List[nn.Parameter]:
    """The weight and the biases that ride with it."""
    return [unit.param] + [b.param for b in unit.biases]


def _cat(tensors: List[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` without the copy when there is one tensor (a weight with one use)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _set_dense_only(unit: FactorUnit, dense_only: bool) -> None:
    """Route a unit through dense all-reduce for good; its rows are then of no use."""
    unit.dense_only = dense_only
    _update_capture(unit)


def _update_capture(unit: FactorUnit) -> None:
    """Capture a unit's rows only while some route can use them."""
    for capture in unit.uses:
        capture.enabled = not (unit.dense_only or unit.rows_unused)


def in_backward() -> bool:
    """True while autograd runs a backward pass (checkpointing recomputes forwards there)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def _compute_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


def _add_traffic(entry: ParamReport, traffic: Traffic) -> None:
    entry.handed_bytes += traffic.handed
    entry.sent_bytes += traffic.sent
    entry.received_bytes += traffic.received
