"""Row layouts: how a captured use's ``(left, right)`` row blocks rebuild its weight's gradient.

Every captured call yields a pair ``(left, right)`` of row blocks, oriented to the weight's matrix
view (`matrix_shape`: PowerSGD's ``view(shape[0], -1)``). A use's *layout* says how they combine;
the layer kinds (`layers`) map every module they capture onto one of three:

| layout      | weight view  | left                        | right              | grad           |
|-------------|--------------|-----------------------------|--------------------|----------------|
| `linear`    | (out, in)    | output-grad rows D (N, out) | input rows X (N,in)| ``left^T right`` |
| `conv1d`    | (in, out)    | input rows X (N, in)        | D (N, out)         | ``left^T right`` |
| `embedding` | (V, d)       | token ids (N,) int64        | D (N, d)           | ``index_add``  |

Any leading dimensions (batch, time, tokens, output positions) are flattened into rows. A use may
cover a *row block* ``(offset, height)`` of the weight's view (one group of a grouped convolution,
the query slice of a packed attention projection): its left then has ``height`` columns and adds
into rows ``offset : offset + height``.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple, Union

import torch
from torch import nn

Rows = Tuple[torch.Tensor, torch.Tensor]

Block = Optional[Tuple[int, int]]  # (row offset, height) into the weight's matrix view; None: all rows


def matrix_shape(shape: Sequence[int]) -> Tuple[int, int]:
    """A weight's matrix view, ``(shape[0], prod(shape[1:]))`` as PowerSGD views it (2-D unchanged)."""
    shape = tuple(shape)
    if len(shape) < 2:
        raise ValueError(f"a matrix view needs two or more dimensions, got shape {shape}")
    return int(shape[0]), math.prod(int(d) for d in shape[1:])


def as_matrix(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as its matrix (`matrix_shape`) where it has more than two dimensions."""
    return t.reshape(t.shape[0], -1) if t.dim() > 2 else t


def compute_dtype(p: Union[torch.Tensor, torch.dtype]) -> torch.dtype:
    """Rebuilds and reductions run in fp32 for fp16/bf16 parameters, in the parameter's dtype
    otherwise; ``p`` is the parameter or its dtype."""
    dtype = p if isinstance(p, torch.dtype) else p.dtype
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def concat_rows(pairs: Sequence[Rows], kind: str, shape: Tuple[int, int], p: nn.Parameter,
                block: Block = None) -> Rows:
    """One (left, right) block per use: all calls' rows, in call order of arrival. ``shape`` is
    the weight's matrix view; ``block`` the use's row block (its empty left has its height; the
    empty rows of no calls are made once and shared)."""
    if len(pairs) == 1:  # one call: no copy (the rows are only read from here on)
        return pairs[0][0].contiguous(), pairs[0][1].contiguous()
    if pairs:
        return torch.cat([a for a, _ in pairs]), torch.cat([b for _, b in pairs])
    m, n = shape[0], matrix_shape(shape)[1]
    if block is not None:
        m = block[1]
    key = (kind == "embedding", m, n, p.dtype, p.device)
    empty = _EMPTY.get(key)
    if empty is None:  # made once: a use whose rows go uncaptured asks every step (they hold no data)
        left = (torch.zeros(0, dtype=torch.int64, device=p.device) if key[0]
                else torch.zeros(0, m, dtype=p.dtype, device=p.device))
        empty = _EMPTY[key] = (left, torch.zeros(0, n, dtype=p.dtype, device=p.device))
    return empty


_EMPTY: Dict[tuple, Rows] = {}  # concat_rows' rows of no calls, by (embedding?, m, n, dtype, device)


def add_bias_grad(kind: str, grad: torch.Tensor, rows: Rows, block: Block = None) -> None:
    """Accumulate a bias gradient, the sum of the use's output-gradient rows, into ``grad``."""
    d = output_grad_rows(kind, rows)
    if block is not None:
        grad = grad[block[0]:block[0] + block[1]]
    grad.add_(d.to(grad.dtype).sum(0))


def output_grad_rows(kind: str, rows: Rows) -> torch.Tensor:
    """The output-gradient rows D of a (left, right) pair (the bias gradient is their sum)."""
    left, right = rows
    return left if kind == "linear" else right


def add_rebuilt_grad(kind: str, grad: torch.Tensor, rows: Rows, block: Block = None) -> None:
    """Accumulate the weight gradient of ``rows`` into ``grad`` (the matrix view, in place); a
    use's ``block`` adds into its rows only."""
    left, right = rows
    if left.shape[0] == 0:
        return
    if block is not None:
        grad = grad[block[0]:block[0] + block[1]]
    if kind == "embedding":
        deterministic_index_add(grad, left, right.to(grad.dtype))
    else:
        grad.addmm_(left.t().to(grad.dtype), right.to(grad.dtype))


def deterministic_index_add(grad: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """``grad[ids[i]] += rows[i]`` with the same bits on every rank.

    Every rank rebuilds from the same gathered rows and must end with bit-identical parameters.
    CPU ``index_add_`` adds in row order; CUDA's uses atomics, whose order varies, so there the
    rows are sorted by id (stable) and summed per id with a segmented reduction instead.
    """
    if grad.is_cuda:
        sorted_segment_add(grad, ids, rows)
    else:
        grad.index_add_(0, ids, rows)


def sorted_segment_add(grad: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """``grad[ids[i]] += rows[i]`` through a stable sort and a per-id segmented sum (no atomics)."""
    if ids.numel() == 0:
        return
    order = torch.sort(ids, stable=True).indices
    unique, counts = torch.unique_consecutive(ids[order], return_counts=True)
    sums = torch.segment_reduce(rows[order], "sum", lengths=counts)
    grad[unique] += sums
