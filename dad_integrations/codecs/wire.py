"""Packing a unit's rows into one byte buffer per rank, so each layer costs one collective.

Blocks of different dtypes (float rows in the wire dtype, int32 token ids) travel together as
bytes; each block is padded to 8 bytes so that every block can be viewed back in place.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

ALIGN = 8
BlockSpec = Tuple[torch.dtype, Tuple[int, ...]]


def _nbytes(spec: BlockSpec) -> int:
    dtype, shape = spec
    n = 1
    for d in shape:
        n *= d
    size = n * dtype.itemsize
    return -(-size // ALIGN) * ALIGN


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
        size = _nbytes((dtype, shape))
        itemsize = dtype.itemsize
        n = 1
        for d in shape:
            n *= d
        chunk = buffer[offset:offset + n * itemsize]
        if chunk.storage_offset() % itemsize:  # gathered buffers may start anywhere
            chunk = chunk.clone()
        out.append(chunk.view(dtype).reshape(shape))
        offset += size
    return out


ID_DTYPE = torch.int32


def exact_block_specs(kinds: Sequence[str], shape: Tuple[int, int], rows: Sequence[int],
                      wire_dtype: torch.dtype, blocks: Optional[Sequence[Optional[Tuple[int, int]]]] = None
                      ) -> List[BlockSpec]:
    """Block layout of a unit's exact factors for one rank with ``rows[u]`` rows in use u; a use
    with a row block ``(offset, height)`` (``blocks[u]``) has ``height`` columns on its left."""
    m, n = shape
    specs: List[BlockSpec] = []
    for u, (kind, r) in enumerate(zip(kinds, rows)):
        if kind == "embedding":
            specs += [(ID_DTYPE, (r,)), (wire_dtype, (r, n))]
        else:
            block = blocks[u] if blocks is not None else None
            specs += [(wire_dtype, (r, m if block is None else block[1])), (wire_dtype, (r, n))]
    return specs


def rank_block_specs(shape: Tuple[int, int], components: int, wire_dtype: torch.dtype) -> List[BlockSpec]:
    m, n = shape
    return [(wire_dtype, (components, m + n))]


def sharded_exact_covers(kinds: Sequence[str], blocks: Optional[Sequence[Optional[Tuple[int, int]]]] = None) -> bool:
    """Whether the sharded exchanges of exact factors (FSDP2's column slices, `codecs.sharded_exact`;
    ZeRO's covering rows, `codecs.partition_exact`) carry a unit with uses ``kinds`` and row
    ``blocks``: it needs uses, and a use with a row block ``(offset, height)`` must be ``linear``
    (its left's ``height`` columns are rows ``offset:offset+height`` of the matrix view, and its D
    columns are those rows of a split bias), as a packed attention projection's q/k/v slices are.
    Embedding uses take whole factors there, which place no blocks."""
    if not kinds:
        return False
    if blocks is None:
        return True
    return "embedding" not in kinds and all(b is None or k == "linear" for k, b in zip(kinds, blocks))
