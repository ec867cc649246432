"""Layer kinds whose weight gradient is a sum of outer products, and how to rebuild it.

Every captured call yields a pair ``(left, right)`` of row blocks, oriented to the parameter:

| kind        | weight shape | left                        | right              | grad           |
|-------------|--------------|-----------------------------|--------------------|----------------|
| `linear`    | (out, in)    | output-grad rows D (N, out) | input rows X (N,in)| ``left^T right`` |
| `conv1d`    | (in, out)    | input rows X (N, in)        | D (N, out)         | ``left^T right`` |
| `embedding` | (V, d)       | token ids (N,) int64        | D (N, d)           | ``index_add``  |

Any leading dimensions (batch, time, tokens) are flattened into rows.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import nn

Rows = Tuple[torch.Tensor, torch.Tensor]

try:  # Hugging Face's transposed linear layer (GPT-2); transformers is optional.
    from transformers.pytorch_utils import Conv1D as _HFConv1D
except Exception:  # pragma: no cover - exercised only without transformers
    _HFConv1D = None


def _runs_stock_forward(module: nn.Module, base: type) -> bool:
    # A subclass with its own forward may use the weight differently: leave it to dense all-reduce.
    return isinstance(module, base) and type(module).forward is base.forward


def compute_dtype(p: torch.Tensor) -> torch.dtype:
    """Rebuilds and reductions run in fp32 for fp16/bf16 parameters, in the parameter's dtype otherwise."""
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


def layer_kind(module: nn.Module) -> Optional[str]:
    """The kind name of a module whose weight gradient dAD can rebuild, else None."""
    if _runs_stock_forward(module, nn.Linear):
        return "linear"
    if _runs_stock_forward(module, nn.Embedding):
        return "embedding"
    if _HFConv1D is not None and _runs_stock_forward(module, _HFConv1D):
        return "conv1d"
    return None


def rows_of_call(kind: str, module: nn.Module, inputs: torch.Tensor, grad_out: torch.Tensor) -> Rows:
    """The (left, right) row blocks of one forward call and its output gradient."""
    if kind == "linear":
        return grad_out.reshape(-1, grad_out.shape[-1]), inputs.reshape(-1, inputs.shape[-1])
    if kind == "conv1d":
        return inputs.reshape(-1, inputs.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
    if kind == "embedding":
        ids = inputs.reshape(-1)
        d = grad_out.reshape(-1, grad_out.shape[-1])
        if module.padding_idx is not None:
            # autograd gives the padding row no gradient: drop its rows before they cost bytes
            keep = ids != module.padding_idx
            ids, d = ids[keep], d[keep]
        if module.scale_grad_by_freq:
            # autograd divides each row by its id's count within this call
            counts = torch.bincount(ids, minlength=1)[ids].to(d.dtype)
            d = d / counts.unsqueeze(1)
        return ids, d
    raise ValueError(f"unknown layer kind {kind!r}")


def concat_rows(pairs: Sequence[Rows], kind: str, shape: Tuple[int, int], p: nn.Parameter) -> Rows:
    """One (left, right) block per use: all calls' rows, in call order of arrival."""
    if len(pairs) == 1:  # one call: no copy (the rows are only read from here on)
        return pairs[0][0].contiguous(), pairs[0][1].contiguous()
    if pairs:
        return torch.cat([a for a, _ in pairs]), torch.cat([b for _, b in pairs])
    m, n = shape
    if kind == "embedding":
        return (torch.zeros(0, dtype=torch.int64, device=p.device),
                torch.zeros(0, n, dtype=p.dtype, device=p.device))
    return torch.zeros(0, m, dtype=p.dtype, device=p.device), torch.zeros(0, n, dtype=p.dtype, device=p.device)


def output_grad_rows(kind: str, rows: Rows) -> torch.Tensor:
    """The output-gradient rows D of a (left, right) pair (the bias gradient is their sum)."""
    left, right = rows
    return left if kind == "linear" else right


def add_rebuilt_grad(kind: str, grad: torch.Tensor, rows: Rows) -> None:
    """Accumulate the weight gradient of ``rows`` into ``grad`` (weight-shaped, in place)."""
    left, right = rows
    if left.shape[0] == 0:
        return
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
