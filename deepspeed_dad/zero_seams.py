"""Where dAD enters ZeRO-2 and ZeRO-3 (DeepSpeed 0.19): the calls that turn a bucket's local
gradients into this rank's partition of their average.

ZeRO-2 (``stage_1_and_2.DeepSpeedZeroOptimizer``). Gradient hooks copy each gradient into the
bucket; ``reduce_ipg_grads`` then reduces the bucket through one of two calls, and afterwards keeps
the elements in this rank's partition (``copy_grads_in_partition``, the epilogue's
``get_flat_partition``) and frees the rest:

* ``average_tensor(tensor, dtype)`` with ``contiguous_gradients`` (the default): ``tensor`` is the
  flat bucket (or one oversized gradient), in ``ipg_buckets[dtype].params`` order; DeepSpeed reduces
  each partition's slice to its owner (``reduce_scatter``, the default) or all-reduces it all;
* ``buffered_reduce_fallback(None, grads, dtype, ...)`` without ``contiguous_gradients``: an
  all-reduce of every gradient of the bucket.

`Zero2Seam` wraps both: factor-covered weights get their owned elements written in place
(``[lo, hi)`` of the weight, from ``param_to_partition_ids`` and ``grad_start_offset``, which may
cut a weight anywhere; a weight may span two partitions); the others go to DeepSpeed's call, on
runs of consecutive parameters of the same buffer (views: nothing is copied), or on the list of the
rest. ``overlap_comm`` only changes streams and when other partitions' gradients are freed, which
stay DeepSpeed's; on CPU every stream is the default one.

ZeRO-3 (``stage3.DeepSpeedZeroOptimizer_Stage3``). ``__reduce_and_partition_ipg_grads`` gets the
bucket's partitions from ``__avg_scatter_grads(params, dtype)`` (reduce-scatter, the default) or,
with ``contiguous_gradients`` and ``reduce_scatter=false``, from
``__avg_scatter_contiguous_grads(buffer, dtype)`` (an all-reduce), and hands them to
``partition_grads``, which accumulates them into the fp32 partitions. `Zero3Seam` wraps both: a
covered weight's partition is its ``[r P, (r+1) P)`` elements (``P = partition_numel()``), zero
past the weight's end; the others come from DeepSpeed's call.

Scaling mirrors each call: ZeRO-2 divides by S (when averaging); ZeRO-3 divides by S and applies
``gradient_predivide_factor`` as its two calls do.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, List, Sequence, Set

import torch

from dad_integrations.codecs.exact import Range

from .attachment import shadow, unshadow

_Z3 = "_DeepSpeedZeroOptimizer_Stage3__"  # name-mangled private methods of the stage-3 optimizer


class _Seam:
    def __init__(self, dad: Any, optimizer: Any, methods: Dict[str, Callable]):
        self.dad, self.opt = dad, optimizer
        self.world, self.rank = dad._world, dad.aggregator.rank
        self._originals: Dict[str, Callable] = {}
        shadow(optimizer, methods, self._originals)

    def remove(self) -> None:
        unshadow(self.opt, self._originals)

    def _reduce_in_place(self, params: Sequence[torch.nn.Parameter], views: Sequence[torch.Tensor],
                         ranges: Sequence[Sequence[Range]], itemsize: int) -> Set[int]:
        """`ZeroDAD.reduce`, each covered weight's owned elements written over its local gradient's
        ``[lo, hi)`` in ``views`` (ZeRO-2 keeps that slice of the bucket as the partition)."""
        where = {id(p): (view, r[self.rank]) for p, view, r in zip(params, views, ranges)}

        def write(p: torch.nn.Parameter, owned: torch.Tensor) -> None:
            view, (lo, hi) = where[id(p)]
            view[lo:hi].copy_(owned)

        return self.dad.reduce(params, views, ranges, self.scale, itemsize, write)


def _by_runs(bucket: Any, entries: list, covered: Sequence[bool], reduce: Callable[[int, int], None]) -> None:
    """``reduce(a, b)`` for each run ``[a, b)`` of consecutive uncovered entries, with ``bucket.params``
    narrowed to ``entries[a:b]`` meanwhile (DeepSpeed's calls reduce the bucket's parameters)."""
    saved, start = bucket.params, 0
    try:
        for c, run in itertools.groupby(covered):
            end = start + len(list(run))
            if not c:
                bucket.params = entries[start:end]
                reduce(start, end)
            start = end
    finally:
        bucket.params = saved


class Zero2Seam(_Seam):
    """ZeRO-2's ``average_tensor`` and ``buffered_reduce_fallback`` (module doc)."""

    def __init__(self, dad: Any, optimizer: Any):
        super().__init__(dad, optimizer, {"average_tensor": self.average_tensor,
                                          "buffered_reduce_fallback": self.buffered_reduce_fallback})

    @property
    def scale(self) -> float:
        # every ZeRO-2 path (reduce to owner, all-reduce with or without predivide) ends with 1/S
        return 1.0 / self.world if self.opt.gradient_average else 1.0

    def ranges(self, group: int, param_id: int, numel: int) -> List[Range]:
        """Every rank's ``[lo, hi)`` of one parameter, as ``average_tensor`` slices it."""
        out: List[Range] = [(0, 0)] * self.world
        starts = sorted((self.opt.grad_start_offset[group][pid][param_id], pid)
                        for pid in self.opt.param_to_partition_ids[group][param_id])
        for k, (lo, pid) in enumerate(starts):
            out[pid] = (lo, starts[k + 1][0] if k + 1 < len(starts) else numel)
        return out

    def _bucket(self, dtype: torch.dtype):
        opt = self.opt
        bucket = opt.ipg_buckets[dtype]
        entries = list(bucket.params)
        params = [opt.bit16_groups[i][j] for i, j, _ in entries]
        ranges = [self.ranges(i, pid, p.numel()) for (i, _, pid), p in zip(entries, params)]
        return bucket, entries, params, ranges

    def average_tensor(self, tensor: torch.Tensor, communication_data_type: torch.dtype) -> None:
        original = self._originals["average_tensor"]
        bucket, entries, params, ranges = self._bucket(communication_data_type)
        offsets = [0, *itertools.accumulate(p.numel() for p in params)]
        if offsets[-1] != tensor.numel():  # not the bucket layout this seam knows: DeepSpeed's own
            self.dad.exchanger.log_once(f"a ZeRO-2 reduction of {tensor.numel()} elements for a bucket of "
                                        f"{offsets[-1]}: DeepSpeed's reduction kept")
            return original(tensor, communication_data_type)
        views = [tensor.narrow(0, offsets[k], p.numel()) for k, p in enumerate(params)]
        owned = self._reduce_in_place(params, views, ranges, tensor.element_size())
        self._after_writes()
        _by_runs(bucket, entries, [id(p) in owned for p in params], lambda a, b: original(
            tensor.narrow(0, offsets[a], offsets[b] - offsets[a]), communication_data_type))

    def buffered_reduce_fallback(self, rank: Any, grads: List[torch.Tensor], communication_data_type: torch.dtype,
                                 elements_per_buffer: int = 500000000, log: Any = None) -> None:
        original = self._originals["buffered_reduce_fallback"]
        bucket, entries, params, ranges = self._bucket(communication_data_type)
        if rank is not None or len(grads) != len(params) or any(
                g.numel() != p.numel() for g, p in zip(grads, params)):
            return original(rank, grads, communication_data_type, elements_per_buffer, log)
        views = [g.view(-1) for g in grads]
        owned = self._reduce_in_place(params, views, ranges, grads[0].element_size() if grads else 4)
        self._after_writes()
        rest = [g for g, p in zip(grads, params) if id(p) not in owned]
        if rest:
            original(None, rest, communication_data_type, elements_per_buffer, log)

    def _after_writes(self) -> None:
        # with overlap_comm DeepSpeed copies the partition on its reduction stream: order it after ours
        from deepspeed.accelerator import get_accelerator
        acc = get_accelerator()
        if self.opt.overlap_comm and not acc.resolves_data_dependency():
            self.opt.reduction_stream.wait_stream(acc.current_stream())


class Zero3Seam(_Seam):
    """ZeRO-3's ``__avg_scatter_grads`` and ``__avg_scatter_contiguous_grads`` (module doc)."""

    def __init__(self, dad: Any, optimizer: Any):
        super().__init__(dad, optimizer, {_Z3 + "avg_scatter_grads": self.avg_scatter_grads,
                                          _Z3 + "avg_scatter_contiguous_grads": self.avg_scatter_contiguous_grads})

    @property
    def scale(self) -> float:
        """What each call multiplies the sum of local gradients by (non-MoE parameters)."""
        opt, S = self.opt, self.world
        f, post = float(opt.gradient_predivide_factor), bool(opt.postscale_gradients)
        scale = 1.0 / S
        if post and f != 1.0:
            scale /= f        # both calls predivide by f, then multiply back by f unless f == S
            if f != S:
                scale *= f
        return scale

    def ranges(self, p: torch.nn.Parameter) -> List[Range]:
        size, numel = p.partition_numel(), p.ds_numel
        return [(min(r * size, numel), min((r + 1) * size, numel)) for r in range(self.world)]

    def _reduce_to_partitions(self, params: Sequence[torch.nn.Parameter], views: Sequence[torch.Tensor],
                              communication_data_type: torch.dtype) -> Dict[int, torch.Tensor]:
        """`ZeroDAD.reduce`, as the partitions DeepSpeed's calls return (by ``id(param)``): the owned
        elements, zero past the weight's end, in the gradient accumulation dtype."""
        parts: Dict[int, torch.Tensor] = {}

        def partition(p: torch.nn.Parameter, owned: torch.Tensor) -> None:
            part = torch.zeros(p.partition_numel(), dtype=self.opt.gradient_accumulation_dtype, device=owned.device)
            part[:owned.numel()].copy_(owned)
            parts[id(p)] = part

        itemsize = torch.empty((), dtype=communication_data_type).element_size()
        self.dad.reduce(params, views, [self.ranges(p) for p in params], self.scale, itemsize, partition)
        return parts

    def avg_scatter_grads(self, params_to_reduce: List[torch.nn.Parameter],
                          communication_data_type: torch.dtype) -> List[torch.Tensor]:
        original = self._originals[_Z3 + "avg_scatter_grads"]
        views = [p.grad.view(-1) for p in params_to_reduce]
        parts = self._reduce_to_partitions(params_to_reduce, views, communication_data_type)
        rest = [p for p in params_to_reduce if id(p) not in parts]
        dense = iter(original(rest, communication_data_type) if rest else [])
        return [parts[id(p)] if id(p) in parts else next(dense) for p in params_to_reduce]

    def avg_scatter_contiguous_grads(self, buffer_to_reduce: torch.Tensor,
                                     communication_data_type: torch.dtype) -> List[torch.Tensor]:
        original = self._originals[_Z3 + "avg_scatter_contiguous_grads"]
        bucket = self.opt.ipg_buckets[communication_data_type]
        params = list(bucket.params)
        offsets = [0, *itertools.accumulate(p.grad.numel() for p in params)]
        views = [buffer_to_reduce.narrow(0, offsets[k], p.grad.numel()) for k, p in enumerate(params)]
        out = self._reduce_to_partitions(params, views, communication_data_type)

        def dense(a: int, b: int) -> None:
            parts = original(buffer_to_reduce.narrow(0, offsets[a], offsets[b] - offsets[a]), communication_data_type)
            out.update((id(p), part) for p, part in zip(params[a:b], parts))

        _by_runs(bucket, params, [id(p) in out for p in params], dense)
        return [out[id(p)] for p in params]
