"""Which FSDP shards a model: FSDP2 (``fully_shard``) is supported, FSDP1 is refused with the reason
(`FSDP1_MESSAGE`; FSDP1 is deprecated in PyTorch, Accelerate and Transformers alike).

`enable_dad_fsdp`, Accelerate's `enable_dad` and `DADCallback` ask this module, so the three say
the same thing about the same model.
"""
from __future__ import annotations

from typing import List, Optional

from torch import nn

FSDP1_MESSAGE = (
    "{where}: the model is wrapped in FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel), which dAD "
    "does not support: FSDP1 flattens each wrapped module's parameters into one FlatParameter and hands "
    "its communication hook one flat gradient per unit, with no per-layer view of it, while dAD exchanges "
    "each layer's gradient factors. Use FSDP2 (torch.distributed.fsdp.fully_shard; Accelerate: "
    "fsdp_version: 2 in the FSDP config; Trainer: fsdp_config={{\"version\": 2}}) and "
    "dad_integrations.fsdp.enable_dad_fsdp."
)


def fsdp2_modules(model: Optional[nn.Module]) -> List[nn.Module]:
    """The ``fully_shard``-ed modules in ``model`` (itself included), outermost first."""
    if model is None:
        return []
    from torch.distributed.fsdp import FSDPModule
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def reject_fsdp1(model: Optional[nn.Module], where: str) -> None:
    """Raise `ValueError` (naming ``where`` and the reason) if ``model`` (itself included) holds an
    FSDP1 ``FullyShardedDataParallel``."""
    if model is None:
        return
    from torch.distributed.fsdp import FullyShardedDataParallel
    if any(isinstance(m, FullyShardedDataParallel) for m in getattr(model, "_orig_mod", model).modules()):
        raise ValueError(FSDP1_MESSAGE.format(where=where))
