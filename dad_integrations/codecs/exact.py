"""Exact factors (lossless dAD): each rank's rows, all-gathered, rebuilt as a sum of outer products.

For a weight with uses u (m x n, its matrix view), rank s holds rows ``(left_su, right_su)`` with
``G_s = sum_u left_su^T right_su`` (a use with a row block adds into its rows); the ranks all-gather every block, and each rebuilds
``G = scale * sum_s G_s`` with one matmul per use over all ranks' rows stacked, and each bias as
the sum of its use's output-gradient rows. Cost per rank: ``N (m+n)`` numbers sent, one
``S N m n`` matmul. One packed buffer per unit and rank (float rows in the wire dtype, int32 ids
for embeddings), so a unit costs one collective.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from dad_integrations.capture.rows import Rows, add_bias_grad, add_rebuilt_grad, compute_dtype
from dad_integrations.capture.units import FactorUnit
from dad_integrations.codecs.wire import ID_DTYPE, exact_block_specs, pack, packed_size, unpack


class ExactCodec:
    """Encode a unit's rows as one byte buffer; decode every rank's buffers into its gradients."""

    def __init__(self, wire_dtype: Optional[torch.dtype], device: torch.device):
        self.wire_dtype = wire_dtype
        self.device = device

    def wire(self, unit: FactorUnit) -> torch.dtype:
        """None: factors travel in the gradients' dtype."""
        return self.wire_dtype or unit.param.dtype

    def encode(self, unit: FactorUnit, rows: Sequence[Rows]) -> torch.Tensor:
        wire = self.wire(unit)
        blocks = []
        for kind, (left, right) in zip(unit.kinds, rows):
            blocks += [left.to(ID_DTYPE) if kind == "embedding" else left.to(wire), right.to(wire)]
        return pack(blocks, self.device)

    def sizes(self, unit: FactorUnit, rows_by_rank: Sequence[Sequence[int]]) -> List[int]:
        """Every rank's buffer length, from the agreed row counts (no size exchange needed)."""
        return [packed_size(exact_block_specs(unit.kinds, unit.shape, r, self.wire(unit), unit.blocks))
                for r in rows_by_rank]

    def stacked_rows(self, unit: FactorUnit, buffers: Sequence[torch.Tensor],
                     rows_by_rank: Sequence[Sequence[int]]) -> List[Rows]:
        """Per use, every rank's rows stacked in rank order (ids as int64, floats in the compute dtype)."""
        cdt = compute_dtype(unit.param)
        per_rank = [unpack(buf, exact_block_specs(unit.kinds, unit.shape, r, self.wire(unit), unit.blocks))
                    for buf, r in zip(buffers, rows_by_rank)]
        out = []
        for u, kind in enumerate(unit.kinds):
            left = torch.cat([blk[2 * u] for blk in per_rank])
            right = torch.cat([blk[2 * u + 1] for blk in per_rank])
            out.append((left.long() if kind == "embedding" else left.to(cdt), right.to(cdt)))
        return out

    def decode(self, unit: FactorUnit, buffers: Sequence[torch.Tensor], rows_by_rank: Sequence[Sequence[int]],
               scale: float) -> Optional[Dict[nn.Parameter, torch.Tensor]]:
        """``scale * sum over ranks`` of the weight's and its biases' gradients; None if no rank
        used the weight (its gradient then stays as it is, as with DDP)."""
        if not any(any(r) for r in rows_by_rank):
            return None
        p = unit.param
        grad = torch.zeros(unit.shape, dtype=compute_dtype(p), device=p.device)
        gathered = self.stacked_rows(unit, buffers, rows_by_rank)
        for use, rows in zip(unit.uses, gathered):
            add_rebuilt_grad(use.kind, grad, rows, use.block)
        out = {p: grad.mul_(scale)}
        for b in unit.biases:
            bias = torch.zeros(b.param.shape, dtype=grad.dtype, device=p.device)
            for use in b.uses:
                add_bias_grad(use.kind, bias, gathered[unit.uses.index(use)], use.block)
            out[b.param] = bias.mul_(scale)
        return out


def local_rebuild(unit: FactorUnit, rows: Sequence[Rows], dtype: torch.dtype) -> Dict[nn.Parameter, torch.Tensor]:
    """This rank's gradients of the weight and its biases, rebuilt from its own rows."""
    p = unit.param
    grad = torch.zeros(unit.shape, dtype=dtype, device=p.device)  # the matrix view
    for use, (left, right) in zip(unit.uses, rows):
        add_rebuilt_grad(use.kind, grad, (left if use.kind == "embedding" else left.to(dtype), right.to(dtype)),
                         use.block)
    out = {p: grad}
    for b in unit.biases:
        bias = torch.zeros(b.param.shape, dtype=dtype, device=p.device)
        for use in b.uses:
            add_bias_grad(use.kind, bias, rows[unit.uses.index(use)], use.block)
        out[b.param] = bias
    return out
