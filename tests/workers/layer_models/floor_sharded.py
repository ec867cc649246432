"""A model for PowerSGD's coverage floor under the sharded engines (FSDP2, ZeRO-2/3): 4-D weights
and raw parameters that no layer kind captures, beside captured Linears.

A ViT-like stem: a 3x3 conv stem with 5 output channels (FSDP2's Shard(0) of its (5, 3, 3, 3)
weight gives 3 and 2 rows on 2 ranks: a padded shard of a 4-D weight), a 4x4 patch conv (8x8
images into 2x2 patches of 12 features), a class token ``(1, 1, 12)`` and a position embedding
``(5, 12)`` (raw ``nn.Parameter``s), then a Linear and a head on the mean token. With the "conv"
kind left out of ``layer_kinds`` the convolutions are units without uses whatever kinds exist.
"""
from __future__ import annotations

import torch
from torch import nn

from . import Model


class PatchStem(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 5, 3, padding=1)
        self.patch = nn.Conv2d(5, 12, 4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, 12) * 0.1)
        self.pos = nn.Parameter(torch.randn(5, 12) * 0.1)
        self.proj = nn.Linear(12, 12)
        self.head = nn.Linear(12, 6)

    def forward(self, x):
        h = self.patch(torch.tanh(self.stem(x))).flatten(2).transpose(1, 2)  # (N, 4, 12)
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), h], dim=1) + self.pos
        return self.head(torch.tanh(self.proj(h)).mean(1))


def _batch(size: int, g: torch.Generator) -> dict:
    return {"x": torch.randn(size, 3, 8, 8, generator=g), "y": torch.randn(size, 6, generator=g)}


def _loss(model: nn.Module, data: dict) -> torch.Tensor:
    return nn.functional.mse_loss(model(data["x"]), data["y"])


# the weights the floor covers in this model (no kind captures them), and the kinds that leave the
# convolutions uncaptured (a "conv" kind, where one exists, is not among them)
FLOOR_WEIGHTS = ("stem.weight", "patch.weight", "cls", "pos")
KINDS_WITHOUT_CONV = ["linear", "conv1d", "embedding"]

def _wide() -> nn.Module:
    """Two 64 x 64 Linears on one row per example: a rank-8 route beats exact factors at 8 rows a
    rank and loses to them at 1 or 2 (a weight that leaves its rank route when rows fall)."""
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))


def _wide_batch(size: int, g: torch.Generator) -> dict:
    return {"x": torch.randn(size, 64, generator=g), "y": torch.randn(size, 64, generator=g)}


def _wide_loss(model: nn.Module, data: dict) -> torch.Tensor:
    return nn.functional.mse_loss(model(data["x"]), data["y"])


MODELS = {"patch_stem": Model(PatchStem, _batch, _loss), "wide_rows": Model(_wide, _wide_batch, _wide_loss)}
