"""Checks at attach and on the first step: same model on every rank, same start, factors that rebuild.

* `check_same_model`: every rank holds the same parameters in the same routes (names, shapes,
  dtypes), or the collectives would not match and the job would hang; raises naming the first
  difference.
* `broadcast_model`: rank 0's parameters and buffers, copied to every rank at attach, as DDP
  does when it wraps a model (ranks seeded differently would otherwise never train one model).
* `factors_rebuild_local_grad`: on the first synchronised step, do this rank's captured factors
  rebuild the gradient autograd computed? A weight used outside its layers, or changed by a
  gradient hook, fails and goes dense for good. Weights are compared through a random sketch of
  ``k`` columns (Freivalds' check), biases whole.
"""
from __future__ import annotations

import itertools
import json
import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from dad_integrations.comm.aggregator import FactorAggregator, Traffic
from dad_integrations.codecs.exact import rebuild_unit
from dad_integrations.capture.rows import Rows
from dad_integrations.capture.sink import GradSink, ShardSink
from dad_integrations.capture.units import FactorUnit, SyncPlan
from dad_integrations.codecs.wire import pack, unpack

# relative error allowed between the factors' local rebuild and autograd's local gradient
VERIFY_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3}
VERIFY_TOLERANCE_LOW_PRECISION = 5e-2
# the first step's check compares each weight through k random directions (`factors_rebuild_local_grad`)
SKETCH_COLUMNS = 8
SKETCH_SEED = 0x5EED


def check_same_model(plan: SyncPlan, aggregator: FactorAggregator, device: torch.device) -> None:
    """Raise `ValueError` unless every rank built the same model (names, shapes, dtypes, routes)."""
    mine = plan.signature_bytes()
    buf = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
    theirs = [bytes(t.cpu().tolist()) for t in aggregator.all_gather(buf, name="dad.signature").wait()]
    if all(t == mine for t in theirs):
        return
    own = json.loads(mine)
    for rank, t in enumerate(theirs):
        if t == mine:
            continue
        for i, (a, b) in enumerate(itertools.zip_longest(own, json.loads(t))):
            if a != b:
                raise ValueError(
                    f"the model differs across ranks: parameter #{i} is {a} on rank {aggregator.rank} but "
                    f"{b} on rank {rank}; every rank must build the same model (names, shapes, dtypes, "
                    f"trainable parameters) before attaching dAD")
    raise ValueError("the model differs across ranks")


def broadcast_model(model: nn.Module, aggregator: FactorAggregator, chunk_bytes: int = 256 * 2 ** 20) -> None:
    """Copy rank 0's parameters and buffers to every rank (DDP's start-up broadcast).

    The tensors travel as bytes, in chunks of about ``chunk_bytes`` per device (memory: one chunk
    beside the model), each a sum all-reduce to which only rank 0 contributes: ``x + 0 + ... + 0``
    is ``x`` bit for bit, for every dtype, so no backend needs a broadcast call of its own (it
    moves twice a broadcast's bytes, once per attach).
    """
    chunks: dict = {}   # device -> list of tensor lists
    filled: dict = {}   # device -> bytes in its last chunk
    seen = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen or not t.numel():
            continue
        seen.add(id(t))
        device_chunks = chunks.setdefault(t.device, [[]])
        if filled.get(t.device, 0) >= chunk_bytes:
            device_chunks.append([])
            filled[t.device] = 0
        device_chunks[-1].append(t)
        filled[t.device] = filled.get(t.device, 0) + t.numel() * t.element_size()
    for device, device_chunks in chunks.items():
        for k, tensors in enumerate(device_chunks):
            flat = pack([t.detach() for t in tensors], device)
            if aggregator.rank != 0:
                flat.zero_()
            flat = aggregator.all_reduce(flat, name=f"dad.broadcast.{device}.{k}", op="sum").wait()
            with torch.no_grad():
                for t, value in zip(tensors, unpack(flat, [(t.dtype, tuple(t.shape)) for t in tensors])):
                    t.copy_(value)


def verify_tolerance(dtype: torch.dtype, rows: Sequence[Rows]) -> float:
    """The relative error allowed for gradients of ``dtype`` rebuilt from ``rows``: low precision
    where either is (under autocast the output-gradient rows are bf16/fp16, the inputs maybe fp32)."""
    low = any(t.is_floating_point() and t.dtype not in VERIFY_TOLERANCE for pair in rows for t in pair)
    return VERIFY_TOLERANCE_LOW_PRECISION if low else VERIFY_TOLERANCE.get(dtype, VERIFY_TOLERANCE_LOW_PRECISION)


def failed_somewhere(units: Sequence[FactorUnit], bad: Sequence[float], aggregator: FactorAggregator, name: str,
                     device) -> Tuple[List[FactorUnit], Traffic]:
    """The units flagged ``bad`` (1.0) on some rank, agreed in one sum all-reduce of the flags, and its bytes."""
    handle = aggregator.all_reduce(torch.tensor(bad, device=device), name=name, op="sum")
    return [u for u, flag in zip(units, handle.wait().tolist()) if flag], handle.traffic


def factors_rebuild_local_grad(unit: FactorUnit, rows: Sequence[Rows], sink: Union[GradSink, ShardSink],
                               columns: int = SKETCH_COLUMNS) -> bool:
    """Do this rank's factors rebuild the gradients autograd computed locally (weight and biases)?

    The weight is compared through a sketch (Freivalds' check), its biases whole. Let ``G`` be
    autograd's local gradient of the ``m x n`` matrix view, ``R`` the factors' rebuild and
    ``E = R - G``. The check passes where, per tensor, ``||E|| <= tol * max(||G||, tol * whole)``
    (Frobenius norms; ``tol``: `verify_tolerance`; ``whole``: the norm of the unit's weight and
    biases together, so that a bias whose gradient is round-off, a conv bias before batch norm,
    cannot send its weight dense). Building ``R`` costs ``2 N m n`` flops over the rows' N tokens
    and an ``m x n`` buffer, and comparing it three more passes over ``m x n``: at 307 M
    parameters, most of a first step's exchange. Instead:

    1. draw ``V``, ``n x k`` with ``k = columns``, i.i.d. standard normal, from a generator of the
       check's own (seeded by the unit: the same on every run, and the user's random stream is
       untouched; ranks need not draw alike, since only their verdicts are agreed);
    2. ``R V`` from the factors with each use's right ``B`` (N, n) replaced by ``B V`` (N, k): in
       every row layout the gradient is linear in the right (``A^T B V``, an index add of the rows
       of ``B V``), so this is `codecs.exact.rebuild` unchanged, ``m x k`` wide;
    3. ``G V`` and ``||G||`` in one read each of autograd's gradient;
    4. ``||E V|| / sqrt(k)`` stands for ``||E||`` in the test above; every norm but this one is exact.

    Cost per weight: ``2 k (N n + N m + m n)`` flops against the whole rebuild's ``2 N m n`` (``k``
    is 8; ``N``, the rank's tokens, often thousands); two reads of ``G`` (the product and its norm)
    against an ``m x n`` buffer zeroed, added into, subtracted from ``G`` and read by two norms; and
    ``(m + n + N) k`` numbers of memory against ``2 m n``. A compute dtype other than the
    gradient's (fp32 for fp16 and bf16) still makes one fp32 copy of ``G``, as the sink's
    ``local_grad`` gives it.

    What it may miss: ``||E V||^2 / k = sum_i s_i^2 c_i / k`` over ``E``'s singular values ``s_i``,
    with ``c_i`` independent chi-square variables of ``k`` degrees, a mean of ``||E||^2``. For any
    ``E``, ``P(||E V||^2 <= t k ||E||^2)`` for ``t < 1``, and ``P(||E V||^2 >= t k ||E||^2)`` for
    ``t > 1``, are at most ``(t e^(1-t))^(k/2)`` (Chernoff's bounds; an ``E`` of rank one, where they
    are the chi-square's own, is the worst case for both). An error ``rho``
    times the tolerance passes only where ``t <= 1 / rho^2``: with ``k = 8``, at ``rho = 10`` (a
    hook scaling fp32 gradients by 1.01) with probability below ``6e-7``; at ``rho = 3`` below
    ``1e-2``; a weight used outside its layer (``rho`` in the hundreds) effectively never. The
    other side, a good rebuild (round-off, ``rho < 1/30``) failing, needs ``t >= 900``: below
    ``1e-1000``. A weight no wider than ``k`` columns is compared whole (``E`` itself, exactly).
    """
    cdt = torch.float64 if unit.param.dtype == torch.float64 else torch.float32
    tol = verify_tolerance(unit.param.dtype, rows)
    sketch = sketch_matrix(unit, columns, cdt)
    rebuilt = rebuild_unit(unit, rows, cdt, sketch=sketch)
    errors, norms = [], []
    for p, mine in rebuilt.items():
        g = sink.local_grad(p, cdt)
        norms.append(float(g.norm()))
        if p is unit.param and sketch is not None:  # the weight, through the sketch: E V = R V - G V
            errors.append(float(mine.sub_(torch.mm(sketch.t(), g.t()).t()).norm()) / math.sqrt(columns))
        else:
            errors.append(float((mine - g).norm()))
    # each tensor's error against its own norm, floored at tol x the unit's whole norm (so the
    # error bound is at least tol^2 = 1e-6 of it in fp32)
    whole = math.sqrt(sum(v * v for v in norms))
    return all(err <= tol * max(norm, tol * whole, 1e-30) or err <= 1e-12 for err, norm in zip(errors, norms))


def sketch_matrix(unit: FactorUnit, columns: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """`factors_rebuild_local_grad`'s ``V``: ``(n, columns)`` standard normal on the weight's device,
    from a generator seeded by the unit; None where the weight is no wider (its check is whole)."""
    n, device = unit.shape[1], unit.param.device
    if n <= columns:
        return None
    generator = torch.Generator(device=device).manual_seed(SKETCH_SEED + unit.index)
    # column-major: V^T is contiguous, the thin products' fast shape on CPU BLAS (about 2x over (n, k) rows)
    return torch.randn(columns, n, generator=generator, dtype=dtype, device=device).t()


def why_factors_fail(name: str, ok_by_rank: Sequence[bool], rows_by_rank: Sequence[Sequence[int]]) -> str:
    """What the first step's check found for weight ``name``, from every rank's verdict and row
    counts (per use): the same text on every rank. No rows at all on a failing rank means the
    capture never ran there (under ``torch.compile``, on a torch whose dynamo did not guard on
    hooks, a graph compiled without it; or capture hooks removed)."""
    failing = [r for r, ok in enumerate(ok_by_rank) if not ok]
    if failing and all(sum(rows_by_rank[r]) == 0 for r in failing):
        return (f"the capture of {name!r} did not run on rank(s) {failing} (no rows, though the weight has a "
                f"gradient): under torch.compile, a graph compiled without dAD's capture ran (a copy of the model "
                f"compiled before dAD was attached?) or its layer kind does not capture under compile; without "
                f"compile, the weight is used only outside its layers")
    return (f"the factors of {name!r} do not rebuild its local gradient on rank(s) {failing} (is the weight "
            f"used outside its layers, or changed by a gradient hook?)")


def agree_factors_rebuild(units: Sequence[FactorUnit], rows: Dict[int, Sequence[Rows]],
                          sink: Union[GradSink, ShardSink], aggregator: FactorAggregator
                          ) -> Tuple[List[FactorUnit], Traffic]:
    """`factors_rebuild_local_grad` for every unit (``rows`` by ``unit.index``), agreed over ranks
    (`failed_somewhere`): the units that fail on some rank, and the bytes."""
    return failed_somewhere(units, [0.0 if factors_rebuild_local_grad(u, rows[u.index], sink) else 1.0 for u in units],
                            aggregator, "dad.verify", units[0].param.device if units else None)
