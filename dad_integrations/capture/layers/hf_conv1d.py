"""Hugging Face's ``Conv1D`` (GPT-2's transposed linear, weight ``in x out``): ``dW = X^T D``."""
from __future__ import annotations

from typing import List

import torch
from torch import nn

from dad_integrations.capture.hooks import ModuleCapture
from dad_integrations.capture.rows import Rows
from dad_integrations.capture.layers.registry import Claim, LayerKind, register_kind, runs_stock_forward

try:  # transformers is optional
    from transformers.pytorch_utils import Conv1D as HFConv1D
except Exception:  # pragma: no cover - exercised only without transformers
    HFConv1D = None


def hf_conv1d_rows(module: nn.Module, inputs: torch.Tensor, grad_out: torch.Tensor) -> Rows:
    """(X, D): the weight is ``in x out``, so the input rows come first."""
    return inputs.reshape(-1, inputs.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])


@register_kind
class HFConv1DKind(LayerKind):
    name = "conv1d"

    def accepts(self, module: nn.Module) -> bool:
        return HFConv1D is not None and runs_stock_forward(module, HFConv1D)

    def claims(self, module: nn.Module) -> List[Claim]:
        return [Claim("weight")] + ([Claim("bias", bias=True)] if module.bias is not None else [])

    def capture(self, name, module, on_forward):
        c = ModuleCapture(name, module, "conv1d", hf_conv1d_rows, on_forward)
        return c, {"weight": c}
