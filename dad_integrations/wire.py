"""Packing a unit's rows into one byte buffer per rank, so each layer costs one collective.

Blocks of different dtypes (float rows in the wire dtype, int32 token ids) travel together as
bytes; each block is padded to 8 bytes so that every block can be viewed back in place.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

ALIGN = 8
BlockSpec = Tuple[torch.dtype, Tuple[int, ...]]


def _nbytes(spec: BlockSpec) -> int:
    dtype, shape = spec
    n = 1
    for d in shape:
        n *= d
    size = n * torch.empty((), dtype=dtype).element_size()
    return -(-size // ALIGN) * ALIGN


def packed_size(specs: Sequence[BlockSpec]) -> int:
    """Bytes of the buffer `pack` builds for blocks of these specs."""
    return sum(_nbytes(s) for s in specs)


def pack(blocks: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Concatenate ``blocks`` as a flat uint8 tensor (each block padded to `ALIGN` bytes)."""
    parts = []
    for t in blocks:
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        parts.append(raw)
        pad = -raw.numel() % ALIGN
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=raw.device))
    if not parts:
        return torch.zeros(0, dtype=torch.uint8, device=device)
    return torch.cat(parts)


def unpack(buffer: torch.Tensor, specs: Sequence[BlockSpec]) -> List[torch.Tensor]:
    """Views of ``buffer`` as the blocks described by ``specs`` (inverse of `pack`)."""
    out, offset = [], 0
    for dtype, shape in specs:
        size = _nbytes((dtype, shape))
        itemsize = torch.empty((), dtype=dtype).element_size()
        n = 1
        for d in shape:
            n *= d
        chunk = buffer[offset:offset + n * itemsize]
        if chunk.storage_offset() % itemsize:  # gathered buffers may start anywhere
            chunk = chunk.clone()
        out.append(chunk.view(dtype).reshape(shape))
        offset += size
    return out
