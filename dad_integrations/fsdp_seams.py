"""FSDP2's internals the adapter touches (torch 2.13), in one place: its parameter groups, the
parameters one reduce-scatter carries and their places in its buffer, its gradient scaling. Layout,
scaling and call order: ``docs/internals/fsdp2_notes.md``.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import ReduceOp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (DefaultAllocMixin, DefaultReduceScatter,
                                                                    _get_gradient_divide_factors)
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

from dad_integrations.capture.sink import ShardSlot

OnCall = Callable[..., None]  # (param_group, output, input, group, op)


class DADReduceScatter(DefaultAllocMixin, ReduceScatter):
    """The ``ReduceScatter`` installed on one FSDP parameter group: hands each call to ``on_call``."""

    def __init__(self, on_call: OnCall, param_group):
        self.on_call, self.param_group = on_call, param_group

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        self.on_call(self.param_group, output_tensor, input_tensor, group, op)


def param_groups(model: nn.Module, log_once: Callable[[str], None]) -> List[Tuple[FSDPModule, object]]:
    """Each FSDP parameter group dAD can take, once, with a module that owns it:
    `fully_shard([norm, lm_head])` (Accelerate's tail) makes several modules share one group."""
    groups, seen = [], set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        pgs = list(module._get_fsdp_state()._fsdp_param_groups)
        if len(pgs) > 1:
            log_once(f"{type(module).__name__} has {len(pgs)} parameter groups: FSDP's reduce-scatter kept")
            continue
        kept = [pg for pg in pgs if type(pg.mesh_info) in (FSDPMeshInfo, HSDPMeshInfo)]
        if len(kept) < len(pgs):
            log_once(f"{type(module).__name__}: replicate-only mesh (no shard dim), FSDP's own reduction kept")
        for pg in kept:
            if id(pg) not in seen:
                seen.add(id(pg))
                groups.append((module, pg))
    return groups


def shard_problem(fp) -> Optional[str]:
    """Why an ``FSDPParam``'s shard is not a row block dAD can write; None where it is."""
    if fp.fsdp_placement.dim != 0:
        return f"sharded as {fp.fsdp_placement}, not a row block along dim 0"
    if getattr(fp, "is_dtensor", False):
        return "already a DTensor (tensor parallel)"
    if hasattr(fp.sharded_param._local_tensor, "fsdp_pre_all_gather"):
        return "has FSDP all-gather extensions"
    if getattr(fp, "offload_to_cpu", False):
        return "CPU offload (untested)"
    return None


def install(module: FSDPModule, pg, on_call: OnCall, with_grad: Dict[int, list]) -> None:
    """Take ``pg``'s reduce-scatter, and note in ``with_grad[id(pg)]`` what each post-backward is
    about to reduce (the hook is not told): FSDPParams with a gradient, in the group's order, as
    ``foreach_reduce`` lays out its buffer."""
    original = pg.post_backward  # bound method of the group's class

    def post_backward(*args, **kwargs):
        if pg.reduce_grads:
            with_grad[id(pg)] = [
                fp for fp in pg.fsdp_params if hasattr(fp, "_unsharded_param") and (
                    fp.unsharded_accumulated_grad is not None or fp.unsharded_param.grad is not None
                    or (pg.reduce_scatter_unused_params and fp.unsharded_param.requires_grad))]
        return original(*args, **kwargs)

    pg.post_backward = post_backward
    module.set_custom_reduce_scatter(DADReduceScatter(on_call, pg))


def uninstall(module: FSDPModule, pg) -> None:
    pg.__dict__.pop("post_backward", None)
    module.set_custom_reduce_scatter(DefaultReduceScatter())


def slots_of(fps: list, names: Dict[int, str], inp: torch.Tensor, S: int) -> Optional[List[ShardSlot]]:
    """Each reduced parameter's place in the buffers, or None where they do not add up."""
    slots, offset = [], 0
    for fp in fps:
        numel = math.prod(fp.padded_sharded_param_size)
        p = fp.sharded_param
        slots.append(ShardSlot(names.get(id(p), "?"), p, offset, numel, int(fp.padded_sharded_param_size[0]),
                               tuple(p.shape)))
        offset += numel
    return slots if offset * S == inp.numel() else None


def whole_slot(pg, inp: torch.Tensor, S: int) -> ShardSlot:
    """A group's whole buffer as one slot (where its parameters could not be mapped)."""
    return ShardSlot(f"{pg._module_fqn}.*", None, 0, inp.numel() // S, inp.numel() // S, (inp.numel(),))


def scaling(pg, group: dist.ProcessGroup, inp: torch.Tensor, op) -> Tuple[float, float]:
    """FSDP's predivide (already applied to ``inp``) and what its reduce-scatter multiplies the sum
    of the predivided gradients by: ``1/S`` for AVG, ``1/factor`` for PREMUL_SUM, 1 for SUM."""
    pre, _, rs_op, _ = _get_gradient_divide_factors(group, None, inp.dtype, inp.device.type,
                                                    pg.gradient_divide_factor, pg.force_sum_reduction_for_comms)
    pre = pre or 1.0
    divide = (group.size() if rs_op == ReduceOp.AVG
              else 1.0 if rs_op == ReduceOp.SUM else float(pg.gradient_divide_factor))
    return pre, 1.0 / pre / divide


# -- HSDP: the replicate hop ------------------------------------------------------------------------
# FSDP runs its all-reduce between replicas inside `foreach_reduce`, with no hook that can replace
# it; dAD gives the group a 1-D view of the same shard dim, so FSDP reduce-scatters inside the node
# and stops, and dAD does the hop between nodes (``docs/internals/fsdp2_notes.md``, "HSDP"). No
# function is patched; the attribute is put back at `close`. Checked on the torch versions below.
HSDP_TORCH = ("2.13",)


def is_hsdp(pg) -> bool:
    return type(pg.mesh_info) is HSDPMeshInfo


def hsdp_supported() -> Optional[str]:
    """Why this torch cannot take HSDP's replicate hop; None where it can."""
    version = torch.__version__.split("+")[0]
    if not any(version == v or version.startswith(v + ".") for v in HSDP_TORCH):
        return (f"torch {torch.__version__}: dAD takes HSDP's replicate hop through FSDP2 internals checked on "
                f"torch {', '.join(HSDP_TORCH)} only")
    return None


def take_replicate_hop(pg) -> HSDPMeshInfo:
    """Make ``pg`` reduce-scatter inside the node only (see above); returns its HSDP mesh info."""
    info = pg.mesh_info
    view = FSDPMeshInfo(mesh=info.mesh, shard_mesh_dim=info.shard_mesh_dim, dp_mesh_dims=info.dp_mesh_dims,
                        spmd_mesh=info.spmd_mesh)
    view.reduce_scatter_process_group = info.reduce_scatter_process_group
    if pg.post_forward_mesh_info is info:  # reshard after forward onto the same mesh: kept so
        pg.post_forward_mesh_info = view
    pg.mesh_info = view
    pg._dad_hsdp_info = info
    return info


def give_back_replicate_hop(pg) -> None:
    info = pg.__dict__.pop("_dad_hsdp_info", None)
    if info is None:
        return
    if pg.post_forward_mesh_info is pg.mesh_info:
        pg.post_forward_mesh_info = info
    pg.mesh_info = info


def hsdp_info(pg) -> Optional[HSDPMeshInfo]:
    """``pg``'s HSDP mesh info where dAD took its replicate hop."""
    return pg.__dict__.get("_dad_hsdp_info")


def hsdp_grid(info: HSDPMeshInfo) -> List[List[int]]:
    """World ranks as ``grid[node][s]``: the replicate dim first, the shard dim second."""
    ranks = info.mesh.mesh
    order = [info.replicate_mesh_dim, info.shard_mesh_dim]
    if ranks.dim() != 2:
        raise ValueError(f"HSDP mesh of {ranks.dim()} dims (dAD takes 2-D (replicate, shard) meshes)")
    return ranks.permute(*order).tolist()


def hsdp_scaling(pg, info: HSDPMeshInfo, inp: torch.Tensor) -> Tuple[float, float]:
    """FSDP's predivide (already applied to ``inp``) under the 1-D view, and what a sum over the
    world of local gradients must be multiplied by so that FSDP's post-divide (the view's) leaves
    what HSDP keeps: the sum over ``gradient_divide_factor`` (default: the world size)."""
    shard = info.shard_process_group
    pre, post, _, _ = _get_gradient_divide_factors(shard, None, inp.dtype, inp.device.type,
                                                   pg.gradient_divide_factor, pg.force_sum_reduction_for_comms)
    world = shard.size() * info.replicate_process_group.size()
    divide = float(pg.gradient_divide_factor or world)
    return (pre or 1.0), (post or 1.0) / divide
