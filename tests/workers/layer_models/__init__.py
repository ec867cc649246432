"""Models of the layer kinds beyond Linear/Embedding/Conv1D, one module per family.

Each module defines ``MODELS = {name: Model(build, batch, loss)}``; `models.build`, `models.batch`
and `models.loss_of` look names up here after their own, so the check workers run them unchanged.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable, Dict

import torch
from torch import nn


@dataclass(frozen=True)
class Model:
    build: Callable[[], nn.Module]                          # after torch.manual_seed(seed)
    batch: Callable[[int, torch.Generator], dict]           # (size, generator) -> batch
    loss: Callable[[nn.Module, dict], torch.Tensor]


def registry() -> Dict[str, Model]:
    out: Dict[str, Model] = {}
    for info in pkgutil.iter_modules(__path__):
        out.update(getattr(importlib.import_module(f"{__name__}.{info.name}"), "MODELS", {}))
    return out
