"""How each argument of ``hvd.DistributedOptimizer`` maps onto dAD, and the checks of those dAD
cannot honour (`horovod_dad.optimizer.DADOptimizer` runs them in Horovod's order; what each keeps
and what raises: ``docs/guides/horovod.md``, "What stays Horovod's"). ``gradient_predivide_factor``
becomes prescale ``1/f`` and postscale ``f/size``, ``Compression.fp16`` the float16 wire.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Union

import torch
from torch import nn

from dad_integrations import DADConfig

from ._horovod import Compression, hvd

_OP_NAMES = {getattr(hvd, n): n for n in ("Average", "Sum", "Adasum", "Min", "Max", "Product") if hasattr(hvd, n)}


def dad_config_for(op: Any, gradient_predivide_factor: Any, dad: Union[DADConfig, Mapping[str, Any], None],
                   compression: Any, groups: Any) -> DADConfig:
    """The `DADConfig` for these arguments, after refusing what dAD cannot express (``ValueError``)."""
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op=hvd.{_OP_NAMES.get(op, op)} is not supported with dAD: dAD rebuilds the sum "
                         f"of every rank's gradient factors, so only op=hvd.Average and op=hvd.Sum can be "
                         f"expressed (use hvd.DistributedOptimizer for Adasum)")
    if isinstance(gradient_predivide_factor, bool) or not isinstance(gradient_predivide_factor, (int, float)) \
            or not 0 < gradient_predivide_factor < float("inf"):
        raise ValueError(f"gradient_predivide_factor must be a positive number, got {gradient_predivide_factor!r}")
    config = DADConfig() if dad is None else DADConfig.from_dict(dad)
    config = apply_compression(config, compression)
    check_groups(groups)
    return config


def apply_compression(config: DADConfig, compression: Any) -> DADConfig:
    """Horovod's fp16 compression is dAD's float16 wire; other compressors cannot act on factors."""
    if compression is Compression.none:
        return config
    if compression is Compression.fp16:
        if config.wire_dtype not in (None, "float16"):
            raise ValueError(f"compression=hvd.Compression.fp16 conflicts with dad wire_dtype="
                             f"{config.wire_dtype!r}; choose one")
        return DADConfig.from_dict(dict(config.to_dict(), wire_dtype="float16"))
    raise ValueError(f"compression={getattr(compression, '__name__', compression)!r} is not supported with dAD: "
                     f"only hvd.Compression.none and hvd.Compression.fp16 (float16 factors and buckets) "
                     f"can be applied to gradient factors; see also the dad 'wire_dtype' key")


def check_groups(groups: Any) -> None:
    """Horovod's validation of ``groups`` (a positive integer or a list of lists of tensors)."""
    if groups is None:
        return
    if not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    if isinstance(groups, list):
        seen = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))


def check_named_parameters(named_parameters: Any, param_groups: List[dict]) -> Dict[nn.Parameter, str]:
    """Horovod's checks of ``named_parameters``; returns parameter -> name."""
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    else:
        named_parameters = [(f"allreduce.noname.{i}.{j}", v) for i, group in enumerate(param_groups)
                            for j, v in enumerate(group["params"])]
    if any(not isinstance(p, tuple) for p in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced "
                         "by model.named_parameters().")
    seen, dups = set(), set()
    for k, _ in named_parameters:
        (dups if k in seen else seen).add(k)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: %s"
                         % ", ".join(sorted(dups)))
    all_ids = {id(v) for group in param_groups for v in group["params"]}
    unnamed = all_ids - {id(v) for _, v in named_parameters}
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                         "Python object ids: %s" % ", ".join(str(i) for i in unnamed))
    return {v: k for k, v in named_parameters}
