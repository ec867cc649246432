"""What a DeepSpeed engine must be for dAD to take over its reduction, and how it scales and types it.

Read from the engine before attaching (`deepspeed_dad.engine`, and `deepspeed_dad.zero` with
ZeRO-2/3's own problems): the settings dAD cannot honour are rejected with a reason, the
reduction's scaling (`reduction_scales`) and wire dtype are DeepSpeed's own.
"""
from __future__ import annotations

import sys
from typing import Any, List, Optional, Tuple

import torch

from dad_integrations import DADConfig

_WIRE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def is_engine(obj: Any) -> bool:
    """Whether ``obj`` is a ``deepspeed.DeepSpeedEngine`` (without DeepSpeed imported there is none:
    it is not imported for the check)."""
    module = sys.modules.get("deepspeed.runtime.engine")
    return module is not None and isinstance(obj, module.DeepSpeedEngine)


def reduction_scales(engine: Any, world_size: int) -> Tuple[float, float]:
    """(prescale, postscale) with which DeepSpeed reduces this engine's gradients.

    Mirrors ``DeepSpeedEngine.allreduce_bucket`` and ZeRO's ``average_tensor``: a ``"sum"``
    all-reduce op does not scale; ``prescale_gradients`` divides by the world size first;
    otherwise ``gradient_predivide_factor`` f divides by f first and multiplies by f / world after;
    ZeRO 1's reduce-scatter path divides by the world size first.
    """
    if not engine.gradient_average:
        return 1.0, 1.0
    if engine.zero_optimization_stage() == 1 and getattr(engine.optimizer, "reduce_scatter", False):
        return 1.0 / world_size, 1.0
    if engine.postscale_gradients():
        f = float(engine.gradient_predivide_factor())
        return 1.0 / f, f / world_size
    return 1.0 / world_size, 1.0


def wire_dtype(engine: Any, config: DADConfig) -> Optional[str]:
    """dAD's wire dtype: DeepSpeed's ``communication_data_type`` when it is set, else the block's."""
    explicit = engine._config.communication_data_type
    if explicit is None:
        return config.wire_dtype
    model_dtype = engine.get_data_types()[0]
    if explicit == torch.float32:
        if model_dtype != torch.float32:
            raise ValueError(
                "communication_data_type fp32 with fp16/bf16 parameters is not supported with dAD: factors "
                "travel in the gradients' dtype or in dad.wire_dtype ('float16'/'bfloat16'); remove "
                "communication_data_type or set it to the parameters' dtype")
        name = None
    elif explicit in _WIRE_NAMES:
        name = _WIRE_NAMES[explicit]
    else:
        raise ValueError(f"communication_data_type {explicit} is not supported with dAD")
    if config.wire_dtype is not None and config.wire_dtype != name:
        raise ValueError(f"contradictory settings: DeepSpeed's communication_data_type is {explicit} but "
                         f"dad config key 'wire_dtype' is {config.wire_dtype!r}; set only one of them")
    return name


def check_engine(engine: Any, config: DADConfig, sharded: bool = False) -> Tuple[int, DADConfig]:
    """Reject what dAD cannot honour; returns the data-parallel world size and ``config`` with its
    `wire_dtype`. ``sharded``: for `deepspeed_dad.zero` (ZeRO-2/3, with their own problems)."""
    from deepspeed import comm as dist
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    if not is_engine(engine):
        raise TypeError(f"attach() needs a deepspeed.DeepSpeedEngine, got {type(engine).__name__}")
    stage = int(engine.zero_optimization_stage())
    problems = _zero_problems(engine, config, stage) if sharded else []
    if stage not in (0, 1) and not sharded:
        problems.append(f"ZeRO stage {stage} is attached by deepspeed_dad.zero, not here")
    if engine.optimizer is None:
        problems.append("the engine has no optimizer (dAD synchronises training gradients)")
    if isinstance(engine.optimizer, BF16_Optimizer):
        problems.append("the BF16 optimizer (bf16 with data_types.grad_accum_dtype fp32) accumulates gradients "
                        "in its own fp32 buffers before reducing them; use bf16 gradient accumulation "
                        "(the default) or fp32")
    if stage == 1 and engine.optimizer is not None:
        opt = engine.optimizer
        if getattr(opt, "overlap_comm", False):
            problems.append("zero_optimization.overlap_comm=true reduces ZeRO 1 gradients inside backward hooks; "
                            "set it to false")
        if getattr(opt, "use_grad_accum_attribute", False):
            problems.append("a gradient accumulation dtype different from the parameters' dtype moves ZeRO 1 "
                            "gradients out of param.grad during backward; remove data_types.grad_accum_dtype")
        if getattr(opt, "cpu_offload", False):
            problems.append("ZeRO optimizer offload is not supported with dAD")
    if getattr(engine, "pipeline_parallelism", False):
        problems.append("pipeline parallelism is not supported with dAD")
    if engine.mpu is not None or getattr(engine, "sequence_parallel_size", 1) > 1:
        problems.append("model/sequence parallelism is not supported with dAD (data parallelism only)")
    if getattr(engine, "has_moe_layers", False):
        problems.append("MoE layers (expert-parallel gradient groups) are not supported with dAD")
    if getattr(engine, "zenflow", False):
        problems.append("ZenFlow is not supported with dAD")
    if engine.is_deepcompile_enabled():
        problems.append("DeepCompile reduces gradients in its compiled graph; it is not supported with dAD")
    if not engine.managed_gradient_accumulation():
        problems.append("managed_gradient_accumulation=false is not supported with dAD")
    if not engine.enable_backward_allreduce:
        problems.append("the engine's backward all-reduce is disabled (enable_backward_allreduce=False), so "
                        "there is nothing for dAD to replace")
    if problems:
        raise ValueError("dAD cannot be attached to this DeepSpeed engine: " + "; ".join(problems))
    world = dist.get_world_size()
    dp_world = dist.get_world_size(group=engine.seq_data_parallel_group)
    if dp_world != world:
        raise ValueError(f"dAD needs plain data parallelism over every rank; the data-parallel group has "
                         f"{dp_world} of {world} ranks")
    wire = wire_dtype(engine, config)
    if wire != config.wire_dtype:
        config = DADConfig.from_dict({**config.to_dict(), "wire_dtype": wire})
    return world, config


def _zero_problems(engine: Any, config: DADConfig, stage: int) -> List[str]:
    """What dAD cannot honour under ZeRO-2/3 (each problem names its setting); [] when fine."""
    zc = engine._config.zero_config
    opt = engine.optimizer
    problems: List[str] = []
    if config.adaptive_tolerance is not None:
        problems.append(f"dad.adaptive_tolerance is not supported under ZeRO-{stage} (ranks are padded to 'rank' "
                        f"so that no count exchange is needed); remove it")
    for name, setting in (("offload_optimizer", zc.offload_optimizer), ("offload_param", zc.offload_param)):
        device = getattr(setting, "device", None)
        if setting is not None and str(getattr(device, "value", device)) != "none":
            problems.append(f"zero_optimization.{name} (device {getattr(device, 'value', device)}) is not supported "
                            f"with dAD under ZeRO-{stage}: the offloaded reduction path is not replaced; remove it")
    for key in ("zero_quantized_gradients", "zero_quantized_weights", "zero_quantized_nontrainable_weights"):
        if getattr(zc, key, False):
            problems.append(f"ZeRO++ zero_optimization.{key}=true is not supported with dAD (ZeRO++ quantizes and "
                            f"reduces gradients with its own all-to-all); set it to false")
    # hpZ (zero_hpz_partition_size) is accepted: it keeps a secondary copy of the parameters inside
    # a node for backward's all-gather; gradients still reduce-scatter over the whole group into
    # the same partitions (checked on the simulated 2x2 cluster, tests/test_multinode.py)
    if opt is not None and stage == 2:
        if getattr(opt, "use_grad_accum_attribute", False) or (
                getattr(opt, "gradient_accumulation_dtype", opt.dtype) != opt.dtype):
            problems.append("data_types.grad_accum_dtype different from the parameters' dtype is not supported with "
                            "dAD under ZeRO-2 (gradients are reduced into separate fp32 partition buffers); "
                            "remove data_types.grad_accum_dtype")
    inner = getattr(opt, "optimizer", None)
    if inner is not None and "Muon" in type(inner).__name__:
        problems.append("the Muon optimizer needs whole gradients on several ranks; not supported with dAD under "
                        "ZeRO-2/3")
    return problems
