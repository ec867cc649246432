"""``nn.Embedding``: the gradient adds each output-gradient row into its token's row (``index_add``)."""
from __future__ import annotations

import torch
from torch import nn

from dad_integrations.capture.rows import Rows
from dad_integrations.capture.layers.registry import ModuleKind, register_kind


def embedding_rows(module: nn.Module, inputs: torch.Tensor, grad_out: torch.Tensor) -> Rows:
    """(ids, D), without the padding row's rows and scaled by frequency where the module is."""
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


@register_kind
class EmbeddingKind(ModuleKind):
    name = "embedding"
    base = nn.Embedding
    layout = "embedding"
    rows = embedding_rows
    forward_count = torch.numel  # every id (the padding row's are dropped later: at most this many)
