"""``nn.Linear``: ``dW = D^T X`` over every row (batch, time, tokens flattened); ``db = sum D``."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from dad_integrations.capture.rows import Rows
from dad_integrations.capture.layers.registry import ModuleKind, leading_rows, register_kind


def linear_rows(module: nn.Module, inputs: torch.Tensor, grad_out: torch.Tensor) -> Rows:
    """(D, X): output-gradient rows and input rows, every leading dimension flattened."""
    return grad_out.reshape(-1, grad_out.shape[-1]), inputs.reshape(-1, inputs.shape[-1])


@register_kind
class LinearKind(ModuleKind):
    name = "linear"
    base = nn.Linear
    rows = linear_rows
    forward_count = leading_rows

    def accepts(self, module: nn.Module) -> bool:
        # MultiheadAttention's out_proj has Linear's forward, but attention never calls it (it hands
        # the weight to F.multi_head_attention_forward): its hooks would never fire. The "mha" kind
        # claims it; without that kind it is left to the coverage floor.
        return super().accepts(module) and not isinstance(module, NonDynamicallyQuantizableLinear)
