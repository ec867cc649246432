"""``nn.Linear``: ``dW = D^T X`` over every row (batch, time, tokens flattened); ``db = sum D``."""
from __future__ import annotations

from typing import List

import torch
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from dad_integrations.capture.hooks import ModuleCapture
from dad_integrations.capture.rows import Rows
from dad_integrations.capture.layers.registry import Claim, LayerKind, register_kind, runs_stock_forward


def linear_rows(module: nn.Module, inputs: torch.Tensor, grad_out: torch.Tensor) -> Rows:
    """(D, X): output-gradient rows and input rows, every leading dimension flattened."""
    return grad_out.reshape(-1, grad_out.shape[-1]), inputs.reshape(-1, inputs.shape[-1])


@register_kind
class LinearKind(LayerKind):
    name = "linear"

    def accepts(self, module: nn.Module) -> bool:
        # MultiheadAttention's out_proj has Linear's forward, but attention never calls it (it hands
        # the weight to F.multi_head_attention_forward): its hooks would never fire. The "mha" kind
        # claims it; without that kind it is left to the coverage floor.
        return runs_stock_forward(module, nn.Linear) and not isinstance(module, NonDynamicallyQuantizableLinear)

    def claims(self, module: nn.Module) -> List[Claim]:
        return [Claim("weight")] + ([Claim("bias", bias=True)] if module.bias is not None else [])

    def capture(self, name, module, on_forward):
        c = ModuleCapture(name, module, "linear", linear_rows, on_forward)
        return c, {"weight": c}
