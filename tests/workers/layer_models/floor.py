"""Models whose matrices no layer kind captures today: they exercise PowerSGD's coverage floor."""
from __future__ import annotations

import torch
from torch import nn

from . import Model


class TokenMixer(nn.Module):
    """A raw position embedding and class token (``nn.Parameter``s) around a Linear."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(5, 12) * 0.1)
        self.cls = nn.Parameter(torch.randn(1, 1, 12) * 0.1)
        self.proj = nn.Linear(12, 12)
        self.head = nn.Linear(12, 6)

    def forward(self, x):
        h = torch.tanh(self.proj(x + self.pos))
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), h], dim=1)
        return self.head(h[:, 0])


def _batch(size: int, g: torch.Generator) -> dict:
    return {"x": torch.randn(size, 5, 12, generator=g), "y": torch.randn(size, 6, generator=g)}


def _loss(model: nn.Module, data: dict) -> torch.Tensor:
    return nn.functional.mse_loss(model(data["x"]), data["y"])


MODELS = {"raw_params": Model(TokenMixer, _batch, _loss)}
