"""``nn.Conv1d``/``Conv2d``/``Conv3d``: ``dW = D^T unfold(X)``, one row per image and output position.

A convolution is a linear map applied at every output position to the input patch under the
kernel. With the weight viewed as its matrix (PowerSGD's ``view(C_out, -1)``, columns
``C_in/g x k_1 x ... x k_d``), the patch is a row of the *unfolded* input (im2col) in the same
column order, so a conv is the ``linear`` row layout with ``rows = images x output positions``:
``D: (N L, C_out)``, ``X: (N L, C_in/g * prod(k))``, ``db = sum D``.

The unfold pads the input exactly as the module does (`pad_like_module`: int/tuple, ``"valid"``,
``"same"`` and non-zero ``padding_mode``), then windows each spatial dimension with
``Tensor.unfold``. A grouped convolution (``groups = G``) is G independent ones: G uses
``"g0"`` .. ``"g{G-1}"``, each a row block of the weight with the unfold of its own input channels,
and a split bias. Depthwise convolutions and more than `MAX_GROUPS` groups are not claimed (their
rows never shrink with G while the gradient does): the coverage floor takes them.

Memory: the forward hook keeps a reference to the raw input (autograd keeps it anyway); the
unfolded rows are formed at the output-gradient hook, only for enabled uses.
"""
from __future__ import annotations

import logging
import math
from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from dad_integrations.capture.hooks import HookedCapture, Use
from dad_integrations.capture.rows import Rows
from dad_integrations.capture.layers.registry import Claim, LayerKind, register_kind, runs_stock_forward
from dad_integrations.logs import OnceLogger

log = logging.getLogger(__name__)
_log_once = OnceLogger(log, level=logging.INFO)

CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
# exact pays only below C_out C_in/G k / (C_out + C_in k) < C_out/G rows per rank: beyond 8 groups
# that is under one late-layer image (ResNeXt's 32 groups at 7x7: 29 rows, one image has 49)
MAX_GROUPS = 8


def pad_like_module(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The input as the module's convolution sees it, padded (then convolved with padding 0)."""
    pad = module._reversed_padding_repeated_twice
    if not any(pad):
        return x
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, pad, mode=mode)


def unfold(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """im2col of a batched input ``(N, C, *S)``: the view ``(N, C, *L, *k)``, no copy made.

    Each spatial dimension is windowed in turn; the window dimension lands last, so the taps end in
    ``(k_1, ..., k_d)`` order, as in the weight."""
    x = pad_like_module(module, x)
    for i, (k, s, d) in enumerate(zip(module.kernel_size, module.stride, module.dilation)):
        x = x.unfold(2 + i, d * (k - 1) + 1, s)
        if d > 1:
            x = x[..., ::d]
    return x


def conv_rows(module: nn.Module, inputs: torch.Tensor, grad_out: torch.Tensor) -> List[Rows]:
    """Per group, ``(D_g, X_g)``: output-gradient rows ``(N L, C_out/G)`` and unfolded input rows
    ``(N L, C_in/G prod(k))``, columns in the order of ``weight.view(C_out, -1)``'s block.

    ``sum_g`` of ``D_g^T X_g`` into row block g is the weight gradient autograd computes."""
    nd = len(module.kernel_size)
    if inputs.dim() == nd + 1:  # an unbatched call
        inputs, grad_out = inputs.unsqueeze(0), grad_out.unsqueeze(0)
    g = module.groups
    cols = unfold(module, inputs)                      # (N, C_in, *L, *k)
    n, c_in = cols.shape[:2]
    lk = cols.shape[2:]
    cols = cols.reshape(n, g, c_in // g, *lk)          # splits the channel dim: still a view
    spatial = tuple(range(3, 3 + nd))
    taps = tuple(range(3 + nd, 3 + 2 * nd))
    x = cols.permute(1, 0, *spatial, 2, *taps).reshape(g, -1, (c_in // g) * math.prod(module.kernel_size))
    d = grad_out.reshape(n, g, grad_out.shape[1] // g, *grad_out.shape[2:])
    d = d.permute(1, 0, *range(3, 3 + nd), 2).reshape(g, -1, grad_out.shape[1] // g)
    return [(d[i], x[i]) for i in range(g)]


def claims_groups(module: nn.Module) -> bool:
    """Whether a conv's groups are worth factors: not depthwise, at most `MAX_GROUPS` groups."""
    g = module.groups
    return g == 1 or (g <= MAX_GROUPS and module.in_channels // g > 1 and module.out_channels // g > 1)


def _keys(module: nn.Module) -> Tuple[str, ...]:
    """The uses of a conv: ``"weight"``, or one per group, ``"g0"`` .. ``"g{G-1}"``."""
    return ("weight",) if module.groups == 1 else tuple(f"g{i}" for i in range(module.groups))


class ConvCapture(HookedCapture):
    """The hooks of one convolution: its raw input kept at forward, its rows formed when this
    call's output gradient arrives (paired through the output tensor, not by call order)."""

    def __init__(self, name: str, module: nn.Module, on_forward=None):
        if module.groups == 1:
            by_key = {"weight": Use(name, module, "linear")}
        else:
            h = module.out_channels // module.groups
            by_key = {k: Use(f"{name}[{k}]", module, "linear", block=(i * h, h)) for i, k in enumerate(_keys(module))}
        super().__init__(name, module, by_key, on_forward)
        self.hook_input_calls()

    def _add(self, x: torch.Tensor, grad: torch.Tensor) -> None:
        for use, rows in zip(self.uses, conv_rows(self.module, x, grad)):
            if use.enabled:
                use.pairs.append(rows)


@register_kind
class ConvKind(LayerKind):
    name = "conv"
    capture_class = ConvCapture

    def accepts(self, module: nn.Module) -> bool:
        if not any(runs_stock_forward(module, t) for t in CONV_TYPES):
            return False
        if not claims_groups(module):
            _log_once("dAD conv: a %s with groups=%d (%d -> %d channels) is left to the coverage floor "
                      "(dense or rank routes from its dense gradient): exact factors of depthwise or "
                      "many-group convolutions never pay", type(module).__name__, module.groups,
                      module.in_channels, module.out_channels,
                      key=f"groups-{module.in_channels}-{module.out_channels}-{module.groups}")
            return False
        return True

    def claims(self, module: nn.Module) -> List[Claim]:
        keys = _keys(module)
        out = [Claim("weight", uses=keys)]
        if module.bias is not None:
            out.append(Claim("bias", uses=keys, bias=True))  # split in the weight's row blocks
        return out
