"""Convolutions (`layers.conv`): every padding, stride, dilation and group setting the kind handles,
a depthwise conv it leaves to the coverage floor, and a small CNN with batch norm."""
from __future__ import annotations

import torch
from torch import nn

from . import Model


class Conv1dNet(nn.Module):
    """Stride and dilation; ``"same"`` (even kernel: asymmetric) with reflect; ``"valid"``, no bias."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv1d(3, 8, 3, stride=2, dilation=2, padding=1)
        self.b = nn.Conv1d(8, 8, 4, padding="same", padding_mode="reflect")
        self.c = nn.Conv1d(8, 6, 3, padding="valid", bias=False)
        self.head = nn.Linear(6, 4)

    def forward(self, x):
        h = torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x))))))
        return self.head(h.mean(-1))


class Conv2dNet(nn.Module):
    """Tuple stride/dilation/padding, groups=2 with its split bias, replicate padding, a conv
    called twice (weight reuse), no bias."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, (3, 2), stride=(2, 1), dilation=(1, 2), padding=(1, 2))
        self.b = nn.Conv2d(8, 8, 3, padding=1, groups=2, padding_mode="replicate")
        self.c = nn.Conv2d(8, 8, 3, padding="same", bias=False)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h))
        h = torch.tanh(self.c(torch.tanh(self.c(h))))
        return self.head(h.mean((-2, -1)))


class Conv3dNet(nn.Module):
    """3-D: strides and dilation per dimension, groups=2, circular ``"same"``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv3d(2, 6, (2, 3, 2), stride=(1, 2, 1), dilation=(2, 1, 1), padding=1)
        self.b = nn.Conv3d(6, 6, 3, padding="same", groups=2, padding_mode="circular")
        self.head = nn.Linear(6, 4)

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.head(h.mean((-3, -2, -1)))


class DepthwiseNet(nn.Module):
    """A depthwise conv (not claimed: the coverage floor) before a pointwise conv (claimed)."""

    def __init__(self):
        super().__init__()
        self.dw = nn.Conv2d(6, 6, 3, padding=1, groups=6)
        self.pw = nn.Conv2d(6, 8, 1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.pw(torch.tanh(self.dw(x)))).mean((-2, -1)))


class SmallCNN(nn.Module):
    """conv-BN-ReLU twice, pooling, a Linear head; c2 has a bias before its batch norm (VGG-BN's
    layout), whose gradient is round-off: the first-step check must not send c2 dense for it."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.n1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.n2 = nn.BatchNorm2d(16)
        self.head = nn.Linear(16 * 4 * 4, 5)

    def forward(self, x):
        h = torch.relu(self.n1(self.c1(x)))
        h = torch.relu(self.n2(self.c2(h)))
        return self.head(nn.functional.adaptive_avg_pool2d(h, 4).flatten(1))


class LateCNN(nn.Module):
    """Where exact factors pay: a wide stem over 36 positions (dense under auto), then late convs,
    plain and grouped, over 4 positions with many channels (exact under auto at few images)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(8, 32, 3, padding=1)
        self.late = nn.Conv2d(32, 64, 3, stride=2)
        self.grouped = nn.Conv2d(64, 64, 3, padding=1, groups=2)
        self.head = nn.Linear(64, 5)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        h = torch.relu(self.grouped(torch.relu(self.late(h))))
        return self.head(h.mean((-2, -1)))


class WeightNormConvNet(nn.Module):
    """wav2vec2's positional convolution: a grouped Conv1d under weight norm (a parametrization
    computes its weight from ``original0``/``original1`` in every forward), beside a plain conv;
    with ``old``, also ``torch.nn.utils.weight_norm``'s ``weight_g``/``weight_v`` (its model does
    not deepcopy, so only the plan test builds it)."""

    def __init__(self, old: bool = False):
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.pos = nn.utils.parametrizations.weight_norm(nn.Conv1d(8, 8, 3, padding=1, groups=2), dim=2)
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the old API is deprecated, still used
            self.old = nn.utils.weight_norm(nn.Linear(8, 8)) if old else nn.Identity()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.conv(x))
        h = h + self.pos(h)
        return self.head(self.old(h.mean(-1)))


def _batch_of(shape, classes: int):
    def batch(size: int, g: torch.Generator) -> dict:
        return {"x": torch.randn(size, *shape, generator=g), "y": torch.randint(0, classes, (size,), generator=g)}
    return batch


def _loss(model: nn.Module, data: dict) -> torch.Tensor:
    return nn.functional.cross_entropy(model(data["x"]), data["y"])


MODELS = {
    "conv1d_net": Model(Conv1dNet, _batch_of((3, 17), 4), _loss),
    "conv2d_net": Model(Conv2dNet, _batch_of((3, 9, 8), 4), _loss),
    "conv3d_net": Model(Conv3dNet, _batch_of((2, 5, 6, 5), 4), _loss),
    "depthwise_net": Model(DepthwiseNet, _batch_of((6, 7, 7), 4), _loss),
    "small_cnn": Model(SmallCNN, _batch_of((3, 8, 8), 5), _loss),
    "late_cnn": Model(LateCNN, _batch_of((8, 6, 6), 5), _loss),
    "weightnorm_net": Model(WeightNormConvNet, _batch_of((4, 9), 4), _loss),
}
