"""Hugging Face's ``Conv1D`` (GPT-2's transposed linear, weight ``in x out``): ``dW = X^T D``."""
from __future__ import annotations

import torch
from torch import nn

from dad_integrations.capture.rows import Rows
from dad_integrations.capture.layers.registry import ModuleKind, leading_rows, register_kind

try:  # transformers is optional
    from transformers.pytorch_utils import Conv1D as HFConv1D
except Exception:  # pragma: no cover - exercised only without transformers
    HFConv1D = None


def hf_conv1d_rows(module: nn.Module, inputs: torch.Tensor, grad_out: torch.Tensor) -> Rows:
    """(X, D): the weight is ``in x out``, so the input rows come first."""
    return inputs.reshape(-1, inputs.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])


@register_kind
class HFConv1DKind(ModuleKind):
    name = "conv1d"
    base = HFConv1D
    layout = "conv1d"
    rows = hf_conv1d_rows
    forward_count = leading_rows
