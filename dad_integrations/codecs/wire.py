"""Packing a unit's rows into one byte buffer per rank, so each layer costs one collective.

Blocks of different dtypes (float rows in the wire dtype, int32 token ids) travel together as
bytes; each block is padded to 8 bytes so that every block can be viewed back in place.
"""
from __future__ import annotations

from math import prod
from typing import List, Sequence, Tuple

import torch

ALIGN = 8
BlockSpec = Tuple[torch.dtype, Tuple[int, ...]]


def _nbytes(spec: BlockSpec) -> int:
    dtype, shape = spec
    return -(-prod(shape) * dtype.itemsize // ALIGN) * ALIGN


def packed_size(specs: Sequence[BlockSpec]) -> int:
    """Bytes of the buffer `pack` builds for blocks of these specs."""
    return sum(_nbytes(s) for s in specs)


def pack(blocks: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Concatenate ``blocks`` as a flat uint8 tensor (each block padded to `ALIGN` bytes)."""
    out = torch.empty(packed_size([(t.dtype, tuple(t.shape)) for t in blocks]), dtype=torch.uint8,
                      device=blocks[0].device if blocks else device)
    pack_into(blocks, out)
    return out


def pack_into(blocks: Sequence[torch.Tensor], out: torch.Tensor) -> int:
    """Write ``blocks`` into the uint8 buffer ``out`` as `pack` lays them out; return the bytes
    written. Each block is copied straight into its place (no packed temporaries), so a caller that
    packs many blocks into one send buffer holds that buffer only."""
    offset = 0
    for t in blocks:
        size = _nbytes((t.dtype, tuple(t.shape)))
        raw = t.element_size() * t.numel()
        if raw:
            out.narrow(0, offset, raw).view(t.dtype).view(t.shape).copy_(t)
        if size > raw:
            out.narrow(0, offset + raw, size - raw).zero_()
        offset += size
    return offset


def unpack(buffer: torch.Tensor, specs: Sequence[BlockSpec]) -> List[torch.Tensor]:
    """Views of ``buffer`` as the blocks described by ``specs`` (inverse of `pack`)."""
    out, offset = [], 0
    for dtype, shape in specs:
        chunk = buffer[offset:offset + prod(shape) * dtype.itemsize]
        if chunk.storage_offset() % dtype.itemsize:  # gathered buffers may start anywhere
            chunk = chunk.clone()
        out.append(chunk.view(dtype).reshape(shape))
        offset += _nbytes((dtype, shape))
    return out


ID_DTYPE = torch.int32


def rank_block_specs(shape: Tuple[int, int], components: int, wire_dtype: torch.dtype) -> List[BlockSpec]:
    m, n = shape
    return [(wire_dtype, (components, m + n))]
